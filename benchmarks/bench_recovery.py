"""Issue 52: what being recoverable costs and how fast a pipe recovers: ``Pipe(..., spares=, snapshot_every=)``
with ``pipe.train_stream`` under 1F1B, against the same stream without spares; the time from a stage worker's
SIGKILL to the next step; and a soak with a worker killed every M steps that must end on the weights of an
uninterrupted run.

``python benchmarks/bench_recovery.py`` (about 3-4 minutes on 2 CPU cores, more while other work runs;
``--quick``: a smoke run of a few seconds after the workers start) prints three tables and a targets block
and writes ``benchmarks/results/recovery.json`` (``--out``).

Workers: one ``workers.LocalWorkers(n + extra, threads=1)`` group (1 intra-op thread in every process, this
one included) for the whole run: ``n`` (``--stages``, 4) stage workers and a pool of spares, each used once
(a killed worker stays a dead member of the static group; the engine notes, docs/engine-notes-recovery.md,
show that the live ones keep working). Every pid is taken from the worker itself
(``rpc.rpc_sync(name, os.getpid)``); a kill is ``os.kill(pid, SIGKILL)``.

Model (bench_core's MLP family): ``--blocks`` x (Linear(``--width``) + ReLU) (default 8 x 512), cut into
``--stages`` stages of equal block counts, batch ``--batch`` (128) rows split into ``--chunks`` (4)
micro-batches, ``schedule='1F1B'``, ``checkpoint='never'``, cross-entropy over ``--width`` classes,
``opt = pipe.optimizer(torch.optim.AdamW, lr=--lr)`` and ``for loss in pipe.train_stream(batches,
F.cross_entropy, opt)`` everywhere.

1. **Steady state.** On the same ``n`` stage workers, five pipes built from the same weights: ``base``
   (``spares=0``), ``base_aa`` (``spares=0`` again: the **A/A control**), and ``k1``, ``k10``, ``k50``
   (``spares=[the first pool worker]``, ``snapshot_every`` = 1, ``--snapshot-every`` (10, the default) and 50;
   ``--compare-every`` sets the others). After an untimed stream of 3 batches per pipe (which also takes the
   first snapshot), ``--rounds`` rounds (order reversed every other round) in which each pipe runs one
   stream of 2 warm-up batches and a timed window of W batches, the same batch every time: W is the
   smallest multiple of the pipe's ``snapshot_every`` that is at least ``--window`` (20; 50 for k50), so
   that the window holds exactly W / k snapshots (the guard's update count runs on across streams, and a
   snapshot is taken inside the step that makes the k-th update). A pipe's **step time** in a round is the
   window's time over W (the snapshots amortised); ``/base`` is its pooled time per step (all rounds) over
   ``base``'s, beside it the geometric mean of the rounds' ratios and its standard error (``+-``). The
   snapshot's time is ``pipe._guard.snapshot_seconds``: what the next step waits for (every stage pickling
   its structure without tensor data and copying its tensors' storages; taken on the driver; the first,
   outside any stream's window, left out); ``xfer`` is ``pipe._guard.transfer_seconds``, from the start of
   a snapshot until all of it is on the holder (TensorPipe sends the copies while the next step runs); its
   size is ``pipe._guard.snapshot_bytes`` (what the holder keeps per pipe). ``pred`` = 1 + median snapshot
   time / (k x base step): what the snapshots' waits alone should add (the transfer's share of the cores is
   not in it).

2. **Time to recover.** ``--kill-repeats`` (2) trials of each scenario, alternating, each on a fresh pipe
   (``spares=[the next pool worker]``, ``snapshot_every=--snapshot-every`` k) whose stage workers are the
   live ones (a trial's spare serves the killed stage in the next): after ``2k - 1`` updates (the committed
   snapshot is the one taken at update k: the next step's recovery replays ``k - 1`` batches) or after
   ``2k`` updates (a snapshot taken just before the kill, waited for until all of it is on the holder:
   it replays none; a kill during its transfer would go back to the one before), the worker of stage
   ``--kill-stage`` (1) is SIGKILLed between two steps, and the stream goes on for 2 more. **kill -> step**:
   from ``time.perf_counter()`` just before ``os.kill`` to the next loss yielded. The guard's methods are
   wrapped on the pipe's instance (timing only; the library is unchanged) to split it: ``surface``, from
   the kill to the error reaching the guard (``Guard.recover`` called: the failed step's own work and the
   error's way back); ``ping``, ``Guard.dead`` (pinging every worker to find the dead one); ``rebuild``,
   the rest of ``recover`` without the snapshot it re-takes (``resnap``, only when another spare is left)
   and the replayed batches (``replay``); ``retry``, the failed batch run again; ``rec.s`` is
   ``pipe.recoveries[-1].seconds`` (from the error to the end of the replay). Detection = surface + ping.
   ``xfer``, the state's transfer time on loopback, is the pipe's median snapshot transfer time (the first,
   taken before any update and without AdamW's state, left out): the same bytes the rebuild sends from the
   holder to every stage's worker. Most of ``rebuild`` on these small models is the spare's first
   ``torch.optim`` optimizer, which imports ``torch._dynamo`` (0.8-2 s on 2 busy cores); ``--warm-spares``
   imports it on every spare before anything is measured, to show the recovery without it. Target: kill -> step <= 2 s + xfer where nothing
   is replayed, and kill -> step - replay <= 2 s + xfer where k - 1 batches are.

3. **Soak.** One pipe with ``spares`` = ``--soak-spares`` fresh pool workers (default: the kills + 1, so
   that it still has one at the end), ``snapshot_every=k``, runs ``--soak-steps`` (400) distinct batches
   (seeded by their index); kill i (i = 1, 2, ... while i x M < steps, M = ``--kill-every``, 100) SIGKILLs
   the worker of stage (i - 1) mod n after update i x M (i odd: just after a snapshot, nothing to replay)
   or i x M - 1 (i even: k - 1 to replay; for i odd the kill waits until that snapshot is all on the holder). ``VmRSS`` of the driver and of every live worker is read from
   ``/proc/PID/status`` after update ``--soak-warmup`` (M / 2: the holder's RSS settles over its first
   snapshots, two generations and the one arriving), every ``--rss-every`` (50) updates, just before each
   kill and at the end; ``flat``:
   for the driver, and for each worker over the samples in which it kept one role (stage j, snapshot
   holder, idle spare), from ``--soak-warmup`` updates after it took that role on (a new holder fills up to
   two generations and the one arriving; a new stage worker, its optimizer's state), the last sample minus
   the first <= max(``--rss-tolerance-mib`` (16), 5%). The same
   run is computed in plain PyTorch in this process (the same initial weights, batches, micro-batches
   (each loss weighted by its rows, backward per micro-batch) and AdamW, 1 thread) before the workers start;
   the pipe's final ``state_dict()`` against it: ``torch.testing.assert_close(atol=1e-6, rtol=0)`` ->
   ``exact``, with the largest difference of a weight and of a loss.

Statistics: medians with [min-max] over the rounds or trials; nothing is asserted. The load average is
recorded at the start and end of the run and of every round, trial and kill: on 2 shared cores look at it,
and at the A/A control, before reading a ratio.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's rrefpipe and workers (the stage workers use it too)

import torch  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import workers  # noqa: E402
from bench_core import exit_without_teardown, loadavg, machine_info, make_model  # noqa: E402
from bench_suite import add_run_args, log, new_parser, print_written, run_and_report  # noqa: E402
from suite_targets import print_targets  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "recovery.json"
MIB = 2**20
BASE, CONTROL = "base", "base_aa"
SCENARIOS = ("k-1", "0")  # batches left to replay by the kill: k - 1, or none
WARMUP = 2  # batches before a steady-state window (the window starts at the last one's loss)
AFTER = 2  # batches a recovery trial runs after the first step past the kill


# -- model, data, the plain run ----------------------------------------------------------------------
def balance(blocks: int, stages: int) -> list[int]:
    """Layers per stage: (Linear, ReLU) blocks spread evenly, the earlier stages taking one more."""
    return [2 * (blocks // stages + (j < blocks % stages)) for j in range(stages)]


def make_batch(width: int, rows: int, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10_000 + seed)
    return torch.randn(rows, width, generator=gen), torch.randint(0, width, (rows,), generator=gen)


def batches(args: argparse.Namespace, start: int, count: int) -> Iterator[tuple[Tensor, Tensor]]:
    for t in range(start, start + count):
        yield make_batch(args.width, args.batch, t)


def plain_run(model: nn.Module, args: argparse.Namespace, steps: int) -> tuple[dict[str, Tensor], list[float], float]:
    """The uninterrupted run in this process: for each batch, every micro-batch's loss (weighted by its rows,
    as ``train_step``'s mean) backward, then AdamW's step. Returns the final state, the losses, the seconds."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    started = time.perf_counter()
    for x, y in batches(args, 0, steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xi, yi in zip(x.tensor_split(args.chunks), y.tensor_split(args.chunks)):
            loss = F.cross_entropy(model(xi), yi) * (len(xi) / len(x))
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, time.perf_counter() - started


def new_pipe(model: nn.Module, args: argparse.Namespace, stage_workers: Sequence[str], spares: Sequence[str],
             every: int) -> tuple[Any, Any]:
    from rrefpipe import Pipe

    pipe = Pipe(copy.deepcopy(model), chunks=args.chunks, balance=balance(args.blocks, args.stages),
                workers=list(stage_workers), spares=list(spares), snapshot_every=every, schedule="1F1B",
                checkpoint="never")
    return pipe, pipe.optimizer(torch.optim.AdamW, lr=args.lr)


# -- processes -----------------------------------------------------------------------------------------
def rss(pid: int) -> int | None:
    """``VmRSS`` of ``pid`` in bytes (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Pool:
    """The group's workers: the stage workers now, and the spares not used yet (each is used once)."""

    def __init__(self, names: Sequence[str], stages: int) -> None:
        self.pids = {name: int(rpc.rpc_sync(name, os.getpid)) for name in names}
        self.stage_workers = list(names[:stages])
        self.fresh = list(names[stages:])
        self.killed: list[str] = []

    def take(self, count: int) -> list[str]:
        if len(self.fresh) < count:
            raise RuntimeError(f"{count} spare(s) wanted, {len(self.fresh)} left in the pool")
        out, self.fresh = self.fresh[:count], self.fresh[count:]
        return out

    def kill(self, name: str) -> float:
        """SIGKILL ``name``; returns ``time.perf_counter()`` taken just before the kill."""
        pid = self.pids[name]
        self.killed.append(name)
        started = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        return started


# -- timing the guard ----------------------------------------------------------------------------------
class GuardTimes:
    """Wraps ``pipe._guard``'s ``recover``, ``dead`` and ``snapshot`` on the instance (nothing else changes)
    to time the parts of each recovery: entry and exit of ``recover``, its pings, the snapshot it re-takes and
    the batches it replays."""

    def __init__(self, guard: Any) -> None:
        self.events: list[dict[str, Any]] = []
        self._now: dict[str, Any] | None = None
        recover, dead, snapshot = guard.recover, guard.dead, guard.snapshot

        def timed_recover(exc: BaseException, replay: Callable[[Any], None], snapshotting: bool = False) -> None:
            event = {"enter": time.perf_counter(), "ping_s": 0.0, "resnapshot_s": 0.0, "replay_s": 0.0,
                     "replayed": 0, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            self.events.append(event)
            self._now = event

            def timed_replay(batch: Any) -> None:
                t0 = time.perf_counter()
                replay(batch)
                event["replay_s"] += time.perf_counter() - t0
                event["replayed"] += 1

            try:
                recover(exc, timed_replay, snapshotting)
            finally:
                event["exit"] = time.perf_counter()
                self._now = None

        def timed_dead(names: Sequence[str]) -> list[str]:
            t0 = time.perf_counter()
            try:
                return list(dead(names))
            finally:
                if self._now is not None:
                    self._now["ping_s"] += time.perf_counter() - t0

        def timed_snapshot() -> None:
            t0 = time.perf_counter()
            try:
                snapshot()
            finally:
                if self._now is not None:
                    self._now["resnapshot_s"] += time.perf_counter() - t0

        guard.recover, guard.dead, guard.snapshot = timed_recover, timed_dead, timed_snapshot


def breakdown(t_kill: float, t_step: float, events: list[dict[str, Any]], record: Any) -> dict[str, Any]:
    """The parts of one recovery (seconds), from the kill at ``t_kill`` to the loss at ``t_step``."""
    ev = events[-1] if events else None
    out: dict[str, Any] = {"kill_to_step_s": t_step - t_kill, "recover_calls": len(events)}
    if ev is not None:
        whole = ev["exit"] - ev["enter"]
        out.update(surface_s=ev["enter"] - t_kill, ping_s=ev["ping_s"], resnapshot_s=ev["resnapshot_s"],
                   replay_s=ev["replay_s"], replay_batches=ev["replayed"],
                   rebuild_s=whole - ev["ping_s"] - ev["resnapshot_s"] - ev["replay_s"], recover_s=whole,
                   retry_s=t_step - ev["exit"], detect_s=ev["enter"] - t_kill + ev["ping_s"], error=ev["error"])
    if record is not None:
        out["record"] = {"worker": record.worker, "stages": list(record.stages), "spare": record.spare,
                         "failed_update": record.failed_update, "restored_update": record.restored_update,
                         "replayed": record.replayed, "seconds": record.seconds, "cause": record.cause}
    return out


# -- statistics ----------------------------------------------------------------------------------------
def spread(values: Sequence[float]) -> dict[str, Any] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "values": list(values)}


def quantiles(values: Sequence[float]) -> dict[str, Any] | None:
    if not values:
        return None
    data = sorted(values)
    dec = statistics.quantiles(data, n=10) if len(data) > 1 else [data[0]] * 9
    return {"median": statistics.median(data), "p10": dec[0], "p90": dec[-1], "n": len(data), "values": list(values)}


def gm_se(values: Sequence[float]) -> dict[str, Any]:
    """Geometric mean of ratios, and the standard error of their mean log (None for one value)."""
    logs = [math.log(v) for v in values]
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else None
    return {"gm": math.exp(statistics.fmean(logs)), "se": se, "n": len(logs), "min": min(values), "max": max(values)}


# -- 1. steady state -------------------------------------------------------------------------------------
def window_of(every: int | None, window: int) -> int:
    return window if every is None else every * math.ceil(window / every)


def timed_stream(pipe: Any, opt: Any, data: tuple[Tensor, Tensor], warmup: int, window: int) -> dict[str, Any]:
    stamps = []
    for _ in pipe.train_stream((data for _ in range(warmup + window)), F.cross_entropy, opt):
        stamps.append(time.perf_counter())
    seconds = stamps[-1] - stamps[warmup - 1]
    gaps = [b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:])]
    return {"steps": window, "seconds": seconds, "step_s": seconds / window, "median_gap_s": statistics.median(gaps),
            "loadavg": loadavg()}


