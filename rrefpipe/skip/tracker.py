"""Where stashed skip tensors go: a per-thread dict outside a Pipe, a stage's router inside one."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from torch import Tensor

from ..microbatch import detached
from .namespace import Namespace

__all__ = ["DetachingTracker", "SkipKey", "SkipTracker", "Tracker", "current_tracker", "use_tracker",
           "current_skip_tracker", "use_skip_tracker"]

SkipKey = tuple[Namespace, str]


class Tracker(Protocol):
    """Where a thread's stashes go and its pops come from."""

    def save(self, key: SkipKey, tensor: Tensor | None) -> None: ...

    def load(self, key: SkipKey) -> Tensor | None: ...


class SkipTracker:
    """Outside a Pipe: a stash is kept until its pop, in the same thread (``tensors``, by key).

    Each thread starts with one (:func:`current_skip_tracker`); ``with use_skip_tracker(SkipTracker()):``
    gives a block its own, as PyTorch's did."""

    def __init__(self) -> None:
        self.tensors: dict[SkipKey, Tensor | None] = {}

    def save(self, key: SkipKey, tensor: Tensor | None) -> None:
        self.tensors[key] = tensor

    def load(self, key: SkipKey) -> Tensor | None:
        try:
            return self.tensors.pop(key)
        except KeyError:
            raise RuntimeError(f"skip {key[1]!r} ({key[0]}) was popped before it was stashed") from None


class DetachingTracker(SkipTracker):
    """For layers run one at a time (balancing profiles them so): each stash is cut from the stashing
    layer's graph, keeping ``requires_grad``, as each layer's input is; the popping layer's backward then
    stays its own, where the stashing layer's graph is gone by then."""

    def save(self, key: SkipKey, tensor: Tensor | None) -> None:
        super().save(key, None if tensor is None else detached(tensor))


_local = threading.local()


def current_tracker() -> Tracker:
    """This thread's tracker: the one in use, else a :class:`SkipTracker` of its own."""
    tracker: Tracker | None = getattr(_local, "tracker", None)
    if tracker is None:
        tracker = _local.tracker = SkipTracker()
    return tracker


@contextmanager
def use_tracker(tracker: Tracker) -> Iterator[None]:
    """Route stashes and pops of this thread through ``tracker`` (a stage does this per micro-batch)."""
    previous = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        yield
    finally:
        _local.tracker = previous


#: PyTorch's names for them (``torch.distributed.pipeline.sync.skip.tracker``).
current_skip_tracker = current_tracker
use_skip_tracker = use_tracker
