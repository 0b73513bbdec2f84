"""bench_contention's spinning stage process leaves with its parent: a killed benchmark leaves no busy
process behind on the machine."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import pid_alive, wait_gone

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


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_spinner_exits_when_its_parent_dies() -> None:
    out = subprocess.run([sys.executable, "-c", ORPHANING_PARENT], cwd=BENCHMARKS, capture_output=True, text=True,
                         timeout=50, check=True).stdout
    pid = int(out.split()[-1])
    try:
        wait_gone([pid], within=20)  # the spinner must not outlive its parent
    finally:
        if pid_alive(pid):
            os.kill(pid, 9)
