"""``rrefpipe.GradScaler``: torch's loss scaling over the stages' gradients, against ``torch.amp.GradScaler``
on the plain model."""
import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import DistributedOptimizer

import rrefpipe.optim
from rrefpipe import GradScaler, Pipe, StageError
from tests.layers import twin
from tests.training import Batches, batches_with_overflows, model_that_overflows

pytestmark = pytest.mark.timeout(120)


def plain_scaled_steps(model: nn.Module, batches: Batches, clip: float | None, **scaler_args) -> list[float]:
    """torch.amp.GradScaler and SGD with momentum on the plain model; the scale after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler, scales = torch.amp.GradScaler("cpu", **scaler_args), []
    for x, y in batches:
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def pipe_scaled_steps(pipe: Pipe, opt: DistributedOptimizer, scaler: GradScaler, batches: Batches,
                      clip: float | None) -> list[float]:
    scales = []
    for x, y in batches:
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, scaler.scale(F.cross_entropy(pipe(x).local_value(), y)))
            if clip is not None:
                scaler.unscale_(ctx)
                pipe.clip_grad_norm_(ctx, clip)
            scaler.step(opt, ctx)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize(("clip", "stage"), [(None, 0), (0.5, 0), (None, 1)])
def test_steps_and_scales_follow_torchs_grad_scaler(cluster, clip, stage):
    """Two batches overflow, on one stage only: every stage skips those steps, the scale halves, and
    grows again after two good steps, as torch's GradScaler does with one optimizer over the model."""
    model = model_that_overflows(stage)
    reference = twin(model)
    batches = batches_with_overflows(8, bad=[2, 5])
    args = {"init_scale": 2.0**10, "growth_interval": 2}
    expected = plain_scaled_steps(reference, batches, clip, **args)
    assert expected == [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11]  # the test's premise
    with Pipe(model, chunks=2, balance=[1, 5], workers=cluster.names[:2]) as pipe:
        opt = DistributedOptimizer(rrefpipe.optim.SGD, pipe.parameter_rrefs(), lr=0.05, momentum=0.9)
        scales = pipe_scaled_steps(pipe, opt, GradScaler(pipe, **args), batches, clip)
        trained = pipe.state_dict()
    assert scales == expected
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("stage", [0, 1])
def test_a_step_with_an_overflow_leaves_every_stage_alone(cluster, stage):
    model = model_that_overflows(stage)
    (x, y), = batches_with_overflows(1, bad=[0])
    with Pipe(model, chunks=2, balance=[1, 5], workers=cluster.names[:2]) as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1)  # TorchScript's SGD also works
        scaler = GradScaler(pipe, init_scale=256.0)
        before = pipe.state_dict()
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, scaler.scale(F.cross_entropy(pipe(x).local_value(), y)))
            scaler.step(opt, ctx)
        scaler.update()
        after = pipe.state_dict()
        assert scaler.get_scale() == 128.0
        with dist_autograd.context() as ctx:  # the same batch unscaled by 100: stepped
            pipe.backward(ctx, scaler.scale(F.cross_entropy(pipe(x / 100).local_value(), y)))
            scaler.step(opt, ctx)
        scaler.update()
        stepped = pipe.state_dict()
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)
        assert not torch.equal(stepped[key], value), key


def test_state_dict_is_torchs(cluster):
    """Loaded from torch's, a growth tracker one step short of the interval grows the scale at the
    next good step; saved, torch's loads it."""
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=64.0, growth_factor=4.0, backoff_factor=0.25,
                                        growth_interval=7)
    state = {**torch_scaler.state_dict(), "_growth_tracker": 6}
    (x, y), = batches_with_overflows(1, bad=[])
    with Pipe(model_that_overflows(0), balance=[1, 5], workers=cluster.names[:2]) as pipe:
        scaler = GradScaler(pipe)
        scaler.load_state_dict(state)
        assert scaler.state_dict() == state
        opt = DistributedOptimizer(rrefpipe.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, scaler.scale(F.cross_entropy(pipe(x).local_value(), y)))
            scaler.step(opt, ctx)
        scaler.update()
        assert scaler.state_dict() == {**state, "scale": 256.0, "_growth_tracker": 0}
        back = torch.amp.GradScaler("cpu")
        back.load_state_dict(scaler.state_dict())
        assert back.state_dict() == scaler.state_dict()
        scaler.update(new_scale=3.0)  # set by hand, as torch's; the tracker stays
        assert scaler.get_scale() == 3.0 and scaler.state_dict()["_growth_tracker"] == 0
        disabled = GradScaler(pipe, enabled=False)
        loss = torch.tensor(3.0)
        assert disabled.state_dict() == {} and disabled.scale(loss) is loss and disabled.get_scale() == 1.0


