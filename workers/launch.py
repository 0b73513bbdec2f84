"""Local stage workers: child processes on this host, on loopback, with this process as the driver.

This is rrefpipe's embedded default. The children run ``python -m workers``'s ``main``, so they are
the same workers ``torchrun`` would start on other hosts; they are forked from a warm process that has
imported torch once (``workers.warm``), or started as fresh interpreters. They die with their driver:
each watches its stdin pipe (closed by the kernel when the driver exits, however it exits) and pings
the driver.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import TracebackType

import torch.distributed.rpc as rpc

from rrefpipe._cpp_log import QUIET_ENV

from .options import (DEFAULT_RPC_TIMEOUT, LOCAL_TRANSPORTS, backend_options, device_name, init_rpc,
                      maps_to_later_workers)
from .rendezvous import local_url, watching
from .serve import stop_workers
from .warm import WorkerProcess, start_processes

__all__ = ["LocalWorkers", "free_port", "acquire_embedded", "release_embedded", "embedded_running",
           "adopt_driver_sys_path"]

#: The driver's ``sys.path`` (JSON), handed to the local workers it starts.
DRIVER_SYS_PATH = "RREFPIPE_DRIVER_SYS_PATH"

_live: set[LocalWorkers] = set()
_live_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class LocalWorkers:
    """Start ``num_workers`` stage workers on this host and join their RPC group as the driver.

    ``devices`` (one per worker, e.g. ``["cuda:0", "cuda:1"]``) sets each worker's TensorPipe device
    map so that worker k sends its device's tensors straight to every later worker's device. Everything binds
    to 127.0.0.1: RPC unpickles what peers send, so the group is reachable from this host only.

    ``start()`` fails as soon as a worker process exits before joining the group, and at
    ``startup_timeout`` seconds if they have not all joined (``workers.rendezvous``).

    Use as a context manager, or call :meth:`close`; workers are also stopped at interpreter exit.
    """

    def __init__(
        self,
        num_workers: int,
        *,
        devices: Sequence[str] | None = None,
        threads: int | None = None,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
        startup_timeout: float = 60.0,
        transports: Sequence[str] = LOCAL_TRANSPORTS,
        driver_name: str = "driver",
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if devices is not None and len(devices) != num_workers:
            raise ValueError(f"devices has {len(devices)} entries for {num_workers} workers")
        self.num_workers = num_workers
        self.driver_name = driver_name
        self.names = [f"worker{k}" for k in range(1, num_workers + 1)]
        self.devices = list(devices) if devices is not None else None
        self.threads = threads or max(1, (os.cpu_count() or 1) // num_workers)
        self.rpc_timeout = rpc_timeout
        self.startup_timeout = startup_timeout
        self.transports = list(transports)
        self.refs = 0
        self._procs: list[WorkerProcess] = []
        self._started = False
        self._agent: object | None = None  # the driver's RPC agent of this group (the user may start another)
        self._owner: int | None = None  # the process that started the workers

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> LocalWorkers:
        from rrefpipe import _rpc

        if _rpc.is_initialized():
            raise RuntimeError("RPC is already initialised in this process: close the other pipe or LocalWorkers "
                               "first, or name its workers with Pipe(..., workers=[...])")
        port = free_port()
        init_method = local_url("127.0.0.1", port, self.startup_timeout)  # gives up on a worker that died
        env = dict(os.environ, TP_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo", **QUIET_ENV)
        # Stage work runs on many RPC/autograd threads; glibc's per-thread arenas then keep returning
        # memory to the OS and page-faulting it back (ResNet-style, m=8: 321 -> 259 ms per step).
        env.setdefault("MALLOC_ARENA_MAX", "1")
        # Activations above glibc's mmap threshold (128 KiB at first) are mapped fresh and fault in on
        # every allocation, and freed heap tops are trimmed back to the OS: keep both in the heap, as
        # a training step reaches the same peak every time (8 x Linear(2048), m=16: minor faults per
        # step and worker 5-32k -> 0.5-1k, step 770-802 -> 708-730 ms).
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))  # glibc's largest allowed value
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))
        # torch.set_num_threads binds the calling thread only (MKL's count is thread-local), and stage
        # work runs on RPC threads that would otherwise start OpenMP teams sized to every core, whose
        # spinning members steal the other stages' cores. These bind every thread of the worker.
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(key, str(self.threads))
        env[DRIVER_SYS_PATH] = json.dumps([os.path.abspath(p) for p in sys.path])
        self._owner = os.getpid()
        world = self.num_workers + 1
        with _live_lock:
            _live.add(self)
        saved = {k: os.environ.get(k) for k in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}
        os.environ.update(TP_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo")
        try:
            args = [self._worker_args(rank, world, port) for rank in range(1, world)]
            self._procs = start_processes(args, env, timeout=self.startup_timeout)
            _rpc.prepare_reinit()
            options = backend_options(rpc_timeout=self.startup_timeout, init_method=init_method,
                                      transports=self.transports)
            with watching(port, lambda: any(p.poll() is not None for p in self._procs)):
                init_rpc(self.driver_name, rank=0, world_size=world, options=options)
            rpc._set_rpc_timeout(self.rpc_timeout)
            self._agent = _rpc.current_agent()
        except BaseException as exc:
            dead = {name: p.returncode for name, p in zip(self.names, self._procs) if p.poll() is not None}
            self._reap(timeout=0)  # they watch their stdin only once joined: nothing to wait for
            if not isinstance(exc, Exception):  # Ctrl-C while waiting for the workers stays a KeyboardInterrupt
                raise
            detail = f" (workers that exited: {dead})" if dead else ""
            raise RuntimeError(f"could not start {self.num_workers} local stage workers{detail}: {exc}") from exc
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self._started = True
        return self

    def _worker_args(self, rank: int, world: int, port: int) -> list[str]:
        """``python -m workers``'s arguments for the worker of ``rank``."""
        args = ["--rank", str(rank), "--world-size", str(world), "--master-addr", "127.0.0.1", "--master-port",
                str(port), "--name", self.names[rank - 1], "--driver", self.driver_name, "--threads",
                str(self.threads), "--watch-stdin", "--rpc-timeout", str(self.rpc_timeout), "--interface", "lo",
                "--rendezvous", "local"]
        for transport in self.transports:
            args += ["--transport", transport]
        return args + self._device_args(rank - 1)

    def _device_args(self, k: int) -> list[str]:
        """A GPU worker's device and its maps to every later GPU worker (``maps_to_later_workers``)."""
        devices = [device_name(d) for d in self.devices or ["cpu"] * self.num_workers]
        later = dict(zip(self.names[k + 1:], devices[k + 1:]))
        args = [] if devices[k] == "cpu" else ["--device", devices[k]]
        for peer, mapping in maps_to_later_workers(devices[k], later).items():
            args += ["--device-map", f"{peer}={devices[k]}>{mapping[devices[k]]}"]
        return args

    def close(self) -> None:
        """Stop the workers and leave the RPC group; returns promptly even if a worker is dead.

        Only in the process that started them: a child forked from it (``os.fork``) inherits this object
        and its exit hooks, but neither the RPC agent's threads nor the worker processes as children, and
        its ``stop_workers`` waited forever on replies no thread was left to receive."""
        if self._owner != os.getpid():
            return
        if self._started:
            self._started = False
            if self._in_group():  # the user may have shut RPC down already, or joined another group since
                # Each worker is asked to leave, then the driver leaves. Closing the stdin pipes would
                # tell them too, but a child forked from the driver (a DataLoader worker) holds copies
                # of those pipes open: the workers then waited out the reaping and were killed.
                stop_workers(self.names)
            self._agent = None
        self._reap()

    def _reap(self, timeout: float = 10.0) -> None:
        for proc in self._procs:
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = []
        with _live_lock:
            _live.discard(self)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def running(self) -> bool:
        """Started, and RPC not shut down since (a user's own ``rpc.shutdown()`` ends the group too, and
        their own ``init_rpc`` after it starts another)."""
        return self._started and self._in_group()

    def _in_group(self) -> bool:
        from rrefpipe import _rpc

        return self._agent is not None and _rpc.current_agent() is self._agent

    def exited(self) -> dict[str, int]:
        """The workers whose process has exited, with their exit status."""
        return {name: code for name, code in zip(self.names, (p.poll() for p in self._procs)) if code is not None}

    def __enter__(self) -> LocalWorkers:
        return self if self._started else self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