def steady_state(model: nn.Module, pool: Pool, args: argparse.Namespace) -> dict[str, Any]:
    every = [args.snapshot_every] + [k for k in args.compare_every if k != args.snapshot_every]
    spec: dict[str, int | None] = {BASE: None, CONTROL: None, **{f"k{k}": k for k in sorted(every)}}
    windows = {key: window_of(k, args.window) for key, k in spec.items()}
    spare = pool.fresh[:1]  # not used up: the recovery trials take it next
    data = make_batch(args.width, args.batch, -1)
    pipes: dict[str, tuple[Any, Any]] = {}
    try:
        for key, k in spec.items():
            pipes[key] = new_pipe(model, args, pool.stage_workers, spare if k is not None else [], k or 10)
            for _ in pipes[key][0].train_stream((data for _ in range(3)), F.cross_entropy, pipes[key][1]):
                pass  # untimed: first calls, and the first snapshot
        # the control one place away from what it controls, the others between
        order = [BASE] + [key for key in spec if key not in (BASE, CONTROL)]
        order.insert(2, CONTROL)
        rounds = []
        for r in range(args.rounds):
            this = order if r % 2 == 0 else order[::-1]
            row = {"order": this, "loadavg_start": loadavg(), "pipes": {}}
            for key in this:
                pipe, opt = pipes[key]
                row["pipes"][key] = timed_stream(pipe, opt, data, WARMUP, windows[key])
            rounds.append(row)
            log(f"steady round {r}: " + ", ".join(f"{k} {v['step_s'] * 1e3:.1f} ms" for k, v in row["pipes"].items())
                + f" (load {row['loadavg_start']})")
        snaps = {key: (list(pipes[key][0]._guard.snapshot_seconds), pipes[key][0]._guard.snapshot_bytes,
                       list(pipes[key][0]._guard.transfer_seconds)) for key, k in spec.items() if k is not None}
    finally:
        for pipe, _ in pipes.values():
            pipe.close()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out: dict[str, Any] = {"spare": spare, "windows": windows, "rounds": rounds, "pipes": {}, "ratios": {}}
    for key, k in spec.items():
        steps = [r["pipes"][key]["step_s"] for r in rounds]
        pooled = sum(r["pipes"][key]["seconds"] for r in rounds) / sum(r["pipes"][key]["steps"] for r in rounds)
        row = {"spares": 0 if k is None else 1, "snapshot_every": k, "window": windows[key],
               "step_s": spread(steps), "pooled_step_s": pooled}
        if k is not None:
            seconds, nbytes, transfers = snaps[key]
            row["snapshot"] = {"seconds": quantiles(seconds[1:]), "first_s": seconds[0] if seconds else None,
                               "transfer": quantiles(transfers[1:]), "count": len(seconds), "bytes": nbytes,
                               "bytes_over_weights": nbytes / weight_bytes}
        out["pipes"][key] = row
    base = out["pipes"][BASE]["pooled_step_s"]
    for key, row in out["pipes"].items():
        if key == BASE:
            continue
        per_round = [r["pipes"][key]["step_s"] / r["pipes"][BASE]["step_s"] for r in rounds]
        ratio: dict[str, Any] = {"pooled": row["pooled_step_s"] / base, "rounds": gm_se(per_round)}
        snap = row.get("snapshot")
        if snap and snap["seconds"]:
            ratio["predicted"] = 1 + snap["seconds"]["median"] / (row["snapshot_every"] * base)
        out["ratios"][key] = ratio
    return out


