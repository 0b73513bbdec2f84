"""Training a pipe and the plain model side by side on the same batches (CPU and GPU tests alike)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.optim import DistributedOptimizer

from rrefpipe import Pipe
from tests.layers import Overflow


def blobs(steps: int, batch: int, seed: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
    """Four Gaussian clusters in 10-D, a fixed batch sequence."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, 10, generator=g) * 2
    for _ in range(steps):
        y = torch.randint(0, 4, (batch,), generator=g)
        yield centres[y] + torch.randn(batch, 10, generator=g), y


def train_side_by_side(pipe: Pipe, reference: nn.Module, batches: Iterable[tuple[Tensor, Tensor]],
                       device: str = "cpu") -> tuple[list[float], list[float]]:
    """SGD with momentum on both (the pipe through DistributedOptimizer, ``reference`` on ``device``);
    the losses of each step, the pipe's first."""
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.05, momentum=0.9)
    pipe_losses, plain_losses = [], []
    for x, y in batches:
        with dist_autograd.context() as ctx:
            loss = F.cross_entropy(pipe(x).local_value(), y)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        pipe_losses.append(loss.item())
        plain_opt.zero_grad()
        plain_loss = F.cross_entropy(reference(x.to(device)), y.to(device))
        plain_loss.backward()
        plain_opt.step()
        plain_losses.append(plain_loss.item())
    return pipe_losses, plain_losses


def pipe_steps(pipe: Pipe, opt: DistributedOptimizer, sched: Any, batches: Iterable[tuple[Tensor, Tensor]]) -> None:
    """Cross-entropy steps through the pipe, each followed by ``sched.step()`` (if a scheduler)."""
    for x, y in batches:
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, F.cross_entropy(pipe(x).local_value(), y))
            opt.step(ctx)
        if sched is not None:
            sched.step()


def plain_steps(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, batches: Iterable[tuple[Tensor, Tensor]],
                device: str = "cpu") -> None:
    """The same steps on the plain model, on ``device``."""
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
        if sched is not None:
            sched.step()


Batches = list[tuple[Tensor, Tensor]]


def model_that_overflows(stage: int) -> nn.Sequential:
    """For balance [1, 5]: a batch of large inputs gives ``stage`` (0 or 1) inf gradients, the other
    stage finite ones."""
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(10, 16), Overflow(16, threshold=50.0, into="input" if stage == 0 else "weight"),
                         nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def batches_with_overflows(steps: int, bad: Iterable[int]) -> Batches:
    """Batches of 8; those numbered in ``bad`` 100 times as large (they overflow the model above)."""
    large = set(bad)
    return [(x * 100 if k in large else x, y) for k, (x, y) in enumerate(blobs(steps, 8, seed=4))]
