"""What the driver asks of a stage between steps, over RPC on the stage's worker: its parameters, its
training mode, its gradients in an autograd context (norm, scaling), its state dict, and its records
(execution events, traffic, failures kept from backward).

The data path (building a stage, micro-batches, skips, outputs) is :mod:`rrefpipe.stage_side.server`; these calls
only look a stage up in its registry.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

import torch.distributed.autograd as dist_autograd

from .. import _rpc, replicas
from . import gradients
from ..captured import counted_elsewhere
from ..errors import Failure
from .server import _server
from ..trace import Event
from .transfer import StageStream

__all__: list[str] = []

T = TypeVar("T")


def reporting(fn: Callable[..., T], *args: Any) -> T | Failure:
    """``fn(*args)`` here; an exception comes back as a :class:`Failure`, a value, so that the driver
    raises it with its type, message and cause (torch's RPC re-raises few types, the rest as a blob of
    text, and prefixes the message). The driver fills in the stage."""
    try:
        return fn(*args)
    except Exception as exc:
        return Failure.capture(exc, stage=-1, worker=rpc.get_worker_info().name, microbatch=None, phase=fn.__name__)


def parameter_rrefs(pipe_id: str, index: int) -> list[rpc.RRef]:
    return [rpc.RRef(p) for p in _server(pipe_id, index).stage.module.parameters()]


def gradient_norm(pipe_id: str, index: int, context_id: int, norm_type: float) -> Tensor | None:
    """The norm of this stage's gradients in the context, after backward's last kernels; a tied
    parameter's copy counts on the first stage that holds one only."""
    server = _server(pipe_id, index)
    module = server.stage.module
    with server.stream.running():
        return gradients.gradient_norm(gradients.context_gradients(module, context_id, counted_elsewhere(module)),
                                       norm_type)


def tied_gradients(pipe_id: str, index: int, context_id: int, names: list[str]) -> list[Tensor | None]:
    """The gradients in the context of this stage's copies of tied parameters (by name in the stage), on
    the CPU: the driver sums them over the stages that hold a copy (:func:`set_tied_gradients`)."""
    server = _server(pipe_id, index)
    stored = dist_autograd.get_gradients(context_id)
    with server.stream.running():
        grads = [stored.get(server.stage.module.get_parameter(name)) for name in names]
        return [None if g is None else g.to("cpu", copy=True) for g in grads]


def set_tied_gradients(pipe_id: str, index: int, context_id: int, names: list[str], totals: list[Tensor]) -> None:
    """Each tied copy's gradient in the context becomes ``totals`` (their sum over the stages)."""
    server = _server(pipe_id, index)
    with server.stream.running():
        gradients.assign(context_id, [server.stage.module.get_parameter(name) for name in names], totals)
    server.stream.settle()


def _rewrite_gradients(pipe_id: str, index: int, context_id: int, rewrite: Callable[[list[Tensor]], T]) -> T:
    """``rewrite`` this stage's gradients in the context in place, done before the reply: the optimizer's
    step runs on another stream and is ordered only after backward's writes, not after these."""
    server = _server(pipe_id, index)
    with server.stream.running():
        result = rewrite(gradients.context_gradients(server.stage.module, context_id))
    server.stream.settle()
    return result


def scale_gradients(pipe_id: str, index: int, context_id: int, factor: float) -> None:
    _rewrite_gradients(pipe_id, index, context_id, lambda grads: gradients.scale(grads, factor))


def unscale_gradients(pipe_id: str, index: int, context_id: int, inv_scale: float) -> bool:
    """Whether any of this stage's gradients held an inf or a nan (they are unscaled all the same)."""
    return _rewrite_gradients(pipe_id, index, context_id, lambda grads: gradients.unscale(grads, inv_scale))


def convert(pipe_id: str, index: int, dtype: torch.dtype | None, memory_format: torch.memory_format | None) -> None:
    """Convert this stage's floating-point parameters and buffers to ``dtype`` and its 4- and 5-D ones to
    ``memory_format`` (None: as they are), after any optimizer step queued on its device. ``nn.Module.to``
    keeps each Parameter object, so RRefs to them stay valid."""
    server = _server(pipe_id, index)
    server.stream.settle()
    with server.stream.running():
        conversion: dict[str, Any] = {"dtype": dtype, "memory_format": memory_format}  # (not in torch's stubs)
        server.stage.module.to(**conversion)
    server.stream.settle()  # before the reply: the next forward may run on another stream


