"""Train through a pipeline whose stage workers run on several hosts, launched with torchrun.

One script for every process of the job: rank 0 is the driver (it runs the training loop), every other
rank serves one pipeline stage and exits when the driver is done. Two hosts x N processes, HOST0 and
HOST1 being the hosts' addresses on the network they share; each host names its own interface on that
network (IFACE0, IFACE1: a name such as eth1, or the host's address):

    # on host 0 (rank 0 = driver, ranks 1..N-1 = stage workers)
    torchrun --nnodes 2 --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id job1 \\
        --rdzv-conf is_host=1 --local-addr HOST0 examples/multihost.py --interface IFACE0
    # on host 1 (ranks N..2N-1 = stage workers)
    torchrun --nnodes 2 --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id job1 \\
        --rdzv-conf is_host=0 --local-addr HOST1 examples/multihost.py --interface IFACE1

That is 2N-1 stages; only host 0 prints results. A host that never comes leaves the other waiting for
torchrun's join_timeout (600 s; ``--rdzv-conf is_host=1,join_timeout=120`` shortens it). On one host,
for a try: ``torchrun --standalone --nproc-per-node 3 examples/multihost.py`` (MASTER_ADDR is loopback,
so everything binds to ``lo``). ``--cuda`` puts the stage of each rank on
``cuda:LOCAL_RANK`` (modulo the host's GPUs: on one GPU every stage shares ``cuda:0``), activations going
GPU to GPU between hosts through TensorPipe device maps.

Rank 0 prints the stages (layers, worker, device), the loss, samples/s, and the same training run in
plain PyTorch for comparison.
"""
from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import workers
from demo import dataset, train_pipe, train_plain  # examples/ is this script's directory
from rrefpipe import Pipe


def make_model(stages: int, width: int, classes: int) -> tuple[nn.Sequential, list[int]]:
    """An MLP and its balance: Linear + ReLU per stage, the last stage adding the classifier."""
    layers: list[nn.Module] = []
    features = 20
    for _ in range(stages):
        layers += [nn.Linear(features, width), nn.ReLU()]
        features = width
    return nn.Sequential(*layers, nn.Linear(width, classes)), [2] * (stages - 1) + [3]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interface", help="network interface (or this host's address on it) the RPC group uses; "
                   "default: lo when MASTER_ADDR is loopback, else TensorPipe's guess (with a warning)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch (default: 4)")
    p.add_argument("--steps", type=int, default=50, help="training steps (default: 50)")
    p.add_argument("--batch-size", type=int, default=64, help="mini-batch size (default: 64)")
    p.add_argument("--width", type=int, default=128, help="width of the hidden layers (default: 128)")
    p.add_argument("--lr", type=float, default=0.03, help="SGD learning rate, momentum 0.9 (default: 0.03)")
    p.add_argument("--cuda", action="store_true", help="each stage worker on cuda:LOCAL_RANK (modulo the node's GPUs)")
    p.add_argument("--rpc-timeout", type=float, default=120, help="seconds an RPC may take (default: 120)")
    args = p.parse_args()

    with workers.torchrun_group(interface=args.interface, rpc_timeout=args.rpc_timeout,
                                devices="cuda" if args.cuda else None, threads=1) as stage_workers:
        # Only rank 0 gets here; stage_workers = ["worker1", ..., "worker<WORLD_SIZE-1>"].
        stages = len(stage_workers)
        group = workers.GroupEnv.from_environ()  # the same rule as devices="cuda" on each worker
        devices = [group.cuda_device(rank) for rank in range(1, stages + 1)] if args.cuda else ["cpu"] * stages
        torch.manual_seed(0)
        classes = 5
        model, balance = make_model(stages, args.width, classes)
        plain = copy.deepcopy(model)
        x_all, y_all = dataset(args.steps * args.batch_size, classes)
        batches = list(zip(x_all.split(args.batch_size), y_all.split(args.batch_size)))

        with Pipe(model, chunks=args.chunks, balance=balance, workers=stage_workers, devices=devices) as pipe:
            print("stages:")
            for stage in pipe.stages:
                print(f"  {stage}")
            loss, elapsed = train_pipe(pipe, batches, args.lr, log_every=max(1, args.steps // 5))
            state = pipe.state_dict()

        plain_loss = train_plain(plain, batches, args.lr)
        drift = max((state[k].cpu() - v).abs().max().item() for k, v in plain.state_dict().items())
        print(f"pipeline: {args.steps} steps in {elapsed:.2f}s, "
              f"{args.steps * args.batch_size / elapsed:.1f} samples/s, "
              f"final loss {loss:.4f}")
        print(f"plain PyTorch, same seed: final loss {plain_loss:.4f} "
              f"(difference {abs(plain_loss - loss):.2e}, largest parameter difference {drift:.2e})")


if __name__ == "__main__":
    main()
