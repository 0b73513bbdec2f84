"""Starting local stage-worker processes: forked from a warm process that imported torch once
(``workers.zygote``), or as fresh interpreters when that is off or cannot start.

A warm process serves one environment, the one it started with: glibc, OpenMP and MKL and torch's
C++ logging read theirs at start or at ``import torch``. The driver keeps one per environment (in
practice one: the same variables and thread count for every group), reuses it for every group it
starts, and stops it at exit; it also leaves by itself when the driver dies. Environments are told
apart by every variable but those that change between starts for reasons of no concern to a worker
(``PER_WORKER``), rather than by a list of the variables read at start, which no list could be sure
to hold in full. Each worker sets the driver's environment as it starts. Why a fork server of our
own, and the protocol: ``workers.zygote``.

``RREFPIPE_FRESH_WORKERS=1`` starts every worker as a fresh ``python -c`` process instead, as do
systems other than Linux and a warm process that exits before it is ready (a broken environment, said
again by each fresh worker).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import IO, Protocol

from .zygote import MAX_REQUEST, READY, UNSAFE

__all__ = ["FRESH_WORKERS", "PER_WORKER", "WorkerProcess", "ForkedWorker", "start_processes", "warm_pids"]

log = logging.getLogger("rrefpipe.workers")

#: Set to 1 to start every local worker as a fresh interpreter.
FRESH_WORKERS = "RREFPIPE_FRESH_WORKERS"
#: Variables a warm process may differ in from a worker it forks: the driver's ``sys.path``
#: (``workers.launch.DRIVER_SYS_PATH``) and pytest's name of the running test.
PER_WORKER = frozenset({"RREFPIPE_DRIVER_SYS_PATH", "PYTEST_CURRENT_TEST"})
#: Warm processes kept for other environments than the latest one, if none of their workers runs.
MAX_IDLE = 1

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: ``python -m workers``, but of this very package: ``-m`` would look in the current directory first,
#: where a user's own ``workers.py`` would run instead.
RUN_WORKER = f"import sys; sys.path.insert(0, {_PACKAGE_PARENT!r}); from workers.__main__ import main; main()"
#: The warm process: the same start, with the forking in between (``serve_forks`` returns in a worker).
RUN_WARM = (f"import sys; sys.path.insert(0, {_PACKAGE_PARENT!r}); from workers.zygote import serve_forks; "
            "serve_forks(); from workers.__main__ import main; main()")

Environment = frozenset[tuple[str, str]]


class WorkerProcess(Protocol):
    """What ``LocalWorkers`` uses of a worker process: ``subprocess.Popen``'s names."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def stdin(self) -> IO[bytes] | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def kill(self) -> None: ...


class ForkedWorker:
    """A worker forked by a warm process, with ``Popen``'s interface: it is the warm process's child, so
    its pid and then its wait status arrive on a status pipe that the warm process writes."""

    def __init__(self, status: int, stdin: int) -> None:
        self.stdin: IO[bytes] | None = os.fdopen(stdin, "wb")  # its end tells the worker: driver gone
        self.pid = 0
        self.returncode: int | None = None
        self.args = ["forked worker"]
        self._status = status
        self._closed = weakref.finalize(self, os.close, status)
        self._lines = b""
        self._lock = threading.Lock()

    def _read(self, timeout: float) -> None:
        """Take in what the warm process wrote within ``timeout`` seconds (one read)."""
        with self._lock:
            if not self._closed.alive:
                return
            poller = select.poll()
            poller.register(self._status, select.POLLIN)
            if not poller.poll(max(0, int(timeout * 1000))):
                return
            data = os.read(self._status, 4096)
            self._lines += data
            *lines, self._lines = self._lines.split(b"\n")
            for line in lines:
                key, value = line.split()
                if key == b"pid":
                    self.pid = int(value)
                else:
                    self.returncode = os.waitstatus_to_exitcode(int(value))
            if not data:  # the warm process is gone: PR_SET_PDEATHSIG killed this worker with it
                self.returncode = -signal.SIGKILL if self.returncode is None else self.returncode
            if self.returncode is not None:
                self._closed()

    def wait_forked(self, timeout: float) -> None:
        """Until the warm process says which pid the worker has; OSError if it ended first."""
        deadline = time.monotonic() + timeout
        while not self.pid and self.returncode is None and time.monotonic() < deadline:
            self._read(deadline - time.monotonic())
        if not self.pid:
            raise OSError("the warm process did not fork the worker")

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 60.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._read(left)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None and self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # exited, and its status is on the way
                pass


