"""bench_schedules' zero-bubble section (issue #49): rrefpipe's ZBVZeroBubble, InterleavedZeroBubble and
DualPipeV against its 1F1B, against torch.distributed.pipelining's schedules of the same names, and
against the physical limit; and each stage's split backward (I + W) against its fused backward.

``bench_schedules.py`` runs it (``--zb-models``, ``--zb-chunks``, ``--zb-contestants``, ``--bw-repeats``;
``--zero-bubble-only`` skips its other sections); its module docstring, section 4, defines every number
here. This file holds the section's pieces: the layouts and splits, pipelining's multi-stage ranks for
these schedules, the measurements (split backward, physical yardstick, simulated bubble), the targets
and the tables.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from bench_core import loadavg, ms, one_process_step, summary, time_calls
from bench_schedules import CONTROL, _f, _pm, _ratio, _target, cores, cores_used, gm_se, time_train_step
from bench_suite import log, pipelining_row, pooled
from suite_models import SPECS, ModelSpec, split
from suite_pipelining import LR, timed_steps
from suite_report import cpu_total_ms, sps

from rrefpipe.schedule import is_split, simulate, stage_layout, worker_orders

P = 2  # workers (rrefpipe stage workers; pipelining ranks)
ZB_CHUNKS = (4, 8, 16)
#: Layers per stage of the 4-stage splits, by layout. ``loop``: stage j on worker j mod 2 (Megatron's,
#: rrefpipe's Interleaved* and pipelining's ScheduleInterleaved*): each worker holds its 2-stage split's
#: layers, as ``bench_schedules.IL_BALANCES``. ``v``: stage j on worker j for j < 2, 3 - j otherwise
#: (ZBVZeroBubble, DualPipeV): worker 0 holds the first and the last stage, so the splits differ where
#: layers differ in cost. The Transformer's (and tiny's) 6 equal layers: 3 per worker either way. The
#: ResNet's: ``rrefpipe.balance.balance_cost`` over its layers timed at 16 samples, 1 thread (this
#: machine), which puts 58/55 ms of 114 on the V layout's workers and 64/50 on the loop layout's (its
#: 2-stage split [5, 7]: 62/52).
BALANCES = {
    "loop": {"mlp": [4, 4, 4, 4], "resnet": [4, 1, 2, 5], "transformer": [1, 2, 2, 1], "tiny": [1, 2, 2, 1]},
    "v": {"mlp": [4, 4, 4, 4], "resnet": [4, 1, 2, 5], "transformer": [2, 1, 2, 1], "tiny": [2, 1, 2, 1]},
}


class Contestant(NamedTuple):
    """A contestant of the section: the schedule it runs, its stages per worker and its split's layout
    (``two``: the 2-stage split ``spec.balance(2)``), and whose processes run it."""

    schedule: str
    stages_per_worker: int
    layout: str
    framework: str  # 'rrefpipe' | 'pipelining'

    @property
    def stages(self) -> int:
        return P * self.stages_per_worker

    @property
    def split_backward(self) -> bool:
        return is_split(self.schedule)


#: Every contestant, in the order of a round (reversed every other round and at every other chunk count).
#: ``izb1``/``pp_izb1`` (InterleavedZeroBubble with 1 stage per worker on the 2-stage split, ZB-H1) are
#: not in the default run.
CONTESTANTS: dict[str, Contestant] = {
    "pp_1f1b": Contestant("1F1B", 1, "two", "pipelining"),
    "1f1b": Contestant("1F1B", 1, "two", "rrefpipe"),
    "pp_zbv": Contestant("ZBVZeroBubble", 2, "v", "pipelining"),
    "zbv": Contestant("ZBVZeroBubble", 2, "v", "rrefpipe"),
    CONTROL: Contestant("1F1B", 1, "two", "pipelining"),
    "gpipe": Contestant("GPipe", 1, "two", "rrefpipe"),
    "pp_izb": Contestant("InterleavedZeroBubble", 2, "loop", "pipelining"),
    "izb": Contestant("InterleavedZeroBubble", 2, "loop", "rrefpipe"),
    "pp_dpv": Contestant("DualPipeV", 2, "v", "pipelining"),
    "dpv": Contestant("DualPipeV", 2, "v", "rrefpipe"),
    "pp_izb1": Contestant("InterleavedZeroBubble", 1, "two", "pipelining"),
    "izb1": Contestant("InterleavedZeroBubble", 1, "two", "rrefpipe"),
}
DEFAULT_CONTESTANTS = tuple(k for k in CONTESTANTS if not k.endswith("izb1"))
#: The zero-bubble contestants whose ratios the targets read, rrefpipe's key -> pipelining's.
ZERO_BUBBLE = {"zbv": "pp_zbv", "izb": "pp_izb", "dpv": "pp_dpv", "izb1": "pp_izb1"}
PHYSICAL = "physical"  # the one-process step, timed in each round beside the contestants
#: pipelining's schedule keys of ``suite_pipelining``'s commands for this section's schedules.
PP_SCHEDULES = {"zbv": ("ZBVZeroBubble", "v"), "izb": ("InterleavedZeroBubble", "loop"),
                "dpv": ("DualPipeV", "v"), "izb1": ("InterleavedZeroBubble", "two")}
LABELS = {"pp_1f1b": "pp1F1B", "1f1b": "1F1B", "pp_zbv": "ppZBV", "zbv": "ZBV", CONTROL: "A/A pp", "gpipe": "GPipe",
          "pp_izb": "ppIZB", "izb": "IZB", "pp_dpv": "ppDPV", "dpv": "DPV", "pp_izb1": "ppIZB1", "izb1": "IZB1"}


def balance(spec: ModelSpec, layout: str) -> list[int]:
    return spec.balance(2) if layout == "two" else BALANCES[layout][spec.name]


def stage_workers(layout: str, stages: int) -> list[int]:
    """The worker (rank) of each stage under ``layout``: rrefpipe's V or loop layout (``stage_layout``)."""
    return stage_layout("ZBVZeroBubble" if layout == "v" else "Interleaved1F1B", stages, stages // P)


def pp_schedule_key(key: str) -> str:
    """The schedule name a pipelining contestant sends its ranks (``suite_pipelining``'s, or this file's)."""
    c = CONTESTANTS[key]
    return "1f1b" if c.schedule == "1F1B" else key.removeprefix("pp_")


# -- torch.distributed.pipelining: multi-stage ranks ----------------------------------------------
def pp_time_steps(cmd: dict[str, Any], rank: int, world: int, cache: dict[str, Any]) -> dict[str, Any]:
    """A pipelining rank's timed steps of ``cmd["schedule"]`` (a ``PP_SCHEDULES`` key): the stages its
    layout gives this rank (V: ``rank`` and ``2 world - 1 - rank``; loop: ``rank``, ``rank + world``; the
    2-stage split: ``rank``), each a ``PipelineStage``, run by pipelining's schedule class of that name,
    which splits each stage's backward into I and W itself; timed as ``suite_pipelining`` times the others."""
    import torch.distributed.pipelining as pp
    from torch.distributed.pipelining import PipelineStage

    schedule, layout = PP_SCHEDULES[cmd["schedule"]]
    spec = SPECS[cmd["model"]]
    bal = balance(spec, layout)
    n = len(bal)
    key = f"{spec.name}/{layout}"
    if key not in cache:
        cache.clear()  # one model at a time
        parts = split(spec.build(), bal)
        mine = [j for j, w in enumerate(stage_workers(layout, n)) if w == rank]
        cache[key] = (mine, [parts[j] for j in mine], *spec.data())
    mine, parts, x, y = cache[key]
    stages: list[Any] = [PipelineStage(part, j, n, torch.device("cpu")) for j, part in zip(mine, parts)]
    cls = getattr(pp, f"Schedule{schedule}")
    sched = cls(stages, n_microbatches=cmd["chunks"], loss_fn=spec.loss_fn())
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=LR)
    return timed_steps(cmd, sched, opt, first=0 in mine, last=n - 1 in mine, x=x, y=y)


