"""Activation checkpointing of a stage, and whether the current thread is recomputing.

Uses ``torch.utils.checkpoint`` in its non-reentrant form: it recomputes under distributed autograd
and gives exact gradients; the reentrant form silently drops parameter gradients there (measured
with torch 2.13).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["run_checkpointed", "is_checkpointing", "is_recomputing", "recomputing", "warm_up"]

_state = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed stage re-runs its forward in backward (layers must not count it twice)."""
    return bool(getattr(_state, "recomputing", False))


def is_checkpointing() -> bool:
    """True during the first forward of a checkpointed micro-batch, the run whose activations are
    dropped and recomputed later (as in PyTorch's Pipe and torchgpipe)."""
    return bool(getattr(_state, "checkpointing", False))


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
    with :func:`is_recomputing` true during the re-runs.

    An exception of the first run is raised only after ``checkpoint`` has closed its forward context.
    torch 2.11 (not 2.13) leaves that context, a saved-tensor hook, pushed on the calling thread when
    the function raises, for as long as the exception lives: every later autograd graph on that thread
    (a stage worker's one RPC thread) then saves its tensors into the failed forward, and its backward
    fails (``python_error``)."""
    calls = 0
    failed: list[BaseException] = []

    def counted(v: Any) -> Any:
        nonlocal calls
        again = calls > 0
        calls += 1
        with recomputing(again):
            if again:
                return fn(v)
            _state.checkpointing = True
            try:
                return fn(v)
            except BaseException as exc:  # raised again below, whatever it is
                failed.append(exc)
                return None
            finally:
                _state.checkpointing = False

    try:
        return checkpoint(counted, value, use_reentrant=False, preserve_rng_state=True)
    finally:
        if failed:  # the stage's own error, also if checkpoint then raised one of its own
            raise failed.pop()


def warm_up() -> None:
    """Pay one-time lazy initialisation now: the first non-reentrant ``checkpoint`` call in a process
    costs about a second (imports inside torch), which would otherwise stall the first micro-batch."""
    x = torch.zeros(1, requires_grad=True)
    run_checkpointed(torch.sin, x).sum().backward()
