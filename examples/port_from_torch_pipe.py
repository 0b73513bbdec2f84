"""A PyTorch 2.x ``torch.distributed.pipeline.sync.Pipe`` script, ported to rrefpipe's stage workers.

The model takes two inputs, ``pipe(x, mask)``, and its layers pass ``(hidden, mask)`` pairs on, each
spread into the next layer's two arguments, as PyTorch 2.x did. Before, with PyTorch 2.x::

    rpc.init_rpc("worker", rank=0, world_size=1)
    pipe = Pipe(model, chunks=4)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for x, mask, y in batches:
        loss = F.cross_entropy(pipe(x, mask).local_value(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

After: no ``init_rpc`` (rrefpipe starts a local stage worker per stage), ``.local_value()`` as before,
one ``dist_autograd.context()`` per step with ``pipe.backward``, a ``DistributedOptimizer`` over
``pipe.parameter_rrefs()``, and ``with`` to close the pipe. The script trains the pipe and the plain
model side by side and checks that losses and weights agree.

    python examples/port_from_torch_pipe.py
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import DistributedOptimizer

from rrefpipe import Pipe


class Encode(nn.Module):
    """Two inputs, as ``pipe(x, mask)`` spreads them; returns a pair."""

    def __init__(self, features: int, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(self.fc(x)), mask


class MaskedBlock(nn.Module):
    """A pair in (spread into two arguments), a pair out."""

    def __init__(self, width: int, features: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.gate = nn.Linear(features, width)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h + torch.tanh(self.fc(h)) * torch.sigmoid(self.gate(mask)), mask


class Classify(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, classes)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.fc(h)


def build(features: int = 8, width: int = 32, classes: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Encode(features, width), MaskedBlock(width, features), MaskedBlock(width, features),
                         Classify(width, classes))


def plain_forward(model: nn.Sequential, *inputs: torch.Tensor) -> torch.Tensor:
    """The model run as PyTorch 2.x's Pipe ran it: inputs spread into the first layer, pairs spread."""
    value: object = inputs
    for layer in model:
        value = layer(*value) if isinstance(value, tuple) else layer(value)
    assert isinstance(value, torch.Tensor)
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps (default: %(default)s)")
    args = parser.parse_args()

    model = build()
    plain = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=g), torch.rand(16, 8, generator=g),
                torch.randint(0, 4, (16,), generator=g)) for _ in range(args.steps)]

    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    with Pipe(model, chunks=4, balance=[2, 2]) as pipe:  # two stages, each on its own local worker
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        for step, (x, mask, y) in enumerate(batches):
            with dist_autograd.context() as ctx:
                loss = F.cross_entropy(pipe(x, mask).local_value(), y)  # several inputs: 2.x style
                pipe.backward(ctx, loss)
                opt.step(ctx)

            plain_loss = F.cross_entropy(plain_forward(plain, x, mask), y)
            plain_opt.zero_grad()
            plain_loss.backward()
            plain_opt.step()
            torch.testing.assert_close(loss, plain_loss)
            print(f"step {step}: loss {loss.item():.4f} (plain model {plain_loss.item():.4f})")
        state = pipe.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value)
    print(f"ported: {args.steps} steps on {len(pipe.balance)} stage workers, weights equal to the plain model's")


if __name__ == "__main__":
    main()