# -- split backward: I + W against one fused backward, and the stage costs the simulation takes --------
def split_backward_costs(model: nn.Sequential, bal: Sequence[int], x: Tensor, rows: int, warmup: int,
                         repeats: int) -> list[dict[str, float]]:
    """Per stage of ``model`` split by ``bal``, for ``rows`` samples, in this process with 1 intra-op thread:
    the forward (``forward_ms``), one fused backward (``torch.autograd.backward``, ``backward_ms``), and the
    split backward's halves (``rrefpipe.stage_side.backward_split.input_gradients``, ``input_ms``; then
    ``WeightGradients.run``, ``weight_ms``), each the median over ``repeats`` after ``warmup``; in each
    repeat both backwards run, each after its own forward, in an order alternating between repeats.
    ``split_over_fused``: the median of the repeats' I + W over the fused backward's median. Stage 0's
    input needs no gradient (as in a pipeline), so there everything is W."""
    from rrefpipe.stage_side.backward_split import input_gradients

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    stages = [copy.deepcopy(s) for s in split(model, list(bal))]
    out: list[dict[str, float]] = []
    h = x[:rows].clone()
    try:
        for j, stage in enumerate(stages):
            inp = h.detach().requires_grad_(j > 0)
            with torch.no_grad():
                h = stage(inp)
            grad = torch.randn_like(h)
            params = [p for p in stage.parameters() if p.requires_grad]
            times: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": [], "IW": []}

            def forward() -> Tensor:
                start = time.perf_counter()
                y = stage(inp)
                times["F"].append(time.perf_counter() - start)
                return y

            def fused() -> None:
                y = forward()
                start = time.perf_counter()
                torch.autograd.backward([y], [grad])
                times["B"].append(time.perf_counter() - start)
                inp.grad = None

            def halves() -> None:
                y = forward()
                start = time.perf_counter()
                _, later = input_gradients([y], [grad], [inp] if j > 0 else [], params)
                mid = time.perf_counter()
                later.run()
                end = time.perf_counter()
                times["I"].append(mid - start)
                times["W"].append(end - mid)
                times["IW"].append(end - start)

            for k in range(warmup + repeats):
                if k == warmup:
                    times = {kind: [] for kind in times}
                for call in ((fused, halves) if k % 2 == 0 else (halves, fused)):
                    call()
            med = {kind: ms(statistics.median(v)) for kind, v in times.items()}
            out.append({"forward_ms": med["F"], "backward_ms": med["B"], "input_ms": med["I"],
                        "weight_ms": med["W"], "split_ms": med["IW"], "split_over_fused": med["IW"] / med["B"]})
    finally:
        torch.set_num_threads(saved)
    return out


