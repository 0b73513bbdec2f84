"""The driver side of a continuous pipeline (``Pipe.train_stream`` under an asynchronous rule, and
``Pipe.stream``): feed batches ahead, yield each batch's result in order, stop cleanly.

One message to each worker starts its long-lived run (:mod:`rrefpipe.stage_side.streamed`); then each batch is
announced to every worker (the input to the first stage's, the target to the last stage's) as the
caller's iterable gives it, at most ``in_flight`` batches ahead of the results yielded, and the last
stage sends each batch's losses or output back here (:func:`deliver`). When the iterable ends (or
the caller leaves the loop) every worker is told how many batches there were; it finishes those and
its run ends, so that the weights are those after every fed batch's update.

A failure anywhere calls the stream off on every worker, as a failed step is (:mod:`rrefpipe.driver_side.training`).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.futures import Future

from .. import _rpc, autocast, microbatch, replicas
from ..stage_side import streamed
from ..captured import StructuredLoss
from .remote import _pickled_loss, _send_copy
from .local import LocalDriver
from .diagnosis import first_cause
from ..errors import Failure, ReplicasDropped, StageReplaced
from ..loss import mean_loss, split_target
from ..microbatch import TensorOrTensors
from ..schedule import PipeMareOptions, is_async
from ..stage_side.streamed import StreamPlan, StreamReport
from .training import ABORT_WAIT, _explained, call_off

__all__: list[str] = []


@dataclass
class _Inbox:
    """Results of one stream, filled in by :func:`deliver` and by the workers' reports."""

    results: dict[int, Any] = field(default_factory=dict)
    reports: dict[int, StreamReport] = field(default_factory=dict)  # by worker index, when its run ends
    cond: threading.Condition = field(default_factory=threading.Condition)

    def failures(self) -> list[Failure]:
        return [r.failure for r in self.reports.values() if r.failure is not None]


_inboxes: dict[tuple[str, int], _Inbox] = {}


def deliver(pipe_id: str, step: int, t: int, value: Any) -> None:
    """Called (over RPC, by the last stage) with batch t's losses or output."""
    inbox = _inboxes.get((pipe_id, step))
    if inbox is not None:
        with inbox.cond:
            inbox.results[t] = value
            inbox.cond.notify_all()


@dataclass(frozen=True)
class StreamRequest:
    """What a caller asks of a stream: training (a loss function and the pipe optimizer's id) or
    forward only, and how many batches may be fed ahead of the results."""

    in_flight: int
    loss_fn: bytes | None = None  # None: forward only
    optimizer: int | None = None
    scheduler: int | None = None
    vertical_sync: bool = False
    pipemare: PipeMareOptions | None = None
    undo_depth: int = 0  # updates each stage can undo after a failure (0: no rollback)


