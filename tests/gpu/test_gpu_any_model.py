"""A captured model (``Pipe(model, split_points=..., sample=x)``) with its stages on a CUDA GPU: the GPT-style
model, whose forward names a device (``torch.arange(T, device=idx.device)``, written into the graph as the
CPU by ``torch.export``) and whose head is tied to the embedding across stages, trains as the plain model
on the GPU: the output, the losses, and the parameters after SGD steps with momentum (Adam would blow up
the rounding noise of gradients that are zero in exact arithmetic, such as the attention key bias's),
through ``pipe.backward`` and through ``train_step`` under 1F1B.

Each scenario runs in a fresh interpreter with its own local workers (``tests/gpu/runner.py``); skipped
without a GPU, dry-run on the CPU with ``RREFPIPE_TEST_GPU=cpu``.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.optim import DistributedOptimizer

from tests.gpu import runner
from tests.gpu.scenarios import GPU, TOLERANCE

pytestmark = runner.MARKS
TRAINED_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}


@pytest.mark.parametrize("path", ["backward", "train_step"])
def test_captured_gpt_on_gpu_stages_trains_as_the_plain_model(path):
    runner.scenario("tests.gpu.test_gpu_any_model", f"trains_as_the_plain_model({path!r})")


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.to(logits.device).flatten())


def trains_as_the_plain_model(path: str) -> None:
    from examples.tiny_gpt import GPT
    from rrefpipe import Pipe

    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, heads=2, layers=4, context=8)
    reference = copy.deepcopy(model).to(GPU)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (8, 8), generator=g), torch.randint(0, 64, (8, 8), generator=g))
               for _ in range(3)]
    with Pipe(copy.deepcopy(model), chunks=4, split_points=["blocks.1", "blocks.3"], sample=batches[0][0],
              devices=[GPU] * 3, schedule="1F1B") as pipe:
        assert [s.device for s in pipe.stages] == [GPU] * 3, pipe.stages
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1, momentum=0.9)
        plain_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        for x, y in batches:
            with dist_autograd.context() as ctx:
                if path == "backward":
                    out = pipe(x).local_value()
                    torch.testing.assert_close(out, reference(x.to(GPU)).detach().cpu(), **TOLERANCE)
                    loss = lm_loss(out, y)
                    pipe.backward(ctx, loss)
                else:
                    loss = pipe.train_step(ctx, x, y, lm_loss)
                opt.step(ctx)
            plain_opt.zero_grad()
            plain_loss = lm_loss(reference(x.to(GPU)), y)
            plain_loss.backward()
            plain_opt.step()
            torch.testing.assert_close(loss.detach().cpu(), plain_loss.detach().cpu(), **TOLERANCE)
        trained = pipe.state_dict()
        assert trained.keys() == reference.state_dict().keys()
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(trained[key], value.cpu(), **TRAINED_TOLERANCE, msg=lambda m, k=key: f"{k}: {m}")
        pipe.eval()
        reference.eval()
        with torch.no_grad():
            torch.testing.assert_close(pipe(batches[0][0]).local_value(), reference(batches[0][0].to(GPU)).cpu(),
                                       **TOLERANCE)
