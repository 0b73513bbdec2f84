"""Autograd plumbing: phony tensors that keep every RPC hop in the backward graph, and timing markers.

Distributed autograd records an RPC only when its message carries a tensor that requires grad, and
the driver's engine waits for a gradient to reach *every* recorded send. A stage with no parameters,
or a first stage whose input needs no gradient, would break one of those. So every hop carries a
*phony*: a tensor that requires grad, forked from the sender's output and joined, past the receiver's
:func:`arrival` node, into the receiver's output::

    stage j                          stage j+1
    out ─ Hop ─┬─ out ───── RPC ──── inp ─ Arrival ─ inp' ─ layers ─ Hop ─ ...
               └─ phony ─── RPC ──── phony ──┘    └── phony' ────────┘

So every ``recv`` is reachable from the loss and every ``send`` gets its gradient. The phony has one
element per tensor of the output, and in backward :func:`arrival` answers it with which of them got a
gradient: distributed autograd's receive node sends zeros for the others, where one process would
give none (a parameter with no gradient is one that optimizers skip, weight decay included), and the
sender's :func:`hop` turns those back into none.

On a stage the join, the fork and the marker that times the start of backward are one autograd node
(:func:`hop`), and the end of backward is timed by :func:`arrival`'s node: each Python node costs a GIL
acquisition in backward, on the autograd engine's threads that otherwise run only C++ and compete
with the RPC threads for the GIL. On the first stage, whose input comes from the driver, the end of
backward is a hook on the input's gradient or, where no input needs one, a :func:`fence` joined into
the hop.
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


# The nodes that carry a stage's tensors pass "no gradient" (None) on as such
# (``set_materialize_grads(False)``): autograd hands a Python node zeros for an output nothing used,
# and the layers before it would get zero gradients where one process gives none.


def _identity(ctx: Any, tensors: Sequence[Tensor], differentiable: Sequence[bool]) -> tuple[Tensor, ...]:
    """``tensors`` as a node's outputs; those not ``differentiable`` stay without gradient (autograd would
    make every output of a node with a differentiable input differentiable)."""
    outputs = tuple(t.detach() for t in tensors)
    constant = [o for o, d in zip(outputs, differentiable) if not d]
    if constant:
        ctx.mark_non_differentiable(*constant)
    return outputs


def _shaped_like(value: TensorOrTensors, tensors: Sequence[Tensor]) -> TensorOrTensors:
    """``tensors`` as a tensor or a tuple, as ``value`` is."""
    return tensors[0] if isinstance(value, Tensor) else tuple(tensors)


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, phony: Tensor) -> Tensor:
        ctx.set_materialize_grads(False)
        ctx.phony_device = phony.device
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> tuple[Tensor | None, Tensor]:
        return grad, torch.empty(0, device=ctx.phony_device)


class _Marker(torch.autograd.Function):
    """Identity on its tensor inputs; calls ``callback`` when its backward runs."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.callback = callback
        return _identity(ctx, tensors, [t.requires_grad for t in tensors])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


class _Hop(torch.autograd.Function):
    """Join ``phonies`` into a stage's output, fork a phony off it, and call ``callback`` (if any) when
    the output's gradients arrive: a join, a fork and :func:`mark`, in one node.

    ``masked``: the phony has one element per tensor, and its gradient (from :class:`_Arrival`) says
    which tensors the receiver used; the others get no gradient here (``None``), as in one process.
    Distributed autograd sends zeros for them otherwise."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None] | None, differentiable: tuple[bool, ...], masked: bool,
                *args: Tensor) -> tuple[Tensor, ...]:
        count = len(differentiable)
        ctx.set_materialize_grads(False)
        ctx.callback, ctx.masked = callback, masked
        ctx.phony_devices = [p.device for p in args[count:]]
        return (*_identity(ctx, args[:count], differentiable), torch.zeros(count if masked else 0))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        if ctx.callback is not None:
            ctx.callback()
        tensor_grads, used = list(grads[:-1]), grads[-1]
        if ctx.masked and used is not None and used.numel() == len(tensor_grads):
            tensor_grads = [g if flag else None for g, flag in zip(tensor_grads, used.tolist())]
        return (None, None, None, *tensor_grads, *(torch.empty(0, device=d) for d in ctx.phony_devices))


class _Arrival(torch.autograd.Function):
    """A received message's tensors as they came, and a phony on ``device`` to join into what the stage
    makes of them; in backward, calls ``callback`` once all their gradients are in, and answers the
    sender's phony with which tensors got one (see :class:`_Hop`)."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None] | None, device: torch.device, phony: Tensor,
                *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.callback, ctx.phony_size, ctx.phony_device = callback, phony.numel(), phony.device
        return (*_identity(ctx, tensors, [t.requires_grad for t in tensors]), torch.empty(0, device=device))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        if ctx.callback is not None:
            ctx.callback()
        tensor_grads = grads[:-1]
        if ctx.phony_size != len(tensor_grads):  # (an unmasked hop's phony)
            used = torch.empty(ctx.phony_size, device=ctx.phony_device)
        elif all(g is not None for g in tensor_grads):  # (the usual case, ~2 us cheaper than the next)
            used = torch.ones(ctx.phony_size, device=ctx.phony_device)
        else:
            used = torch.tensor([float(g is not None) for g in tensor_grads], device=ctx.phony_device)
        return (None, None, used, *tensor_grads)


