"""How the GPU tests run their scenarios: each in a fresh interpreter (its own local workers, started
with device maps) or as a ``torchrun`` job, skipped without a GPU unless ``RREFPIPE_TEST_GPU=cpu`` asks
for a dry run on the CPU."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, run_script
from tests.gpu.scenarios import GPU

DRY_RUN = GPU == "cpu"
MARKS = [pytest.mark.skipif(not (torch.cuda.is_available() or DRY_RUN), reason="needs a CUDA GPU"),
         pytest.mark.timeout(240)]


def scenario(module: str, call: str) -> None:
    """``module.call`` (a Python call, as text) in a fresh interpreter; fails with its output."""
    try:
        run_script(f"import {module} as s\ns.{call}\nprint('ok')", timeout=150)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{call} did not finish in {exc.timeout} s:\n{exc.stdout!r}\n{exc.stderr!r}")


def torchrun_job(nproc: int, *args: str, timeout: float = 150) -> tuple[int, str, str]:
    """``torchrun --standalone --nproc-per-node nproc args``: exit status, stdout, stderr. In a session of
    its own, so that a timeout ends every rank."""
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(nproc), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the torchrun job did not finish in {timeout} s:\n{out}\n{err}")
    return proc.returncode, out, err
