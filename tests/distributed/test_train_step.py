"""``pipe.train_step`` under each schedule is the plain model run whole: the loss, every parameter's gradient
in the context, and the parameters after optimizer steps; with skips, tuple boundaries, tuple targets,
unequal micro-batches, deferred batch norm, clipping, loss scaling, schedulers and accumulation.

Each schedule runs on its own layout: GPipe and 1F1B on 3 stages (3 workers), Interleaved1F1B and
InterleavedZeroBubble on 4 stages, 2 per worker (stage j on worker j mod 2), ZBVZeroBubble and DualPipeV on
4 stages in a V (stages 0 and 3 on worker 0, 1 and 2 on worker 1). The zero-bubble schedules split each
backward in two (the inputs' gradients, then the weights'), which must change no number."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.optim import DistributedOptimizer
from torch.optim.lr_scheduler import StepLR

import rrefpipe.optim
from rrefpipe import GradScaler, Pipe
from rrefpipe.optim import RemoteLRScheduler
from rrefpipe.schedule import is_split, worker_orders
from rrefpipe.skip import Namespace
from tests.conftest import run_script
from tests.distributed.probes import stage_gradients
from tests.layers import Merge, PopAdd, Split, StashInput, StashLinear, make_head, make_tail, mlp, twin
from tests.training import batches_with_overflows, model_that_overflows

pytestmark = pytest.mark.timeout(120)

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
CHECKPOINTS = ("always", "except_last", "never")
LAYOUT = {"GPipe": (3, 1), "1F1B": (3, 1), "Interleaved1F1B": (4, 2),  # schedule -> (stages, stages per worker)
          "InterleavedZeroBubble": (4, 2), "ZBVZeroBubble": (4, 2), "DualPipeV": (4, 2)}
MLP_BALANCE = {2: [3, 4], 3: [2, 3, 2], 4: [2, 2, 2, 1]}  # mlp([5, 8, 8, 6, 3]): 7 layers


def pipe_for(cluster: Any, model: nn.Sequential, schedule: str, balances: dict[int, list[int]], **kwargs: Any) -> Pipe:
    """``model`` under ``schedule`` on its layout (``LAYOUT``), on the session's workers."""
    stages, per_worker = LAYOUT[schedule]
    return Pipe(model, schedule=schedule, stages_per_worker=per_worker, balance=balances[stages],
                workers=cluster.names[:stages // per_worker], **kwargs)


def assert_same_gradients(grads: dict[str, Tensor], plain: nn.Module, what: str = "") -> None:
    """Every parameter of ``plain`` has a gradient, and the pipe's context has exactly those, equal."""
    expected = {name: p.grad for name, p in plain.named_parameters()}
    assert all(g is not None for g in expected.values()), "the test's premise: every parameter gets a gradient"
    assert grads.keys() == expected.keys(), (what, sorted(grads), sorted(expected))
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, msg=lambda m, name=name: f"{what} {name}: {m}")


def assert_same_state(state: dict[str, Tensor], plain: nn.Module) -> None:
    expected = plain.state_dict()
    assert state.keys() == expected.keys(), (sorted(state), sorted(expected))
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key}: {m}")


def train_side_by_side(pipe: Pipe, plain: nn.Module, batches: Sequence[tuple[Any, Any]],
                       loss_fn: Callable[[Any, Any], Tensor]) -> None:
    """SGD with momentum through ``train_step`` + ``DistributedOptimizer`` and on the plain model: at every
    step the loss and every gradient equal, and at the end every parameter and buffer."""
    opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.05, momentum=0.9)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    for step, (x, target) in enumerate(batches):
        with dist_autograd.context() as ctx:
            loss = pipe.train_step(ctx, x, target, loss_fn)
            grads = stage_gradients(pipe, ctx)
            opt.step(ctx)
        plain_opt.zero_grad()
        plain_loss = loss_fn(plain(x), target)
        plain_loss.backward()
        assert not loss.requires_grad and loss.shape == ()
        torch.testing.assert_close(loss, plain_loss.detach(), msg=lambda m, step=step: f"loss of step {step}: {m}")
        assert_same_gradients(grads, plain, f"step {step}")
        plain_opt.step()
    assert_same_state(pipe.state_dict(), plain)