def run(driver: Any, batches: Iterable[Any], request: StreamRequest, *, training: bool, spread: bool,
        prepare: Any) -> Iterator[Any]:
    """Stream ``batches`` through ``driver``'s stages; yields each batch's mean loss (training) or
    output, in order. ``prepare(item)`` turns an item of ``batches`` into ``(input, target)`` (target
    None when forward only); its TypeError or ValueError is raised naming the item's position."""
    driver._check_open()
    n = len(driver.infos)
    workers = list(driver.workers)
    forward_only = request.loss_fn is None
    with driver._lock:
        step = next(driver._steps)
    plan = StreamPlan(
        step=step, schedule=driver.schedule, stages=n, chunks=driver.chunks, checkpoint=driver.checkpoint,
        workers=tuple(workers), skip_sources={key: j for j, info in enumerate(driver.infos) for key in info.stashes},
        driver=_rpc.self_name(), deliver=deliver, timeout=driver.rpc_timeout, forward_only=forward_only,
        training=training, vertical_sync=request.vertical_sync, optimizer=request.optimizer,
        scheduler=request.scheduler, spread=spread, autocast=autocast.capture(),
        undo_depth=request.undo_depth,
        pipemare=request.pipemare)
    inbox = _inboxes[(driver.pipe_id, step)] = _Inbox()
    driver.streaming = True
    first, last = workers[0], workers[n - 1]
    distinct = list(dict.fromkeys(workers))
    fed = yielded = 0
    rows_of: dict[int, tuple[int, ...]] = {}
    ended = False
    try:
        _start(driver.pipe_id, distinct, plan, request, last, inbox)
        source = iter(batches)
        while True:
            while not ended and fed - yielded < request.in_flight and not inbox.failures():
                try:
                    item = next(source)
                except StopIteration:
                    ended = True
                    break
                try:
                    value, target = prepare(item)
                    rows_of[fed] = _rows(value, target, driver.chunks, forward_only)
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"item {fed} of the stream: {exc}") from exc
                value = microbatch.apply(_send_copy, value)
                target = None if target is None else microbatch.apply(_send_copy, target)
                for worker in distinct:
                    rpc.rpc_async(worker, streamed.feed, timeout=driver.rpc_timeout, args=(
                        driver.pipe_id, step, fed, rows_of[fed], value if worker == first else None,
                        target if worker == last else None))
                fed += 1
            if ended and yielded == fed:
                break
            result = _next_result(inbox, yielded, driver.rpc_timeout, distinct)
            if result is None:  # a worker failed
                break
            yield result if forward_only else mean_loss(result, rows_of.pop(yielded))
            yielded += 1
        _finish(driver, inbox, step, fed, distinct)
        _raise_failure(driver, inbox, step, distinct, rollback=request.undo_depth > 0)
    except BaseException:
        # The caller left the loop (GeneratorExit), the iterable or an item failed, or the wait did: what
        # was fed is finished and applied, so that every stage ends on the same update.
        if len(inbox.reports) < len(distinct) and not inbox.failures():
            _finish(driver, inbox, step, fed, distinct)
        raise
    finally:
        _inboxes.pop((driver.pipe_id, step), None)
        driver.streaming = False


def _finish(driver: Any, inbox: _Inbox, step: int, batches: int, workers: list[str]) -> None:
    """Tell every worker the stream has ``batches`` batches and wait until their runs end; a run that
    has not ended within the RPC timeout is called off."""
    if inbox.failures():
        return
    _end(driver.pipe_id, workers, step, batches, driver.rpc_timeout)
    with inbox.cond:
        done = inbox.cond.wait_for(lambda: len(inbox.reports) == len(workers) or bool(inbox.failures()),
                                   timeout=driver.rpc_timeout)
    if not done:
        late = [w for i, w in enumerate(workers) if i not in inbox.reports]
        call_off(driver.pipe_id, step, late)  # none keeps running
        with inbox.cond:
            for i, worker in enumerate(workers):
                inbox.reports.setdefault(i, StreamReport(failure=Failure(
                    driver.workers.index(worker), worker, None, "stream", "TimeoutError",
                    f"its run did not end within {driver.rpc_timeout:g} s of the stream's end (workers still "
                    f"running: {late})", "", transport=True)))


def _start(pipe_id: str, workers: list[str], plan: StreamPlan, request: StreamRequest, last: str,
           inbox: _Inbox) -> None:
    """Each worker's run; its report lands in the inbox when the run ends (no timeout: a stream lasts as
    long as its caller feeds it; a dead worker still ends the call)."""
    for w, worker in enumerate(workers):
        def record(done: Future[StreamReport], w: int = w, worker: str = worker) -> None:
            try:
                report = done.wait()
            except Exception as exc:
                report = StreamReport(failure=Failure.capture(exc, stage=plan.workers.index(worker), worker=worker,
                                                            microbatch=None, phase="stream", transport=True))
            with inbox.cond:
                inbox.reports[w] = report
                inbox.cond.notify_all()

        loss_fn = request.loss_fn if worker == last else None
        rpc.rpc_async(worker, streamed.run_stream, args=(pipe_id, w, plan, loss_fn), timeout=0).add_done_callback(record)


def _rows(value: TensorOrTensors, target: TensorOrTensors | None, chunks: int, forward_only: bool
          ) -> tuple[int, ...]:
    if forward_only:
        return microbatch.rows(microbatch.scatter(value, chunks))
    assert target is not None
    return split_target(value, target, chunks)


def _next_result(inbox: _Inbox, t: int, timeout: float, workers: list[str]) -> Any:
    """Batch t's result, or None once a worker's run has failed. Waits at most ``timeout`` seconds
    without news from the stream."""
    deadline = time.monotonic() + timeout
    with inbox.cond:
        while t not in inbox.results:
            if inbox.failures() or len(inbox.reports) == len(workers):
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"RPC ran for more than set timeout ({timeout:g} s) waiting for batch {t}'s result "
                                   "from the last stage")
            inbox.cond.wait(min(left, 1.0))
        return inbox.results.pop(t)


