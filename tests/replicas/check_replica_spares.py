"""The script of tests/replicas/test_replica_spares.py: 2 replicas of a 2-stage pipeline, each on a "host" of
its own (a torchrun agent per replica, on this machine), each with one spare (``torchrun_group(replicas=2,
spares=1)``). Replica 1's driver SIGKILLs its own last stage worker before step ``KILL_AT`` (with
``--update``: during that step's optimizer step, after replica 1's first stage was updated; replica 0's
update goes through and its next step fails): replica 1's spare takes the lost stage, every stage of
replica 1 takes its state from replica 0's same stage, and both replicas go on. Each driver then checks itself against plain PyTorch trained on both replicas'
batches (the uninterrupted data-parallel run; ``OK ...`` lines, ``DONE replica r``):

* every loss ``train_stream`` yielded: its own share's loss under the plain model's weights then;
* the final weights, atol 1e-6, rtol 0;
* ``pipe.recoveries``: on replica 1, worker6 -> worker7 from replica 0; none on replica 0.

The guide's section "Spares with replicas" (docs/guide/recovery.md) shows the block between the ``guide``
marks, less the lines marked ``# (test)``; the test checks that it is this file's text.
"""
from __future__ import annotations

import copy
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import Tensor, nn

import workers
from rrefpipe import Pipe

STEPS, KILL_AT = 6, 3
UPDATE = "--update" in sys.argv  # the kill comes during replica 1's optimizer step of step KILL_AT
ROWS = [6, 4]  # each step's share of replica 0 and replica 1


def shares(seed: int = 1) -> list[list[tuple[Tensor, Tensor]]]:
    """Per step, each replica's (input, target), the same on both drivers."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in ROWS]
            for _ in range(STEPS)]


def plain_run(model: nn.Module, steps: list[list[tuple[Tensor, Tensor]]], r: int) -> tuple[list[Tensor], nn.Module]:
    """Plain PyTorch on both shares of every step; replica ``r``'s own loss of each step."""
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    losses = []
    own = slice(0, ROWS[0]) if r == 0 else slice(ROWS[0], None)
    for step in steps:
        x, y = torch.cat([x for x, _ in step]), torch.cat([y for _, y in step])
        opt.zero_grad()
        out = plain(x)
        F.cross_entropy(out, y).backward()
        losses.append(F.cross_entropy(out[own], y[own]).detach())
        opt.step()
    return losses, plain


def _sleep_in_updates(seconds: float) -> None:
    """On a stage worker: each optimizer step sleeps ``seconds`` first (for a kill during one)."""
    from rrefpipe.stage_side import stage_optim

    step = stage_optim.step

    def sleeping(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return step(*args, **kwargs)

    stage_optim.step = sleeping


def kill_in_update(worker: str) -> None:
    """Have ``worker`` SIGKILLed 0.7 s from now, during the next optimizer step, which sleeps 2 s on it."""
    rpc.rpc_sync(worker, _sleep_in_updates, args=(2.0,))
    pid = rpc.rpc_sync(worker, os.getpid)

    def kill() -> None:
        os.kill(pid, signal.SIGKILL)
        print(f"KILLED at {time.time():.3f}", flush=True)

    threading.Timer(0.7, kill).start()


def main() -> None:
    steps = shares()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    initial = copy.deepcopy(model)
    # guide: begin
    with workers.torchrun_group(replicas=2, spares=1, threads=1, rpc_timeout=60,
                                collective_timeout=5) as stage_workers:
        r = stage_workers.replica
        pipe = Pipe(model, chunks=2, balance=[3, 2], schedule="1F1B", workers=stage_workers,
                    spares=stage_workers.spares)
        opt = pipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)

        def my_share():
            for t, step in enumerate(steps):
                if r == 1 and t == KILL_AT:  # replica 1's last stage worker dies, between two steps
                    if UPDATE:  # (test)
                        kill_in_update(pipe.stages[-1].worker)  # (test)
                        yield step[r]  # (test)
                        continue  # (test)
                    os.kill(rpc.rpc_sync(pipe.stages[-1].worker, os.getpid), signal.SIGKILL)
                    print(f"KILLED at {time.time():.3f}", flush=True)  # (test)
                yield step[r]

        losses = []
        for loss in pipe.train_stream(my_share(), F.cross_entropy, opt):
            losses.append(loss)
            print(f"STEP {len(losses) - 1} DONE at {time.time():.3f}", flush=True)  # (test)
        for record in pipe.recoveries:               # replica 1: its worker, the spare, the donor
            print(f"replica {r}: {record.worker} -> {record.spare} (stages {record.stages}) from "
                  f"{record.source} at {record.restored_update} updates, {record.seconds:.2f} s", flush=True)
        state = pipe.state_dict()
        serving = [stage.worker for stage in pipe.stages]  # (test)
    # guide: end
        expected, plain = plain_run(initial, steps, r)
        assert len(losses) == STEPS, len(losses)
        for t, (got, want) in enumerate(zip(losses, expected)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=lambda m, t=t: f"the loss of step {t}: {m}")
        print(f"OK replica {r}: {STEPS} losses as plain PyTorch's on both replicas' batches", flush=True)
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
        print(f"OK replica {r}: final weights as plain PyTorch's", flush=True)
        records = [(x.worker, x.spare, x.stages, x.source) for x in pipe.recoveries]
        want = [("worker6", "worker7", (1,), "replica 0")] if r == 1 else []
        assert records == want, records
        assert serving == (["worker5", "worker7"] if r == 1 else ["worker1", "worker2"]), serving
        print(f"OK replica {r}: recoveries {records}, stages on {serving}", flush=True)
        print(f"DONE replica {r}", flush=True)


if __name__ == "__main__":
    main()
