"""The stage-worker runtime: join the RPC group, serve stages, leave when told or when the driver is gone.

TensorPipe's graceful shutdown hangs forever once a peer is dead (measured with torch 2.13), so a
worker never uses it. It waits for a ``stop`` RPC, for a ping to find its driver's connection lost,
for the rendezvous store to stop answering, or (for local workers) for its stdin pipe from the driver
to close, then shuts down non-gracefully. A ping that only times out is no such sign while the store
or the stdin pipe is watched: a live driver holding the GIL (a long C call) answers no ping, yet those
watches still see its process, and they exit this one themselves when it is gone.

Why the store as well as the ping: an RPC completes, even with an error, only on the worker's RPC
thread, and a stage worker has one (``workers.options.STAGE_RPC_THREADS``). A stage body that never
returns (a user layer that deadlocks) holds it, so the ping neither answers nor fails; measured: such
a worker was still running 40 s after its driver was SIGKILLed. The store (hosted by the driver, or by
torchrun's agent) is checked over its own connection from its own thread.
"""
from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn, TextIO

import torch
import torch.distributed.rpc as rpc

from rrefpipe._cpp_log import quiet_cpp_warnings, quiet_from_now
from rrefpipe.errors import first_line

from .options import STAGE_INTEROP_THREADS, init_rpc

__all__ = ["serve", "prepare_stop", "request_stop", "alive", "stop_workers"]

log = logging.getLogger("rrefpipe.workers")
_stop = threading.Event()


def prepare_stop() -> None:
    """RPC target: the group is about to stop, so peers leaving is expected from now on: their TensorPipe
    "EOF" warnings are dropped (``rrefpipe._cpp_log``). A round of its own before :func:`request_stop`,
    since the first worker to leave would otherwise reach a peer that has not been told yet."""
    quiet_from_now()


def request_stop() -> None:
    """RPC target: ask this worker to leave the group (quieted as by :func:`prepare_stop`)."""
    quiet_from_now()
    _stop.set()


def alive() -> bool:
    """RPC target: workers ping their driver with it. False once the driver is in a graceful
    ``rpc.shutdown()``, which waits until every worker of the group has called it too."""
    from rrefpipe import _rpc

    return not _rpc.in_graceful_shutdown()


def _watch_stdin(grace: float) -> None:
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except (OSError, ValueError):
        pass
    _stop.set()  # EOF: the driver process is gone; the main thread leaves at once, unless it is stuck
    time.sleep(grace)  # in a ping that a stage body holding the RPC thread keeps from ending
    os._exit(0)


def _driver_store(name: str, interval: float) -> torch.distributed.TCPStore | None:
    """A client of the rendezvous store at MASTER_ADDR:MASTER_PORT, or None when there is none to watch."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    timeout = timedelta(seconds=max(2 * interval, 5.0))
    try:
        return torch.distributed.TCPStore(addr, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    except Exception as exc:
        log.warning("worker %s: cannot watch the rendezvous store %s:%s (%s); relying on pings", name, addr, port,
                    first_line(exc))
        return None


def _watch_store(store: torch.distributed.TCPStore, name: str, interval: float) -> None:
    """Exit the process once the rendezvous store misses two checks in a row.

    Exits directly (``os._exit``): the main thread may be stuck in a ping, or in ``rpc.shutdown`` waiting
    for the RPC thread that a hung stage body holds."""
    misses = 0
    while not _stop.wait(interval):
        try:
            store.check(["rrefpipe/liveness"])
            misses = 0
        except Exception as exc:
            misses += 1
            if misses >= 2 and not _stop.is_set():
                log.warning("worker %s: the rendezvous store %s:%s is gone (%s); leaving", name, store.host,
                            store.port, first_line(exc))
                os._exit(0)


def _start_watches(name: str, interval: float, watch_stdin: bool) -> bool:
    """Start the threads that exit this process once the driver's process is gone; whether any runs."""
    if watch_stdin:
        threading.Thread(target=_watch_stdin, args=(interval,), name="rrefpipe-stdin-watch", daemon=True).start()
    store = _driver_store(name, interval)
    if store is not None:
        threading.Thread(target=_watch_store, args=(store, name, interval), name="rrefpipe-store-watch",
                         daemon=True).start()
    return watch_stdin or store is not None


def _freeze_start_up_objects() -> None:
    """Hide what start-up left alive (torch's modules and the RPC agent, ~240k objects) from the garbage
    collector: a full collection walks every tracked object with the GIL held, and a stage stalled
    stalls the whole pipeline. Transformer-style model, 2 stages, m=32, 300 steps, first stage: 3 full
    collections of ~107 ms each before, 7 of ~29 ms after (what is created later stays unfrozen, such as
    the ~75k objects of a DistributedOptimizer's first use). Young garbage is collected as before, and
    these objects live as long as the worker."""
    gc.collect()
    gc.freeze()


def _drop_torchscript_optimizer_warning() -> None:
    """DistributedOptimizer scripts its functional optimizer on each worker, and torch 2.13 then warns
    there about its own use of TorchScript: nothing a user of DistributedOptimizer can act on. torch
    warns inside ``simplefilter("always")``, past any filter, so the message is dropped at display."""
    show = warnings.showwarning

    def showwarning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    file: TextIO | None = None, line: str | None = None) -> None:
        if "support for functional optimizers is deprecated" not in str(message):
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