def test_growth_and_backoff_are_read_and_changed_as_torchs(cluster):
    """The setters change what the next update() does: a good step at interval 1 grows the scale by the
    new growth factor, an overflow lowers it by the new backoff factor; bad values are refused."""
    batches = batches_with_overflows(2, bad=[1])
    with Pipe(model_that_overflows(0), balance=[1, 5], workers=cluster.names[:2]) as pipe:
        scaler = GradScaler(pipe, init_scale=8.0, growth_interval=5)
        reference = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=5)
        for s in (scaler, reference):
            s.set_growth_factor(3.0)
            s.set_backoff_factor(0.25)
            s.set_growth_interval(1)
        read = (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())
        assert read == (reference.get_growth_factor(), reference.get_backoff_factor(),
                        reference.get_growth_interval()) == (3.0, 0.25, 1)
        opt = DistributedOptimizer(rrefpipe.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        assert pipe_scaled_steps(pipe, opt, scaler, batches, None) == [24.0, 6.0]
        refused = [(scaler.set_growth_factor, 1.0, ValueError), (scaler.set_backoff_factor, 1.5, ValueError),
                   (scaler.set_growth_interval, 0, ValueError), (scaler.set_growth_interval, 1.5, TypeError)]
        for setter, bad, error in refused:
            with pytest.raises(error):
                setter(bad)
        assert read == (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())


def test_a_disabled_scaler_steps_as_plain_training(cluster):
    model = model_that_overflows(0)
    reference = twin(model)
    batches = batches_with_overflows(3, bad=[])
    plain_scaled_steps(reference, batches, None, enabled=False)
    with Pipe(model, chunks=2, balance=[1, 5], workers=cluster.names[:2]) as pipe:
        opt = DistributedOptimizer(rrefpipe.optim.SGD, pipe.parameter_rrefs(), lr=0.05, momentum=0.9)
        assert pipe_scaled_steps(pipe, opt, GradScaler(pipe, enabled=False), batches, None) == [1.0] * 3
        trained = pipe.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value, msg=lambda m: f"{key}: {m}")


def test_misuse_is_refused(cluster):
    (x, y), = batches_with_overflows(1, bad=[])
    with pytest.raises(TypeError, match="rrefpipe.Pipe"):
        GradScaler(nn.Linear(2, 2))  # type: ignore[arg-type]
    with Pipe(model_that_overflows(0), balance=[1, 5], workers=cluster.names[:2]) as pipe:
        for bad in ({"init_scale": 0.0}, {"growth_factor": 1.0}, {"backoff_factor": 1.0}, {"growth_interval": 0}):
            with pytest.raises(ValueError):
                GradScaler(pipe, **bad)
        scaler = GradScaler(pipe)
        opt = DistributedOptimizer(rrefpipe.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        with pytest.raises(TypeError, match="tensor"):
            scaler.scale("loss")  # type: ignore[arg-type]
        assert scaler.scale((torch.tensor(1.0), torch.tensor(2.0))) == (2.0**16, 2.0**17)
        with pytest.raises(RuntimeError, match="no inf checks"):
            scaler.update()
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, scaler.scale(F.cross_entropy(pipe(x).local_value(), y)))
            with pytest.raises(TypeError, match="DistributedOptimizer"):
                scaler.step(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), ctx)  # type: ignore[arg-type]
            scaler.unscale_(ctx)
            with pytest.raises(RuntimeError, match="already been called"):
                scaler.unscale_(ctx)
            scaler.step(opt, ctx)
            with pytest.raises(RuntimeError, match="already been called"):
                scaler.step(opt, ctx)
            with pytest.raises(RuntimeError, match="after step"):
                scaler.unscale_(ctx)
        scaler.update()
        with pytest.raises(RuntimeError, match="no dist_autograd context"):
            scaler.unscale_(ctx)


def test_float16_gradients_are_refused_naming_the_stage(cluster):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).half()
    with Pipe(model, balance=[2, 1], workers=cluster.names[:2]) as pipe:
        scaler = GradScaler(pipe)
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, scaler.scale(pipe(torch.randn(2, 4).half()).local_value().float().sum()))
            with pytest.raises(StageError, match="float16") as caught:
                scaler.unscale_(ctx)
    assert caught.value.stage == 0 and caught.value.worker == cluster.names[0]
    assert isinstance(caught.value, ValueError)
