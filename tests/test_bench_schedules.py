"""benchmarks/bench_schedules.py (issues #41, #49) and its zero-bubble section (sched_zero_bubble.py): the
--quick smoke run writes every row the report and targets read; the targets' arithmetic, the physical
limit's and the achieved bubble's; the zero-bubble layouts and options. Timing targets are not asserted: a
smoke run on a shared machine says nothing about them."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import WarmPython

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import sched_zero_bubble as zb  # noqa: E402
from bench_schedules import (  # noqa: E402  (the benchmarks are scripts, not a package)
    CONTESTANTS, IL_CONTESTANTS, gm_se, interleaved_target, memory_target, parse_args, pipelining_target,
    recompute_target, undisturbed)


def quick_run(warm_python: WarmPython, script: str, tmp_path: Path, timeout: float, *args: str
              ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``benchmarks/<script> --quick ARGS``, forked from the warm interpreter: what it printed, and the JSON
    it wrote."""
    out = tmp_path / "result.json"
    run = warm_python.run([script, "--quick", "--out", str(out), *args], cwd=BENCHMARKS, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["settings"]["quick"] is True
    return run, result


@pytest.mark.timeout(240)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="local stage workers and /proc")
def test_quick_run_writes_every_row(tmp_path: Path, warm_python: WarmPython) -> None:
    run, result = quick_run(warm_python, "bench_schedules.py", tmp_path, 230)
    assert "targets (issue #41, #49)" in run.stdout and "Zero bubble (issue #49)" in run.stdout

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

    (z,) = result["zero_bubble"]
    assert (z["name"], z["workers"]) == ("tiny", 2)
    assert z["balances"] == {"two": [3, 3], "loop": [1, 2, 2, 1], "v": [2, 1, 2, 1]}
    (row,) = z["rows"]
    assert row["chunks"] == 4 and list(row["contestants"]) == list(zb.DEFAULT_CONTESTANTS)
    phys = row["physical"]
    assert phys["workers"] == 2 and phys["one_process"]["n"] == 2
    assert phys["physical_step_ms"] == pytest.approx(phys["one_process"]["median_ms"] / 2)
    for key, cell in row["contestants"].items():
        assert "error" not in cell, (key, cell.get("error"))
        assert cell["samples_per_s"] > 0 and cell["step"]["n"] == 2
        assert cell["achieved_over_physical"] > 0 and cell["achieved_bubble"] < 1 and cell["work_ms"] > 0
        assert 0 <= cell["simulated_bubble"] < 1, key  # rrefpipe.schedule has every schedule's orders
    for name, sim in row["simulated"].items():
        assert sim["step_ms"] > 0 and set(sim["costs_ms"]) == {"F", "B", "I", "W"}, name
    assert set(row["simulated"]) == {"1F1B/1", "GPipe/1", "ZBVZeroBubble/2", "InterleavedZeroBubble/2",
                                     "DualPipeV/2"}
    assert {layout: len(by_m["4"]) for layout, by_m in z["split_backward"].items()} == {"two": 2, "loop": 4, "v": 4}
    for by_m in z["split_backward"].values():
        for c in by_m["4"]:
            assert min(c.values()) > 0 and c["split_over_fused"] == pytest.approx(c["split_ms"] / c["backward_ms"])

    kinds = [t["target"].split()[0].rstrip(":") for t in result["targets"]]
    assert kinds == ["memory", "speed", "speed", "interleaved", "zero", "zero", "zero", "split"]
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


# -- the zero-bubble section (issue #49) -------------------------------------------------------------
def zb_result(cells: dict[int, dict[str, float]], name: str = "mlp") -> dict[str, Any]:
    """A result whose zero-bubble section has one row per chunk count, ``cells[m][key]`` samples/s."""
    rows = [{"chunks": m, "contestants": {k: {"samples_per_s": v} for k, v in c.items()}} for m, c in cells.items()]
    return {"speed": [], "interleaved": [], "memory": [],
            "zero_bubble": [{"name": name, "rows": rows, "split_backward": {}}]}


