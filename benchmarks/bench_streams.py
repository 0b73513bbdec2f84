"""Issue 50: continuous pipelines measured: ``train_stream`` under PipeDream-2BW, PipeDream and PipeMare
against the synchronous 1F1B loop, ``pipe.stream`` against a loop of ``pipe(x)``, both against the
physical limit, the in-flight bound, and each rule's weight memory against its formula.

``python benchmarks/bench_streams.py`` (5-7 minutes on 2 CPU cores, more while other work runs;
``--quick``: a smoke run of about 15 s on a tiny model) prints tables and a targets block and writes
``/tmp/rrefpipe-bench/streams.json`` (``--out``). Two stage workers (``workers.LocalWorkers(2,
threads=1)``: 1 intra-op thread each, as every benchmark here) and this process as the driver (1
intra-op thread); every pipe is
``Pipe(model, chunks=m, balance=[L, L], schedule=..., checkpoint='never')`` (a stream does not recompute
ahead, so neither side checkpoints) on the same model, mini-batch and split: ``--blocks`` x
(Linear(``--width``) + ReLU), ``--blocks``/2 blocks per stage, batch ``--batch`` (default 8 x
Linear(1024), batch 128: a stage's forward of one micro-batch takes 4-8 ms at m = 4 and its backward
twice that, 1 thread, against about 1 ms per message between processes), plain
SGD (lr 1e-4: the weights barely move, so every contestant computes on the same numbers),
cross-entropy. For each m in ``--chunks`` (4, 8), in ``--rounds`` rounds whose order is reversed
every other round and at every other m (so a steady drift of the machine's speed hits all alike):

1. **Training throughput.** Each contestant runs one stream of ``--warmup`` + ``--batches`` batches
   (the same ``(x, y)`` each time) per round; its time is from the loss of the last warm-up batch
   to the loss of the last batch, so the pipeline is full and the drain is left out:

   * ``1f1b``: ``pipe.train_stream`` under ``'1F1B'``, which is exactly the loop of ``train_step`` and
     ``optimizer.step(context_id)`` per batch (each step fills and drains the pipeline);
   * ``1f1b_aa``: the same on a second pipe of the same workers, the **A/A control** (its ratio to
     ``1f1b`` is what the machine's noise and its place in the round do to two equal contestants);
   * ``2bw``, ``pipedream``, ``pipemare``: ``train_stream`` under ``'PipeDream-2BW'``, ``'PipeDream'``,
     ``'PipeMare'``; every optimizer is the pipe's own (``pipe.optimizer(torch.optim.SGD, ...)``).

2. **Inference throughput**, under ``torch.no_grad()``, on the ``1f1b`` pipe (``loop_aa`` on the
   control's): ``loop`` is ``pipe(x).local_value()`` per input, ``loop_aa`` the same (A/A control),
   ``stream`` is ``pipe.stream(inputs)`` with its default in-flight bound K = ceil((n - 1)/m) + 2, and
   ``stream_k1`` the same with ``in_flight=K + 1`` (4, the in-flight bound: does one more batch
   help?). Timed as in 1 from the last warm-up output to the last output.

3. **Physical limit**, timed in every round beside the contestants, in this process, 1 intra-op thread,
   on a copy of the same model: training, one micro-batched step (``sched_zero_bubble.physical_step``:
   ``zero_grad``, then forward, loss and backward of each of the m micro-batches, then the SGD step);
   inference, the m micro-batches' forwards under ``no_grad``. Each one's median (all rounds' repeats
   pooled) divided by the 2 stages is the physical limit: two workers cannot do a batch's work faster
   unless they compute faster than this process. ``ach/phys`` = a contestant's batches/s over the
   limit's. (The same step as ``sched_zero_bubble.physical_step``, timed here with its CPU.)

4. **Weight memory** (``--memory-chunks``, 4): for PipeDream-2BW, PipeDream, PipeDream with
   ``vertical_sync=True`` and PipeMare, each with the stream's rollback (the default: undo records of
   the last ``streaming.undo_depth(n, m)`` updates) and with ``train_stream(rollback=False)``, a stream
   of ``--memory-batches`` batches with a probe installed on each worker over RPC (``on_worker``; no
   change to rrefpipe): it wraps ``rrefpipe.stage_side.versions.StageWeights.leaves`` and ``.update`` in that
   worker process and, after each call, counts the bytes of the distinct storages holding the stage's
   weights. ``steady``: the live parameters, the kept versions and the leaves of every batch still in
   flight, the most over the stream after each ``leaves`` and each update (not counting the
   just-applied batch's leaves, dropped as the update returns); ``+undo``: the same with the
   pre-update weights ``update`` returned while the undo records keep them; ``peak``: all of it with
   the applied batch's leaves, i.e. during the update's copy-on-write. All in units of the stage's
   weight bytes (``buffers``), against ``rrefpipe.schedule.weight_buffers(schedule, stages, j,
   chunks)`` (the formula, for ``steady``).

Also, per m, the **simulated ceiling**: ``rrefpipe.schedule.simulate`` of each rule's stream
(``stream_orders``, ``--batches`` batches; the forward-only stream for inference) against as many
flushed 1F1B steps (``worker_orders``; GPipe's forwards for the ``pipe(x)`` loop), with F and B the
stages' forward and backward of one micro-batch timed in this process (``bench_core.stage_compute``,
mean of the two stages), transfers, the loss, the optimizer step and the driver free. It is what the
schedules alone allow; a measured ratio above it comes from what the loop pays per step beyond the
bubble (its optimizer RPC, the driver's round trips).

``cores``: the CPU time of the driver and both workers over a contestant's timed window, over the
window (``/proc``): with 3 processes on 2 cores, a contestant near 2.0 is bound by the cores, and one
that needs more CPU per batch than another pays for it in time. ``cpu/b``: that CPU per batch (ms),
against the one-process step's (``phys cpu``).

Statistics: a cell's batches/s is all its rounds' timed batches over their summed time; a cell's
ratio is one contestant's over another's; beside it the geometric mean of the rounds' ratios (each
round's two contestants ran minutes apart at most) and the standard error of their mean log (``+-``,
about a relative error). Over the cells (m), the geometric mean of the cells' ratios and its standard
error. Targets (issue 50; reported, never asserted): PipeDream-2BW / 1F1B >= 1.15 geometric mean over
m; stream / ``pipe(x)`` loop >= 1.15; achieved / physical >= 0.90 for both; each rule's steady weight
buffers <= the formula on every stage. The load average is recorded at the start and end of the run
and each cell: on 2 shared cores, look at it, and at the A/A control, before reading any ratio.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's rrefpipe and workers (the stage workers use it too)

import cloudpickle  # noqa: E402
import torch  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from bench_core import (exit_without_teardown, loadavg, machine_info, ms, one_process_step, stage_compute,  # noqa: E402
                        summary)
from bench_suite import add_run_args, log, new_parser, print_written, run_and_report  # noqa: E402
from suite_record import proc_delta, proc_stat  # noqa: E402
from suite_report import cpu_total_ms  # noqa: E402
from suite_targets import print_targets  # noqa: E402

if __name__ != "__main__":  # the worker-side probes travel by value (run as a script, __main__ does anyway)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

DEFAULT_OUT = Path("/tmp/rrefpipe-bench/streams.json")
STAGES = 2
LR = 1e-4
CHUNKS = (4, 8)
#: Training contestants: the schedule each pipe runs. ``1f1b_aa`` is the A/A control (a second pipe).
TRAIN = {"1f1b": "1F1B", "2bw": "PipeDream-2BW", "1f1b_aa": "1F1B", "pipedream": "PipeDream",
         "pipemare": "PipeMare"}
#: Inference contestants: (the training contestant whose pipe runs it, streamed?, extra in-flight batches).
INFER = {"loop": ("1f1b", False, 0), "stream": ("1f1b", True, 0), "loop_aa": ("1f1b_aa", False, 0),
         "stream_k1": ("1f1b", True, 1)}
PHYS_TRAIN, PHYS_FWD = "phys_train", "phys_fwd"
#: A round, in order (reversed every other round and at every other m): the controls one place away
#: from what they control.
ROUND = ("1f1b", "2bw", "1f1b_aa", "pipedream", "pipemare", PHYS_TRAIN, "loop", "stream", "loop_aa", "stream_k1",
         PHYS_FWD)
LABELS = {"1f1b": "1F1B", "1f1b_aa": "A/A", "2bw": "2BW", "pipedream": "PD", "pipemare": "PM", "loop": "loop",
          "loop_aa": "A/A", "stream": "stream", "stream_k1": "K+1"}
#: Memory section: (schedule, vertical_sync).
MEMORY = {"2bw": ("PipeDream-2BW", False), "pipedream": ("PipeDream", False), "pipedream_vs": ("PipeDream", True),
          "pipemare": ("PipeMare", False)}


# -- the model ----------------------------------------------------------------------------------------
def build_model(width: int, blocks: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[layer for _ in range(blocks) for layer in (nn.Linear(width, width), nn.ReLU())])


def make_data(width: int, batch: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, width, generator=gen), torch.randint(0, width, (batch,), generator=gen)


def balance(blocks: int) -> list[int]:
    """Layers per stage: half the (Linear, ReLU) blocks each."""
    return [2 * (blocks // 2), 2 * (blocks - blocks // 2)]


def weight_bytes(model: nn.Sequential, bal: Sequence[int]) -> list[int]:
    out, start = [], 0
    for size in bal:
        out.append(sum(p.numel() * p.element_size() for p in model[start:start + size].parameters()))
        start += size
    return out


def make_pipe(names: Sequence[str], model: nn.Sequential, bal: Sequence[int], chunks: int, schedule: str,
              vertical_sync: bool = False) -> Any:
    from rrefpipe import Pipe

    return Pipe(copy.deepcopy(model), chunks=chunks, balance=list(bal), workers=list(names[:STAGES]),
                schedule=schedule, checkpoint="never", vertical_sync=vertical_sync)


# -- timing a stream -----------------------------------------------------------------------------------
def time_stream(results: Iterator[Any], warmup: int, batches: int, pids: Sequence[int]) -> dict[str, Any]:
    """Pull ``warmup + batches`` results; the timed window runs from the last warm-up result to the last
    result (``batches`` intervals), and the CPU of ``pids`` is read at both ends of it. What ``results``
    does after its last result (a stream's drain) is not timed."""
    stamps: list[float] = []
    before = after = None
    total = warmup + batches
    for k, _ in enumerate(results):
        stamps.append(time.perf_counter())
        if k == warmup - 1:
            before = [proc_stat(p) for p in pids]
        if k == total - 1:
            after = [proc_stat(p) for p in pids]
    if len(stamps) != total or before is None or after is None:
        raise RuntimeError(f"the stream gave {len(stamps)} results of {total}")
    window = stamps[-1] - stamps[warmup - 1]
    gaps = [b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:])]
    return {"batches": batches, "seconds": window, "batches_per_s": batches / window, "interval": summary(gaps),
            "cpu": proc_delta(before, after, batches)}