# -- the physical limit -----------------------------------------------------------------------------
def physical_step(model: nn.Sequential, data: tuple[Tensor, Tensor], loss_fn: Callable[[Tensor, Tensor], Tensor],
                  chunks: int, warmup: int, repeats: int) -> dict[str, Any]:
    """One process's micro-batched step (``bench_core.one_process_step``), 1 intra-op thread.
    ``physical_step_ms`` is its median over the ``P`` workers: no pipeline on ``P`` workers can do it
    faster unless its stages compute faster than this process does."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = time_calls(one_process_step(model, data, loss_fn, chunks, LR), warmup, repeats)
    finally:
        torch.set_num_threads(saved)
    return {"step": summary(times)}


def physical_row(rows: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """The rounds' one-process steps pooled (all their timed steps), and the physical limit from them."""
    one = summary([t / 1e3 for r in rows for t in r["step"]["samples_ms"]])
    step_ms = physical_ms(one["median_ms"], P)
    return {"one_process": one, "workers": P, "physical_step_ms": step_ms,
            "samples_per_s": batch / (step_ms / 1e3), "round_medians_ms": [r["step"]["median_ms"] for r in rows]}


def physical_ms(one_process_ms: float, workers: int) -> float:
    """The physical limit of a step: one process's time for it over the number of workers."""
    return one_process_ms / workers


# -- the simulated bubble ---------------------------------------------------------------------------
def stage_kind_costs(costs: list[dict[str, float]]) -> list[dict[str, float]]:
    """Per stage, the ms of each kind of action: F, B (the fused backward), I and W."""
    return [{"F": c["forward_ms"], "B": c["backward_ms"], "I": c["input_ms"], "W": c["weight_ms"]} for c in costs]


