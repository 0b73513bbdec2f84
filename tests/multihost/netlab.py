"""Test hosts on one machine: Linux network namespaces on one Ethernet segment.

Each host is a network namespace with ``lo`` up and one interface ``lan0`` at ``10.77.0.<k+1>/24``, a range
that exists only inside these namespaces: nothing here sends to any other address. The segment is

* ``Lab(n)``: a bridge in a switch namespace, joined to each host by a veth pair;
* ``Lab(n, delay_ms=d)``: the relay of :mod:`tests.multihost.relay` (it runs in the switch namespace)
  between TAP devices moved into the hosts, adding ``d`` ms one way to every frame (this kernel has no
  netem); ``d=0`` gives the same path without the delay.

``rate="100mbit"`` puts a token bucket (``tc ... tbf``) on every host's ``lan0``, so everything a host
sends is shaped. :meth:`Lab.spawn` runs a command in a host **and in a new PID namespace**
(``unshare --pid --fork --kill-child``): TensorPipe's CMA channel, which copies between the memory of
processes that see each other, cannot then bypass the link. :meth:`Lab.kill` ends one host: every
process on it SIGKILLed at once. :meth:`Lab.close` kills every process in the hosts (PID-namespace init
first, then whatever ``ip netns pids`` still lists), stops the relay and deletes the namespaces. If the harness process itself is killed, its children die with it (parent-death
signal); the namespaces it leaves are removed by :func:`cleanup_stale` on the next run.
"""
from __future__ import annotations

import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = ["Lab", "Host", "unavailable", "relay_unavailable", "cleanup_stale", "our_namespaces", "SUBNET", "IFNAME"]

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "rrpmh"  # namespaces are PREFIX<pid of the creating process>n<lab>-<role>
SUBNET = "10.77.0"
IFNAME = "lan0"
_labs = itertools.count()


class LabError(RuntimeError):
    """A command building or tearing down the lab failed."""