# -- 2. time to recover ---------------------------------------------------------------------------------
def recovery_trial(model: nn.Module, pool: Pool, args: argparse.Namespace, scenario: str) -> dict[str, Any]:
    k = args.snapshot_every
    spare = pool.take(1)
    stage_workers = list(pool.stage_workers)
    victim = stage_workers[args.kill_stage]
    before = 2 * k - 1 if scenario == "k-1" else 2 * k  # updates before the kill (the second snapshot holds AdamW's state)
    pipe, opt = new_pipe(model, args, stage_workers, spare, k)
    try:
        times = GuardTimes(pipe._guard)
        it = pipe.train_stream(batches(args, 0, before + 1 + AFTER), F.cross_entropy, opt)
        stamps = [time.perf_counter()]
        for _ in range(before):
            next(it)
            stamps.append(time.perf_counter())
        snapshots = list(pipe._guard.snapshot_seconds)
        if scenario == "0":
            arrived(pipe, before)
        load = loadavg()
        t_kill = pool.kill(victim)
        next(it)
        t_step = time.perf_counter()
        after = [t_step]
        for _ in it:
            after.append(time.perf_counter())
        records = pipe.recoveries
        row = breakdown(t_kill, t_step, times.events, records[-1] if records else None)
        gaps = [b - a for a, b in zip(stamps[2:], stamps[3:])] + [b - a for a, b in zip(after, after[1:])]
        transfers = list(pipe._guard.transfer_seconds)
        xfer = statistics.median(transfers[1:] or transfers)  # (the first, before any update, has no AdamW state)
        row.update(scenario=scenario, victim=victim, spare=spare[0], stage=args.kill_stage, updates_before=before,
                   expected_replayed=k - 1 if scenario == "k-1" else 0, step_s=statistics.median(gaps) if gaps else None,
                   snapshot_s=snapshots, xfer_s=xfer, snapshot_bytes=pipe._guard.snapshot_bytes, loadavg=load,
                   steps_after=len(after), recoveries=len(records))
        row["bar_s"] = args.recover_bar + xfer
        row["judged_s"] = row["kill_to_step_s"] - (row.get("replay_s") or 0.0)
    finally:
        pipe.close()
    pool.stage_workers = [spare[0] if w == victim else w for w in stage_workers]
    return row