class WarmProcess:
    """One warm process: started with ``env``, ready once it has imported torch and the worker."""

    def __init__(self, env: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen([sys.executable, "-c", RUN_WARM, str(theirs.fileno())], env=dict(env),
                                         stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()],
                                         stdout=None if _is_open(1) else subprocess.DEVNULL,
                                         stderr=None if _is_open(2) else subprocess.DEVNULL)
        self.control = ours
        self.workers: list[ForkedWorker] = []

    def wait_ready(self, timeout: float) -> str | None:
        """None once ready; else why not (its first word: ``exited``, ``unsafe`` or ``timeout``)."""
        poller = select.poll()
        poller.register(self.control, select.POLLIN)
        if not poller.poll(int(timeout * 1000)):
            return f"timeout: not ready within {timeout:g} s"
        message = self.control.recv(MAX_REQUEST)
        if message == READY:
            return None
        if message.startswith(UNSAFE):
            return "unsafe: " + message[len(UNSAFE):].decode()
        try:
            return f"exited with status {self.proc.wait(timeout=10)}"
        except subprocess.TimeoutExpired:
            return "exited: closed its socket"

    def fork(self, args: Sequence[str], env: Mapping[str, str]) -> ForkedWorker:
        """A worker that runs ``python -m workers`` with ``args``, in ``env`` and this directory."""
        stdin_r, stdin_w = os.pipe()
        status_r, status_w = os.pipe()
        request = json.dumps({"args": list(args), "env": dict(env), "cwd": os.getcwd()}).encode()
        stdout, stderr = (fd if _is_open(fd) else os.open(os.devnull, os.O_WRONLY) for fd in (1, 2))
        try:
            worker = ForkedWorker(status_r, stdin_w)
            socket.send_fds(self.control, [request], [stdin_r, stdout, stderr, status_w])
        finally:
            for fd in {stdin_r, status_w, stdout, stderr} - {1, 2}:
                os.close(fd)
        worker.wait_forked(timeout=30.0)
        self.workers = [w for w in self.workers if w.poll() is None] + [worker]
        return worker

    def idle(self) -> bool:
        return all(w.poll() is not None for w in self.workers)

    def close(self) -> None:
        """Stop it (its end of the socket closes) and reap it; its workers still running die with it."""
        self.control.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


_warm: dict[Environment, WarmProcess] = {}  # the last used last
_broken: set[Environment] = set()  # environments whose warm process never got ready: fresh workers
_lock = threading.Lock()
_owner = os.getpid()


def start_processes(args: Sequence[Sequence[str]], env: Mapping[str, str], timeout: float) -> list[WorkerProcess]:
    """One local worker process per entry of ``args`` (``python -m workers``'s arguments), in ``env``:
    forked from the warm process of ``env`` where possible. RuntimeError if that warm process does not
    get ready within ``timeout`` seconds (its workers would not have joined in time either)."""
    with _lock:
        warm = _warm_process(env, timeout, len(args))
        if warm is not None:
            forked = _fork_all(warm, args, env)
            if forked is not None:
                return forked
    fresh: list[WorkerProcess] = [
        subprocess.Popen([sys.executable, "-c", RUN_WORKER, *argv], stdin=subprocess.PIPE, env=dict(env))
        for argv in args]
    return fresh


def _fork_all(warm: WarmProcess, args: Sequence[Sequence[str]], env: Mapping[str, str]) -> list[WorkerProcess] | None:
    """The workers forked by ``warm``; None if that failed (what it forked is killed). A warm process
    still running may serve another group's workers, so it stays; this environment's workers then
    start fresh."""
    forked: list[WorkerProcess] = []
    try:
        for argv in args:
            forked.append(warm.fork(argv, env))
        return forked
    except OSError as exc:
        log.warning("the warm worker process could not fork a worker (%s); starting fresh worker processes", exc)
        for worker in forked:
            worker.kill()
            worker.wait()
        if warm.proc.poll() is not None:
            _drop(_key(env))  # died: the next group starts another
        else:
            _broken.add(_key(env))
        return None


def _key(env: Mapping[str, str]) -> Environment:
    return frozenset((k, v) for k, v in env.items() if k not in PER_WORKER)


def _warm_process(env: Mapping[str, str], timeout: float, workers: int) -> WarmProcess | None:
    """The warm process of ``env``, started if need be; None where workers start fresh."""
    key = _key(env)
    if env.get(FRESH_WORKERS) == "1" or not sys.platform.startswith("linux") or key in _broken:
        return None
    warm = _warm.pop(key, None)
    if warm is not None and warm.proc.poll() is None:
        _warm[key] = warm  # the last used last
        return warm
    if warm is not None:  # killed: its workers died with it
        warm.close()
    try:
        warm = WarmProcess(env)
    except OSError as exc:
        log.warning("cannot start a warm worker process (%s); starting fresh worker processes", exc)
        return None
    why = warm.wait_ready(timeout)
    if why is None:
        _warm[key] = warm
        _close_idle()
        return warm
    _broken.add(key)
    warm.proc.kill()
    warm.close()
    if why.startswith("timeout"):
        raise RuntimeError(f"0 of {workers} stage workers joined the group within {timeout:g} s (the warm process "
                           "they are forked from was still importing)")
    log.warning("the warm worker process %s; starting fresh worker processes", why)
    return None


def _drop(key: Environment) -> None:
    warm = _warm.pop(key, None)
    if warm is not None:
        warm.close()


def _close_idle() -> None:
    """Stop the least recently used warm processes beyond ``MAX_IDLE`` + 1 whose workers have all exited."""
    for key in [k for k, warm in list(_warm.items())[:-1] if warm.idle()][:max(0, len(_warm) - 1 - MAX_IDLE)]:
        _drop(key)


def warm_pids() -> list[int]:
    """The pids of this process's warm processes."""
    return [warm.proc.pid for warm in _warm.values()]


@atexit.register
def _close_all() -> None:
    """At exit (after ``workers.launch`` stopped its workers: registered before it), stop them."""
    if os.getpid() != _owner:
        return
    for key in list(_warm):
        _drop(key)


def _forget_in_child() -> None:
    """In a child forked from the driver: the warm processes are the driver's. Close the copies of their
    sockets, which would keep them from seeing the driver go, and start afresh if it needs workers."""
    global _lock, _owner
    for warm in _warm.values():
        warm.control.close()
    _warm.clear()
    _lock = threading.Lock()
    _owner = os.getpid()


os.register_at_fork(after_in_child=_forget_in_child)