def repeat(item: Any, count: int) -> Iterator[Any]:
    for _ in range(count):
        yield item


def train_round(pipe: Any, opt: Any, data: tuple[Tensor, Tensor], args: argparse.Namespace,
                pids: Sequence[int]) -> dict[str, Any]:
    return time_stream(pipe.train_stream(repeat(data, args.warmup + args.batches), F.cross_entropy, opt),
                       args.warmup, args.batches, pids)


def infer_round(pipe: Any, x: Tensor, streamed: bool, in_flight: int | None, args: argparse.Namespace,
                pids: Sequence[int]) -> dict[str, Any]:
    count = args.warmup + args.batches
    with torch.no_grad():
        if streamed:
            results: Iterator[Any] = pipe.stream(repeat(x, count), in_flight=in_flight)
        else:
            results = (pipe(x).local_value() for _ in range(count))
        return time_stream(results, args.warmup, args.batches, pids)


# -- the physical limit --------------------------------------------------------------------------------
def physical_train(model: nn.Sequential, data: tuple[Tensor, Tensor], chunks: int, warmup: int,
                   repeats: int) -> dict[str, Any]:
    """One process's micro-batched step (``bench_core.one_process_step``), 1 intra-op thread."""
    return _timed(one_process_step(model, data, F.cross_entropy, chunks, LR), warmup, repeats)