def classification(steps: int, rows: int, seed: int = 0, features: int = 5) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, features, generator=g), torch.randint(0, 3, (rows,), generator=g))
            for _ in range(steps)]


# -- every schedule x checkpoint mode ---------------------------------------------------------------
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_loss_gradients_and_parameters_after_three_steps_equal_the_plain_models(cluster, schedule, checkpoint):
    model = mlp([5, 8, 8, 6, 3], seed=1)
    plain = twin(model)
    with pipe_for(cluster, model, schedule, MLP_BALANCE, chunks=4, checkpoint=checkpoint) as pipe:
        assert pipe.schedule == schedule
        train_side_by_side(pipe, plain, classification(3, 12, seed=2), F.cross_entropy)
        recomputed = sorted((e.step, e.stage, e.microbatch) for e in pipe.execution_record() if e.kind == "recompute")
    stop = {"always": 4, "except_last": 3, "never": 0}[checkpoint]  # the checkpointed micro-batches, on every stage
    steps = sorted({e[0] for e in recomputed})
    assert recomputed == [(s, j, i) for s in steps for j in range(LAYOUT[schedule][0]) for i in range(stop)]
    assert len(steps) == (3 if stop else 0)


def skips_and_tuples(seed: int = 0) -> nn.Sequential:
    """Stage 0 ends in a tuple (Split | Merge); three skips, each in its own namespace: ``a`` from stage 0
    to stage 2 past stage 1, ``c`` (whose layer's parameters reach the loss only through the skip) from
    stage 1 to 2, ``b`` from stage 1 to the last stage. Balances in ``SKIP_BALANCE``: on 4 stages 2 per
    worker, ``a`` and ``b`` stay on one worker (past the other's stage) and ``c`` crosses workers."""
    torch.manual_seed(seed)
    a, b, c = Namespace(), Namespace(), Namespace()
    return nn.Sequential(
        nn.Linear(5, 6), StashInput().isolate(a), nn.Tanh(), Split(),
        Merge(), StashInput().isolate(b), StashLinear(6).isolate(c), nn.Linear(6, 6),
        PopAdd().isolate(a), PopAdd().isolate(c), nn.Tanh(),
        PopAdd().isolate(b), nn.Linear(6, 3))


SKIP_BALANCE = {3: [4, 4, 5], 4: [4, 4, 3, 2]}


def weighted_cross_entropy(out: Tensor, target: tuple[Tensor, Tensor]) -> Tensor:
    """A loss taking a tuple target: (labels, per-sample weights)."""
    labels, sample_weights = target
    return (F.cross_entropy(out, labels, reduction="none") * sample_weights).mean()


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_skips_across_stages_tuple_boundaries_tuple_targets_and_unequal_micro_batches(cluster, schedule, checkpoint):
    """11 rows in 4 micro-batches (3, 3, 3, 2): the row-weighted mean of the micro-batch losses is the
    whole batch's loss."""
    model = skips_and_tuples(seed=3)
    plain = twin(model)
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(11, 5, generator=g),
                (torch.randint(0, 3, (11,), generator=g), torch.rand(11, generator=g) + 0.5)) for _ in range(3)]
    assert [len(c) for c in batches[0][0].chunk(4)] == [3, 3, 3, 2]
    with pipe_for(cluster, model, schedule, SKIP_BALANCE, chunks=4, checkpoint=checkpoint) as pipe:
        routed = [info.layers for info in pipe.stages]
        assert "Split" in routed[0][-1] and "Merge" in routed[1][0], routed  # the tuple crosses a boundary
        train_side_by_side(pipe, plain, batches, weighted_cross_entropy)