def sh(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise LabError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL when the process that started it dies, however it dies (kept across
    exec; ``unshare --kill-child`` passes it on to the PID namespace)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def unavailable() -> str | None:
    """Why test hosts cannot be made here, or None if they can (tries a namespace and a veth pair)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (ip netns add); run the multi-host tests as root"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found: install iproute2 (ip, tc) and util-linux (unshare)"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        sh("ip", "netns", "add", probe)
        sh("ip", "link", "add", "name", "probe0", "netns", probe,
           "type", "veth", "peer", "name", "probe1", "netns", probe)
        sh("ip", "netns", "exec", probe, "unshare", "--pid", "--fork", "--kill-child", "true")
    except (LabError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot make test hosts here: {exc}"
    finally:
        sh("ip", "netns", "del", probe, check=False)
    return None


def relay_unavailable() -> str | None:
    """Why the delaying relay cannot run here (it needs TAP devices), or None."""
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR)
    except OSError as exc:
        return f"the latency relay needs TAP devices, but /dev/net/tun cannot be opened: {exc}"
    os.close(fd)
    return None


def our_namespaces() -> list[str]:
    """Namespaces this harness made (in any process) that still exist."""
    out = sh("ip", "-j", "netns", "list", check=False).stdout.strip()
    names = [entry["name"] for entry in json.loads(out)] if out else []
    return [n for n in names if n.startswith(PREFIX)]


def cleanup_stale() -> list[str]:
    """Delete lab namespaces whose creating process is gone (left by a killed run); returns their names."""
    removed = []
    for ns in our_namespaces():
        pid = ns[len(PREFIX):].split("n", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            _kill_all_in(ns)
            sh("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    return removed


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill_all_in(ns: str, within: float = 5.0) -> None:
    """SIGKILL every process in namespace ``ns`` (only this harness starts any there)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        pids = [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


@dataclass(frozen=True)
class Host:
    """One test host: namespace ``ns`` whose ``lan0`` has ``addr``."""

    index: int
    ns: str
    addr: str


class Lab:
    """``hosts`` test hosts on one segment; use as a context manager (or call :meth:`close`)."""

    def __init__(self, hosts: int, *, delay_ms: float | None = None, rate: str | None = None,
                 logdir: Path | None = None) -> None:
        self.id = f"{PREFIX}{os.getpid()}n{next(_labs)}"
        self.hosts = [Host(k, f"{self.id}-h{k}", f"{SUBNET}.{k + 1}") for k in range(hosts)]
        self.switch = f"{self.id}-sw"
        self.delay_ms = delay_ms
        self.rate = rate
        self.logdir = logdir
        self.relay: subprocess.Popen[str] | None = None
        self._relay_log: IO[bytes] | None = None
        self._procs: list[tuple[str, subprocess.Popen[bytes], IO[bytes] | None]] = []
        self._made: list[str] = []

    # -- building ------------------------------------------------------------------------------
    def start(self) -> Lab:
        try:
            for ns in [self.switch] + [h.ns for h in self.hosts]:
                sh("ip", "netns", "add", ns)
                self._made.append(ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
            if self.delay_ms is None:
                self._bridge()
            else:
                self._relay(self.delay_ms)
            for host in self.hosts:
                sh("ip", "-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", IFNAME)
                sh("ip", "-n", host.ns, "link", "set", IFNAME, "up")
                if self.rate:
                    sh("tc", "-n", host.ns, "qdisc", "add", "dev", IFNAME, "root", "tbf", "rate", self.rate,
                       "burst", "32kbit", "latency", "400ms")
        except BaseException:
            self.close()
            raise
        return self

    def _bridge(self) -> None:
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            port = f"p{host.index}"
            sh("ip", "link", "add", "name", IFNAME, "netns", host.ns, "type", "veth", "peer", "name", port,
               "netns", self.switch)
            sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            sh("ip", "-n", self.switch, "link", "set", port, "up")

    def _relay(self, delay_ms: float) -> None:
        taps = [f"tap{h.index}" for h in self.hosts]
        self._relay_log = self._log("relay")
        self.relay = subprocess.Popen(
            ["ip", "netns", "exec", self.switch, sys.executable, "-m", "tests.multihost.relay",
             "--delay-ms", str(delay_ms), *taps],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._relay_log, text=True,
            preexec_fn=_die_with_parent)
        assert self.relay.stdout is not None
        if not select.select([self.relay.stdout], [], [], 20)[0] or self.relay.stdout.readline().strip() != "ready":
            raise LabError(f"the relay did not start (exit status {self.relay.poll()}); see {self.log_path('relay')}")
        for host, tap in zip(self.hosts, taps):
            sh("ip", "-n", self.switch, "link", "set", tap, "netns", host.ns)
            sh("ip", "-n", host.ns, "link", "set", tap, "name", IFNAME)

    # -- using ---------------------------------------------------------------------------------
    def spawn(self, host: Host, argv: Sequence[str], *, name: str, env: Mapping[str, str] | None = None,
              pid_namespace: bool = True) -> subprocess.Popen[bytes]:
        """Run ``argv`` on ``host`` (cwd: the repository; output to the log ``name``)."""
        prefix = ["ip", "netns", "exec", host.ns]
        if pid_namespace:
            prefix += ["unshare", "--pid", "--fork", "--kill-child"]
        full_env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        full_env.update(env or {})
        log = self._log(name)
        proc = subprocess.Popen([*prefix, *argv], cwd=ROOT, env=full_env, stdin=subprocess.DEVNULL,
                                stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        self._procs.append((name, proc, log))
        return proc

    def pids(self, host: Host) -> list[int]:
        """The processes running on ``host`` now (those in its network namespace)."""
        return [int(p) for p in sh("ip", "netns", "pids", host.ns).stdout.split()]

    def kill(self, host: Host) -> list[int]:
        """The host dies: SIGKILL every process on it at once (its kernel, still up, closes their
        connections, as for processes killed on a real host). Returns their pids, all gone on return."""
        pids = self.pids(host)
        _kill_all_in(host.ns)
        left = self.pids(host)
        if left:
            raise LabError(f"processes {left} of {host.ns} outlived SIGKILL")
        for _, proc, _ in self._procs:
            if proc.pid in pids:
                proc.wait(timeout=5)  # (reaped: spawn's own child is the host's first process)
        return pids

    def counters(self, host: Host) -> dict[str, int]:
        """Bytes ``host``'s ``lan0`` has received and sent so far."""
        out = sh("ip", "-n", host.ns, "-j", "-s", "link", "show", "dev", IFNAME).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"rx": int(stats["rx"]["bytes"]), "tx": int(stats["tx"]["bytes"])}

    def output(self, name: str) -> str:
        path = self.log_path(name)
        return path.read_text(errors="replace") if self.logdir is not None and path.exists() else ""

    def outputs(self) -> str:
        """Every log of this lab, for failure messages."""
        names = ["relay"] * (self.delay_ms is not None) + [name for name, _, _ in self._procs]
        return "\n".join(f"--- {name} ---\n{self.output(name)[-4000:]}" for name in names)

    def log_path(self, name: str) -> Path:
        """Where the output of ``name`` goes (under ``logdir``; without one, nothing is kept)."""
        return (self.logdir or Path(os.devnull)) / f"{self.id}-{name}.log"

    def _log(self, name: str) -> IO[bytes] | None:
        return open(self.log_path(name), "wb") if self.logdir is not None else None  # noqa: SIM115 (closed in close())

    # -- tearing down --------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process in the hosts, stop the relay, delete the namespaces (idempotent)."""
        for _, proc, _ in self._procs:
            if proc.poll() is None:
                proc.kill()  # unshare: --kill-child takes the PID namespace's init, and with it the rest
        for _, proc, log in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if log is not None:
                log.close()
        if self.relay is not None:
            if self.relay.stdin is not None:
                self.relay.stdin.close()  # EOF: the relay stops (and prints its counts)
            try:
                self.relay.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.relay.kill()
                self.relay.wait()
            if self.relay.stdout is not None:
                self.relay.stdout.close()
            self.relay = None
        if self._relay_log is not None:
            self._relay_log.close()
            self._relay_log = None
        for ns in self._made:
            _kill_all_in(ns)
        for ns in reversed(self._made):
            sh("ip", "netns", "del", ns, check=False)
        self._made = []

    def __enter__(self) -> Lab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
