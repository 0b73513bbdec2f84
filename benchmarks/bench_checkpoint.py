"""Checkpoints of a large model: building a pipe, saving and loading its weights through the driver (the
old way) against on the stage workers (``Pipe(init=)``, ``pipe.save``, ``pipe.load``): time, and the peak
memory of the driver and of every worker.

``python benchmarks/bench_checkpoint.py`` (an estimated 3-4 minutes on 2 quiet CPU cores with the default
1.07 GB model, 550 s at a load average of 6-18; the first repeat of each stage count, which saves the
optimizer and verifies, is about half of it) prints a table per stage count and a targets block, and writes
``benchmarks/results/bench_checkpoint.json`` (``--out``). ``--layers 4 --width 512 --stages 2 --repeats 1``
is a smoke run of a few seconds (4 MiB).

Model: ``--layers`` x ``nn.Linear(--width, --width)`` in an ``nn.Sequential`` (default 16 x 4096: 1.07 GB
of float32), cut into ``--stages`` (2 and 4) stages of equal layer counts on ``workers.LocalWorkers(n,
threads=1)`` (this process is the driver; one set of workers per stage count, shared by every pipe of
it; on fresh workers a tiny pipe (a Linear(8, 8) per stage) first runs every call below once, untimed,
so that the first repeat does not pay for what a worker imports the first time). Before anything is
timed the model is built once on the driver (seed 0) and written as Hugging Face safetensors shards
(``model-0000k-of-0000K.safetensors`` of at most ``--shard-mb`` MiB, with ``model.safetensors.index.json``)
into the scratch directory (``--dir``, a fresh one under the system's temporary directory by default,
removed at the end). Every file is read back while the page cache still
holds it: the numbers are the framework's and the copies', not the disk's.

Each **repeat** runs both ways, one after the other (``old`` first in even repeats, ``new`` first in odd
ones), each on a pipe of its own that it closes at the end. Phases, each timed with ``time.perf_counter``
around exactly the calls named:

1. **build**. ``old``: the model built on the driver (its own initialisation, seed 0: the same weights as
   the shards) and ``Pipe(model, balance=...)``, which pickles each stage's weights to its worker.
   ``new``: the model built under ``torch.device("meta")`` and ``Pipe(meta_model, balance=...,
   init=<shard directory>)``: each worker reads its stages' tensors from the shards.
2. Untimed, in a repeat that verifies or saves the optimizer: ``opt = pipe.optimizer(torch.optim.AdamW,
   lr=1e-4)`` and one ``train_step`` (MSE on a random batch of ``--batch`` rows) + ``opt.step``, so that
   the weights moved and Adam's state exists (2 more tensors per parameter: with it a checkpoint holds 3x
   the model's bytes). Other repeats have no optimizer and take no step.
3. **save**. ``old``: ``torch.save(pipe.state_dict(), file)``; ``new``: ``pipe.save(dir)``.
4. Untimed, when verifying: another training step, so that the weights differ from the saved ones.
5. **load**. ``old``: ``pipe.load_state_dict(torch.load(file))``; ``new``: ``pipe.load(dir)``.
6. **save+opt** (in the first ``--opt-repeats`` repeats, default 1): ``old``: ``torch.save({"model":
   pipe.state_dict(), "optim": opt.state_dict()}, file)``; ``new``: ``pipe.save(dir, optimizer=opt)``;
   (when verifying, a training step;) then **load+opt**: ``old``: ``state = torch.load(file)``,
   ``pipe.load_state_dict(state["model"])``, ``opt.load_state_dict(state["optim"])``; ``new``:
   ``pipe.load(dir, optimizer=opt)``.

Each checkpoint is deleted after its load (the file's size is reported as ``ckpt``).

Memory: before each phase, after ``gc.collect()`` and ``os.sync()`` (``pipe.save`` fsyncs the files it
writes, DCP's default, which ``torch.save`` does not: the sync keeps the previous phase's writes out of
it), ``5`` is written to ``/proc/PID/clear_refs`` of the
driver and of every worker (the workers are local processes: the driver writes and reads their ``/proc``
files itself; nothing runs on the workers for it), which resets the peak resident set (``VmHWM``) to the
current one (``VmRSS``); after the phase ``VmHWM`` is read. ``growth`` = peak - resident at the start:
what the phase needed on top of what the process held. ``growth/model`` is the driver's growth over the
model's bytes (the target: at most 10% on the new path, for build, save and load).

**Verification** (off the clock; by default of the new path in the first repeat of each stage count:
``--verify both`` adds the old path, ``--verify-all`` every repeat): a digest (shape, dtype and the CRC-32
of the bytes of every tensor) of ``pipe.state_dict()``, gathered on the driver, right after the build
(against the shards': the old path's model is built from the same seed), after each save, after the step
that follows it (it must differ from the saved one: the load then has something to undo; checked for
the weights, and the same AdamW step moves every weight and every Adam step count) and after the load
(it must equal the saved one); in the optimizer phases with ``opt.state_dict()`` (the model's parameter
names). ``verified`` is true when every check of the row held. At 1 GB the gathers cost about as much as
the phases; that is why only one repeat checks.

Statistics: per stage count, way and phase the median over the repeats with the smallest and largest
value (``median [min-max]``); ``new/old`` is the ratio of the medians, beside it the range of the ratios
of the repeats (each repeat ran both ways back to back). Targets (reported, never asserted): the driver's
growth/model <= 0.10 on the new path in build, save and load; ``pipe.save`` time / ``torch.save(
pipe.state_dict())`` time <= 1. On 2 shared cores look at the load average printed with the run.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's rrefpipe and workers (the stage workers use it too)

import torch  # noqa: E402
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import workers  # noqa: E402
from bench_core import exit_without_teardown, loadavg, machine_info  # noqa: E402
from bench_suite import add_run_args, log, new_parser, print_written, run_and_report  # noqa: E402
from rrefpipe import Pipe  # noqa: E402
from suite_targets import print_targets  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_checkpoint.json"
MIB = 2**20
WAYS = ("old", "new")
PHASES = ("build", "save", "load", "save_opt", "load_opt")
LABELS = {"build": "build", "save": "save", "load": "load", "save_opt": "save+opt", "load_opt": "load+opt"}
#: What each way runs in each phase, for the report.
CALLS = {
    "old": {"build": "model built on the driver; Pipe(model, balance=...)",
            "save": "torch.save(pipe.state_dict(), file)",
            "load": "pipe.load_state_dict(torch.load(file))",
            "save_opt": 'torch.save({"model": pipe.state_dict(), "optim": opt.state_dict()}, file)',
            "load_opt": 'torch.load(file); pipe.load_state_dict(...["model"]); opt.load_state_dict(...["optim"])'},
    "new": {"build": 'meta model; Pipe(meta_model, balance=..., init=<safetensors shards>)',
            "save": "pipe.save(dir)", "load": "pipe.load(dir)",
            "save_opt": "pipe.save(dir, optimizer=opt)", "load_opt": "pipe.load(dir, optimizer=opt)"},
}
LR = 1e-4
VERIFY = {"new": ("new",), "both": WAYS, "none": ()}


# -- the model and its shards -----------------------------------------------------------------------
def make_model(width: int, layers: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def balance(layers: int, stages: int) -> list[int]:
    return [layers // stages + (j < layers % stages) for j in range(stages)]


def write_shards(state: Mapping[str, Tensor], directory: Path, shard_bytes: int) -> int:
    """``state`` as Hugging Face safetensors shards with ``model.safetensors.index.json``; returns the count."""
    from safetensors.torch import save_file

    groups: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append({})
            size = 0
        groups[-1][key] = tensor.contiguous()
        size += nbytes
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for k, group in enumerate(groups, 1):
        name = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(directory / name))
        weight_map.update(dict.fromkeys(group, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return len(groups)


def digest(state: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every tensor of a (nested) state dict by key: shape, dtype and the CRC-32 of its bytes; other
    values by their repr."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Tensor):
            t = value.detach().cpu().contiguous()
            data: Any = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
            out[name] = (tuple(t.shape), str(t.dtype), zlib.crc32(data))
        elif isinstance(value, Mapping):
            out.update(digest(value, f"{name}."))
        else:
            out[name] = repr(value)
    return out


def path_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- memory -------------------------------------------------------------------------------------------
def proc_status(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of ``pid`` in bytes."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                found[line[:5]] = int(line.split()[1]) * 1024
    return {"rss": found["VmRSS"], "hwm": found["VmHWM"]}


class Peaks:
    """Peak resident memory of the driver and the workers over a phase (``/proc/PID/clear_refs``)."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)

    def reset(self) -> dict[str, int]:
        start = {}
        for name, pid in self.pids.items():
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            start[name] = proc_status(pid)["rss"]
        return start

    def read(self, start: Mapping[str, int]) -> dict[str, dict[str, int]]:
        out = {}
        for name, pid in self.pids.items():
            status = proc_status(pid)
            peak = max(status["hwm"], start[name])
            out[name] = {"start": start[name], "peak": peak, "growth": peak - start[name], "end": status["rss"]}
        return out


