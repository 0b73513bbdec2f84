"""Run under ``torchrun`` by tests/recovery/test_torchrun.py, as two "hosts" (two torchrun agents with a
static rendezvous): host 0 runs the driver (rank 0) and workers 1 and 2, host 1 runs worker 3. The pipe's
stages are on worker1 and worker3, worker2 is the spare. The test kills host 1 whole (its agent and its
rank) mid-stream; the stream recovers onto the spare and ends where plain PyTorch does. The driver
prints ``READY`` when host 1 may be killed, then ``OK ...``, or raises."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import workers
from rrefpipe import Pipe


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 3))


def main() -> None:
    signal_file = Path(sys.argv[1])  # the test creates it once host 1 is dead
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(8)]
    plain = mlp()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches:
        plain_opt.zero_grad()
        loss = F.cross_entropy(plain(x), y)
        loss.backward()
        plain_opt.step()
        losses.append(loss.item())
    with workers.torchrun_group(rpc_timeout=30) as stage_workers:
        assert list(stage_workers) == ["worker1", "worker2", "worker3"], list(stage_workers)
        with Pipe(mlp(), chunks=2, balance=[3, 2], workers=["worker1", "worker3"], spares=["worker2"],
                  schedule="1F1B", snapshot_every=3) as pipe:
            opt = pipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
            got = []
            for t, loss in enumerate(pipe.train_stream(batches, F.cross_entropy, opt)):
                got.append(loss.item())
                if t == 4:
                    print("READY", flush=True)
                    while not signal_file.exists():  # the test kills host 1, then creates the file
                        signal_file.parent.stat()
            state = pipe.state_dict()
            [record] = pipe.recoveries
            assert (record.worker, record.spare, record.stages) == ("worker3", "worker2", (1,)), record
        torch.testing.assert_close(torch.tensor(got), torch.tensor(losses), atol=1e-6, rtol=0)
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0)
        print(f"OK recovered onto {record.spare} in {record.seconds:.2f} s, replayed {record.replayed}", flush=True)


if __name__ == "__main__":
    main()
