"""The stage-worker runtime: join the RPC group, serve stages, leave when told or when the driver is gone.

TensorPipe's graceful shutdown hangs forever once a peer is dead (RPC_FACTS), so a worker never uses
it. It waits for a ``stop`` RPC, for its driver to stop answering pings, or (for local workers) for
its stdin pipe from the driver to close, then shuts down non-gracefully.
"""
from __future__ import annotations

import logging
import os
import sys
import threading

import torch
import torch.distributed.rpc as rpc

__all__ = ["serve", "request_stop", "alive", "stop_workers"]

log = logging.getLogger("rrefpipe.workers")
_stop = threading.Event()


def request_stop() -> None:
    """RPC target: ask this worker to leave the group."""
    _stop.set()


def alive() -> bool:
    """RPC target: workers ping their driver with it."""
    return True


def _watch_stdin() -> None:
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except (OSError, ValueError):
        pass
    _stop.set()  # EOF: the driver process is gone


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
    rpc_timeout: float | None = None,
) -> None:
    """Serve stages as RPC worker ``name`` until stopped or orphaned.

    ``options.rpc_timeout`` applies while joining the group; ``rpc_timeout``, if given, from then on.
    """
    if threads:
        torch.set_num_threads(threads)
    from rrefpipe.checkpoint import warm_up

    warm_up()
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    if rpc_timeout is not None:
        rpc._set_rpc_timeout(rpc_timeout)
    if watch_stdin:
        threading.Thread(target=_watch_stdin, name="rrefpipe-stdin-watch", daemon=True).start()
    misses = 0
    while not _stop.wait(ping_interval):
        try:
            rpc.rpc_sync(driver, alive, timeout=max(2 * ping_interval, 5.0))
            misses = 0
        except Exception as exc:
            misses += 1
            if misses >= 2 or "timeout" not in str(exc).lower():
                log.warning("worker %s: driver %r is gone (%s); leaving", name, driver, exc)
                break
    rpc.shutdown(graceful=False)
    os._exit(0)  # TensorPipe threads can outlive shutdown; nothing else is left to flush


def stop_workers(names: list[str], timeout: float = 2.0) -> None:
    """From a driver: ask ``names`` to leave, then leave the group non-gracefully (never hangs)."""
    futures = []
    for name in names:
        try:
            futures.append(rpc.rpc_async(name, request_stop, timeout=timeout))
        except Exception:
            pass
    for future in futures:
        try:
            future.wait()
        except Exception:
            pass  # a worker that is already gone counts as stopped
    rpc.shutdown(graceful=False)