# -- layouts ------------------------------------------------------------------------------------------
def test_interleaved_with_a_worker_named_for_each_stage(cluster):
    model = mlp([5, 8, 8, 6, 3], seed=5)
    plain = twin(model)
    w0, w1 = cluster.names[2], cluster.names[3]
    with Pipe(model, chunks=4, schedule="interleaved1f1b", stages_per_worker=2, balance=MLP_BALANCE[4],
              workers=[w0, w1, w0, w1]) as pipe:
        assert pipe.schedule == "Interleaved1F1B"
        assert [s.worker for s in pipe.stages] == [w0, w1, w0, w1]
        train_side_by_side(pipe, plain, classification(2, 8, seed=6), F.cross_entropy)


def test_stages_built_by_factories(cluster):
    plain = nn.Sequential(*make_head(), *make_tail())
    with Pipe.from_factories([make_head, make_tail], chunks=3, schedule="1F1B", workers=cluster.names[:2]) as pipe:
        train_side_by_side(pipe, plain, classification(2, 9, seed=7), F.cross_entropy)


def test_a_pipe_that_keeps_its_output_on_the_last_worker(cluster):
    model = mlp([5, 8, 8, 6, 3], seed=8)
    plain = twin(model)
    with Pipe(model, chunks=4, schedule="1F1B", balance=MLP_BALANCE[2], workers=cluster.names[:2],
              remote_output=True) as pipe:
        train_side_by_side(pipe, plain, classification(2, 8, seed=9),
                           lambda out, y: F.mse_loss(out, F.one_hot(y, 3).float()))  # a lambda travels by value


# -- deferred batch norm --------------------------------------------------------------------------------
BN_BALANCE = {3: [3, 3, 2], 4: [2, 2, 2, 2]}  # the BatchNorm (layer 3) on stage 1


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_deferred_batch_norm_keeps_the_whole_batchs_running_statistics(cluster, schedule, checkpoint):
    """After each step (11 rows in micro-batches of 3, 3, 3, 2) the running statistics are those of a plain
    BatchNorm over the whole batch, counted once per step however often checkpointing recomputes; in eval
    mode the pipe's output is then the plain model's."""
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(),
                          nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    plain = twin(model)
    with pipe_for(cluster, model, schedule, BN_BALANCE, chunks=4, checkpoint=checkpoint,
                  deferred_batch_norm=True) as pipe:
        for step, (x, y) in enumerate(classification(3, 11, seed=11)):
            x = x * (1 + step) + step
            with dist_autograd.context() as ctx:
                pipe.train_step(ctx, x, y, F.cross_entropy)
            plain(x)
        state = pipe.state_dict()
        assert state["3.num_batches_tracked"].item() == 3
        assert_same_state(state, plain)
        pipe.eval()
        plain.eval()
        x = torch.randn(6, 5)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value(), plain(x))


# -- what comes after train_step ------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_clip_grad_norm_after_train_step_equals_torchs(cluster, schedule):
    model = mlp([5, 8, 8, 6, 3], seed=12)
    plain = twin(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    with pipe_for(cluster, model, schedule, MLP_BALANCE, chunks=4) as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.5)
        for step, (x, y) in enumerate(classification(2, 8, seed=13)):
            with dist_autograd.context() as ctx:
                pipe.train_step(ctx, x, y, F.cross_entropy)
                total = pipe.clip_grad_norm_(ctx, 0.05)
                grads = stage_gradients(pipe, ctx)
                opt.step(ctx)
            plain_opt.zero_grad()
            F.cross_entropy(plain(x), y).backward()
            expected_total = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
            assert expected_total > 0.05  # the test's premise: the gradients are clipped
            torch.testing.assert_close(total, expected_total)
            assert_same_gradients(grads, plain, f"step {step}, clipped")
            plain_opt.step()
        assert_same_state(pipe.state_dict(), plain)


