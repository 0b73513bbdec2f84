"""One pipeline stage: its layers on its device, run on one micro-batch with or without checkpointing.

Transport-free, so the same code runs on an RPC stage worker and in the driver's own process.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .. import autocast, microbatch
from ..autocast import AutocastRegion
from ..batchnorm import DeferredBatchNorm, plain_batch_norms, running_stats_frozen
from ..calling import as_layer_sequence
from .checkpoint import Recomputable, is_recomputing, overwrites_input, random_turns
from ..errors import Failure
from ..dependency import arrival, fence, hop, join, mark, new_phony
from ..microbatch import TensorOrTensors
from ..skip.layout import SkipRoutes, StageRouter
from ..skip.namespace import DEFAULT
from ..skip.skippable import crossing_skips, skippable_layers
from ..skip.tracker import SkipKey, use_tracker
from ..trace import Recorder
from .transfer import to_device

__all__ = ["StepMeta", "StageInfo", "StageOutput", "Stage"]


@dataclass(frozen=True)
class StepMeta:
    """What every stage needs to know about one forward pass; travels with each micro-batch."""

    step: int
    chunks: int
    checkpoint_stop: int
    grad_enabled: bool
    driver: str  # the driver's worker name: the last stage delivers the output there
    timeout: float
    keep_output: bool = False  # the output stays on the last stage (only phonies no loss can reach go)
    per_message: int = 1  # micro-batches per message from a stage to the next
    autocast: tuple[AutocastRegion, ...] = ()  # the driver's autocast regions around the forward
    spread: bool = False  # the call had several inputs: tuples reach layers spread (see ``calling``)
    split_backward: bool = False  # train_step runs backward in two halves (``backward_split``) and times them


@dataclass(frozen=True)
class StageInfo:
    """Which layers a stage holds, on which worker and device. ``print(pipe)`` or
    ``print(*pipe.stages)`` shows them as lines."""

    index: int
    worker: str
    device: str
    layers: tuple[str, ...]
    num_parameters: int
    stashes: tuple[SkipKey, ...] = ()
    pops: tuple[SkipKey, ...] = ()

    def __str__(self) -> str:
        text = (f"stage {self.index}: worker {self.worker!r} on {self.device}, layers {', '.join(self.layers)} "
                f"({self.num_parameters:,} parameters)")
        if self.stashes or self.pops:
            text += f", skips: stash {[_skip_name(k) for k in self.stashes]} pop {[_skip_name(k) for k in self.pops]}"
        return text


def _skip_name(key: SkipKey) -> str:
    """A skip's name, with its namespace unless the default one (isolated copies share names)."""
    namespace, name = key
    return name if namespace == DEFAULT else f"{name} ({namespace.id[:8]})"


@dataclass
class StageOutput:
    """A micro-batch's output, and the skip tensors to send straight to later stages."""

    value: TensorOrTensors
    phony: Tensor | None = None
    skips: dict[SkipKey, Tensor | None] = field(default_factory=dict)
    skip_phonies: dict[SkipKey, Tensor] = field(default_factory=dict)


