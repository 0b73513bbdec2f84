"""``python -m rrefpipe``: the command line: run the demo, the tutorial, or draw a pipeline timeline."""
from __future__ import annotations

import argparse
import json
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

DESCRIPTION = """\
commands:
  demo       the smallest end-to-end job: an MLP trained on local stage workers, checked against plain
             PyTorch (examples/demo.py; its flags follow the command, `demo --help` lists them)
  tutorial   the GPipe tutorial: a ResNet-style classifier on scikit-learn's digits, trained plainly and
             through the pipeline; accuracy, samples/s, memory per stage worker (examples/tutorial.py;
             `tutorial --help` lists its flags; needs pip install -e '.[tutorial]')
  timeline   run a few steps of a small pipeline and draw its schedule: PREFIX.json (Chrome/Perfetto
             trace) and PREFIX.png (one row per stage), or redraw a saved trace (--from-json)
"""


def _run_example(name: str, argv: Sequence[str]) -> None:
    """Run ``examples/NAME.py`` as ``__main__`` with ``argv`` (the examples live in a source checkout)."""
    script = EXAMPLES / f"{name}.py"
    if not script.is_file():
        raise SystemExit(f"{script} not found: the examples are in rrefpipe's source checkout, not in the "
                         "installed package; install with `pip install -e .` from a checkout")
    saved = sys.argv
    sys.argv = [f"python -m rrefpipe {name}", *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved


def _timeline_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("timeline", help="draw the schedule of a small pipeline (or of a saved trace)",
                       description="Run a few training steps of an MLP on local stage workers and draw the last "
                       "step: PREFIX.json for chrome://tracing or https://ui.perfetto.dev, PREFIX.png with one "
                       "row per stage, one box per forward/recompute/backward of micro-batch i.")
    p.add_argument("--out", metavar="PREFIX", default="rrefpipe-timeline",
                   help="where to write PREFIX.json and PREFIX.png (default: rrefpipe-timeline)")
    p.add_argument("--from-json", metavar="TRACE", help="redraw the PNG of a trace written earlier; runs nothing")
    p.add_argument("--stages", type=int, default=3, help="pipeline stages = local worker processes (default: 3)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch (default: 4)")
    p.add_argument("--checkpoint", choices=["always", "except_last", "never"], default="except_last",
                   help="micro-batches that recompute their forward in backward (default: except_last)")
    p.add_argument("--steps", type=int, default=3, help="training steps; the last one is drawn (default: 3)")
    p.add_argument("--batch-size", type=int, default=256, help="mini-batch size (default: 256)")
    p.add_argument("--width", type=int, default=512, help="width of the MLP's layers (default: 512)")
    p.add_argument("--layers-per-stage", type=int, default=2, help="Linear+ReLU pairs per stage (default: 2)")


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

    from .pipe import Pipe

    torch.manual_seed(0)
    layers = [m for _ in range(args.stages * args.layers_per_stage)
              for m in (nn.Linear(args.width, args.width), nn.ReLU())]
    x = torch.randn(args.batch_size, args.width)
    with Pipe(nn.Sequential(*layers), chunks=args.chunks, checkpoint=args.checkpoint,
              devices=["cpu"] * args.stages) as pipe:
        for step in range(args.steps):
            if step == args.steps - 1:
                pipe.execution_record(clear=True)
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [pipe(x).local_value().square().mean()])
        json_path, png_path = pipe.timeline(args.out)
    print(f"wrote {json_path} (open in https://ui.perfetto.dev or chrome://tracing) and {png_path}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rrefpipe", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{demo,tutorial,timeline}", required=True)
    sub.add_parser("demo", add_help=False, help="run examples/demo.py (flags after the command; demo --help)")
    sub.add_parser("tutorial", add_help=False, help="run examples/tutorial.py (flags after it; tutorial --help)")
    _timeline_parser(sub)
    args, rest = parser.parse_known_args(argv)
    if args.command in ("demo", "tutorial"):
        _run_example(args.command, rest)
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    else:
        try:
            _timeline(args)
        except ImportError as exc:  # matplotlib missing: the JSON trace is written, the picture is not
            raise SystemExit(f"python -m rrefpipe timeline: {exc}") from None


if __name__ == "__main__":
    main()
