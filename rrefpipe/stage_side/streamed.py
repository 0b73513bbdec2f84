"""The stage side of a continuous pipeline (``Pipe.train_stream`` under PipeDream, PipeDream-2BW or
PipeMare, and ``Pipe.stream``): batch t + 1 enters before batch t has left.

One long-lived run per worker, on a thread of its own, follows its stage's lazily made order
(:func:`rrefpipe.schedule.stream_order`): forwards, backwards and, under training, ``U``, the stage's
own optimizer step with one batch's gradient, as soon as that batch's backward is done there. It is
:mod:`rrefpipe.stage_side.scheduled`'s step run with two changes:

* micro-batches are numbered across batches (``g``), so the messages of batch t + 1 never meet those
  of batch t, and the stream is one "step" of the mailbox for as long as it lasts;
* each batch runs on the weight version its rule gives (:mod:`rrefpipe.stage_side.versions`), its gradients
  summed in leaves of its own and applied by ``U``; nothing goes through distributed autograd, whose
  contexts end only with a backward that a stream never finishes.

The driver (:mod:`rrefpipe.driver_side.streaming`) announces each batch (its rows; the input to the first stage,
the target to the last) and finally the number of batches; the last stage sends each batch's losses
(or, forward only, its output) to the driver as soon as it has them.
"""
from __future__ import annotations

import copy
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, cast

import cloudpickle
import torch
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.futures import Future

from .. import microbatch
from ..autocast import AutocastRegion
from ..errors import Failure
from ..loss import weights
from ..microbatch import TensorOrTensors
from ..schedule import Action, PipeMareOptions, checkpoint_stop, stream_order, weight_version
from ..skip.tracker import SkipKey
from . import server, stage_optim
from .scheduled import Payload, StepPlan, StepReport, _mailbox, _own_storage, _split_on, _StepRun
from .stage import StageOutput, StepMeta
from .versions import StageWeights

__all__: list[str] = []

#: ``deliver(pipe_id, stream, t, value)`` on the driver: batch t's losses (stacked, detached) or output.
Deliver = Callable[[str, int, int, Any], None]


@dataclass(frozen=True)
class StreamPlan:
    """Everything every worker needs to run its part of a stream; the same for all of them."""

    step: int  # the stream's number in the mailbox, from the pipe's step counter
    schedule: str  # a continuous rule for training; any schedule when forward only
    stages: int
    chunks: int  # the pipe's: the version rules' m (a batch may split into fewer micro-batches)
    checkpoint: str
    workers: tuple[str, ...]  # per stage
    skip_sources: dict[SkipKey, int]
    driver: str
    deliver: Deliver
    timeout: float
    forward_only: bool
    training: bool  # the modules' mode: checkpointing only in training mode
    vertical_sync: bool = False
    optimizer: int | None = None  # the pipe optimizer's id on the workers (training)
    undo_depth: int = 0  # the updates each stage can undo after a failure (training)
    pipemare: PipeMareOptions | None = None  # PipeMare's rescheduling and correction
    scheduler: int | None = None  # the LR scheduler each stage steps after its update (its id on the workers)
    spread: bool = False
    autocast: tuple[AutocastRegion, ...] = ()

    def as_step(self) -> StepPlan:
        """The step plan whose fields the shared step machinery reads (messages, timeouts, skips)."""
        return StepPlan(step=self.step, schedule="1F1B", stages=self.stages, stages_per_worker=1, chunks=self.chunks,
                        rows=(), checkpoint_stop=0, workers=self.workers, skip_sources=self.skip_sources,
                        driver=self.driver, timeout=self.timeout, context_id=-1, spread=self.spread,
                        autocast=self.autocast)


@dataclass
class StreamReport(StepReport):
    """A worker's answer at the end of its run: as a step's, with the updates each of its stages applied."""

    updates: dict[int, int] = field(default_factory=dict)


