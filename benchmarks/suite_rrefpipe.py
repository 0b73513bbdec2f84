"""The rrefpipe contestant: training steps on local stage workers, memory per checkpoint mode, and the
chunks sweep. Every timed step is forward + loss + ``pipe.backward`` + ``DistributedOptimizer.step``
(SGD), timed on the driver; the execution record of the timed steps is analysed by ``suite_record``."""
from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor, nn

from bench_core import busy_ms, ms, summary
from suite_record import analyse_steps, proc_delta, proc_stat

CHECKPOINTS = ("never", "except_last", "always")
LR = 1e-3  # small: a few steps must not drive the weights into denormals or NaNs


def make_pipe(names: Sequence[str], model: nn.Sequential, balance: Sequence[int], chunks: int,
              checkpoint: str, microbatches_per_message: int = 1) -> Any:
    from rrefpipe import Pipe

    return Pipe(copy.deepcopy(model), chunks=chunks, checkpoint=checkpoint, balance=list(balance),
                workers=list(names[:len(balance)]), microbatches_per_message=microbatches_per_message)


def _step(pipe: Any, opt: Any, x: Tensor, y: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> dict[str, float]:
    """One training step; wall-clock marks (``time.time``, comparable with the execution record)."""
    marks = {"start": time.time()}
    with dist_autograd.context() as ctx:
        out = pipe(x).local_value()
        marks["forward"] = time.time()
        loss = loss_fn(out, y)
        marks["loss"] = time.time()
        pipe.backward(ctx, loss)
        marks["backward"] = time.time()
        opt.step(ctx)
    marks["end"] = time.time()
    return marks


def time_pipe(names: Sequence[str], model: nn.Sequential, balance: Sequence[int], data: tuple[Tensor, Tensor],
              loss_fn: Callable[[Tensor, Tensor], Tensor], chunks: int, checkpoint: str, warmup: int,
              repeats: int, timeline: str | None = None, pids: Sequence[int] = (),
              microbatches_per_message: int = 1) -> dict[str, Any]:
    """Median step time of one configuration, with the execution-record analysis of its timed steps and,
    for the processes ``pids`` (driver, then the stage workers), their CPU time and page faults per step."""
    from torch.distributed.optim import DistributedOptimizer

    x, y = data
    with make_pipe(names, model, balance, chunks, checkpoint, microbatches_per_message) as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=LR)
        for _ in range(warmup):
            _step(pipe, opt, x, y, loss_fn)
        pipe.execution_record(clear=True)
        steps = []
        before = [proc_stat(p) for p in pids]
        for _ in range(repeats):
            t0 = time.perf_counter()
            marks = _step(pipe, opt, x, y, loss_fn)
            marks["elapsed"] = time.perf_counter() - t0
            steps.append(marks)
        cpu = proc_delta(before, [proc_stat(p) for p in pids], repeats) if pids else None
        events = pipe.execution_record(clear=True)
        if timeline:
            from rrefpipe.timeline import write_timeline

            last = max(e.step for e in events)
            write_timeline([e for e in events if e.step == last], timeline)
    step = summary([s["elapsed"] for s in steps])
    return {"chunks": chunks, "checkpoint": checkpoint, "step": step,
            "samples_per_s": len(x) / (step["median_ms"] / 1e3),
            "record_ms": busy_ms(events), "steps_total_ms": ms(sum(s["elapsed"] for s in steps)),
            "record": analyse_steps(events, steps, len(balance)), "timeline": timeline, "cpu": cpu}


