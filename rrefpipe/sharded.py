"""Sharded checkpoints in ``torch.distributed.checkpoint`` (DCP) format, written by the processes that
hold the tensors: ``pipe.save`` / ``pipe.load`` for a pipe, :func:`save_model` / :func:`load_model` for a
plain model in one process. The two write and read the same checkpoints.

A checkpoint is one DCP directory::

    model.<key>                        each tensor of the model's state_dict(), by the model's keys
    optim.state.<param>.<field>        the optimizer's state per parameter (exp_avg, step, ...)
    optim.param_groups.<param>.<name>  the settings of each parameter's group (lr, betas, ...)
    lr_scheduler.<name>                the learning-rate scheduler's state_dict()
    step                               the step the caller gave

``optim`` is torch's flattened optimizer format (``torch.distributed.checkpoint.state_dict``'s
``get_optimizer_state_dict(..., options=StateDictOptions(flatten_optimizer_state_dict=True))``), which
names each parameter's state by the parameter, so that it loads into any split of the model. Each
process writes its part into a directory of its own (``worker-<k>/``, ``driver/``), all at the same
time; the driver then writes the checkpoint's ``.metadata``, which names every part's files, so that
``dcp.load`` reads the directory as one checkpoint. Loading builds the state each process needs from
that metadata and reads only its own tensors. (A checkpoint is unpickled when loaded, as every DCP and
``torch.load`` checkpoint is: load only checkpoints you trust.)
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .dcp_parts import merge_parts, read_entries, read_metadata, replacing, templates, under, write_part

__all__ = ["save_model", "load_model", "optimizer_entries", "load_optimizer", "optimizer_keys", "extras", "load_extras"]


# -- the format -------------------------------------------------------------------------------------
def optimizer_entries(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> dict[str, Any]:
    """``optimizer``'s state in the flattened format, each parameter by ``names[id(parameter)]``."""
    flat: dict[str, Any] = {}
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            name = names[id(p)]
            flat.update((f"param_groups.{name}.{k}", v) for k, v in settings.items())
            _flatten(optimizer.state.get(p, {}), f"state.{name}", flat)
    return flat


def _flatten(value: Mapping[str, Any], prefix: str, into: dict[str, Any]) -> None:
    for k, v in value.items():
        if isinstance(v, Mapping):
            _flatten(v, f"{prefix}.{k}", into)
        else:
            into[f"{prefix}.{k}"] = v.detach() if isinstance(v, Tensor) else v


def load_optimizer(optimizer: torch.optim.Optimizer, names: Mapping[int, str], flat: Mapping[str, Any],
                   where: str = "") -> None:
    """Load the flattened state ``flat`` (without the ``optim.`` prefix) into ``optimizer``. Each group's
    settings come from its first parameter's; a parameter without saved settings, or saved with other
    settings' names (another optimizer class), raises ``ValueError`` before anything is loaded."""
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group in optimizer.param_groups:
        ours = sorted(k for k in group if k != "params")
        settings: dict[str, Any] | None = None
        params = []
        for p in group["params"]:
            name = names[id(p)]
            saved = {k[len(f"param_groups.{name}."):]: v for k, v in flat.items()
                     if k.startswith(f"param_groups.{name}.")}
            if not saved:
                raise ValueError(f"{where}the checkpoint has no optimizer state for {name!r}: it was saved without "
                                 "this optimizer, or by another model")
            if sorted(saved) != ours:
                raise ValueError(f"{where}the optimizer state of {name!r} was saved with the settings {sorted(saved)}, "
                                 f"this optimizer has {ours}: load into an optimizer of the class that saved it")
            settings = settings or saved
            entry = _unflatten({k[len(f"state.{name}."):]: v for k, v in flat.items() if k.startswith(f"state.{name}.")})
            if entry:
                state[index] = entry
            params.append(index)
            index += 1
        groups.append({**(settings or {}), "params": params})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *path, last = key.split(".")
        node = out
        for atom in path:
            node = node.setdefault(atom, {})
        node[last] = value
    return out


