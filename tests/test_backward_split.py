"""The split backward of the zero-bubble schedules (``rrefpipe.stage_side.backward_split``), in one process: the two
halves give exactly the gradients of one backward, the first computes no parameter gradient, and no node
that the first half ran runs again in the second (except the border nodes, asked there only for their
other outputs)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from rrefpipe import memory
from rrefpipe.stage_side import backward_split
from rrefpipe.stage_side.backward_split import input_gradients
from rrefpipe.stage_side.checkpoint import Recomputable

Forward = Callable[[nn.Module, list[Tensor]], list[Tensor]]


class Counted(torch.autograd.Function):
    """The identity, counting its backward runs."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        Counted.calls += 1
        return g


class MatMul(torch.autograd.Function):
    """``x @ w`` as a Python node, which computes both gradients whatever is asked."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors
        return g @ w.t(), x.t() @ g


class Tied(nn.Module):
    """One weight used twice on the input's path: its two uses must add up, neither counted twice."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.b = nn.Parameter(torch.randn(16))

    def forward(self, x: Tensor) -> Tensor:
        return (x @ self.w).relu() @ self.w.t() + self.b


class TwoInputs(nn.Module):
    """Two inputs and three outputs, one of which reaches a parameter and no input."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(16, 16), nn.Linear(16, 16)
        self.p = nn.Parameter(torch.randn(8, 16))
        self.unused = nn.Linear(16, 16)

    def forward(self, x: Tensor, y: Tensor) -> list[Tensor]:
        return [self.a(x) * self.c(y), self.p * 2, self.a(y).sum(0, keepdim=True)]


class Python(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.l = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return self.l(MatMul.apply(x, self.w))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))


MODELS: dict[str, tuple[Callable[[], nn.Module], int, Forward]] = {
    "mlp": (mlp, 1, lambda m, xs: [m(xs[0])]),
    "tied": (Tied, 1, lambda m, xs: [m(xs[0])]),
    "two_inputs": (TwoInputs, 2, lambda m, xs: m(*xs)),
    "python_node": (Python, 1, lambda m, xs: [m(xs[0])]),
}


def reference(model: nn.Module, outs: list[Tensor], grads: list[Tensor], xs: list[Tensor]) -> list[Tensor | None]:
    return list(torch.autograd.grad(outs, [*xs, *model.parameters()], grads, retain_graph=True, allow_unused=True))


@pytest.fixture(params=["private", "public"])
def engine(request, monkeypatch):
    """The engine call the split makes: torch's private one, or (where a torch lacks it) the public
    ``torch.autograd.grad`` and ``backward``."""
    if request.param == "public":
        monkeypatch.setattr(backward_split, "_engine", None)
    return request.param


@pytest.mark.parametrize("name", MODELS)
def test_the_two_halves_give_one_backwards_gradients(name, engine):
    torch.manual_seed(0)
    build, n_in, forward = MODELS[name]
    model = build()
    xs = [torch.randn(8, 16, requires_grad=True) for _ in range(n_in)]
    outs = forward(model, xs)
    grads = [torch.randn_like(o) for o in outs]
    expected = reference(model, outs, grads, xs)
    got, later = input_gradients(outs, grads, xs, list(model.parameters()))
    for g, e in zip(got, expected[:n_in]):
        torch.testing.assert_close(g, e)
    assert all(p.grad is None for p in model.parameters())  # the first half leaves the weights alone
    assert later.held_bytes > 0
    later.run()
    for p, e in zip(model.parameters(), expected[n_in:]):
        if e is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, e)
    assert all(x.grad is None for x in xs)  # nor does the second touch the inputs


def test_the_second_half_adds_to_what_the_parameters_hold(engine):
    """Micro-batches accumulate into ``.grad``, as one backward per micro-batch does."""
    torch.manual_seed(0)
    model = mlp()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    x = torch.randn(8, 16, requires_grad=True)
    out = model(x)
    g = torch.randn_like(out)
    expected = reference(model, [out], [g], [x])[1:]
    _, later = input_gradients([out], [g], [x], list(model.parameters()))
    later.run()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e + 1)


def test_a_node_of_the_first_half_does_not_run_again():
    """An identity node between two layers is on the inputs' path and no border node: once, in the first half."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    x = torch.randn(8, 16, requires_grad=True)
    out = model[2](Counted.apply(model[1](model[0](x))))
    Counted.calls = 0
    _, later = input_gradients([out], [torch.ones_like(out)], [x], list(model.parameters()))
    assert Counted.calls == 1
    later.run()
    assert Counted.calls == 1


def test_without_inputs_everything_is_the_second_half(engine):
    """The first stage: its input needs no gradient, so the first half has nothing to do."""
    torch.manual_seed(0)
    model = mlp()
    out = model(torch.randn(8, 16))
    g = torch.randn_like(out)
    expected = torch.autograd.grad(out, list(model.parameters()), g, retain_graph=True)
    got, later = input_gradients([out], [g], [], list(model.parameters()))
    assert got == [] and all(p.grad is None for p in model.parameters())
    later.run()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e)


def test_a_checkpointed_stage_recomputes_once_for_both_halves():
    torch.manual_seed(0)
    model = mlp()
    runs = []

    def forward(x: Tensor) -> Tensor:
        runs.append(1)
        return model(x)

    x = torch.randn(8, 16, requires_grad=True)
    out = Recomputable(forward, keep_unpacked=True).run(x)
    g = torch.randn_like(out)
    expected = reference(model, [model(x)], [g], [x])
    runs.clear()
    got, later = input_gradients([out], [g], [x], list(model.parameters()))
    later.run()
    assert len(runs) == 1
    torch.testing.assert_close(got[0], expected[0])
    for p, e in zip(model.parameters(), expected[1:]):
        torch.testing.assert_close(p.grad, e)


def test_the_kept_gradients_are_counted_as_kept_for_backward():
    memory.start_tracking()
    try:
        model = mlp()
        x = torch.randn(8, 16, requires_grad=True)
        out = model(x)
        before = memory.local_report().saved_now
        assert before
        _, later = input_gradients([out], [torch.ones_like(out)], [x], list(model.parameters()))
        memory.count_kept(later.kept())
        held = later.held_bytes
        assert held == 3 * 8 * 16 * 4  # the gradient reaching each of the three Linear layers
        assert memory.local_report().saved_now == before + held
        later.run()
        del later, out
        assert memory.local_report().saved_now == 0
    finally:
        memory.stop_tracking()

