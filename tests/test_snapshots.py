"""A stage's snapshot in two parts (its structure pickled without tensor data, and copies of its storages
that RPC sends beside it) and the holder's generations, in one process: ``rrefpipe.stage_side.snapshots``
(issue 52; the recoveries themselves: tests/distributed/test_recovery.py)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rrefpipe.stage_side import snapshots


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # one parameter, two places
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("window", torch.arange(12.0).view(3, 4)[1:])  # a view into a larger storage
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def _trained() -> tuple[Tied, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randint(0, 10, (8,))).sum().backward()
        opt.step()
    return model, opt


def test_a_split_object_joins_back_equal_with_its_ties_views_and_parameters():
    model, opt = _trained()
    part = snapshots.split((model, opt.state_dict(), torch.get_rng_state()))
    structure, storages = part
    assert len(structure) < 4096  # no tensor data in the pickle: it travels as the storages
    weights = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers()))
    assert sum(s.numel() for s in storages) >= weights - model.embed.weight.untyped_storage().nbytes()
    back, state, rng = snapshots.join(part)
    torch.testing.assert_close(back.state_dict(), model.state_dict(), rtol=0, atol=0)
    assert back.head.weight is back.embed.weight and isinstance(back.embed.weight, nn.Parameter)
    assert back.window.untyped_storage().nbytes() == 12 * 4 and back.window.storage_offset() == 4
    assert back.frozen.requires_grad is False and back.embed.weight.requires_grad is True
    torch.testing.assert_close(rng, torch.get_rng_state(), rtol=0, atol=0)
    again = copy.deepcopy(back)
    restored = torch.optim.AdamW(back.parameters(), lr=0.1)
    restored.load_state_dict(state)
    ids = torch.randint(0, 10, (8,))
    model.zero_grad(set_to_none=True)  # (gradients are not part of a snapshot: a step starts without them)
    for m, o in ((model, opt), (back, restored)):
        m(ids).sum().backward()
        o.step()
    torch.testing.assert_close(back.state_dict(), model.state_dict(), rtol=0, atol=0)
    assert not torch.equal(again.embed.weight, back.embed.weight)  # (the step did change them)


def test_the_storages_are_copies_the_stage_may_train_on():
    model, opt = _trained()
    before = copy.deepcopy(model.state_dict())
    part = snapshots.split(model)
    with torch.no_grad():
        model.embed.weight.add_(1.0)
        model.norm.running_mean.zero_()
    torch.testing.assert_close(snapshots.join(part).state_dict(), before, rtol=0, atol=0)


def test_the_holder_commits_a_generation_once_every_stage_arrived_and_a_recovery_gives_up_the_one_in_transit():
    pipe = "p-holder-test"
    try:
        def part(value: float) -> snapshots.Part:
            return snapshots.split(torch.full((3,), value))

        first = snapshots.committed(pipe, 1)
        snapshots.keep(pipe, 0, 1, 2, *part(1.0))
        assert not first.done()  # stage 1's part has not arrived
        snapshots.keep(pipe, 1, 1, 2, *part(1.5))
        assert first.wait() == 2 * snapshots.nbytes(part(1.0))
        snapshots.keep(pipe, 0, 2, 2, *part(2.0))  # generation 2 in transit: stage 1's never comes
        second = snapshots.committed(pipe, 2)
        assert snapshots.restoring(pipe) == 1  # a recovery goes back to the committed one ...
        with pytest.raises(RuntimeError, match="given up"):
            second.wait()
        snapshots.keep(pipe, 1, 2, 2, *part(2.5))  # ... and a late part of the one given up changes nothing
        held = snapshots._held[pipe]
        assert held.generation == 1 and held.arriving == {}
        torch.testing.assert_close(snapshots.join(held.committed[1]), torch.full((3,), 1.5))
        with pytest.raises(RuntimeError, match="given up"):
            snapshots.committed(pipe, 2).wait()
        snapshots.keep(pipe, 1, 3, 2, *part(3.5))
        snapshots.keep(pipe, 0, 3, 2, *part(3.0))
        assert snapshots.committed(pipe, 3).wait() > 0 and held.generation == 3
    finally:
        snapshots.drop(pipe)
    assert pipe not in snapshots._held
    snapshots.keep(pipe, 0, 4, 1, *part(4.0))  # a part that was on its way when the pipe closed
    assert pipe not in snapshots._held
