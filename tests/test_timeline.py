"""The timeline: Chrome trace JSON and PNG from an execution record, synthetic and from a real pipe."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
import torch.distributed.autograd as dist_autograd
from PIL import Image

from rrefpipe import Event, Pipe
from rrefpipe.timeline import COLORS, chrome_trace, events_from_chrome_trace, plot_timeline, write_timeline
from tests.layers import mlp

T0 = 1_700_000_000.0  # time.time()-like seconds


def gpipe_events(stages: int = 3, chunks: int = 4, ms: float = 10.0) -> list[Event]:
    """A textbook GPipe schedule: forward of micro-batch i on stage j in clock cycle i + j, then the mirror."""
    events = []
    cycles = chunks + stages - 1
    for j in range(stages):
        for i in range(chunks):
            f = T0 + (i + j) * ms / 1e3
            b = T0 + (cycles + (chunks - 1 - i) + (stages - 1 - j)) * ms / 1e3
            events.append(Event(j, f"worker{j + 1}", "forward", 0, i, f, f + ms / 1e3 * 0.9))
            events.append(Event(j, f"worker{j + 1}", "recompute", 0, i, b, b + ms / 1e3 * 0.4))
            events.append(Event(j, f"worker{j + 1}", "backward", 0, i, b, b + ms / 1e3 * 0.9))
    return events


def rgb(color: str) -> tuple[int, int, int]:
    return tuple(int(color[k:k + 2], 16) for k in (1, 3, 5))  # type: ignore[return-value]


def colour_counts(png, rows: tuple[int, ...]) -> list[dict[str, int]]:
    """Per pixel row: how many pixels have each kind's exact colour."""
    pixels = np.asarray(Image.open(png).convert("RGB"))
    return [{kind: int((pixels[y] == rgb(c)).all(axis=1).sum()) for kind, c in COLORS.items()} for y in rows]


def test_chrome_trace_has_one_complete_event_per_span():
    events = gpipe_events(stages=2, chunks=3)
    trace = chrome_trace(events)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(events) == 18
    names = {(e["pid"], e["name"]) for e in spans}
    assert {(0, "F0"), (1, "F2"), (0, "B1"), (1, "R0")} <= names
    first = min(spans, key=lambda e: e["ts"])
    assert first["ts"] == 0 and first["name"] == "F0" and first["pid"] == 0
    assert first["dur"] == pytest.approx(9000, abs=1)  # microseconds
    by_kind = {e["cat"]: e["tid"] for e in spans}
    assert len(set(by_kind.values())) == 3  # one track per kind
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert [m["args"]["name"] for m in meta] == ["stage 0 (worker1)", "stage 1 (worker2)"]
    back = events_from_chrome_trace(json.loads(json.dumps(trace)))  # the round trip, to redraw a saved trace
    key = lambda e: (e.stage, e.kind, e.microbatch)  # noqa: E731
    for a, b in zip(sorted(back, key=key), sorted(events, key=key), strict=True):
        assert (a.stage, a.worker, a.kind, a.step, a.microbatch) == (b.stage, b.worker, b.kind, b.step, b.microbatch)
        assert a.start == b.start and a.end == pytest.approx(b.end, abs=1e-6)


@pytest.mark.parametrize("stages", [1, 3, 5])
def test_png_has_one_row_per_stage_with_its_boxes(tmp_path, stages):
    events = gpipe_events(stages=stages, chunks=4)
    plot = plot_timeline(events, tmp_path / "t.png")
    image = Image.open(plot.path)
    assert image.size == (plot.width, plot.height) == (1200, round((1.2 + 0.55 * stages) * 100))
    assert len(plot.rows) == stages and plot.rows[0].startswith("stage 0 (worker1)")
    assert list(plot.row_centers) == sorted(plot.row_centers)  # stage 0 on top
    counts = colour_counts(plot.path, plot.row_centers)
    for row in counts:
        assert row["forward"] > 0 and row["backward"] > 0
    # recompute sits in the lower half of a row, below its middle line: a few pixels further down
    lower = colour_counts(plot.path, tuple(y + 8 for y in plot.row_centers))
    assert all(row["recompute"] > 0 for row in lower)
    # between two rows: no boxes
    gaps = colour_counts(plot.path, tuple((a + b) // 2 for a, b in zip(plot.row_centers, plot.row_centers[1:])))
    assert all(sum(row.values()) == 0 for row in gaps)
    # the bubble: stage 0 idles while the others fill up, so its busy share is below 100 %
    if stages > 1:
        assert "busy 100%" not in plot.rows[0]


def test_write_timeline_writes_both_files(tmp_path):
    json_path, png_path = write_timeline(gpipe_events(), tmp_path / "sub" / "run")
    assert (json_path.name, png_path.name) == ("run.json", "run.png")
    assert len([e for e in json.loads(json_path.read_text())["traceEvents"] if e["ph"] == "X"]) == 36
    assert Image.open(png_path).format == "PNG"


def test_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no events"):
        write_timeline([], tmp_path / "empty")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    with pytest.raises(ImportError, match=r"pip install matplotlib \(in a checkout: pip install -e '\.\[plot\]'\)"):
        plot_timeline(gpipe_events(), tmp_path / "x.png")
    assert chrome_trace(gpipe_events())["traceEvents"]  # the JSON needs no matplotlib


@pytest.mark.timeout(120)
def test_pipe_timeline_from_a_real_run(cluster, tmp_path):
    model = mlp([8, 16, 16, 16, 4], seed=3)  # 7 layers
    x = torch.randn(16, 8, requires_grad=True)
    with Pipe(model, chunks=4, checkpoint="except_last", balance=[3, 2, 2], workers=cluster.names[:3]) as pipe:
        for _ in range(2):
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [pipe(x).local_value().sum()])
        json_path, png_path = pipe.timeline(str(tmp_path / "pipe"), clear=True)
        assert pipe.execution_record() == []
    spans = [e for e in json.loads(json_path.read_text())["traceEvents"] if e["ph"] == "X"]
    for stage in range(3):
        mine = [e for e in spans if e["pid"] == stage]
        assert sorted(e["name"] for e in mine if e["cat"] == "forward") == sorted(["F0", "F1", "F2", "F3"] * 2)
        assert sum(e["cat"] == "backward" for e in mine) == 8
        assert sum(e["cat"] == "recompute" for e in mine) == 6
    assert Image.open(png_path).size == (1200, round((1.2 + 0.55 * 3) * 100))
