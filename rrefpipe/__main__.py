"""``python -m rrefpipe``: the command line: run the demo, the tutorial, draw a pipeline timeline, or print a
schedule's orders."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from .schedule import (ASYNC_SCHEDULES, SCHEDULES, Action, check_schedule, format_orders, is_async, is_v_shaped,
                       parse_schedule, peak_in_flight, pipemare_forward_version, simulate, stage_layout, stream_orders,
                       weight_buffers, weight_version, worker_orders, worker_peaks)

__all__ = ["main"]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: The ``--checkpoint`` help of the commands and examples that train a pipe: what Pipe's checkpoint does.
CHECKPOINT_HELP = ("micro-batches that keep only their input and recompute their forward for backward: always, "
                   "except_last (all but the last) or never. CPU stages before the last recompute while they wait "
                   "for the gradient; the last stage and GPU stages recompute in backward (default: %(default)s)")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks (examples of commands); option help is wrapped."""


def _run_example(name: str, argv: Sequence[str]) -> None:
    """Run ``examples/NAME.py``'s ``main(argv, prog)`` (the examples live in a source checkout).

    Imported as module ``NAME`` from the examples folder, which goes first on ``sys.path`` as it would
    for ``python examples/NAME.py``: the examples import each other, and the stage workers (which take
    this process's ``sys.path``) import the example's classes from there."""
    script = EXAMPLES / f"{name}.py"
    if not script.is_file():
        raise SystemExit(f"{script} not found: the examples are in rrefpipe's source checkout, not in the "
                         "installed package; install with `pip install -e .` from a checkout")
    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(name, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    module.main(list(argv), prog=f"python -m rrefpipe {name}")


def _timeline_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("timeline", help="run a few steps of a small pipeline and draw its schedule: PREFIX.json "
                       "(Chrome/Perfetto trace) and PREFIX.png (one row per stage), or redraw a saved trace",
                       description="Run a few training steps of an MLP on local stage workers and draw the last "
                       "step: PREFIX.json for\nchrome://tracing or https://ui.perfetto.dev, PREFIX.png with one row "
                       "per stage, one box per\nforward/recompute/backward of micro-batch i. With --schedule, each "
                       "step is a pipe.train_step\nthat follows that schedule.",
                       epilog="examples:\n"
                       "  python -m rrefpipe timeline --out step\n"
                       "  python -m rrefpipe timeline --schedule 1F1B --stages 2 --chunks 8 --out 1f1b\n"
                       "  python -m rrefpipe timeline --schedule Interleaved1F1B --stages 4 --stages-per-worker 2 "
                       "--chunks 8 --out interleaved",
                       formatter_class=HelpFormatter)
    p.add_argument("--out", metavar="PREFIX", default="rrefpipe-timeline",
                   help="where to write PREFIX.json and PREFIX.png (default: %(default)s)")
    p.add_argument("--from-json", metavar="TRACE", help="redraw the PNG of a trace written earlier; runs nothing")
    p.add_argument("--stages", type=int, default=3,
                   help="pipeline stages; local worker processes: stages / --stages-per-worker (default: "
                   "%(default)s)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch (default: %(default)s)")
    p.add_argument("--checkpoint", choices=["always", "except_last", "never"], default="except_last",
                   help=CHECKPOINT_HELP)
    p.add_argument("--steps", type=int, default=3, help="training steps; the last one is drawn (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=256, help="mini-batch size (default: %(default)s)")
    p.add_argument("--width", type=int, default=512, help="width of the MLP's layers (default: %(default)s)")
    p.add_argument("--layers-per-stage", type=int, default=2,
                   help="Linear+ReLU pairs per stage (default: %(default)s)")
    p.add_argument("--schedule", type=_step_schedule, metavar="{" + ",".join(SCHEDULES) + "}",
                   help="run each step as pipe.train_step(ctx, x, target, mse_loss) under this schedule (any "
                   "case), the loss on the last stage; without it, each step is pipe(x) and pipe.backward, "
                   "which run GPipe's order")
    p.add_argument("--stages-per-worker", type=int, default=1,
                   help="stages on each worker, for --schedule Interleaved1F1B or InterleavedZeroBubble (stage j "
                   "runs on worker j mod (STAGES / STAGES_PER_WORKER)), ZBVZeroBubble or DualPipeV (2, in a V) "
                   "(default: %(default)s)")


def _schedule(name: str) -> str:
    try:
        return parse_schedule(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _step_schedule(name: str) -> str:
    """A synchronous schedule: the timeline draws one ``train_step``, which would run a continuous
    schedule as plain 1F1B, under the wrong name."""
    canonical = _schedule(name)
    if is_async(canonical):
        raise argparse.ArgumentTypeError(
            f"schedule must be one of {', '.join(SCHEDULES)} (any case) for a timeline of train_step steps, got "
            f"{name!r}: {canonical} is a continuous schedule, whose stream `python -m rrefpipe schedule --schedule "
            f"{canonical}` prints")
    return canonical


def _check_timeline(args: argparse.Namespace) -> None:
    """Refuse a pipe the schedule cannot run before any worker starts, saying what to change."""
    if args.stages_per_worker != 1 and args.schedule is None:
        raise ValueError(f"--stages-per-worker {args.stages_per_worker} needs --schedule Interleaved1F1B, "
                         "InterleavedZeroBubble, ZBVZeroBubble or DualPipeV")
    if args.schedule is not None:
        check_schedule(args.schedule, args.stages, args.chunks, args.stages_per_worker)


def _timeline(args: argparse.Namespace) -> None:
    from .timeline import events_from_chrome_trace, plot_timeline

    if args.from_json:
        events = events_from_chrome_trace(json.loads(Path(args.from_json).read_text()))
        plot = plot_timeline(events, Path(args.out + ".png"))
        print(f"wrote {plot.path} ({plot.width}x{plot.height}, rows: {len(plot.rows)})")
        return
    import torch
    import torch.distributed.autograd as dist_autograd
    from torch import nn
    from torch.nn.functional import mse_loss

    from .pipe import Pipe

    torch.manual_seed(0)
    layers = [m for _ in range(args.stages * args.layers_per_stage)
              for m in (nn.Linear(args.width, args.width), nn.ReLU())]
    x = torch.randn(args.batch_size, args.width)
    target = torch.zeros(args.batch_size, args.width)  # the loss is the output's mean square either way
    with Pipe(nn.Sequential(*layers), chunks=args.chunks, checkpoint=args.checkpoint,
              devices=["cpu"] * args.stages, schedule=args.schedule or "GPipe",
              stages_per_worker=args.stages_per_worker) as pipe:
        for step in range(args.steps):
            if step == args.steps - 1:
                pipe.execution_record(clear=True)
            with dist_autograd.context() as ctx:
                if args.schedule is None:
                    dist_autograd.backward(ctx, [mse_loss(pipe(x).local_value(), target)])
                else:
                    pipe.train_step(ctx, x, target, mse_loss)
        json_path, png_path = pipe.timeline(args.out)
    print(f"wrote {json_path} (open in https://ui.perfetto.dev or chrome://tracing) and {png_path}")


def _schedule_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schedule", help="print a schedule's orders: which action each worker runs at each tick, "
                       "the bubble and the micro-batches each stage keeps (no processes)",
                       description="Print the order in which each worker runs its actions under a schedule "
                       "(rrefpipe.schedule.worker_orders),\none column per tick at unit costs: F3 is the forward "
                       "of micro-batch 3, B3 its backward, I3 and W3\nthe two halves of a split backward (inputs' "
                       "gradient, weights' gradient), 5F3 the forward on stage 5\nwhere a worker holds several "
                       "stages, '.' an idle tick. Then the bubble (the workers' idle share)\nand the most "
                       "micro-batches in flight on each stage and worker. Starts no processes.",
                       epilog="examples:\n"
                       "  python -m rrefpipe schedule --schedule 1F1B --stages 4 --chunks 8\n"
                       "  python -m rrefpipe schedule --schedule InterleavedZeroBubble --stages 4 --chunks 8\n"
                       "  python -m rrefpipe schedule --schedule ZBVZeroBubble --stages 4 --stages-per-worker 2 "
                       "--chunks 8\n"
                       "  python -m rrefpipe schedule --schedule DualPipeV --stages 4 --stages-per-worker 2 --chunks 8 "
                       "--costs F=1,I=1,W=1,B=2\n"
                       "  python -m rrefpipe schedule --schedule PipeDream-2BW --stages 3 --chunks 2 --batches 4",
                       formatter_class=HelpFormatter)
    p.add_argument("--schedule", type=_schedule, default="1F1B",
                   metavar="{" + ",".join(SCHEDULES + ASYNC_SCHEDULES) + "}",
                   help="the schedule, in any case; PipeDream, PipeDream-2BW and PipeMare are continuous: their table "
                   "is a stream of --batches batches, F1.3 the forward of batch 1's micro-batch 3, B1.3+U1 its "
                   "backward then batch 1's update (default: %(default)s)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=8, help="micro-batches per mini-batch (default: %(default)s)")
    p.add_argument("--stages-per-worker", type=int, default=1,
                   help="stages on each worker: any divisor of STAGES for Interleaved1F1B and InterleavedZeroBubble "
                   "(stage j on worker j mod (STAGES / STAGES_PER_WORKER)), 2 for ZBVZeroBubble and DualPipeV "
                   "(in a V) (default: %(default)s)")
    p.add_argument("--costs", type=_costs, default={}, metavar="KIND=TICKS,...",
                   help="durations of F, B, I, W for the bubble line, e.g. F=1,I=1,W=1,B=2 to weigh a fused "
                   "backward as its two halves, and U, a continuous schedule's update; the table is drawn at unit "
                   "costs (default: 1 each, U 0)")
    p.add_argument("--batches", type=int, metavar="T",
                   help=f"batches in the stream of a continuous schedule ({', '.join(ASYNC_SCHEDULES)}), each of "
                   f"CHUNKS micro-batches; a synchronous schedule prints one step (default: {STREAM_BATCHES})")
    p.add_argument("--vertical-sync", action="store_true",
                   help="PipeDream only: every stage runs a batch on the weight version stage 0 uses (default: off)")


def _costs(text: str) -> dict[str, float]:
    costs = {}
    for item in filter(None, text.split(",")):
        kind, _, value = item.partition("=")
        kind = kind.strip().upper()
        try:
            costs[kind] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"costs are KIND=TICKS pairs such as F=1,B=2, got {item!r}") from None
        if kind not in ("F", "B", "I", "W", "U") or costs[kind] < 0 or (costs[kind] == 0 and kind != "U"):
            raise argparse.ArgumentTypeError(f"costs are positive durations of F, B, I or W (U's may be 0), got "
                                             f"{item!r}")
    return costs


#: The batches ``python -m rrefpipe schedule`` streams under a continuous schedule without ``--batches``.
STREAM_BATCHES = 4


def _print_schedule(args: argparse.Namespace) -> None:
    """The ``schedule`` command: the orders' table, the bubble and the in-flight peaks."""
    name, n, m, v = args.schedule, args.stages, args.chunks, args.stages_per_worker
    check_schedule(name, n, m, v)
    if is_async(name):
        _print_stream(args)
        return
    if args.batches is not None or args.vertical_sync:
        raise ValueError(f"--batches and --vertical-sync are for the continuous schedules "
                         f"({', '.join(ASYNC_SCHEDULES)}): {name} drains the pipeline after each batch, so its orders "
                         f"are one step's")
    orders = worker_orders(name, n, m, v)
    layout = stage_layout(name, n, v)
    how = (" in a V" if is_v_shaped(name) else "") if v > 1 else ""
    placed = "; ".join(f"worker {w}: stages {', '.join(str(j) for j in range(n) if layout[j] == w)}"
                       for w in range(len(orders))) if v > 1 else ""
    print(f"{name}: {n} stages on {len(orders)} workers{how}, {m} micro-batches" + (f" ({placed})" if placed else ""))
    print(format_orders(orders))
    _print_bubbles(orders, args.costs, {"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0})
    print(f"micro-batches in flight at most, per stage: {peak_in_flight(orders, n)}"
          + (f"; per worker (all its stages): {worker_peaks(orders, n)}" if v > 1 else ""))


def _print_bubbles(orders: Sequence[Sequence[Action]], costs: dict[str, float], defaults: dict[str, float]) -> None:
    """The makespan and bubble at unit costs and, if given, at ``costs`` (listed over ``defaults``)."""
    unit: dict[str, float] = {}
    for given in [unit] + ([costs] if costs else []):
        sim = simulate(orders, given)
        listed = ", ".join(f"{k}={c:g}" for k, c in {**defaults, **given}.items())
        print(f"at {'costs ' + listed if given else 'unit costs'}: {sim.makespan:g} ticks, bubble {sim.bubble:.1%}")


def _print_stream(args: argparse.Namespace) -> None:
    """The ``schedule`` command under a continuous schedule: the stream's table over ``--batches``
    batches, its bubble against as many flushed 1F1B steps, and per stage the weight version each
    batch uses and the weight buffers the stage keeps."""
    name, n, m, vs = args.schedule, args.stages, args.chunks, args.vertical_sync
    batches = STREAM_BATCHES if args.batches is None else args.batches
    if batches < 1:
        raise ValueError(f"--batches must be at least 1, got {batches}")
    orders = stream_orders(name, n, m, batches, vertical_sync=vs)
    print(f"{name}: {n} stages on {n} workers, {batches} batch{'es' if batches > 1 else ''} of {m} "
          f"micro-batch{'es' if m > 1 else ''}"
          + (", vertical sync" if vs else ""))
    print(format_orders(orders))
    _print_bubbles(orders, args.costs, {"F": 1.0, "B": 1.0, "U": 0.0})
    stream, flushed = simulate(orders, args.costs).makespan, batches * simulate(worker_orders("1F1B", n, m),
                                                                                args.costs).makespan
    print(f"{batches} flushed 1F1B steps take {flushed:g} ticks{' at these costs' if args.costs else ''}: the stream "
          f"is {flushed / stream:.3f}x as fast")
    print(f"micro-batches in flight at most, per stage: {peak_in_flight(orders, n)}")
    if name == "PipeMare":
        print("weight versions (updates applied) each forward sees, a batch's micro-batches joined by commas; "
              "every backward of batch t sees t:")
    else:
        print(f"weight versions (updates applied) each batch's forwards and backwards use, batches 0 to {batches - 1}:")
    for j in range(n):
        buffers = weight_buffers(name, n, j, m, vertical_sync=vs)
        print(f"  stage {j}: {' '.join(_versions(name, t, j, n, m, vs) for t in range(batches))} "
              f"({buffers} weight buffer{'s' if buffers > 1 else ''})")
    if name == "PipeDream-2BW" and m < n - 1:
        print(f"with chunks < stages - 1, a first forward waits for its version (batch t needs U(t - 2)) on stages "
              f"{', '.join(str(j) for j in range(n) if n - 1 - j > m)}: use chunks >= {n - 1} to stream at full speed")


def _versions(name: str, t: int, j: int, n: int, m: int, vertical_sync: bool) -> str:
    """Batch t's weight version on stage j; under PipeMare, each of its forwards', comma-joined."""
    if name == "PipeMare":
        return ",".join(str(pipemare_forward_version(t, i, j, n, m)) for i in range(m))
    return str(weight_version(name, t, j, n, m, vertical_sync=vertical_sync))


def parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per task, each listed once in ``--help``."""
    p = argparse.ArgumentParser(prog="python -m rrefpipe", formatter_class=HelpFormatter,
                                description="rrefpipe's commands; `python -m rrefpipe COMMAND --help` lists a "
                                "command's flags.")
    sub = p.add_subparsers(dest="command", title="commands", required=True)
    sub.add_parser("demo", add_help=False,
                   help="the smallest end-to-end job: an MLP trained on local stage workers, checked against plain "
                   "PyTorch (examples/demo.py)")
    sub.add_parser("tutorial", add_help=False,
                   help="the GPipe tutorial: a ResNet-style classifier on scikit-learn's digits, trained plainly and "
                   "through the pipeline (examples/tutorial.py; needs pip install -e '.[tutorial]')")
    _timeline_parser(sub)
    _schedule_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser_ = parser()
    args, rest = parser_.parse_known_args(argv)
    if args.command in ("demo", "tutorial"):
        _run_example(args.command, rest)
    elif rest:
        parser_.error(f"unrecognized arguments: {' '.join(rest)}")
    elif args.command == "schedule":
        try:
            _print_schedule(args)
        except ValueError as exc:
            parser_.exit(2, f"python -m rrefpipe schedule: {exc}\n")
    else:
        try:
            _check_timeline(args)
        except ValueError as exc:
            parser_.exit(2, f"python -m rrefpipe timeline: {exc}\n")
        try:
            _timeline(args)
        except ImportError as exc:  # matplotlib missing: the JSON trace is written, the picture is not
            raise SystemExit(f"python -m rrefpipe timeline: {exc}") from None


if __name__ == "__main__":
    main()
