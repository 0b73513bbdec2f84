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
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from . import microbatch

__all__ = ["run_checkpointed", "overwrites_input", "is_checkpointing", "is_recomputing", "recomputing", "warm_up"]

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


def overwrites_input(module: nn.Module) -> bool:
    """Whether ``module`` overwrites its input: it is, or starts with (through nested ``nn.Sequential``),
    a layer that says so, such as ``nn.ReLU(inplace=True)``. A stage that starts with one must recompute
    from a copy; a stage boundary can fall right before one, automatic balancing included."""
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    return bool(getattr(module, "inplace", False))


def _versions(value: Any) -> list[int]:
    return [t._version for t in microbatch.as_tensors(value)]


def _copied(value: Any) -> Any:
    return microbatch.apply(Tensor.clone, value)


def run_checkpointed(fn: Callable[[Any], Any], value: Any, copy_input: bool = False) -> Any:
    """``fn(value)`` keeping only its input; the forward is re-run when backward needs activations,
    with :func:`is_recomputing` true during the re-runs.

    Checkpointing keeps ``value`` to recompute from, so ``fn`` must not modify it in place. With
    ``copy_input`` each run starts from a copy of it (see :func:`overwrites_input`); without, a
    run that modified it raises at once, naming the cause, instead of backward failing later on a
    version-counter check that distributed autograd reports only as "python_error".

    An exception of the first run is raised only after ``checkpoint`` has closed its forward context.
    torch 2.11 (not 2.13) leaves that context, a saved-tensor hook, pushed on the calling thread when
    the function raises, for as long as the exception lives: every later autograd graph on that thread
    (a stage worker's one RPC thread) then saves its tensors into the failed forward, and its backward
    fails (``python_error``)."""
    calls = 0
    failed: list[BaseException] = []
    run: Callable[[Any], Any] = (lambda v: fn(_copied(v))) if copy_input else fn

    def counted(v: Any) -> Any:
        nonlocal calls
        again = calls > 0
        calls += 1
        with recomputing(again):
            if again:
                return run(v)
            _state.checkpointing = True
            try:
                before = _versions(v)
                out = run(v)
                if _versions(v) != before:
                    raise RuntimeError(
                        "a layer modified the stage's input in place (e.g. an in-place activation or `x.add_()` "
                        "in its first layer's forward), but checkpointing keeps that input to recompute from "
                        "in backward: use the layer's out-of-place form, or checkpoint='never'")
                return out
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
