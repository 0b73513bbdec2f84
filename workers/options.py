"""TensorPipe backend options, built in one place for the driver and every stage worker."""
from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import torch
import torch.distributed.rpc as rpc

from rrefpipe._rpc import DEFAULT_RPC_TIMEOUT

__all__ = ["DEFAULT_RPC_TIMEOUT", "DRIVER_RPC_THREADS", "LOCAL_TRANSPORTS", "STAGE_INTEROP_THREADS",
           "STAGE_RPC_THREADS", "backend_options", "device_name", "init_rpc", "maps_to_later_workers",
           "parse_device_map"]

#: Transports for processes on one host. The shared-memory transport busy-polls about half a core per
#: idle process (measured on the 2-core development machine), which on a small machine steals the
#: stages' compute; "uv" (TCP) idles at 0%.
LOCAL_TRANSPORTS: tuple[str, ...] = ("uv",)

#: RPC threads of a stage worker. One thread runs every RPC body and creates every autograd node of the
#: stage's forward, so the nodes' sequence numbers (kept per thread) follow the micro-batches: the last
#: stage's backward, one autograd task for the whole step (see ``rrefpipe.driver_side.remote.deliver``), then runs
#: micro-batch m-1 first and sends each input gradient as soon as it is ready. With 16 threads the
#: order was arbitrary (8 x Linear(2048), m=8: 513-523 -> 630 ms). One thread also saves hand-offs
#: (tiny 2-stage model, m=32, per-mb outputs: 51-53 -> 44 ms). No stage body waits on an RPC, so one
#: thread cannot deadlock; a worker answers (and its pings complete) between micro-batches.
STAGE_RPC_THREADS = 1
#: Inter-op threads of a stage worker (``torch.set_num_interop_threads``, before any parallel work).
#: Distributed autograd runs the backward of each gradient message as a task on the inter-op pool; with
#: the default (one per core) the first stage ran two micro-batches' backward at once whenever gradients
#: arrived faster than it finished them, taking a core from the bottleneck stage. With one, its backward
#: runs micro-batch after micro-batch, as in GPipe (ResNet-style, 2 stages, m=16, pairs against
#: pipelining's GPipe: 213-218 -> 195-199 ms per step, 0.92-0.95 -> 1.02-1.06 of GPipe; Transformer
#: m=32: 410-424 -> 398-402 ms; MLP, ResNet m=4 and 3 stages unchanged; in the benchmark suite, where
#: the overlap had cost less, no change beyond noise).
STAGE_INTEROP_THREADS = 1
#: RPC threads of the driver, which also runs the user's code.
DRIVER_RPC_THREADS = 16

DeviceMap = Mapping[str, Mapping[str, str]]


def backend_options(
    *,
    num_worker_threads: int = DRIVER_RPC_THREADS,
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
    init_method: str | None = None,
    device_maps: DeviceMap | None = None,
    devices: Sequence[str] | None = None,
    transports: Sequence[str] | None = LOCAL_TRANSPORTS,
    channels: Sequence[str] | None = None,
) -> rpc.TensorPipeRpcBackendOptions:
    """Options for ``rpc.init_rpc``.

    ``device_maps`` is ``{peer_name: {"cuda:0": "cuda:1"}}``: tensors this worker sends to ``peer`` on
    the source device arrive on the target device, GPU to GPU. ``transports=None`` lets TensorPipe pick
    (shared memory first, then TCP); ``channels=["basic"]`` forces tensors through the transport (CMA
    copies between processes' memory directly, bypassing the network).
    """
    kwargs: dict[str, object] = {"num_worker_threads": num_worker_threads, "rpc_timeout": rpc_timeout}
    if init_method is not None:
        kwargs["init_method"] = init_method
    if transports is not None:
        kwargs["_transports"] = list(transports)
    if channels is not None:
        kwargs["_channels"] = list(channels)
    if devices is not None:
        kwargs["devices"] = [torch.device(d) for d in devices]
    options = rpc.TensorPipeRpcBackendOptions(**kwargs)  # type: ignore[arg-type]
    for peer, mapping in (device_maps or {}).items():
        options.set_device_map(peer, {torch.device(k): torch.device(v) for k, v in mapping.items()})
    return options


def device_name(device: str | torch.device) -> str:
    """One spelling per device, as stages and device maps compare them: ``"cpu"`` for any CPU device,
    ``"cuda:K"`` for a GPU (a bare ``"cuda"`` is ``"cuda:0"``)."""
    d = torch.device(device)
    return "cpu" if d.type == "cpu" else f"{d.type}:{d.index or 0}"


def maps_to_later_workers(own: str, later: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """A stage worker's device maps: from its device to the device of every later worker (name ->
    device) that is not on the CPU. Activations go to the next stage, skips straight to any later one;
    gradients come back over the reverse maps. TensorPipe maps join GPUs only: a CPU worker has none,
    and a GPU stage sends to a CPU one from the CPU (``rrefpipe.stage_side.server``)."""
    if own == "cpu":
        return {}
    return {name: {own: device} for name, device in later.items() if device != "cpu"}


def parse_device_map(entries: Sequence[str]) -> dict[str, dict[str, str]]:
    """Parse ``PEER=SRC>DST`` entries (e.g. ``worker2=cuda:0>cuda:1``) into ``backend_options`` form."""
    maps: dict[str, dict[str, str]] = {}
    for entry in entries:
        peer, sep, pair = entry.partition("=")
        src, arrow, dst = pair.partition(">")
        if not (sep and arrow and peer and src and dst):
            raise ValueError(f"device map entry must look like PEER=SRC>DST (e.g. worker2=cuda:0>cuda:1), "
                             f"got {entry!r}")
        maps.setdefault(peer, {})[src] = dst
    return maps


def init_rpc(name: str, *, rank: int, world_size: int, options: rpc.TensorPipeRpcBackendOptions) -> None:
    """``rpc.init_rpc``, without the deprecation warning torch prints in every process about its own
    internal use of a gloo group ("You are using a Backend ... as a ProcessGroup"): nothing a user of
    rrefpipe could act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"You are using a Backend .* as a ProcessGroup",
                                category=UserWarning)
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