def work_ms(costs: list[dict[str, float]], chunks: int, split_backward: bool) -> float:
    """All stages' compute of a step: ``chunks`` x the sum over stages of F + B, or of F + I + W."""
    return chunks * sum(c["F"] + (c["I"] + c["W"] if split_backward else c["B"]) for c in costs)


def simulated(schedule: str, stages: int, chunks: int, stages_per_worker: int,
              costs: list[dict[str, float]]) -> dict[str, Any]:
    """``rrefpipe.schedule.simulate`` of the schedule's worker orders (``worker_orders``) with the measured
    costs (``stage_kind_costs``): its makespan (ms), bubble and workers' busy ms, and ``work_ms``, the
    orders' actions each at its own stage's cost. ``simulate`` takes one cost per kind of action, so
    each kind costs the mean of its per-stage costs (the stages' total work is kept; where stages
    differ, as stage 0, whose I is next to nothing, against the others, the model evens them out). An
    error (a schedule ``worker_orders`` lacks) is the row's ``error``."""
    try:
        orders = worker_orders(schedule, stages, chunks, stages_per_worker)
        per_kind = kind_means(costs)
        sim = simulate(orders, per_kind)
    except Exception as exc:  # reported, not fatal: the measurements stand without it
        return {"error": repr(exc)[-500:]}
    work = sum(costs[a.j][a.kind] for order in orders for a in order)
    return {"step_ms": sim.makespan, "bubble": sim.bubble, "busy_ms": list(sim.busy), "costs_ms": per_kind,
            "work_ms": work}


def kind_means(costs: list[dict[str, float]]) -> dict[str, float]:
    """Each kind's mean cost over the stages (a positive floor: ``simulate`` refuses a zero cost)."""
    return {kind: max(statistics.fmean(c[kind] for c in costs), 1e-6) for kind in costs[0]}


def achieved_bubble(step_ms: float, work: float, workers: int = P) -> float:
    """The idle share of the workers' time in a step of ``step_ms``, taking their busy time as the stages'
    compute timed in this process (``work``): ``1 - work / (workers x step_ms)``."""
    return 1 - work / (workers * step_ms)


# -- a cell -----------------------------------------------------------------------------------------
def run_cell(cluster: Any, groups: dict[str, Any], spec: ModelSpec, m: int, k: int, contestants: Sequence[str],
             model: nn.Sequential, args: argparse.Namespace) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Every contestant and the one-process step at ``m`` micro-batches, back to back, ``--rounds`` times
    (the order reversed every other round and at odd ``k``), each one's timed steps of all rounds pooled."""
    rounds: dict[str, list[dict[str, Any]]] = {}
    data = spec.data()
    order = [*contestants, PHYSICAL]
    for r in range(args.rounds):
        for key in (order if (k + r) % 2 == 0 else order[::-1]):
            if key == PHYSICAL:
                row = physical_step(model, data, spec.loss_fn(), m, args.warmup, args.repeats)
                rounds.setdefault(key, []).append(row)
                log(f"  {spec.name} m={m} one process: {row['step']['median_ms']:.1f} ms")
                continue
            c = CONTESTANTS[key]
            bal = balance(spec, c.layout)
            if c.framework == "pipelining":
                row = pipelining_row(groups[key], spec, pp_schedule_key(key), m, len(bal), args)
            else:
                row = time_train_step(cluster.names, model, bal, data, spec.loss_fn(), m, key, args.warmup,
                                      args.repeats, [os.getpid(), *cluster.pids[:P]],
                                      rref=(c.schedule, "never", c.stages_per_worker))
            rounds.setdefault(key, []).append(row)
            log(f"  {spec.name} m={m} {key}: " + (f"{row['samples_per_s']:.1f} samples/s" if "error" not in row
                                                  else row["error"].splitlines()[0]))
    physical = physical_row(rounds.pop(PHYSICAL), spec.batch)
    out = {key: pooled(rows, spec.batch) for key, rows in rounds.items()}
    for row in out.values():
        row["cores"] = cores_used(row)
    return out, physical


