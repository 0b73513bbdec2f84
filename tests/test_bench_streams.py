"""benchmarks/bench_streams.py (issue 50): the --quick smoke run writes every row the report and targets
read, with every ratio finite and positive; the simulated ceilings are the design note's. Timing
targets are not asserted: a smoke run on a shared machine says nothing about them."""
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

from bench_streams import INFER, MEMORY, RATIOS, TRAIN, gm_se, simulated  # noqa: E402  (a script, not a package)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="local stage workers and /proc")
def test_quick_run_writes_every_row(tmp_path: Path, warm_python: WarmPython) -> None:
    out = tmp_path / "streams.json"
    run = warm_python.run(["bench_streams.py", "--quick", "--out", str(out)], cwd=BENCHMARKS, timeout=110)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "targets (issue 50)" in run.stdout and "Weight memory per stage" in run.stdout
    result = json.loads(out.read_text())
    assert result["settings"]["quick"] is True

    (cell,) = result["cells"]
    assert cell["chunks"] == 4 and cell["in_flight"] == 3  # ceil((2 - 1) / 4) + 2
    assert set(cell["contestants"]) == {*TRAIN, *INFER}
    for key, row in cell["contestants"].items():
        assert "error" not in row, (key, row.get("error"))
        assert row["batches"] == 4 and row["batches_per_s"] > 0 and row["achieved_over_physical"] > 0
        assert row["cpu_ms_per_batch"] is not None and len(row["cpu_ms_per_batch_by_process"]) == 3
    for kind in ("train", "infer"):
        phys = cell["physical"][kind]
        assert phys["one_process"]["n"] == 2 and phys["physical_ms_per_batch"] == pytest.approx(
            phys["one_process"]["median_ms"] / 2)

    assert set(cell["ratios"]) == set(RATIOS) == set(cell["round_ratios"])
    ratios = [*cell["ratios"].values(), *(r["gm"] for r in cell["round_ratios"].values())]
    for sim in result["simulated"].values():
        ratios += [v for rule in sim["train"].values() for v in rule.values()] + list(sim["infer"].values())
    assert all(math.isfinite(v) and v > 0 for v in ratios), ratios

    assert [(r["key"], r["rollback"]) for r in result["memory"]] == [(k, b) for k in MEMORY for b in (True, False)]
    for row in result["memory"]:
        assert "error" not in row, row.get("error")
        assert [s["stage"] for s in row["stages"]] == [0, 1]
        for s in row["stages"]:  # the probe saw the stage's updates and weights
            assert s["samples"] > 0 and s["weight_bytes"] > 0
            assert 1 <= s["steady_buffers"] <= s["undo_buffers"] <= s["peak_buffers"]
            assert math.isfinite(s["peak_buffers"])
            if not row["rollback"]:  # no undo records: nothing beyond the versions
                assert s["undo_buffers"] == s["steady_buffers"]
    for row in result["memory"]:
        if row["key"] == "pipemare":  # no stash: the live weights only
            assert [s["steady_buffers"] for s in row["stages"]] == [1.0, 1.0]

    kinds = [t["target"].split(":")[0] for t in result["targets"]]
    assert kinds[:2] == ["speed", "speed"] and len(kinds) == 6
    assert all(t["met"] in (True, False, None) for t in result["targets"])


def test_simulated_ceilings_are_the_design_notes() -> None:
    # notes/issue-50-design.md, section 2: n = 2, F = 1, B = 2, 40 batches: 1.242 (m = 4), 1.121 (m = 8)
    for m, ceiling in ((4, 1.242), (8, 1.121)):
        sim = simulated([{"forward_ms": 1.0, "backward_ms": 2.0}] * 2, m, 40)
        for rule in ("2bw", "pipedream", "pipemare"):
            assert sim["train"][rule]["over_1f1b"] == pytest.approx(ceiling, abs=1e-3)
        assert sim["train"]["2bw"]["over_physical"] == pytest.approx(40 * m * 2 * 3 / (2 * sim_span(m)), rel=1e-9)
        # forward only: a pipe(x) takes m + 1 forward ticks, the stream about m per batch
        assert sim["infer"]["stream_over_loop"] == pytest.approx(40 * (m + 1) / (40 * m + 1))


def sim_span(m: int) -> float:
    from rrefpipe.schedule import simulate, stream_orders

    return simulate(stream_orders("PipeDream-2BW", 2, m, 40), {"F": 1.0, "B": 2.0}).makespan


def test_geometric_mean_and_standard_error() -> None:
    s: dict[str, Any] = gm_se([1.1, 1.0 / 1.1, 1.0])
    assert s["gm"] == pytest.approx(1.0) and s["se"] == pytest.approx(math.log(1.1) / math.sqrt(3))
    assert gm_se([2.0])["se"] is None
