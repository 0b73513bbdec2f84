"""Pipelined == plain nn.Sequential: outputs, every parameter's gradient and the input's gradient."""
import pytest
import torch
import torch.distributed.autograd as dist_autograd

from rrefpipe import Pipe
from tests.distributed.probes import check_transparent, stage_gradients
from tests.layers import DetachFirst, Merge, PopSignFirst, ReadFirst, Split, StashSign, mlp, twin

pytestmark = pytest.mark.timeout(120)

BALANCES = {1: [7], 2: [3, 4], 3: [2, 3, 2]}


@pytest.mark.parametrize("chunks", [1, 3, 8])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_outputs_and_gradients_match_plain_model(cluster, stages, checkpoint, chunks):
    model = mlp([5, 8, 8, 6, 3])  # 7 layers
    x = torch.randn(8, 5, requires_grad=True)
    with Pipe(model, chunks=chunks, checkpoint=checkpoint, balance=BALANCES[stages],
              workers=cluster.names[:stages]) as pipe:
        check_transparent(pipe, model, x)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_in_place_first_layer_after_a_boundary(cluster, checkpoint):
    """ReLU(inplace=True) as a stage's first layer (as automatic balancing may cut a ResNet): the
    checkpointed stage recomputes from a copy of its input, which the layer would otherwise overwrite."""
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Sequential(torch.nn.ReLU(inplace=True)),
                                torch.nn.Linear(8, 8), torch.nn.LeakyReLU(0.1, inplace=True), torch.nn.Linear(8, 3))
    x = torch.randn(8, 5, requires_grad=True)
    with Pipe(model, chunks=4, checkpoint=checkpoint, balance=[1, 2, 2], workers=cluster.names[:3]) as pipe:
        check_transparent(pipe, model, x)


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_in_place_first_layer_of_the_pipe_on_an_input_that_needs_a_gradient(cluster, checkpoint, chunks):
    """The first stage's micro-batches are views of the batch, which autograd forbids overwriting: the
    in-place first layer gets a copy of each (it failed with "Output 0 of SplitBackward0 is a view and
    is being modified inplace" unless every micro-batch was checkpointed)."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.ReLU(inplace=True), torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))
    reference = twin(model)
    x = torch.randn(8, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out_ref = reference(x_ref * 2)
    out_ref.square().sum().backward()
    with Pipe(model, chunks=chunks, checkpoint=checkpoint, balance=[2, 1], workers=cluster.names[:2]) as pipe:
        with dist_autograd.context() as ctx:
            out = pipe(x * 2).local_value()
            dist_autograd.backward(ctx, [out.square().sum()])
            x_grad = dist_autograd.get_gradients(ctx)[x]
            grads = stage_gradients(pipe, ctx)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(x_grad, x_ref.grad)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_tuple_boundaries_between_workers(cluster, checkpoint):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), Split(), Merge(), torch.nn.Linear(6, 2))
    x = torch.randn(6, 4, requires_grad=True)
    with Pipe(model, chunks=3, checkpoint=checkpoint, balance=[2, 1, 1], workers=cluster.names[:3]) as pipe:
        check_transparent(pipe, model, x)


def test_tuple_input_and_output(cluster):
    torch.manual_seed(4)
    model = torch.nn.Sequential(Merge(), torch.nn.Linear(6, 4), Split())
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    with Pipe(model, chunks=2, balance=[2, 1], workers=cluster.names[:2]) as pipe:
        with torch.no_grad():
            out = pipe((a, b)).local_value()
    ref = model((a, b))
    assert isinstance(out, tuple) and len(out) == 2
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want)


def _check_pair_output(pipe, model, x) -> tuple[torch.Tensor, torch.Tensor]:
    """A model returning (first, value), the loss on the value: outputs and gradients as the plain
    model's. Returns the pipe's pair."""
    reference = twin(model)
    first_ref, out_ref = reference(x)
    out_ref.pow(2).sum().backward()
    with dist_autograd.context() as ctx:
        output = pipe(x)
        first, out = output.to_here() if pipe.remote_output else output.local_value()
        dist_autograd.backward(ctx, [out.pow(2).sum()])
        grads = stage_gradients(pipe, ctx)
    torch.testing.assert_close(first, first_ref)
    torch.testing.assert_close(out, out_ref)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m: f"{name}: {m}")
    return first, out


@pytest.mark.parametrize("remote_output", [False, True])
def test_output_whose_first_tensor_carries_no_gradient(cluster, remote_output):
    """(integer mask, value) out of the last stage, the mask a skip that needs no gradient: backward
    must still reach the skip's message (only its phony leads there) and every gradient must match.
    The phonies go into the value: a kept output (remote_output) had them in the mask, which no
    gradient reaches, and backward never returned."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), StashSign(), torch.nn.Tanh(), torch.nn.Linear(6, 3),
                                PopSignFirst())
    with Pipe(model, chunks=3, balance=[2, 1, 2], workers=cluster.names[:3], remote_output=remote_output) as pipe:
        mask, out = _check_pair_output(pipe, model, torch.randn(6, 4))
    assert mask.dtype == torch.long and not mask.requires_grad and out.requires_grad


