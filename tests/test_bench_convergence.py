"""benchmarks/bench_convergence.py (issue 50, statistical efficiency): the --quick smoke run trains both
tasks under every rule and writes the JSON the report, the table and the picture read, with finite curves;
the analysis (running mean, equal-batch loss, common loss, the 1-point criterion) on made-up runs. Nothing
about convergence is asserted: a smoke run of a few batches says nothing about it."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import WarmPython

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from bench_convergence import ASYNC, RUNS, evaluate, smoothed, summarize  # noqa: E402  (a script, not a package)

QUICK_RUNS = [key for key in RUNS if key != "1f1b_aa"]
RUN_KEYS = {"key", "schedule", "label", "batches", "batches_per_s", "wall_s", "build_s", "eval_s", "time_s", "loss",
            "smoothed", "train_loss", "heldout", "best_heldout", "evals", "slices", "loss_at_equal_batches",
            "batches_to_common", "seconds_to_common", "accuracy_gap_points", "within_1_point", "heldout_loss_over_ref",
            "cores", "load"}


def finite(values: Any) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


@pytest.mark.timeout(180)  # < 20 s on a quiet 2-core machine; the margin is for a busy one
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="local stage workers and /proc")
def test_quick_run_writes_finite_curves_for_every_rule(tmp_path: Path, warm_python: WarmPython) -> None:
    out = tmp_path / "convergence.json"
    # the digits task only: the GPT's capture (torch.export) would double the run; the suite's any-model
    # tests capture that GPT already
    run = warm_python.run(["bench_convergence.py", "--quick", "--tasks", "digits", "--out", str(out)],
                          cwd=BENCHMARKS, timeout=170)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["settings"]["quick"] is True and result["wall_s"] > 0
    assert Path(result["settings"]["png"]) == out.with_suffix(".png") and out.with_suffix(".png").stat().st_size > 0
    assert [t["name"] for t in result["tasks"]] == ["digits"]
    for task in result["tasks"]:
        assert task["stages"] == 2 and task["budget_s"] == 0.5 and task["rounds"] >= 1
        assert [r["key"] for r in task["runs"]] == QUICK_RUNS
        assert [r["schedule"] for r in task["runs"]] == [RUNS[k][0] for k in QUICK_RUNS]
        for r in task["runs"]:
            assert RUN_KEYS <= set(r), (task["name"], r["key"], RUN_KEYS - set(r))
            assert 1 <= r["batches"] <= 4  # --quick caps the batches at 4
            assert len(r["loss"]) == len(r["time_s"]) == len(r["smoothed"]) == r["batches"]
            assert finite(r["loss"]) and finite(r["smoothed"]) and finite(r["time_s"]), (task["name"], r["key"])
            assert r["time_s"] == sorted(r["time_s"]) and r["time_s"][-1] <= r["wall_s"] + 1e-4  # (rounded to 0.1 ms)
            assert finite([r["heldout"]["loss"], r["heldout"]["accuracy"], r["train_loss"], r["wall_s"]])
            assert 0 <= r["heldout"]["accuracy"] <= 1 and r["heldout"]["samples"] > 0
            # one held-out evaluation after each slice, the last one the final numbers
            assert len(r["evals"]) == len(r["slices"]) >= 1 and r["evals"][-1] == r["heldout"]
            assert [e["batches"] for e in r["evals"]][-1] == r["batches"] == sum(s["batches"] for s in r["slices"])
            assert all(finite([e["loss"], e["accuracy"], e["time_s"]]) for e in r["evals"])
            assert r["best_heldout"]["loss"] == min(e["loss"] for e in r["evals"])
            assert isinstance(r["within_1_point"], bool)
        ref = task["runs"][0]
        assert ref["key"] == "1f1b" and ref["accuracy_gap_points"] == 0 and ref["within_1_point"]
        assert task["common_loss"] == max(r["train_loss"] for r in task["runs"])
        assert all(r["batches_to_common"] is not None for r in task["runs"])  # every run reaches the common loss
        # GPipe and 1F1B train on the same weights and batches: the same losses (a different order of the
        # micro-batches' backwards can round differently)
        gpipe = next(r for r in task["runs"] if r["key"] == "gpipe")
        n = min(ref["batches"], gpipe["batches"])
        assert gpipe["loss"][:n] == pytest.approx(ref["loss"][:n], rel=1e-4)
    assert len(result["targets"]) == len(ASYNC)  # one task
    assert "within 1 pt" in run.stdout and "targets (issue 50)" in run.stdout


def test_running_mean() -> None:
    assert smoothed([4.0, 2.0, 0.0, 2.0], 2) == [4.0, 3.0, 1.0, 1.0]
    assert smoothed([1.0, 3.0], 5) == [1.0, 2.0]


def _run(key: str, losses: list[float], accuracy: float) -> dict[str, Any]:
    heldout = {"accuracy": accuracy, "loss": 1.0}
    return {"key": key, "label": RUNS[key][1], "batches": len(losses), "loss": losses,
            "time_s": [0.5 * (k + 1) for k in range(len(losses))], "heldout": heldout,
            "evals": [{"loss": 1.5}, heldout]}


def test_summary_and_the_one_point_criterion() -> None:
    task: dict[str, Any] = {"name": "t", "smooth": 1, "budget_s": 2.0, "runs": [
        _run("1f1b", [3.0, 2.0, 1.0], 0.90), _run("pipedream", [3.0, 2.9, 2.0, 1.5], 0.895),
        _run("2bw", [3.0, 2.8], 0.88)]}
    summarize(task)
    ref, pd, bw = task["runs"]
    assert task["equal_batches"] == 2 and task["common_loss"] == 2.8  # 2BW's final loss is the highest
    assert [r["loss_at_equal_batches"] for r in task["runs"]] == [2.0, 2.9, 2.8]
    assert [r["batches_to_common"] for r in task["runs"]] == [2, 3, 2]
    assert [r["seconds_to_common"] for r in task["runs"]] == [1.0, 1.5, 1.0]
    assert pd["accuracy_gap_points"] == pytest.approx(-0.5) and pd["within_1_point"]
    assert bw["accuracy_gap_points"] == pytest.approx(-2.0) and not bw["within_1_point"]
    assert ref["best_heldout"]["loss"] == 1.0 and task["sync_spread_points"] == 0
    targets = evaluate({"tasks": [task]})
    assert [t["met"] for t in targets] == [True, False]