def recovery_times(model: nn.Module, pool: Pool, args: argparse.Namespace) -> dict[str, Any]:
    trials = []
    for r in range(args.kill_repeats):
        for scenario in args.scenarios:
            row = recovery_trial(model, pool, args, scenario)
            row["repeat"] = r
            trials.append(row)
            log(f"recovery {scenario} #{r}: killed {row['victim']}, kill -> step {row['kill_to_step_s']:.2f} s, "
                f"replayed {row.get('record', {}).get('replayed')} (load {row['loadavg']})")
    summary = {}
    for scenario in args.scenarios:
        rows = [t for t in trials if t["scenario"] == scenario]
        summary[scenario] = {key: spread([t[key] for t in rows if t.get(key) is not None])
                             for key in ("kill_to_step_s", "surface_s", "ping_s", "detect_s", "rebuild_s",
                                         "resnapshot_s", "replay_s", "retry_s", "judged_s", "xfer_s", "bar_s")}
        summary[scenario]["record_seconds"] = spread([t["record"]["seconds"] for t in rows if "record" in t])
    return {"snapshot_every": args.snapshot_every, "kill_stage": args.kill_stage, "trials": trials,
            "summary": summary}


# -- 3. soak -------------------------------------------------------------------------------------------
def arrived(pipe: Any, update: int, within: float = 30.0) -> None:
    """Wait until the snapshot taken with ``update`` is all on the holder (``pipe.snapshots``): a kill meant
    to find nothing to replay must not land in its transfer (which the step before did not wait for), or the
    holder gives it up and the recovery goes back to the one before."""
    deadline = time.monotonic() + within
    while (pipe.snapshots.committed_update or 0) < update:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the snapshot of update {update} did not reach the holder within {within} s")
        time.sleep(0.001)


def kill_plan(steps: int, every: int) -> list[int]:
    """The update after which each kill comes: i x every (i odd) or i x every - 1 (i even), while < steps."""
    return [i * every - (0 if i % 2 else 1) for i in range(1, steps) if i * every < steps]


def roles(pipe: Any, pool: Pool, spares: Sequence[str]) -> dict[str, str]:
    guard = pipe._guard
    out = {}
    for name in pool.pids:
        if name in pool.killed:
            continue
        if name in pipe._driver.workers:
            out[name] = "stage " + ",".join(str(j) for j, w in enumerate(pipe._driver.workers) if w == name)
        elif name == guard.holder:
            out[name] = "holder"
        elif name in guard.spares and name in spares:
            out[name] = "spare"
    return out


