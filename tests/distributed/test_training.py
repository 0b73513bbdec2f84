"""A real training run through the pipe reaches the same losses as plain PyTorch with the same seed."""
import contextlib
import warnings

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch.distributed.optim import DistributedOptimizer

from rrefpipe import Pipe
from tests.distributed.probes import check_transparent, stage_gradients
from tests.layers import UNREACHED_CASES, Parent, mlp, partly_unreached, twin
from tests.training import blobs, train_side_by_side

pytestmark = pytest.mark.timeout(180)


def test_200_steps_match_plain_training(cluster):
    model = mlp([10, 32, 32, 4], seed=7)  # 5 layers
    reference = twin(model)
    with Pipe(model, chunks=4, balance=[2, 3], workers=cluster.names[:2]) as pipe:
        pipe_losses, plain_losses = train_side_by_side(pipe, reference, blobs(200, 32))
        trained = pipe.state_dict()
    assert pipe_losses[-1] < 0.5 * pipe_losses[0]  # it learned
    torch.testing.assert_close(torch.tensor(pipe_losses), torch.tensor(plain_losses), rtol=1e-3, atol=1e-4)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value, rtol=1e-3, atol=1e-4)


def test_gradient_accumulation_over_several_forwards(cluster):
    """Several forwards in one context, one backward over the summed loss (dist autograd allows one
    backward per context), then one optimizer step."""
    model = mlp([10, 16, 4], seed=3)
    reference = twin(model)
    batches = list(blobs(3, 12, seed=5))
    with Pipe(model, chunks=3, balance=[1, 2], workers=cluster.names[:2]) as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        with dist_autograd.context() as ctx:
            total = sum(F.cross_entropy(pipe(x).local_value(), y) for x, y in batches)
            dist_autograd.backward(ctx, [total])
            opt.step(ctx)
        updated = pipe.state_dict()
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    sum(F.cross_entropy(reference(x), y) for x, y in batches).backward()
    plain_opt.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(updated[key], value)


def test_old_style_optimizer_second_backward_and_unused_forward_are_refused_at_once(cluster):
    """pipe.parameters() had been empty (an optimizer over it trained nothing, silently); a second
    backward in one context, or a forward of the context left out of the loss, had waited for the
    RPC timeout. The pipe then trains normally."""
    model = mlp([10, 16, 4], seed=3)
    reference = twin(model)
    (x, y), = blobs(1, 12, seed=5)
    with Pipe(model, chunks=3, balance=[1, 2], workers=cluster.names[:2]) as pipe:
        with pytest.raises(TypeError, match=r"parameter_rrefs\(\)"):
            torch.optim.SGD(pipe.parameters(), lr=0.1)
        with pytest.raises(TypeError, match=r"pipe.clip_grad_norm_\(context_id, max_norm\)"):
            torch.nn.utils.clip_grad_norm_(pipe.parameters(), 1.0)
        pipe.zero_grad()  # old training loops call it: nothing to zero on the workers
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, F.cross_entropy(pipe(x).local_value(), y))
            with pytest.raises(RuntimeError, match="one backward per context"):
                pipe.backward(ctx, F.cross_entropy(pipe(x).local_value(), y))
        with dist_autograd.context() as ctx:
            loss = F.cross_entropy(pipe(x).local_value(), y)
            metric = pipe(x).local_value()  # a metric, say, computed with gradients on
            for _ in range(2):  # refused again when retried, not waited out
                with pytest.raises(RuntimeError, match="forward 2 of 2 of this pipe .* is not part of the loss"):
                    pipe.backward(ctx, loss)
            pipe.backward(ctx, loss + 0 * metric.sum())  # both forwards in the loss: it runs
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, F.cross_entropy(pipe(x).local_value(), y))
            opt.step(ctx)
        updated = pipe.state_dict()
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    F.cross_entropy(reference(x), y).backward()
    plain_opt.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(updated[key], value)


