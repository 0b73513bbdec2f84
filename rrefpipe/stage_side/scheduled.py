"""The stage side of ``Pipe.train_step``: each worker runs its stages' forwards and backwards in the
order its schedule gives (:func:`rrefpipe.schedule.worker_orders`), one action after another on a
thread of its own, and computes each micro-batch's loss on the last stage.

Why not distributed autograd inside the step, as ``pipe(x)`` + ``pipe.backward`` use it: a stage
that must hold a forward back until a backward has finished (1F1B's bound of n - j micro-batches in
flight) would have to send that forward later from a thread other than the RPC body that received
it, and distributed autograd records a send only in the body whose context is current (there is no
public way to make a context current on another thread; ``../shared/RPC_FACTS.md``). So within a
step each stage runs plain autograd on its own part of the graph, and the tensors that cross stages
travel as explicit messages, detached: activations and skips forward, their gradients backward
(``post``, into the receiver's mailbox). Parameter gradients accumulate in ``.grad`` over the
micro-batches, as in one process; at the end of the step each worker *installs* them into the
caller's distributed autograd context with one local ``dist_autograd.backward`` (``gradients.install``), so
that ``DistributedOptimizer.step(context_id)``, clipping and loss scaling read them as after
``pipe.backward``. The context reached this worker with the driver's ``run_step`` message, which
carries a tensor that requires grad for that purpose.

Messages never wait on anything: ``post`` files what it brought and returns. Only the step's own
thread waits, for a message its next action needs, with the step's timeout, and it wakes when the
driver aborts the step (another stage failed).
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.futures import Future

from .. import autocast, memory, microbatch, replicas
from . import backward_split, gradients, server
from ..autocast import AutocastRegion
from ..errors import Failure
from ..loss import checked_loss, weights
from ..microbatch import TensorOrTensors
from ..schedule import Action, is_split, worker_orders
from .server import StageServer
from ..skip.tracker import SkipKey
from .stage import StageOutput, StepMeta
from .transfer import to_device

__all__: list[str] = []

# What crosses between stages: tensors (None where a gradient is missing or a skip stashed None),
# detached, and whether each asked for a gradient; a lone tensor (not a tuple) travels as such.
Payload = tuple[Tensor | tuple[Tensor | None, ...] | None, tuple[bool, ...]]
# Mailbox keys: ("F", j, i) activation into stage j; ("S", j, i, key) skip into stage j; ("B", j, i) the
# gradients of stage j's output; ("G", j, i, key) the gradient of a skip stage j stashed.
Key = tuple[Any, ...]


@dataclass(frozen=True)
class StepPlan:
    """Everything every worker needs to run one training step; the same for all of them."""

    step: int
    schedule: str
    stages: int
    stages_per_worker: int
    chunks: int  # micro-batches of this step (fewer than the pipe's chunks for a small batch)
    rows: tuple[int, ...]  # samples per micro-batch: the weights of the micro-batch losses
    checkpoint_stop: int
    workers: tuple[str, ...]  # per stage
    skip_sources: dict[SkipKey, int]  # the stage that stashes each routed skip
    driver: str
    timeout: float
    context_id: int
    loss_scale: float = 1.0  # the micro-batch losses' backward is scaled by this (``GradScaler``)
    average: bool = True  # with replicas: average at the end (False under ``Pipe.no_sync()``)
    unaveraged_rows: int = 0  # rows of earlier steps in the context left unaveraged (no_sync): averaged too
    replica_generation: int | None = None  # with replicas: the group generation the driver planned the step for
    spread: bool = False
    autocast: tuple[AutocastRegion, ...] = ()

    def meta(self) -> StepMeta:
        return StepMeta(step=self.step, chunks=self.chunks, checkpoint_stop=self.checkpoint_stop,
                        grad_enabled=True, driver=self.driver, timeout=self.timeout, spread=self.spread,
                        autocast=self.autocast, split_backward=is_split(self.schedule))


@dataclass
class StepReport:
    """A worker's answer: the last stage's micro-batch losses (detached, in micro-batch order), or why
    the step failed there."""

    losses: Tensor | None = None
    failure: Failure | None = None


class _Aborted(Exception):
    """The driver called the step off: another stage failed."""


class _Mailbox:
    """What other stages sent this worker's stages for a pipe, by step and key, until taken."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: dict[tuple[int, Key], tuple[Payload, list[torch.cuda.Event]]] = {}
        self.failed: dict[int, Failure | None] = {}  # aborted steps: a failure to raise, or None (cancelled)
        self.newest = -1

    def put(self, step: int, key: Key, payload: Payload) -> None:
        with self.cond:
            if step < self.newest:
                return  # a message of a step given up on
            self._advance(step)
            self.items[(step, key)] = (payload, _ready_events(payload))
            self.cond.notify_all()

    def abort(self, step: int, failure: Failure | None) -> None:
        with self.cond:
            self.failed.setdefault(step, failure)
            self.cond.notify_all()

    def start(self, step: int) -> None:
        with self.cond:
            self._advance(step)

    def _advance(self, step: int) -> None:
        if step > self.newest:  # what is left of older steps is dropped
            self.newest = step
            self.items = {k: v for k, v in self.items.items() if k[0] >= step}
            self.failed = {s: f for s, f in self.failed.items() if s >= step}

    def check(self, step: int) -> None:
        """Raise if the step was called off, or failed in a send of this worker's."""
        if step in self.failed:
            failure = self.failed[step]
            raise _Aborted() if failure is None else _Relayed(failure)

    def take(self, step: int, key: Key, timeout: float,
             what: Callable[[], str]) -> tuple[Payload, list[torch.cuda.Event]]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while (step, key) not in self.items:
                self.check(step)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"RPC ran for more than set timeout ({timeout:g} s) waiting for {what()}")
                self.cond.wait(min(left, 1.0))
            return self.items.pop((step, key))

    def first_of(self, step: int, keys: Sequence[Key]) -> Key:
        """The first of ``keys`` that has arrived, left in the box; waits as long as it takes (a
        continuous pipeline waiting for its caller's next batch), but wakes when the step is called off."""
        with self.cond:
            while True:
                self.check(step)
                for key in keys:
                    if (step, key) in self.items:
                        return key
                self.cond.wait(1.0)