_embedded: LocalWorkers | None = None
_embedded_lock = threading.Lock()  # pipes built (or closed) from several threads at once share one group


def acquire_embedded(num_workers: int, *, devices: Sequence[str] | None, rpc_timeout: float) -> LocalWorkers:
    """The process's embedded workers: started by the first pipe that needs them, shared by later ones
    (counted), so closing one pipe never stops another's stages."""
    global _embedded
    with _embedded_lock:
        if _embedded is not None and not _embedded.running:
            _embedded.close()  # stopped, or RPC shut down under it: reap what is left and start afresh
            _embedded = None
        if _embedded is None:
            _embedded = LocalWorkers(num_workers, devices=devices, rpc_timeout=rpc_timeout).start()
        else:
            _check_shareable(_embedded, num_workers, devices)
        _embedded.refs += 1
        return _embedded


def _check_shareable(workers: LocalWorkers, num_workers: int, devices: Sequence[str] | None) -> None:
    """Refuse the open pipes' group to a pipe it cannot serve. A ValueError, as ``Pipe`` gives up the holds
    of pipes dropped without ``close()`` on one and tries again: the last hold gone, a new group starts."""
    exited = workers.exited()
    if exited:
        raise ValueError(f"local stage workers of another open pipe have exited (status: {exited}): close that pipe "
                         "first (pipe.close()); the next pipe then starts new workers")
    if num_workers > workers.num_workers:
        raise ValueError(f"this pipe needs {num_workers} local stage workers, but another open pipe started "
                         f"{workers.num_workers}: close it first, or start "
                         f"workers.LocalWorkers({num_workers}) yourself and pass workers=")
    if devices is not None and list(devices) != (workers.devices or [])[:num_workers]:
        raise ValueError(f"the local workers of another open pipe use devices {workers.devices}, this "
                         f"pipe asks for {list(devices)}: close it first")


def embedded_running() -> bool:
    return _embedded is not None and _embedded.running


def release_embedded(workers: LocalWorkers) -> None:
    """A pipe is done with the embedded workers; the last one out stops them."""
    with _embedded_lock:
        workers.refs -= 1
        if workers.refs <= 0:
            workers.close()


@atexit.register
def _close_all() -> None:
    """At exit, stop the workers this process started (a forked child's copies are left alone: ``close``)."""
    with _live_lock:
        live = list(_live)
    for workers in live:
        workers.close()


def adopt_driver_sys_path() -> None:
    """In a local worker: import from the driver's ``sys.path`` first, as ``multiprocessing``'s spawned
    children do. Stages arrive pickled, and classes from an importable module travel by reference: a
    ``models.py`` beside the user's script (the driver's ``sys.path[0]``), or a folder the script added
    to ``sys.path``, must be importable here too, whatever the current directory."""
    raw = os.environ.get(DRIVER_SYS_PATH)
    if raw:
        driver: list[str] = json.loads(raw)
        sys.path[:] = driver + [p for p in sys.path if p not in driver]
