"""One pipeline stage: its layers on its device, run on one micro-batch with or without checkpointing.

Transport-free, so the same code runs on an RPC stage worker and in the driver's own process.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from . import microbatch
from .dependency import fork, join, mark
from .microbatch import TensorOrTensors
from .trace import Recorder

__all__ = ["StepMeta", "StageInfo", "Stage", "warm_up"]


def warm_up() -> None:
    """Pay one-time lazy initialisation now: the first non-reentrant ``checkpoint`` call in a process
    costs about a second (imports inside torch), which would otherwise stall the first micro-batch."""
    x = torch.zeros(1, requires_grad=True)
    checkpoint(torch.sin, x, use_reentrant=False).sum().backward()


@dataclass(frozen=True)
class StepMeta:
    """What every stage needs to know about one forward pass; travels with each micro-batch."""

    step: int
    chunks: int
    checkpoint_stop: int
    grad_enabled: bool
    deliver_to: str | None  # the driver's worker name, or None to keep the output on the last stage
    timeout: float


@dataclass(frozen=True)
class StageInfo:
    """Which layers a stage holds, on which worker and device. ``print(pipe.stages)`` shows these."""

    index: int
    worker: str
    device: str
    layers: tuple[str, ...]
    num_parameters: int

    def __str__(self) -> str:
        return (f"stage {self.index}: worker {self.worker!r} on {self.device}, layers {', '.join(self.layers)} "
                f"({self.num_parameters:,} parameters)")


class Stage:
    """A partition of the model on one device, with its execution record."""

    def __init__(self, index: int, module: nn.Sequential, device: torch.device, worker: str) -> None:
        self.index = index
        self.device = device
        self.worker = worker
        self.module = module.to(device)
        self.recorder = Recorder(index, worker)
        self._backward_starts: dict[tuple[int, int], float] = {}

    def info(self) -> StageInfo:
        names = tuple(f"{name}: {type(layer).__name__}" for name, layer in self.module.named_children())
        count = sum(p.numel() for p in self.module.parameters())
        return StageInfo(self.index, self.worker, str(self.device), names, count)

    def run(self, meta: StepMeta, i: int, value: TensorOrTensors, phony: Tensor | None) -> tuple[TensorOrTensors, Tensor | None]:
        """Run micro-batch ``i``. With a phony (training under a dist-autograd context) the output
        is joined to it and a new phony is forked for the next hop."""
        value = microbatch.apply(lambda t: t.to(self.device, non_blocking=True), value)
        checkpointed = meta.grad_enabled and i < meta.checkpoint_stop and self.module.training
        with torch.set_grad_enabled(meta.grad_enabled):
            if meta.grad_enabled:
                backward_end = self._backward_callback(meta.step, i, "end")
                value = mark(value, backward_end)
            fn = self._counted(meta.step, i)
            out = checkpoint(fn, value, use_reentrant=False) if checkpointed else fn(value)
            microbatch.check(out, f"output of stage {self.index}")
            if isinstance(out, list):
                out = tuple(out)
            if not meta.grad_enabled:
                return out, None
            phony_out = None
            if phony is not None:  # the output crosses an RPC hop: keep the hop in the backward graph
                out, phony_out = fork(join(out, phony))
            out = mark(out, self._backward_callback(meta.step, i, "start"))
        return out, phony_out

    def _counted(self, step: int, i: int) -> Callable[[TensorOrTensors], TensorOrTensors]:
        """The partition's forward; its first call records 'forward', later ones (checkpoint) 'recompute'."""
        calls = 0

        def run(value: TensorOrTensors) -> TensorOrTensors:
            nonlocal calls
            kind = "forward" if calls == 0 else "recompute"
            calls += 1
            with self.recorder.span(kind, step, i):
                return self.module(value)

        return run

    def _backward_callback(self, step: int, i: int, edge: str) -> Callable[[], None]:
        """Backward of a stage starts when its output's gradient arrives and ends at its inputs'."""
        pending = self._backward_starts

        def callback() -> None:
            now = time.time()
            if edge == "start":
                pending[(step, i)] = now
            else:
                self.recorder.add("backward", step, i, pending.pop((step, i), now), now)

        return callback
