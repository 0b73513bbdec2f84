"""``pipe.train_stream`` under PipeDream, PipeDream-2BW and PipeMare follows each rule exactly, and
``pipe.stream`` is the model, input by input.

The reference is a single-process simulation written here from the rules as the issue states them
(not from the runtime): every weight version W(u) is snapshotted, and each micro-batch runs the whole
model through ``functional_call`` on a dict that takes each stage's parameters from the version the
rule gives that stage; PipeMare's backward reads the weights current when it runs (the leaves'
storage is overwritten between forward and backward, as the optimizer's in-place step does on the
worker). Losses and parameters after 6 batches must agree, and the same simulation with one stage's
version shifted by one must not (so a stage on the wrong version fails the test)."""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.optim.lr_scheduler import StepLR

from rrefpipe import Pipe, PipeMareOptions
from rrefpipe.optim import RemoteLRScheduler
from rrefpipe.schedule import pipemare_forward_version, weight_buffers, weight_version
from tests.distributed.probes import track_weight_buffers, weight_buffer_peaks
from tests.distributed.test_any_model import gpt, lm_loss, token_batches
from tests.layers import PopAdd, StashInput, mlp, twin

pytestmark = pytest.mark.timeout(120)

Version = Callable[[int, int, int], int]  # (batch t, micro-batch i, stage j) -> updates applied


def batches(count: int, rows: int, seed: int = 0, last_rows: int | None = None) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sizes = [rows] * (count - 1) + [last_rows or rows]
    return [(torch.randn(r, 5, generator=g), torch.randint(0, 3, (r,), generator=g)) for r in sizes]


def stage_names(model: nn.Module, balance: Sequence[int]) -> list[list[str]]:
    """The parameter names of each stage of an ``nn.Sequential`` split by ``balance``."""
    bounds, start = [], 0
    for size in balance:
        bounds.append(range(start, start + size))
        start += size
    return [[name for name, _ in model.named_parameters() if int(name.split(".")[0]) in layers] for layers in bounds]


def simulate(model: nn.Module, names: list[list[str]], data: Sequence[tuple[Tensor, Tensor]], make_opt: Any,
             chunks: int, forward: Version, backward: Version | None = None, make_scheduler: Any = None,
             optimizers_out: list[Any] | None = None, loss_fn: Callable[[Any, Any], Tensor] = F.cross_entropy,
             lr_factor: Callable[[int, int], float] | None = None, correction: Callable[[int], float] | None = None
             ) -> tuple[list[float], dict[str, Tensor]]:
    """The rule in one process: micro-batch (t, i) runs stage j's parameters at version ``forward(t, i, j)``
    and, if ``backward`` is given, backpropagates through the weights of version ``backward(t, i, j)``
    (PipeMare); every stage then steps its own optimizer with batch t's row-weighted mean gradient.
    ``optimizers_out`` receives each stage's optimizer.

    PipeMare's options, as the guide states them: ``lr_factor(j, k)`` multiplies stage j's learning rate
    for its update k only (T1); with ``correction(j)`` = g_j (T2) the backward reads W(b) - (b - f) v_j(b)
    instead of W(b) (b, f: the backward's and forward's versions), v_j(u + 1) = g_j v_j(u) + (1 - g_j)
    (W(u + 1) - W(u)), v_j(0) = 0."""
    stage_of = {k: j for j, stage in enumerate(names) for k in stage}
    history = [{k: p.detach().clone() for k, p in model.named_parameters()}]  # history[u] = W(u)
    live = {k: nn.Parameter(v.clone()) for k, v in history[0].items()}
    optimizers = [make_opt([live[k] for k in stage]) for stage in names]
    schedulers = [make_scheduler(o) for o in optimizers] if make_scheduler else []
    if optimizers_out is not None:
        optimizers_out.extend(optimizers)
    velocity = [{k: torch.zeros_like(v) for k, v in history[0].items()}]  # velocity[u] = v(u)
    losses = []
    for t, (x, y) in enumerate(data):
        xs, ys = x.chunk(chunks), y.chunk(chunks)
        grads: dict[str, Tensor] = {}
        loss_t = 0.0
        for i, (xi, yi) in enumerate(zip(xs, ys)):
            share = len(xi) / len(x)
            leaves = {k: history[forward(t, i, stage_of[k])][k].clone().requires_grad_() for k in live}
            loss = loss_fn(functional_call(model, leaves, (xi,)), yi)
            if backward is not None:
                for k, leaf in leaves.items():
                    b, f = backward(t, i, stage_of[k]), forward(t, i, stage_of[k])
                    leaf.data.copy_(history[b][k] - (b - f) * velocity[b][k] if correction else history[b][k])
            (loss * share).backward()
            loss_t += share * loss.item()
            for k, leaf in leaves.items():
                if leaf.grad is not None:
                    grads[k] = grads[k] + leaf.grad if k in grads else leaf.grad
        for j, (optimizer, stage) in enumerate(zip(optimizers, names)):
            for k in stage:
                live[k].grad = grads.get(k)
            factor = lr_factor(j, t) if lr_factor else 1.0
            for group in optimizer.param_groups:
                group["lr"] *= factor
            optimizer.step()
            for group in optimizer.param_groups:
                group["lr"] /= factor
            optimizer.zero_grad()
        for scheduler in schedulers:  # each stage's, after its own update
            scheduler.step()
        history.append({k: p.detach().clone() for k, p in live.items()})
        if correction:
            velocity.append({k: correction(stage_of[k]) * velocity[-1][k] + (1 - correction(stage_of[k]))
                             * (history[-1][k] - history[-2][k]) for k in live})
        losses.append(loss_t)
    return losses, history[-1]


