"""Where stashed skip tensors go: a per-thread dict outside a Pipe, a stage's router inside one."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from torch import Tensor

from ..microbatch import detached
from .namespace import Namespace

__all__ = ["DetachingTracker", "SkipKey", "SkipTracker", "current_tracker", "use_tracker"]

SkipKey = tuple[Namespace, str]


class SkipTracker(Protocol):
    def save(self, key: SkipKey, tensor: Tensor | None) -> None: ...

    def load(self, key: SkipKey) -> Tensor | None: ...


class _PlainTracker:
    """Outside a Pipe: a stash is kept until its pop, in the same thread."""

    def __init__(self) -> None:
        self.tensors: dict[SkipKey, Tensor | None] = {}

    def save(self, key: SkipKey, tensor: Tensor | None) -> None:
        self.tensors[key] = tensor

    def load(self, key: SkipKey) -> Tensor | None:
        try:
            return self.tensors.pop(key)
        except KeyError:
            raise KeyError(f"skip {key[1]!r} ({key[0]}) was popped before it was stashed") from None


class DetachingTracker(_PlainTracker):
    """For layers run one at a time (balancing profiles them so): each stash is cut from the stashing
    layer's graph, keeping ``requires_grad``, as each layer's input is; the popping layer's backward then
    stays its own, where the stashing layer's graph is gone by then."""

    def save(self, key: SkipKey, tensor: Tensor | None) -> None:
        super().save(key, None if tensor is None else detached(tensor))


_local = threading.local()


def current_tracker() -> SkipTracker:
    tracker: SkipTracker | None = getattr(_local, "tracker", None)
    if tracker is None:
        tracker = _local.tracker = _PlainTracker()
    return tracker


@contextmanager
def use_tracker(tracker: SkipTracker) -> Iterator[None]:
    """Route stashes and pops of this thread through ``tracker`` (a stage does this per micro-batch)."""
    previous = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        yield
    finally:
        _local.tracker = previous
