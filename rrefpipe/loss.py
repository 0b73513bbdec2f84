"""The loss of a training step (``Pipe.train_step``), pure: the target split like the input, each
micro-batch's loss checked, and the mini-batch loss as the micro-batch losses' mean weighted by their
rows, which for a loss that averages over samples is the loss of the whole batch, also when the
micro-batches differ in size."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import microbatch
from .microbatch import TensorOrTensors

__all__ = ["split_target", "checked_loss", "weights", "mean_loss"]


def split_target(value: TensorOrTensors, target: TensorOrTensors, chunks: int) -> tuple[int, ...]:
    """The rows of each micro-batch of ``value``; the target must split the same way (same batch size).

    Raises:
        TypeError: ``target`` is not a tensor or a tuple of tensors.
        ValueError: its batch size (dim 0) differs from the input's.
    """
    batches = microbatch.scatter(value, chunks)
    targets = microbatch.scatter(target, chunks, "train_step target")
    rows, target_rows = microbatch.rows(batches), microbatch.rows(targets)
    if rows != target_rows:
        raise ValueError(f"the target has {sum(target_rows)} rows and the input {sum(rows)}: they must share "
                         "their batch size (dim 0), so that micro-batch i of the target goes with micro-batch i "
                         "of the input")
    return rows


def checked_loss(loss: object) -> Tensor:
    """``loss_fn``'s result as a 0-dim tensor backward can start from, or an error saying what to change."""
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else f"a {type(loss).__name__}"
        raise ValueError(f"loss_fn must return a scalar tensor (one element), got {what}: reduce it with .mean() "
                         "or .sum()")
    if not loss.requires_grad:
        raise RuntimeError("loss_fn returned a tensor that does not require grad: compute it from the output it is "
                           "given (not under torch.no_grad(), not from a detached copy)")
    return loss.reshape(())


def weights(rows: Sequence[int]) -> list[float]:
    """Each micro-batch's share of the mini-batch loss: its rows over all rows."""
    total = sum(rows)
    return [r / total for r in rows]


def mean_loss(losses: Tensor, rows: Sequence[int]) -> Tensor:
    """The mini-batch loss from the micro-batch losses (in micro-batch order), in their dtype."""
    w = torch.tensor(weights(rows), dtype=torch.float64, device=losses.device)
    return (losses.double() * w).sum().to(losses.dtype)
