"""Why a step failed, said with the stage and worker: distributed autograd's and TensorPipe's error texts
read back, and the stage workers asked which of them is dead, hung or still busy.

Distributed autograd reports a failed backward as "Error on Node N: <text>", N being the process that
saw the error, and TensorPipe a lost peer as a bare "EOF" from whichever process noticed: neither
names a stage, and the process that noticed is often not the one at fault. These functions run on the
driver after a step failed, never on the way of a healthy one.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import torch.distributed.rpc as rpc

from .. import _rpc
from ..stage_side import control, server
from . import contexts
from ..errors import UNREACHABLE, Failure, StageError, is_transport_error, timed_out

__all__: list[str] = []

_NODE = re.compile(r"Error on Node (\d+): ")
_STAGE_MESSAGE = re.compile(r"stage \d+ on worker '[^']*'(?:, micro-batch (?P<i>\d+))? failed in (?P<phase>\w+): "
                            r"(?P<type>\w+): (?P<message>.*)", re.DOTALL)


def explain(exc: BaseException, phase: str, pipe_id: str, workers: Sequence[str],
            by_pipe: dict[str, contexts.Forwards] | None = None) -> BaseException:
    """Turn distributed autograd's "Error on Node N: ..." (or a bare transport error) into a
    StageError naming the stage of pipe ``pipe_id``, whose stages run on ``workers``.

    A transport error names the node that *saw* a peer vanish (the stage sending a gradient to a
    dead worker), so the stage workers are probed first and a dead one is named instead.
    ``by_pipe``: the forwards of every pipe in the failed backward's context, whose losses may all be
    in this backward: a node is looked up among this pipe's stages first, then theirs."""
    by_pipe = by_pipe or {}
    mine = by_pipe.get(pipe_id) or contexts.Forwards()
    text = str(exc)
    matches = list(_NODE.finditer(text))
    names = _rpc.worker_names()
    message = text[matches[-1].end():] if matches else text
    if not matches or is_transport_error(message):
        dead = unresponsive(workers, UNREACHABLE, phase, message)
        if dead is not None:
            return dead
        if timed_out(message):  # a backward hung in a layer leaves its worker's RPC thread free
            hung = longest_backward(pipe_id, workers, message)
            if hung is not None:
                return hung
            if mine.remote:
                return RuntimeError(
                    f"{text}\n(no stage is hung or unreachable, and {len(mine.steps)} forward(s) of this pipe "
                    f"ran in this context with their outputs left on the last worker (remote_output=True): "
                    "distributed autograd waits until the RPC timeout for the gradient of every forward in "
                    "the context, so each one's fetched output must be part of the loss. Run forwards you "
                    "do not backpropagate under torch.no_grad() or outside the context)")
    pipes = [(pipe_id, list(workers), mine.steps)] + [
        (other, record.workers, record.steps) for other, record in by_pipe.items() if other != pipe_id]
    for match in reversed(matches):
        node = int(match.group(1))
        worker = names[node] if node < len(names) else ""
        stages = [(pid, held.index(worker), steps) for pid, held, steps in pipes if worker in held]
        if not stages:
            continue
        for pid, j, steps in stages:
            try:
                recorded = rpc.rpc_sync(worker, control.backward_failure, args=(pid, j, steps), timeout=5)
            except Exception:
                recorded = None
            if recorded is not None:
                return recorded.to_exception()
        j = stages[0][1]
        where = _STAGE_MESSAGE.match(message)
        if where:
            return Failure(j, worker, int(where["i"]) if where["i"] else None, where["phase"],
                           where["type"], where["message"], text).to_exception()
        if len(stages) > 1:  # a layer's own error in backward is not recorded: its text names no stage
            listed = ", ".join(f"stage {index} of pipe {pid}" for pid, index, _ in stages)
            message += f" (worker {worker!r} holds {listed} in this backward; which one raised is not known)"
        return Failure(j, worker, None, phase, "Error", message, text,
                       transport=is_transport_error(message)).to_exception()
    return exc


def longest_backward(pipe_id: str, workers: Sequence[str], cause: str) -> StageError | None:
    """A WorkerError for the stage whose unfinished backward has run longest, or None."""
    running: list[tuple[float, int]] = []
    for j, worker in enumerate(workers):
        try:
            age = rpc.rpc_sync(worker, control.backward_running, args=(pipe_id, j), timeout=2)
        except Exception:
            continue
        if age is not None:
            running.append((age, j))
    if not running:
        return None
    age, j = max(running)
    return Failure(j, workers[j], None, "backward", "WorkerError",
                   f"its backward of a micro-batch has run for {age:.1f} s, past the RPC timeout: a layer's "
                   f"backward hung or is very slow ({cause})", cause, transport=True).to_exception()


def unresponsive(workers: Sequence[str], why: str, phase: str = "forward", cause: str = "") -> StageError | None:
    """A WorkerError for the first stage worker that does not answer a ping within 2 s (dead, or
    its one RPC thread stuck in a stage's layers), or None when all answer."""
    for j, worker in enumerate(workers):
        try:
            rpc.rpc_sync(worker, server._noop, timeout=2)
        except Exception as exc:
            detail = cause or str(exc)
            return Failure(j, worker, None, phase, "WorkerError", f"{why} ({detail})", detail,
                           transport=True).to_exception()
    return None


def first_cause(failures: list[Failure]) -> StageError:
    """The failure that caused the others: a real error before a cancellation; among those, a stage's
    own error before a transport failure, then the earliest micro-batch."""
    real = [f for f in failures if not f.cancelled] or failures
    return min(real, key=lambda f: (f.transport, f.microbatch or 0)).to_exception()
