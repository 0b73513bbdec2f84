"""The suite's PNG: samples/s against chunks per model and stage count, then scaling, hops and memory."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from suite_report import recompute_ratios, sps

STYLE = {"gpipe": ("pipelining GPipe", "#c44e52", "s-"), "1f1b": ("pipelining 1F1B", "#dd8452", "D-"),
         "gpipe_control": ("pipelining GPipe again (A/A control)", "#c44e52", "s:"),
         "never": ("rrefpipe never", "#4c72b0", "o-"), "except_last": ("rrefpipe except_last", "#55a868", "o-"),
         "always": ("rrefpipe always", "#8172b3", "o-")}


def _throughput(ax: Any, sec: dict[str, Any], plain: list[dict[str, Any]]) -> None:
    ms = [r["chunks"] for r in sec["rows"]]
    for key, (label, color, fmt) in STYLE.items():
        pts = [(m, sps(r["contestants"].get(key))) for m, r in zip(ms, sec["rows"])]
        pts = [(m, v) for m, v in pts if v]
        if pts:
            ax.plot(*zip(*pts), fmt, color=color, label=label, ms=4, lw=1.2)
    ax.plot(ms, [r["ideal_samples_per_s"] for r in sec["rows"]], "k--", lw=1, label="ideal (full-batch compute)")
    ax.plot(ms, [r["ideal_mb_samples_per_s"] for r in sec["rows"]], "k:", lw=1, label="ideal@mb")
    for p, style in zip(plain, ("-.", (0, (1, 3)))):
        ax.axhline(p["samples_per_s"], color="grey", ls=style, lw=1, label=f"plain, {p['threads']} thread(s)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_title(f"{sec['name']}, {sec['stages']} stages", fontsize=9)
    ax.set_xlabel("chunks (micro-batches)", fontsize=8)
    ax.set_ylabel("samples/s", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set_ylim(bottom=0)


def _scaling(ax: Any, sc: dict[str, Any]) -> None:
    xs = [r["chunks"] for r in sc["rows"]]
    ax.plot(xs, [r["step_ms"] for r in sc["rows"]], "o-", color=STYLE["never"][1], label="measured")
    fit = sc.get("fit_m_ge_8")
    if fit:
        ax.plot(xs, [fit["intercept"] + fit["slope"] * x for x in xs], "k--", lw=1,
                label=f"fit m>=8: {fit['slope']:.2f} ms/mb, R² {fit['r2']:.3f}")
    ax.plot(xs, [r["ideal_mb_ms"] for r in sc["rows"]], "k:", lw=1, label="ideal@mb")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    per_mb = f", {sc['micro_batch']} samples/micro-batch" if "micro_batch" in sc else f", batch {sc.get('batch')}"
    ax.set_title(f"rrefpipe MLP step time vs chunks ({sc['checkpoint']}{per_mb})", fontsize=9)
    ax.set_xlabel("chunks", fontsize=8)
    ax.set_ylabel("ms per step", fontsize=8)
    ax.legend(fontsize=7)
    ax.tick_params(labelsize=7)


def _hops(ax: Any, rows: list[dict[str, Any]]) -> None:
    labels = [r["size"] for r in rows]
    ax.bar(labels, [r["hop_over_raw"] for r in rows], color=STYLE["never"][1])
    ax.axhline(1.5, color="k", ls="--", lw=1, label="target 1.5")
    ax.set_title("stage hop / raw rpc_sync (no grad)", fontsize=9)
    ax.legend(fontsize=7)
    ax.tick_params(labelsize=7)


def _memory(ax: Any, result: dict[str, Any]) -> None:
    labels, always, recompute = [], [], []
    for sec in result["sections"]:
        mem = sec.get("memory")
        if not mem or "always" not in mem.get("over_never", {}):
            continue
        labels.append(f"{sec['name']}\n{sec['stages']}st")
        always.append(max(mem["over_never"]["always"]))
        ratios = recompute_ratios(sec)
        recompute.append(statistics.median(ratios.values()) - 1 if ratios else 0.0)
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], always, 0.4, label="memory always/never (max stage)", color=STYLE["always"][1])
    ax.bar([x + 0.2 for x in xs], recompute, 0.4, label="recompute: extra step time (median over m)", color="#937860")
    ax.axhline(0.35, color="k", ls="--", lw=1, label="35%")
    ax.set_xticks(list(xs), labels, fontsize=6)
    ax.set_title("checkpoint='always' vs 'never'", fontsize=9)
    ax.legend(fontsize=6)
    ax.tick_params(labelsize=7)


def write_chart(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(s["name"] for s in result["sections"]))
    stages = sorted({s["stages"] for s in result["sections"]})
    cols = max(3, len(models))
    fig, axes = plt.subplots(len(stages) + 1, cols, figsize=(5 * cols, 3.6 * (len(stages) + 1)), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for sec in result["sections"]:
        ax = axes[stages.index(sec["stages"])][models.index(sec["name"])]
        ax.set_visible(True)
        _throughput(ax, sec, result["plain"][sec["name"]])
    handles, labels = next((a.get_legend_handles_labels() for a in axes.flat if a.get_visible()), ([], []))
    extra = axes[-1]
    panels: list[tuple[Any, Any, Any]] = [(extra[0], _scaling, result.get("scaling")),
                                          (extra[1], _hops, result.get("hop")), (extra[2], _memory, result)]
    for ax, draw, data in panels:
        if data:
            ax.set_visible(True)
            draw(ax, data)
    m = result["machine"]
    fig.suptitle(f"rrefpipe benchmark suite: {m['cpu_count']} CPUs, torch {m['torch']}, 1 intra-op thread per stage; "
                 f"load {m['loadavg_start']} -> {m.get('loadavg_end')}", fontsize=10)
    fig.legend(handles, labels, loc="upper right", fontsize=7, ncol=1)
    fig.tight_layout(rect=(0, 0, 0.88, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