def memory_by_mode(names: Sequence[str], model: nn.Sequential, balance: Sequence[int], data: tuple[Tensor, Tensor],
                   loss_fn: Callable[[Tensor, Tensor], Tensor], chunks: int, modes: Sequence[str],
                   input_bytes: Sequence[int]) -> dict[str, Any]:
    """Peak bytes kept for backward on each stage worker during one step, per checkpoint mode.

    Tracking (``rrefpipe.memory``) hooks every module call on the workers, so it runs here, apart from
    the timed steps, and is switched off afterwards. ``input_bytes``: each stage's whole-batch input.
    """
    from torch.distributed.optim import DistributedOptimizer

    from rrefpipe import memory

    workers = list(names[:len(balance)])
    x, y = data
    out: dict[str, Any] = {"chunks": chunks, "stage_input_bytes": list(input_bytes), "peak_bytes": {}}
    memory.track_workers(workers)
    try:
        for mode in modes:
            with make_pipe(names, model, balance, chunks, mode) as pipe:
                opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=LR)
                _step(pipe, opt, x, y, loss_fn)  # warm-up, not counted
                memory.worker_reports(workers, reset=True)
                _step(pipe, opt, x, y, loss_fn)
                out["peak_bytes"][mode] = [r.saved_peak for r in memory.worker_reports(workers)]
    finally:
        for future in [rpc.rpc_async(w, memory.stop_tracking) for w in workers]:
            future.wait()
    never = out["peak_bytes"].get("never")
    for mode, peaks in out["peak_bytes"].items():
        if never:
            out.setdefault("over_never", {})[mode] = [p / q if q else None for p, q in zip(peaks, never)]
        out.setdefault("over_inputs", {})[mode] = [p / b if b else None for p, b in zip(peaks, input_bytes)]
    return out


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least-squares ``y = intercept + slope * x`` and its R²."""
    slope, intercept = statistics.linear_regression(xs, ys)
    mean = statistics.fmean(ys)
    total = sum((y - mean) ** 2 for y in ys)
    resid = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    return {"slope": slope, "intercept": intercept, "r2": 1.0 - resid / total if total else 1.0}


def scaling(names: Sequence[str], model: nn.Sequential, balance: Sequence[int], data: tuple[Tensor, Tensor],
            loss_fn: Callable[[Tensor, Tensor], Tensor], chunks: Sequence[int], micro_batch: int, checkpoint: str,
            warmup: int, repeats: int, compute_repeats: int, cliff: float = 1.25) -> dict[str, Any]:
    """Step time against the number of micro-batches ``m`` at a fixed micro-batch size (the mini-batch
    is ``m x micro_batch`` samples, tiled from ``data``), so every micro-batch is the same work and the
    step should cost ``a + b m``: a linear fit over all ``m`` and over ``m >= 8``, and the worst point
    relative to the latter (a cliff). (With a fixed mini-batch instead, the micro-batch shrinks as m
    grows and its compute per sample changes with the matmul kernel MKL picks for 1, 2, 4... rows, which
    says nothing about rrefpipe.) Each point also gets ``ideal@mb``, the bubble model on the compute of
    one micro-batch timed in this process, and ``overhead`` = step - ideal@mb."""
    from bench_core import ideal_step_ms, stage_compute

    def tiled(t: Tensor, rows: int) -> Tensor:
        return t.repeat(-(-rows // len(t)), *([1] * (t.dim() - 1)))[:rows].contiguous()

    costs = stage_compute(model, balance, tiled(data[0], micro_batch), micro_batch, 3, max(compute_repeats, 20))
    recomputed = {"never": lambda m: 0, "except_last": lambda m: m - 1, "always": lambda m: m}[checkpoint]
    rows = []
    for m in chunks:
        batch = (tiled(data[0], m * micro_batch), tiled(data[1], m * micro_batch))
        r = time_pipe(names, model, balance, batch, loss_fn, m, checkpoint, warmup, repeats)
        ideal = ideal_step_ms(costs, m, recomputed(m), True)
        rows.append({"chunks": m, "batch": m * micro_batch, "step_ms": r["step"]["median_ms"],
                     "p10_ms": r["step"]["p10_ms"], "p90_ms": r["step"]["p90_ms"], "samples_per_s": r["samples_per_s"],
                     "ideal_mb_ms": ideal, "overhead_ms": r["step"]["median_ms"] - ideal})
        print(f"  scaling chunks={m}: {r['step']['median_ms']:.0f} ms/step, ideal@mb {ideal:.0f} ms", flush=True)
    out: dict[str, Any] = {"checkpoint": checkpoint, "balance": list(balance), "micro_batch": micro_batch,
                           "rows": rows, "cliff_threshold": cliff}
    xs, ys = [r["chunks"] for r in rows], [r["step_ms"] for r in rows]
    if len(xs) >= 3:
        out["fit_all"] = linear_fit(xs, ys)
        out["fit_overhead"] = linear_fit(xs, [r["overhead_ms"] for r in rows])
    tail = [(x, y) for x, y in zip(xs, ys) if x >= 8]
    if len(tail) >= 3:
        fit = linear_fit([x for x, _ in tail], [y for _, y in tail])
        out["fit_m_ge_8"] = fit
        # A cliff is a jump in what one more micro-batch costs: compare each step between neighbouring
        # points, (step(m2) - step(m1)) / (m2 - m1), with the fitted slope.
        marginal = [((b[1] - a[1]) / (b[0] - a[0]), b[0]) for a, b in zip(tail, tail[1:])]
        worst_cost, worst_m = max(marginal)
        out["worst_marginal"] = {"chunks": worst_m, "ms_per_microbatch": worst_cost, "ratio": worst_cost / fit["slope"]}
    return out


def rpc_floor(worker: str, shapes: Sequence[tuple[int, ...]], repeats: int) -> dict[str, float]:
    """Median ms of a raw ``rpc_sync(worker, torch.numel, args=(t,))`` per tensor shape (the tensor one way)."""
    from bench_core import time_calls

    out = {}
    for shape in sorted(set(shapes)):
        t = torch.randn(shape)
        out["x".join(map(str, shape))] = ms(statistics.median(
            time_calls(lambda: rpc.rpc_sync(worker, torch.numel, args=(t,)), 3, repeats)))
    return out