def test_a_loss_that_uses_no_kept_output_is_refused_at_once(cluster):
    """remote_output=True and a loss that reaches no fetched output (the student's loss alone, the
    teacher's output never fetched): plain dist_autograd.backward would never return, as nothing is in
    flight for the RPC timeout to end. pipe.backward refuses it, again when retried, and the pipe then
    trains as the plain model does."""
    model = mlp([10, 16, 4], seed=3)
    reference = twin(model)
    student = torch.nn.Linear(10, 4)
    (x, y), = blobs(1, 12, seed=5)
    with Pipe(model, chunks=3, balance=[1, 2], workers=cluster.names[:2], remote_output=True) as pipe:
        with dist_autograd.context() as ctx:
            pipe(x)
            for _ in range(2):
                with pytest.raises(RuntimeError, match=r"the loss uses no output of the 1 forward\(s\) of this pipe"):
                    pipe.backward(ctx, F.cross_entropy(student(x), y))
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, F.cross_entropy(pipe(x).to_here(), y))
            grads = stage_gradients(pipe, ctx)
    F.cross_entropy(reference(x), y).backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("remote", [False, True], ids=["delivered", "kept"])
def test_a_teacher_pipe_whose_output_the_loss_detaches_is_refused_by_the_students_backward(cluster, remote):
    """Distillation with a frozen teacher pipe run with gradients in the step's context, its output
    detached as the target: no gradient reaches the teacher's sends, and the student's backward waited
    for them for ever (the student knew only its own forwards). Any pipe's backward now checks every
    pipe's forwards in the context; a second backward there, by either pipe, is refused too. With the
    teacher under no_grad the student's gradients are the plain ones.
    With the teacher's output kept on its last worker (remote_output=True) the driver cannot tell that
    output from others: the fetched message's receive node, which the loss does not reach, says so, and
    a second fetch of it, in the loss, does not hide the first."""
    teacher_model = mlp([10, 16, 4], seed=4)
    student_model = mlp([10, 16, 4], seed=3)
    reference = twin(student_model)
    (x, _), = blobs(1, 12, seed=5)
    F.mse_loss(reference(x), teacher_model(x).detach()).backward()
    with Pipe(teacher_model, chunks=3, balance=[1, 2], workers=cluster.names[:2], remote_output=remote) as teacher, \
            Pipe(student_model, chunks=3, balance=[1, 2], workers=cluster.names[2:4]) as student:
        teacher_id = teacher._driver.pipe_id
        with dist_autograd.context() as ctx:
            target = teacher(x).to_here().detach()
            loss = F.mse_loss(student(x).local_value(), target)
            refusal = (f"1 of the 1 tensor message.s. fetched in autograd context {ctx} from '{cluster.names[1]}', "
                       f"the last worker of pipe {teacher_id} .* not part of the loss" if remote else
                       f"forward 1 of 1 of pipe {teacher_id} in autograd context {ctx} is not part of the loss")
            for _ in range(2):  # refused again when retried, not waited out
                with pytest.raises(RuntimeError, match=refusal):
                    student.backward(ctx, loss)
        if remote:
            with dist_autograd.context() as ctx:
                rref = teacher(x)
                target, used = rref.to_here().detach(), rref.to_here()
                with pytest.raises(RuntimeError, match="1 of the 2 tensor message.s. fetched"):
                    student.backward(ctx, F.mse_loss(student(x).local_value(), target) + 0 * used.sum())
        with dist_autograd.context() as ctx:
            with torch.no_grad():
                target = teacher(x).to_here()
            student.backward(ctx, F.mse_loss(student(x).local_value(), target))
            grads = stage_gradients(student, ctx)
            with pytest.raises(RuntimeError, match=f"pipe {student._driver.pipe_id} already ran a backward"):
                teacher.backward(ctx, F.mse_loss(student(x).local_value(), target))
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m: f"{name}: {m}")


class ArgMax(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=1)