class _Relayed(Exception):
    """A failure found by this worker outside the step's thread (a send that failed)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


_mailboxes: dict[str, _Mailbox] = {}
_mailboxes_lock = threading.Lock()


def _mailbox(pipe_id: str) -> _Mailbox:
    with _mailboxes_lock:
        box = _mailboxes.get(pipe_id)
        if box is None:
            box = _mailboxes[pipe_id] = _Mailbox()
            for gone in [p for p in _mailboxes if not server.has_stages(p)]:  # pipes closed since
                if gone != pipe_id:
                    del _mailboxes[gone]
        return box


@dataclass
class _Kept:
    """What micro-batch ``i``'s backward on a stage needs from its forward."""

    inputs: list[Tensor | None]  # the leaves that stand for the received activation (None: no gradient)
    skip_leaves: dict[SkipKey, Tensor]  # the same for the received skips that ask for a gradient
    outputs: list[Tensor]
    skips_out: dict[SkipKey, Tensor] = field(default_factory=dict)  # stashed here, popped later
    loss: Tensor | None = None  # the last stage's, already weighted and scaled for backward


class _StepRun:
    """One worker's part of one step: its actions, in its schedule's order, on the calling thread."""

    def __init__(self, pipe_id: str, worker_index: int, plan: StepPlan, value: TensorOrTensors | None,
                 target: TensorOrTensors | None, loss_fn: Callable[..., Tensor] | None) -> None:
        self.orders = worker_orders(plan.schedule, plan.stages, plan.chunks, plan.stages_per_worker)[worker_index]
        self._hold(pipe_id, plan, sorted({a.j for a in self.orders}), plan.meta(), loss_fn)
        self._value, self._target = value, target
        self.weights.update(enumerate(weights(plan.rows)))

    def _hold(self, pipe_id: str, plan: StepPlan, stages: Sequence[int], meta: StepMeta,
              loss_fn: Callable[..., Tensor] | None) -> None:
        """What a run of this worker's ``stages`` holds, a step's or a stream's (``streamed``): messages,
        micro-batches in flight by number, the last stage's losses."""
        self.pipe_id = pipe_id
        self.plan = plan
        self.name = rpc.get_worker_info().name
        self.box = _mailbox(pipe_id)
        self.servers = {j: server._server(pipe_id, j) for j in stages}
        self.meta = meta
        self.loss_fn = loss_fn
        # by micro-batch (a continuous pipeline numbers them across batches: ``streamed``)
        self.batches: dict[int, TensorOrTensors] = {}
        self.targets: dict[int, TensorOrTensors] = {}
        self.weights: dict[int, float] = {}  # each micro-batch's share of its batch's loss (by rows)
        self.sent: list[Future[Any]] = []
        self.kept: dict[tuple[int, int], _Kept] = {}
        self.later: dict[tuple[int, int], backward_split.WeightGradients] = {}  # W of (j, i), after its I
        self.params = ({j: list(srv.stage.module.parameters()) for j, srv in self.servers.items()}
                       if self.meta.split_backward else {})  # what W accumulates into, per stage
        self.losses: list[Tensor] = []

    # -- the step ----------------------------------------------------------------------------------
    def run(self) -> StepReport:
        action: Action | None = None
        try:
            self._begin()
            for action in self.orders:  # each on its stage's stream (on a GPU), takes included
                with self.servers[action.j].stream.running():
                    if action.kind == "F":
                        self._forward(action.j, action.i)
                    elif action.kind == "W":
                        self._weight(action.j, action.i)
                    else:
                        self._backward(action.j, action.i, split=action.kind == "I")
            action = None
            for sent in self.sent:  # a failed send is reported by ``_post``'s callback, through the mailbox
                with contextlib.suppress(Exception):
                    sent.wait()
            self.box.check(self.plan.step)
            self._install()
        except BaseException as exc:  # SystemExit from a layer too: it fails the step, not the worker
            return StepReport(failure=self._failure(exc, action))
        finally:
            self.kept.clear()
            self.later.clear()
            for srv in self.servers.values():
                for p in srv.stage.module.parameters():
                    p.grad = None
        losses = torch.stack(self.losses).cpu() if self.losses else None
        return StepReport(losses=losses)

    def _failure(self, exc: BaseException, action: Action | None) -> Failure:
        if isinstance(exc, _Relayed):
            return exc.failure
        stage = action.j if action is not None else min(self.servers)
        i = action.i if action is not None else None
        if isinstance(exc, _Aborted):
            return Failure(stage, self.name, i, "train_step", "Cancelled",
                           "the step was called off: another stage failed", "", cancelled=True)
        phase = "train_step" if action is None else _PHASES[action.kind]
        if isinstance(exc, _LossError):
            phase, exc = "loss_fn", exc.__cause__ or exc
        return Failure.capture(exc, stage=stage, worker=self.name, microbatch=i, phase=phase,
                               transport=isinstance(exc, TimeoutError))

    def _begin(self) -> None:
        self.box.start(self.plan.step)
        for srv in self.servers.values():
            srv.stream.settle()  # an optimizer step on another stream may still update the weights
            for p in srv.stage.module.parameters():
                p.grad = None  # gradients accumulate here over the step's micro-batches only
        first = self.servers.get(0)
        if first is not None and self._value is not None:  # one copy to the device, not one per micro-batch
            with first.stream.running():
                # Each micro-batch in storage of its own, so that its forward's saved input goes with its
                # backward: views would keep the whole batch until the step's last backward (1F1B's bound).
                self.batches = dict(enumerate(microbatch.apply(_own_storage, b)
                                              for b in _split_on(first, self._value, self.plan.chunks)))
            self._value = None
        last = self.servers.get(self.plan.stages - 1)
        if last is not None and self._target is not None:  # loss_fn gets it where the output is
            with last.stream.running():
                self.targets = dict(enumerate(_split_on(last, self._target, self.plan.chunks)))

    def _forward(self, j: int, i: int) -> None:
        srv = self.servers[j]
        stage = srv.stage
        if j == 0:
            value = self.batches.pop(i)  # the graph keeps what backward needs, nothing else
            inputs: list[Tensor | None] = [None] * len(microbatch.as_tensors(value))
        else:
            value, inputs = _leaves(self._take(("F", j, i), lambda: f"the activation of micro-batch {i} from stage "
                                                                   f"{j - 1} (worker {self.plan.workers[j - 1]!r})"))
        received: dict[SkipKey, Tensor | None] = {}
        skip_leaves: dict[SkipKey, Tensor] = {}
        for key in stage.routes.incoming:
            source = self.plan.skip_sources[key]
            payload = self._take(("S", j, i, key), lambda: f"skip {key[1]!r} of micro-batch {i} from stage {source} "
                                                           f"(worker {self.plan.workers[source]!r})")
            if payload[0] is None:  # the stash was None
                received[key] = None
                continue
            skip, (leaf,) = _leaves(payload)
            received[key] = skip  # type: ignore[assignment]  # (one tensor in, one out)
            if leaf is not None:
                skip_leaves[key] = leaf
        out = self._run_stage(j, i, value, received)
        kept = _Kept(inputs, skip_leaves, list(microbatch.as_tensors(out.value)))
        for key, tensor in out.skips.items():
            target = stage.routes.outgoing[key]
            if tensor is not None and tensor.requires_grad:
                kept.skips_out[key] = tensor
            self._post(srv, target, ("S", target, i, key), None if tensor is None else (tensor,), whole=True)
        if j + 1 < self.plan.stages:
            self._post(srv, j + 1, ("F", j + 1, i), kept.outputs, whole=isinstance(out.value, Tensor))
        else:
            kept.loss = self._loss(i, out.value)
        self.kept[(j, i)] = kept

    def _run_stage(self, j: int, i: int, value: TensorOrTensors, received: dict[SkipKey, Tensor | None]
                   ) -> StageOutput:
        """Stage j's forward of micro-batch ``i`` (a continuous pipeline runs it on a weight version)."""
        return self.servers[j].stage.run(self.meta, i, value, (), received)

    def _loss(self, i: int, output: TensorOrTensors) -> Tensor:
        assert self.loss_fn is not None
        try:
            with autocast.entered(self.plan.autocast):  # as the caller's loss would be, beside the forward
                loss = checked_loss(self.loss_fn(output, self.targets[i]))
        except BaseException as exc:
            raise _LossError() from exc
        self.losses.append(loss.detach())
        # The mini-batch loss is the row-weighted mean of the micro-batch losses; backward takes this part.
        return loss * (self.weights[i] * self.plan.loss_scale)

    def _backward(self, j: int, i: int, split: bool = False) -> None:
        """Micro-batch i's backward on stage j (``split``: only its inputs' gradients, the schedules' I;
        :meth:`_weight` does the rest later), sending the inputs' gradients back."""
        srv = self.servers[j]
        kept = self.kept.pop((j, i))
        srv.stage.recompute_soon(self.plan.step, i)  # a checkpointed forward recomputes while we wait
        roots, grads = self._output_gradients(srv, j, i, kept)
        start = time.time()
        grad: Callable[[Tensor | None], Tensor | None] = _grad
        if split:
            leaves = [t for t in kept.inputs if t is not None] + list(kept.skip_leaves.values())
            if kept.loss is not None:
                roots, grads = [kept.loss, *roots], [torch.ones_like(kept.loss), *grads]
            got, later = backward_split.input_gradients(roots, grads, leaves, self.params[j])
            roots.clear()  # the graph above the border goes now: the kept gradients take its place
            kept.outputs.clear()
            kept.skips_out.clear()
            kept.loss = None
            memory.count_kept(later.kept())
            self.later[(j, i)] = later
            by_leaf = {id(t): g for t, g in zip(leaves, got)}
            grad = lambda t: None if t is None else by_leaf[id(t)]  # noqa: E731
        else:
            starts = [] if kept.loss is None else [kept.loss]
            if roots:
                starts.append(_Given.apply(tuple(grads), *roots))
            if starts:
                torch.autograd.backward(starts)
        if self.meta.split_backward:  # markers in the graph time a fused backward otherwise
            srv.stage.recorder.add("backward", self.plan.step, i, start, time.time())
        if j > 0:
            self._post(srv, j - 1, ("B", j - 1, i), [grad(t) for t in kept.inputs], whole=False)
        for key, leaf in kept.skip_leaves.items():
            source = self.plan.skip_sources[key]
            self._post(srv, source, ("G", source, i, key), [grad(leaf)], whole=False)

    def _weight(self, j: int, i: int) -> None:
        """Micro-batch i's parameter gradients on stage j (the schedules' W), from what its I kept."""
        start = time.time()
        self.later.pop((j, i)).run()
        self.servers[j].stage.recorder.add("weight", self.plan.step, i, start, time.time())

    def _output_gradients(self, srv: StageServer, j: int, i: int, kept: _Kept) -> tuple[list[Tensor], list[Tensor]]:
        """The tensors micro-batch i's backward on stage j starts from, each with the gradient the stages
        after it sent (the output's, the stashed skips'); the loss is not among them."""
        roots: list[Tensor] = []
        grads: list[Tensor] = []
        if kept.loss is None:
            value, _ = self._take(("B", j, i), lambda: f"the gradient of micro-batch {i} from stage {j + 1} "
                                                        f"(worker {self.plan.workers[j + 1]!r})")
            _add_roots(roots, grads, kept.outputs, _as_tuple(value))
        for key, tensor in kept.skips_out.items():
            target = srv.stage.routes.outgoing[key]
            value, _ = self._take(("G", j, i, key), lambda: f"the gradient of skip {key[1]!r} of micro-batch {i} "
                                                             f"from stage {target}")
            _add_roots(roots, grads, [tensor], _as_tuple(value))
        return roots, grads

    def _install(self) -> None:
        """Move the parameters' gradients, summed over the step's micro-batches (and averaged over the
        replicas, if any), into the caller's context, adding to what an earlier step there left.

        Under ``Pipe.no_sync()`` nothing is averaged; the next step that averages in the context takes
        what those steps left there along with its own (weighted by all their rows, in one all-reduce)
        and writes the average over it."""
        # once each: a parameter two stages of this worker share got one sum
        params, buffers = gradients.worker_tensors([srv.stage.module for srv in self.servers.values()])
        grads: list[Tensor | None] = [p.grad for p in params]
        for p in params:
            p.grad = None
        context_id = self.plan.context_id
        with next(iter(self.servers.values())).stream.running():  # a worker's stages share its device
            if replicas.current() is not None and self.plan.average:
                start = time.time()
                earlier = self.plan.unaveraged_rows > 0
                if earlier:
                    stored = dist_autograd.get_gradients(context_id)
                    grads = [_added(stored.get(p), g) for p, g in zip(params, grads)]
                grads = replicas.end_step(params, grads, sum(self.plan.rows) + self.plan.unaveraged_rows, buffers,
                                          generation=self.plan.replica_generation)
                for srv in self.servers.values():  # one span per stage row of the timeline
                    srv.stage.recorder.add("allreduce", self.plan.step, -1, start, time.time())
                if earlier:  # the context's gradients become the average
                    gradients.assign(context_id, params, grads)
                    return
            kept = [(p, g) for p, g in zip(params, grads) if g is not None]
            gradients.install(context_id, [p for p, _ in kept], [g for _, g in kept])

    # -- messages ----------------------------------------------------------------------------------
    def _take(self, key: Key, what: Callable[[], str]) -> Payload:
        """What ``key`` brought, ready for the current stream (a stage's, on a GPU) to use."""
        payload, events = self.box.take(self.plan.step, key, self.plan.timeout, what)
        if events:
            stream = torch.cuda.current_stream()
            for event in events:
                stream.wait_event(event)
            for t in _as_tuple(payload[0]):
                if t is not None and t.is_cuda:
                    t.record_stream(stream)  # its memory is not reused while this stream may still read it
        return payload

    def _post(self, srv: StageServer, stage: int, key: Key, tensors: Sequence[Tensor | None] | None,
              whole: bool) -> None:
        """Send ``tensors`` (detached, saying which asked for a gradient) to ``stage``'s mailbox; ``whole``:
        they are one tensor, not a tuple, as the receiving layer must see them."""
        if tensors is None:
            payload: Payload = (None, (False,))
        else:
            flags = tuple(t is not None and t.requires_grad for t in tensors)
            sent = tuple(None if t is None else srv._outbound(t.detach(), stage) for t in tensors)
            payload = (sent[0] if whole else sent, flags)  # type: ignore[assignment]  # (whole: one tensor)
        worker = self.plan.workers[stage]
        if worker == self.name:
            self.box.put(self.plan.step, key, payload)
            return
        future = rpc.rpc_async(worker, post, args=(self.pipe_id, self.plan.step, key, payload),
                               timeout=self.plan.timeout)
        step, box, sender = self.plan.step, self.box, srv.spec.index

        def check(done: Future[Any]) -> None:
            try:
                done.wait()
            except Exception as exc:
                box.abort(step, Failure.capture(exc, stage=stage, worker=worker, microbatch=key[2], transport=True,
                                                phase=f"train_step (receiving from stage {sender})"))

        future.add_done_callback(check)
        self.sent.append(future)


