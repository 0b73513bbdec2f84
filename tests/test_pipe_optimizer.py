"""The pipe's own optimizer (``pipe_optimizer.build(pipe, cls, **kwargs)``, ``pipe.optimizer``): one regular
torch optimizer per stage on the stage's worker. Its steps equal ``DistributedOptimizer``'s bit for bit and
plain PyTorch's; its param groups, state dicts (keyed by ``pipe.state_dict()``'s names, a captured model's
tied copies included) and schedulers; its errors, and what it leaves on the workers (nothing, once closed).

Two pipes of one MLP are built once for the module (one trained each way) and reset by each test; the
captured model's test builds its own; a pipe in one process (``LocalDriver``) runs here beside them."""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.optim import DistributedOptimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

import rrefpipe.optim
from rrefpipe import Pipe, StageError
from rrefpipe.stage_side import stage_optim
from rrefpipe.driver_side import pipe_optimizer
from rrefpipe.driver_side.local import LocalDriver
from rrefpipe.optim import RemoteLRScheduler
from rrefpipe.partition import split_module
from tests.layers import mlp
from tests.training import blobs, plain_steps

pytestmark = pytest.mark.timeout(120)

WIDTHS = [10, 16, 16, 4]  # layers 0, 2 and 4 have parameters; stage 0 holds layer 0, stage 1 layers 2 and 4
Batches = Sequence[tuple[Tensor, Tensor]]


def _registered(pipe_id: str) -> list[tuple[int, int]]:
    """On a stage worker: (optimizer id, stage) of the pipe's optimizers there, and its optimizers' locks."""
    from rrefpipe.stage_side import stage_optim

    stages = [(opt_id, j) for pid, opt_id, j in stage_optim._stages if pid == pipe_id]
    locks = [(opt_id, -1) for pid, opt_id in stage_optim._locks if pid == pipe_id]
    return sorted(stages + locks)


def _parameter(pipe_id: str, j: int, name: str) -> Tensor:
    """On a stage worker: a parameter of stage ``j`` (by its name there), on the CPU."""
    from rrefpipe.stage_side.server import _server

    return _server(pipe_id, j).stage.module.get_parameter(name).detach().cpu().clone()


def left_on_workers(pipe: Pipe) -> list[tuple[int, int]]:
    driver = pipe._driver
    return [entry for worker in dict.fromkeys(driver.workers)
            for entry in rpc.rpc_sync(worker, _registered, args=(driver.pipe_id,))]


def train(pipe: Pipe, step: Callable[[int], None], batches: Batches, loss_fn: Any = F.cross_entropy,
          after: Callable[[], None] | None = None) -> None:
    """``train_step`` then ``step(context_id)`` (then ``after()``) per batch."""
    for x, y in batches:
        with dist_autograd.context() as ctx:
            pipe.train_step(ctx, x, y, loss_fn)
            step(ctx)
        if after is not None:
            after()


def assert_equal_states(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def pipes(cluster: Any) -> Iterator[tuple[Pipe, Pipe]]:
    first = Pipe(mlp(WIDTHS), chunks=2, balance=[2, 3], workers=cluster.names[:2])
    second = Pipe(mlp(WIDTHS), chunks=2, balance=[2, 3], workers=cluster.names[:2])  # (workers warmed up once)
    yield first, second
    first.close()
    second.close()


def reset(pipe: Pipe, seed: int) -> nn.Module:
    """A plain model whose parameters the pipe now holds."""
    plain = mlp(WIDTHS, seed=seed)
    pipe.load_state_dict(plain.state_dict())
    return plain


@pytest.mark.parametrize("cls, rrefpipe_cls, options", [
    (torch.optim.SGD, rrefpipe.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adam, rrefpipe.optim.Adam, {"lr": 0.01}),
], ids=["SGD-momentum", "Adam"])
def test_steps_equal_distributed_optimizer_bit_for_bit_and_plain_training(pipes, cls, rrefpipe_cls, options):
    ours, theirs = pipes
    plain = reset(ours, seed=1)
    reset(theirs, seed=1)
    batches = list(blobs(3, 8, seed=5))
    with pipe_optimizer.build(ours, cls, **options) as opt:
        train(ours, opt.step, batches)
    dist_opt = DistributedOptimizer(rrefpipe_cls, theirs.parameter_rrefs(), **options)
    train(theirs, dist_opt.step, batches)
    assert_equal_states(ours.state_dict(), theirs.state_dict())
    plain_steps(plain, cls(plain.parameters(), **options), None, batches)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value)
    assert left_on_workers(ours) == []  # closed by the with block


