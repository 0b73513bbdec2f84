"""Training throughput of a 2-stage pipeline whose driver and stages are on separate (namespace) hosts.

Run as root: ``python benchmarks/bench_multihost.py`` (about 2-3 minutes on 2 cores; ``--quick`` for a
smoke test). It prints a table and writes every number to ``benchmarks/results/multihost.json``.

Set-up (the test harness of ``tests/multihost``): three hosts, each a network namespace with ``lan0`` at
10.77.0.1-3; the driver on host 1, ``python -m workers`` stage workers on hosts 2 and 3, each process in
its own PID namespace, so every tensor crosses a link (driver -> stage 0 -> stage 1 -> driver, and the
gradient stage 1 -> stage 0). The links, one scenario each:

* ``loopback``: no namespaces; local workers (``workers.LocalWorkers``) on one host, for reference;
* ``veth``: a bridge joined to each host by a veth pair (kernel forwarding, nothing added);
* ``relay +0/+1/+10 ms``: the user-space relay between TAP devices (``tests/multihost/relay.py``),
  adding that much one-way delay to every frame (a round trip gets twice it). ``+0 ms`` is the relay's
  own cost, the baseline for the delayed rows;
* ``100 Mbit``: the veth bridge with every host's egress shaped by ``tc ... tbf rate 100mbit``.

Workload: ``layers`` x (Linear(width, width) + ReLU) + Linear(width, 10), split in half, batch ``batch``
in ``chunks`` micro-batches, checkpoint 'except_last', SGD through ``DistributedOptimizer``. A step is
forward + cross-entropy + ``dist_autograd.backward`` + ``opt.step`` timed on the driver; after ``warmup``
steps, ``steps`` are timed. ``rtt`` is the median of 50 empty ``rpc_sync`` calls from the driver to
stage 0's worker (one round trip over one link). ``link MB/step`` is what stage 0's host sent and received
per timed step (its ``lan0`` byte counters). Each worker and the driver use one intra-op thread.
"""
from __future__ import annotations

import argparse
import json
import operator
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "multihost.json"
MASTER_PORT = "29500"
#: name -> Lab keyword arguments (None: loopback, no namespaces)
SCENARIOS: dict[str, dict[str, Any] | None] = {
    "loopback": None,
    "veth": {},
    "relay +0 ms": {"delay_ms": 0.0},
    "relay +1 ms": {"delay_ms": 1.0},
    "relay +10 ms": {"delay_ms": 10.0},
    "100 Mbit": {"rate": "100mbit"},
}


