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

``torchrun_group(replicas=R)`` runs R replicas of the pipeline (data parallel): R drivers, each with
WORLD_SIZE / R - 1 stage workers of its own (see :class:`GroupEnv` for which rank is which). The drivers
yield their replica's workers, and every rank also joins a c10d process group (gloo; NCCL too for CUDA
stages) in which stage worker k of every replica averages its gradients with the others after each
step (:mod:`rrefpipe.replicas`).
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from .network import configure_interface
from .options import (DEFAULT_RPC_TIMEOUT, DRIVER_RPC_THREADS, LOCAL_TRANSPORTS, STAGE_INTEROP_THREADS,
                      STAGE_RPC_THREADS, DeviceMap, backend_options, device_name, init_rpc,
                      maps_to_later_workers)
from .serve import serve, stop_workers

__all__ = ["GroupEnv", "StageWorkers", "torchrun_group", "stage_devices", "LAYOUTS"]

DRIVER = "driver"
LAYOUTS = ("replica", "stage")


class StageWorkers(list[str]):
    """The stage workers of this driver's replica (a list of names, as before replicas existed), with
    its place among the replicas: ``replica`` (0-based) and ``replicas``, for a
    ``DistributedSampler(dataset, num_replicas=workers.replicas, rank=workers.replica)``."""

    def __init__(self, names: Sequence[str], replica: int = 0, replicas: int = 1, spares: Sequence[str] = ()) -> None:
        super().__init__(names)
        self.replica = replica
        self.replicas = replicas
        self.spares = list(spares)  # idle workers for ``Pipe(..., spares=stage_workers.spares)``

    @property
    def live(self) -> list[int]:
        """The replicas still in the job (numbered as at launch): all of them, until a replica lost with
        ``torchrun_group(on_replica_loss="continue")`` was dropped. Re-shard the data over these if the lost
        replicas' share is to be trained (``DistributedSampler(num_replicas=len(live),
        rank=live.index(replica))``)."""
        from rrefpipe import replicas

        membership = replicas.current()
        return [self.replica] if membership is None else list(membership.live_replicas)

    @property
    def losses(self) -> list[Any]:
        """Each time this driver's job went on without lost replicas (:class:`rrefpipe.replicas.ReplicaLoss`),
        oldest first."""
        from rrefpipe import replicas

        return list(replicas.losses)

    @property
    def group(self) -> Any:
        """The drivers' c10d process group (None with one replica): for the drivers' own collectives, such
        as averaging the loss they log (``dist.all_reduce(loss, group=stage_workers.group)``). The job's
        default group holds the stage workers too, which never join a driver's collective."""
        from rrefpipe import replicas

        membership = replicas.current()
        return None if membership is None else membership.group


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
    #: Replicas of the pipeline (data parallel), each of ``WORLD_SIZE / replicas`` ranks: a driver and
    #: its stage workers. ``layout="replica"``: replica r is ranks r*S .. r*S+S-1 (its driver first), so
    #: ``--nproc-per-node S`` puts each replica on a host of its own. ``layout="stage"``: ranks 0..R-1
    #: are the drivers, then stage worker k of every replica in turn (ranks R(k+1) + r), which spreads a
    #: replica's stages over the hosts.
    replicas: int = 1
    layout: str = "replica"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, replicas: int = 1,
                     layout: str = "replica") -> GroupEnv:
        env = os.environ if environ is None else environ
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise RuntimeError(f"torchrun_group needs {', '.join(missing)} in the environment: run the script with "
                               "torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as it does)")
        group = cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), master_addr=env["MASTER_ADDR"],
                    master_port=int(env["MASTER_PORT"]), local_rank=int(env.get("LOCAL_RANK", "0")),
                    local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")), gpus_per_node=torch.cuda.device_count(),
                    replicas=replicas, layout=layout)
        if group.world_size < 2:
            raise RuntimeError(f"WORLD_SIZE is {group.world_size}: a pipeline group needs rank 0 (the driver) and at "
                               "least one stage worker; launch with --nproc-per-node >= 2 or on several nodes")
        if not 0 <= group.rank < group.world_size:
            raise RuntimeError(f"RANK {group.rank} is outside WORLD_SIZE {group.world_size}")
        group.check_replicas()
        return group

    def check_replicas(self) -> None:
        """``replicas`` and ``layout`` fit the job, or a ValueError says what to launch."""
        r = self.replicas
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"replicas must be a positive int, got {r!r}")
        if self.world_size % r or self.world_size // r < 2:
            raise ValueError(f"WORLD_SIZE {self.world_size} does not split into replicas={r} of a driver and at least "
                             f"one stage worker each: launch replicas x (1 + stage workers) processes, a multiple of "
                             f"{r} and at least {2 * r}")

    @property
    def per_replica(self) -> int:
        """Ranks per replica: its driver and its stage workers."""
        return self.world_size // self.replicas

    def rank_of(self, replica: int, position: int) -> int:
        """The rank of stage worker ``position`` (0-based) of ``replica``; position -1 is its driver."""
        if self.layout == "replica":
            return replica * self.per_replica + position + 1
        return self.replicas * (position + 1) + replica

    def place_of(self, rank: int) -> tuple[int, int]:
        """(replica, position) of ``rank``; position -1 for a driver."""
        if self.layout == "replica":
            return divmod(rank, self.per_replica)[0], rank % self.per_replica - 1
        return rank % self.replicas, rank // self.replicas - 1

    def name_of(self, rank: int) -> str:
        """The RPC name of ``rank``: ``driver`` (replica 0's), ``driver<r>`` (replica r's), ``worker<rank>``."""
        replica, position = self.place_of(rank)
        if position >= 0:
            return f"worker{rank}"
        return DRIVER if replica == 0 else f"{DRIVER}{replica}"

    @property
    def replica(self) -> int:
        """The replica this rank belongs to (0-based)."""
        return self.place_of(self.rank)[0]

    @property
    def name(self) -> str:
        """This rank's RPC name (see :meth:`name_of`)."""
        return self.name_of(self.rank)

    @property
    def driver(self) -> str:
        """The driver of this rank's replica."""
        return self.name_of(self.rank_of(self.replica, -1))

    @property
    def stage_workers(self) -> list[str]:
        """The stage workers of this rank's replica, in stage order."""
        return [self.name_of(self.rank_of(self.replica, k)) for k in range(self.per_replica - 1)]

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
        position = group.place_of(rank)[1]
        if position < 0:
            return "cpu"
        if devices == "cuda":
            return group.cuda_device(rank)
        assert not isinstance(devices, str) and devices is not None
        return device_name(devices[position])

    workers = group.per_replica - 1
    if isinstance(devices, str) and devices != "cuda":
        raise ValueError(f"devices must be None, 'cuda' or one device per stage worker, got {devices!r}")
    if devices is not None and not isinstance(devices, str) and len(devices) != workers:
        raise ValueError(f"devices has {len(devices)} entries for {workers} stage workers" +
                         (f" (ranks 1..{workers})" if group.replicas == 1 else " per replica"))
    maps: dict[str, dict[str, str]] = {}
    used: set[str] = set()  # TensorPipe wants every device a rank sends from or receives on in its list
    replica, position = group.place_of(group.rank)
    if devices is not None and position >= 0:
        own = device_of(group.rank)
        used.add(own)
        later = [group.rank_of(replica, k) for k in range(position + 1, workers)]  # of this replica
        maps = maps_to_later_workers(own, {group.name_of(r): device_of(r) for r in later})
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
    replicas: int = 1,
    layout: str = "replica",
    collective_timeout: float | None = None,
    spares: int = 0,
    on_replica_loss: str = "stop",
) -> Iterator[StageWorkers]:
    """Join the job's RPC group. On each driver yield its replica's stage workers; on other ranks serve and exit.

    Args:
        interface: network interface (or an address of this host) to bind and advertise; default ``lo``
            when ``MASTER_ADDR`` is loopback, else ``TP_SOCKET_IFNAME`` if set, else TensorPipe's guess
            (with a warning naming the interface the route to the master uses).
        rpc_timeout: seconds an RPC may take once the group is up (``startup_timeout`` while joining).
        devices: CUDA stages across hosts, see :func:`stage_devices` (with replicas: one device per stage
            worker of a replica, the same for every replica).
        device_maps: TensorPipe device maps added to (or overriding) those ``devices`` implies, see
            :func:`stage_devices`.
        transports: TensorPipe's transports (default: TCP only).
        channels: TensorPipe's channels (``channels=["basic"]`` sends tensors through the transport too).
        num_worker_threads: RPC threads per process (default: ``DRIVER_RPC_THREADS`` on the driver,
            ``STAGE_RPC_THREADS`` on stage workers).
        threads: intra-op threads of a stage worker.
        interop_threads: inter-op threads of a stage worker (``None`` keeps PyTorch's default).
        replicas: replicas of the pipeline (data parallel): WORLD_SIZE / replicas ranks each, a driver
            and its stage workers; every driver runs the block with its own replica's workers.
        layout: which rank is which with replicas: ``"replica"`` (each replica's ranks contiguous, so
            ``--nproc-per-node WORLD_SIZE/replicas`` keeps a replica on one host) or ``"stage"`` (the
            drivers first, then stage worker k of every replica in turn), see :class:`GroupEnv`.
        collective_timeout: seconds a collective between replicas (averaging gradients) may wait for
            the others before the step fails; default ``rpc_timeout``. A replica that stops taking part
            (dead, or out of data) fails the others' steps after this long, not c10d's 30 minutes.
        spares: the last ``spares`` ranks of each replica serve no stage: the yielded list leaves them out
            and names them in its ``spares``, for ``Pipe(..., workers=stage_workers,
            spares=stage_workers.spares)`` (a stage worker that dies is replaced by one). With one replica
            the pipe keeps snapshots of its stages on a spare; with replicas it keeps none: a replica's lost
            stage worker is replaced by one of its own spares, which takes the stage's state from the same
            stage of a live replica (see the recovery guide, "Spares with replicas"). A spare averages
            nothing until it takes a stage (its group until then is the same spare of every replica's).
        on_replica_loss: with replicas, what the job does when a replica loses a process (its driver or a
            stage worker: dead, or not answering): ``"stop"`` (default; every replica's next averaging fails,
            naming what is gone) or ``"continue"``: the lost replica's driver gets a
            :class:`~rrefpipe.ReplicaLost` and leaves, and the others rebuild their groups without it and run
            the failed step again averaged over their own rows (``train_stream`` does it; ``train_step``
            raises :class:`~rrefpipe.ReplicasDropped` for a loop of your own to run the step again). The lost
            replica's batches are not trained from that step on: its share is yours to give to the others
            (``stage_workers.live``). Needs the job's store to survive (the rendezvous host, where
            replica 0's driver runs in a plain launch), and each replica on hosts of its own under torchrun
            (its agent stops every rank of a host when one exits).

    Stage workers call ``os._exit(0)`` after leaving, so nothing after the ``with`` runs there.
    """
    if on_replica_loss not in ("stop", "continue"):
        raise ValueError(f"on_replica_loss must be 'stop' or 'continue', got {on_replica_loss!r}")
    group = GroupEnv.from_environ(replicas=replicas, layout=layout)
    if spares and not 0 < spares < len(group.stage_workers):
        raise ValueError(f"spares={spares} with {len(group.stage_workers)} ranks per replica besides its driver: "
                         "spares must leave at least one stage worker" +
                         (" in each replica (they are taken from each replica's own ranks)" if replicas > 1 else ""))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = group.master_addr, str(group.master_port)
    configure_interface(interface, group.master_addr, who=f"rank {group.rank} ({group.name})")
    own_devices, maps = stage_devices(group, devices, device_maps)
    if num_worker_threads is None:
        num_worker_threads = DRIVER_RPC_THREADS if group.place_of(group.rank)[1] < 0 else STAGE_RPC_THREADS
    options = backend_options(num_worker_threads=num_worker_threads, transports=transports, channels=channels,
                              devices=own_devices, device_maps=maps, rpc_timeout=max(rpc_timeout, startup_timeout))
    join = None if group.replicas == 1 else (
        lambda: _join_replicas(group, _collective_backend(group, devices), collective_timeout or rpc_timeout,
                               on_replica_loss))
    if group.name != group.driver:
        serve(name=group.name, rank=group.rank, world_size=group.world_size, options=options, driver=group.driver,
              threads=threads, interop_threads=interop_threads, rpc_timeout=rpc_timeout, after_join=join)
        raise SystemExit(0)  # not reached: serve leaves the process
    init_rpc(group.name, rank=group.rank, world_size=group.world_size, options=options)
    rpc._set_rpc_timeout(rpc_timeout)
    try:
        if join is not None:
            join()
        names = list(group.stage_workers)
        yield StageWorkers(names[:len(names) - spares], group.replica, group.replicas, names[len(names) - spares:])
    finally:
        stop_workers(group.stage_workers)
        if group.replicas > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _collective_backend(group: GroupEnv, devices: str | Sequence[str] | None) -> str:
    """NCCL for CUDA gradients where the stage workers of a node are on GPUs of their own (NCCL refuses
    two ranks on one GPU: one GPU shared by every stage worker, as on a one-GPU test machine); else
    gloo, which all-reduces CUDA tensors too, through the host. Drivers hold no GPU and do not count."""
    if devices is None:
        return "gloo"
    node = group.rank // group.local_world_size  # ranks fill nodes in order, local_world_size each
    ranks = range(node * group.local_world_size, min((node + 1) * group.local_world_size, group.world_size))
    stage_ranks = [r for r in ranks if group.place_of(r)[1] >= 0]
    if devices == "cuda":
        if not group.gpus_per_node:
            return "gloo"
        gpus = [group.cuda_device(r) for r in stage_ranks]
    else:
        gpus = [device_name(devices[group.place_of(r)[1]]) for r in stage_ranks]
    return "cpu:gloo,cuda:nccl" if len(set(gpus)) == len(gpus) else "gloo"


