"""Spares with replicas (issue 52, item 1): 2 replicas of a 2-stage pipeline, each on a "host" of its own (a
torchrun agent per replica, static rendezvous, on this machine), each with one spare; replica 1 loses a stage
worker; its spare takes the stage, replica 1's stages take their state from replica 0's, and both replicas end
as the uninterrupted data-parallel run in plain PyTorch (tests/replicas/check_replica_spares.py)."""
from __future__ import annotations

import re
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, descendants, free_port, record_surfacing, run_script, wait_gone
from tests.replicas.test_replica_loss import _agent as replica_agent
from tests.replicas.test_replica_loss import _kill_host, _wait_for

SCRIPT = "tests/replicas/check_replica_spares.py"


def _agent(node: int, port: int, out: Path, monitor: float, *args: str) -> subprocess.Popen[bytes]:
    """A torchrun agent for "host" ``node``: one replica, a driver, 2 stage workers and a spare."""
    return replica_agent(node, port, out, monitor, *args, script=SCRIPT, nproc=4)


def _run(tmp_path: Path, *args: str) -> tuple[list[str], float, float]:
    """Both replicas' outputs once each printed DONE (checked), the kill's time and the wall time."""
    port = free_port()
    outs = [tmp_path / "host0.out", tmp_path / "host1.out"]
    # host 1's agent would stop every rank of its host once it sees worker6 dead: it looks only every 100 s
    agents = [_agent(0, port, outs[0], 0.5, *args), _agent(1, port, outs[1], 100, *args)]
    start = time.monotonic()
    try:
        texts = [_wait_for(out, rf"DONE replica {r}", start + 100, agent)
                 for r, (out, agent) in enumerate(zip(outs, agents))]
        wall = time.monotonic() - start
    finally:
        pids = [pid for agent in agents for pid in [agent.pid, *descendants(agent.pid)]]
        for agent in agents:
            _kill_host(agent)
    wait_gone(pids, 10)
    for r, text in enumerate(texts):
        other = texts[1 - r]
        assert f"DONE replica {r}" in text, text[-6000:] + f"\n--- host {1 - r} ---\n" + other[-3000:]
        assert f"OK replica {r}: 6 losses as plain PyTorch's on both replicas' batches" in text, text[-4000:]
        assert f"OK replica {r}: final weights as plain PyTorch's" in text, text[-4000:]
    assert "OK replica 0: recoveries [], stages on ['worker1', 'worker2']" in texts[0], texts[0][-4000:]
    assert ("OK replica 1: recoveries [('worker6', 'worker7', (1,), 'replica 0')], stages on "
            "['worker5', 'worker7']") in texts[1], texts[1][-4000:]
    killed = float(re.search(r"KILLED at ([\d.]+)", texts[1]).group(1))  # type: ignore[union-attr]
    return texts, killed, wall


def _done(text: str, step: int) -> float:
    return float(re.search(rf"STEP {step} DONE at ([\d.]+)", text).group(1))  # type: ignore[union-attr]


@pytest.mark.timeout(120)
def test_a_spare_takes_a_lost_stage_worker_with_its_state_from_the_other_replica(tmp_path: Path):
    """Replica 1's last stage worker (worker6) is SIGKILLed between steps 2 and 3: both replicas' step 3 fails,
    worker7 (replica 1's spare) takes stage 1, replica 1's stages are rebuilt from replica 0's, and both run
    step 3 again. Every loss of both replicas and both replicas' final weights equal plain PyTorch trained on
    both replicas' batches (atol 1e-6, rtol 0); replica 1's pipe.recoveries names worker6 -> worker7 from
    replica 0, and worker7 serves stage 1 to the end; no process is left."""
    texts, killed, wall = _run(tmp_path)
    record = re.search(r"replica 1: worker6 -> worker7 \(stages \(1,\)\) from replica 0 at 3 updates, ([\d.]+) s",
                       texts[1])
    assert record, texts[1][-4000:]
    resumed = [_done(text, 3) for text in texts]
    record_surfacing("a replica's stage worker replaced by its spare (state from replica 0)",
                     "kill to both replicas' step done", max(resumed) - killed)
    print(f"\nwall {wall:.1f} s; kill to step 3 done: replica 0 {resumed[0] - killed:.2f} s, replica 1 "
          f"{resumed[1] - killed:.2f} s (its recovery {record.group(1)} s)")


