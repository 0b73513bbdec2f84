"""Issue 43: a model ``Pipe`` captured and cut at named submodules, against the same model's hand-made stages.

``python benchmarks/bench_any_model.py`` (about 3 minutes on 2 CPU cores; ``--quick``: a smoke run of a tiny
model, about 20 s) prints a table and writes ``benchmarks/results/any_model.json`` (``--out``).

The model is ``examples/tiny_gpt.py``'s GPT-style LM (token + position embeddings, blocks in a ModuleList,
final LayerNorm, a head, the long skip embeddings -> head), cut into 2 and 3 stages where blocks begin
(``split_points``: ``blocks.3`` and ``blocks.2``, ``blocks.4`` for 6 layers). For each stage count and chunk
count m (a **cell**), these contestants train on the same weights (one seed), mini-batch and split:

* ``handmade``: rrefpipe on an ``nn.Sequential`` of stages written by hand (``Embed`` stashes the
  embeddings as a ``rrefpipe.skip`` skip, the blocks, ``Head`` pops it), split by ``balance`` at the same
  blocks: the reference every ratio divides by;
* ``captured``: ``Pipe(model, chunks, split_points=[...], sample=x)``, the model torch.export captured;
* ``pipelining``: ``torch.distributed.pipelining``'s ``pipeline()`` with ``SplitPoint.BEGINNING`` at the same
  blocks, ``Schedule1F1B``, one process per stage over gloo (``suite_pipelining``'s ranks);
* ``handmade_control``: ``handmade`` again, the A/A control: its ratio to ``handmade`` is what the
  machine's noise does to two equal contestants in this run;
* ``captured_tied``: ``captured`` with the head tied to the token embedding, as the model is written:
  each of the first and last stages holds a copy and the driver sums their gradients after each step.
  Hand-made stages cannot tie across stages (``Pipe`` refuses a parameter two stages share), so the
  other contestants run the model with the head untied; this one prices the tie.

Every rrefpipe contestant runs ``pipe.train_step`` with ``schedule='1F1B'``, ``checkpoint='never'`` (loss on
the last stage) then ``DistributedOptimizer.step`` (SGD) on ``workers.LocalWorkers`` (1 intra-op thread per
process, the driver too), timed on the driver; pipelining's step is ``schedule.step`` + SGD, timed on rank 0
between barriers (``suite_pipelining.timed_steps``). In a cell every contestant is built once (its pipe,
optimizer, schedule), then runs ``--rounds`` rounds of one step each, the contestants in a shuffled order
every round (``bench_core.time_interleaved``), after ``--warmup`` untimed rounds: a burst of load on the
shared machine then hits every contestant alike. Ratios are step time over ``handmade``'s (above 1:
slower): per cell the ratio of the median steps, and the geometric mean of the rounds' ratios (one step
over the hand-made step of the same round) with the standard error of their mean log (``+-``, about a
relative error); over the cells, the geometric mean of the cells' geometric means, its standard error
from the cells'. Target (issue 43): captured over hand-made at most 1.05 over the cells, set beside the
A/A control's. The load average is recorded before each cell. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import cloudpickle
import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples.tiny_gpt (also in pipelining's ranks)

import suite_pipelining  # noqa: E402
from bench_core import Timer, exit_without_teardown, loadavg, machine_info, summary, time_interleaved  # noqa: E402
from bench_schedules import _f, _train, gm_se  # noqa: E402
from bench_suite import add_run_args, log, new_parser, print_written, run_and_report  # noqa: E402
from examples import tiny_gpt  # noqa: E402
from examples.tiny_gpt import GPT  # noqa: E402
from rrefpipe.skip import pop, skippable, stash  # noqa: E402
from suite_pipelining import LR, PipeliningGroup, timed_steps  # noqa: E402
from suite_targets import geometric_mean, print_targets  # noqa: E402

cloudpickle.register_pickle_by_value(tiny_gpt)  # the stage workers get the GPT's classes by value

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "any_model.json"
CHUNKS = (4, 8)
REF, CONTROL = "handmade", "handmade_control"
CONTESTANTS = (REF, "captured", "pipelining", CONTROL, "captured_tied")
LABELS = {REF: "hand", "captured": "capt", "pipelining": "pp1F1B", CONTROL: "A/A", "captured_tied": "tied"}


@dataclass(frozen=True)
class Config:
    """The GPT's size and mini-batch; ``name`` (its JSON) is what pipelining's ranks build it from."""

    vocab: int = 256
    d: int = 128
    heads: int = 4
    layers: int = 6
    context: int = 64
    batch: int = 16
    seed: int = 0

    @property
    def name(self) -> str:
        return json.dumps(asdict(self))

    def build(self, tied: bool = False) -> GPT:
        """The model from the seed, identical in every process; untied: the head gets a copy of its own."""
        torch.manual_seed(self.seed)
        model = GPT(self.vocab, self.d, self.heads, self.layers, self.context)
        if not tied:
            model.head.weight = nn.Parameter(model.tok.weight.detach().clone())
        return model

    def data(self) -> tuple[Tensor, Tensor]:
        """Token ids ``x`` and next-token targets ``y`` (random), identical in every process."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        x, y = (torch.randint(0, self.vocab, (self.batch, self.context), generator=gen) for _ in "xy")
        return x, y

    def split_points(self, n: int) -> list[str]:
        """Where stages 1..n-1 begin: blocks spread evenly (stage 0 also embeds, the last also has the head)."""
        return [f"blocks.{self.layers * j // n}" for j in range(1, n)]