def rule(schedule: str, n: int, m: int, vertical_sync: bool = False) -> tuple[Version, Version | None]:
    """The forward and backward versions of ``schedule`` (the issue's rules; for chunks > 1 PipeDream's
    version is the newest when a batch's first micro-batch enters, as the guide says)."""
    if schedule == "PipeMare":
        return (lambda t, i, j: pipemare_forward_version(t, i, j, n, m)), (lambda t, i, j: t)
    return (lambda t, i, j: weight_version(schedule, t, j, n, m, vertical_sync=vertical_sync)), None


def shifted(version: Version, stage: int) -> Version:
    """``version`` with ``stage`` one update newer (where that exists): what a wrong rule would run."""
    return lambda t, i, j: version(t, i, j) + (1 if j == stage and version(t, i, j) < t else 0)


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.02}),
}

# (schedule, vertical_sync, stages, chunks, optimizer, skip): pairwise over the rules, 2 and 3 stages,
# chunks 1 and 4, SGD with momentum and Adam, with and without a skip across stages.
CASES = [
    ("PipeDream", False, 2, 1, "sgd", False),
    ("PipeDream", False, 3, 4, "adam", True),
    ("PipeDream", True, 3, 1, "sgd", True),
    ("PipeDream-2BW", False, 2, 4, "adam", False),
    ("PipeDream-2BW", False, 3, 1, "sgd", True),
    ("PipeMare", False, 2, 4, "sgd", False),
    ("PipeMare", False, 3, 1, "adam", True),
]


def model_for(stages: int, skip: bool) -> tuple[nn.Sequential, list[int]]:
    if not skip:
        model = mlp([5, 8, 8, 6, 3], seed=1)  # 7 layers
        return model, {2: [3, 4], 3: [2, 3, 2]}[stages]
    torch.manual_seed(2)  # a skip from stage 0 to the last stage, past the middle ones
    model = nn.Sequential(nn.Linear(5, 6), StashInput(), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), PopAdd(),
                          nn.Linear(6, 3))
    return model, {2: [3, 4], 3: [2, 3, 2]}[stages]