def _join_replicas(group: GroupEnv, backend: str, timeout: float, on_loss: str = "stop") -> None:
    """On every rank: the job's c10d group, then one group per stage-worker position (stage worker k of
    every replica, which average their gradients) and the drivers' (which compare their pipes). Group
    creation is collective over the whole job, so every rank creates every group, in the same order."""
    from rrefpipe import replicas

    limit = timedelta(seconds=timeout)
    dist.init_process_group(backend, rank=group.rank, world_size=group.world_size, timeout=limit)
    groups = {}
    for position in range(-1, group.per_replica - 1):
        ranks = [group.rank_of(r, position) for r in range(group.replicas)]
        groups[position] = (ranks, dist.new_group(ranks, timeout=limit))
    replica, position = group.place_of(group.rank)
    ranks, process_group = groups[position]
    replicas.join(replicas.Membership(replica=replica, replicas=group.replicas, group=process_group, ranks=ranks,
                                      names=[group.name_of(r) for r in ranks], timeout=timeout,
                                      job=tuple(group.name_of(r) for r in range(group.world_size)),
                                      job_replicas=tuple(group.place_of(r)[0] for r in range(group.world_size)),
                                      on_loss=on_loss))
    # every rank in: a member of another group returns from new_group without waiting for that group's members,
    # so a driver could otherwise ask its workers for replica 0's state before they joined theirs (seen with a
    # replica's ranks started later, on a host of its own)
    dist.barrier()
