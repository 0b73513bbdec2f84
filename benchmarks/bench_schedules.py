"""Issues #41 and #49: ``Pipe.train_step``'s schedules (GPipe, 1F1B, Interleaved1F1B, zero bubble) measured.

The zero-bubble schedules are InterleavedZeroBubble, ZBVZeroBubble and DualPipeV (section 4).

``python benchmarks/bench_schedules.py`` (about 30 minutes on 2 CPU cores, and about 15 more for the
zero-bubble section, estimated; ``--quick``: a smoke run of about 20 s; ``--zero-bubble-only``: section 4
alone) prints tables and a targets block and writes ``benchmarks/results/schedules.json`` (``--out``). It
reuses the benchmark suite's pieces (``bench_suite``, ``suite_pipelining``, ``suite_targets``,
``bench_core``): the same models, mini-batches and splits (``suite_models``), the same processes and
threads (``workers.LocalWorkers``, 1 intra-op thread per stage process and in the driver; one process
per stage over gloo for torch.distributed.pipelining), the same timed step (forward, loss, backward and
the SGD step; the median over ``--repeats`` steps after ``--warmup``, pooled over ``--rounds`` rounds
in which every contestant of a cell runs back to back, the order reversed every other round and at
every other chunk count) and the same ideal (``ideal@mb``: the bubble model ``(m + n - 1) x`` the
slowest stage's forward + backward of one micro-batch, timed in this process with 1 thread). Every
rrefpipe contestant here runs ``pipe.train_step`` (the loss on the last stage's worker, as pipelining
computes it on its last rank), then ``DistributedOptimizer.step``.

1. **Speed**, for each model, stage count and chunk count m:

   * ``pp_1f1b``: pipelining ``Schedule1F1B``, and ``pp_1f1b_control``: the same on a second group of
     processes, the A/A control (its ratio to ``pp_1f1b`` is what the machine's noise does to two
     equal contestants in this run);
   * ``1f1b``: rrefpipe ``schedule='1F1B'``, ``checkpoint='never'``;
   * ``gpipe``: rrefpipe ``schedule='GPipe'``, ``checkpoint='never'`` (for reference);
   * ``gpipe_always``: rrefpipe ``schedule='GPipe'``, ``checkpoint='always'``: what 1F1B replaces
     where memory is short (both keep a stage's activations bounded; 'always' by recomputing);
   * ``pipe_never``: rrefpipe's other training path, ``pipe(x)`` + loss on the driver + ``pipe.backward``
     (``suite_rrefpipe.time_pipe``, the suite's 'never'), GPipe's order: what ``train_step`` changes.

2. **Interleaved**, 2 workers, m = 4 and 8, in the same rounds: rrefpipe ``Interleaved1F1B`` with
   ``stages_per_worker=2`` (4 stages, stage j on worker j mod 2) and pipelining
   ``ScheduleInterleaved1F1B`` (4 stages on 2 ranks, rank r holding stages r and r + 2), beside each
   framework's ``1F1B`` on the 2-stage split. ``achieved/ideal@mb`` uses one yardstick for all four:
   the 2-worker bubble model of the 2-stage split (the suite's ``ideal@mb``), so it compares the
   schedules on the same work and workers and can exceed 1 for an interleaved schedule, whose own
   bubble model, ``(m v + p - 1) x`` the slowest of the 4 stages' ticks (v = 2 stages per worker,
   p = 2 workers), is smaller; that one is reported as ``own``. The bubble the interleaved schedule
   saves, ``gain`` (ms per step: ``(m + p - 1) x`` the slowest worker's summed stage ticks less
   ``own``, both from the 4-stage times; negative where the 4 stages are unequal, as the Transformer's
   6 layers split), is set beside the CPU its 2 extra boundaries cost (``+cpu``: CPU ms per step of all
   the contestant's processes, interleaved less 1F1B): where both cores are busy, a step takes about
   half of that extra CPU longer, so an interleaved schedule gains on this machine only where
   ``+cpu / 2`` stays under ``gain``.

3. **Memory** kept for backward per stage (``rrefpipe.memory``: saved tensors counted while alive,
   one tracked step after an untracked one), ``1F1B`` against ``GPipe``, both ``checkpoint='never'``
   through ``train_step``, at m = 8, 16, 32: 1F1B holds at most n - j micro-batches in flight on
   stage j, GPipe all m, so the ratio per stage should stay under ``(n - j)/m + 1/m``. (Stage 0 splits
   the mini-batch into micro-batches of their own storage, so each saved input goes with its backward.)

4. **Zero bubble** (issue #49; ``sched_zero_bubble``), 2 workers, m = 4, 8, 16 (``--zb-chunks``), the MLP,
   ResNet-style and Transformer models (``--zb-models``), every contestant in the same rounds
   (``--zb-contestants``; a round runs them in this order):

   * ``pp1F1B``, rrefpipe ``1F1B``, ``A/A pp`` (pipelining's 1F1B on a second group of processes, the A/A
     control of section 1) and rrefpipe ``GPipe``, all on the 2-stage split;
   * ``ZBV``, ``DPV``: rrefpipe ``ZBVZeroBubble`` and ``DualPipeV``, ``stages_per_worker=2``, 4 stages in a
     V (stage j on worker j for j < 2, on worker 3 - j otherwise: worker 0 holds stages 0 and 3), and
     ``ppZBV``, ``ppDPV``: pipelining's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` on the same split,
     rank r holding stages r and 3 - r;
   * ``IZB``: rrefpipe ``InterleavedZeroBubble`` (ZB1P) with ``stages_per_worker=2``, 4 stages in a loop
     (stage j on worker j mod 2, as Interleaved1F1B in section 2), and ``ppIZB``: pipelining's
     ``ScheduleInterleavedZeroBubble`` on the same. Two stages per worker rather than one, so that the three
     zero-bubble schedules run the same 4-stage work on the same workers and differ in order and layout
     only; with one (ZB-H1 on the 2-stage split, fewer boundaries to cross) they are ``izb1``/``pp_izb1``,
     not in the default run (``--zb-contestants``).

   The 4-stage splits are ``sched_zero_bubble.BALANCES``: each worker holds half the layers (the MLP 4/4/4/4;
   the Transformer 1/2/2/1 in the loop, 2/1/2/1 in the V), the ResNet 4/1/2/5 by timed layer cost. Every
   zero-bubble contestant splits each stage's backward into I (the inputs' gradients, which the previous
   stage waits for) and W (the weights'): rrefpipe with ``rrefpipe.stage_side.backward_split``, pipelining with its
   stages' own split. Per cell, beside the samples/s:

   * ``phys``, the **physical limit**: one process's micro-batched step (``physical_step``: ``zero_grad``,
     then for each of the m micro-batches forward, loss and backward of the whole model, then the SGD step;
     1 intra-op thread), timed in every round beside the contestants, pooled as they are, its median
     divided by the 2 workers. ``ach/phys`` = a contestant's samples/s over the limit's, for every
     contestant: 2 workers cannot do a step's work faster unless they compute faster than this process.
   * the **bubble**, simulated against achieved: ``sim`` is ``rrefpipe.schedule.simulate`` of the
     schedule's worker orders (``worker_orders``: rrefpipe's, for pipelining's contestant of the same
     name too) with the costs measured below at the cell's micro-batch size, F and the fused B, or F, I
     and W (``simulate`` takes one cost per kind: each kind's mean over the stages), transfers free;
     ``ach`` is ``1 - compute / (2 x step)``, compute being m times the sum over stages of those costs.
     With the ``cores`` a contestant kept busy (CPU of all its processes per step over the step), this
     shows where the 2 cores bound a figure: an achieved bubble well above the simulated one while the
     contestant keeps about 2 cores busy is CPU spent outside the stages' compute (transfers, the driver,
     the framework), not the schedule's bubble; one near the simulated one is the schedule's own.
   * **split backward** per stage of each split (2-stage, V, loop) at each m's micro-batch size, in this
     process, 1 thread (``split_backward_costs``): F, I (``input_gradients``), W (``WeightGradients.run``)
     and one fused backward B (``torch.autograd.backward``) of the same stage on the same micro-batch,
     each the median over ``--bw-repeats`` repeats after ``--warmup``; each repeat runs both backwards,
     each after its own forward, in an order alternating between repeats. ``(I+W)/B``: the median of the
     repeats' I + W over B's median. (Stage 0's input needs no gradient, as in a pipeline: there I is
     next to nothing and W does all.)

   Ratios: ``ZBV/1F1B``, ``IZB/1F1B``, ``DPV/1F1B`` (rrefpipe against its own 1F1B on the 2-stage split),
   ``ZBV/pp`` etc. (rrefpipe over pipelining, the same schedule class and split), and ``A/A`` beside them.

Statistics: a cell's ratio is one contestant's samples/s over another's (pooled medians); over cells,
the geometric mean and the standard error of the mean log ratio (``+-``, about a relative error).
Zero-bubble targets (issue #49): ZBV/1F1B's geometric mean >= 1.10 (IZB's and DPV's beside it);
rrefpipe/pipelining's geometric mean for each zero-bubble schedule >= the A/A control's over the same
cells (with each one's standard error and the ratio to the control cell by cell); ZBV's achieved/physical
>= 0.90 in every MLP cell at m >= 4 (with its simulated and achieved bubble and cores busy; every
contestant's range beside it); ``(I+W)/B`` <= 1.10 on every stage of every split and m.
``cores``: the fewest and most cores the contestants of a cell kept busy (CPU time of all a contestant's
processes per step, over the step time, first round): a cell where they differ much was disturbed by
another process (or a schedule left a core idle). Nothing is asserted. The load average is recorded at
the start and end of the run and before each cell: on 2 shared cores, look at it before comparing
anything.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor, nn

import suite_pipelining
from bench_core import (exit_without_teardown, ideal_step_ms, loadavg, machine_info, stage_compute, stage_tick_ms,
                        summary)
# (bench_suite registers suite_models for pickling by value: the stage workers get the models' classes)
from bench_suite import (add_ideal, add_run_args, log, new_parser, pipelining_row, pooled, print_written,
                         run_and_report)
from suite_models import SPECS, ModelSpec, split
from suite_pipelining import LR, PipeliningGroup, timed_steps
from suite_pipelining import _time_steps as suite_time_steps
from suite_record import proc_delta, proc_stat
from suite_report import cpu_total_ms, sps
from suite_rrefpipe import time_pipe
from suite_targets import geometric_mean, print_targets, work_ratio

# Run as a script this file is ``__main__``: the zero-bubble section's module (``sched_zero_bubble``), which
# imports this one, must find it rather than load a second copy.
sys.modules.setdefault("bench_schedules", sys.modules[__name__])

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "schedules.json"
CHUNKS = (4, 8, 16, 32)
IL_CHUNKS = (4, 8)
MEMORY_CHUNKS = (8, 16, 32)
V = 2  # stages per worker in the interleaved section
#: Layers per stage for the interleaved section's 4 stages on 2 workers: each worker's two stages hold
#: what its stage of the 2-stage split holds (``suite_models``' balances stop at 3 stages).
IL_BALANCES = {"mlp": [4, 4, 4, 4], "transformer": [1, 2, 2, 1], "tiny": [1, 2, 2, 1]}
CONTROL = "pp_1f1b_control"
#: rrefpipe contestants: (schedule, checkpoint, stages per worker).
RREF = {"1f1b": ("1F1B", "never", 1), "gpipe": ("GPipe", "never", 1), "gpipe_always": ("GPipe", "always", 1),
        "il": ("Interleaved1F1B", "never", V)}
#: pipelining contestants: the schedule each runs ('interleaved' is this file's, the others the suite's).
PIPELINING = {"pp_1f1b": "1f1b", CONTROL: "1f1b", "pp_il": "interleaved"}
PIPE = "pipe_never"  # pipe(x) + pipe.backward, the suite's rrefpipe contestant
CONTESTANTS = ("pp_1f1b", "1f1b", CONTROL, "gpipe", "gpipe_always", PIPE)
IL_CONTESTANTS = ("pp_1f1b", "1f1b", "pp_il", "il")


def recomputed(key: str, m: int) -> int:
    """Micro-batches whose forward contestant ``key`` recomputes per stage in a step of ``m``."""
    return m if key in RREF and RREF[key][1] == "always" else 0


# -- torch.distributed.pipelining, interleaved ------------------------------------------------------
def _time_steps(cmd: dict[str, Any], rank: int, world: int, cache: dict[str, Any]) -> dict[str, Any]:
    """A rank's timed steps: the suite's for GPipe and 1F1B; for ``ScheduleInterleaved1F1B``, stages
    ``rank``, ``rank + world``, ... of the model's ``IL_BALANCES`` split, timed as the suite times the others;
    the zero-bubble schedules' (``sched_zero_bubble.PP_SCHEDULES``) as ``sched_zero_bubble.pp_time_steps`` does."""
    import sched_zero_bubble

    if cmd["schedule"] in sched_zero_bubble.PP_SCHEDULES:
        return sched_zero_bubble.pp_time_steps(cmd, rank, world, cache)
    if cmd["schedule"] != "interleaved":
        return suite_time_steps(cmd, rank, world, cache)
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    spec = SPECS[cmd["model"]]
    n = len(IL_BALANCES[spec.name])
    key = f"{spec.name}/{n}/interleaved"
    if key not in cache:
        cache.clear()
        cache[key] = (split(spec.build(), IL_BALANCES[spec.name])[rank::world], *spec.data())
    parts, x, y = cache[key]
    stages: list[Any] = [PipelineStage(part, rank + k * world, n, torch.device("cpu")) for k, part in enumerate(parts)]
    sched = ScheduleInterleaved1F1B(stages, n_microbatches=cmd["chunks"], loss_fn=spec.loss_fn())
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=LR)
    return timed_steps(cmd, sched, opt, first=rank == 0, last=rank == (n - 1) % world, x=x, y=y)


