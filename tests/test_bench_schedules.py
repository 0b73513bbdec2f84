"""benchmarks/bench_schedules.py (issue #41): its --quick smoke run writes every row the report and
targets read, and the targets' arithmetic. Timing targets are not asserted: a smoke run on a shared
machine says nothing about them."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from bench_schedules import (  # noqa: E402  (the benchmarks are scripts, not a package)
    CONTESTANTS, IL_CONTESTANTS, gm_se, interleaved_target, memory_target, pipelining_target, recompute_target,
    undisturbed)


def quick_run(script: str, tmp_path: Path, timeout: float) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``benchmarks/<script> --quick`` in a subprocess: what it printed, and the JSON it wrote."""
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, script, "--quick", "--out", str(out)], cwd=BENCHMARKS,
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["settings"]["quick"] is True
    return run, result


@pytest.mark.timeout(240)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="local stage workers and /proc")
def test_quick_run_writes_every_row(tmp_path: Path) -> None:
    run, result = quick_run("bench_schedules.py", tmp_path, 230)
    assert "targets (issue #41)" in run.stdout

    (speed,) = result["speed"]
    assert (speed["name"], speed["stages"]) == ("tiny", 2)
    (row,) = speed["rows"]
    assert row["chunks"] == 8 and set(row["contestants"]) == set(CONTESTANTS)
    for key, cell in row["contestants"].items():
        assert "error" not in cell, (key, cell.get("error"))
        assert cell["samples_per_s"] > 0 and cell["step"]["n"] == 2
        assert cell["achieved_over_ideal_mb"] > 0
        assert cell["cpu"] is not None and cell["cores"] >= 0  # the contestant's processes were found in /proc
        # (not > 0: two quick steps of the tiny model can take less CPU than one clock tick of /proc's counters)

    (il,) = result["interleaved"]
    assert (il["name"], il["balance_interleaved"], il["stages_per_worker"], il["workers"]) == ("tiny", [1, 2, 2, 1],
                                                                                               2, 2)
    (row,) = il["rows"]
    assert row["chunks"] == 4 and set(row["contestants"]) == set(IL_CONTESTANTS)
    for key, cell in row["contestants"].items():
        assert "error" not in cell, (key, cell.get("error"))
        assert cell["samples_per_s"] > 0
    assert row["contestants"]["il"]["achieved_over_own_ideal_mb"] > 0
    assert row["contestants"]["pp_il"]["achieved_over_own_ideal_mb"] > 0

    (mem,) = result["memory"]
    assert (mem["name"], mem["stages"]) == ("tiny", 2)
    (row,) = mem["rows"]
    assert row["chunks"] == 8 and set(row["peak_bytes"]) == {"gpipe", "1f1b"}
    assert all(b > 0 for peaks in row["peak_bytes"].values() for b in peaks)
    assert row["bound"] == pytest.approx([2 / 8 + 1 / 8, 1 / 8 + 1 / 8])
    # Memory is deterministic: 1F1B keeps n - j of the 8 micro-batches on stage j, stage 0 included.
    assert row["ratio"] == pytest.approx([2 / 8, 1 / 8])

    kinds = [t["target"].split()[0].rstrip(":") for t in result["targets"]]
    assert kinds == ["memory", "speed", "speed", "interleaved"]
    assert all(t["met"] in (True, False, None) for t in result["targets"])


def speed_result(cells: dict[str, dict[str, float]]) -> dict[str, Any]:
    """A result whose speed section has one row per chunk count, ``cells[m][key]`` samples/s."""
    rows = [{"chunks": int(m), "contestants": {k: {"samples_per_s": v} for k, v in c.items()}}
            for m, c in cells.items()]
    return {"speed": [{"name": "mlp", "stages": 2, "rows": rows}], "interleaved": [], "memory": []}


