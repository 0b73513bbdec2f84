"""Soak: 2,000 training steps on local stage workers; memory of every process and the step-time distribution.

Run ``python benchmarks/bench_soak.py`` (a few minutes on 2 cores; ``--steps`` to change). It prints two
tables and writes everything, the RSS series included, to ``benchmarks/results/soak.json``.

Workload: a 2-stage pipeline on ``workers.LocalWorkers(2)`` (this process drives), an MLP of
Linear(256, 512) + ReLU + Linear(512, 512) + ReLU + Linear(512, 10) split [3, 2], batch 64 in 4
micro-batches, checkpoint 'except_last', SGD (momentum) through ``DistributedOptimizer``; each step is
forward + cross-entropy + ``dist_autograd.backward`` + ``opt.step`` with a fresh batch, timed on the driver.

Memory: ``VmRSS`` from ``/proc/PID/status`` of the driver and of each worker, after step 1 ("start"),
after the warm-up (the first ``--warmup`` steps, default 10%: allocator pools, lazy imports and RPC
connections settle there) and after the last step ("end"), plus every ``--sample-every`` steps for the
series. ``warm`` and ``end`` are medians of three consecutive samples (a worker's RSS wanders by a few
MiB from sample to sample); ``growth`` is end minus warm; ``slope`` the least-squares slope of the samples
after the warm-up, in KiB per 1,000 steps. Growth up to ``--noise`` MiB (default 2) is reported as flat.

The execution record (every stage's forward/recompute/backward spans, kept on the workers until
``pipe.execution_record(clear=True)``) is left alone by default, as a user would; ``--clear-record N``
clears it every N steps, to tell its share of any growth apart.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import DistributedOptimizer

import workers
from rrefpipe import Pipe
from steps import train_step  # benchmarks/ is this script's directory

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "soak.json"
MIB = 1024 * 1024


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (``VmRSS`` in ``/proc/PID/status``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def slope_kib_per_1000(series: list[tuple[int, int]]) -> float:
    """Least-squares slope of (step, bytes) samples, in KiB per 1,000 steps."""
    if len(series) < 2:
        return 0.0
    xs, ys = [float(s) for s, _ in series], [float(b) for _, b in series]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx * 1000 / 1024


def bytes_per_event() -> float:
    """Python heap an execution-record event takes (measured here with tracemalloc, 10,000 events)."""
    import tracemalloc
    from collections import deque

    from rrefpipe.trace import Event

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = deque(Event(0, "worker1", "forward", 1000 + k // 11, k % 4, time.time(), time.time())
                     for k in range(10_000))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del kept
    return used / 10_000


def record_counts(pipe: Pipe, since_step: int) -> dict[str, dict[str, int]]:
    """Execution-record events each worker holds: all (``kept``) and those of steps ``since_step`` (1-based)
    onwards (``after_warmup``). Fetched once, at the end: fetching them earlier would itself grow the
    driver's heap inside the measured window."""
    counts: dict[str, dict[str, int]] = {"kept": {}, "after_warmup": {}}
    for event in pipe.execution_record():
        counts["kept"][event.worker] = counts["kept"].get(event.worker, 0) + 1
        if event.step + 1 >= since_step:  # the pipe numbers its steps from 0
            counts["after_warmup"][event.worker] = counts["after_warmup"].get(event.worker, 0) + 1
    return counts