@pytest.mark.parametrize("schedule,vertical_sync,stages,chunks,opt,skip", CASES)
def test_train_stream_follows_the_rule_exactly(cluster, schedule, vertical_sync, stages, chunks, opt, skip):
    model, balance = model_for(stages, skip)
    plain = twin(model)
    data = batches(6, 8, seed=stages * 10 + chunks, last_rows=6)
    cls, kwargs = OPTIMIZERS[opt]
    forward, backward = rule(schedule, stages, chunks, vertical_sync)
    names = stage_names(plain, balance)
    expected, weights = simulate(plain, names, data, lambda p: cls(p, **kwargs), chunks, forward, backward)
    with Pipe(model, chunks=chunks, balance=balance, workers=cluster.names[:stages], schedule=schedule,
              vertical_sync=vertical_sync, checkpoint="never" if schedule == "PipeMare" else "except_last") as pipe:
        optimizer = pipe.optimizer(cls, **kwargs)
        losses = [loss.item() for loss in pipe.train_stream(data, F.cross_entropy, optimizer)]
        state = pipe.state_dict()
    torch.testing.assert_close(losses, expected)
    for name, value in weights.items():
        torch.testing.assert_close(state[name], value, msg=lambda m, name=name: f"{name}: {m}")
    # the same simulation on a wrong version (one stage one update newer) is far off
    wrong = shifted(forward, 0) if backward is None else forward
    wrong_backward = None if backward is None else shifted(lambda t, i, j: t - 1 if t else 0, 0)
    _, off = simulate(twin(model_for(stages, skip)[0]), names, data, lambda p: cls(p, **kwargs), chunks, wrong,
                      wrong_backward)
    with pytest.raises(AssertionError):  # the comparison above would have failed on it
        torch.testing.assert_close({k: state[k] for k in off}, off)


