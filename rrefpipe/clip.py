"""Gradient clipping across stages: ``torch.nn.utils.clip_grad_norm_`` for gradients that live in a
``dist_autograd`` context on several workers.

Each stage reduces its own gradients to one norm where they are, the driver combines the norms into
the total (the norm of all gradients as one vector, as ``clip_grad_norm_`` takes it), and each stage
scales its gradients in the context in place, where ``DistributedOptimizer.step`` then reads them.
Norms are taken in float32 at least (torch takes a bfloat16 norm of bfloat16 gradients).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed.autograd as dist_autograd
from torch import Tensor, nn

__all__ = ["as_number", "context_gradients", "gradient_norm", "total_norm", "clip_coefficient", "scale"]


def as_number(name: str, value: object, *, positive: bool) -> float:
    """``value`` as a float (a number, a 0-dim tensor or a string such as ``'inf'``, as torch takes it)."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None
    if not (number > 0 if positive else number >= 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return number


def context_gradients(module: nn.Module, context_id: int) -> list[Tensor]:
    """The gradients of ``module``'s parameters in the context (those that got one), in place."""
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p] for p in module.parameters() if p in grads]


def gradient_norm(grads: Sequence[Tensor], norm_type: float) -> Tensor | None:
    """The ``norm_type`` norm of ``grads`` taken together as a 0-dim CPU tensor, or ``None`` for none."""
    if not grads:
        return None
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.promote_types(g.dtype, torch.float32)) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type).cpu()


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


def scale(grads: list[Tensor], factor: float) -> None:
    if grads:  # _foreach_mul_ refuses an empty list (a stage without parameters, or all frozen)
        torch._foreach_mul_(grads, factor)