def _end(pipe_id: str, workers: list[str], step: int, batches: int, timeout: float) -> None:
    for worker in workers:
        try:
            rpc.rpc_async(worker, streamed.end, args=(pipe_id, step, batches), timeout=timeout)
        except Exception:
            pass  # a worker known to be gone: its run's report says so


def _raise_failure(driver: Any, inbox: _Inbox, step: int, workers: list[str], rollback: bool) -> None:
    """If a worker's run failed: call the others off, wait for them briefly, roll every stage back to
    the last update all of them applied, and raise the first cause, saying which weights are left."""
    if not inbox.failures():
        return
    call_off(driver.pipe_id, step, workers)
    with inbox.cond:
        inbox.cond.wait_for(lambda: len(inbox.reports) == len(workers), timeout=ABORT_WAIT)
        failures = inbox.failures()
        updates = {j: u for report in inbox.reports.values() for j, u in report.updates.items()}
    error = _explained(first_cause(failures), driver.workers)
    if updates:
        note = _rolled_back(driver, updates, rollback)
        if hasattr(error, "add_note"):  # (Python 3.11+; shown under the message)
            error.add_note(note)
        else:
            error.args = (f"{error.args[0]}\n{note}", *error.args[1:])
    raise error


def _rolled_back(driver: Any, updates: dict[int, int], rollback: bool) -> str:
    """Roll every stage back to the fewest updates any stage applied; what the weights are now."""
    n = len(driver.infos)
    missing = [j for j in range(n) if j not in updates]
    if not rollback:
        return f"The stages were not rolled back (rollback=False): they applied {updates} updates (by stage)."
    if missing:
        return (f"The stages' updates were not rolled back: stage(s) {missing} did not report (their worker is "
                f"gone); the others applied {updates} updates. Rebuild the pipe and load a checkpoint.")
    applied = min(updates.values())
    problems = []
    for j, u in updates.items():
        if u > applied:
            try:
                why = rpc.rpc_sync(driver.workers[j], streamed.roll_back, args=(driver.pipe_id, j, applied),
                                   timeout=driver.rpc_timeout)
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
            if why is not None:
                problems.append(f"stage {j} ({u} updates) could not be rolled back: {why}")
    if problems:
        return "; ".join(problems) + f". The other stages hold the weights after {applied} updates."
    return (f"Every stage now holds the weights (and optimizer state) after {applied} update(s), those of "
            f"batches 0-{applied - 1}: the last update every stage had applied." if applied else
            "Every stage holds its initial weights: no update had been applied everywhere.")



