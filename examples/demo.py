"""The smallest real job: train a classifier through a pipeline of local stage workers.

    python examples/demo.py --stages 2 --chunks 4 --steps 100

Prints the stages (which layers, worker, device), the loss as it trains, samples/s, and checks the
result against the same model trained plainly in this process.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import DistributedOptimizer

from rrefpipe import Pipe


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


def train_pipe(pipe: Pipe, batches: Batches, lr: float, log_every: int) -> tuple[float, float]:
    """SGD with momentum through the pipe (the classic dist-autograd loop); returns (last loss, seconds)."""
    opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=lr, momentum=0.9)
    start = time.perf_counter()
    for step, (x, y) in enumerate(batches, 1):
        with dist_autograd.context() as ctx:
            loss = F.cross_entropy(pipe(x).local_value(), y)
            pipe.backward(ctx, loss)
            opt.step(ctx)
        if step % log_every == 0 or step == 1:
            rate = step * len(x) / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {loss.item():.4f}  {rate:8.1f} samples/s", flush=True)
    del opt  # its parameter RRefs go before any RPC group stops
    return loss.item(), time.perf_counter() - start


def train_plain(model: nn.Module, batches: Batches, lr: float) -> float:
    """The same training in plain PyTorch, for comparison; returns the last loss."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages = local worker processes")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    p.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"],
                   help="micro-batches that recompute their forward in backward (default: except_last)")
    p.add_argument("--steps", type=int, default=100, help="training steps (default: 100)")
    p.add_argument("--batch-size", type=int, default=64, help="mini-batch size (default: 64)")
    p.add_argument("--width", type=int, default=128, help="width of the hidden layers (default: 128)")
    p.add_argument("--lr", type=float, default=0.03, help="SGD learning rate, momentum 0.9 (default: 0.03)")
    args = p.parse_args()

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
        loss, elapsed = train_pipe(pipe, batches, args.lr, log_every=max(1, args.steps // 10))
        pipe.eval()
        with torch.no_grad():
            accuracy = (pipe(x_all[:1024]).local_value().argmax(1) == y_all[:1024]).float().mean().item()

    plain_loss = train_plain(plain, batches, args.lr)
    print(f"pipeline: {args.steps} steps in {elapsed:.2f}s, {args.steps * args.batch_size / elapsed:.1f} samples/s, "
          f"final loss {loss:.4f}, train accuracy {accuracy:.3f}")
    print(f"plain PyTorch, same seed: final loss {plain_loss:.4f} (difference {abs(plain_loss - loss):.2e})")


if __name__ == "__main__":
    main()