def soak(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    data = torch.Generator().manual_seed(1)
    with workers.LocalWorkers(2, threads=1) as local:
        procs = {"driver": os.getpid(), **dict(zip(local.names, local.pids))}
        series: dict[str, list[tuple[int, int]]] = {name: [] for name in procs}
        marks: dict[str, dict[str, int]] = {}
        times: list[float] = []

        def sample(step: int) -> None:
            for name, pid in procs.items():
                series[name].append((step, rss_bytes(pid)))

        with Pipe(model, chunks=4, balance=[3, 2], workers=local.names) as pipe:
            opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.01, momentum=0.9)
            for step in range(1, args.steps + 1):
                x = torch.randn(64, 256, generator=data)
                y = torch.randint(0, 10, (64,), generator=data)
                seconds, loss = train_step(pipe, opt, x, y)
                times.append(seconds)
                if args.clear_record and step % args.clear_record == 0:
                    pipe.execution_record(clear=True)
                if step in (1, args.warmup, args.steps) or step % args.sample_every == 0:
                    sample(step)
                    if step in (1, args.warmup, args.steps):
                        mark = {1: "start", args.warmup: "warm", args.steps: "end"}[step]
                        marks[mark] = {name: s[-1][1] for name, s in series.items()}
                if step % max(1, args.steps // 10) == 0:
                    print(f"step {step:5d}  loss {loss:.4f}  "
                          f"median step {1e3 * statistics.median(times[-100:]):.2f} ms", flush=True)
            del opt
            events = record_counts(pipe, args.warmup + 1)
    return {"procs": procs, "series": series, "marks": marks, "step_s": times, "events": events,
            "final_loss": loss}


def memory_rows(run: dict[str, Any], args: argparse.Namespace, per_event: float) -> tuple[str, dict[str, Any]]:
    """Per process: RSS at the marks, growth after the warm-up, the execution record's share of it."""
    lines = [f"{'process':<9} {'pid':>7} {'start MiB':>10} {'warm MiB':>9} {'end MiB':>8} {'growth MiB':>11} "
             f"{'record MiB':>11} {'rest MiB':>9} {'slope KiB/1k':>13}  verdict"]
    summary: dict[str, Any] = {}
    for name, pid in run["procs"].items():
        after = [b for step, b in run["series"][name] if step >= args.warmup]
        m = {"start": run["marks"]["start"][name], "warm": int(statistics.median(after[:3])),
             "end": int(statistics.median(after[-3:]))}
        growth = (m["end"] - m["warm"]) / MIB
        added = run["events"]["after_warmup"].get(name, 0)
        record = max(0, added) * per_event / MIB if not args.clear_record else 0.0
        rest = growth - record
        slope = slope_kib_per_1000([s for s in run["series"][name] if s[0] >= args.warmup])
        verdict = ("flat (within noise)" if growth <= args.noise
                   else "grows by the execution record" if rest <= args.noise else "GROWS")
        summary[name] = {"pid": pid, **{f"{k}_bytes": v for k, v in m.items()}, "growth_mib": growth,
                         "record_events_added": added, "record_mib": record, "rest_mib": rest,
                         "slope_kib_per_1000_steps": slope, "verdict": verdict}
        lines.append(f"{name:<9} {pid:>7} {m['start'] / MIB:>10.1f} {m['warm'] / MIB:>9.1f} {m['end'] / MIB:>8.1f} "
                     f"{growth:>+11.2f} {record:>+11.2f} {rest:>+9.2f} {slope:>+13.1f}  {verdict}")
    return "\n".join(lines), summary


def timing_rows(times: list[float]) -> tuple[str, dict[str, float]]:
    ms = sorted(1e3 * t for t in times)
    stats = {"first_ms": 1e3 * times[0], "p50_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90),
             "p99_ms": percentile(ms, 99), "max_ms": ms[-1], "mean_ms": statistics.fmean(ms)}
    rest = sorted(1e3 * t for t in times[1:])
    stats.update({"max_after_first_ms": rest[-1] if rest else ms[-1]})
    head = (f"{'steps':>6} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} {'first ms':>9} "
            f"{'max after first':>16}")
    row = (f"{len(times):>6} {stats['p50_ms']:>8.2f} {stats['p90_ms']:>8.2f} {stats['p99_ms']:>8.2f} "
           f"{stats['max_ms']:>8.2f} {stats['first_ms']:>9.2f} {stats['max_after_first_ms']:>16.2f}")
    return head + "\n" + row, stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="training steps (default: 2000)")
    p.add_argument("--warmup", type=int, help="steps before the warm-up RSS sample (default: 10%% of --steps)")
    p.add_argument("--sample-every", type=int, default=100, help="RSS sample interval in steps (default: 100)")
    p.add_argument("--noise", type=float, default=2.0, help="growth in MiB still reported as flat (default: 2)")
    p.add_argument("--clear-record", type=int, default=0,
                   help="clear the execution record every N steps (default: never)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default: {DEFAULT_OUT})")
    args = p.parse_args()
    args.warmup = args.warmup or max(1, args.steps // 10)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    run = soak(args)
    wall = time.monotonic() - t0
    per_event = bytes_per_event()
    mem_table, mem = memory_rows(run, args, per_event)
    time_table, timing = timing_rows(run["step_s"])
    kept = sum(run["events"]["kept"].values())
    print(f"\nsoak: {args.steps} steps on 2 local stage workers in {wall:.0f}s, final loss {run['final_loss']:.4f}")
    print(f"execution record on the workers at the end: {kept} events, ~{per_event:.0f} B each "
          f"({'cleared every %d steps' % args.clear_record if args.clear_record else 'never cleared'})")
    print(f"\nRSS (VmRSS) per process: start = after step 1, warm = median of the 3 samples from step {args.warmup}, "
          f"end = median of the last 3 samples (every {args.sample_every} steps);\ngrowth = end - warm; record = "
          f"execution-record events the worker added after step {args.warmup} x {per_event:.0f} B; "
          "rest = growth - record")
    print(mem_table)
    print("\nstep time (forward + loss + backward + optimizer step), all steps")
    print(time_table)
    print(f"load average before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "steps": args.steps, "warmup": args.warmup, "noise_mib": args.noise, "clear_record_every": args.clear_record,
        "wall_s": wall, "memory": mem, "step_time": timing, "rss_series": run["series"],
        "step_ms_all": [1e3 * t for t in run["step_s"]], "record_events": run["events"], "bytes_per_event": per_event,
        "final_loss": run["final_loss"], "load_average": [load_before[0], os.getloadavg()[0]],
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "cpu_count": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M:%S %z")},
    }, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
