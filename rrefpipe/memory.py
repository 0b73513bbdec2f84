"""Memory of a stage worker: bytes kept for backward (saved-tensor hooks), peak RSS, CUDA statistics.

Tracking is process-wide and runs *on the worker*: the driver asks each stage worker over RPC::

    from rrefpipe import memory
    names = [s.worker for s in pipe.stages]
    memory.track_workers(names)           # before training
    ...                                   # train
    for r in memory.worker_reports(names):
        print(r)                          # worker2: peak kept for backward 1.2 MiB, peak RSS 310.5 MiB

"Kept for backward" counts, while they are alive, the tensors autograd saves during the forward of a stage
(every storage once, parameters and buffers left out), and the inputs that checkpointing keeps in place
of the activations of a checkpointed micro-batch. The activations a checkpointed micro-batch recomputes
live only around its backward (on a stage that recomputes ahead, from when the stage starts waiting for
that gradient: one micro-batch at a time) and are not counted. Under a schedule that splits backward,
the gradients its first half keeps for the second are counted too (:func:`count_kept`).
"""
from __future__ import annotations

import resource
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor, nn
from torch.nn.modules import module as module_hooks

from . import _rpc
from .balance.profile import storage_bytes, storage_key

__all__ = ["MemoryReport", "start_tracking", "stop_tracking", "count_kept", "local_report", "track_workers", "worker_reports",
           "format_bytes"]

StorageKey = tuple[str, int]


def format_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@dataclass(frozen=True)
class MemoryReport:
    """One process's memory. Bytes; ``None`` where not measured (no tracking, no CUDA)."""

    worker: str
    peak_rss: int
    saved_peak: int | None
    saved_now: int | None
    cuda_allocated: int | None  # peak torch.cuda.max_memory_allocated, summed over devices
    cuda_reserved: int | None

    def __str__(self) -> str:
        parts = [f"{self.worker}: peak kept for backward {format_bytes(self.saved_peak)}",
                 f"peak RSS {format_bytes(self.peak_rss)}"]
        if self.cuda_allocated is not None:
            parts.append(f"CUDA peak allocated {format_bytes(self.cuda_allocated)}, "
                         f"reserved {format_bytes(self.cuda_reserved)}")
        return ", ".join(parts)


