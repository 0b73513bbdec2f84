"""Deferred batch norm: per-micro-batch normalisation, running statistics committed once per mini-batch."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from collections import OrderedDict
from contextlib import contextmanager
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .stage_side.checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm", "defer_batch_norms", "plain_batch_norms", "running_stats_frozen"]


def plain_batch_norms(module: nn.Module) -> list[_BatchNorm]:
    """The BatchNorm layers of ``module`` that update running statistics themselves (not deferred)."""
    return [m for m in module.modules()
            if isinstance(m, _BatchNorm) and not isinstance(m, DeferredBatchNorm) and m.track_running_stats]


@contextmanager
def running_stats_frozen(norms: Sequence[_BatchNorm]) -> Iterator[None]:
    """Run plain BatchNorm layers without changing their running statistics: re-run by checkpointing,
    they normalise with the batch's statistics as the first run did, but must not count the
    micro-batch a second time. The layers still take their running buffers (checkpoint checks that
    the re-run saves the same tensors), with momentum 0, and ``num_batches_tracked`` is put back."""
    saved = [(norm.momentum, None if norm.num_batches_tracked is None else norm.num_batches_tracked.clone())
             for norm in norms]
    for norm in norms:
        norm.momentum = 0.0
    try:
        yield
    finally:
        for norm, (momentum, tracked) in zip(norms, saved):
            norm.momentum = momentum
            if tracked is not None and norm.num_batches_tracked is not None:
                norm.num_batches_tracked.copy_(tracked)


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm whose running statistics see the whole mini-batch, not each micro-batch.

    In training, each micro-batch is normalised with its own statistics (as BatchNorm would on that
    micro-batch), while the sum and sum of squares are accumulated over the ``chunks`` micro-batches
    of the mini-batch. After the last one the running mean/var are updated once, exactly as plain
    BatchNorm would on the whole mini-batch (momentum, or the cumulative average when ``momentum`` is
    None). Recomputation by checkpointing does not count twice. Eval mode uses the running statistics.
    A BatchNorm *after* a deferred one sees micro-batch-normalised inputs, so its statistics are those
    of what it sees, not of the plain model's whole-batch path.
    """

    sum: Tensor
    sum_squares: Tensor
    counted: Tensor

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 chunks: int = 1) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.chunks = chunks
        self.register_buffer("sum", torch.zeros(num_features, dtype=torch.float64), persistent=False)
        self.register_buffer("sum_squares", torch.zeros(num_features, dtype=torch.float64), persistent=False)
        self.register_buffer("counted", torch.zeros((), dtype=torch.long), persistent=False)
        self.microbatches = 0

    def _check_input_dim(self, input: Tensor) -> None:  # noqa: A002
        if input.dim() < 2:
            raise ValueError(f"expected at least 2-D input (batch, channels, ...), got {input.dim()}-D")

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        if not is_recomputing():
            self._track(input)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _track(self, input: Tensor) -> None:  # noqa: A002
        dims = [d for d in range(input.dim()) if d != 1]
        with torch.no_grad():
            x = input.detach().to(torch.float64)
            self.sum += x.sum(dims)
            self.sum_squares += x.square().sum(dims)
            self.counted += input.numel() // input.size(1)
        self.microbatches += 1
        if self.microbatches >= self.chunks:
            self._commit()

    def _commit(self) -> None:
        n = int(self.counted)
        mean = self.sum / n
        var = self.sum_squares / n - mean.square()
        unbiased = var * n / max(n - 1, 1)
        tracked = cast(Tensor, self.num_batches_tracked)
        tracked += 1
        factor = 1.0 / float(tracked) if self.momentum is None else self.momentum
        with torch.no_grad():
            running_mean = cast(Tensor, self.running_mean)
            running_var = cast(Tensor, self.running_var)
            running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        self.sum.zero_()
        self.sum_squares.zero_()
        self.counted.zero_()
        self.microbatches = 0

    def start_minibatch(self, chunks: int) -> None:
        """A new mini-batch of ``chunks`` micro-batches begins (fewer than Pipe's chunks for small batches)."""
        self.chunks = chunks
        if self.microbatches:  # an abandoned mini-batch (a failed step) must not leak into this one
            self.sum.zero_()
            self.sum_squares.zero_()
            self.counted.zero_()
            self.microbatches = 0

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int = 1) -> nn.Module:
        """Return ``module`` with every ``BatchNorm*d`` replaced by a DeferredBatchNorm sharing its state.

        A DeferredBatchNorm already built for ``chunks`` is kept as it is; one built for another number
        of chunks is converted again (a new module sharing its state), as PyTorch 2.3's was, since it
        would otherwise commit its statistics after the wrong number of micro-batches."""
        if isinstance(module, cls) and module.chunks == chunks:
            return module
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            converted = cls(module.num_features, module.eps, module.momentum, module.affine, chunks)
            if module.affine:
                converted.weight = module.weight
                converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
            device = module.running_mean.device  # type: ignore[union-attr]
            if device.type != "meta":  # (a model on the meta device keeps its accumulators real: zeros)
                for name in ("sum", "sum_squares", "counted"):
                    setattr(converted, name, getattr(converted, name).to(device))
            return converted
        for name, child in module.named_children():
            module.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return module


def defer_batch_norms(module: nn.Sequential, chunks: int) -> nn.Sequential:
    """The module with every BatchNorm that tracks running statistics replaced by DeferredBatchNorm
    (the other layers are shared, not copied); the module itself where it has none."""
    if not plain_batch_norms(module):
        return module
    return nn.Sequential(OrderedDict(
        (name, DeferredBatchNorm.convert_deferred_batch_norm(child, chunks)) for name, child in module._modules.items()
        if child is not None))
