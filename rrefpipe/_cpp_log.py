"""Quiet torch's C++ warnings while a group of stage workers shuts down, where they report nothing wrong.

When a group shuts down, every process's TensorPipe agent logs "RPC agent for X encountered error
when reading incoming request from Y: EOF" once per peer that leaves first: the expected end of the
connection, which reads like a failure. These lines come from C++ straight to file descriptor 2, past
Python's ``logging`` and ``warnings``. torch takes their level from ``TORCH_CPP_LOG_LEVEL`` once, at
import, into c10's ``FLAGS_caffe2_log_level``: local stage workers are started with the variable set
(:data:`QUIET_ENV`), and a process already running (the driver, a worker ``torchrun`` started) raises
the flag itself for as long as its shutdown lasts (:func:`quiet_cpp_warnings`). Errors still show.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__: list[str] = []

#: The environment of a process started to serve stages: C++ warnings off, errors shown.
QUIET_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR"}

_ERROR = 2  # c10's levels: 0 info, 1 warning, 2 error, 3 fatal
_lock = threading.Lock()
_depth = 0
_saved = 0
_explained = False


@functools.cache  # looked up once: each quiet block reads it twice
def _level_flag() -> ctypes.c_int | None:
    """c10's ``FLAGS_caffe2_log_level`` in the library torch loaded, or None where it cannot be found."""
    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "*c10.*")):
        try:
            return ctypes.c_int.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_log_level")
        except (OSError, ValueError):
            continue
    return None


@contextmanager
def quiet_cpp_warnings() -> Iterator[None]:
    """Drop torch's C++ warnings in this block (nested and concurrent blocks allowed); errors still
    show. Where the level cannot be changed, the first block explains the warnings once instead."""
    quieted = _quiet()
    try:
        yield
    finally:
        if quieted:
            _unquiet()
        else:
            _explain()


def quiet_from_now() -> None:
    """Drop torch's C++ warnings for the rest of this process's life: a stage worker told to leave."""
    if not _quiet():
        _explain()


def _quiet() -> bool:
    """Raise the level to errors (counted); False where the flag cannot be found."""
    global _depth, _saved
    flag = _level_flag()
    if flag is None:
        return False
    with _lock:
        if _depth == 0:
            _saved = flag.value
            flag.value = max(_saved, _ERROR)
        _depth += 1
    return True


def _unquiet() -> None:
    global _depth
    flag = _level_flag()
    with _lock:
        _depth -= 1
        if _depth == 0 and flag is not None:
            flag.value = _saved


def _explain() -> None:
    global _explained
    if not _explained:
        _explained = True
        print("rrefpipe: TensorPipe's 'encountered error ... EOF' lines at shutdown are the stage workers leaving, "
              "not a failure", file=sys.stderr, flush=True)