def test_layouts_put_the_stages_where_the_schedules_do() -> None:
    assert zb.stage_workers("v", 4) == [0, 1, 1, 0]  # stage j on worker j, then 2p - 1 - j
    assert zb.stage_workers("loop", 4) == [0, 1, 0, 1]
    assert zb.stage_workers("two", 2) == [0, 1]
    for layout, balances in zb.BALANCES.items():
        for name, bal in balances.items():
            assert sum(bal) == sum(zb.SPECS[name].balance(2)), name
            if name != "resnet":  # (its layers differ in cost: split by time) each worker holds its half
                held = [sum(b for b, w in zip(bal, zb.stage_workers(layout, 4)) if w == r) for r in (0, 1)]
                assert held == zb.SPECS[name].balance(2), (layout, name)
    for key, c in zb.CONTESTANTS.items():  # rrefpipe's and pipelining's contestants of a schedule run the same split
        twin = zb.ZERO_BUBBLE.get(key)
        if twin:
            assert zb.CONTESTANTS[twin][:3] == c[:3] and c.split_backward
    assert zb.pp_schedule_key("pp_zbv") == "zbv" and zb.pp_schedule_key("pp_1f1b_control") == "1f1b"


def test_physical_limit_is_one_process_over_the_workers() -> None:
    assert zb.physical_ms(300.0, 2) == 150.0
    rounds = [{"step": {"median_ms": 200.0, "samples_ms": [190.0, 210.0]}},
              {"step": {"median_ms": 300.0, "samples_ms": [300.0, 320.0]}}]
    row = zb.physical_row(rounds, batch=256)
    assert row["one_process"]["median_ms"] == pytest.approx(255.0)  # pooled: the median of all 4 steps
    assert row["physical_step_ms"] == pytest.approx(127.5) and row["workers"] == 2
    assert row["samples_per_s"] == pytest.approx(256 / 0.1275)
    assert row["round_medians_ms"] == [200.0, 300.0]
    # a contestant as fast as the one process reaches half the limit
    cell = {"step": {"median_ms": 255.0}, "samples_per_s": 256 / 0.255}
    sim = {"step_ms": 110.0, "bubble": 0.1, "work_ms": 200.0}
    zb.add_yardsticks(cell, zb.CONTESTANTS["zbv"], row, [], sim, 4)
    assert cell["achieved_over_physical"] == pytest.approx(0.5)
    assert cell["achieved_bubble"] == pytest.approx(1 - 200.0 / (2 * 255.0))
    assert cell["simulated_bubble"] == 0.1 and cell["achieved_over_simulated"] == pytest.approx(110 / 255)


