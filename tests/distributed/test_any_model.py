"""Any model on stage workers (issue 43): a model captured with torch.export and cut at named submodules
computes what the plain model does, through ``pipe(x)`` + ``pipe.backward`` (GPipe's order) and through
``train_step``: outputs, losses, every parameter's gradient under the model's names (each copy of the GPT's
tied embedding/head holding the sum, as the plain model's one parameter does) and the parameters after
optimizer steps; clipping, state dicts, eval mode, BatchNorm statistics, ``set_stage`` marks, several
inputs with a dict output, and the interleaved schedule.

The GPT pipes are built once per (stages, checkpoint) (each build captures the model twice) and reset
from a plain model's state dict by each test. The one-process tests of the capture are in
tests/test_capture.py and tests/test_captured.py."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.optim import DistributedOptimizer

from examples.tiny_gpt import GPT
from rrefpipe import Pipe, set_stage
from tests.distributed.probes import stage_gradients
from tests.distributed.test_train_step import assert_same_state
from tests.test_capture import OneFlowExample, TwoInputs, UNet

pytestmark = [
    pytest.mark.timeout(120),
    # One 1F1B pipe serves both paths; pipe(x) + pipe.backward on it runs GPipe's order, as it warns.
    pytest.mark.filterwarnings(r"ignore:Pipe\(schedule='1F1B'\). pipe\(x\) followed by pipe.backward:UserWarning"),
]

GPT_SPLITS = {2: ["blocks.2"], 3: ["blocks.1", "blocks.3"]}
CHECKPOINTS = ("always", "except_last", "never")
PATHS = ("GPipe", "1F1B")  # pipe(x) + pipe.backward; pipe.train_step
Optimizer = tuple[type[torch.optim.Optimizer], dict[str, Any]]
SGD: Optimizer = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})
# Adam's step is lr * m / (sqrt(v) + eps): near a zero gradient it is lr / eps times the gradient's rounding,
# which differs where the pipe adds in another order (a tied parameter's copies, micro-batches); with the
# default eps 1e-8 that moved the GPT's output by 1e-4 after one step. eps 1e-4 bounds the factor at 100.
ADAM: Optimizer = (torch.optim.Adam, {"lr": 0.01, "eps": 1e-4})


def gpt(seed: int = 0, dropout: float = 0.0) -> GPT:
    torch.manual_seed(seed)
    return GPT(vocab=64, d=32, heads=2, layers=4, context=8, dropout=dropout)


def token_batches(steps: int, rows: int = 8, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """(tokens, next tokens) of shape (rows, 8)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 64, (rows, 8), generator=g), torch.randint(0, 64, (rows, 8), generator=g))
            for _ in range(steps)]


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


# -- the pipe's gradients under the model's names, and one training run beside the plain model ---------
def model_gradients(pipe: Pipe, ctx: int) -> dict[str, list[Tensor]]:
    """The context's gradients of a captured pipe's stages under the model's parameter names, one per
    copy: a tied parameter has a copy on each stage that uses it, listed under each of its names (the
    stages' names are ``'<j>.graph.<name>'``; ``state_keys[j]`` maps ``<name>`` to the model's keys)."""
    captured = pipe._captured
    assert captured is not None
    by_stage = stage_gradients(pipe, ctx)
    out: dict[str, list[Tensor]] = defaultdict(list)
    for j, names in enumerate(captured.state_keys):
        for name, keys in names.items():
            grad = by_stage.pop(f"{j}.graph.{name}", None)
            for key in keys if grad is not None else ():
                out[key].append(grad)
    assert not by_stage, f"gradients of no model parameter: {sorted(by_stage)}"
    for tied in captured.tied:  # every copy has one
        assert all(len(out[key]) == len(tied.names) for key in tied.keys), (tied, {k: len(out[k]) for k in tied.keys})
    return dict(out)


def assert_same_model_gradients(grads: dict[str, list[Tensor]], plain: nn.Module, what: str = "") -> None:
    """Every parameter of ``plain`` (under each of its names) has a gradient, and every copy of it in the
    pipe has that gradient: a tied one's copies each the sum, as the plain model's one parameter."""
    expected = {name: p.grad for name, p in plain.named_parameters(remove_duplicate=False)}
    assert all(g is not None for g in expected.values()), "the test's premise: every parameter gets a gradient"
    assert grads.keys() == expected.keys(), (what, sorted(grads), sorted(expected))
    for name, grad in expected.items():
        for copy_ in grads[name]:
            torch.testing.assert_close(copy_, grad, msg=lambda m, name=name: f"{what} {name}: {m}")