def measure(peaks: Peaks, fn: Callable[[], Any]) -> tuple[dict[str, Any], Any]:
    gc.collect()
    os.sync()  # no phase waits for an earlier one's writes to reach the disk (pipe.save fsyncs its files)
    start = peaks.reset()
    t0 = time.perf_counter()
    value = fn()
    seconds = time.perf_counter() - t0
    return {"s": seconds, "memory": peaks.read(start)}, value


# -- one way, one repeat ------------------------------------------------------------------------------
def train_once(pipe: Pipe, opt: Any, data: tuple[Tensor, Tensor]) -> None:
    with dist_autograd.context() as ctx:
        pipe.train_step(ctx, data[0], data[1], F.mse_loss)
        opt.step(ctx)


def warm_up(names: Sequence[str], scratch: Path) -> None:
    """One untimed round of every call on fresh workers (a Linear(8, 8) per stage), so that what a worker
    imports the first time it reads safetensors or DCP is not counted in the first repeat."""
    n = len(names)
    tiny = make_model(8, n)
    write_shards(tiny.state_dict(), scratch / "warm-up" / "shards", MIB)
    with torch.device("meta"):
        meta = make_model(8, n)
    for model, init in ((tiny, None), (meta, str(scratch / "warm-up" / "shards"))):
        with Pipe(model, balance=[1] * n, workers=list(names), init=init) as pipe:
            opt = pipe.optimizer(torch.optim.AdamW, lr=LR)
            train_once(pipe, opt, (torch.randn(2, 8), torch.randn(2, 8)))
            torch.save({"model": pipe.state_dict(), "optim": opt.state_dict()}, scratch / "warm-up" / "old.pt")
            loaded = torch.load(scratch / "warm-up" / "old.pt")
            pipe.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optim"])
            pipe.save(scratch / "warm-up" / "new", optimizer=opt)
            pipe.load(scratch / "warm-up" / "new", optimizer=opt)
    shutil.rmtree(scratch / "warm-up")


