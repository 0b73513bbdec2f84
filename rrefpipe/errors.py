"""Errors that name where they happened: stage, worker, micro-batch and the original exception.

TensorPipe keeps only ``ValueError``/``TypeError`` across an RPC and names no worker, so stage code
never lets an exception cross the wire: it captures a :class:`Failure` (a plain value, the original
exception in it as pickled bytes, so a class the driver cannot import costs the chaining and not the
report) and the driver turns it back into a :class:`StageError` chained to the original exception.
"""
from __future__ import annotations

import builtins
import errno
import os
import pickle
import re
import sys
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

import torch.nn.modules

__all__ = ["StageError", "WorkerError", "ReplicaLost", "ReplicasDropped", "StageReplaced"]


class StageError(RuntimeError):
    """A stage failed: it raised while running a micro-batch (``microbatch`` names it), or a control
    call to its worker failed (building the stage, a state dict, gathering outputs: ``microbatch`` is
    None).

    Attributes carry the place (``stage``, ``worker``, ``microbatch``, ``phase``) and the cause
    (``error_type``, ``error_message``, ``remote_traceback``); ``__cause__`` is the original exception
    when it could be pickled.
    """

    def __init__(
        self,
        stage: int,
        worker: str,
        microbatch: int | None,
        phase: str,
        error_type: str,
        error_message: str,
        remote_traceback: str = "",
    ) -> None:
        where = f"stage {stage} on worker {worker!r}"
        if microbatch is not None:
            where += f", micro-batch {microbatch}"
        super().__init__(f"{where} failed in {phase}: {error_type}: {error_message}")
        self.stage = stage
        self.worker = worker
        self.microbatch = microbatch
        self.phase = phase
        self.error_type = error_type
        self.error_message = error_message
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[Any, ...]:
        # ``args`` holds the message only, and a mirrored class (``StageValueError``) is made at run time:
        # rebuild from the fields, so the error crosses processes (a process pool, pytest-xdist) and copies.
        fields = (self.stage, self.worker, self.microbatch, self.phase, self.error_type, self.error_message,
                  self.remote_traceback)
        named = type(self) if type(self) in (StageError, WorkerError) else None  # else a mirror: made again
        return _rebuilt, (named, fields), self.__dict__


class WorkerError(StageError):
    """The RPC to or from a stage worker failed: the worker died, was unreachable, or timed out."""


#: How a failure that is a lost connection to the worker reads.
UNREACHABLE = "the worker is unreachable"


#: How TensorPipe and torch's RPC agent word a connection they lost, could not make or gave up on: an
#: errno name ("EPIPE: broken pipe", "ECONNREFUSED: ...", or TensorPipe's "EOF: end of file") or "pipe
#: closed" at the start, TensorPipe's "(this error originated at tensorpipe/...)" or the agent's timeout
#: anywhere. A layer's own message may say "closed", "timeout" or "ERROR:" in any words: only these forms count.
_TIMEOUT = "RPC ran for more than set timeout"
_ERRNO_NAMES = "|".join(sorted({*errno.errorcode.values(), "EOF"}))
_TRANSPORT = re.compile(rf"^\s*(?:(?:{_ERRNO_NAMES}): |pipe closed)|\(this error originated at tensorpipe/|{_TIMEOUT}")
#: How torch reports an exception that the remote function raised: the worker answered, so it is alive.
_REMOTE_EXCEPTION = "On WorkerInfo("


class ReplicaLost(RuntimeError):
    """On the driver of a replica that lost a process, in a job that goes on without it
    (``workers.torchrun_group(replicas=R, on_replica_loss="continue")``): this replica is out of the job
    and its driver should leave (its stage workers are stopped when the ``with`` block ends); the other
    replicas go on. ``replica`` (numbered as at launch), ``gone`` (the job's processes that did not
    answer), ``step`` (the steps averaged over every replica before the one that failed)."""

    def __init__(self, message: str, replica: int, gone: tuple[str, ...], step: int) -> None:
        super().__init__(message)
        self.replica, self.gone, self.step = replica, gone, step


class ReplicasDropped(RuntimeError):
    """Raised by ``train_step`` on a surviving replica's driver, once the replicas' groups were rebuilt
    without the lost ones (``on_replica_loss="continue"``): the step failed and nothing of it was applied;
    run it again in a new distributed-autograd context (``train_stream`` does), and it is averaged over the
    live replicas only. ``loss``: what happened (a :class:`rrefpipe.replicas.ReplicaLoss`)."""

    def __init__(self, message: str, loss: Any) -> None:
        super().__init__(message)
        self.loss = loss


class StageReplaced(RuntimeError):
    """Raised by ``train_step`` or ``PipeOptimizer.step`` on every replica's driver of a job with spares
    (``workers.torchrun_group(replicas=R, spares=k)``) once a lost stage worker was replaced by a spare and
    the replicas behind were rebuilt from a live one (the donor). ``again``: run the failed step again, in a
    new distributed-autograd context (``train_stream`` does); False on a replica that was behind the donor
    (its optimizer step failed where the donor's was done): its update came with the donor's state, so go on
    to the next batch, and keep the loss ``train_step`` returned for this one. ``recoveries``: this
    pipe's :class:`~rrefpipe.driver_side.recovery.Recovery` records of it (none where no stage moved)."""

    def __init__(self, message: str, again: bool, recoveries: tuple[Any, ...] = ()) -> None:
        super().__init__(message)
        self.again, self.recoveries = again, recoveries


def add_note(exc: BaseException, text: str) -> None:
    """``exc.add_note(text)`` where Python has it (3.11+: shown under the message); nothing before."""
    if hasattr(exc, "add_note"):
        exc.add_note(text)


