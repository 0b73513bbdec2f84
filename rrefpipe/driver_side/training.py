"""The driver side of ``Pipe.train_step``: one message to each worker starts its part of the step
(:mod:`rrefpipe.stage_side.scheduled`), and one reply from each says how it went; the last stage's worker sends
the micro-batch losses. A failure anywhere calls the step off on every worker, so that none waits
for a message that will not come, and the error names the stage, worker and micro-batch where it
happened."""
from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.futures import Future

from ..stage_side import scheduled
from . import diagnosis
from ..errors import Failure, StageError, WorkerError, timed_out
from ..microbatch import TensorOrTensors
from ..schedule import stage_layout
from ..stage_side.scheduled import StepPlan, StepReport

__all__: list[str] = []

ABORT_WAIT = 5.0  # seconds the other workers get to end a step called off, before the error is raised


def run(pipe_id: str, workers: Sequence[str], plan: StepPlan, value: TensorOrTensors, target: TensorOrTensors,
        loss_fn: bytes, timeout: float) -> Tensor:
    """Run ``plan`` on ``workers`` (worker w holds stages w, w + p, ...); the micro-batch losses.

    Must be called with the caller's autograd context current: each message carries a tensor that
    requires grad, so that the context reaches every worker, which installs its gradients there."""
    n = plan.stages
    last = stage_layout(plan.schedule, n, plan.stages_per_worker)[n - 1]
    anchor = torch.zeros((), requires_grad=True)
    calls: list[Future[StepReport] | Failure] = []
    for w, worker in enumerate(workers):
        args = (pipe_id, w, plan, value if w == 0 else None, target if w == last else None,
                loss_fn if w == last else None, anchor)
        try:
            calls.append(rpc.rpc_async(worker, scheduled.run_step, args=args, timeout=timeout))
        except Exception as exc:  # refused before it left (a worker known to be gone)
            calls.append(Failure.capture(exc, stage=w, worker=worker, microbatch=None, phase="train_step",
                                         transport=True))
    reports = _wait(calls, workers, pipe_id, plan.step)
    failures = [r.failure for r in reports if r.failure is not None]
    if failures:
        raise _explained(diagnosis.first_cause(failures), workers)
    losses = reports[last].losses
    assert losses is not None
    return losses


def _wait(calls: list[Future[StepReport] | Failure], workers: Sequence[str], pipe_id: str,
          step: int) -> list[StepReport]:
    """Every worker's report; once one has failed, the others are called off and get ``ABORT_WAIT``
    seconds to answer (a worker stuck in a layer may never), after which they count as cancelled."""
    reports: list[StepReport | None] = [StepReport(failure=c) if isinstance(c, Failure) else None for c in calls]
    changed = threading.Condition()

    def record(w: int, future: Future[StepReport]) -> None:
        try:
            report = future.wait()
        except Exception as exc:
            report = StepReport(failure=Failure.capture(exc, stage=w, worker=workers[w], microbatch=None,
                                                        phase="train_step", transport=True))
        with changed:
            reports[w] = report
            changed.notify_all()

    for w, call in enumerate(calls):
        if not isinstance(call, Failure):
            call.add_done_callback(lambda f, w=w: record(w, f))  # type: ignore[misc]
    with changed:  # (a Condition's wait, unlike a future's, lets Ctrl-C through)
        while not all(reports) and not _any_failed(reports):
            changed.wait()
    if all(reports):
        return reports  # type: ignore[return-value]
    call_off(pipe_id, step, workers)
    with changed:
        changed.wait_for(lambda: all(reports), timeout=ABORT_WAIT)
        return [r if r is not None else StepReport(failure=_cancelled(w, workers[w])) for w, r in enumerate(reports)]


def call_off(pipe_id: str, step: int, workers: Sequence[str]) -> None:
    """Tell each of ``workers`` (once each) to end step ``step`` of the pipe (a training step or a stream)
    at its next wait; a worker known to be gone is skipped."""
    for worker in dict.fromkeys(workers):
        try:
            rpc.rpc_async(worker, scheduled.abort, args=(pipe_id, step), timeout=ABORT_WAIT)
        except Exception:
            pass


def _any_failed(reports: list[StepReport | None]) -> bool:
    return any(r is not None and r.failure is not None for r in reports)


def _cancelled(w: int, worker: str) -> Failure:
    return Failure(w, worker, None, "train_step", "Cancelled", "did not answer after the step was called off", "",
                   cancelled=True)


def _explained(cause: StageError, workers: Sequence[str]) -> StageError:
    """A timeout is reported by whoever waited; ask which worker is hung or gone before blaming one."""
    if isinstance(cause, WorkerError) and timed_out(cause.error_message):
        busy = diagnosis.unresponsive(list(dict.fromkeys(workers)), "did not answer within 2 s, hung or still busy "
                                      "in its layers", phase="train_step")
        if busy is not None:
            busy.__cause__ = cause
            return busy
    return cause

