"""The training script of the multi-host tests: one script for every rank, as a user would write it.

Under ``torchrun`` every node runs it: rank 0 drives, other ranks serve stages inside
``workers.torchrun_group``. Against ``python -m workers`` stage workers it runs as rank 0 only (RANK=0 and
the rest set by the test). Rank 0 trains a few SGD steps of an MLP through a ``Pipe`` over all stage
workers and checks, at every step, the output, the input's gradient and every parameter's gradient against
the same model trained in this process (``torch.testing.assert_close``); at the end the pipe's state dict
against the plain model's. With ``--stream PipeDream-2BW`` (or another asynchronous schedule) it then runs
``pipe.train_stream`` under that schedule against the single-process simulation of its weight-version rule
(``tests/distributed/test_streams.py``), and ``pipe.stream`` under ``no_grad`` against the plain model. It
prints one line ``RESULT {json}`` with what was sent, for byte-counter checks.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import DistributedOptimizer

import workers


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--interface", help="network interface (or address) to bind")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--rpc-timeout", type=float, default=60)
    p.add_argument("--schedule", help="then train the same steps with pipe.train_step under this schedule too")
    p.add_argument("--stream", help="then pipe.train_stream under this asynchronous schedule against the simulation "
                                    "of its rule, and pipe.stream against the plain model")
    p.add_argument("--stream-batches", type=int, default=4)
    return p.parse_args()


def balance(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, stages)
    return [base + (j < extra) for j in range(stages)]


def main() -> None:
    args = parse_args()
    with workers.torchrun_group(interface=args.interface, rpc_timeout=args.rpc_timeout, threads=1) as stage_workers:
        from rrefpipe import Pipe
        from tests.distributed.probes import stage_gradients

        torch.manual_seed(0)
        b, f, h, c = args.batch, args.features, args.hidden, args.classes
        model = nn.Sequential(nn.Linear(f, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, c))
        reference = copy.deepcopy(model)
        reference_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
        start = time.monotonic()
        with Pipe(model, chunks=args.chunks, balance=balance(len(model), len(stage_workers)),
                  workers=stage_workers) as pipe:
            opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.05)
            for step in range(args.steps):
                x = torch.randn(b, f, requires_grad=True)
                y = torch.randint(0, c, (b,))
                with dist_autograd.context() as ctx:
                    out = pipe(x).local_value()
                    loss = F.cross_entropy(out, y)
                    dist_autograd.backward(ctx, [loss])
                    x_grad = dist_autograd.get_gradients(ctx)[x]
                    grads = stage_gradients(pipe, ctx)
                    opt.step(ctx)
                x_ref = x.detach().clone().requires_grad_()
                reference_opt.zero_grad()
                out_ref = reference(x_ref)
                F.cross_entropy(out_ref, y).backward()
                reference_opt.step()
                torch.testing.assert_close(out, out_ref)
                torch.testing.assert_close(x_grad, x_ref.grad)
                expected = {name: p.grad for name, p in reference.named_parameters()}
                assert grads.keys() == expected.keys(), (sorted(grads), sorted(expected))
                for name, grad in expected.items():
                    torch.testing.assert_close(grads[name], grad, msg=lambda m, name=name: f"step {step} {name}: {m}")
                print(f"step {step}: loss {loss.item():.4f}, outputs and gradients match the plain model", flush=True)
            state = pipe.state_dict()
            for name, value in reference.state_dict().items():
                torch.testing.assert_close(state[name], value)
            stages = [(s.worker, list(s.layers)) for s in pipe.stages]
        if args.schedule:
            check_train_step(model, args, stage_workers)
        if args.stream:
            check_streams(args, stage_workers)
        result = {
            "rank": int(os.environ["RANK"]), "workers": stage_workers, "stages": stages, "steps": args.steps,
            "seconds": time.monotonic() - start,
            # float32 bytes per step: the input (driver -> stage 0) and each stage's output (-> the next hop)
            "input_bytes": b * f * 4, "activation_bytes": [b * h * 4] * (len(stage_workers) - 1),
            "output_bytes": b * c * 4,
        }
        print("RESULT " + json.dumps(result), flush=True)


def check_train_step(model: nn.Module, args: argparse.Namespace, stage_workers: list[str]) -> None:
    """``pipe.train_step`` under ``args.schedule`` across the hosts: the loss, every gradient and the
    parameters after each SGD step equal the plain model's."""
    from rrefpipe import Pipe
    from tests.distributed.probes import stage_gradients

    reference = copy.deepcopy(model)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    with Pipe(model, chunks=args.chunks, balance=balance(len(model), len(stage_workers)), workers=stage_workers,
              schedule=args.schedule, checkpoint="never") as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.05)
        for step in range(args.steps):
            x = torch.randn(args.batch, args.features)
            y = torch.randint(0, args.classes, (args.batch,))
            with dist_autograd.context() as ctx:
                loss = pipe.train_step(ctx, x, y, F.cross_entropy)
                grads = stage_gradients(pipe, ctx)
                opt.step(ctx)
            reference_opt.zero_grad()
            expected_loss = F.cross_entropy(reference(x), y)
            expected_loss.backward()
            reference_opt.step()
            torch.testing.assert_close(loss, expected_loss.detach())
            for name, p in reference.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, msg=lambda m, name=name: f"step {step} {name}: {m}")
            print(f"{args.schedule} step {step}: loss {loss.item():.4f} and gradients match the plain model", flush=True)
        state = pipe.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value)