def test_a_first_tensor_that_needs_no_gradient_reaches_the_next_stage_so(cluster):
    """(x.detach(), x * 2) out of a stage: the next stage gets the first tensor without requires_grad, as
    in the plain module (it came out of the stage's hop requiring grad, for the phonies' sake, and NumPy
    refused it). The pipe's own output keeps it requiring grad: see the two tests below."""
    torch.manual_seed(9)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), DetachFirst(), ReadFirst(), torch.nn.Linear(6, 3),
                                DetachFirst())
    with Pipe(model, chunks=2, balance=[2, 2, 1], workers=cluster.names[:3]) as pipe:
        _check_pair_output(pipe, model, torch.randn(6, 4))


def _frozen(module: torch.nn.Module) -> torch.nn.Module:
    return module.requires_grad_(False)


def test_a_kept_output_whose_first_tensor_needs_no_gradient_still_trains(cluster):
    """remote_output=True, a frozen first stage, a last stage returning (features, logits), the loss on
    the logits: backward reaches every hop through the kept first tensor (the phony that would go with
    it stays on the worker), so it must require grad there. When it did not, backward never returned
    (over 400 s with the group's 120 s RPC timeout): the driver's engine waits for a gradient of its
    own send to the first stage, and no RPC is in flight for a timeout to end."""
    torch.manual_seed(10)
    model = torch.nn.Sequential(_frozen(torch.nn.Linear(4, 6)), torch.nn.Tanh(), Split(), Merge(),
                                torch.nn.Linear(6, 6), DetachFirst())
    model[4].requires_grad_(True)
    reference = twin(model)
    x = torch.randn(6, 4)
    reference(x)[1].pow(2).sum().backward()
    with Pipe(model, chunks=2, balance=[2, 4], workers=cluster.names[:2], remote_output=True) as pipe:
        with dist_autograd.context() as ctx:
            _, logits = pipe(x).to_here()
            dist_autograd.backward(ctx, [logits.pow(2).sum()])
            grads = stage_gradients(pipe, ctx)
    assert grads.keys() == {"4.weight", "4.bias"}
    for name in grads:
        torch.testing.assert_close(grads[name], reference.get_parameter(name).grad)


def test_a_frozen_pipe_output_in_a_trained_loss_leaves_backward_free(cluster):
    """A frozen teacher pipe run in the training context (not under no_grad), its output in the loss of
    a module trained on the driver: backward completes. With the output not requiring grad, the step's
    sends were unreachable from the loss and backward never returned, as in the test above."""
    torch.manual_seed(11)
    teacher = _frozen(mlp([4, 6, 3]))
    student = torch.nn.Linear(4, 3)
    reference = twin(student)
    x = torch.randn(6, 4)
    torch.nn.functional.mse_loss(reference(x), teacher(x)).backward()
    with Pipe(teacher, chunks=2, balance=[1, 2], workers=cluster.names[:2]) as pipe:
        with dist_autograd.context() as ctx:
            target = pipe(x).local_value()
            loss = torch.nn.functional.mse_loss(student(x), target)
            dist_autograd.backward(ctx, [loss])
            got = dist_autograd.get_gradients(ctx)
    torch.testing.assert_close(got[student.weight], reference.weight.grad)
    torch.testing.assert_close(got[student.bias], reference.bias.grad)


@pytest.mark.parametrize("per_message", [2, 3])
@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_several_microbatches_per_message_match_plain_model(cluster, per_message, checkpoint):
    """5 micro-batches in messages of 2 (2+2+1) or 3 (3+2) between each pair of stages."""
    model = mlp([5, 8, 8, 6, 3])
    x = torch.randn(10, 5, requires_grad=True)
    with Pipe(model, chunks=5, checkpoint=checkpoint, balance=BALANCES[3], workers=cluster.names[:3],
              microbatches_per_message=per_message) as pipe:
        check_transparent(pipe, model, x)
        check_transparent(pipe, model, x)  # a second step reuses the stages' message state


def test_next_stage_starts_when_a_message_is_full(cluster):
    """With 2 micro-batches per message, stage 1 starts micro-batch 0 only after stage 0 ran 1."""
    model = mlp([5, 8, 8, 6, 3])
    with Pipe(model, chunks=4, balance=[3, 4], workers=cluster.names[:2], microbatches_per_message=2) as pipe:
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [pipe(torch.randn(8, 5)).local_value().sum()])
        forward = {(e.stage, e.microbatch): e for e in pipe.execution_record() if e.kind == "forward"}
    assert forward[(1, 0)].start >= forward[(0, 1)].end
    assert forward[(1, 2)].start >= forward[(0, 3)].end


def test_any_spelling_of_the_cpu_is_the_cpu(cluster):
    """'cpu:0' and torch.device('cpu') name the same device: stages on it need no crossing to the CPU."""
    model = mlp([5, 8, 3])
    with Pipe(model, chunks=2, balance=[1, 2], devices=["cpu:0", torch.device("cpu")],
              workers=cluster.names[:2]) as pipe:
        assert [s.device for s in pipe.stages] == ["cpu", "cpu"]
        check_transparent(pipe, model, torch.randn(4, 5, requires_grad=True))


def test_a_model_on_one_device_splits_evenly_over_the_named_workers(cluster):
    """``Pipe(model, workers=stage_workers)``, as under torchrun: no balance, no devices, every layer on
    the CPU; one stage per named worker, layers split as evenly as the count allows."""
    model = mlp([5, 8, 8, 6, 3])  # 7 layers
    with Pipe(model, chunks=4, workers=cluster.names[:3]) as pipe:
        assert pipe.balance == [3, 2, 2]
        assert [s.worker for s in pipe.stages] == cluster.names[:3]
        check_transparent(pipe, model, torch.randn(8, 5, requires_grad=True))
