"""Going on with fewer replicas (issue 52): 2 replicas of a 2-stage pipeline, each on a "host" of its own (a
torchrun agent per replica, static rendezvous, on this machine), ``on_replica_loss="continue"``; replica 1
loses a stage worker; replica 0 goes on alone and ends as plain PyTorch does on both replicas' batches
before the step that failed and on its own after (tests/replicas/check_replica_loss.py)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, descendants, free_port, pid_alive, record_surfacing, run_script

SCRIPT = "tests/replicas/check_replica_loss.py"


def _agent(node: int, port: int, out: Path, monitor: float, *args: str, script: str = SCRIPT, nproc: int = 3
           ) -> subprocess.Popen[bytes]:
    """A torchrun agent for "host" ``node`` running ``script``: one replica of ``nproc`` ranks (layout "replica":
    a driver and 2 stage workers here, and a spare in tests/replicas/test_replica_spares.py)."""
    with open(out, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                                 str(node), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                                 "--master-port", str(port), "--monitor-interval", str(monitor), script, *args],
                                stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))




def _wait_for(path: Path, pattern: str, deadline: float, agent: subprocess.Popen[bytes]) -> str:
    """The agent's output once it matches ``pattern``, or once the agent has exited or the deadline passed."""
    while True:
        text = path.read_text(errors="replace")
        if re.search(pattern, text) or agent.poll() is not None or time.monotonic() > deadline:
            return path.read_text(errors="replace")
        time.sleep(0.2)


@pytest.mark.timeout(150)
def test_the_replicas_go_on_without_a_lost_one_as_plain_pytorch_on_the_survivors_batches(tmp_path: Path):
    """Replica 1's last stage worker is SIGKILLed between steps 2 and 3: replica 1's driver ends with
    ReplicaLost naming it; replica 0's step 3 fails at the averaging, it drops replica 1 (its record agrees
    with replica 1's account: the same worker, after 3 steps), runs step 3 again alone and goes on. Its six
    losses and final weights equal plain PyTorch's (assert_close's float32 tolerances) trained on both
    replicas' shares for steps 0-2 and on replica 0's share alone for steps 3-5."""
    port = free_port()
    outs = [tmp_path / "host0.out", tmp_path / "host1.out"]
    # host 1's agent looks at its processes every 5 s: its driver has that long to report before the agent
    # stops the rest of its host
    agents = [_agent(0, port, outs[0], monitor=0.5), _agent(1, port, outs[1], monitor=5)]
    start = time.monotonic()
    try:
        text = _wait_for(outs[0], r"DONE replica 0", start + 130, agents[0])
        wall = time.monotonic() - start
        lost = outs[1].read_text(errors="replace")
        assert "DONE replica 0" in text, text[-6000:] + "\n--- host 1 ---\n" + lost[-3000:]
        assert re.search(r"OK replica 0: 6 losses as plain PyTorch's", text), text[-4000:]
        assert "OK replica 0: final weights as plain PyTorch's" in text, text[-4000:]
        record = re.search(r"replica 0: replicas \[1\] lost \((.*?)\) after 3 steps, ([\d.]+) s; replicas \[0\] go on; "
                           r"their report: (.*)", text)
        assert record, text[-4000:]
        assert "worker5" in record.group(1), record.group(0)
        assert "'worker5' gone after 3 averaged steps" in record.group(3), record.group(0)  # replica 1's account
        line = re.search(r"LOST replica 1: (.*)", lost)
        assert line, lost[-4000:]
        assert "replica 1 is lost: 'worker5' of it is gone" in line.group(1) and "after 3 steps" in line.group(1) \
            and "replicas [0] go on without it" in line.group(1), line.group(1)
        killed = float(re.search(r"KILLED at ([\d.]+)", lost).group(1))  # type: ignore[union-attr]
        resumed = float(re.search(r"STEP 3 DONE at ([\d.]+)", text).group(1))  # type: ignore[union-attr]
        record_surfacing("a replica lost (on_replica_loss='continue')", "kill to the survivor's step done",
                         resumed - killed)
        print(f"\nwall {wall:.1f} s; kill to replica 0's step 3 done {resumed - killed:.2f} s (its drop took "
              f"{record.group(2)} s)")
    finally:
        for agent in agents:
            _kill_host(agent)
    for agent in agents:
        assert not pid_alive(agent.pid)