def check_streams(args: argparse.Namespace, stage_workers: list[str]) -> None:
    """``pipe.train_stream`` under ``args.stream`` (SGD with momentum, the last batch smaller) across the
    hosts: each batch's loss and the parameters at the end equal the single-process simulation of the
    schedule's weight-version rule, which synchronous training does not match. Then ``pipe.stream`` under
    ``no_grad``: every output, in order, equals the plain model with the pipe's trained weights."""
    from rrefpipe import Pipe
    from tests.distributed.test_streams import rule, simulate, stage_names

    start = time.monotonic()
    torch.manual_seed(1)
    b, f, h, c = args.batch, args.features, args.hidden, args.classes
    model = nn.Sequential(nn.Linear(f, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, c))
    plain = copy.deepcopy(model)
    rows = [b] * (args.stream_batches - 1) + [b // 2 + 3]
    data = [(torch.randn(r, f), torch.randint(0, c, (r,))) for r in rows]
    stages = balance(len(model), len(stage_workers))
    names = stage_names(plain, stages)

    def make_opt(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    forward, backward = rule(args.stream, len(stage_workers), args.chunks)
    expected, weights = simulate(copy.deepcopy(plain), names, data, make_opt, args.chunks, forward, backward)
    _, synchronous = simulate(copy.deepcopy(plain), names, data, make_opt, args.chunks, lambda t, i, j: t)
    with Pipe(model, chunks=args.chunks, balance=stages, workers=stage_workers, schedule=args.stream,
              checkpoint="never") as pipe:
        optimizer = pipe.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
        losses = [loss.item() for loss in pipe.train_stream(iter(data), F.cross_entropy, optimizer)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected),  # float32 tolerances
                                   msg=lambda m: f"{args.stream} losses {losses} != {expected}: {m}")
        for t, loss in enumerate(losses):
            print(f"{args.stream} train_stream batch {t}: loss {loss:.4f} as the simulation of the rule", flush=True)
        state = pipe.state_dict()
        assert state.keys() == weights.keys(), (sorted(state), sorted(weights))
        for name, value in weights.items():
            torch.testing.assert_close(state[name], value, msg=lambda m, name=name: f"{args.stream} {name}: {m}")
        assert any(not torch.allclose(state[k], synchronous[k], rtol=1.3e-6, atol=1e-5) for k in weights), \
            f"{args.stream} ended where synchronous training does: the check cannot tell the rules apart"
        plain.load_state_dict(state)
        inputs = [x for x, _ in data]
        with torch.no_grad():
            outputs = list(pipe.stream(iter(inputs)))
            assert len(outputs) == len(inputs), (len(outputs), len(inputs))
            for k, (out, x) in enumerate(zip(outputs, inputs)):
                torch.testing.assert_close(out, plain(x), msg=lambda m, k=k: f"stream input {k}: {m}")
        print(f"{args.stream} stream: {len(inputs)} outputs equal the plain model's, in order "
              f"({time.monotonic() - start:.2f} s for both checks)", flush=True)


if __name__ == "__main__":
    main()
