"""Issue 50: statistical efficiency of the continuous pipelines. Two real tasks trained to the same
wall-clock budget under GPipe, 1F1B, PipeDream, PipeDream-2BW and PipeMare: loss against wall-clock and
against batches, final held-out accuracy and loss.

``python benchmarks/bench_convergence.py`` (about 11 minutes on 2 CPU cores: 6 contestants x (40 s + 50 s)
of training, plus building, capturing and evaluating; ``--quick``: a smoke run, under 20 s on a quiet
machine) prints a table per task and writes ``benchmarks/results/convergence.json`` (``--out``) and the
picture ``docs/img/convergence-streams.png`` (``--png``; two panels per task: training and held-out loss
against wall-clock and against batches).

Setup. Two stage workers (``workers.LocalWorkers(2, threads=1)``) and this process as the driver, every
process 1 intra-op thread, as every benchmark here. Each contestant is its own ``Pipe`` of a copy of the
same initial model on those workers (``chunks=4``, ``checkpoint='never'``: PipeMare needs it, and the others
then do the same work), with ``opt = pipe.optimizer(...)`` (the same optimizer and hyperparameters for every
rule) and its own iterator over the same batches in the same order. It trains with
``for loss in pipe.train_stream(batches, loss_fn, opt)``: under GPipe and 1F1B that is exactly the loop of
``train_step`` and ``opt.step`` per batch (each batch fills and drains the pipeline); under the three
asynchronous rules the pipeline never drains and each stage updates its weights as soon as its own backward
of a batch is done (the guide's "Asynchronous pipelines and streaming" has the rules).

Fair clocks on a shared machine. All contestants' pipes are built first; then they train in rounds, each
contestant one ``--slice`` (5 s) per round, the order reversed every other round, until each has trained
for the task's budget (``--digits-budget`` 40 s, ``--gpt-budget`` 50 s): a change in the machine's load
hits every rule alike instead of whichever ran then. A slice is one ``train_stream`` whose iterable
stops giving batches once the slice's time is up; the stream then finishes and applies every batch it
was fed (so every loss is yielded: ``batches`` is the number of updates) and the slice's time runs until
its loop ends. After each slice, off the clock, the contestant's held-out loss and accuracy are measured
(``pipe.eval()``, then ``pipe.train()``); the last of these are the final numbers. So an asynchronous
stream restarts every slice: it drains once per slice (about once per 100 batches here), and the rule's
weight versions count again from the weights the stream starts with. The wall-clock axis is training
time only (building, capturing and evaluating are not on it).

Contestants: ``1F1B``, ``GPipe``, ``PipeDream``, ``PipeDream-2BW``, ``PipeMare`` and ``1F1B`` again
(``1F1B (A/A)``, the **A/A control**: same code, same data, same rounds, another pipe: what the machine
does to a run's batch count and final numbers). The synchronous reference is the first 1F1B. GPipe and
1F1B compute the same updates (the same losses at every batch, up to rounding), so GPipe is a second
control for everything but speed.

Tasks (their builders are imported from ``examples/``, not copied):

* ``digits``: ``examples/tutorial.py``'s ResNet-style classifier (``resnet(width 16, 2 blocks)``, 10
  layers, BatchNorm) on scikit-learn's bundled digits (``tutorial.digits``: 1,437 training and 360
  held-out 8x8 images, nothing downloaded), batches of 64 in ``tutorial.batches``'s seeded order epoch
  after epoch, balance by measured layer time (``tutorial.choose_balance``, once, the same for every run),
  SGD lr 0.05 momentum 0.9 (the tutorial's), cross-entropy. Held-out: accuracy and cross-entropy over the
  360 images in eval mode (BatchNorm's running statistics).
* ``gpt``: ``examples/gpt_text.py``'s character GPT (``make_model``: ``tiny_gpt.GPT``, width 32, 2 heads,
  4 blocks, context 32) on its text (``gpt_text.TEXT``, 1,327 characters), captured and cut at
  ``blocks.2`` (2 stages), windows of 32 characters drawn by ``gpt_text.batches`` (batch 16; 256 batches
  per seed, seeds 0, 1, 2, ...) from the first 85% of the text; AdamW lr 1e-2, eps 1e-6, weight decay
  0.01 (the example's), ``gpt_text.next_char_loss``. **One change to the example's model:** its head is
  tied to the token embedding, and the asynchronous rules refuse parameters tied across stages (each
  stage's optimizer would update its copy apart), so every run here unties them: the head starts as a
  copy of the embedding and trains on its own. Held-out: next-character cross-entropy and accuracy over
  every 32-character window of the last 15% of the text (text the model never trains on; with so little
  text, held-out loss rises again once the model memorises the training part).

Reported per run: batches done in the budget, batches/s, the final held-out accuracy and loss, the
best held-out loss over the evaluations (and when), the training loss (the stream's per-batch losses,
mean of the last ``--smooth`` batches), the smoothed training loss at the fewest batches any run of the
task did (``@equal b``: the same work for every rule, so what staleness costs per update) and the time and
batches each run took to reach the **common loss** (the highest final smoothed training loss among the
task's runs, so every run reaches it), and ``within 1 pt``: the held-out accuracy no more than 1 percentage
point below the first 1F1B run's (issue 50's criterion; the GPT's accuracy is next-character accuracy).
Beside it, how far the other synchronous runs (GPipe, the A/A control) land from 1F1B: the criterion's
noise floor. ``cores``: CPU time of the driver and both workers over the training time; ``load``: the mean
1-minute load average at the contestant's slice starts. The curves are running means over ``--smooth``
batches (digits: about an epoch); the dots, the held-out loss after each slice.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's rrefpipe and workers (the stage workers use it too)
sys.path.insert(0, str(ROOT / "examples"))  # tutorial, gpt_text and tiny_gpt (gpt_text imports tiny_gpt so)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from bench_core import exit_without_teardown, loadavg, machine_info  # noqa: E402
from bench_suite import add_run_args, log, new_parser, print_written, run_and_report  # noqa: E402
from suite_record import proc_stat  # noqa: E402
from suite_targets import print_targets  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "convergence.json"
DEFAULT_PNG = ROOT / "docs" / "img" / "convergence-streams.png"
STAGES = 2
CHUNKS = 4
#: Contestants in run order: key -> (schedule, label). ``1f1b_aa`` is the A/A control.
RUNS = {"1f1b": ("1F1B", "1F1B"), "gpipe": ("GPipe", "GPipe"), "pipedream": ("PipeDream", "PipeDream"),
        "2bw": ("PipeDream-2BW", "PipeDream-2BW"), "pipemare": ("PipeMare", "PipeMare"),
        "1f1b_aa": ("1F1B", "1F1B (A/A)")}
REFERENCE = "1f1b"
ASYNC = ("pipedream", "2bw", "pipemare")
STYLE = {"1f1b": ("#4c72b0", "-"), "gpipe": ("#55a868", "-"), "pipedream": ("#c44e52", "-"),
         "2bw": ("#dd8452", "-"), "pipemare": ("#8172b3", "-"), "1f1b_aa": ("#4c72b0", ":")}
TASKS = ("digits", "gpt")


# -- the tasks ----------------------------------------------------------------------------------------
class Task:
    """A model, a stream of batches, a loss, an optimizer and a held-out evaluation."""

    name: str
    metric_note: str
    description: str
    _model: nn.Module
    optimizer: tuple[type[torch.optim.Optimizer], dict[str, Any]]
    loss_fn: Callable[[Tensor, Tensor], Tensor]

    def pipe_kwargs(self) -> dict[str, Any]:
        raise NotImplementedError

    def model(self) -> nn.Module:
        """A fresh copy of the initial model (the same weights for every run)."""
        return copy.deepcopy(self._model)

    def batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        raise NotImplementedError

    def heldout(self) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def evaluate(self, pipe: Any) -> dict[str, float]:
        """Held-out loss and accuracy of the pipe's weights, in eval mode, no gradients."""
        x, y = self.heldout()
        pipe.eval()
        with torch.no_grad():
            logits = pipe(x).local_value()
        logits, y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        return {"loss": float(F.cross_entropy(logits, y)), "accuracy": float((logits.argmax(-1) == y).float().mean()),
                "samples": int(y.numel())}