def physical_forward(model: nn.Sequential, x: Tensor, chunks: int, warmup: int, repeats: int) -> dict[str, Any]:
    """One process's forward of the m micro-batches of ``x`` under ``no_grad``, 1 intra-op thread."""
    model = copy.deepcopy(model)
    xs = x.tensor_split(chunks)

    def forward() -> None:
        with torch.no_grad():
            for xi in xs:
                model(xi)

    return _timed(forward, warmup, repeats)


def _timed(fn: Callable[[], None], warmup: int, repeats: int) -> dict[str, Any]:
    """``fn``'s wall time per call (``summary``) and this process's CPU ms per call over the timed calls,
    1 intra-op thread."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(warmup):
            fn()
        times = []
        before = proc_stat(os.getpid())
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        after = proc_stat(os.getpid())
    finally:
        torch.set_num_threads(saved)
    cpu = None if before is None or after is None else (after[0] + after[1] - before[0] - before[1]) / repeats
    return {"step": summary(times), "cpu_ms_per_step": cpu}


def physical_row(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' one-process steps pooled (every timed repeat), and the limit: their median / stages."""
    one = summary([t / 1e3 for r in rounds for t in r["step"]["samples_ms"]])
    step_ms = one["median_ms"] / STAGES
    cpu = [r["cpu_ms_per_step"] for r in rounds if r.get("cpu_ms_per_step") is not None]
    return {"one_process": one, "stages": STAGES, "physical_ms_per_batch": step_ms, "batches_per_s": 1e3 / step_ms,
            "round_medians_ms": [r["step"]["median_ms"] for r in rounds],
            "cpu_ms_per_step": statistics.median(cpu) if cpu else None}


# -- the simulated ceiling ----------------------------------------------------------------------------
def simulated(costs: list[dict[str, float]], chunks: int, batches: int) -> dict[str, Any]:
    """Each rule's stream over as many flushed 1F1B steps, and the forward-only stream over as many
    GPipe forwards (``pipe(x)``), at the measured per-micro-batch costs (mean over the stages); and each
    stream's makespan against the work over the 2 workers (its own achieved/physical, transfers free)."""
    from rrefpipe.schedule import simulate, stream_orders, worker_orders

    f = statistics.fmean(c["forward_ms"] for c in costs)
    b = statistics.fmean(c["backward_ms"] for c in costs)
    cost = {"F": max(f, 1e-6), "B": max(b, 1e-6)}
    flushed = batches * simulate(worker_orders("1F1B", STAGES, chunks), cost).makespan
    out: dict[str, Any] = {"costs_ms": cost, "batches": batches, "train": {}, "infer": {}}
    work = batches * chunks * STAGES * (cost["F"] + cost["B"])
    for key, schedule in TRAIN.items():
        if schedule == "1F1B":
            continue
        span = simulate(stream_orders(schedule, STAGES, chunks, batches), cost).makespan
        out["train"][key] = {"over_1f1b": flushed / span, "over_physical": work / (STAGES * span)}
    out["train"]["1f1b"] = {"over_1f1b": 1.0, "over_physical": work / (STAGES * flushed)}
    fwd = {"F": cost["F"]}
    loop = batches * simulate(stream_orders("1F1B", STAGES, chunks, 1, forward_only=True), fwd).makespan  # pipe(x)
    span = simulate(stream_orders("1F1B", STAGES, chunks, batches, forward_only=True), fwd).makespan
    fwork = batches * chunks * STAGES * cost["F"]
    out["infer"] = {"stream_over_loop": loop / span, "stream_over_physical": fwork / (STAGES * span),
                    "loop_over_physical": fwork / (STAGES * loop)}
    return out


# -- weight memory: a probe on each worker --------------------------------------------------------------
_CALL = "__import__('cloudpickle').loads(fn)(*args)"


