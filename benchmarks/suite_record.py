"""Reading rrefpipe's execution record for idle gaps, serialisation and driver-side delays.

For every timed step the driver keeps wall-clock marks (``time.time``: step start, output received,
loss computed, ``pipe.backward`` returned, step end), comparable with the stages' spans (local
processes share the clock). Per step we compute, then report the median over the timed steps:

* ``lead_ms``: step start -> stage 0 starts micro-batch 0's forward (scatter + first RPC);
* ``fwd_tail_ms``: the last stage's last forward ends -> the driver has the gathered output;
* ``loss_ms``, ``opt_ms``: the driver's loss, and ``DistributedOptimizer.step``;
* ``bwd_lead_ms``: loss computed -> the last stage's first backward span starts;
* ``bwd_tail_ms``: the last backward span on any stage ends -> ``pipe.backward`` returns;
* ``fwd_handoff_ms``: median over stages j >= 1 and micro-batches i of F[j,i].start - max(F[j-1,i].end,
  F[j,i-1].end): the time from "input ready and stage free" to "stage starts" (one hop plus queueing);
* ``bwd_handoff_ms``: median of B[j,i].start - B[j+1,i].end (gradient hop to the previous stage);
* ``fwd_concurrency`` / ``bwd_concurrency``: sum over stages of the time covered by their forward
  (backward + recompute) spans, over the time covered by those spans on any stage. 1.0 means the
  stages never work on that phase at the same time (serialised); a balanced GPipe reaches
  n*m/(m+n-1);
* ``fwd_gap_ms``: per stage, the median gap between its consecutive forward spans;
* ``fwd_ms`` / ``bwd_ms``: per stage, the summed forward spans and the time covered by its backward
  (and recompute) spans; ``bench_suite`` divides them by m x the in-process micro-batch compute time
  (``fwd_inflation`` / ``bwd_inflation``: above 1 the stage computes slower on its worker than alone);
* ``cpu`` (``proc_delta``): per process and timed step, user and kernel CPU ms, minor page faults and
  the CPU ms of the transport threads (TensorPipe's or gloo's loops) (rrefpipe: the driver, then each
  stage worker; pipelining: each rank), from ``/proc``;
* ``busy``: per stage, the time covered by its spans over the step; ``max_gap_ms``: its largest idle
  gap between its first and its last span; ``bwd_overlap``: most backward spans open at once on one
  stage (several micro-batches' backward interleaved by the autograd engine).

Backward spans run from the arrival of the output gradient to the input gradients being computed,
so they include queueing behind other backward work on that worker.
"""
from __future__ import annotations

import os
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

Span = tuple[float, float]


def union(spans: Sequence[Span]) -> tuple[float, float]:
    """Seconds covered by ``spans``, and the largest gap between the first start and the last end."""
    covered, gap, reach = 0.0, 0.0, None
    for start, end in sorted(spans):
        if reach is not None and start > reach:
            gap = max(gap, start - reach)
        covered += max(0.0, end - max(start, reach if reach is not None else start))
        reach = end if reach is None else max(reach, end)
    return covered, gap


def max_open(spans: Sequence[Span]) -> int:
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda p: (p[0], p[1]))
    best = now = 0
    for _, delta in edges:
        now += delta
        best = max(best, now)
    return best


def _concurrency(per_stage: dict[int, list[Span]]) -> float | None:
    spans = [s for v in per_stage.values() for s in v]
    total = union(spans)[0]
    return sum(union(v)[0] for v in per_stage.values()) / total if total > 0 else None


def _handoffs(f: dict[tuple[int, int], Span], b: dict[tuple[int, int], Span],
              n: int) -> tuple[list[float], list[float]]:
    fwd = [f[j, i][0] - max(f[j - 1, i][1], f.get((j, i - 1), (0.0, 0.0))[1])
           for (j, i) in f if j >= 1 and (j - 1, i) in f]
    bwd = [b[j, i][0] - b[j + 1, i][1] for (j, i) in b if j < n - 1 and (j + 1, i) in b]
    return fwd, bwd


def _gap(f: dict[tuple[int, int], Span], j: int) -> float:
    """Median ms between stage ``j``'s consecutive forwards (stage 0: its inputs are all there, so this is
    the stage's own per-micro-batch work outside the forward span: bookkeeping, the push, the next job)."""
    gaps = [f[j, i][0] - f[j, i - 1][1] for (k, i) in f if k == j and (j, i - 1) in f]
    return 1e3 * statistics.median(gaps) if gaps else 0.0


