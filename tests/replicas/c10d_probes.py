"""Scenarios that tests/replicas/test_engine_replicas.py runs: plain c10d (Gloo, CPU processes, no RPC, no
rrefpipe) after one member of a group is SIGKILLed. Notes: docs/engine-notes-recovery.md, "Replicas:
c10d after a lost member".

A scenario's parent (``python -c "...scenario(...)"``, started by the test in a session of its own) hosts a
control store of its own and starts ``WORLD`` members as its children. The members join one default group
(Gloo, over a ``TCPStore`` that rank 0 hosts, as ``init_process_group("env://")`` does outside torchrun)
and a group ``G`` of ranks 0..3, as ``workers.torchrun_group(replicas=R)`` makes one per stage position;
rank 4 is in the default group only: a spare. The parent SIGKILLs the scenario's victim while the other
members of G wait in an all-reduce, and every member then reports, one ``FACT <name> <seconds> <json>``
line each, what c10d still does:

* ``member``: the victim is rank 3, not the store's host;
* ``store_host``: the victim is rank 0, which hosts the job's store.

Every collective runs on a thread of its own for at most a bounded time (``bounded``), every group has
the timeout ``TIMEOUT``, and every process ends itself after ``LIMIT`` seconds."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT = 3.0  # seconds: every group's timeout, and the stores'
LIMIT = 60.0  # seconds after which any process of a scenario ends itself
WORLD = 5  # ranks 0..3 form G; rank 4 is the spare
G_RANKS = [0, 1, 2, 3]
SPARE = 4
VICTIMS = {"member": 3, "store_host": 0}
KILL_AFTER = 0.5  # seconds the survivors wait in the all-reduce before the victim is killed

_T0 = time.perf_counter()


def fact(name: str, value: Any) -> None:
    """``FACT <name> <seconds since this process started> <json>``, in one write (the processes of a
    scenario share one output file)."""
    sys.stdout.flush()
    os.write(1, f"FACT {name} {time.perf_counter() - _T0:.2f} {json.dumps(value)}\n".encode())


def describe(exc: BaseException) -> str:
    text = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text[:600]}"


def exit_after(seconds: float) -> None:
    timer = threading.Timer(seconds, os._exit, args=(3,))
    timer.daemon = True
    timer.start()


def bounded(fn: Callable[[], Any], within: float) -> dict[str, Any]:
    """``fn`` on a thread of its own for at most ``within`` seconds: {"outcome": "returned" | "raised" |
    "hung", "ms", "error"?, "value"?, "ended"?: the wall-clock time it ended}."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # the outcome reported
            box["error"] = describe(e)
        box["ended"] = time.time()

    start = time.perf_counter()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(within)
    out: dict[str, Any] = {"ms": round((time.perf_counter() - start) * 1000, 1)}
    if t.is_alive():
        out["outcome"] = "hung"
    elif "error" in box:
        out.update(outcome="raised", error=box["error"], ended=box["ended"])
    else:
        out.update(outcome="returned", value=box.get("value"), ended=box["ended"])
    return out


def _all_reduce(group: Any) -> float:
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    return float(t[0])


# --- a member ----------------------------------------------------------------------------------------

def member(kind: str, rank: int, port: int, control_port: int) -> None:
    exit_after(LIMIT)
    victim = VICTIMS[kind]
    limit = timedelta(seconds=TIMEOUT)
    control = dist.TCPStore("127.0.0.1", control_port, is_master=False, timeout=timedelta(seconds=LIMIT))
    start = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=limit, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=limit)
    group = dist.new_group(G_RANKS, timeout=limit)
    if rank in G_RANKS:
        assert _all_reduce(group) == len(G_RANKS)
    dist.barrier()
    fact(f"joined.r{rank}", round((time.perf_counter() - start) * 1000, 1))
    if rank == victim:
        control.set("victim_ready", str(os.getpid()))
        time.sleep(LIMIT)
        return
    survivors = [r for r in G_RANKS if r != victim]
    if rank in G_RANKS:
        control.set(f"entering{rank}", "1")
        during = bounded(lambda: _all_reduce(group), 3 * TIMEOUT)
        killed = float(control.get("killed_at").decode())
        if "ended" in during:
            during["ms_after_kill"] = round((during.pop("ended") - killed) * 1000, 1)
        fact(f"a_during.r{rank}", during)
        fact(f"a_after.r{rank}", _clean(bounded(lambda: _all_reduce(group), 3 * TIMEOUT)))
    else:
        control.wait(["killed_at"])
    sync = _phases(control, WORLD - 1)
    sync("default")
    fact(f"c_default_barrier.r{rank}", _clean(bounded(lambda: dist.barrier(), 3 * TIMEOUT)))
    fact(f"c_default_all_reduce.r{rank}", _clean(bounded(lambda: _all_reduce(None), 3 * TIMEOUT)))
    # (b) a new group of the survivors and the spare
    ranks = survivors + [SPARE]
    made: dict[str, Any] = {}

    def new_group() -> float:
        made["group"] = dist.new_group(ranks, timeout=limit, use_local_synchronization=True)
        return _all_reduce(made["group"])

    sync("new_group")
    fact(f"b_new_group.r{rank}", _clean(bounded(new_group, 3 * TIMEOUT)))

    def new_group_of_survivors() -> float:  # members of G only: the same count of groups on each
        made["survivors"] = dist.new_group(survivors, timeout=limit, use_local_synchronization=True)
        return _all_reduce(made["survivors"])

    if rank in survivors:
        fact(f"b_new_group_survivors.r{rank}", _clean(bounded(new_group_of_survivors, 3 * TIMEOUT)))

    def fresh_gloo() -> float:
        prefix = dist.PrefixStore("probe/rebuilt/1", dist.distributed_c10d._get_default_store())
        pg = dist.ProcessGroupGloo(prefix, ranks.index(rank), len(ranks), limit)
        made["gloo"] = pg
        t = torch.ones(4)
        dist.all_reduce(t, group=pg)  # a group c10d's registry does not know, through the public call
        return float(t[0])

    sync("fresh_gloo")
    fact(f"b_fresh_gloo.r{rank}", _clean(bounded(fresh_gloo, 3 * TIMEOUT)))

    def in_new_store() -> float:  # a store of their own, hosted by the first survivor
        new_store = dist.TCPStore("127.0.0.1", int(control.get("new_store_port").decode()), len(ranks),
                                  is_master=rank == ranks[0], timeout=limit, wait_for_workers=False)
        pg = dist.ProcessGroupGloo(new_store, ranks.index(rank), len(ranks), limit)
        made["own"] = pg
        t = torch.ones(4)
        pg.allreduce([t]).wait(limit)
        return float(t[0])

    sync("own_store")
    fact(f"b_own_store.r{rank}", _clean(bounded(in_new_store, 3 * TIMEOUT)))
    # (c) the broken group dropped
    if rank in G_RANKS:
        fact(f"c_destroy_broken.r{rank}", _clean(bounded(lambda: dist.destroy_process_group(group), 3 * TIMEOUT)))
    if "gloo" in made:  # the fresh group, once the broken one is gone
        sync("after_destroy")
        fact(f"c_fresh_after_destroy.r{rank}", _clean(bounded(lambda: _all_reduce(made["gloo"]), 3 * TIMEOUT)))
    fact(f"c_destroy_all.r{rank}", _clean(bounded(lambda: dist.destroy_process_group(), 3 * TIMEOUT)))
    control.add("done", 1)
    fact(f"done.r{rank}", True)
    os._exit(0)


