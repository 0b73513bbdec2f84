"""Shared fixtures: one set of local stage workers for the multi-process tests, a script runner, and the
command lines' --help texts (each run once per test process)."""
from __future__ import annotations

import functools
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Stage workers must import the test layers: put the repo root on their path.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


_surfacing: list[tuple[str, str, float]] = []
_pending_surfacing: list[tuple[str, str, float]] = []  # recorded during the test that runs now


def record_surfacing(test: str, what: str, seconds: float) -> None:
    """Note how long a fault took to surface; printed at the end of the run."""
    _pending_surfacing.append((test, what, seconds))


_cluster_pids: dict[str, int] = {}  # the session group's live workers, by name
_cluster_lost: list[tuple[str, str, list[str]]] = []  # (test, worker, its captured stderr lines on workers)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _surfacing:
        terminalreporter.section("fault surfacing times")
        for test, what, seconds in _surfacing:
            terminalreporter.write_line(f"{test:<48} {what:<34} {seconds * 1000:8.1f} ms")
    if _cluster_lost:
        terminalreporter.section("session workers lost")
        for test, worker, lines in _cluster_lost:
            terminalreporter.write_line(f"{worker} was gone after {test}; its test's stderr on workers:")
            for line in lines or ["(nothing)"]:
                terminalreporter.write_line(f"    {line}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Name the test after which a worker of the session group was gone: a later test that uses it
    fails with "EOF", and the worker's own last words went to this test's captured stderr, which pytest
    shows only for failures. Reported at the end of the run; the outcome is left as it is.

    Both reports travel in the teardown report's ``user_properties``: under pytest-xdist the tests run
    in worker processes and only reports reach the process that prints the summary."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "teardown":
        return
    for name, pid in list(_cluster_pids.items()):
        if not pid_alive(pid):
            del _cluster_pids[name]
            lines = [line for line in report.capstderr.splitlines() if "worker" in line.lower()]
            report.user_properties.append(("rrefpipe_cluster_lost", (item.nodeid, name, lines[-20:])))
    for entry in _pending_surfacing:
        report.user_properties.append(("rrefpipe_surfacing", entry))
    _pending_surfacing.clear()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collect what the teardown reports carry, in the process that prints the summary."""
    for key, value in report.user_properties:
        if key == "rrefpipe_surfacing":
            _surfacing.append(tuple(value))  # type: ignore[arg-type]
        elif key == "rrefpipe_cluster_lost":
            _cluster_lost.append(tuple(value))  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def cluster() -> Iterator[object]:
    """Four local stage workers, with this pytest process as the driver, for the whole session."""
    from workers import LocalWorkers

    workers = LocalWorkers(4, threads=1).start()
    pids = workers.pids
    _cluster_pids.update(zip(workers.names, pids))
    try:
        yield workers
    finally:
        _cluster_pids.clear()  # they are stopped now, not lost
        workers.close()
    assert not [pid for pid in pids if pid_alive(pid)], "stage workers outlived the session"


def free_urls(count: int) -> list[str]:
    """``count`` distinct free rendezvous addresses: each port is held until all are chosen (one port chosen
    twice put two scenarios on one store, whose client then failed to validate: "Connection reset by peer")."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    """A TCP port free on loopback now (for a torchrun agent's rendezvous or a store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_gone(pids: list[int], within: float) -> float:
    """Seconds until every pid is gone; fails after ``within`` (polls: they need not be our children)."""
    start = time.monotonic()
    while any(pid_alive(p) for p in pids):
        if time.monotonic() - start > within:
            pytest.fail(f"processes {[p for p in pids if pid_alive(p)]} still alive after {within}s")
        time.sleep(0.05)
    return time.monotonic() - start


def run_script(code: str, timeout: float = 90, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (its own RPC state); fail with its output when it fails."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        pytest.fail(f"script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


class WarmPython:
    """``python ARGV`` in a child forked from one warm interpreter that has imported torch and rrefpipe
    (``tests/script_runner.py``): ~4 CPU-seconds less per script than a fresh interpreter. For scripts
    that train (guide pages, the tutorial, benchmark smoke runs); a test of the interpreter's own start,
    exit or signals wants :func:`run_script` or ``subprocess``."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "script_runner.py")], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._pending = b""
        self._outputs = tempfile.TemporaryDirectory(prefix="warm-python-")
        self._runs = 0

    def _reply(self, deadline: float) -> object | None:
        """The runner's next line (JSON), or None at the deadline; fails if the runner has exited."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                pytest.fail(f"the script runner exited ({self.proc.wait()})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: Sequence[str], timeout: float, cwd: Path = ROOT, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        """``python ARGV`` (``ARGV`` a script and its arguments, or ``-m``, a module and its arguments) in
        ``cwd``, with ``env`` added to the environment: its exit status and output, as ``subprocess.run`` gives
        them. At ``timeout`` seconds the script and the stage workers it started are killed and the test fails."""
        self._runs += 1
        out = Path(self._outputs.name) / f"{self._runs}.out"
        err = out.with_suffix(".err")
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps([list(map(str, argv)), str(cwd), str(out), str(err), env or {}]) + "\n").encode())
        deadline = time.monotonic() + timeout
        pid = self._reply(deadline)
        assert isinstance(pid, int), f"the script runner did not fork: {pid}"
        status = self._reply(deadline)
        if status is None:
            os.killpg(pid, signal.SIGKILL)  # the script's process group: it and the workers it started
            status = self._reply(time.monotonic() + 30)
            pytest.fail(f"python {' '.join(map(str, argv))} ran past {timeout} s (killed: {status}):\n"
                        f"{out.read_text()}\n{err.read_text()}")
        assert isinstance(status, int), status
        return subprocess.CompletedProcess([sys.executable, *argv], status, out.read_text(), err.read_text())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._outputs.cleanup()


_warm: WarmPython | None = None


def warm() -> WarmPython:
    """This test process's :class:`WarmPython`, started at the first call (stopped at the session's end)."""
    global _warm
    if _warm is None:
        _warm = WarmPython()
    return _warm


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _warm
    if _warm is not None:
        _warm.close()
        _warm = None


@pytest.fixture
def warm_python() -> WarmPython:
    """This test process's :class:`WarmPython`."""
    return warm()


@functools.lru_cache(maxsize=None)
def help_text(*argv: str) -> str:
    """The stdout of ``python ARGV --help`` (e.g. ``help_text("-m", "rrefpipe", "demo")``, or
    ``help_text("examples/demo.py")``), run once per test process: the CLI tests and the API-page tests
    read the same help of the real entry points, each forked from the warm interpreter (:func:`warm`),
    where a fresh one imported torch anew (~4 CPU-s).

    At COLUMNS=100, the width the API pages paste; the width only rewraps usage and help text, which
    no reader of it depends on. Fails with the output when the command fails (and then is not cached)."""
    proc = warm().run([*argv, "--help"], timeout=120, env={"COLUMNS": "100"})  # (forked from a warm interpreter)
    if proc.returncode != 0:
        pytest.fail(f"python {' '.join(argv)} --help failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def parameter_drifts(output: str) -> list[float]:
    """The ``max parameter difference from plain PyTorch: <x>`` values that the drivers of a torchrun job
    printed (examples/data_parallel.py). Ranks share the job's stdout, so one rank's line may run into
    another's: read the numbers, not the lines."""
    return [float(x) for x in re.findall(r"max parameter difference from plain PyTorch: (\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)", output)]