class _Fence(torch.autograd.Function):
    """A phony on ``device`` made of ``phonies``; calls ``callback`` when its gradient arrives."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], device: torch.device, *phonies: Tensor) -> Tensor:
        ctx.callback = callback
        ctx.phony_devices = [p.device for p in phonies]
        return torch.empty(0, device=device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, None, *(torch.empty(0, device=d) for d in ctx.phony_devices))


def _first(value: TensorOrTensors) -> Tensor:
    return value if isinstance(value, Tensor) else value[0]


def _replace_first(value: TensorOrTensors, first: Tensor) -> TensorOrTensors:
    return first if isinstance(value, Tensor) else (first, *value[1:])


def join(value: TensorOrTensors, phony: Tensor) -> TensorOrTensors:
    """Return ``value`` unchanged, but make its first tensor depend on ``phony`` in backward."""
    return _replace_first(value, _Join.apply(_first(value), phony))


def hop(value: TensorOrTensors, phonies: Sequence[Tensor], callback: Callable[[], None] | None, *,
        as_is: bool = True, masked: bool = False) -> tuple[TensorOrTensors, Tensor]:
    """``value`` joined with ``phonies``, and a phony forked off it for the next hop; ``callback`` runs
    when the gradients of ``value`` arrive (its tensors travel in one RPC message, so they arrive
    together). ``masked``: the receiver runs :func:`arrival` on it, and tensors it left unused get
    no gradient here instead of distributed autograd's zeros.

    ``as_is``: each tensor keeps its ``requires_grad``, as in the plain module; the phony that goes with
    the output to the next stage, joined there, keeps this hop in backward. An output leaving the
    pipe (``as_is=False``) has a tensor made to require grad instead: a kept output (``remote_output``)
    loses its phony, and the driver's loss may use no other tensor of the step's output message (a
    frozen teacher's), where backward must still reach every send. There the first tensor that can
    carry a gradient is the one (an integer mask first, say, cannot)."""
    tensors = as_tensors(value)
    k = 0 if as_is else next((j for j, t in enumerate(tensors) if t.is_floating_point() or t.is_complex()), 0)
    differentiable = tuple(t.requires_grad or (j == k and not as_is) for j, t in enumerate(tensors))
    *outputs, phony = _Hop.apply(callback, differentiable, masked, *tensors, *phonies)
    return _shaped_like(value, outputs), phony


def arrival(value: TensorOrTensors, phony: Tensor, callback: Callable[[], None] | None,
            device: torch.device) -> tuple[TensorOrTensors, Tensor]:
    """``value`` as received with ``phony`` (from a masked :func:`hop`), and a phony on ``device`` to join
    into the output made of it; ``callback`` runs once all gradients for ``value`` are in (or, where
    none needs one, after the nodes recorded later on this thread, as with :func:`fence`)."""
    *outputs, joined = _Arrival.apply(callback, device, phony, *as_tensors(value))
    return _shaped_like(value, outputs), joined


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
    return _shaped_like(value, _Marker.apply(callback, *tensors))


def fence(callback: Callable[[], None], phonies: Sequence[Tensor], device: torch.device) -> Tensor:
    """One phony on ``device`` that depends on ``phonies`` and whose backward calls ``callback`` after
    every node autograd records later on this thread: join it into the output of the forward that
    follows, in place of ``phonies``.

    This times the end of a stage's backward when no input needs a gradient (the first stage), with one
    node instead of a hook on every node that feeds a parameter, which meant walking the whole graph
    in Python (a Transformer stage, 165 nodes: 0.75 ms per micro-batch). The engine runs ready nodes
    in decreasing sequence number (``Node.sequence_nr``, counted per thread in creation order) and,
    while any node of the forward is left, one of them is ready; so this node, created before all of
    them, runs after the last. It lives on the stage's device, whose queue runs the stage's nodes.
    """
    return _Fence.apply(callback, device, *phonies)
