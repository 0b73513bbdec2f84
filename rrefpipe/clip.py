"""Gradient clipping across stages: ``torch.nn.utils.clip_grad_norm_`` for gradients that live in a
``dist_autograd`` context on several workers.

Each stage reduces its own gradients to one norm where they are, the driver combines the norms into
the total (the norm of all gradients as one vector, as ``clip_grad_norm_`` takes it), and each stage
scales its gradients in the context in place, where ``DistributedOptimizer.step`` then reads them.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed.autograd as dist_autograd
from torch import Tensor, nn

__all__ = ["context_gradients", "gradient_norm", "total_norm", "clip_coefficient", "check_norm_type"]


def check_norm_type(max_norm: float, norm_type: float) -> None:
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm >= 0:
        raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
    if not isinstance(norm_type, (int, float)) or isinstance(norm_type, bool) or not norm_type > 0:
        raise ValueError(f"norm_type must be a number > 0 (or math.inf), got {norm_type!r}")


def context_gradients(module: nn.Module, context_id: int) -> list[Tensor]:
    """The gradients of ``module``'s parameters in the context (those that got one), in place."""
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p] for p in module.parameters() if p in grads]


def gradient_norm(grads: Sequence[Tensor], norm_type: float) -> float:
    """The ``norm_type`` norm of ``grads`` taken together, in float32 (0.0 for none)."""
    if not grads:
        return 0.0
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
    return float(torch.linalg.vector_norm(torch.stack(norms), norm_type))


def total_norm(norms: Sequence[float], norm_type: float) -> Tensor:
    """The stages' norms combined into the norm of all gradients together (a 0-dim float32 tensor)."""
    return torch.linalg.vector_norm(torch.tensor(list(norms), dtype=torch.float32), norm_type)


def clip_coefficient(total: Tensor, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> float | None:
    """The factor to scale every gradient by, or ``None`` where they are within ``max_norm``."""
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise RuntimeError(f"the total norm of order {norm_type} of the stages' gradients is {float(total)}, so "
                           "they cannot be clipped; pass error_if_nonfinite=False to clip anyway")
    coefficient = max_norm / (float(total) + 1e-6)
    return coefficient if coefficient < 1.0 else None