class Digits(Task):
    name = "digits"
    metric_note = "held-out accuracy over the 360 test images"

    def __init__(self, args: argparse.Namespace) -> None:
        import cloudpickle
        import tutorial

        # The stages' ResidualBlock travels by value: the workers need not import tutorial, which imports
        # scikit-learn (seconds on 2 busy cores, in each worker).
        cloudpickle.register_pickle_by_value(tutorial)
        self.tutorial = tutorial
        self.batch_size, self.seed = args.digits_batch, args.seed
        torch.manual_seed(args.seed)
        self.data = tutorial.digits(args.seed)
        self._model = tutorial.resnet(args.digits_width, args.digits_blocks)
        ns = argparse.Namespace(balance_by="time", batch_size=self.batch_size, chunks=CHUNKS, stages=STAGES,
                                profile_seconds=args.profile_seconds)
        self.balance = tutorial.choose_balance(self._model, self.data[0], ns, "cpu")
        self.optimizer = (torch.optim.SGD, {"lr": args.digits_lr, "momentum": 0.9})
        self.loss_fn = F.cross_entropy
        self.description = (f"examples/tutorial.py resnet(width {args.digits_width}, {args.digits_blocks} blocks), "
                            f"{sum(p.numel() for p in self._model.parameters()):,} parameters, balance "
                            f"{self.balance}; digits {len(self.data[1])} train / {len(self.data[3])} held-out; "
                            f"batch {self.batch_size}; SGD lr {args.digits_lr} momentum 0.9")

    def pipe_kwargs(self) -> dict[str, Any]:
        return {"balance": list(self.balance)}

    def batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        for epoch in itertools.count():
            yield from self.tutorial.batches(self.data[0], self.data[1], self.batch_size, epoch, self.seed)

    def heldout(self) -> tuple[Tensor, Tensor]:
        return self.data[2], self.data[3]


