"""``python -m workers``: run one stage worker.

Rank, world size and the master's address come from the flags or from the environment ``torchrun``
sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the same worker runs on any host.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .launch import adopt_driver_sys_path
from .network import configure_interface
from .options import (DEFAULT_RPC_TIMEOUT, LOCAL_TRANSPORTS, STAGE_INTEROP_THREADS, STAGE_RPC_THREADS, backend_options,
                      parse_device_map)
from .rendezvous import local_url
from .serve import serve

__all__ = ["main", "parse_args", "parser"]


def _env_int(key: str) -> int | None:
    value = os.environ.get(key)
    return int(value) if value is not None else None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    for key in ("rank", "world_size", "master_port"):
        if getattr(args, key) is None:
            p.error(f"--{key.replace('_', '-')} is required (or set {key.upper()} as torchrun does)")
    return args


def parser() -> argparse.ArgumentParser:
    """``python -m workers``'s flags; defaults from the environment ``torchrun`` sets, read now."""
    p = argparse.ArgumentParser(prog="python -m workers", description="Serve rrefpipe stages as an RPC worker.")
    p.add_argument("--rank", type=int, default=_env_int("RANK"), help="rank in the RPC group (default: env RANK)")
    p.add_argument("--world-size", type=int, default=_env_int("WORLD_SIZE"),
                   help="group size (default: env WORLD_SIZE)")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   help="rendezvous address (default: env MASTER_ADDR, else 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=_env_int("MASTER_PORT"),
                   help="rendezvous port (default: env MASTER_PORT)")
    p.add_argument("--name", help="worker name (default: worker<rank>)")
    p.add_argument("--driver", default="driver", help="name of the driver to watch (default: %(default)s)")
    p.add_argument("--interface", metavar="NAME_OR_ADDRESS",
                   help="network interface to bind and advertise, or an address of this host (the interface holding "
                   "it); sets TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME. Default: lo when the master is loopback, else "
                   "TP_SOCKET_IFNAME if set, else TensorPipe's guess (with a warning)")
    p.add_argument("--threads", type=int,
                   help="intra-op threads for this worker (torch.set_num_threads; default: PyTorch's, one per core)")
    p.add_argument("--interop-threads", type=int, default=STAGE_INTEROP_THREADS,
                   help="inter-op threads, where backward runs (default: %(default)s, see workers.options)")
    p.add_argument("--num-worker-threads", type=int, default=STAGE_RPC_THREADS,
                   help="RPC thread pool size (default: %(default)s, see workers.options)")
    p.add_argument("--rpc-timeout", type=float, default=DEFAULT_RPC_TIMEOUT,
                   help="seconds an RPC may take (default: %(default)s)")
    p.add_argument("--transport", action="append", help="TensorPipe transport (repeatable; default: uv)")
    p.add_argument("--channel", action="append", help="TensorPipe channel (repeatable; default: TensorPipe's choice)")
    p.add_argument("--device", action="append",
                   help="a device this worker uses (repeatable, e.g. cuda:0; default: none, the CPU only)")
    p.add_argument("--device-map", action="append", default=[], metavar="PEER=SRC>DST",
                   help="send tensors on SRC to PEER's DST device, e.g. worker2=cuda:0>cuda:1 (repeatable; default: "
                   "none)")
    p.add_argument("--watch-stdin", action="store_true",
                   help="exit when stdin closes (used by local launching; default: off)")
    p.add_argument("--rendezvous", choices=("env", "local"), default="env",
                   help="env (default): torch's, at the master's address; local: for a LocalWorkers driver, which "
                   "watches its worker processes while they join (used by local launching)")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    adopt_driver_sys_path()
    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.master_port)
    try:
        configure_interface(args.interface, args.master_addr, who=f"worker rank {args.rank}")
    except ValueError as exc:
        raise SystemExit(f"python -m workers: {exc}") from None
    local = args.rendezvous == "local"
    options = backend_options(
        num_worker_threads=args.num_worker_threads, rpc_timeout=args.rpc_timeout,
        init_method=local_url(args.master_addr, args.master_port, args.rpc_timeout) if local else None,
        transports=args.transport or LOCAL_TRANSPORTS,
        channels=args.channel, devices=args.device, device_maps=parse_device_map(args.device_map),
    )
    if not args.watch_stdin:  # started by hand: a wrong port would otherwise look like a hang
        print(f"python -m workers: {args.name or f'worker{args.rank}'} (rank {args.rank} of {args.world_size}) joining "
              f"the group at {args.master_addr}:{args.master_port}; it starts once rank 0 (the driver) is up",
              file=sys.stderr, flush=True)
    serve(name=args.name or f"worker{args.rank}", rank=args.rank, world_size=args.world_size, options=options,
          driver=args.driver, watch_stdin=args.watch_stdin, threads=args.threads, interop_threads=args.interop_threads)


if __name__ == "__main__":
    main()
