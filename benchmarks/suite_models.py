"""The benchmark suite's models: one ``ModelSpec`` per model, rebuilt identically from a seed in any process.

Every contestant (plain PyTorch, torch.distributed.pipelining, rrefpipe) builds its model with
``spec.build()`` and its data with ``spec.data()``, so all see the same weights, batch and split. The
classes here reach rrefpipe's stage workers by value (``register_pickle_by_value`` in
``bench_suite``), so the workers need not import this file.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SEED = 0


class ResidualBlock(nn.Module):
    """conv-bn-relu-conv-bn plus the input (a 1x1 strided projection where the shape changes), then relu."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


def build_mlp() -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(2048, 2048), nn.ReLU())])


def build_resnet() -> nn.Sequential:
    torch.manual_seed(SEED)
    stem = [nn.Conv2d(3, 24, 3, 1, 1, bias=False), nn.BatchNorm2d(24), nn.ReLU()]
    blocks = [ResidualBlock(24, 24), ResidualBlock(24, 24), ResidualBlock(24, 48, 2), ResidualBlock(48, 48),
              ResidualBlock(48, 96, 2), ResidualBlock(96, 96)]
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(96, 10)]
    return nn.Sequential(*stem, *blocks, *head)


def build_tiny() -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])


def build_transformer() -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(*[nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
                           for _ in range(6)])


@dataclass(frozen=True)
class ModelSpec:
    """A model, its mini-batch and loss, and the layers per stage for each number of stages."""

    name: str
    description: str
    build: Callable[[], nn.Sequential]
    batch: int
    input_shape: tuple[int, ...]          # one sample
    loss: str                              # 'ce' (target: class index) or 'mse' (target: like the output)
    classes: int = 0
    balances: dict[int, list[int]] = field(default_factory=dict)

    def data(self, seed: int = SEED) -> tuple[Tensor, Tensor]:
        """The mini-batch ``(x, y)``, identical in every process."""
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(self.batch, *self.input_shape, generator=gen)
        if self.loss == "ce":
            return x, torch.randint(0, self.classes, (self.batch,), generator=gen)
        return x, torch.randn(self.batch, *self.input_shape, generator=gen)  # the output has the input's shape

    def loss_fn(self) -> Callable[[Tensor, Tensor], Tensor]:
        return F.cross_entropy if self.loss == "ce" else F.mse_loss

    def balance(self, stages: int) -> list[int]:
        if stages not in self.balances:
            raise ValueError(f"model {self.name!r} has no balance for {stages} stages (has {sorted(self.balances)})")
        return self.balances[stages]


# Balances: the MLP splits whole Linear+ReLU blocks; the others were split with
# rrefpipe.balance.balance_by_time on this machine (1 thread) and then fixed, so every run uses the same.
SPECS: dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", "8 x (Linear(2048, 2048) + ReLU), batch 256, cross-entropy", build_mlp, 256, (2048,),
                     "ce", 2048, {2: [8, 8], 3: [6, 6, 4]}),
    "resnet": ModelSpec("resnet", "ResNet-style: stem + 6 residual blocks (24-48-96 ch) + head, 3x32x32, batch 64, "
                        "cross-entropy", build_resnet, 64, (3, 32, 32), "ce", 10, {2: [5, 7], 3: [4, 2, 6]}),
    "transformer": ModelSpec("transformer", "6 x TransformerEncoderLayer(d=256, 4 heads, ff 1024), seq 32, batch 32, "
                             "MSE", build_transformer, 32, (32, 256), "mse", 0, {2: [3, 3], 3: [2, 2, 2]}),
    # Next to no compute: what a step costs each framework per micro-batch (not in the default run).
    "tiny": ModelSpec("tiny", "6 x Linear(64, 64), batch 256, MSE (framework overhead)", build_tiny, 256, (64,),
                      "mse", 0, {2: [3, 3], 3: [2, 2, 2]}),
}
DEFAULT_MODELS = ("mlp", "resnet", "transformer")


def split(model: nn.Sequential, balance: list[int]) -> list[nn.Sequential]:
    """The stages of ``model`` (views sharing its layers), ``balance[j]`` layers each."""
    out: list[nn.Sequential] = []
    offset = 0
    for size in balance:
        out.append(model[offset:offset + size])  # type: ignore[arg-type]  # a slice of a Sequential is one
        offset += size
    return out


def boundary_shapes(spec: ModelSpec, stages: int) -> list[tuple[int, ...]]:
    """Shape of each stage's input for the whole mini-batch (stage 0: the model input)."""
    x, _ = spec.data()
    shapes = []
    with torch.no_grad():
        for part in split(spec.build(), spec.balance(stages)):
            shapes.append(tuple(x.shape))
            x = part(x)
    return shapes
