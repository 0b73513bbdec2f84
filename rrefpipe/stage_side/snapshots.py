"""Snapshots of a pipe's stages kept off their workers, and stages rebuilt from them: what lets a pipe
with spares recover from a dead stage worker (the driver's side: :mod:`rrefpipe.driver_side.recovery`).

A stage's snapshot is everything that makes it what it is after an update: its layers with their
weights and buffers, how it was built (its :class:`~rrefpipe.stage_side.server.StageSpec`), the state
of each of the pipe's optimizers on it and of their schedulers, and its worker's random state. The
stage's worker pickles it and sends it straight to the *holder* (a spare worker), which keeps two
generations per stage: the one being taken, and the last one every stage finished (``commit``). A
rebuild sends the committed snapshot from the holder to the stage's new worker (or builds it on the
holder itself), so no weight passes through the driver.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any

import cloudpickle
import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from . import server, stage_optim
from .stage import StageInfo

__all__: list[str] = []

_DEFAULT_TIMEOUT = 120.0


@dataclass
class _Kept:
    """One stage's snapshots on the holder: the committed one, and one being taken."""

    committed: tuple[int, bytes] | None = None  # (generation, pickled snapshot)
    pending: tuple[int, bytes] | None = None


_kept: dict[tuple[str, int], _Kept] = {}  # (pipe id, stage) -> its snapshots, on the holder
_lock = threading.Lock()


def alive() -> bool:
    """What the driver pings a worker with (a dead one fails at once)."""
    return True


def warm(payloads: list[bytes]) -> None:
    """On a spare: build each optimizer class once, on a throwaway parameter, so that what its first
    construction imports (``torch._dynamo``, a second or more) is paid now, not in a recovery."""
    for payload in payloads:
        cls, kwargs = cloudpickle.loads(payload)
        cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)


# -- on the stage's worker -------------------------------------------------------------------------------
def _state(pipe_id: str, j: int, optimizers: dict[int, list[int]]) -> bytes:
    """Stage ``j``'s snapshot, pickled: spec, layers, optimizers (by id, with their schedulers' states)."""
    here = server._server(pipe_id, j)
    here.stream.settle()  # after an optimizer step's writes
    opts: dict[int, tuple[dict[str, Any], dict[int, Any]]] = {}
    for opt_id, scheduler_ids in optimizers.items():
        with stage_optim.lock(pipe_id, opt_id):
            optimizer = stage_optim.optimizer(pipe_id, opt_id, j)
            schedules = {s: stage_optim.scheduler(pipe_id, opt_id, j, s).state_dict() for s in scheduler_ids}
            opts[opt_id] = (optimizer.state_dict(), schedules)
    with here.stream.running():
        return cloudpickle.dumps((replace(here.spec, module=None, factory=None, init=None), here.stage.module, opts,
                                  _random_state(here.stage.device)))


def _random_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@rpc.functions.async_execution
def push(pipe_id: str, j: int, holder: str, generation: int, optimizers: dict[int, list[int]],
         timeout: float = _DEFAULT_TIMEOUT) -> Future[None]:
    """Take stage ``j``'s snapshot and send it to ``holder``, worker to worker (never blocks an RPC thread)."""
    payload = _state(pipe_id, j, optimizers)
    return rpc.rpc_async(holder, keep, args=(pipe_id, j, generation, payload), timeout=timeout)


# -- on the holder -----------------------------------------------------------------------------------------
def keep(pipe_id: str, j: int, generation: int, payload: bytes) -> None:
    with _lock:
        _kept.setdefault((pipe_id, j), _Kept()).pending = (generation, payload)


def commit(pipe_id: str, generation: int, stages: int) -> int:
    """Every stage's snapshot of ``generation`` arrived: it replaces the committed one. Returns the bytes
    the holder keeps for the pipe."""
    with _lock:
        kept = [_kept.get((pipe_id, j)) for j in range(stages)]
        if any(k is None or k.pending is None or k.pending[0] != generation for k in kept):
            raise RuntimeError(f"snapshot {generation} of pipe {pipe_id!r} is incomplete on "
                               f"{rpc.get_worker_info().name!r}")
        for k in kept:
            assert k is not None
            k.committed, k.pending = k.pending, None
        return sum(len(k.committed[1]) for k in kept if k is not None and k.committed is not None)


def drop(pipe_id: str) -> None:
    """Forget the pipe's snapshots (the pipe closed)."""
    with _lock:
        for key in [key for key in _kept if key[0] == pipe_id]:
            del _kept[key]


@rpc.functions.async_execution
def send(pipe_id: str, j: int, to: str, timeout: float = _DEFAULT_TIMEOUT) -> Future[tuple[int, StageInfo]]:
    """Rebuild stage ``j`` on worker ``to`` from the committed snapshot (here, when ``to`` is the holder)."""
    with _lock:
        kept = _kept.get((pipe_id, j))
        committed = kept.committed if kept is not None else None
    if committed is None:
        raise LookupError(f"no committed snapshot of stage {j} of pipe {pipe_id!r} on {rpc.get_worker_info().name!r}")
    generation, payload = committed
    if to == rpc.get_worker_info().name:
        done: Future[tuple[int, StageInfo]] = Future()
        done.set_result((generation, rebuild(pipe_id, payload)))
        return done
    return rpc.rpc_async(to, _rebuild_remote, args=(pipe_id, generation, payload), timeout=timeout)


def _rebuild_remote(pipe_id: str, generation: int, payload: bytes) -> tuple[int, StageInfo]:
    return generation, rebuild(pipe_id, payload)


# -- on the stage's (new) worker -------------------------------------------------------------------------
_restored: dict[tuple[str, int], tuple[dict[int, Any], tuple[torch.Tensor, torch.Tensor | None]]] = {}


def rebuild(pipe_id: str, payload: bytes) -> StageInfo:
    """Build the stage of a snapshot here, replacing the stage of that index if this worker has it; its
    optimizers' and random states wait for :func:`restore_optimizers` (after ``connect``)."""
    spec, module, opts, rng = cloudpickle.loads(payload)
    spec.module = module
    server.discard_stage(pipe_id, spec.index)
    info = server.create_stage(pipe_id, cloudpickle.dumps(spec))
    with _lock:
        _restored[(pipe_id, spec.index)] = (opts, rng)
    return info


def restore_optimizers(pipe_id: str, j: int, optimizers: dict[int, tuple[bytes, dict[int, bytes]]]) -> None:
    """Rebuild the pipe's optimizers of stage ``j`` (``optimizers``: id -> (class and arguments, scheduler
    factories by id), as the driver built them) and load their states and the worker's random state from
    the snapshot. Called once every stage is connected: an optimizer finds its parameters through them."""
    with _lock:
        opts, (cpu, cuda) = _restored.pop((pipe_id, j))
    for opt_id, (payload, factories) in optimizers.items():
        stage_optim.build_optimizer(pipe_id, j, opt_id, payload)
        for scheduler_id, factory in factories.items():  # (a scheduler's first step sets the groups' lr ...)
            stage_optim.add_scheduler(pipe_id, j, opt_id, scheduler_id, factory)
        state, schedules = opts.get(opt_id, ({}, {}))
        with stage_optim.lock(pipe_id, opt_id):
            if state:  # (... which the optimizer's saved groups then put back)
                stage_optim.optimizer(pipe_id, opt_id, j).load_state_dict(state)
            for scheduler_id, scheduler_state in schedules.items():
                stage_optim.scheduler(pipe_id, opt_id, j, scheduler_id).load_state_dict(scheduler_state)
    torch.set_rng_state(cpu)
    device = server._server(pipe_id, j).stage.device
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)