def _kill_host(agent: subprocess.Popen[bytes]) -> None:
    """SIGKILL a "host": its agent and every process below it."""
    for pid in [*descendants(agent.pid), agent.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait(timeout=10)


@pytest.mark.timeout(150)
def test_the_replicas_go_on_without_a_host_lost_whole_driver_included(tmp_path: Path):
    """Replica 1's host (agent, driver, stage workers) is SIGKILLed while replica 0 runs step 3: replica 0's
    averaging fails, it drops replica 1 with no report from it (its driver is dead too), runs step 3 again
    alone and ends as plain PyTorch on both replicas' shares for steps 0-2 and its own for 3-5."""
    port = free_port()
    outs = [tmp_path / "host0.out", tmp_path / "host1.out"]
    agents = [_agent(0, port, outs[0], 0.5, "--host"), _agent(1, port, outs[1], 0.5, "--host")]
    start = time.monotonic()
    try:
        ready = _wait_for(outs[1], r"HOST 1 READY at ([\d.]+)", start + 100, agents[1])
        assert "HOST 1 READY" in ready, ready[-4000:] + "\n--- host 0 ---\n" + outs[0].read_text()[-3000:]
        time.sleep(0.5)  # replica 0 is in its step 3 by now, waiting for replica 1 in the averaging
        killed = time.time()
        _kill_host(agents[1])
        text = _wait_for(outs[0], r"DONE replica 0", start + 130, agents[0])
        assert "DONE replica 0" in text, text[-6000:]
        assert "OK replica 0: final weights as plain PyTorch's" in text, text[-4000:]
        record = re.search(r"replica 0: replicas \[1\] lost \((.*?)\) after 3 steps, ([\d.]+) s; replicas \[0\] go on; "
                           r"their report: \{\}", text)
        assert record, text[-4000:]
        resumed = float(re.search(r"STEP 3 DONE at ([\d.]+)", text).group(1))  # type: ignore[union-attr]
        record_surfacing("a replica's host lost (on_replica_loss='continue')", "kill to the survivor's step done",
                         resumed - killed)
        print(f"\nwall {time.monotonic() - start:.1f} s; host killed to replica 0's step 3 done {resumed - killed:.2f} s")
    finally:
        for agent in agents:
            _kill_host(agent)


def test_the_guide_shows_this_script():
    """The guide's "Replicas" section shows the block of the script between its ``guide`` marks (less the
    lines marked ``# (test)``), which the test above runs."""
    source = (ROOT / SCRIPT).read_text()
    block = source.split("    # guide: begin\n")[1].split("    # guide: end\n")[0]
    shown = textwrap.dedent("".join(line for line in block.splitlines(keepends=True)
                                    if not line.rstrip().endswith("# (test)")))
    page = (ROOT / "docs" / "guide" / "recovery.md").read_text()
    section = page[page.index("\n## Replicas\n"):]
    code = re.search(r"^```py\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    assert code is not None and code.group(1) == shown, "docs/guide/recovery.md's Replicas code differs from " + SCRIPT


def test_on_replica_loss_takes_stop_or_continue():
    import workers

    with pytest.raises(ValueError, match="on_replica_loss must be 'stop' or 'continue', got 'retry'"):
        with workers.torchrun_group(replicas=2, on_replica_loss="retry"):
            pass


@pytest.mark.timeout(60)
def test_a_rebuilt_group_is_new_and_a_step_planned_before_it_does_not_join_it():
    """In one process (a job of one replica, for the mechanics): ``rebuild`` makes a new Gloo group of the live
    replicas over the job's store, once per generation; ``end_step`` averages in it, and refuses a step planned
    for the group's previous generation (one called off before the rebuild, whose thread gets there late)."""
    run_script(f"""
        import torch, torch.distributed as dist
        from rrefpipe import replicas
        store = dist.TCPStore("127.0.0.1", {free_port()}, 1, is_master=True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        old = dist.new_group([0])
        replicas.join(replicas.Membership(replica=0, replicas=1, group=old, ranks=[0], names=["driver"], timeout=5,
                                          on_loss="continue"))
        p = torch.ones(2)
        assert replicas.end_step([p], [torch.full((2,), 3.0)], 4, [], generation=0)[0].tolist() == [3.0, 3.0]
        replicas.rebuild([0], 1)
        m = replicas.current()
        assert m.generation == 1 and m.group is not old and m.live_replicas == (0,) and m.first, m
        replicas.rebuild([0], 1)
        assert replicas.current().group is m.group  # the same generation again: nothing
        assert replicas.end_step([p], [torch.full((2,), 2.0)], 4, [], generation=1)[0].tolist() == [2.0, 2.0]
        try:
            replicas.end_step([p], [torch.ones(2)], 4, [], generation=0)
        except RuntimeError as exc:
            assert "planned for the replicas' group of generation 0" in str(exc), exc
        else:
            raise AssertionError("a step of generation 0 averaged in the group of generation 1")
        replicas.barrier()
        dist.destroy_process_group()
        print("OK")
    """, timeout=50)
