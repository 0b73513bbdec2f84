"""One training script for every node of a ``torchrun`` job: rank 0 drives, every other rank serves stages.

On each node::

    torchrun --nnodes 2 --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST0:29400 train.py

``train.py``::

    with workers.torchrun_group(interface="eth1") as stage_workers:   # ranks >= 1 never get past this line
        pipe = Pipe(model, chunks=8, workers=stage_workers)           # rank 0 only: the driver
        ...

Rank 0 joins the RPC group as ``"driver"`` and runs the block; rank k >= 1 joins as ``"worker<k>"``, serves
stages (:func:`workers.serve`) and exits the process (status 0) when the driver stops the group on leaving
the block, or when the driver is gone. There is no launcher protocol of rrefpipe's own: only torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``), so any launcher that sets those works.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed.rpc as rpc

from .network import configure_interface
from .options import (DEFAULT_RPC_TIMEOUT, DRIVER_RPC_THREADS, LOCAL_TRANSPORTS, STAGE_INTEROP_THREADS,
                      STAGE_RPC_THREADS, DeviceMap, backend_options, device_name, init_rpc,
                      maps_to_later_workers)
from .serve import serve, stop_workers

__all__ = ["GroupEnv", "torchrun_group", "stage_devices"]

DRIVER = "driver"


@dataclass(frozen=True)
class GroupEnv:
    """This process's place in the job, as torchrun describes it."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int
    local_world_size: int
    #: CUDA devices each node has (``torch.cuda.device_count()`` here; every node is assumed alike, as
    #: ``--nproc-per-node`` already assumes); ``None``: unknown, ``devices="cuda"`` then maps rank k to
    #: ``cuda:LOCAL_RANK`` whatever the node has.
    gpus_per_node: int | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> GroupEnv:
        env = os.environ if environ is None else environ
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise RuntimeError(f"torchrun_group needs {', '.join(missing)} in the environment: run the script with "
                               "torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as it does)")
        group = cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), master_addr=env["MASTER_ADDR"],
                    master_port=int(env["MASTER_PORT"]), local_rank=int(env.get("LOCAL_RANK", "0")),
                    local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")), gpus_per_node=torch.cuda.device_count())
        if group.world_size < 2:
            raise RuntimeError(f"WORLD_SIZE is {group.world_size}: a pipeline group needs rank 0 (the driver) and at "
                               "least one stage worker; launch with --nproc-per-node >= 2 or on several nodes")
        if not 0 <= group.rank < group.world_size:
            raise RuntimeError(f"RANK {group.rank} is outside WORLD_SIZE {group.world_size}")
        return group

    @property
    def name(self) -> str:
        return DRIVER if self.rank == 0 else f"worker{self.rank}"

    @property
    def stage_workers(self) -> list[str]:
        return [f"worker{k}" for k in range(1, self.world_size)]

    def cuda_device(self, rank: int) -> str:
        """The GPU ``devices="cuda"`` gives the stage worker of ``rank``: ``cuda:LOCAL_RANK``, wrapped
        around the node's GPUs when it runs more processes than it has GPUs (one GPU, three processes:
        every stage on ``cuda:0``), so a one-GPU machine runs the same job as a node of eight."""
        local_rank = self.local_rank if rank == self.rank else rank % self.local_world_size
        if self.gpus_per_node is None:
            return f"cuda:{local_rank}"
        if self.gpus_per_node == 0:
            raise RuntimeError(f"devices='cuda' puts rank {rank} on a GPU, but this node ({self.name}) sees no CUDA "
                               "device, and every node is taken to have as many GPUs as this one: pass devices=None "
                               "for CPU stages, or one device per stage worker")
        return f"cuda:{local_rank % self.gpus_per_node}"