# -- a plain model, in one process ----------------------------------------------------------------------
def save_model(path: str | os.PathLike[str], model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
               lr_scheduler: Any = None, step: int | None = None) -> None:
    """Save ``model`` (and its optimizer, LR scheduler and step) as ``pipe.save`` does, from one process:
    a checkpoint that loads into a pipe of any split (``pipe.load``) and back (:func:`load_model`)."""
    entries: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        entries["optim"] = optimizer_entries(optimizer, _param_names(model))
    entries.update(extras(lr_scheduler, step))
    with replacing(path) as fresh:
        merge_parts(fresh, [("process", write_part(fresh / "process", entries))])


def load_model(path: str | os.PathLike[str], model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
               lr_scheduler: Any = None, strict: bool = True) -> int | None:
    """Load a checkpoint of ``pipe.save`` (or :func:`save_model`, or ``dcp.save`` of
    ``{"model": model.state_dict(), ...}``) into ``model`` in this process; returns the step saved with it.
    ``strict``: as ``load_state_dict``'s (missing and unexpected keys raise)."""
    from .weights import DCPCheckpoint, TensorMeta, resolve

    metadata = read_metadata(path)
    state = model.state_dict()
    stored = {key[len("model."):] for key in under(metadata, "model.")}
    if strict:  # named as load_state_dict names them, before anything is read
        resolve(DCPCheckpoint(Path(path)), [{k: (k,) for k in state}],
                [{k: TensorMeta.of(v) for k, v in state.items()}])
    wanted = templates(metadata, (f"model.{k}" for k in state if k in stored))
    keys: list[str] = []
    if optimizer is not None:
        keys = optimizer_keys(metadata, set(_param_names(model).values()))
        wanted.update(templates(metadata, keys))
    read = read_entries(path, wanted)
    if optimizer is not None:  # first: what it refuses leaves the weights as they were
        load_optimizer(optimizer, _param_names(model), {k[len("optim."):]: read[k] for k in keys})
    model.load_state_dict({k[len("model."):]: v for k, v in read.items() if k.startswith("model.")}, strict=strict)
    return load_extras(path, metadata, lr_scheduler)


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_keys(metadata: Any, params: set[str]) -> list[str]:
    """The checkpoint's ``optim.`` keys of the parameters named ``params``: what an optimizer over them reads."""
    return [key for key in under(metadata, "optim.") if _param_of(key[len("optim."):], params) is not None]


def _param_of(key: str, names: set[str]) -> str | None:
    """The parameter an ``optim`` key (``state.<param>.<field>`` or ``param_groups.<param>.<name>``) is of."""
    kind, _, rest = key.partition(".")
    if kind not in ("state", "param_groups"):
        return None
    atoms = rest.split(".")
    for cut in range(len(atoms) - 1, 0, -1):
        if ".".join(atoms[:cut]) in names:
            return ".".join(atoms[:cut])
    return None


def extras(lr_scheduler: Any, step: int | None) -> dict[str, Any]:
    """The scheduler's state (the first of a ``RemoteLRScheduler``'s, every one of which steps alike) and
    the step."""
    entries: dict[str, Any] = {}
    if lr_scheduler is not None:
        state = lr_scheduler.state_dict()
        entries["lr_scheduler"] = state[0] if isinstance(state, list) else state
    if step is not None:
        entries["step"] = int(step)
    return entries


def load_extras(path: str | os.PathLike[str], metadata: Any, lr_scheduler: Any) -> int | None:
    """Load the scheduler's state into ``lr_scheduler`` (each of a ``RemoteLRScheduler``'s); the step."""
    wanted = templates(metadata, ["step"]) if "step" in metadata.state_dict_metadata else {}
    if lr_scheduler is not None:
        current = lr_scheduler.state_dict()
        if not under(metadata, "lr_scheduler."):
            raise ValueError(f"the checkpoint {os.fspath(path)!r} holds no LR scheduler state: it was saved without "
                             "lr_scheduler=")
        wanted["lr_scheduler"] = dict(current[0] if isinstance(current, list) else current)
    read = read_entries(path, wanted)
    if lr_scheduler is not None:
        state = read["lr_scheduler"]
        lr_scheduler.load_state_dict([dict(state) for _ in current] if isinstance(current, list) else state)
    step = read.get("step")
    return int(step) if step is not None else None
