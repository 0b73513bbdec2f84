"""Deferred batch norm on stage workers: running statistics equal plain BatchNorm on the whole batch."""
import copy

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch import nn

from rrefpipe import Pipe

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("bn_stage", [0, 1])
def test_running_stats_after_training_steps(cluster, checkpoint, momentum, bn_stage):
    """(A BatchNorm *after* a deferred one sees micro-batch-normalised inputs, so its statistics are
    not the plain model's by design: one BatchNorm per model here, on either stage.)"""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3 if bn_stage == 0 else 4, momentum=momentum)
    layers = [bn, nn.Conv2d(3, 4, 3), nn.ReLU()] if bn_stage == 0 else [nn.Conv2d(3, 4, 3), nn.ReLU(), bn]
    model = nn.Sequential(*layers, nn.Conv2d(4, 4, 3), nn.Tanh(), nn.Flatten())
    plain = copy.deepcopy(model)
    with Pipe(model, chunks=4, checkpoint=checkpoint, deferred_batch_norm=True, balance=[3, 3],
              workers=cluster.names[:2]) as pipe:
        for step in range(3):
            x = torch.randn(8, 3, 8, 8) * (1 + step)
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [pipe(x).local_value().sum()])
            plain(x)
        state = pipe.state_dict()
        pipe.eval()
        plain.eval()
        x = torch.randn(4, 3, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value(), plain(x))  # eval uses the running statistics
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_plain_batch_norm_counts_each_micro_batch_once_when_recomputed(cluster, checkpoint, momentum):
    """Without deferred batch norm, BatchNorm updates its running statistics per micro-batch, as on
    micro-batches in one process; recomputation had counted the micro-batch again (num_batches_tracked
    7 for 'except_last', 8 for 'always' after one step of 4 micro-batches, and a second momentum step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=momentum), nn.ReLU(), nn.Linear(8, 8),
                          nn.Sequential(nn.BatchNorm1d(8, momentum=momentum)))
    plain = copy.deepcopy(model)
    with Pipe(copy.deepcopy(model), chunks=4, checkpoint=checkpoint, balance=[2, 3],
              workers=cluster.names[:2]) as pipe:
        for step in range(2):
            x = torch.randn(16, 4) * (1 + step)
            with dist_autograd.context() as ctx:
                pipe.backward(ctx, pipe(x).local_value().sum())
            for micro_batch in x.chunk(4):
                plain(micro_batch)
        state = pipe.state_dict()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value)


def test_stages_built_by_factories_defer_their_batch_norms_on_the_workers(cluster):
    """Pipe.from_factories(..., deferred_batch_norm=True): each worker converts the BatchNorm its factory
    built, and the running statistics are those of plain BatchNorm over whole mini-batches."""
    def first():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())

    def second():
        torch.manual_seed(1)
        return nn.Sequential(nn.Flatten(), nn.Linear(4 * 6 * 6, 5))

    plain = nn.Sequential(*first(), *second())
    with Pipe.from_factories([first, second], chunks=4, deferred_batch_norm=True, workers=cluster.names[:2]) as pipe:
        assert pipe.stages[0].layers[1].split(": ")[1] == "DeferredBatchNorm"
        for step in range(2):
            x = torch.randn(8, 3, 8, 8) * (1 + step)
            with dist_autograd.context() as ctx:
                pipe.backward(ctx, pipe(x).local_value().sum())
            plain(x)
        state = pipe.state_dict()
    assert state["1.num_batches_tracked"].item() == 2
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=lambda m: f"{key}: {m}")