def call(model: nn.Module, args: tuple[Any, ...]) -> Any:
    return model(*args)


def train_captured_side_by_side(pipe: Pipe, plain: nn.Module, batches: Sequence[tuple[Any, Any]],
                                loss_fn: Callable[[Any, Any], Tensor], paths: Sequence[str], optimizer: Optimizer = SGD,
                                forward: Callable[[nn.Module, tuple[Any, ...]], Any] = call) -> None:
    """test_train_step's ``train_side_by_side`` for a captured pipe: gradients by the model's names, and
    step ``i`` through ``paths[i]`` (``'GPipe'``: ``pipe(*x)`` then ``pipe.backward``, whose output must
    equal the plain model's; ``'1F1B'``: ``train_step``), then ``DistributedOptimizer``; on the plain model
    ``forward(plain, args)`` gives the whole batch's output. At every step the loss and every gradient
    equal, and at the end every parameter and buffer."""
    assert len(paths) == len(batches)
    optimizer_class, options = optimizer
    opt = DistributedOptimizer(optimizer_class, pipe.parameter_rrefs(), **options)
    plain_opt = optimizer_class(plain.parameters(), **options)
    for step, ((x, target), path) in enumerate(zip(batches, paths)):
        args = x if isinstance(x, tuple) else (x,)
        plain_opt.zero_grad()
        expected = forward(plain, args)
        plain_loss = loss_fn(expected, target)
        plain_loss.backward()
        what = f"step {step} ({path})"
        with dist_autograd.context() as ctx:
            if path == "GPipe":
                out = pipe(*args).local_value()
                torch.testing.assert_close(out, expected, msg=lambda m: f"{what} output: {m}")
                loss = loss_fn(out, target)
                pipe.backward(ctx, loss)
            else:
                loss = pipe.train_step(ctx, x, target, loss_fn)
                assert not loss.requires_grad and loss.shape == ()
            grads = model_gradients(pipe, ctx)
            opt.step(ctx)
        torch.testing.assert_close(loss.detach(), plain_loss.detach(), msg=lambda m: f"{what} loss: {m}")
        assert_same_model_gradients(grads, plain, what)
        plain_opt.step()
    assert_same_state(pipe.state_dict(), plain)


# -- the GPT: every layout x checkpoint mode x path ----------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_pipes(cluster: Any) -> Iterator[Callable[[int, str], Pipe]]:
    """``get(stages, checkpoint)``: a 1F1B pipe of the GPT on the session's workers, built on first use
    and kept for the module (tests reset its state)."""
    pipes: dict[tuple[int, str], Pipe] = {}

    def get(stages: int, checkpoint: str) -> Pipe:
        if (stages, checkpoint) not in pipes:
            pipes[stages, checkpoint] = Pipe(gpt(), chunks=4, split_points=GPT_SPLITS[stages],
                                             sample=token_batches(1)[0][0], checkpoint=checkpoint, schedule="1F1B",
                                             workers=cluster.names[:stages])
        return pipes[stages, checkpoint]

    yield get
    for pipe in pipes.values():
        pipe.close()


def reset(pipe: Pipe, seed: int) -> GPT:
    """A plain GPT, whose state the pipe now holds (loaded strictly: the model's keys, both tied ones)."""
    plain = gpt(seed)
    pipe.load_state_dict(plain.state_dict())
    assert_same_state(pipe.state_dict(), plain)
    return plain


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("stages", [2, 3])
def test_gpt_outputs_losses_gradients_and_parameters_after_three_steps(gpt_pipes, stages, checkpoint, path):
    pipe = gpt_pipes(stages, checkpoint)
    assert pipe._captured is not None
    tied = pipe._captured.tied
    assert [sorted(t.names) for t in tied] == [[0, stages - 1]]  # the premise: the embedding/head on both ends
    plain = reset(pipe, seed=1)
    optimizer = SGD if path == "GPipe" else ADAM  # each path with each optimizer would double the time
    train_captured_side_by_side(pipe, plain, token_batches(3, seed=2), lm_loss, [path] * 3, optimizer)