def default_in_flight(stages: int, chunks: int) -> int:
    """Batches fed ahead of the results yielded: when the first stage finishes batch t's forwards it
    needs batch t + 1, and by then the results up to t - ceil((n - 1) / m) can be back; one more
    covers the round trip."""
    return -(-(stages - 1) // chunks) + 2


def undo_depth(stages: int, chunks: int) -> int:
    """Updates each stage keeps the means to undo: when a stream is called off, the last stage is at
    most ceil(n / m) updates ahead of the first (stage 0 holds at most n micro-batches between its
    forward and its backward, and every micro-batch the last stage finished went through it)."""
    return -(-stages // chunks) + 1


def train_stream(pipe: Any, batches: Iterable[Any], loss_fn: Any, optimizer: Any, lr_scheduler: Any = None,
                 pipemare: PipeMareOptions | None = None, rollback: bool = True) -> Iterator[Tensor]:
    """``Pipe.train_stream``: a loop of train steps under a synchronous schedule, a continuous pipeline
    under an asynchronous one."""
    from .pipe_optimizer import PipeOptimizer  # (driver side, as this module)

    if pipemare is not None and (pipe.schedule != "PipeMare" or not isinstance(pipemare, PipeMareOptions)):
        raise ValueError(f"pipemare= takes rrefpipe.PipeMareOptions, for schedule='PipeMare' only (this pipe's is "
                         f"{pipe.schedule!r}), got {type(pipemare).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")
    if not is_async(pipe.schedule):
        if not callable(getattr(optimizer, "step", None)):
            raise TypeError(f"optimizer must have step(context_id) (pipe.optimizer(...) or a DistributedOptimizer), "
                            f"got {type(optimizer).__name__}")
        return _train_loop(pipe, batches, loss_fn, optimizer, lr_scheduler)
    if pipe._guard is not None:
        raise ValueError(f"spares recover synchronous schedules: under {pipe.schedule} each stage holds weight versions "
                         "of batches still in flight, which the snapshots (taken between updates) do not capture, so a "
                         "rebuilt pipeline could not go on exactly; use GPipe, 1F1B or an interleaved schedule with "
                         "spares, or no spares")
    if not isinstance(optimizer, PipeOptimizer):
        raise TypeError(f"train_stream under {pipe.schedule} steps the stages' optimizers inside the pipeline: pass "
                        f"the pipe's own, pipe.optimizer(torch.optim.SGD, lr=...), not a {type(optimizer).__name__}")
    driver = _remote(pipe, f"train_stream under {pipe.schedule}")
    if len(set(driver.workers)) < len(driver.workers):
        raise ValueError(f"{pipe.schedule} runs one stage per worker, and workers {driver.workers} hold several: name "
                         "a worker for each stage")
    scheduler = None
    if lr_scheduler is not None:
        scheduler = getattr(lr_scheduler, "stage_scheduler_id", lambda _: None)(optimizer)
        if scheduler is None:
            raise TypeError(f"under {pipe.schedule} each stage steps lr_scheduler after its own update: pass an "
                            "rrefpipe.optim.RemoteLRScheduler built on this optimizer, not a "
                            f"{type(lr_scheduler).__name__}")
    if replicas.current() is not None:
        raise ValueError(f"{pipe.schedule} with replicas is not supported: each replica would update its weights on "
                         "its own; train replicas with a synchronous schedule")
    if driver.tied:
        raise ValueError(f"{pipe.schedule}: this captured model has parameters tied across stages, whose copies would "
                         "be updated apart by each stage's own optimizer; train it with a synchronous schedule")
    if not torch.is_grad_enabled():
        raise RuntimeError("train_stream under torch.no_grad(): training needs gradients; for inference use "
                           "pipe.stream(inputs)")
    if pipe._captured is not None and not pipe._captured.outputs.plain:
        loss_fn = StructuredLoss(loss_fn, pipe._captured.outputs)
    n = len(driver.infos)
    request = StreamRequest(in_flight=default_in_flight(n, driver.chunks),
                            loss_fn=_pickled_loss(loss_fn), optimizer=optimizer.id,
                            scheduler=scheduler, vertical_sync=pipe.vertical_sync,
                            pipemare=pipemare, undo_depth=undo_depth(n, driver.chunks) if rollback else 0)
    return run(driver, batches, request, training=pipe.training, spread=pipe.call_style == "2.x",
               prepare=lambda item: _pair(pipe, item))


def _train_loop(pipe: Any, batches: Iterable[Any], loss_fn: Any, optimizer: Any, lr_scheduler: Any
                ) -> Iterator[Tensor]:
    """Under a synchronous schedule: ``train_step`` and ``optimizer.step`` per batch, exactly. With spares
    (``pipe._guard``), a step that a lost worker failed is recovered from and run again
    (:mod:`rrefpipe.driver_side.recovery`); with spares and replicas (``pipe._driver.peers``) the step is run
    again, or not where this replica's update came with the donor's state
    (:mod:`rrefpipe.driver_side.replica_spares`)."""
    from .pipe_optimizer import PipeOptimizer  # (driver side, as this module)

    guard = pipe._guard
    peers = getattr(pipe._driver, "peers", None)  # spares with replicas (driver_side.replica_spares)
    if (guard is not None or peers is not None) and not isinstance(optimizer, PipeOptimizer):
        raise TypeError("a pipe with spares recovers the optimizer with its stages: pass pipe.optimizer(...), not "
                        f"a {type(optimizer).__name__} (a DistributedOptimizer holds RRefs to the lost worker's "
                        "parameters)")
    if guard is not None:
        guard.start()

    def step(batch: tuple[Any, Any]) -> Tensor:
        updated = True
        while True:  # (at most once per replica dropped or stage worker replaced)
            try:
                with dist_autograd.context() as context_id:
                    loss = pipe.train_step(context_id, batch[0], batch[1], loss_fn)
                    optimizer.step(context_id)
                break
            except ReplicasDropped:  # lost replicas were dropped: the batch again, averaged over the live ones
                continue
            except StageReplaced as exc:  # a spare took a lost worker's place, the stages rebuilt from a replica
                if exc.again:
                    continue
                updated = False  # (this batch's update, and its scheduler's step, came with the donor's state)
                break
        if lr_scheduler is not None and updated:
            lr_scheduler.step()
        return loss

    def replay(batch: tuple[Any, Any]) -> None:
        step(batch)
        guard.applied(batch)

    for t, item in enumerate(batches):
        try:
            batch = _pair(pipe, item, captured=False)
        except TypeError as exc:
            raise TypeError(f"item {t} of the stream: {exc}") from exc
        if guard is None:
            yield step(batch)
            continue
        try:
            yield _guarded(guard, batch, step, replay)
        except BaseException:
            if guard.failed:
                pipe.close()  # workers were lost beyond recovery: its stages and spares are let go
            raise


def _guarded(guard: Any, batch: Any, step: Any, replay: Any) -> Tensor:
    """One update of a pipe with spares: run again after a recovery from a lost worker; then a snapshot if
    one is due (a recovery there restores the last one and replays, this batch included)."""
    while True:
        try:
            loss = step(batch)
            break
        except Exception as exc:
            guard.recover(exc, replay)
    guard.applied(batch)
    if guard.due():
        try:
            guard.snapshot()
        except Exception as exc:
            guard.recover(exc, replay, snapshotting=True)
    return loss


def stream(pipe: Any, inputs: Iterable[Any], in_flight: int | None) -> Iterator[Any]:
    """``Pipe.stream``: forward only, batch t + 1 entering before batch t has left."""
    if pipe.training and torch.is_grad_enabled():
        raise RuntimeError("pipe.stream runs forwards only: call it under torch.no_grad() or after pipe.eval() "
                           "(to train on a stream of batches, use pipe.train_stream)")
    if in_flight is not None and (not isinstance(in_flight, int) or isinstance(in_flight, bool) or in_flight < 1):
        raise ValueError(f"in_flight must be a positive number of batches, got {in_flight!r}")
    if isinstance(pipe._driver, LocalDriver) or not pipe._driver.infos:  # one process: nothing to overlap
        return (pipe(item).local_value() for item in inputs)
    driver = pipe._driver
    request = StreamRequest(in_flight=in_flight or default_in_flight(len(driver.infos), driver.chunks))
    results = run(driver, inputs, request, training=pipe.training, spread=pipe.call_style == "2.x",
                  prepare=lambda item: (_input(pipe, item), None))
    if pipe._captured is None or pipe._captured.outputs.plain:
        return results
    return (pipe._captured.outputs.rebuild(out) for out in results)


def _remote(pipe: Any, what: str) -> Any:
    if isinstance(pipe._driver, LocalDriver):
        raise ValueError(f"{what} needs stage workers: this pipe runs in one process (an RPC group of one), where "
                         "there is no pipeline to keep busy; use a synchronous schedule")
    return pipe._driver


def _input(pipe: Any, item: Any) -> TensorOrTensors:
    """An item of a stream as the pipe's stages take it (checked: CPU tensors)."""
    if pipe._captured is not None:
        item = pipe._captured.inputs(item if isinstance(item, tuple) else (item,))
    value, _ = microbatch.call_inputs((item,))
    microbatch.check(value, "the input")
    _check_cpu(value)
    return value


def _pair(pipe: Any, item: Any, captured: bool = True) -> tuple[Any, Any]:
    """An item of a training stream as ``(input, target)``."""
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise TypeError(f"expected a pair (input, target), got {type(item).__name__}")
    value, target = item
    if not captured:  # train_step checks and converts it
        return value, target
    value = _input(pipe, value)
    microbatch.check(target, "the target")
    _check_cpu(target)
    return value, target


def _check_cpu(value: Any) -> None:
    for tensor in microbatch.as_tensors(value):
        if tensor.device.type != "cpu":
            raise ValueError(f"got a tensor on {tensor.device}; stage workers receive batches from this process's "
                             "CPU memory: pass CPU tensors (the stages move them)")