# -- the driver (runs in host 1's namespace, or on loopback) ---------------------------------------------------
def drive(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed.rpc as rpc
    from torch import nn
    from torch.distributed.optim import DistributedOptimizer

    import workers
    from rrefpipe import Pipe

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(args.width, 10))
    half = len(model) // 2
    x = torch.randn(args.batch, args.width)
    y = torch.randint(0, 10, (args.batch,))

    from steps import train_step  # benchmarks/ is this script's directory

    def run(stage_workers: list[str]) -> dict[str, Any]:
        with Pipe(model, chunks=args.chunks, balance=[half, len(model) - half], workers=stage_workers) as pipe:
            opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.01)
            times = []
            for step in range(args.warmup + args.steps):
                if step == args.warmup:
                    print("TIMING", flush=True)  # the orchestrator reads the link counters here
                seconds, loss = train_step(pipe, opt, x, y)
                times.append(seconds)
            print("TIMED", flush=True)
            rtts = []
            for _ in range(50):
                start = time.perf_counter()
                rpc.rpc_sync(stage_workers[0], operator.add, args=(1, 1))
                rtts.append(time.perf_counter() - start)
            del opt
        timed = sorted(times[args.warmup:])
        return {"step_ms": {"median": 1e3 * statistics.median(timed), "p10": 1e3 * timed[len(timed) // 10],
                            "p90": 1e3 * timed[(9 * len(timed)) // 10]},
                "samples_per_s": args.batch / statistics.median(timed), "rtt_ms": 1e3 * statistics.median(rtts),
                "step_ms_all": [1e3 * t for t in times], "loss": loss}

    if args.role == "local":
        with workers.LocalWorkers(2, threads=1) as local:
            result = run(local.names)
    else:
        with workers.torchrun_group(interface="lan0", rpc_timeout=120) as stage_workers:
            result = run(stage_workers)
    print("RESULT " + json.dumps(result), flush=True)


# -- the orchestrator (root namespace) ------------------------------------------------------------------------
def driver_argv(args: argparse.Namespace, role: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--role", role, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--batch", str(args.batch), "--chunks", str(args.chunks),
            "--width", str(args.width), "--layers", str(args.layers)]


def wait_for_line(path: Path, marker: str, proc: subprocess.Popen[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and f"\n{marker}\n" in "\n" + path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            return
        time.sleep(0.02)
    raise TimeoutError(f"no {marker!r} from the driver after {timeout}s")


def result_line(text: str) -> dict[str, Any]:
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"the driver printed no result:\n{text[-3000:]}")
    return dict(json.loads(lines[-1][len("RESULT "):]))


def run_local(args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(driver_argv(args, "local"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    (logdir / "loopback.log").write_text(proc.stdout + proc.stderr)
    return result_line(proc.stdout)


def run_hosts(args: argparse.Namespace, lab_kwargs: dict[str, Any], logdir: Path, tag: str) -> dict[str, Any]:
    from tests.multihost.netlab import IFNAME, Lab

    with Lab(3, logdir=logdir, **lab_kwargs) as lab:
        driver, *stages = lab.hosts
        common = ["--world-size", "3", "--master-addr", driver.addr, "--master-port", MASTER_PORT,
                  "--interface", IFNAME, "--threads", "1"]
        procs = [lab.spawn(host, [sys.executable, "-m", "workers", "--rank", str(k), *common], name=f"{tag}-worker{k}")
                 for k, host in enumerate(stages, start=1)]
        env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": driver.addr, "MASTER_PORT": MASTER_PORT}
        proc = lab.spawn(driver, driver_argv(args, "driver"), name=f"{tag}-driver", env=env)
        log = lab.log_path(f"{tag}-driver")
        wait_for_line(log, "TIMING", proc, timeout=240)
        before = lab.counters(stages[0])
        wait_for_line(log, "TIMED", proc, timeout=240)
        after = lab.counters(stages[0])
        if proc.wait(timeout=120) != 0 or any(p.wait(timeout=30) != 0 for p in procs):
            raise RuntimeError(f"scenario {tag!r} failed:\n{lab.outputs()}")
        result = result_line(lab.output(f"{tag}-driver"))
        moved = (after["rx"] - before["rx"]) + (after["tx"] - before["tx"])
        result["link_mb_per_step"] = moved / args.steps / 1e6
        return result


def table(results: dict[str, dict[str, Any]], batch: int) -> str:
    rows = [f"{'link':<14} {'step ms':>8} {'p10':>7} {'p90':>7} {'samples/s':>10} {'vs veth':>8} {'rtt ms':>7} "
            f"{'link MB/step':>12}"]
    base = results.get("veth", {}).get("samples_per_s")
    for name, r in results.items():
        if "error" in r:
            rows.append(f"{name:<14} failed: {r['error'][:80]}")
            continue
        s = r["step_ms"]
        rel = f"{r['samples_per_s'] / base:.2f}" if base else "-"
        mb = f"{r['link_mb_per_step']:.2f}" if "link_mb_per_step" in r else "-"
        rows.append(f"{name:<14} {s['median']:>8.1f} {s['p10']:>7.1f} {s['p90']:>7.1f} {r['samples_per_s']:>10.0f} "
                    f"{rel:>8} {r['rtt_ms']:>7.2f} {mb:>12}")
    return "\n".join(rows)


def orchestrate(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.multihost import netlab

    reason = netlab.unavailable()
    if reason:
        raise SystemExit(f"bench_multihost: {reason}")
    netlab.cleanup_stale()
    names = [n for n in SCENARIOS if n != "relay +0 ms" or not args.quick]
    if netlab.relay_unavailable():
        print(f"skipping the relay scenarios: {netlab.relay_unavailable()}")
        names = [n for n in names if not n.startswith("relay")]
    logdir = args.out.parent / "multihost-logs"  # this run's process logs (the previous run's are removed)
    shutil.rmtree(logdir, ignore_errors=True)
    logdir.mkdir(parents=True)
    load_before = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        kwargs = SCENARIOS[name]
        tag = name.replace(" ", "").replace("+", "p")
        print(f"running {name} ...", flush=True)
        try:
            results[name] = run_local(args, logdir) if kwargs is None else run_hosts(args, kwargs, logdir, tag)
        except Exception as exc:  # a failed scenario is reported, the others still run
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    workload = {k: getattr(args, k) for k in ("batch", "chunks", "width", "layers", "steps", "warmup")}
    print(f"\n2-stage pipeline, batch {args.batch} in {args.chunks} micro-batches, "
          f"{args.layers} x Linear({args.width}) "
          f"+ ReLU + Linear({args.width}, 10); driver and each stage on its own host")
    print(table(results, args.batch))
    print(f"load average before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "workload": workload, "results": results, "load_average": [load_before[0], os.getloadavg()[0]],
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
                    "time": time.strftime("%Y-%m-%d %H:%M:%S %z")},
    }, indent=1))
    print(f"wrote {args.out}")
    leftover = [ns for ns in netlab.our_namespaces() if ns.startswith(f"{netlab.PREFIX}{os.getpid()}n")]
    if leftover:
        raise SystemExit(f"namespaces left behind: {leftover}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=["orchestrate", "driver", "local"], default="orchestrate", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=40, help="timed steps per scenario (default: 40)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    p.add_argument("--batch", type=int, default=64, help="mini-batch size (default: 64)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches (default: 4)")
    p.add_argument("--width", type=int, default=512, help="layer width (default: 512)")
    p.add_argument("--layers", type=int, default=4, help="Linear+ReLU blocks (default: 4)")
    p.add_argument("--quick", action="store_true", help="few steps, no relay +0 ms row")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default: {DEFAULT_OUT})")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup = 8, 2
    if args.role == "orchestrate":
        orchestrate(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