def sample(pipe: Any, pool: Pool, spares: Sequence[str], update: int, what: str) -> dict[str, Any]:
    procs = {"driver": {"role": "driver", "rss": rss(os.getpid())}}
    for name, role in roles(pipe, pool, spares).items():
        procs[name] = {"role": role, "rss": rss(pool.pids[name])}
    return {"update": update, "what": what, "loadavg": loadavg(), "processes": procs}


def flatness(samples: list[dict[str, Any]], tolerance: int, settle: int = 0) -> dict[str, Any]:
    """Per process and role held over two or more samples, from ``settle`` updates after the role began (its
    warm-up: a new holder fills up to two generations and the one arriving, a new stage worker its
    optimizer's state): the first and last RSS, and whether the growth is within max(tolerance, 5%)."""
    segments: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for s in samples:
        for name, p in s["processes"].items():
            if p["rss"] is not None:
                segments.setdefault((name, p["role"]), []).append((s["update"], p["rss"]))
    rows = []
    for (name, role), points in segments.items():
        began = 0 if points[0][0] == samples[0]["update"] else points[0][0]  # (roles of the first sample: at 0)
        settled = [(u, v) for u, v in points if u >= began + settle]
        points = settled if len(settled) >= 2 else points
        if len(points) < 2:
            continue
        first, last = points[0][1], points[-1][1]
        allowed = max(tolerance, int(0.05 * first))
        rows.append({"process": name, "role": role, "from_update": points[0][0], "to_update": points[-1][0],
                     "first": first, "last": last, "growth": last - first, "max": max(v for _, v in points),
                     "allowed": allowed, "flat": last - first <= allowed})
    return {"segments": rows, "flat": all(r["flat"] for r in rows) if rows else None}


def soak(model: nn.Module, pool: Pool, args: argparse.Namespace, reference: tuple[dict[str, Tensor], list[float], float]
         ) -> dict[str, Any]:
    plan = kill_plan(args.soak_steps, args.kill_every)
    spares = pool.take(args.soak_spares)
    k = args.snapshot_every
    pipe, opt = new_pipe(model, args, pool.stage_workers, spares, k)
    kills: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    losses: list[float] = []
    try:
        times = GuardTimes(pipe._guard)
        it = pipe.train_stream(batches(args, 0, args.soak_steps), F.cross_entropy, opt)
        started = time.perf_counter()
        pending: tuple[float, dict[str, Any]] | None = None
        for update, loss in enumerate(it, 1):
            losses.append(loss.item())
            if pending is not None:
                t_kill, row = pending
                records = pipe.recoveries
                row.update(breakdown(t_kill, time.perf_counter(), times.events, records[-1] if records else None))
                log(f"soak kill {len(kills)} after update {row['after_update']}: {row['victim']} -> "
                    f"{row.get('record', {}).get('spare')}, kill -> step {row['kill_to_step_s']:.2f} s, replayed "
                    f"{row.get('record', {}).get('replayed')} (load {row['loadavg']})")
                pending = None
            if update == args.soak_warmup:
                samples.append(sample(pipe, pool, spares, update, "warm"))
            elif (update not in plan and args.soak_warmup < update < args.soak_steps and args.rss_every
                  and update % args.rss_every == 0):
                samples.append(sample(pipe, pool, spares, update, "every"))
            if update in plan:
                if update % k == 0:
                    arrived(pipe, update)
                samples.append(sample(pipe, pool, spares, update, f"kill {len(kills) + 1}"))
                stage = len(kills) % args.stages
                victim = pipe._driver.workers[stage]
                row = {"after_update": update, "stage": stage, "victim": victim, "loadavg": loadavg(),
                       "expected_replayed": 0 if update % k == 0 else update % k}
                kills.append(row)
                pending = (pool.kill(victim), row)
        wall = time.perf_counter() - started
        samples.append(sample(pipe, pool, spares, len(losses), "end"))
        state = {key: v.detach().clone() for key, v in pipe.state_dict().items()}
        final_workers = list(pipe._driver.workers)
        recoveries = len(pipe.recoveries)
        snapshot_s = list(pipe._guard.snapshot_seconds)
        transfer_s = list(pipe._guard.transfer_seconds)
        snapshot_bytes = pipe._guard.snapshot_bytes
    finally:
        pipe.close()
    pool.stage_workers = final_workers
    ref_state, ref_losses, ref_s = reference
    try:
        torch.testing.assert_close(state, ref_state, atol=1e-6, rtol=0)
        exact, mismatch = True, None
    except AssertionError as exc:
        exact, mismatch = False, str(exc)[:2000]
    weight_diff = max((state[key] - ref_state[key]).abs().max().item() for key in ref_state)
    loss_diff = max((abs(a - b) for a, b in zip(losses, ref_losses)), default=math.nan)
    return {"steps": len(losses), "kill_every": args.kill_every, "spares": spares, "snapshot_every": k,
            "plan": plan, "kills": kills, "recoveries": recoveries, "final_workers": final_workers,
            "wall_s": wall, "step_s": wall / max(1, len(losses)), "snapshot_s": quantiles(snapshot_s),
            "transfer_s": quantiles(transfer_s), "snapshot_bytes": snapshot_bytes, "samples": samples,
            "rss": flatness(samples, args.rss_tolerance_mib * MIB, args.soak_warmup), "exact": exact, "mismatch": mismatch,
            "max_weight_diff": weight_diff, "max_loss_diff": loss_diff, "reference_s": ref_s,
            "losses": losses}


