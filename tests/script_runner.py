"""Run Python scripts as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would, each in a child forked
from this warm interpreter.

Started once per test process (the ``warm_python`` fixture, ``tests/conftest.py``): a fresh interpreter
for each guide page, tutorial or benchmark smoke run spent ~4 CPU-seconds importing torch and rrefpipe
before the script's first line. Here they are imported once, and each script runs in a process of its
own (``os.fork``): its own RPC state, ``__main__``, globals, stage workers and exit hooks, as a fresh
interpreter's. Nothing here initialises RPC, starts a thread or a worker, so the children inherit none.
Scripts about the interpreter itself (its start, its exit, its signals) still want a real one.

Protocol, one line each way per script: the parent writes ``[ARGV, CWD, OUT, ERR, ENV]`` (JSON; ENV: variables
to set) on stdin; this process writes the child's pid as soon as it has forked, then its exit status
(negative: the signal that ended it, as ``subprocess`` reports), both as JSON. The child's stdout and
stderr go to OUT and ERR.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import threading
import traceback

import torch  # noqa: F401  (what every script would import first: the point of this process)
import torch.distributed.autograd  # noqa: F401
import torch.nn.functional  # noqa: F401

import rrefpipe  # noqa: F401
import workers  # noqa: F401


def run_child(argv: list[str], cwd: str, out: str, err: str, env: dict[str, str]) -> int:
    """In the forked child: ``python ARGV``'s run and exit, in ``cwd``; returns the exit status."""
    os.setpgid(0, 0)  # its own group: the test kills it and its stage workers at once on a timeout
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # not the protocol's pipe
    os.close(null)
    sys.stdin = open(0, closefd=False)
    os.chdir(cwd)
    os.environ.update(env)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = list(argv[1:])  # run_module puts the module's file first, as ``-m`` does
            sys.path[0] = cwd  # ``-m`` puts the current directory first
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(script)  # as ``python SCRIPT`` puts it first
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # What the interpreter does at exit: wait for the non-daemon threads, then run the exit hooks
    # (local stage workers are stopped by one), then flush.
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return code


def main() -> None:
    for line in sys.stdin:
        argv, cwd, out, err, env = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = run_child(argv, cwd, out, err, env)
            finally:
                os._exit(code & 0xFF)
        print(json.dumps(pid), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)


if __name__ == "__main__":
    main()
