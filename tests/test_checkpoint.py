"""Activation checkpointing of a stage (in one process): recomputation and failures."""
import pytest
import torch
from torch import nn

import rrefpipe.checkpoint
from rrefpipe import is_checkpointing, is_recomputing  # exported where PyTorch's Pipe exported them
from rrefpipe.checkpoint import overwrites_input, run_checkpointed


def test_recomputation_gives_the_same_gradients_and_is_flagged():
    flags = []

    def fn(x):
        flags.append((is_checkpointing(), is_recomputing()))
        return torch.tanh(x) * x

    x = torch.randn(5, requires_grad=True)
    run_checkpointed(fn, x).sum().backward()
    y = x.detach().clone().requires_grad_()
    (torch.tanh(y) * y).sum().backward()
    torch.testing.assert_close(x.grad, y.grad)
    assert flags == [(True, False), (False, True)]
    assert (is_checkpointing(), is_recomputing()) == (False, False)
    fn(x)  # outside checkpointing
    assert flags[-1] == (False, False)


def test_a_failed_forward_leaves_later_graphs_of_the_thread_alone():
    """The exception stays alive (a stage keeps its failure for the driver): later autograd on the same
    thread must still save and use its own tensors."""
    def boom(x):
        raise ValueError("boom")

    kept = []
    with pytest.raises(ValueError, match="boom") as info:
        run_checkpointed(boom, torch.ones(3, requires_grad=True))
    kept.append(info.value)
    x = torch.arange(3.0, requires_grad=True)
    (x * x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())
    z = torch.ones(2, requires_grad=True)
    run_checkpointed(torch.exp, z).sum().backward()  # and checkpointing itself still works
    torch.testing.assert_close(z.grad, torch.exp(z.detach()))


def test_a_failed_forward_does_not_raise_through_checkpoint(monkeypatch):
    """The mechanism behind the test above, on any torch: checkpoint itself never sees the exception
    (torch 2.11 left its forward context open when one passed through it)."""
    passed_through = []
    real = rrefpipe.checkpoint.checkpoint

    def watching(function, *args, **kwargs):
        def watched(*a):
            try:
                return function(*a)
            except BaseException as exc:
                passed_through.append(exc)
                raise
        return real(watched, *args, **kwargs)

    monkeypatch.setattr(rrefpipe.checkpoint, "checkpoint", watching)

    def boom(x):
        raise KeyboardInterrupt  # not only Exception: whatever the forward raises

    with pytest.raises(KeyboardInterrupt):
        run_checkpointed(boom, torch.ones(3, requires_grad=True))
    assert passed_through == []


def test_a_failed_recomputation_raises_in_backward():
    calls = []

    def flaky(x):
        calls.append(is_recomputing())
        if is_recomputing():
            raise RuntimeError("changed its mind")
        return x * x  # saves x: backward must recompute

    x = torch.ones(2, requires_grad=True)
    out = run_checkpointed(flaky, x)
    with pytest.raises(RuntimeError, match="changed its mind"):
        out.sum().backward()
    assert calls == [False, True]


def test_overwrites_input_looks_through_nested_sequentials():
    assert overwrites_input(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(2, 2)))
    assert overwrites_input(nn.Sequential(nn.Sequential(nn.Dropout(inplace=True)), nn.ReLU()))
    assert not overwrites_input(nn.Sequential(nn.ReLU(), nn.ReLU(inplace=True)))
    assert not overwrites_input(nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True)))
    assert not overwrites_input(nn.Sequential())


@pytest.mark.parametrize("requires_grad", [True, False])
def test_a_copied_input_may_be_modified_in_place(requires_grad):
    """An in-place first layer changes the copy: the recomputation starts from the same input, and the
    gradients are those of the plain module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LeakyReLU(0.1, inplace=True), nn.Linear(4, 3))
    x = torch.randn(5, 4)
    h = x.clone().requires_grad_(requires_grad)
    out = run_checkpointed(model, h, copy_input=True)
    torch.testing.assert_close(h, x)  # untouched
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref_in = x.clone().requires_grad_(requires_grad)
    ref = model(ref_in * 1)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, want)
    if requires_grad:
        torch.testing.assert_close(h.grad, ref_in.grad)


def test_an_input_modified_in_place_is_refused_in_forward():
    """Without the copy, backward would fail on a version counter (over distributed autograd only as
    "python_error"): the forward says why at once."""
    def double(x):
        return x.mul_(2) + 1

    x = torch.randn(3, requires_grad=True) * 1
    with pytest.raises(RuntimeError, match="modified the stage's input in place"):
        run_checkpointed(double, x)
    y = torch.randn(3, requires_grad=True) * 1
    run_checkpointed(torch.exp, y).sum().backward()  # the thread's checkpointing still works
