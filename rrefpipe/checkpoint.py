"""Activation checkpointing of a stage, and whether the current thread is recomputing.

Uses ``torch.utils.checkpoint`` in its non-reentrant form: it recomputes under distributed autograd
and gives exact gradients; the reentrant form silently drops parameter gradients there (RPC_FACTS).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["run_checkpointed", "is_recomputing", "recomputing", "warm_up"]

_state = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed stage re-runs its forward in backward (layers must not count it twice)."""
    return bool(getattr(_state, "recomputing", False))


@contextmanager
def recomputing(flag: bool) -> Iterator[None]:
    previous = is_recomputing()
    _state.recomputing = flag
    try:
        yield
    finally:
        _state.recomputing = previous


def run_checkpointed(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn(value)`` keeping only its input; the forward is re-run when backward needs activations,
    with :func:`is_recomputing` true during the re-runs."""
    calls = 0

    def counted(v: Any) -> Any:
        nonlocal calls
        again = calls > 0
        calls += 1
        with recomputing(again):
            return fn(v)

    return checkpoint(counted, value, use_reentrant=False, preserve_rng_state=True)


def warm_up() -> None:
    """Pay one-time lazy initialisation now: the first non-reentrant ``checkpoint`` call in a process
    costs about a second (imports inside torch), which would otherwise stall the first micro-batch."""
    x = torch.zeros(1, requires_grad=True)
    run_checkpointed(torch.sin, x).sum().backward()
