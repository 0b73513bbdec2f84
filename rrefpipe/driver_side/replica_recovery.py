"""Going on with fewer replicas: what a driver does when a step fails in a job started with
``workers.torchrun_group(replicas=R, on_replica_loss="continue")``.

A replica is lost when one of its processes (its driver or a stage worker) is: dead, or not answering a
ping within 2 s. After a failed step each driver pings every process of the job
(:func:`rrefpipe.replicas.unreachable`); a failure with every process answering is not a loss and is raised
as it is. Then::

    lost replica's driver                     each surviving replica's driver
    ---------------------                     -------------------------------
    publish its account to the job's store    rebuild the drivers' group without the lost replicas
    raise ReplicaLost (its `with` block       agree over it: the same replicas lost, the same steps done
      ends: its stage workers are stopped)    publish the decision (the first survivor)
                                              have each of its stage workers rebuild its group (RPC)
                                              read what the lost drivers published (up to 2 s
                                                for a driver that answered the ping)
                                              raise ReplicasDropped: run the step again

A replica dropped while alive (a process of it busy past the pings) finds the decision at its next failed
step and raises ``ReplicaLost`` too.

Nothing of the failed step was applied (the optimizer steps after ``train_step`` returns), so the step run
again, averaged over the survivors' rows only, continues the run exactly as if the lost replicas had left
before it. The lost replicas' share of this step and of every later one is not trained: the survivors go on
with their own batches, and giving them the lost share is the user's choice
(``stage_workers.live`` says who is left).
"""
from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist
import torch.distributed.rpc as rpc

from .. import replicas
from ..errors import ReplicaLost, ReplicasDropped, first_line

__all__: list[str] = []

PING_WITHIN = 2.0  # seconds a process of the job has to answer before it counts as gone
REPORT_WAIT = 2.0  # seconds a survivor waits for a live lost replica's driver to publish its account

_averaged = [0]  # this driver's train_steps averaged over the replicas so far


def step_averaged() -> None:
    """Count a train_step whose gradients were averaged over the replicas (it returned)."""
    _averaged[0] += 1


def after_failure(exc: BaseException) -> None:
    """Called by ``train_step`` when a step failed in a job of replicas. Returns when the job does not go on
    without lost replicas, or when no process of the job is gone (the caller raises ``exc``); raises
    :class:`ReplicaLost` on a lost replica's driver and :class:`ReplicasDropped` on a survivor's, once its
    groups and its stage workers' are rebuilt."""
    m = replicas.current()
    if m is None or m.on_loss != "continue":
        return
    start = time.perf_counter()
    line = first_line(exc)
    decided = replicas.read(f"dropped/{m.generation + 1}", 0)
    if decided is not None and m.replica in decided["lost"]:  # the others went on without this replica
        raise ReplicaLost(
            f"replica {m.replica} was dropped by replicas {decided['live']} after {decided['step']} steps averaged "
            f"over every replica: they found {', '.join(map(repr, decided['gone']))} gone or not answering within "
            f"{PING_WITHIN:g} s (a process of this replica busy for that long counts as lost). This replica cannot "
            f"rejoin; leave the torchrun_group block ({line})", m.replica, tuple(decided["gone"]),
            int(decided["step"])) from exc
    gone = tuple(replicas.unreachable(PING_WITHIN))
    by_name = dict(zip(m.job, m.job_replicas))
    lost = tuple(sorted({by_name[name] for name in gone if name in by_name} & set(m.live_replicas)))
    if not lost:
        return
    step = _averaged[0]
    if m.replica in lost:
        own = tuple(name for name in gone if by_name.get(name) == m.replica)
        account = f"{', '.join(map(repr, own))} gone after {step} averaged steps ({line})"
        try:
            replicas.publish(f"lost/{m.replica}", {"gone": list(own), "step": step, "account": account})
        except Exception:  # the store's host is gone too: the survivors cannot go on anyway
            pass
        others = [r for r in m.live_replicas if r not in lost]
        raise ReplicaLost(
            f"replica {m.replica} is lost: {', '.join(map(repr, own))} of it "
            f"{'is' if len(own) == 1 else 'are'} gone or do{'es' if len(own) == 1 else ''} not answer, in the step "
            f"after {step} steps averaged over every replica ({line}). With on_replica_loss='continue' "
            + (f"replicas {others} go on without it from that step, averaging over their own rows; this replica's "
               "batches from that step on are not trained unless you give them to the others (stage_workers.live "
               "names who is left). " if others else "no replica is left to go on. ")
            + "Leave the torchrun_group block: its stage workers are stopped there.", m.replica, own, step) from exc
    live = tuple(r for r in m.live_replicas if r not in lost)
    generation = m.generation + 1
    replicas.rebuild(live, generation)  # the drivers' group first: where the survivors agree
    views: list[object] = [None] * len(live)
    dist.all_gather_object(views, (lost, step), group=replicas.current().group)  # type: ignore[union-attr]
    if any(view != (lost, step) for view in views):
        raise RuntimeError(f"the surviving replicas {list(live)} disagree on what happened (lost replicas, steps "
                           f"averaged: {dict(zip(live, views))}); they cannot go on as one model") from exc
    if replicas.current().first:  # type: ignore[union-attr]  # (for a dropped replica that was only slow)
        replicas.publish(f"dropped/{generation}", {"lost": list(lost), "live": list(live), "step": step,
                                                   "gone": list(gone)})
    _rebuild_workers(m, live, generation)
    reported = {}
    drivers = dict(zip(m.live_replicas, m.names))  # (on a driver, its group is the drivers')
    for r in lost:  # a dead driver reports nothing: no wait for it
        account = replicas.read(f"lost/{r}", 0 if drivers.get(r) in gone else REPORT_WAIT)
        if account is not None:
            reported[r] = str(account["account"])
    loss = replicas.ReplicaLoss(lost=lost, gone=gone, live=live, step=step,
                                seconds=round(time.perf_counter() - start, 3), reported=reported)
    replicas.losses.append(loss)
    raise ReplicasDropped(
        f"replica{'s' if len(lost) > 1 else ''} {list(lost)} lost ({', '.join(map(repr, gone))} gone) in the step "
        f"after {step} averaged steps; replicas {list(live)} go on without {'them' if len(lost) > 1 else 'it'}: "
        "nothing of this step was applied, run it again in a new distributed-autograd context (train_stream "
        f"does), averaged over the live replicas' rows ({line})", loss) from exc


def _rebuild_workers(m: replicas.Membership, live: tuple[int, ...], generation: int) -> None:
    """Have each of this replica's stage workers rebuild its group, all at once. A worker still waiting in
    the failed step's collective rebuilds once that ends (at the latest the collective timeout later), and
    the group waits up to that timeout for the other replicas' workers: each call is bounded by twice it."""
    own = [name for name, r in zip(m.job, m.job_replicas) if r == m.replica and name != rpc.get_worker_info().name]
    calls = {name: rpc.rpc_async(name, replicas.rebuild, args=(live, generation), timeout=2 * m.timeout + 10)
             for name in own}
    wait_all(calls, f"the stage workers of replica {m.replica} could not rebuild their groups without the lost "
                    "replicas")


def wait_all(calls: dict[str, Any], failure: str) -> None:
    """Wait for every worker's call; if any failed, raise a RuntimeError saying ``failure`` and, for each,
    the worker and the first line of its error."""
    failed = []
    for name, call in calls.items():
        try:
            call.wait()
        except Exception as exc:
            failed.append(f"{name}: {first_line(exc)}")
    if failed:
        raise RuntimeError(f"{failure}: {'; '.join(failed)}")
