"""``pipe.train_step`` under 1F1B and Interleaved1F1B with every stage on a CUDA GPU: the loss, every
gradient and the parameters after SGD steps equal the plain model's trained whole on the GPU.

As in ``tests/gpu/test_cuda.py``, each scenario (the functions below, which the stage workers can import)
runs in a fresh interpreter with its own local workers, started with device maps; without a GPU the
tests are skipped, and ``RREFPIPE_TEST_GPU=cpu`` dry-runs them on the CPU.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.optim import DistributedOptimizer

from tests.conftest import run_script
from tests.gpu import runner
from tests.gpu.scenarios import GPU, TOLERANCE

pytestmark = runner.MARKS

#: schedule -> (stages, stages per worker): 1F1B on 2 workers, the others on 4 stages, 2 per worker (the
#: zero-bubble ones split each backward in two on the stage's stream; ZBV and DualPipeV in a V)
LAYOUT = {"1F1B": (2, 1), "Interleaved1F1B": (4, 2), "ZBVZeroBubble": (4, 2), "InterleavedZeroBubble": (4, 2),
          "DualPipeV": (4, 2)}
SCHEDULES = list(LAYOUT)
MLP_BALANCE = {2: [3, 4], 4: [2, 2, 2, 1]}  # mlp([5, 8, 8, 6, 3]): 7 layers
SKIP_BALANCE = {2: [3, 4], 4: [2, 2, 2, 1]}  # skip_model(): 7 layers; both skips cross workers either way
# Parameters after a few momentum steps: the rounding differences of the micro-batch kernels add up.
TRAINED_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}


def scenario(call: str) -> None:
    runner.scenario("tests.gpu.test_gpu_train_step", call)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpu_stages_train_as_the_plain_model(schedule, checkpoint):
    scenario(f"trains_as_the_plain_model({schedule!r}, {checkpoint!r})")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_skips_between_gpu_stages(schedule):
    scenario(f"skips_between_gpu_stages({schedule!r})")


def test_the_target_reaches_loss_fn_on_the_last_stages_device():
    proc = run_script("from tests.gpu import test_gpu_train_step as s\ns.target_on_the_last_stages_device()\n"
                      "print('ok')", timeout=150, check=False)
    if proc.returncode != 0 and "TARGET NOT ON THE STAGE'S DEVICE" in proc.stdout + proc.stderr:
        raise AssertionError(proc.stderr[-3000:])
    if proc.returncode != 0:
        pytest.fail(f"script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


# -- scenarios (run in a fresh interpreter) ---------------------------------------------------------------
def cross_entropy_on_device(out: Tensor, y: Tensor) -> Tensor:
    """A loss that also takes a target on another device (train_step hands it over on the output's)."""
    return F.cross_entropy(out, y.to(out.device))


def mse_on_device(out: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(out, target.to(out.device))


def _mlp() -> nn.Sequential:
    from tests.layers import mlp

    return mlp([5, 8, 8, 6, 3], seed=1)


def _pipe(model: nn.Sequential, schedule: str, balances: dict[int, list[int]], **kwargs: Any) -> Any:
    from rrefpipe import Pipe

    stages, per_worker = LAYOUT[schedule]
    pipe = Pipe(model, schedule=schedule, stages_per_worker=per_worker, balance=balances[stages],
                devices=[GPU] * stages, **kwargs)
    assert [s.device for s in pipe.stages] == [GPU] * stages, pipe.stages
    assert len({s.worker for s in pipe.stages}) == stages // per_worker, pipe.stages
    return pipe


def _side_by_side(pipe: Any, model: nn.Module, batches: list[tuple[Tensor, Tensor]],
                  loss_fn: Callable[[Tensor, Tensor], Tensor]) -> None:
    """SGD with momentum through ``train_step`` and on a copy of ``model`` on the GPU: the loss and every
    gradient at each step, and the parameters at the end, agree to the GPU's rounding."""
    from tests.distributed.probes import stage_gradients

    reference = copy.deepcopy(model).to(GPU)
    opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.05, momentum=0.9)
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step, (x, target) in enumerate(batches):
        with dist_autograd.context() as ctx:
            loss = pipe.train_step(ctx, x, target, loss_fn)
            grads = stage_gradients(pipe, ctx)  # on the CPU
            opt.step(ctx)
        plain_opt.zero_grad()
        plain_loss = loss_fn(reference(x.to(GPU)), target.to(GPU))
        plain_loss.backward()
        assert loss.device.type == "cpu" and not loss.requires_grad
        torch.testing.assert_close(loss, plain_loss.detach().cpu(), **TOLERANCE)
        expected = {name: p.grad.cpu() for name, p in reference.named_parameters()}
        assert grads.keys() == expected.keys(), (sorted(grads), sorted(expected))
        for name, grad in expected.items():
            torch.testing.assert_close(grads[name], grad, **TOLERANCE, msg=lambda m, n=name: f"step {step} {n}: {m}")
        plain_opt.step()
    trained = pipe.state_dict()
    for key, value in reference.state_dict().items():
        assert trained[key].device.type == "cpu"
        torch.testing.assert_close(trained[key], value.cpu(), **TRAINED_TOLERANCE, msg=lambda m, k=key: f"{k}: {m}")


def _classification(steps: int, rows: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 5, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(steps)]


def trains_as_the_plain_model(schedule: str, checkpoint: str) -> None:
    """Three steps of 11 rows in 4 micro-batches (3, 3, 3, 2)."""
    model = _mlp()
    with _pipe(copy.deepcopy(model), schedule, MLP_BALANCE, chunks=4, checkpoint=checkpoint) as pipe:
        _side_by_side(pipe, model, _classification(3, 11, seed=2), cross_entropy_on_device)


def skips_between_gpu_stages(schedule: str) -> None:
    """``skip_model``: two skips between GPU workers, one from stage 0 to the last stage (on 4 stages, 2 per
    worker, past both of the other worker's stages) and one into the next stage."""
    from tests.layers import skip_model

    model = skip_model(width=6, seed=3)
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)) for _ in range(2)]
    for checkpoint in ("always", "never"):
        with _pipe(copy.deepcopy(model), schedule, SKIP_BALANCE, chunks=4, checkpoint=checkpoint) as pipe:
            _side_by_side(pipe, model, batches, mse_on_device)


def target_on_the_last_stages_device() -> None:
    """``F.cross_entropy`` as the loss, as on one device: the target must reach it on the output's device."""
    from rrefpipe import StageError

    model = _mlp()
    with _pipe(copy.deepcopy(model), "1F1B", MLP_BALANCE, chunks=2) as pipe:
        try:
            _side_by_side(pipe, model, _classification(2, 8, seed=5), F.cross_entropy)
        except StageError as exc:
            if exc.phase == "loss_fn" and "device" in exc.error_message:
                raise AssertionError(f"TARGET NOT ON THE STAGE'S DEVICE: {exc}") from exc
            raise