def _phases(control: Any, members: int) -> Callable[[str], None]:
    """``sync(name)``: wait until every live member has reached phase ``name`` (through the control store,
    which the scenario's parent hosts), so that each phase starts on every member at once."""
    def sync(name: str) -> None:
        control.add(f"phase/{name}", 1)
        deadline = time.monotonic() + 3 * TIMEOUT  # (a member that skips the phase costs that much)
        while int(control.add(f"phase/{name}", 0)) < members and time.monotonic() < deadline:
            time.sleep(0.005)

    return sync


def _clean(result: dict[str, Any]) -> dict[str, Any]:
    result.pop("ended", None)
    return result


# --- the scenario's parent ---------------------------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scenario(kind: str, port: int) -> None:
    exit_after(LIMIT + 5)
    control_port, new_store_port = _free_port(), _free_port()
    control = dist.TCPStore("127.0.0.1", control_port, is_master=True, timeout=timedelta(seconds=LIMIT),
                            wait_for_workers=False)
    control.set("new_store_port", str(new_store_port))
    victim = VICTIMS[kind]
    children = {rank: subprocess.Popen(
        [sys.executable, "-c", f"from tests.replicas.c10d_probes import member; "
                               f"member({kind!r}, {rank}, {port}, {control_port})"],
        env=dict(os.environ, OMP_NUM_THREADS="1")) for rank in range(WORLD)}
    fact("pids", {str(rank): p.pid for rank, p in children.items()})
    control.wait(["victim_ready"] + [f"entering{r}" for r in G_RANKS if r != victim])
    time.sleep(KILL_AFTER)
    os.kill(children[victim].pid, signal.SIGKILL)
    control.set("killed_at", repr(time.time()))
    children[victim].wait(timeout=10)
    fact("killed", victim)
    deadline = time.monotonic() + LIMIT
    for rank, child in children.items():
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
    fact("exits", {str(rank): p.returncode for rank, p in children.items()})
    fact("done", True)


# --- a member that lets go of its group (no kill) -----------------------------------------------------

def closing(how: str, rank: int, port: int) -> None:
    """Two processes, a group of both (``how``: ``"registered"``, made by ``new_group``, or ``"rebuilt"``, a
    ``ProcessGroupGloo`` over a prefix of the job's store); rank 0 waits in an all-reduce that rank 1 never
    joins, and 0.5 s in, rank 1 lets go of the group: takes it out of c10d's registry
    (``destroy_process_group``, for a registered one) and drops its last reference, as
    ``rrefpipe.replicas.let_go`` does. Rank 0 reports ``FACT closed <json>``: its all-reduce's outcome and
    the ms from rank 1's letting go (``closed_at``, a wall-clock time written to the store)."""
    exit_after(LIMIT)
    limit = timedelta(seconds=TIMEOUT)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=limit)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=limit)
    group = (dist.new_group([0, 1], timeout=limit) if how == "registered" else
             dist.ProcessGroupGloo(dist.PrefixStore("closing/", store), rank, 2, limit))
    _all_reduce(group)  # (connected)
    if rank == 0:
        outcome = bounded(lambda: _all_reduce(group), 2 * TIMEOUT)
        closed_at = float(store.get("closed_at"))
        outcome["ms_after_close"] = round((outcome.get("ended", time.time()) - closed_at) * 1000, 1)
        fact("closed", outcome)
        store.set("reported", "1")
    else:
        time.sleep(0.5)
        if how == "registered":
            dist.destroy_process_group(group)
        del group
        store.set("closed_at", repr(time.time()))
        store.wait(["reported"], timedelta(seconds=LIMIT))
    fact("done", True)
