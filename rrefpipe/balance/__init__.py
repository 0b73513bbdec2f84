"""Automatic balancing: layer counts per stage from profiled per-layer time or memory.

    from rrefpipe.balance import balance_by_time
    balance = balance_by_time(4, model, sample)          # e.g. [3, 5, 6, 2]
    pipe = Pipe(model, chunks=8, balance=balance)

or ``Pipe(model, chunks=8, balance="time", sample=sample, devices=[...])``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..microbatch import TensorOrTensors, scatter
from .partition import check_partitions, solve, stage_costs
from .profile import layer_sizes, layer_times

__all__ = ["balance_by_time", "balance_by_size", "balance_cost", "layer_times", "layer_sizes", "stage_costs",
           "balance_for_pipe"]

BALANCE_MODES = ("time", "size")


def balance_cost(costs: Sequence[float], partitions: int) -> list[int]:
    """Layer counts per stage minimising the largest stage's summed cost (exact; see ``partition.solve``)."""
    return solve(costs, partitions)


def _layer_count(module: object) -> int:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"balancing profiles an nn.Sequential layer by layer, got {type(module).__name__}")
    return len(module)


def balance_by_time(partitions: int, module: nn.Sequential, sample: TensorOrTensors, *, timeout: float = 1.0,
                    device: str | torch.device | None = None, spread: bool = False) -> list[int]:
    """Layer counts per stage that minimise the slowest stage's forward+backward time on ``sample``.

    ``sample`` is what one stage sees at a time: a micro-batch (a tensor or a tuple of tensors). Each layer
    is timed on its own, forward then backward, over repeated passes for about ``timeout`` seconds, on
    deep copies on ``device`` (default: where the module's parameters are, else the CPU). The module's
    parameters, gradients, training flag and the RNG state are unchanged afterwards. Each layer is called
    as in a pipe (:mod:`rrefpipe.calling`): a tuple whole, or spread for a layer that requires several
    arguments; ``spread=True`` spreads every tuple, as a pipe called with several inputs does (``sample``
    then is the tuple of them).

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: more ``partitions`` than layers; parameters that already have gradients.
    """
    check_partitions(partitions, _layer_count(module))
    return solve(layer_times(module, sample, timeout=timeout, device=device, spread=spread), partitions)


def balance_by_size(partitions: int, module: nn.Sequential, input: TensorOrTensors, *,  # noqa: A002
                    chunks: int = 1, param_scale: float = 2.0, device: str | torch.device | None = None,
                    spread: bool = False) -> list[int]:
    """Layer counts per stage that minimise the largest stage's memory: activations + parameters.

    ``input`` is a mini-batch as given to the pipe, split into ``chunks`` micro-batches; one micro-batch
    is measured. Per layer: the activation bytes it keeps (CUDA: growth of ``memory_allocated`` over its
    forward; CPU: bytes saved for backward, via saved-tensor hooks) plus ``param_scale`` times its
    parameter bytes (2: weights and gradients; 4 for Adam's two extra moments). Runs on deep copies; the
    module and the RNG state are unchanged. Layers are called as in :func:`balance_by_time` (``spread``).

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: more ``partitions`` than layers; parameters that already have gradients.
    """
    check_partitions(partitions, _layer_count(module))
    sizes = layer_sizes(module, input, chunks=chunks, param_scale=param_scale, device=device, spread=spread)
    return solve(sizes, partitions)


def balance_for_pipe(mode: str, module: nn.Sequential, sample: TensorOrTensors | None, *, chunks: int,
                     workers: Sequence[str] | None, devices: Sequence[str | torch.device] | None,
                     spread: bool = False) -> list[int]:
    """``Pipe(balance='time' | 'size', sample=...)``: one stage per device (or else per worker named),
    profiled on the first stage's device (default: where the module is) with the pipe's ``chunks``; ``spread``
    for ``call_style='2.x'``."""
    if mode not in BALANCE_MODES:
        raise ValueError(f"balance must be a list of layer counts, 'time' or 'size', got {mode!r}")
    if sample is None:
        raise ValueError(f"balance={mode!r} profiles the layers on an example input: pass sample=<a mini-batch>")
    if devices is not None:
        partitions, device = len(devices), torch.device(devices[0]) if devices else None
    elif workers is not None:
        partitions, device = len(workers), None
    else:
        raise ValueError(f"balance={mode!r} needs the number of stages: pass devices=[...] or workers=[...], "
                         "one per stage")
    if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        if mode == "time":
            raise ValueError("balance='time' times each layer's forward and backward, which needs real weights, and "
                             "this model is on the meta device: use balance='size' (measured on the meta device) or "
                             "give balance as layer counts")
        device = torch.device("meta")  # sizes of a model that has no memory: measured there
    if mode == "time":
        return balance_by_time(partitions, module, scatter(sample, chunks)[0], device=device, spread=spread)
    return balance_by_size(partitions, module, sample, chunks=chunks, device=device, spread=spread)
