"""``Pipe.clip_grad_norm_``: torch's ``clip_grad_norm_`` over every stage's gradients in a context."""
import copy
import math

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch.distributed.optim import DistributedOptimizer

from rrefpipe import Pipe
from tests.distributed.probes import stage_gradients
from tests.layers import mlp

pytestmark = pytest.mark.timeout(120)


def setup():
    torch.manual_seed(0)
    model = mlp([5, 8, 8, 6, 3])  # 7 layers
    return model, copy.deepcopy(model), torch.randn(8, 5)


@pytest.mark.parametrize(("norm_type", "max_norm", "balance"), [
    (2.0, 0.1, [2, 3, 2]), (1.0, 0.1, [2, 3, 2]), (math.inf, 0.1, [2, 3, 2]), (2.0, 1e3, [3, 4])])
def test_total_norm_and_clipped_gradients_equal_torchs(cluster, norm_type, max_norm, balance):
    model, plain, x = setup()
    plain(x).pow(2).sum().backward()
    expected_total = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm, norm_type)
    with Pipe(model, chunks=4, balance=balance, workers=cluster.names[:len(balance)]) as pipe:
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, pipe(x).local_value().pow(2).sum())
            total = pipe.clip_grad_norm_(ctx, max_norm, norm_type)
            grads = stage_gradients(pipe, ctx)
    assert total.dtype == torch.float32 and total.dim() == 0
    torch.testing.assert_close(total, expected_total)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m: f"{name}: {m}")


def test_the_optimizer_steps_with_the_clipped_gradients(cluster):
    model, plain, x = setup()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    with Pipe(model, chunks=2, balance=[3, 4], workers=cluster.names[:2]) as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.5)
        for _ in range(3):
            with dist_autograd.context() as ctx:
                pipe.backward(ctx, pipe(x).local_value().pow(2).sum())
                pipe.clip_grad_norm_(ctx, 0.05)
                opt.step(ctx)
            plain_opt.zero_grad()
            plain(x).pow(2).sum().backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
            plain_opt.step()
        state = pipe.state_dict()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=lambda m: f"{key}: {m}")


def test_nonfinite_norms_and_bad_arguments_are_refused(cluster):
    model, _, x = setup()
    with Pipe(model, chunks=2, balance=[3, 4], workers=cluster.names[:2]) as pipe:
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, pipe(x).local_value().sum() * math.inf)
            with pytest.raises(RuntimeError,
                               match="total norm of order 2.0 .* is (inf|nan), so they cannot be clipped"):
                pipe.clip_grad_norm_(ctx, 1.0, error_if_nonfinite=True)
            with pytest.raises(ValueError, match="max_norm must be >= 0"):
                pipe.clip_grad_norm_(ctx, -1.0)
            with pytest.raises(ValueError, match="norm_type must be > 0"):
                pipe.clip_grad_norm_(ctx, 1.0, norm_type=0)
            with pytest.raises(TypeError, match="norm_type must be a number, got 'two'"):
                pipe.clip_grad_norm_(ctx, 1.0, norm_type="two")
        with pytest.raises(RuntimeError, match=f"no dist_autograd context {ctx} in this process: call clip_grad_norm_"):
            pipe.clip_grad_norm_(ctx, 1.0)  # the context is gone


@pytest.mark.parametrize("case", ["stage without parameters", "frozen stage", "float64", "nan",
                                  "torch's argument forms"])
def test_clip_follows_torch_in_the_corners(cluster, case):
    """A stage with no gradients to scale, float64 gradients, a nan norm (torch scales by nan), and
    max_norm as a tensor with norm_type 'inf' as a string: all as torch.nn.utils.clip_grad_norm_."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    balance, scale, max_norm, norm_type = [1, 1, 1], 1.0, 0.1, 2.0
    if case == "frozen stage":
        model[0].requires_grad_(False)
        balance = [2, 1]
    elif case == "float64":
        model.double()
    elif case == "nan":
        scale = math.nan
    elif case == "torch's argument forms":
        max_norm, norm_type = torch.tensor(0.1), "inf"
    plain = copy.deepcopy(model)
    x = torch.randn(6, 4, dtype=next(model.parameters()).dtype)
    (plain(x).pow(2).sum() * scale).backward()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm, norm_type)
    with Pipe(model, chunks=2, balance=balance, workers=cluster.names[:len(balance)]) as pipe:
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, pipe(x).local_value().pow(2).sum() * scale)
            total = pipe.clip_grad_norm_(ctx, max_norm, norm_type)
            grads = stage_gradients(pipe, ctx)
    torch.testing.assert_close(total, expected, equal_nan=True)
    for name, p in plain.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, equal_nan=True, msg=lambda m: f"{name}: {m}")
    assert grads.keys() == {name for name, p in plain.named_parameters() if p.grad is not None}
