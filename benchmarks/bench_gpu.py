"""rrefpipe on a CUDA GPU: the cost of a GPU-to-GPU stage hop, and training against plain PyTorch.

Run ``python benchmarks/bench_gpu.py`` on a machine with a CUDA GPU (about 2 minutes; one GPU is
enough, the stage workers then share it). It prints two tables and writes them, raw timings included,
to ``benchmarks/results/gpu.json``.

1. **Hop.** For float32 tensors of 4 KB to 64 MB, timed interleaved after a warm-up:

   * ``raw``: a plain TensorPipe ``rpc_sync`` of the CUDA tensor between two processes on the GPU,
     over a device map (``cuda:0 -> cuda:0``), in a separate RPC group of two spawned processes;
   * ``pipe1`` / ``pipe2``: a ``Pipe`` of one / two ``nn.Identity`` stages on the GPU, driven from the
     CPU (the input goes up to the first stage, the output comes back down), under ``no_grad``.
     ``hop = pipe2 - pipe1`` is one stage-to-stage hop over the device map, framework included.

2. **Training** of 8 x (Linear(h, h) + ReLU), SGD, against two baselines in one process with the model
   on the GPU: ``plain`` (the whole batch, loss on the GPU) and ``plain@mb`` (the same micro-batches
   as the pipe, one after the other with gradients accumulating, the output gathered and the loss
   taken on the CPU, as the pipe's driver does). Small micro-batches use a GPU less well: ``plain@mb``
   over ``plain`` is that price, which any micro-batching pays; the pipe over ``plain@mb`` is
   rrefpipe's own (messages, processes, distributed autograd, host copies). The pipe has 1 stage (one
   worker process) or 2 (``DistributedOptimizer``, loss on the driver). With one GPU two stages share
   it (their kernels take turns), so this prices overhead, not the speed-up of more GPUs.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn.functional as F

from bench_core import loadavg, machine_info, make_model, summary, time_calls, time_interleaved

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu.json"
SIZES = {"4KB": 4 << 10, "64KB": 64 << 10, "1MB": 1 << 20, "16MB": 16 << 20, "64MB": 64 << 20}
ROW = 1024


def _raw_rank(rank: int, port: int, device: str, sizes: list[str], warmup: int, repeats: int, out: str) -> None:
    """One of two processes of a bare RPC group: rank 0 times ``rpc_sync`` of tensors on ``device`` to rank 1."""
    from workers.options import backend_options

    names = ["sender", "receiver"]
    gpu = device != "cpu"
    options = backend_options(init_method=f"tcp://127.0.0.1:{port}", devices=[device] if gpu else None,
                              device_maps={names[1 - rank]: {device: device}} if gpu else None)
    rpc.init_rpc(names[rank], rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        samples = {}
        for label in sizes:
            x = torch.randn(max(1, SIZES[label] // (4 * ROW)), ROW, device=device)
            samples[label] = time_calls(lambda: rpc.rpc_sync("receiver", torch.numel, args=(x,)), warmup, repeats)
        Path(out).write_text(json.dumps(samples))
    rpc.shutdown()


def raw_hops(device: str, sizes: list[str], warmup: int, repeats: int) -> dict[str, list[float]]:
    from workers import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "raw.json")
        mp.spawn(_raw_rank, args=(free_port(), device, sizes, warmup, repeats, out), nprocs=2, join=True)
        return dict(json.loads(Path(out).read_text()))


def pipe_hops(names: Sequence[str], device: str, sizes: list[str], warmup: int,
              repeats: int) -> dict[str, dict[str, list[float]]]:
    from rrefpipe import Pipe

    gpu = [device, device]
    pipes = {"pipe1": Pipe(torch.nn.Sequential(torch.nn.Identity()), checkpoint="never", devices=gpu[:1],
                           workers=names[:1]),
             "pipe2": Pipe(torch.nn.Sequential(torch.nn.Identity(), torch.nn.Identity()), checkpoint="never",
                           devices=gpu, workers=names[:2])}
    out = {}
    try:
        for label in sizes:
            x = torch.randn(max(1, SIZES[label] // (4 * ROW)), ROW)

            def timer(pipe: Any) -> Any:
                def run() -> None:
                    with torch.no_grad():
                        pipe(x).local_value()
                return run

            out[label] = time_interleaved({k: timer(p) for k, p in pipes.items()}, warmup, repeats)
    finally:
        for pipe in pipes.values():
            pipe.close()
    return out


def plain_training(device: str, model: torch.nn.Sequential, x: torch.Tensor, y: torch.Tensor, warmup: int,
                   repeats: int, chunks: int | None = None) -> dict[str, Any]:
    """The whole batch with the loss on the device; or, with ``chunks``, the pipe's micro-batches one
    after the other, gathered to the CPU for the loss, as the pipe's driver takes it."""
    model = copy.deepcopy(model).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if chunks is None:
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
        else:
            loss = F.cross_entropy(torch.cat([model(part.to(device)) for part in x.chunk(chunks)]).cpu(), y)
        loss.backward()
        opt.step()
        if device != "cpu":
            torch.cuda.synchronize(device)

    return summary(time_calls(step, warmup, repeats))


