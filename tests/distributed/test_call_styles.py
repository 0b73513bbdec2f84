"""PyTorch 2.x's call style (``pipe(a, b)``, tuples spread between layers) and 1.8's (``pipe((a, b))``, tuples
passed whole) on stage workers: outputs and gradients equal the plain model's run as each version ran it,
with checkpointing, a skip across stages, and stage boundaries between pairs."""
import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch import nn

from rrefpipe import Pipe
from tests.compat_models import loss_of, model_18, model_2x, model_2x_one_input, reference
from tests.distributed.probes import stage_gradients

pytestmark = pytest.mark.timeout(120)


def run_pipe(pipe, style, inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    with dist_autograd.context() as ctx:
        out = (pipe(*leaves) if style == "2x" else pipe(tuple(leaves))).local_value()
        pipe.backward(ctx, loss_of(out))
        grads = dist_autograd.get_gradients(ctx)
        input_grads = [grads[t] for t in leaves]
        params = stage_gradients(pipe, ctx)
    return out.detach(), input_grads, params


def check_against_plain(pipe, model, style, inputs):
    out_ref, input_grads_ref, params_ref = reference(model, style, inputs)
    out, input_grads, params = run_pipe(pipe, style, inputs)
    torch.testing.assert_close(out, out_ref)
    for got, want in zip(input_grads, input_grads_ref):
        torch.testing.assert_close(got, want)
    assert params.keys() == params_ref.keys()
    for name, grad in params_ref.items():
        torch.testing.assert_close(params[name], grad)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_several_inputs_spread_like_pytorch_2(cluster, checkpoint):
    model = model_2x()
    inputs = (torch.randn(6, 4), torch.rand(6, 4))
    with Pipe(model, chunks=3, checkpoint=checkpoint, balance=[2, 2, 2], workers=cluster.names[:3]) as pipe:
        check_against_plain(pipe, model, "2x", inputs)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_one_tuple_input_passes_whole_like_pytorch_1_8(cluster, checkpoint):
    """The same 2.x model called with one tuple: a layer that can take one argument (Either) gets the pair
    whole, unlike in 2.x; those requiring two get it spread. model_18's layers take pairs whole."""
    inputs = (torch.randn(6, 4), torch.rand(6, 4))
    for model, balance in ((model_2x(), [2, 2, 2]), (model_18(), [2, 2, 1])):
        with Pipe(model, chunks=3, checkpoint=checkpoint, balance=balance, workers=cluster.names[:3]) as pipe:
            check_against_plain(pipe, model, "18", inputs)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_call_style_2x_spreads_after_one_input_too(cluster, checkpoint):
    """``call_style='2.x'``: a one-tensor call spreads every tuple, into ``*args`` and optional arguments, and
    a nested ``nn.Sequential`` is run layer by layer, as 2.x ran them; balancing profiles layers the same way."""
    model = model_2x_one_input()
    inputs = (torch.randn(6, 4),)
    with Pipe(model, chunks=3, checkpoint=checkpoint, balance=[2, 2, 2], workers=cluster.names[:3],
              call_style="2.x") as pipe:
        check_against_plain(pipe, model, "2x", inputs)
    with Pipe(model, chunks=3, balance="size", sample=inputs[0], workers=cluster.names[:2], call_style="2.x") as pipe:
        assert sum(pipe.balance) == len(model) and len(pipe.balance) == 2
        check_against_plain(pipe, model, "2x", inputs)


def test_styles_differ_where_a_layer_may_take_one_argument(cluster):
    model = model_2x()
    x, mask = torch.randn(4, 4), torch.rand(4, 4)
    with Pipe(model, chunks=2, balance=[3, 3], workers=cluster.names[:2]) as pipe, torch.no_grad():
        spread, whole = pipe(x, mask).local_value(), pipe((x, mask)).local_value()
    assert not torch.allclose(spread, whole)


def test_several_inputs_checked_and_empty_pipe(cluster):
    with Pipe(nn.Sequential(nn.Linear(2, 2)), workers=cluster.names[:1]) as pipe:
        x = torch.randn(4, 2)
        with torch.no_grad():  # PyTorch 1.8's keyword form
            torch.testing.assert_close(pipe(input=x).local_value(), pipe(x).local_value())
        with pytest.raises(TypeError, match="pass the mini-batch once"):
            pipe(x, input=x)
        message = r"Pipe input 1 of 2 \(int\) is not a Tensor: every input must be one, split.*NoChunk"
        with pytest.raises(TypeError, match=message):
            pipe(torch.ones(2, 2), 3)
        with pytest.raises(TypeError, match="Pipe needs an input"):
            pipe()
    empty = Pipe(nn.Sequential())
    assert len(empty) == 0 and empty.stages == []
    x = torch.tensor(42)  # not even a batch: nothing is split
    assert empty(x).local_value() is x
    a, b = torch.ones(2), torch.zeros(2)
    assert empty(a, b).local_value() == (a, b)
    with pytest.raises(TypeError):
        empty(42)
    empty.close()