def lm_loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


# -- the hand-made stages ---------------------------------------------------------------------------
@skippable(stash=["e"])
class Embed(nn.Module):
    """The GPT's embeddings, kept as skip ``e`` for the head (the long skip)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.tok, self.pos, self.drop = model.tok, model.pos, model.drop

    def forward(self, idx: Tensor):  # type: ignore[no-untyped-def]
        e = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        yield stash("e", e)
        return e


@skippable(pop=["e"])
class Head(nn.Module):
    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        e = yield pop("e")
        return self.head(self.ln_f(x) + e)


def handmade(model: GPT, split_points: Sequence[str]) -> tuple[nn.Sequential, list[int]]:
    """``model``'s layers as an ``nn.Sequential`` (sharing its parameters) and the balance that cuts it
    where ``split_points`` (``blocks.i``) begin."""
    cuts = [0, *(1 + int(p.split(".")[1]) for p in split_points), len(model.blocks) + 2]
    seq = nn.Sequential(Embed(model), *model.blocks, Head(model))
    return seq, [b - a for a, b in zip(cuts, cuts[1:])]


def check_same(cfg: Config) -> None:
    """The hand-made stages compute what the model computes (in this process)."""
    model, (x, _) = cfg.build(), cfg.data()
    seq, _ = handmade(model, cfg.split_points(2))
    with torch.no_grad():
        torch.testing.assert_close(seq(x), model(x))


# -- contestants ------------------------------------------------------------------------------------
def make_pipe(key: str, cfg: Config, n: int, m: int, names: Sequence[str]) -> Any:
    from rrefpipe import Pipe

    common: dict[str, Any] = {"chunks": m, "checkpoint": "never", "schedule": "1F1B", "workers": list(names[:n])}
    if key in (REF, CONTROL):
        seq, balance = handmade(cfg.build(), cfg.split_points(n))
        return Pipe(seq, balance=balance, **common)
    return Pipe(cfg.build(tied=key == "captured_tied"), split_points=cfg.split_points(n), sample=cfg.data()[0],
                **common)


def rrefpipe_step(key: str, cfg: Config, n: int, m: int, names: Sequence[str], stack: contextlib.ExitStack) -> Timer:
    """One training step of a new pipe (closed with ``stack``), timed by the caller."""
    from torch.distributed.optim import DistributedOptimizer

    pipe = stack.enter_context(make_pipe(key, cfg, n, m, names))
    opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=LR)
    x, y = cfg.data()
    return lambda: _train(pipe, opt, x, y, lm_loss)


def pipelining_step(group: PipeliningGroup, cfg: Config, m: int, warmup: int) -> Timer:
    """One step of pipelining's ranks, timed there (a float: ``time_interleaved`` takes it as the time)."""
    group.time_steps(cfg.name, "1f1b", m, warmup, 1)  # traces the model, builds the schedule, warms it up
    return lambda: group.time_steps(cfg.name, "1f1b", m, 0, 1)[0][0]


