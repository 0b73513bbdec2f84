"""Random numbers on stage workers: seeded from the driver's seed, different on every stage, and the
same in a checkpointed micro-batch's recomputation as in its forward."""
import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

from rrefpipe import Pipe
from tests.layers import AppendRandom, manual_seed

pytestmark = pytest.mark.timeout(120)


def stage_draws(cluster, seed: int | None) -> torch.Tensor:
    """One column of torch.rand per stage (3 stages), drawn on the workers after torch.manual_seed(seed)
    (None: the driver's generator as it is)."""
    if seed is not None:
        torch.manual_seed(seed)
    model = nn.Sequential(AppendRandom(), AppendRandom(), AppendRandom())
    with Pipe(model, chunks=2, balance=[1, 1, 1], workers=cluster.names[:3]) as pipe:
        with torch.no_grad():
            return pipe(torch.zeros(6, 1)).local_value()[:, 1:]


def test_the_drivers_seed_makes_the_workers_draws_repeat(cluster):
    first = stage_draws(cluster, seed=5)
    assert torch.equal(stage_draws(cluster, seed=5), first)  # the workers' generators moved on in between
    assert not torch.equal(stage_draws(cluster, seed=6), first)


def test_building_a_pipe_draws_nothing_from_the_drivers_generator(cluster):
    """The script's own random numbers stay those of the plain model; a pipe built after more draws
    gets other seeds than one built right after torch.manual_seed."""
    torch.manual_seed(3)
    first = stage_draws(cluster, seed=None)
    after_build = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(4), after_build)  # as if no pipe had been built
    assert not torch.equal(stage_draws(cluster, seed=None), first)  # built after four more draws


def test_stages_draw_different_numbers_even_from_equally_seeded_workers(cluster):
    """Under torchrun every rank runs the script's torch.manual_seed(0): the workers start alike."""
    for name in cluster.names[:3]:
        rpc.rpc_sync(name, manual_seed, args=(0,))
    draws = stage_draws(cluster, seed=0)
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert not torch.equal(draws[:, a], draws[:, b]), (a, b)


def test_factories_build_the_same_weights_from_the_same_seed(cluster):
    def weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        with Pipe.from_factories([lambda: nn.Linear(4, 4), lambda: nn.Linear(4, 2)],
                                 workers=cluster.names[:2]) as pipe:
            return pipe.state_dict()

    first = weights(1)
    again = weights(1)
    assert first.keys() == again.keys()
    for key, value in first.items():
        torch.testing.assert_close(again[key], value, rtol=0, atol=0)
    assert not torch.equal(weights(2)["0.weight"], first["0.weight"])


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_recomputation_drops_what_the_forward_dropped(cluster, checkpoint):
    """out = x * mask0 * mask1 * 4, so d(sum(out * w))/dx = 4 w where out != 0: a recomputation that drew
    other masks would give other gradients."""
    torch.manual_seed(7)
    x = torch.rand(16, 32) + 0.5  # no zeros: out == 0 exactly where a mask dropped
    w = torch.randn(16, 32)
    x.requires_grad_()
    with Pipe(nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5)), chunks=4, checkpoint=checkpoint, balance=[1, 1],
              workers=cluster.names[:2]) as pipe:
        with dist_autograd.context() as ctx:
            out = pipe(x).local_value()
            dist_autograd.backward(ctx, [(out * w).sum()])
            grad = dist_autograd.get_gradients(ctx)[x]
    kept = out != 0
    assert 0.15 < kept.float().mean() < 0.35  # both masks at work, independently
    torch.testing.assert_close(out, x.detach() * kept * 4)
    torch.testing.assert_close(grad, w * kept * 4)


def test_two_pipes_on_the_same_workers_replay_their_own_draws(cluster):
    """D(G(x)), dropout on every stage of both pipes, both pipes on the same two workers, one backward:
    each stage's recomputation (ahead of backward on one thread, or in it on another) draws its own
    forward's masks, whatever the other pipe's stage on that worker does meanwhile."""
    torch.manual_seed(11)
    x = torch.rand(16, 32) + 0.5
    w = torch.randn(16, 32)
    x.requires_grad_()

    def dropouts() -> Pipe:
        return Pipe(nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5)), chunks=4, checkpoint="always",
                    balance=[1, 1], workers=cluster.names[:2])

    with dropouts() as g, dropouts() as d:
        with dist_autograd.context() as ctx:
            out = d(g(x).local_value()).local_value()
            dist_autograd.backward(ctx, [(out * w).sum()])
            grad = dist_autograd.get_gradients(ctx)[x]
    kept = out != 0
    assert 0.02 < kept.float().mean() < 0.12  # four masks at work
    torch.testing.assert_close(out, x.detach() * kept * 16)
    torch.testing.assert_close(grad, w * kept * 16)