# -- the run -------------------------------------------------------------------------------------------
def pool_size(args: argparse.Namespace) -> int:
    trials = len(args.scenarios) * args.kill_repeats if "recovery" in args.sections else 0
    spares = args.soak_spares if "soak" in args.sections else 0
    return args.stages + max(1, trials + spares)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = make_model(args.width, args.blocks)
    params = sum(p.numel() for p in model.parameters())
    result: dict[str, Any] = {
        "loadavg_start": loadavg(), "machine": machine_info(1, 1), "source": source_state(),
        "model": {"description": f"{args.blocks} x (Linear({args.width}) + ReLU), batch {args.batch}, "
                                 f"cross-entropy; AdamW lr {args.lr}",
                  "width": args.width, "blocks": args.blocks, "batch": args.batch, "chunks": args.chunks,
                  "stages": args.stages, "balance": balance(args.blocks, args.stages), "parameters": params,
                  "weight_bytes": params * 4, "schedule": "1F1B", "checkpoint": "never"}}
    reference = None
    if "soak" in args.sections:
        reference = plain_run(model, args, args.soak_steps)
        log(f"plain PyTorch reference: {args.soak_steps} steps in {reference[2]:.1f} s")
    size = pool_size(args)
    t0 = time.perf_counter()
    with workers.LocalWorkers(size, threads=1, startup_timeout=args.startup_timeout) as local:
        pool = Pool(local.names, args.stages)
        result["workers"] = {"names": list(local.names), "pids": dict(pool.pids),
                             "start_s": time.perf_counter() - t0}
        log(f"{size} local workers started in {result['workers']['start_s']:.1f} s (load {loadavg()})")
        if args.warm_spares:  # what a spare's first optimizer costs it, paid now (not rrefpipe's default)
            t1 = time.perf_counter()
            for name in pool.fresh:
                rpc.rpc_sync(name, exec, args=("import torch._dynamo",))
            result["workers"]["warm_spares_s"] = time.perf_counter() - t1
        if "steady" in args.sections:
            result["steady"] = steady_state(model, pool, args)
        if "recovery" in args.sections:
            result["recovery"] = recovery_times(model, pool, args)
        if "soak" in args.sections:
            assert reference is not None
            result["soak"] = soak(model, pool, args, reference)
        result["killed"] = list(pool.killed)
    result["loadavg_end"] = loadavg()
    return result


def source_state() -> dict[str, Any]:
    import subprocess

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "?"

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "changed": git("status", "--porcelain", "--", "rrefpipe", "workers").splitlines()}


# -- targets ---------------------------------------------------------------------------------------------
def _target(name: str, met: bool | None, detail: str) -> dict[str, Any]:
    return {"target": name, "met": met, "detail": detail}


def _pm(s: dict[str, Any]) -> str:
    se = "n/a" if s["se"] is None else f"{s['se']:.3f}"
    return f"{s['gm']:.3f} +- {se} over {s['n']} (range {s['min']:.3f}-{s['max']:.3f})"