@dataclass
class _Undo:
    """What undoes one update of a stage: the weights, optimizer state and LR schedulers' state before it."""

    updates: int  # the stage's update count before it
    weights: dict[str, Tensor]
    optimizer: dict[str, Any]
    schedulers: list[tuple[Any, dict[str, Any]]]  # the LR schedulers it stepped, each with its state before


# By (pipe id, stage): the undo records of the stage's last updates, kept after a run that failed until
# the driver rolls the stage back to the last update every stage applied (or the next stream starts).
_undo: dict[tuple[str, int], tuple[int, deque[_Undo]]] = {}


@dataclass
class _Batch:
    """What a stage knows about one batch: where its micro-batches start in the global numbering, its
    rows, the meta its forwards run under, and (training) the leaves its gradients sum into per stage."""

    first: int
    rows: tuple[int, ...]
    meta: StepMeta
    leaves: dict[int, dict[str, Tensor]]
    losses: list[Tensor]
    outputs: list[TensorOrTensors]


class _StreamRun(_StepRun):
    """One worker's part of a stream: its stages' actions in their order, until the stream ends."""

    def __init__(self, pipe_id: str, worker_index: int, plan: StreamPlan, loss_fn: Callable[..., Tensor] | None
                 ) -> None:
        self.stream = plan
        name = rpc.get_worker_info().name
        mine = [j for j, w in enumerate(plan.workers) if w == name]
        meta = StepMeta(step=plan.step, chunks=plan.chunks, checkpoint_stop=0, grad_enabled=not plan.forward_only,
                        driver=plan.driver, timeout=plan.timeout)  # (each batch runs under one of its own)
        self._hold(pipe_id, plan.as_step(), mine, meta, loss_fn)
        self.batch: dict[int, _Batch] = {}
        self.where: dict[int, tuple[int, int]] = {}  # g -> (t, i)
        self.next_first = 0
        self.announced: dict[int, int | None] = {}
        self.versions = {j: StageWeights(self.servers[j].stage.module, stash=plan.schedule != "PipeMare")
                         for j in mine} if not plan.forward_only else {}
        self.undo: dict[int, deque[_Undo]] = {j: deque(maxlen=plan.undo_depth) for j in self.versions}
        for j in mine:
            _undo.pop((pipe_id, j), None)  # an earlier stream's, never rolled back
        self.forwarded = -1  # the last batch whose first forward ran here
        correcting = plan.pipemare is not None and plan.pipemare.discrepancy_correction
        self.forward_updates: dict[int, int] | None = {} if correcting else None  # g -> updates at its forward
        self.velocity = {j: {name: torch.zeros_like(p) for name, p in v.params.items()}
                         for j, v in self.versions.items()} if correcting else {}  # PipeMare's T2, per stage
        self.action: Action | None = None

    # -- the order ---------------------------------------------------------------------------------
    def _orders(self) -> Iterator[Action]:
        """This worker's actions: its one stage's continuous order when training; when forward only,
        every micro-batch through each of its stages in stage order (which cannot deadlock: a stage
        waits only for earlier stages' forwards of micro-batches this worker already passed)."""
        if not self.stream.forward_only:
            (j,) = self.servers
            yield from stream_order(self.stream.schedule, self.stream.stages, j, self._chunks_of,
                                    chunks=self.stream.chunks, vertical_sync=self.stream.vertical_sync)
            return
        t = 0
        while (m := self._chunks_of(t)) is not None:
            for i in range(m):
                for j in self.servers:
                    yield Action("F", i, j, t)
            t += 1

    def _chunks_of(self, t: int) -> int | None:
        """Batch t's micro-batch count, or None when the stream ends before it: waits for the driver to
        say which (for as long as the caller's loop takes to pull the next batch)."""
        if t in self.announced:
            return self.announced[t]
        end = None
        while True:
            key = self.box.first_of(self.plan.step, [("batch", t)] if end is not None else [("batch", t), ("end",)])
            if key == ("end",):
                payload, _ = self.box.take(self.plan.step, key, self.plan.timeout, lambda: "the end")
                _, (end,) = cast(tuple[None, tuple[int]], payload)
                if t >= end:
                    self.announced[t] = None
                    return None
                continue
            payload, _ = self.box.take(self.plan.step, key, self.plan.timeout, lambda: "a batch")
            value, (rows, target) = cast(tuple[Any, tuple[tuple[int, ...], Any]], payload)
            self._announce(t, rows, value, target)
            return len(rows)

    def _announce(self, t: int, rows: tuple[int, ...], value: TensorOrTensors | None,
                  target: TensorOrTensors | None) -> None:
        m = len(rows)
        first = self.next_first
        self.next_first += m
        training = self.stream.training and not self.stream.forward_only
        meta = StepMeta(step=t, chunks=m, checkpoint_stop=checkpoint_stop(self.stream.checkpoint, m, enabled=training),
                        grad_enabled=not self.stream.forward_only, driver=self.stream.driver,
                        timeout=self.stream.timeout, spread=self.stream.spread, autocast=self.stream.autocast)
        self.batch[t] = _Batch(first, rows, meta, {}, [], [])
        for i in range(m):
            self.where[first + i] = (t, i)
        for i, share in enumerate(weights(rows)):
            self.weights[first + i] = share
        if value is not None:
            srv = self.servers[0]
            with srv.stream.running():
                for i, part in enumerate(_split_on(srv, value, m)):
                    self.batches[first + i] = microbatch.apply(_own_storage, part)
        if target is not None:
            srv = self.servers[self.stream.stages - 1]
            with srv.stream.running():
                for i, part in enumerate(_split_on(srv, target, m)):
                    self.targets[first + i] = part
        self.announced[t] = m

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> StreamReport:
        failure = None
        try:
            for self.action in self._orders():
                a = self.action
                with self.servers[a.j].stream.running():
                    if a.kind == "U":
                        self._update(a.j, a.t)
                        continue
                    g = self.batch[a.t].first + a.i
                    if a.kind == "F":
                        self._forward(a.j, g)
                    else:
                        self._backward(a.j, g)
                        self.where.pop(g)
                        self.weights.pop(g)
                if len(self.sent) > 64:  # a stream is long: keep only the sends still going
                    self.sent = [f for f in self.sent if not f.done()]
            self.action = None
            for sent in self.sent:
                sent.wait()
            self.box.check(self.plan.step)
        except BaseException as exc:
            failure = self._failure(exc, self.action)
        finally:
            self.kept.clear()
            self.batch.clear()
        updates = {j: v.updates for j, v in self.versions.items()}
        self.versions.clear()
        if failure is not None and self.stream.optimizer is not None:
            for j, records in self.undo.items():
                _undo[(self.pipe_id, j)] = (self.stream.optimizer, records)
        return StreamReport(failure=failure, updates=updates)

    def _failure(self, exc: BaseException, action: Action | None) -> Failure:
        """As a step's, with the micro-batch numbered within its batch and the batch named in the phase."""
        local = None if action is None or action.kind == "U" else Action(action.kind, action.i, action.j)
        failure = super()._failure(exc, local)
        if action is not None and action.kind == "U":
            return replace(failure, stage=action.j, phase=f"optimizer step after batch {action.t}")
        if action is not None and not failure.cancelled:
            return replace(failure, phase=f"{failure.phase} of batch {action.t}")
        return failure

    def _run_stage(self, j: int, g: int, value: TensorOrTensors, received: dict[SkipKey, Tensor | None]
                   ) -> StageOutput:
        t, i = self.where[g]
        batch = self.batch[t]
        params = None
        if not self.stream.forward_only:
            if i == 0:
                batch.leaves[j] = self._leaves(j, t)
            params = batch.leaves[j]
            if self.forward_updates is not None:
                self.forward_updates[g] = self.versions[j].updates
        return self.servers[j].stage.run(batch.meta, i, value, (), received, params=params)

    def _backward(self, j: int, g: int, split: bool = False) -> None:
        """As a step's; with PipeMare's discrepancy correction, on the weights predicted for the forward:
        W - delta * v (``PipeMareOptions``), written into the live storage the batch's leaves alias, and
        the current weights put back after."""
        if self.forward_updates is None:
            return super()._backward(j, g, split)
        params = self.versions[j].params
        delta = self.versions[j].updates - self.forward_updates.pop(g)
        if not delta:
            return super()._backward(j, g, split)
        current = {name: p.data.clone() for name, p in params.items()}
        for name, p in params.items():
            p.data.sub_(self.velocity[j][name], alpha=delta)
        try:
            super()._backward(j, g, split)
        finally:
            for name, p in params.items():
                p.data.copy_(current[name])

    def _leaves(self, j: int, t: int) -> dict[str, Tensor]:
        """The leaves batch t runs on at stage j: the version its rule gives (PipeMare: the live weights,
        which later updates change in place)."""
        versions = self.versions[j]
        s = self.stream
        if s.schedule == "PipeMare":
            return versions.leaves(versions.updates)
        version = weight_version(s.schedule, t, j, s.stages, s.chunks, vertical_sync=s.vertical_sync)
        versions.forget_below(version)  # versions are monotone in t: older ones serve no later batch
        self.forwarded = t
        return versions.leaves(version)

    def _loss(self, g: int, output: TensorOrTensors) -> Tensor:
        t, i = self.where[g]
        batch = self.batch[t]
        if self.stream.forward_only:
            batch.outputs.append(output)
            if len(batch.outputs) == len(batch.rows):
                last = self.servers[self.stream.stages - 1]  # the driver takes CPU tensors (no device maps)
                self._deliver(t, last._outbound(microbatch.gather(batch.outputs), None))
            return None  # type: ignore[return-value]  # (nothing to backpropagate)
        loss = super()._loss(g, output)
        self.targets.pop(g)
        batch.losses.append(self.losses.pop())
        if len(batch.losses) == len(batch.rows):
            self._deliver(t, torch.stack(batch.losses).cpu())
        return loss

    def _forward(self, j: int, g: int) -> None:
        super()._forward(j, g)
        if self.stream.forward_only and j == max(self.servers):  # nothing to keep for a backward
            for stage in self.servers:
                self.kept.pop((stage, g), None)
            t, i = self.where.pop(g)
            self.weights.pop(g)
            if i == len(self.batch[t].rows) - 1:
                del self.batch[t]

    def _update(self, j: int, t: int) -> None:
        """U(t): stage j applies batch t's gradient (summed in its leaves) with its own optimizer."""
        batch = self.batch.pop(t)
        leaves = batch.leaves.pop(j)
        s = self.stream
        opt_id = s.optimizer
        assert opt_id is not None
        optimizer = stage_optim.optimizer(self.pipe_id, opt_id, j)
        versions = self.versions[j]
        keep = False  # whether the next batch to enter runs on the weights as they are before this update
        if s.schedule != "PipeMare":  # no later forward needs an older version than the next batch's
            needed = weight_version(s.schedule, self.forwarded + 1, j, s.stages, s.chunks, vertical_sync=s.vertical_sync)
            versions.forget_below(needed)
            keep = needed <= versions.updates

        schedulers = [] if s.scheduler is None else [stage_optim.scheduler(self.pipe_id, opt_id, j, s.scheduler)]
        factor = 1.0 if s.pipemare is None else s.pipemare.lr_factor(j, versions.updates, s.stages, s.chunks)
        states: list[Any] = []

        def step() -> None:
            with stage_optim.lock(self.pipe_id, opt_id):
                if s.undo_depth:  # (the copies cost a stage's optimizer state per update)
                    states[:] = [copy.deepcopy(optimizer.state_dict()),
                                 [(x, copy.deepcopy(x.state_dict())) for x in schedulers]]
                lrs = [group["lr"] for group in optimizer.param_groups]
                for group in optimizer.param_groups:  # PipeMare's rescheduling (T1): this update only
                    group["lr"] = group["lr"] * factor
                try:
                    optimizer.step()
                finally:
                    for group, lr in zip(optimizer.param_groups, lrs):
                        group["lr"] = lr
                for scheduler in schedulers:
                    scheduler.step()

        before = versions.update(leaves, step, keep=keep, record=bool(s.undo_depth) or j in self.velocity)
        if s.undo_depth:
            self.undo[j].append(_Undo(versions.updates - 1, before, *states))
        if j in self.velocity:  # PipeMare's T2: the moving average of this stage's updates
            assert s.pipemare is not None
            decay = s.pipemare.ema_decay(j, s.stages, s.chunks)
            for name, p in versions.params.items():
                self.velocity[j][name].mul_(decay).add_(p.data - before[name], alpha=1 - decay)

    def _deliver(self, t: int, value: Any) -> None:
        """Batch t's losses or output to the driver, as soon as the last stage has them all."""
        future = rpc.rpc_async(self.stream.driver, self.stream.deliver, args=(self.pipe_id, self.plan.step, t, value),
                               timeout=self.plan.timeout)
        step, box, stage, worker = self.plan.step, self.box, self.stream.stages - 1, self.stream.driver

        def check(done: Future[Any]) -> None:
            try:
                done.wait()
            except Exception as exc:
                box.abort(step, Failure.capture(exc, stage=stage, worker=worker, microbatch=None, transport=True,
                                                phase=f"sending batch {t}'s result to the driver"))

        future.add_done_callback(check)
        self.sent.append(future)