def test_geometric_mean_and_standard_error() -> None:
    s = gm_se([1.1, 1.0 / 1.1, 1.0])
    assert s["gm"] == pytest.approx(1.0)
    assert s["se"] == pytest.approx(math.log(1.1) / math.sqrt(3))  # sd of (l, -l, 0) is l
    assert gm_se([2.0])["se"] is None


def test_recompute_target_counts_m_8_and_more() -> None:
    result = speed_result({"4": {"1f1b": 100.0, "gpipe_always": 100.0},  # m < 8: left out
                           "8": {"1f1b": 120.0, "gpipe_always": 100.0},
                           "16": {"1f1b": 120.0, "gpipe_always": 100.0}})
    t = recompute_target(result)
    assert t["met"] is True and t["stats"]["cells"] == 2 and t["stats"]["gm"] == pytest.approx(1.2)
    assert not recompute_target(result, bar=1.25)["met"]


def test_pipelining_target_compares_with_the_control() -> None:
    result = speed_result({"8": {"1f1b": 105.0, "pp_1f1b": 100.0, "pp_1f1b_control": 102.0},
                           "16": {"1f1b": 99.0, "pp_1f1b": 100.0, "pp_1f1b_control": 100.0}})
    t = pipelining_target(result)
    assert t["met"] is True
    assert t["rrefpipe"]["gm"] == pytest.approx(math.sqrt(1.05 * 0.99))
    assert t["control"]["gm"] == pytest.approx(math.sqrt(1.02))
    result["speed"][0]["rows"][0]["contestants"]["pp_1f1b_control"]["samples_per_s"] = 110.0
    assert pipelining_target(result)["met"] is False
    assert pipelining_target(speed_result({"8": {"1f1b": 1.0, "pp_1f1b": 1.0}}))["met"] is None


def test_memory_target_reads_every_stage() -> None:
    row = {"chunks": 8, "ratio": [0.25, 0.125], "bound": [0.375, 0.25], "within_bound": True}
    result: dict[str, Any] = {"speed": [], "interleaved": [], "memory": [{"name": "mlp", "stages": 2, "rows": [row]}]}
    assert memory_target(result)["met"] is True
    row.update(ratio=[0.4, 0.125], within_bound=False)
    t = memory_target(result)
    assert t["met"] is False and "mlp 2st m=8 stage 0 0.400" in t["detail"] and "0/1 configurations" in t["detail"]


def test_interleaved_target_needs_every_cell_ahead() -> None:
    def row(m: int, il: float, one: float) -> dict[str, Any]:
        return {"chunks": m, "contestants": {"il": {"achieved_over_ideal_mb": il},
                                             "1f1b": {"achieved_over_ideal_mb": one}}}

    rows = [row(4, 0.9, 0.8), row(8, 0.95, 0.9)]
    result: dict[str, Any] = {"speed": [], "memory": [], "interleaved": [{"name": "mlp", "rows": rows}]}
    assert interleaved_target(result)["met"] is True
    rows.append(row(16, 0.8, 0.9))
    assert interleaved_target(result)["met"] is False


def test_undisturbed_cells_kept_the_cores_busy() -> None:
    def busy(cpu_ms: float, step_ms: float) -> dict[str, Any]:
        return {"samples_per_s": 1.0, "step": {"median_ms": step_ms}, "round_medians_ms": [step_ms],
                "cpu": {"user_ms": [cpu_ms], "sys_ms": [0.0], "minor_faults": [0.0]}}

    rows = [{"chunks": 8, "contestants": {"1f1b": busy(180.0, 100.0), "pp_1f1b": busy(160.0, 100.0)}},
            {"chunks": 16, "contestants": {"1f1b": busy(180.0, 100.0), "pp_1f1b": busy(110.0, 100.0)}}]
    result = {"machine": {"cpus_usable": 2}, "speed": [{"name": "mlp", "stages": 2, "rows": rows}]}
    assert undisturbed(result) == {"mlp 2st m=8"}  # at m=16 pipelining kept 1.1 of 2 cores busy