def test_param_groups_are_snapshots_and_writes_reach_the_workers(pipes):
    pipe, _ = pipes
    plain = reset(pipe, seed=2)
    batches = list(blobs(2, 8, seed=6))
    with pipe_optimizer.build(pipe, torch.optim.SGD, lr=0.1, momentum=0.9) as opt:
        groups = opt.param_groups
        assert [g["names"] for g in groups] == [["0.weight", "0.bias"], ["2.weight", "2.bias", "4.weight", "4.bias"]]
        assert [(g.stage, g.group) for g in groups] == [(0, 0), (1, 0)]
        assert groups[0]["lr"] == 0.1 and groups[0]["momentum"] == 0.9 and "params" not in groups[0]
        train(pipe, opt.step, batches[:1])
        for g in groups:
            g["lr"] *= 0.1
        stale = opt.param_groups[1]
        groups[1]["lr"] = 0.005  # stage 1 only
        assert stale["lr"] == pytest.approx(0.01)  # read when it was taken
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01, 0.005])
        with pytest.raises(KeyError, match="cannot be set"):
            groups[0]["names"] = ["0.weight"]
        train(pipe, opt.step, batches[1:])
    plain_opt = torch.optim.SGD([{"params": plain[0].parameters()},
                                 {"params": [*plain[2].parameters(), *plain[4].parameters()]}], lr=0.1, momentum=0.9)
    plain_steps(plain, plain_opt, None, batches[:1])
    plain_opt.param_groups[0]["lr"], plain_opt.param_groups[1]["lr"] = 0.01, 0.005
    plain_steps(plain, plain_opt, None, batches[1:])
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], value)


def test_a_saved_state_resumes_exactly_in_a_fresh_pipe_and_optimizer(pipes, cluster):
    pipe, _ = pipes
    reset(pipe, seed=3)
    batches = list(blobs(4, 8, seed=7))
    with pipe_optimizer.build(pipe, torch.optim.Adam, lr=0.01) as opt:
        train(pipe, opt.step, batches[:2])
        saved_model, saved = pipe.state_dict(), opt.state_dict()
        train(pipe, opt.step, batches[2:])
    uninterrupted = pipe.state_dict()
    assert list(saved["state"]) == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert [g["params"] for g in saved["param_groups"]] == [["0.weight", "0.bias"],
                                                            ["2.weight", "2.bias", "4.weight", "4.bias"]]
    assert saved["param_groups"][0]["lr"] == 0.01
    assert all(t.device.type == "cpu" for s in saved["state"].values() for t in s.values())
    with Pipe(mlp(WIDTHS), chunks=2, balance=[2, 3], workers=cluster.names[:2]) as fresh:
        fresh.load_state_dict(saved_model)
        opt = pipe_optimizer.build(fresh, torch.optim.Adam, lr=0.01)
        opt.load_state_dict(saved)
        train(fresh, opt.step, batches[2:])
        assert_equal_states(fresh.state_dict(), uninterrupted)
        pipe_optimizer.close_all(fresh)  # the pipe's close hook
        assert opt.closed and left_on_workers(fresh) == []


def test_a_state_that_does_not_fit_is_refused_before_anything_is_loaded(pipes):
    pipe, _ = pipes
    reset(pipe, seed=4)
    with pipe_optimizer.build(pipe, torch.optim.SGD, lr=0.1, momentum=0.9) as opt:
        train(pipe, opt.step, list(blobs(1, 8, seed=8)))
        before = opt.state_dict()
        renamed = copy.deepcopy(before)
        renamed["param_groups"][1]["params"][2] = "5.weight"
        with pytest.raises(ValueError, match=r"group 1 of the state holds '5.weight' where this optimizer's holds "
                                             r"'4.weight'"):
            opt.load_state_dict(renamed)
        reshaped = copy.deepcopy(before)
        reshaped["state"]["4.bias"]["momentum_buffer"] = torch.zeros(5)
        reshaped["state"]["0.bias"]["momentum_buffer"] += 1  # would load first, were anything loaded early
        with pytest.raises(ValueError, match=r"'momentum_buffer' of '4.bias' has shape \[5\], the parameter \[4\]"):
            opt.load_state_dict(reshaped)
        with pytest.raises(ValueError, match="the state has 1 parameter groups, this optimizer 2"):
            opt.load_state_dict({"state": {}, "param_groups": before["param_groups"][:1]})
        after = opt.state_dict()
        assert_equal_states({k: v["momentum_buffer"] for k, v in after["state"].items()},
                            {k: v["momentum_buffer"] for k, v in before["state"].items()})


