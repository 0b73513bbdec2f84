"""Snapshots of a pipe's stages kept off their workers, and stages rebuilt from them: what lets a pipe
with spares recover from a dead stage worker (the driver's side: :mod:`rrefpipe.driver_side.recovery`).

A stage's snapshot is everything that makes it what it is after an update: its layers with their
weights and buffers, how it was built (its :class:`~rrefpipe.stage_side.server.StageSpec`), the state
of each of the pipe's optimizers on it and of their schedulers, and its worker's random state. It
travels in two parts: its structure, pickled with every tensor replaced by a reference to its storage,
and those storages, copied, as tensors beside it. RPC sends tensors without pickling their data, so
the stage's worker only pickles the structure and copies the storages (what the next update waits
for), and TensorPipe's threads send the copies to the *holder* (a spare worker) while the next step
runs. The holder keeps two generations per stage: the one arriving, and the last one every stage's
part reached (committed on the last arrival). A rebuild sends the committed snapshot from the holder
to the stage's new worker (or builds it on the holder itself), so no weight passes through the driver.
"""
from __future__ import annotations

import io
import pickle
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import cloudpickle
import torch
import torch.distributed.rpc as rpc
from torch import Tensor, nn
from torch.futures import Future

from . import server, stage_optim
from .stage import StageInfo

__all__: list[str] = []

_DEFAULT_TIMEOUT = 120.0

#: A stage's snapshot in transit or kept: its pickled structure and the storages it refers to.
Part = tuple[bytes, list[Tensor]]


def alive() -> bool:
    """What the driver pings a worker with (a dead one fails at once)."""
    return True


def warm(payloads: list[bytes]) -> None:
    """On a spare: build each optimizer class once, on a throwaway parameter, so that what its first
    construction imports (``torch._dynamo``, a second or more) is paid now, not in a recovery."""
    for payload in payloads:
        cls, kwargs = cloudpickle.loads(payload)
        cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)


# -- a snapshot's two parts ------------------------------------------------------------------------------
class _Splitter(cloudpickle.CloudPickler):
    """Pickles an object with each dense tensor replaced by (its storage's index, its view of it), and
    copies each storage once to the host: tied parameters and views stay tied."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.storages: list[Tensor] = []
        self._index: dict[tuple[int, str, int], int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if (type(obj) not in (Tensor, nn.Parameter) or obj.layout != torch.strided or obj.is_quantized
                or obj.is_meta):
            return None  # (pickled as it is)
        storage = obj.untyped_storage()
        key = (storage.data_ptr(), str(obj.device), storage.nbytes())
        k = self._index.get(key)
        if k is None:
            k = self._index[key] = len(self.storages)
            whole = torch.empty(0, dtype=torch.uint8, device=obj.device).set_(storage)
            self.storages.append(whole.to("cpu", copy=True))
        return ("storage", k, obj.dtype, obj.storage_offset(), tuple(obj.size()), obj.stride(), obj.requires_grad,
                type(obj) is nn.Parameter)


def split(obj: Any) -> Part:
    """``obj`` pickled without its tensors' data, and copies of their storages (see :class:`_Splitter`)."""
    file = io.BytesIO()
    pickler = _Splitter(file)
    pickler.dump(obj)
    return file.getvalue(), pickler.storages


