"""Seeing the schedule: the execution record as a Chrome/Perfetto trace (JSON) and a PNG timeline."""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .trace import KINDS, Event

__all__ = ["COLORS", "TimelinePlot", "chrome_trace", "events_from_chrome_trace", "plot_timeline", "write_timeline"]

#: Box colour of each kind of work (also the legend).
COLORS = {"forward": "#4c72b0", "recompute": "#dd8452", "backward": "#55a868", "weight": "#937860",
          "allreduce": "#8172b3"}
_LETTER = {"forward": "F", "recompute": "R", "backward": "B", "weight": "W", "allreduce": "A"}
_TID = {kind: k for k, kind in enumerate(KINDS)}  # one track per kind: recompute nests inside backward


@dataclass(frozen=True)
class TimelinePlot:
    """What :func:`plot_timeline` drew: the PNG's size in pixels and, per stage row (top to bottom), its
    label and the pixel row through its middle (from the top of the image)."""

    path: Path
    width: int
    height: int
    rows: tuple[str, ...]
    row_centers: tuple[int, ...]
    span_ms: float


def _name(event: Event) -> str:
    letter = _LETTER.get(event.kind, event.kind[:1].upper())
    return letter if event.microbatch < 0 else f"{letter}{event.microbatch}"  # (a step's, not a micro-batch's)


def _checked(events: Iterable[Event]) -> list[Event]:
    out = sorted(events, key=lambda e: (e.start, e.stage))
    if not out:
        raise ValueError("no events to draw: run at least one step (pipe.execution_record() is empty)")
    return out


def _stages(events: Sequence[Event]) -> dict[int, str]:
    return {e.stage: e.worker for e in sorted(events, key=lambda e: e.stage)}


