"""Replicas of a pipeline (data parallel x pipeline parallel): this process's place among them, and the
collectives that keep them one model, over the c10d groups ``workers.torchrun_group(replicas=R)`` made.

A stage worker's group joins stage worker k of every replica; a driver's joins the drivers. After each
step (under ``Pipe.no_sync()``, after the step that ends the accumulation, over the gradients of all its
steps) stage worker k of every replica averages its parameters' gradients with the others, weighted by
each replica's rows (so that the average is the gradient of the loss over all replicas' samples, also
when a replica's batch is smaller) and in one flat all-reduce per device and dtype (one message, not
one per parameter), then takes replica 0's buffers (BatchNorm's running statistics), as
``DistributedDataParallel`` broadcasts them. At start-up every worker takes replica 0's parameters and
buffers, and the drivers compare their pipes. Why not DDP: its reducer runs inside a backward, which
``Pipe.train_step`` does not run in distributed autograd (see :mod:`rrefpipe.stage_side.scheduled`), and its forward
runs collectives, which would tie every forward (evaluation too) of every replica together.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Membership", "join", "current", "average_gradients", "broadcast_from_first", "end_step", "check_same",
           "unreachable"]


@dataclass(frozen=True)
class Membership:
    """This process's replica, and its group: the same stage worker (or the driver) of every replica."""

    replica: int
    replicas: int
    group: Any  # a c10d ProcessGroup
    ranks: list[int]  # the group's global ranks, by replica
    names: list[str]  # their RPC names, by replica
    timeout: float  # seconds a collective waits for the other replicas
    job: tuple[str, ...] = ()  # the RPC names of every rank of the job: who to ask when a collective fails


_membership: Membership | None = None


def join(membership: Membership) -> None:
    global _membership
    _membership = membership


def current() -> Membership | None:
    """This process's membership, or None outside a job of several replicas."""
    return _membership


def average_gradients(grads: Sequence[Tensor | None], rows: int, like: Sequence[Tensor]) -> list[Tensor | None]:
    """Each gradient averaged over the replicas, weighted by their ``rows``: sum(rows_r g_r) / sum(rows_r),
    with a replica that has none for a parameter counting zero; None where no replica has one.

    ``like``: the parameters (for the shape, device and dtype of a missing gradient). Every replica must
    pass its parameters in the same order (the drivers checked that the replicas' pipes match). The
    averages are new tensors: ``grads`` are left as they are (they may be a context's own)."""
    m = _require()
    present = torch.tensor([float(rows)] + [float(g is not None) for g in grads], dtype=torch.float64)
    _all_reduce([present], m)
    total, counts = present[0].item(), present[1:].tolist()
    if total <= 0:
        raise ValueError("no replica had any rows in this step")
    filled = [g * (rows / total) if g is not None else torch.zeros_like(p) for g, p in zip(grads, like)]
    _all_reduce(filled, m)
    return [g if count > 0 else None for g, count in zip(filled, counts)]


def broadcast_from_first(tensors: Sequence[Tensor]) -> None:
    """Overwrite ``tensors`` in place with replica 0's."""
    m = _require()
    _flat_collective(list(tensors), lambda flat: dist.broadcast(flat, m.ranks[0], group=m.group))


def end_step(params: Sequence[Tensor], grads: Sequence[Tensor | None], rows: int,
             buffers: Sequence[Tensor]) -> list[Tensor | None]:
    """What a stage worker does at the end of a step: its gradients averaged over the replicas (see
    :func:`average_gradients`), and replica 0's buffers taken. A failure names the job's processes that
    do not answer (dead, or stuck in a layer), where the collective's own error names none."""
    try:
        averaged = average_gradients(grads, rows, params)
        if buffers:
            broadcast_from_first(buffers)
    except Exception as exc:
        m = _require()
        gone = unreachable()
        who = (f"{', '.join(repr(name) for name in gone)} of the job {'is' if len(gone) == 1 else 'are'} gone or "
               "do not answer" if gone else "every process of the job answers: a replica may have run fewer steps "
               "(out of data?) or stopped training")
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        raise RuntimeError(f"averaging gradients with the other replicas ({', '.join(m.names)}) failed: {who} "
                           f"({type(exc).__name__}: {first_line})") from exc
    return averaged


def unreachable(within: float = 2.0) -> list[str]:
    """The job's other processes that do not answer a ping within ``within`` seconds (asked all at once)."""
    import torch.distributed.rpc as rpc

    m = _require()
    me = rpc.get_worker_info().name
    pings = {}
    for name in m.job or m.names:
        if name != me:
            try:
                pings[name] = rpc.rpc_async(name, _alive, timeout=within)
            except Exception:
                pings[name] = None
    gone = []
    for name, ping in pings.items():
        try:
            if ping is None:
                raise RuntimeError
            ping.wait()
        except Exception:
            gone.append(name)
    return gone


def _alive() -> bool:
    return True


def check_same(summary: list[str]) -> None:
    """Raise a ValueError naming the replicas whose pipe (``summary``: one line per stage and setting)
    differs from replica 0's; called by every driver when a pipe is built."""
    m = _require()
    gathered: list[list[str] | None] = [None] * m.replicas
    dist.all_gather_object(gathered, summary, group=m.group)
    first = gathered[0] or []
    for replica, other in enumerate(gathered):
        if other != first:
            diff = next((f"replica 0: {a!r}\n  replica {replica}: {b!r}" for a, b in zip(first, other or [])
                         if a != b), f"replica 0 has {len(first)} stages and settings, replica {replica} "
                                     f"{len(other or [])}")
            raise ValueError(f"the replicas built different pipes: every replica must build the same model with "
                             f"the same stages and settings (their gradients are averaged stage by stage). First "
                             f"difference:\n  {diff}")


def _require() -> Membership:
    if _membership is None:
        raise RuntimeError("this process is not in a job of several replicas (workers.torchrun_group(replicas=R))")
    return _membership


def _all_reduce(tensors: list[Tensor], m: Membership) -> None:
    _flat_collective(tensors, lambda flat: dist.all_reduce(flat, group=m.group))


def _flat_collective(tensors: list[Tensor], collective: Any) -> None:
    """``collective`` on one flat buffer per device and dtype, copied back into ``tensors`` in place: one
    message per buffer instead of one per tensor. Buffers go in a fixed order, the same on every replica."""
    buckets: dict[tuple[str, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        buckets.setdefault((str(t.device), t.dtype), []).append(t)
    for key in sorted(buckets, key=str):
        bucket = buckets[key]
        flat = torch.cat([t.reshape(-1) for t in bucket])
        collective(flat)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
