"""Skip connections across stage workers: transparency, every cut, direct routing, None skips."""
import itertools

import pytest
import torch
from torch import nn

from rrefpipe import Pipe
from tests.distributed.probes import check_transparent
from tests.layers import (NestedResidual, PopAdd, PopMaybe, StashInput, StashNone, nested_skip_models, residual_model,
                          skip_model)

pytestmark = pytest.mark.timeout(180)


def compositions(total: int, parts: int):
    """Every balance of ``total`` layers into ``parts`` non-empty stages."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_skippable_model_is_transparent(cluster, stages, checkpoint):
    model = residual_model(blocks=2)  # 10 layers
    balance = {1: [10], 2: [4, 6], 3: [3, 4, 3], 4: [2, 3, 3, 2]}[stages]
    x = torch.randn(6, 8, requires_grad=True)
    with Pipe(model, chunks=3, checkpoint=checkpoint, balance=balance, workers=cluster.names[:stages]) as pipe:
        check_transparent(pipe, model, x)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("name, balance", [("pop registered first", [2, 2]), ("pop registered first", [1, 2, 1]),
                                           ("repeated blocks", [2, 3]), ("repeated blocks", [1, 3, 1])])
def test_skips_kept_inside_blocks_are_transparent(cluster, name, balance, checkpoint):
    """Blocks that stash and pop a default name inside themselves (a pop registered first, repeated
    blocks, several on one stage) around an isolated skip crossing stages: the plain model's result."""
    model = nested_skip_models()[name]
    x = torch.randn(6, 6, requires_grad=True)
    with Pipe(model, chunks=3, checkpoint=checkpoint, balance=balance, workers=cluster.names[:len(balance)]) as pipe:
        reported = sum(len(info.stashes) + len(info.pops) for info in pipe.stages)
        assert reported == (2 if name == "repeated blocks" else 0)  # the crossing isolated skip only
        check_transparent(pipe, model, x)


def test_stages_from_factories_may_repeat_a_block_with_its_default_names(cluster):
    """Each stage's blocks keep their skip inside: no stage reports it, so none pairs across stages."""
    torch.manual_seed(0)
    model = nn.Sequential(*(NestedResidual(4) for _ in range(4)))
    x = torch.randn(4, 4, requires_grad=True)
    with Pipe.from_factories([lambda: model[:2], lambda: model[2:]], chunks=2,
                             workers=cluster.names[:2]) as pipe:
        assert all(not info.stashes and not info.pops for info in pipe.stages)
        check_transparent(pipe, model, x)


def test_skips_with_several_microbatches_per_message(cluster):
    """Skips travel on their own, each micro-batch's as soon as it is stashed; activations in pairs."""
    model = residual_model(blocks=2)
    x = torch.randn(10, 8, requires_grad=True)
    with Pipe(model, chunks=5, checkpoint="except_last", balance=[3, 4, 3], workers=cluster.names[:3],
              microbatches_per_message=2) as pipe:
        check_transparent(pipe, model, x)


def test_every_cut_of_a_skippable_model(cluster):
    """Wherever the cuts fall (between a stash and its pop, or not), the result is the plain model's."""
    model = skip_model()
    cuts = [b for parts in range(1, 5) for b in compositions(len(model), parts)]
    assert len(cuts) == 1 + 6 + 15 + 20
    for balance in cuts:
        x = torch.randn(4, 6, requires_grad=True)
        with Pipe(model, chunks=2, checkpoint="except_last", balance=balance,
                  workers=cluster.names[:len(balance)]) as pipe:
            check_transparent(pipe, model, x)


def test_skip_goes_straight_from_stash_stage_to_pop_stage(cluster):
    """A skip from stage 0 to stage 3: stages 1 and 2 receive the activations and nothing else."""
    torch.manual_seed(0)
    model = nn.Sequential(StashInput(), nn.Linear(32, 16), nn.Linear(16, 8), nn.Linear(8, 32), PopAdd())
    chunks, batch = 4, 8
    with Pipe(model, chunks=chunks, balance=[2, 1, 1, 1], workers=cluster.names) as pipe:
        for _ in range(2):
            x = torch.randn(batch, 32)
            with torch.no_grad():
                torch.testing.assert_close(pipe(x).local_value(), model(x))
        traffic = pipe.traffic()
    f32 = 4
    # two forwards: activation bytes are exactly the boundary tensors; the skip (batch x 32) only reaches stage 3
    assert traffic[1] == {"activation": (2 * chunks, 2 * batch * 16 * f32), "skip": (0, 0)}
    assert traffic[2] == {"activation": (2 * chunks, 2 * batch * 8 * f32), "skip": (0, 0)}
    assert traffic[3] == {"activation": (2 * chunks, 2 * batch * 32 * f32), "skip": (2 * chunks, 2 * batch * 32 * f32)}
    # the first stage gets each step's input whole, in one message, and splits it itself
    assert traffic[0] == {"activation": (2, 2 * batch * 32 * f32), "skip": (0, 0)}


def test_skip_output_matches_plain_model_across_four_stages(cluster):
    torch.manual_seed(1)
    model = nn.Sequential(StashInput(), nn.Linear(32, 16), nn.Linear(16, 8), nn.Linear(8, 32), PopAdd())
    x = torch.randn(8, 32, requires_grad=True)
    with Pipe(model, chunks=4, balance=[2, 1, 1, 1], workers=cluster.names, checkpoint="always") as pipe:
        check_transparent(pipe, model, x)


def test_stashed_none_costs_nothing(cluster):
    model = nn.Sequential(StashNone(), nn.Linear(4, 4), nn.Tanh(), PopMaybe())
    x = torch.randn(6, 4, requires_grad=True)
    with Pipe(model, chunks=3, balance=[1, 1, 2], workers=cluster.names[:3]) as pipe:
        check_transparent(pipe, model, x)
        assert all(t["skip"] == (0, 0) for t in pipe.traffic())


def test_skips_of_stages_built_from_factories_must_pair_up(cluster):
    """Nothing checks the whole model when each stage is built on its worker: the driver checks the
    stages' skip names before the first forward, and drops the stages it built."""
    from tests.distributed.probes import all_counts

    with pytest.raises(TypeError, match="'skip' is stashed by 2 stages 0 and 1"):
        Pipe.from_factories([StashInput, StashInput, PopAdd], workers=cluster.names[:3])
    with pytest.raises(TypeError, match="'skip' is popped by stage 1 but never stashed"):
        Pipe.from_factories([lambda: nn.Linear(3, 3), PopAdd], workers=cluster.names[:2])
    assert all(counts["stages"] == 0 for counts in all_counts(cluster.names).values())
