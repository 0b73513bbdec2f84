"""Fixtures of the multi-host tests: test hosts (network namespaces) made for each test and removed after it.

Where hosts cannot be made (not root, no iproute2, no namespaces) every test here is skipped with the
reason, which ``-ra`` prints in the summary.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.multihost import netlab
from tests.multihost.netlab import Host, Lab

CHECK_SCRIPT = "tests/multihost/check_pipe.py"
MASTER_PORT = "29500"  # each host has its own port space: nothing else listens there


@pytest.fixture(scope="session")
def can_make_hosts() -> Iterator[None]:
    reason = netlab.unavailable()
    if reason:
        pytest.skip(reason)
    stale = netlab.cleanup_stale()
    if stale:
        print(f"removed namespaces left by an earlier, killed run: {stale}")
    yield
    mine = [ns for ns in netlab.our_namespaces() if ns.startswith(f"{netlab.PREFIX}{os.getpid()}n")]
    assert not mine, f"namespaces outlived the tests: {mine}"


@pytest.fixture
def make_lab(can_make_hosts: None, tmp_path: Path) -> Iterator[Callable[..., Lab]]:
    """``make_lab(hosts, delay_ms=None, rate=None)``: a started :class:`Lab`, closed after the test."""
    labs: list[Lab] = []

    def make(hosts: int, **kwargs: Any) -> Lab:
        if kwargs.get("delay_ms") is not None:
            reason = netlab.relay_unavailable()
            if reason:
                pytest.skip(reason)
        lab = Lab(hosts, logdir=tmp_path, **kwargs)
        labs.append(lab)
        return lab.start()

    try:
        yield make
    finally:
        for lab in labs:
            lab.close()
        left = [ns for ns in netlab.our_namespaces() if any(ns.startswith(lab.id + "-") for lab in labs)]
        assert not left, f"namespaces not removed: {left}"


# -- helpers for the tests ---------------------------------------------------------------------------
def wait_all(lab: Lab, procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    """Exit statuses of ``procs``; fails with every log of the lab if one is still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {timeout}s:\n{lab.outputs()}")
    return codes


def wait_for_output(lab: Lab, name: str, text: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until log ``name`` (written by ``proc``) contains ``text``; fails with every log of the lab if
    ``proc`` exits first or ``timeout`` passes (polls the log: it is a file)."""
    deadline = time.monotonic() + timeout
    while text not in lab.output(name):
        if proc.poll() is not None and text not in lab.output(name):
            pytest.fail(f"{name} exited ({proc.returncode}) without printing {text!r}:\n{lab.outputs()}")
        if time.monotonic() > deadline:
            pytest.fail(f"{name} did not print {text!r} in {timeout}s:\n{lab.outputs()}")
        time.sleep(0.05)


def result_of(lab: Lab, name: str) -> dict[str, Any]:
    """The ``RESULT {json}`` line the check script printed to log ``name``."""
    lines = [line for line in lab.output(name).splitlines() if line.startswith("RESULT ")]
    if not lines:
        pytest.fail(f"no RESULT line from {name}:\n{lab.outputs()}")
    return dict(json.loads(lines[-1][len("RESULT "):]))


def worker_cmd(rank: int, world_size: int, master: Host, interface: str) -> list[str]:
    """``python -m workers`` as a user starts it on a stage host."""
    return [sys.executable, "-m", "workers", "--rank", str(rank), "--world-size", str(world_size),
            "--master-addr", master.addr, "--master-port", MASTER_PORT, "--interface", interface, "--threads", "1"]


def torchrun_cmd(host: Host, endpoint: Host, nproc: int, script: Sequence[str], nnodes: int = 2,
                 options: Sequence[str] = ()) -> list[str]:
    """``torchrun`` as a user starts it on each node (c10d rendezvous hosted on ``endpoint``), with more of
    torchrun's ``options`` if given."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{endpoint.addr}:29400", "--rdzv-id", "multihost-test",
            "--rdzv-conf", f"is_host={int(host == endpoint)}", "--local-addr", host.addr, *options, *script]


def traffic(lab: Lab, before: dict[Host, dict[str, int]]) -> dict[Host, dict[str, int]]:
    """Bytes each host's ``lan0`` received and sent since ``before``."""
    return {h: {k: lab.counters(h)[k] - before[h][k] for k in ("rx", "tx")} for h in lab.hosts}


def run_entry_point_pipeline(lab: Lab, *extra: str) -> tuple[dict[str, Any], dict[Host, dict[str, int]]]:
    """Driver on host 0, ``python -m workers`` stage workers on hosts 1.. (worker k on host k); returns the
    driver's RESULT and each host's traffic. Worker 2 names its interface by address, the others by name."""
    driver, *stage_hosts = lab.hosts
    world = len(lab.hosts)
    before = {h: lab.counters(h) for h in lab.hosts}
    procs = [lab.spawn(host, worker_cmd(k, world, driver, host.addr if k == 2 else netlab.IFNAME), name=f"worker{k}")
             for k, host in enumerate(stage_hosts, start=1)]
    env = {"RANK": "0", "WORLD_SIZE": str(world), "MASTER_ADDR": driver.addr, "MASTER_PORT": MASTER_PORT}
    procs.insert(0, lab.spawn(driver, [sys.executable, CHECK_SCRIPT, "--interface", netlab.IFNAME, *extra],
                              name="driver", env=env))
    codes = wait_all(lab, procs, timeout=100)
    assert codes == [0] * len(procs), f"exit statuses {codes} (driver first):\n{lab.outputs()}"
    return result_of(lab, "driver"), traffic(lab, before)


def assert_at_least(moved: dict[Host, dict[str, int]], host: Host, direction: str, nbytes: int, what: str) -> None:
    got = moved[host][direction]
    assert got >= nbytes, f"{host.ns} lan0 {direction} grew by {got} bytes, less than {what} ({nbytes} bytes)"