def join(part: Part) -> Any:
    """The object :func:`split` took apart, its tensors on the host, viewing ``part``'s storages."""
    structure, storages = part
    made: dict[Any, Tensor] = {}

    class Joiner(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Tensor:
            tensor = made.get(pid)
            if tensor is None:
                _, k, dtype, offset, size, stride, requires_grad, parameter = pid
                view = torch.empty(0, dtype=dtype).set_(storages[k].untyped_storage(), offset, size, stride)
                tensor = nn.Parameter(view, requires_grad) if parameter else view.requires_grad_(requires_grad)
                made[pid] = tensor
            return tensor

    return Joiner(io.BytesIO(structure)).load()


def nbytes(part: Part) -> int:
    return len(part[0]) + sum(s.numel() for s in part[1])


# -- on the stage's worker -------------------------------------------------------------------------------
#: A donor's optimizer ids as another pipe knows them: donor id -> (the other's id, donor scheduler id -> its id).
Renamed = dict[int, tuple[int, dict[int, int]]]


def _state(pipe_id: str, j: int, optimizers: dict[int, list[int]], rename: Renamed | None = None) -> Part:
    """Stage ``j``'s snapshot: spec, layers, optimizers (by id, with their schedulers' states), random state.
    ``rename``: the optimizers and schedulers keyed by another pipe's ids instead (a replica's, see :func:`give`)."""
    here = server._server(pipe_id, j)
    here.stream.settle()  # after an optimizer step's writes
    opts: dict[int, tuple[dict[str, Any], dict[int, Any]]] = {}
    for opt_id, scheduler_ids in optimizers.items():
        with stage_optim.lock(pipe_id, opt_id):
            optimizer = stage_optim.optimizer(pipe_id, opt_id, j)
            schedules = {s: stage_optim.scheduler(pipe_id, opt_id, j, s).state_dict() for s in scheduler_ids}
            if rename is not None:
                opt_id, ids = rename[opt_id]
                schedules = {ids[s]: state for s, state in schedules.items()}
            opts[opt_id] = (optimizer.state_dict(), schedules)
    with here.stream.running():
        return split((replace(here.spec, module=None, factory=None, init=None), here.stage.module, opts,
                      _random_state(here.stage.device)))


def _random_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def push(pipe_id: str, j: int, holder: str, generation: int, stages: int, optimizers: dict[int, list[int]],
         timeout: float = _DEFAULT_TIMEOUT) -> None:
    """Take stage ``j``'s snapshot and start sending it to ``holder``, worker to worker; returns once it is
    taken (the stage may go on: what is sent is a copy)."""
    structure, storages = _state(pipe_id, j, optimizers)
    rpc.rpc_async(holder, keep, args=(pipe_id, j, generation, stages, structure, storages), timeout=timeout)


# -- on the holder -----------------------------------------------------------------------------------------
@dataclass
class _Held:
    """One pipe's snapshots on the holder."""

    committed: dict[int, Part] = field(default_factory=dict)  # stage -> its part of ``generation``
    arriving: dict[int, tuple[int, Part]] = field(default_factory=dict)  # stage -> (generation, part)
    generation: int = 0  # the committed generation (0: none)
    abandoned: int = 0  # parts of generations up to this one are late: a recovery went back past them
    waiting: dict[int, list[Future[int]]] = field(default_factory=dict)  # generation -> its commit's waiters

    def bytes(self) -> int:
        return sum(nbytes(part) for part in self.committed.values())


_held: dict[str, _Held] = {}  # pipe id -> its snapshots, on the holder
_dropped: OrderedDict[str, None] = OrderedDict()  # pipes closed lately: a part still in flight is not kept
_lock = threading.Lock()


def keep(pipe_id: str, j: int, generation: int, stages: int, structure: bytes, storages: list[Tensor]) -> None:
    """Stage ``j``'s part of ``generation``; the last of the ``stages`` parts to arrive commits it."""
    with _lock:
        if pipe_id in _dropped:
            return  # (the pipe closed while its last snapshot was on its way)
        held = _held.setdefault(pipe_id, _Held())
        if generation <= max(held.abandoned, held.generation):
            return  # late: a recovery gave this generation up, or a later one is committed
        held.arriving[j] = (generation, (structure, storages))
        if len(held.arriving) < stages or any(g != generation for g, _ in held.arriving.values()):
            return
        held.committed = {stage: part for stage, (_, part) in held.arriving.items()}
        held.arriving, held.generation = {}, generation
        done = [g for g in held.waiting if g <= generation]
        waiters = [w for g in done for w in held.waiting.pop(g)]
        size = held.bytes()
    for waiter in waiters:
        waiter.set_result(size)


@rpc.functions.async_execution
def committed(pipe_id: str, generation: int) -> Future[int]:
    """Completes once ``generation`` (or a later one) is committed, with the bytes the holder keeps for
    the pipe; fails if a recovery gives it up first."""
    waiter: Future[int] = Future()
    with _lock:
        held = _held.setdefault(pipe_id, _Held())
        if held.generation >= generation:
            waiter.set_result(held.bytes())
        elif generation <= held.abandoned:
            waiter.set_exception(_given_up(pipe_id, held.generation))
        else:
            held.waiting.setdefault(generation, []).append(waiter)
    return waiter


def restoring(pipe_id: str) -> int:
    """A recovery starts: the generation arriving is given up (its late parts will be dropped), and the
    committed one, which every stage goes back to, is returned (0: none)."""
    with _lock:
        held = _held.setdefault(pipe_id, _Held())
        late = [g for g, _ in held.arriving.values()] + list(held.waiting)
        held.abandoned = max([held.abandoned, *late])
        held.arriving = {}
        waiters = [w for ws in held.waiting.values() for w in ws]
        held.waiting = {}
        generation = held.generation
    for waiter in waiters:
        waiter.set_exception(_given_up(pipe_id, generation))
    return generation


def _given_up(pipe_id: str, generation: int) -> Any:  # (Any: torch's stubs type the exception as the result)
    return RuntimeError(f"a snapshot of pipe {pipe_id!r} in transit was given up: a recovery went back to "
                        f"generation {generation}")


def drop(pipe_id: str) -> None:
    """Forget the pipe's snapshots (the pipe closed)."""
    with _lock:
        _held.pop(pipe_id, None)
        _dropped[pipe_id] = None
        while len(_dropped) > 64:
            _dropped.popitem(last=False)


@rpc.functions.async_execution
def send(pipe_id: str, j: int, to: str, timeout: float = _DEFAULT_TIMEOUT) -> Future[tuple[int, StageInfo]]:
    """Rebuild stage ``j`` on worker ``to`` from the committed snapshot (here, when ``to`` is the holder)."""
    with _lock:
        held = _held.get(pipe_id)
        kept = held.committed.get(j) if held is not None else None
        generation = held.generation if held is not None else 0
    if kept is None:
        raise LookupError(f"no committed snapshot of stage {j} of pipe {pipe_id!r} on {rpc.get_worker_info().name!r}")
    structure, storages = kept
    if to == rpc.get_worker_info().name:  # (the stage trains its tensors in place: not the kept ones)
        done: Future[tuple[int, StageInfo]] = Future()
        done.set_result((generation, rebuild(pipe_id, structure, [s.clone() for s in storages])))
        return done
    return rpc.rpc_async(to, _rebuild_remote, args=(pipe_id, generation, structure, storages), timeout=timeout)


@rpc.functions.async_execution
def give(pipe_id: str, j: int, optimizers: dict[int, list[int]], rename: Renamed, to: str, target_pipe_id: str,
         timeout: float = _DEFAULT_TIMEOUT) -> Future[tuple[int, StageInfo]]:
    """On the stage's worker in a donor replica: stage ``j``'s state now, sent worker to worker to ``to``, which
    rebuilds it as stage ``j`` of the pipe ``target_pipe_id`` (the same stage of another replica's pipe; its
    optimizers by that pipe's ids, ``rename``). What a lost stage worker's spare, and every stage of a replica
    behind the donor, takes (:mod:`rrefpipe.driver_side.replica_spares`); no snapshot is kept anywhere."""
    structure, storages = _state(pipe_id, j, optimizers, rename)
    return rpc.rpc_async(to, _rebuild_remote, args=(target_pipe_id, 0, structure, storages), timeout=timeout)


def _rebuild_remote(pipe_id: str, generation: int, structure: bytes, storages: list[Tensor]
                    ) -> tuple[int, StageInfo]:
    return generation, rebuild(pipe_id, structure, storages)


# -- on the stage's (new) worker -------------------------------------------------------------------------
_restored: dict[tuple[str, int], tuple[dict[int, Any], tuple[torch.Tensor, torch.Tensor | None]]] = {}


def rebuild(pipe_id: str, structure: bytes, storages: list[Tensor]) -> StageInfo:
    """Build the stage of a snapshot here (its storages are this worker's to keep), replacing the stage of
    that index if this worker has it; its optimizers' and random states wait for :func:`restore_optimizers`
    (after ``connect``)."""
    spec, module, opts, rng = join((structure, storages))
    spec.module = module
    server.discard_stage(pipe_id, spec.index)
    info = server.build_stage(pipe_id, spec)
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
