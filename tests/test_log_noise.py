"""A run that ends well ends quietly: no TensorPipe "encountered error ... EOF" lines from the driver or its
local workers at shutdown. Real errors still show."""
from __future__ import annotations

import subprocess
import sys

import pytest

from rrefpipe import _cpp_log
from tests.conftest import ROOT, run_script

pytestmark = pytest.mark.timeout(120)

NOISE = ("encountered error", "EOF", "tensorpipe_agent")


def test_quiet_block_raises_the_cpp_level_and_restores_it():
    flag = _cpp_log._level_flag()
    assert flag is not None, "c10's log level flag was not found: the driver's shutdown lines would show"
    before = flag.value
    with _cpp_log.quiet_cpp_warnings():
        with _cpp_log.quiet_cpp_warnings():  # nested: the outer block restores
            assert flag.value == 2
        assert flag.value == 2
    assert flag.value == before


def test_without_the_flag_the_lines_are_explained_once(monkeypatch, capsys):
    """A torch whose c10 library the flag cannot be found in (another layout): nothing is quieted, and the
    first block says once what the lines are."""
    monkeypatch.setattr(_cpp_log, "_level_flag", lambda: None)
    monkeypatch.setattr(_cpp_log, "_explained", False)
    with _cpp_log.quiet_cpp_warnings():
        pass
    _cpp_log.quiet_from_now()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rrefpipe: ")]
    assert len(lines) == 1 and "stage workers leaving, not a failure" in lines[0]


def test_a_worker_told_to_leave_stays_quiet():
    """``quiet_from_now`` lasts: a context manager entered by hand would be undone when collected."""
    proc = run_script("""
        import gc
        from rrefpipe import _cpp_log
        _cpp_log.quiet_from_now()
        gc.collect()
        print(_cpp_log._level_flag().value)
    """)
    assert proc.stdout.strip() == "2"


def test_torchrun_job_ends_without_shutdown_noise():
    """Under torchrun the workers are not started by rrefpipe (no TORCH_CPP_LOG_LEVEL): both sides quiet
    themselves when the driver stops the group."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           "examples/multihost.py", "--steps", "3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=110)
    assert proc.returncode == 0, proc.stderr
    assert "plain PyTorch, same seed" in proc.stdout
    assert [line for line in proc.stderr.splitlines() if any(word in line for word in NOISE + ("won't send",))] == []


def test_demo_ends_without_shutdown_noise():
    proc = subprocess.run([sys.executable, "examples/demo.py", "--steps", "3"], cwd=ROOT, capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr
    assert "plain PyTorch, same seed" in proc.stdout
    noisy = [line for line in proc.stderr.splitlines() if any(word in line for word in NOISE)]
    assert noisy == []


def test_a_stage_error_still_shows():
    proc = run_script("""
        import torch
        import torch.distributed.autograd as dist_autograd
        from torch import nn
        from rrefpipe import Pipe

        class Fails(nn.Module):
            def forward(self, x):
                raise ValueError("a layer's own error")

        with Pipe(nn.Sequential(nn.Linear(2, 2), Fails()), devices=["cpu", "cpu"]) as pipe:
            with dist_autograd.context():
                pipe(torch.ones(2, 2))
    """, check=False)
    assert proc.returncode == 1
    assert "StageValueError: stage 1 on worker 'worker2', micro-batch 0 failed in forward: ValueError: a layer's " \
           "own error" in proc.stderr
    assert not [line for line in proc.stderr.splitlines() if any(word in line for word in NOISE)]