class CharGPT(Task):
    name = "gpt"
    metric_note = "held-out next-character accuracy over the last 15% of the text"
    SEEDS_EVERY = 256  # batches per gpt_text.batches call (seed 0, 1, 2, ...)

    def __init__(self, args: argparse.Namespace) -> None:
        import gpt_text

        self.gpt_text = gpt_text
        self.batch_size, self.context = args.gpt_batch, args.gpt_context
        chars = gpt_text.Chars(gpt_text.TEXT)
        ids = chars.encode(gpt_text.TEXT)
        cut = int(len(ids) * (1 - args.gpt_heldout))
        self.train_ids, self.test_ids = ids[:cut], ids[cut:]
        shape = argparse.Namespace(width=args.gpt_width, heads=args.gpt_heads, layers=args.gpt_layers,
                                   context=self.context)
        model = gpt_text.make_model(len(chars.alphabet), shape)
        model.head.weight = nn.Parameter(model.tok.weight.detach().clone())  # untied (see the docstring)
        self._model = model
        self.split_points = [f"blocks.{args.gpt_layers // 2}"]
        self.sample = next(iter(gpt_text.batches(self.train_ids, 1, self.batch_size, self.context, seed=0)))[0]
        self.optimizer = (torch.optim.AdamW, {"lr": args.gpt_lr, "eps": 1e-6, "weight_decay": 0.01})
        self.loss_fn = gpt_text.next_char_loss
        self.description = (f"examples/gpt_text.py make_model (tiny_gpt.GPT width {args.gpt_width}, {args.gpt_heads} "
                            f"heads, {args.gpt_layers} blocks, context {self.context}, head untied), "
                            f"{sum(p.numel() for p in model.parameters()):,} parameters, cut at {self.split_points}; "
                            f"text {len(ids)} characters ({len(chars.alphabet)} distinct), first {cut} for training; "
                            f"batch {self.batch_size}; AdamW lr {args.gpt_lr} eps 1e-6 weight decay 0.01")

    def pipe_kwargs(self) -> dict[str, Any]:
        return {"split_points": list(self.split_points), "sample": self.sample}

    def batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        for seed in itertools.count():
            yield from self.gpt_text.batches(self.train_ids, self.SEEDS_EVERY, self.batch_size, self.context, seed)

    def heldout(self) -> tuple[Tensor, Tensor]:
        """Every window of ``context`` characters of the held-out text, and its next characters."""
        ids, c = self.test_ids, self.context
        windows = torch.stack([ids[s:s + c + 1] for s in range(len(ids) - c)])
        return windows[:, :-1], windows[:, 1:]