def set_training(pipe_id: str, index: int, mode: bool) -> None:
    _server(pipe_id, index).stage.module.train(mode)


def state_dict(pipe_id: str, index: int) -> dict[str, Tensor]:
    server = _server(pipe_id, index)
    server.stream.settle()  # after an optimizer step's writes
    with server.stream.running():
        return {k: v.detach().cpu() for k, v in server.stage.module.state_dict().items()}


def state_shapes(pipe_id: str, index: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of each tensor of the stage's state dict: what a checkpoint must match."""
    return {k: (tuple(v.shape), v.dtype) for k, v in _server(pipe_id, index).stage.module.state_dict().items()}


def load_state_dict(pipe_id: str, index: int, state: dict[str, Tensor],
                    metadata: dict[str, Any]) -> tuple[list[str], list[str], str]:
    """Load what matches, as ``nn.Module.load_state_dict`` does (``metadata``: the layers' versions, as a
    state dict carries them); returns the missing and unexpected keys and the error (shape mismatches),
    for the driver to report as one module would."""
    server = _server(pipe_id, index)
    versioned: Any = OrderedDict(state)
    versioned._metadata = metadata
    server.stream.settle()  # after an optimizer step's writes
    with server.stream.running():  # before what the stage queues next
        try:
            result = server.stage.module.load_state_dict(versioned, strict=False)
        except RuntimeError as exc:  # "Error(s) in loading state_dict for Sequential:\n\t<errors>"
            return [], [], str(exc).split(":\n\t", 1)[-1]
    return list(result.missing_keys), list(result.unexpected_keys), ""


def events(pipe_id: str, index: int, clear: bool) -> list[Event]:
    return _server(pipe_id, index).stage.recorder.snapshot(clear)


def backward_failure(pipe_id: str, index: int, steps: Collection[int]) -> Failure | None:
    """The latest failure this stage recorded in the backward of one of ``steps`` (those are then forgotten)."""
    return _server(pipe_id, index).stage.take_backward_failure(steps)


def abandon_backward(pipe_id: str, index: int, context_id: int, steps: Collection[int]) -> None:
    """A backward in the context failed: keep the context past its release (``_rpc.retain_context``)
    and drop what this stage's checkpoints keep for ``steps``, which that context's graph holds."""
    _rpc.retain_context(context_id)
    _server(pipe_id, index).stage.abandon(steps)


def backward_running(pipe_id: str, index: int) -> float | None:
    """Seconds this stage has been in the backward of its oldest unfinished micro-batch, if any."""
    return _server(pipe_id, index).stage.backward_running()


def traffic(pipe_id: str, index: int) -> dict[str, tuple[int, int]]:
    """Tensors and bytes this stage received, by kind ('activation' or 'skip')."""
    return {kind: (n, b) for kind, (n, b) in _server(pipe_id, index).traffic.items()}


# -- replicas (data parallel): one call per worker, for all its stages of the pipe -------------------------
def _worker_state(pipe_id: str, indices: list[int]) -> tuple[list[Tensor], list[Tensor], StageStream]:
    """The parameters and buffers of this worker's stages ``indices`` (each once), and their stream."""
    servers = [_server(pipe_id, j) for j in indices]
    params, buffers = gradients.worker_tensors([server.stage.module for server in servers])
    return params, buffers, servers[0].stream


def average_replica_gradients(pipe_id: str, indices: list[int], context_id: int, rows: int) -> None:
    """After ``pipe.backward``: this worker's gradients in the context averaged with the other replicas'
    (weighted by their ``rows``), in place, and replica 0's buffers taken (:func:`replicas.end_step`)."""
    params, buffers, stream = _worker_state(pipe_id, indices)
    stored = dist_autograd.get_gradients(context_id)
    with stream.running():
        # (a parameter with no gradient here but some elsewhere has no entry in the context to copy into)
        gradients.assign(context_id, params, replicas.end_step(params, [stored.get(p) for p in params], rows, buffers))
    stream.settle()  # before the reply: the optimizer's step runs on another stream


def take_first_replica_state(pipe_id: str, indices: list[int]) -> None:
    """When a pipe is built: this worker's stages take replica 0's parameters and buffers, so that every
    replica starts from the same model whatever each process's random state was."""
    params, buffers, stream = _worker_state(pipe_id, indices)
    with stream.running(), torch.no_grad():
        replicas.broadcast_from_first([p.data for p in params] + buffers)
    stream.settle()
