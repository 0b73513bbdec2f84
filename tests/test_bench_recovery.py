"""benchmarks/bench_recovery.py (issue 52): the --quick smoke run (2 stages, a recovery trial with one kill, a
12-step soak with one kill) prints every table and writes the JSON the report and the targets read, with
sane values: each kill was recovered from once, replaying what the kill left, and the soak ends on the
plain-PyTorch run's weights (``exact``). Timing targets are not asserted: a smoke run on a shared machine
says nothing about them."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.conftest import WarmPython

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from bench_recovery import BASE, CONTROL, balance, flatness, kill_plan, window_of  # noqa: E402  (a script)


@pytest.mark.timeout(120)  # ~10-20 s on a quiet 2-core machine (5 workers start); the margin is for a busy one
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="local stage workers, SIGKILL and /proc")
def test_quick_run_recovers_exactly_and_writes_every_row(tmp_path: Path, warm_python: WarmPython) -> None:
    out = tmp_path / "recovery.json"
    run = warm_python.run(["bench_recovery.py", "--quick", "--out", str(out)], cwd=BENCHMARKS, timeout=110)
    assert run.returncode == 0, run.stderr[-3000:]
    for heading in ("Steady state:", "Time to recover", "Soak:", "VmRSS MiB", "targets (issue 52)"):
        assert heading in run.stdout, heading
    result = json.loads(out.read_text())
    assert result["settings"]["quick"] is True
    assert len(result["workers"]["names"]) == 5 and len(result["killed"]) == 2  # 2 stages + 3 spares; 2 kills

    steady = result["steady"]
    assert set(steady["pipes"]) == {BASE, CONTROL, "k1", "k2", "k4"}
    assert set(steady["ratios"]) == set(steady["pipes"]) - {BASE}
    for key, row in steady["pipes"].items():
        assert row["step_s"]["n"] == 1 and row["step_s"]["median"] > 0, key
        assert row["window"] % (row["snapshot_every"] or 1) == 0
        if row["snapshot_every"] is not None:  # the holder keeps every stage's state: weights and AdamW's 2x
            snap = row["snapshot"]
            assert snap["count"] >= 2 and snap["seconds"]["median"] > 0 and snap["bytes_over_weights"] > 3
    assert all(math.isfinite(r["pooled"]) and r["pooled"] > 0 for r in steady["ratios"].values())

    (trial,) = result["recovery"]["trials"]
    assert trial["scenario"] == "k-1" and trial["recoveries"] == 1 and trial["recover_calls"] == 1
    record = trial["record"]
    assert record["worker"] == trial["victim"] == "worker2" and record["spare"] == trial["spare"] == "worker3"
    assert record["stages"] == [1] and record["replayed"] == trial["replay_batches"] == 1  # k - 1, k = 2
    assert record["restored_update"] == 2 and record["failed_update"] == 3  # killed after 2k - 1 updates
    parts = ("surface_s", "ping_s", "rebuild_s", "resnapshot_s", "replay_s", "retry_s")
    assert all(trial[p] >= 0 for p in parts)
    assert sum(trial[p] for p in parts) == pytest.approx(trial["kill_to_step_s"], rel=1e-6)
    assert 0 < record["seconds"] <= trial["kill_to_step_s"] and trial["steps_after"] == 3

    soak = result["soak"]
    assert soak["steps"] == 12 and soak["plan"] == [6] and len(soak["losses"]) == 12
    assert soak["exact"] is True and soak["max_weight_diff"] <= 1e-6 and soak["recoveries"] == 1
    (kill,) = soak["kills"]
    assert kill["record"]["replayed"] == kill["expected_replayed"] == 0 and kill["record"]["worker"] == kill["victim"]
    assert kill["resnapshot_s"] > 0  # a second spare was left: the recovery took a snapshot on it
    assert [s["what"] for s in soak["samples"]] == ["warm", "kill 1", "end"]
    # the driver, 2 stage workers, the holder and a spare; at the end the spare holds the snapshots
    assert [len(s["processes"]) for s in soak["samples"]] == [5, 5, 4]
    assert all(p["rss"] > 0 for s in soak["samples"] for p in s["processes"].values())
    assert soak["rss"]["flat"] in (True, False) and soak["rss"]["segments"]

    names = [t["target"].split(":")[0] for t in result["targets"]]
    assert names == ["steady state", "time to recover", "soak", "soak"]
    assert result["targets"][2]["met"] is True  # exact, one recovery per kill


def test_kill_plan_windows_and_balance() -> None:
    assert kill_plan(400, 100) == [100, 199, 300] and kill_plan(2000, 200)[-1] == 1800
    assert len(kill_plan(2000, 200)) == 9 and kill_plan(12, 6) == [6]
    assert [window_of(k, 20) for k in (None, 1, 10, 50, 3)] == [20, 20, 20, 50, 21]
    assert balance(8, 4) == [4, 4, 4, 4] and balance(5, 2) == [6, 4]


def test_flatness_per_role() -> None:
    mib = 2**20

    def s(update: int, **procs: tuple[str, int]) -> dict[str, object]:
        return {"update": update, "processes": {n: {"role": r, "rss": v * mib} for n, (r, v) in procs.items()}}

    samples = [s(1, driver=("driver", 300), w3=("spare", 290)), s(2, driver=("driver", 310), w3=("stage 1", 320)),
               s(3, driver=("driver", 312), w3=("stage 1", 321))]
    got = flatness(samples, 16 * mib)  # w3's role changed: only its samples as a stage are compared
    assert got["flat"] is True and {(r["process"], r["role"]) for r in got["segments"]} == {
        ("driver", "driver"), ("w3", "stage 1")}
    samples.append(s(4, driver=("driver", 400)))
    assert flatness(samples, 16 * mib)["flat"] is False
