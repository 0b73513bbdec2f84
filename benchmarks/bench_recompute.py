"""What activation checkpointing costs a stage in one process, with no pipeline around it.

``python benchmarks/bench_recompute.py`` (about a minute on 2 CPU cores) times, for each stage of the
suite's models (``suite_models``, 2 stages) at the micro-batch sizes of the suite's chunk counts, with
1 intra-op thread as on a stage worker:

* ``plain``: forward + backward of the stage (random output gradient);
* ``checkpointed``: the same through :func:`rrefpipe.stage_side.checkpoint.run_checkpointed`, the function a
  stage worker uses for ``checkpoint='always'`` (saved-tensor hooks, recomputed in backward here:
  nothing runs ahead of it in one process);
* ``no-grad forward``: the stage's forward under ``torch.no_grad()``.

``checkpointed / plain`` is what recomputation costs a stage when nothing overlaps it: the issue's
"recomputation <= 35% extra step time" cannot be met by a pipeline whose bottleneck stage costs more
than that here. ``1 + no-grad forward / plain`` is the textbook floor (a recomputation is one more
forward); the recomputed forward records the autograd graph again, so it costs more than that. The
variants are timed interleaved in shuffled rounds (``bench_core.time_interleaved``); medians are
reported. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench_core import time_interleaved
from rrefpipe.stage_side.checkpoint import run_checkpointed
from suite_models import DEFAULT_MODELS, SPECS, split


def stage_costs(stage: torch.nn.Module, inp: torch.Tensor, rounds: int) -> dict[str, float]:
    """Median ms of plain, checkpointed and no-grad forward calls of ``stage`` on ``inp``."""
    with torch.no_grad():
        grad = torch.randn_like(stage(inp))

    def forward() -> None:
        with torch.no_grad():
            stage(inp)

    variants: dict[str, Callable[[], Any]] = {
        "plain": lambda: stage(inp).backward(grad),
        "checkpointed": lambda: run_checkpointed(stage, inp).backward(grad),
        "forward": forward,
    }
    # 3 warm-up rounds: oneDNN primitives, the checkpoint machinery
    samples = time_interleaved(variants, warmup=3, repeats=rounds)
    return {f"{name}_ms": statistics.median(v) * 1e3 for name, v in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list(SPECS))
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20, help="timed calls of each variant, interleaved")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "recompute.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{'model':<12} {'m':>3} {'rows':>4} {'stage':>5} {'plain ms':>9} {'ckpt ms':>8} {'ckpt/plain':>10} "
          f"{'1+fwd/plain':>11}")
    for name in args.models:
        spec = SPECS[name]
        x, _ = spec.data()
        stages = split(spec.build(), spec.balance(args.stages))
        for m in args.chunks:
            h = x[:math.ceil(spec.batch / m)]
            for j, stage in enumerate(stages):
                inp = h.detach().requires_grad_(j > 0)  # stage 0's input needs no gradient, later ones do
                costs = stage_costs(stage, inp, args.rounds)
                row = {"model": name, "chunks": m, "rows": len(h), "stage": j, **costs,
                       "checkpointed_over_plain": costs["checkpointed_ms"] / costs["plain_ms"],
                       "textbook_floor": 1 + costs["forward_ms"] / costs["plain_ms"]}
                rows.append(row)
                print(f"{name:<12} {m:>3} {len(h):>4} {j:>5} "
                      f"{costs['plain_ms']:>9.2f} {costs['checkpointed_ms']:>8.2f} "
                      f"{row['checkpointed_over_plain']:>10.2f} {row['textbook_floor']:>11.2f}", flush=True)
                with torch.no_grad():
                    h = stage(h)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"torch": torch.__version__, "threads": 1, "settings": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
