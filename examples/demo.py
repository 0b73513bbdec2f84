"""The smallest real job: train a classifier through a pipeline of local stage workers.

    python examples/demo.py --stages 2 --chunks 4 --steps 100
    python examples/demo.py --amp float16       # autocast on the stages, loss scaled by rrefpipe.GradScaler

Prints the stages (which layers, worker, device), the loss as it trains, samples/s, and checks the
result against the same model trained plainly in this process.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import DistributedOptimizer

from rrefpipe import GradScaler, Pipe
from rrefpipe.__main__ import CHECKPOINT_HELP


def make_model(width: int, depth: int, classes: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(20, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def dataset(n: int, classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian clusters in 20-D: learnable, and the same every run."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, 20, generator=g) * 1.0
    y = torch.randint(0, classes, (n,), generator=g)
    return centres[y] + torch.randn(n, 20, generator=g), y


Batches = list[tuple[torch.Tensor, torch.Tensor]]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast(amp: str) -> contextlib.AbstractContextManager[object]:
    """The region the forward runs in: ``torch.autocast`` reaches the stages (all on the CPU here)."""
    return torch.autocast("cpu", dtype=DTYPES[amp]) if amp in DTYPES else contextlib.nullcontext()


def train_pipe(pipe: Pipe, batches: Batches, lr: float, log_every: int, amp: str = "none") -> tuple[float, float]:
    """SGD with momentum through the pipe (the classic dist-autograd loop); returns (last loss, seconds).
    float16 scales the loss, as it underflows small gradients otherwise."""
    opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=lr, momentum=0.9)
    scaler = GradScaler(pipe, enabled=amp == "float16")
    start = time.perf_counter()
    for step, (x, y) in enumerate(batches, 1):
        with dist_autograd.context() as ctx:
            with autocast(amp):
                out = pipe(x).local_value()
            loss = F.cross_entropy(out.float(), y)
            pipe.backward(ctx, scaler.scale(loss))
            scaler.step(opt, ctx)  # opt.step(ctx), unless a float16 gradient overflowed
        scaler.update()
        if step % log_every == 0 or step == 1:
            rate = step * len(x) / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {loss.item():.4f}  {rate:8.1f} samples/s", flush=True)
    if scaler.is_enabled():
        print(f"loss scale at the end: {scaler.get_scale():g}")
    del opt  # its parameter RRefs go before any RPC group stops
    return loss.item(), time.perf_counter() - start


def train_plain(model: nn.Module, batches: Batches, lr: float, amp: str = "none") -> float:
    """The same training in plain PyTorch, for comparison; returns the last loss."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=amp == "float16")
    for x, y in batches:
        opt.zero_grad()
        with autocast(amp):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return loss.item()


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2,
                   help="pipeline stages = local worker processes (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch (default: %(default)s)")
    p.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"],
                   help=CHECKPOINT_HELP)
    p.add_argument("--steps", type=int, default=100, help="training steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=64, help="mini-batch size (default: %(default)s)")
    p.add_argument("--width", type=int, default=128, help="width of the hidden layers (default: %(default)s)")
    p.add_argument("--lr", type=float, default=0.03, help="SGD learning rate, momentum 0.9 (default: %(default)s)")
    p.add_argument("--amp", choices=["none", *DTYPES], default="none",
                   help="mixed precision: the forward under torch.autocast in that dtype on the stages; float16 "
                        "also scales the loss with rrefpipe.GradScaler (default: %(default)s)")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """``prog``: the name --help gives (``python -m rrefpipe demo`` passes its own)."""
    args = parser(prog).parse_args(argv)

    torch.manual_seed(0)
    classes = 5
    model = make_model(args.width, depth=2 * args.stages, classes=classes)
    plain = copy.deepcopy(model)
    x_all, y_all = dataset(args.steps * args.batch_size, classes)
    batches = list(zip(x_all.split(args.batch_size), y_all.split(args.batch_size)))

    with Pipe(model, chunks=args.chunks, checkpoint=args.checkpoint, devices=["cpu"] * args.stages) as pipe:
        print("stages:")
        for stage in pipe.stages:
            print(f"  {stage}")
        loss, elapsed = train_pipe(pipe, batches, args.lr, log_every=max(1, args.steps // 10), amp=args.amp)
        pipe.eval()
        with torch.no_grad():
            accuracy = (pipe(x_all[:1024]).local_value().argmax(1) == y_all[:1024]).float().mean().item()

    plain_loss = train_plain(plain, batches, args.lr, args.amp)
    print(f"pipeline: {args.steps} steps in {elapsed:.2f}s, {args.steps * args.batch_size / elapsed:.1f} samples/s, "
          f"final loss {loss:.4f}, train accuracy {accuracy:.3f}")
    print(f"plain PyTorch, same seed: final loss {plain_loss:.4f} (difference {abs(plain_loss - loss):.2e})")


if __name__ == "__main__":
    main()
