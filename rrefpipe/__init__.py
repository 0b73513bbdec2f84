"""rrefpipe: GPipe-style pipeline parallelism over ``torch.distributed.rpc`` stage workers."""
from .capture import CaptureError, set_stage
from .stage_side.checkpoint import is_checkpointing, is_recomputing
from .errors import ReplicaLost, ReplicasDropped, StageError, StageReplaced, WorkerError
from .driver_side.grad_scaler import GradScaler
from .driver_side.local import InProcessWarning
from .driver_side.output import PipeRRef, RemotePipeRRef
from .driver_side.recovery import Recovery, Snapshots
from .pipe import Pipe
from .schedule import PipeMareOptions
from .stage_side.stage import StageInfo
from .trace import Event, format_events
from .sharded import load_model, save_model
from .weights import meta_parameters

__all__ = ["Pipe", "GradScaler", "StageError", "WorkerError", "StageInfo", "Event", "format_events",
           "is_checkpointing", "is_recomputing", "InProcessWarning", "PipeRRef", "RemotePipeRRef", "set_stage",
           "CaptureError", "PipeMareOptions", "meta_parameters", "save_model", "load_model", "Recovery", "Snapshots",
           "ReplicaLost", "ReplicasDropped", "StageReplaced"]
__version__ = "0.1.0"
