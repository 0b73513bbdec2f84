"""``python -m rrefpipe timeline --schedule``: the steps drawn are ``pipe.train_step`` calls, and each worker's
spans come in its schedule's order (``rrefpipe.schedule.worker_orders``). ``python -m rrefpipe schedule``: that
order printed as a table, with its bubble and in-flight peaks, without processes; for a continuous schedule, the
stream's orders (``rrefpipe.schedule.stream_orders``) with each batch's weight versions."""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from rrefpipe.__main__ import main, parser
from rrefpipe.schedule import (Action, format_orders, peak_in_flight, simulate, stream_orders, worker_orders,
                               worker_peaks)
from tests.conftest import ROOT, warm


def _run(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    """``python -m rrefpipe timeline ARGS``, forked from the warm interpreter."""
    return warm().run(["-m", "rrefpipe", "timeline", *args], timeout=timeout)


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


def test_the_timeline_refuses_a_continuous_schedule_and_says_where_its_stream_is(capsys):
    """One train_step of PipeDream is 1F1B: a timeline of it under that name would mislead."""
    with pytest.raises(SystemExit):
        parser().parse_args(["timeline", "--schedule", "pipedream-2bw"])
    err = capsys.readouterr().err
    assert "schedule must be one of GPipe, 1F1B, Interleaved1F1B" in err
    assert "PipeDream-2BW is a continuous schedule, whose stream `python -m rrefpipe schedule --schedule " \
           "PipeDream-2BW` prints" in err


@pytest.mark.parametrize("flags, message", [
    (["--schedule", "Interleaved1F1B", "--stages", "3", "--chunks", "4"], "chunks must be a multiple of 3"),
    (["--schedule", "1F1B", "--stages", "4", "--stages-per-worker", "2"],
     "schedule='Interleaved1F1B' or 'InterleavedZeroBubble'"),
    (["--stages-per-worker", "2", "--stages", "4"],
     "--stages-per-worker 2 needs --schedule Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV"),
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


# python -m rrefpipe schedule: the orders as a table, in process (it starts no workers)

def _schedule(capsys, *flags: str) -> str:
    main(["schedule", *flags])
    return capsys.readouterr().out


def test_schedule_command_prints_the_zbv_table_with_split_backwards(capsys):
    out = _schedule(capsys, "--schedule", "zbvzerobubble", "--stages", "4", "--stages-per-worker", "2", "--chunks", "8",
                    "--costs", "F=1,I=1,W=1,B=2")
    orders = worker_orders("ZBVZeroBubble", 4, 8, 2)
    lines = out.splitlines()
    assert lines[0] == ("ZBVZeroBubble: 4 stages on 2 workers in a V, 8 micro-batches (worker 0: stages 0, 3; "
                        "worker 1: stages 1, 2)")
    assert "\n".join(lines[1:4]) == format_orders(orders)
    assert {"3I0", "3W0", "0I7", "0W7"} <= set(lines[2].split()) and "2I0" in lines[3].split()
    sim = simulate(orders)
    assert lines[4] == f"at unit costs: {sim.makespan:g} ticks, bubble {sim.bubble:.1%}" == \
        "at unit costs: 49 ticks, bubble 2.0%"  # p - 1 = 1 idle tick per worker of 49
    assert lines[5].startswith("at costs F=1, B=2, I=1, W=1: 49 ticks")
    assert lines[6] == (f"micro-batches in flight at most, per stage: {peak_in_flight(orders, 4)}; per worker (all its "
                        f"stages): {worker_peaks(orders, 4)}")
    assert worker_peaks(orders, 4) == [4, 4]


@pytest.mark.parametrize("name, stages, v", [("GPipe", 3, 1), ("1F1B", 4, 1), ("Interleaved1F1B", 4, 2),
                                             ("InterleavedZeroBubble", 4, 1), ("InterleavedZeroBubble", 6, 3),
                                             ("DualPipeV", 6, 2)])
def test_schedule_command_prints_each_schedules_orders(capsys, name, stages, v):
    out = _schedule(capsys, "--schedule", name, "--stages", str(stages), "--stages-per-worker", str(v))
    assert format_orders(worker_orders(name, stages, 8, v)) in out
    assert out.startswith(f"{name}: {stages} stages on {stages // v} workers")


def test_schedule_command_compares_a_fused_backward_weighed_as_its_halves(capsys):
    out = _schedule(capsys, "--schedule", "1F1B", "--stages", "4", "--chunks", "8", "--costs", "B=2")
    assert "at unit costs: 22 ticks, bubble 27.3%" in out  # 2 (m + n - 1); (n - 1) / (m + n - 1)
    assert "at costs F=1, B=2, I=1, W=1: 33 ticks, bubble 27.3%" in out  # 3 (m + n - 1)
    zb = _schedule(capsys, "--schedule", "InterleavedZeroBubble", "--stages", "4", "--chunks", "8")
    assert "at unit costs: 30 ticks, bubble 20.0%" in zb  # 3m + 2 (p - 1): ZB-H1 on 1F1B's memory
    assert "per stage: [4, 3, 2, 1]" in zb


@pytest.mark.parametrize("flags, message", [
    (["--schedule", "ZBVZeroBubble", "--stages", "4"], "use stages_per_worker=2, got 1"),
    (["--schedule", "DualPipeV", "--stages", "8", "--stages-per-worker", "2", "--chunks", "6"],
     "too few micro-batches for DualPipeV: chunks >= 8"),
    (["--schedule", "ZBVZeroBubble", "--stages", "3", "--stages-per-worker", "2"], "use stages=4 or 2"),
])
def test_schedule_command_says_what_to_change(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        main(["schedule", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("python -m rrefpipe schedule: ") and message in err


@pytest.mark.parametrize("costs", ["X=2", "F=0", "F", "U=-1"])
def test_schedule_command_refuses_costs_it_cannot_use(capsys, costs):
    with pytest.raises(SystemExit):
        main(["schedule", "--costs", costs])
    assert "costs are" in capsys.readouterr().err


def test_schedule_command_help_explains_every_flag_with_its_default():
    schedule = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["schedule"]
    options = [a for a in schedule._actions if a.option_strings and a.dest != "help"]
    assert [a.dest for a in options] == ["schedule", "stages", "chunks", "stages_per_worker", "costs", "batches",
                                         "vertical_sync"]
    assert all(a.help and "default" in a.help for a in options)
    assert "ZBVZeroBubble --stages 4 --stages-per-worker 2 --chunks 8" in schedule.epilog
    assert "PipeDream-2BW --stages 3 --chunks 2 --batches 4" in schedule.epilog


# python -m rrefpipe schedule under a continuous schedule: the stream, the versions, the buffers

def test_schedule_command_prints_a_2bw_stream_with_its_versions_and_buffers(capsys):
    out = _schedule(capsys, "--schedule", "pipedream-2bw", "--stages", "3", "--chunks", "2", "--batches", "4")
    orders = stream_orders("PipeDream-2BW", 3, 2, 4)
    lines = out.splitlines()
    assert lines[0] == "PipeDream-2BW: 3 stages on 3 workers, 4 batches of 2 micro-batches"
    assert "\n".join(lines[1:5]) == format_orders(orders)
    assert lines[2].split()[2:10] == ["F0.0", "F0.1", "F1.0", ".", ".", "B0.0", "F1.1", "B0.1+U0"]
    assert lines[5:] == [
        "at unit costs: 20 ticks, bubble 20.0%",  # 16 ticks of work per worker, 2 (n - 1) to fill and drain
        "4 flushed 1F1B steps take 32 ticks: the stream is 1.600x as fast",  # 4 x 2 (m + n - 1)
        "micro-batches in flight at most, per stage: [3, 2, 1]",
        "weight versions (updates applied) each batch's forwards and backwards use, batches 0 to 3:",
        "  stage 0: 0 0 1 2 (2 weight buffers)",
        "  stage 1: 0 0 1 2 (2 weight buffers)",
        "  stage 2: 0 0 1 2 (2 weight buffers)"]


def test_schedule_command_prints_pipedream_pipemare_and_2bw_waiting_for_versions(capsys):
    out = _schedule(capsys, "--schedule", "PipeDream", "--stages", "4", "--chunks", "1", "--batches", "6",
                    "--costs", "F=1,B=2")
    assert "at costs F=1, B=2, U=0: 27 ticks" in out and "take 72 ticks at these costs" in out
    assert "  stage 0: 0 0 0 0 1 2 (4 weight buffers)\n  stage 1: 0 0 0 1 2 3 (3 weight buffers)" in out
    assert "  stage 3: 0 1 2 3 4 5 (1 weight buffer)" in out
    synced = _schedule(capsys, "--schedule", "PipeDream", "--stages", "4", "--chunks", "1", "--vertical-sync")
    assert synced.startswith("PipeDream: 4 stages on 4 workers, 4 batches of 1 micro-batch, vertical sync")
    assert "  stage 3: 0 0 0 0 (4 weight buffers)" in synced
    mare = _schedule(capsys, "--schedule", "PipeMare", "--stages", "3", "--chunks", "4", "--batches", "3")
    assert "every backward of batch t sees t:\n  stage 0: 0,0,0,0 0,0,1,1 1,1,2,2 (1 weight buffer)" in mare
    slow = _schedule(capsys, "--schedule", "PipeDream-2BW", "--stages", "4", "--chunks", "1")
    assert slow.rstrip().endswith("a first forward waits for its version (batch t needs U(t - 2)) on stages 0, 1: "
                                  "use chunks >= 3 to stream at full speed")
    assert "waits for its version" not in _schedule(capsys, "--schedule", "PipeDream-2BW", "--stages", "4",
                                                    "--chunks", "3")


@pytest.mark.parametrize("flags, message", [
    (["--schedule", "1F1B", "--batches", "4"], "--batches and --vertical-sync are for the continuous schedules "
                                               "(PipeDream, PipeDream-2BW, PipeMare): 1F1B drains the pipeline"),
    (["--schedule", "GPipe", "--vertical-sync"], "--batches and --vertical-sync are for the continuous schedules"),
    (["--schedule", "PipeMare", "--vertical-sync"], "vertical_sync=True goes with schedule='PipeDream' only"),
    (["--schedule", "PipeDream", "--stages", "4", "--stages-per-worker", "2"],
     "PipeDream runs exactly one stage per worker"),
    (["--schedule", "PipeDream", "--batches", "0"], "--batches must be at least 1, got 0"),
])
def test_schedule_command_says_what_a_stream_needs(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        main(["schedule", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("python -m rrefpipe schedule: ") and message in err
