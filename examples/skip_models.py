"""Skip connections on stage workers: a ResNet-style net and a U-Net-style net.

    python examples/skip_models.py --model resnet --stages 3
    python examples/skip_models.py --model unet --stages 4

Shortcuts are ``@skippable`` stash/pop pairs: the stashed tensor goes straight from the worker that
stashes it to the worker that pops it. The script trains a few steps through the pipe and in plain
PyTorch from the same seed, prints both losses, and shows what each stage received.
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.optim import DistributedOptimizer

from rrefpipe import Pipe
from rrefpipe.skip import Namespace, pop, skippable, stash


@skippable(stash=["shortcut"])
class Fork(nn.Module):
    """Keeps its input for the block's shortcut (or, in the U-Net, for the decoder)."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("shortcut", x)
        return x


@skippable(pop=["shortcut"])
class AddShortcut(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        shortcut = yield pop("shortcut")
        return F.relu(x + shortcut)


@skippable(pop=["shortcut"])
class ConcatShortcut(nn.Module):
    """Upsamples and concatenates the encoder's feature map (the U-Net long skip)."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        shortcut = yield pop("shortcut")
        x = F.interpolate(x, size=shortcut.shape[-2:], mode="nearest")
        return torch.cat([x, shortcut], dim=1)


def conv(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]


def resnet(width: int = 16, blocks: int = 4, classes: int = 10) -> nn.Sequential:
    layers: list[nn.Module] = [*conv(3, width)]
    for _ in range(blocks):
        ns = Namespace()  # each block reuses the name "shortcut" in its own namespace
        layers += [Fork().isolate(ns), *conv(width, width), nn.Conv2d(width, width, 3, padding=1),
                   nn.BatchNorm2d(width), AddShortcut().isolate(ns)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes))


def unet(width: int = 8, classes: int = 10) -> nn.Sequential:
    outer, inner = Namespace(), Namespace()
    return nn.Sequential(
        *conv(3, width), Fork().isolate(outer), nn.MaxPool2d(2),
        *conv(width, 2 * width), Fork().isolate(inner), nn.MaxPool2d(2),
        *conv(2 * width, 2 * width),
        ConcatShortcut().isolate(inner), *conv(4 * width, width),
        ConcatShortcut().isolate(outer), *conv(2 * width, width),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["resnet", "unet"], default="resnet")
    p.add_argument("--stages", type=int, default=3, help="stage workers (1-8)")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()

    torch.manual_seed(0)
    model = resnet() if args.model == "resnet" else unet()
    plain = copy.deepcopy(model)
    data = [(torch.randn(args.batch_size, 3, 16, 16), torch.randint(0, 10, (args.batch_size,)))
            for _ in range(args.steps)]
    with Pipe(model, chunks=args.chunks, checkpoint=args.checkpoint, devices=["cpu"] * args.stages) as pipe:
        print(*pipe.stages, sep="\n")
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.05)
        losses = []
        for x, y in data:
            with dist_autograd.context() as ctx:
                loss = F.cross_entropy(pipe(x).local_value(), y)
                # The raw call computes the same gradients here (no tied parameters, no replicas);
                # pipe.backward(ctx, loss) would also name the stage that fails (guide: The training loop).
                dist_autograd.backward(ctx, [loss])
                opt.step(ctx)
            losses.append(loss.item())
        traffic = pipe.traffic()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    for (x, y), loss in zip(data, losses):
        plain_opt.zero_grad()
        plain_loss = F.cross_entropy(plain(x), y)
        plain_loss.backward()
        plain_opt.step()
        print(f"pipe loss {loss:.5f}   plain loss {plain_loss.item():.5f}")
    print("received per stage (tensors, bytes):")
    for j, t in enumerate(traffic):
        print(f"  stage {j}: activations {t['activation']}, skip tensors {t['skip']}")
    print("(with chunks > 1 and BatchNorm the losses differ slightly: each micro-batch is normalised on its own)")


if __name__ == "__main__":
    main()
