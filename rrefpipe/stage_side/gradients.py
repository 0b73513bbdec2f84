"""A stage's gradients in a ``dist_autograd`` context, where they are: collected, reduced to a norm,
scaled and unscaled in place (what each stage runs for :mod:`rrefpipe.driver_side.clip` and
:class:`rrefpipe.GradScaler`; the driver's side of both sits above the pipe), and added to the
context from outside a backward (``install``: ``Pipe.train_step`` computes them by plain autograd), and
what ``.grad`` keeps between steps on a stage worker (``drop_after_optimizer_steps``).
"""
from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["context_gradients", "gradient_norm", "scale", "unscale", "install", "assign", "worker_tensors",
           "drop_after_optimizer_steps"]


def context_gradients(module: nn.Module, context_id: int, leave_out: Collection[Tensor] = ()) -> list[Tensor]:
    """The gradients of ``module``'s parameters in the context (those that got one), in place; none of
    the parameters ``leave_out``."""
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p] for p in module.parameters() if p in grads and p not in leave_out]


def worker_tensors(modules: Sequence[nn.Module]) -> tuple[list[Tensor], list[Tensor]]:
    """The parameters that train and the buffers of a worker's stages, each once (stages of one worker may
    share one): what its gradient install and the averaging between replicas go over, in a fixed order."""
    params: list[Tensor] = list(dict.fromkeys(p for m in modules for p in m.parameters() if p.requires_grad))
    buffers = list(dict.fromkeys(b for m in modules for b in m.buffers()))
    return params, buffers


def gradient_norm(grads: Sequence[Tensor], norm_type: float) -> Tensor | None:
    """The ``norm_type`` norm of ``grads`` taken together as a 0-dim CPU tensor, or ``None`` for none."""
    if not grads:
        return None
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.promote_types(g.dtype, torch.float32)) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type).cpu()


def scale(grads: list[Tensor], factor: float) -> None:
    if grads:  # _foreach_mul_ refuses an empty list (a stage without parameters, or all frozen)
        torch._foreach_mul_(grads, factor)


def unscale(grads: Sequence[Tensor], inv_scale: float) -> bool:
    """Multiply ``grads`` by ``inv_scale`` in place; whether any of them held an inf or a nan."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for grad in grads:
        if grad.dtype == torch.float16:
            raise ValueError("cannot unscale float16 gradients (as torch.amp.GradScaler cannot): keep the "
                             "parameters in float32 and run the forward under torch.autocast")
        if grad.is_sparse:
            raise TypeError("sparse gradients cannot be unscaled by rrefpipe.GradScaler")
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    found = False
    for (device, _), group in groups.items():  # torch's kernel takes one device and dtype at a time
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)  # float32 whatever the default dtype
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv)
        found = bool(found_inf.item()) or found
    return found


class _Install(torch.autograd.Function):
    """A node whose backward hands each parameter the gradient given to it: run through
    ``dist_autograd.backward`` in a context, it stores those gradients in the context (adding to what
    is there), exactly, without arithmetic on them."""

    @staticmethod
    def forward(ctx: Any, grads: Sequence[Tensor], *params: Tensor) -> Tensor:
        ctx.grads = grads
        return torch.zeros((), device=params[0].device)

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple[Tensor | None, ...]:
        return (None, *ctx.grads)


def install(context_id: int, params: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    """Add ``grads`` to the gradients of ``params`` in the context, as a backward there would: one local
    ``dist_autograd.backward``, which needs the context on this worker (a message of it arrived here)
    and records no send. Call it on the stream the gradients were computed on (a stage's, on a GPU)."""
    if not params:
        return
    with torch.enable_grad():
        root = _Install.apply(grads, *params)
        dist_autograd.backward(context_id, [root])


def assign(context_id: int, params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
    """Make ``grads`` the gradients of ``params`` in the context (``None``: leave that one as it is): written
    in place where the context has one, installed (:func:`install`) where no gradient reached it here."""
    stored = dist_autograd.get_gradients(context_id)
    missing = []
    for p, grad in zip(params, grads):
        if grad is None:
            continue
        if p in stored:
            stored[p].copy_(grad)
        else:
            missing.append((p, grad.to(p.device)))
    install(context_id, [p for p, _ in missing], [g for _, g in missing])


_dropping = threading.Lock()
_dropping_hook: Any = None  # the handle of the process-wide hook, once installed


def drop_after_optimizer_steps() -> None:
    """From now on, every optimizer of this process drops its parameters' ``.grad`` after each step.

    Installed on stage workers only (where ``.grad`` has no other use: distributed autograd keeps the
    gradients in the contexts). ``DistributedOptimizer`` copies a context's gradients into ``.grad`` and
    steps; for optimizer classes it has no TorchScript twin of, it never clears them, so a parameter
    that got no gradient in a later step would be stepped again with the old one (a plain loop that
    called ``zero_grad()`` would skip it), and every worker would keep a full set of gradients alive
    between steps. Idempotent."""
    global _dropping_hook
    with _dropping:
        if _dropping_hook is None:
            _dropping_hook = register_optimizer_step_post_hook(_drop_gradients)


def _drop_gradients(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    optimizer.zero_grad(set_to_none=True)
