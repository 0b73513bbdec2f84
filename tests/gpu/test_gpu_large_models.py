"""Large models and recovery with every stage on a CUDA GPU: a model on the meta device is materialised
on the stages' GPU from a safetensors file (``Pipe(init=)``); ``pipe.save`` from GPU stages and
``pipe.load`` into another split restore weights and optimizer state there; a stage worker killed
during ``train_stream`` with a spare (``spares=1``) is rebuilt on the spare's GPU and the run ends as
the plain model's on the GPU.

As in ``tests/gpu/test_gpu_streams.py``, each scenario runs in a fresh interpreter with its own local
workers; without a GPU the tests are skipped, and ``RREFPIPE_TEST_GPU=cpu`` dry-runs them on the CPU.
"""
from __future__ import annotations

import copy
import os
import signal
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import Tensor

from tests.gpu import runner
from tests.gpu.scenarios import GPU

pytestmark = runner.MARKS

BALANCE = [3, 4]  # mlp([5, 8, 8, 6, 3]): 7 layers on 2 GPU stages
TRAINED_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}  # a few steps of the GPU's micro-batch kernels


def scenario(call: str) -> None:
    runner.scenario("tests.gpu.test_gpu_large_models", call)


def test_a_meta_model_is_materialised_on_the_stages_gpu_from_safetensors():
    scenario("materialised_on_the_gpu()")


def test_a_checkpoint_of_gpu_stages_resumes_in_another_split():
    scenario("saved_and_resumed()")


def test_a_lost_gpu_stage_worker_is_rebuilt_on_the_spare():
    scenario("recovered_on_the_spare()")


# -- scenarios (run in a fresh interpreter) ---------------------------------------------------------------
def _loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y.to(out.device))


def _batches(n: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _plain(model: torch.nn.Module, batches: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    model = model.to(GPU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x.to(GPU)), y.to(GPU)).backward()
        opt.step()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def _stage_device(pipe_id: str, j: int) -> str:
    """On a stage worker: the device of stage ``j``'s first parameter."""
    from rrefpipe.stage_side.server import _server

    return str(next(_server(pipe_id, j).stage.module.parameters()).device)


def materialised_on_the_gpu() -> None:
    from safetensors.torch import save_model

    from rrefpipe import Pipe
    from tests.layers import mlp

    real = mlp([5, 8, 8, 6, 3], seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        save_model(real, str(path))
        with torch.device("meta"):
            meta = mlp([5, 8, 8, 6, 3], seed=1)
        with Pipe(meta, chunks=4, balance=BALANCE, devices=[GPU] * 2, init=path) as pipe:
            driver = pipe._driver
            assert [rpc.rpc_sync(w, _stage_device, args=(driver.pipe_id, j)) for j, w in enumerate(driver.workers)] \
                == [GPU] * 2
            state = pipe.state_dict()
            pipe.eval()
            x = torch.randn(8, 5)
            with torch.no_grad():
                out = pipe(x).local_value()
    for key, value in real.state_dict().items():
        assert torch.equal(state[key], value), key
    torch.testing.assert_close(out, real.to(GPU).eval()(x.to(GPU)).cpu(), rtol=1e-4, atol=1e-5)


def saved_and_resumed() -> None:
    from rrefpipe import Pipe
    from tests.layers import mlp

    data = _batches(4)
    expected = _plain(mlp([5, 8, 8, 6, 3], seed=3), data)
    with tempfile.TemporaryDirectory() as tmp:
        with Pipe(mlp([5, 8, 8, 6, 3], seed=3), chunks=4, balance=BALANCE, devices=[GPU] * 2,
                  schedule="1F1B") as pipe:
            opt = pipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
            for x, y in data[:2]:
                with dist_autograd.context() as ctx:
                    pipe.train_step(ctx, x, y, _loss)
                    opt.step(ctx)
            pipe.save(tmp, optimizer=opt, step=2)
        with Pipe(mlp([5, 8, 8, 6, 3], seed=9), chunks=2, balance=[5, 2], devices=[GPU] * 2) as pipe:
            opt = pipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
            assert pipe.load(tmp, optimizer=opt) == 2
            for x, y in data[2:]:
                with dist_autograd.context() as ctx:
                    pipe.train_step(ctx, x, y, _loss)
                    opt.step(ctx)
            state = pipe.state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, **TRAINED_TOLERANCE, msg=lambda m, k=key: f"{k}: {m}")


def recovered_on_the_spare() -> None:
    from rrefpipe import Pipe
    from tests.layers import mlp

    data = _batches(8)
    expected = _plain(mlp([5, 8, 8, 6, 3], seed=4), data)
    with Pipe(copy.deepcopy(mlp([5, 8, 8, 6, 3], seed=4)), chunks=4, balance=BALANCE, devices=[GPU] * 2,
              schedule="1F1B", spares=1, snapshot_every=3) as pipe:
        opt = pipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
        for t, _ in enumerate(pipe.train_stream(data, _loss, opt)):
            if t == 4:
                os.kill(rpc.rpc_sync(pipe._driver.workers[1], os.getpid), signal.SIGKILL)
        [record] = pipe.recoveries
        driver = pipe._driver
        assert driver.workers[1] == record.spare
        assert rpc.rpc_sync(record.spare, _stage_device, args=(driver.pipe_id, 1)) == GPU
        state = pipe.state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, **TRAINED_TOLERANCE, msg=lambda m, k=key: f"{k}: {m}")


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
