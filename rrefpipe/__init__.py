"""rrefpipe: GPipe-style pipeline parallelism over ``torch.distributed.rpc`` stage workers."""
from .capture import CaptureError, set_stage
from .checkpoint import is_checkpointing, is_recomputing
from .errors import StageError, WorkerError
from .grad_scaler import GradScaler
from .local import InProcessWarning
from .output import PipeRRef, RemotePipeRRef
from .pipe import Pipe
from .schedule import PipeMareOptions
from .stage import StageInfo
from .trace import Event, format_events

__all__ = ["Pipe", "GradScaler", "StageError", "WorkerError", "StageInfo", "Event", "format_events",
           "is_checkpointing", "is_recomputing", "InProcessWarning", "PipeRRef", "RemotePipeRRef", "set_stage",
           "CaptureError", "PipeMareOptions"]
__version__ = "0.1.0"
