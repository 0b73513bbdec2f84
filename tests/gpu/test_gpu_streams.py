"""Continuous pipelines with every stage on a CUDA GPU: ``train_stream`` under PipeDream-2BW and
PipeMare follows its rule (the one-process simulation of ``tests/distributed/test_streams.py``, run on
the GPU), ``pipe.optimizer``'s state stays on the stages' device, and ``pipe.stream`` gives the
model's outputs on the driver's CPU, in order.

As in ``tests/gpu/test_gpu_train_step.py``, each scenario runs in a fresh interpreter with its own local
workers, started with device maps; without a GPU the tests are skipped, and ``RREFPIPE_TEST_GPU=cpu``
dry-runs them on the CPU.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tests.gpu import runner
from tests.gpu.scenarios import GPU

pytestmark = runner.MARKS

BALANCE = [3, 4]  # mlp([5, 8, 8, 6, 3]): 7 layers on 2 GPU stages
TRAINED_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}  # a few momentum steps of the GPU's micro-batch kernels


def scenario(call: str) -> None:
    runner.scenario("tests.gpu.test_gpu_streams", call)


@pytest.mark.parametrize("schedule", ["PipeDream-2BW", "PipeMare"])
def test_gpu_stages_stream_by_the_rule(schedule):
    scenario(f"streams_by_the_rule({schedule!r})")


def test_a_forward_stream_of_gpu_stages():
    scenario("forward_stream()")


# -- scenarios (run in a fresh interpreter) ---------------------------------------------------------------
def cross_entropy_on_device(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y.to(out.device))


def streams_by_the_rule(schedule: str) -> None:
    from rrefpipe import Pipe
    from tests.distributed.test_streams import batches, rule, simulate, stage_names
    from tests.layers import mlp

    model = mlp([5, 8, 8, 6, 3], seed=1)
    data = batches(5, 8, seed=2, last_rows=6)
    reference = copy.deepcopy(model).to(GPU)
    forward, backward = rule(schedule, 2, 4)
    on_gpu = [(x.to(GPU), y.to(GPU)) for x, y in data]
    expected, weights = simulate(reference, stage_names(reference, BALANCE), on_gpu,
                                 lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 4, forward, backward)
    with Pipe(model, chunks=4, balance=BALANCE, devices=[GPU] * 2, schedule=schedule, checkpoint="never") as pipe:
        assert [s.device for s in pipe.stages] == [GPU] * 2, pipe.stages
        optimizer = pipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
        losses = list(pipe.train_stream(data, cross_entropy_on_device, optimizer))
        state = pipe.state_dict()
        saved = optimizer.state_dict()["state"]
    assert all(loss.device.type == "cpu" for loss in losses)
    torch.testing.assert_close(torch.stack(losses), torch.tensor(expected), **TRAINED_TOLERANCE)
    for name, value in weights.items():
        torch.testing.assert_close(state[name], value.cpu(), **TRAINED_TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")
    assert all(v["momentum_buffer"].device.type == "cpu" for v in saved.values())  # state_dict() gives CPU


def forward_stream() -> None:
    from rrefpipe import Pipe
    from tests.layers import mlp

    model = mlp([5, 8, 8, 6, 3], seed=3)
    reference = copy.deepcopy(model).to(GPU).eval()
    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(rows, 5, generator=g) for rows in (8, 8, 8, 3)]
    with Pipe(model, chunks=4, balance=BALANCE, devices=[GPU] * 2) as pipe, torch.no_grad():
        pipe.eval()
        outputs = list(pipe.stream(inputs))
        for out, x in zip(outputs, inputs):
            assert out.device.type == "cpu"
            torch.testing.assert_close(out, reference(x.to(GPU)).cpu(), rtol=1e-4, atol=1e-5)