def test_clip_grad_norm_counts_the_tied_parameter_once(gpt_pipes):
    pipe = gpt_pipes(3, "except_last")
    plain = reset(pipe, seed=3)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.5)
    for step, (x, y) in enumerate(token_batches(2, seed=4)):
        with dist_autograd.context() as ctx:
            if step == 0:
                pipe.backward(ctx, lm_loss(pipe(x).local_value(), y))
            else:
                pipe.train_step(ctx, x, y, lm_loss)
            total = pipe.clip_grad_norm_(ctx, 0.1)
            grads = model_gradients(pipe, ctx)
            opt.step(ctx)
        plain_opt.zero_grad()
        lm_loss(plain(x), y).backward()
        expected_total = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)  # tok.weight once
        assert expected_total > 0.1  # the premise: the gradients are clipped
        torch.testing.assert_close(total, expected_total)
        assert_same_model_gradients(grads, plain, f"step {step}, clipped")
        plain_opt.step()
    assert_same_state(pipe.state_dict(), plain)


def test_state_dict_round_trip_with_the_plain_model(gpt_pipes):
    """The plain model's state dict loads into the pipe (strict; every copy of the tied parameter: the
    output, which uses both ends, is the model's) and, after a step, the pipe's into a fresh plain model
    (strict), which then computes what the pipe does."""
    pipe = gpt_pipes(2, "never")
    plain = gpt(seed=5)
    pipe.load_state_dict(plain.state_dict())
    (x, y), = token_batches(1, seed=6)
    state = pipe.state_dict()
    assert list(state) == list(plain.state_dict())  # tok.weight and head.weight both, in the model's order
    assert_same_state(state, plain)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x).local_value(), plain(x))
    with dist_autograd.context() as ctx:
        pipe.train_step(ctx, x, y, lm_loss)
        DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.5).step(ctx)
    fresh = gpt(seed=7)
    fresh.load_state_dict(pipe.state_dict())  # strict
    assert fresh.head.weight is fresh.tok.weight
    assert not torch.equal(fresh.tok.weight, plain.tok.weight)  # the premise: the step changed it
    with torch.no_grad():
        torch.testing.assert_close(pipe(x).local_value(), fresh(x))


def test_eval_mode_runs_the_eval_graph(cluster):
    """Dropout 0.5: in eval mode the pipe's output is the plain model's in eval mode; in training mode
    (the premise) it is not."""
    model, plain = gpt(seed=8, dropout=0.5), gpt(seed=8, dropout=0.5).eval()
    (x, _), = token_batches(1, seed=9)
    with Pipe(model, chunks=2, split_points=GPT_SPLITS[2], sample=x, workers=cluster.names[:2]) as pipe:
        with torch.no_grad():
            expected = plain(x)
            assert not torch.allclose(pipe(x).local_value(), expected)  # training mode: dropout
            pipe.eval()
            torch.testing.assert_close(pipe(x).local_value(), expected)


# -- other models --------------------------------------------------------------------------------------------
def micro_batch_by_micro_batch(chunks: int) -> Callable[[nn.Module, tuple[Any, ...]], Tensor]:
    """The plain model run on each micro-batch in turn: BatchNorm normalizes by each micro-batch's
    statistics and updates its running statistics once per micro-batch, in order, as each stage does."""
    def forward(model: nn.Module, args: tuple[Any, ...]) -> Tensor:
        (x,) = args
        return torch.cat([model(c) for c in x.chunk(chunks)])
    return forward


@pytest.mark.parametrize(("split_points", "checkpoint"), [(["bottom"], "never"), (["down2", "up1"], "always")])
def test_unet_with_batch_norm_and_long_skips(cluster, split_points, checkpoint):
    """The encoder's features cross to the decoder (on the 3-stage layout, from stage 0 past stage 1);
    two steps, one through each path: outputs, gradients and parameters equal, and the BatchNorm
    running statistics (recomputation must not update them again), which then give the same eval output."""
    chunks = 4
    torch.manual_seed(10)
    model = UNet()
    plain = UNet()
    plain.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(11)
    batches = [(torch.randn(8, 3, 16, 16, generator=g) * (1 + step), torch.randn(8, 2, 16, 16, generator=g))
               for step in range(2)]
    with Pipe(model, chunks=chunks, split_points=split_points, sample=batches[0][0][:2], checkpoint=checkpoint,
              schedule="1F1B", workers=cluster.names[:len(split_points) + 1]) as pipe:
        assert pipe._captured is not None
        assert [j for _, j in pipe._captured.captured.skips()] == [2] * (len(split_points) == 2)  # f1: 0 > 2
        train_captured_side_by_side(pipe, plain, batches, F.mse_loss, PATHS, forward=micro_batch_by_micro_batch(chunks))
        assert pipe.state_dict()["down1.1.num_batches_tracked"].item() == 2 * chunks
        pipe.eval()
        plain.eval()
        x = torch.randn(3, 3, 16, 16, generator=g)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value(), plain(x))


