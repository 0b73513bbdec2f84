"""A worker's part of a sharded checkpoint (``pipe.save`` / ``pipe.load``): the tensors of its stages
and their optimizer's state, under the model's names, written to and read from DCP by this process
(:mod:`rrefpipe.sharded` has the format). One call per worker covers all of its stages of the pipe.

``names[j]`` maps stage ``j``'s state-dict keys to the model's (None: they are the model's, as for an
``nn.Sequential`` cut into stages). The optimizer is ``("pipe", id)`` for ``pipe.optimizer``'s, or
``("rref", rref)`` for this worker's optimizer of a ``DistributedOptimizer``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

from .. import dcp_parts, sharded
from . import stage_optim
from .server import _server

__all__: list[str] = []

Names = dict[int, dict[str, tuple[str, ...]] | None]
OptimizerRef = tuple[str, Any] | None


def _model_keys(names: Names, j: int, key: str) -> tuple[str, ...]:
    stage_names = names.get(j)
    return (key,) if stage_names is None else stage_names.get(key, ())


def _param_names(pipe_id: str, indices: list[int], names: Names) -> dict[int, str]:
    """Every parameter of this worker's stages by the model's (first) key for it."""
    out: dict[int, str] = {}
    for j in indices:
        for key, p in _server(pipe_id, j).stage.module.named_parameters(remove_duplicate=False):
            keys = _model_keys(names, j, key)
            if keys:
                out.setdefault(id(p), keys[0])
    return out


@contextlib.contextmanager
def _optimizers(pipe_id: str, indices: list[int], optimizer: OptimizerRef) -> Iterator[list[torch.optim.Optimizer]]:
    """This worker's optimizers of the pipe's stages, held under the lock their steps take."""
    if optimizer is None:
        yield []
        return
    kind, ref = optimizer
    if kind == "pipe":
        with stage_optim.lock(pipe_id, ref):
            yield [stage_optim.optimizer(pipe_id, ref, j) for j in indices]
        return
    local, lock = stage_optim.distributed_optimizer(ref)
    with lock:
        yield [local]


@contextlib.contextmanager
def _held(pipe_id: str, indices: list[int], optimizer: OptimizerRef
          ) -> Iterator[tuple[list[Any], list[torch.optim.Optimizer]]]:
    """This worker's servers of the pipe's stages, their pending optimizer writes settled and their stream
    held, and their optimizers under their lock: what a save reads and a load writes, with nothing running."""
    servers = [_server(pipe_id, j) for j in indices]
    for server in servers:
        server.stream.settle()  # after an optimizer step's writes
    with contextlib.ExitStack() as held:
        if servers:
            held.enter_context(servers[0].stream.running())
        yield servers, held.enter_context(_optimizers(pipe_id, indices, optimizer))


def save_part(pipe_id: str, indices: list[int], directory: str, names: Names, optimizer: OptimizerRef) -> Any:
    """Write this worker's stages (and optimizer state) to ``directory``; returns the DCP metadata."""
    model: dict[str, Tensor] = {}
    with _held(pipe_id, indices, optimizer) as (servers, optimizers):
        for j, server in zip(indices, servers):
            for key, value in server.stage.module.state_dict().items():
                for model_key in _model_keys(names, j, key):
                    model.setdefault(model_key, value)
        entries: dict[str, Any] = {"model": model}
        if optimizers:
            param_names = _param_names(pipe_id, indices, names)
            flat: dict[str, Any] = {}
            for opt in optimizers:
                flat.update(sharded.optimizer_entries(opt, param_names))
            entries["optim"] = flat
        return dcp_parts.write_part(directory, entries)


def optimizer_settings(pipe_id: str, indices: list[int], names: Names, optimizer: OptimizerRef) -> dict[str, list[str]]:
    """Each parameter of this worker's optimizer, by the model's name, with its group's setting names: what
    the driver checks a checkpoint against before any worker loads."""
    param_names = _param_names(pipe_id, indices, names)
    with _optimizers(pipe_id, indices, optimizer) as optimizers:
        return {param_names[id(p)]: sorted(k for k in group if k != "params")
                for opt in optimizers for group in opt.param_groups for p in group["params"]}


def load_part(pipe_id: str, indices: list[int], path: str, names: Names, stored: Mapping[str, str],
              optimizer: OptimizerRef) -> None:
    """Read this worker's stages (``stored``: model key -> checkpoint key) and their optimizer state from
    the checkpoint at ``path`` into them. Everything is read before anything is written, so a read that
    fails leaves the stages as they were."""
    metadata = dcp_parts.read_metadata(path)
    where = f"worker {rpc.get_worker_info().name!r}: "
    wanted = dcp_parts.templates(metadata, set(stored.values()))
    optim_keys: list[str] = []
    param_names: dict[int, str] = {}
    if optimizer is not None:
        param_names = _param_names(pipe_id, indices, names)
        optim_keys = sharded.optimizer_keys(metadata, set(param_names.values()))
        wanted.update(dcp_parts.templates(metadata, optim_keys))
    read = dcp_parts.read_entries(path, wanted)
    with _held(pipe_id, indices, optimizer) as (servers, optimizers):
        flat = {k[len("optim."):]: read[k] for k in optim_keys}
        for opt in optimizers:  # checked (and loaded) first: its errors leave the weights untouched
            sharded.load_optimizer(opt, param_names, flat, where)
        with torch.no_grad():
            for j, server in zip(indices, servers):
                for key, tensor in server.stage.module.state_dict(keep_vars=True).items():
                    keys = [k for k in _model_keys(names, j, key) if k in stored]
                    if keys:
                        tensor.copy_(read[stored[keys[0]]])
