"""Activation checkpointing of a stage (in one process): recomputation, ahead of backward or in it, and failures."""
import gc
import threading
import types
import weakref

import pytest
import torch
from torch import nn

from rrefpipe import is_checkpointing, is_recomputing  # exported where PyTorch's Pipe exported them
from rrefpipe.stage_side import checkpoint
from rrefpipe.stage_side.checkpoint import Recomputable, overwrites_input, random_turns, run_checkpointed


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
    with pytest.raises(RuntimeError, match="input or a skip tensor it popped in place"):
        run_checkpointed(double, x)
    y = torch.randn(3, requires_grad=True) * 1
    run_checkpointed(torch.exp, y).sum().backward()  # the thread's checkpointing still works


def _counted(fn):
    calls = []

    def run(x):
        calls.append(is_recomputing())
        return fn(x)

    return run, calls


def test_recomputed_ahead_then_used_by_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fn, calls = _counted(model)
    x = torch.randn(3, 4, requires_grad=True)
    run = Recomputable(fn)
    out = run.run(x)
    run.recompute()
    run.recompute()  # once is enough
    assert calls == [False, True]
    out.square().sum().backward()
    assert calls == [False, True]  # backward found the activations ready
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    y = x.detach().clone().requires_grad_()
    model(y).square().sum().backward()
    torch.testing.assert_close(x.grad, y.grad)
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad)


def test_recomputing_ahead_while_backward_needs_it_runs_the_forward_once():
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(64, 64), nn.Tanh())])
    for _ in range(20):
        fn, calls = _counted(model)
        x = torch.randn(32, 64, requires_grad=True)
        run = Recomputable(fn)
        out = run.run(x)
        ahead = threading.Thread(target=run.recompute)
        ahead.start()
        out.sum().backward()
        ahead.join()
        assert calls == [False, True]


def test_recomputation_ahead_replays_the_random_draws_and_leaves_the_generator_alone():
    """Dropout draws the same mask again, on whichever thread recomputes, and the caller's generator
    goes on as if nothing had been recomputed."""
    model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.Linear(32, 3))
    x = torch.randn(8, 6)
    run = Recomputable(model)
    torch.manual_seed(3)
    out = run.run(x)
    after = torch.rand(5)
    thread = threading.Thread(target=run.recompute)
    thread.start()
    thread.join()
    later = torch.rand(5)
    torch.manual_seed(3)
    model(x)
    torch.testing.assert_close(torch.rand(5), after)  # the caller's draws go on as without checkpointing
    torch.testing.assert_close(torch.rand(5), later)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.manual_seed(3)
    ref = model(x)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_failed_recomputation_raises_in_backward(ahead):
    calls = []

    def flaky(x):
        calls.append(is_recomputing())
        if is_recomputing():
            raise RuntimeError("changed its mind")
        return x * x  # saves x: backward must recompute

    x = torch.ones(2, requires_grad=True)
    told: list[BaseException] = []
    run = Recomputable(flaky, on_failure=told.append)
    out = run.run(x)
    if ahead:
        run.recompute()  # keeps the error for backward, on backward's thread
    with pytest.raises(RuntimeError, match="changed its mind"):
        out.sum().backward()
    assert calls == [False, True]  # not tried again
    assert [str(e) for e in told] == ["changed its mind"]  # told once, for the driver to ask


@pytest.mark.parametrize("again", [lambda x: x.exp().exp(), lambda x: x.double().exp(), lambda x: x[:1].exp()],
                         ids=["count", "dtype", "shape"])
def test_a_recomputation_that_saves_other_tensors_is_refused(again):
    def changing(x):
        return again(x) if is_recomputing() else x.exp()

    x = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="recomputed forward saved .* first saved 1, or of other shapes, dtypes"):
        run_checkpointed(changing, x).sum().backward()


def test_the_recomputed_activations_go_with_the_graph():
    """Reference counting alone frees them: an output saved by its own node (exp) must not hold the
    graph it belongs to, a cycle that only the process's end would break."""
    recomputed = []

    def fn(x):
        mid = x.exp()  # saves its output
        if is_recomputing():
            recomputed.append(weakref.ref(mid))
        return mid.sin()

    gc.disable()
    try:
        x = torch.randn(100, requires_grad=True)
        run = Recomputable(fn)
        kept = weakref.ref(run)
        out = run.run(x)
        del run
        run_ahead = kept()
        run_ahead.recompute()
        del run_ahead
        out.sum().backward()
        del out
        assert recomputed and all(r() is None for r in recomputed)
        assert kept() is None
    finally:
        gc.enable()


def test_a_recomputation_holds_the_process_lock_on_random_numbers():
    """Forwards, seeding and every recomputation (of any pipe's stage, on any thread) take turns on it."""
    held = []

    def fn(x):
        if is_recomputing():
            held.append(random_turns._is_owned())
        return x.exp()

    x = torch.ones(2, requires_grad=True)
    run = Recomputable(fn)
    out = run.run(x)
    thread = threading.Thread(target=run.recompute)
    thread.start()
    thread.join()
    out.sum().backward()
    assert held == [True]


def test_released_activations_come_back_for_backward():
    fn, calls = _counted(torch.exp)
    x = torch.randn(3, requires_grad=True)
    run = Recomputable(fn)
    out = run.run(x)
    run.recompute()
    run.release()
    assert all(slot.tensor is None for slot in run._slots)
    run.recompute()  # a request still queued ahead when the next forward released them: not wanted now
    assert all(slot.tensor is None for slot in run._slots)
    out.sum().backward()
    assert calls == [False, True, True]
    torch.testing.assert_close(x.grad, x.detach().exp())


def test_gradients_inside_a_checkpointed_forward_are_refused_clearly():
    def penalised(x):
        y = x.exp()
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y + g

    x = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="computed gradients inside its own forward"):
        run_checkpointed(penalised, x)


def test_accelerator_random_state_is_asked_of_torch_only_for_accelerator_tensors(monkeypatch):
    """A CPU stage skips torch's ``get_device_states`` (a pytree walk per micro-batch, which finds nothing
    there); a tensor on an accelerator still gets it, so a GPU stage replays its random state."""
    asked = []
    monkeypatch.setattr(checkpoint, "get_device_states", lambda *ts: asked.append(ts) or ([0], ["state"]))
    assert checkpoint._accelerator_rng_states((torch.ones(1), torch.ones(1, device="meta"))) == ([], [])
    assert asked == []
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert checkpoint._accelerator_rng_states((torch.ones(1), on_gpu)) == ([0], ["state"])  # type: ignore[arg-type]
    assert len(asked) == 1
