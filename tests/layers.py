"""Layers used by the multi-process tests; importable on the stage workers (tests/ is on PYTHONPATH)."""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

SENTINEL = 1e9  # a micro-batch containing this value makes Boom raise


class Boom(nn.Module):
    """Identity, except that it raises ValueError on a micro-batch that contains SENTINEL."""

    def forward(self, x: Tensor) -> Tensor:
        if bool((x == SENTINEL).any()):
            raise ValueError(f"boom: sentinel in a batch of {x.size(0)}")
        return x


class ToDict(nn.Module):
    """Returns a non-tensor: the stage must reject it with a TypeError."""

    def forward(self, x: Tensor) -> dict:  # type: ignore[type-arg]
        return {"x": x}


class Split(nn.Module):
    """Tensor -> tuple of two tensors (a tuple boundary between stages)."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x[:, : x.size(1) // 2], x[:, x.size(1) // 2:] * 2


class Merge(nn.Module):
    def forward(self, xs: tuple[Tensor, Tensor]) -> Tensor:
        a, b = xs
        return torch.cat([a * b, a + b], dim=1)


def mlp(widths: list[int], seed: int = 0) -> nn.Sequential:
    """Linear+Tanh layers: every other child has parameters."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def make_tail(width: int = 8) -> nn.Sequential:
    """A stage factory (module-level, so workers can import it)."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3))


def make_head(width: int = 8) -> nn.Sequential:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(5, width), nn.Tanh())


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
