"""Recovery across separate hosts (network namespaces, each torchrun agent in its own PID namespace;
tests/multihost/netlab.py): a torchrun job over three hosts, laid out as the guide says for recovery:
the driver alone on host 0, both stage workers on host 1, two spares (``torchrun_group(spares=2)``) on
host 2. Mid-stream host 1 dies whole: every process on it, its agent and both stage workers, SIGKILLed at
once. Both its workers are lost in the same step, each spare takes one's stage, and the stream ends with
the losses and weights of plain PyTorch (tests/recovery/check_hosts.py runs the job).

torchrun's agents on the hosts that survive wait at its exit barrier for the lost host's agent, 300 s
(``exit_barrier_timeout``, which torchrun's command line does not expose, and no option of it shortens),
once their own ranks have ended: the test waits for each of them to log that its worker group finished
(every rank exited with status 0, ``LOGLEVEL=INFO``) and then ends them with the hosts.
"""
from __future__ import annotations

import json
import socket
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from tests.conftest import pid_alive
from tests.multihost import netlab
from tests.multihost.conftest import can_make_hosts, make_lab, torchrun_cmd, wait_for_output  # noqa: F401 (fixtures)
from tests.multihost.netlab import IFNAME, Lab
from tests.recovery.check_hosts import BATCHES, HOST_VARIABLE, KILL_AFTER, SNAPSHOT_EVERY, reference

SCRIPT = "tests/recovery/check_hosts.py"
FINISHED = "worker group successfully finished"  # torchrun's agent: every local rank exited with status 0


def _line(replies: IO[bytes], lab: Lab, what: str) -> bytes:
    try:
        line = replies.readline()
    except TimeoutError:
        pytest.fail(f"the driver did not send {what} in time:\n{lab.outputs()}")
    if not line:
        pytest.fail(f"the driver closed the control socket before {what}:\n{lab.outputs()}")
    return line


@pytest.mark.timeout(120)
def test_a_host_of_two_stage_workers_dies_and_spares_on_another_host_take_their_stages(make_lab, tmp_path: Path):
    threads = set(threading.enumerate())
    lab = make_lab(3)
    driver_host, stage_host, spare_host = lab.hosts
    with tempfile.TemporaryDirectory(prefix="rrp") as tmp, socket.socket(socket.AF_UNIX) as listener:
        path = f"{tmp}/control"  # (a Unix socket's path is seen from every network namespace)
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(60)
        agents = {}
        for host, nproc in ((driver_host, 1), (stage_host, 2), (spare_host, 2)):
            options = ["--log-dir", str(tmp_path / f"torchrun-host{host.index}")]  # (not a new /tmp/torchelastic_*)
            command = torchrun_cmd(host, driver_host, nproc, [SCRIPT, path, IFNAME], nnodes=3, options=options)
            env = {HOST_VARIABLE: f"host{host.index}", "LOGLEVEL": "INFO"}  # (INFO: the agent logs FINISHED)
            agents[host] = lab.spawn(host, command, name=f"host{host.index}", env=env)
        try:
            control, _ = listener.accept()
        except TimeoutError:
            pytest.fail(f"the driver did not connect in time:\n{lab.outputs()}")
        with control, control.makefile("rb") as replies:
            control.settimeout(60)
            assert _line(replies, lab, "READY") == b"READY\n"
            job = {host: lab.pids(host) for host in lab.hosts}  # every process of the job, host by host
            assert all(len(pids) >= 2 + nproc for pids, nproc in zip(job.values(), (1, 2, 2))), job  # + agent, unshare
            killed = lab.kill(stage_host)
            assert sorted(killed) == sorted(job[stage_host]) and not any(pid_alive(p) for p in killed)
            assert agents[stage_host].returncode is not None
            control.sendall(b"GO\n")
            line = _line(replies, lab, "its RESULT")
        assert line.startswith(b"RESULT "), line
        result: dict[str, Any] = json.loads(line[len(b"RESULT "):])
    for host in (driver_host, spare_host):  # its ranks ended by themselves, each with status 0
        wait_for_output(lab, f"host{host.index}", FINISHED, agents[host], timeout=30)
    lab.close()  # (the agents of hosts 0 and 2 were waiting at torchrun's exit barrier for host 1's)

    assert result["stage_workers"] == ["worker1", "worker2"] and result["spares"] == ["worker3", "worker4"], result
    assert result["hosts"] == {"driver": "host0", "worker1": "host1", "worker2": "host1",
                               "worker3": "host2", "worker4": "host2"}, result["hosts"]
    failed = KILL_AFTER + 1
    restored = failed // SNAPSHOT_EVERY * SNAPSHOT_EVERY
    got = [(r["worker"], r["stages"], r["spare"], r["failed_update"], r["restored_update"], r["replayed"])
           for r in result["recoveries"]]
    assert got == [("worker1", [0], "worker3", failed, restored, failed - restored),
                   ("worker2", [1], "worker4", failed, restored, failed - restored)], result["recoveries"]
    assert result["stages"] == ["worker3", "worker4"]
    losses, state = reference()
    assert len(result["losses"]) == BATCHES
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), atol=1e-6, rtol=0)
    assert result["state"].keys() == state.keys()
    for name, value in state.items():
        torch.testing.assert_close(torch.tensor(result["state"][name]), value, atol=1e-6, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")

    left = [pid for pids in job.values() for pid in pids if pid_alive(pid)]
    assert not left, f"processes of the job outlived it: {left}"
    assert not [ns for ns in netlab.our_namespaces() if ns.startswith(lab.id + "-")]
    assert set(threading.enumerate()) <= threads, set(threading.enumerate()) - threads
