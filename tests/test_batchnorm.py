import copy

import pytest
import torch
from torch import nn

from rrefpipe.batchnorm import DeferredBatchNorm
from rrefpipe.stage_side.checkpoint import run_checkpointed


def _pair(momentum):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU())
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(plain), chunks=4)
    assert isinstance(deferred[1], DeferredBatchNorm)
    return plain, deferred


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats_equal_plain_batchnorm_on_whole_minibatch(momentum):
    plain, deferred = _pair(momentum)
    for step in range(3):
        x = torch.randn(8, 3, 6, 6) * (step + 1) + step
        plain(x)
        for chunk in x.chunk(4):
            deferred(chunk)
        torch.testing.assert_close(deferred[1].running_mean, plain[1].running_mean)
        torch.testing.assert_close(deferred[1].running_var, plain[1].running_var)
        assert int(deferred[1].num_batches_tracked) == int(plain[1].num_batches_tracked) == step + 1


def test_microbatches_are_normalised_with_their_own_statistics_and_eval_uses_running_ones():
    plain, deferred = _pair(0.1)
    x = torch.randn(8, 3, 6, 6)
    for chunk in x.chunk(4):
        torch.testing.assert_close(deferred(chunk), copy.deepcopy(plain)(chunk))
    plain(x)
    plain.eval()
    deferred.eval()
    torch.testing.assert_close(deferred(x), plain(x))


def test_recomputation_does_not_count_twice():
    plain, deferred = _pair(0.1)
    x = torch.randn(8, 3, 6, 6, requires_grad=True)
    for chunk in x.chunk(4):
        run_checkpointed(deferred, chunk).sum().backward()  # recomputes the forward under the hood
    plain(x)
    torch.testing.assert_close(deferred[1].running_mean, plain[1].running_mean)