def test_a_step_lr_schedule_follows_the_plain_one(pipes):
    pipe, _ = pipes
    plain = reset(pipe, seed=5)
    batches = list(blobs(3, 8, seed=9))
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.2, momentum=0.9)
    plain_sched = StepLR(plain_opt, step_size=1, gamma=0.5)
    with pipe_optimizer.build(pipe, torch.optim.SGD, lr=0.2, momentum=0.9) as opt:
        sched = RemoteLRScheduler(opt, StepLR, step_size=1, gamma=0.5)
        lrs: list[list[float]] = []
        train(pipe, opt.step, batches, after=lambda: (sched.step(), lrs.append([g["lr"] for g in opt.param_groups])))
        assert sched.get_last_lr() == pytest.approx([0.025, 0.025])  # one group per stage
        saved = sched.state_dict()
        assert len(saved) == 2 and saved[0]["last_epoch"] == 3
        sched.load_state_dict(saved)
        with pytest.raises(ValueError, match="one per stage as saved"):
            sched.load_state_dict(saved[:1])
    expected = []
    for x, y in batches:
        plain_steps(plain, plain_opt, plain_sched, [(x, y)])
        expected.append(plain_sched.get_last_lr() * 2)
    assert [lr for step in lrs for lr in step] == pytest.approx([lr for step in expected for lr in step])
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], value)


class _RefusesBiasesOf4(torch.optim.SGD):
    """Fails on the stage that holds the last layer only (its bias has 4 elements)."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        params = list(params)
        if any(p.shape == (4,) for p in params):
            raise ValueError("no biases of 4")
        super().__init__(params, **kwargs)


def test_build_errors_name_the_stage_and_worker_and_leave_nothing_built(pipes):
    pipe, _ = pipes
    workers = pipe._driver.workers
    with pytest.raises(TypeError, match=rf"stage 0 on worker '{workers[0]}' failed in build_optimizer: TypeError: "
                                        r"pipe.optimizer takes a torch.optim.Optimizer subclass") as info:
        pipe_optimizer.build(pipe, dict, lr=0.1)
    assert isinstance(info.value, StageError)
    with pytest.raises(ValueError, match=rf"stage 0 on worker '{workers[0]}' failed in build_optimizer: ValueError: "
                                         "Invalid learning rate"):
        pipe_optimizer.build(pipe, torch.optim.SGD, lr=-1.0)
    with pytest.raises(StageError, match=rf"stage 1 on worker '{workers[1]}' .* no biases of 4"):
        pipe_optimizer.build(pipe, _RefusesBiasesOf4, lr=0.1)  # stage 0's was built, and is dropped
    assert left_on_workers(pipe) == []


def test_after_close_the_workers_hold_nothing_and_calls_raise(pipes):
    pipe, _ = pipes
    opt = pipe_optimizer.build(pipe, torch.optim.SGD, lr=0.1)
    sched = RemoteLRScheduler(opt, StepLR, step_size=1)
    assert sorted(left_on_workers(pipe)) == [(opt.id, -1), (opt.id, -1), (opt.id, 0), (opt.id, 1)]  # a lock each
    opt.close()
    opt.close()  # twice is fine
    assert left_on_workers(pipe) == []
    for call in (opt.zero_grad, lambda: opt.param_groups, opt.state_dict, sched.step):
        with pytest.raises(RuntimeError, match="this PipeOptimizer is closed"):
            call()


def test_two_stages_per_worker_step_as_distributed_optimizer(cluster):
    """Interleaved1F1B: stages 0 and 2 on one worker, 1 and 3 on the other, one optimizer per stage."""
    batches = list(blobs(2, 8, seed=10))
    with Pipe(mlp(WIDTHS, seed=8), chunks=2, balance=[1, 1, 1, 2], schedule="Interleaved1F1B", stages_per_worker=2,
              workers=cluster.names[:2]) as ours, \
            Pipe(mlp(WIDTHS, seed=8), chunks=2, balance=[1, 1, 1, 2], schedule="Interleaved1F1B",
                 stages_per_worker=2, workers=cluster.names[:2]) as theirs:
        with pipe_optimizer.build(ours, torch.optim.SGD, lr=0.1, momentum=0.9) as opt:
            assert [g["names"] for g in opt.param_groups] == [["0.weight", "0.bias"], [], ["2.weight", "2.bias"],
                                                              ["4.weight", "4.bias"]]
            train(ours, opt.step, batches)
        dist_opt = DistributedOptimizer(rrefpipe.optim.SGD, theirs.parameter_rrefs(), lr=0.1, momentum=0.9)
        train(theirs, dist_opt.step, batches)
        assert_equal_states(ours.state_dict(), theirs.state_dict())


def test_a_pipe_dropped_without_closing_leaves_its_optimizers_until_the_next_build(pipes, cluster):
    """The driver closes a pipe garbage-collected unclosed (``placement.close_abandoned``) without its
    optimizers: the next build on the worker drops those of pipes it no longer holds a stage of."""
    dropped = Pipe(mlp(WIDTHS), chunks=2, balance=[2, 3], workers=cluster.names[:2])
    opt = pipe_optimizer.build(dropped, torch.optim.SGD, lr=0.1)
    dropped._driver.close()
    assert len(left_on_workers(dropped)) == 4
    pipe_optimizer.build(pipes[0], torch.optim.SGD, lr=0.1).close()
    assert left_on_workers(dropped) == []
    with pytest.raises(RuntimeError, match="the Pipe of this PipeOptimizer is closed"):
        opt.zero_grad()
    dropped.close()


def test_a_captured_models_tied_copies_are_saved_once_and_loaded_into_each(cluster):
    """The tiny GPT's embedding is tied to its head: stage 0 and stage 1 each hold a copy."""
    from examples.tiny_gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab=32, d=16, heads=2, layers=2, context=4)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 32, (4, 4), generator=g), torch.randint(0, 32, (4, 4), generator=g))
               for _ in range(4)]

    def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    with Pipe(model, chunks=2, split_points=["blocks.1"], sample=batches[0][0], workers=cluster.names[:2]) as pipe:
        (tie,) = pipe._driver.tied
        assert sorted(tie) == [0, 1]
        with pipe_optimizer.build(pipe, torch.optim.Adam, lr=0.01) as opt:
            assert "tok.weight" in opt.param_groups[0]["names"] and "tok.weight" in opt.param_groups[1]["names"]
            train(pipe, opt.step, batches[:2], lm_loss)
            saved_model, saved = pipe.state_dict(), opt.state_dict()
            train(pipe, opt.step, batches[2:], lm_loss)
        uninterrupted = pipe.state_dict()
        names = [name for group in saved["param_groups"] for name in group["params"]]
        assert names.count("tok.weight") == 1 and "head.weight" not in names  # the first holder's
        assert "tok.weight" in saved["param_groups"][0]["params"] and sorted(saved["state"]) == sorted(names)

        pipe.load_state_dict(saved_model)  # into both copies
        with pipe_optimizer.build(pipe, torch.optim.Adam, lr=0.01) as opt:
            opt.load_state_dict(saved)  # into both copies' optimizers
            train(pipe, opt.step, batches[2:], lm_loss)
        assert_equal_states(pipe.state_dict(), uninterrupted)
        copies = [rpc.rpc_sync(pipe._driver.workers[j], _parameter, args=(pipe._driver.pipe_id, j, name))
                  for j, name in tie.items()]
        assert torch.equal(copies[0], copies[1])


