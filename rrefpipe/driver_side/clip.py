"""Gradient clipping across stages: ``torch.nn.utils.clip_grad_norm_`` for gradients that live in a
``dist_autograd`` context on several workers.

Each stage reduces its own gradients to one norm where they are, the driver combines the norms into
the total (the norm of all gradients as one vector, as ``clip_grad_norm_`` takes it), and each stage
scales its gradients in the context in place, where ``DistributedOptimizer.step`` then reads them
(the stages' part is in :mod:`rrefpipe.stage_side.gradients`; this is the driver's).
Norms are taken in float32 at least (torch takes a bfloat16 norm of bfloat16 gradients).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["as_number", "total_norm", "clip_coefficient"]


def as_number(name: str, value: object, *, positive: bool) -> float:
    """``value`` as a float (a number, a 0-dim tensor or a string such as ``'inf'``, as torch takes it)."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None
    if not (number > 0 if positive else number >= 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return number


def total_norm(norms: Sequence[Tensor | None], norm_type: float) -> Tensor:
    """The stages' norms combined into the norm of all gradients together (0 where there are none)."""
    present = [n for n in norms if n is not None]
    return torch.linalg.vector_norm(torch.stack(present), norm_type) if present else torch.tensor(0.0)


def clip_coefficient(total: Tensor, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> float | None:
    """The factor to scale every gradient by, or ``None`` where they are within ``max_norm``. A nan
    total gives a nan factor and an inf one zero, as in torch."""
    norm = float(total)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the stages' gradients is {norm}, so they cannot "
                           "be clipped; pass error_if_nonfinite=False to clip anyway")
    coefficient = max_norm / (norm + 1e-6)
    return None if coefficient >= 1.0 else coefficient  # nan compares False: scaled, as torch does