def analyse_step(events: Sequence[Any], marks: dict[str, float], n: int) -> dict[str, Any]:
    f = {(e.stage, e.microbatch): (e.start, e.end) for e in events if e.kind == "forward"}
    b = {(e.stage, e.microbatch): (e.start, e.end) for e in events if e.kind == "backward"}
    by_stage: dict[int, list[Span]] = defaultdict(list)
    fwd_stage: dict[int, list[Span]] = defaultdict(list)
    bwd_stage: dict[int, list[Span]] = defaultdict(list)
    for e in events:
        by_stage[e.stage].append((e.start, e.end))
        (fwd_stage if e.kind == "forward" else bwd_stage)[e.stage].append((e.start, e.end))
    elapsed = marks["end"] - marks["start"]
    last_f = [s for (j, _), s in f.items() if j == n - 1]
    out: dict[str, Any] = {
        "lead_ms": 1e3 * (min(s[0] for (j, _), s in f.items() if j == 0) - marks["start"]),
        "fwd_tail_ms": 1e3 * (marks["forward"] - max(s[1] for s in last_f)),
        "loss_ms": 1e3 * (marks["loss"] - marks["forward"]),
        "opt_ms": 1e3 * (marks["end"] - marks["backward"]),
        "fwd_concurrency": _concurrency(fwd_stage), "bwd_concurrency": _concurrency(bwd_stage),
        "busy": [union(by_stage[j])[0] / elapsed for j in range(n)],
        "max_gap_ms": [1e3 * union(by_stage[j])[1] for j in range(n)],
        "bwd_overlap": [max_open([s for (j, _), s in b.items() if j == k]) for k in range(n)],
        "fwd_ms": [1e3 * sum(e - s for s, e in fwd_stage[j]) for j in range(n)],
        "bwd_ms": [1e3 * union(bwd_stage[j])[0] for j in range(n)],
        "fwd_gap_ms": [_gap(f, j) for j in range(n)],
    }
    last_b = [s for (j, _), s in b.items() if j == n - 1]
    if last_b:
        out["bwd_lead_ms"] = 1e3 * (min(s[0] for s in last_b) - marks["loss"])
        out["bwd_tail_ms"] = 1e3 * (marks["backward"] - max(s[1] for s in b.values()))
    fwd, bwd = _handoffs(f, b, n)
    out["fwd_handoff_ms"] = 1e3 * statistics.median(fwd) if fwd else None
    out["bwd_handoff_ms"] = 1e3 * statistics.median(bwd) if bwd else None
    return out


def _median(values: list[Any]) -> Any:
    if all(isinstance(v, list) for v in values):
        return [_median(list(col)) for col in zip(*values)]
    nums = [v for v in values if v is not None]
    return statistics.median(nums) if nums else None


def analyse_steps(events: Sequence[Any], steps: Sequence[dict[str, float]], n: int) -> dict[str, Any]:
    """Median of :func:`analyse_step` over the timed steps; ``events`` hold exactly those steps' spans."""
    by_step: dict[int, list[Any]] = defaultdict(list)
    for e in events:
        by_step[e.step].append(e)
    ids = sorted(by_step)[-len(steps):]
    per_step = [analyse_step(by_step[k], marks, n) for k, marks in zip(ids, steps[-len(ids):])]
    if not per_step:
        return {}
    out = {key: _median([p[key] for p in per_step if key in p]) for key in per_step[0]}
    last = by_step[ids[-1]]
    out["bwd_order_last_step"] = {j: [e.microbatch for e in sorted(last, key=lambda e: e.start)
                                      if e.stage == j and e.kind == "backward"] for j in range(n)}
    return out


# Threads that carry messages: TensorPipe's transport and channel loops (``TP_UV_loop``, ``TP_CMA_loop``,
# ...) and gloo's (``gloo_tcp_loop``, ``pt_gloo_runloop``). What they burn is per-message engine cost.
TRANSPORT_THREADS = ("TP_", "gloo", "pt_gloo")


def proc_stat(pid: int) -> list[float] | None:
    """CPU ms in user and kernel mode, minor page faults, and the CPU ms of the process's
    :data:`TRANSPORT_THREADS`, of process ``pid`` so far (Linux ``/proc``)."""
    stat = _read_stat(f"/proc/{pid}/stat")
    if stat is None:
        return None
    _, fields = stat
    tick = os.sysconf("SC_CLK_TCK")
    return [int(fields[11]) * 1e3 / tick, int(fields[12]) * 1e3 / tick, float(fields[7]),
            _transport_ticks(pid) * 1e3 / tick]


def _read_stat(path: str) -> tuple[str, list[str]] | None:
    """The name in a ``/proc`` ``stat`` file and the fields after it; None once the process or thread is gone."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    name, rest = text.split("(", 1)[1].rsplit(")", 1)
    return name, rest.split()


def _transport_ticks(pid: int) -> int:
    """Clock ticks (user + kernel) of the process's live :data:`TRANSPORT_THREADS`."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    stats = (_read_stat(f"/proc/{pid}/task/{tid}/stat") for tid in tids)
    return sum(int(fields[11]) + int(fields[12]) for name, fields in filter(None, stats)
               if name.startswith(TRANSPORT_THREADS))


def proc_delta(before: Sequence[list[float] | None], after: Sequence[list[float] | None],
               steps: int) -> dict[str, list[float]] | None:
    """Per process, per step: ``user_ms``, ``sys_ms``, ``minor_faults`` and ``transport_ms`` between
    two :func:`proc_stat` lists."""
    if not steps or any(b is None or a is None for b, a in zip(before, after)):
        return None
    keys = ("user_ms", "sys_ms", "minor_faults", "transport_ms")  # proc_stat's order
    rows = [[(a[k] - b[k]) / steps for k in range(len(keys))] for b, a in zip(before, after)]  # type: ignore[index]
    return {key: [r[k] for r in rows] for k, key in enumerate(keys)}