def chrome_trace(events: Iterable[Event]) -> dict[str, Any]:
    """A Chrome trace (``chrome://tracing``, https://ui.perfetto.dev): one process per stage, one thread per
    kind of work, one complete ('X') event per span named ``F3`` / ``R3`` / ``B3`` (kind, micro-batch);
    times in microseconds from the first start."""
    evs = _checked(events)
    t0 = evs[0].start
    trace: list[dict[str, Any]] = []
    for stage, worker in _stages(evs).items():
        trace.append({"name": "process_name", "ph": "M", "pid": stage, "args": {"name": f"stage {stage} ({worker})"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": stage, "args": {"sort_index": stage}})
        for kind, tid in _TID.items():
            trace.append({"name": "thread_name", "ph": "M", "pid": stage, "tid": tid, "args": {"name": kind}})
    for e in evs:
        trace.append({"name": _name(e), "cat": e.kind, "ph": "X", "pid": e.stage, "tid": _TID.get(e.kind, len(_TID)),
                      "ts": round((e.start - t0) * 1e6, 3), "dur": round(max(e.duration, 0.0) * 1e6, 3),
                      "args": {"step": e.step, "microbatch": e.microbatch, "worker": e.worker, "start": e.start}})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def events_from_chrome_trace(trace: dict[str, Any]) -> list[Event]:
    """The events back from :func:`chrome_trace`'s output (to redraw a trace saved earlier)."""
    out = []
    for item in trace.get("traceEvents", []):
        if item.get("ph") != "X":
            continue
        args = item["args"]
        start = float(args["start"])
        out.append(Event(int(item["pid"]), str(args["worker"]), str(item["cat"]), int(args["step"]),
                         int(args["microbatch"]), start, start + float(item["dur"]) / 1e6))
    return _checked(out)


def _busy_fraction(spans: list[tuple[float, float]], span: float) -> float:
    """Share of ``span`` covered by the union of ``spans`` (the rest is the bubble)."""
    covered, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            covered += b - max(a, end)
            end = b
    return covered / span if span > 0 else 1.0


def _pyplot_free_figure(width_in: float, height_in: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("drawing the timeline needs matplotlib: pip install matplotlib (in a checkout: "
                          "pip install -e '.[plot]'); the JSON trace needs nothing") from exc
    fig = Figure(figsize=(width_in, height_in))
    FigureCanvasAgg(fig)
    return fig


def _draw_row(ax: Any, row: int, events: list[Event], t0: float, span_ms: float) -> None:
    """Forward and backward boxes fill the row; recompute (inside a backward) is a lower, narrower box."""
    for e in sorted(events, key=lambda e: e.kind == "recompute"):  # recompute drawn over its backward
        left, width = (e.start - t0) * 1e3, max(e.duration * 1e3, span_ms * 1e-4)
        low, height = (row - 0.4, 0.8) if e.kind != "recompute" else (row - 0.05, 0.45)
        ax.broken_barh([(left, width)], (low, height), facecolors=COLORS.get(e.kind, "#8c8c8c"),
                       edgecolor="white", linewidth=0.5)
        if width >= span_ms / 90:  # room for a label
            y = low + height * (0.25 if e.kind == "backward" else 0.5)  # clear of a recompute box below
            ax.text(left + width / 2, y, str(e.microbatch), ha="center", va="center",
                    fontsize=7, color="white", clip_on=True)


def plot_timeline(events: Iterable[Event], path: str | Path, *, width: float = 12.0, dpi: int = 100) -> TimelinePlot:
    """A PNG with one row per stage (stage 0 on top), one box per forward / recompute / backward of
    micro-batch ``i`` (labelled ``i``, coloured by kind), time in ms from the first start on the x axis.
    White space in a row is idle time, the pipeline bubble; each row's label gives the stage's busy share."""
    evs = _checked(events)
    stages = _stages(evs)
    t0, t1 = evs[0].start, max(e.end for e in evs)
    span_ms = max((t1 - t0) * 1e3, 1e-3)
    fig = _pyplot_free_figure(width, 1.2 + 0.55 * len(stages))
    ax = fig.add_subplot(1, 1, 1)
    labels = []
    for row, (stage, worker) in enumerate(stages.items()):
        mine = [e for e in evs if e.stage == stage]
        busy = _busy_fraction([(e.start, e.end) for e in mine if e.kind in ("forward", "backward", "weight")], t1 - t0)
        labels.append(f"stage {stage} ({worker})\nbusy {busy:.0%}")
        ax.axhspan(row - 0.45, row + 0.45, color="#f0f0f0", zorder=0)
        _draw_row(ax, row, mine, t0, span_ms)
    ax.set_yticks(range(len(stages)), labels, fontsize=8)
    ax.set_ylim(len(stages) - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time (ms)")
    steps, chunks = len({e.step for e in evs}), max(e.microbatch for e in evs) + 1
    ax.set_title(f"{len(stages)} stages, {steps} step(s) of {chunks} micro-batches; box label = micro-batch, "
                 "gaps = bubble", fontsize=9, loc="left")
    from matplotlib.patches import Patch

    kinds = [k for k in KINDS if any(e.kind == k for e in evs)]
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds], loc="lower right", bbox_to_anchor=(1, 1),
              fontsize=8, ncols=len(kinds), frameon=False, borderaxespad=0.2)
    fig.tight_layout()
    fig.canvas.draw()
    height_px = int(round(fig.get_figheight() * dpi))
    scale = dpi / fig.dpi  # display coordinates are at the figure's dpi; the file at ``dpi``
    centers = tuple(int(round(height_px - ax.transData.transform((0, row))[1] * scale)) for row in range(len(stages)))
    out = Path(path)
    fig.savefig(out, dpi=dpi)
    return TimelinePlot(out, int(round(fig.get_figwidth() * dpi)), height_px, tuple(labels), centers, span_ms)


def write_timeline(events: Iterable[Event], path_prefix: str | Path) -> tuple[Path, Path]:
    """Write ``PREFIX.json`` (Chrome/Perfetto trace) and ``PREFIX.png`` (timeline); returns both paths."""
    evs = _checked(events)
    prefix = Path(path_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    json_path, png_path = prefix.with_name(prefix.name + ".json"), prefix.with_name(prefix.name + ".png")
    json_path.write_text(json.dumps(chrome_trace(evs)))
    plot_timeline(evs, png_path)
    return json_path, png_path