def evaluate(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    steady = result.get("steady")
    k = result["settings"]["snapshot_every"]
    title = f"steady state: step time with spares=1, snapshot_every={k} / spares=0 <= 1.05"
    if steady and f"k{k}" in steady["ratios"]:
        r, aa = steady["ratios"][f"k{k}"], steady["ratios"][CONTROL]
        detail = (f"pooled {r['pooled']:.3f}, rounds {_pm(r['rounds'])} | A/A control pooled {aa['pooled']:.3f}, "
                  f"rounds {_pm(aa['rounds'])}")
        if "predicted" in r:
            detail += f" | snapshots alone (median time / (k x base step)) {r['predicted']:.3f}"
        out.append(_target(title, r["pooled"] <= 1.05, detail))
    else:
        out.append(_target(title, None, "not measured"))
    rec = result.get("recovery")
    title = "time to recover: kill -> next step <= 2 s + the state's transfer (replay 0); minus the replay (replay k-1)"
    if rec and rec["trials"]:
        parts = [f"{t['scenario']}: {t['judged_s']:.2f} s vs {t['bar_s']:.2f} s" for t in rec["trials"]]
        out.append(_target(title, all(t["judged_s"] <= t["bar_s"] for t in rec["trials"]), "; ".join(parts)))
    else:
        out.append(_target(title, None, "not measured"))
    sk = result.get("soak")
    title = "soak: final weights equal the uninterrupted plain-PyTorch run's (assert_close atol 1e-6, rtol 0)"
    if sk:
        out.append(_target(title, sk["exact"] and sk["recoveries"] == len(sk["kills"]),
                           f"{sk['steps']} steps, {len(sk['kills'])} kills, {sk['recoveries']} recoveries; largest "
                           f"weight difference {sk['max_weight_diff']:.3g}, loss {sk['max_loss_diff']:.3g}"))
        segs = sk["rss"]["segments"]
        worst = sorted(segs, key=lambda s: s["growth"] - s["allowed"])[-3:]
        out.append(_target("soak: RSS of the driver and the live workers flat (per role held)", sk["rss"]["flat"],
                           "; ".join(f"{s['process']} ({s['role']}) {s['growth'] / MIB:+.1f} MiB over updates "
                                     f"{s['from_update']}-{s['to_update']} (allowed {s['allowed'] / MIB:.0f})"
                                     for s in worst[::-1]) or "no process sampled twice in one role"))
    else:
        out.append(_target(title, None, "not measured"))
    return out


# -- report --------------------------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def print_steady(result: dict[str, Any]) -> None:
    st = result["steady"]
    print(f"\nSteady state: train_stream step time (a window of W batches after {WARMUP}, snapshots amortised), "
          f"{len(st['rounds'])} round(s): median [min-max] of the rounds; /base = pooled over base's, rounds = "
          "geometric mean of the rounds' ratios +- s.e.; snapshot = pipe._guard.snapshot_seconds, what the next step "
          "waits for (median [p10-p90]); xfer = pipe._guard.transfer_seconds, until all of it is on the holder "
          "(median), while the next step runs; held = snapshot_bytes (x weights); pred = 1 + snapshot / (k x base step)")
    print(f"  {'pipe':<8} {'spares':>6} {'every':>5} {'W':>3} | {'step ms':>18} | {'/base':>6} {'rounds':>13} | "
          f"{'snapshot ms':>16} {'xfer':>5} {'n':>3} {'held MiB':>9} {'x w':>5} | {'pred':>5}")
    for key, row in st["pipes"].items():
        s = row["step_s"]
        step = f"{s['median'] * 1e3:.1f} [{s['min'] * 1e3:.0f}-{s['max'] * 1e3:.0f}]"
        ratio = st["ratios"].get(key)
        rr = "-" if ratio is None else f"{ratio['pooled']:.3f}"
        rd = "-" if ratio is None else (f"{ratio['rounds']['gm']:.3f}" + (
            f"+-{ratio['rounds']['se']:.3f}" if ratio["rounds"]["se"] is not None else ""))
        snap = row.get("snapshot")
        if snap and snap["seconds"]:
            q = snap["seconds"]
            sn = f"{q['median'] * 1e3:.0f} [{q['p10'] * 1e3:.0f}-{q['p90'] * 1e3:.0f}]"
            xfer = _ms((snap.get("transfer") or {}).get("median"))
            held = f"{snap['bytes'] / MIB:9.1f} {snap['bytes_over_weights']:5.2f}"
            count = snap["count"]
        else:
            sn, xfer, held, count = "-", "-", f"{'-':>9} {'-':>5}", "-"
        pred = f"{ratio['predicted']:.3f}" if ratio and "predicted" in ratio else "-"
        every = row["snapshot_every"] or "-"
        print(f"  {key:<8} {row['spares']:>6} {every:>5} {row['window']:>3} | {step:>18} | {rr:>6} {rd:>13} | "
              f"{sn:>16} {xfer:>5} {count:>3} {held} | {pred:>5}")


def print_recovery(result: dict[str, Any]) -> None:
    rec = result["recovery"]
    k = rec["snapshot_every"]
    print(f"\nTime to recover (seconds): stage {rec['kill_stage']}'s worker SIGKILLed between steps, spares=1, "
          f"snapshot_every={k}; kill->step = perf_counter before os.kill to the next loss; surface = kill to "
          "Guard.recover called; ping = Guard.dead; detect = surface + ping; rebuild = the rest of recover less "
          "resnap and replay; retry = the failed batch again; rec.s = pipe.recoveries[-1].seconds; xfer = the "
          "pipe's median snapshot transfer time (pipe._guard.transfer_seconds); bar = 2 + xfer, against kill->step less replay")
    print(f"  {'replay':>6} {'victim':>8} {'spare':>8} {'n':>2} | {'kill->step':>10} {'surface':>7} {'ping':>5} "
          f"{'detect':>6} {'rebuild':>7} {'resnap':>6} {'replay':>6} {'retry':>5} | {'rec.s':>5} {'step':>5} "
          f"{'xfer':>5} {'bar':>5} {'ok':>3} | load")
    for t in rec["trials"]:
        rep = t.get("record", {}).get("replayed", "?")
        print(f"  {t['scenario']:>6} {t['victim']:>8} {t['spare']:>8} {rep!s:>2} | {_s(t['kill_to_step_s']):>10} "
              f"{_s(t.get('surface_s')):>7} {_s(t.get('ping_s')):>5} {_s(t.get('detect_s')):>6} "
              f"{_s(t.get('rebuild_s')):>7} {_s(t.get('resnapshot_s')):>6} {_s(t.get('replay_s')):>6} "
              f"{_s(t.get('retry_s')):>5} | {_s(t.get('record', {}).get('seconds')):>5} {_s(t['step_s']):>5} "
              f"{_s(t['xfer_s']):>5} {_s(t['bar_s']):>5} {'yes' if t['judged_s'] <= t['bar_s'] else 'NO':>3} | "
              f"{(t['loadavg'] or ['?'])[0]}")
    for scenario, s in rec["summary"].items():
        parts = [f"{name} {v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]" for name, v in s.items()
                 if v is not None and name in ("kill_to_step_s", "detect_s", "rebuild_s", "record_seconds")]
        print(f"  replay {scenario}: median [min-max] " + ", ".join(parts))


def print_soak(result: dict[str, Any]) -> None:
    sk = result["soak"]
    print(f"\nSoak: {sk['steps']} steps, a stage worker killed after updates {sk['plan']}, spares={len(sk['spares'])}, "
          f"snapshot_every={sk['snapshot_every']}; {sk['wall_s']:.1f} s ({sk['step_s'] * 1e3:.0f} ms per step with "
          f"the recoveries); snapshot {_ms((sk['snapshot_s'] or {}).get('median'))} ms median (the step's wait), "
          f"transfer {_ms((sk.get('transfer_s') or {}).get('median'))} ms, "
          f"{sk['snapshot_bytes'] / MIB:.1f} MiB held")
    print(f"  {'after':>5} {'stage':>5} {'victim':>8} -> {'spare':>8} {'rep':>3} | {'kill->step':>10} {'detect':>6} "
          f"{'rebuild':>7} {'resnap':>6} {'replay':>6} {'rec.s':>5} | load")
    for kl in sk["kills"]:
        rec = kl.get("record", {})
        print(f"  {kl['after_update']:>5} {kl['stage']:>5} {kl['victim']:>8} -> {rec.get('spare', '?'):>8} "
              f"{rec.get('replayed', '?')!s:>3} | {_s(kl.get('kill_to_step_s')):>10} {_s(kl.get('detect_s')):>6} "
              f"{_s(kl.get('rebuild_s')):>7} {_s(kl.get('resnapshot_s')):>6} {_s(kl.get('replay_s')):>6} "
              f"{_s(rec.get('seconds')):>5} | {(kl['loadavg'] or ['?'])[0]}")
    names = list(dict.fromkeys(n for s in sk["samples"] for n in s["processes"]))
    print("  VmRSS MiB (role) at each sample:")
    print(f"  {'update':>6} {'when':<7} | " + " ".join(f"{n:>16}" for n in names))
    for s in sk["samples"]:
        cells = []
        for n in names:
            p = s["processes"].get(n)
            cells.append(f"{'-':>16}" if p is None or p["rss"] is None else
                         f"{p['rss'] / MIB:>7.0f} {'(' + p['role'] + ')':>8}")
        print(f"  {s['update']:>6} {s['what']:<7} | " + " ".join(cells))
    print(f"  RSS flat (per role held, growth <= max({result['settings']['rss_tolerance_mib']} MiB, 5%)): "
          f"{sk['rss']['flat']}; exact (assert_close atol 1e-6 rtol 0 vs plain PyTorch): {str(sk['exact']).lower()}, "
          f"largest weight difference {sk['max_weight_diff']:.3g}, loss {sk['max_loss_diff']:.3g}; "
          f"{sk['recoveries']} recoveries for {len(sk['kills'])} kills")


def report(result: dict[str, Any], out: Path) -> None:
    m, model = result["machine"], result["model"]
    print(f"\nrrefpipe recovery (issue 52): {m['platform']}, torch {m['torch']}, {m['cpu_count']} CPUs "
          f"({m['cpus_usable']} usable); {model['description']}; {model['stages']} stages {model['balance']}, "
          f"m = {model['chunks']}, 1F1B, checkpoint 'never'; {model['weight_bytes'] / MIB:.1f} MiB of weights; "
          f"{len(result['workers']['names'])} local workers (started in {result['workers']['start_s']:.1f} s), "
          f"every process 1 intra-op thread; rrefpipe at {result['source']['commit']}"
          + (f" (with uncommitted changes in {len(result['source']['changed'])} files)"
             if result["source"]["changed"] else ""))
    if "steady" in result:
        print_steady(result)
    if "recovery" in result:
        print_recovery(result)
    if "soak" in result:
        print_soak(result)
    print_targets(result["targets"], "52")
    print_written(result, out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = new_parser(__doc__, DEFAULT_OUT)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 stages of 2 x Linear(32), batch 16, m = 2, snapshot_every 2 (1 and 4 beside), "
                        "1 round, one recovery trial, a soak of 12 steps with one kill")
    p.add_argument("--sections", nargs="+", choices=("steady", "recovery", "soak"),
                   default=["steady", "recovery", "soak"], help="what to measure")
    p.add_argument("--stages", type=int, default=4, help="stage workers (one stage each)")
    p.add_argument("--width", type=int, default=512, help="Linear width (and classes)")
    p.add_argument("--blocks", type=int, default=8, help="(Linear + ReLU) blocks")
    p.add_argument("--batch", type=int, default=128, help="rows per batch")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per batch (>= stages for 1F1B)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    p.add_argument("--snapshot-every", type=int, default=10, help="k: the default snapshot interval measured")
    p.add_argument("--compare-every", type=int, nargs="*", default=[1, 50], help="other intervals, steady state")
    p.add_argument("--window", type=int, default=20, help="least timed batches per pipe and round (steady state)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every pipe (steady state)")
    p.add_argument("--kill-repeats", type=int, default=2, help="recovery trials per scenario")
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS),
                   help="batches left to replay by a trial's kill: k-1 or 0")
    p.add_argument("--kill-stage", type=int, default=1, help="the stage whose worker a recovery trial kills")
    p.add_argument("--recover-bar", type=float, default=2.0, help="seconds allowed beyond the state's transfer")
    p.add_argument("--soak-steps", type=int, default=400, help="batches of the soak (the issue: 2000)")
    p.add_argument("--kill-every", type=int, default=100, help="a stage worker killed every this many (the issue: 200)")
    p.add_argument("--soak-spares", type=int, default=None, help="spares of the soak's pipe (default: kills + 1)")
    p.add_argument("--soak-warmup", type=int, default=None,
                   help="update of the soak's first RSS sample (default: --kill-every / 2)")
    p.add_argument("--rss-every", type=int, default=50, help="also sample RSS every this many updates (0: no)")
    p.add_argument("--warm-spares", action="store_true",
                   help="import torch._dynamo on every spare before measuring (a process's first torch.optim "
                        "optimizer imports it: 0.8-2 s on 2 busy cores, otherwise paid in the recovery)")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds the local workers have to join (many start at once on 2 busy cores)")
    p.add_argument("--rss-tolerance-mib", type=int, default=16, help="RSS growth still flat (or 5%%, the larger)")
    add_run_args(p)
    args = p.parse_args(argv)
    if args.quick:
        args.stages, args.width, args.blocks, args.batch, args.chunks = 2, 32, 4, 16, 2
        args.snapshot_every, args.compare_every, args.window, args.rounds = 2, [1, 4], 4, 1
        args.kill_repeats, args.scenarios = 1, ["k-1"]
        args.soak_steps, args.kill_every, args.soak_warmup = 12, 6, 3
    if args.soak_warmup is None:
        args.soak_warmup = max(1, args.kill_every // 2)
    kills = len(kill_plan(args.soak_steps, args.kill_every))
    if args.soak_spares is None:
        args.soak_spares = kills + 1
    if (args.stages < 2 or args.chunks < args.stages or args.chunks > args.batch or args.blocks < args.stages
            or args.snapshot_every < 1 or min(args.compare_every, default=1) < 1 or args.window < 1
            or args.rounds < 1 or args.kill_repeats < 0 or not 0 <= args.kill_stage < args.stages
            or args.kill_every < 1 or args.soak_spares < kills or not 1 <= args.soak_warmup < args.soak_steps):
        p.error("need 2 <= stages <= chunks <= batch, blocks >= stages, positive intervals, window and rounds, "
                "0 <= kill-stage < stages, soak-spares >= the soak's kills, 1 <= soak-warmup < soak-steps")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    run_and_report(parse_args(argv), run, evaluate, report)


if __name__ == "__main__":
    main()
    exit_without_teardown()  # the workers are closed and the results written
