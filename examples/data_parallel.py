"""Data parallel x pipeline parallel: R replicas of an n-stage pipeline, launched with torchrun.

One script for every process of the job. ``workers.torchrun_group(replicas=R)`` splits the WORLD_SIZE
processes into R replicas of a driver and WORLD_SIZE / R - 1 stage workers; each driver trains its own
replica on its share of every batch (``DistributedSampler`` with the replica's index and count), and
after every step stage k of each replica averages its gradients with stage k of the others, so all
replicas keep one model. On one host, 2 replicas of a 2-stage pipeline (6 processes)::

    torchrun --standalone --nproc-per-node 6 examples/data_parallel.py --replicas 2 --steps 5

On two hosts, one replica each (HOST0, HOST1 their addresses on the network they share, IFACE0, IFACE1
each host's interface on it)::

    # host 0: ranks 0-2, replica 0
    torchrun --nnodes 2 --nproc-per-node 3 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id job1 \\
        --rdzv-conf is_host=1 --local-addr HOST0 examples/data_parallel.py --replicas 2 --interface IFACE0
    # host 1: ranks 3-5, replica 1
    torchrun --nnodes 2 --nproc-per-node 3 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id job1 \\
        --rdzv-conf is_host=0 --local-addr HOST1 examples/data_parallel.py --replicas 2 --interface IFACE1

``--layout stage`` instead puts the drivers first and spreads each replica's stages over the hosts.
Every driver checks itself against plain PyTorch: the same model trained in its own process on the
whole batch (all replicas' shares) with the same loss and optimizer, and prints as its last line
``max parameter difference from plain PyTorch: <x>``.
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.optim import DistributedOptimizer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import workers
from rrefpipe import Pipe


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="replicas of the pipeline (default: 2)")
    p.add_argument("--layout", choices=workers.LAYOUTS, default="replica",
                   help="which rank is which: 'replica' keeps each replica's ranks together (default), 'stage' "
                        "spreads a replica's stages over the hosts")
    p.add_argument("--steps", type=int, default=5, help="training steps (default: 5)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per step, all replicas together (default: 32)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per replica's share (default: 4)")
    p.add_argument("--schedule", default="1F1B", help="GPipe, 1F1B or Interleaved1F1B (default: 1F1B)")
    p.add_argument("--checkpoint", default="never", help="always, except_last or never (default: never)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd", help="SGD with momentum, or Adam")
    p.add_argument("--interface", help="network interface (or this host's address on it) the job uses")
    p.add_argument("--cuda", action="store_true", help="each stage worker on cuda:LOCAL_RANK (modulo the node's "
                   "GPUs: on one GPU every stage of every replica shares cuda:0)")
    p.add_argument("--rpc-timeout", type=float, default=60, help="seconds an RPC or collective may take")
    return p.parse_args()


def make_model(stages: int, width: int = 32, features: int = 10, classes: int = 4) -> tuple[nn.Sequential, list[int]]:
    """An MLP of a Linear + ReLU per stage and a classifier on the last, and its balance."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for k in range(stages):
        layers += [nn.Linear(features if k == 0 else width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes)), [2] * (stages - 1) + [3]


def make_dataset(size: int = 512, features: int = 10, classes: int = 4) -> TensorDataset:
    """Four Gaussian clusters: the same on every process (a fixed generator)."""
    g = torch.Generator().manual_seed(1)
    centres = torch.randn(classes, features, generator=g) * 2
    y = torch.randint(0, classes, (size,), generator=g)
    return TensorDataset(centres[y] + torch.randn(size, features, generator=g), y)


def loaders(dataset: TensorDataset, replicas: int, share: int) -> list[DataLoader]:
    """Each replica's loader: its share of every batch, as DistributedSampler deals them."""
    return [DataLoader(dataset, batch_size=share, drop_last=True,
                       sampler=DistributedSampler(dataset, num_replicas=replicas, rank=r, shuffle=True, seed=0))
            for r in range(replicas)]


def optimizer_for(args: argparse.Namespace) -> tuple[type[torch.optim.Optimizer], dict[str, float]]:
    if args.optimizer == "adam":
        return torch.optim.Adam, {"lr": 0.01}
    return torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}


def main() -> None:
    args = parse_args()
    with workers.torchrun_group(replicas=args.replicas, layout=args.layout, interface=args.interface,
                                rpc_timeout=args.rpc_timeout, threads=1,
                                devices="cuda" if args.cuda else None) as stage_workers:
        # Only the drivers get here: replica `stage_workers.replica` of `stage_workers.replicas`.
        replica, replicas = stage_workers.replica, stage_workers.replicas
        group = workers.GroupEnv.from_environ(replicas=replicas, layout=args.layout)  # devices="cuda"'s rule
        devices = [group.cuda_device(group.rank_of(replica, k)) for k in range(len(stage_workers))] if args.cuda \
            else None
        model, balance = make_model(len(stage_workers))
        plain = copy.deepcopy(model)
        share = args.batch_size // replicas
        dataset = make_dataset()
        every_replica = loaders(dataset, replicas, share)  # this driver's own and, for the check, the others'
        optim_class, optim_args = optimizer_for(args)
        plain_opt = optim_class(plain.parameters(), **optim_args)
        with Pipe(model, chunks=args.chunks, checkpoint=args.checkpoint, balance=balance, workers=stage_workers,
                  schedule=args.schedule, devices=devices) as pipe:
            if replica == 0:
                print(f"{replicas} replicas of {len(stage_workers)} stages; replica 0's:", *pipe.stages, sep="\n  ")
            opt = DistributedOptimizer(optim_class, pipe.parameter_rrefs(), **optim_args)
            for step, shares in enumerate(zip(*every_replica)):
                if step == args.steps:
                    break
                x, y = shares[replica]
                with dist_autograd.context() as ctx:
                    loss = pipe.train_step(ctx, x, y, F.cross_entropy)  # gradients averaged over the replicas
                    opt.step(ctx)
                whole_x, whole_y = (torch.cat(parts) for parts in zip(*shares))
                plain_loss = train_plain_step(plain, plain_opt, whole_x, whole_y)
                print(f"replica {replica} step {step}: loss {loss.item():.4f} on its share, plain PyTorch "
                      f"{plain_loss:.4f} on the whole batch", flush=True)
            state = pipe.state_dict()
        drift = max((state[k] - v).abs().max().item() for k, v in plain.state_dict().items())
        print(f"replica {replica}: max parameter difference from plain PyTorch: {drift:.3g}", flush=True)


def train_plain_step(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor) -> float:
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


if __name__ == "__main__":
    main()
