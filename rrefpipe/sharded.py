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

import contextlib
import dataclasses
import os
import pickle
import shutil
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["save_model", "load_model", "optimizer_entries", "load_optimizer", "write_part", "merge_parts",
           "read_metadata", "read_entries", "templates", "METADATA"]

METADATA = ".metadata"


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


# -- DCP: one part per process, one metadata for the whole --------------------------------------------
def write_part(directory: str | os.PathLike[str], entries: Mapping[str, Any]) -> Any:
    """Write ``entries`` (nested dicts of tensors and values) as a DCP checkpoint of this process alone;
    returns its ``Metadata``."""
    import torch.distributed.checkpoint as dcp  # (imported when used: it imports sympy, which a step need not)
    from torch.distributed.checkpoint.api import CheckpointException
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... a single process": as meant
        try:
            return dcp.save(dict(entries), storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
        except CheckpointException as exc:  # (a BaseException: say what failed as an ordinary error)
            raise OSError(f"cannot write the checkpoint part {os.fspath(directory)!r}: {exc}") from None


def merge_parts(path: str | os.PathLike[str], parts: Sequence[tuple[str, Any]]) -> None:
    """Write ``path``'s ``.metadata``: the parts' (``(subdirectory, Metadata)``), their files named from
    ``path``. A key several parts hold (a tied parameter saved by two workers) is read from the first."""
    if not parts:
        raise ValueError("nothing to merge")
    state_md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for sub, md in parts:
        for key, entry in md.state_dict_metadata.items():
            state_md.setdefault(key, entry)
            owner.setdefault(key, sub)
        for index, info in md.storage_data.items():
            if owner.get(index.fqn) == sub:
                storage[index] = dataclasses.replace(info, relative_path=f"{sub}/{info.relative_path}")
        planner.update(md.planner_data or {})
    merged = dataclasses.replace(parts[0][1], state_dict_metadata=state_md, storage_data=storage, planner_data=planner)
    target = Path(path) / METADATA
    temporary = target.with_name(METADATA + ".tmp")
    with open(temporary, "wb") as f:
        pickle.dump(merged, f)
        f.flush()
        os.fsync(f.fileno())
    temporary.replace(target)


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A new directory beside ``path`` to write a checkpoint into; once the block ends without error it
    becomes ``path`` (an earlier checkpoint there is removed only then), otherwise it is removed: a save
    that fails half-way leaves the earlier checkpoint whole."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    fresh = target.with_name(f".{target.name}.writing-{tag}")
    fresh.mkdir()
    try:
        yield fresh
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    old = target.with_name(f".{target.name}.old-{tag}")
    if target.exists():
        target.rename(old)
    fresh.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def read_metadata(path: str | os.PathLike[str]) -> Any:
    """The checkpoint's DCP ``Metadata``; ``ValueError`` naming the path if there is none."""
    from torch.distributed.checkpoint import FileSystemReader
    if not (Path(path) / METADATA).is_file():
        raise ValueError(f"{os.fspath(path)!r} is not a DCP checkpoint (no {METADATA} in it)"
                         if Path(path).is_dir() else f"no checkpoint at {os.fspath(path)!r}")
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        raise ValueError(f"cannot read the checkpoint {os.fspath(path)!r}: {type(exc).__name__}: {exc}") from None


def templates(metadata: Any, keys: Iterable[str]) -> dict[str, Any]:
    """What :func:`read_entries` fills for ``keys``: an empty tensor of the stored shape and dtype, or None
    for a value."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    out: dict[str, Any] = {}
    for key in keys:
        entry = metadata.state_dict_metadata[key]
        out[key] = (torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
                    if isinstance(entry, TensorStorageMetadata) else None)
    return out


def read_entries(path: str | os.PathLike[str], wanted: dict[str, Any]) -> dict[str, Any]:
    """Read the flat keys of ``wanted`` (from :func:`templates`) from the checkpoint, in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    if wanted:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                dcp.load(wanted, checkpoint_id=str(path), no_dist=True)
            except (Exception, CheckpointException) as exc:  # (DCP's is a BaseException)
                raise ValueError(f"cannot read the checkpoint {os.fspath(path)!r}: {type(exc).__name__}: "
                                 f"{exc}") from None
    return wanted


def under(metadata: Any, prefix: str) -> list[str]:
    """The checkpoint's keys that begin with ``prefix``."""
    return [key for key in metadata.state_dict_metadata if key.startswith(prefix)]


# -- a plain model, in one process ----------------------------------------------------------------------
def save_model(path: str | os.PathLike[str], model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
               lr_scheduler: Any = None, step: int | None = None) -> None:
    """Save ``model`` (and its optimizer, LR scheduler and step) as ``pipe.save`` does, from one process:
    a checkpoint that loads into a pipe of any split (``pipe.load``) and back (:func:`load_model`)."""
    entries: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        entries["optim"] = optimizer_entries(optimizer, _param_names(model))
    entries.update(_extras(lr_scheduler, step))
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
                {k: TensorMeta(tuple(v.shape), v.dtype) for k, v in state.items()})
    wanted = templates(metadata, (f"model.{k}" for k in state if k in stored))
    keys: list[str] = []
    if optimizer is not None:
        names = set(_param_names(model).values())
        keys = [k for k in under(metadata, "optim.") if _param_of(k[len("optim."):], names) is not None]
        wanted.update(templates(metadata, keys))
    read = read_entries(path, wanted)
    if optimizer is not None:  # first: what it refuses leaves the weights as they were
        load_optimizer(optimizer, _param_names(model), {k[len("optim."):]: read[k] for k in keys})
    model.load_state_dict({k[len("model."):]: v for k, v in read.items() if k.startswith("model.")}, strict=strict)
    return load_extras(path, metadata, lr_scheduler)


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


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


def _extras(lr_scheduler: Any, step: int | None) -> dict[str, Any]:
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