class Stage:
    """A partition of the model on one device, with its skip routes and execution record."""

    def __init__(self, index: int, module: nn.Sequential, device: torch.device, worker: str,
                 recompute_ahead: bool = False, last: bool = False) -> None:
        self.index = index
        self.last = last  # its output leaves the pipe (see ``dependency.hop``)
        self.device = device
        self.worker = worker
        self.module = as_layer_sequence(module).to(device)  # runs its layers by the call rule (calling)
        self.recorder = Recorder(index, worker)
        self.routes = SkipRoutes({}, frozenset())
        self._deferred = [m for m in module.modules() if isinstance(m, DeferredBatchNorm)]
        self._plain_norms = plain_batch_norms(module)  # frozen while recomputing
        self._skippable = any(True for _ in skippable_layers(self.module))  # else no skip tracker is needed
        self._copy_input = overwrites_input(self.module)  # checkpointing recomputes from the input
        self._backward_starts: dict[tuple[int, int], float] = {}
        self._backward_failures: deque[tuple[int, Failure]] = deque(maxlen=16)  # (step, failure)
        self._failures_lock = threading.Lock()  # recorded on autograd's threads, taken on the RPC thread
        # Not on a GPU yet: there a recomputation ahead would queue on the stage's stream while sends
        # record their events on it, and the next stage could wait for it (never measured: no GPU).
        self._ahead = _RecomputeAhead() if recompute_ahead and self.device.type == "cpu" else None
        # the checkpointed runs of each step whose graph lives, for ``abandon`` (the graph owns each run)
        self._checkpoints: dict[int, list[weakref.ref[Recomputable]]] = {}

    def info(self) -> StageInfo:
        names = tuple(f"{name}: {getattr(layer, 'description', type(layer).__name__)}"  # (a captured stage's parts)
                      for name, layer in self.module.named_children())
        count = sum(p.numel() for p in self.module.parameters())
        crossing = list(crossing_skips(self.module))  # a skip kept inside one layer needs no route
        stashes = tuple(key for _, stashed, _ in crossing for key in stashed)
        pops = tuple(key for _, _, popped in crossing for key in popped)
        return StageInfo(self.index, self.worker, str(self.device), names, count, stashes, pops)

    def run(self, meta: StepMeta, i: int, value: TensorOrTensors, phonies: Sequence[Tensor] = (),
            received: dict[SkipKey, Tensor | None] | None = None, sent_with: Tensor | None = None,
            params: dict[str, Tensor] | None = None) -> StageOutput:
        """Run micro-batch ``i`` with the skip tensors ``received`` from earlier stages.

        ``params``: weights to run with instead of the module's own (a continuous pipeline's version,
        :mod:`rrefpipe.stage_side.versions`), named as in ``module.named_parameters()``; a checkpointed run
        recomputes with them too, in its own backward (never ahead, on another thread).

        Under autograd each phony is joined into the output and new phonies are forked for the next
        hops, so every hop stays in the backward graph (see ``dependency``). ``sent_with``: the phony
        that came with ``value`` from the previous stage, which backward answers with the tensors of
        ``value`` that got a gradient."""
        move = self._to_device
        value = microbatch.apply(move, value)
        received = {k: None if t is None else move(t) for k, t in (received or {}).items()}
        if i == 0:
            for bn in self._deferred:
                bn.start_minibatch(meta.chunks)
            self._backward_starts.clear()  # starts of a step whose backward never ran (eval in a context)
            self._checkpoints = {step: runs for step, runs in self._checkpoints.items()  # steps whose graph went
                                 if any(run() is not None for run in runs)}
            if self._ahead is not None:
                self._ahead.new_step()
        checkpointed = meta.grad_enabled and i < meta.checkpoint_stop and self.module.training
        if self._copy_input and not checkpointed:  # (checkpointing runs from a copy of its own)
            value = microbatch.apply(_overwritable, value)
        with torch.set_grad_enabled(meta.grad_enabled), autocast.entered(meta.autocast):
            backward_end = self._backward_callback(meta.step, i, "end")
            crosses = bool(phonies) or sent_with is not None  # the output crosses an RPC hop
            inputs_need_grad = meta.grad_enabled and any(t.requires_grad for t in microbatch.as_tensors(value))
            timed = meta.grad_enabled and not meta.split_backward  # markers in the graph time its backward
            if sent_with is not None and meta.grad_enabled:  # it times the end of backward too, both cases below
                value, joined = arrival(value, sent_with, backward_end, self.device)
                phonies = [joined, *phonies]
            elif inputs_need_grad and timed:  # backward ends when the inputs' gradients are computed
                value = mark(value, backward_end)
            elif timed:  # ... or after the last node that the forward below records
                phonies = [fence(backward_end, phonies or [new_phony()], self.device)]
            fn, outgoing = self._runner(meta.step, i, received, meta.spread, params)
            with random_turns:
                out = self._checkpointed(meta, i, fn, value, received, ahead=params is None) if checkpointed else fn(value)
            microbatch.check(out, f"output of stage {self.index}")
            if isinstance(out, list):
                out = tuple(out)
            if not meta.grad_enabled:
                return StageOutput(out, None, outgoing)
            started = self._backward_callback(meta.step, i, "start")
            if crosses:
                result = StageOutput(*hop(out, phonies, started, as_is=not self.last, masked=not self.last))
            else:  # in the driver's process: a fence goes where the output's gradient will flow, if any
                if phonies and microbatch.as_tensors(out)[0].requires_grad:
                    out = join(out, phonies[0])
                result = StageOutput(mark(out, started) if timed else out)
            for key, tensor in outgoing.items():
                if tensor is not None and crosses:  # a skip message must be recorded, like any hop
                    if tensor.requires_grad:
                        sent, result.skip_phonies[key] = hop(tensor, [], None, masked=True)
                        tensor = sent  # type: ignore[assignment]  # (one tensor in, one out)
                    else:
                        result.skip_phonies[key] = new_phony()
                result.skips[key] = tensor
            outgoing.clear()  # the forward (kept for recomputation) must not hold its own graph
        return result

    def _checkpointed(self, meta: StepMeta, i: int, fn: Callable[[TensorOrTensors], TensorOrTensors],
                      value: TensorOrTensors, received: dict[SkipKey, Tensor | None], ahead: bool = True
                      ) -> TensorOrTensors:
        recomputable = Recomputable(fn, self._copy_input, partial(self._recompute_failed, meta.step, i),
                                    keep_unpacked=meta.split_backward)
        out = recomputable.run(value, [t for t in received.values() if t is not None])
        if self._ahead is not None and ahead:
            self._ahead.keep(meta.step, i, recomputable)
        self._checkpoints.setdefault(meta.step, []).append(weakref.ref(recomputable))
        return out

    def abandon(self, steps: Collection[int]) -> None:
        """The backward of ``steps`` failed: drop the inputs and activations their checkpointed runs keep
        here, which their graph would hold for as long as a failed backward's context is kept."""
        for step in steps:
            for ref in list(self._checkpoints.get(step, ())):
                run = ref()
                if run is not None:
                    run.discard()

    def _recompute_failed(self, step: int, i: int, exc: BaseException) -> None:
        """Keep the whole story of a failed recomputation for the driver to ask: it fails inside
        backward, where distributed autograd keeps at most the text (from a saved-tensor hook, only
        "python_error")."""
        failure = Failure.capture(exc, stage=self.index, worker=self.worker, microbatch=i, phase="recompute")
        with self._failures_lock:
            self._backward_failures.append((step, failure))

    def take_backward_failure(self, steps: Collection[int]) -> Failure | None:
        """The latest failure recorded in the backward of one of ``steps``; those of ``steps`` are
        forgotten, so a later step's error is never blamed on them."""
        with self._failures_lock:
            mine = [f for s, f in self._backward_failures if s in steps]
            others = [(s, f) for s, f in self._backward_failures if s not in steps]
            self._backward_failures.clear()
            self._backward_failures.extend(others)
        return mine[-1] if mine else None

    def recompute_soon(self, step: int, i: int) -> None:
        """Recompute checkpointed micro-batch ``i`` ahead of its backward, if this stage does that: the
        server calls it once the step's last output here has gone on (the stage then waits for its
        gradient); the stage itself, for micro-batch i-1, when i's backward ends."""
        if self._ahead is not None:
            self._ahead.request(step, i)

    def _to_device(self, t: Tensor) -> Tensor:
        return to_device(t, self.device)

    def _runner(self, step: int, i: int, received: dict[SkipKey, Tensor | None], spread: bool,
                params: dict[str, Tensor] | None = None
                ) -> tuple[Callable[[TensorOrTensors], TensorOrTensors], dict[SkipKey, Tensor | None]]:
        """The partition's forward with its skip router. The forward records 'forward' and collects the
        outgoing skips; checkpoint recomputation records 'recompute' and sends nothing. With ``params``,
        every call (the recomputation too) runs the module on those weights."""
        outgoing: dict[SkipKey, Tensor | None] = {}

        def call(value: TensorOrTensors) -> TensorOrTensors:
            if params is None:
                return self.module(value, spread=spread)
            return functional_call(self.module, params, (value,), {"spread": spread})

        def run(value: TensorOrTensors) -> TensorOrTensors:
            again = is_recomputing()
            start = time.time()
            try:
                with running_stats_frozen(self._plain_norms if again else ()):
                    if not self._skippable:  # the common case: no tracker to install
                        return call(value)
                    router = StageRouter(self.routes, received, recomputing=again)
                    with use_tracker(router):
                        out = call(value)
                if not again:
                    outgoing.update(router.outgoing)
                return out
            finally:
                self.recorder.add("recompute" if again else "forward", step, i, start, time.time())

        return run, outgoing

    def backward_running(self) -> float | None:
        """Seconds since the oldest micro-batch whose backward started here and has not ended, if any."""
        starts = list(self._backward_starts.values())
        return time.time() - min(starts) if starts else None

    def _backward_callback(self, step: int, i: int, edge: str) -> Callable[[], None]:
        """Backward of a stage starts when its output's gradient arrives and ends at its inputs'."""
        pending = self._backward_starts

        def callback() -> None:
            now = time.time()
            if edge == "start":
                pending[(step, i)] = now
            else:
                self.recorder.add("backward", step, i, pending.pop((step, i), now), now)
                if i > 0:  # the previous micro-batch's gradient comes next
                    self.recompute_soon(step, i - 1)

        return callback


