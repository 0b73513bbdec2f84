"""The script of tests/replicas/test_replica_loss.py: 2 replicas of a 2-stage pipeline, each on a "host" of
its own (a torchrun agent per replica, on this machine), started with ``on_replica_loss="continue"``.
Replica 1's driver SIGKILLs its own last stage worker before step ``KILL_AT``: its driver gets
``ReplicaLost`` and prints ``LOST replica 1: ...``; replica 0 drops it, runs step ``KILL_AT`` again alone and
goes on, then checks itself against plain PyTorch (``OK ...`` lines, ``DONE replica 0``):

* before the step that failed: every step on both replicas' shares (the averaging weighted by rows is the
  gradient of the loss over their union);
* from that step on: replica 0's share alone;
* every loss ``train_stream`` yielded: replica 0's own share's loss under the plain model's weights then.

With ``--host``, replica 1's driver waits before step ``KILL_AT`` instead, and the test kills its host whole
(agent, driver and stage workers) while replica 0 runs that step: no driver of replica 1 reports.

The guide's section "Replicas" (docs/guide/recovery.md) shows the block between the ``guide`` marks, less
the lines marked ``# (test)`` (timing for the test); the test checks that it is this file's text.
"""
from __future__ import annotations

import copy
import os
import signal
import sys
import time

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import Tensor, nn

import workers
from rrefpipe import Pipe, ReplicaLost

STEPS, KILL_AT = 6, 3
ROWS = [6, 4]  # each step's share of replica 0 and replica 1


def shares(seed: int = 1) -> list[list[tuple[Tensor, Tensor]]]:
    """Per step, each replica's (input, target), the same on both drivers."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in ROWS]
            for _ in range(STEPS)]


def plain_run(model: nn.Module, steps: list[list[tuple[Tensor, Tensor]]], dropped_at: int) -> tuple[list[Tensor], nn.Module]:
    """Plain PyTorch: both shares per step before ``dropped_at``, replica 0's alone from it on; replica 0's
    own loss of each step (under the weights of that step)."""
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for t, step in enumerate(steps):
        used = step if t < dropped_at else step[:1]
        x, y = torch.cat([x for x, _ in used]), torch.cat([y for _, y in used])
        opt.zero_grad()
        out = plain(x)
        F.cross_entropy(out, y).backward()
        losses.append(F.cross_entropy(out[:ROWS[0]], y[:ROWS[0]]).detach())
        opt.step()
    return losses, plain


def main() -> None:
    steps = shares()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    initial = copy.deepcopy(model)
    # guide: begin
    with workers.torchrun_group(replicas=2, on_replica_loss="continue", threads=1, rpc_timeout=60,
                                collective_timeout=20) as stage_workers:
        r = stage_workers.replica
        pipe = Pipe(model, chunks=2, balance=[3, 2], schedule="1F1B", workers=stage_workers)
        opt = pipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)

        def my_share():
            for t, step in enumerate(steps):
                if r == 1 and t == KILL_AT:          # replica 1's last stage worker dies between two steps
                    if "--host" in sys.argv:  # (test)
                        print(f"HOST 1 READY at {time.time():.3f}", flush=True)  # (test)
                        time.sleep(600)  # the test kills this host whole meanwhile  # (test)
                    os.kill(rpc.rpc_sync(pipe.stages[-1].worker, os.getpid), signal.SIGKILL)
                    print(f"KILLED at {time.time():.3f}", flush=True)  # (test)
                yield step[r]

        losses = []
        try:
            for loss in pipe.train_stream(my_share(), F.cross_entropy, opt):
                losses.append(loss)
                if len(losses) == KILL_AT + 1:  # (test)
                    print(f"STEP {KILL_AT} DONE at {time.time():.3f}", flush=True)  # (test)
        except ReplicaLost as exc:                   # on replica 1's driver: it is out, the others go on
            print(f"LOST replica {r}: {exc}", flush=True)
            sys.exit(0)                              # (its stage workers are stopped as the block ends)
        for drop in stage_workers.losses:            # on replica 0's: what it went on from
            print(f"replica {r}: replicas {list(drop.lost)} lost ({', '.join(drop.gone)} gone) after "
                  f"{drop.step} steps, {drop.seconds:.2f} s; replicas {list(drop.live)} go on; their report: "
                  f"{drop.reported}", flush=True)
        state = pipe.state_dict()
    # guide: end
        (drop,) = stage_workers.losses
        assert stage_workers.live == [0] and drop.lost == (1,) and drop.step == KILL_AT, (stage_workers.live, drop)
        assert set(drop.gone) == {"driver1", "worker4", "worker5"} or "--host" not in sys.argv, drop
        expected, plain = plain_run(initial, steps, dropped_at=drop.step)
        assert len(losses) == STEPS, len(losses)
        for t, (got, want) in enumerate(zip(losses, expected)):
            torch.testing.assert_close(got, want, msg=lambda m, t=t: f"the loss of step {t}: {m}")
        print(f"OK replica {r}: {STEPS} losses as plain PyTorch's (both shares before step {drop.step}, replica 0's "
              "after)", flush=True)
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(state[name], value, msg=lambda m, name=name: f"{name}: {m}")
        print(f"OK replica {r}: final weights as plain PyTorch's", flush=True)
        print(f"DONE replica {r}", flush=True)


if __name__ == "__main__":
    main()