def make_task(name: str, args: argparse.Namespace) -> Task:
    return Digits(args) if name == "digits" else CharGPT(args)


# -- the runs -----------------------------------------------------------------------------------------
def within(source: Iterator[Any], started: float, seconds: float, cap: int) -> Iterator[Any]:
    """Items of ``source`` until ``seconds`` after ``started`` (and at most ``cap``, if > 0). Checks before
    taking an item, so that the next slice goes on with the next batch."""
    k = 0
    while (not cap or k < cap) and time.perf_counter() - started < seconds:
        yield next(source)
        k += 1


def cpu_ms(pids: Sequence[int]) -> float | None:
    total = 0.0
    for pid in pids:
        stat = proc_stat(pid)
        if stat is None:
            return None
        total += stat[0] + stat[1]  # user + kernel
    return total


class Contestant:
    """One rule's pipe, optimizer and batch stream, and what its slices recorded."""

    def __init__(self, key: str, task: Task, names: Sequence[str]) -> None:
        from rrefpipe import Pipe

        self.key, self.task = key, task
        self.schedule, self.label = RUNS[key]
        built = time.perf_counter()
        self.pipe = Pipe(task.model(), chunks=CHUNKS, workers=list(names[:STAGES]), schedule=self.schedule,
                         checkpoint="never", **task.pipe_kwargs())
        cls, kwargs = task.optimizer
        self.opt = self.pipe.optimizer(cls, **kwargs)
        self.source = task.batches()
        self.record: dict[str, Any] = {"key": key, "schedule": self.schedule, "label": self.label,
                                       "build_s": time.perf_counter() - built, "wall_s": 0.0, "eval_s": 0.0,
                                       "cpu_s": 0.0, "time_s": [], "loss": [], "evals": [], "slices": []}

    def finished(self, budget: float, max_batches: int) -> bool:
        r = self.record
        return r["wall_s"] >= budget or bool(max_batches and len(r["loss"]) >= max_batches)

    def train_slice(self, seconds: float, budget: float, max_batches: int, pids: Sequence[int]) -> None:
        """Train for ``seconds`` (at most what is left of ``budget``), then evaluate on the held-out data
        (off the clock)."""
        r = self.record
        length = min(seconds, budget - r["wall_s"])
        cap = max_batches - len(r["loss"]) if max_batches else 0
        load, cpu_before, before = loadavg(), cpu_ms(pids), len(r["loss"])
        started = time.perf_counter()
        for loss in self.pipe.train_stream(within(self.source, started, length, cap), self.task.loss_fn, self.opt):
            r["time_s"].append(round(r["wall_s"] + time.perf_counter() - started, 4))
            r["loss"].append(float(loss))
        took = time.perf_counter() - started
        cpu_after = cpu_ms(pids)
        r["slices"].append({"start_s": r["wall_s"], "seconds": took, "batches": len(r["loss"]) - before,
                            "loadavg": load, "cpu_s": None if cpu_before is None or cpu_after is None
                            else (cpu_after - cpu_before) / 1e3})
        r["wall_s"] += took
        evaluated = time.perf_counter()
        r["evals"].append({"batches": len(r["loss"]), "time_s": r["wall_s"], **self.task.evaluate(self.pipe)})
        self.pipe.train()
        r["eval_s"] += time.perf_counter() - evaluated

    def finish(self) -> dict[str, Any]:
        r = self.record
        r["batches"] = len(r["loss"])
        r["heldout"] = r["evals"][-1] if r["evals"] else None
        r["batches_per_s"] = r["batches"] / r["wall_s"] if r["wall_s"] > 0 else None
        cpus = [sl["cpu_s"] for sl in r["slices"]]
        r["cores"] = None if None in cpus or r["wall_s"] <= 0 else sum(cpus) / r["wall_s"]
        loads = [sl["loadavg"][0] for sl in r["slices"] if sl["loadavg"]]
        r["load"] = statistics.fmean(loads) if loads else None
        return r