@pytest.mark.parametrize("remote", [False, True], ids=["delivered", "kept"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_labels_from_a_pipe_train_a_student(cluster, checkpoint, remote):
    """A teacher pipe that outputs integer labels, run with gradients on in the step's context, and a
    second pipe (the student) trained on them: no loss can reach the teacher's sends, and backward never
    returned. pipe.backward reaches them (the student's, though it knows nothing of the teacher), plain
    dist_autograd.backward would not: the forward warns. The student's gradients are the plain ones.
    Labels kept on the teacher's last worker (remote_output=True) too: backward waited for their sends
    until the RPC timeout, as the last stage kept what reaches them."""
    teacher_model = torch.nn.Sequential(*mlp([10, 16, 4], seed=4), ArgMax())
    student_model = mlp([10, 16, 4], seed=3)
    reference = twin(student_model)
    (x, _), = blobs(1, 12, seed=5)
    F.cross_entropy(reference(x), teacher_model(x)).backward()
    with Pipe(teacher_model, chunks=3, balance=[2, 2], workers=cluster.names[:2], checkpoint=checkpoint,
              remote_output=remote) as teacher, \
            Pipe(student_model, chunks=3, balance=[1, 2], workers=cluster.names[2:4], checkpoint=checkpoint) as student:
        for step in range(2):  # the teacher's workers are ready for the next step
            with dist_autograd.context() as ctx:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    labels = teacher(x).to_here()
                warned = [str(w.message) for w in caught if "cannot carry a gradient" in str(w.message)]
                assert len(warned) == (0 if step else 1), warned  # once per pipe
                assert all("plain dist_autograd.backward would wait for them for ever" in w for w in warned)
                loss = F.cross_entropy(student(x).local_value(), labels)
                with torch.no_grad() if step else contextlib.nullcontext():  # pipe.backward works under both
                    student.backward(ctx, loss)
                grads = stage_gradients(student, ctx)
                assert stage_gradients(teacher, ctx) == {}  # none reach it, as in the plain module
            for name, p in reference.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("case", UNREACHED_CASES)
def test_parameters_the_loss_does_not_reach_get_no_gradient_as_in_one_process(cluster, case, checkpoint):
    """Distributed autograd sends zeros for every tensor of a message that the receiver did not use, and
    the sending stage ran its backward on them: parameters the loss never reached got zero gradients,
    and weight decay still moved them where plain PyTorch leaves them alone. A stage's input that its
    layers leave out, or a head the loss leaves out, now gives no gradient, as in one process."""
    model, balance = partly_unreached(case)
    reference = twin(model)
    (x, y), = blobs(1, 12, seed=5)

    def loss_of(out):
        return F.cross_entropy(out[0] if isinstance(out, tuple) else out, y)

    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    loss_of(reference(x)).backward()
    plain_opt.step()
    with Pipe(model, chunks=3, balance=balance, workers=cluster.names[:2], checkpoint=checkpoint) as pipe:
        check_transparent(pipe, model, x, loss_of=loss_of)
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1, momentum=0.9, weight_decay=0.1)
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, loss_of(pipe(x).local_value()))
            opt.step(ctx)
        updated = pipe.state_dict()
    for key, value in reference.state_dict().items():  # weight decay left the unreached ones alone
        torch.testing.assert_close(updated[key], value, msg=lambda m: f"{key}: {m}")


def test_a_local_backward_of_the_output_says_what_to_call(cluster):
    """``loss.backward()``, what PyTorch's Pipe took, cannot reach the stage workers: it fails at once,
    naming distributed autograd's calls (torch's own error was an internal assert), and the pipe then
    trains as the plain model does."""
    model = mlp([10, 16, 4], seed=3)
    reference = twin(model)
    (x, y), = blobs(1, 12, seed=5)
    with Pipe(model, chunks=3, balance=[1, 2], workers=cluster.names[:2]) as pipe:
        with dist_autograd.context():
            loss = F.cross_entropy(pipe(x).local_value(), y)
            with pytest.raises(RuntimeError, match=r"run pipe.backward\(ctx, loss\) or dist_autograd.backward"):
                loss.backward()
        check_transparent(pipe, reference, x.clone().requires_grad_())


