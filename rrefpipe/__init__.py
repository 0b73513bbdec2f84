"""rrefpipe: GPipe-style pipeline parallelism over ``torch.distributed.rpc`` stage workers."""
from .errors import StageError, WorkerError
from .pipe import Pipe
from .stage import StageInfo
from .trace import Event, format_events

__all__ = ["Pipe", "StageError", "WorkerError", "StageInfo", "Event", "format_events"]
__version__ = "0.1.0"