class _Given(torch.autograd.Function):
    """A scalar whose backward hands each root the gradient received for it, as it is: backward from it
    is ``torch.autograd.backward(roots, grads)`` without that function's Python check of the gradients,
    which imports ``torch.fx.experimental.symbolic_shapes`` and with it sympy, once per process: 0.3 s
    of each worker's first step on an idle machine, seconds on a busy one (issue 48), and nothing else
    a step runs imports it. The engine still validates each gradient against its root (shape, dtype,
    device), as it does a root's own."""

    @staticmethod
    def forward(ctx: Any, grads: tuple[Tensor, ...], *roots: Tensor) -> Tensor:
        ctx.grads = grads
        return torch.zeros((), device=roots[0].device)  # on the stage's device, as its nodes are

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple[Tensor | None, ...]:
        return (None, *ctx.grads)


_PHASES = {"F": "forward", "B": "backward", "I": "backward (input gradient)", "W": "backward (weight gradient)"}


class _LossError(Exception):
    """``loss_fn`` raised, or returned something backward cannot start from (the cause says which)."""


def _leaves(payload: Payload) -> tuple[TensorOrTensors, list[Tensor | None]]:
    """The received tensors as leaves of this stage's graph: those that asked for a gradient ask again,
    and are returned a second time (None for the others) to read their gradients from after backward."""
    value, flags = payload
    tensors = _as_tuple(value)
    assert all(t is not None for t in tensors)  # activations and skips: gradients travel the other way
    leaves = [t.requires_grad_(True) if flag else t for t, flag in zip(tensors, flags) if t is not None]
    rebuilt: TensorOrTensors = leaves[0] if isinstance(value, Tensor) else tuple(leaves)
    return rebuilt, [t if flag else None for t, flag in zip(leaves, flags)]


