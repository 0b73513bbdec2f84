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

With ``torchrun_group(replicas=R, on_replica_loss="continue")`` a replica that lost a process is dropped:
the survivors' drivers have every live process of theirs :func:`rebuild` its group without the lost
replicas (:mod:`rrefpipe.driver_side.replica_recovery`). A rebuilt group is a ``ProcessGroupGloo`` made over
a prefix of the job's store, not ``dist.new_group``: the latter needs the job's default group (broken, a
member is dead) or, with ``use_local_synchronization``, names the group from each process's count of groups,
which differs between drivers, stage workers and spares (docs/engine-notes-recovery.md, "Replicas").
"""
from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .errors import summary

__all__ = ["Membership", "ReplicaLoss", "join", "current", "average_gradients", "broadcast_from_first", "end_step",
           "check_same", "unreachable", "rebuild", "regroup", "let_go", "barrier", "losses", "ON_LOSS"]

#: What a job of replicas does when one loses a process: ``"stop"`` (every replica's step fails, naming
#: what is gone) or ``"continue"`` (the others drop it and go on, see :func:`rebuild`).
ON_LOSS = ("stop", "continue")


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
    job_replicas: tuple[int, ...] = ()  # the replica of every rank of the job (by rank): who a lost process takes
    live: tuple[int, ...] = ()  # the replicas in the group (by their number at launch); () for all of them
    generation: int = 0  # how many times the group was rebuilt without lost replicas
    on_loss: str = "stop"  # ``torchrun_group(on_replica_loss=)``

    @property
    def live_replicas(self) -> tuple[int, ...]:
        """The replicas in the group now, by their number at launch (all of them until one was dropped)."""
        return self.live or tuple(range(self.replicas))

    @property
    def first(self) -> bool:
        """Whether this process is of the first live replica: the one whose buffers the others take, and
        which writes a checkpoint (replica 0 until it is dropped)."""
        return self.replica == self.live_replicas[0]

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.ranks[self.live_replicas.index(self.replica)]


@dataclass(frozen=True)
class ReplicaLoss:
    """One time the replicas went on without some of them (``on_replica_loss="continue"``), as this
    driver saw it: ``lost`` replicas (numbered as at launch), the job's processes that did not answer
    (``gone``), the replicas that go on (``live``), ``step``: how many steps had been averaged over every
    replica (the step that failed is the next one, run again by the survivors alone), and what each lost
    replica's driver reported, where it was alive to (``reported``: replica -> its account)."""

    lost: tuple[int, ...]
    gone: tuple[str, ...]
    live: tuple[int, ...]
    step: int
    seconds: float
    reported: dict[int, str]


_membership: Membership | None = None
_lock = threading.RLock()  # a process's collectives between replicas and a rebuild of its group never overlap
_retired: list[Any] = []  # groups replaced by a rebuild, kept: a group's destructor waits for its collectives
losses: list[ReplicaLoss] = []  # on a driver: every loss of replicas it went on from, oldest first


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
    # (group_src: a rebuilt group is not in c10d's registry, which ``src``, a global rank, is looked up in)
    _flat_collective(list(tensors), lambda flat: dist.broadcast(flat, group_src=0, group=m.group))


def end_step(params: Sequence[Tensor], grads: Sequence[Tensor | None], rows: int,
             buffers: Sequence[Tensor], generation: int | None = None) -> list[Tensor | None]:
    """What a stage worker does at the end of a step: its gradients averaged over the replicas (see
    :func:`average_gradients`), and replica 0's buffers taken. A failure names the job's processes that
    do not answer (dead, or stuck in a layer), where the collective's own error names none.

    ``generation``: the group's generation the driver planned the step for; a step planned before the group
    was rebuilt (one called off, whose thread only gets here now) fails instead of joining the new group's
    collectives, which belong to the survivors' next steps."""
    with _lock:
        m = _require()
        if generation is not None and generation != m.generation:
            raise RuntimeError(f"this step was planned for the replicas' group of generation {generation}, and the "
                               f"group is now of generation {m.generation} (replicas {list(m.live_replicas)})")
        try:
            averaged = average_gradients(grads, rows, params)
            if buffers:
                broadcast_from_first(buffers)
        except Exception as exc:
            failed: Exception | None = exc
        else:
            failed = None
    if failed is not None:  # (the pings outside the lock: a rebuild need not wait for them)
        gone = unreachable()
        who = (f"{', '.join(repr(name) for name in gone)} of the job {'is' if len(gone) == 1 else 'are'} gone or "
               "do not answer" if gone else "every process of the job answers: a replica may have run fewer steps "
               "(out of data?) or stopped training")
        raise RuntimeError(f"averaging gradients with the other replicas ({', '.join(m.names)}) failed: {who} "
                           f"({summary(failed)})") from failed
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


def barrier() -> None:
    """Wait until every replica's process of this group gets here (an all-reduce of one number: a rebuilt
    group is not in c10d's registry, which ``dist.barrier`` looks groups up in)."""
    m = _require()
    with _lock:
        dist.all_reduce(torch.zeros(1), group=m.group)


