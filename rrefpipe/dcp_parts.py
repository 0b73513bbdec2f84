"""A DCP (``torch.distributed.checkpoint``) checkpoint written in parts, one per process, each alone
(no process group: stage workers share none), and read back key by key in one process: what
:mod:`rrefpipe.sharded`'s checkpoints and ``Pipe(init=<a DCP directory>)`` stand on.

Each part is an ordinary DCP checkpoint of its own directory; :func:`merge_parts` writes the whole
checkpoint's ``.metadata`` naming every part's files from the top, so that ``dcp.load`` reads the
directory as one checkpoint. DCP is imported when used: it imports sympy, which a training step need not.
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

__all__ = ["METADATA", "write_part", "merge_parts", "replacing", "read_metadata", "templates", "read_entries",
           "under"]

METADATA = ".metadata"


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
