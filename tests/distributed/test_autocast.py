"""``torch.autocast`` around ``pipe(x)`` reaches the stage workers, as it reaches layers in one process."""
import copy

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch import nn

from rrefpipe import Pipe
from tests.distributed.probes import stage_gradients
from tests.layers import AutocastProbe

pytestmark = pytest.mark.timeout(120)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_stages_compute_in_the_callers_autocast_dtype(cluster, checkpoint):
    """Outputs and gradients equal the plain model's run under the same autocast, micro-batch by
    micro-batch (bfloat16 rounds differently with the batch size); recomputation runs in bfloat16 too."""
    plain = model()
    x = torch.randn(6, 8)
    parts = []
    for part in x.chunk(2):  # a region per micro-batch, as on a stage: a bfloat16 copy of each weight per region
        with torch.autocast("cpu", dtype=torch.bfloat16):
            parts.append(plain(part))
    expected = torch.cat(parts)
    expected.float().pow(2).sum().backward()
    with Pipe(copy.deepcopy(plain), chunks=2, balance=[2, 3], checkpoint=checkpoint,
              workers=cluster.names[:2]) as pipe:
        with dist_autograd.context() as ctx:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = pipe(x).local_value()
            dist_autograd.backward(ctx, [out.float().pow(2).sum()])
            grads = stage_gradients(pipe, ctx)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, expected)
        for name, p in plain.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=lambda m: f"{name}: {m}")
        with torch.no_grad():  # the region ended with the caller's: the next forward is float32 again
            torch.testing.assert_close(pipe(x).local_value(), plain(x))


def test_the_regions_dtype_cache_and_a_disabled_one_inside_are_carried(cluster):
    plain = nn.Sequential(*model(), AutocastProbe())
    x = torch.randn(4, 8)
    with Pipe(copy.deepcopy(plain), chunks=2, balance=[3, 3], workers=cluster.names[:2]) as pipe, torch.no_grad():
        for cache in (True, False):
            with torch.autocast("cpu", dtype=torch.float16, cache_enabled=cache):
                out = pipe(x).local_value()
                assert out.dtype == torch.float16
                torch.testing.assert_close(out, torch.cat([plain(part) for part in x.chunk(2)]))
                with torch.autocast("cpu", enabled=False):
                    torch.testing.assert_close(pipe(x).local_value(), plain(x))