def run_way(way: str, names: Sequence[str], peaks: Peaks, args: argparse.Namespace, scratch: Path,
            reference: dict[str, Any], bal: list[int], verify: bool, with_opt: bool) -> dict[str, Any]:
    """Build a pipe, save and load it (and with its optimizer if ``with_opt``); ``verify``: check each
    state against the one expected (off the clock)."""
    phases: dict[str, Any] = {}
    checks: dict[str, bool] = {}
    sizes: dict[str, int] = {}
    data = (torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1)),
            torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(2)))
    construct: list[float] = []

    def build() -> Pipe:
        if way == "old":
            t0 = time.perf_counter()
            model = make_model(args.width, args.layers)
            construct.append(time.perf_counter() - t0)
            return Pipe(model, balance=bal, workers=list(names))
        with torch.device("meta"):
            model = make_model(args.width, args.layers)
        return Pipe(model, balance=bal, workers=list(names), init=str(scratch / "shards"))

    phases["build"], pipe = measure(peaks, build)
    if construct:
        phases["build"]["construct_s"] = construct[0]
    with pipe:
        if verify:
            checks["build"] = digest(pipe.state_dict()) == reference
        opt: Any = None
        if verify or with_opt:  # the weights move, and Adam's state exists
            opt = pipe.optimizer(torch.optim.AdamW, lr=LR)
            train_once(pipe, opt, data)
        cells = [("save", "load", False)] + ([("save_opt", "load_opt", True)] if with_opt else [])
        weights: dict[str, Any] | None = None  # the digest of the weights as they are now, when known
        for save, load, optim in cells:
            target = scratch / f"{way}-{save}" if way == "new" else scratch / f"{way}-{save}.pt"

            def state() -> dict[str, Any]:
                return {"model": pipe.state_dict(), "optim": opt.state_dict()} if optim else pipe.state_dict()

            def state_digest() -> dict[str, Any]:
                if not optim:
                    return digest(pipe.state_dict())
                return {"model": weights if weights is not None else digest(pipe.state_dict()),
                        "optim": digest(opt.state_dict())}

            if way == "old":
                def do_save() -> None:
                    torch.save(state(), target)

                def do_load() -> None:
                    loaded = torch.load(target)
                    if optim:
                        pipe.load_state_dict(loaded["model"])
                        opt.load_state_dict(loaded["optim"])
                    else:
                        pipe.load_state_dict(loaded)
            else:
                def do_save() -> None:
                    pipe.save(target, optimizer=opt if optim else None)

                def do_load() -> None:
                    pipe.load(target, optimizer=opt if optim else None)

            phases[save], _ = measure(peaks, do_save)
            sizes[save] = path_bytes(target)
            if verify:
                saved = state_digest()
                train_once(pipe, opt, data)  # moves every weight (AdamW's decay) and every Adam step count
                if not optim:  # (shown once: the same step moves the optimizer's state too)
                    checks["the step between save and load changed the weights"] = digest(pipe.state_dict()) != saved
                weights = None
            phases[load], _ = measure(peaks, do_load)
            if verify:
                loaded = {"model": digest(pipe.state_dict()), "optim": digest(opt.state_dict())} if optim \
                    else digest(pipe.state_dict())
                checks[load] = loaded == saved
                weights = loaded["model"] if optim else loaded
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    return {"way": way, "phases": phases, "checkpoint_bytes": sizes, "checks": checks,
            "verified": all(checks.values()) if checks else None}