def _time_steps(cmd: dict[str, Any], rank: int, world: int, cache: dict[str, Any]) -> dict[str, Any]:
    """A pipelining rank's timed steps of the GPT ``cmd['model']`` names: ``pipeline()`` cut at the same
    blocks, traced once per chunk count (static shapes), ``Schedule1F1B``; the schedule is kept between
    commands, as a pipe is kept between a rrefpipe contestant's steps."""
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    cfg, m = Config(**json.loads(cmd["model"])), cmd["chunks"]
    key = f"{cmd['model']}/{world}/{m}"
    if key not in cache:
        cache.clear()
        x, y = cfg.data()
        split = dict.fromkeys(cfg.split_points(world), SplitPoint.BEGINNING)
        traced = pipeline(cfg.build(), mb_args=(x[:cfg.batch // m],), split_spec=split)
        stage = traced.build_stage(rank, torch.device("cpu"))
        cache[key] = (Schedule1F1B(stage, n_microbatches=m, loss_fn=lm_loss),
                      torch.optim.SGD(stage.submod.parameters(), lr=LR), x, y)
    sched, opt, x, y = cache[key]
    return timed_steps(cmd, sched, opt, first=rank == 0, last=rank == world - 1, x=x, y=y)


def _rank_main(*args: Any) -> None:
    """``suite_pipelining``'s stage process, running this file's ``_time_steps``."""
    warnings.filterwarnings("ignore", message=r".*LeafSpec", category=FutureWarning)  # torch.export's, per trace
    suite_pipelining._time_steps = _time_steps  # (this spawned process only)
    suite_pipelining._rank_main(*args)


# -- cells ------------------------------------------------------------------------------------------
def ratios(samples: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Each contestant's step time over ``handmade``'s: of the medians, and round by round (gm +- se)."""
    ref = samples[REF]
    return {key: {"median": statistics.median(s) / statistics.median(ref),
                  "rounds": gm_se([a / b for a, b in zip(s, ref)])}
            for key, s in samples.items() if key != REF}


def run_cell(cluster: Any, group: Any, cfg: Config, n: int, m: int, k: int,
             args: argparse.Namespace) -> dict[str, Any]:
    """Every contestant built once, then ``--rounds`` rounds of one step each, in a shuffled order."""
    cell: dict[str, Any] = {"stages": n, "chunks": m, "split_points": cfg.split_points(n),
                            "balance": handmade(cfg.build(), cfg.split_points(n))[1], "loadavg_start": loadavg()}
    with contextlib.ExitStack() as stack:
        steps, errors = {}, {}
        for key in args.contestants:
            try:
                steps[key] = (pipelining_step(group, cfg, m, args.warmup) if key == "pipelining" else
                              rrefpipe_step(key, cfg, n, m, cluster.names, stack))
            except Exception as exc:  # a contestant that fails is an error in the cell, not a lost run
                errors[key] = repr(exc)[-2000:]
                log(f"  {n}st m={m} {key} failed: {errors[key].splitlines()[0]}")
        if REF in steps:
            samples = time_interleaved(steps, args.warmup, args.rounds, seed=k)
            cell["contestants"] = {key: summary(s) for key, s in samples.items()}
            cell["ratios"] = ratios(samples)
            log(f"  {n}st m={m}: " + ", ".join(f"{key} {s['median_ms']:.1f} ms"
                                               for key, s in cell["contestants"].items()))
    cell.update(errors=errors, loadavg_end=loadavg())
    return cell


def run(args: argparse.Namespace) -> dict[str, Any]:
    from workers import LocalWorkers

    cfg = Config(**args.config)
    check_same(cfg)
    result: dict[str, Any] = {"loadavg_start": loadavg(), "config": asdict(cfg), "cells": []}
    log(f"load average at start: {result['loadavg_start']}")
    torch.set_num_threads(1)  # the driver, like every stage process
    with LocalWorkers(max(args.stages), threads=1) as cluster:
        result["machine"] = machine_info(torch.get_num_threads(), cluster.threads)
        for n in args.stages:
            with contextlib.ExitStack() as stack:
                group = None
                if "pipelining" in args.contestants:
                    with mock.patch.object(suite_pipelining, "_rank_main", _rank_main):
                        group = stack.enter_context(PipeliningGroup(n))
                for m in args.chunks:
                    result["cells"].append(run_cell(cluster, group, cfg, n, m, len(result["cells"]), args))
    result["summary"], result["loadavg_end"] = summarise(result["cells"]), loadavg()
    return result


# -- summary and report -----------------------------------------------------------------------------
def summarise(cells: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Over the cells, each contestant's step time over ``handmade``'s: the geometric mean of the cells'
    round-by-round geometric means, its standard error from theirs, and the range of the cells'."""
    out = {}
    for key in CONTESTANTS:
        found = [c["ratios"][key]["rounds"] for c in cells if key in c.get("ratios", {})]
        if found:
            ses = [s["se"] for s in found]
            se = None if None in ses else math.sqrt(sum(v * v for v in ses)) / len(ses)
            gms = [s["gm"] for s in found]
            out[key] = {"gm": geometric_mean(gms), "se": se, "cells": len(gms), "min": min(gms), "max": max(gms)}
    return out


def evaluate(result: dict[str, Any], bar: float = 1.05) -> list[dict[str, Any]]:
    """The target: captured over hand-made at most ``bar`` (geometric mean over the cells)."""
    summary = result["summary"]
    name = f"captured / hand-made step time <= {bar} (geometric mean over the cells)"
    if "captured" not in summary:
        return [{"target": name, "met": None, "detail": "not measured"}]
    s, ctrl = summary["captured"], summary.get(CONTROL)
    detail = f"{_pm(s)}; A/A control {_pm(ctrl) if ctrl else 'n/a'}"
    return [{"target": name, "met": s["gm"] <= bar, "detail": detail, "stats": s}]


def _pm(s: dict[str, Any]) -> str:
    return f"{s['gm']:.3f} +- {_f(s['se'], '.3f')} over {s['cells']} cells (range {s['min']:.3f}-{s['max']:.3f})"


def _cell_ratio(r: dict[str, Any] | None) -> str:
    if r is None:
        return "n/a"
    return f"{r['median']:.3f} ({r['rounds']['gm']:.3f}+-{_f(r['rounds']['se'], '.3f')})"


def report(result: dict[str, Any], out: Path) -> None:
    mach, st, cfg = result["machine"], result["settings"], result["config"]
    keys = [k for k in CONTESTANTS if k in st["contestants"]]
    print(f"\nAny model (issue 43): {mach['platform']}, torch {mach['torch']}, {mach['cpu_count']} CPUs; GPT-style "
          f"LM vocab {cfg['vocab']}, d {cfg['d']}, {cfg['heads']} heads, {cfg['layers']} layers, context "
          f"{cfg['context']}, batch {cfg['batch']}; every process 1 intra-op thread; step = 1F1B train_step "
          f"(pipelining: Schedule1F1B.step) + SGD; {st['rounds']} rounds of one step of each contestant, in a "
          f"shuffled order, after {st['warmup']}")
    print("\nmedian step ms, and step time over the hand-made stages': ratio of the medians (geometric mean of the "
          "rounds' ratios +- standard error)")
    print(f"  {'n':>2} {'m':>3} | " + " ".join(f"{LABELS[k]:>7}" for k in keys) + " | "
          + " ".join(f"{LABELS[k] + '/hand':<22}" for k in keys if k != REF) + f" | {'load':>4}")
    for c in result["cells"]:
        ms = [_f(c.get("contestants", {}).get(k, {}).get("median_ms"), ".1f") for k in keys]
        ratios = c.get("ratios", {})
        print(f"  {c['stages']:>2} {c['chunks']:>3} | " + " ".join(f"{v:>7}" for v in ms) + " | "
              + " ".join(f"{_cell_ratio(ratios.get(k)):<22}" for k in keys if k != REF)
              + f" | {_f((c.get('loadavg_start') or [None])[0], '.1f'):>4}")
        for key, error in c["errors"].items():
            print(f"      {key} failed: {error.splitlines()[0]}")
    print("  hand = rrefpipe, hand-made nn.Sequential stages (skip e -> head by stash/pop); capt = Pipe(model, "
          "split_points=...); pp1F1B = torch.distributed.pipelining pipeline() at the same blocks; A/A = hand again "
          "(the run's noise); tied = capt with the head tied to the embedding (the others untied); load = 1-min "
          "load average before the cell")
    print("\nover the cells, step time over the hand-made stages' (geometric mean of the cells' round-by-round "
          "geometric means +- its standard error):")
    for key, s in result["summary"].items():
        print(f"  {LABELS[key]:>7}: {_pm(s)}")
    print_targets(result["targets"], "43")
    print_written(result, out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = new_parser(__doc__, DEFAULT_OUT)
    p.add_argument("--quick", action="store_true",
                   help="smoke run (~20 s, 22 CPU-s): a tiny GPT, the last of --stages only, m = 4, 2 rounds")
    p.add_argument("--stages", nargs="+", type=int, choices=(2, 3), default=[2, 3])
    p.add_argument("--chunks", nargs="+", type=int, default=list(CHUNKS), help="micro-batch counts (>= stages)")
    p.add_argument("--contestants", nargs="+", choices=CONTESTANTS, default=list(CONTESTANTS),
                   help=f"{REF!r}, the reference, is always run")
    for field, default in asdict(Config()).items():
        p.add_argument(f"--{field}", type=int, default=default, help=f"the GPT's {field} (default {default})")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds before the timed ones")
    p.add_argument("--rounds", type=int, default=40,
                   help="timed rounds per cell, each one step of every contestant in a shuffled order")
    add_run_args(p)
    args = p.parse_args(argv)
    fields = asdict(Config())
    args.config = {k: getattr(args, k) for k in fields}
    if args.quick:
        args.config = {**fields, "vocab": 32, "d": 16, "heads": 2, "layers": 3, "context": 8, "batch": 8}
        args.chunks, args.warmup, args.rounds, args.stages = [4], 1, 2, args.stages[-1:]
    if min(args.chunks) < max(args.stages) or max(args.chunks) > args.config["batch"]:
        p.error(f"need {max(args.stages)} <= chunks <= batch {args.config['batch']} (1F1B needs m >= stages)")
    if args.config["layers"] < max(args.stages) or args.warmup < 0 or args.rounds < 2:
        p.error("need layers >= stages, --warmup >= 0, --rounds >= 2 (a standard error)")
    args.chunks = sorted(set(args.chunks))
    args.contestants = [k for k in CONTESTANTS if k in {REF, *args.contestants}]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    run_and_report(parse_args(argv), run, evaluate, report)


if __name__ == "__main__":
    main()
    exit_without_teardown()  # every stage process is closed and the results written