def test_state_dict_round_trip_and_train_eval_reach_workers(cluster):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 2))
    with Pipe(model, chunks=2, balance=[2, 1], workers=cluster.names[:2]) as pipe:
        assert list(pipe.state_dict()) == list(model.state_dict())
        new = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
        pipe.load_state_dict(new)
        for key, value in pipe.state_dict().items():
            torch.testing.assert_close(value, new[key])
        model.load_state_dict(new)
        x = torch.randn(6, 4)
        pipe.eval()  # dropout off on the worker: deterministic and equal to the plain model in eval
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value(), model.eval()(x))
        with pytest.raises(RuntimeError, match='Unexpected key.*"9.weight"'):
            pipe.load_state_dict({"9.weight": torch.zeros(1)})


def test_state_dicts_of_a_module_holding_a_pipe_reach_the_workers(cluster):
    """A parent module's state_dict and load_state_dict (nn.Module's own) go through the pipe's stages
    under the parent's prefix; what does not fit is reported as nn.Module reports it, naming the stage."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))

    with Pipe(model, chunks=2, balance=[2, 1], workers=cluster.names[:2]) as pipe:
        parent = Parent(pipe, width=4)
        assert list(parent.state_dict()) == ["head.weight", "head.bias"] + ["pipe." + k for k in model.state_dict()]
        new = {k: torch.randn_like(v) for k, v in parent.state_dict().items()}
        assert parent.load_state_dict(new) is not None  # nn.Module's _IncompatibleKeys
        for key, value in pipe.state_dict().items():
            torch.testing.assert_close(value, new["pipe." + key])
        x = torch.randn(6, 4)
        model.load_state_dict({k[len("pipe."):]: v for k, v in new.items() if k.startswith("pipe.")})
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value(), model(x))

        partial = {k: v for k, v in new.items() if k != "pipe.2.bias"}
        with pytest.raises(RuntimeError, match='Missing key.*"pipe.2.bias"'):
            parent.load_state_dict(partial)
        result = parent.load_state_dict({**partial, "pipe.7.weight": torch.zeros(1)}, strict=False)
        assert result.missing_keys == ["pipe.2.bias"] and result.unexpected_keys == ["pipe.7.weight"]
        with pytest.raises(RuntimeError, match="stage 1 on worker 'worker2': .*size mismatch for 2.weight"):
            pipe.load_state_dict({**model.state_dict(), "2.weight": torch.zeros(3, 3)})


def test_layer_versions_in_a_checkpoint_reach_the_stages(cluster):
    """A state dict carries each layer's version, which layers read old checkpoints by: the pipe loads
    as the plain module does. BatchNorm's num_batches_tracked is missing from a current checkpoint (an
    error, as for the plain module) and expected missing from a version 1 one (BatchNorm adds it)."""
    def batch_norm_model() -> torch.nn.Sequential:
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))

    with Pipe(batch_norm_model(), chunks=2, balance=[2, 1], workers=cluster.names[:2]) as pipe:
        plain = batch_norm_model()
        current = plain.state_dict()
        without = type(current)((k, v) for k, v in current.items() if k != "1.num_batches_tracked")
        without._metadata = current._metadata
        for module in (plain, pipe):
            with pytest.raises(RuntimeError, match='Missing key.*"1.num_batches_tracked"'):
                module.load_state_dict(without)
        without._metadata = type(current._metadata)(current._metadata)
        without._metadata["1"] = {**current._metadata["1"], "version": 1}
        for module in (plain, pipe):
            result = module.load_state_dict(without)
            assert result.missing_keys == [] and result.unexpected_keys == []
        torch.testing.assert_close(pipe.state_dict()["1.num_batches_tracked"], torch.tensor(0))