def add_yardsticks(row: dict[str, Any], c: Contestant, physical: dict[str, Any], costs: list[dict[str, float]],
                   sim: dict[str, Any], m: int) -> None:
    """A contestant's row: achieved over the physical limit, its bubble against the simulated one."""
    if "error" in row:
        return
    step = row["step"]["median_ms"]
    row["achieved_over_physical"] = physical["physical_step_ms"] / step
    row["work_ms"] = sim.get("work_ms") or work_ms(stage_kind_costs(costs), m, c.split_backward)
    row["achieved_bubble"] = achieved_bubble(step, row["work_ms"])
    if "error" not in sim:
        row["simulated_step_ms"], row["simulated_bubble"] = sim["step_ms"], sim["bubble"]
        row["achieved_over_simulated"] = sim["step_ms"] / step


def section(cluster: Any, groups: dict[str, Any], spec: ModelSpec, args: argparse.Namespace) -> dict[str, Any]:
    """One model: the stage costs of each split (split backward against fused, per m), then every cell."""
    load_start = loadavg()
    model = spec.build()
    keys = list(args.zb_contestants)
    layouts = sorted({CONTESTANTS[k].layout for k in keys} | {"two"})
    x = spec.data()[0]
    log(f"{spec.name}, zero bubble: timing each stage's fused and split backward ...")
    costs = {layout: {str(m): split_backward_costs(model, balance(spec, layout), x, math.ceil(spec.batch / m),
                                                   args.warmup, args.bw_repeats) for m in args.zb_chunks}
             for layout in layouts}
    if not args.quick:  # one untimed step on each group of processes first, as bench_schedules' warm_up
        warm_up(cluster, groups, spec, model, args.zb_chunks[0], keys, args)
    rows = []
    for k, m in enumerate(args.zb_chunks):
        load = loadavg()
        contestants, physical = run_cell(cluster, groups, spec, m, k, keys, model, args)
        sims: dict[str, dict[str, Any]] = {}
        for key, row in contestants.items():
            c = CONTESTANTS[key]
            per_stage = costs[c.layout][str(m)]
            name = f"{c.schedule}/{c.stages_per_worker}"
            if name not in sims:
                sims[name] = simulated(c.schedule, c.stages, m, c.stages_per_worker, stage_kind_costs(per_stage))
            add_yardsticks(row, c, physical, per_stage, sims[name], m)
        rows.append({"chunks": m, "contestants": contestants, "physical": physical, "simulated": sims,
                     "loadavg_start": load, "loadavg_end": loadavg()})
    return {"name": spec.name, "model": spec.description, "batch": spec.batch, "workers": P,
            "balances": {layout: balance(spec, layout) for layout in layouts},
            "split_backward": costs,
            "rows": rows, "loadavg_start": load_start, "loadavg_end": loadavg()}


def warm_up(cluster: Any, groups: dict[str, Any], spec: ModelSpec, model: nn.Sequential, m: int,
            keys: Sequence[str], args: argparse.Namespace) -> None:
    """One untimed step on each group of pipelining processes, one untimed rrefpipe 1F1B step: the first
    configuration of a model ran 15-30% slower (``bench_suite.warm_up``)."""
    done: set[int] = set()
    for key in keys:
        c = CONTESTANTS[key]
        if c.framework == "pipelining" and id(groups[key]) not in done:
            done.add(id(groups[key]))
            try:
                groups[key].time_steps(spec.name, "1f1b", m, args.warmup, 1)
            except RuntimeError as exc:  # shows again in the timed rounds
                log(f"  pipelining warm-up failed: {exc}")
    time_train_step(cluster.names, model, spec.balance(2), spec.data(), spec.loss_fn(), m, "1f1b", args.warmup, 1, [])


# -- targets ----------------------------------------------------------------------------------------
def zb_cells(result: dict[str, Any], key: str, over: str, min_chunks: int = 1) -> dict[str, float]:
    """{cell name: samples/s of ``key`` over ``over``} for every zero-bubble cell where both ran."""
    out = {}
    for sec in result.get("zero_bubble") or []:
        for r in sec["rows"]:
            a, b = sps(r["contestants"].get(key)), sps(r["contestants"].get(over))
            if a and b and r["chunks"] >= min_chunks:
                out[f"{sec['name']} m={r['chunks']}"] = a / b
    return out


