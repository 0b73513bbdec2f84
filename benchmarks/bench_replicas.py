"""What averaging gradients between replicas costs (data parallel x pipeline parallel, issue 42).

    python benchmarks/bench_replicas.py            # ~1-2 min on 2 CPU cores
    python benchmarks/bench_replicas.py --quick    # smoke test, < 60 s

Runs the same job under ``torchrun --standalone`` three times, in this order: one replica of a
2-stage pipeline (3 processes), two replicas (6 processes), one replica again (the A/A control: the
same job against itself). Every replica trains the same MLP with ``train_step`` (1F1B, checkpoint
'never', momentum SGD) on the same per-replica batch, so R = 2 does twice the work on the same two
cores: what it shows is the step time of R = 2 over R = 1 (ideal with cores to spare: 1.0; here the
cores are shared, so about 2 plus the all-reduce's cost), the bytes each stage worker all-reduces per
step, and the share of each all-reduce hidden behind the other stages' backward (from the execution
record: the part of an ``allreduce`` span that overlaps a ``backward`` span of another stage of the
same replica, in the same step). Prints a table and writes ``benchmarks/results/replicas.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    """One driver of the job (under torchrun): time the steps, report what the record says."""
    import torch
    import torch.distributed.autograd as dist_autograd
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.optim import DistributedOptimizer

    import workers
    from rrefpipe import Pipe

    with workers.torchrun_group(replicas=args.replicas, threads=1, rpc_timeout=120) as stage_workers:
        torch.manual_seed(0)
        width = args.width
        layers: list[nn.Module] = []
        for _ in range(args.layers):
            layers += [nn.Linear(width, width), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(width, 10))
        g = torch.Generator().manual_seed(stage_workers.replica)
        x = torch.randn(args.batch, width, generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)
        half = len(model) // 2
        with Pipe(model, chunks=args.chunks, checkpoint="never", balance=[half, len(model) - half],
                  workers=stage_workers, schedule="1F1B") as pipe:
            opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.01, momentum=0.9)
            times = []
            for step in range(args.warmup + args.steps):
                if step == args.warmup:
                    pipe.execution_record(clear=True)
                start = time.perf_counter()
                with dist_autograd.context() as ctx:
                    pipe.train_step(ctx, x, y, F.cross_entropy)
                    opt.step(ctx)
                if step >= args.warmup:
                    times.append(time.perf_counter() - start)
            events = pipe.execution_record()
            result = {"replica": stage_workers.replica, "replicas": stage_workers.replicas, "step_s": times,
                      "allreduce_bytes": [s.num_parameters * 4 for s in pipe.stages],
                      "hidden": hidden_shares(events), "allreduce_s": [e.duration for e in events
                                                                        if e.kind == "allreduce"]}
        print("RESULT " + json.dumps(result), flush=True)


def hidden_shares(events: list[Any]) -> list[float]:
    """Per all-reduce span, the share of it that overlaps another stage's backward in the same step."""
    shares = []
    for a in (e for e in events if e.kind == "allreduce"):
        others = [(b.start, b.end) for b in events
                  if b.kind == "backward" and b.step == a.step and b.stage != a.stage]
        covered = union_overlap(others, a.start, a.end)
        shares.append(covered / a.duration if a.duration > 0 else 1.0)
    return shares


def union_overlap(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of [lo, hi] covered by the union of ``spans``."""
    covered, reach = 0.0, lo
    for start, end in sorted(spans):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            covered += end - start
            reach = end
    return covered


def run_job(replicas: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(3 * replicas),
           __file__, "--child", "--replicas", str(replicas), "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--batch", str(args.batch), "--chunks", str(args.chunks), "--width", str(args.width),
           "--layers", str(args.layers)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(results) != replicas:
        raise RuntimeError(f"the job with {replicas} replicas failed ({proc.returncode}):\n{proc.stdout}\n"
                           f"{proc.stderr[-4000:]}")
    return results


def summary(label: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [t for r in results for t in r["step_s"]]
    hidden = [h for r in results for h in r["hidden"]]
    reduce_s = [t for r in results for t in r["allreduce_s"]]
    return {"job": label, "median_step_ms": statistics.median(steps) * 1e3,
            "p10_ms": statistics.quantiles(steps, n=10)[0] * 1e3, "p90_ms": statistics.quantiles(steps, n=10)[-1] * 1e3,
            "allreduce_bytes_per_stage": results[0]["allreduce_bytes"] if hidden else [0] * 2,
            "median_allreduce_ms": statistics.median(reduce_s) * 1e3 if reduce_s else 0.0,
            "hidden_share": statistics.mean(hidden) if hidden else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke test: fewer steps")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=64, help="samples per replica and step")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "replicas.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.steps, args.warmup = 6, 2
    load = os.getloadavg()
    rows = [summary("R=1", run_job(1, args)), summary("R=2", run_job(2, args)), summary("R=1 again (A/A)",
                                                                                       run_job(1, args))]
    base, control = rows[0]["median_step_ms"], rows[2]["median_step_ms"]
    print(f"load average before: {load[0]:.2f}; model {args.layers} x Linear({args.width}) + head, 2 stages, "
          f"batch {args.batch} per replica, chunks {args.chunks}, 1F1B, checkpoint 'never'")
    print(f"{'job':<16} {'step ms':>8} {'p10':>7} {'p90':>7} {'vs R=1':>7} {'allreduce ms':>12} "
          f"{'hidden':>7}  bytes all-reduced per stage")
    for row in rows:
        hidden = "-" if row["hidden_share"] is None else f"{row['hidden_share']:.0%}"
        print(f"{row['job']:<16} {row['median_step_ms']:>8.1f} {row['p10_ms']:>7.1f} {row['p90_ms']:>7.1f} "
              f"{row['median_step_ms'] / base:>7.2f} {row['median_allreduce_ms']:>12.2f} {hidden:>7}  "
              f"{row['allreduce_bytes_per_stage']}")
    print(f"A/A control (R=1 again / R=1): {control / base:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "args": vars(args), "load_before": load}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
