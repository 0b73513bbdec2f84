"""The timed training step the benchmarks share: forward, cross-entropy, backward, optimizer step."""
from __future__ import annotations

import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch.distributed.optim import DistributedOptimizer

from rrefpipe import Pipe

__all__ = ["train_step"]


def train_step(pipe: Pipe, opt: DistributedOptimizer, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """One training step through ``pipe``; returns (wall time in seconds, loss)."""
    start = time.perf_counter()
    with dist_autograd.context() as ctx:
        loss = F.cross_entropy(pipe(x).local_value(), y)
        pipe.backward(ctx, loss)
        opt.step(ctx)
    return time.perf_counter() - start, loss.item()
