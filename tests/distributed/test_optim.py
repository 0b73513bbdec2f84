"""Learning-rate schedules and optimizer checkpoints over stage workers, against plain PyTorch."""
import logging

import pytest
import torch
from torch.distributed.optim import DistributedOptimizer
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LinearLR, ReduceLROnPlateau, SequentialLR, StepLR

import rrefpipe.optim
from rrefpipe import Pipe
from rrefpipe.optim import RemoteLRScheduler, load_optimizer_state_dict, optimizer_state_dict
from tests.layers import WideOnly, mlp, twin
from tests.training import blobs, pipe_steps, plain_steps

pytestmark = pytest.mark.timeout(120)


def assert_same_weights(trained: dict, reference: nn.Module) -> None:
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value)


def test_a_lambda_schedule_with_momentum_matches_plain_training(cluster):
    """The lambda comes from this module: the scheduler travels to the workers by value."""
    model = mlp([10, 16, 16, 4], seed=11)
    reference = twin(model)
    batches = list(blobs(5, 16, seed=2))
    warmup = lambda step: min(1.0, (step + 1) / 3)  # noqa: E731
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    plain_sched = LambdaLR(plain_opt, lr_lambda=warmup)
    plain_steps(reference, plain_opt, plain_sched, batches)
    with Pipe(model, chunks=2, balance=[2, 3], workers=cluster.names[:2]) as pipe:
        opt = DistributedOptimizer(rrefpipe.optim.SGD, pipe.parameter_rrefs(), lr=0.2, momentum=0.9)
        sched = RemoteLRScheduler(opt, LambdaLR, lr_lambda=warmup)
        assert sched.get_last_lr() == pytest.approx([0.2 / 3] * 2)  # one parameter group per worker
        pipe_steps(pipe, opt, sched, batches)
        assert sched.get_last_lr() == pytest.approx(plain_sched.get_last_lr() * 2)
        trained = pipe.state_dict()
    assert_same_weights(trained, reference)


@pytest.mark.parametrize("cls, kwargs", [
    (torch.optim.SGD, {"momentum": 0.9}),  # torch builds its TorchScript twin on the workers
    (rrefpipe.optim.SGD, {"momentum": 0.9}),  # the regular torch.optim.SGD on the workers
    (torch.optim.NAdam, {}),  # no twin: torch's _LocalOptimizer, which never clears .grad
], ids=["torch-SGD", "rrefpipe-SGD", "torch-NAdam"])
def test_a_parameter_without_a_gradient_in_a_step_is_left_alone(cluster, cls, kwargs):
    """torch's DistributedOptimizer copies gradients into .grad and, for a class it has no TorchScript
    twin of, never clears them: unless stage workers drop them after each step, the bias below would
    be stepped again on the narrow batch that gives it no gradient. Plain PyTorch, zero_grad() between
    steps, skips it. Whatever class the user passes, the pipe trains as plain PyTorch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 8), WideOnly(8), nn.Tanh(), nn.Linear(8, 4))
    reference = twin(model)
    wide, narrow = next(blobs(1, 8, seed=3)), next(blobs(1, 4, seed=4))
    plain_steps(reference, cls(reference.parameters(), lr=0.1, **kwargs), None, [wide, narrow])
    with Pipe(model, chunks=1, balance=[2, 2], workers=cluster.names[:2]) as pipe:
        opt = DistributedOptimizer(cls, pipe.parameter_rrefs(), lr=0.1, **kwargs)
        pipe_steps(pipe, opt, None, [wide, narrow])
        trained = pipe.state_dict()
    assert_same_weights(trained, reference)


def test_a_scheduler_made_of_schedulers_goes_as_a_function(cluster):
    model = mlp([10, 8, 4], seed=6)
    reference = twin(model)
    batches = list(blobs(4, 8, seed=1))

    def warmup_then_decay(o):
        return SequentialLR(o, [LinearLR(o, start_factor=0.25, total_iters=2), StepLR(o, 1, gamma=0.5)], [2])

    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.4)
    plain_sched = warmup_then_decay(plain_opt)
    plain_steps(reference, plain_opt, plain_sched, batches)
    with Pipe(model, chunks=2, balance=[1, 2], workers=cluster.names[:2]) as pipe:
        opt = DistributedOptimizer(rrefpipe.optim.SGD, pipe.parameter_rrefs(), lr=0.4)
        sched = RemoteLRScheduler(opt, warmup_then_decay)
        pipe_steps(pipe, opt, sched, batches)
        assert sched.get_last_lr() == pytest.approx(plain_sched.get_last_lr() * 2)
        trained = pipe.state_dict()
    assert_same_weights(trained, reference)


def test_resuming_from_saved_optimizer_and_scheduler_states_continues_exactly(cluster):
    """Adam's moments and the schedule's position come back: 2 + 2 steps equal 4 uninterrupted ones,
    which equal plain PyTorch's. Without the optimizer state the moments restart (checked)."""
    model = mlp([10, 16, 4], seed=4)
    batches = list(blobs(4, 12, seed=8))
    reference = twin(model)
    plain_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    plain_steps(reference, plain_opt, StepLR(plain_opt, step_size=2, gamma=0.5), batches)

    def run(first, then, restore_optimizer=True):
        with Pipe(twin(model), chunks=3, balance=[1, 2], workers=cluster.names[:2]) as pipe:
            opt = DistributedOptimizer(rrefpipe.optim.Adam, pipe.parameter_rrefs(), lr=0.01)
            sched = RemoteLRScheduler(opt, StepLR, step_size=2, gamma=0.5)
            pipe_steps(pipe, opt, sched, first)
            saved = pipe.state_dict(), optimizer_state_dict(opt), sched.state_dict()
        if not then:
            return saved[0]
        with Pipe(twin(model), chunks=3, balance=[1, 2], workers=cluster.names[:2]) as pipe:
            pipe.load_state_dict(saved[0])
            opt = DistributedOptimizer(rrefpipe.optim.Adam, pipe.parameter_rrefs(), lr=0.01)
            sched = RemoteLRScheduler(opt, StepLR, step_size=2, gamma=0.5)
            if restore_optimizer:
                load_optimizer_state_dict(opt, saved[1])
            sched.load_state_dict(saved[2])
            assert sched.get_last_lr() == pytest.approx([0.005] * 2)  # halved after step 2
            pipe_steps(pipe, opt, sched, then)
            return pipe.state_dict()

    uninterrupted = run(batches, [])
    resumed = run(batches[:2], batches[2:])
    restarted = run(batches[:2], batches[2:], restore_optimizer=False)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(uninterrupted[key], value)
        torch.testing.assert_close(resumed[key], value)
    assert any(not torch.allclose(restarted[key], value) for key, value in reference.state_dict().items())