def test_oneflow_example_marked_with_set_stage(cluster):
    torch.manual_seed(12)
    model, plain = OneFlowExample(), OneFlowExample()
    plain.load_state_dict(model.state_dict())
    set_stage(model.m_stage0, 0)
    set_stage(model.m_stage1, 1)
    g = torch.Generator().manual_seed(13)
    batches = [(torch.randn(6, 1, 28, 28, generator=g), torch.randint(0, 10, (6,), generator=g)) for _ in range(3)]
    with Pipe(model, chunks=2, sample=batches[0][0], schedule="1F1B", workers=cluster.names[:2]) as pipe:
        assert len(pipe.stages) == 2
        train_captured_side_by_side(pipe, plain, batches, F.cross_entropy, ["GPipe", "1F1B", "GPipe"])


def logits_loss(out: dict[str, Tensor], target: Tensor) -> Tensor:
    """A loss that reads the model's dict output."""
    return F.cross_entropy(out["logits"].flatten(0, 1), target.flatten())


def test_several_positional_inputs_and_a_dict_output(cluster):
    """``pipe(idx, pos, mask)`` returns the model's dict; ``train_step`` takes the three inputs as a tuple
    and its loss function gets the dict."""
    torch.manual_seed(14)
    model, plain = TwoInputs(), TwoInputs()
    plain.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(15)
    batches = [((torch.randint(0, 10, (6, 5), generator=g), torch.randint(0, 10, (6, 5), generator=g),
                 torch.rand(6, 5, generator=g)), torch.randint(0, 8, (6, 5), generator=g)) for _ in range(3)]
    with Pipe(model, chunks=3, split_points=["b"], sample=batches[0][0], schedule="1F1B",
              workers=cluster.names[:2]) as pipe:
        with torch.no_grad():
            out = pipe(*batches[0][0]).local_value()
        assert isinstance(out, dict) and list(out) == ["logits", "hidden"]
        train_captured_side_by_side(pipe, plain, batches, logits_loss, ["GPipe", "1F1B", "1F1B"])


def test_interleaved_gpt_with_the_tied_copies_on_two_workers(cluster):
    """4 stages, 2 per worker: the embedding (stage 0) on worker 0, its tied head (stage 3) on worker 1."""
    w0, w1 = cluster.names[:2]
    model, plain = gpt(seed=16), gpt(seed=16)
    with Pipe(model, chunks=4, split_points=["blocks.1", "blocks.2", "blocks.3"], sample=token_batches(1)[0][0],
              schedule="Interleaved1F1B", stages_per_worker=2, workers=[w0, w1]) as pipe:
        assert [s.worker for s in pipe.stages] == [w0, w1, w0, w1]
        assert pipe._captured is not None and [sorted(t.names) for t in pipe._captured.tied] == [[0, 3]]
        train_captured_side_by_side(pipe, plain, token_batches(1, seed=17), lm_loss, ["1F1B"], ADAM)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble"])
def test_zero_bubble_gpt_with_the_tied_copies(cluster, schedule):
    """4 stages, 2 per worker, each backward split in two: in the V (ZBVZeroBubble) the embedding (stage 0)
    and its tied head (stage 3) are both on worker 0; in the loop (InterleavedZeroBubble) on two workers."""
    w0, w1 = cluster.names[:2]
    model, plain = gpt(seed=18), gpt(seed=18)
    with Pipe(model, chunks=4, split_points=["blocks.1", "blocks.2", "blocks.3"], sample=token_batches(1)[0][0],
              schedule=schedule, stages_per_worker=2, workers=[w0, w1]) as pipe:
        v_shaped = schedule == "ZBVZeroBubble"
        assert [s.worker for s in pipe.stages] == ([w0, w1, w1, w0] if v_shaped else [w0, w1, w0, w1])
        assert pipe._captured is not None and [sorted(t.names) for t in pipe._captured.tied] == [[0, 3]]
        train_captured_side_by_side(pipe, plain, token_batches(2, seed=19), lm_loss, ["1F1B"] * 2, ADAM)
