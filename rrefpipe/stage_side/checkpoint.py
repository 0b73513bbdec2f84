"""Activation checkpointing of a stage, recomputed in backward or ahead of it, and whether the current
thread is recomputing.

A checkpointed run keeps its input and puts placeholders where autograd would save activations
(saved-tensor hooks, the mechanism of torch's non-reentrant ``checkpoint``). The forward's graph is
recorded as usual, so gradients are exact under distributed autograd too; the reentrant form silently
drops parameter gradients there (measured with torch 2.13). The activations come back by running the
forward again, either when backward first needs one or earlier, on request (:meth:`Recomputable.
recompute`): a stage waiting for its next output gradient recomputes that micro-batch meanwhile.
``torch.utils.checkpoint`` recomputes only inside backward, so it cannot do the latter.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import get_device_states, set_device_states

from .. import autocast, microbatch

__all__ = ["Recomputable", "random_turns", "run_checkpointed", "overwrites_input", "is_checkpointing",
           "is_recomputing", "recomputing", "warm_up"]

_state = threading.local()

#: Held around anything in the process that draws from, or resets, torch's random generators: a
#: forward, a recomputation (which rewinds them to its first run's state, then restores them), seeding.
#: The generators belong to the process, so this lock does too: stages of several pipes may share a
#: worker, and a recomputation ahead runs on a thread of its own.
random_turns = threading.RLock()


def is_recomputing() -> bool:
    """True while a checkpointed stage re-runs its forward for backward (layers must not count it twice)."""
    return bool(getattr(_state, "recomputing", False))


def is_checkpointing() -> bool:
    """True during the first forward of a checkpointed micro-batch, the run whose activations are
    dropped and recomputed later (as in PyTorch's Pipe and torchgpipe)."""
    return bool(getattr(_state, "checkpointing", False))


@contextmanager
def _flag(name: str, value: bool) -> Iterator[None]:
    previous = getattr(_state, name, False)
    setattr(_state, name, value)
    try:
        yield
    finally:
        setattr(_state, name, previous)


def recomputing(flag: bool) -> Any:
    """A context in which :func:`is_recomputing` returns ``flag``."""
    return _flag("recomputing", flag)


def overwrites_input(module: nn.Module) -> bool:
    """Whether ``module`` overwrites its input: it is, or starts with (through nested ``nn.Sequential``),
    a layer that says so, such as ``nn.ReLU(inplace=True)``. A stage that starts with one must recompute
    from a copy; a stage boundary can fall right before one, automatic balancing included."""
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    return bool(getattr(module, "inplace", False))


def _versions(value: Any) -> list[int]:
    return [t._version for t in microbatch.as_tensors(value)]


class _Slot:
    """Stands in the graph for one saved activation; holds it between a recomputation and its use."""

    __slots__ = ("kind", "tensor")

    def __init__(self, kind: tuple[torch.Size, torch.dtype, torch.device]) -> None:
        self.kind = kind  # shape, dtype and device: what the recomputation must save here again
        self.tensor: Tensor | None = None


class Recomputable:
    """One checkpointed run of ``fn(value)`` (:meth:`run`) and what it takes to bring back its activations.
    Thread-safe: a recomputation ahead of backward (on any thread) and backward's own need of an
    activation run it once.

    The graph owns it, through the saved-tensor hooks, and it owns nothing of the graph its run recorded
    (only the input, which comes before it): not the output, and not the recomputed graph either (see
    :meth:`_fill`), so reference counting frees it with the graph. (A cycle through autograd's C++ nodes
    is invisible to the garbage collector: every step's activations stayed, 100 MB a step on a ResNet
    stage, and backward ran twice as slow from fresh pages.)"""

    def __init__(self, fn: Callable[[Any], Any], copy_input: bool = False,
                 on_failure: Callable[[BaseException], None] | None = None, keep_unpacked: bool = False) -> None:
        self._fn = fn
        # A split backward (``backward_split``) runs the nodes on the border between its halves twice,
        # each unpacking what it saved: the recomputed activations stay until the graph goes, after both.
        self._keep_unpacked = keep_unpacked
        self._unpacked = False
        self._copy_input = copy_input
        self._on_failure = on_failure  # told once when recomputing fails, where backward keeps only text
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._recomputed = False
        self._released = False  # a recomputation asked for ahead is no longer wanted
        self._first_run = False

    def run(self, value: Any, reused: Sequence[Tensor] = ()) -> Any:
        """The first run of ``fn(value)``: its output, with placeholders for what backward needs. Keeps
        the input, and the random, autocast and stream state to run it again as it ran now. ``reused``:
        other tensors ``fn`` reads that a recomputation reads again (skip tensors received from earlier
        stages): neither they nor the input may change in place."""
        self._autocast = autocast.capture()
        self._cpu_rng = torch.get_rng_state()
        self._devices, self._device_rng = _accelerator_rng_states(microbatch.as_tensors(value))
        self._stream = _current_stream(value)
        self._input = value  # the tensors themselves: memory tracking counts an input kept while they live

        def pack(t: Tensor) -> _Slot:
            slot = _Slot((t.shape, t.dtype, t.device))
            self._slots.append(slot)
            return slot

        self._first_run = True
        try:
            with saved_tensors_hooks(pack, self._unpack), _flag("checkpointing", True):
                before = _versions((*microbatch.as_tensors(value), *reused))
                out = self._fn(self._own(value))
                if _versions((*microbatch.as_tensors(value), *reused)) != before:
                    raise RuntimeError(
                        "a layer modified the stage's input or a skip tensor it popped in place (e.g. an in-place "
                        "activation first, or `x.add_()` in a forward), but checkpointing keeps them to recompute "
                        "from in backward: use the out-of-place form, or checkpoint='never'")
        finally:
            self._first_run = False
        return out

    def recompute(self) -> None:
        """Bring the activations back now, unless that happened already or :meth:`release` said they
        are not wanted ahead; a failure is kept and raised again where backward needs the activations."""
        with self._lock:
            if self._slots and not self._recomputed and not self._released and self._error is None:
                try:
                    self._fill()
                except BaseException as exc:  # backward raises it, on its own thread (SystemExit too)
                    self._error = exc

    def release(self) -> None:
        """Drop activations recomputed ahead that backward has not used yet (they come back if it needs
        them): one run's, as checkpointing promises, when another forward follows before backward. A
        recomputation still queued ahead for this run does nothing after this: backward brings them."""
        with self._lock:
            self._released = True
            if self._recomputed and not self._unpacked and all(s.tensor is not None for s in self._slots):
                for s in self._slots:
                    s.tensor = None
                self._recomputed = False

    def discard(self) -> None:
        """Drop what this run keeps for backward (its input, activations recomputed ahead): its step's
        backward failed, and the graph may outlive that (a failed backward's context is kept past its
        release, see ``_rpc.retain_context``). A backward that still comes raises."""
        with self._lock:
            self._error = self._error or RuntimeError("this micro-batch's step failed in backward, and its "
                                                      "checkpoint was dropped")
            self._input = None
            for s in self._slots:
                s.tensor = None

    def _unpack(self, slot: _Slot) -> Tensor:
        if self._first_run:
            raise RuntimeError("checkpointing: a layer of this stage computed gradients inside its own forward "
                               "(torch.autograd.grad, or backward), which rrefpipe's checkpointing does not "
                               "support: use checkpoint='never' for this model")
        with self._lock:
            if self._error is not None:
                raise self._error
            if slot.tensor is None:  # not recomputed ahead (or used already: a graph kept for a second backward)
                self._fill()
            self._unpacked = True
            tensor = slot.tensor
            if not self._keep_unpacked:
                slot.tensor = None
        assert tensor is not None
        return tensor

    def _fill(self) -> None:
        self._recomputed = True
        try:
            self._rerun()
        except BaseException as exc:
            if self._on_failure is not None:
                self._on_failure(exc)
            raise

    def _rerun(self) -> None:
        slots = iter(self._slots)
        count = 0
        same = True

        def pack(t: Tensor) -> None:
            # Runs once per saved tensor (90 a micro-batch on a ResNet-style stage): kept to the least.
            nonlocal count, same
            count += 1
            slot = next(slots, None)
            if slot is not None:
                slot.tensor = t.detach() if t.requires_grad else t
                same = same and slot.kind == (t.shape, t.dtype, t.device)
            # Nothing for the recomputed graph, which never runs backward: an output saved by its own node
            # would hold that node, a cycle autograd cannot see, and leak the whole graph.

        with self._replayed(), saved_tensors_hooks(pack, _never_unpacked), torch.enable_grad(), recomputing(True):
            self._fn(self._own(microbatch.apply(microbatch.detached, self._input)))
        if count != len(self._slots) or not same:
            for s in self._slots:
                s.tensor = None
            raise RuntimeError(f"checkpointing: the recomputed forward saved {count} tensors for backward where "
                               f"the first saved {len(self._slots)}, or of other shapes, dtypes or devices: the "
                               "stage's forward must do the same work when run again")

    def _own(self, value: Any) -> Any:
        """What a run of ``fn`` gets: a copy of ``value`` where the stage's first layer overwrites its input."""
        return microbatch.apply(Tensor.clone, value) if self._copy_input else value

    @contextmanager
    def _replayed(self) -> Iterator[None]:
        """The random, autocast and stream state of the first run, without disturbing the caller's."""
        with random_turns, torch.random.fork_rng(self._devices):
            torch.set_rng_state(self._cpu_rng)
            set_device_states(self._devices, self._device_rng)
            with autocast.entered(self._autocast), torch.cuda.stream(self._stream) if self._stream else nullcontext():
                yield


def _never_unpacked(_: None) -> Tensor:
    raise RuntimeError("checkpointing: backward through a recomputed forward")


def _accelerator_rng_states(tensors: Sequence[Tensor]) -> tuple[list[int], list[Tensor]]:
    """The random state of the accelerators ``tensors`` are on, as torch's ``get_device_states`` gives it;
    nothing, without asking it, when all are on the CPU: it walks its arguments with pytree, 15 µs of
    each checkpointed micro-batch on a CPU stage."""
    if all(t.device.type in ("cpu", "meta") for t in tensors):
        return [], []
    return get_device_states(*tensors)


def _current_stream(value: Any) -> torch.cuda.Stream | None:
    """The stream the first run queued on (a stage's stream), for a recomputation on another thread."""
    for t in microbatch.as_tensors(value):
        if t.is_cuda:
            return torch.cuda.current_stream(t.device)
    return None


def run_checkpointed(fn: Callable[[Any], Any], value: Any, copy_input: bool = False) -> Any:
    """``fn(value)`` keeping only its input; the forward runs again when backward needs its activations,
    with :func:`is_recomputing` true during the re-run.

    Checkpointing keeps ``value`` to recompute from, so ``fn`` must not modify it in place. With
    ``copy_input`` each run starts from a copy of it (see :func:`overwrites_input`); without, a
    run that modified it raises at once, naming the cause, instead of backward failing later on a
    version-counter check that distributed autograd reports only as "python_error"."""
    return Recomputable(fn, copy_input).run(value)


def warm_up() -> None:
    """Pay one-time lazy initialisation of checkpointing now, not in a stage's first micro-batch (about
    2 ms; ``torch.utils.checkpoint``'s first call cost a second of imports)."""
    x = torch.zeros(1, requires_grad=True)
    run_checkpointed(torch.sin, x).sum().backward()
