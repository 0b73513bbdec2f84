"""Save a training run and resume it in another split: the resumed run ends where an uninterrupted one does.

    python examples/checkpoint_resume.py --steps 4 --more 4

Trains a small classifier through a pipeline of 2 stages (balance [3, 2]) on local stage workers with
Adam and a StepLR schedule, then saves it with `pipe.save`: a sharded checkpoint, each stage worker
writing its stage's weights and Adam state in parallel, the driver adding the scheduler's state and the
step (the guide's "Large models"). It then builds a pipe of 3 stages (balance [1, 2, 2]) from a model
on the meta device, so the driver never holds its weights, loads the checkpoint into it with
`pipe.load` (each worker reads only its stages' tensors) and trains `--more` steps. Then it trains the
same model for `--steps + --more` steps in the first split without stopping and prints how far the two
runs' weights are apart. Exits with status 1 if they are not equal (within float tolerance).

The optimizer is a `DistributedOptimizer` of `rrefpipe.optim.Adam`, not `torch.optim.Adam`: a schedule
and a checkpoint of its state need the `rrefpipe.optim` class (the guide's "The training loop",
Optimizers). `pipe.optimizer(torch.optim.Adam, lr=...)` saves and loads alike.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import DistributedOptimizer

import rrefpipe.optim
import workers
from rrefpipe import Pipe
from rrefpipe.optim import RemoteLRScheduler

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def make_model(seed: int) -> nn.Sequential:
    """No dropout: a resumed run's stages are seeded afresh, so dropout masks would differ."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


class Run:
    """A pipe with its optimizer and LR scheduler: what a checkpoint saves and restores."""

    def __init__(self, model: nn.Sequential, balance: list[int], stage_workers: list[str]) -> None:
        self.pipe = Pipe(model, chunks=4, balance=balance, workers=stage_workers)
        # rrefpipe.optim.Adam, not torch.optim.Adam: RemoteLRScheduler and pipe.save need it
        self.opt = DistributedOptimizer(rrefpipe.optim.Adam, self.pipe.parameter_rrefs(), lr=0.01)
        self.sched = RemoteLRScheduler(self.opt, torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5)
        self.step = 0

    def train(self, batches: Batches) -> float:
        loss = torch.tensor(float("nan"))
        for x, y in batches:
            with dist_autograd.context() as ctx:
                loss = F.cross_entropy(self.pipe(x).local_value(), y)
                self.pipe.backward(ctx, loss)
                self.opt.step(ctx)
            self.sched.step()
            self.step += 1
        return loss.item()

    def save(self, path: Path) -> None:
        """Each stage worker writes its part of ``path`` at once; the driver adds the rest."""
        self.pipe.save(path, optimizer=self.opt, lr_scheduler=self.sched, step=self.step)

    def load(self, path: Path) -> None:
        """Each stage worker reads its stages' share, whatever split saved it."""
        step = self.pipe.load(path, optimizer=self.opt, lr_scheduler=self.sched)
        assert step is not None
        self.step = step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="steps before the checkpoint (default: 4)")
    p.add_argument("--more", type=int, default=4, help="steps after resuming (default: 4)")
    args = p.parse_args()

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 20, generator=g), torch.randint(0, 4, (32,), generator=g))
               for _ in range(args.steps + args.more)]
    first, rest = batches[:args.steps], batches[args.steps:]

    with workers.LocalWorkers(3) as group, tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint"
        run = Run(make_model(seed=1), [3, 2], group.names[:2])
        print(f"trained {args.steps} steps in 2 stages, loss {run.train(first):.4f}; saving to {path.name}/")
        run.save(path)
        run.pipe.close()
        print("checkpoint:", " ".join(sorted(p.name for p in path.iterdir())))

        with torch.device("meta"):  # no weights on the driver: each worker builds its stages, then loads
            model = make_model(seed=2)
        resumed = Run(model, [1, 2, 2], group.names)
        resumed.load(path)
        start = resumed.step
        print(f"resumed, trained {args.more} more (from step {start}, in 3 stages), "
              f"loss {resumed.train(rest):.4f}, learning rates {resumed.sched.get_last_lr()}")
        after_resume = resumed.pipe.state_dict()
        resumed.pipe.close()

        straight = Run(make_model(seed=1), [3, 2], group.names[:2])
        print(f"uninterrupted run of {args.steps + args.more} steps, loss {straight.train(batches):.4f}")
        uninterrupted = straight.pipe.state_dict()
        straight.pipe.close()

    difference = max((after_resume[k] - uninterrupted[k]).abs().max().item() for k in uninterrupted)
    print(f"largest weight difference, resumed vs uninterrupted: {difference:.3g}")
    try:
        for key in uninterrupted:
            torch.testing.assert_close(after_resume[key], uninterrupted[key])
    except AssertionError as e:
        print(f"the resumed run differs from the uninterrupted one: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
