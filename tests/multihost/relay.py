"""A user-space Ethernet switch between TAP devices that delays every frame: added latency without netem.

``python -m tests.multihost.relay --delay-ms 10 TAP0 TAP1 ...`` creates the TAP devices (in the namespace it
runs in), prints ``ready`` and then forwards frames: a frame read from one TAP is written, ``delay`` later,
to the TAP where its destination MAC was last seen (to all others when unknown or broadcast), so the TAPs,
once moved into test hosts' namespaces, form one L2 segment whose one-way latency is ``delay`` more than
the kernel's (round trips ``2 * delay``). It stops when its stdin closes (its parent is gone) or after
``--max-seconds``; the TAP devices vanish with it. Counts of frames and bytes go to stderr at exit.
"""
from __future__ import annotations

import argparse
import collections
import fcntl
import os
import select
import struct
import sys
import time
from collections.abc import Sequence

__all__ = ["open_tap", "forward"]

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_MAX_FRAME = 65536


def open_tap(name: str) -> int:
    """A non-blocking fd of a new TAP device ``name`` (Ethernet frames, no packet-info header)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def forward(fds: Sequence[int], delay: float, deadline: float, control: int | None = None) -> dict[str, int]:
    """Switch frames between ``fds`` with ``delay`` seconds added, until ``control`` hits EOF or ``deadline``."""
    where: dict[bytes, int] = {}  # MAC -> fd it was last seen on
    queue: collections.deque[tuple[float, list[int], bytes]] = collections.deque()  # FIFO = due order (one delay)
    stats = {"frames": 0, "bytes": 0, "dropped": 0}
    watched = list(fds) + ([control] if control is not None else [])
    while True:
        now = time.monotonic()
        if now >= deadline:
            break
        while queue and queue[0][0] <= now:
            _, targets, frame = queue.popleft()
            for fd in targets:
                try:
                    os.write(fd, frame)
                except OSError:  # the interface is down or its queue full: a lossy link drops the frame
                    stats["dropped"] += 1
        timeout = min(max(0.0, queue[0][0] - now), 1.0) if queue else 1.0
        ready = select.select(watched, [], [], timeout)[0]
        for fd in ready:
            if fd == control:
                if not os.read(fd, 4096):
                    return stats
                continue
            for _ in range(256):  # a burst, then look at the others again
                try:
                    frame = os.read(fd, _MAX_FRAME)
                except OSError:  # EAGAIN: nothing more to read now
                    break
                if len(frame) < 14:
                    continue
                where[frame[6:12]] = fd
                dst = where.get(frame[0:6])
                targets = [dst] if dst is not None and dst != fd else [f for f in fds if f != fd]
                queue.append((time.monotonic() + delay, targets, frame))
                stats["frames"] += 1
                stats["bytes"] += len(frame)
    return stats


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.multihost.relay", description=__doc__.split("\n")[0])
    p.add_argument("taps", nargs="+", help="names of the TAP devices to create")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added to every frame")
    p.add_argument("--max-seconds", type=float, default=900.0, help="stop after this long in any case")
    args = p.parse_args(argv)
    fds = [open_tap(name) for name in args.taps]
    print("ready", flush=True)
    stats = forward(fds, args.delay_ms / 1e3, time.monotonic() + args.max_seconds, control=sys.stdin.fileno())
    print(f"relay: {stats}", file=sys.stderr, flush=True)
    for fd in fds:
        os.close(fd)


if __name__ == "__main__":
    main()
