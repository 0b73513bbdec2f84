"""Splitting a mini-batch into micro-batches along dim 0 and gathering the outputs back, in order."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Union

import torch
from torch import Tensor

__all__ = ["Tensors", "TensorOrTensors", "as_tensors", "call_inputs", "check", "scatter", "gather", "apply", "detached"]

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


def call_inputs(inputs: tuple[object, ...]) -> tuple[TensorOrTensors, bool]:
    """The value of a call ``pipe(*inputs)`` and whether it is 2.x style (spread, see :mod:`rrefpipe.calling`).

    One input is the value as given (checked where it is split). Several must all be tensors: PyTorch
    2.x also took other values, copied whole into every micro-batch, and ``NoChunk`` tensors; neither
    is carried over."""
    if not inputs:
        raise TypeError("Pipe needs an input: pipe(x), pipe((a, b)) (1.8 style) or pipe(a, b) (2.x style)")
    if len(inputs) == 1:
        return inputs[0], False  # type: ignore[return-value]  # (checked where it is split)
    for k, value in enumerate(inputs):
        if not isinstance(value, Tensor):
            raise TypeError(f"Pipe input {k} of {len(inputs)} ({type(value).__name__}) is not a Tensor: every "
                            "input must be one, split along dim 0 into micro-batches. PyTorch 2.x's non-tensor inputs "
                            "and NoChunk (copied whole into every micro-batch) are not carried over: give such values "
                            "to the layers when you build them, or expand a tensor to the batch size")
    return tuple(inputs), True  # type: ignore[arg-type]  # (all tensors, checked above)


def apply(fn: Callable[[Tensor], Tensor], value: TensorOrTensors) -> TensorOrTensors:
    """Apply ``fn`` to a tensor or to each tensor of a tuple, keeping the structure."""
    if isinstance(value, Tensor):
        return fn(value)
    return tuple(fn(t) for t in value)


def detached(t: Tensor) -> Tensor:
    """``t`` cut from its graph, as a leaf that still asks for a gradient if ``t`` did: the start of a piece
    of a graph run on its own (a recomputation, a layer profiled alone, a stash between such layers)."""
    return t.detach().requires_grad_(t.requires_grad)


def scatter(value: TensorOrTensors, chunks: int, where: str = "Pipe input") -> list[TensorOrTensors]:
    """Split along dim 0 into at most ``chunks`` micro-batches (``torch.chunk`` semantics).

    A batch smaller than ``chunks`` gives one micro-batch per sample. Tuple elements must share
    their batch size. ``where`` names the value in errors.
    """
    check(value, where)
    tensors = as_tensors(value)
    sizes = set()
    for t in tensors:
        if t.dim() == 0:
            raise ValueError(f"{where} tensors need a batch dimension, got a 0-dim tensor")
        sizes.add(t.size(0))
    if len(sizes) != 1:
        raise ValueError(f"all {where} tensors must have the same batch size (dim 0), got sizes {sorted(sizes)}")
    if 0 in sizes:
        raise ValueError(f"{where} has batch size 0: nothing to split into micro-batches")
    pieces = [t.chunk(chunks) for t in tensors]
    if isinstance(value, Tensor):
        return list(pieces[0])
    return [tuple(group) for group in zip(*pieces)]


def rows(parts: Sequence[TensorOrTensors]) -> tuple[int, ...]:
    """The batch size (dim 0) of each of ``parts`` (micro-batches, as ``scatter`` gives them)."""
    return tuple(as_tensors(part)[0].size(0) for part in parts)


def gather(outputs: list[TensorOrTensors]) -> TensorOrTensors:
    """Concatenate micro-batch outputs along dim 0, keeping the tensor/tuple structure."""
    first = outputs[0]
    if len(outputs) == 1:
        return first  # one micro-batch: no copy
    if isinstance(first, Tensor):
        return torch.cat(outputs, dim=0)  # type: ignore[arg-type]
    return tuple(torch.cat([out[k] for out in outputs], dim=0) for k in range(len(first)))
