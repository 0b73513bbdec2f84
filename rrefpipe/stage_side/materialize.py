"""A stage built from a module on the meta device: its tensors made on the stage's device and read
from a :class:`~rrefpipe.weights.WeightSource`, on the stage's worker (``Pipe(model, init=...)``).

The driver sends the stage as a skeleton (its meta tensors pickle as shapes and dtypes) with the names
to read: each of the stage's state-dict keys, the model's key for it and the key it is stored under.
Tensors the stage holds twice (a parameter tied within the stage, or the train- and eval-mode graphs of
a captured stage sharing theirs) stay one tensor.
"""
from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..weights import WeightSource

__all__ = ["StageInit", "materialize", "meta_tensors"]


@dataclass
class StageInit:
    """How a worker makes stage ``j``'s tensors: ``names`` maps each stage key to (model key, stored key)."""

    skeleton: bytes
    names: dict[str, tuple[str, str]]
    source: WeightSource


def meta_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Every parameter and buffer of ``module`` on the meta device, by name (aliases included)."""
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if tensor.is_meta:
            yield name, tensor


def _modules(module: nn.Module) -> Iterator[nn.Module]:
    for m in module.modules():
        yield m
        hidden = m.__dict__.get("_eval_graph")  # a captured stage's eval-mode graph shares its tensors
        if isinstance(hidden, nn.Module):
            yield from hidden.modules()


def _make_real(module: nn.Module, device: torch.device) -> None:
    """Replace every meta tensor by an uninitialised one on ``device``; one tensor stays one."""
    made: dict[int, Tensor] = {}
    for m in _modules(module):
        for slots in (m._parameters, m._buffers):
            for name, t in slots.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    empty = torch.empty_like(t, device=device)
                    made[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
                slots[name] = made[id(t)]  # type: ignore[assignment]  # (a buffer slot takes a tensor)


def materialize(init: StageInit, device: torch.device, where: str) -> nn.Sequential:
    """The stage, its tensors on ``device`` and filled from ``init.source``. ``where`` ("stage 1 on worker
    'w1'") starts every error: a key the source lacks or holds with another shape or dtype is named."""
    module: nn.Sequential = pickle.loads(init.skeleton)
    state = module.state_dict(keep_vars=True)
    like = {model: state[stage_key] for stage_key, (model, _) in init.names.items()}
    stored = {model: key for model, key in init.names.values()}
    values = init.source.read(stored, like)
    problems = []
    for model, wanted in like.items():
        got = values.get(model)
        if not isinstance(got, Tensor):
            problems.append(f"{model!r} is missing" if got is None else f"{model!r} is a {type(got).__name__}")
        elif tuple(got.shape) != tuple(wanted.shape):
            problems.append(f"{model!r} has shape {list(got.shape)} in the source, {list(wanted.shape)} in the model")
        elif got.dtype != wanted.dtype:
            problems.append(f"{model!r} is {got.dtype} in the source, {wanted.dtype} in the model")
    if problems:
        raise ValueError(f"{where}: {init.source.describe()} does not fit the model: " + "; ".join(problems[:5])
                         + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    _make_real(module, device)
    state = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for stage_key, (model, _) in init.names.items():
            state[stage_key].copy_(values[model])
    left = [name for name, _ in meta_tensors(module)]
    if left:  # (the driver checked: only a source that skipped a key gets here)
        raise ValueError(f"{where}: {left[:5]} stayed on the meta device: nothing initialised them")
    return module

