"""Layers written for PyTorch 2.x's Pipe (several inputs, tuples spread between layers) and 1.8's (one
tuple passed whole), with references that run them as those versions did, independently of rrefpipe."""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from rrefpipe.skip import pop, skippable, stash


class Masked(nn.Module):
    """2.x style: two arguments in, a pair out."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.fc = nn.Linear(a, b)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.fc(x)) * mask, mask


@skippable(stash=["h"])
class StashMasked(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> Any:
        yield stash("h", x)
        return x * 2, mask


@skippable(pop=["h"])
class PopMasked(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> Any:
        h = yield pop("h")
        return x + h, mask


class Head(nn.Module):
    """Two arguments in, one tensor out."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.fc = nn.Linear(a, b)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.fc(x + mask)


class Either(nn.Module):
    """A second argument that may be left out: 2.x spreads a pair into it, 1.8 passes the pair whole."""

    def forward(self, x: Any, y: torch.Tensor | None = None) -> Any:
        if y is None:  # the pair came whole
            a, b = x
            return a - b, b
        return x + y, y


class Pair(nn.Module):
    """1.8 style: one argument, a pair (PyTorch's test_input_pair)."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.fc_a = nn.Linear(a, b)
        self.fc_b = nn.Linear(a, b)

    def forward(self, a_and_b: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = a_and_b
        return self.fc_a(a), self.fc_b(b)


class Add(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


def model_2x(width: int = 4, seed: int = 0) -> nn.Sequential:
    """Several inputs (x, mask), pairs between layers, a skip across stages; 6 layers."""
    torch.manual_seed(seed)
    return nn.Sequential(Masked(width, width), StashMasked(), Masked(width, width), Either(), PopMasked(),
                         Head(width, 3))


def model_18(width: int = 4, seed: int = 0) -> nn.Sequential:
    """One tuple input passed whole, into layers that take it whole and one that requires two arguments."""
    torch.manual_seed(seed)
    return nn.Sequential(Pair(width, width), Either(), Pair(width, width), Add(), nn.Linear(width, 3))


def run_2x(model: nn.Sequential, *inputs: Any) -> Any:
    """As PyTorch 2.x's PipeSequential: the inputs spread into the first layer, every tuple spread; a nested
    ``nn.Sequential`` flattened into its layers, as 2.x assembled its partitions."""
    value: Any = inputs
    layers = [inner for layer in model for inner in (layer if isinstance(layer, nn.Sequential) else [layer])]
    for layer in layers:
        value = layer(*value) if isinstance(value, tuple) else layer(value)
    return value


def run_18(model: nn.Sequential, value: Any) -> Any:
    """As PyTorch 1.8 (an nn.Sequential), except that a layer requiring two arguments gets a pair spread."""
    for layer in model:
        value = layer(*value) if isinstance(layer, (Add, Masked, Head, StashMasked, PopMasked)) else layer(value)
    return value


def reference(model: nn.Sequential, style: str, inputs: tuple[torch.Tensor, ...]
              ) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """The plain model's output, input gradients and parameter gradients for the loss of :func:`loss_of`."""
    plain = copy.deepcopy(model)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = run_2x(plain, *leaves) if style == "2x" else run_18(plain, tuple(leaves))
    loss_of(out).backward()
    return out.detach(), [t.grad for t in leaves], {n: p.grad for n, p in plain.named_parameters()}


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()


class Twin(nn.Module):
    """One tensor in, a pair out."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.fc = nn.Linear(a, b)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x), torch.sigmoid(x)


class SumArgs(nn.Module):
    """``*args``: 2.x spreads a pair into it; its signature cannot say so."""

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return torch.stack(xs).sum(0)


def model_2x_one_input(width: int = 4, seed: int = 0) -> nn.Sequential:
    """A 2.x model called with one tensor whose layers take ``*args`` or an optional argument: it needs
    ``call_style='2.x'``; 6 layers, a nested ``nn.Sequential`` among them (2.x flattened it)."""
    torch.manual_seed(seed)
    return nn.Sequential(Twin(width, width), Either(), nn.Sequential(SumArgs(), Twin(width, width)), Either(),
                         SumArgs(), nn.Linear(width, 3))
