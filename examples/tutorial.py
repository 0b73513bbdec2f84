"""The GPipe tutorial: a ResNet-style classifier on scikit-learn's digits, trained plainly and through rrefpipe.

    pip install -e '.[tutorial]'
    python examples/tutorial.py --stages 2 --chunks 4 --balance-by time --epochs 8
    python examples/tutorial.py --mode pipe --checkpoint never --timeline out/tutorial   # + a schedule plot

The data (1,797 8x8 handwritten digits) ships with scikit-learn: nothing is downloaded. Both runs start
from the same weights and see the same batches; at the end the script prints held-out accuracy,
throughput and memory: per stage worker the peak bytes kept for backward and the peak RSS (on CUDA,
allocated/reserved). Try --balance-by time|size|uniform, --chunks, --batch-size and --checkpoint.
Micro-batches normalise BatchNorm over fewer samples than the plain run, so the two runs agree within
noise, not bit for bit.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.optim import DistributedOptimizer

from rrefpipe import Pipe, memory
from rrefpipe.__main__ import CHECKPOINT_HELP
from rrefpipe.balance import balance_cost, layer_sizes, layer_times, stage_costs
from rrefpipe.partition import uniform_balance

try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from tqdm import tqdm
except ImportError as exc:  # pragma: no cover - the message is the point
    raise SystemExit(f"the tutorial needs scikit-learn and tqdm ({exc}): pip install -e '.[tutorial]'") from None

CLASSES = 10


class ResidualBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the shortcut (a 1x1 projection when the shape changes), then ReLU.
    The residual stays inside the block, so the block is one layer of the nn.Sequential."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet(width: int, blocks: int) -> nn.Sequential:
    """stem, ``blocks`` blocks at 8x8, a strided block to 4x4, ``blocks - 1`` more, pooled linear head."""
    layers: list[nn.Module] = [nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    layers += [ResidualBlock(width, width) for _ in range(blocks)]
    layers += [ResidualBlock(width, 2 * width, stride=2)]
    layers += [ResidualBlock(2 * width, 2 * width) for _ in range(blocks - 1)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, CLASSES)]
    return nn.Sequential(*layers)


def digits(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Train/held-out split (80/20, stratified) of the digits as standardised 1x8x8 images."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(torch.arange(len(y)).numpy(), test_size=0.2, random_state=seed,
                                           stratify=y.numpy())
    x_train, x_test = x[idx_train], x[idx_test]
    mean, std = x_train.mean(), x_train.std()
    return (x_train - mean) / std, y[idx_train], (x_test - mean) / std, y[idx_test]


def batches(x: Tensor, y: Tensor, batch_size: int, epoch: int, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
    """The same shuffled batches for both runs."""
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    for k in range(0, len(y), batch_size):
        yield x[order[k:k + batch_size]], y[order[k:k + batch_size]]


@dataclass
class Result:
    mode: str
    accuracy: float = 0.0
    samples_per_s: float = 0.0
    steps: int = 0
    final_loss: float = 0.0
    balance: list[int] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)


def train(mode: str, step: Callable[[Tensor, Tensor], float], data: tuple[Tensor, Tensor, Tensor, Tensor],
          args: argparse.Namespace, before_last: Callable[[], object] = lambda: None) -> Result:
    """Run the epochs with ``step(x, y) -> loss``; tqdm shows samples/s. Evaluation is separate."""
    x_train, y_train = data[0], data[1]
    result = Result(mode)
    per_epoch = (len(y_train) + args.batch_size - 1) // args.batch_size
    total = min(args.epochs * per_epoch, args.max_steps or args.epochs * per_epoch)
    elapsed, seen = 0.0, 0
    for epoch in range(args.epochs):
        bar = tqdm(total=min(per_epoch, total - result.steps) * args.batch_size, unit="samples", unit_scale=True,
                   desc=f"{mode} epoch {epoch + 1}", leave=False, disable=args.no_progress)
        start = time.perf_counter()
        for x, y in batches(x_train, y_train, args.batch_size, epoch, args.seed):
            if result.steps == total:
                break
            if result.steps == total - 1:
                before_last()
            result.final_loss = step(x, y)
            result.steps += 1
            bar.update(len(y))
            bar.set_postfix(loss=f"{result.final_loss:.3f}")
            seen += len(y)
        elapsed += time.perf_counter() - start
        bar.close()
        print(f"{mode:>5} epoch {epoch + 1}: loss {result.final_loss:.4f}, {seen / elapsed:7.1f} samples/s", flush=True)
        if result.steps == total:
            break
    result.samples_per_s = seen / elapsed
    return result


def accuracy(forward: Callable[[Tensor], Tensor], x: Tensor, y: Tensor) -> float:
    with torch.no_grad():
        return float((forward(x).argmax(1) == y).float().mean())


def mixed_precision(args: argparse.Namespace) -> torch.autocast:
    """bfloat16 autocast around the forward with --bf16, else a region that changes nothing."""
    return torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.bf16)


def run_plain(model: nn.Sequential, data: tuple[Tensor, Tensor, Tensor, Tensor], args: argparse.Namespace) -> Result:
    device = torch.device(args.device if args.device == "cpu" else "cuda:0")
    model = model.to(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"plain: one process, {torch.get_num_threads()} intra-op threads, on {device}")
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    memory.start_tracking()

    def step(x: Tensor, y: Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        with mixed_precision(args):
            out = model(x.to(device))
        loss = F.cross_entropy(out.float(), y.to(device))
        loss.backward()
        if args.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        opt.step()
        return loss.item()

    result = train("plain", step, data, args)
    model.eval()
    result.accuracy = accuracy(lambda x: model(x.to(device)).cpu(), data[2], data[3])
    result.memory = [asdict(memory.local_report())]
    memory.stop_tracking()
    return result


def choose_balance(model: nn.Sequential, x: Tensor, args: argparse.Namespace, device: str) -> list[int]:
    """Layers per stage by measured time, by memory, or evenly; prints the cost per stage."""
    if args.balance_by == "uniform":
        return uniform_balance(len(model), args.stages)
    sample = x[:args.batch_size]
    if args.balance_by == "time":
        costs = layer_times(model, sample.chunk(args.chunks)[0], timeout=args.profile_seconds, device=device)
        unit, scale = "ms", 1e3
    else:
        costs = [float(c) for c in layer_sizes(model, sample, chunks=args.chunks, device=device)]
        unit, scale = "KiB", 1 / 1024
    balance = balance_cost(costs, args.stages)
    shown = ", ".join(f"{c * scale:.2f}" for c in stage_costs(costs, balance))
    print(f"balance by {args.balance_by}: {balance} (cost per stage, {unit}: {shown})")
    return balance


def run_pipe(model: nn.Sequential, data: tuple[Tensor, Tensor, Tensor, Tensor], args: argparse.Namespace) -> Result:
    gpus = torch.cuda.device_count()
    devices = ["cpu"] * args.stages if args.device == "cpu" else [f"cuda:{j % gpus}" for j in range(args.stages)]
    balance = choose_balance(model, data[0], args, devices[0])
    with Pipe(model, chunks=args.chunks, checkpoint=args.checkpoint, balance=balance, devices=devices,
              deferred_batch_norm=args.deferred_batch_norm) as pipe:
        print("stages:", *(f"  {s}" for s in pipe.stages), sep="\n")
        names = [s.worker for s in pipe.stages]
        memory.track_workers(names)
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=args.lr, momentum=0.9)

        def step(x: Tensor, y: Tensor) -> float:
            with dist_autograd.context() as ctx:
                with mixed_precision(args):  # reaches the stages
                    out = pipe(x).local_value()
                loss = F.cross_entropy(out.float(), y)
                pipe.backward(ctx, loss)
                if args.clip_grad_norm:  # by the norm of all stages' gradients together
                    pipe.clip_grad_norm_(ctx, args.clip_grad_norm)
                opt.step(ctx)
            return loss.item()

        result = train("pipe", step, data, args, before_last=lambda: pipe.execution_record(clear=True))
        if args.timeline:
            json_path, png_path = pipe.timeline(args.timeline)
            print(f"timeline of the last step: {json_path} (open in https://ui.perfetto.dev), {png_path}")
        pipe.eval()
        result.accuracy = accuracy(lambda x: pipe(x).local_value(), data[2], data[3])
        result.memory = [asdict(r) for r in memory.worker_reports(names)]
    result.balance = balance
    return result


def report(results: list[Result], test_size: int) -> None:
    print(f"\nheld-out accuracy ({test_size} images), throughput and memory:")
    for r in results:
        print(f"  {r.mode:>5}: accuracy {r.accuracy:.4f}, {r.samples_per_s:8.1f} samples/s, {r.steps} steps, "
              f"final loss {r.final_loss:.4f}" + (f", balance {r.balance}" if r.balance else ""))
        for j, m in enumerate(r.memory):
            where = f"stage {j} on " if r.mode == "pipe" else ""
            print(f"         {where}{memory.MemoryReport(**m)}")
    if len(results) == 2:
        diff = abs(results[0].accuracy - results[1].accuracy)
        print(f"  accuracy difference pipe vs plain: {diff * 100:.2f} points")


def parse(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    """``prog``: the name --help gives (``python -m rrefpipe tutorial`` passes its own)."""
    return parser(prog).parse_args(argv)


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["plain", "pipe", "both"], default="both",
                   help="train in one process, through the pipeline, or both for comparison (default: both)")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages = local worker processes (default: 2)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch (default: 4)")
    p.add_argument("--batch-size", type=int, default=64, help="mini-batch size (default: 64)")
    p.add_argument("--checkpoint", choices=["always", "except_last", "never"], default="except_last",
                   help=CHECKPOINT_HELP)
    p.add_argument("--balance-by", choices=["time", "size", "uniform"], default="time",
                   help="layers per stage from measured forward+backward time, from memory (activations + "
                        "2x parameters), or evenly by layer count (default: time)")
    p.add_argument("--profile-seconds", type=float, default=0.5,
                   help="how long --balance-by time profiles the layers (default: 0.5)")
    p.add_argument("--epochs", type=int, default=8, help="passes over the 1,437 training images (default: 8)")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop each run after this many steps (default: 0, no limit)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu, or cuda: stage j on GPU j modulo the GPU count; the plain run on cuda:0 "
                        "(default: cpu)")
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads of the plain run (default: 0, PyTorch's default, all cores; each local "
                        "stage worker gets cores / stages)")
    p.add_argument("--width", type=int, default=16, help="channels of the first blocks (default: 16)")
    p.add_argument("--blocks", type=int, default=2, help="residual blocks per resolution (default: 2)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default: 0.05)")
    p.add_argument("--bf16", action="store_true", help="forward under torch.autocast in bfloat16 (both runs)")
    p.add_argument("--clip-grad-norm", type=float, default=0.0, metavar="MAX",
                   help="clip the gradients' total norm to MAX before each step (default: 0, no clipping)")
    p.add_argument("--seed", type=int, default=0, help="weights, split and batch order (default: 0)")
    p.add_argument("--deferred-batch-norm", action="store_true",
                   help="pipe: BatchNorm running statistics over the whole mini-batch, not per micro-batch")
    p.add_argument("--timeline", metavar="PREFIX", default=None,
                   help="pipe: write the last step's schedule to PREFIX.json (Chrome/Perfetto) and PREFIX.png")
    p.add_argument("--results-json", metavar="PATH", default=None, help="also write the results as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (epoch lines still print)")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> list[Result]:
    args = parse(argv, prog)
    torch.manual_seed(args.seed)
    data = digits(args.seed)
    model = resnet(args.width, args.blocks)
    print(f"digits: {len(data[1])} training and {len(data[3])} held-out 8x8 images; model: {len(model)} layers, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")
    results = []
    if args.mode in ("plain", "both"):
        results.append(run_plain(copy.deepcopy(model), data, args))
    if args.mode in ("pipe", "both"):
        results.append(run_pipe(model, data, args))
    report(results, len(data[3]))
    if args.results_json:
        with open(args.results_json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return results


if __name__ == "__main__":
    main()
