"""Printing the suite's tables from one run's result dict (the targets are in ``suite_targets``)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from bench_core import print_hops

MODES = ("never", "except_last", "always")
#: Micro-batches each stage recomputes in a step of m, per checkpoint mode.
CHECKPOINTED = {"never": lambda m: 0, "except_last": lambda m: m - 1, "always": lambda m: m}
ISSUE_PIPELINING_ACH = {8: 0.91, 16: 0.83}  # pipelining GPipe achieved/ideal quoted in the issue (MLP, 2 stages)


def sections(result: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from result["sections"]


def _f(v: float | None, spec: str = ".0f") -> str:
    return "n/a" if v is None else format(v, spec)


def sps(row: dict[str, Any] | None) -> float | None:
    return None if row is None or "error" in row else row["samples_per_s"]


def print_throughput(sec: dict[str, Any], plain: list[dict[str, Any]]) -> None:
    pl = ", ".join(f"{p['threads']} thread(s) {p['samples_per_s']:.0f}" for p in plain)
    print(f"\n{sec['model']} | {sec['stages']} stages, balance {sec['balance']}, batch {sec['batch']} | "
          f"plain PyTorch samples/s: {pl} | load {sec['loadavg_start']} -> {sec['loadavg_end']}")
    print("  compute per stage, whole batch, 1 thread (fwd/bwd ms): " + ", ".join(
        f"{c['forward_ms']:.0f}/{c['backward_ms']:.0f}" for c in sec["stage_compute"]))
    print(f"  {'m':>3} | {'GPipe':>6} {'1F1B':>6} | {'never':>6} {'exc_lst':>7} {'always':>6} | {'ideal':>6} "
          f"{'i@mb':>6} | {'rr/GP':>5} {'el/GP':>5} {'A/A':>5} | {'ach/i@mb: rr':>12} {'GP':>5} | "
          f"{'rpc/mb':>6} {'load':>5}")
    for r in sec["rows"]:
        c = r["contestants"]
        gp, rr, el = sps(c.get("gpipe")), sps(c.get("never")), sps(c.get("except_last"))
        again = sps(c.get("gpipe_control"))
        print(f"  {r['chunks']:>3} | {_f(gp):>6} {_f(sps(c.get('1f1b'))):>6} | {_f(rr):>6} {_f(el):>7} "
              f"{_f(sps(c.get('always'))):>6} | {r['ideal_samples_per_s']:>6.0f} {r['ideal_mb_samples_per_s']:>6.0f} | "
              f"{_f(rr / gp if rr and gp else None, '.2f'):>5} {_f(el / gp if el and gp else None, '.2f'):>5} "
              f"{_f(again / gp if again and gp else None, '.2f'):>5} | "
              f"{_f(rr / r['ideal_mb_samples_per_s'] if rr else None, '.2f'):>12} "
              f"{_f(gp / r['ideal_mb_samples_per_s'] if gp else None, '.2f'):>5} | {r['rpc_mb_ms']:>6.2f} "
              f"{_f((r.get('loadavg_start') or [None])[0], '.1f'):>5}")


def _join(values: list[Any], spec: str) -> str:
    return "/".join(format(v, spec) for v in values)


def print_records(sec: dict[str, Any], mode: str) -> None:
    print(f"  execution record, rrefpipe '{mode}' (medians over timed steps, ms; '/' separates stages; F gap: "
          "stage 0; definitions in suite_record.py):")
    print(f"  {'m':>3} {'lead':>5} {'fwdtail':>7} {'bwdlead':>7} {'bwdtail':>7} {'opt':>5} {'F hop':>6} {'B hop':>6} "
          f"{'F gap':>5} {'F conc':>6} {'B conc':>6} {'busy':>15} {'maxgap':>11} {'B open':>6} {'F infl':>11} "
          f"{'B infl':>11}")
    for r in sec["rows"]:
        rec = (r["contestants"].get(mode) or {}).get("record")
        if not rec:
            continue
        print(f"  {r['chunks']:>3} {_f(rec['lead_ms'], '.1f'):>5} {_f(rec['fwd_tail_ms'], '.1f'):>7} "
              f"{_f(rec.get('bwd_lead_ms'), '.1f'):>7} {_f(rec.get('bwd_tail_ms'), '.1f'):>7} "
              f"{_f(rec['opt_ms'], '.1f'):>5} {_f(rec['fwd_handoff_ms'], '.1f'):>6} "
              f"{_f(rec['bwd_handoff_ms'], '.1f'):>6} "
              f"{rec['fwd_gap_ms'][0]:>5.1f} {_f(rec['fwd_concurrency'], '.2f'):>6} "
              f"{_f(rec['bwd_concurrency'], '.2f'):>6} {_join(rec['busy'], '.2f'):>15} "
              f"{_join(rec['max_gap_ms'], '.0f'):>11} {_join(rec['bwd_overlap'], 'g'):>6} "
              f"{_join(rec.get('fwd_inflation', []), '.2f'):>11} {_join(rec.get('bwd_inflation', []), '.2f'):>11}")


def _cpu(cpu: dict[str, list[float]] | None) -> str:
    if not cpu:
        return "n/a"
    return " ".join(f"{u:.0f}/{s_:.0f}/{f / 1e3:.1f}k" for u, s_, f in zip(cpu["user_ms"], cpu["sys_ms"],
                                                                           cpu["minor_faults"]))


def cpu_total_ms(cpu: dict[str, list[float]] | None) -> float | None:
    """CPU time of a step summed over every process of a contestant (user + kernel)."""
    return None if not cpu else sum(cpu["user_ms"]) + sum(cpu["sys_ms"])


def transport_ms(cpu: dict[str, list[float]] | None) -> float | None:
    """CPU time of a step on the transport threads (TensorPipe's or gloo's loops), all processes."""
    return None if not cpu or "transport_ms" not in cpu else sum(cpu["transport_ms"])


def print_cpu(sec: dict[str, Any]) -> None:
    print("  CPU per timed step, user ms / kernel ms / minor page faults, per process "
          "(rrefpipe 'never': driver, then stage workers; GPipe: ranks); GP/rr: GPipe's CPU over rrefpipe's, "
          "all processes (on the 2-core machine it follows the rr/GP throughput ratio); loops: ms of it on "
          "the transport threads (TensorPipe's, gloo's), rrefpipe / GPipe:")
    for r in sec["rows"]:
        c = r["contestants"]
        rr, gp = ((c.get(k) or {}).get("cpu") for k in ("never", "gpipe"))
        rr_ms, gp_ms = cpu_total_ms(rr), cpu_total_ms(gp)
        ratio = gp_ms / rr_ms if rr_ms and gp_ms is not None else None
        loops = (transport_ms(rr), transport_ms(gp))
        loops_text = "" if loops == (None, None) else f"  loops {_f(loops[0])}/{_f(loops[1])}"  # older runs: none
        print(f"  {r['chunks']:>3}  rrefpipe {_cpu(rr):<44} GPipe {_cpu(gp):<30} GP/rr {_f(ratio, '.2f')}{loops_text}")


def print_memory(result: dict[str, Any]) -> None:
    print("\nMemory kept for backward per stage (rrefpipe.memory, one step) and recomputation cost")
    print(f"  {'model':<12} {'n':>2} {'m':>3} {'mode':<12} {'peak MiB per stage':<26} "
          f"{'/never':<17} {'/stage input':<17}")
    for sec in sections(result):
        mem = sec.get("memory")
        if not mem:
            continue
        for mode, peaks in mem["peak_bytes"].items():
            print(f"  {sec['name']:<12} {sec['stages']:>2} {mem['chunks']:>3} {mode:<12} "
                  f"{' '.join(f'{p / 2**20:7.2f}' for p in peaks):<26} "
                  f"{' '.join(_f(v, '5.2f') for v in mem.get('over_never', {}).get(mode, [])):<17} "
                  f"{' '.join(_f(v, '5.2f') for v in mem['over_inputs'][mode]):<17}")
        rec = recompute_ratios(sec)
        if rec:
            print(f"  {'':<12} {'':>2} recomputation: 'always' / 'never' step time by m: "
                  + ", ".join(f"{m}: {v:.2f}" for m, v in rec.items()))


def print_scaling(sc: dict[str, Any]) -> None:
    size = (f"{sc['micro_batch']} samples per micro-batch (batch = m x {sc['micro_batch']})" if "micro_batch" in sc
            else f"batch {sc['batch']}")
    print(f"\nScaling: rrefpipe step time vs micro-batches, MLP, {len(sc['balance'])} stages, {size}, "
          f"checkpoint '{sc['checkpoint']}'")
    print(f"  {'m':>4} {'step ms':>8} {'p10-p90':>13} {'samples/s':>9} {'ideal@mb':>8} {'overhead':>8} {'ovh/m':>6}")
    for r in sc["rows"]:
        print(f"  {r['chunks']:>4} {r['step_ms']:>8.1f} {r['p10_ms']:>6.0f}-{r['p90_ms']:<6.0f} "
              f"{r['samples_per_s']:>9.0f} {r['ideal_mb_ms']:>8.1f} {r['overhead_ms']:>8.1f} "
              f"{r['overhead_ms'] / r['chunks']:>6.2f}")
    names = {"fit_all": "step time, all m", "fit_m_ge_8": "step time, m >= 8", "fit_overhead": "overhead, all m"}
    for key, label in names.items():
        if key in sc:
            f = sc[key]
            print(f"  linear fit ({label}): {f['intercept']:.1f} ms + {f['slope']:.3f} ms x m, R² {f['r2']:.3f}")
    if "worst_marginal" in sc:
        w = sc["worst_marginal"]
        print(f"  costliest step between neighbouring m >= 8: up to m={w['chunks']}, "
              f"{w['ms_per_microbatch']:.2f} ms per added micro-batch = {w['ratio']:.2f} x the fitted slope "
              f"(a cliff: above {sc['cliff_threshold']:.2f} x)")


def print_all(result: dict[str, Any]) -> None:
    plain = result["plain"]
    for sec in sections(result):
        print_throughput(sec, plain[sec["name"]])
        print_records(sec, "never")
        print_cpu(sec)
    print("\n  rr = rrefpipe 'never', el = 'except_last', GP = pipelining GPipe; A/A = GPipe again, on a "
          "second group of processes in the same rounds, over GPipe (the control: where two equal contestants "
          "land in this run); ideal = m/(m+n-1) x slowest stage "
          "(fwd+bwd at full batch, 1 thread, no recompute); i@mb = same with fwd/bwd timed at the micro-batch size "
          "(the bubble model; ach/i@mb = achieved over it); "
          "rpc/mb = raw rpc_sync ms of one micro-batch's boundary tensor (largest boundary); load = 1-min load "
          "average before the row (this run's own processes count: ~2-3 while it runs)")
    print_memory(result)
    if result.get("scaling"):
        print_scaling(result["scaling"])
    if result.get("hop"):
        print()
        print_hops(result["hop"])


def recompute_ratios(sec: dict[str, Any]) -> dict[int, float]:
    out = {}
    for r in sec["rows"]:
        a, n = sps(r["contestants"].get("always")), sps(r["contestants"].get("never"))
        if a and n:
            out[r["chunks"]] = n / a  # step time ratio = inverse throughput ratio
    return out