def _overwritable(t: Tensor) -> Tensor:
    """``t``, or a copy where autograd forbids overwriting it: a view that needs a gradient (a micro-batch
    split off the batch, or off a pair), which the stage's in-place first layer would change."""
    return t.clone() if t.requires_grad and t._is_view() else t


class _RecomputeAhead:
    """Recomputes a stage's checkpointed micro-batches ahead of backward, while the stage waits for
    their gradients, so that backward finds the activations ready.

    A stage before the last one is idle between sending an input gradient and receiving the next output
    gradient, and at the start of backward for as long as the later stages take on the step's last
    micro-batch: its recomputation can run then instead of on the step's critical path. It runs on a
    thread of the process (the RPC thread stays free, autograd's is busy with the previous micro-batch),
    one micro-batch ahead at most, so checkpointing keeps its memory bound."""

    _requests: queue.SimpleQueue[weakref.ref[Recomputable]] = queue.SimpleQueue()
    _started = threading.Lock()
    _thread: threading.Thread | None = None

    def __init__(self) -> None:
        self._runs: dict[tuple[int, int], weakref.ref[Recomputable]] = {}  # the graph owns each run
        self._requested: list[weakref.ref[Recomputable]] = []
        self._lock = threading.Lock()  # requests come from the RPC thread and from backward's
        with self._started:
            if _RecomputeAhead._thread is None:  # one for the process: a daemon, so exit never waits on it
                _RecomputeAhead._thread = threading.Thread(target=self._serve, name="rrefpipe-recompute", daemon=True)
                _RecomputeAhead._thread.start()

    def keep(self, step: int, i: int, run: Recomputable) -> None:
        with self._lock:
            self._runs[(step, i)] = weakref.ref(run)

    def new_step(self) -> None:
        """A forward starts: runs whose graph has gone are forgotten, and activations recomputed ahead
        for a backward that has not come (several forwards before one backward) are dropped again."""
        with self._lock:
            self._runs = {key: ref for key, ref in self._runs.items() if ref() is not None}
            requested, self._requested = self._requested, []
        for ref in requested:
            run = ref()
            if run is not None:
                run.release()

    def request(self, step: int, i: int) -> None:
        with self._lock:
            ref = self._runs.pop((step, i), None)
            if ref is None:
                return
            self._requested = [r for r in self._requested if r() is not None] + [ref]
        self._requests.put(ref)

    @classmethod
    def _serve(cls) -> None:
        while True:
            run = cls._requests.get()()  # None once its graph has gone
            if run is not None:
                run.recompute()  # keeps any failure for backward to raise
            del run
