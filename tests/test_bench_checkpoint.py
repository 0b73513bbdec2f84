"""benchmarks/bench_checkpoint.py: a smoke run on a 4 MiB model (2 stages, 1 repeat, both ways verified)
prints every phase's row and writes the JSON the report and the targets read, with sane values: each way's
build, save and load gave the state expected (checked by the benchmark itself), the checkpoints hold the
model's bytes (3x with AdamW's state), the new path's driver grows by a small fraction of what the old
path's does. Timing targets are not asserted: a smoke run on a shared machine says nothing about them."""
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

from bench_checkpoint import PHASES, WAYS, balance, digest  # noqa: E402  (a script, not a package)


@pytest.mark.timeout(120)  # ~10 s on a quiet 2-core machine; the margin is for a busy one
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="local stage workers and /proc")
def test_smoke_run_verifies_and_writes_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "checkpoint.json"
    run = subprocess.run([sys.executable, "bench_checkpoint.py", "--layers", "4", "--width", "512", "--stages", "2",
                          "--repeats", "1", "--verify", "both", "--dir", str(tmp_path / "scratch"), "--out", str(out)],
                         cwd=BENCHMARKS, capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stderr[-3000:]
    for label in ("build", "save", "load", "save+opt", "load+opt"):
        for way in WAYS:
            assert f"  {label:<8} {way:<3} |" in run.stdout, (label, way)
    assert "time new/old" in run.stdout and "targets (issue checkpoints)" in run.stdout

    result = json.loads(out.read_text())
    model = result["model"]
    assert model["bytes"] == 4 * (512 * 512 + 512) * 4 and model["shards"] >= 1
    assert result["verified"] is True
    (block,) = result["stages"]
    assert block["stages"] == 2 and block["balance"] == [2, 2] and block["workers"] == ["worker1", "worker2"]
    assert [r["way"] for r in block["rows"]] == ["old", "new"]  # repeat 0: the old way first
    for row in block["rows"]:
        assert row["verified"] is True and set(row["checks"]) == {
            "build", "the step between save and load changed the weights", "load", "load_opt"}
        assert set(row["phases"]) == set(PHASES)
        for name, phase in row["phases"].items():
            assert phase["s"] > 0, name
            assert set(phase["memory"]) == {"driver", "worker1", "worker2"}
            for mem in phase["memory"].values():
                assert mem["peak"] >= mem["start"] > 0 and mem["growth"] == mem["peak"] - mem["start"]
        sizes = row["checkpoint_bytes"]  # the weights, then with AdamW's exp_avg and exp_avg_sq: about 3x
        assert model["bytes"] <= sizes["save"] < 1.5 * model["bytes"]
        assert 3 * model["bytes"] <= sizes["save_opt"] < 3.5 * model["bytes"]

    cells = block["cells"]
    assert set(cells) == {f"{w}/{p}" for w in WAYS for p in PHASES}
    for cell in cells.values():
        assert cell["s"]["n"] == 1 and cell["s"]["median"] > 0
        assert math.isfinite(cell["driver_growth_over_model"]["median"])
    # The old build makes the model on the driver and pickles it: at least the model's bytes. The new
    # path's driver holds none of it (a few MiB of noise allowed at this size).
    assert cells["old/build"]["driver_growth"]["median"] >= model["bytes"]
    for phase in ("build", "save", "load"):
        assert cells[f"new/{phase}"]["driver_growth"]["median"] < cells["old/build"]["driver_growth"]["median"]
    assert set(block["ratios"]) == set(PHASES)
    assert all(r["time_new_over_old"] > 0 for r in block["ratios"].values())

    kinds = [t["target"] for t in result["targets"]]
    assert len(kinds) == 4 and kinds[-1].startswith("verified") and result["targets"][-1]["met"] is True
    # --dir given: the shards stay there; every checkpoint and the warm-up's files are deleted
    assert sorted(p.name for p in (tmp_path / "scratch").iterdir()) == ["shards"]


def test_balance_and_digest() -> None:
    assert balance(16, 4) == [4, 4, 4, 4] and balance(5, 2) == [3, 2]
    import torch

    w = torch.arange(6.0).reshape(2, 3)
    a: dict[str, Any] = {"w": w, "opt": {"step": torch.tensor(1.0), "lr": 0.1}}
    b: dict[str, Any] = {"w": w.clone(), "opt": {"step": torch.tensor(1.0), "lr": 0.1}}
    assert digest(a) == digest(b)
    b["w"][1, 2] += 1e-6
    assert digest(a) != digest(b)
    assert digest(a) != digest({**a, "w": w.reshape(3, 2)})  # same bytes, other shape
    assert digest(a) != digest({**a, "opt": {"step": torch.tensor(2.0), "lr": 0.1}})  # nested
