"""The test-host harness itself: hosts are made as described and leave nothing behind."""
from __future__ import annotations

import json
import os
import time

import pytest

from tests.conftest import pid_alive
from tests.multihost import netlab

pytestmark = pytest.mark.timeout(60)


def test_hosts_have_lo_and_one_private_address_and_are_removed_with_their_processes(make_lab):
    lab = make_lab(2)
    for host in lab.hosts:
        links = json.loads(netlab.sh("ip", "-n", host.ns, "-j", "addr", "show").stdout)
        by_name = {link["ifname"]: link for link in links}
        assert set(by_name) == {"lo", netlab.IFNAME}
        assert "UP" in by_name["lo"]["flags"] and "UP" in by_name[netlab.IFNAME]["flags"]
        assert [a["local"] for a in by_name[netlab.IFNAME]["addr_info"] if a["family"] == "inet"] == [host.addr]
    # one process in its own PID namespace, one without: close() must end both
    lab.spawn(lab.hosts[0], ["sleep", "300"], name="sleep-pidns")
    lab.spawn(lab.hosts[1], ["sleep", "300"], name="sleep-plain", pid_namespace=False)
    deadline = time.monotonic() + 10
    pids: list[int] = []
    while time.monotonic() < deadline and len(pids) < 2:
        pids = [int(p) for h in lab.hosts for p in netlab.sh("ip", "netns", "pids", h.ns).stdout.split()]
        time.sleep(0.05)
    assert len(pids) >= 2, pids
    lab.close()
    assert not [pid for pid in pids if pid_alive(pid)]
    assert not [ns for ns in netlab.our_namespaces() if ns.startswith(lab.id + "-")]


def test_stale_namespaces_of_a_killed_run_are_removed(can_make_hosts):
    dead_pid = 4_000_000 + os.getpid() % 100_000  # above any pid in use here: "a run that is gone"
    while os.path.exists(f"/proc/{dead_pid}"):
        dead_pid += 1
    stale = f"{netlab.PREFIX}{dead_pid}n0-h0"
    netlab.sh("ip", "netns", "add", stale)
    try:
        assert stale in netlab.cleanup_stale()
        assert stale not in netlab.our_namespaces()
    finally:
        netlab.sh("ip", "netns", "del", stale, check=False)
