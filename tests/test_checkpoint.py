"""Activation checkpointing of a stage (in one process): recomputation and failures."""
import pytest
import torch

import rrefpipe.checkpoint
from rrefpipe import is_checkpointing, is_recomputing  # exported where PyTorch's Pipe exported them
from rrefpipe.checkpoint import run_checkpointed


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
