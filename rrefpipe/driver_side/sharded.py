"""``pipe.save`` and ``pipe.load``: sharded checkpoints written and read by the stage workers in
parallel (format: :mod:`rrefpipe.sharded`; a worker's part: :mod:`rrefpipe.stage_side.sharded`).

The driver sends each worker the model's names for its stages' tensors, waits for their parts, and
writes the checkpoint's metadata and its own small part (the LR scheduler's state, the step, and a
captured model's tensors that no stage uses). On load it checks the whole checkpoint against the
pipe (keys, shapes, dtypes, the optimizer's parameters and settings) before any worker reads: a
checkpoint of another model loads nothing. With replicas, replica 0 writes and every replica reads.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import dcp_parts, replicas, sharded
from ..stage_side import sharded as stage_sharded
from ..weights import DCPCheckpoint, TensorMeta, resolve
from .pipe_optimizer import PipeOptimizer
from .remote import RemoteDriver

if TYPE_CHECKING:
    from ..pipe import Pipe

__all__ = ["save", "load"]

DESCRIPTION = "rrefpipe.json"  # what wrote the checkpoint, for people: DCP's .metadata is what loading reads


def save(pipe: Pipe, path: str | os.PathLike[str], optimizer: Any, lr_scheduler: Any, step: int | None) -> None:
    driver = _remote(pipe)
    if driver is None:  # a world of one: the stages are this process's modules
        sharded.save_model(path, pipe, optimizer=_local_optimizer(optimizer), lr_scheduler=lr_scheduler, step=step)
        return
    membership = replicas.current()
    if membership is None or membership.first:  # replica 0, or the first live one once it was dropped
        with dcp_parts.replacing(path) as fresh:
            _write(pipe, driver, fresh, optimizer, lr_scheduler, step)
    if membership is not None:  # no replica goes on (to load it, say) before it is whole
        replicas.barrier()


def _write(pipe: Pipe, driver: RemoteDriver, path: Path, optimizer: Any, lr_scheduler: Any, step: int | None) -> None:
    workers = list(dict.fromkeys(driver.workers))  # in stage order
    parts = {w: str(path / f"worker-{k}") for k, w in enumerate(workers)}
    names = _names(pipe)
    per_worker = {w: (parts[w], names, _optimizer_ref(driver, optimizer, w)) for w in workers}
    written = driver.per_worker(stage_sharded.save_part, per_worker=per_worker)
    merged = [(f"worker-{workers.index(w)}", metadata) for w, metadata in written.items()]
    own: dict[str, Any] = sharded.extras(lr_scheduler, step)
    if pipe._captured is not None and pipe._captured.unused:
        own["model"] = dict(pipe._captured.unused)
    if own:
        merged.append(("driver", dcp_parts.write_part(path / "driver", own)))
    dcp_parts.merge_parts(path, merged)
    (path / DESCRIPTION).write_text(json.dumps({
        "format": 1, "written_by": "rrefpipe pipe.save", "stages": len(driver.infos), "balance": pipe.balance,
        "schedule": pipe.schedule, "workers": {f"worker-{k}": w for k, w in enumerate(workers)},
        "optimizer": type(optimizer).__name__ if optimizer is not None else None, "step": step}, indent=1) + "\n")


def load(pipe: Pipe, path: str | os.PathLike[str], optimizer: Any, lr_scheduler: Any) -> int | None:
    driver = _remote(pipe)
    if driver is None:
        return sharded.load_model(path, pipe, optimizer=_local_optimizer(optimizer), lr_scheduler=lr_scheduler)
    metadata = dcp_parts.read_metadata(path)
    names = _names(pipe)
    stage_shapes = [{key: TensorMeta(*meta) for key, meta in stage.items()} for stage in driver.state_shapes()]
    wanted: list[dict[str, tuple[str, ...]]] = []
    for stage_names, stage in zip(names.values(), stage_shapes):
        keys = {key: (key,) if stage_names is None else stage_names.get(key, ()) for key in stage}
        wanted.append({key: model_keys for key, model_keys in keys.items() if model_keys})
    unused = list(pipe._captured.unused) if pipe._captured is not None else []
    stored = resolve(DCPCheckpoint(Path(path)), wanted, stage_shapes, also_expected=unused)
    workers = list(dict.fromkeys(driver.workers))
    if optimizer is not None:
        refs = {w: (names, _optimizer_ref(driver, optimizer, w)) for w in workers}
        settings = driver.per_worker(stage_sharded.optimizer_settings, per_worker=refs)
        _check_optimizer(metadata, {name: keys for part in settings.values() for name, keys in part.items()})
    if lr_scheduler is not None and not dcp_parts.under(metadata, "lr_scheduler."):
        raise ValueError(f"the checkpoint {os.fspath(path)!r} holds no LR scheduler state: it was saved without "
                         "lr_scheduler=")
    per_worker = {}
    for w in workers:
        ours = {model_key for j, worker in enumerate(driver.workers) if worker == w
                for model_keys in wanted[j].values() for model_key in model_keys}
        per_worker[w] = (str(path), names, {k: "model." + stored[k][1] for k in ours if k in stored},
                         _optimizer_ref(driver, optimizer, w))
    driver.per_worker(stage_sharded.load_part, per_worker=per_worker)
    if pipe._captured is not None and unused:
        present = [f"model.{k}" for k in unused if f"model.{k}" in metadata.state_dict_metadata]
        read = dcp_parts.read_entries(path, dcp_parts.templates(metadata, present))
        pipe._captured.unused.update((k[len("model."):], v) for k, v in read.items())
    return sharded.load_extras(path, metadata, lr_scheduler)


def _remote(pipe: Pipe) -> RemoteDriver | None:
    driver = pipe._driver
    return driver if isinstance(driver, RemoteDriver) else None


def _names(pipe: Pipe) -> dict[int, dict[str, tuple[str, ...]] | None]:
    """Each stage's state-dict keys -> the model's (None: the same, for an ``nn.Sequential``)."""
    if pipe._captured is None:
        return {j: None for j in range(len(pipe.balance))}
    return dict(enumerate(pipe._captured.stage_keys()))


def _optimizer_ref(driver: RemoteDriver, optimizer: Any, worker: str) -> tuple[str, Any] | None:
    """What worker ``worker`` finds its optimizer by (:mod:`rrefpipe.stage_side.sharded`)."""
    if optimizer is None:
        return None
    from torch.distributed.optim import DistributedOptimizer  # (imports FSDP and sympy: only when asked)

    if isinstance(optimizer, PipeOptimizer):
        if optimizer.closed:
            raise ValueError("the PipeOptimizer is closed: pass the pipe's open optimizer")
        return ("pipe", optimizer.id)
    if isinstance(optimizer, DistributedOptimizer):
        rrefs = [r for r in optimizer.remote_optimizers if r.owner().name == worker]
        if not rrefs:
            raise ValueError(f"the DistributedOptimizer has no optimizer on worker {worker!r}: build it over "
                             "pipe.parameter_rrefs() of this pipe")
        _check_regular(optimizer)
        return ("rref", rrefs[0])
    raise TypeError(f"optimizer= takes the pipe's pipe.optimizer(...) or a DistributedOptimizer over its "
                    f"parameter_rrefs(), got {type(optimizer).__name__}")


def _check_regular(optimizer: Any) -> None:
    from ..optim import _remote_optimizers
    _remote_optimizers(optimizer)  # refuses TorchScript's functional twins, which have no state to save


def _local_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise TypeError(f"in an RPC world of one, pipe.save and pipe.load take a torch.optim.Optimizer over "
                    f"pipe.parameters(), got {type(optimizer).__name__}")


def _check_optimizer(metadata: Any, ours: dict[str, list[str]]) -> None:
    """Every parameter of the pipe's optimizer (``ours``: its setting names, by parameter) has its settings
    in the checkpoint, under the same names: checked before any worker loads (a checkpoint saved without
    an optimizer, or by another class, loads nothing)."""
    saved: dict[str, set[str]] = {}
    for key in dcp_parts.under(metadata, "optim.param_groups."):
        name, _, setting = key[len("optim.param_groups."):].rpartition(".")
        saved.setdefault(name, set()).add(setting)
    for name, settings in ours.items():
        if name not in saved:
            raise ValueError(f"the checkpoint has no optimizer state for {name!r}: it was saved without optimizer=, "
                             "or by another model")
        if saved[name] != set(settings):
            raise ValueError(f"the optimizer state of {name!r} was saved with the settings {sorted(saved[name])}, this "
                             f"optimizer has {sorted(settings)}: load into an optimizer of the class that saved it")