def rebuild(live: Sequence[int], generation: int) -> None:
    """Replace this process's group by one of the ``live`` replicas' same processes only (those of the others
    are lost); called by each survivor's driver for itself and, over RPC, for each of its stage workers.
    Every live member must call it with the same arguments; it waits for them up to the group's timeout.
    Calling it again for a generation already built does nothing.

    The new group is a ``ProcessGroupGloo`` over a prefix of the job's store named by the generation and
    the members' ranks. Measured (docs/engine-notes-recovery.md, "Replicas"): it forms in 10-30 ms when
    the store's host lives; it cannot form once the store's host is dead. The old group is kept, not
    destroyed: its destructor would wait for a collective that still waits on a lost peer."""
    with _lock:
        m = _require()
        if generation <= m.generation:
            return
        if m.replica not in live:
            raise RuntimeError(f"replica {m.replica} was asked to rebuild its group without itself (live: {list(live)})")
        keep = [i for i, r in enumerate(m.live_replicas) if r in live]
        ranks, names = [m.ranks[i] for i in keep], [m.names[i] for i in keep]
        prefix = f"rrefpipe/replicas/{generation}/{'-'.join(map(str, ranks))}/"
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, _job_store()), ranks.index(m.rank), len(ranks),
                                          timedelta(seconds=m.timeout))
        except Exception as exc:
            raise RuntimeError(f"{m.names[m.live_replicas.index(m.replica)]} could not form the replicas' group "
                               f"{names} without the lost replicas within {m.timeout:g} s: the job's store is gone "
                               f"(its host, the rendezvous host, was lost) or a live replica did not take part "
                               f"({summary(exc)})") from exc
        _retired.append(m.group)
        join(replace(m, replicas=len(ranks), group=group, ranks=ranks, names=names, live=tuple(live),
                     generation=generation))


def regroup(ranks: Sequence[int], names: Sequence[str], generation: int) -> None:
    """Replace this process's group by a new one of ``ranks`` (global ranks, by live replica; ``names``:
    their RPC names), the same members as before but for a spare in a lost worker's place: called by each
    driver for itself and, over RPC, for each of its stage workers, a spare that takes a stage included
    (:mod:`rrefpipe.driver_side.replica_spares`). Every member must call it with the same arguments; it
    waits for them up to the group's timeout. Calling it again for a generation already built does nothing.
    Made as :func:`rebuild` makes its groups (a ``ProcessGroupGloo`` over a prefix of the job's store).

    Unlike :func:`rebuild`, the old group is let go first, not kept: a member of it may still wait in the
    failed step's collective for this process (a replica's worker whose own step failed before averaging),
    and closing it here makes that wait fail at once, instead of at the collective timeout, and that member
    come to the new group (measured: 1 ms after the close, where the timeout was 5 s). Nothing of this
    process waits in the old group: its collectives run under the lock held here."""
    with _lock:
        m = _require()
        if generation <= m.generation:
            return
        me = dist.get_rank()
        if me not in ranks:
            raise RuntimeError(f"rank {me} was asked to join the replicas' group of ranks {list(ranks)} without being "
                               "one of them")
        old = m.group
        join(replace(m, group=None))
        m = _require()
        _let_go(old)
        del old  # (the last reference: its Gloo connections close with it)
        prefix = f"rrefpipe/replicas/{generation}/{'-'.join(map(str, ranks))}/"
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, _job_store()), list(ranks).index(me), len(ranks),
                                          timedelta(seconds=m.timeout))
        except Exception as exc:
            raise RuntimeError(f"rank {me} could not form the replicas' group {list(names)} within {m.timeout:g} s: "
                               f"the job's store is gone or a member did not take part ({summary(exc)})") from exc
        join(replace(m, group=group, ranks=list(ranks), names=list(names), generation=generation))


def let_go(generation: int) -> None:
    """Close this process's group of ``generation`` (if it still is that one): called over RPC by a driver that
    found a process of the job gone, on its stage workers, before :func:`regroup` replaces their groups. A peer
    still waiting for this process in the failed step's collective then fails at once (its connection closed)
    instead of at the collective timeout, and its driver learns of the failure that much sooner. Waits for
    this process's own collective, if one runs."""
    with _lock:
        m = _require()
        if m.generation != generation or m.group is None:
            return
        old = m.group
        join(replace(m, group=None))
        del m
        _let_go(old)


def _let_go(group: Any) -> None:
    """Take ``group`` out of c10d's registry (a group ``torchrun_group`` made; a rebuilt one is not in it), so
    that it is destroyed, its connections closed, once the caller drops it."""
    try:
        if group is not None and group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)
    except Exception:
        pass  # (only its closing is late then: the peers waiting in it fail at the collective timeout)


def publish(key: str, value: Any) -> None:
    """Write ``value`` (JSON) under ``key`` in the job's store (``rrefpipe/replicas/`` in front)."""
    _job_store().set(f"rrefpipe/replicas/{key}", json.dumps(value))


def read(key: str, within: float) -> Any:
    """What :func:`publish` wrote under ``key``, waiting up to ``within`` seconds (0: not at all); None if
    nothing (or no store to ask)."""
    store = _job_store()
    full = f"rrefpipe/replicas/{key}"
    try:
        if within > 0:
            store.wait([full], timedelta(seconds=within))
        elif not store.check([full]):
            return None
        return json.loads(store.get(full))
    except Exception:
        return None


def _job_store() -> Any:
    """The store of the job's default process group (a private torch function: torch keeps no public
    handle on it once ``init_process_group`` has made it)."""
    return dist.distributed_c10d._get_default_store()


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
