"""The benchmark suite's bounds on achieved/ideal: fewer cores than stages, stages slower beside each other."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from suite_targets import (  # noqa: E402  (the benchmarks are scripts, not a package)
    contended_bubble, core_bound, margin_to_clear, round_ratios, vs_pipelining, work_ratio)


def section(forward_ms: list[float], backward_ms: list[float], chunks: int) -> dict[str, object]:
    return {"stage_compute_per_microbatch": {
        str(chunks): [{"forward_ms": f, "backward_ms": b} for f, b in zip(forward_ms, backward_ms)]}}


def test_a_core_per_stage_is_no_limit() -> None:
    # Bubble model (8 + 1) * 3 ms = 27 ms; the work, 2 * 8 * 3 ms, on 2 cores: 24 ms.
    assert core_bound(section([1.0, 1.0], [2.0, 2.0], 8), 8, "never", cores=2) == pytest.approx(27 / 24)


def test_three_equal_stages_on_two_cores() -> None:
    # Bubble model: (32 + 2) * 3 ms = 102 ms; the work, 3 stages * 32 * 3 ms, on 2 cores takes 144 ms.
    assert core_bound(section([1.0] * 3, [2.0] * 3, 32), 32, "never", cores=2) == pytest.approx(102 / 144)


def test_recomputation_counts_as_work() -> None:
    # 'always' recomputes all 32 forwards: tick 4 ms, bubble model 136 ms; work 3 * 32 * 4 / 2 = 192 ms.
    assert core_bound(section([1.0] * 3, [2.0] * 3, 32), 32, "always", cores=2) == pytest.approx(136 / 192)
    # 'except_last' recomputes 31: tick 3 + 31/32 ms.
    tick = 3 + 31 / 32
    assert core_bound(section([1.0] * 3, [2.0] * 3, 32), 32, "except_last", cores=2) == pytest.approx(
        34 * tick / (3 * (32 * 3 + 31) / 2))


def test_unbalanced_stages_fit_on_fewer_cores() -> None:
    # The slow stage sets the bubble model's pace, (16 + 2) * 9 ms; the work, 16 * 12 ms, on 2 cores: 96 ms.
    assert core_bound(section([3.0, 0.5, 0.5], [6.0, 1.0, 1.0], 16), 16, "never", cores=2) == pytest.approx(162 / 96)


def test_missing_measurement() -> None:
    assert core_bound(section([1.0], [2.0], 8), 16, "never", cores=2) is None
    assert core_bound(section([1.0], [2.0], 8), 8, "never", cores=0) is None


def test_work_ratio_adds_one_forward_per_stage() -> None:
    # Stage work per micro-batch 1 + 2 and 2 + 3 ms, 8 ms in all; recomputed, 3 ms more.
    assert work_ratio(section([1.0, 2.0], [2.0, 3.0], 4), 4) == pytest.approx(11 / 8)
    assert work_ratio(section([1.0], [2.0], 4), 8) is None


def contended(section_: dict[str, object], chunks: int, factors: list[float]) -> dict[str, object]:
    return {**section_, "contention": {str(chunks): [{"beside_over_alone": f} for f in factors]}}


def test_contended_bubble_model() -> None:
    # Ticks alone 3 and 2 ms; beside each other 1.2 * 3 and 1.5 * 2 ms: the slower, 3.6 ms, paces the 7
    # steady ticks, the fill and drain cost 2 ticks alone. Bubble model alone: 9 * 3 ms.
    sec = contended(section([1.0, 1.0], [2.0, 1.0], 8), 8, [1.2, 1.5])
    assert contended_bubble(sec, 8, "never") == pytest.approx(27 / (7 * 3.6 + 2 * 3))
    # 'always' recomputes every forward: ticks 4 and 3 ms.
    assert contended_bubble(sec, 8, "always") == pytest.approx(9 * 4 / (7 * 4.8 + 2 * 4))


def test_no_contention_is_the_bubble_model() -> None:
    sec = contended(section([1.0, 1.0], [2.0, 2.0], 16), 16, [1.0, 1.0])
    assert contended_bubble(sec, 16, "except_last") == pytest.approx(1.0)


def test_contention_not_measured() -> None:
    assert contended_bubble(section([1.0, 1.0], [2.0, 2.0], 8), 8, "never") is None
    assert contended_bubble(contended(section([1.0, 1.0], [2.0, 2.0], 8), 16, [1.1, 1.1]), 8, "never") is None


def cell(chunks: int, rr_rounds_ms: list[float], gp_rounds_ms: list[float]) -> dict[str, object]:
    def row(rounds_ms: list[float]) -> dict[str, object]:
        return {"samples_per_s": 1e3 / sorted(rounds_ms)[len(rounds_ms) // 2], "round_medians_ms": rounds_ms}
    return {"chunks": chunks, "contestants": {"never": row(rr_rounds_ms), "gpipe": row(gp_rounds_ms)}}


def test_cells_behind_in_every_round() -> None:
    # m=4: behind in all three rounds; m=8: behind pooled, ahead in one round; m=16: ahead; m=2: above 0.9.
    result = {"sections": [{"name": "mlp", "stages": 2, "rows": [
        cell(2, [105.0, 105.0, 105.0], [100.0, 100.0, 100.0]),
        cell(4, [110.0, 104.0, 120.0], [100.0, 100.0, 100.0]),
        cell(8, [110.0, 95.0, 110.0], [100.0, 100.0, 100.0]),
        cell(16, [90.0, 90.0, 90.0], [100.0, 100.0, 100.0])]}]}
    target = vs_pipelining(result)
    assert target["met"] is False
    assert "m>=4: 1/3 at >= 1.0" in target["detail"]
    assert "of the 2 below the bar, under it in each of the 3 rounds: mlp 2st m=4 0.91/0.96/0.83" in target["detail"]
    assert "m=8" not in target["detail"].split("rounds:")[1]


def test_the_control_is_counted_like_rrefpipe() -> None:
    # GPipe's second group: level at m=4 (not below the bar), behind in every round at m=8, ahead at m=16.
    result = {"sections": [{"name": "resnet", "stages": 3, "rows": [
        cell(4, [100.0, 100.0], [100.0, 100.0]),
        cell(8, [100.0, 100.0], [100.0, 100.0]),
        cell(16, [100.0, 100.0], [100.0, 100.0])]}]}
    control = {4: [100.0, 100.0], 8: [104.0, 102.0], 16: [97.0, 99.0]}
    for row in result["sections"][0]["rows"]:
        rounds_ms = control[row["chunks"]]
        row["contestants"]["gpipe_control"] = {"samples_per_s": 1e3 / sorted(rounds_ms)[1],
                                               "round_medians_ms": rounds_ms}
    target = vs_pipelining(result)
    assert target["met"] is True  # the control never decides the verdict
    rrefpipe, control_text, scatter = target["detail"].split(" | ")
    assert rrefpipe.startswith("m>=4: 3/3 at >= 1.0")
    assert control_text.startswith("A/A control, GPipe against itself in the same rounds: m>=4: 2/3 at >= 1.0, "
                                   "worst 0.96 (resnet 3st m=8)")
    assert scatter.startswith("m>=4, geometric mean over 3 cells")
    assert control_text.endswith("of the 1 below the bar, under it in each of the 2 rounds: resnet 3st m=8 0.96/0.98")


def test_margin_to_clear_every_cell() -> None:
    import math
    from statistics import NormalDist

    # One cell at even odds needs no lead; no scatter needs none either.
    assert margin_to_clear(0.06, 1) == pytest.approx(0.0, abs=1e-12)
    assert margin_to_clear(0.0, 24) == pytest.approx(0.0)
    # With the margin, each of 24 cells reads >= 1.0 with the probability whose 24th power is one half.
    margin = margin_to_clear(0.06, 24)
    each = NormalDist(math.log(1 + margin), 0.06).cdf(0.0)  # P(log ratio < 0) for one cell
    assert (1 - each) ** 24 == pytest.approx(0.5)
    assert margin_to_clear(0.06, 24, chance=0.9) > margin > margin_to_clear(0.03, 24)


def test_control_scatter_needs_three_cells_at_m_4_or_more() -> None:
    rows = [cell(m, [100.0], [100.0]) for m in (4, 8, 16)]
    for row, control_ms in zip(rows, (100 / 1.05, 100.0, 105.0)):  # A/A 1.05, 1.0 and 1 / 1.05
        row["contestants"]["gpipe_control"] = {"samples_per_s": 1e3 / control_ms, "round_medians_ms": [control_ms]}
    detail = vs_pipelining({"sections": [{"name": "mlp", "stages": 2, "rows": rows}]})["detail"]
    # rrefpipe level with GPipe, over a control at 1.05, 1.0, 1/1.05: log ratios -l, 0, l with l = log 1.05
    assert ("geometric mean over 3 cells: A/A 1.000, rrefpipe/GPipe 1.000, rrefpipe/A/A 1.000 +- 0.028 "
            "(standard error); A/A scatter 0.049") in detail
    assert "all 3 cells read >= 1.0 in half of the runs only for a contestant" in detail
    two = vs_pipelining({"sections": [{"name": "mlp", "stages": 2, "rows": rows[:2]}]})["detail"]
    assert "geometric mean" not in two


def test_a_control_only_run_reports_the_control() -> None:
    rows = [cell(m, [100.0], [100.0]) for m in (4, 8, 16)]
    for row, control_ms in zip(rows, (100 / 1.05, 100.0, 105.0)):
        del row["contestants"]["never"]
        row["contestants"]["gpipe_control"] = {"samples_per_s": 1e3 / control_ms, "round_medians_ms": [control_ms]}
    target = vs_pipelining({"sections": [{"name": "mlp", "stages": 2, "rows": rows}]})
    assert target["met"] is None  # rrefpipe did not run: nothing to judge
    assert target["detail"].startswith("rrefpipe not run | A/A control, GPipe against itself in the same rounds: "
                                       "m>=4: 2/3 at >= 1.0, worst 0.95 (mlp 2st m=16)")
    assert "geometric mean over 3 cells: A/A 1.000; A/A scatter 0.049" in target["detail"]


def test_no_control_no_control_text() -> None:
    result = {"sections": [{"name": "mlp", "stages": 2, "rows": [cell(4, [100.0], [100.0])]}]}
    assert "A/A" not in vs_pipelining(result)["detail"]


def test_round_ratios_pair_rounds() -> None:
    rr = {"round_medians_ms": [100.0, 200.0]}
    assert round_ratios(rr, {"round_medians_ms": [110.0, 100.0]}) == pytest.approx([1.1, 0.5])
    assert round_ratios({}, {"round_medians_ms": [1.0]}) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_of_transport_threads_is_counted_apart() -> None:
    """A thread named as TensorPipe names its loop counts as transport; another does not. Both stay
    alive until the second reading: /proc lists only live threads (as a worker's loops are)."""
    import ctypes
    import os
    import threading
    import time

    from suite_record import proc_delta, proc_stat

    burnt, done = threading.Barrier(3, timeout=60), threading.Event()

    def burn(name: bytes) -> None:
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
        while time.thread_time() < 0.15:  # CPU-seconds each: /proc floors a thread's to 10 ms ticks
            pass
        burnt.wait()
        done.wait(60)

    before = proc_stat(os.getpid())
    threads = [threading.Thread(target=burn, args=(name,)) for name in (b"TP_UV_loop", b"worker")]
    for thread in threads:
        thread.start()
    burnt.wait()
    after = proc_stat(os.getpid())
    done.set()
    for thread in threads:
        thread.join()
    delta = proc_delta([before], [after], steps=1)
    assert delta is not None
    assert 120 <= delta["transport_ms"][0] <= 220  # the first thread only (both: 300; clock ticks 10 ms apart)
    assert delta["user_ms"][0] + delta["sys_ms"][0] >= 270  # the process: both threads
