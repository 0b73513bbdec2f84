"""``StageWeights`` in one process: a batch's gradients are those of the version it ran on, whatever
updates happen between its forward and its backward; PipeMare's leaves see the updates; kept versions
and copies are exactly those needed."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

from rrefpipe.stage_side.versions import StageWeights

pytestmark = pytest.mark.timeout(30)


def stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def loss_on(module: nn.Module, leaves: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return functional_call(module, leaves, (x,)).square().mean()


def test_a_stashed_batch_gets_the_gradients_of_its_version_after_an_update_in_between():
    module = stage()
    reference = copy.deepcopy(module)
    weights = StageWeights(module)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    x0, x1 = torch.randn(3, 4), torch.randn(3, 4)
    first = weights.leaves(0)
    loss0 = loss_on(module, first, x0)  # batch 0's forward on W(0) ...
    second = weights.leaves(0)
    loss_on(module, second, x1).backward()
    weights.update(second, opt.step, keep=False)  # ... an update from another batch before its backward
    loss0.backward()
    reference(x0).square().mean().backward()  # W(0)'s own gradient
    for (name, p), leaf in zip(reference.named_parameters(), first.values()):
        torch.testing.assert_close(leaf.grad, p.grad, rtol=0, atol=0, msg=name)
    assert not torch.equal(module[0].weight, reference[0].weight), "the live weights moved on"


def test_an_update_equals_the_optimizer_on_the_plain_module():
    module, plain = stage(), stage()
    weights = StageWeights(module)
    opt, plain_opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (module, plain))
    x = torch.randn(5, 4)
    for _ in range(3):
        leaves = weights.leaves(weights.updates)
        loss_on(module, leaves, x).backward()
        weights.update(leaves, opt.step, keep=False)
        plain_opt.zero_grad()
        plain(x).square().mean().backward()
        plain_opt.step()
    for a, b in zip(module.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert a.grad is None  # dropped after the step


def test_kept_versions_serve_later_forwards_and_are_forgotten():
    module = stage()
    weights = StageWeights(module)
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    w0 = {k: v.clone() for k, v in weights.weights(0).items()}
    leaves = weights.leaves(0)
    loss_on(module, leaves, torch.randn(2, 4)).backward()
    weights.update(leaves, opt.step, keep=True)  # a later batch runs on W(0): 2BW's stash
    assert weights.buffers() == 2
    later = weights.leaves(0)
    for name, leaf in later.items():
        torch.testing.assert_close(leaf, w0[name], rtol=0, atol=0)
    assert not torch.equal(module[0].weight, w0["0.weight"])
    weights.forget_below(1)
    assert weights.buffers() == 1
    with pytest.raises(RuntimeError, match="version 0 is gone"):
        weights.leaves(0)


def test_pipemare_leaves_read_the_weights_current_when_backward_runs():
    module = stage()
    weights = StageWeights(module, stash=False)
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    x = torch.randn(3, 4)
    leaves = weights.leaves(0)
    loss = loss_on(module, leaves, x)
    other = weights.leaves(0)
    loss_on(module, other, torch.randn(3, 4)).backward()
    weights.update(other, opt.step, keep=False)  # in place: no copy
    loss.backward()
    # the reference: forward on W(0), backward through W(1), as overwriting the saved weights gives
    reference = stage()
    ref_leaves = {k: p.detach().clone().requires_grad_() for k, p in reference.named_parameters()}
    ref_loss = loss_on(reference, ref_leaves, x)
    for k, leaf in ref_leaves.items():
        leaf.data.copy_(dict(module.named_parameters())[k].detach())
    ref_loss.backward()
    for k in leaves:
        torch.testing.assert_close(leaves[k].grad, ref_leaves[k].grad, rtol=0, atol=0, msg=k)
    assert weights.buffers() == 1