def first_line(exc: BaseException) -> str:
    """An exception's first line (c10d's and TensorPipe's errors carry a C++ stack trace after it), or its
    type's name when it has no message."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def summary(exc: BaseException) -> str:
    """``Type: first line`` of an exception: its cause quoted in a message of ours, in one line."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def is_transport_error(exc: BaseException | str) -> bool:
    """Whether an RPC error is TensorPipe's about the connection (lost, refused, timed out), not an
    exception raised by the remote function or a layer, whatever words that uses."""
    text = str(exc)
    return _REMOTE_EXCEPTION not in text and _TRANSPORT.search(text) is not None


def timed_out(exc: BaseException | str) -> bool:
    """A transport error that is the RPC timeout: the peer may be gone, or only busy."""
    return is_transport_error(exc) and _TIMEOUT in str(exc)


def lost_connection(exc: BaseException | str) -> bool:
    """A transport error other than a timeout: the peer is gone (a timed-out peer may only be busy)."""
    return is_transport_error(exc) and not timed_out(exc)


@dataclass
class Failure:
    """A picklable record of an exception raised on a worker."""

    stage: int
    worker: str
    microbatch: int | None
    phase: str
    error_type: str
    message: str
    remote_traceback: str
    original: bytes | None = None  # the pickled exception: unpickled on the driver only when it can be
    transport: bool = False
    cancelled: bool = False

    @classmethod
    def capture(
        cls, exc: BaseException, *, stage: int, worker: str, microbatch: int | None, phase: str,
        transport: bool = False,
    ) -> Failure:
        original: bytes | None
        try:
            original = pickle.dumps(exc)
            pickle.loads(original)
        except Exception:
            original = None
        try:
            message, trace = str(exc), "".join(traceback.format_exception(exc))
        except Exception as unprintable:  # a __str__ that raises must not cost the report
            message = f"<{type(exc).__name__} that cannot be printed: {type(unprintable).__name__}>"
            trace, original = "".join(traceback.format_exception(unprintable)), None
        error_type = type(exc).__name__
        if transport and lost_connection(message):  # the same words wherever a dead worker shows
            error_type, message = "WorkerError", f"{UNREACHABLE} ({message})"
        return cls(stage, worker, microbatch, phase, error_type, message, trace, original, transport)

    def original_exception(self) -> BaseException | None:
        """The original exception, where this process can unpickle it: its class may live in a module
        only the worker imports (then the type name and message still tell the cause)."""
        if self.original is None:
            return None
        try:
            exc = pickle.loads(self.original)
        except Exception:
            return None
        return exc if isinstance(exc, BaseException) else None

    def to_exception(self) -> StageError:
        kind = WorkerError if self.transport else _with_original_type(StageError, self.error_type)
        error = kind(
            self.stage, self.worker, self.microbatch, self.phase, self.error_type, self.message,
            self.remote_traceback,
        )
        error.__cause__ = self.original_exception()
        if not self.transport and self.remote_traceback.startswith("Traceback") and hasattr(error, "add_note"):
            # Tracebacks do not pickle: without this an uncaught error shows no line of the layer that raised.
            error.add_note(f"Raised on worker {self.worker!r} (stage {self.stage}), in the stage's layers (the full "
                           f"remote traceback is .remote_traceback):\n{_layer_frames(self.remote_traceback)}")
        return error


def _layer_frames(trace: str) -> str:
    """The frames of a formatted traceback below rrefpipe's own (the layers' code), without
    ``nn.Module``'s call wrappers; the whole text when it has no rrefpipe frame."""
    frames: list[list[str]] = []
    for line in trace.rstrip().splitlines()[1:]:
        if line.startswith('  File "') or not frames:
            frames.append([line])
        else:
            frames[-1].append(line)
    ours = [k for k, frame in enumerate(frames) if f"{os.sep}rrefpipe{os.sep}" in frame[0]]
    if not ours:
        return trace.rstrip()
    wrapper = f"{os.sep}torch{os.sep}nn{os.sep}modules{os.sep}module.py"
    kept = [frame for frame in frames[ours[-1] + 1:] if wrapper not in frame[0]]
    return "\n".join(line for frame in kept for line in frame)


_OWN_FILES = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
              os.path.dirname(os.path.abspath(torch.nn.modules.__file__)) + os.sep)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointing at the caller's own line: the first frame outside rrefpipe and
    ``nn.Module``'s call wrappers (``pipe(x)`` reaches ``forward`` through several)."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_OWN_FILES):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


# Builtin errors a stage error also *is*, so ``except TypeError`` around a pipe call still works.
_MIRRORED = (TypeError, ValueError, IndexError, ArithmeticError, ZeroDivisionError, AssertionError,
             NotImplementedError, AttributeError, LookupError)
_mirrors: dict[str, type[StageError]] = {}


def _rebuilt(kind: type[StageError] | None, fields: tuple[Any, ...]) -> StageError:
    """A StageError unpickled: of class ``kind``, or (None) of the mirrored class its error type names."""
    return (kind or _with_original_type(StageError, fields[4]))(*fields)


def _with_original_type(base: type[StageError], error_type: str) -> type[StageError]:
    """``StageError`` subclassing the original builtin error type, when it is one of ``_MIRRORED``."""
    original = getattr(builtins, error_type, None)
    if original not in _MIRRORED:
        return base
    if error_type not in _mirrors:
        _mirrors[error_type] = type(f"Stage{error_type}", (base, original), {"__module__": __name__})
    return _mirrors[error_type]