@pytest.mark.timeout(120)
def test_a_stage_worker_lost_in_its_optimizer_step_is_rebuilt_at_the_other_replicas_count(tmp_path: Path):
    """Replica 1's worker6 is SIGKILLed during replica 1's optimizer step of step 3 (it sleeps there), after
    worker5's stage was updated: replica 0 applied that update and fails in step 4. Replica 0 had applied 4
    updates and replica 1 3, so replica 1's stages are rebuilt from replica 0's at 4 updates (its half-done
    update with them), replica 1 goes on with step 4 (yielding step 3's loss, computed before) and replica 0
    runs step 4 again: every loss and the final weights of both equal plain PyTorch's, as above."""
    texts, killed, wall = _run(tmp_path, "--update")
    record = re.search(r"replica 1: worker6 -> worker7 \(stages \(1,\)\) from replica 0 at 4 updates, ([\d.]+) s",
                       texts[1])
    assert record, texts[1][-4000:]
    resumed = [_done(text, 4) for text in texts]
    record_surfacing("a replica's stage worker lost in its optimizer step (state from replica 0)",
                     "kill to both replicas' next step done", max(resumed) - killed)
    print(f"\nwall {wall:.1f} s; kill to step 4 done: replica 0 {resumed[0] - killed:.2f} s, replica 1 "
          f"{resumed[1] - killed:.2f} s (its recovery {record.group(1)} s)")


def test_the_guide_shows_this_script():
    """The guide's "Spares with replicas" subsection shows the block of the script between its ``guide``
    marks (less the lines marked ``# (test)``), which the test above runs."""
    source = (ROOT / SCRIPT).read_text()
    block = source.split("    # guide: begin\n")[1].split("    # guide: end\n")[0]
    shown = textwrap.dedent("".join(line for line in block.splitlines(keepends=True)
                                    if not line.rstrip().endswith("# (test)")))
    page = (ROOT / "docs" / "guide" / "recovery.md").read_text()
    section = page[page.index("\n### Spares with replicas\n"):]
    code = re.search(r"^```py\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    assert code is not None and code.group(1) == shown, "docs/guide/recovery.md's spares code differs from " + SCRIPT


def test_each_replica_keeps_its_last_ranks_as_spares_leaving_a_stage_worker(monkeypatch: pytest.MonkeyPatch):
    """``spares=k`` with replicas takes k ranks from each replica's block; it must leave each replica a stage
    worker (checked before anything joins)."""
    import workers

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match=r"spares=2 with 2 ranks per replica besides its driver: spares must leave "
                                         r"at least one stage worker in each replica"):
        with workers.torchrun_group(replicas=2, spares=2):
            pass


@pytest.mark.timeout(60)
def test_let_go_closes_a_generation_and_regroup_makes_the_next():
    """In one process (a job of one replica, for the mechanics): ``let_go`` drops the group of the generation it
    names (not a later one), ``regroup`` makes a fresh group of the ranks it is given at a new generation, once,
    and averaging works in it."""
    run_script(f"""
        import torch, torch.distributed as dist
        from rrefpipe import replicas
        store = dist.TCPStore("127.0.0.1", {free_port()}, 1, is_master=True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        old = dist.new_group([0])
        replicas.join(replicas.Membership(replica=0, replicas=1, group=old, ranks=[0], names=["worker1"], timeout=5))
        replicas.let_go(1)  # (not this generation: nothing)
        assert replicas.current().group is old
        replicas.let_go(0)
        assert replicas.current().group is None and old not in dist.distributed_c10d._world.pg_map
        replicas.regroup([0], ["worker3"], 1)
        m = replicas.current()
        assert m.generation == 1 and m.group is not None and m.names == ["worker3"], m
        replicas.regroup([0], ["worker3"], 1)
        assert replicas.current().group is m.group  # the same generation again: nothing
        replicas.let_go(0)  # (a late call for the old generation: the new group stays)
        assert replicas.current().group is m.group
        p = torch.ones(2)
        assert replicas.end_step([p], [torch.full((2,), 2.0)], 4, [], generation=1)[0].tolist() == [2.0, 2.0]
        dist.destroy_process_group()
        print("OK")
    """, timeout=50)