def test_a_pipe_in_one_process_has_the_same_optimizer(cluster):
    """The stages, and so their optimizers, in the driver's process (RPC of world size 1: ``LocalDriver``,
    run here beside the session's workers). A Linear's weight used by both stages belongs to stage 0's
    optimizer only: stepped once, as in the plain model. State dicts are copies, as over RPC."""
    model = mlp([8, 8, 8, 4], seed=7)
    model[2].weight = model[0].weight
    plain = copy.deepcopy(model)
    local = SimpleNamespace(_driver=LocalDriver(split_module(model, [2, 3]), [torch.device("cpu")] * 2, chunks=2,
                                                checkpoint="never"), _captured=None)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(3)]
    opt = pipe_optimizer.build(local, torch.optim.SGD, lr=0.1, momentum=0.9)
    sched = RemoteLRScheduler(opt, StepLR, step_size=1, gamma=0.5)
    assert [g["names"] for g in opt.param_groups] == [["0.weight", "0.bias"], ["2.bias", "4.weight", "4.bias"]]
    assert [len(stage_optim.schedulers("in-process", opt.id, j)) for j in range(2)] == [1, 1]
    with pytest.raises(TypeError, match="ReduceLROnPlateau steps on a metric"):
        RemoteLRScheduler(opt, ReduceLROnPlateau)
    assert [len(stage_optim.schedulers("in-process", opt.id, j)) for j in range(2)] == [1, 1]  # none left of it
    for k, (x, y) in enumerate(batches):
        with dist_autograd.context() as ctx:
            local._driver.train_step(ctx, x, y, F.cross_entropy, training=True, spread=False, loss_scale=1.0)
            opt.step(ctx)
        sched.step()
        if k == 0:
            saved = opt.state_dict()
            kept = {name: s["momentum_buffer"].clone() for name, s in saved["state"].items()}
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain_steps(plain, plain_opt, StepLR(plain_opt, step_size=1, gamma=0.5), batches)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value)
    assert all(torch.equal(saved["state"][name]["momentum_buffer"], v) for name, v in kept.items())
    pipe_optimizer.close_all(local)
    with pytest.raises(RuntimeError, match="this PipeOptimizer is closed"):
        opt.zero_grad()
    assert not [key for key in stage_optim._stages if key[1] == opt.id]
