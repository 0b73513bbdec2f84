"""bench_contention's spinning stage process leaves with its parent: a killed benchmark leaves no busy
process behind on the machine."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# The parent starts a spinner, passes on its pid once it is ready, and dies without killing it.
ORPHANING_PARENT = """
import os, subprocess, sys
p = subprocess.Popen([sys.executable, "bench_contention.py", "--spin", "tiny", "8", "0"], stdout=subprocess.PIPE,
                     stderr=subprocess.DEVNULL, text=True)  # holds none of the pipes the test reads to EOF
assert p.stdout.readline().strip() == "ready"
print(p.pid, flush=True)
os._exit(0)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie waiting for a reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_spinner_exits_when_its_parent_dies() -> None:
    out = subprocess.run([sys.executable, "-c", ORPHANING_PARENT], cwd=BENCHMARKS, capture_output=True, text=True,
                         timeout=50, check=True).stdout
    pid = int(out.split()[-1])
    try:
        deadline = time.monotonic() + 20
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling a pid: nothing to wait on for a process that is not our child
        assert not running(pid), "the spinner outlived its parent"
    finally:
        if running(pid):
            os.kill(pid, 9)
