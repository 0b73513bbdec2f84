"""Core rrefpipe benchmarks: the cost of one stage hop, and 2-stage training throughput.

Run ``python benchmarks/bench_core.py`` (about 1-2 minutes on a 2-core machine; ``--quick`` for a
smoke test). It prints tables and writes everything, raw timings included, to a JSON file.

What is measured and how
========================

1. **Stage hop.** For float32 tensors of 4 KB, 64 KB, 1 MB and 16 MB (shape ``(rows, 1024)``, batch
   dim first) we time, interleaved in shuffled order after a warm-up, with ``time.perf_counter``:

   * ``raw``: ``rpc_sync(worker1, torch.numel, args=(x,))``, a plain TensorPipe call carrying the
     tensor driver -> worker (the reply is an int);
   * ``echo``: ``rpc_sync(worker1, torch.clone, args=(x,))``, the tensor there and back;
   * ``pipe1`` / ``pipe2``: a ``Pipe`` of one / two ``nn.Identity`` stages (chunks=1) on worker1 /
     worker1 -> worker2, under ``torch.no_grad()``. Both include driver -> stage 0 and last stage ->
     driver, so ``hop = median(pipe2) - median(pipe1)`` is one worker-to-worker hop, framework included.

   The same difference is taken with autograd on (input ``requires_grad``, inside a
   ``dist_autograd.context()``): *forward only* (``grad fwd``), and *forward + backward* of
   ``out.sum()`` (``grad f+b``; that hop carries the tensor forward and its gradient back, so it is
   compared with twice the raw call). ``hop/raw`` divides by the median ``raw`` time.

2. **Training throughput** of a balanced 2-stage pipeline: ``blocks`` x (Linear(h, h) + ReLU),
   split half and half, SGD through ``DistributedOptimizer``, cross-entropy on the driver, for
   ``chunks`` in {1, 2, 4, 8, 16} and ``checkpoint`` in {'never', 'except_last'}. A step (timed from
   the driver) is forward + loss + ``dist_autograd.backward`` + ``opt.step``; samples/s = batch /
   median step time. Baselines:

   * *single*: plain training of the same model in this process (same loss and optimizer), with the
     driver's intra-op threads (2 by default) and, for reference, 1 thread, before the workers start;
     and with the driver's threads again after the pipeline runs (workers idle). ``vs single`` uses
     the faster of the two runs with the driver's threads;
   * *ideal*: GPipe's bubble model. Per-stage compute is measured by plain in-process timing of each
     half (forward, and forward+backward with a random output gradient) with 1 intra-op thread, as each
     stage worker has. With F_j, B_j the stage's forward/backward time for the whole batch and ``c`` the
     number of checkpointed micro-batches (recomputing their forward), the ideal step is
     ``(m + n - 1) / m * max_j(F_j + B_j + c/m * F_j)``, i.e. efficiency ``m / (m + n - 1)`` applied to
     the per-stage compute. ``ideal@mb`` redoes this with F, B timed at the micro-batch size, so it also
     prices the slower small matmuls: ``(m + n - 1) * max_j(f_j + b_j + c/m * f_j)``. Neither includes
     transfers, the loss or the optimizer step; ``achieved/ideal`` is throughput over ideal throughput.

   (The execution record is not used for the ideal: it lacks stage 0's backward spans when the pipe's
   input does not require grad. It does give the last stage's utilisation, ``s1 busy``: the time
   covered by its forward, recompute and backward spans over the total step time; backward spans
   include waiting for the autograd engine, so this is an upper bound.)

The machine's load average is recorded before and after: other processes on the host skew every
number here, the hop tails most.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import Tensor, nn

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "core.json"
SIZES: dict[str, int] = {"4KB": 4 << 10, "64KB": 64 << 10, "1MB": 1 << 20, "16MB": 16 << 20}
ROW = 1024  # floats per row of the hop tensors
CHUNKS = (1, 2, 4, 8, 16)
CHECKPOINTS = ("never", "except_last")
Timer = Callable[[], Any]

# Benign deprecation chatter from torch's RPC init; the env var quiets the worker processes too.
# (DistributedOptimizer's TorchScript warning forces itself through any filter: it goes to stderr.)
_QUIET = "ignore:You are using a Backend"
os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), _QUIET]))
warnings.filterwarnings("ignore", message="You are using a Backend")


# -- helpers ----------------------------------------------------------------------------------------
def ms(seconds: float) -> float:
    return seconds * 1e3


def summary(samples: Sequence[float]) -> dict[str, Any]:
    """Median, 10th and 90th percentile (in ms) of timings given in seconds."""
    data = sorted(samples)
    deciles = statistics.quantiles(data, n=10) if len(data) > 1 else [data[0]] * 9
    return {"median_ms": ms(statistics.median(data)), "p10_ms": ms(deciles[0]), "p90_ms": ms(deciles[-1]),
            "n": len(data), "samples_ms": [ms(t) for t in samples]}


def one_process_step(model: nn.Module, data: tuple[Tensor, Tensor], loss_fn: Callable[[Tensor, Tensor], Tensor],
                     chunks: int, lr: float) -> Callable[[], None]:
    """The physical limit's unit of work: one process's micro-batched training step on a copy of
    ``model`` (``zero_grad``; for each of the ``chunks`` micro-batches forward, loss over ``chunks``, a
    mean like the pipelines', and backward; then an SGD step). Time it with 1 intra-op thread."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    xs, ys = data[0].tensor_split(chunks), data[1].tensor_split(chunks)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for xi, yi in zip(xs, ys):
            (loss_fn(model(xi), yi) / chunks).backward()
        opt.step()

    return step


def time_calls(fn: Timer, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def time_interleaved(fns: dict[str, Timer], warmup: int, repeats: int, seed: int = 0) -> dict[str, list[float]]:
    """Time each callable once per round, in a shuffled order, so drift hits all of them alike. A callable
    that returns a float reports its own time in seconds (a step timed in another process)."""
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for round_ in range(warmup + repeats):
        rng.shuffle(names)
        for name in names:
            start = time.perf_counter()
            own = fns[name]()
            elapsed = own if isinstance(own, float) else time.perf_counter() - start
            if round_ >= warmup:
                samples[name].append(elapsed)
    return samples


def machine_info(driver_threads: int, worker_threads: int | None) -> dict[str, Any]:
    import rrefpipe
    import workers

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "cpu_count": os.cpu_count(), "cpus_usable": usable, "driver_threads": driver_threads,
        "driver_interop_threads": torch.get_num_interop_threads(), "worker_threads": worker_threads,
        "worker_rpc_threads": workers.options.STAGE_RPC_THREADS,
        "worker_interop_threads": workers.options.STAGE_INTEROP_THREADS,
        "transports": list(getattr(workers.options, "LOCAL_TRANSPORTS", [])) or None,
        "rrefpipe": f"{getattr(rrefpipe, '__version__', '?')} from {Path(rrefpipe.__file__).parent}",
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def exit_without_teardown(code: int = 0) -> None:
    """Leave the process now: run its exit hooks (``atexit``: multiprocessing joins its queues' feeder threads
    there) and flush stdout/stderr, but skip the interpreter's teardown of its modules, which after
    ``import torch`` (and torch.distributed.pipelining, torch.export) costs about 1 CPU-second and 1-3 s on
    2 busy cores, per process. For a benchmark's end, and a stage process's, once everything is written."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


# -- 1. stage hop -----------------------------------------------------------------------------------
def hop_timers(names: Sequence[str], x: Tensor, pipe1: Any, pipe2: Any, grad: bool) -> dict[str, Timer]:
    first = names[0]
    xg = x.clone().requires_grad_()

    def no_grad(pipe: Any) -> Timer:
        def run() -> None:
            with torch.no_grad():
                pipe(x).local_value()
        return run

    def grad_fwd(pipe: Any) -> Timer:
        def run() -> None:
            with dist_autograd.context():
                pipe(xg).local_value()
        return run

    def grad_fwd_bwd(pipe: Any) -> Timer:
        def run() -> None:
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [pipe(xg).local_value().sum()])
        return run

    timers: dict[str, Timer] = {
        "raw": lambda: rpc.rpc_sync(first, torch.numel, args=(x,)),
        "echo": lambda: rpc.rpc_sync(first, torch.clone, args=(x,)),
        "pipe1": no_grad(pipe1), "pipe2": no_grad(pipe2),
    }
    if grad:
        timers.update({"pipe1_gf": grad_fwd(pipe1), "pipe2_gf": grad_fwd(pipe2),
                       "pipe1_gfb": grad_fwd_bwd(pipe1), "pipe2_gfb": grad_fwd_bwd(pipe2)})
    return timers


def hop_row(label: str, shape: tuple[int, ...], samples: dict[str, list[float]]) -> dict[str, Any]:
    stats = {name: summary(s) for name, s in samples.items()}
    med = {name: s["median_ms"] for name, s in stats.items()}
    row: dict[str, Any] = {"size": label, "shape": list(shape), "stats": stats,
                           "hop_ms": med["pipe2"] - med["pipe1"], "pipe1_minus_echo_ms": med["pipe1"] - med["echo"]}
    row["hop_over_raw"] = row["hop_ms"] / med["raw"]
    if "pipe2_gf" in med:
        row["hop_grad_fwd_ms"] = med["pipe2_gf"] - med["pipe1_gf"]
        row["hop_grad_fwd_over_raw"] = row["hop_grad_fwd_ms"] / med["raw"]
        row["hop_grad_fwd_bwd_ms"] = med["pipe2_gfb"] - med["pipe1_gfb"]
        row["hop_grad_fwd_bwd_over_2raw"] = row["hop_grad_fwd_bwd_ms"] / (2 * med["raw"])
    return row


def bench_hops(names: Sequence[str], sizes: Sequence[str], repeats: int, warmup: int,
               grad: bool) -> list[dict[str, Any]]:
    from rrefpipe import Pipe

    pipe1 = Pipe(nn.Sequential(nn.Identity()), chunks=1, checkpoint="never", balance=[1], workers=names[:1])
    pipe2 = Pipe(nn.Sequential(nn.Identity(), nn.Identity()), chunks=1, checkpoint="never", balance=[1, 1],
                 workers=names[:2])
    rows = []
    try:
        for label in sizes:
            x = torch.randn(max(1, SIZES[label] // (4 * ROW)), ROW)
            # Big tensors are slow and noisy alike; fewer rounds keep the run time bounded.
            n = repeats if SIZES[label] < (4 << 20) else max(5, repeats // 2)
            samples = time_interleaved(hop_timers(names, x, pipe1, pipe2, grad), warmup, n)
            rows.append(hop_row(label, tuple(x.shape), samples))
            print(f"  hop {label}: done ({n} rounds)", file=sys.stderr, flush=True)
    finally:
        pipe1.close()
        pipe2.close()
    return rows


def print_hops(rows: list[dict[str, Any]]) -> None:
    grad = "hop_grad_fwd_ms" in rows[0]
    head = f"{'size':>5} {'raw':>8} {'echo':>8} {'pipe1':>8} {'pipe2':>8} {'hop':>8} {'hop/raw':>8}"
    if grad:
        head += f" | {'grad fwd':>8} {'/raw':>6} | {'grad f+b':>8} {'/2raw':>6}"
    print("Stage hop, median ms (hop = pipe2 - pipe1; grad fwd / f+b: same difference with autograd)")
    print(head)
    for r in rows:
        m = {k: v["median_ms"] for k, v in r["stats"].items()}
        line = (f"{r['size']:>5} {m['raw']:>8.3f} {m['echo']:>8.3f} {m['pipe1']:>8.3f} {m['pipe2']:>8.3f} "
                f"{r['hop_ms']:>8.3f} {r['hop_over_raw']:>8.1f}")
        if grad:
            line += (f" | {r['hop_grad_fwd_ms']:>8.3f} {r['hop_grad_fwd_over_raw']:>6.1f} | "
                     f"{r['hop_grad_fwd_bwd_ms']:>8.3f} {r['hop_grad_fwd_bwd_over_2raw']:>6.1f}")
        print(line)
    print("  p10-p90 ms of pipe2: " + ", ".join(
        f"{r['size']} {r['stats']['pipe2']['p10_ms']:.2f}-{r['stats']['pipe2']['p90_ms']:.2f}" for r in rows))


# -- 2. training throughput -------------------------------------------------------------------------
def make_model(hidden: int, blocks: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[layer for _ in range(blocks) for layer in (nn.Linear(hidden, hidden), nn.ReLU())])


def single_process(model: nn.Sequential, x: Tensor, y: Tensor, threads: int, warmup: int, repeats: int,
                   when: str = "before workers start",
                   loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy) -> dict[str, Any]:
    """Plain training of ``model`` in this process with ``threads`` intra-op threads (SGD step included)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    try:
        samples = time_calls(step, warmup, repeats)
    finally:
        torch.set_num_threads(saved)
    stats = summary(samples)
    return {"threads": threads, "when": when, "step": stats, "samples_per_s": len(x) / (stats["median_ms"] / 1e3)}


def stage_compute(model: nn.Sequential, balance: Sequence[int], x: Tensor, rows: int, warmup: int,
                  repeats: int) -> list[dict[str, float]]:
    """Forward and backward ms of each stage for ``rows`` samples, 1 intra-op thread (as on a worker)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    stages, offset = [], 0
    for size in balance:
        stages.append(copy.deepcopy(model[offset:offset + size]))
        offset += size
    out, h = [], x[:rows].clone()
    try:
        for j, stage in enumerate(stages):
            inp = h.detach().requires_grad_(j > 0)  # stage 0's input needs no gradient, later ones do
            with torch.no_grad():
                h = stage(inp)
            grad = torch.randn_like(h)
            fwd = statistics.median(time_calls(lambda: stage(inp), warmup, repeats))
            fwd_bwd = statistics.median(time_calls(lambda: stage(inp).backward(grad), warmup, repeats))
            out.append({"forward_ms": ms(fwd), "backward_ms": ms(max(fwd_bwd - fwd, 0.0))})
    finally:
        torch.set_num_threads(saved)
    return out


def stage_tick_ms(cost: dict[str, float], m: int, checkpointed: int) -> float:
    """A stage's forward + backward and its share of the ``checkpointed`` of ``m`` forwards recomputed."""
    return cost["forward_ms"] + cost["backward_ms"] + checkpointed / m * cost["forward_ms"]


def ideal_step_ms(costs: list[dict[str, float]], m: int, checkpointed: int, per_microbatch: bool) -> float:
    """GPipe bubble model; ``costs`` are for the whole batch, or for one micro-batch if ``per_microbatch``."""
    n = len(costs)
    tick = max(stage_tick_ms(c, m, checkpointed) for c in costs)
    return (m + n - 1) * tick if per_microbatch else (m + n - 1) / m * tick


def busy_ms(events: list[Any]) -> dict[str, dict[str, float]]:
    """Per stage: summed span ms of each kind, and ``covered`` = ms covered by the union of its spans.

    Backward spans start when the output gradient arrives, so they include queueing behind other
    micro-batches' backward and overlap; the union counts each instant once.
    """
    out: dict[str, dict[str, float]] = {}
    for stage in sorted({e.stage for e in events}):
        mine = sorted((e for e in events if e.stage == stage), key=lambda e: e.start)
        sums: dict[str, float] = {}
        covered, reach = 0.0, float("-inf")
        for e in mine:
            sums[e.kind] = sums.get(e.kind, 0.0) + ms(e.end - e.start)
            covered += ms(max(0.0, e.end - max(e.start, reach)))
            reach = max(reach, e.end)
        out[str(stage)] = {**sums, "covered": covered}
    return out


def train_pipeline(names: Sequence[str], model: nn.Sequential, balance: Sequence[int], x: Tensor, y: Tensor,
                   chunks: int, checkpoint: str, warmup: int, repeats: int) -> dict[str, Any]:
    from torch.distributed.optim import DistributedOptimizer

    from rrefpipe import Pipe

    pipe = Pipe(copy.deepcopy(model), chunks=chunks, checkpoint=checkpoint, balance=list(balance),
                workers=list(names[:len(balance)]))
    try:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.01)
        parts: dict[str, list[float]] = {"step": [], "forward": [], "backward": [], "optimizer": []}
        for k in range(warmup + repeats):
            if k == warmup:
                pipe.execution_record(clear=True)
            t0 = time.perf_counter()
            with dist_autograd.context() as ctx:
                out = pipe(x).local_value()
                t1 = time.perf_counter()
                dist_autograd.backward(ctx, [F.cross_entropy(out, y)])
                t2 = time.perf_counter()
                opt.step(ctx)
                t3 = time.perf_counter()
            if k >= warmup:
                for key, value in zip(parts, (time.perf_counter() - t0, t1 - t0, t2 - t1, t3 - t2)):
                    parts[key].append(value)
        busy = busy_ms(pipe.execution_record(clear=True))
    finally:
        pipe.close()
    step = summary(parts["step"])
    return {"chunks": chunks, "checkpoint": checkpoint, "step": step,
            "samples_per_s": len(x) / (step["median_ms"] / 1e3),
            **{f"{k}_median_ms": ms(statistics.median(v)) for k, v in parts.items() if k != "step"},
            "record_ms": busy, "steps_total_ms": ms(sum(parts["step"]))}


def add_ideal(row: dict[str, Any], full: list[dict[str, float]], per_mb: list[dict[str, float]], batch: int) -> None:
    m = min(row["chunks"], batch)
    c = {"always": m, "except_last": m - 1, "never": 0}[row["checkpoint"]]  # checkpointed micro-batches
    for key, costs, per in (("ideal", full, False), ("ideal_mb", per_mb, True)):
        step = ideal_step_ms(costs, m, c, per)
        row[f"{key}_step_ms"] = step
        row[f"{key}_samples_per_s"] = batch / (step / 1e3)
        row[f"achieved_over_{key}"] = row["samples_per_s"] / row[f"{key}_samples_per_s"]
    last = row["record_ms"].get(str(len(full) - 1), {})
    row["last_stage_busy_fraction"] = last.get("covered", 0.0) / row["steps_total_ms"]


def print_training(result: dict[str, Any]) -> None:
    single = result["single_process"]
    print(f"Training throughput: {result['model']}, batch {result['batch']}, balance {result['balance']}")
    for s in single:
        print(f"  single process, {s['threads']} thread(s), {s['when']}: {s['samples_per_s']:.0f} samples/s "
              f"({s['step']['median_ms']:.1f} ms/step, p10-p90 {s['step']['p10_ms']:.1f}-{s['step']['p90_ms']:.1f})")
    print("  per-stage compute, whole batch, 1 thread (fwd/bwd ms): " + ", ".join(
        f"stage {j} {c['forward_ms']:.1f}/{c['backward_ms']:.1f}" for j, c in enumerate(result["stage_compute"])))
    print(f"{'ckpt':>11} {'m':>3} {'step ms':>8} {'p10-p90':>13} {'fwd':>6} {'bwd':>6} {'opt':>5} {'samples/s':>9} "
          f"{'vs single':>9} {'ideal':>6} {'ach/ideal':>9} {'ideal@mb':>8} {'ach/i@mb':>8} {'s1 busy':>7}")
    for r in result["pipeline"]:
        s = r["step"]
        print(f"{r['checkpoint']:>11} {r['chunks']:>3} {s['median_ms']:>8.1f} {s['p10_ms']:>6.1f}-{s['p90_ms']:<6.1f} "
              f"{r['forward_median_ms']:>6.1f} {r['backward_median_ms']:>6.1f} {r['optimizer_median_ms']:>5.1f} "
              f"{r['samples_per_s']:>9.0f} {r['over_single']:>9.2f} {r['ideal_samples_per_s']:>6.0f} "
              f"{r['achieved_over_ideal']:>9.2f} {r['ideal_mb_samples_per_s']:>8.0f} "
              f"{r['achieved_over_ideal_mb']:>8.2f} {r['last_stage_busy_fraction']:>7.2f}")
    print(f"  vs single = samples/s over the faster single-process run with {result['single_reference']['threads']} "
          "thread(s); s1 busy = time covered by the last stage's recorded spans / total step time")


# -- driver -----------------------------------------------------------------------------------------
def baselines(args: argparse.Namespace, model: nn.Sequential, x: Tensor, y: Tensor) -> dict[str, Any]:
    """In-process measurements, taken before any worker exists so nothing competes for the cores."""
    threads = sorted({args.threads, 1}, reverse=True)
    single = [single_process(model, x, y, t, args.warmup, args.train_repeats) for t in threads]
    full = stage_compute(model, args.balance, x, args.batch, args.warmup, args.compute_repeats)
    per_mb = {m: stage_compute(model, args.balance, x, -(-args.batch // m), args.warmup, args.compute_repeats)
              for m in args.chunks}
    return {"single_process": single, "stage_compute": full,
            "stage_compute_per_microbatch": {str(m): c for m, c in per_mb.items()}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from workers import LocalWorkers

    load_start = loadavg()
    torch.set_num_threads(args.threads)
    model = make_model(args.hidden, args.blocks)
    x, y = torch.randn(args.batch, args.hidden), torch.randint(0, args.hidden, (args.batch,))
    print("measuring in-process baselines ...", file=sys.stderr, flush=True)
    train: dict[str, Any] = {"model": f"{args.blocks} x (Linear({args.hidden}, {args.hidden}) + ReLU)",
                             "batch": args.batch, "balance": args.balance, **baselines(args, model, x, y)}
    with LocalWorkers(2) as cluster:
        result: dict[str, Any] = {"machine": {**machine_info(torch.get_num_threads(), cluster.threads),
                                              "loadavg_start": load_start},
                                  "settings": {k: v for k, v in vars(args).items() if k != "out"}}
        print("measuring stage hops ...", file=sys.stderr, flush=True)
        result["hop"] = bench_hops(cluster.names, args.sizes, args.hop_repeats, args.warmup, not args.no_grad_hop)
        rows = []
        for checkpoint in CHECKPOINTS:
            for m in args.chunks:
                row = train_pipeline(cluster.names, model, args.balance, x, y, m, checkpoint, args.warmup,
                                     args.train_repeats)
                add_ideal(row, train["stage_compute"], train["stage_compute_per_microbatch"][str(m)], args.batch)
                rows.append(row)
                print(f"  train {checkpoint} chunks={m}: {row['samples_per_s']:.0f} samples/s", file=sys.stderr,
                      flush=True)
        train["pipeline"] = rows
        # Again with the workers idle: a load spike during the first run would skew every "vs single".
        train["single_process"].append(single_process(model, x, y, args.threads, args.warmup, args.train_repeats,
                                                      when="after the pipeline runs, workers idle"))
    same = [s for s in train["single_process"] if s["threads"] == args.threads]
    train["single_reference"] = max(same, key=lambda s: s["samples_per_s"])
    for row in rows:
        row["over_single"] = row["samples_per_s"] / train["single_reference"]["samples_per_s"]
    result["train"] = train
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None,
                                epilog="See the module docstring for what each number means.")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="smoke test: fewer repeats, sizes and chunk counts (<60 s)")
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES), help="hop tensor sizes")
    p.add_argument("--chunks", nargs="+", type=int, default=list(CHUNKS), help="micro-batch counts to train with")
    p.add_argument("--hop-repeats", type=int, default=100, help="timed rounds per hop size (half for 16MB)")
    p.add_argument("--train-repeats", type=int, default=20, help="timed training steps per configuration")
    p.add_argument("--compute-repeats", type=int, default=15, help="timed runs per stage-compute measurement")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs before each measurement")
    p.add_argument("--no-grad-hop", action="store_true", help="skip the hop measurements with autograd")
    p.add_argument("--batch", type=int, default=128, help="training batch size")
    p.add_argument("--hidden", type=int, default=1024, help="Linear width (also the number of classes)")
    p.add_argument("--blocks", type=int, default=8, help="Linear+ReLU blocks; split evenly over 2 stages")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of this (driver) process")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes = [s for s in args.sizes if s in ("4KB", "1MB", "16MB")] or args.sizes
        args.chunks = [m for m in args.chunks if m in (1, 4, 16)] or args.chunks
        args.hop_repeats, args.train_repeats, args.compute_repeats, args.warmup = 10, 4, 4, 2
    if args.blocks < 2 or min(args.chunks) < 1 or args.batch < 1:
        p.error("need --blocks >= 2, --chunks >= 1 and --batch >= 1")
    if min(args.hop_repeats, args.train_repeats, args.compute_repeats) < 1 or args.warmup < 0:
        p.error("repeats must be >= 1 and --warmup >= 0")
    args.balance = [args.blocks, args.blocks]  # layers per stage: each block is Linear + ReLU
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    result = run(args)
    result["wall_s"] = time.perf_counter() - started
    result["machine"]["loadavg_end"] = loadavg()
    m = result["machine"]
    print(f"\nrrefpipe core benchmark: {m['platform']}, python {m['python']}, torch {m['torch']}, "
          f"{m['cpu_count']} CPUs ({m['cpus_usable']} usable); rrefpipe {m['rrefpipe']}")
    print(f"threads: driver {m['driver_threads']} intra-op / {m['driver_interop_threads']} inter-op, "
          f"each of 2 stage workers {m['worker_threads']} intra-op; transports {m['transports']}")
    print(f"load average (1/5/15 min) at start {m['loadavg_start']}, at end {m['loadavg_end']}\n")
    print_hops(result["hop"])
    print()
    print_training(result["train"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
