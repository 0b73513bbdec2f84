"""Joining a local group without waiting on a worker that has died.

torch's ``tcp://`` and ``env://`` rendezvous make rank 0 wait for every other rank inside the
``TCPStore`` constructor, for the default process-group timeout (30 minutes), blind to a worker
process that exited first (a broken environment, a device it cannot open). :class:`LocalWorkers`
started those processes, so its driver joins through the ``rrefpipe-local://`` scheme instead: the
same store, but rank 0 waits for the others in short turns, asking between turns whether one of
its worker processes has exited, and gives up at the start-up timeout; and the store listens on the
group's address alone (loopback), where torch's listens on every interface.

Each worker says it has joined with a counter in the store; the last one sets a key the driver
waits on. Everything after the rendezvous (the RPC agents exchanging names) is torch's, bounded by
the store timeout ``init_rpc`` sets to the RPC timeout.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

__all__ = ["SCHEME", "local_url", "watching"]

SCHEME = "rrefpipe-local"
_JOINED = "rrefpipe/joined"
_ALL_JOINED = "rrefpipe/all-joined"
_TURN = 0.05  # seconds between the driver's looks at the store and at its worker processes

_watchers: dict[int, Callable[[], bool]] = {}  # port -> "has one of the workers exited?"
_watchers_lock = threading.Lock()


def local_url(host: str, port: int, timeout: float) -> str:
    """The ``init_method`` for a local group joining at ``host:port`` within ``timeout`` seconds."""
    return f"{SCHEME}://{host}:{port}?timeout={timeout:g}"


@contextmanager
def watching(port: int, exited: Callable[[], bool]) -> Iterator[None]:
    """While the driver joins at ``port``, ``exited()`` tells whether one of its workers has gone."""
    with _watchers_lock:
        _watchers[port] = exited
    try:
        yield
    finally:
        with _watchers_lock:
            _watchers.pop(port, None)


def _handler(url: str, **kwargs: object) -> Iterator[tuple[dist.Store, int, int]]:
    """torch's rendezvous-handler protocol: yield (store, rank, world size) once."""
    parsed = urlparse(url)
    query = {key: values[-1] for key, values in parse_qs(parsed.query).items()}
    rank, world_size = int(query["rank"]), int(query["world_size"])
    timeout = timedelta(seconds=float(query.get("timeout", 60)))
    assert parsed.hostname is not None and parsed.port is not None, f"{SCHEME}:// needs host:port, got {url!r}"
    if rank == 0:
        store = _serving_store(parsed.hostname, parsed.port, world_size, timeout)
        _wait_for_workers(store, parsed.port, world_size - 1, timeout)
    else:
        store = dist.TCPStore(parsed.hostname, parsed.port, world_size, is_master=False, timeout=timeout,
                              wait_for_workers=False)
        if store.add(_JOINED, 1) == world_size - 1:
            store.set(_ALL_JOINED, "1")
    yield store, rank, world_size
    raise RuntimeError(f"{SCHEME}:// cannot rendezvous again: start new workers")


def _serving_store(host: str, port: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The group's store, served on a socket that listens on ``host`` alone: given an address,
    ``TCPStore``'s own server still listens on every interface, and the store outlives the group in
    torch's keeping. The default (libuv) server of older torch releases takes no socket; the other one does."""
    for options in ({}, {"use_libuv": False}):
        fd = _listening_socket(host, port)
        try:
            return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                                 master_listen_fd=fd, **options)
        except (RuntimeError, ValueError) as exc:
            error = exc
            _close_if_listening(fd, port)  # for the next try to bind the port again
    raise error


def _close_if_listening(fd: int, port: int) -> None:
    """Close ``fd`` if it is still a socket bound to ``port``: a store that failed may have closed it,
    and the number may belong to another file since."""
    try:
        sock = socket.socket(fileno=fd)  # OSError when ``fd`` is no socket (any more)
    except OSError:
        return
    try:
        ours = sock.getsockname()[1] == port
    except OSError:
        ours = False
    if ours:
        sock.close()
    else:
        sock.detach()


def _listening_socket(host: str, port: int) -> int:
    """A socket listening on ``host`` alone; its descriptor, for the store to own."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family).detach()


def _wait_for_workers(store: dist.Store, port: int, workers: int, timeout: timedelta) -> None:
    with _watchers_lock:
        exited = _watchers.get(port, lambda: False)
    deadline = time.monotonic() + timeout.total_seconds()
    while workers and not store.check([_ALL_JOINED]):  # (a timed-out store.wait logs a C++ warning)
        if exited():
            raise RuntimeError("a stage worker exited before joining the group")
        if time.monotonic() > deadline:
            joined = store.add(_JOINED, 0)
            raise RuntimeError(f"{joined} of {workers} stage workers joined the group within "
                               f"{timeout.total_seconds():g} s")
        time.sleep(_TURN)


try:
    dist.register_rendezvous_handler(SCHEME, _handler)
except RuntimeError:  # registered already (a module reloaded)
    pass