class Custom(torch.optim.SGD):
    pass


def test_torch_notice_about_torchscript_is_dropped_for_these_classes_only(cluster):
    """torch's logger does not propagate to pytest's capture: listen on it directly."""
    heard: list[str] = []
    listener = logging.Handler()
    listener.emit = lambda record: heard.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("torch.distributed.optim.optimizer")
    logger.addHandler(listener)
    try:
        with Pipe(mlp([10, 8, 4], seed=1), chunks=2, balance=[1, 2], workers=cluster.names[:2]) as pipe:
            DistributedOptimizer(rrefpipe.optim.Adam, pipe.parameter_rrefs(), lr=0.1)
            assert not heard
            DistributedOptimizer(Custom, pipe.parameter_rrefs(), lr=0.1)
            assert len(heard) == 1 and "without TorchScript support" in heard[0]
    finally:
        logger.removeHandler(listener)


def test_what_cannot_be_scheduled_or_restored_is_refused(cluster):
    model = mlp([10, 8, 4], seed=1)
    with Pipe(model, chunks=2, balance=[1, 2], workers=cluster.names[:2]) as pipe:
        functional = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        with pytest.raises(TypeError, match=r"rrefpipe\.optim\.SGD"):
            RemoteLRScheduler(functional, StepLR, step_size=1)
        with pytest.raises(TypeError, match="has no param_groups or state_dict"):
            optimizer_state_dict(functional)
        with pytest.raises(TypeError, match="DistributedOptimizer, got SGD"):
            optimizer_state_dict(torch.optim.SGD(twin(model).parameters(), lr=0.1))
        opt = DistributedOptimizer(rrefpipe.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        with pytest.raises(TypeError, match="ReduceLROnPlateau"):
            RemoteLRScheduler(opt, ReduceLROnPlateau)
        with pytest.raises(TypeError, match="ReduceLROnPlateau"):
            RemoteLRScheduler(opt, lambda o: ReduceLROnPlateau(o, patience=2))
        with pytest.raises(ValueError,
                           match=r"state 0 does not fit the optimizer on worker 'worker1': .*shapes \[\[4, 8\]"):
            load_optimizer_state_dict(opt, optimizer_state_dict(opt)[::-1])  # stage 1's state into stage 0
        with pytest.raises(ValueError, match="a list of 2 optimizer states, .* got a list of 1"):
            load_optimizer_state_dict(opt, optimizer_state_dict(opt)[:1])
        with pytest.raises(RuntimeError, match="building the scheduler on worker 'worker1' failed: ZeroDivisionError"):
            RemoteLRScheduler(opt, lambda o: 1 / 0)
        sched = RemoteLRScheduler(opt, StepLR, step_size=1)
        with pytest.raises(ValueError, match="a list of 2 scheduler states, .* got dict"):
            sched.load_state_dict(sched.state_dict()[0])
