"""Copies between a stage's GPU and host memory that do not stall the host, and the one CUDA stream
a GPU stage runs on.

A plain ``.cpu()`` blocks the calling thread until its GPU stream has run everything queued before it,
and a copy from pageable host memory to the GPU first waits for the stream to drain (CUDA's documented
behaviour for pageable memory). A stage that did one of each per micro-batch stopped queueing work
whenever its GPU was busy: on one H100 shared by two stages, 8 x Linear(4096), m=16, a stage's
forward of three micro-batches was followed by 17 ms in which it queued nothing. Here both directions
go through pinned host memory, asynchronously, in forward and in backward; a reader of a host copy
waits for it first (``to_host`` returns the wait).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from .. import microbatch
from ..microbatch import TensorOrTensors

__all__ = ["to_device", "to_host", "StageStream"]


def _pinned_to(t: Tensor, device: torch.device) -> Tensor:
    """Through a pinned copy, which goes back to torch's caching host allocator once the copy has run.
    Not ``t.pin_memory()``: it keeps the strides, and an expanded gradient (of a ``sum``) has overlapping
    ones, which a copy cannot write to."""
    if not t.is_pinned():
        pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        pinned.copy_(t)
        t = pinned
    return t.to(device, non_blocking=True)


# Both pass "no gradient" (None) on as such: autograd would otherwise hand their backward zeros, and a
# tensor the loss left out would give the layers before it zero gradients (``dependency``'s masks).


class _HostToDevice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor, device: torch.device) -> Tensor:
        ctx.set_materialize_grads(False)
        return _pinned_to(t, device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> tuple[Tensor | None, None]:
        # only when a stage's host input needs a gradient: rare, kept simple
        return (None if grad is None else grad.cpu()), None


class _DeviceToHost(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor) -> Tensor:
        ctx.set_materialize_grads(False)
        ctx.device = t.device
        return t.to("cpu", non_blocking=True)  # into pinned memory: the host goes on at once

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> Tensor | None:
        return None if grad is None else _pinned_to(grad, ctx.device)


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``; from host memory to a GPU without waiting for the GPU (differentiable)."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return _HostToDevice.apply(t, device)
    return t.to(device, non_blocking=True)


def to_host(value: TensorOrTensors) -> tuple[TensorOrTensors, Callable[[], None]]:
    """``value`` in host memory (differentiable), and a function that waits until the copies are done:
    call it before anything reads the host tensors (sending them over TensorPipe included)."""
    events: list[torch.cuda.Event] = []

    def move(t: Tensor) -> Tensor:
        if t.device.type != "cuda":
            return t.cpu()
        host = _DeviceToHost.apply(t)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        events.append(event)
        return host

    moved = microbatch.apply(move, value)

    def wait() -> None:
        for event in events:
            event.synchronize()

    return moved, wait


class StageStream:
    """The one CUDA stream a GPU stage computes on, forward and backward (autograd runs each node's
    backward on its forward's stream).

    TensorPipe runs each RPC body on streams of its own pool (32 per device), where the body's
    received tensors are ready. PyTorch gives every stream that runs a matmul a cuBLAS workspace of
    its own, kept for good: a stage computing on whatever pool stream its request brought held 2 GiB
    of them after eight steps (the tutorial's model, 2 stages on an H100: 65 MiB a stream, every
    stream of the pool). Here a receiving body makes the stage's stream wait for its arrivals, which
    also orders a micro-batch that runs in a later body than the one that brought its input (one
    that waited for a skip). On the CPU both calls do nothing.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def arrived(self) -> None:
        """Call in a receiving body: work the stage queues from now on comes after its arrivals."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def settle(self) -> None:
        """Block until every stream of the device has run what was queued on it. Call before the stage
        reads its parameters after a ``DistributedOptimizer`` step: that step updates them in an RPC body
        of its own, on a stream of TensorPipe's pool, and its reply orders nothing on the GPU. (The other
        way round torch orders it: the step's body waits for the events distributed autograd records
        where it accumulates the gradients, on the stage's stream.)"""
        if self.stream is not None:
            torch.cuda.synchronize(self.device)

    def running(self) -> AbstractContextManager[Any]:
        """The stage's stream as the current one (``with stream.running(): ...``)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