# -- statistics ----------------------------------------------------------------------------------------
def spread(values: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "values": list(values)}


def summarize(rows: list[dict[str, Any]], model_bytes: int, worker_names: Sequence[str]) -> dict[str, Any]:
    """Per way and phase: time, driver and worker memory (median [min-max] over the repeats); new/old."""
    cells: dict[str, dict[str, Any]] = {}
    for way in WAYS:
        for phase in PHASES:
            got = [r["phases"][phase] for r in rows if r["way"] == way and phase in r["phases"]]
            if not got:
                continue
            drv = [g["memory"]["driver"] for g in got]
            cell = {"s": spread([g["s"] for g in got]),
                    "driver_growth": spread([d["growth"] for d in drv]),
                    "driver_peak": spread([d["peak"] for d in drv]),
                    "driver_growth_over_model": spread([d["growth"] / model_bytes for d in drv]),
                    "workers_growth": {w: spread([g["memory"][w]["growth"] for g in got]) for w in worker_names},
                    "workers_peak": {w: spread([g["memory"][w]["peak"] for g in got]) for w in worker_names}}
            sizes = [r["checkpoint_bytes"][phase] for r in rows if r["way"] == way and phase in r["checkpoint_bytes"]]
            if sizes:
                cell["checkpoint_bytes"] = sizes[0]
            if phase == "build" and all("construct_s" in g for g in got):
                cell["construct_s"] = spread([g["construct_s"] for g in got])
            cells[f"{way}/{phase}"] = cell
    ratios: dict[str, Any] = {}
    for phase in PHASES:
        if f"old/{phase}" in cells and f"new/{phase}" in cells:
            paired = [(o["phases"][phase]["s"], n["phases"][phase]["s"])
                      for o, n in zip([r for r in rows if r["way"] == "old"], [r for r in rows if r["way"] == "new"])
                      if phase in o["phases"] and phase in n["phases"]]
            per_repeat = [n / o for o, n in paired]
            medians = {way: cells[f"{way}/{phase}"]["s"]["median"] for way in WAYS}
            ratios[phase] = {"time_new_over_old": medians["new"] / medians["old"], "per_repeat": spread(per_repeat)}
    return {"cells": cells, "ratios": ratios}