def _rank_main(*args: Any) -> None:
    """``suite_pipelining``'s stage process, running this file's ``_time_steps``."""
    suite_pipelining._time_steps = _time_steps  # (this spawned process only)
    suite_pipelining._rank_main(*args)


def pipelining_group(world: int) -> PipeliningGroup:
    """A ``suite_pipelining.PipeliningGroup`` whose ranks also run ``ScheduleInterleaved1F1B``."""
    with mock.patch.object(suite_pipelining, "_rank_main", _rank_main):
        return PipeliningGroup(world)


# -- rrefpipe ---------------------------------------------------------------------------------------
def make_pipe(names: Sequence[str], model: nn.Sequential, balance: Sequence[int], chunks: int, schedule: str,
              checkpoint: str, stages_per_worker: int) -> Any:
    from rrefpipe import Pipe

    return Pipe(copy.deepcopy(model), chunks=chunks, checkpoint=checkpoint, balance=list(balance),
                workers=list(names[:len(balance) // stages_per_worker]), schedule=schedule,
                stages_per_worker=stages_per_worker)


def _train(pipe: Any, opt: Any, x: Tensor, y: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> None:
    with dist_autograd.context() as ctx:
        pipe.train_step(ctx, x, y, loss_fn)
        opt.step(ctx)


def time_train_step(names: Sequence[str], model: nn.Sequential, balance: Sequence[int], data: tuple[Tensor, Tensor],
                    loss_fn: Callable[[Tensor, Tensor], Tensor], chunks: int, contestant: str, warmup: int,
                    repeats: int, pids: Sequence[int], rref: tuple[str, str, int] | None = None) -> dict[str, Any]:
    """Median ``train_step`` + ``DistributedOptimizer.step`` time of one rrefpipe contestant, and the CPU
    time and page faults per step of the driver and the stage workers it uses (``pids``). ``rref``: the
    contestant's (schedule, checkpoint, stages per worker) where ``RREF`` has no such key."""
    from torch.distributed.optim import DistributedOptimizer

    schedule, checkpoint, v = rref or RREF[contestant]
    x, y = data
    try:
        with make_pipe(names, model, balance, chunks, schedule, checkpoint, v) as pipe:
            opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=LR)
            for _ in range(warmup):
                _train(pipe, opt, x, y, loss_fn)
            times = []
            before = [proc_stat(p) for p in pids]
            for _ in range(repeats):
                start = time.perf_counter()
                _train(pipe, opt, x, y, loss_fn)
                times.append(time.perf_counter() - start)
            cpu = proc_delta(before, [proc_stat(p) for p in pids], repeats)
            pipe.execution_record(clear=True)
    except Exception as exc:  # a contestant that fails is a row with an error, not a lost run
        log(f"  rrefpipe {contestant} m={chunks} failed: {exc!r}")
        return {"error": repr(exc)[-2000:]}
    step = summary(times)
    return {"step": step, "samples_per_s": len(x) / (step["median_ms"] / 1e3), "cpu": cpu}


def memory_by_schedule(names: Sequence[str], spec: ModelSpec, n: int, chunks: Sequence[int]) -> list[dict[str, Any]]:
    """Peak bytes kept for backward per stage during one ``train_step``, GPipe and 1F1B ('never'), per m.
    Tracking hooks every module call on the workers, so it runs apart from the timed steps."""
    from torch.distributed.optim import DistributedOptimizer

    from rrefpipe import memory

    workers, model, balance, (x, y) = list(names[:n]), spec.build(), spec.balance(n), spec.data()
    rows = []
    memory.track_workers(workers)
    try:
        for m in chunks:
            row: dict[str, Any] = {"chunks": m, "peak_bytes": {}}
            for key in ("gpipe", "1f1b"):
                schedule, checkpoint, v = RREF[key]
                with make_pipe(names, model, balance, m, schedule, checkpoint, v) as pipe:
                    opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=LR)
                    _train(pipe, opt, x, y, spec.loss_fn())  # warm-up, not counted
                    memory.worker_reports(workers, reset=True)
                    _train(pipe, opt, x, y, spec.loss_fn())
                    row["peak_bytes"][key] = [r.saved_peak for r in memory.worker_reports(workers)]
            gp, one = row["peak_bytes"]["gpipe"], row["peak_bytes"]["1f1b"]
            row["ratio"] = [a / b if b else None for a, b in zip(one, gp)]
            row["bound"] = [(n - j) / m + 1 / m for j in range(n)]
            row["within_bound"] = all(r is not None and r <= b for r, b in zip(row["ratio"], row["bound"]))
            rows.append(row)
            log(f"  memory {spec.name} {n}st m={m}: 1F1B/GPipe " + " ".join(_f(r, ".3f") for r in row["ratio"]))
    finally:
        for future in [rpc.rpc_async(w, memory.stop_tracking) for w in workers]:
            future.wait()
    return rows


# -- rounds -----------------------------------------------------------------------------------------
def warm_up(cluster: Any, groups: dict[str, Any], spec: ModelSpec, m: int, contestants: Sequence[str],
            setups: dict[str, tuple[nn.Sequential, list[int], int]], args: argparse.Namespace) -> None:
    """Run the first rrefpipe contestant and, on each group of processes, the first pipelining one once,
    untimed, as ``bench_suite.warm_up`` does: the first configuration of a model ran 15-30% slower."""
    data, done = spec.data(), set[object]()
    for key in contestants:
        if key in PIPELINING and id(groups[key]) not in done:
            done.add(id(groups[key]))
            with contextlib.suppress(RuntimeError):  # a failure shows again in the timed rounds
                groups[key].time_steps(spec.name, PIPELINING[key], m, args.warmup, 1)
        elif key in RREF and "rrefpipe" not in done:
            done.add("rrefpipe")
            model, balance, _ = setups[key]
            time_train_step(cluster.names, model, balance, data, spec.loss_fn(), m, key, args.warmup, 1, [])


def run_cell(cluster: Any, groups: dict[str, Any], spec: ModelSpec, m: int, k: int,
             contestants: Sequence[str], setups: dict[str, tuple[nn.Sequential, list[int], int]],
             args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every contestant at ``m`` micro-batches, back to back, ``--rounds`` times (the order reversed every
    other round and at odd ``k``); each contestant's timed steps of all rounds pooled (``bench_suite.pooled``).
    ``setups[key]``: the model, balance and stage count a contestant runs."""
    rounds: dict[str, list[dict[str, Any]]] = {}
    data = spec.data()
    for r in range(args.rounds):
        for key in (contestants if (k + r) % 2 == 0 else contestants[::-1]):
            model, balance, n = setups[key]
            if key in PIPELINING:
                row = pipelining_row(groups[key], spec, PIPELINING[key], m, n, args)
            elif key == PIPE:
                row = time_pipe(cluster.names, model, balance, data, spec.loss_fn(), m, "never", args.warmup,
                                args.repeats, pids=[os.getpid(), *cluster.pids[:n]])
            else:
                pids = [os.getpid(), *cluster.pids[:len(balance) // RREF[key][2]]]
                row = time_train_step(cluster.names, model, balance, data, spec.loss_fn(), m, key, args.warmup,
                                      args.repeats, pids)
            rounds.setdefault(key, []).append(row)
            log(f"  {spec.name} m={m} {key}: " + (f"{row['samples_per_s']:.1f} samples/s" if "error" not in row
                                                  else row["error"].splitlines()[0]))
    out = {key: pooled(rows, spec.batch) for key, rows in rounds.items()}
    for row in out.values():
        row["cores"] = cores_used(row)
    return out


def cores_used(row: dict[str, Any]) -> float | None:
    """Cores a contestant kept busy: the CPU ms per step of all its processes over the step's ms, both of
    its first round's timed steps (``cpu`` is the first round's)."""
    total = cpu_total_ms(row.get("cpu"))
    if total is None or "error" in row:
        return None
    return total / (row.get("round_medians_ms") or [row["step"]["median_ms"]])[0]


def cores(contestants: dict[str, dict[str, Any]]) -> str:
    """The fewest and most cores the contestants of a cell kept busy: far apart, something outside took
    a core from some of them (or a schedule left one idle)."""
    used = [u for u in map(cores_used, contestants.values()) if u is not None]
    return f"{min(used):.1f}-{max(used):.1f}" if used else "n/a"


def stage_costs(spec: ModelSpec, model: nn.Sequential, balance: list[int], chunks: Sequence[int],
                args: argparse.Namespace) -> dict[int, list[dict[str, float]]]:
    """Each stage's forward/backward ms, 1 thread, in this process, at the micro-batch size of each m
    and (key 1) at the whole batch, as the suite times them: over m calls per repeat, a batch's worth."""
    x = spec.data()[0]
    return {m: stage_compute(model, balance, x, math.ceil(spec.batch / m), args.warmup * m, args.compute_repeats * m)
            for m in sorted({1, *chunks})}


def speed_section(cluster: Any, groups: dict[str, Any], spec: ModelSpec, n: int,
                  args: argparse.Namespace) -> dict[str, Any]:
    load_start = loadavg()
    model, balance = spec.build(), spec.balance(n)
    log(f"{spec.name}, {n} stages: measuring per-stage compute ...")
    per_mb = stage_costs(spec, model, balance, args.chunks, args)
    setups = {key: (model, balance, n) for key in args.contestants}
    if not args.quick:  # (as bench_suite's --quick: each contestant's --warmup steps do for a smoke run)
        warm_up(cluster, groups, spec, args.chunks[0], args.contestants, setups, args)
    rows = []
    for k, m in enumerate(args.chunks):
        load = loadavg()
        contestants = run_cell(cluster, groups, spec, m, k, args.contestants, setups, args)
        for key, row in contestants.items():
            if "error" not in row:
                add_ideal(row, per_mb[1], per_mb[m], spec.batch, m, recomputed(key, m))
        rows.append({"chunks": m, "contestants": contestants, "ideal_mb_step_ms": ideal_step_ms(per_mb[m], m, 0, True),
                     "loadavg_start": load, "loadavg_end": loadavg()})
    return {"name": spec.name, "model": spec.description, "stages": n, "balance": balance, "batch": spec.batch,
            "stage_compute": per_mb[1], "stage_compute_per_microbatch": {str(m): c for m, c in per_mb.items()},
            "rows": rows,
            "loadavg_start": load_start, "loadavg_end": loadavg()}


def worker_costs(costs: list[dict[str, float]], p: int) -> list[dict[str, float]]:
    """Per worker, the summed forward/backward ms of its stages (stage j on worker j mod p)."""
    return [{kind: sum(c[kind] for c in costs[w::p]) for kind in ("forward_ms", "backward_ms")} for w in range(p)]


def interleaved_section(cluster: Any, group: PipeliningGroup | None, spec: ModelSpec,
                        args: argparse.Namespace) -> dict[str, Any]:
    load_start = loadavg()
    model, two, four = spec.build(), spec.balance(2), IL_BALANCES[spec.name]
    log(f"{spec.name}, interleaved: measuring per-stage compute ...")
    per_mb2 = stage_costs(spec, model, two, args.il_chunks, args)
    per_mb4 = stage_costs(spec, model, four, args.il_chunks, args)
    setups = {"pp_1f1b": (model, two, 2), "1f1b": (model, two, 2), "pp_il": (model, four, 4), "il": (model, four, 4)}
    p = 4 // V
    if not args.quick:
        warm_up(cluster, dict.fromkeys(PIPELINING, group), spec, args.il_chunks[0], args.il_contestants, setups,
                args)
    rows = []
    for k, m in enumerate(args.il_chunks):
        load = loadavg()
        contestants = run_cell(cluster, dict.fromkeys(PIPELINING, group), spec, m, k, args.il_contestants, setups,
                               args)
        common = ideal_step_ms(per_mb2[m], m, 0, True)  # the 2-stage split's bubble model: one yardstick for all
        own = (m * V + p - 1) * max(stage_tick_ms(c, m, 0) for c in per_mb4[m])  # Megatron's interleaved bubble
        for row in contestants.values():
            if "error" not in row:
                add_ideal(row, per_mb2[1], per_mb2[m], spec.batch, m, 0)
        for key in ("il", "pp_il"):
            il = contestants.get(key)
            if il and "error" not in il:
                il["own_ideal_mb_step_ms"] = own
                il["achieved_over_own_ideal_mb"] = il["samples_per_s"] / (spec.batch / (own / 1e3))
        # The bubble interleaving saves, from the 4-stage times alone: GPipe's bubble model on the workers'
        # summed stages, less the interleaved one (not ``common - own``: two measurements, their noise).
        plain = ideal_step_ms(worker_costs(per_mb4[m], p), m, 0, True)
        row = {"chunks": m, "contestants": contestants, "ideal_mb_step_ms": common, "own_ideal_mb_step_ms": own,
               "bubble_gain_ms": plain - own, "loadavg_start": load, "loadavg_end": loadavg()}
        # What the 2 extra boundaries cost: CPU per step, all processes, interleaved less 1F1B, and per
        # extra message (4 stages on 2 workers: 3 boundaries, all between workers, against 1; a message
        # each way per micro-batch and boundary: 4m more).
        for ikey, okey in (("il", "1f1b"), ("pp_il", "pp_1f1b")):
            a, b = (cpu_total_ms((contestants.get(k) or {}).get("cpu")) for k in (ikey, okey))
            if a is not None and b is not None:
                row[f"{ikey}_extra_cpu_ms"] = a - b
                row[f"{ikey}_extra_cpu_ms_per_message"] = (a - b) / (4 * m)
        rows.append(row)
    return {"name": spec.name, "model": spec.description, "balance_1f1b": two, "balance_interleaved": four,
            "stages_per_worker": V, "workers": p, "batch": spec.batch,
            "stage_compute": per_mb2[1], "stage_compute_per_microbatch": {str(m): c for m, c in per_mb2.items()},
            "stage_compute_per_microbatch_interleaved": {str(m): c for m, c in per_mb4.items()},
            "worker_compute_per_microbatch_interleaved": {str(m): worker_costs(c, p) for m, c in per_mb4.items()},
            "rows": rows, "loadavg_start": load_start, "loadavg_end": loadavg()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import sched_zero_bubble as zb
    from workers import LocalWorkers

    result: dict[str, Any] = {"loadavg_start": loadavg()}
    log(f"load average at start: {result['loadavg_start']}")
    torch.set_num_threads(1)  # the driver, like every stage process
    speed = {n: args.models for n in args.stages}
    workers = max([n for n in args.stages if args.models] + [n for n in args.memory_stages if args.memory_models] + [2])
    with LocalWorkers(workers, threads=1) as cluster:
        result["machine"] = machine_info(torch.get_num_threads(), cluster.threads)
        result["speed"], result["interleaved"], result["memory"], result["zero_bubble"] = [], [], [], []
        two = args.il_models or args.zb_models  # the 2-worker sections
        for n in sorted(n for n in {*args.stages, 2} if speed.get(n) or (n == 2 and two)):
            with contextlib.ExitStack() as stack:  # the stage processes of n-stage pipelining, closed after
                used = {*(args.contestants if speed.get(n) else ()),
                        *(args.il_contestants if n == 2 and args.il_models else ()),
                        *(args.zb_contestants if n == 2 and args.zb_models else ())}
                own = {k for k in used if k.startswith("pp_") and k != CONTROL}  # on pipelining's processes
                group = stack.enter_context(pipelining_group(n)) if own else None
                groups = {"pp_1f1b": group, "pp_il": group, **dict.fromkeys(own, group)}
                if group is not None:
                    result["machine"][f"pipelining_threads_{n}st"] = group.threads
                if CONTROL in used:  # its own group; --quick: the same one (2 processes fewer)
                    groups[CONTROL] = (group if group is not None and args.control_group == "shared" else
                                       stack.enter_context(pipelining_group(n)))
                for name in speed.get(n, []):
                    result["speed"].append(speed_section(cluster, groups, SPECS[name], n, args))
                if n == 2:
                    for name in args.il_models:
                        result["interleaved"].append(interleaved_section(cluster, group, SPECS[name], args))
                    for name in args.zb_models:
                        result["zero_bubble"].append(zb.section(cluster, groups, SPECS[name], args))
        for n in args.memory_stages:
            for name in args.memory_models:
                log(f"memory: {name}, {n} stages ...")
                result["memory"].append({"name": name, "stages": n, "balance": SPECS[name].balance(n),
                                         "rows": memory_by_schedule(cluster.names, SPECS[name], n,
                                                                    args.memory_chunks)})
    result["loadavg_end"] = loadavg()
    return result


# -- targets ----------------------------------------------------------------------------------------
def gm_se(ratios: Sequence[float]) -> dict[str, Any]:
    """Geometric mean of ``ratios`` and the standard error of their mean log (n - 1 in the sd)."""
    logs = [math.log(r) for r in ratios]
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else None
    return {"gm": geometric_mean(list(ratios)), "se": se, "cells": len(ratios), "min": min(ratios),
            "max": max(ratios)}


def _pm(s: dict[str, Any]) -> str:
    return f"{s['gm']:.3f} +- {_f(s['se'], '.3f')} over {s['cells']} cells (range {s['min']:.2f}-{s['max']:.2f})"


def _f(v: float | None, spec: str = ".0f") -> str:
    return "n/a" if v is None else format(v, spec)


def cells(result: dict[str, Any], key: str, over: str, min_chunks: int = 1) -> list[tuple[str, float]]:
    """(cell name, samples/s of ``key`` over ``over``) for every speed cell where both ran."""
    out = []
    for sec in result["speed"]:
        for r in sec["rows"]:
            a, b = sps(r["contestants"].get(key)), sps(r["contestants"].get(over))
            if a and b and r["chunks"] >= min_chunks:
                out.append((f"{sec['name']} {sec['stages']}st m={r['chunks']}", a / b))
    return out


def undisturbed(result: dict[str, Any], share: float = 0.75) -> set[str]:
    """The speed cells in which every contestant kept at least ``share`` of the usable cores busy (with
    fewer cores than stage processes, an undisturbed pipeline keeps them all busy): the others lost a
    core to another process for part of the cell, which a ratio of pooled medians does not undo."""
    need = share * (result.get("machine", {}).get("cpus_usable") or 2)
    out = set()
    for sec in result["speed"]:
        for r in sec["rows"]:
            used = [cores_used(c) for c in r["contestants"].values()]
            if used and all(u is not None and u >= need for u in used):
                out.add(f"{sec['name']} {sec['stages']}st m={r['chunks']}")
    return out


def _clean(values: dict[str, float], clean: set[str]) -> str:
    kept = [v for name, v in values.items() if name in clean]
    return f"{gm_se(kept)['gm']:.3f} +- {_f(gm_se(kept)['se'], '.3f')} ({len(kept)} cells)" if kept else "no cells"


def _target(name: str, met: bool | None, detail: str, **numbers: Any) -> dict[str, Any]:
    return {"target": name, "met": met, "detail": detail, **numbers}


def memory_target(result: dict[str, Any]) -> dict[str, Any]:
    name = "memory: 1F1B / GPipe kept for backward, per stage, <= (n - j)/m + 1/m (m = 8, 16, 32)"
    rows = [(sec, r) for sec in result["memory"] for r in sec["rows"]]
    if not rows:
        return _target(name, None, "memory not measured")
    worst = max(((ratio / bound, f"{sec['name']} {sec['stages']}st m={r['chunks']} stage {j}", ratio, bound)
                 for sec, r in rows for j, (ratio, bound) in enumerate(zip(r["ratio"], r["bound"]))
                 if ratio is not None), default=None)
    met = all(r["within_bound"] for _, r in rows)
    detail = f"{sum(r['within_bound'] for _, r in rows)}/{len(rows)} configurations within the bound on every stage"
    if worst:
        detail += f"; furthest above or closest to it: {worst[1]} {worst[2]:.3f} against {worst[3]:.3f}"
    outside = [f"{sec['name']} {sec['stages']}st m={r['chunks']} stage {j} {v:.3f}" for sec, r in rows
               for j, (v, b) in enumerate(zip(r["ratio"], r["bound"])) if v is None or v > b]
    if outside:
        detail += f"; above it: {', '.join(outside)}"
    return _target(name, met, detail)


def recompute_target(result: dict[str, Any], bar: float = 1.15) -> dict[str, Any]:
    name = f"speed: 1F1B 'never' / GPipe 'always' >= {bar}x at m >= 8 (train_step)"
    found = cells(result, "1f1b", "gpipe_always", 8)
    if not found:
        return _target(name, None, "not measured")
    s = gm_se([v for _, v in found])
    works = [w for sec in result["speed"] for r in sec["rows"] if r["chunks"] >= 8
             for w in [work_ratio(sec, r["chunks"])] if w is not None]
    worst = min(found, key=lambda c: c[1])
    detail = (f"geometric mean {_pm(s)}; {sum(v >= bar for _, v in found)}/{len(found)} cells >= {bar}, worst "
              f"{worst[1]:.2f} ({worst[0]})")
    if works:
        detail += (f"; work ratio (stages' fwd+bwd+recomputed fwd over fwd+bwd, timed alone) "
                   f"{min(works):.2f}-{max(works):.2f}")
    detail += f"; undisturbed cells only: {_clean(dict(found), undisturbed(result))}"
    return _target(name, s["gm"] >= bar, detail, stats=s)


def pipelining_target(result: dict[str, Any]) -> dict[str, Any]:
    name = "speed: rrefpipe 1F1B / pipelining Schedule1F1B, geometric mean >= the A/A control's"
    ours = dict(cells(result, "1f1b", "pp_1f1b"))
    control = dict(cells(result, CONTROL, "pp_1f1b"))
    both = [c for c in ours if c in control]
    if len(both) < 2:
        return _target(name, None, "fewer than 2 cells with rrefpipe, pipelining and the control")
    s_ours, s_ctrl = gm_se([ours[c] for c in both]), gm_se([control[c] for c in both])
    s_diff = gm_se([ours[c] / control[c] for c in both])
    clean = undisturbed(result)
    detail = (f"rrefpipe/pipelining {_pm(s_ours)}; A/A control {_pm(s_ctrl)}; rrefpipe over the control cell by "
              f"cell {s_diff['gm']:.3f} +- {_f(s_diff['se'], '.3f')}; A/A scatter "
              f"{_f(statistics.stdev(math.log(control[c]) for c in both), '.3f')} (sd of log ratio) | undisturbed "
              f"cells only (every contestant kept >= 0.75 of the cores busy): rrefpipe/pipelining "
              f"{_clean(ours, clean)}, A/A {_clean(control, clean)}")
    return _target(name, s_ours["gm"] >= s_ctrl["gm"], detail, rrefpipe=s_ours, control=s_ctrl, over_control=s_diff)


def interleaved_target(result: dict[str, Any]) -> dict[str, Any]:
    name = "interleaved (v = 2, 4 stages on 2 workers): achieved/ideal@mb above 1F1B's at m = 4, 8"
    parts, met, pp = [], True, []
    for sec in result["interleaved"]:
        for r in sec["rows"]:
            c = r["contestants"]
            il, one = c.get("il") or {}, c.get("1f1b") or {}
            if "achieved_over_ideal_mb" not in il or "achieved_over_ideal_mb" not in one:
                met = False
                parts.append(f"{sec['name']} m={r['chunks']}: not measured")
                continue
            a, b = il["achieved_over_ideal_mb"], one["achieved_over_ideal_mb"]
            met = met and a > b
            extra = r.get("il_extra_cpu_ms")
            parts.append(f"{sec['name']} m={r['chunks']}: {a:.2f} vs {b:.2f} (bubble saved "
                         f"{_f(r.get('bubble_gain_ms'))} ms/step, half the extra CPU "
                         f"{_f(None if extra is None else extra / 2)} ms/step)")
            p_il, p_one = (c.get(k) or {} for k in ("pp_il", "pp_1f1b"))
            if "achieved_over_ideal_mb" in p_il and "achieved_over_ideal_mb" in p_one:
                pp.append(f"{sec['name']} m={r['chunks']}: {p_il['achieved_over_ideal_mb']:.2f} vs "
                          f"{p_one['achieved_over_ideal_mb']:.2f}")
    if not parts:
        return _target(name, None, "not measured")
    detail = "rrefpipe Interleaved1F1B vs 1F1B: " + "; ".join(parts)
    if pp:
        detail += " | pipelining ScheduleInterleaved1F1B vs Schedule1F1B: " + "; ".join(pp)
    return _target(name, met, detail)


def evaluate(result: dict[str, Any]) -> list[dict[str, Any]]:
    import sched_zero_bubble as zb

    return [memory_target(result), recompute_target(result), pipelining_target(result), interleaved_target(result),
            *zb.evaluate(result)]


# -- report -----------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> str:
    return _f(a / b if a and b else None, ".2f")


def _ach(row: dict[str, Any] | None, key: str = "achieved_over_ideal_mb") -> str:
    return _f((row or {}).get(key), ".2f")


def print_speed(sec: dict[str, Any]) -> None:
    print(f"\n{sec['model']} | {sec['stages']} stages, balance {sec['balance']} | samples/s | load "
          f"{sec['loadavg_start']} -> {sec['loadavg_end']}")
    print(f"  {'m':>3} | {'pp1F1B':>6} {'A/A pp':>6} | {'1F1B':>6} {'GPipe':>6} {'GP-alw':>6} {'pipe()':>6} "
          f"{'i@mb':>6} | {'1F1B/pp':>7} {'A/A':>5} | {'1F1B/GP':>7} {'1F1B/alw':>8} {'work':>5} {'GP/pipe':>7} | "
          f"{'ach/i@mb: 1F1B':>14} {'pp':>5} {'GP':>5} {'alw':>5} | {'cores':>7} {'load':>4}")
    for r in sec["rows"]:
        c = r["contestants"]
        pp, ctrl, one, gp, alw, pipe = (sps(c.get(k)) for k in ("pp_1f1b", CONTROL, "1f1b", "gpipe", "gpipe_always",
                                                                PIPE))
        print(f"  {r['chunks']:>3} | {_f(pp, '.1f'):>6} {_f(ctrl, '.1f'):>6} | {_f(one, '.1f'):>6} {_f(gp, '.1f'):>6} "
              f"{_f(alw, '.1f'):>6} {_f(pipe, '.1f'):>6} {sec['batch'] / r['ideal_mb_step_ms'] * 1e3:>6.1f} | "
              f"{_ratio(one, pp):>7} {_ratio(ctrl, pp):>5} | {_ratio(one, gp):>7} {_ratio(one, alw):>8} "
              f"{_f(work_ratio(sec, r['chunks']), '.2f'):>5} {_ratio(gp, pipe):>7} | {_ach(c.get('1f1b')):>14} "
              f"{_ach(c.get('pp_1f1b')):>5} "
              f"{_ach(c.get('gpipe')):>5} {_ach(c.get('gpipe_always')):>5} | {cores(c):>7} "
              f"{_f((r.get('loadavg_start') or [None])[0], '.1f'):>4}")


def print_interleaved(secs: list[dict[str, Any]]) -> None:
    if not secs:
        return
    print(f"\nInterleaved: {V} stages per worker, 4 stages on 2 workers, against 1F1B on the 2-stage split | "
          "samples/s; ach = achieved / the 2-stage split's bubble model (i@mb); own = achieved / the interleaved "
          "bubble model (m v + p - 1) x slowest of 4 stages; gain = the bubble ms per step the interleaved model "
          "saves; +cpu = interleaved's CPU ms per step (all processes) over its 1F1B's")
    print(f"  {'model':<12} {'m':>3} | {'1F1B':>6} {'IL':>6} {'pp1F1B':>6} {'ppIL':>6} {'i@mb':>6} | "
          f"{'IL/1F1B':>7} {'ppIL/pp':>7} {'IL/ppIL':>7} | {'ach: 1F1B':>9} {'IL':>5} {'pp1F1B':>6} {'ppIL':>5} | "
          f"{'own: IL':>7} {'ppIL':>5} | {'gain':>5} {'+cpu IL':>7} {'ppIL':>5} | {'cores':>7} {'load':>4}")
    for sec in secs:
        for r in sec["rows"]:
            c = r["contestants"]
            one, il, pp, ppil = (sps(c.get(k)) for k in ("1f1b", "il", "pp_1f1b", "pp_il"))
            print(f"  {sec['name']:<12} {r['chunks']:>3} | {_f(one, '.1f'):>6} {_f(il, '.1f'):>6} {_f(pp, '.1f'):>6} "
                  f"{_f(ppil, '.1f'):>6} {sec['batch'] / r['ideal_mb_step_ms'] * 1e3:>6.1f} | {_ratio(il, one):>7} "
                  f"{_ratio(ppil, pp):>7} {_ratio(il, ppil):>7} | {_ach(c.get('1f1b')):>9} {_ach(c.get('il')):>5} "
                  f"{_ach(c.get('pp_1f1b')):>6} {_ach(c.get('pp_il')):>5} | "
                  f"{_ach(c.get('il'), 'achieved_over_own_ideal_mb'):>7} "
                  f"{_ach(c.get('pp_il'), 'achieved_over_own_ideal_mb'):>5} | {_f(r.get('bubble_gain_ms')):>5} "
                  f"{_f(r.get('il_extra_cpu_ms')):>7} {_f(r.get('pp_il_extra_cpu_ms')):>5} | {cores(c):>7} "
                  f"{_f((r.get('loadavg_start') or [None])[0], '.1f'):>4}")


def print_memory(secs: list[dict[str, Any]]) -> None:
    if not secs:
        return
    print("\nMemory kept for backward per stage, one train_step, checkpoint 'never' (rrefpipe.memory): MiB for GPipe "
          "and 1F1B, their ratio and the bound (n - j)/m + 1/m, '/' between stages")
    print(f"  {'model':<12} {'n':>2} {'m':>3} | {'GPipe MiB':<20} {'1F1B MiB':<20} | {'1F1B/GPipe':<20} "
          f"{'bound':<20} within")
    for sec in secs:
        for r in sec["rows"]:
            mib = {k: "/".join(f"{b / 2**20:.2f}" for b in v) for k, v in r["peak_bytes"].items()}
            print(f"  {sec['name']:<12} {sec['stages']:>2} {r['chunks']:>3} | {mib['gpipe']:<20} {mib['1f1b']:<20} | "
                  f"{'/'.join(_f(v, '.3f') for v in r['ratio']):<20} {'/'.join(f'{b:.3f}' for b in r['bound']):<20} "
                  f"{'yes' if r['within_bound'] else 'NO'}")


def report(result: dict[str, Any], out: Path) -> None:
    import sched_zero_bubble as zb

    m, st = result["machine"], result["settings"]
    print(f"\nrrefpipe schedules (issues #41, #49): {m['platform']}, torch {m['torch']}, {m['cpu_count']} CPUs "
          f"({m['cpus_usable']} usable); every stage process and the driver 1 intra-op thread; timed step = "
          f"train_step (pipelining: schedule.step) + SGD step, median of {st['repeats']} x {st['rounds']} rounds "
          f"after {st['warmup']} warm-up; load average at start {result['loadavg_start']}, at end "
          f"{result['loadavg_end']}")
    for sec in result["speed"]:
        print_speed(sec)
    if result["speed"]:
        where = ("the same group of processes (--quick)" if st.get("control_group") == "shared" else
                 "a second group of processes")
        print(f"  pp1F1B = pipelining Schedule1F1B; A/A pp = the same on {where} (A/A = it over "
              "pp1F1B: the run's noise); 1F1B, GPipe = rrefpipe train_step 'never'; GP-alw = GPipe 'always'; "
              "pipe() = rrefpipe pipe(x) + pipe.backward ('never', the suite's path; GP/pipe: train_step GPipe over "
              "it); "
              "work = all stages' fwd+bwd+recomputed fwd over fwd+bwd (suite_targets.work_ratio); i@mb = the "
              "bubble model at the micro-batch size; cores = fewest-most cores the cell's contestants kept busy (far "
              "apart: disturbed); load = 1-min load average before the row")
    print_interleaved(result["interleaved"])
    print_memory(result["memory"])
    zb.print_section(result.get("zero_bubble") or [])
    print_targets(result["targets"], "#41, #49")
    print_written(result, out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    import sched_zero_bubble as zb

    p = new_parser(__doc__, DEFAULT_OUT)
    p.add_argument("--quick", action="store_true",
                   help="smoke run (~20 s): the tiny model, 2 stages, m = 8 (interleaved and zero bubble m = 4), "
                        "1 round, no untimed run first, the A/A control on pipelining's processes")
    p.add_argument("--models", nargs="*", choices=list(SPECS), default=["mlp", "resnet", "transformer"],
                   help="models of the speed section (none: skip it)")
    p.add_argument("--stages", nargs="+", type=int, choices=(2, 3), default=[2, 3], help="speed section stage counts")
    p.add_argument("--chunks", nargs="+", type=int, default=list(CHUNKS), help="speed section micro-batch counts")
    p.add_argument("--contestants", nargs="+", choices=CONTESTANTS, default=list(CONTESTANTS),
                   help=f"speed section contestants, in this order in a round (reversed every other round); "
                        f"{CONTROL!r} is the A/A control")
    p.add_argument("--il-models", nargs="*", choices=sorted(IL_BALANCES), default=["mlp", "transformer"],
                   help="models of the interleaved section (none: skip it)")
    p.add_argument("--il-chunks", nargs="+", type=int, default=list(IL_CHUNKS), help="interleaved micro-batch counts")
    p.add_argument("--il-contestants", nargs="+", choices=IL_CONTESTANTS, default=list(IL_CONTESTANTS))
    p.add_argument("--memory-models", nargs="*", choices=list(SPECS), default=["mlp", "resnet", "transformer"],
                   help="models of the memory section (none: skip it)")
    p.add_argument("--memory-stages", nargs="+", type=int, choices=(2, 3), default=[2, 3])
    p.add_argument("--memory-chunks", nargs="+", type=int, default=list(MEMORY_CHUNKS))
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each measurement")
    p.add_argument("--repeats", type=int, default=4, help="timed steps per contestant and round")
    p.add_argument("--rounds", type=int, default=2, help="rounds per cell (the median is over all their steps)")
    p.add_argument("--compute-repeats", type=int, default=3, help="timed runs per stage-compute measurement")
    zb.add_args(p)
    add_run_args(p)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.stages, args.chunks, args.il_models, args.il_chunks = ["tiny"], [2], [8], ["tiny"], [4]
        args.memory_models, args.memory_stages, args.memory_chunks = ["tiny"], [2], [8]
        args.warmup, args.repeats, args.rounds, args.compute_repeats = 1, 2, 1, 1
    zb.fix_args(p, args)  # its --quick settings; --zero-bubble-only empties the other sections' models
    # The A/A control's processes: a second group; --quick runs it on pipelining's group (a smoke run's
    # ratios mean nothing, and 2 more stage processes cost it a quarter of its CPU time).
    args.control_group = "shared" if args.quick else "own"
    smallest = min([SPECS[name].batch for name in [*args.models, *args.il_models, *args.memory_models]] or [1 << 30])
    chunks = [*args.chunks, *args.il_chunks, *args.memory_chunks]
    if min(chunks) < max(args.stages) or max(chunks) > smallest or min(args.il_chunks) % (4 // V):
        p.error(f"need {max(args.stages)} <= chunks <= {smallest} (the smallest batch; 1F1B needs m >= stages) and "
                f"even interleaved chunks")
    if args.warmup < 0 or args.repeats < 1 or args.rounds < 1:
        p.error("need --warmup >= 0, --repeats >= 1, --rounds >= 1")
    args.chunks, args.il_chunks = sorted(set(args.chunks)), sorted(set(args.il_chunks))
    args.contestants = [k for k in CONTESTANTS if k in args.contestants]
    args.il_contestants = [k for k in IL_CONTESTANTS if k in args.il_contestants]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    run_and_report(parse_args(argv), run, evaluate, report)


if __name__ == "__main__":
    main()
    exit_without_teardown()  # every stage process is closed and the results written
