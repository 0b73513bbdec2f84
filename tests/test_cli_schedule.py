"""``python -m rrefpipe timeline --schedule``: the steps drawn are ``pipe.train_step`` calls, and each worker's
spans come in its schedule's order (``rrefpipe.schedule.worker_orders``)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rrefpipe.__main__ import parser
from rrefpipe.schedule import Action, worker_orders
from tests.conftest import ROOT


def _run(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rrefpipe", "timeline", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def _spans(path: Path) -> list[dict]:
    return sorted((e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"), key=lambda e: e["ts"])


def _orders_seen(spans: list[dict]) -> dict[str, list[Action]]:
    """Per worker, its forwards and backwards in the order they started."""
    seen: dict[str, list[Action]] = {}
    for e in spans:
        if e["cat"] in ("forward", "backward"):
            action = Action(e["cat"][0].upper(), e["args"]["microbatch"], e["pid"])
            seen.setdefault(e["args"]["worker"], []).append(action)
    return seen


def test_schedule_is_read_in_any_case_and_defaults_to_the_pipe_x_path():
    assert parser().parse_args(["timeline", "--schedule", "interleaved1f1b"]).schedule == "Interleaved1F1B"
    args = parser().parse_args(["timeline"])
    assert args.schedule is None and args.stages_per_worker == 1


@pytest.mark.parametrize("flags, message", [
    (["--schedule", "Interleaved1F1B", "--stages", "3", "--chunks", "4"], "chunks must be a multiple of 3"),
    (["--schedule", "1F1B", "--stages", "4", "--stages-per-worker", "2"], "schedule='Interleaved1F1B' or 'InterleavedZeroBubble'"),
    (["--stages-per-worker", "2", "--stages", "4"], "--stages-per-worker 2 needs --schedule Interleaved1F1B"),
    (["--schedule", "PipeDream"], "schedule must be one of GPipe, 1F1B, Interleaved1F1B"),
])
def test_a_layout_the_schedule_cannot_run_is_refused_before_any_worker_starts(flags, message):
    proc = _run(*flags, "--out", "never-written", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (ROOT / "never-written.json").exists()


@pytest.mark.timeout(180)
def test_1f1b_timeline_interleaves_forwards_and_backwards(tmp_path):
    proc = _run("--schedule", "1f1b", "--stages", "2", "--chunks", "4", "--steps", "1", "--width", "32",
                "--batch-size", "16", "--checkpoint", "never", "--out", str(tmp_path / "tl"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "tl.png").stat().st_size > 0
    spans = _spans(tmp_path / "tl.json")
    stage0 = [e["cat"] for e in spans if e["pid"] == 0]
    assert stage0.count("forward") == stage0.count("backward") == 4
    # a forward after a backward: GPipe's order (every forward, then every backward) would have none
    assert "forward" in stage0[stage0.index("backward"):], stage0
    assert _orders_seen(spans) == {"worker1": worker_orders("1F1B", 2, 4)[0], "worker2": worker_orders("1F1B", 2, 4)[1]}


@pytest.mark.timeout(180)
def test_interleaved_timeline_runs_two_stages_on_each_worker_in_its_order(tmp_path):
    proc = _run("--schedule", "Interleaved1F1B", "--stages", "4", "--stages-per-worker", "2", "--chunks", "4",
                "--steps", "1", "--width", "32", "--batch-size", "16", "--layers-per-stage", "1",
                "--checkpoint", "never", "--out", str(tmp_path / "tl"))
    assert proc.returncode == 0, proc.stderr
    spans = _spans(tmp_path / "tl.json")
    workers = {e["pid"]: e["args"]["worker"] for e in spans}
    assert workers == {0: "worker1", 1: "worker2", 2: "worker1", 3: "worker2"}
    orders = worker_orders("Interleaved1F1B", 4, 4, 2)
    assert _orders_seen(spans) == {"worker1": orders[0], "worker2": orders[1]}