class _Held:
    """What autograd stores instead of a saved tensor: the tensor without its graph (no reference cycle)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


def _other_hooks_active() -> bool:
    """True inside checkpointing (or anyone's saved-tensor hooks): ours must then stay out, since only the
    innermost pair of hooks applies. PyTorch has no public query; when this one is missing, assume so."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return True if top is None else top(False) is not None


class _Tracker:
    """Live bytes per storage, refcounted by the holders autograd keeps; the peak of their sum."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: dict[StorageKey, list[int]] = {}  # key -> [holders, bytes]
        self.now = self.peak = 0
        self.local = threading.local()
        self.handles = [module_hooks.register_module_forward_pre_hook(self._enter),
                        module_hooks.register_module_forward_hook(self._exit, always_call=True)]
        self.inputs: dict[int, weakref.ref[Tensor]] = {}

    def _acquire(self, key: StorageKey, nbytes: int) -> None:
        with self.lock:
            entry = self.live.setdefault(key, [0, nbytes])
            entry[0] += 1
            if entry[0] == 1:
                self.now += nbytes
                self.peak = max(self.peak, self.now)

    def _release(self, key: StorageKey) -> None:
        with self.lock:
            entry = self.live[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.now -= entry[1]
                del self.live[key]

    def _keep(self, obj: object, key: StorageKey, nbytes: int) -> None:
        self._acquire(key, nbytes)
        weakref.finalize(obj, self._release, key)

    def _enter(self, module: nn.Module, args: Any) -> None:
        depth = getattr(self.local, "depth", 0)
        self.local.depth = depth + 1
        if depth > 0 or not torch.is_grad_enabled():
            return
        if _other_hooks_active():  # a checkpointed micro-batch: its inputs are what stays
            self._keep_inputs(args)
            return
        own = {storage_key(t) for t in [*module.parameters(), *module.buffers()]}
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, own), lambda h: h.tensor)
        hooks.__enter__()
        self.local.hooks = hooks

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.local.depth -= 1
        hooks = getattr(self.local, "hooks", None)
        if self.local.depth == 0 and hooks is not None:
            self.local.hooks = None
            hooks.__exit__()

    def _pack(self, t: Tensor, own: set[StorageKey]) -> Any:
        key = storage_key(t)
        if key in own:
            return _Held(t.detach())
        held = _Held(t.detach())
        self._keep(held, key, storage_bytes(t))
        return held

    def _keep_inputs(self, args: Any) -> None:
        flat = [a for arg in args for a in (arg if isinstance(arg, (tuple, list)) else (arg,))]
        for t in flat:
            if isinstance(t, Tensor) and t.numel() and id(t) not in self.inputs:  # not again in recompute
                self.inputs[id(t)] = weakref.ref(t)
                weakref.finalize(t, self.inputs.pop, id(t), None)
                self._keep(t, storage_key(t), storage_bytes(t))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


_tracker: _Tracker | None = None


def start_tracking() -> None:
    """Start counting bytes kept for backward in this process; when already counting, restart the peak
    from now (a worker may serve several pipes). Runs on a worker via RPC."""
    global _tracker
    if _tracker is None:
        _tracker = _Tracker()
    else:
        with _tracker.lock:
            _tracker.peak = _tracker.now


def count_kept(tensors: list[Tensor]) -> None:
    """Count ``tensors`` as kept for backward while they live, where autograd does not save them: the
    gradients a split backward keeps between its halves (:mod:`rrefpipe.stage_side.backward_split`)."""
    tracker = _tracker
    if tracker is not None:
        for t in tensors:
            tracker._keep(t, storage_key(t), storage_bytes(t))


def stop_tracking() -> None:
    """Stop what :func:`start_tracking` started in this process (nothing if it is not tracking)."""
    global _tracker
    if _tracker is not None:
        _tracker.close()
        _tracker = None


def _peak_rss() -> int:
    """This process's peak resident set size in bytes. On Linux ``VmHWM`` of /proc/self/status: getrusage's
    ``ru_maxrss`` carries over the parent's peak through fork and exec, so a worker started by a big driver
    would report the driver's."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def _cuda() -> tuple[int | None, int | None]:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None, None
    devices = range(torch.cuda.device_count())
    return (sum(torch.cuda.max_memory_allocated(d) for d in devices),
            sum(torch.cuda.max_memory_reserved(d) for d in devices))


def local_report(reset: bool = False) -> MemoryReport:
    """This process's memory; ``reset`` restarts the peaks of kept bytes (and CUDA's) from now."""
    name = rpc.get_worker_info().name if _rpc.is_initialized() else "this process"
    saved_peak = saved_now = None
    if _tracker is not None:
        with _tracker.lock:
            saved_peak, saved_now = _tracker.peak, _tracker.now
            if reset:
                _tracker.peak = _tracker.now
    allocated, reserved = _cuda()
    if reset and allocated is not None:
        for d in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(d)
    return MemoryReport(name, _peak_rss(), saved_peak, saved_now, allocated, reserved)


def track_workers(workers: list[str]) -> None:
    """Start tracking on each named worker (call before training)."""
    for future in [rpc.rpc_async(w, start_tracking) for w in workers]:
        _rpc.wait(future)


def worker_reports(workers: list[str], reset: bool = False) -> list[MemoryReport]:
    """Each named worker's :func:`local_report`, in order."""
    return [_rpc.wait(future) for future in [rpc.rpc_async(w, local_report, args=(reset,)) for w in workers]]
