"""Transparency across real separate hosts (network namespaces, each process in its own PID namespace).

The driver and the stage workers run on different hosts; outputs, the input's gradient and every
parameter's gradient must equal the plain model's at every step (checked in ``check_pipe.py``), and
the hosts' ``lan0`` byte counters must have grown by at least the tensors that crossed them: the tensors
really went over the link, not through TensorPipe's CMA channel.
"""
from __future__ import annotations

import sys

import pytest

from tests.multihost.conftest import (CHECK_SCRIPT, assert_at_least, result_of, run_entry_point_pipeline, torchrun_cmd,
                                      traffic, wait_all)
from tests.conftest import parameter_drifts
from tests.multihost.netlab import IFNAME

STEPS = 2
STREAM_BATCHES = 4


def check_stage_traffic(lab, result, moved):
    """Host 0 drives; stage worker k runs on host k (stage k-1)."""
    driver, *stage_hosts = lab.hosts
    assert [w for w, _ in result["stages"]] == [f"worker{k}" for k in range(1, len(stage_hosts) + 1)]
    assert_at_least(moved, driver, "tx", STEPS * result["input_bytes"], "the inputs sent to stage 0")
    assert_at_least(moved, stage_hosts[0], "rx", STEPS * result["input_bytes"], "the inputs stage 0 received")
    for j, nbytes in enumerate(result["activation_bytes"]):
        assert_at_least(moved, stage_hosts[j], "tx", STEPS * nbytes, f"stage {j}'s activations")
        assert_at_least(moved, stage_hosts[j + 1], "rx", STEPS * nbytes, f"stage {j + 1}'s received activations")
    assert_at_least(moved, driver, "rx", STEPS * result["output_bytes"], "the outputs")


@pytest.mark.timeout(120)
def test_worker_entry_point_on_other_hosts(make_lab):
    """``python -m workers --interface lan0`` (and ``--interface <address>``) on two hosts, driver on a third."""
    lab = make_lab(3)
    result, moved = run_entry_point_pipeline(lab, "--steps", str(STEPS))
    check_stage_traffic(lab, result, moved)


@pytest.mark.timeout(150)
def test_torchrun_two_nodes(make_lab):
    """One script under ``torchrun --nnodes 2`` (c10d rendezvous): rank 0 on node 0 drives, node 1's two
    ranks serve the stages and exit when the driver is done; the driver code runs on rank 0 only. The
    script then trains the same way with ``pipe.train_step`` under 1F1B, across the hosts; then a
    PipeDream-2BW ``pipe.train_stream`` of 4 batches equals the single-process simulation of its rule
    (losses and parameters), and ``pipe.stream`` under ``no_grad`` equals the plain model."""
    lab = make_lab(2)
    node0, node1 = lab.hosts
    before = {h: lab.counters(h) for h in lab.hosts}
    script = [CHECK_SCRIPT, "--interface", IFNAME, "--steps", str(STEPS), "--schedule", "1F1B",
              "--stream", "PipeDream-2BW", "--stream-batches", str(STREAM_BATCHES)]
    procs = [lab.spawn(node0, torchrun_cmd(node0, node0, 1, script), name="node0"),
             lab.spawn(node1, torchrun_cmd(node1, node0, 2, script), name="node1")]
    codes = wait_all(lab, procs, timeout=130)
    assert codes == [0, 0], f"torchrun exit statuses {codes}:\n{lab.outputs()}"
    result = result_of(lab, "node0")
    assert result["rank"] == 0 and result["workers"] == ["worker1", "worker2"]
    assert "RESULT " not in lab.output("node1"), "the driver's code ran on a stage-worker rank"
    out = lab.output("node0")
    assert out.count("1F1B step") == STEPS, out
    assert out.count("PipeDream-2BW train_stream batch") == STREAM_BATCHES, out
    assert f"PipeDream-2BW stream: {STREAM_BATCHES} outputs equal the plain model's" in out, out
    moved = traffic(lab, before)
    assert_at_least(moved, node0, "tx", STEPS * result["input_bytes"], "the inputs sent to stage 0")
    assert_at_least(moved, node1, "rx", STEPS * result["input_bytes"], "the inputs stage 0 received")
    assert_at_least(moved, node1, "tx", STEPS * result["output_bytes"], "the outputs sent to the driver")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("link", ["latency-10ms", "bandwidth-100mbit"])
