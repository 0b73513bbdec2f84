"""Measuring each layer of an ``nn.Sequential`` on a sandboxed copy: forward+backward time, memory."""
from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from .. import microbatch
from ..calling import run_layers
from ..microbatch import TensorOrTensors
from ..skip.tracker import DetachingTracker, use_tracker

__all__ = ["layer_times", "layer_sizes", "sandbox", "resolve_device", "param_bytes", "storage_key", "storage_bytes"]


def resolve_device(module: nn.Module, device: str | torch.device | None) -> torch.device:
    """``device``, or else where the module's first parameter is, or else the CPU."""
    if device is not None:
        return torch.device(device)
    first = next(iter([*module.parameters(), *module.buffers()]), None)
    return first.device if first is not None else torch.device("cpu")


def _check_module(module: object) -> nn.Sequential:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"balancing profiles an nn.Sequential layer by layer, got {type(module).__name__}")
    if len(module) == 0:
        raise ValueError("cannot balance an empty nn.Sequential")
    with_grads = [name for name, p in module.named_parameters() if p.grad is not None]
    if with_grads:
        shown = ", ".join(with_grads[:5]) + (", ..." if len(with_grads) > 5 else "")
        raise ValueError(f"{len(with_grads)} parameters already have gradients ({shown}); profiling runs backward "
                         "and would copy them: call module.zero_grad(set_to_none=True) first (some parameter already "
                         "has gradient)")
    return module


@contextmanager
def sandbox(module: nn.Sequential, device: torch.device) -> Iterator[Callable[[], Iterator[nn.Module]]]:
    """A maker of passes over the layers: each pass yields a deep copy of one layer at a time, on ``device``
    in training mode, made when it is reached; a copy lives until the caller moves on. Balancing is for
    models too large for one device: the whole model never goes to ``device`` at once. The RNG state
    (torch, and CUDA for a CUDA device) is restored on exit; ``module`` itself (parameters, gradients,
    training flag) is never touched."""
    _check_module(module)
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []

    def copies() -> Iterator[nn.Module]:
        for layer in module:
            yield copy.deepcopy(layer).to(device).train()

    with torch.random.fork_rng(devices=cuda):
        yield copies


def _prepare(sample: TensorOrTensors, device: torch.device, where: str) -> TensorOrTensors:
    """Own copies on ``device`` (a micro-batch reaches a stage as a tensor of its own, not a view)."""
    microbatch.check(sample, where)
    if isinstance(sample, list):
        sample = tuple(sample)
    return microbatch.apply(lambda t: t.detach().to(device, copy=True).requires_grad_(t.requires_grad), sample)


def _detach(value: object, where: str) -> TensorOrTensors:
    microbatch.check(value, where)
    if isinstance(value, list):
        value = tuple(value)
    return microbatch.apply(microbatch.detached, value)  # type: ignore[arg-type]


def _own_copy(value: TensorOrTensors) -> TensorOrTensors:
    """A layer's input: a copy of ``value`` (the previous layer's output, detached). Autograd refuses
    in-place changes of a leaf that requires grad, and a layer may change its input in place whether it
    says so (``nn.ReLU(inplace=True)``) or not (``x.mul_(2)`` in a custom forward)."""
    return microbatch.apply(Tensor.clone, value)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _blamed_on(index: int, layer: nn.Module) -> Iterator[None]:
    """An error while profiling a layer says which one (as a note: the exception keeps its type)."""
    try:
        yield
    except Exception as exc:
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"rrefpipe.balance: raised by layer {index} ({type(layer).__name__}) while profiling it")
        raise


def _timed_pass(layers: Iterator[nn.Module], sample: TensorOrTensors, device: torch.device,
                spread: bool = False) -> list[float]:
    """One forward+backward of every layer on its own (input: the previous layer's output, detached), each
    called as in the pipe (:func:`~rrefpipe.calling.run_layers`)."""
    times = []
    value = _prepare(sample, device, "sample")
    stashes = DetachingTracker()
    for j, layer in enumerate(layers):
        value = _own_copy(value)  # not timed
        _sync(device)
        start = time.perf_counter()
        with _blamed_on(j, layer), use_tracker(stashes):
            out = run_layers((layer,), value, spread)
            value = _detach(out, f"output of layer {j}")
            outputs = [t for t in microbatch.as_tensors(out) if t.requires_grad]
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        _sync(device)
        times.append(time.perf_counter() - start)
        del out, outputs, layer  # this layer's copy and graph go before the next copy is made
    return times


