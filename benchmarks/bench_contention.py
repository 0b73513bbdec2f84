"""What a stage's compute costs while the other stage computes beside it, against alone.

``python benchmarks/bench_contention.py`` (about 2 minutes on 2 CPU cores) times, for the suite's
models split in 2 stages (``suite_models``) at the micro-batch sizes of the suite's chunk counts, with
1 intra-op thread as on a stage worker, each stage's forward + backward:

* ``alone``: nothing else computes (how the suite measures the bubble model's "ideal@mb");
* ``beside``: while another process runs the other stage's forward + backward in a loop, as a
  pipeline's stages do on a machine's cores.

``beside / alone`` is what sharing the machine (memory bandwidth, caches) costs a stage. An ideal
that uses the ``alone`` time cannot be reached by any schedule, GPipe's included, by more than about
``alone / beside`` of the slowest stage. The two are timed in alternating rounds; medians are reported.
Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from suite_models import SPECS, split


def _stage_step(name: str, chunks: int, j: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """Stage ``j`` of the 2-stage split, its input at micro-batch size and an output gradient."""
    spec = SPECS[name]
    x, _ = spec.data()
    stages = split(spec.build(), spec.balance(2))
    h = x[:math.ceil(spec.batch / chunks)]
    with torch.no_grad():
        for stage in stages[:j]:
            h = stage(h)
        grad = torch.randn_like(stages[j](h))
    return stages[j], h.detach().requires_grad_(j > 0), grad


def _spin(name: str, chunks: int, j: int) -> None:
    """Run stage ``j``'s step until the parent is gone (killed, or it died); say "ready" once warm."""
    parent = os.getppid()
    stage, inp, grad = _stage_step(name, chunks, j)
    for _ in range(3):
        stage(inp).backward(grad)
    print("ready", flush=True)
    while os.getppid() == parent:  # an orphan is re-parented: a killed benchmark leaves no spinner behind
        stage(inp).backward(grad)
    os._exit(0)  # at once: no teardown of torch's modules (half a CPU-second) in a process nobody waits for


def _timed(stage: torch.nn.Module, inp: torch.Tensor, grad: torch.Tensor, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        stage(inp).backward(grad)
        out.append(time.perf_counter() - start)
    return out


def measure(name: str, chunks: int, j: int, rounds: int, calls: int) -> dict[str, float]:
    stage, inp, grad = _stage_step(name, chunks, j)
    _timed(stage, inp, grad, 3)  # warm-up
    alone: list[float] = []
    beside: list[float] = []
    for _ in range(rounds):
        alone += _timed(stage, inp, grad, calls)
        other = subprocess.Popen([sys.executable, __file__, "--spin", name, str(chunks), str(1 - j)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert other.stdout is not None and other.stdout.readline().strip() == "ready"
            beside += _timed(stage, inp, grad, calls)
        finally:
            other.kill()
            other.wait()
    a, b = statistics.median(alone) * 1e3, statistics.median(beside) * 1e3
    return {"alone_ms": a, "beside_ms": b, "beside_over_alone": b / a}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["mlp", "resnet", "transformer"], choices=list(SPECS))
    p.add_argument("--chunks", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--rounds", type=int, default=3, help="alternating alone/beside rounds")
    p.add_argument("--calls", type=int, default=8, help="timed calls per round and condition")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "contention.json")
    p.add_argument("--spin", nargs=3, metavar=("MODEL", "CHUNKS", "STAGE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.spin:
        _spin(args.spin[0], int(args.spin[1]), int(args.spin[2]))
        return
    rows = []
    print(f"{'model':<12} {'m':>3} {'stage':>5} {'alone ms':>9} {'beside ms':>10} {'beside/alone':>12}")
    for name in args.models:
        for m in args.chunks:
            for j in (0, 1):
                row = {"model": name, "chunks": m, "stage": j, **measure(name, m, j, args.rounds, args.calls)}
                rows.append(row)
                print(f"{name:<12} {m:>3} {j:>5} {row['alone_ms']:>9.2f} {row['beside_ms']:>10.2f} "
                      f"{row['beside_over_alone']:>12.2f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"torch": torch.__version__, "threads": 1, "settings": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "spin"}, "rows": rows},
        indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
