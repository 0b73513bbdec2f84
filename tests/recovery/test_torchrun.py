"""Recovery under ``torchrun`` across two "hosts" (two agents, static rendezvous, on this machine): one
host is killed whole, agent and rank, mid-stream, and a spare on the other takes its stage
(tests/recovery/check_torchrun.py). (Within one host, torchrun's agent stops every rank of the host once
one of them exits: a single killed process ends its host's ranks, which is why the spares must be on
another host than the workers they replace.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, descendants, free_port, pid_alive




def _agent(node: int, nproc: int, port: int, go: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                             "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
                             "tests/recovery/check_torchrun.py", str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))




@pytest.mark.timeout(120)
def test_a_spare_on_another_host_takes_the_stage_of_a_host_that_died(tmp_path: Path):
    port, go = free_port(), tmp_path / "host-1-is-dead"
    hosts = [_agent(0, 3, port, go), _agent(1, 1, port, go)]
    try:
        deadline = time.monotonic() + 90
        out: list[str] = []
        assert hosts[0].stdout is not None
        while not any(line.startswith("READY") for line in out):
            line = hosts[0].stdout.readline()
            assert line or hosts[0].poll() is None, "".join(out)
            out.append(line)
            assert time.monotonic() < deadline, "".join(out)
        for pid in [hosts[1].pid, *descendants(hosts[1].pid)]:  # host 1: its agent and worker3
            os.kill(pid, signal.SIGKILL)
        hosts[1].wait(timeout=10)
        go.touch()
        while not any(line.startswith(("OK recovered", "Traceback")) for line in out):  # (then torchrun's agent
            line = hosts[0].stdout.readline()                   # waits at its exit barrier for host 1's, 300 s)
            assert line or hosts[0].poll() is None, "".join(out)[-4000:]
            out.append(line)
            assert time.monotonic() < deadline, "".join(out)[-4000:]
        text = "".join(out)
        ok = [line for line in text.splitlines() if line.startswith("OK recovered onto worker2")]
        assert ok, text[-4000:]
    finally:
        for host in hosts:
            for pid in [*descendants(host.pid), host.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            host.wait(timeout=10)
    for host in hosts:
        assert not pid_alive(host.pid)
