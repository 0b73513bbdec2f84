"""The script of the data-parallel tests, run under ``torchrun`` by tests/replicas/test_replicas.py: R
replicas of a pipeline, every driver checking itself against plain PyTorch on the whole batch (all
replicas' shares) and printing ``OK <what>`` lines, or provoking the failure its ``--mode`` names.

Modes:
- ``train``: train_step under GPipe and 1F1B, checkpoint 'never' and 'always', momentum SGD and Adam;
  pipe(x) + pipe.backward; one replica's last share smaller than the others'; clip_grad_norm_;
  GradScaler with an overflow in one replica only; deferred BatchNorm (every replica keeps replica 0's
  statistics, as DistributedDataParallel does); state_dict and resuming from it; pipe.save by replica 0
  and pipe.load by every replica into another balance; accumulating k train_steps
  in one context under ``Pipe.no_sync()`` (equal and unequal shares, a captured model's tied parameters):
  one averaging per context, counted in c10d's all-reduces on the stage workers; pipe.backward under
  no_sync() refused, k forwards summed into one pipe.backward averaged once.
- ``mismatch``: replica 1 builds another model: both drivers get a ValueError at once.
- ``extra-step``: replica 0 runs one step more than replica 1: its step fails after the collective timeout.
- ``kill-worker``: replica 0's last stage worker dies in a step: every driver gets an error naming it.
- ``kill-driver``: replica 1's driver dies between steps: replica 0's next step fails naming what is gone.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import signal
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.optim import DistributedOptimizer

import workers
from examples.tiny_gpt import GPT
from rrefpipe import GradScaler, Pipe, StageError, replicas
from tests.distributed.probes import stage_gradients

FEATURES, CLASSES = 6, 3


def mlp(seed: int = 0, width: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, CLASSES))


def batches(steps: int, rows: list[int], seed: int = 1) -> list[list[tuple[Tensor, Tensor]]]:
    """Per step, every replica's share (``rows[r]`` samples each), the same on every driver."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)) for n in rows]
            for _ in range(steps)]


def uneven(rows: list[list[int]], seed: int) -> list[list[tuple[Tensor, Tensor]]]:
    """Per step, every replica's share: ``rows[step][r]`` samples."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(k, FEATURES, generator=g), torch.randint(0, CLASSES, (k,), generator=g)) for k in step]
            for step in rows]


def whole(shares: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    return torch.cat([x for x, _ in shares]), torch.cat([y for _, y in shares])


def lm_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    """A language model's loss on its own input (the targets do not matter here, only that both sides agree)."""
    return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, shares: list[tuple[Tensor, Tensor]]) -> float:
    opt.zero_grad()
    x, y = whole(shares)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def assert_same_parameters(pipe: Pipe, plain: nn.Module, what: str) -> None:
    state = pipe.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, msg=lambda m, name=name: f"{what}: {name}: {m}")


def same_on_every_replica(state: dict[str, Tensor], what: str) -> None:
    """Every driver holds the same ``state`` (compared over the drivers' group)."""
    group = replicas.current()
    assert group is not None
    gathered: list[dict[str, Tensor] | None] = [None] * group.replicas
    dist.all_gather_object(gathered, state, group=group.group)
    for other in gathered[1:]:
        assert other is not None and other.keys() == state.keys(), what
        for k in state:
            torch.testing.assert_close(other[k], gathered[0][k], rtol=0, atol=0,  # type: ignore[index]
                                       msg=lambda m, k=k: f"{what}: replicas differ in {k}: {m}")


OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), "adam": (torch.optim.Adam, {"lr": 0.02})}

_all_reduces: list[int] = []  # on a stage worker, once counting: [c10d all-reduces run since]


def all_reduces() -> int:
    """On a stage worker: the c10d all-reduces this process has run since its first call, which starts the
    count by wrapping ``torch.distributed.all_reduce`` (what ``rrefpipe.replicas`` calls, by attribute)."""
    if not _all_reduces:
        _all_reduces.append(0)
        real = dist.all_reduce

        def counting(*args: Any, **kwargs: Any) -> Any:
            _all_reduces[0] += 1
            return real(*args, **kwargs)

        dist.all_reduce = counting
    return _all_reduces[0]