# -- the run ----------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    own_scratch = args.dir is None
    scratch = Path(tempfile.mkdtemp(prefix="rrefpipe-bench-checkpoint-")) if own_scratch else Path(args.dir)
    scratch.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"loadavg_start": loadavg(), "machine": machine_info(torch.get_num_threads(), 1),
                              "source": source_state(), "scratch": str(scratch), "stages": []}
    try:
        t0 = time.perf_counter()
        model = make_model(args.width, args.layers)
        state = model.state_dict()
        model_bytes = sum(t.numel() * t.element_size() for t in state.values())
        shards = write_shards(state, scratch / "shards", args.shard_mb * MIB)
        reference = digest(state)
        del model, state
        gc.collect()
        result["model"] = {"layers": args.layers, "width": args.width, "bytes": model_bytes, "shards": shards,
                           "parameters": model_bytes // 4,
                           "description": f"{args.layers} x Linear({args.width}, {args.width}), float32",
                           "shards_written_s": time.perf_counter() - t0}
        log(f"model {model_bytes / MIB:.1f} MiB written as {shards} safetensors shards in "
            f"{result['model']['shards_written_s']:.1f} s to {scratch}")
        for n in args.stages:
            bal = balance(args.layers, n)
            rows = []
            load_before = loadavg()
            with workers.LocalWorkers(n, threads=1) as local:
                peaks = Peaks({"driver": os.getpid(), **dict(zip(local.names, local.pids))})
                if args.warmup:
                    warm_up(local.names, scratch)
                for r in range(args.repeats):
                    order = WAYS if r % 2 == 0 else WAYS[::-1]
                    for way in order:
                        t1 = time.perf_counter()
                        verify = way in VERIFY[args.verify] and (args.verify_all or r == 0)
                        row = run_way(way, local.names, peaks, args, scratch, reference, bal, verify=verify,
                                      with_opt=r < args.opt_repeats)
                        row.update(repeat=r, wall_s=time.perf_counter() - t1, loadavg=loadavg())
                        rows.append(row)
                        log(f"stages {n} repeat {r} {way}: " + ", ".join(
                            f"{LABELS[p]} {v['s']:.2f} s" for p, v in row["phases"].items())
                            + f" ({row['wall_s']:.0f} s; verified {row['verified']}; load {row['loadavg']})")
                names = list(local.names)
            result["stages"].append({"stages": n, "balance": bal, "workers": names, "loadavg_start": load_before,
                                     "loadavg_end": loadavg(), "rows": rows,
                                     **summarize(rows, model_bytes, names)})
    finally:
        if own_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    checked = [r["verified"] for s in result["stages"] for r in s["rows"] if r["verified"] is not None]
    result["verified"] = all(checked) if checked else None
    result["loadavg_end"] = loadavg()
    return result