def on_worker(worker: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on ``worker``, ``fn`` sent by value (cloudpickle) through the builtin ``eval``: a
    stage worker imports rrefpipe, not this file."""
    return rpc.rpc_sync(worker, eval, args=(_CALL, {"fn": cloudpickle.dumps(fn), "args": args}))


def _install_weight_probe() -> None:
    """(On a worker.) Wrap ``StageWeights.leaves`` and ``.update``: after each call, count the bytes of the
    distinct storages that hold the stage's weights: the live parameters, the kept versions and the leaves
    of the batches still in flight (``steady``: the versions; after an update, without the leaves of the
    batch it applied, which go as it returns), the same plus the pre-update weights ``update`` returned
    for the stream's undo records while they live (``undo``), and everything, the applied batch's leaves
    included (``peak``: during the update's copy-on-write); the most of each per stage, keyed by the
    stage's first Parameter."""
    import weakref

    from rrefpipe.stage_side.versions import StageWeights

    if getattr(StageWeights, "_bench_probe", None) is not None:
        return
    stats: dict[int, dict[str, Any]] = {}
    tracked: dict[tuple[int, str], list[Any]] = {}  # (id(StageWeights), 'leaves' | 'undo') -> weakrefs
    original = {"leaves": StageWeights.leaves, "update": StageWeights.update}

    def alive(sw: Any, kind: str) -> list[Tensor]:
        out = [t for t in (r() for r in tracked.get((id(sw), kind), [])) if t is not None]
        tracked[(id(sw), kind)] = [weakref.ref(t) for t in out]
        return out

    def held(sw: Any, skip: set[int], undo: bool, fresh: Sequence[Tensor] = ()) -> int:
        tensors = [p.data for p in sw.params.values()] + [t for v in sw.kept.values() for t in v.values()]
        tensors += [t for t in alive(sw, "leaves") if id(t) not in skip] + (alive(sw, "undo") if undo else [])
        storages = {}
        for t in [*tensors, *fresh]:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())

    def record(sw: Any, applied: set[int], fresh: Sequence[Tensor]) -> None:
        """``applied``: the leaves of the batch an update just applied; ``fresh``: the weights it returned,
        counted in ``undo`` from the next call on if an undo record still holds them then."""
        key = id(next(iter(sw.params.values())))
        row = stats.setdefault(key, {"steady_bytes": 0, "undo_bytes": 0, "peak_bytes": 0, "samples": 0})
        for name, n in (("steady_bytes", held(sw, applied, False)), ("undo_bytes", held(sw, applied, True)),
                        ("peak_bytes", held(sw, set(), True, fresh))):
            row[name] = max(row[name], n)
        row["samples"] += 1

    def leaves(self: Any, version: int) -> Any:
        out = original["leaves"](self, version)
        tracked.setdefault((id(self), "leaves"), []).extend(weakref.ref(t) for t in out.values())
        record(self, set(), ())
        return out

    def update(self: Any, applied: dict[str, Tensor], step: Any, **kwargs: Any) -> Any:
        before = original["update"](self, applied, step, **kwargs)
        fresh = list(before.values()) if isinstance(before, dict) else []  # (what an undo record may keep)
        record(self, {id(t) for t in applied.values()}, fresh)
        tracked.setdefault((id(self), "undo"), []).extend(weakref.ref(t) for t in fresh)
        return before

    StageWeights.leaves, StageWeights.update = leaves, update
    StageWeights._bench_probe = (stats, original)


def _weight_probe_report(pipe_id: str, stages: Sequence[int], remove: bool) -> dict[int, dict[str, Any]]:
    """(On a worker.) The probe's counts for this worker's stages of ``pipe_id``, with each stage's weight
    bytes; ``remove``: restore ``StageWeights`` as it was."""
    from rrefpipe.stage_side import server
    from rrefpipe.stage_side.versions import StageWeights

    stats, original = StageWeights._bench_probe
    out = {}
    for j in stages:
        module = server._server(pipe_id, j).stage.module
        params = dict(module.named_parameters())
        row = dict(stats.get(id(next(iter(params.values()))),
                             {"steady_bytes": 0, "undo_bytes": 0, "peak_bytes": 0, "samples": 0}))
        row["weight_bytes"] = sum(p.numel() * p.element_size() for p in params.values())
        out[j] = row
    if remove:
        StageWeights.leaves, StageWeights.update = original["leaves"], original["update"]
        StageWeights._bench_probe = None
    return out


def weight_memory(names: Sequence[str], model: nn.Sequential, bal: Sequence[int], data: tuple[Tensor, Tensor],
                  chunks: int, batches: int) -> list[dict[str, Any]]:
    """For each rule, with the stream's rollback (its undo records; the default) and without
    (``train_stream(rollback=False)``), a stream of ``batches`` batches with the probe on both workers:
    each stage's most weight bytes held (steady, with the undo records, peak), in buffers, against
    ``weight_buffers``."""
    from rrefpipe.driver_side import streaming
    from rrefpipe.schedule import weight_buffers

    rows = []
    for key, (schedule, vsync) in MEMORY.items():
        for rollback in (True, False):
            depth = getattr(streaming, "undo_depth", lambda n, m: 0)(STAGES, chunks) if rollback else 0
            row: dict[str, Any] = {"key": key, "schedule": schedule, "vertical_sync": vsync, "chunks": chunks,
                                   "batches": batches, "rollback": rollback, "undo_depth": depth, "stages": []}
            try:
                for w in names[:STAGES]:
                    on_worker(w, _install_weight_probe)
                with make_pipe(names, model, bal, chunks, schedule, vsync) as pipe:
                    opt = pipe.optimizer(torch.optim.SGD, lr=LR)
                    kwargs = {} if rollback else {"rollback": False}
                    for _ in pipe.train_stream(repeat(data, batches), F.cross_entropy, opt, **kwargs):
                        pass
                    for j, w in enumerate(names[:STAGES]):
                        probe = on_worker(w, _weight_probe_report, pipe._driver.pipe_id, [j], True)[j]
                        formula = weight_buffers(schedule, STAGES, j, chunks, vertical_sync=vsync)
                        wb = probe["weight_bytes"]
                        row["stages"].append({
                            "stage": j, "weight_bytes": wb, "formula_buffers": formula, "formula_bytes": formula * wb,
                            **{f"{k}_bytes": probe[f"{k}_bytes"] for k in ("steady", "undo", "peak")},
                            **{f"{k}_buffers": probe[f"{k}_bytes"] / wb for k in ("steady", "undo", "peak")},
                            "samples": probe["samples"], "within_formula": probe["steady_bytes"] <= formula * wb})
            except Exception as exc:  # reported, not fatal
                log(f"  memory {key} rollback={rollback} failed: {exc!r}")
                row["error"] = repr(exc)[-2000:]
                for w in names[:STAGES]:
                    with contextlib.suppress(Exception):
                        on_worker(w, _weight_probe_report, "", [], True)
            rows.append(row)
            if "error" not in row:
                log(f"  memory {key} rollback={rollback}: steady "
                    + " / ".join(f"{s['steady_buffers']:.2f}" for s in row["stages"]) + ", with undo records "
                    + " / ".join(f"{s['undo_buffers']:.2f}" for s in row["stages"]) + " buffers, formula "
                    + " / ".join(str(s["formula_buffers"]) for s in row["stages"]))
    return rows


# -- a cell: one chunk count ------------------------------------------------------------------------
def run_cell(names: Sequence[str], pids: Sequence[int], model: nn.Sequential, bal: Sequence[int],
             data: tuple[Tensor, Tensor], m: int, k: int, args: argparse.Namespace) -> dict[str, Any]:
    from rrefpipe.driver_side.streaming import default_in_flight

    load = loadavg()
    rounds: dict[str, list[dict[str, Any]]] = {key: [] for key in ROUND}
    in_flight = default_in_flight(STAGES, m)
    with contextlib.ExitStack() as stack:
        pipes, opts = {}, {}
        for key in TRAIN:
            pipes[key] = stack.enter_context(make_pipe(names, model, bal, m, TRAIN[key]))
            opts[key] = pipes[key].optimizer(torch.optim.SGD, lr=LR)
        if not args.quick:  # one untimed stream per pipe: the first run of a configuration is slower
            for key in TRAIN:
                for _ in pipes[key].train_stream(repeat(data, args.warmup), F.cross_entropy, opts[key]):
                    pass
        for r in range(args.rounds):
            for key in (ROUND if (k + r) % 2 == 0 else ROUND[::-1]):
                try:
                    if key == PHYS_TRAIN:
                        row = physical_train(model, data, m, 1, args.physical_repeats)
                    elif key == PHYS_FWD:
                        row = physical_forward(model, data[0], m, 1, args.physical_repeats)
                    elif key in TRAIN:
                        row = train_round(pipes[key], opts[key], data, args, pids)
                    else:
                        owner, streamed, extra = INFER[key]
                        row = infer_round(pipes[owner], data[0], streamed, in_flight + extra if streamed else None,
                                          args, pids)
                except Exception as exc:  # a contestant that fails is a row with an error, not a lost run
                    log(f"  m={m} {key} failed: {exc!r}")
                    row = {"error": repr(exc)[-2000:]}
                rounds[key].append(row)
                if "error" not in row:
                    what = (f"{row['step']['median_ms']:.1f} ms one process" if key in (PHYS_TRAIN, PHYS_FWD) else
                            f"{row['batches_per_s']:.2f} batches/s")
                    log(f"  m={m} round {r + 1} {key}: {what}")
    cell: dict[str, Any] = {"chunks": m, "in_flight": in_flight, "loadavg_start": load}
    cell["physical"] = {"train": physical_row(rounds.pop(PHYS_TRAIN)), "infer": physical_row(rounds.pop(PHYS_FWD))}
    cell["contestants"] = {key: pooled(rows) for key, rows in rounds.items()}
    for key, row in cell["contestants"].items():
        if "error" in row:
            continue
        phys = cell["physical"]["train" if key in TRAIN else "infer"]
        row["achieved_over_physical"] = row["batches_per_s"] / phys["batches_per_s"]
    cell["ratios"], cell["round_ratios"] = ratios(cell["contestants"])
    cell["loadavg_end"] = loadavg()
    return cell


def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A contestant's rounds: batches/s over all their timed batches, the intervals and CPU pooled."""
    failed = next((row for row in rows if "error" in row), None)
    if failed is not None:
        return failed
    batches = sum(r["batches"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    cpu = [cpu_total_ms(r["cpu"]) for r in rows]
    per_process = None
    if all(r["cpu"] for r in rows):
        per_process = [statistics.fmean(r["cpu"]["user_ms"][p] + r["cpu"]["sys_ms"][p] for r in rows)
                       for p in range(len(rows[0]["cpu"]["user_ms"]))]
    out = {"batches": batches, "seconds": seconds, "batches_per_s": batches / seconds,
           "ms_per_batch": ms(seconds / batches),
           "round_batches_per_s": [r["batches_per_s"] for r in rows],
           "interval": summary([t / 1e3 for r in rows for t in r["interval"]["samples_ms"]]),
           "cpu_ms_per_batch": statistics.fmean(c for c in cpu if c is not None) if None not in cpu else None,
           "cpu_ms_per_batch_by_process": per_process}
    if out["cpu_ms_per_batch"] is not None:
        out["cores"] = out["cpu_ms_per_batch"] / out["ms_per_batch"]
    return out


#: (numerator, denominator) of every ratio a cell reports.
RATIOS = {"2bw/1f1b": ("2bw", "1f1b"), "pipedream/1f1b": ("pipedream", "1f1b"), "pipemare/1f1b": ("pipemare", "1f1b"),
          "aa/1f1b": ("1f1b_aa", "1f1b"), "stream/loop": ("stream", "loop"), "aa/loop": ("loop_aa", "loop"),
          "k1/stream": ("stream_k1", "stream")}


def ratios(c: dict[str, dict[str, Any]]) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """Each ratio of pooled batches/s, and the geometric mean of the rounds' ratios with its standard error."""
    cell, by_round = {}, {}
    for name, (a, b) in RATIOS.items():
        ra, rb = c.get(a) or {}, c.get(b) or {}
        if "batches_per_s" not in ra or "batches_per_s" not in rb:
            continue
        cell[name] = ra["batches_per_s"] / rb["batches_per_s"]
        by_round[name] = gm_se([x / y for x, y in zip(ra["round_batches_per_s"], rb["round_batches_per_s"])])
    return cell, by_round


def gm_se(values: Sequence[float]) -> dict[str, Any]:
    """Geometric mean and the standard error of the mean log (None for one value)."""
    logs = [math.log(v) for v in values]
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else None
    return {"gm": math.exp(statistics.fmean(logs)), "se": se, "n": len(logs), "min": min(values), "max": max(values)}


# -- the run ------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    from workers import LocalWorkers

    result: dict[str, Any] = {"loadavg_start": loadavg(), "source_start": source_state()}
    log(f"load average at start: {result['loadavg_start']}; rrefpipe at {result['source_start']}")
    torch.set_num_threads(1)  # the driver, like each stage worker
    model = build_model(args.width, args.blocks)
    bal = balance(args.blocks)
    data = make_data(args.width, args.batch)
    result["model"] = {"description": f"{args.blocks} x (Linear({args.width}) + ReLU), batch {args.batch}, "
                                      "cross-entropy, SGD", "balance": bal, "batch": args.batch,
                       "weight_bytes": weight_bytes(model, bal)}
    log("per-stage compute at each micro-batch size (1 thread, this process) ...")
    result["stage_compute"] = {str(m): stage_compute(model, bal, data[0], math.ceil(args.batch / m), 2,
                                                     args.physical_repeats) for m in args.chunks}
    result["simulated"] = {str(m): simulated(result["stage_compute"][str(m)], m, args.warmup + args.batches)
                           for m in args.chunks}
    with LocalWorkers(STAGES, threads=1) as cluster:
        result["machine"] = machine_info(torch.get_num_threads(), cluster.threads)
        pids = [os.getpid(), *cluster.pids[:STAGES]]
        result["cells"] = []
        for k, m in enumerate(args.chunks):
            log(f"m={m}: {args.rounds} rounds of {len(ROUND)} ...")
            result["cells"].append(run_cell(cluster.names, pids, model, bal, data, m, k, args))
        result["memory"] = []
        for m in args.memory_chunks:
            log(f"weight memory, m={m} ...")
            result["memory"] += weight_memory(cluster.names, model, bal, data, m, args.memory_batches)
    result["loadavg_end"] = loadavg()
    result["source_end"] = source_state()
    if result["source_end"] != result["source_start"]:
        log(f"rrefpipe changed during the run: now {result['source_end']}")
    return result


def source_state() -> dict[str, Any]:
    """The commit of this checkout and the files of rrefpipe/ and workers/ that differ from it: what the
    run measured (a tree edited during the run measured something in between)."""
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "?"

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "changed": git("status", "--porcelain", "--", "rrefpipe", "workers").splitlines()}


# -- targets -----------------------------------------------------------------------------------------
def _target(name: str, met: bool | None, detail: str, **numbers: Any) -> dict[str, Any]:
    return {"target": name, "met": met, "detail": detail, **numbers}


def _f(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def _pm(s: dict[str, Any]) -> str:
    return f"{s['gm']:.3f} +- {_f(s['se'], '.3f')} over {s['n']} (range {s['min']:.2f}-{s['max']:.2f})"


def cell_ratios(result: dict[str, Any], name: str) -> dict[str, float]:
    return {f"m={c['chunks']}": c["ratios"][name] for c in result["cells"] if name in c["ratios"]}


def speed_target(result: dict[str, Any], name: str, control: str, label: str, bar: float = 1.15) -> dict[str, Any]:
    title = f"speed: {label} >= {bar}, geometric mean over m"
    found, aa = cell_ratios(result, name), cell_ratios(result, control)
    if not found:
        return _target(title, None, "not measured")
    s = gm_se(list(found.values()))
    detail = f"{_pm(s)}; " + ", ".join(f"{c} {v:.3f}" for c, v in found.items())
    if aa:
        detail += f" | A/A control {_pm(gm_se(list(aa.values())))}"
    sims = [result["simulated"][str(c["chunks"])] for c in result["cells"]]
    key = {"2bw/1f1b": ("train", "2bw", "over_1f1b"), "stream/loop": ("infer", "stream_over_loop", None)}.get(name)
    if key and sims:
        vals = [s_[key[0]][key[1]][key[2]] if key[2] else s_[key[0]][key[1]] for s_ in sims]
        detail += f" | simulated ceiling (measured F, B; transfers free) {gm_se(vals)['gm']:.3f}"
    return _target(title, s["gm"] >= bar, detail, stats=s, control=gm_se(list(aa.values())) if aa else None)


def physical_target(result: dict[str, Any], key: str, label: str, bar: float = 0.90) -> dict[str, Any]:
    title = f"{label} achieved / physical limit >= {bar:.2f} (every m)"
    vals = {f"m={c['chunks']}": c["contestants"][key]["achieved_over_physical"] for c in result["cells"]
            if "achieved_over_physical" in c["contestants"].get(key, {})}
    if not vals:
        return _target(title, None, "not measured")
    cores = [f"m={c['chunks']} {_f(c['contestants'][key].get('cores'))}" for c in result["cells"]
             if key in c["contestants"]]
    detail = ", ".join(f"{c} {v:.2f}" for c, v in vals.items()) + f"; cores busy {', '.join(cores)}"
    # The CPU a batch took (driver and workers) against the one process's: even on 2 free cores a contestant
    # reaches at most their ratio of the limit (the machine's share aside, what the code itself costs).
    kind = "train" if key in TRAIN else "infer"
    cpu = {f"m={c['chunks']}": phys / mine for c in result["cells"]
           for phys, mine in [(c["physical"][kind].get("cpu_ms_per_step"), c["contestants"].get(key, {})
                               .get("cpu_ms_per_batch"))] if phys and mine}
    if cpu:
        detail += ("; one process's CPU per batch over the pipeline's (driver + workers), the most it could reach "
                   "with 2 free cores: " + ", ".join(f"{c} {v:.2f}" for c, v in cpu.items()))
    return _target(title, all(v >= bar for v in vals.values()), detail, cells=vals, cpu_bound=cpu)


def in_flight_target(result: dict[str, Any]) -> dict[str, Any]:
    title = "in-flight bound: stream with K + 1 batches in flight over the default K (reported)"
    found = cell_ratios(result, "k1/stream")
    if not found:
        return _target(title, None, "not measured")
    s = gm_se(list(found.values()))
    aa = cell_ratios(result, "aa/loop")
    # "Helps" only where it shows through the noise: in every cell the rounds' ratios above 1 by more than
    # twice their standard error, and over the cells further from 1 than the A/A control.
    rounds = [c["round_ratios"].get("k1/stream") for c in result["cells"]]
    clear = all(r is not None and r["se"] is not None and math.log(r["gm"]) > 2 * r["se"] for r in rounds)
    helps = clear and (not aa or math.log(s["gm"]) > abs(math.log(gm_se(list(aa.values()))["gm"])))
    detail = (f"K+1/K {_pm(s)}; " + ", ".join(
        f"m={c['chunks']} {c['ratios']['k1/stream']:.3f} (rounds {_f(r and r['gm'], '.3f')} +- "
        f"{_f(r and r['se'], '.3f')})" for c, r in zip(result["cells"], rounds) if "k1/stream" in c["ratios"])
              + f"; one more batch {'helps' if helps else 'does not help measurably'} (A/A loop "
              + (_pm(gm_se(list(aa.values()))) if aa else "n/a") + ")")
    return _target(title, None, detail, stats=s, helps=helps)


def memory_target(result: dict[str, Any]) -> dict[str, Any]:
    title = "weight memory: each rule's steady weight buffers <= weight_buffers(...) on every stage"
    rows = [r for r in result["memory"] if "error" not in r]
    if not rows:
        return _target(title, None, "not measured")
    parts = [f"{r['key']} m={r['chunks']} undo {r.get('undo_depth', '?')}: " + " / ".join(
        f"{s['steady_buffers']:.2f} (+undo {s.get('undo_buffers', 0.0):.2f}, peak {s['peak_buffers']:.2f}) vs "
        f"{s['formula_buffers']}" for s in r["stages"]) for r in rows]
    met = all(s["within_formula"] for r in rows for s in r["stages"])
    return _target(title, met, "; ".join(parts))


def evaluate(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [speed_target(result, "2bw/1f1b", "aa/1f1b", "train_stream PipeDream-2BW / 1F1B train_step loop"),
            speed_target(result, "stream/loop", "aa/loop", "pipe.stream / pipe(x) loop under no_grad"),
            physical_target(result, "2bw", "train_stream PipeDream-2BW"),
            physical_target(result, "stream", "pipe.stream"),
            in_flight_target(result), memory_target(result)]


# -- report -------------------------------------------------------------------------------------------
def _bps(c: dict[str, Any], key: str) -> str:
    return _f((c.get(key) or {}).get("batches_per_s"))


def _ach(c: dict[str, Any], key: str) -> str:
    return _f((c.get(key) or {}).get("achieved_over_physical"))


def _rr(cell: dict[str, Any], name: str) -> str:
    """A cell's ratio, with the standard error of its rounds' ratios."""
    v = cell["ratios"].get(name)
    if v is None:
        return "n/a"
    se = (cell["round_ratios"].get(name) or {}).get("se")
    return f"{v:.3f}" + (f"+-{se:.3f}" if se is not None else "")


def print_training(result: dict[str, Any]) -> None:
    keys = list(TRAIN)
    print(f"\nTraining: train_stream, batches/s (timed: {result['settings']['batches']} batches after "
          f"{result['settings']['warmup']}, x {result['settings']['rounds']} rounds); ratios +- the standard error of "
          "the rounds' ratios; sim = the schedules' ceiling at the measured F and B (transfers free); phys = the "
          "physical limit (one process's micro-batched step / 2)")
    print(f"  {'m':>2} | " + " ".join(f"{LABELS[k]:>5}" for k in keys) + f" {'phys':>5} | {'2BW/1F1B':>12} "
          f"{'PD/1F1B':>12} {'PM/1F1B':>12} {'A/A':>12} | {'sim 2BW':>7} | {'ach/phys: 1F1B':>14} {'2BW':>5} {'PD':>5} "
          f"{'PM':>5} | {'cores: 1F1B':>11} {'2BW':>4} | {'cpu/b: 1F1B':>11} {'2BW':>5} {'phys':>5} | {'load':>4}")
    for cell in result["cells"]:
        c, phys, sim = cell["contestants"], cell["physical"]["train"], result["simulated"][str(cell["chunks"])]
        print(f"  {cell['chunks']:>2} | " + " ".join(f"{_bps(c, k):>5}" for k in keys)
              + f" {phys['batches_per_s']:>5.2f} | {_rr(cell, '2bw/1f1b'):>12} {_rr(cell, 'pipedream/1f1b'):>12} "
              f"{_rr(cell, 'pipemare/1f1b'):>12} {_rr(cell, 'aa/1f1b'):>12} | "
              f"{sim['train']['2bw']['over_1f1b']:>7.3f} | "
              f"{_ach(c, '1f1b'):>14} {_ach(c, '2bw'):>5} {_ach(c, 'pipedream'):>5} {_ach(c, 'pipemare'):>5} | "
              f"{_f(c['1f1b'].get('cores')):>11} {_f(c['2bw'].get('cores')):>4} | "
              f"{_f(c['1f1b'].get('cpu_ms_per_batch'), '.0f'):>11} {_f(c['2bw'].get('cpu_ms_per_batch'), '.0f'):>5} "
              f"{_f(phys.get('cpu_ms_per_step'), '.0f'):>5} | {_f((cell['loadavg_start'] or [None])[0], '.1f'):>4}")


def print_inference(result: dict[str, Any]) -> None:
    keys = list(INFER)
    print("\nInference under no_grad: batches/s; loop = pipe(x).local_value() per input, stream = pipe.stream "
          "(in_flight K = default), K+1 = in_flight=K + 1; A/A = the loop on a second pipe")
    print(f"  {'m':>2} {'K':>2} | " + " ".join(f"{LABELS[k]:>6}" for k in keys) + f" {'phys':>6} | "
          f"{'stream/loop':>12} {'A/A':>12} {'K+1/K':>12} | {'sim':>5} | {'ach/phys: loop':>14} {'stream':>6} "
          f"{'K+1':>5} | {'cores: loop':>11} {'stream':>6} | {'cpu/b: loop':>11} {'stream':>6} {'phys':>5} | "
          f"{'load':>4}")
    for cell in result["cells"]:
        c, phys, sim = cell["contestants"], cell["physical"]["infer"], result["simulated"][str(cell["chunks"])]
        print(f"  {cell['chunks']:>2} {cell['in_flight']:>2} | " + " ".join(f"{_bps(c, k):>6}" for k in keys)
              + f" {phys['batches_per_s']:>6.2f} | {_rr(cell, 'stream/loop'):>12} {_rr(cell, 'aa/loop'):>12} "
              f"{_rr(cell, 'k1/stream'):>12} | {sim['infer']['stream_over_loop']:>5.3f} | {_ach(c, 'loop'):>14} "
              f"{_ach(c, 'stream'):>6} {_ach(c, 'stream_k1'):>5} | {_f(c['loop'].get('cores')):>11} "
              f"{_f(c['stream'].get('cores')):>6} | {_f(c['loop'].get('cpu_ms_per_batch'), '.0f'):>11} "
              f"{_f(c['stream'].get('cpu_ms_per_batch'), '.0f'):>6} {_f(phys.get('cpu_ms_per_step'), '.0f'):>5} | "
              f"{_f((cell['loadavg_start'] or [None])[0], '.1f'):>4}")


def print_memory(result: dict[str, Any]) -> None:
    if not result["memory"]:
        return
    print("\nWeight memory per stage (probe on each worker): buffers = bytes of the distinct storages holding the "
          "stage's weights / its weight bytes; steady = the most after each action (live, kept versions, leaves in "
          "flight); +undo = with the pre-update weights the stream's undo records keep (rollback, `undo` updates "
          "deep); peak = all of it during an update's copy-on-write; formula = rrefpipe.schedule.weight_buffers")
    print(f"  {'rule':<26} {'m':>2} {'undo':>4} {'stage':>5} {'MiB':>6} | {'formula':>7} {'steady':>6} {'+undo':>5} "
          f"{'peak':>5} | {'formula MiB':>11} {'steady MiB':>10} {'peak MiB':>8} | within")
    for r in result["memory"]:
        name = r["schedule"] + (" (vertical sync)" if r["vertical_sync"] else "")
        undo = r.get("undo_depth", "?")
        if "error" in r:
            print(f"  {name:<26} {r['chunks']:>2} {undo:>4} failed: {r['error'].splitlines()[0][:100]}")
            continue
        for s in r["stages"]:
            print(f"  {name:<26} {r['chunks']:>2} {undo:>4} {s['stage']:>5} {s['weight_bytes'] / 2**20:>6.1f} | "
                  f"{s['formula_buffers']:>7} {s['steady_buffers']:>6.2f} {s.get('undo_buffers', 0.0):>5.2f} "
                  f"{s['peak_buffers']:>5.2f} | {s['formula_bytes'] / 2**20:>11.1f} {s['steady_bytes'] / 2**20:>10.1f} "
                  f"{s['peak_bytes'] / 2**20:>8.1f} | {'yes' if s['within_formula'] else 'NO'}")


def report(result: dict[str, Any], out: Path) -> None:
    m, st = result["machine"], result["settings"]
    print(f"\nrrefpipe continuous pipelines (issue 50): {m['platform']}, torch {m['torch']}, {m['cpu_count']} CPUs "
          f"({m['cpus_usable']} usable); {result['model']['description']}, balance {result['model']['balance']}, "
          f"{STAGES} local workers, every process 1 intra-op thread, checkpoint 'never'; load average at start "
          f"{result['loadavg_start']}, at end {result['loadavg_end']}; rrefpipe at "
          f"{result.get('source_start', {}).get('commit', '?')}"
          + ("" if result.get("source_end") == result.get("source_start") else
             f" (changed during the run, to {result.get('source_end')})"))
    print_training(result)
    print_inference(result)
    print_memory(result)
    print_targets(result["targets"], "50")
    print_written(result, out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = new_parser(__doc__, DEFAULT_OUT)
    p.add_argument("--quick", action="store_true",
                   help="smoke run (~15 s): 4 x Linear(64), batch 32, m = 4, 1 round of 4 batches after 2, "
                        "no untimed stream first")
    p.add_argument("--chunks", nargs="+", type=int, default=list(CHUNKS), help="micro-batches per batch (m)")
    p.add_argument("--width", type=int, default=1024, help="Linear width")
    p.add_argument("--blocks", type=int, default=8, help="(Linear + ReLU) blocks, half per stage")
    p.add_argument("--batch", type=int, default=128, help="rows per batch")
    p.add_argument("--batches", type=int, default=24, help="timed batches per stream")
    p.add_argument("--warmup", type=int, default=4, help="batches before the timed window (>= 1; fills the pipeline)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per m (every contestant once per round)")
    p.add_argument("--physical-repeats", type=int, default=5, help="timed one-process steps per round")
    p.add_argument("--memory-chunks", nargs="*", type=int, default=[4], help="m of the weight-memory section")
    p.add_argument("--memory-batches", type=int, default=10, help="batches per weight-memory stream")
    add_run_args(p)
    args = p.parse_args(argv)
    if args.quick:
        args.chunks, args.width, args.blocks, args.batch, args.memory_chunks = [4], 64, 4, 32, [4]
        args.batches, args.warmup, args.rounds, args.physical_repeats, args.memory_batches = 4, 2, 1, 2, 6
    if (min(args.chunks) < STAGES or max(args.chunks + args.memory_chunks, default=0) > args.batch
            or args.blocks < 2 or args.warmup < 1 or args.batches < 1 or args.rounds < 1):
        p.error(f"need {STAGES} <= chunks <= --batch, --blocks >= 2, --warmup >= 1, --batches >= 1, --rounds >= 1")
    args.chunks = sorted(set(args.chunks))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    run_and_report(parse_args(argv), run, evaluate, report)


if __name__ == "__main__":
    main()
    exit_without_teardown()  # the workers are closed and the results written
