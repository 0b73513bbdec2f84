"""Micro-batches per message: rrefpipe against itself with ``Pipe(microbatches_per_message=k)``.

``python benchmarks/bench_per_message.py`` (about 2 minutes on 2 CPU cores) times training steps of the
suite's models (``suite_models``, checkpoint 'never', 1 intra-op thread per stage worker) for every
``k`` in ``--per-message``, alternating the values round after round on the same local workers, so
a burst of load hits every value alike. For each model and chunk count it prints the median step
time per value, the median over rounds of each value's step time over the first value's, and in how
many rounds it was faster; writes JSON. More micro-batches per message means fewer messages (one
request, reply and gradient message per k micro-batches) and a later start for the next stage.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import cloudpickle
import torch

import suite_models
from suite_models import SPECS
from suite_rrefpipe import time_pipe

cloudpickle.register_pickle_by_value(suite_models)  # stage workers get the model classes by value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["resnet", "transformer"], choices=list(SPECS))
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 32])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--per-message", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5, help="timed steps per value and round")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "per_message.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    from workers import LocalWorkers

    base, rows = args.per_message[0], []
    print(f"{'model':<12} {'m':>3} " + " ".join(f"{f'k={k} ms':>9}" for k in args.per_message)
          + " " + " ".join(f"{f'k={k}/k={base}':>10} {'faster':>6}" for k in args.per_message[1:]))
    with LocalWorkers(args.stages, threads=1) as cluster:
        for name in args.models:
            spec = SPECS[name]
            model, data, loss_fn, balance = spec.build(), spec.data(), spec.loss_fn(), spec.balance(args.stages)
            for m in args.chunks:
                medians: dict[int, list[float]] = {k: [] for k in args.per_message}
                for _ in range(args.rounds):
                    for k in args.per_message:
                        run = time_pipe(cluster.names, model, balance, data, loss_fn, m, "never", args.warmup,
                                        args.repeats, microbatches_per_message=k)
                        medians[k].append(run["step"]["median_ms"])
                row: dict[str, Any] = {"model": name, "chunks": m, "stages": args.stages, "round_medians_ms": {
                    str(k): v for k, v in medians.items()}}
                cells = []
                for k in args.per_message[1:]:
                    ratios = [a / b for a, b in zip(medians[k], medians[base])]
                    faster = sum(r < 1 for r in ratios)
                    row[f"k{k}_over_k{base}"] = statistics.median(ratios)
                    row[f"k{k}_faster_rounds"] = faster
                    cells.append(f"{statistics.median(ratios):>10.3f} {f'{faster}/{args.rounds}':>6}")
                rows.append(row)
                print(f"{name:<12} {m:>3} " + " ".join(f"{statistics.median(medians[k]):>9.1f}"
                                                       for k in args.per_message) + " " + " ".join(cells), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"torch": torch.__version__, "settings": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
