"""Data parallel x pipeline parallel under ``torchrun`` on this host: 2 replicas of a 2-stage pipeline (6
processes) train as plain PyTorch does on the whole batch, and mistakes and failures end every
replica's run with an error that names the cause, in bounded time (tests/replicas/check_replicas.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, parameter_drifts, pid_alive, record_surfacing

SCRIPT = "tests/replicas/check_replicas.py"


#: Set in every process of this module's jobs (they inherit it): what ``no_process_left`` looks for, so
#: that another test's job running at the same time (pytest-xdist) is not taken for one of ours.
JOB_MARK = f"RREFPIPE_REPLICAS_TEST_JOB={os.getpid()}"


def torchrun(*args: str, timeout: float, nproc: int = 6, monitor: float | None = None
             ) -> tuple[subprocess.CompletedProcess[str], float]:
    """``torchrun --standalone`` of ``args`` on this host; the finished process and its wall time.
    ``monitor``: seconds between torchrun's looks at its processes (once one has died, it stops the rest)."""
    start = time.monotonic()
    name, value = JOB_MARK.split("=")
    watch = [] if monitor is None else ["--monitor-interval", str(monitor)]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", *watch, "--nproc-per-node",
                           str(nproc), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **{name: value}))
    return proc, time.monotonic() - start


def lines(proc: subprocess.CompletedProcess[str], prefix: str) -> list[str]:
    """The drivers' reports starting with ``prefix``. Ranks share the job's stdout, and one rank's report
    may run into another's line: split at every report, not at newlines."""
    reports = re.split(r"(?=(?:OK|FAILED|DONE|REFUSED) replica )", proc.stdout)
    return [r.split("\n", 1)[0] for r in reports if r.startswith(prefix)]


def no_process_left() -> None:
    """No process of this module's jobs is left (found by the mark in their environment)."""
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                marked = JOB_MARK.encode() in f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if marked and pid_alive(int(entry)):
            left.append(f"{entry} {args}")
    assert not left, f"processes of the job outlived it:\n{left}"


@pytest.mark.timeout(180)
def test_replicas_train_as_plain_pytorch_on_the_whole_batch():
    """GPipe, 1F1B, Interleaved1F1B and the zero-bubble schedules, checkpointing on and off, momentum SGD and Adam, a smaller last
    share on one replica, pipe.backward with clipping, a captured model with tied parameters, GradScaler,
    deferred BatchNorm and resuming, a sharded checkpoint saved by replica 0 and loaded by every replica into
    another balance, gradients accumulated under no_sync() (averaged once per context, by
    the count of c10d all-reduces): every driver matches plain PyTorch on both replicas' samples (or, for
    the buffers, replica 0's)."""
    proc, _ = torchrun(SCRIPT, "--mode", "train", timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ok = lines(proc, "OK ")
    assert len(ok) == 32, "\n".join(ok) + proc.stderr[-3000:]
    assert {line.split(":")[0] for line in ok} == {"OK replica 0", "OK replica 1"}
    no_process_left()


@pytest.mark.timeout(120)
def test_example_trains_two_replicas_as_plain_pytorch():
    proc, _ = torchrun("examples/data_parallel.py", "--replicas", "2", "--steps", "5", "--schedule", "GPipe",
                       "--optimizer", "adam", timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    drifts = parameter_drifts(proc.stdout)
    assert len(drifts) == 2 and max(drifts) < 1e-5, proc.stdout
    no_process_left()


@pytest.mark.timeout(120)
def test_replicas_that_build_different_pipes_are_refused_at_once():
    proc, _ = torchrun(SCRIPT, "--mode", "mismatch", timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    refused = lines(proc, "REFUSED ")
    assert len(refused) == 2, proc.stdout + proc.stderr[-3000:]
    assert "the replicas built different pipes" in proc.stdout
    assert "replica 0: 'stage 0: layers 0: Linear, 1: ReLU, 2: Linear, 128 parameters on cpu'" in proc.stdout
    assert "replica 1: 'stage 0: layers 0: Linear, 1: ReLU, 2: Linear, 153 parameters on cpu'" in proc.stdout


@pytest.mark.timeout(120)
def test_a_replica_with_one_more_step_fails_it_instead_of_waiting():
    """Replica 1 runs out of data a step early and leaves: replica 0's extra step fails, naming the
    processes that are gone, within the collective timeout (5 s here), not c10d's 30 minutes."""
    proc, _ = torchrun(SCRIPT, "--mode", "extra-step", "--collective-timeout", "5", timeout=110)
    assert lines(proc, "DONE replica 1"), proc.stdout + proc.stderr[-3000:]
    failed = lines(proc, "FAILED replica 0")
    assert failed, proc.stdout + proc.stderr[-3000:]
    seconds = float(re.search(r"after ([\d.]+)s", failed[0]).group(1))  # type: ignore[union-attr]
    assert seconds < 5 + 5, failed[0]
    assert "averaging gradients with the other replicas" in failed[0] and "worker4" in failed[0], failed[0]
    record_surfacing("a replica with one more step", "averaging fails", seconds)
    no_process_left()


@pytest.mark.timeout(120)
def test_a_dead_stage_worker_fails_every_replica_naming_it():
    """Replica 0's last stage worker is SIGKILLed in a step: its driver names it (WorkerError); the
    other replica's averaging fails naming it among the processes gone (torchrun then stops the job);
    the whole job is gone within seconds. torchrun looks at its processes every 3 s here: it stops the job
    once it sees the dead one, and at its default (0.1 s) a driver on a busy machine was stopped before it
    could print what it found."""
    proc, wall = torchrun(SCRIPT, "--mode", "kill-worker", timeout=110, monitor=3)
    assert proc.returncode != 0  # torchrun reports the killed process
    first = lines(proc, "FAILED replica 0")
    assert first and "stage 1 on worker 'worker2'" in first[0] and "WorkerError" in first[0], \
        proc.stdout + proc.stderr[-3000:]
    seconds = float(re.search(r"after ([\d.]+)s", first[0]).group(1))  # type: ignore[union-attr]
    assert seconds < 10, first[0]
    record_surfacing("replica's stage worker killed", "its driver's WorkerError", seconds)
    other = lines(proc, "FAILED replica 1")  # may be missing: torchrun can stop the job before it prints
    assert all("'worker2'" in line for line in other), other
    assert wall < 60, wall
    no_process_left()


@pytest.mark.timeout(120)
def test_a_dead_driver_fails_the_other_replicas_and_the_job_ends():
    """Replica 1's driver is SIGKILLed between steps: torchrun stops the job; replica 0, if it gets that
    far first, fails its next step naming what is gone; no process is left, in bounded time."""
    proc, wall = torchrun(SCRIPT, "--mode", "kill-driver", timeout=110)
    assert proc.returncode != 0
    failed = lines(proc, "FAILED replica 0")
    assert all("gone or do not answer" in line or "WorkerError" in line for line in failed), failed
    assert not lines(proc, "FAILED replica 1")
    assert wall < 60, wall
    no_process_left()
