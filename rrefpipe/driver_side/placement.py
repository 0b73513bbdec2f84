"""Where a pipe's stages run: the device of each, and the workers, named, the RPC group's others, or
embedded local ones that every open pipe of the process shares (started with the first pipe that needs
them, stopped when the last one lets go, pipes garbage-collected without ``close()`` included)."""
from __future__ import annotations

import copy
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import _rpc
from ..partition import module_device
from ..schedule import is_v_shaped, stage_layout
from ..seeding import stage_seed
from ..stage_side.materialize import StageInit
from ..stage_side.server import StageSpec

__all__: list[str] = []

StageFactory = Callable[[], nn.Module]


def worker_module(name: str) -> Any:
    """``workers.<name>``, from rrefpipe's stage-worker package (imported when first needed). A module
    of the user's named ``workers`` earlier on ``sys.path`` (a workers.py beside the script) hides it:
    say so, instead of "'workers' is not a package"."""
    try:
        return importlib.import_module(f"workers.{name}")
    except ImportError as exc:
        hidden = sys.modules.get("workers")
        if hidden is not None and not hasattr(hidden, "__path__"):
            raise ImportError(f"rrefpipe's stage-worker package 'workers' is hidden by {hidden.__file__}, a module of "
                              "the same name earlier on sys.path: rename that module") from exc
        raise


def stage_devices(devices: Sequence[str | torch.device] | None, count: int | None) -> list[torch.device] | None:
    """The devices as stages and device maps compare them ("cpu:0" is "cpu", a bare "cuda" "cuda:0")."""
    device_name = worker_module("options").device_name

    if devices is None:
        return None
    if len(devices) == 0:
        raise ValueError("devices is empty: name a device for each stage, or leave devices out")
    out = []
    for d in devices:
        try:
            out.append(torch.device(device_name(d)))
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"invalid device {d!r}: {exc}") from None
    if count is not None and len(out) != count:
        raise ValueError(f"{len(out)} devices given for {count} stages")
    return out


def check_local_devices(devices: Sequence[torch.device]) -> None:
    """Stages on this host (in-process or local workers): their devices must exist here. Remote
    workers check their own (the driver may have no GPU)."""
    for d in devices:
        if d.type == "cuda" and (not torch.cuda.is_available() or (d.index or 0) >= torch.cuda.device_count()):
            raise ValueError(f"device {d} does not exist on this host ({torch.cuda.device_count()} CUDA devices)")


def stage_spec(j: int, module: nn.Sequential | None, factory: StageFactory | None,
               devices: Sequence[torch.device], seed: int, init: StageInit | None = None) -> StageSpec:
    """What builds stage ``j`` on its worker: its layers (a copy on the CPU where they are elsewhere, so
    that they pickle without CUDA tensors), the factory that makes them there, or (``init``) a skeleton
    on the meta device and where its tensors come from."""
    if init is not None:
        module = None
    elif module is not None:
        device = module_device(module, "stage")
        if device is not None and device.type != "cpu":
            module = copy.deepcopy(module).cpu()
    return StageSpec(index=j, num_stages=len(devices), module=module, factory=factory, device=str(devices[j]),
                     next_worker=None, stage_devices=[str(d) for d in devices], seed=stage_seed(seed, j), init=init)


def stage_workers(n: int, workers: Sequence[str] | None, devices: Sequence[torch.device], held: list[Any],
                  rpc_timeout: float) -> tuple[Sequence[str], Any]:
    """The workers of ``n`` stages: those named, else the RPC group's others, else embedded local ones;
    with the pipe's hold on the embedded workers (None for the others). ``held`` are dropped pipes'
    holds on them (:func:`close_abandoned`), given up if those workers do not fit."""
    launch = worker_module("launch")
    if workers is None and (launch.embedded_running() or not _rpc.is_initialized()):
        check_local_devices(devices)
        cuda = any(d.type == "cuda" for d in devices)
        wanted = {"devices": [str(d) for d in devices] if cuda else None, "rpc_timeout": rpc_timeout}
        try:
            local_workers = launch.acquire_embedded(n, **wanted)
        except ValueError:
            if not held:
                raise
            release(held)  # only dropped pipes held workers that do not fit this one: start afresh
            local_workers = launch.acquire_embedded(n, **wanted)
        return list(local_workers.names[:n]), local_workers
    if not _rpc.is_initialized():
        raise ValueError(f"workers {list(workers or [])} named, but RPC is not initialised: call rpc.init_rpc "
                         "(or launch with torchrun) first, or leave workers out to start local ones")
    known = [w for w in _rpc.worker_names() if w != _rpc.self_name()]
    if workers is None:
        if len(known) < n:
            raise ValueError(f"{n} stages need {n} workers, but the RPC group has {len(known)} besides this "
                             f"process: {known}")
        return known[:n], None
    unknown = [w for w in workers if w not in known]
    if unknown:
        raise ValueError(f"unknown worker names {unknown}; the RPC group has {known}")
    return workers, None


