"""Splitting a mini-batch into micro-batches along dim 0 and gathering the outputs back, in order."""
from __future__ import annotations

from collections.abc import Callable
from typing import Union

import torch
from torch import Tensor

__all__ = ["Tensors", "TensorOrTensors", "as_tensors", "check", "scatter", "gather", "apply", "detached"]

Tensors = tuple[Tensor, ...]
TensorOrTensors = Union[Tensor, Tensors]


def as_tensors(value: TensorOrTensors) -> Tensors:
    """A tensor or a tuple of tensors, as a tuple."""
    return (value,) if isinstance(value, Tensor) else tuple(value)


def check(value: object, where: str) -> None:
    """Raise ``TypeError`` unless ``value`` is a tensor or a non-empty tuple/list of tensors."""
    if isinstance(value, Tensor):
        return
    if isinstance(value, (tuple, list)) and value and all(isinstance(t, Tensor) for t in value):
        return
    if isinstance(value, (tuple, list)):
        kinds = ", ".join(type(t).__name__ for t in value) or "empty"
        raise TypeError(f"{where} must be a Tensor or a tuple of Tensors, got a {type(value).__name__} of ({kinds})")
    raise TypeError(f"{where} must be a Tensor or a tuple of Tensors, got {type(value).__name__}")


def apply(fn: Callable[[Tensor], Tensor], value: TensorOrTensors) -> TensorOrTensors:
    """Apply ``fn`` to a tensor or to each tensor of a tuple, keeping the structure."""
    if isinstance(value, Tensor):
        return fn(value)
    return tuple(fn(t) for t in value)


def detached(t: Tensor) -> Tensor:
    """``t`` cut from its graph, as a leaf that still asks for a gradient if ``t`` did: the start of a piece
    of a graph run on its own (a recomputation, a layer profiled alone, a stash between such layers)."""
    return t.detach().requires_grad_(t.requires_grad)


def scatter(value: TensorOrTensors, chunks: int) -> list[TensorOrTensors]:
    """Split along dim 0 into at most ``chunks`` micro-batches (``torch.chunk`` semantics).

    A batch smaller than ``chunks`` gives one micro-batch per sample. Tuple elements must share
    their batch size.
    """
    check(value, "Pipe input")
    tensors = as_tensors(value)
    sizes = set()
    for t in tensors:
        if t.dim() == 0:
            raise ValueError("Pipe input tensors need a batch dimension, got a 0-dim tensor")
        sizes.add(t.size(0))
    if len(sizes) != 1:
        raise ValueError(f"all input tensors must have the same batch size (dim 0), got sizes {sorted(sizes)}")
    if 0 in sizes:
        raise ValueError("Pipe input has batch size 0: nothing to split into micro-batches")
    pieces = [t.chunk(chunks) for t in tensors]
    if isinstance(value, Tensor):
        return list(pieces[0])
    return [tuple(group) for group in zip(*pieces)]


def gather(outputs: list[TensorOrTensors]) -> TensorOrTensors:
    """Concatenate micro-batch outputs along dim 0, keeping the tensor/tuple structure."""
    first = outputs[0]
    if len(outputs) == 1:
        return first  # one micro-batch: no copy
    if isinstance(first, Tensor):
        return torch.cat(outputs, dim=0)  # type: ignore[arg-type]
    return tuple(torch.cat([out[k] for out in outputs], dim=0) for k in range(len(first)))
