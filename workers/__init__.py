"""Stage-worker entry points: ``python -m workers`` (torchrun-compatible) and local launching."""
from .group import LAYOUTS, GroupEnv, StageWorkers, torchrun_group
from .launch import LocalWorkers, free_port
from .options import DEFAULT_RPC_TIMEOUT, backend_options
from .serve import serve, stop_workers

__all__ = ["torchrun_group", "GroupEnv", "StageWorkers", "LAYOUTS", "LocalWorkers", "free_port", "backend_options",
           "serve", "stop_workers", "DEFAULT_RPC_TIMEOUT"]
