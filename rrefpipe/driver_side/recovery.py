"""A pipe that outlives its stage workers: ``Pipe(..., spares=k)`` keeps a snapshot of every stage on a
spare worker and, when a stage worker dies during ``train_stream``, moves its stages to a spare, puts
every stage back to the last snapshot and replays the batches since, so that the run goes on to the
weights it would have had (the worker side: :mod:`rrefpipe.stage_side.snapshots`).

Why this design (measured in ``docs/engine-notes-recovery.md``): torch's RPC group is static and keeps a
SIGKILLed member, but calls to the live workers, new distributed-autograd contexts that avoid the dead
one and a stage built on an idle spare all work, with exact gradients; no error names the dead worker,
so the driver finds it by pinging; a dynamic group cannot take a new process once a member died, so
spares are started with the pipe. A snapshot is taken every ``snapshot_every`` updates, between steps:
each stage copies its state and sends the copy straight to the holder (the first free spare) while the
next step runs; the holder commits a generation only once every stage's part arrived, and a recovery
goes back to the generation committed there (a failure while one is in transit leaves the previous one
whole, and the driver keeps the batches since the committed one).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed.rpc as rpc

from .. import _rpc
from ..errors import StageError, add_note, summary, warn_user
from ..stage_side import snapshots
from . import pipe_optimizer
from .remote import RemoteDriver

__all__ = ["Recovery", "Snapshots", "Guard"]

PING_TIMEOUT = 2.0  # seconds a live worker has to answer; a dead one fails at once (engine notes, fact 1)


@dataclass(frozen=True)
class Recovery:
    """One recovery (``pipe.recoveries``): the worker lost, where its stages went, and what it cost.

    Attributes:
        worker: the stage worker found dead.
        stages: its stages, now on ``spare``.
        spare: the spare worker that took them.
        failed_update: ``train_stream``'s updates applied when the failure surfaced (after ``pipe.recover()``
            in a loop of your own, which the pipe does not count: the tag ``recover()`` returned tells).
        restored_update: the update count of the snapshot every stage went back to (as above).
        replayed: batches ``train_stream`` ran again since that snapshot (0 for ``pipe.recover()``).
        seconds: from the failure surfacing to the failed batch about to run again (replay included).
        cause: the error that surfaced it (``'pipe.recover()'`` for that call).
        source: where the stages' state came from: ``"snapshot"`` (the pipe's, on a spare), or
            ``"replica r"``, the same stages of live replica r (spares with replicas: ``restored_update`` is
            then that replica's count of optimizer updates, and ``replayed`` is 0).
    """

    worker: str
    stages: tuple[int, ...]
    spare: str
    failed_update: int
    restored_update: int
    replayed: int
    seconds: float
    cause: str
    source: str = "snapshot"


@dataclass(frozen=True)
class Snapshots:
    """What keeping a pipe recoverable holds and costs (``pipe.snapshots``), for choosing ``snapshot_every``.

    Attributes:
        every: ``snapshot_every``.
        holder: the spare keeping them (``None``: none left, and the pipe can no longer recover).
        taken: snapshots taken so far.
        committed_update: ``train_stream``'s update count at the snapshot a recovery goes back to (``None``:
            none yet).
        bytes: what the holder keeps of one snapshot (every stage's state); it holds up to twice that while
            the next one arrives, and each stage worker a copy of its own part until it is sent.
        wait_seconds: per snapshot, what the step after it waited for (each stage copying its state).
        transfer_seconds: per snapshot, from its start until all of it was on the holder (meanwhile the
            next step ran).
    """

    every: int
    holder: str | None
    taken: int
    committed_update: int | None
    bytes: int
    wait_seconds: tuple[float, ...]
    transfer_seconds: tuple[float, ...]


@dataclass(frozen=True)
class _Pending:
    """A snapshot taken, whose parts are on their way to the holder."""

    generation: int
    updates: int
    tag: Any
    arrived: Any  # a torch Future of the holder's ``snapshots.committed``


class Guard:
    """Snapshots and recovery for one pipe with spares (see the module's docstring)."""

    def __init__(self, driver: RemoteDriver, spares: Sequence[str], snapshot_every: int) -> None:
        self.driver = driver
        self.spares = list(spares)  # not serving stages, alive as far as known
        self.holder: str | None = self.spares[0] if self.spares else None
        self.every = snapshot_every
        self.generation = 0
        self.updates = 0  # updates applied by train_stream since the pipe was built
        self.committed: int | None = None  # the update count of the committed snapshot
        self.since: list[Any] = []  # the batches since the committed snapshot, to replay
        self.records: list[Recovery] = []
        self.snapshot_bytes = 0
        self.snapshot_seconds: list[float] = []
        self.failed = False  # workers were lost and the pipe could not recover
        self.tag: Any = None  # the committed snapshot's (``pipe.snapshot(tag)``)
        self._warmed: set[int] = set()  # optimizers whose class the spares have built once
        self._generation = 0  # the committed snapshot's generation on the holder (0: none)
        self._pending: _Pending | None = None  # a snapshot taken, still in transit to the holder
        self._taken: int | None = None  # the update count of the last snapshot taken
        self.transfer_seconds: list[float] = []  # from a snapshot's start to all of it on the holder

    # -- snapshots ------------------------------------------------------------------------------------------
    def _optimizers(self) -> dict[int, list[int]]:
        return {opt.id: list(opt.schedulers) for opt in pipe_optimizer.owned(self.driver)}

    def snapshot(self, tag: Any = None, required: bool = False) -> None:
        """Every stage's state now, sent to the holder (committed once all arrived); ``tag`` is what
        :meth:`restore` returns for it. Returns once every stage has taken its copy: the transfer goes on
        while the next step runs. Without a holder (no spare left) nothing is taken, or,
        ``required`` (``pipe.snapshot``, which waits), a RuntimeError says so. The first on a holder waits
        too: until it arrives there is nothing to go back to."""
        if self.holder is None:
            if required:
                raise RuntimeError("no spare worker is left to hold a snapshot (each took the stages of a lost worker, "
                                   "or died): this pipe can no longer recover")
            return
        self._settle()  # the previous one (long arrived, normally)
        started = time.perf_counter()
        self.generation += 1
        optimizers = self._optimizers()
        self._warm()
        driver, n = self.driver, len(self.driver.workers)
        calls = [(j, rpc.rpc_async(w, snapshots.push, args=(driver.pipe_id, j, self.holder, self.generation, n,
                                                               optimizers, driver.rpc_timeout),
                                   timeout=driver.rpc_timeout)) for j, w in enumerate(driver.workers)]
        for j, call in calls:
            try:
                _rpc.wait(call)
            except Exception as exc:
                raise driver._control_failure(j, snapshots.push, exc) from exc
        arrived = rpc.rpc_async(self.holder, snapshots.committed, args=(driver.pipe_id, self.generation),
                                timeout=driver.rpc_timeout)
        self._pending = _Pending(self.generation, self.updates, tag, arrived)
        self._taken = self.updates
        self.snapshot_seconds.append(time.perf_counter() - started)
        arrived.then(lambda _: self.transfer_seconds.append(time.perf_counter() - started))
        if required or self.committed is None:  # (with nothing committed, nothing to go back to)
            self._settle()

    def start(self) -> None:
        """A stream starts: a snapshot of the state before its first update, unless one is kept already."""
        if self._taken is None:
            self.snapshot()

    def stats(self) -> Snapshots:
        """``pipe.snapshots`` (the one in transit counts as committed once it has arrived)."""
        self._poll()
        return Snapshots(self.every, self.holder, len(self.snapshot_seconds), self.committed, self.snapshot_bytes,
                         tuple(self.snapshot_seconds), tuple(self.transfer_seconds))

    def _settle(self) -> None:
        """Wait for the snapshot in transit to be committed on the holder, and make it the one to go back to
        (raises what its transfer raised)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._commit(pending, _rpc.wait(pending.arrived))

    def _commit(self, pending: _Pending, size: int | None) -> None:
        """``pending`` is committed on the holder: the batches before it need no replay."""
        after = self.updates - pending.updates
        self.since = self.since[len(self.since) - after:] if after else []
        self.committed, self.tag = pending.updates, pending.tag
        self._generation = pending.generation
        if size is not None:
            self.snapshot_bytes = size

    def _poll(self) -> None:
        """Commit the snapshot in transit if it has arrived (without waiting). If its transfer failed
        because the holder died, the snapshots go to another spare and one is due at once; otherwise the
        committed one stays (a stage that died surfaces in the next step)."""
        pending = self._pending
        if pending is None or not pending.arrived.done():
            return
        self._pending = None
        try:
            size = pending.arrived.wait()
        except Exception:
            if self.holder is not None and self.dead([self.holder]):
                self._lose_holder()
            return
        self._commit(pending, size)

    def _restoring(self) -> None:
        """A recovery starts: the holder gives up the snapshot in transit unless all of it arrived, and the
        generation it keeps is the one to go back to."""
        assert self.holder is not None
        generation = rpc.rpc_sync(self.holder, snapshots.restoring, args=(self.driver.pipe_id,),
                                  timeout=self.driver.rpc_timeout)
        pending, self._pending = self._pending, None
        if pending is not None and pending.generation == generation:
            self._commit(pending, None)
        elif generation != self._generation:
            raise RuntimeError(f"the holder {self.holder!r} keeps snapshot {generation} of the pipe, and the driver "
                               f"expected {self._generation}")

    def _warm(self) -> None:
        """Build each new optimizer class once on every spare (see ``snapshots.warm``)."""
        fresh = [opt for opt in pipe_optimizer.owned(self.driver) if opt.id not in self._warmed]
        if not fresh:
            return
        calls = [rpc.rpc_async(s, snapshots.warm, args=([opt.payload for opt in fresh],),
                               timeout=self.driver.rpc_timeout) for s in self.spares if s not in self.driver.workers]
        for call in calls:
            _rpc.wait(call)
        self._warmed.update(opt.id for opt in fresh)

    def applied(self, batch: Any) -> None:
        """One more update applied everywhere (``batch`` made it)."""
        self.updates += 1
        self.since.append(batch)
        self._poll()

    def due(self) -> bool:
        """Whether a snapshot is due (every ``every`` updates, and when none is committed or in transit)."""
        return self.holder is not None and (self._taken is None or self.updates - self._taken >= self.every)

    # -- recovery -------------------------------------------------------------------------------------------
    def dead(self, workers: Sequence[str]) -> list[str]:
        """Those of ``workers`` that do not answer a ping."""
        pings = {w: rpc.rpc_async(w, snapshots.alive, timeout=PING_TIMEOUT) for w in dict.fromkeys(workers)}
        gone = []
        for w, ping in pings.items():
            try:
                _rpc.wait(ping)
            except Exception:
                gone.append(w)
        return gone

    def recover(self, exc: BaseException, replay: Callable[[Any], None], snapshotting: bool = False) -> None:
        """After ``exc`` surfaced in a step (or, ``snapshotting``, in a snapshot taken after it): if stage
        workers died, move their stages to spares, put every stage back to the committed snapshot and
        ``replay`` the batches since (``replay(batch)`` runs one update and calls :meth:`applied`); if only
        the holder died in a snapshot, take it again on another spare; otherwise raise ``exc``. Where
        workers died and the pipe cannot recover (no spare left, the holder lost too), ``failed`` is set
        and ``exc`` raised with a note saying why."""
        started = time.perf_counter()
        holder = self.holder
        lost, lost_stages = self._lost()
        if not lost_stages:
            if holder is None or holder not in lost:
                raise exc  # not a lost worker: the caller's error, as without spares
            self._lose_holder()  # a spare died: the snapshots go to another, or the pipe runs on unguarded
            if snapshotting:
                self.snapshot()
                return
            raise exc
        if holder is not None and holder not in lost:
            self._restoring()
        why = self._cannot(lost, lost_stages)
        if why:
            self.failed = True
            add_note(exc, f"{why}; the pipe is closed")
            raise exc
        before = list(self.driver.workers)
        moved = self._restore(lost_stages)
        failed_update, restored = self.updates, self.committed
        assert restored is not None
        again, self.since = list(self.since), []
        self.updates = restored
        if self.holder in moved.values():  # it serves stages now: the next snapshot goes to a spare still free
            self._lose_holder()
            self.snapshot()  # (the state after the replay below is what a later failure goes back to)
        for batch in again:
            replay(batch)
        self._record(moved, before, failed_update, restored, len(again), started,
                     summary(exc))

    def restore(self) -> Any:
        """``pipe.recover()``: every stage back to the last snapshot (``pipe.snapshot(tag)``'s), the stages
        of dead workers on spares; returns that snapshot's tag."""
        started = time.perf_counter()
        if self.committed is None and self._pending is None or self.holder is None:
            raise RuntimeError("no snapshot to recover from: take one with pipe.snapshot(tag) (a pipe with spares= "
                               "keeps the last one on a spare)" if self.holder is not None else
                               "the spare that held the snapshots is lost, and no spare is left to hold them")
        lost, lost_stages = self._lost()
        if self.holder not in lost:
            self._restoring()
        why = self._cannot(lost, lost_stages)
        if why:
            raise RuntimeError(why)
        before = list(self.driver.workers)
        moved = self._restore(lost_stages)
        tag = self.tag
        if self.holder in moved.values():
            self._lose_holder()
            self.snapshot(tag)
        self._record(moved, before, self.updates, self.committed or 0, 0, started, "pipe.recover()")
        return tag

    def _lost(self) -> tuple[list[str], list[str]]:
        """The workers (stage workers, the holder and the other spares) that do not answer, and the stage
        workers among them; dead spares are forgotten."""
        stage_workers = list(dict.fromkeys(self.driver.workers))
        lost = self.dead(stage_workers + ([self.holder] if self.holder is not None else []) + self.spares)
        self.spares = [s for s in self.spares if s not in lost]
        return lost, [w for w in stage_workers if w in lost]

    def _cannot(self, lost: list[str], lost_stages: list[str]) -> str:
        """Why the stages of ``lost_stages`` cannot be recovered, or ''."""
        holder = self.holder
        if holder is None or holder in lost or self.committed is None:
            return f"worker(s) {lost_stages} died and the pipe cannot recover: " + (
                "no spare worker was left to take their stages" if holder is None else
                f"the spare holding the snapshots ({holder!r}) is lost too")
        free = [holder] + [s for s in self.spares if s != holder]
        if len(free) < len(lost_stages):
            return f"workers {lost_stages} died and only {len(free)} spare(s) are left: the pipe cannot recover"
        return ""

    def _restore(self, lost_stages: list[str]) -> dict[str, str]:
        """Rebuild every stage from the committed snapshot, those of ``lost_stages`` on spares (the holder
        first: it has the snapshots); reconnect them and restore their optimizers. Returns the moves."""
        driver, holder = self.driver, self.holder
        assert holder is not None
        moved = dict(zip(lost_stages, [holder] + [s for s in self.spares if s != holder]))
        workers = [moved.get(w, w) for w in driver.workers]
        calls = [rpc.rpc_async(holder, snapshots.send, args=(driver.pipe_id, j, w, driver.rpc_timeout),
                               timeout=driver.rpc_timeout) for j, w in enumerate(workers)]
        reconnect_rebuilt(driver, workers, calls, "from its snapshot")
        self.spares = [s for s in self.spares if s not in moved.values()]
        return moved

    def _record(self, moved: dict[str, str], before: list[str], failed_update: int, restored: int, replayed: int,
                started: float, cause: str) -> None:
        for w, spare in moved.items():
            self.records.append(Recovery(w, tuple(j for j, old in enumerate(before) if old == w), spare, failed_update,
                                         restored, replayed, time.perf_counter() - started, cause))

    def _lose_holder(self) -> None:
        """The holder serves stages now (or died): the next free spare that answers holds the snapshots; with
        none, the pipe runs on unable to recover, and says so."""
        old = self.holder
        candidates = [s for s in self.spares if s != old and s not in self.driver.workers]
        gone = self.dead(candidates) if candidates else []
        self.spares = [s for s in self.spares if s not in gone]
        self.holder = next((s for s in candidates if s not in gone), None)
        self.committed, self._generation, self._pending, self._taken = None, 0, None, None
        if self.holder is None:
            warn_user(f"no spare worker is left to hold the pipe's snapshots (the last, {old!r}, "
                      f"{'now serves stages' if old in self.driver.workers else 'is lost'}): the pipe goes on, but a "
                      "stage worker lost from now on ends it")
        if old is not None:
            try:
                rpc.rpc_sync(old, snapshots.drop, args=(self.driver.pipe_id,), timeout=PING_TIMEOUT)
            except Exception:
                pass  # (a dead holder's memory went with it)

    def close(self) -> None:
        """Drop the pipe's snapshots from the holder."""
        if self.holder is not None:
            try:
                rpc.rpc_sync(self.holder, snapshots.drop, args=(self.driver.pipe_id,), timeout=PING_TIMEOUT)
            except Exception:
                pass


def reconnect_rebuilt(driver: RemoteDriver, workers: list[str], calls: Sequence[Any], source: str) -> None:
    """The pipe's stages rebuilt by ``calls`` (one per stage, each giving ``(generation, StageInfo)``) on
    ``workers``: reconnect them and restore the pipe's optimizers on each (``snapshots.restore_optimizers``)."""
    infos = []
    for j, call in enumerate(calls):
        try:
            infos.append(_rpc.wait(call)[1])
        except Exception as error:
            raise StageError(j, workers[j], None, f"rebuilding the stage {source} (recovery)", type(error).__name__,
                             str(error)) from error
    driver.reconnect(workers, infos)
    optimizers = {opt.id: (opt.payload, dict(opt.schedulers)) for opt in pipe_optimizer.owned(driver)}
    restoring = [rpc.rpc_async(w, snapshots.restore_optimizers, args=(driver.pipe_id, j, optimizers),
                               timeout=driver.rpc_timeout) for j, w in enumerate(workers)]
    for call in restoring:
        _rpc.wait(call)