def count_all_reduces(stage_workers: workers.StageWorkers) -> int:
    """The all-reduces this replica's stage workers have run, together (counting starts at the first call)."""
    return sum(rpc.rpc_sync(name, all_reduces, timeout=30) for name in stage_workers)


def no_sync_window(pipe: Pipe, opt: DistributedOptimizer, shares: list[tuple[Tensor, Tensor]],
                   synced: Callable[[int], bool]) -> dict[str, Tensor]:
    """One context of ``len(shares)`` train_steps, step k under ``pipe.no_sync()`` unless ``synced(k)``,
    then the optimizer's step; the gradients it stepped on."""
    with dist_autograd.context() as ctx:
        for k, (x, y) in enumerate(shares):
            with contextlib.nullcontext() if synced(k) else pipe.no_sync():
                pipe.train_step(ctx, x, y, F.cross_entropy)
        grads = stage_gradients(pipe, ctx)
        opt.step(ctx)
    return grads


def plain_window(plain: nn.Module, opt: torch.optim.Optimizer, window: list[list[tuple[Tensor, Tensor]]],
                 union: bool = True) -> None:
    """Plain PyTorch's accumulation over ``window`` (per step, every replica's share), then its step. ``union``:
    each step's loss is the mean over the union of the replicas' shares; else each replica's mean, weighted
    by the rows it has in the whole window (what no_sync's one averaging gives when the replicas' shares of
    each step are not in the same proportions)."""
    opt.zero_grad()
    totals = [sum(len(step[r][1]) for step in window) for r in range(len(window[0]))]
    for step in window:
        if union:
            x, y = whole(step)
            loss = F.cross_entropy(plain(x), y)
        else:
            loss = sum((t / sum(totals)) * F.cross_entropy(plain(x), y) for t, (x, y) in zip(totals, step))
        loss.backward()
    opt.step()


def assert_same_gradients(grads: dict[str, Tensor], plain: nn.Module, what: str) -> None:
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m, name=name: f"{what}: {name}: {m}")