@pytest.mark.parametrize("schedule, balance", [("1F1B", [1, 5]), ("ZBVZeroBubble", [1, 2, 2, 1])])
def test_grad_scaler_scales_the_step_and_skips_overflows_as_torchs(cluster, schedule, balance):
    """``scaler=``: the context holds the gradients of the scaled loss (the returned loss is not scaled);
    ``scaler.step`` unscales them, and skips the step where they overflow, with the scale following
    ``torch.amp.GradScaler`` on the plain model."""
    model = model_that_overflows(stage=0)
    plain = twin(model)
    args = {"init_scale": 2.0**10, "growth_interval": 2}
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    plain_scaler = torch.amp.GradScaler("cpu", **args)
    batches = batches_with_overflows(4, bad=[1])
    with Pipe(model, chunks=2, schedule=schedule, balance=balance, workers=cluster.names[:2],
              stages_per_worker=len(balance) // 2) as pipe:
        opt = DistributedOptimizer(rrefpipe.optim.SGD, pipe.parameter_rrefs(), lr=0.05, momentum=0.9)
        scaler = GradScaler(pipe, **args)
        scales, plain_scales = [], []
        for step, (x, y) in enumerate(batches):
            scale = scaler.get_scale()
            with dist_autograd.context() as ctx:
                loss = pipe.train_step(ctx, x, y, F.cross_entropy, scaler=scaler)
                grads = stage_gradients(pipe, ctx)
                scaler.step(opt, ctx)
            scaler.update()
            scales.append(scaler.get_scale())
            plain_opt.zero_grad()
            plain_loss = F.cross_entropy(plain(x), y)
            plain_scaler.scale(plain_loss).backward()
            torch.testing.assert_close(loss, plain_loss.detach())
            if step != 1:  # the scaled gradients, before the step unscales them
                assert_same_gradients(grads, plain, f"step {step}, scaled by {scale}")
            plain_scaler.step(plain_opt)
            plain_scaler.update()
            plain_scales.append(plain_scaler.get_scale())
        assert plain_scales == [2.0**10, 2.0**9, 2.0**9, 2.0**10]  # the premise: one overflow, one growth
        assert scales == plain_scales
        assert_same_state(pipe.state_dict(), plain)


def test_a_learning_rate_schedule(cluster):
    model = mlp([5, 8, 8, 6, 3], seed=14)
    plain = twin(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.4, momentum=0.9)
    plain_sched = StepLR(plain_opt, step_size=1, gamma=0.5)
    with pipe_for(cluster, model, "Interleaved1F1B", MLP_BALANCE, chunks=2) as pipe:
        opt = DistributedOptimizer(rrefpipe.optim.SGD, pipe.parameter_rrefs(), lr=0.4, momentum=0.9)
        sched = RemoteLRScheduler(opt, StepLR, step_size=1, gamma=0.5)
        for x, y in classification(3, 8, seed=15):
            with dist_autograd.context() as ctx:
                pipe.train_step(ctx, x, y, F.cross_entropy)
                opt.step(ctx)
            sched.step()
            plain_opt.zero_grad()
            F.cross_entropy(plain(x), y).backward()
            plain_opt.step()
            plain_sched.step()
        assert sched.get_last_lr() == pytest.approx(plain_sched.get_last_lr() * 2)  # one group per worker
        assert sched.get_last_lr()[0] == pytest.approx(0.05)
        assert_same_state(pipe.state_dict(), plain)


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_two_train_steps_in_one_context_add_up_their_gradients(cluster, schedule):
    model = mlp([5, 8, 8, 6, 3], seed=16)
    plain = twin(model)
    (x1, y1), (x2, y2) = classification(2, 8, seed=17)
    with pipe_for(cluster, model, schedule, MLP_BALANCE, chunks=4) as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        with dist_autograd.context() as ctx:
            first = pipe.train_step(ctx, x1, y1, F.cross_entropy)
            second = pipe.train_step(ctx, x2, y2, F.cross_entropy)
            grads = stage_gradients(pipe, ctx)
            opt.step(ctx)
        state = pipe.state_dict()
    plain_first, plain_second = F.cross_entropy(plain(x1), y1), F.cross_entropy(plain(x2), y2)
    plain_first.backward()
    plain_second.backward()
    torch.testing.assert_close(first, plain_first.detach())
    torch.testing.assert_close(second, plain_second.detach())
    assert_same_gradients(grads, plain, "two steps")
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    assert_same_state(state, plain)


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_train_step_under_autocast_equals_the_plain_model_micro_batch_by_micro_batch(cluster, schedule):
    """``torch.autocast`` around ``train_step`` reaches the stages and ``loss_fn``: the loss and the
    gradients are the plain model's run under the same autocast one micro-batch at a time (bfloat16
    rounds differently with the batch size), its micro-batch losses weighted by their rows."""
    model = mlp([5, 8, 8, 6, 3], seed=22)
    plain = twin(model)
    x, y = classification(1, 8, seed=23)[0]
    losses = []
    for part, target in zip(x.chunk(4), y.chunk(4)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(F.cross_entropy(plain(part), target) * len(part) / len(x))
    expected = torch.stack(losses).sum()
    expected.backward()
    with pipe_for(cluster, model, schedule, MLP_BALANCE, chunks=4) as pipe:
        with dist_autograd.context() as ctx:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = pipe.train_step(ctx, x, y, F.cross_entropy)
            grads = stage_gradients(pipe, ctx)
    torch.testing.assert_close(loss, expected.detach().to(loss.dtype))
    assert_same_gradients(grads, plain, schedule)


# -- the order the stages ran ---------------------------------------------------------------------------
@pytest.mark.parametrize(("schedule", "stages", "per_worker"), [
    ("GPipe", 2, 1), ("1F1B", 2, 1), ("Interleaved1F1B", 4, 2), ("InterleavedZeroBubble", 2, 1),
    ("ZBVZeroBubble", 4, 2), ("DualPipeV", 4, 2)])
def test_the_execution_record_follows_the_schedule(cluster, schedule, stages, per_worker):
    """Each stage's forwards and backwards, by start time, in the order ``worker_orders`` gives its worker;
    under a split schedule "backward" is the inputs' gradient (I, or a whole B) and "weight" the rest (W)."""
    m = 4
    model = mlp([5, 8, 8, 6, 3], seed=18)
    with Pipe(model, chunks=m, checkpoint="never", schedule=schedule, stages_per_worker=per_worker,
              balance=MLP_BALANCE[stages], workers=cluster.names[:stages // per_worker]) as pipe:
        x, y = classification(1, 8, seed=19)[0]
        with dist_autograd.context() as ctx:
            pipe.train_step(ctx, x, y, F.cross_entropy)
        events = pipe.execution_record()
    split = is_split(schedule)
    assert {e.kind for e in events} == ({"forward", "backward", "weight"} if split else {"forward", "backward"})
    expected = [a for order in worker_orders(schedule, stages, m, per_worker) for a in order]
    for j in range(stages):
        mine = sorted((e for e in events if e.stage == j), key=lambda e: e.start)
        ran = [(e.kind[0].upper(), e.microbatch) for e in mine]
        assert ran == [({"I": "B"}.get(a.kind, a.kind), a.i) for a in expected if a.j == j], (j, ran)
        forwards = [e.start for e in mine if e.kind == "forward"]
        backwards = [e.start for e in mine if e.kind == "backward"]
        assert len(forwards) == len(backwards) == m
        if schedule == "GPipe":
            assert max(forwards) < min(backwards), j
        if schedule == "1F1B" and j == 0:
            assert min(backwards) < max(forwards)  # a backward before the last forward


# -- a world of one -------------------------------------------------------------------------------------
def test_in_a_world_of_one_train_step_equals_the_plain_model():
    """``rpc.init_rpc`` with world size 1: the stages run in this process (in GPipe's order whatever the
    schedule); loss, the context's gradients and the parameters after an optimizer step are the plain
    model's."""
    proc = run_script("""
        import copy, os, warnings
        import torch, torch.nn.functional as F
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        from torch.distributed.optim import DistributedOptimizer
        import workers
        from rrefpipe import Pipe
        from tests.layers import mlp

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(workers.free_port()))
        rpc.init_rpc("driver", rank=0, world_size=1)
        warnings.simplefilter("ignore")
        g = torch.Generator().manual_seed(0)
        for schedule, per_worker, balance in (("GPipe", 1, [3, 4]), ("1F1B", 1, [2, 3, 2]),
                                              ("Interleaved1F1B", 2, [2, 2, 2, 1]), ("ZBVZeroBubble", 2, [2, 2, 2, 1])):
            model = mlp([5, 8, 8, 6, 3], seed=20)
            plain = copy.deepcopy(model)
            pipe = Pipe(model, chunks=4, schedule=schedule, stages_per_worker=per_worker, balance=balance)
            opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1, momentum=0.9)
            plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
            for step in range(2):
                x, y = torch.randn(11, 5, generator=g), torch.randint(0, 3, (11,), generator=g)
                with dist_autograd.context() as ctx:
                    loss = pipe.train_step(ctx, x, y, F.cross_entropy)
                    grads = dist_autograd.get_gradients(ctx)
                    opt.step(ctx)
                plain_opt.zero_grad()
                plain_loss = F.cross_entropy(plain(x), y)
                plain_loss.backward()
                assert not loss.requires_grad
                torch.testing.assert_close(loss, plain_loss.detach())
                named = list(pipe.named_parameters())
                assert [n for n, _ in named] == [n for n, _ in plain.named_parameters()]
                for (name, p), q in zip(named, plain.parameters()):
                    assert p in grads, name
                    torch.testing.assert_close(grads[p], q.grad)
                    assert p.grad is None  # the gradients are in the context
                plain_opt.step()
            for key, value in plain.state_dict().items():
                torch.testing.assert_close(pipe.state_dict()[key], value)
            print("ok", schedule)
        rpc.shutdown()
    """, timeout=100)
    assert proc.stdout.splitlines() == ["ok GPipe", "ok 1F1B", "ok Interleaved1F1B", "ok ZBVZeroBubble"], proc.stdout


# -- fresh workers ------------------------------------------------------------------------------------
FIRST_STEP_SCRIPT = """
import torch, torch.nn.functional as F
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from rrefpipe import Pipe
from workers import LocalWorkers
from tests.distributed.probes import loaded
from tests.layers import PopAdd, StashInput

MODULES = ["sympy", "torch.fx.experimental.symbolic_shapes"]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 5), StashInput(), nn.Linear(5, 5), PopAdd(), nn.Linear(5, 3))
with LocalWorkers(2, threads=1) as group:
    pipe = Pipe(model, chunks=2, balance=[3, 2], workers=group.names, schedule="1F1B")
    print("started=" + repr([rpc.rpc_sync(name, loaded, args=(MODULES,)) for name in group.names]))
    with dist_autograd.context() as ctx:
        pipe.train_step(ctx, torch.randn(4, 5), torch.randn(4, 3), F.mse_loss)
    print("stepped=" + repr([rpc.rpc_sync(name, loaded, args=(MODULES,)) for name in group.names]))
    pipe.close()
"""


def test_a_first_step_on_fresh_workers_imports_no_sympy():
    """A stage before the last starts its backward from the gradients of its outputs (and skips). Given to
    ``torch.autograd.backward`` as such, they made torch import sympy to check their shapes
    (``_make_grads`` imports ``torch.fx.experimental.symbolic_shapes``): 0.3 s and more of each worker's
    first step (issue 48). Neither starting a worker nor its first step imports it now. On workers of its
    own: the session's may have imported it for other tests' models."""
    proc = run_script(FIRST_STEP_SCRIPT, timeout=100)
    values = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    assert values == {"started": "[[], []]", "stepped": "[[], []]"}, proc.stdout
