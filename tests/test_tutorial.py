"""The tutorial end to end in a subprocess, on a small subset: both runs learn, memory and timeline reported."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import WarmPython

CHANCE = 1 / 10  # ten digit classes


def run_tutorial(warm_python: WarmPython, *args: str, timeout: float = 280) -> subprocess.CompletedProcess[str]:
    """``python examples/tutorial.py --no-progress ARGS``, forked from the warm interpreter."""
    proc = warm_python.run(["examples/tutorial.py", "--no-progress", *args], timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"tutorial failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.mark.timeout(300)
def test_tutorial_trains_plain_and_pipelined_better_than_chance(tmp_path, warm_python):
    results_path, prefix = tmp_path / "results.json", tmp_path / "timeline"
    proc = run_tutorial(warm_python, "--mode", "both", "--epochs", "1", "--max-steps", "30", "--batch-size", "32",
                        "--stages", "2", "--chunks", "2", "--balance-by", "size", "--threads", "1",
                        "--results-json", str(results_path), "--timeline", str(prefix))
    plain, pipe = json.loads(results_path.read_text())
    assert (plain["mode"], pipe["mode"]) == ("plain", "pipe")
    assert plain["steps"] == pipe["steps"] == 30
    assert plain["accuracy"] > 3 * CHANCE and pipe["accuracy"] > 3 * CHANCE, proc.stdout
    assert len(pipe["balance"]) == 2 and sum(pipe["balance"]) == 10
    assert pipe["samples_per_s"] > 0 and plain["samples_per_s"] > 0
    assert len(pipe["memory"]) == 2  # one report per stage worker
    for report in [*plain["memory"], *pipe["memory"]]:
        assert report["saved_peak"] > 0 and report["peak_rss"] > 0
    assert [r["worker"] for r in pipe["memory"]] == ["worker1", "worker2"]
    assert (tmp_path / "timeline.json").is_file() and (tmp_path / "timeline.png").is_file()
    for text in ("balance by size: [", "held-out accuracy (360 images)", "samples/s", "peak kept for backward",
                 "accuracy difference pipe vs plain"):
        assert text in proc.stdout


@pytest.mark.timeout(300)
def test_checkpointing_keeps_less_for_backward_on_every_stage(tmp_path, warm_python):
    peaks = {}
    for mode in ("never", "always"):
        path = tmp_path / f"{mode}.json"
        run_tutorial(warm_python, "--mode", "pipe", "--epochs", "1", "--max-steps", "3", "--chunks", "4",
                     "--checkpoint", mode, "--balance-by", "uniform", "--results-json", str(path))
        (pipe,) = json.loads(path.read_text())
        peaks[mode] = [r["saved_peak"] for r in pipe["memory"]]
    assert all(a < b for a, b in zip(peaks["always"], peaks["never"])), peaks


@pytest.mark.timeout(300)
def test_tutorial_in_bfloat16_with_clipped_gradients(tmp_path, warm_python):
    """--bf16 and --clip-grad-norm: autocast around both runs' forward (reaching the stages) and
    clipping by the norm of all stages' gradients; both still learn, to the same accuracy here."""
    path = tmp_path / "results.json"
    proc = run_tutorial(warm_python, "--mode", "both", "--epochs", "1", "--max-steps", "30", "--batch-size", "32",
                        "--chunks", "2", "--balance-by", "uniform", "--threads", "1", "--bf16", "--clip-grad-norm",
                        "1.0", "--results-json", str(path))
    plain, pipe = json.loads(path.read_text())
    assert plain["accuracy"] > 3 * CHANCE and pipe["accuracy"] > 3 * CHANCE, proc.stdout
    assert abs(plain["accuracy"] - pipe["accuracy"]) < 0.05, proc.stdout