def test_work_and_simulated_bubble() -> None:
    costs = [{"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}, {"F": 1.0, "B": 2.0, "I": 1.5, "W": 0.5}]
    assert zb.work_ms(costs, 4, split_backward=False) == 4 * (3 + 3)
    assert zb.work_ms(costs, 4, split_backward=True) == 4 * (3 + 3)
    assert zb.kind_means(costs) == {"F": 1.0, "B": 2.0, "I": 1.25, "W": 0.75}
    sim = zb.simulated("1F1B", 2, 4, 1, costs)
    assert sim["work_ms"] == pytest.approx(24.0)  # each action at its own stage's cost: no I or W in 1F1B
    assert sim["step_ms"] == pytest.approx(15.0) and sim["bubble"] == pytest.approx(1 - 24 / 30)  # (m + 1) x 3
    assert "error" in zb.simulated("NoSuchSchedule", 2, 4, 1, costs)


def test_zbv_over_1f1b_target() -> None:
    result = zb_result({4: {"zbv": 115.0, "1f1b": 100.0, "dpv": 90.0}, 8: {"zbv": 110.0, "1f1b": 100.0}})
    t = zb.over_1f1b_target(result)
    assert t["met"] is True and t["stats"]["gm"] == pytest.approx(math.sqrt(1.15 * 1.10))
    assert t["others"]["dpv"]["cells"] == 1 and "DPV/1F1B 0.900" in t["detail"]
    assert zb.over_1f1b_target(result, bar=1.2)["met"] is False
    assert zb.over_1f1b_target(zb_result({4: {"1f1b": 1.0}}))["met"] is None


def test_zero_bubble_pipelining_target_needs_each_schedule_at_the_control() -> None:
    cells = {4: {"zbv": 105.0, "pp_zbv": 100.0, "dpv": 99.0, "pp_dpv": 100.0, "pp_1f1b": 100.0,
                 "pp_1f1b_control": 101.0},
             8: {"zbv": 103.0, "pp_zbv": 100.0, "dpv": 101.0, "pp_dpv": 100.0, "pp_1f1b": 100.0,
                 "pp_1f1b_control": 100.0}}
    t = zb.pipelining_target(zb_result(cells))
    assert set(t["schedules"]) == {"zbv", "dpv"}
    assert t["schedules"]["zbv"]["rrefpipe"]["gm"] == pytest.approx(math.sqrt(1.05 * 1.03))
    assert t["schedules"]["zbv"]["control"]["gm"] == pytest.approx(math.sqrt(1.01))
    assert t["met"] is False  # DPV: sqrt(0.99 x 1.01) under the control's sqrt(1.01)
    cells[8]["dpv"] = 103.0
    assert zb.pipelining_target(zb_result(cells))["met"] is True
    assert zb.pipelining_target(zb_result({4: cells[4]}))["met"] is None  # one cell: no standard error


def test_physical_target_reads_zbv_on_the_mlp_at_m_4_and_more() -> None:
    def cell(v: float) -> dict[str, Any]:
        return {"samples_per_s": 1.0, "achieved_over_physical": v, "achieved_bubble": 0.2, "simulated_bubble": 0.1,
                "cores": 1.9}

    result = zb_result({4: {}, 8: {}})
    for r, v in zip(result["zero_bubble"][0]["rows"], (0.95, 0.91)):
        r["contestants"] = {"zbv": cell(v), "1f1b": cell(0.8)}
    t = zb.physical_target(result)
    assert t["met"] is True and t["cells"]["zbv"] == {"m=4": 0.95, "m=8": 0.91}
    assert "bubble simulated 0.10, achieved 0.20; cores busy 1.90" in t["detail"] and "1F1B 0.80-0.80" in t["detail"]
    result["zero_bubble"][0]["rows"][1]["contestants"]["zbv"]["achieved_over_physical"] = 0.89
    assert zb.physical_target(result)["met"] is False
    result["zero_bubble"][0]["name"] = "transformer"
    assert zb.physical_target(result)["met"] is None


def test_split_backward_target_reads_every_stage() -> None:
    per = [{"split_over_fused": 1.02}, {"split_over_fused": 1.08}]
    result = {"zero_bubble": [{"name": "mlp", "rows": [], "split_backward": {"v": {"4": per}}}]}
    t = zb.split_backward_target(result)
    assert t["met"] is True and t["stats"]["cells"] == 2 and "2/2 stages within" in t["detail"]
    per[1]["split_over_fused"] = 1.2
    t = zb.split_backward_target(result)
    assert t["met"] is False and "mlp v m=4 stage 1 1.20" in t["detail"]
    assert zb.split_backward_target({"zero_bubble": []})["met"] is None


def test_zero_bubble_options() -> None:
    args = parse_args(["--zero-bubble-only"])
    assert (args.models, args.il_models, args.memory_models) == ([], [], [])
    assert args.zb_models == ["mlp", "resnet", "transformer"] and args.zb_chunks == [4, 8, 16]
    assert args.zb_contestants == list(zb.DEFAULT_CONTESTANTS) and "izb1" not in args.zb_contestants
    quick = parse_args(["--quick"])
    assert (quick.zb_models, quick.zb_chunks, quick.models) == (["tiny"], [4], ["tiny"])
    assert parse_args(["--zb-contestants", "izb1", "zbv", "1f1b"]).zb_contestants == ["1f1b", "zbv", "izb1"]
    for bad in (["--zb-chunks", "2"], ["--zb-chunks", "6", "7"], ["--zb-models", "transformer", "--zb-chunks", "64"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