def stage_devices(
    group: GroupEnv, devices: str | Sequence[str] | None, device_maps: Mapping[str, DeviceMap] | None = None,
) -> tuple[list[str] | None, dict[str, dict[str, str]]]:
    """This rank's TensorPipe ``devices`` and device maps (pure; the driver keeps tensors on the CPU).

    ``devices``: ``None`` (CPU stages), ``"cuda"`` (stage worker of rank k on ``cuda:LOCAL_RANK``, modulo
    the node's GPUs, see :meth:`GroupEnv.cuda_device`; the other workers' devices are derived assuming
    every node runs ``LOCAL_WORLD_SIZE`` processes and has as many GPUs as this one), or one device per
    stage worker (ranks 1..WORLD_SIZE-1, the same list as ``Pipe(devices=...)``), mapped as
    :func:`~workers.options.maps_to_later_workers` says.
    ``device_maps``, keyed by the *sending* worker's name (``{"worker1": {"worker2": {"cuda:0":
    "cuda:1"}}}``), adds or overrides entries for whichever rank has that name, so one literal serves the
    whole job.
    """
    def device_of(rank: int) -> str:
        if rank == 0:
            return "cpu"
        if devices == "cuda":
            return group.cuda_device(rank)
        assert not isinstance(devices, str) and devices is not None
        return device_name(devices[rank - 1])

    if isinstance(devices, str) and devices != "cuda":
        raise ValueError(f"devices must be None, 'cuda' or one device per stage worker, got {devices!r}")
    if devices is not None and not isinstance(devices, str) and len(devices) != group.world_size - 1:
        raise ValueError(f"devices has {len(devices)} entries for {group.world_size - 1} stage workers "
                         f"(ranks 1..{group.world_size - 1})")
    maps: dict[str, dict[str, str]] = {}
    used: set[str] = set()  # TensorPipe wants every device a rank sends from or receives on in its list
    if devices is not None and group.rank > 0:
        own = device_of(group.rank)
        used.add(own)
        maps = maps_to_later_workers(own, {f"worker{r}": device_of(r) for r in range(group.rank + 1, group.world_size)})
    for peer, mapping in (device_maps or {}).get(group.name, {}).items():
        maps.setdefault(peer, {}).update(mapping)
    used |= {src for mapping in maps.values() for src in mapping}
    used |= {dst for sender, peers in (device_maps or {}).items() if sender != group.name
             for dst in peers.get(group.name, {}).values()}
    return sorted(used - {"cpu"}) or None, maps


@contextmanager
def torchrun_group(
    *,
    interface: str | None = None,
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
    startup_timeout: float = 120.0,
    devices: str | Sequence[str] | None = None,
    device_maps: Mapping[str, DeviceMap] | None = None,
    transports: Sequence[str] | None = LOCAL_TRANSPORTS,
    channels: Sequence[str] | None = None,
    num_worker_threads: int | None = None,
    threads: int | None = None,
    interop_threads: int | None = STAGE_INTEROP_THREADS,
) -> Iterator[list[str]]:
    """Join the job's RPC group. On rank 0 yield the stage workers' names; on other ranks serve and exit.

    Args:
        interface: network interface (or an address of this host) to bind and advertise; default ``lo``
            when ``MASTER_ADDR`` is loopback, else ``TP_SOCKET_IFNAME`` if set, else TensorPipe's guess
            (with a warning naming the interface the route to the master uses).
        rpc_timeout: seconds an RPC may take once the group is up (``startup_timeout`` while joining).
        devices: CUDA stages across hosts, see :func:`stage_devices`.
        device_maps: TensorPipe device maps added to (or overriding) those ``devices`` implies, see
            :func:`stage_devices`.
        transports: TensorPipe's transports (default: TCP only).
        channels: TensorPipe's channels (``channels=["basic"]`` sends tensors through the transport too).
        num_worker_threads: RPC threads per process (default: ``DRIVER_RPC_THREADS`` on the driver,
            ``STAGE_RPC_THREADS`` on stage workers).
        threads: intra-op threads of a stage worker.
        interop_threads: inter-op threads of a stage worker (``None`` keeps PyTorch's default).

    Stage workers call ``os._exit(0)`` after leaving, so nothing after the ``with`` runs there.
    """
    group = GroupEnv.from_environ()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = group.master_addr, str(group.master_port)
    configure_interface(interface, group.master_addr, who=f"rank {group.rank} ({group.name})")
    own_devices, maps = stage_devices(group, devices, device_maps)
    if num_worker_threads is None:
        num_worker_threads = DRIVER_RPC_THREADS if group.rank == 0 else STAGE_RPC_THREADS
    options = backend_options(num_worker_threads=num_worker_threads, transports=transports, channels=channels,
                              devices=own_devices, device_maps=maps, rpc_timeout=max(rpc_timeout, startup_timeout))
    if group.rank != 0:
        serve(name=group.name, rank=group.rank, world_size=group.world_size, options=options, driver=DRIVER,
              threads=threads, interop_threads=interop_threads, rpc_timeout=rpc_timeout)
        raise SystemExit(0)  # not reached: serve leaves the process
    init_rpc(DRIVER, rank=0, world_size=group.world_size, options=options)
    rpc._set_rpc_timeout(rpc_timeout)
    try:
        yield group.stage_workers
    finally:
        stop_workers(group.stage_workers)
