"""The execution record: what each stage ran (forward, recompute, backward of micro-batch i) and when."""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

__all__ = ["Event", "format_events"]

#: Kinds of work a stage records. "allreduce": averaging its gradients with the other replicas (data
#: parallel) at the end of a ``train_step``, once per worker and step, micro-batch -1. Under a schedule
#: that splits backward (``rrefpipe.schedule.is_split``), "backward" is its first half (the inputs'
#: gradients, I) and "weight" the second (the parameters', W).
KINDS = ("forward", "recompute", "backward", "weight", "allreduce")


@dataclass(frozen=True, slots=True)
class Event:
    """One span of work on one stage. Times are ``time.time()`` seconds, comparable across local processes."""

    stage: int
    worker: str
    kind: str
    step: int
    microbatch: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


#: Events a stage keeps (the most recent ones): about 1,300 micro-batches of forward, recompute and
#: backward, ~0.7 MiB. Enough for the timeline of recent steps; a long run's memory stays flat.
CAPACITY = 4096


class Recorder:
    """A bounded, thread-safe log of the most recent :class:`Event` of one stage."""

    def __init__(self, stage: int, worker: str, capacity: int = CAPACITY) -> None:
        self.stage = stage
        self.worker = worker
        self._events: deque[Event] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def add(self, kind: str, step: int, microbatch: int, start: float, end: float) -> None:
        event = Event(self.stage, self.worker, kind, step, microbatch, start, end)
        with self._lock:
            self._events.append(event)

    def snapshot(self, clear: bool = False) -> list[Event]:
        with self._lock:
            events = list(self._events)
            if clear:
                self._events.clear()
        return events


def format_events(events: list[Event]) -> str:
    """A plain-text table of events, times relative to the first start."""
    if not events:
        return "(no events)"
    t0 = min(e.start for e in events)
    lines = [f"{'stage':>5} {'worker':<12} {'kind':<9} {'step':>4} {'mb':>3} {'start ms':>9} {'end ms':>9}"]
    for e in sorted(events, key=lambda e: (e.start, e.stage)):
        lines.append(
            f"{e.stage:>5} {e.worker:<12} {e.kind:<9} {e.step:>4} {e.microbatch:>3} "
            f"{(e.start - t0) * 1e3:>9.2f} {(e.end - t0) * 1e3:>9.2f}"
        )
    return "\n".join(lines)