def serve(
    *,
    name: str,
    rank: int,
    world_size: int,
    options: rpc.TensorPipeRpcBackendOptions,
    driver: str = "driver",
    ping_interval: float = 2.0,
    watch_stdin: bool = False,
    threads: int | None = None,
    interop_threads: int | None = STAGE_INTEROP_THREADS,
    rpc_timeout: float | None = None,
    after_join: Callable[[], None] | None = None,
) -> None:
    """Serve stages as RPC worker ``name`` until stopped or orphaned.

    ``options.rpc_timeout`` applies while joining the group; ``rpc_timeout``, if given, from then on.
    ``interop_threads``: see ``workers.options.STAGE_INTEROP_THREADS`` (None keeps PyTorch's default).
    ``after_join``: run once the RPC group is up (the replicas' process groups, see ``workers.group``).
    """
    if threads:
        torch.set_num_threads(threads)
    if interop_threads:
        try:
            torch.set_num_interop_threads(interop_threads)
        except RuntimeError as exc:  # parallel work already ran in this process (serve called late)
            log.warning("worker %s: keeping %d inter-op threads (%s)", name, torch.get_num_interop_threads(), exc)
    from rrefpipe.stage_side.checkpoint import warm_up

    warm_up()
    _drop_torchscript_optimizer_warning()
    init_rpc(name, rank=rank, world_size=world_size, options=options)
    if rpc_timeout is not None:
        rpc._set_rpc_timeout(rpc_timeout)
    _check_driver_joined(name, driver)
    if after_join is not None:
        after_join()
    _freeze_start_up_objects()
    watched = _start_watches(name, ping_interval, watch_stdin)
    graceful = _ping_driver(name, driver, ping_interval, watched)
    _leave(graceful, timeout=max(10 * ping_interval, 30.0))


def _check_driver_joined(name: str, driver: str) -> None:
    """Leave with status 1 when no member of the group is called ``driver``: every ping would fail
    ("could not find destination name") and the worker would leave blaming a dead driver."""
    from rrefpipe import _rpc

    names = _rpc.worker_names()
    if driver not in names:
        log.error("worker %s: the group has no driver named %r (its members: %s); start the worker with "
                  "--driver NAME, the name the driver gave rpc.init_rpc (rank 0 here: %r); leaving",
                  name, driver, ", ".join(names), names[0])
        _leave(False, timeout=0.0, status=1)


def _timed_out(exc: Exception) -> bool:
    return "timeout" in str(exc).lower()


#: Seconds of unanswered pings after which a worker leaves a driver whose process its watches still see.
SILENT_DRIVER_LIMIT = 120.0


def _ping_driver(name: str, driver: str, interval: float, watched: bool) -> bool:
    """Ping the driver until told to stop or it is gone; True when it waits in a graceful shutdown.

    A lost connection means the driver process is gone. A timeout only means it did not answer in
    time: it may hold the GIL. ``watched`` (the store or stdin watch runs, see :func:`_start_watches`):
    those see the process itself, so timeouts make the worker leave only after ``SILENT_DRIVER_LIMIT``
    seconds of them (a store on another host than the driver's, under torchrun, may outlive it);
    without a watch two in a row do.
    """
    misses, silent_since = 0, 0.0
    while not _stop.wait(interval):
        try:
            if not rpc.rpc_sync(driver, alive, timeout=max(2 * interval, 5.0)):
                return True
            misses = 0
        except Exception as exc:
            misses += 1
            silent_since = time.monotonic() if misses == 1 else silent_since
            silent_too_long = time.monotonic() - silent_since > SILENT_DRIVER_LIMIT if watched else misses >= 2
            if not _timed_out(exc) or silent_too_long:
                log.warning("worker %s: driver %r is gone (%s); leaving", name, driver, exc)
                return False
            if misses == 1:
                log.info("worker %s: driver %r did not answer a ping (%s); waiting", name, driver, exc)
    return False


def _leave(graceful: bool, timeout: float, status: int = 0) -> NoReturn:
    """Leave the group and exit. ``graceful``: join the driver's graceful ``rpc.shutdown()`` (a user's,
    at the end of a script), which would otherwise wait for this worker forever; otherwise leave alone,
    which never waits for anyone."""
    try:
        rpc.shutdown(graceful=graceful, timeout=timeout)
    except Exception as exc:  # the graceful one's barrier failed; it has shut this worker down anyway
        log.warning("graceful shutdown with the driver failed (%s); leaving", first_line(exc))
    os._exit(status)  # TensorPipe threads can outlive shutdown; nothing else is left to flush


def stop_workers(names: list[str], timeout: float = 2.0) -> None:
    """From a driver: ask ``names`` to leave, then leave the group non-gracefully (never hangs). The
    TensorPipe warnings each leaving worker causes ("encountered error ... EOF") are dropped meanwhile."""
    with quiet_cpp_warnings():
        _stop_workers(names, timeout)


def _stop_workers(names: list[str], timeout: float) -> None:
    answered = _call_each(names, prepare_stop, timeout)  # every worker quiet before the first one leaves
    _call_each(answered, request_stop, timeout)  # one that did not answer is gone, or leaves with its driver
    rpc.shutdown(graceful=False)


def _call_each(names: list[str], target: Callable[[], None], timeout: float) -> list[str]:
    """Call ``target`` on every worker at once; the names of those that answered."""
    futures = {}
    for name in names:
        try:
            futures[name] = rpc.rpc_async(name, target, timeout=timeout)
        except Exception:
            pass  # a worker that is already gone counts as stopped
    answered = []
    for name, future in futures.items():
        try:
            future.wait()
            answered.append(name)
        except Exception:
            pass
    return answered
