"""benchmarks/bench_any_model.py (issue 43): its --quick smoke run writes every cell the report reads, and
the hand-made stages it times against the captured model compute what the model computes. Timings are not
asserted: a smoke run on a shared machine says nothing about them."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import WarmPython
from tests.test_bench_schedules import quick_run  # (puts benchmarks/ on sys.path)

from bench_any_model import CONTESTANTS, REF, Config, handmade  # noqa: E402  (the benchmarks are scripts)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="local stage workers and /proc")
def test_quick_run_writes_every_cell(tmp_path: Path, warm_python: WarmPython) -> None:
    # --stages 2: one stage worker and one pipelining rank fewer than --quick's 3-stage cell (~8 CPU-s); the
    # tied head still spans the first and the last stage
    run, result = quick_run(warm_python, "bench_any_model.py", tmp_path, 110, "--stages", "2")
    assert [(c["stages"], c["chunks"]) for c in result["cells"]] == [(2, 4)]  # the 2-stage cell alone
    assert [c["split_points"] for c in result["cells"]] == [["blocks.1"]]
    for cell in result["cells"]:
        assert cell["errors"] == {}
        assert set(cell["contestants"]) == set(CONTESTANTS)
        for step in cell["contestants"].values():
            assert step["n"] == 2 and min(step["samples_ms"]) > 0
        assert set(cell["ratios"]) == set(CONTESTANTS) - {REF}
        for r in cell["ratios"].values():  # 2 rounds: a standard error
            assert r["median"] > 0 and r["rounds"]["cells"] == 2 and r["rounds"]["se"] is not None
    assert set(result["summary"]) == set(CONTESTANTS) - {REF}
    (target,) = result["targets"]
    assert target["met"] in (True, False) and "captured / hand-made" in target["target"]
    for header in ("capt/hand", "pp1F1B/hand", "A/A/hand", "tied/hand", "targets (issue 43)"):
        assert header in run.stdout, header
    assert run.stdout.count("\n   2   4 |") == 1 and "\n   3   4 |" not in run.stdout  # one table row a cell


@pytest.mark.parametrize("n", [2, 3])
def test_handmade_stages_compute_the_model(n: int) -> None:
    """The reference computes what the captured model does: the same outputs and gradients, and the
    balance cuts where the split points do (stage 0 embeds, the last stage holds the head)."""
    cfg = Config(vocab=32, d=16, heads=2, layers=6, context=8, batch=4)
    model, (x, y) = cfg.build(), cfg.data()
    seq, balance = handmade(model, cfg.split_points(n))
    assert balance == {2: [4, 4], 3: [3, 2, 3]}[n]
    assert model.head.weight is not model.tok.weight  # untied, as hand-made stages must be
    torch.testing.assert_close(seq(x), model(x))
    reference = cfg.build()
    for net in (seq, reference):
        torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