# -- RPC entry points (run on the stage's worker) ----------------------------------------------------
def feed(pipe_id: str, step: int, t: int, rows: tuple[int, ...], value: TensorOrTensors | None,
         target: TensorOrTensors | None) -> None:
    """Batch t of stream ``step``: its rows for every worker, the input for the first stage's, the target
    for the last stage's; filed for the stream's thread, never waits."""
    _mailbox(pipe_id).put(step, ("batch", t), cast(Payload, (value, (rows, target))))


def roll_back(pipe_id: str, j: int, updates: int) -> str | None:
    """After a failed stream: stage j's weights, optimizer state and LR schedulers back to where they
    were after ``updates`` updates; None, or why that cannot be done."""
    kept = _undo.pop((pipe_id, j), None)
    if kept is None:
        return "it kept no record of its updates"
    optimizer_id, records = kept
    record = next((r for r in records if r.updates == updates), None)
    if record is None:
        return f"it can undo only its last {len(records)} update(s)"
    for name, p in server._server(pipe_id, j).stage.module.named_parameters():
        p.data = record.weights[name]
    with stage_optim.lock(pipe_id, optimizer_id):
        stage_optim.optimizer(pipe_id, optimizer_id, j).load_state_dict(record.optimizer)
        for scheduler, state in record.schedulers:
            scheduler.load_state_dict(state)
    return None


def end(pipe_id: str, step: int, batches: int) -> None:
    """Stream ``step`` has ``batches`` batches in all: the workers finish those and stop."""
    _mailbox(pipe_id).put(step, ("end",), cast(Payload, (None, (batches,))))


@rpc.functions.async_execution
def run_stream(pipe_id: str, worker_index: int, plan: StreamPlan, loss_fn: bytes | None) -> Future[StreamReport]:
    """Run this worker's part of a stream on a thread of its own; resolves to its report when it ends."""
    done: Future[StreamReport] = Future()

    def work() -> None:
        try:
            fn = None if loss_fn is None else cloudpickle.loads(loss_fn)
            report = _StreamRun(pipe_id, worker_index, plan, fn).run()
        except BaseException as exc:  # the stage is gone, or the loss function does not unpickle here
            name = rpc.get_worker_info().name
            j = next((j for j in range(plan.stages) if plan.workers[j] == name), 0)
            report = StreamReport(failure=Failure.capture(exc, stage=j, worker=name, microbatch=None, phase="stream"))
        done.set_result(report)

    threading.Thread(target=work, name=f"rrefpipe-stream-{plan.step}", daemon=True).start()
    return done