def test_train_stream_under_a_synchronous_schedule_is_the_train_step_loop(cluster):
    model = mlp([5, 8, 8, 6, 3], seed=4)
    data = batches(4, 8, seed=5, last_rows=5)
    results = []
    for streamed in (True, False):
        with Pipe(twin(model), chunks=4, balance=[3, 4], workers=cluster.names[:2], schedule="1F1B") as pipe:
            optimizer = pipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
            if streamed:
                losses = list(pipe.train_stream(data, F.cross_entropy, optimizer))
            else:
                losses = []
                for x, y in data:
                    with dist_autograd.context() as ctx:
                        losses.append(pipe.train_step(ctx, x, y, F.cross_entropy))
                        optimizer.step(ctx)
            results.append((losses, pipe.state_dict()))
    (a, sa), (b, sb) = results
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("stages,chunks,per_worker", [(2, 4, 1), (4, 2, 2)])
def test_stream_is_the_model_input_by_input(cluster, stages, chunks, per_worker):
    model = mlp([5, 8, 8, 6, 3], seed=6)
    plain = twin(model).eval()
    inputs = [x for x, _ in batches(7, 9, seed=7, last_rows=3)]
    schedule = "Interleaved1F1B" if per_worker > 1 else "GPipe"
    with Pipe(model, chunks=chunks, balance={2: [3, 4], 4: [2, 2, 2, 1]}[stages], schedule=schedule,
              stages_per_worker=per_worker, workers=cluster.names[:stages // per_worker]) as pipe:
        with torch.no_grad():
            outputs = list(pipe.stream(iter(inputs)))
            expected = [plain(x) for x in inputs]
        assert len(outputs) == len(inputs)
        for out, exp in zip(outputs, expected):
            torch.testing.assert_close(out, exp)
        with torch.no_grad():  # the pipe is its own again afterwards
            torch.testing.assert_close(pipe(inputs[0]).local_value(), expected[0])


def test_each_stage_steps_its_lr_schedule_after_its_own_update(cluster):
    model = mlp([5, 8, 8, 6, 3], seed=9)
    plain = twin(model)
    data = batches(6, 8, seed=10)
    forward, _ = rule("PipeDream", 2, 2)
    make_opt = lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.5)  # noqa: E731
    make_scheduler = lambda o: StepLR(o, step_size=2, gamma=0.5)  # noqa: E731
    expected, weights = simulate(plain, stage_names(plain, [3, 4]), data, make_opt, 2, forward,
                                 make_scheduler=make_scheduler)
    with Pipe(model, chunks=2, balance=[3, 4], workers=cluster.names[:2], schedule="PipeDream") as pipe:
        optimizer = pipe.optimizer(torch.optim.SGD, lr=0.2, momentum=0.5)
        scheduler = RemoteLRScheduler(optimizer, StepLR, step_size=2, gamma=0.5)
        losses = [loss.item() for loss in pipe.train_stream(data, F.cross_entropy, optimizer, lr_scheduler=scheduler)]
        state = pipe.state_dict()
        assert [g["lr"] for g in optimizer.param_groups] == [0.2 * 0.5 ** 3] * 2  # 6 updates on each stage
    torch.testing.assert_close(losses, expected)
    for name, value in weights.items():
        torch.testing.assert_close(state[name], value, msg=lambda m, name=name: f"{name}: {m}")


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_long_stream_keeps_memory_flat(cluster):
    """1,000 inputs through pipe.stream: the driver's and the workers' RSS after the last 800 within a
    few MiB of what they were after the first 200 (a leak of one input's tensors per batch would add
    12.5 MiB here)."""
    model = mlp([64, 64, 64, 8], seed=11)
    x = torch.randn(64, 64)
    with Pipe(model, chunks=2, balance=[2, 3], workers=cluster.names[:2]) as pipe, torch.no_grad():
        pids = [os.getpid(), *cluster.pids[:2]]
        stream = pipe.stream(x + t for t in range(1000))
        for t, _ in enumerate(stream):
            if t == 199:
                before = [_rss_kib(pid) for pid in pids]
        after = [_rss_kib(pid) for pid in pids]
    growth = [(a - b) / 1024 for a, b in zip(after, before)]
    assert all(g < 3 for g in growth), f"RSS grew by {growth} MiB (driver, workers) over 800 inputs"


def test_a_captured_gpt_follows_the_rule(cluster):
    """The tiny GPT captured by torch.export and split in two (its head untied from the embedding: tied
    copies on two stages would be updated apart), under PipeDream-2BW with Adam, against the rule."""
    model = gpt(seed=12)
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    plain = twin(model)
    data = token_batches(5, rows=4, seed=13)
    first = ("tok.", "pos.", "blocks.0.", "blocks.1.")  # stage 0 (the split is at blocks.2)
    names = [[k for k, _ in plain.named_parameters() if k.startswith(first)],
             [k for k, _ in plain.named_parameters() if not k.startswith(first)]]
    make_opt = lambda p: torch.optim.Adam(p, lr=0.003, eps=1e-4)  # noqa: E731  (eps: see test_any_model's ADAM)
    forward, _ = rule("PipeDream-2BW", 2, 2)
    expected, weights = simulate(plain, names, data, make_opt, 2, forward, loss_fn=lm_loss)
    with Pipe(model, chunks=2, split_points=["blocks.2"], sample=data[0][0], workers=cluster.names[:2],
              schedule="PipeDream-2BW") as pipe:
        optimizer = pipe.optimizer(torch.optim.Adam, lr=0.003, eps=1e-4)
        losses = [loss.item() for loss in pipe.train_stream(data, lm_loss, optimizer)]
        state = pipe.state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected))  # (float32's tolerance)
    for name, value in weights.items():
        torch.testing.assert_close(state[name], value, msg=lambda m, name=name: f"{name}: {m}")