def source_state() -> dict[str, Any]:
    import subprocess

    def git(*a: str) -> str:
        try:
            done = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30)
            return done.stdout.strip() if done.returncode == 0 else "?"
        except (OSError, subprocess.SubprocessError):
            return "?"

    changed = git("status", "--porcelain", "--", "rrefpipe", "workers")
    return {"commit": git("rev-parse", "--short", "HEAD"), "changed": [] if changed == "?" else changed.splitlines()}


# -- targets ------------------------------------------------------------------------------------------
def evaluate(result: dict[str, Any]) -> list[dict[str, Any]]:
    targets = []
    growth = {(s["stages"], p): s["cells"][f"new/{p}"]["driver_growth_over_model"]["max"]
              for s in result["stages"] for p in PHASES if f"new/{p}" in s["cells"]}
    core = {k: v for k, v in growth.items() if k[1] in ("build", "save", "load")}
    detail = "; ".join(f"{n} stages {LABELS[p]} {v:.3f}" for (n, p), v in growth.items())
    targets.append({"target": "new path: driver peak RSS growth / model size <= 0.10 in build, save and load "
                              "(the largest over the repeats; +opt phases for information)",
                    "met": all(v <= 0.10 for v in core.values()) if core else None, "detail": detail or "not measured",
                    "values": {f"{n}/{p}": v for (n, p), v in growth.items()}})
    for phase in ("save", "save_opt"):
        got = {s["stages"]: s["ratios"][phase] for s in result["stages"] if phase in s["ratios"]}
        targets.append({
            "target": f"{LABELS[phase]} time new / old ({CALLS['new'][phase]} over {CALLS['old'][phase]}) <= 1",
            "met": all(v["time_new_over_old"] <= 1 for v in got.values()) if got else None,
            "detail": "; ".join(f"{n} stages {v['time_new_over_old']:.2f} (repeats {v['per_repeat']['min']:.2f}-"
                                f"{v['per_repeat']['max']:.2f})" for n, v in got.items()) or "not measured"})
    targets.append({"target": "verified: every checked build, save and load gave the state expected",
                    "met": result.get("verified"), "detail": "see each row's checks"})
    return targets


# -- report --------------------------------------------------------------------------------------------
def _mib(v: float) -> str:
    return f"{v / MIB:.0f}"


def _range(s: dict[str, Any], fmt: Callable[[float], str]) -> str:
    if s["n"] == 1:
        return fmt(s["median"])
    return f"{fmt(s['median'])} [{fmt(s['min'])}-{fmt(s['max'])}]"