def run_task(name: str, names: Sequence[str], pids: Sequence[int], args: argparse.Namespace) -> dict[str, Any]:
    """Every contestant's pipe built first, then trained in rounds of one ``--slice`` each (the order
    reversed every other round), until each has trained for the budget."""
    task = make_task(name, args)
    budget = args.digits_budget if name == "digits" else args.gpt_budget
    out: dict[str, Any] = {"name": name, "description": task.description, "budget_s": budget, "slice_s": args.slice,
                           "chunks": CHUNKS, "stages": STAGES, "metric": task.metric_note, "smooth": args.smooth,
                           "loadavg_start": loadavg()}
    log(f"{name}: {task.description}")
    with contextlib.ExitStack() as stack:
        contestants = []
        for key in args.runs:
            contestants.append(Contestant(key, task, names))
            stack.callback(contestants[-1].pipe.close)
        log(f"{name}: {len(contestants)} pipes built; {budget:g} s each, in slices of {args.slice:g} s ...")
        rounds = 0
        while True:
            order = [c for c in contestants if not c.finished(budget, args.max_batches)]
            if not order:
                break
            for c in order if rounds % 2 == 0 else order[::-1]:
                c.train_slice(args.slice, budget, args.max_batches, pids)
            rounds += 1
            log(f"{name}: round {rounds}: " + ", ".join(f"{c.label} {len(c.record['loss'])}" for c in contestants)
                + f" batches; load {loadavg()}")
        out["runs"] = [c.finish() for c in contestants]
    out["rounds"], out["loadavg_end"] = rounds, loadavg()
    for r in out["runs"]:
        h = r["heldout"]
        log(f"{name}: {r['label']}: {r['batches']} batches in {r['wall_s']:.1f} s, held-out accuracy "
            f"{h['accuracy']:.4f}, loss {h['loss']:.4f}")
    summarize(out)
    return out


# -- analysis -----------------------------------------------------------------------------------------
def smoothed(values: Sequence[float], window: int) -> list[float]:
    """Running mean over the last ``window`` values (fewer at the start)."""
    return [math.fsum(values[max(0, k + 1 - window):k + 1]) / min(k + 1, window) for k in range(len(values))]


def summarize(task: dict[str, Any]) -> None:
    """Per run: final training loss, loss at equal batches, time and batches to the common loss, the best
    held-out loss, the held-out gap to the reference. Fills each run in place and the task's
    ``common_loss``, ``equal_batches`` and ``sync_spread_points`` (the largest gap of another synchronous
    run, GPipe or the A/A control, to the reference: what the 1-point criterion is up against)."""
    runs = [r for r in task["runs"] if r["batches"]]
    w = task["smooth"]
    for r in runs:
        r["smoothed"] = smoothed(r["loss"], w)
        r["train_loss"] = r["smoothed"][-1]
    task["equal_batches"] = min((r["batches"] for r in runs), default=0)
    task["common_loss"] = max((r["train_loss"] for r in runs), default=None)
    ref = next((r for r in task["runs"] if r["key"] == REFERENCE), None)
    for r in task["runs"]:
        s = r.get("smoothed") or []
        eb = task["equal_batches"]
        r["loss_at_equal_batches"] = s[eb - 1] if eb and len(s) >= eb else None
        hit = next((k for k, v in enumerate(s) if v <= task["common_loss"]), None) if s else None
        r["batches_to_common"] = None if hit is None else hit + 1
        r["seconds_to_common"] = None if hit is None else r["time_s"][hit]
        r["best_heldout"] = min(r.get("evals") or [r["heldout"]], key=lambda e: e["loss"])
        if ref is not None:
            r["accuracy_gap_points"] = 100 * (r["heldout"]["accuracy"] - ref["heldout"]["accuracy"])
            r["within_1_point"] = r["accuracy_gap_points"] >= -1.0
            r["heldout_loss_over_ref"] = r["heldout"]["loss"] / ref["heldout"]["loss"]
    task["sync_spread_points"] = max((abs(r["accuracy_gap_points"]) for r in task["runs"]
                                      if r["key"] not in ASYNC and "accuracy_gap_points" in r), default=None)