def _added(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """``a + b``, where either may be missing (``replicas.end_step`` leaves its inputs as they are)."""
    if a is None or b is None:
        return b if a is None else a
    return a + b


def _as_tuple(value: Tensor | tuple[Tensor | None, ...] | None) -> tuple[Tensor | None, ...]:
    return () if value is None else (value,) if isinstance(value, Tensor) else value


def _add_roots(roots: list[Tensor], grads: list[Tensor], tensors: Sequence[Tensor],
               received: Sequence[Tensor | None]) -> None:
    """Backward starts from each of ``tensors`` that got a gradient (a later stage's input it used)."""
    for t, g in zip(tensors, received):
        if g is not None and t.requires_grad:
            roots.append(t)
            grads.append(g)


def _ready_events(payload: Payload) -> list[torch.cuda.Event]:
    """Events on the current stream of each GPU whose tensors the payload holds: where a body received
    them (TensorPipe's stream, on which they are ready), or where a stage of this worker made them."""
    devices = {t.device for t in _as_tuple(payload[0]) if t is not None and t.is_cuda}
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


def _split_on(srv: StageServer, value: TensorOrTensors, chunks: int) -> list[TensorOrTensors]:
    """``value`` on the stage's device (one copy, on the current stream), split into ``chunks`` micro-batches."""
    device = srv.stage.device
    return microbatch.scatter(microbatch.apply(lambda t: to_device(t, device), value), chunks)


def _own_storage(t: Tensor) -> Tensor:
    """``t``, copied where it is a view into a larger storage."""
    return t.clone() if t.untyped_storage().nbytes() > t.nbytes else t


def _grad(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.grad


# -- RPC entry points (run on the stage's worker) ----------------------------------------------------
def post(pipe_id: str, step: int, key: Key, payload: Payload) -> None:
    """Another stage's activation, skip or gradient for one of this worker's stages; never waits."""
    _mailbox(pipe_id).put(step, key, payload)


def abort(pipe_id: str, step: int) -> None:
    """The driver calls the step off (another stage failed): this worker's step ends at its next wait."""
    _mailbox(pipe_id).abort(step, None)


@rpc.functions.async_execution
def run_step(pipe_id: str, worker_index: int, plan: StepPlan, value: TensorOrTensors | None,
             target: TensorOrTensors | None, loss_fn: bytes | None, anchor: Tensor) -> Future[StepReport]:
    """Run this worker's part of a training step on a thread of its own; resolves to its report.

    ``anchor`` requires grad, so that this message brings the caller's autograd context here, where the
    step installs its gradients. The RPC thread returns at once: the step waits for messages that
    this worker's one RPC thread must take in."""
    done: Future[StepReport] = Future()

    def work() -> None:
        try:
            fn = None if loss_fn is None else cloudpickle.loads(loss_fn)
            report = _StepRun(pipe_id, worker_index, plan, value, target, fn).run()
        except BaseException as exc:  # the stage is gone, or the loss function does not unpickle here
            j = next((j for j in range(plan.stages) if plan.workers[j] == rpc.get_worker_info().name), 0)
            report = StepReport(failure=Failure.capture(exc, stage=j, worker=rpc.get_worker_info().name,
                                                        microbatch=None, phase="train_step"))
        done.set_result(report)

    threading.Thread(target=work, name=f"rrefpipe-step-{plan.step}", daemon=True).start()
    return done
