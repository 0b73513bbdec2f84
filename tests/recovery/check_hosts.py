"""Run under ``torchrun`` by tests/recovery/test_hosts.py on three network-namespace hosts, as the guide's
layout for recovery under torchrun: host 0 runs the driver alone (rank 0), host 1 the two stage workers
(worker1, worker2), host 2 the two spares (worker3, worker4: ``torchrun_group(spares=2)``, the job's last
ranks). After ``KILL_AFTER + 1`` updates of a 1F1B ``train_stream`` the driver tells the test, through the
Unix socket named by ``argv[1]``, that host 1 may die, and waits until the test says it has: the test
SIGKILLs every process of host 1 (its torchrun agent and both stage workers). The stream then recovers,
both stages moving to the spares, and goes on. After leaving the group the driver sends ``RESULT {json}``
(losses, final parameters, ``pipe.recoveries``, where each worker ran) on the socket; the test compares
it with plain PyTorch (:func:`reference`)."""
from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.nn.functional as F
from torch import nn

BATCHES = 8
KILL_AFTER = 4  # the loss of batch 4 yielded (5 updates): host 1 dies; the snapshot of update 3 is replayed from
SNAPSHOT_EVERY = 3
HOST_VARIABLE = "RRP_TEST_HOST"  # each host's torchrun agent (and so its ranks) gets its host's name in it


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(BATCHES)]


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses and final parameters of the same training, uninterrupted, in plain PyTorch."""
    plain = mlp()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        loss = F.cross_entropy(plain(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, plain.state_dict()


def main() -> None:
    import torch.distributed.rpc as rpc

    import workers
    from rrefpipe import Pipe

    with workers.torchrun_group(interface=sys.argv[2], rpc_timeout=30, threads=1, spares=2) as stage_workers:
        control = socket.socket(socket.AF_UNIX)  # (the driver only: stage workers serve inside torchrun_group)
        control.connect(sys.argv[1])
        replies = control.makefile("rb")
        names = [*stage_workers, *stage_workers.spares]
        hosts = {name: rpc.rpc_sync(name, os.getenv, args=(HOST_VARIABLE,)) for name in names}
        hosts["driver"] = os.environ[HOST_VARIABLE]
        with Pipe(mlp(), chunks=2, balance=[3, 2], workers=stage_workers, spares=stage_workers.spares,
                  schedule="1F1B", snapshot_every=SNAPSHOT_EVERY) as pipe:
            opt = pipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
            losses = []
            for t, loss in enumerate(pipe.train_stream(batches(), F.cross_entropy, opt)):
                losses.append(loss.item())
                if t == KILL_AFTER:
                    control.sendall(b"READY\n")
                    if replies.readline() != b"GO\n":  # the test killed host 1 (or is gone: b"")
                        raise SystemExit("the test did not say go")
            state = {name: value.tolist() for name, value in pipe.state_dict().items()}
            recoveries = [{"worker": r.worker, "stages": list(r.stages), "spare": r.spare,
                           "failed_update": r.failed_update, "restored_update": r.restored_update,
                           "replayed": r.replayed, "seconds": r.seconds} for r in pipe.recoveries]
            stages = [s.worker for s in pipe.stages]
        result = {"stage_workers": list(stage_workers), "spares": stage_workers.spares, "hosts": hosts,
                  "losses": losses, "state": state, "recoveries": recoveries, "stages": stages}
    control.sendall(("RESULT " + json.dumps(result) + "\n").encode())  # after leaving the group
    replies.close()
    control.close()


if __name__ == "__main__":
    main()