def evaluate(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 50's criterion per task and asynchronous rule (reported, never asserted)."""
    targets = []
    for task in result["tasks"]:
        ref = next((x for x in task["runs"] if x["key"] == REFERENCE), None)
        spread = task.get("sync_spread_points")
        for r in task["runs"]:
            if r["key"] not in ASYNC or ref is None:
                continue
            targets.append({
                "target": f"{task['name']}: {r['label']} held-out accuracy within 1 point of 1F1B's",
                "met": bool(r["within_1_point"]),
                "detail": f"{100 * r['heldout']['accuracy']:.2f}% vs {100 * ref['heldout']['accuracy']:.2f}% "
                          f"({r['accuracy_gap_points']:+.2f} points; the other synchronous runs differ from 1F1B by "
                          f"up to {_f(spread, '.2f')}), {r['batches']} batches in {task['budget_s']:g} s"})
    return targets


# -- the run ------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    from workers import LocalWorkers

    result: dict[str, Any] = {"loadavg_start": loadavg()}
    log(f"load average at start: {result['loadavg_start']}")
    torch.set_num_threads(1)  # the driver, like each stage worker
    with LocalWorkers(STAGES, threads=1) as cluster:
        result["machine"] = machine_info(torch.get_num_threads(), cluster.threads)
        pids = [os.getpid(), *cluster.pids[:STAGES]]
        result["tasks"] = [run_task(name, cluster.names, pids, args) for name in args.tasks]
    result["loadavg_end"] = loadavg()
    return result


# -- report -------------------------------------------------------------------------------------------
def _f(v: float | None, fmt: str = ".3f") -> str:
    return "n/a" if v is None else format(v, fmt)


def table_rows(task: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in task["runs"]:
        h, best = r["heldout"], r["best_heldout"]
        rows.append([r["label"], str(r["batches"]), _f(r["batches_per_s"], ".1f"), _f(100 * h["accuracy"], ".2f"),
                     _f(r.get("accuracy_gap_points"), "+.2f"),
                     "n/a" if "within_1_point" not in r else ("yes" if r["within_1_point"] else "NO"),
                     _f(h["loss"], ".4f"), f"{best['loss']:.4f} @{best['time_s']:.0f}s",
                     _f(r.get("train_loss"), ".4f"), _f(r.get("loss_at_equal_batches"), ".4f"),
                     _f(r.get("seconds_to_common"), ".1f"), _f(r.get("batches_to_common"), "d"),
                     _f(r.get("cores"), ".2f"), _f(r.get("load"), ".1f")])
    return rows


HEADER = ["rule", "batches", "b/s", "held-out acc %", "vs 1F1B (pt)", "within 1 pt", "held-out loss",
          "best held-out loss", "train loss", "@equal b", "s to common", "b to common", "cores", "load"]


def print_task(task: dict[str, Any]) -> None:
    print(f"\n{task['name']}: {task['description']}\n{task['stages']} stages, chunks {task['chunks']}, "
          f"checkpoint 'never', {task['budget_s']:g} s per run in {task['rounds']} rounds of {task['slice_s']:g} s "
          f"slices; accuracy: {task['metric']}; train loss: mean of the last {task['smooth']} batches; @equal b: "
          f"the same at batch {task['equal_batches']}; common loss {_f(task['common_loss'], '.4f')}; the other "
          f"synchronous runs' accuracy differs from 1F1B's by up to {_f(task['sync_spread_points'], '.2f')} points")
    rows = [HEADER] + table_rows(task)
    widths = [max(len(r[k]) for r in rows) for k in range(len(HEADER))]
    for k, r in enumerate(rows):
        print("  " + " | ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            print("  " + "-+-".join("-" * w for w in widths))


def write_chart(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = result["tasks"]
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 4 * len(tasks)), squeeze=False)
    for row, task in zip(axes, tasks):
        for r in task["runs"]:
            if not r.get("smoothed"):
                continue
            color, ls = STYLE[r["key"]]
            label = f"{r['label']}: {r['batches']} b, held-out acc {100 * r['heldout']['accuracy']:.1f}%"
            row[0].plot(r["time_s"], r["smoothed"], ls, color=color, lw=1.2, label=label)
            row[1].plot(range(1, r["batches"] + 1), r["smoothed"], ls, color=color, lw=1.2, label=label)
            evals = r.get("evals") or []
            for ax, x in ((row[0], [e["time_s"] for e in evals]), (row[1], [e["batches"] for e in evals])):
                ax.plot(x, [e["loss"] for e in evals], ls, color=color, lw=0.6, marker="o", ms=2.5, alpha=0.7)
        for ax, xlabel in zip(row, ("wall-clock (s, training only)", "batches (updates)")):
            ax.set_yscale("log")
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel("loss", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="both", alpha=0.25)
        how = f"lines: training loss (mean of {task['smooth']} batches); dots: held-out loss"
        row[0].set_title(f"{task['name']}: loss vs wall-clock ({task['budget_s']:g} s each)\n{how}", fontsize=9)
        row[1].set_title(f"{task['name']}: loss vs batches\n{how}", fontsize=9)
        row[1].legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"rrefpipe continuous pipelines (issue 50): {STAGES} local stage workers, chunks {CHUNKS}, "
                 f"{m['cpu_count']} CPUs, torch {m['torch']}, 1 intra-op thread per process; load "
                 f"{result['loadavg_start']} -> {result.get('loadavg_end')}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def report(result: dict[str, Any], out: Path) -> None:
    m = result["machine"]
    print(f"\nrrefpipe convergence under each pipeline rule (issue 50): {m['platform']}, torch {m['torch']}, "
          f"{m['cpu_count']} CPUs ({m['cpus_usable']} usable); load average at start {result['loadavg_start']}, "
          f"at end {result['loadavg_end']}")
    for task in result["tasks"]:
        print_task(task)
    print_targets(result["targets"], "50")
    png = Path(result["settings"].get("png") or DEFAULT_PNG)
    paths = [out]
    if png.name:
        paths.append(write_chart(result, png))
    print_written(result, *paths)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = new_parser(__doc__, DEFAULT_OUT)
    p.add_argument("--png", type=Path, default=DEFAULT_PNG, help="the picture (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1F1B, GPipe and the three asynchronous rules (no A/A control), 0.5 s in "
                        "0.1 s slices and at most 4 batches each, a 2-block GPT of width 16; the picture goes "
                        "next to --out")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="contestants, in run order")
    p.add_argument("--digits-budget", type=float, default=40.0, help="seconds of training per digits contestant")
    p.add_argument("--gpt-budget", type=float, default=50.0, help="seconds of training per GPT contestant")
    p.add_argument("--slice", type=float, default=5.0,
                   help="seconds a contestant trains before the next one's turn (and a held-out evaluation)")
    p.add_argument("--max-batches", type=int, default=0, help="also stop each run after this many batches (0: no)")
    p.add_argument("--smooth", type=int, default=20, help="batches per running mean (curves, train loss)")
    p.add_argument("--seed", type=int, default=0, help="weights, split and data order")
    p.add_argument("--profile-seconds", type=float, default=0.5, help="digits: layer timing for the balance")
    p.add_argument("--digits-batch", type=int, default=64)
    p.add_argument("--digits-width", type=int, default=16)
    p.add_argument("--digits-blocks", type=int, default=2)
    p.add_argument("--digits-lr", type=float, default=0.05)
    p.add_argument("--gpt-batch", type=int, default=16)
    p.add_argument("--gpt-context", type=int, default=32)
    p.add_argument("--gpt-width", type=int, default=32)
    p.add_argument("--gpt-heads", type=int, default=2)
    p.add_argument("--gpt-layers", type=int, default=4)
    p.add_argument("--gpt-lr", type=float, default=1e-2)
    p.add_argument("--gpt-heldout", type=float, default=0.15, help="share of the text held out (its end)")
    add_run_args(p)
    args = p.parse_args(argv)
    if args.quick:
        args.digits_budget, args.gpt_budget, args.slice, args.max_batches, args.smooth = 0.5, 0.5, 0.1, 4, 2
        args.gpt_width, args.gpt_layers, args.profile_seconds = 16, 2, 0.05
        args.runs = [key for key in args.runs if key != "1f1b_aa"]
        if args.png == DEFAULT_PNG:
            args.png = args.out.with_suffix(".png")
    if args.gpt_layers < 2 or args.smooth < 1 or args.slice <= 0:
        p.error("--gpt-layers >= 2 (one cut), --smooth >= 1, --slice > 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    run_and_report(parse_args(argv), run, evaluate, report)


if __name__ == "__main__":
    main()
    exit_without_teardown()  # the workers are closed and the results written