def layer_times(module: nn.Sequential, sample: TensorOrTensors, *, timeout: float = 1.0,
                device: str | torch.device | None = None, spread: bool = False) -> list[float]:
    """Seconds of forward+backward per layer on ``sample``: the median over repeated passes.

    Each layer runs on its own, on a copy of the previous layer's output (detached, keeping
    ``requires_grad``; skip stashes the same), then backward from a gradient of ones on its outputs that
    require grad. One untimed warm-up pass, then
    passes until ``timeout`` seconds have gone (at least one); the median ignores passes in which another
    process took the core. Runs on copies (:func:`sandbox`). ``spread``: layers are called as in a pipe
    called with several inputs (``sample`` a tuple of them), see :mod:`rrefpipe.calling`.
    """
    if timeout < 0:
        raise ValueError(f"timeout must be non-negative seconds, got {timeout!r}")
    dev = resolve_device(module, device)
    with sandbox(module, dev) as copies:
        _timed_pass(copies(), sample, dev, spread)
        passes: list[list[float]] = []
        start = time.perf_counter()
        while not passes or time.perf_counter() - start < timeout:
            passes.append(_timed_pass(copies(), sample, dev, spread))
    return [statistics.median(per_layer) for per_layer in zip(*passes)]


def storage_key(t: Tensor) -> tuple[str, int]:
    """Identifies the memory behind a tensor (views of one storage share it). Meta tensors have no address:
    their storage object stands for it (the caller keeps the tensors alive while it compares keys)."""
    if t.is_meta:
        return "meta", t.untyped_storage()._cdata
    try:
        return str(t.device), t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage (sparse, nested)
        return str(t.device), id(t)


def storage_bytes(t: Tensor) -> int:
    """Bytes of the storage behind a tensor (all of it, also for a view)."""
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def param_bytes(layer: nn.Module) -> int:
    """Bytes of the layer's parameters (shared ones once)."""
    seen: dict[tuple[str, int], int] = {storage_key(p): storage_bytes(p) for p in layer.parameters()}
    return sum(seen.values())


def _saved_bytes(layer: nn.Module, value: TensorOrTensors, seen: set[tuple[str, int]],
                 copies: dict[tuple[str, int], Tensor], held: list[Tensor], spread: bool) -> tuple[int, object]:
    """Run ``layer`` counting the bytes autograd saves for backward: storages not counted before (``seen``),
    not parameters or buffers. ``copies``: by storage, the tensor each input copy stands for (in a pipe a
    layer's input is the previous layer's output itself, maybe a view of a larger storage). What is counted
    goes into ``held``: storages are told apart by address, which a freed one would pass on."""
    own = {storage_key(t) for t in [*layer.parameters(), *layer.buffers()]}
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        counted = copies.get(storage_key(t), t)
        key = storage_key(counted)
        if key not in own and key not in seen:
            seen.add(key)
            held.append(counted.detach())  # its storage, not its graph (which holds the layer's copy)
            total += storage_bytes(counted)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_layers((layer,), value, spread)
    return total, out


def _allocated_bytes(layer: nn.Module, value: TensorOrTensors, device: torch.device,
                     spread: bool) -> tuple[int, object]:
    """Run ``layer`` on CUDA; the bytes allocated by its forward and still held after it."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    out = run_layers((layer,), value, spread)
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device) - before, out


def layer_sizes(module: nn.Sequential, input: TensorOrTensors, *, chunks: int = 1,  # noqa: A002
                param_scale: float = 2.0, device: str | torch.device | None = None, spread: bool = False) -> list[int]:
    """Bytes per layer: activations of one micro-batch plus ``param_scale`` times its parameter bytes.

    ``input`` is a mini-batch; the first of its ``chunks`` micro-batches (``torch.chunk`` along dim 0) runs
    forward through copies of the layers (:func:`sandbox`). Activations, on CUDA: the growth of
    ``torch.cuda.memory_allocated`` across the layer's forward (its output and what autograd keeps). Elsewhere
    (CPU): the bytes of the tensors autograd saves for backward, seen with
    ``torch.autograd.graph.saved_tensors_hooks``, each storage counted once (by the first layer saving it)
    and parameters and buffers left out. ``param_scale`` counts the copies of the parameters training keeps:
    2 for the weights and their gradients (plain SGD), 3 with momentum, 4 for Adam. ``spread``: as for
    :func:`layer_times`.
    """
    if param_scale < 0:
        raise ValueError(f"param_scale must be non-negative, got {param_scale!r}")
    micro = microbatch.scatter(input, chunks)[0]
    dev = resolve_device(module, device)
    sizes, seen, copies = [], set[tuple[str, int]](), dict[tuple[str, int], Tensor]()
    held: list[Tensor] = []  # (not on CUDA) inputs and what was counted: no later tensor gets their addresses
    stashes = DetachingTracker()
    with sandbox(module, dev) as layer_copies:
        value = _prepare(micro, dev, "input")
        for j, layer in enumerate(layer_copies()):
            copied = _own_copy(value)
            for copy_, original in zip(microbatch.as_tensors(copied), microbatch.as_tensors(value)):
                copies[storage_key(copy_)] = copies.get(storage_key(original), original)
            with _blamed_on(j, layer), use_tracker(stashes):
                if dev.type == "cuda":
                    activation, out = _allocated_bytes(layer, copied, dev, spread)
                else:
                    activation, out = _saved_bytes(layer, copied, seen, copies, held, spread)
                    held.extend(t.detach() for t in microbatch.as_tensors(copied))
            sizes.append(int(activation + param_bytes(layer) * param_scale))
            value = _detach(out, f"output of layer {j}")
            del out, layer  # this layer's copy and graph go before the next copy is made
        del held
    return sizes
