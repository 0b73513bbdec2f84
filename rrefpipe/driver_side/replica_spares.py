"""Spares with replicas: a replica's lost stage worker replaced by one of its spares, which takes the stage's
state from the same stage of a live replica (``workers.torchrun_group(replicas=R, spares=k)`` and
``Pipe(..., spares=stage_workers.spares)``). No snapshot is kept: the other replicas are the copy, so being
recoverable costs nothing between failures.

After a step (``train_step``) or an update (``PipeOptimizer.step``) fails, each driver pings the job
(:func:`rrefpipe.replicas.unreachable`); with no process gone the error is raised as it is. Otherwise::

    every driver, over the drivers' group (intact: no driver died)
    ---------------------------------------------------------------
    agree: the processes gone, each replica's stage workers, spares and count of updates applied
    donor: a replica with every stage worker alive and the highest count (the lowest number on a tie)
    each replica that lost a worker takes one of its spares per lost worker
    every stage group (stage worker k of every replica) is made again, the spare in the lost one's slot
    each replica that lost a worker, or whose count is below the donor's: every stage rebuilt from the
      donor's same stage, sent worker to worker (``snapshots.give``), reconnected, optimizers restored
    wait for each other (the donor's stages must not move on before they were copied)
    raise StageReplaced: again=True (run the failed step again), or again=False on a replica whose count
      was below the donor's (its update failed where the donor's was done: it came with the donor's state)

Why the whole replica is rebuilt and not only the lost stage: an update that failed midway may have
stepped some stages and not others, and the donor's count says which state every replica must reach.
A step that failed in ``train_step`` applied nothing anywhere (the optimizer steps after it), so every
replica at the donor's count runs it again, averaged as before: the run goes on as an uninterrupted one.
Where this cannot recover (a driver gone, more workers lost in a replica than it has spares, no replica
left whole) the job does what ``on_replica_loss`` says (see :mod:`rrefpipe.driver_side.replica_recovery`).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from .. import replicas
from ..errors import StageReplaced, add_note, summary
from ..stage_side import snapshots
from . import pipe_optimizer, replica_recovery
from .recovery import Recovery, reconnect_rebuilt

__all__ = ["PeerGuard"]


_FIRST_OPTIMIZER = cloudpickle.dumps((torch.optim.SGD, {"lr": 0.1}))


class PeerGuard:
    """A replica's pipe with spares (see the module's docstring); ``driver.peers`` holds it."""

    def __init__(self, driver: Any, spares: Sequence[str]) -> None:
        self.driver = driver
        self.spares = list(spares)  # this replica's, not serving stages, alive as far as known
        self.updates = 0  # optimizer updates applied to the pipe (PipeOptimizer.step calls that returned)
        self.records: list[Recovery] = []
        self._warmed: set[int] = set()  # optimizers whose class the spares have built once
        self.gone: set[str] = set()  # the job's processes found gone by earlier recoveries
        for spare in self.spares:  # the first optimizer built imports torch._dynamo (1.1 s): now, not in a recovery
            rpc.rpc_async(spare, snapshots.warm, args=([_FIRST_OPTIMIZER],), timeout=driver.rpc_timeout)

    def applied(self) -> None:
        """One more update applied; the spares build each new optimizer class once, meanwhile (what its first
        construction imports, a second or more, is paid now and not in a recovery: ``snapshots.warm``)."""
        self.updates += 1
        fresh = [opt for opt in pipe_optimizer.owned(self.driver) if opt.id not in self._warmed]
        if fresh:
            self._warmed.update(opt.id for opt in fresh)
            for spare in self.spares:  # (not waited for)
                rpc.rpc_async(spare, snapshots.warm, args=([opt.payload for opt in fresh],),
                              timeout=self.driver.rpc_timeout)

    def recover(self, exc: BaseException, updating: bool) -> None:
        """After ``exc`` failed a step (``updating``: an optimizer step): returns when no process of the job
        is gone (the caller raises ``exc``); otherwise recovers and raises :class:`StageReplaced`, or raises
        what ``on_replica_loss`` says where this cannot recover."""
        started = time.perf_counter()
        m = replicas.current()
        assert m is not None
        driver = self.driver
        gone = [name for name in replicas.unreachable(replica_recovery.PING_WITHIN) if name not in self.gone]
        if not gone:  # (only processes already recovered from, or none, are gone: not a loss)
            return
        # this replica's stage workers close their groups now: a peer of another replica that waits in the failed
        # step's averaging for one of them fails at once, and its driver comes to the agreement below sooner
        closing = [rpc.rpc_async(w, replicas.let_go, args=(m.generation,), timeout=2 * m.timeout + 10)
                   for w in dict.fromkeys(driver.workers) if w not in gone]
        view = {"replica": m.replica, "gone": sorted(gone), "updates": self.updates, "pipe": driver.pipe_id,
                "workers": list(driver.workers), "spares": [s for s in self.spares if s not in gone],
                "optimizers": [(opt.id, sorted(opt.schedulers)) for opt in pipe_optimizer.owned(driver)],
                "generation": m.generation, "updating": updating}
        drivers_gone = [name for name in gone if name in m.names]
        if drivers_gone:
            self._cannot(exc, f"the driver(s) {drivers_gone} are gone: a replica is only rebuilt by its own driver")
        views: list[Any] = [None] * len(m.live_replicas)
        try:
            dist.all_gather_object(views, view, group=m.group)
        except Exception as error:
            self._cannot(exc, f"the drivers could not agree on what is gone ({summary(error)})")
        by = {v["replica"]: v for v in views}
        gone = sorted(set().union(*(v["gone"] for v in views)))
        self.gone.update(gone)
        lost = {r: [w for w in dict.fromkeys(v["workers"]) if w in gone] for r, v in by.items()}
        spares = {r: [s for s in v["spares"] if s not in gone] for r, v in by.items()}
        short = {r: (ws, spares[r]) for r, ws in lost.items() if len(ws) > len(spares[r])}
        if short:
            self._cannot(exc, "; ".join(f"replica {r} lost {ws} and has {len(free)} spare(s) left ({free})"
                                        for r, (ws, free) in short.items()))
        whole = [r for r in by if not lost[r]]
        if not whole:
            self._cannot(exc, f"every replica lost a stage worker ({gone} gone): none is left to take the state from")
        donor = max(whole, key=lambda r: (by[r]["updates"], -r))
        top = by[donor]["updates"]
        ahead = [r for r in by if by[r]["updates"] > top]
        if ahead:
            self._cannot(exc, f"replicas {ahead} applied more updates than every replica left whole ({top}, replica "
                              f"{donor}): no live replica holds the state they reached")
        targets = [r for r in by if lost[r] or by[r]["updates"] < top]
        moved = {r: dict(zip(lost[r], spares[r])) for r in by}
        new = {r: [moved[r].get(w, w) for w in v["workers"]] for r, v in by.items()}
        generation = max(v["generation"] for v in views) + 1
        for call in closing:  # (done before the groups are made again; a failure shows in regroup)
            try:
                call.wait()
            except Exception:
                pass
        self._regroup(m, [by[r]["replica"] for r in by], new, generation)
        mine = m.replica
        behind = by[mine]["updates"] < top
        if behind and not updating:
            raise RuntimeError(f"replica {mine} failed a training step with {by[mine]['updates']} updates applied, "
                               f"and replica {donor} had applied {top}: the replicas were not in step") from exc
        if mine in targets:
            self._take(by[donor], by[mine], new[mine])
        replicas.barrier()  # (the donor's stages stay as they are until every target has copied them)
        self.spares = [s for s in spares[mine] if s not in moved[mine].values()]
        before, self.updates = self.updates, (top if mine in targets else self.updates)
        cause = summary(exc)
        new_records = [Recovery(w, tuple(j for j, old in enumerate(by[mine]["workers"]) if old == w), spare, before,
                                top, 0, time.perf_counter() - started, cause, f"replica {donor}")
                       for w, spare in moved[mine].items()]
        self.records.extend(new_records)
        again = not (updating and behind)
        rebuilt = f"rebuilt from replica {donor}'s stages" if mine in targets else "kept"
        raise StageReplaced(
            f"{', '.join(map(repr, gone))} gone; " +
            "; ".join(f"replica {r}: {', '.join(f'{w!r} -> {s!r}' for w, s in moved[r].items())}"
                      for r in by if moved[r]) +
            f"; replica {mine}'s stages {rebuilt} (updates applied: {top}). " +
            ("Run the failed step again in a new distributed-autograd context (train_stream does)." if again else
             "This replica's failed update came with the donor's state: go on to the next batch (train_stream does), "
             "keeping the loss train_step returned for this one."), again, tuple(new_records)) from exc

    def _cannot(self, exc: BaseException, why: str) -> None:
        """Spares cannot recover the job: ``on_replica_loss`` decides (``"continue"``: the replicas that lost a
        process are dropped), else ``exc`` is raised with a note saying why."""
        add_note(exc, f"spares could not replace the lost stage workers: {why}")
        replica_recovery.after_failure(exc)  # (raises ReplicaLost or ReplicasDropped with "continue")
        raise exc

    def _regroup(self, m: replicas.Membership, order: list[int], new: dict[int, list[str]], generation: int) -> None:
        """Every stage group made again at ``generation``, with each replica's workers ``new`` (a spare in a lost
        worker's slot): this driver's group for itself, and its stage workers' over RPC, all at once."""
        rank = {name: r for r, name in enumerate(m.job)}
        positions = {r: list(dict.fromkeys(new[r])) for r in order}
        own = positions[m.replica]
        calls = {}
        for k, worker in enumerate(own):
            members = [positions[r][k] for r in order]
            calls[worker] = rpc.rpc_async(worker, replicas.regroup, args=([rank[w] for w in members], members,
                                                                          generation), timeout=2 * m.timeout + 10)
        replicas.regroup(m.ranks, m.names, generation)
        replica_recovery.wait_all(calls, f"the stage workers of replica {m.replica} could not form their groups "
                                         "with the spares in the lost workers' places")

    def _take(self, donor: dict[str, Any], mine: dict[str, Any], workers: list[str]) -> None:
        """Every stage of this replica's pipe rebuilt on ``workers`` from the ``donor`` replica's same stage,
        worker to worker; then reconnected, and their optimizers restored (mapped by the order the drivers
        built them in: their ids are each driver's own)."""
        driver = self.driver
        theirs, ours = donor["optimizers"], mine["optimizers"]
        if [len(s) for _, s in theirs] != [len(s) for _, s in ours]:
            raise RuntimeError(f"replica {donor['replica']} built optimizers and schedulers {theirs} (ids) and replica "
                               f"{mine['replica']} {ours}: every replica must build the same ones, in the same order")
        rename = {d: (o, dict(zip(ds, os))) for (d, ds), (o, os) in zip(theirs, ours)}
        optimizers = {d: ds for d, ds in theirs}
        calls = [rpc.rpc_async(donor["workers"][j], snapshots.give,
                               args=(donor["pipe"], j, optimizers, rename, w, driver.pipe_id, driver.rpc_timeout),
                               timeout=driver.rpc_timeout) for j, w in enumerate(workers)]
        reconnect_rebuilt(driver, workers, calls, f"from replica {donor['replica']}'s")