def check_spares(spares: Sequence[str], workers: Sequence[str]) -> list[str]:
    """Spare workers must be RPC workers that serve none of the pipe's stages."""
    taken = [s for s in spares if s in workers]
    if taken:
        raise ValueError(f"spares {taken} serve stages of this pipe: name idle workers as spares")
    known = set(_rpc.worker_names())
    unknown = [s for s in spares if s not in known]
    if unknown:
        raise ValueError(f"unknown spare worker names {unknown}; the RPC group has {sorted(known)}")
    return list(spares)


def worker_layout(schedule: str, stages: int, stages_per_worker: int) -> tuple[list[int], str]:
    """Each stage's worker index under ``schedule`` (:func:`rrefpipe.schedule.stage_layout`), and that
    layout in words for errors."""
    p = stages // stages_per_worker
    if is_v_shaped(schedule):
        how = f"{schedule} puts stage j on worker j for j < {p} and on worker {2 * p - 1} - j after (a V)"
    else:
        how = f"stages_per_worker={stages_per_worker} puts stage j on worker j mod {p}"
    return stage_layout(schedule, stages, stages_per_worker), how


def interleaved_workers(workers: Sequence[str] | None, layout: Sequence[int], how: str) -> Sequence[str] | None:
    """The distinct workers named for stages that share workers as ``layout`` (each stage's worker
    index; stage j < p on worker j, p workers) says: every stage's worker in that layout, or the p workers
    alone. ``how``: the layout in words, for the error."""
    stages, p = len(layout), 1 + max(layout, default=-1)
    if workers is None or p == stages:
        return workers
    workers = list(workers)
    laid = [workers[w] for w in layout] if len(workers) in (p, stages) else None
    if laid is None or (len(workers) == stages and workers != laid) or len(set(workers[:p])) != p:
        expected = [f"w{w}" for w in layout]
        raise ValueError(f"{how}: name {p} distinct workers, or one per stage in that layout (e.g. {expected}), got "
                         f"{workers}")
    return workers[:p]


def worker_devices(devices: Sequence[torch.device], layout: Sequence[int], how: str) -> list[torch.device]:
    """The device of each worker (stage j < p is on worker j), whose stages must share one."""
    for j, (d, w) in enumerate(zip(devices, layout)):
        if d != devices[w]:
            raise ValueError(f"stage {j} is on {d} and stage {w}, on the same worker ({how}), on {devices[w]}: give "
                             "the stages of one worker one device")
    return list(devices[:1 + max(layout, default=-1)])


#: Pipes garbage-collected without ``close()``: their driver and embedded workers (or None). The
#: finalizer runs inside garbage collection, on whichever thread set it off, possibly one holding a lock
#: that an RPC needs; so it only queues them here, and the next forward, pipe built or close() closes them.
abandoned: list[tuple[Any, Any]] = []


def close_abandoned() -> list[Any]:
    """Drop the stages of pipes collected without ``close()``; returns the embedded workers they held,
    for :func:`release`."""
    held: list[Any] = []
    while True:
        try:
            driver, local_workers = abandoned.pop()
        except IndexError:  # empty (another thread may have taken the last one)
            return held
        driver.close()
        if local_workers is not None:
            held.append(local_workers)


def release(held: list[Any]) -> None:
    """Give up holds on the embedded workers (the last one out stops them)."""
    while held:
        worker_module("launch").release_embedded(held.pop())