def test_tied_copies_on_two_stages_are_refused_under_an_asynchronous_rule(cluster):
    model = gpt(seed=14)
    x, y = token_batches(1, rows=4)[0]
    with Pipe(model, chunks=2, split_points=["blocks.2"], sample=x, workers=cluster.names[:2],
              schedule="PipeDream") as pipe:
        optimizer = pipe.optimizer(torch.optim.SGD, lr=0.1)
        with pytest.raises(ValueError, match="tied across stages.*synchronous schedule"):
            next(pipe.train_stream([(x, y)], lm_loss, optimizer))
        with torch.no_grad():  # a forward stream has nothing to update: it runs
            torch.testing.assert_close(next(pipe.stream([x])), model(x))


@pytest.mark.parametrize("warmup,correct", [(3, False), (0, True), (4, True)])
def test_pipemares_rescheduling_and_discrepancy_correction_follow_their_rules(cluster, warmup, correct):
    """3 stages, chunks 1 (delays 2, 1, 1): T1 damps stage j's early updates by tau_j ** -p_k, T2 runs each
    backward on the forward's weights as predicted from the moving average of the updates."""
    model = mlp([5, 8, 8, 6, 3], seed=15)
    plain = twin(model)
    data = batches(6, 8, seed=16)
    options = PipeMareOptions(warmup_updates=warmup, discrepancy_correction=correct)
    forward, backward = rule("PipeMare", 3, 1)
    names = stage_names(plain, [2, 3, 2])
    make_opt = lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.5)  # noqa: E731
    lr_factor = (lambda j, k: options.lr_factor(j, k, 3, 1)) if warmup else None
    correction = (lambda j: options.ema_decay(j, 3, 1)) if correct else None
    expected, weights = simulate(plain, names, data, make_opt, 1, forward, backward, lr_factor=lr_factor,
                                 correction=correction)
    with Pipe(model, chunks=1, balance=[2, 3, 2], workers=cluster.names[:3], schedule="PipeMare",
              checkpoint="never") as pipe:
        optimizer = pipe.optimizer(torch.optim.SGD, lr=0.3, momentum=0.5)
        losses = [loss.item() for loss in pipe.train_stream(data, F.cross_entropy, optimizer, pipemare=options)]
        state = pipe.state_dict()
        assert [g["lr"] for g in optimizer.param_groups] == [0.3] * 3  # T1 changes each update only
    torch.testing.assert_close(losses, expected)
    for name, value in weights.items():
        torch.testing.assert_close(state[name], value, msg=lambda m, name=name: f"{name}: {m}")
    _, plain_rule = simulate(mlp([5, 8, 8, 6, 3], seed=15), names, data, make_opt, 1, forward, backward)
    with pytest.raises(AssertionError):  # the options changed the outcome: the test can tell them apart
        torch.testing.assert_close({k: state[k] for k in plain_rule}, plain_rule)


@pytest.mark.parametrize("schedule,vertical_sync", [("PipeDream", False), ("PipeDream", True), ("PipeDream-2BW", False)])
def test_each_stage_holds_at_most_the_rules_weight_buffers(cluster, schedule, vertical_sync):
    """Without rollback (whose records add copies), the most weight versions a stage holds itself right
    after an update is ``weight_buffers``: 3 stages, chunks 1 (PipeDream: 3, 2, 1)."""
    workers = cluster.names[:3]
    for worker in workers:
        rpc.rpc_sync(worker, track_weight_buffers, timeout=10)
    with Pipe(mlp([5, 8, 8, 6, 3], seed=17), chunks=1, balance=[2, 3, 2], workers=workers, schedule=schedule,
              vertical_sync=vertical_sync) as pipe:
        optimizer = pipe.optimizer(torch.optim.SGD, lr=0.1)
        list(pipe.train_stream(batches(6, 4, seed=18), F.cross_entropy, optimizer, rollback=False))
    peaks = [max(rpc.rpc_sync(worker, weight_buffer_peaks, timeout=10).values()) for worker in workers]
    assert peaks == [weight_buffers(schedule, 3, j, 1, vertical_sync=vertical_sync) for j in range(3)]