def test_slowed_links_still_complete_and_match(make_lab, link):
    """+10 ms one way on every frame (the TAP relay), or every host's egress shaped to 100 Mbit (tbf)."""
    lab = make_lab(3, delay_ms=10.0) if link == "latency-10ms" else make_lab(3, rate="100mbit")
    result, moved = run_entry_point_pipeline(lab, "--steps", str(STEPS))
    check_stage_traffic(lab, result, moved)
    if lab.relay is not None:
        lab.close()  # the relay reports what it forwarded when it stops
        relayed = lab.output("relay")
        assert "relay: {'frames'" in relayed, relayed
        frames_bytes = int(relayed.split("'bytes': ")[1].split(",")[0])
        assert frames_bytes >= STEPS * (result["input_bytes"] + sum(result["activation_bytes"]))


@pytest.mark.timeout(150)
def test_example_under_torchrun_over_a_slow_link(make_lab):
    """``examples/multihost.py`` as the README launches it, over +1 ms and 100 Mbit: trains, and its loss
    and parameters equal plain PyTorch's."""
    lab = make_lab(2, delay_ms=1.0, rate="100mbit")
    node0, node1 = lab.hosts
    script = ["examples/multihost.py", "--interface", IFNAME, "--steps", "10"]
    procs = [lab.spawn(node0, torchrun_cmd(node0, node0, 2, script), name="node0"),
             lab.spawn(node1, torchrun_cmd(node1, node0, 1, script), name="node1")]
    codes = wait_all(lab, procs, timeout=130)
    assert codes == [0, 0], f"torchrun exit statuses {codes}:\n{lab.outputs()}"
    out = lab.output("node0")
    line = [x for x in out.splitlines() if x.startswith("plain PyTorch, same seed")]
    assert line, out
    drift = float(line[0].rsplit("largest parameter difference ", 1)[1].rstrip(")"))
    assert drift < 1e-4, line[0]
    assert "worker 'worker2'" in out and "stages:" not in lab.output("node1")


@pytest.mark.timeout(150)
def test_data_parallel_replicas_spread_over_two_hosts(make_lab):
    """``examples/data_parallel.py --replicas 2 --layout stage`` on two hosts of 3 processes: ranks 0, 1
    (host 0) drive the two replicas, and each replica has one stage worker on each host (ranks 2, 4 and
    3, 5), so activations and the gradients' averaging cross the link; both drivers end equal to plain
    PyTorch on the whole batch."""
    lab = make_lab(2)
    node0, node1 = lab.hosts
    before = {h: lab.counters(h) for h in lab.hosts}
    script = ["examples/data_parallel.py", "--replicas", "2", "--layout", "stage", "--interface", IFNAME,
              "--steps", "3"]
    procs = [lab.spawn(node0, torchrun_cmd(node0, node0, 3, script), name="node0"),
             lab.spawn(node1, torchrun_cmd(node1, node0, 3, script), name="node1")]
    codes = wait_all(lab, procs, timeout=130)
    assert codes == [0, 0], f"torchrun exit statuses {codes}:\n{lab.outputs()}"
    out = lab.output("node0")
    drifts = parameter_drifts(out)
    assert len(drifts) == 2 and max(drifts) < 1e-5, out
    assert "stage 0: worker 'worker2'" in out and "stage 1: worker 'worker4'" in out, out  # replica 0: hosts 0, 1
    assert "max parameter difference" not in lab.output("node1")  # no driver there
    moved = traffic(lab, before)
    assert moved[node1]["tx"] > 0 and moved[node0]["rx"] > 0