def over_1f1b_target(result: dict[str, Any], bar: float = 1.10) -> dict[str, Any]:
    name = f"zero bubble: rrefpipe ZBVZeroBubble / 1F1B (2 workers) >= {bar}, geometric mean"
    found = zb_cells(result, "zbv", "1f1b")
    if not found:
        return _target(name, None, "not measured")
    s = gm_se(list(found.values()))
    detail = f"ZBV/1F1B {_pm(s)}"
    others = {}
    for key in ("izb", "dpv", "izb1"):
        cells = zb_cells(result, key, "1f1b")
        if cells:
            others[key] = gm_se(list(cells.values()))
            detail += f"; {LABELS[key]}/1F1B {_pm(others[key])}"
    pp = zb_cells(result, "pp_zbv", "pp_1f1b")
    if pp:
        detail += f" | pipelining ScheduleZBVZeroBubble / Schedule1F1B {_pm(gm_se(list(pp.values())))}"
    return _target(name, s["gm"] >= bar, detail, stats=s, others=others)


def pipelining_target(result: dict[str, Any]) -> dict[str, Any]:
    name = ("zero bubble: rrefpipe / pipelining, same schedule class, geometric mean >= the A/A control's "
            "(each schedule)")
    control = zb_cells(result, CONTROL, "pp_1f1b")
    per: dict[str, dict[str, Any]] = {}
    parts, met = [], True
    for key, pp in ZERO_BUBBLE.items():
        ours = zb_cells(result, key, pp)
        both = [c for c in ours if c in control]
        if len(both) < 2:
            continue
        s_ours, s_ctrl = gm_se([ours[c] for c in both]), gm_se([control[c] for c in both])
        s_diff = gm_se([ours[c] / control[c] for c in both])
        per[key] = {"rrefpipe": s_ours, "control": s_ctrl, "over_control": s_diff}
        met = met and s_ours["gm"] >= s_ctrl["gm"]
        parts.append(f"{LABELS[key]}/{LABELS[pp]} {_pm(s_ours)}, A/A in the same cells {s_ctrl['gm']:.3f} +- "
                     f"{_f(s_ctrl['se'], '.3f')}, over the control cell by cell {s_diff['gm']:.3f} +- "
                     f"{_f(s_diff['se'], '.3f')}")
    if not per:
        return _target(name, None, "fewer than 2 cells with a schedule on both frameworks and the control")
    if len(control) > 1:
        parts.append(f"A/A scatter {statistics.stdev(math.log(v) for v in control.values()):.3f} (sd of log ratio)")
    return _target(name, met, "; ".join(parts), schedules=per)


def physical_target(result: dict[str, Any], bar: float = 0.90, key: str = "zbv") -> dict[str, Any]:
    name = (f"zero bubble: rrefpipe ZBVZeroBubble achieved / physical limit >= {bar:.2f} at m >= 4, MLP "
            f"(every cell)")
    vals: dict[str, list[tuple[str, float]]] = {}
    notes = []
    for sec in result.get("zero_bubble") or []:
        if sec["name"] != "mlp":
            continue
        for r in sec["rows"]:
            if r["chunks"] < 4:
                continue
            for k, row in r["contestants"].items():
                if "achieved_over_physical" in row:
                    vals.setdefault(k, []).append((f"m={r['chunks']}", row["achieved_over_physical"]))
            z = r["contestants"].get(key) or {}
            if "achieved_over_physical" in z:
                notes.append(f"m={r['chunks']}: {z['achieved_over_physical']:.2f} (bubble simulated "
                             f"{_f(z.get('simulated_bubble'), '.2f')}, achieved {z['achieved_bubble']:.2f}; "
                             f"cores busy {_f(z.get('cores'), '.2f')})")
    if key not in vals:
        return _target(name, None, "not measured (MLP, m >= 4)")
    met = all(v >= bar for _, v in vals[key])
    detail = "; ".join(notes) + " | every contestant, min-max over the cells: " + ", ".join(
        f"{LABELS.get(k, k)} {min(v for _, v in vs):.2f}-{max(v for _, v in vs):.2f}" for k, vs in vals.items())
    return _target(name, met, detail, cells={k: dict(vs) for k, vs in vals.items()})


