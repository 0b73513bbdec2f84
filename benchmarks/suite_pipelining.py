"""The torch.distributed.pipelining contestant: one process per stage over gloo on 127.0.0.1.

A :class:`PipeliningGroup` spawns ``n`` processes once (1 intra-op thread each, ``GLOO_SOCKET_IFNAME=lo``)
and keeps them waiting for commands, so the suite can time pipelining and rrefpipe alternately for each
chunk count under the same machine load. Each command names a model, a schedule (``gpipe`` |
``1f1b``), the chunk count and the repeats; every rank builds the same model from the seed, keeps its
stage, and makes a fresh ``PipelineStage`` and schedule. Rank 0 times each step::

    barrier; t0; zero_grad; schedule.step(...); SGD step; barrier; t1

so a step ends when every rank has finished its backward and optimizer step (as rrefpipe's
``DistributedOptimizer.step`` waits for every stage).
"""
from __future__ import annotations

import os
import queue
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_core import exit_without_teardown
from suite_record import proc_delta, proc_stat

SCHEDULES = ("gpipe", "1f1b")
LR = 1e-3


def _build_schedule(spec: Any, part: torch.nn.Module, rank: int, world: int, schedule: str, chunks: int) -> Any:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stage, n_microbatches=chunks, loss_fn=spec.loss_fn())  # loss_fn on every rank: it enables backward


def _time_steps(cmd: dict[str, Any], rank: int, world: int, cache: dict[str, Any]) -> dict[str, Any]:
    from suite_models import SPECS, split

    spec = SPECS[cmd["model"]]
    key = f"{spec.name}/{world}"
    if key not in cache:
        cache.clear()  # one model at a time: the MLP alone is 134 MB per process
        part = split(spec.build(), spec.balance(world))[rank]
        cache[key] = (part, *spec.data())
    part, x, y = cache[key]
    sched = _build_schedule(spec, part, rank, world, cmd["schedule"], cmd["chunks"])
    opt = torch.optim.SGD(part.parameters(), lr=LR)
    return timed_steps(cmd, sched, opt, first=rank == 0, last=rank == world - 1, x=x, y=y)


def timed_steps(cmd: dict[str, Any], sched: Any, opt: torch.optim.Optimizer, *, first: bool, last: bool,
                x: Any, y: Any) -> dict[str, Any]:
    """``cmd``'s warm-up and timed steps of a rank's schedule (``first``: it holds stage 0 and feeds ``x``;
    ``last``: the last stage, given ``y``; both where a rank holds both, as in a V-shaped layout): step
    times, and /proc's counters around the timed ones."""
    times, before = [], None
    for k in range(cmd["warmup"] + cmd["repeats"]):
        if k == cmd["warmup"]:
            before = proc_stat(os.getpid())
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if first and last:  # one rank holds the first and the last stage (a V-shaped layout)
            sched.step(x, target=y, losses=[])
        elif first:
            sched.step(x)
        elif last:
            losses: list[Any] = []
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        dist.barrier()
        if k >= cmd["warmup"]:
            times.append(time.perf_counter() - start)
    return {"times": times, "cpu": [before, proc_stat(os.getpid())]}


def _rank_main(rank: int, world: int, port: int, commands: Any, results: Any, parent: int) -> None:
    """A stage process: run commands until ``None`` arrives or the parent is gone."""
    os.environ.update(GLOO_SOCKET_IFNAME="lo", TP_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results.put((rank, "ready", [torch.get_num_threads(), torch.get_num_interop_threads()]))
    try:
        _serve(rank, world, commands, results, parent)
    finally:
        dist.destroy_process_group()
    # Skip the interpreter's teardown (the exit hooks still send what is queued): with pipelining and
    # torch.export imported it took each rank about 1 CPU-second and 1.5-3.5 s, which every close waited out.
    exit_without_teardown()


def _serve(rank: int, world: int, commands: Any, results: Any, parent: int) -> None:
    cache: dict[str, Any] = {}
    while True:
        try:
            cmd = commands.get(timeout=2.0)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if cmd is None:
            return
        try:
            results.put((rank, "ok", _time_steps(cmd, rank, world, cache)))
        except Exception:  # report, then leave: the other ranks may be stuck in a collective
            results.put((rank, "error", traceback.format_exc()))
            return


class PipeliningGroup:
    """``world`` stage processes for torch.distributed.pipelining, started once and reused."""

    def __init__(self, world: int, timeout: float = 600.0) -> None:
        from workers.launch import free_port

        ctx = mp.get_context("spawn")
        self.world, self.timeout = world, timeout
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [ctx.Process(target=_rank_main, args=(r, world, port, self.commands[r], self.results, os.getpid()),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()
        ready = self._collect("ready")
        self.threads = ready[0]  # [intra-op, inter-op] of rank 0
        self.broken: str | None = None

    def _collect(self, expect: str) -> list[Any]:
        out: list[Any] = [None] * self.world
        deadline = time.monotonic() + self.timeout
        for _ in range(self.world):
            try:
                rank, status, value = self.results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"pipelining ranks did not answer within {self.timeout:.0f} s") from None
            if status == "error":
                raise RuntimeError(f"pipelining rank {rank} failed:\n{value}")
            if status != expect:
                raise RuntimeError(f"pipelining rank {rank}: expected {expect!r}, got {status!r}")
            out[rank] = value
        return out

    def time_steps(self, model: str, schedule: str, chunks: int, warmup: int,
                   repeats: int) -> tuple[list[float], dict[str, list[float]] | None]:
        """Seconds per timed step (rank 0's clock), and each rank's CPU ms and page faults per timed step
        (``suite_record.proc_delta``); raises after a rank failed (the group is then closed)."""
        if self.broken:
            raise RuntimeError(f"pipelining group unusable after an earlier failure: {self.broken}")
        cmd = {"model": model, "schedule": schedule, "chunks": chunks, "warmup": warmup, "repeats": repeats}
        for q in self.commands:
            q.put(cmd)
        try:
            out = self._collect("ok")
            cpu = proc_delta([r["cpu"][0] for r in out], [r["cpu"][1] for r in out], repeats)
            return list(out[0]["times"]), cpu
        except RuntimeError as exc:
            self.broken = str(exc).splitlines()[-1]
            self.close()
            raise

    def close(self) -> None:
        """Stop the ranks this group started (politely, then by their own pids)."""
        for q, p in zip(self.commands, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self) -> PipeliningGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
