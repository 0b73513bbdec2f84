"""The caller's autocast regions, carried to the stage workers.

Autocast is thread-local state: a stage's forward runs in an RPC body on another process, where the
driver's ``with torch.autocast(...)`` does not reach (PyTorch's own Pipe ignored it silently). The
driver captures the regions enabled around ``pipe(x)``, each micro-batch carries them, and the stage
re-enters them around its forward. Checkpointing's recomputation restores them by itself, and
backward runs in the dtypes the forward chose, as in one process.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch

__all__ = ["AutocastRegion", "capture", "entered"]

#: (device type, dtype, weight cache enabled), as ``torch.autocast`` takes them.
AutocastRegion = tuple[str, torch.dtype, bool]

_DEVICE_TYPES = ("cpu", "cuda")


def capture() -> tuple[AutocastRegion, ...]:
    """The autocast regions enabled on this thread now."""
    cache = torch.is_autocast_cache_enabled()
    return tuple((kind, torch.get_autocast_dtype(kind), cache) for kind in _DEVICE_TYPES
                 if torch.is_autocast_enabled(kind))


def entered(regions: Sequence[AutocastRegion]) -> AbstractContextManager[Any]:
    """A context that enters ``regions`` (those of a device type this process has; a CPU-only worker
    has no CUDA tensors for a CUDA region to cast)."""
    if not regions:
        return nullcontext()
    stack = ExitStack()
    for kind, dtype, cache in regions:
        if kind == "cpu" or torch.cuda.is_available():
            stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=cache))
    return stack