def split_backward_target(result: dict[str, Any], bar: float = 1.10) -> dict[str, Any]:
    name = f"split backward: I + W / one fused backward <= {bar:.2f}, every stage of every split (1 thread)"
    found = [(f"{sec['name']} {layout} m={m} stage {j}", c["split_over_fused"])
             for sec in result.get("zero_bubble") or [] for layout, by_m in sec["split_backward"].items()
             for m, per in by_m.items() for j, c in enumerate(per)]
    if not found:
        return _target(name, None, "not measured")
    s = gm_se([v for _, v in found])
    above = [f"{n} {v:.2f}" for n, v in found if v > bar]
    worst = max(found, key=lambda p: p[1])
    detail = (f"{sum(v <= bar for _, v in found)}/{len(found)} stages within; geometric mean {_pm(s)}; worst "
              f"{worst[1]:.2f} ({worst[0]})" + (f"; above: {', '.join(above)}" if above else ""))
    return _target(name, not above, detail, stats=s)


def evaluate(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [over_1f1b_target(result), pipelining_target(result), physical_target(result),
            split_backward_target(result)]


# -- report -----------------------------------------------------------------------------------------
def _n(v: float | None) -> str:
    """A positive number in at most 7 characters: 3 significant digits, no exponent up to 10^7."""
    if v is None:
        return "n/a"
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def _ms(v: float) -> str:
    return f"{v:.2f}" if v < 10 else f"{v:.1f}"


def print_section(secs: list[dict[str, Any]]) -> None:
    if not secs:
        return
    print(f"\nZero bubble (issue #49): {P} workers; 1F1B, GPipe on the 2-stage split, ZBV and DPV on 4 stages in a V "
          "(worker 0: stages 0 and 3), IZB on 4 stages in a loop (worker 0: stages 0 and 2); pp = pipelining's "
          "schedule of the same name; samples/s; phys = the physical limit (one process's micro-batched step, 1 "
          f"thread, / {P}); A/A = pipelining's 1F1B on a second group of processes over pp1F1B")
    for sec in secs:
        keys = list(sec["rows"][0]["contestants"]) if sec["rows"] else []
        rref = [k for k in keys if CONTESTANTS[k].framework == "rrefpipe"]
        pp = [k for k in keys if CONTESTANTS[k].framework == "pipelining"]
        zb = [k for k in ZERO_BUBBLE if k in keys]
        vs_pp = [k for k in zb if ZERO_BUBBLE[k] in keys]
        print(f"\n{sec['model']} | balances {sec['balances']} | load {sec['loadavg_start']} -> {sec['loadavg_end']}")
        print(f"  {'m':>3} | " + " ".join(f"{LABELS[k]:>7}" for k in rref) + " | "
              + " ".join(f"{LABELS[k]:>7}" for k in pp) + f" | {'phys':>7} | "
              + " ".join(f"{LABELS[k] + '/1F1B':>9}" for k in zb) + " | "
              + " ".join(f"{LABELS[k] + '/pp':>7}" for k in vs_pp) + f" {'A/A':>5} | {'cores':>7} {'load':>4}")
        for r in sec["rows"]:
            c = r["contestants"]
            print(f"  {r['chunks']:>3} | " + " ".join(f"{_n(sps(c.get(k))):>7}" for k in rref) + " | "
                  + " ".join(f"{_n(sps(c.get(k))):>7}" for k in pp) + f" | {_n(r['physical']['samples_per_s']):>7} | "
                  + " ".join(f"{_ratio(sps(c.get(k)), sps(c.get('1f1b'))):>9}" for k in zb) + " | "
                  + " ".join(f"{_ratio(sps(c.get(k)), sps(c.get(ZERO_BUBBLE[k]))):>7}" for k in vs_pp)
                  + f" {_ratio(sps(c.get(CONTROL)), sps(c.get('pp_1f1b'))):>5} | {cores(c):>7} "
                  f"{_f((r.get('loadavg_start') or [None])[0], '.1f'):>4}")
        print("  achieved / physical limit | bubble, simulated (rrefpipe.schedule.simulate, measured costs, free "
              f"transfers) / achieved (1 - stage compute / ({P} x step)) | cores busy")
        print(f"  {'m':>3} | " + " ".join(f"{LABELS[k]:>6}" for k in keys) + " | "
              + " ".join(f"{LABELS[k]:>9}" for k in keys) + " | " + " ".join(f"{LABELS[k]:>6}" for k in keys))
        for r in sec["rows"]:
            c = [r["contestants"].get(k) or {} for k in keys]
            bubbles = [f"{_f(x.get('simulated_bubble'), '.2f')}/{_f(x.get('achieved_bubble'), '.2f')}" for x in c]
            print(f"  {r['chunks']:>3} | " + " ".join(f"{_f(x.get('achieved_over_physical'), '.2f'):>6}" for x in c)
                  + " | " + " ".join(f"{b:>9}" for b in bubbles)
                  + " | " + " ".join(f"{_f(x.get('cores'), '.2f'):>6}" for x in c))
        print_split_backward(sec)


def print_split_backward(sec: dict[str, Any]) -> None:
    stages = max(len(per) for by_m in sec["split_backward"].values() for per in by_m.values())
    print("  split backward per stage, this process, 1 thread, medians (ms): F | I (input_gradients) W "
          "(WeightGradients.run) | B (one fused backward) | (I+W)/B")
    print(f"  {'split':<5} {'m':>3} {'rows':>4} | " + " | ".join(f"{'stage ' + str(j):<30}" for j in range(stages)))
    for layout, by_m in sec["split_backward"].items():
        for m, per in by_m.items():
            print(f"  {layout:<5} {m:>3} {math.ceil(sec['batch'] / int(m)):>4} | " + " | ".join(
                f"{_ms(c['forward_ms']):>5} {_ms(c['input_ms']):>5} {_ms(c['weight_ms']):>5} "
                f"{_ms(c['backward_ms']):>5} {c['split_over_fused']:>5.2f}" for c in per))


# -- command line -----------------------------------------------------------------------------------
def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zb-models", nargs="*", choices=sorted(BALANCES["v"]), default=["mlp", "resnet", "transformer"],
                   help="models of the zero-bubble section (none: skip it)")
    p.add_argument("--zb-chunks", nargs="+", type=int, default=list(ZB_CHUNKS),
                   help="zero-bubble micro-batch counts (even, >= 4: DualPipeV needs m >= its 4 stages)")
    p.add_argument("--zb-contestants", nargs="+", choices=list(CONTESTANTS), default=list(DEFAULT_CONTESTANTS),
                   help="zero-bubble contestants, in this order in a round (reversed every other round); "
                        "'izb1'/'pp_izb1': InterleavedZeroBubble with 1 stage per worker, not in the default run")
    p.add_argument("--bw-repeats", type=int, default=7,
                   help="timed repeats per stage of the split-backward measurement (the median is taken)")
    p.add_argument("--zero-bubble-only", action="store_true", help="run the zero-bubble section alone")


def fix_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--quick's and --zero-bubble-only's settings, and the checks (``bench_schedules.parse_args``)."""
    if args.quick:
        args.zb_models, args.zb_chunks, args.bw_repeats = ["tiny"], [4], 2
    if args.zero_bubble_only:
        args.models, args.il_models, args.memory_models = [], [], []
    smallest = min([SPECS[name].batch for name in args.zb_models] or [1 << 30])
    if args.zb_models and (min(args.zb_chunks) < 2 * P or any(m % P for m in args.zb_chunks)
                           or max(args.zb_chunks) > smallest):
        p.error(f"need zero-bubble chunks even, >= {2 * P} and <= {smallest} (the smallest batch)")
    if args.bw_repeats < 1:
        p.error("need --bw-repeats >= 1")
    args.zb_chunks = sorted(set(args.zb_chunks))
    args.zb_contestants = [k for k in CONTESTANTS if k in args.zb_contestants]