def print_stage_table(block: dict[str, Any], model_bytes: int) -> None:
    n, names = block["stages"], block["workers"]
    reps = max(r["repeat"] for r in block["rows"]) + 1
    print(f"\n{n} stages, balance {block['balance']}, {reps} repeat(s): median [min-max]; growth = peak - resident "
          f"at the phase's start; load average {block['loadavg_start']} -> {block['loadavg_end']}")
    print(f"  {'phase':<8} {'way':<3} | {'time s':>19} | {'driver growth MiB':>17} {'/model':>6} {'peak MiB':>8} | "
          f"{'worker growth MiB (median)':>26} {'worker peak MiB':>16} | {'ckpt MiB':>8} | verified")
    for phase in PHASES:
        for way in WAYS:
            c = block["cells"].get(f"{way}/{phase}")
            if c is None:
                continue
            rows = [r for r in block["rows"] if r["way"] == way and phase in r["phases"]]
            verified = [r["checks"][phase] for r in rows if phase in r["checks"]]
            wg = ",".join(_mib(c["workers_growth"][w]["median"]) for w in names)
            wp = ",".join(_mib(c["workers_peak"][w]["median"]) for w in names)
            print(f"  {LABELS[phase]:<8} {way:<3} | {_range(c['s'], lambda v: f'{v:.2f}'):>19} | "
                  f"{_range(c['driver_growth'], _mib):>17} {c['driver_growth_over_model']['median']:>6.3f} "
                  f"{_mib(c['driver_peak']['median']):>8} | {wg:>26} {wp:>16} | "
                  f"{_mib(c['checkpoint_bytes']) if 'checkpoint_bytes' in c else '':>8} | "
                  f"{('yes' if all(verified) else 'NO') if verified else '-'}")
    parts = [f"{LABELS[p]} {v['time_new_over_old']:.2f}" + (
        f" [{v['per_repeat']['min']:.2f}-{v['per_repeat']['max']:.2f}]" if v["per_repeat"]["n"] > 1 else "")
             for p, v in block["ratios"].items()]
    print("  time new/old (ratio of medians [range of the repeats' ratios]): " + ", ".join(parts))
    old_build = block["cells"].get("old/build", {}).get("construct_s")
    if old_build:
        print(f"  (old build: of which building the model on the driver {old_build['median']:.2f} s)")


def report(result: dict[str, Any], out: Path) -> None:
    m, model = result["machine"], result["model"]
    print(f"\nrrefpipe checkpoints: {m['platform']}, torch {m['torch']}, {m['cpu_count']} CPUs "
          f"({m['cpus_usable']} usable); model {model['description']}: {model['bytes'] / MIB:.1f} MiB "
          f"({model['bytes'] / 1e9:.2f} GB), {model['shards']} safetensors shard(s); local workers, 1 intra-op "
          f"thread each; rrefpipe at {result['source']['commit']}"
          + (f" (with uncommitted changes in {len(result['source']['changed'])} files)"
             if result["source"]["changed"] else ""))
    print("  old: " + "; ".join(f"{LABELS[p]} = {c}" for p, c in CALLS["old"].items()))
    print("  new: " + "; ".join(f"{LABELS[p]} = {c}" for p, c in CALLS["new"].items()))
    for block in result["stages"]:
        print_stage_table(block, model["bytes"])
    print_targets(result["targets"], "checkpoints")
    print_written(result, out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = new_parser(__doc__, DEFAULT_OUT)
    p.add_argument("--layers", type=int, default=16, help="Linear layers (default 16: 1.07 GB at width 4096)")
    p.add_argument("--width", type=int, default=4096, help="in and out features of each Linear")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="stage counts (one local worker each)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every phase, both ways")
    p.add_argument("--opt-repeats", type=int, default=1,
                   help="of those, how many also save and load with the optimizer (0: never)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the untimed round of every call on a tiny pipe that first runs on fresh workers")
    p.add_argument("--verify", choices=sorted(VERIFY), default="new",
                   help="which way's states to check (off the clock; default: the new path's)")
    p.add_argument("--verify-all", action="store_true", help="verify in every repeat (default: the first)")
    p.add_argument("--batch", type=int, default=8, help="rows of the untimed training steps' batch")
    p.add_argument("--shard-mb", type=int, default=256, help="largest safetensors shard, MiB")
    p.add_argument("--dir", type=Path, default=None,
                   help="scratch directory for shards and checkpoints (default: a fresh temporary one, removed)")
    add_run_args(p)
    args = p.parse_args(argv)
    if args.layers < max(args.stages) or min(args.stages) < 1 or args.repeats < 1 or args.opt_repeats < 0:
        p.error("need --layers >= every stage count >= 1, --repeats >= 1, --opt-repeats >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    run_and_report(parse_args(argv), run, evaluate, report)


if __name__ == "__main__":
    main()
    exit_without_teardown()  # the workers are closed and the results written