def no_sync(stage_workers: workers.StageWorkers) -> None:
    """Accumulation under ``Pipe.no_sync()``: the gradients of a context's k train_steps are averaged once,
    weighted by each replica's rows in all k, and equal plain PyTorch's; pipe.backward inside is refused."""
    r, n = stage_workers.replica, stage_workers.replicas
    model = mlp()
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    with Pipe(model, chunks=2, balance=[3, 2], workers=stage_workers, schedule="1F1B") as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1, momentum=0.9)
        before = count_all_reduces(stage_workers)
        step = batches(1, [4] * n, seed=7)
        grads = no_sync_window(pipe, opt, [step[0][r]], synced=lambda k: True)
        plain_window(plain, plain_opt, step)
        assert_same_gradients(grads, plain, "one step")
        one = count_all_reduces(stage_workers) - before  # the all-reduces of one averaging
        assert one > 0, one
        for seed, synced, averagings in [(8, lambda k: k == 2, 1), (9, lambda k: k == 2, 1), (10, lambda k: True, 3)]:
            window = batches(3, [4] * n, seed=seed)
            before = count_all_reduces(stage_workers)
            grads = no_sync_window(pipe, opt, [shares[r] for shares in window], synced)
            got = count_all_reduces(stage_workers) - before
            assert got == averagings * one, f"{got} all-reduces, not {averagings} averaging(s) of {one}"
            plain_window(plain, plain_opt, window)
            assert_same_gradients(grads, plain, f"k=3, {averagings} averaging(s)")
        assert_same_parameters(pipe, plain, "no_sync, 1F1B")
    print(f"OK replica {r}: no_sync: 3 train_steps averaged once, as plain PyTorch", flush=True)

    # unequal shares: replica 0 has twice the others' rows (then the same proportions each step: exact against
    # the union); then shares in other proportions each step (weighted by the rows of the whole window)
    model = mlp(seed=1)
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    proportional = uneven([[k] + [k // 2] * (n - 1) for k in (6, 4, 8)], seed=11)  # 18 rows against 9
    other = uneven([[4] * (n - 1) + [last] for last in (4, 4, 1)], seed=12)  # 12 against 9, 1 of 5 in the last
    with Pipe(model, chunks=2, balance=[3, 2], workers=stage_workers, schedule="1F1B") as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        for window, union in [(proportional, True), (other, False)]:
            before = count_all_reduces(stage_workers)
            grads = no_sync_window(pipe, opt, [shares[r] for shares in window], lambda k: k == len(window) - 1)
            got = count_all_reduces(stage_workers) - before
            assert got == one, f"{got} all-reduces, not one averaging's {one}"
            plain_window(plain, plain_opt, window, union=union)
            assert_same_gradients(grads, plain, f"unequal shares, union={union}")
        assert_same_parameters(pipe, plain, "no_sync, unequal shares")
        # a context whose last step ran under no_sync: its gradients were never averaged; the next step warns
        x, y = other[0][r]
        with dist_autograd.context() as ctx, pipe.no_sync():
            pipe.train_step(ctx, x, y, F.cross_entropy)
        with dist_autograd.context() as ctx, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe.train_step(ctx, x, y, F.cross_entropy)
        assert any("which no later step in that context averaged" in str(w.message) for w in caught), \
            [str(w.message) for w in caught]
    print(f"OK replica {r}: no_sync: unequal shares weighted by the rows of every step; a context left unaveraged "
          "warns", flush=True)

    # pipe.backward: refused under no_sync (the context keeps its one backward); k forwards summed into one
    # backward outside average once, weighted by all their rows
    model = mlp(seed=2)
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    window = uneven([[k] + [k // 2] * (n - 1) for k in (4, 6, 2)], seed=13)
    with Pipe(model, chunks=2, balance=[3, 2], workers=stage_workers) as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        before = count_all_reduces(stage_workers)
        with dist_autograd.context() as ctx:
            loss = sum(F.cross_entropy(pipe(x).local_value(), y) for x, y in (step[r] for step in window))
            try:
                with pipe.no_sync():
                    pipe.backward(ctx, loss)
            except RuntimeError as exc:
                assert "pipe.backward under pipe.no_sync()" in str(exc), exc
            else:
                raise AssertionError("pipe.backward ran under no_sync()")
            assert count_all_reduces(stage_workers) == before  # refused before anything ran
            pipe.backward(ctx, loss)  # the same context: its one backward is still to come
            grads = stage_gradients(pipe, ctx)
            opt.step(ctx)
        got = count_all_reduces(stage_workers) - before
        assert got == one, f"{got} all-reduces, not one averaging's {one}"
        plain_window(plain, plain_opt, window)
        assert_same_gradients(grads, plain, "pipe.backward of 3 forwards")
        assert_same_parameters(pipe, plain, "pipe.backward of 3 forwards")
    print(f"OK replica {r}: no_sync: pipe.backward refused inside; 3 forwards, one backward, averaged once", flush=True)


def train(stage_workers: workers.StageWorkers) -> None:
    r, n = stage_workers.replica, stage_workers.replicas
    rows = [4] * n
    for schedule, checkpoint, optimizer in [("GPipe", "never", "sgd"), ("1F1B", "always", "sgd"),
                                            ("1F1B", "never", "adam"), ("GPipe", "always", "adam"),
                                            ("Interleaved1F1B", "never", "sgd"), ("ZBVZeroBubble", "always", "sgd"),
                                            ("InterleavedZeroBubble", "never", "adam"), ("DualPipeV", "never", "sgd")]:
        model = mlp()
        plain = copy.deepcopy(model)
        cls, kwargs = OPTIMIZERS[optimizer]
        plain_opt = cls(plain.parameters(), **kwargs)
        k = 2 if schedule == "DualPipeV" else 1  # DualPipeV needs as many micro-batches as stages: twice the rows
        steps = batches(3, [4 * k] * n) + batches(1, [4 * k] * (n - 1) + [2 * k], seed=2)  # the last share: fewer
        interleaved = schedule not in ("GPipe", "1F1B")  # 4 stages on the 2 workers, averaged once per worker
        with Pipe(model, chunks=2 * k, checkpoint=checkpoint, balance=[2, 1, 1, 1] if interleaved else [3, 2],
                  workers=stage_workers, schedule=schedule, stages_per_worker=2 if interleaved else 1) as pipe:
            opt = DistributedOptimizer(cls, pipe.parameter_rrefs(), **kwargs)
            for shares in steps:
                x, y = shares[r]
                with dist_autograd.context() as ctx:
                    pipe.train_step(ctx, x, y, F.cross_entropy)
                    grads = stage_gradients(pipe, ctx)
                    opt.step(ctx)
                plain_step(plain, plain_opt, shares)
            for name, p in plain.named_parameters():  # the last step's: averaged by rows over the replicas
                torch.testing.assert_close(grads[name], p.grad, msg=lambda m, name=name: f"{name}: {m}")
            assert_same_parameters(pipe, plain, f"{schedule} {checkpoint} {optimizer}")
        print(f"OK replica {r}: train_step {schedule} checkpoint={checkpoint} {optimizer}", flush=True)

    # pipe(x) + pipe.backward, uneven shares, then clipping the averaged gradients
    model = mlp()
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    with Pipe(model, chunks=2, balance=[3, 2], workers=stage_workers) as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        for shares in batches(2, [4] * (n - 1) + [3], seed=3):
            x, y = shares[r]
            with dist_autograd.context() as ctx:
                pipe.backward(ctx, F.cross_entropy(pipe(x).local_value(), y))
                norm = pipe.clip_grad_norm_(ctx, max_norm=0.05)
                opt.step(ctx)
            plain_opt.zero_grad()
            px, py = whole(shares)
            F.cross_entropy(plain(px), py).backward()
            plain_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm=0.05)
            plain_opt.step()
            torch.testing.assert_close(norm, plain_norm)
        assert_same_parameters(pipe, plain, "pipe.backward + clip_grad_norm_")
    print(f"OK replica {r}: pipe.backward, clip_grad_norm_", flush=True)

    # a captured model (any nn.Module, cut at a split point) with a parameter tied across its stages: the
    # copies' gradients are averaged over the replicas and summed over the stages, in either order; then
    # accumulated in one context, under no_sync and averaged, twice (each sum adds what came since the last)
    torch.manual_seed(0)
    gpt = GPT(vocab=32, d=16, heads=2, layers=2, context=6)
    plain = copy.deepcopy(gpt)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(4)
    tokens = [[torch.randint(0, 32, (4, 6), generator=g) for _ in range(n)] for _ in range(6)]
    with Pipe(gpt, chunks=2, split_points=["blocks.1"], sample=tokens[0][r], workers=stage_workers,
              schedule="1F1B") as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1, momentum=0.9)
        for step, shares in enumerate(tokens[:2]):
            with dist_autograd.context() as ctx:
                if step == 0:
                    pipe.train_step(ctx, shares[r], shares[r], lm_loss)
                else:
                    pipe.backward(ctx, lm_loss(pipe(shares[r]).local_value(), shares[r]))
                opt.step(ctx)
            plain_opt.zero_grad()
            lm_loss(plain(torch.cat(shares)), torch.cat(shares)).backward()
            plain_opt.step()
        with dist_autograd.context() as ctx:
            for k, shares in enumerate(tokens[2:]):
                with pipe.no_sync() if k % 2 == 0 else contextlib.nullcontext():
                    pipe.train_step(ctx, shares[r], shares[r], lm_loss)
            opt.step(ctx)
        plain_opt.zero_grad()
        for shares in tokens[2:]:
            lm_loss(plain(torch.cat(shares)), torch.cat(shares)).backward()
        plain_opt.step()
        assert_same_parameters(pipe, plain, "captured GPT")
        same_on_every_replica(pipe.state_dict(), "captured GPT")
    print(f"OK replica {r}: captured model, tied parameters, accumulated under no_sync", flush=True)

    model = mlp()
    with Pipe(model, chunks=2, balance=[3, 2], workers=stage_workers, schedule="1F1B") as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        scaler = GradScaler(pipe, init_scale=2.0 ** 10)
        scales = []
        for k, shares in enumerate(batches(3, rows, seed=4)):
            x, y = shares[r]
            if k == 1 and r == n - 1:
                x = x.clone()
                x[0, 0] = float("inf")
            with dist_autograd.context() as ctx:
                pipe.train_step(ctx, x, y, F.cross_entropy, scaler=scaler)
                scaler.step(opt, ctx)
                scaler.update()
            scales.append(scaler.get_scale())
        assert scales == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9], scales
        same_on_every_replica(pipe.state_dict(), "GradScaler")
    print(f"OK replica {r}: GradScaler skips the same steps", flush=True)

    # deferred BatchNorm: replica 0's statistics everywhere; save and resume
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, CLASSES))
    shares = batches(1, rows, seed=6)[0]
    with Pipe(copy.deepcopy(model), chunks=2, balance=[2, 2], workers=stage_workers, deferred_batch_norm=True,
              schedule="1F1B") as pipe:
        with dist_autograd.context() as ctx:
            pipe.train_step(ctx, *shares[r], F.cross_entropy)
        state = pipe.state_dict()
    same_on_every_replica(state, "deferred BatchNorm")
    first = copy.deepcopy(model[:2])
    first(shares[0][0])  # a plain BatchNorm over replica 0's share, in training mode
    torch.testing.assert_close(state["1.running_mean"], first[1].running_mean)
    torch.testing.assert_close(state["1.running_var"], first[1].running_var)
    with Pipe(copy.deepcopy(model), chunks=2, balance=[2, 2], workers=stage_workers, deferred_batch_norm=True) as again:
        again.load_state_dict(state)
        same_on_every_replica(again.state_dict(), "resumed")
        torch.testing.assert_close(again.state_dict()["1.running_mean"], state["1.running_mean"])
    print(f"OK replica {r}: deferred BatchNorm, resume", flush=True)

    sharded_checkpoint(stage_workers)
    no_sync(stage_workers)


def sharded_checkpoint(stage_workers: workers.StageWorkers) -> None:
    """pipe.save with replicas: replica 0's workers write (with the optimizer's state), every replica loads
    into a pipe of another balance and goes on exactly as the uninterrupted plain run on the whole batch."""
    r, n = stage_workers.replica, stage_workers.replicas
    path = Path(tempfile.gettempdir()) / f"rrefpipe-replicas-ckpt-{os.getppid()}"  # torchrun's agent: one per job
    steps = batches(4, [4] * n, seed=7)
    plain = mlp(seed=3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.02)
    for shares in steps:
        plain_step(plain, plain_opt, shares)
    with Pipe(mlp(seed=3), chunks=2, balance=[3, 2], workers=stage_workers, schedule="1F1B") as pipe:
        opt = pipe.optimizer(torch.optim.AdamW, lr=0.02)
        for shares in steps[:2]:
            with dist_autograd.context() as ctx:
                pipe.train_step(ctx, *shares[r], F.cross_entropy)
                opt.step(ctx)
        pipe.save(path, optimizer=opt, step=2)
    written = json.loads((path / "rrefpipe.json").read_text())["workers"]
    assert sorted(written.values()) == sorted(stage_workers) or r != 0, (written, list(stage_workers))  # its own
    assert r == 0 or not set(written.values()) & set(stage_workers), written  # replica 0 wrote
    with Pipe(mlp(seed=9), chunks=2, balance=[2, 3], workers=stage_workers, schedule="GPipe") as pipe:
        opt = pipe.optimizer(torch.optim.AdamW, lr=0.02)
        assert pipe.load(path, optimizer=opt) == 2
        for shares in steps[2:]:
            with dist_autograd.context() as ctx:
                pipe.train_step(ctx, *shares[r], F.cross_entropy)
                opt.step(ctx)
        assert_same_parameters(pipe, plain, "saved by replica 0, loaded by every replica")
    dist.barrier(group=replicas.current().group)  # type: ignore[union-attr]  # every replica has read it
    if r == 0:
        shutil.rmtree(path)
    print(f"OK replica {r}: sharded checkpoint written by replica 0, loaded by all into another balance", flush=True)


def mismatch(stage_workers: workers.StageWorkers) -> None:
    width = 8 if stage_workers.replica == 0 else 9
    try:
        Pipe(mlp(width=width), chunks=2, balance=[3, 2], workers=stage_workers)
    except ValueError as exc:
        print(f"REFUSED replica {stage_workers.replica}: {exc}", flush=True)
        return
    raise AssertionError("a pipe unlike the other replica's was built")


def run_until_failure(stage_workers: workers.StageWorkers, model: nn.Sequential, balance: list[int], steps: int,
                      before_step: Callable[[int], None] = lambda k: None) -> bool:
    """Train ``steps`` steps of this replica's shares (``before_step(k)`` first); print how the first failing
    one failed and when, and return False, or True when all ran."""
    r = stage_workers.replica
    start = time.monotonic()
    try:
        with Pipe(model, chunks=2, balance=balance, workers=stage_workers, schedule="1F1B") as pipe:
            for k, shares in enumerate(batches(steps, [4] * stage_workers.replicas)):
                before_step(k)
                start = time.monotonic()
                with dist_autograd.context() as ctx:
                    pipe.train_step(ctx, *shares[r], F.cross_entropy)
    except StageError as exc:
        print(f"FAILED replica {r} after {time.monotonic() - start:.1f}s: {exc}", flush=True)
        return False
    return True


def extra_step(stage_workers: workers.StageWorkers) -> None:
    r = stage_workers.replica
    if run_until_failure(stage_workers, mlp(), [3, 2], steps=2 if r == 0 else 1):
        print(f"DONE replica {r}", flush=True)


class DieOnStep(nn.Module):
    """Kills its worker process (SIGKILL) in the forward of its ``step``-th call on replica 0."""

    def __init__(self, step: int, replica: int) -> None:
        super().__init__()
        self.step, self.replica, self.calls = step, replica, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.replica == 0 and self.calls == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
        return x


def kill_worker(stage_workers: workers.StageWorkers) -> None:
    model = nn.Sequential(*mlp(), DieOnStep(step=5, replica=stage_workers.replica))  # step 2's micro-batch 0
    assert not run_until_failure(stage_workers, model, [3, 3], steps=4), "the steps went on without a worker"


def kill_driver(stage_workers: workers.StageWorkers) -> None:
    def die(k: int) -> None:
        if k == 1 and stage_workers.replica == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    assert not run_until_failure(stage_workers, mlp(), [3, 2], steps=3, before_step=die), \
        "the steps went on without replica 1"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["train", "mismatch", "extra-step", "kill-worker", "kill-driver"],
                   default="train")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--layout", default="replica")
    p.add_argument("--interface")
    p.add_argument("--collective-timeout", type=float)
    args = p.parse_args()
    with workers.torchrun_group(replicas=args.replicas, layout=args.layout, interface=args.interface, threads=1,
                                rpc_timeout=60, collective_timeout=args.collective_timeout) as stage_workers:
        modes = {"train": train, "mismatch": mismatch, "extra-step": extra_step, "kill-worker": kill_worker,
                 "kill-driver": kill_driver}
        modes[args.mode](stage_workers)


if __name__ == "__main__":
    main()
