"""Issue #5's benchmark suite: rrefpipe against plain PyTorch, torch.distributed.pipelining and the ideal.

``python benchmarks/bench_suite.py`` (about 40 minutes on 2 CPU cores, estimated; 55 with ``--rounds 3``; ``--quick``: a
smoke run under 2 minutes) prints tables and a targets block, and writes ``benchmarks/results/suite.json`` and
``suite.png`` (``--out``). For each model (``--models``), stage count (``--stages``) and chunk count
(``--chunks``), in the same run, on the same model, mini-batch and layer split:

1. plain PyTorch in this process, 1 and 2 intra-op threads (measured before any worker starts);
2. torch.distributed.pipelining ``ScheduleGPipe`` and ``Schedule1F1B`` (1F1B needs chunks >= stages),
   one process per stage over gloo on 127.0.0.1 (``suite_pipelining``); and GPipe again on a second
   group of processes (``gpipe_control``), an A/A control: the two GPipe runs differ by the machine's
   noise (and their group and place in a round), so their ratio shows how far apart two equal
   contestants land in this run;
3. rrefpipe on ``workers.LocalWorkers`` (``suite_rrefpipe``), checkpoint 'never', 'except_last',
   'always', the driver also at 1 thread;
4. the ideal: GPipe efficiency m/(m+n-1) applied to the slowest stage's forward+backward, measured in
   this process with 1 thread at the full batch (``ideal``, plus the recomputed forwards of a
   checkpoint mode) and at the micro-batch size (``ideal@mb``), as in ``bench_core``; and the RPC
   floor, a raw ``rpc_sync`` of each micro-batch boundary tensor (``rpc/mb``). For the 2-stage MLP at
   m >= 8, each stage is also timed beside the other (``bench_contention``), for the targets'
   contended bubble model.

Every contestant's timed step includes the SGD optimizer step (``opt.step()`` on every stage for
pipelining, ``DistributedOptimizer.step`` for rrefpipe, ``opt.step()`` for plain). Steps are the
median of ``--repeats`` after ``--warmup`` untimed ones, pooled over ``--rounds`` rounds: for each chunk
count the contestants run back to back, round after round (order alternating), so a load change hits
them alike. Also: memory kept for backward per
stage and checkpoint mode (``rrefpipe.memory``), step time against chunks up to 256 on the MLP at a
fixed micro-batch size (``--scaling-micro-batch``), the stage-hop cost against raw rpc_sync
(``bench_core.bench_hops``), and the execution record of every rrefpipe configuration
(``suite_record``). Every stage process runs 1 intra-op thread. The load
average is recorded at the start and end of the run and of each section: other processes skew
everything on a 2-core machine. No number here is asserted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import cloudpickle
import torch

import suite_models
from bench_contention import measure as measure_contention
from bench_core import (SIZES, bench_hops, ideal_step_ms, loadavg, machine_info, single_process, stage_compute,
                        summary)
from suite_chart import write_chart
from suite_models import DEFAULT_MODELS, SPECS, ModelSpec, boundary_shapes
from suite_pipelining import SCHEDULES, PipeliningGroup
from suite_report import CHECKPOINTED, MODES, print_all
from suite_rrefpipe import memory_by_mode, rpc_floor, scaling, time_pipe
from suite_targets import evaluate, print_targets

cloudpickle.register_pickle_by_value(suite_models)  # stage workers get the model classes by value

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "suite.json"
CHUNKS = (1, 2, 4, 8, 16, 32)
SCALING_CHUNKS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def add_ideal(row: dict[str, Any], costs: list[dict[str, float]], costs_mb: list[dict[str, float]], batch: int,
              m: int, checkpointed: int) -> None:
    for key, c, per_mb in (("ideal", costs, False), ("ideal_mb", costs_mb, True)):
        row[f"{key}_step_ms"] = ideal_step_ms(c, m, checkpointed, per_mb)
        row[f"achieved_over_{key}"] = row["samples_per_s"] / (batch / (row[f"{key}_step_ms"] / 1e3))


def add_inflation(rec: dict[str, Any], costs_mb: list[dict[str, float]], m: int, checkpointed: int) -> None:
    """Worker compute over in-process compute at the micro-batch size, per stage (see ``suite_record``)."""
    rec["fwd_inflation"] = [f / (m * c["forward_ms"]) for f, c in zip(rec["fwd_ms"], costs_mb)]
    rec["bwd_inflation"] = [b / (m * c["backward_ms"] + checkpointed * c["forward_ms"])
                            for b, c in zip(rec["bwd_ms"], costs_mb)]


CONTROL = "gpipe_control"  # GPipe on a second group of processes: the run's A/A control
#: Every contestant, in the order of a round. The order is reversed every other round and at every other
#: chunk count, so a steady drift in the machine's speed moves no contestant's pooled steps over an even
#: number of rounds, and over neighbouring chunk counts for an odd one. The control runs right after
#: rrefpipe 'never', one place further from GPipe.
CONTESTANTS = ("gpipe", "1f1b", "never", CONTROL, "except_last", "always")


def schedule_of(key: str) -> str:
    """The pipelining schedule a contestant runs (the control runs GPipe's)."""
    return "gpipe" if key == CONTROL else key


def pipelining_row(group: PipeliningGroup, spec: ModelSpec, schedule: str, m: int, n: int,
                   args: argparse.Namespace) -> dict[str, Any]:
    if schedule == "1f1b" and m < n:
        return {"error": f"n/a: Schedule1F1B needs chunks >= stages ({m} < {n})"}
    try:
        times, cpu = group.time_steps(spec.name, schedule, m, args.warmup, args.repeats)
    except RuntimeError as exc:
        log(f"  pipelining {schedule} m={m} failed: {exc}")
        return {"error": str(exc)[-2000:]}
    step = summary(times)
    return {"step": step, "samples_per_s": spec.batch / (step["median_ms"] / 1e3), "cpu": cpu}


def one_chunk_count(names: list[str], groups: dict[str, PipeliningGroup], spec: ModelSpec, n: int, m: int, k: int,
                    ctx: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """All contestants at ``m`` micro-batches, back to back, ``--rounds`` times (the order reversed
    every other round and on odd ``k``); each contestant's timed steps of all rounds are pooled."""
    rounds: dict[str, list[dict[str, Any]]] = {}
    chosen = list(args.contestants)
    for r in range(args.rounds):
        order = chosen if (k + r) % 2 == 0 else chosen[::-1]
        for key, row in one_round(names, groups, spec, n, m, order, ctx, args).items():
            rounds.setdefault(key, []).append(row)
    contestants = {key: pooled(rows, spec.batch) for key, rows in rounds.items()}
    for key, row in contestants.items():
        if "error" not in row:
            add_ideal(row, ctx["full"], ctx["per_mb"][m], spec.batch, m, CHECKPOINTED.get(key, lambda m: 0)(m))
        if row.get("record"):
            add_inflation(row["record"], ctx["per_mb"][m], m, CHECKPOINTED[key](m))
    out: dict[str, Any] = {"chunks": m, "ideal_step_ms": ideal_step_ms(ctx["full"], m, 0, False),  # no recompute
                           "ideal_mb_step_ms": ideal_step_ms(ctx["per_mb"][m], m, 0, True),
                           "contestants": {key: contestants[key] for key in chosen}}
    out["ideal_samples_per_s"] = spec.batch / (out["ideal_step_ms"] / 1e3)
    out["ideal_mb_samples_per_s"] = spec.batch / (out["ideal_mb_step_ms"] / 1e3)
    return out


def one_round(names: list[str], groups: dict[str, PipeliningGroup], spec: ModelSpec, n: int, m: int,
              order: list[str], ctx: dict[str, Any], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for key in order:
        if key in groups:
            row = pipelining_row(groups[key], spec, schedule_of(key), m, n, args)
        else:
            tl = (str(args.out.parent / "suite-timelines" / f"{spec.name}-{n}st-m{m}-{key}")
                  if m == args.timeline_chunks else None)
            row = time_pipe(names, ctx["model"], ctx["balance"], ctx["data"], spec.loss_fn(), m, key,
                            args.warmup, args.repeats, timeline=tl, pids=ctx["pids"])
        rows[key] = row
        log(f"  {spec.name} {n}st m={m} {key}: " + (f"{row['samples_per_s']:.0f} samples/s" if "error" not in row
                                                    else row["error"].splitlines()[0]))
    return rows


def pooled(rows: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """One contestant's rounds as one row: the step statistics of every timed step of every round; the
    rest (CPU, execution record) from the first round. An error in any round is the row's error."""
    failed = next((row for row in rows if "error" in row), None)
    if failed is not None or len(rows) == 1:
        return failed or rows[0]
    times = [t / 1e3 for row in rows for t in row["step"]["samples_ms"]]
    step = summary(times)
    return {**rows[0], "step": step, "samples_per_s": batch / (step["median_ms"] / 1e3),
            "round_medians_ms": [row["step"]["median_ms"] for row in rows]}


def warm_up(names: list[str], groups: dict[str, PipeliningGroup], spec: ModelSpec, ctx: dict[str, Any], m: int,
            args: argparse.Namespace) -> None:
    """Run every pipeline once, untimed: the first configuration of a model ran 15-30% slower (seen on the
    MLP: identical configurations, 'never' and 'except_last' at chunks=1, 780 vs 600 ms per step)."""
    if any(key in MODES for key in args.contestants):
        time_pipe(names, ctx["model"], ctx["balance"], ctx["data"], spec.loss_fn(), m, "never", args.warmup, 1)
    for group in dict.fromkeys(groups.values()):  # each group of processes once
        try:
            group.time_steps(spec.name, "gpipe", m, args.warmup, 1)
        except RuntimeError as exc:
            log(f"  pipelining warm-up failed: {exc}")


def contention(spec: ModelSpec, n: int, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    """Each stage's compute beside the other's against alone (``bench_contention``), at m >= 8, for the
    2-stage sections of ``--contention-models``: the bubble model's stages are timed alone."""
    if n != 2 or spec.name not in args.contention_models or args.contention_rounds < 1:
        return {}
    log(f"{spec.name}, {n} stages: timing each stage beside the other ...")
    return {str(m): [measure_contention(spec.name, m, j, args.contention_rounds, args.contention_calls)
                     for j in range(n)] for m in args.chunks if m >= 8}


def run_section(cluster: Any, groups: dict[str, PipeliningGroup], spec: ModelSpec, n: int,
                args: argparse.Namespace) -> dict[str, Any]:
    """One model on ``n`` stages: per-stage compute, RPC floor, every chunk count, memory."""
    names = cluster.names
    load_start = loadavg()
    model, balance, data = spec.build(), spec.balance(n), spec.data()
    log(f"{spec.name}, {n} stages: measuring per-stage compute ...")
    # A micro-batch's compute is timed over m calls per repeat (a whole batch's worth), so small ones
    # are timed as long as big ones and the noise of a short call does not decide the ideal.
    per_mb = {m: stage_compute(model, balance, data[0], math.ceil(spec.batch / m), args.warmup * m,
                               args.compute_repeats * m)
              for m in args.chunks}
    beside = contention(spec, n, args)
    full = per_mb[1] if 1 in per_mb else stage_compute(model, balance, data[0], spec.batch, args.warmup,
                                                       args.compute_repeats)
    shapes = boundary_shapes(spec, n)
    mb_shapes = {m: [(math.ceil(spec.batch / m), *s[1:]) for s in shapes[1:]] for m in args.chunks}
    floor = rpc_floor(names[0], [s for v in mb_shapes.values() for s in v], args.rpc_repeats)
    ctx = {"model": model, "balance": balance, "data": data, "full": full, "per_mb": per_mb,
           "pids": [os.getpid(), *cluster.pids[:n]]}
    if not args.quick:
        warm_up(names, groups, spec, ctx, args.chunks[0], args)
    rows = []
    for k, m in enumerate(args.chunks):
        load = loadavg()
        row = one_chunk_count(names, groups, spec, n, m, k, ctx, args)
        row["loadavg_start"], row["loadavg_end"] = load, loadavg()
        row["rpc_mb_ms"] = max(floor["x".join(map(str, s))] for s in mb_shapes[m])
        row["rpc_step_ms"] = 2 * m * row["rpc_mb_ms"]  # the busiest boundary's traffic, forward + backward
        rows.append(row)
    input_bytes = [math.prod(s) * 4 for s in shapes]
    mem = (memory_by_mode(names, model, balance, data, spec.loss_fn(), args.memory_chunks, MODES, input_bytes)
           if args.memory_chunks > 0 else None)
    return {"name": spec.name, "model": spec.description, "stages": n, "balance": balance, "batch": spec.batch,
            "stage_compute": full, "stage_compute_per_microbatch": {str(m): c for m, c in per_mb.items()},
            "contention": beside, "boundary_shapes": shapes, "rpc_floor_ms": floor, "rows": rows, "memory": mem,
            "loadavg_start": load_start, "loadavg_end": loadavg()}


def plain_baselines(names: Sequence[str], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for name in names:
        spec = SPECS[name]
        model, (x, y) = spec.build(), spec.data()
        out[name] = [single_process(model, x, y, t, args.warmup, args.repeats, loss_fn=spec.loss_fn()) for t in (1, 2)]
        log(f"plain {name}: " + ", ".join(f"{p['threads']} thread(s) {p['samples_per_s']:.0f} samples/s"
                                          for p in out[name]))
    return out


def pipelining_groups(n: int, contestants: Sequence[str], stack: contextlib.ExitStack) -> dict[str, PipeliningGroup]:
    """The pipelining contestants' groups of ``n`` processes, closed with ``stack``: GPipe and 1F1B share
    one, the control has its own."""
    groups: dict[str, PipeliningGroup] = {}
    schedules = [key for key in SCHEDULES if key in contestants]
    if schedules:
        group = stack.enter_context(PipeliningGroup(n))
        groups.update(dict.fromkeys(schedules, group))
    if CONTROL in contestants:
        groups[CONTROL] = stack.enter_context(PipeliningGroup(n))
    return groups


def run(args: argparse.Namespace) -> dict[str, Any]:
    from workers import LocalWorkers

    result: dict[str, Any] = {"loadavg_start": loadavg()}
    log(f"load average at start: {result['loadavg_start']}")
    result["plain"] = plain_baselines(args.models, args)  # before any other process of ours exists
    torch.set_num_threads(1)  # the driver, like every stage process
    with LocalWorkers(max(args.stages), threads=1) as cluster:
        result["machine"] = {**machine_info(torch.get_num_threads(), cluster.threads),
                             "loadavg_start": result["loadavg_start"]}
        result["sections"] = []
        for n in args.stages:
            with contextlib.ExitStack() as stack:
                groups = pipelining_groups(n, args.contestants, stack)
                if groups:  # every group starts its ranks alike
                    result["machine"][f"pipelining_threads_{n}st"] = next(iter(groups.values())).threads
                for name in args.models:
                    result["sections"].append(run_section(cluster, groups, SPECS[name], n, args))
        if args.scaling_chunks:
            log("scaling: MLP step time vs chunks, fixed micro-batch size ...")
            spec = SPECS["mlp"]
            result["scaling"] = scaling(cluster.names, spec.build(), spec.balance(2), spec.data(), spec.loss_fn(),
                                        args.scaling_chunks, args.scaling_micro_batch, args.scaling_checkpoint,
                                        args.warmup, args.scaling_repeats, args.compute_repeats)
        if args.hop_sizes:
            log("stage hops (bench_core.bench_hops) ...")
            result["hop"] = bench_hops(cluster.names, args.hop_sizes, args.hop_repeats, args.warmup, grad=True)
    result["loadavg_end"] = result["machine"]["loadavg_end"] = loadavg()
    return result


def wait_for_quiet(limit: float, max_wait: float) -> list[float] | None:
    """Sleep in 30 s steps while the 1-minute load average is at or above ``limit`` (at most ``max_wait`` s)."""
    deadline = time.monotonic() + max_wait
    while (load := loadavg()) and load[0] >= limit and time.monotonic() < deadline:
        log(f"load average {load} >= {limit}: waiting 30 s (up to {deadline - time.monotonic():.0f} s more)")
        time.sleep(30)
    return load


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = new_parser(__doc__, DEFAULT_OUT, "JSON output; the chart goes next to it as .png")
    p.add_argument("--quick", action="store_true", help="smoke run (< 2 min): 2 stages, chunks 2 8, few repeats")
    p.add_argument("--models", nargs="+", choices=list(SPECS), default=list(DEFAULT_MODELS),
                   help="models to run ('tiny', next to no compute, shows each framework's cost per micro-batch)")
    p.add_argument("--stages", nargs="+", type=int, choices=(2, 3), default=[2, 3], help="stage counts")
    p.add_argument("--chunks", nargs="+", type=int, default=list(CHUNKS), help="micro-batch counts")
    p.add_argument("--contestants", nargs="+", choices=CONTESTANTS, default=list(CONTESTANTS),
                   help=f"who runs in each round, always in the order {', '.join(CONTESTANTS)} (reversed every "
                        f"other round); {CONTROL!r} is GPipe on a second group of processes, the A/A control")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps before each measurement (a worker warms up per RPC thread: oneDNN/MKL keep "
                   "per-thread state)")
    p.add_argument("--repeats", type=int, default=4, help="timed steps per configuration and round")
    p.add_argument("--rounds", type=int, default=2,
                   help="times every contestant runs at each chunk count, interleaved (the median is over the "
                        "timed steps of all rounds): a burst of load then hits no contestant alone")
    p.add_argument("--compute-repeats", type=int, default=3, help="timed runs per stage-compute measurement")
    p.add_argument("--contention-models", nargs="*", choices=list(SPECS), default=["mlp"],
                   help="models whose 2-stage sections also time each stage beside the other (bench_contention)")
    p.add_argument("--contention-rounds", type=int, default=3, help="alone/beside rounds per stage (0: skip)")
    p.add_argument("--contention-calls", type=int, default=8, help="timed calls per round and condition")
    p.add_argument("--rpc-repeats", type=int, default=15, help="timed raw rpc_sync calls per boundary size")
    p.add_argument("--memory-chunks", type=int, default=4, help="chunks for the memory measurement (0: skip it)")
    p.add_argument("--timeline-chunks", type=int, default=8,
                   help="write rrefpipe timelines (results/suite-timelines/) at this chunk count; 0: none")
    p.add_argument("--scaling-chunks", nargs="*", type=int, default=list(SCALING_CHUNKS),
                   help="chunk counts for the MLP scaling sweep (none: skip)")
    p.add_argument("--scaling-micro-batch", type=int, default=4,
                   help="samples per micro-batch in the sweep (the mini-batch is chunks x this)")
    p.add_argument("--scaling-checkpoint", choices=MODES, default="never", help="checkpoint mode of the sweep")
    p.add_argument("--scaling-repeats", type=int, default=5, help="timed steps per point of the sweep")
    p.add_argument("--hop-sizes", nargs="*", choices=list(SIZES), default=list(SIZES),
                   help="stage-hop tensor sizes (bench_core; none: skip)")
    p.add_argument("--hop-repeats", type=int, default=30, help="timed rounds per hop size (half for 16MB)")
    add_run_args(p, "measure nothing: print the tables and targets of a saved run and redraw its chart")
    args = p.parse_args(argv)
    if args.quick:
        args.stages, args.chunks = [2], [2, 8]
        args.warmup, args.repeats, args.compute_repeats, args.rpc_repeats, args.rounds = 1, 3, 1, 5, 1
        args.scaling_chunks, args.hop_sizes, args.hop_repeats = [8, 16, 32], ["4KB", "1MB"], 6
        args.contention_rounds, args.contention_calls = 1, 3
    batch = min(SPECS[m].batch for m in args.models)
    if (min(args.chunks) < 1 or max(args.chunks) > batch or args.warmup < 0 or args.repeats < 1
            or args.rounds < 1):
        p.error(f"need 1 <= chunks <= {batch} (the smallest batch), --warmup >= 0, --repeats >= 1, --rounds >= 1")
    args.chunks = sorted(set(args.chunks))
    args.contestants = [key for key in CONTESTANTS if key in args.contestants]
    return args


def new_parser(doc: str | None, out: Path, out_help: str = "JSON output") -> argparse.ArgumentParser:
    """A benchmark's parser: its description the docstring's first line, and ``--out``."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n", 1)[0],
                                epilog="The module docstring says exactly what is measured.")
    p.add_argument("--out", type=Path, default=out, help=out_help)
    return p


def add_run_args(p: argparse.ArgumentParser, report: str = "measure nothing: reprint a saved run") -> None:
    """The options :func:`run_and_report` reads: ``--wait-load``, ``--wait-max``, ``--report``."""
    p.add_argument("--wait-load", type=float, default=0.0,
                   help="before starting, wait while the 1-min load average is >= this (0: don't wait)")
    p.add_argument("--wait-max", type=float, default=600.0, help="longest wait for --wait-load, seconds")
    p.add_argument("--report", type=Path, metavar="JSON", help=report)


def report(result: dict[str, Any], out: Path) -> None:
    """Print every table and the targets, and write the chart next to ``out``."""
    m, st = result["machine"], result["settings"]
    print(f"\nrrefpipe benchmark suite: {m['platform']}, python {m['python']}, torch {m['torch']}, "
          f"{m['cpu_count']} CPUs "
          f"({m['cpus_usable']} usable)\nthreads: driver {m['driver_threads']} intra-op; rrefpipe stage workers "
          f"{m['worker_threads']} intra-op, {m.get('worker_interop_threads', '?')} inter-op and "
          f"{m.get('worker_rpc_threads', '?')} RPC thread(s) each; pipelining ranks [intra, inter]: "
          + ", ".join(f"{k[-3:]} {v}" for k, v in m.items() if k.startswith("pipelining_threads"))
          + f"; plain: 1 and 2 intra-op\ntimed step = forward + loss + backward + SGD step; median of {st['repeats']} "
          f"x {st.get('rounds', 1)} rounds, each after {st['warmup']} warm-up\n"
          f"load average (1/5/15 min) at start {result['loadavg_start']}, "
          f"at end {result['loadavg_end']}")
    print_all(result)
    print_targets(result["targets"])
    png = write_chart(result, out.with_suffix(".png"))
    print_written(result, out, png)


def print_written(result: dict[str, Any], *paths: Path) -> None:
    """A report's last line: the files written, how long the run took and the load before and after."""
    print(f"\nwrote {' and '.join(map(str, paths))} ({result['wall_s']:.0f} s); load average at start "
          f"{result['loadavg_start']}, at end {result['loadavg_end']}")


def run_and_report(args: argparse.Namespace, run: Callable[[argparse.Namespace], dict[str, Any]],
                   evaluate: Callable[[dict[str, Any]], Any], report: Callable[[dict[str, Any], Path], None]) -> None:
    """A benchmark's main: redraw a saved run (``--report``), or wait for a quiet machine, run, save the
    JSON (first: nothing below may lose the run), then print the tables and targets."""
    if args.report:  # only redraw: tables, targets and chart from a saved run
        result = json.loads(args.report.read_text())
        result["targets"] = evaluate(result)
        report(result, args.report)
        return
    if args.wait_load > 0:
        wait_for_quiet(args.wait_load, args.wait_max)
    started = time.perf_counter()
    result = run(args)
    result["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result["wall_s"] = time.perf_counter() - started
    result["targets"] = evaluate(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    report(result, args.out)


def main(argv: Sequence[str] | None = None) -> None:
    run_and_report(parse_args(argv), run, evaluate, report)


if __name__ == "__main__":
    main()
