"""Autograd plumbing: phony tensors that keep every RPC hop in the backward graph, and timing markers.

Distributed autograd records an RPC only when its message carries a tensor that requires grad, and
the driver's engine waits for a gradient to reach *every* recorded send. A stage with no parameters,
or a first stage whose input needs no gradient, would break one of those. So every hop carries a
*phony*: a zero-size tensor that requires grad, forked from the sender's output and joined into the
receiver's output::

    stage j                         stage j+1
    out ─ Fork ─┬─ out ───── RPC ──── inp ─ partition ─ Join ─ out' ─ Fork ─ ...
                └─ phony ─── RPC ──── phony ───────────────┘

In backward the phony's gradient is an empty tensor, so the hop costs nothing, but every ``recv``
is reachable from the loss and every ``send`` gets its gradient.

On a stage the join, the fork and the marker that times the start of backward are one autograd node
(:func:`hop`): each Python node costs a GIL acquisition in backward, on the autograd engine's threads
that otherwise run only C++ and compete with the RPC threads for the GIL.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .microbatch import TensorOrTensors, as_tensors

__all__: list[str] = []


def new_phony(requires_grad: bool = True) -> Tensor:
    return torch.empty(0, requires_grad=requires_grad)


class _Fork(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> tuple[Tensor, Tensor]:
        return tensor.detach(), torch.empty(0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor, grad_phony: Tensor) -> Tensor:
        return grad


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, phony: Tensor) -> Tensor:
        ctx.phony_device = phony.device
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, torch.empty(0, device=ctx.phony_device)


class _Marker(torch.autograd.Function):
    """Identity on its tensor inputs; calls ``callback`` when its backward runs."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.callback = callback
        outputs = tuple(t.detach() for t in tensors)
        ctx.mark_non_differentiable(*(o for o, t in zip(outputs, tensors) if not t.requires_grad))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


class _Hop(torch.autograd.Function):
    """Join ``phonies`` into ``tensor``, fork a phony off it, and call ``callback`` when its gradient
    arrives: what :func:`join`, :func:`fork` and :func:`mark` do on a stage's output, in one node."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], tensor: Tensor, *phonies: Tensor) -> tuple[Tensor, Tensor]:
        ctx.callback = callback
        ctx.phony_devices = [p.device for p in phonies]
        return tensor.detach(), torch.empty(0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor, grad_phony: Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, grad, *(torch.empty(0, device=d) for d in ctx.phony_devices))


def _first(value: TensorOrTensors) -> Tensor:
    return value if isinstance(value, Tensor) else value[0]


def _replace_first(value: TensorOrTensors, first: Tensor) -> TensorOrTensors:
    return first if isinstance(value, Tensor) else (first, *value[1:])


def fork(value: TensorOrTensors) -> tuple[TensorOrTensors, Tensor]:
    """Return ``value`` unchanged and a phony that depends on its first tensor."""
    first, phony = _Fork.apply(_first(value))
    return _replace_first(value, first), phony


def join(value: TensorOrTensors, phony: Tensor) -> TensorOrTensors:
    """Return ``value`` unchanged, but make its first tensor depend on ``phony`` in backward."""
    return _replace_first(value, _Join.apply(_first(value), phony))


def hop(value: TensorOrTensors, phonies: Sequence[Tensor], callback: Callable[[], None]
        ) -> tuple[TensorOrTensors, Tensor]:
    """``value`` (its first tensor joined with ``phonies``), and a phony forked off it for the next
    hop; ``callback`` runs when the gradient of the first tensor arrives (the other tensors of the
    output travel in the same RPC message, so their gradients arrive with it)."""
    first, phony = _Hop.apply(callback, _first(value), *phonies)
    return _replace_first(value, first), phony


def mark(value: TensorOrTensors, callback: Callable[[], None]) -> TensorOrTensors:
    """Return ``value`` unchanged; ``callback`` runs once all gradients for it have arrived."""
    tensors = as_tensors(value)
    needing = [t for t in tensors if t.requires_grad]
    if not needing:
        return value
    if len(needing) == 1 and needing[0].grad_fn is not None:
        # One intermediate tensor (a received input, a micro-batch view): a hook is cheaper than a node,
        # and it dies with the tensor (never put one on a leaf: a user's tensor would keep it).
        needing[0].register_hook(lambda grad: callback())
        return value
    marked = _Marker.apply(callback, *tensors)
    return marked[0] if isinstance(value, Tensor) else tuple(marked)


def after_parameter_grads(value: TensorOrTensors, callback: Callable[[], None]) -> bool:
    """Call ``callback`` once every node of ``value``'s local graph that feeds a parameter has run.

    This marks the end of a stage's backward when no input needs a gradient (the first stage): the
    last work is then the parameters' gradients. Returns False when the graph feeds no parameter.
    """
    tensors = as_tensors(value)
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen: set[Any] = set()
    frontier = []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        feeds_leaf = False
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if type(nxt).__name__ == "AccumulateGrad":
                feeds_leaf = True
            else:
                stack.append(nxt)
        if feeds_leaf:
            frontier.append(node)
    if not frontier:
        return False
    remaining = [len(frontier)]

    def done(*_: Any) -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            callback()

    for node in frontier:
        node.register_hook(done)
    return True
