"""The warm process local stage workers are forked from: it imports torch and the worker once, then
forks one worker per request of its driver (the driver's side is ``workers.warm``).

A fresh ``python -c`` worker spent about 1.9 CPU-seconds importing torch before anything else; a
worker forked from this process starts with everything imported.

Why a fork server of our own rather than ``multiprocessing``'s forkserver (``set_forkserver_preload``):

* its child runs ``multiprocessing``'s start-up, which imports the driver's main script again (as
  ``__mp_main__``): a training script without an ``if __name__ == "__main__":`` guard, which local
  workers never needed, would run again in every worker;
* a process has one forkserver, started with the process's environment of that moment, while glibc's
  malloc settings (``MALLOC_ARENA_MAX``, ...), the OpenMP and MKL thread counts and
  ``TORCH_CPP_LOG_LEVEL`` are read once at start or at ``import torch``: they must be in a warm
  process's environment from its start, so the driver keeps one warm process per environment;
* its children report their end through ``multiprocessing.Process``, with stdin closed; a local worker
  needs a pipe from its driver to watch, and ``LocalWorkers`` uses ``Popen``'s ``poll``, ``wait``,
  ``kill`` and ``returncode``, which ``workers.warm.ForkedWorker`` gives from a status pipe.

Protocol, over a ``SOCK_SEQPACKET`` pair (one message per datagram)::

    warm process -> driver   b"ready" once imported; or b"unsafe: ..." and exit (threads already ran)
    driver -> warm process   a JSON request {"args", "env", "cwd"} with four descriptors: the worker's
                             stdin (the read end of a pipe whose write end only the driver holds: the
                             worker's ``--watch-stdin``), stdout, stderr, and the write end of the
                             worker's status pipe
    warm -> status pipe      b"pid N\\n" once forked, b"exit S\\n" (the wait status) once reaped

Forking is safe once importing is done: no thread runs then (checked, see ``_threads_at_fork``), CUDA
is not initialised (a GPU worker initialises it after the fork) and RPC not started. What a fresh
interpreter would draw anew (torch's and numpy's seeds) is drawn in each worker; Python's string hash
seed is the warm process's, the same in all its workers.

The warm process leaves when the driver closes its end or dies (or it finds itself adopted by
another parent). Each worker is SIGKILLed when the warm process ends (``PR_SET_PDEATHSIG``: the warm
process is single-threaded), so a status pipe that closes without an exit line means just that.
"""
from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import traceback
from typing import Any

__all__: list[str] = []

#: What every local worker imports before it serves (torch, RPC, the worker and the stage side),
#: imported once here. Forking after that is safe, which ``serve_forks`` checks before any fork.
PRELOAD = ("torch", "torch.distributed.rpc", "torch.distributed.autograd", "torch.utils.checkpoint",
           "workers.__main__", "rrefpipe.stage_side.server", "rrefpipe.stage_side.control")
READY = b"ready"
UNSAFE = b"unsafe: "
MAX_REQUEST = 1 << 20  # bytes of one request's JSON (the environment, the arguments)
_CHECK_PARENT = 1.0  # seconds between looks at whether the driver is still this process's parent
_PR_SET_PDEATHSIG = 1


def serve_forks() -> None:
    """Be the warm process (``argv[1]``: the descriptor of its end of the driver's socket): import,
    then fork a worker per request until the driver is gone. Returns only in a forked worker, set up
    as a fresh ``python -c`` worker would be (stdio, arguments, environment, directory)."""
    control = socket.socket(fileno=int(sys.argv[1]))
    driver = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is for the driver and its workers
    for name in PRELOAD:
        importlib.import_module(name)
    why = _unsafe_to_fork()
    if why:
        control.send(UNSAFE + f"{why} after importing {', '.join(PRELOAD)}".encode())
        os._exit(0)
    gc.freeze()  # shared with the workers: their collections need not walk (and copy) these objects
    control.send(READY)
    _serve(control, driver)


def _serve(control: socket.socket, driver: int) -> None:
    """Fork a worker per request, reap them, report both on their status pipes; returns in a worker."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup byte is written for handled signals only
    statuses: dict[int, int] = {}  # worker pid -> the write end of its status pipe
    warm = os.getpid()
    poller = select.poll()
    poller.register(control, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while os.getppid() == driver:
        ready = {fd for fd, _ in poller.poll(_CHECK_PARENT * 1000)}
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(statuses)
        if control.fileno() not in ready:
            continue
        message, fds, flags, _ = socket.recv_fds(control, MAX_REQUEST, 4)
        if not message:
            break  # the driver closed its end, or exited
        if flags & socket.MSG_TRUNC or len(fds) != 4:
            for fd in fds:
                os.close(fd)
            continue  # not a request of workers.warm: the driver reads EOF on no status pipe
        pid = os.fork()
        if pid == 0:
            inherited = [wake_r, wake_w, *statuses.values()]
            _become_worker(json.loads(message), fds, control, inherited, parent=warm)
            return
        statuses[pid] = fds[3]
        for fd in fds[:3]:
            os.close(fd)
        _write(fds[3], b"pid %d\n" % pid)
    os._exit(0)  # the workers still running are SIGKILLed with this process (PR_SET_PDEATHSIG)


def _unsafe_to_fork() -> str | None:
    """Why forking this process now would give broken workers, if it would."""
    threads = _threads_at_fork()
    if threads != 1:
        return f"{threads} threads at a fork"
    with open("/proc/self/maps") as maps:
        if "libcuda.so" in maps.read():  # loaded at CUDA's first call, which a forked child cannot repeat
            return "CUDA's driver loaded"
    return None


def _threads_at_fork() -> int:
    """This process's threads after a fork, which only the forking thread survives: a child would find
    the locks that another thread held held for ever. numpy's OpenBLAS starts a pool at import (a
    thread per core but one, unless OMP_NUM_THREADS says fewer) and stops it before each fork (its
    ``pthread_atfork`` handler), to start it again at its next use: those threads are no danger, and
    they are gone after a first fork. torch starts its OpenMP team at its first parallel work."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return len(os.listdir("/proc/self/task"))


def _reap(statuses: dict[int, int]) -> None:
    """Collect every exited worker and send its wait status to the driver."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = statuses.pop(pid, None)
        if fd is not None:
            _write(fd, b"exit %d\n" % status)
            os.close(fd)


def _write(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except OSError:  # the driver dropped the worker's handle: nobody asks any more
        pass


def _become_worker(request: dict[str, Any], fds: list[int], control: socket.socket, inherited: list[int],
                   parent: int) -> None:
    """In a forked child: drop the warm process's descriptors and handlers, take the driver's stdio,
    arguments, environment and directory, and die with the warm process. Never returns on failure."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _die_with(parent)
        control.close()
        for fd in inherited:
            os.close(fd)
        stdin, stdout, stderr, status = fds
        os.close(status)
        for target, fd in enumerate((stdin, stdout, stderr)):
            os.dup2(fd, target)
        for fd in {stdin, stdout, stderr} - {0, 1, 2}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["-c", *request["args"]]
        _reseed()
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def _die_with(parent: int) -> None:
    """SIGKILL this process when ``parent`` (the single-threaded warm process) exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # the warm process ended before the prctl
        os._exit(1)


def _reseed() -> None:
    """Draw new seeds where a fresh interpreter would have: torch seeds its CPU generator from the
    system's entropy at start, as numpy does its global one (``random`` reseeds itself at a fork).
    A stage then seeds torch's from the driver's (``rrefpipe.seeding``). CUDA's generators start in
    the worker: the warm process never initialises CUDA."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