def pipe_training(names: Sequence[str], device: str, model: torch.nn.Sequential, x: torch.Tensor, y: torch.Tensor,
                  stages: int, chunks: int, checkpoint: str, warmup: int, repeats: int,
                  timeline: Path | None = None) -> dict[str, Any]:
    """Median step from the driver; the loss (on the CPU) waits for each forward, and the next step's
    forward queues behind this step's backward and update on the GPU, so steady-state steps are whole."""
    from torch.distributed.optim import DistributedOptimizer

    from rrefpipe import Pipe

    half = len(model) // 2
    balance = [len(model)] if stages == 1 else [half, len(model) - half]
    with Pipe(copy.deepcopy(model), chunks=chunks, checkpoint=checkpoint, balance=balance,
              devices=[device] * stages, workers=list(names[:stages])) as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.01)

        def step() -> None:
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [F.cross_entropy(pipe(x).local_value(), y)])
                opt.step(ctx)

        stats = summary(time_calls(step, warmup, repeats))
        if timeline is not None:  # the host's side of three more steps: where a stage computes, where it waits
            pipe.execution_record(clear=True)
            for _ in range(3):
                step()
            pipe.timeline(timeline.parent / f"{timeline.name}-{checkpoint}-s{stages}-m{chunks}")
        return stats


def run(args: argparse.Namespace) -> dict[str, Any]:
    from workers import LocalWorkers

    gpu = torch.cuda.get_device_name(args.device) if args.device != "cpu" else None
    result: dict[str, Any] = {"machine": {**machine_info(1, 1), "gpu": gpu, "device": args.device},
                              "load_before": loadavg()}
    raw = raw_hops(args.device, args.sizes, args.warmup, args.repeats)
    torch.manual_seed(0)
    model = make_model(args.hidden, args.blocks)
    x, y = torch.randn(args.batch, args.hidden), torch.randint(0, args.hidden, (args.batch,))
    plain = plain_training(args.device, model, x, y, args.warmup, args.repeats)
    plain_mb = {m: plain_training(args.device, model, x, y, args.warmup, args.repeats, chunks=m) for m in args.chunks}
    devices = [args.device] * 2 if args.device != "cpu" else None
    with LocalWorkers(2, devices=devices, threads=1) as local:
        hops = pipe_hops(local.names, args.device, args.sizes, args.warmup, args.repeats)
        training = [{"stages": n, "chunks": m, "checkpoint": ck, "plain_at_mb": plain_mb[m],
                     "step": pipe_training(local.names, args.device, model, x, y, n, m, ck, args.warmup,
                                           args.repeats, args.timeline)}
                    for ck in args.checkpoints for n in args.stages for m in args.chunks]
    result["hops"] = [{"size": label, "raw": summary(raw[label]), **{k: summary(v) for k, v in hops[label].items()}}
                      for label in args.sizes]
    result["plain"] = plain
    result["training"] = training
    result["load_after"] = loadavg()
    return result


def report(result: dict[str, Any]) -> None:
    print(f"device {result['machine']['device']} ({result['machine']['gpu']}), torch {result['machine']['torch']}")
    print("Hop on the GPU, median ms (hop = pipe2 - pipe1)")
    print(f"{'size':>5} {'raw':>8} {'pipe1':>8} {'pipe2':>8} {'hop':>8} {'hop/raw':>8}")
    for r in result["hops"]:
        raw, p1, p2 = (r[k]["median_ms"] for k in ("raw", "pipe1", "pipe2"))
        r["hop_ms"], r["hop_over_raw"] = p2 - p1, (p2 - p1) / raw
        print(f"{r['size']:>5} {raw:>8.3f} {p1:>8.3f} {p2:>8.3f} {p2 - p1:>8.3f} {(p2 - p1) / raw:>8.2f}")
    plain = result["plain"]["median_ms"]
    print(f"Training, median step ms (plain, the whole batch in one process on the GPU: {plain:.2f} ms)")
    print(f"{'checkpoint':>12} {'stages':>6} {'chunks':>6} {'plain@mb':>8} {'step':>8} {'/plain@mb':>9} {'per mb':>7}")
    for r in result["training"]:
        step, at_mb = r["step"]["median_ms"], r["plain_at_mb"]["median_ms"]
        r["over_plain"], r["over_plain_at_mb"] = step / plain, step / at_mb
        print(f"{r['checkpoint']:>12} {r['stages']:>6} {r['chunks']:>6} {at_mb:>8.2f} {step:>8.2f} "
              f"{step / at_mb:>9.2f} "
              f"{(step - at_mb) / r['chunks']:>7.2f}")
    print("  plain@mb: the same micro-batches in one process; per mb: (step - plain@mb) / chunks, rrefpipe's own cost")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--device", default="cuda:0", help="the stages' device ('cpu' dry-runs the benchmark)")
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--chunks", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--stages", nargs="+", type=int, choices=[1, 2], default=[1, 2])
    p.add_argument("--checkpoints", nargs="+", default=["never", "except_last"])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--timeline", type=Path, help="PREFIX: write each training run's last 3 steps as PREFIX-CKPT-mM"
                   ".json/.png (host-side spans: CUDA kernels run asynchronously)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA GPU (or --device cpu for a dry run)")
    start = time.monotonic()
    result = run(args)
    report(result)
    result["seconds"] = time.monotonic() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} ({result['seconds']:.0f} s; median of {args.repeats} after {args.warmup} warm-up;"
          f" load {result['load_before']} -> {result['load_after']})")


if __name__ == "__main__":
    main()
