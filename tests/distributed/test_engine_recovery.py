"""What still works in torch's RPC after a stage worker is SIGKILLed (issue 52: a driver that replaces a
dead stage worker and continues), asserted against the installed torch. Notes: docs/engine-notes-recovery.md.

Five scenarios, each a group of processes of its own, all started at once when the first test needs one
(``runs``): its driver (``recovery_probes.scenario``) starts the group's other members as its children,
SIGKILLs one, and prints each measurement as a ``FACT`` line; the tests below assert on those lines.

* ``static``: a driver and workers A, B, C and an idle spare D (``world_size=5``, plain torch RPC); B is
  SIGKILLed after a context's forward went A -> B -> C and before its backward.
* ``graceful``, ``graceful_timeout``: a driver and workers P, Q; Q is SIGKILLed; the driver and P call
  ``rpc.shutdown()`` (graceful), without and with a timeout.
* ``dynamic``: ``init_rpc`` without a world size: a driver, A, then B joining later; B is SIGKILLed; E
  and then F try to join.
* ``local_workers``: the project's ``workers.LocalWorkers`` (3 workers); worker2 is SIGKILLed; then
  ``close()``.

Every RPC has a timeout (``recovery_probes.RPC_TIMEOUT``), every wait a bound (``HANG_WAIT`` for what may
hang); every process ends itself after ``recovery_probes.LIMIT`` seconds, and the test kills each
scenario's process group (the driver's session) at the end, then checks that none of its processes is left."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, free_urls, wait_gone
from tests.distributed import recovery_probes as probes

pytestmark = pytest.mark.timeout(180)  # the first test waits for its scenario: up to LIMIT + 10 s

HANG_WAIT = 3.0  # seconds a call that may hang is given (those that work take milliseconds)
FAST_MS = 1000.0  # what "fails fast" / "returns promptly" means here (observed: 0.2-30 ms; a shared 2-core box)
#: What TensorPipe says when the peer's process is gone: which one depends on the connection's state.
PEER_GONE = ("EPIPE", "ECONNREFUSED", "ECONNRESET", "EOF", "pipe closed")
SCENARIOS = ("static", "graceful", "graceful_timeout", "dynamic", "local_workers")

#: (scenario, fact, value): every measurement the tests read, printed at the end of the module (-s).
MEASURED: list[tuple[str, str, Any]] = []


class Scenario:
    def __init__(self, kind: str, url: str, folder: Path) -> None:
        self.kind = kind
        self.out_path, self.err_path = folder / f"{kind}.out", folder / f"{kind}.err"
        code = f"from tests.distributed.recovery_probes import scenario; scenario({kind!r}, {url!r}, {HANG_WAIT!r})"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            # a session of its own: the driver and every process it starts are one process group
            self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.facts: dict[str, Any] | None = None
        self.seconds = 0.0

    def result(self) -> dict[str, Any]:
        """The scenario's facts, once its driver has exited (or been killed at LIMIT + 10 s)."""
        if self.facts is None:
            try:
                self.proc.wait(timeout=probes.LIMIT + 10)
            except subprocess.TimeoutExpired:
                pass
            self.kill()
            self.facts = {}
            for chunk in re.split(r"(?=FACT )", self.out_path.read_text()):  # (a line may lack its newline)
                line = chunk.splitlines()[0] if chunk else ""
                if line.startswith("FACT "):
                    _, name, seconds, value = line.split(" ", 3)
                    self.facts[name] = json.loads(value)
                    self.seconds = max(self.seconds, float(seconds))
            if "done" not in self.facts:
                pytest.fail(f"scenario {self.kind} did not finish (exit {self.proc.returncode}):\n"
                            f"{self.out_path.read_text()}\n{self.stderr()[-6000:]}")
        return self.facts

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def kill(self) -> None:
        """End what is left of the scenario's process group (the driver's session), then reap the driver."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def pids(self) -> list[int]:
        return list((self.facts or {}).get("pids", {}).values())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Scenario]]:
    """All the scenarios, started at once (each waits for processes to start and for calls to hang)."""
    folder = tmp_path_factory.mktemp("recovery")
    started = time.perf_counter()
    scenarios = {kind: Scenario(kind, url, folder) for kind, url in zip(SCENARIOS, free_urls(len(SCENARIOS)))}
    try:
        yield scenarios
    finally:
        for s in scenarios.values():
            s.kill()
        print(f"\nscenarios: {time.perf_counter() - started:.1f} s in all; drivers' last facts at "
              + ", ".join(f"{k} {s.seconds:.1f} s" for k, s in scenarios.items()))
        for kind, name, value in MEASURED:
            print(f"  {kind:<14} {name:<32} {json.dumps(value)}")
        wait_gone([pid for s in scenarios.values() for pid in s.pids()], within=10)  # SIGKILL takes a moment


def facts(runs: dict[str, Scenario], kind: str, *names: str) -> list[Any]:
    """The named facts of a scenario (recorded in MEASURED)."""
    got = runs[kind].result()
    for name in names:
        assert name in got, f"{kind}: no fact {name!r}; facts: {sorted(got)}"
        MEASURED.append((kind, name, got[name]))
    return [got[name] for name in names]


def assert_peer_gone(call: dict[str, Any]) -> None:
    """A call that failed fast with TensorPipe's plain RuntimeError about the lost connection."""
    assert call["ok"] is False, call
    assert call["ms"] < FAST_MS, call
    assert call["error"].startswith("RuntimeError: ") and any(s in call["error"] for s in PEER_GONE), call


def assert_context_worked(run: dict[str, Any]) -> None:
    """A context whose forward and backward finished, with the locally computed gradients."""
    assert run["forward"]["ok"], run
    assert run["backward"]["outcome"] == "returned", run
    assert run["max_grad_error"] is not None and run["max_grad_error"] < 1e-6, run


# --- static group: a driver, A, B, C and a spare D; B is SIGKILLed ---------------------------------

def test_after_a_worker_is_sigkilled_calls_to_live_workers_work_and_calls_to_it_fail_at_once(runs):
    """Driver -> A, A -> C and C -> A still work, as fast as before; every call to B, from the driver
    or from A, fails in milliseconds with a plain RuntimeError about the connection ("EPIPE: broken
    pipe", "ECONNREFUSED", ...) that names no worker; the first call after the kill as fast as later ones."""
    before, first_b, second_b, to_a, a_to_c, a_to_b, c_to_a = facts(
        runs, "static", "before.driver_to_A", "after.driver_to_B_first", "after.driver_to_B_second",
        "after.driver_to_A", "after.A_to_C", "after.A_to_B", "after.C_to_A")
    assert before["ok"]
    for call in [*to_a, a_to_c, c_to_a]:
        assert call["ok"] and call["ms"] < FAST_MS, call
    for call in (first_b, second_b, a_to_b):
        assert_peer_gone(call)
        assert "'B'" not in call["error"] and "name=B" not in call["error"], call  # it does not say who


def test_a_new_context_that_avoids_the_dead_worker_gives_exact_gradients_and_one_that_touches_it_fails_fast(runs):
    """New contexts after the kill: driver -> A -> C runs forward and ``dist_autograd.backward`` with the
    gradients of the same layers run locally (twice, the second after a failed context). One whose
    forward goes A -> B fails in the forward, in milliseconds: A's call to B fails and A's error comes
    back to the driver as a RuntimeError naming A ("On WorkerInfo(id=1, name=A)") with B's
    connection error inside; one sent to B directly fails at once the same way as any call to B."""
    a_c, a_b_c, b_direct, a_c_again = facts(runs, "static", "new.context_a_c", "new.context_a_b_c",
                                            "new.context_b_direct", "new.context_a_c_again")
    assert_context_worked(a_c)
    assert_context_worked(a_c_again)
    for run in (a_b_c, b_direct):
        assert "backward" not in run and run["whole"]["outcome"] == "returned", run  # the forward raised
        assert_peer_gone(run["forward"])
    assert "name=A" in a_b_c["forward"]["error"], a_b_c


def test_a_context_that_touched_the_dead_worker_fails_its_backward_at_once_and_releases(runs):
    """Context X went driver -> A -> B -> C before B was killed. Its ``dist_autograd.backward`` raises
    within milliseconds (no hang, no wait for the RPC timeout): "Error on Node 1" (A, whose gradient
    to B could not be sent) with the connection error. Leaving ``with dist_autograd.context()`` returns
    at once; A drops its part of X within milliseconds (the driver's cleanup message reaches A; A's to
    B fails unheard, and A keeps retrying it in the background: TensorPipe warnings about B in the log),
    and the contexts that follow on A work (the previous test)."""
    before, x = facts(runs, "static", "before.context_a_b_c", "x")
    assert_context_worked(before)  # the same path worked before the kill
    assert "error" not in x and x["thread_finished"], x
    backward = x["backward"]
    assert backward["outcome"] == "raised" and backward["ms"] < FAST_MS, x
    assert backward["error"].startswith("RuntimeError: Error on Node 1: "), x
    assert any(s in backward["error"] for s in PEER_GONE), x
    assert x["A_holds_context_before_release"] is True, x
    assert x["release_ms"] < FAST_MS, x
    assert x["A_dropped_context_ms"] is not None, x  # within RPC_TIMEOUT (observed: 6-7 ms)


def test_non_graceful_shutdown_returns_at_once_on_the_driver_and_on_live_workers_after_a_worker_died(runs):
    """``rpc.shutdown(graceful=False)`` on A, C, D (each told by an RPC) and then on the driver returns
    in milliseconds with B dead; all three live workers exit 0 (B: -9)."""
    stop_ms, driver, exited_ms, codes = facts(runs, "static", "shutdown.stop_rpcs_ms", "shutdown.driver",
                                              "shutdown.workers_exited_ms", "shutdown.returncodes")
    workers = facts(runs, "static", "A.shutdown", "C.shutdown", "D.shutdown")
    assert stop_ms < FAST_MS
    assert driver["outcome"] == "returned" and driver["ms"] < FAST_MS, driver
    for w in workers:
        assert w["graceful"] is False and w["outcome"] == "returned" and w["ms"] < FAST_MS, w
    assert codes == {"A": 0, "B": -signal.SIGKILL, "C": 0, "D": 0}
    assert exited_ms < 5 * FAST_MS


def test_a_spare_worker_that_idled_since_the_start_takes_the_dead_workers_stage(runs):
    """D joined the static group with the others and did nothing until B died. Then the driver builds
    B's layer on D (an RPC that creates state there) and a new context chained driver -> A -> D -> C
    runs forward and backward with exactly the gradients of the same layers run locally, twice."""
    joined, place, first, again = facts(runs, "static", "D.join", "spare.place", "spare.context_a_d_c",
                                        "spare.context_a_d_c_again")
    assert joined["ok"]
    assert place["ok"] and place["value"] == 1 and place["ms"] < FAST_MS, place  # D held nothing before
    assert_context_worked(first)
    assert_context_worked(again)


# --- graceful shutdown ------------------------------------------------------------------------------

def test_graceful_shutdown_does_not_return_after_a_peer_died(runs):
    """The default ``rpc.shutdown()`` (graceful, no timeout) on the driver, with P also in it and Q
    SIGKILLed, had not returned after HANG_WAIT seconds (torch's all-gather waits for Q forever); P was
    still running too. The scenario then ends both."""
    driver, p_alive = facts(runs, "graceful", "shutdown.driver", "P_alive_after_wait")
    assert driver["outcome"] == "hung" and driver["ms"] >= HANG_WAIT * 1000, driver
    assert p_alive is True
    assert "P.shutdown" not in runs["graceful"].result()  # P's graceful shutdown did not return either


def test_graceful_shutdown_with_a_timeout_raises_after_it_and_the_rpc_timeout(runs):
    """``rpc.shutdown(graceful=True, timeout=2)`` on the driver and P, Q SIGKILLed: it ends, but raises,
    and not at the timeout alone. P leads torch's all-gather (the smallest name): it waits the timeout
    for Q, then tells the others to proceed and raises "Followers ['Q'] timed out in _all_gather".
    The driver, told to proceed, then waits in the agent's join for every rank's count in the store,
    which the timeout does not bound: it raises ``DistStoreError`` at the store's timeout (the RPC
    timeout given to ``init_rpc``, 5 s) after the all-gather."""
    driver, p_exit, p_shutdown = facts(runs, "graceful_timeout", "shutdown.driver", "P_exit", "P.shutdown")
    assert p_exit["outcome"] == "returned" and p_exit["value"] == 0, p_exit
    timeout_ms, rpc_timeout_ms = probes.GRACEFUL_TIMEOUT * 1000, probes.RPC_TIMEOUT * 1000
    assert p_shutdown["outcome"] == "raised" and p_shutdown["timeout"] == probes.GRACEFUL_TIMEOUT, p_shutdown
    assert p_shutdown["error"].startswith("RuntimeError: Followers ['Q'] timed out in _all_gather"), p_shutdown
    assert p_shutdown["ms"] >= timeout_ms, p_shutdown
    assert driver["outcome"] == "raised", driver
    assert driver["error"].startswith("DistStoreError: wait timeout after 5000ms"), driver
    assert "shutdown/READY" in driver["error"], driver
    # ~7.0 s: the store's 5 s after ~2 s in the all-gather (a little less when P began before the driver)
    assert rpc_timeout_ms <= driver["ms"] < timeout_ms + rpc_timeout_ms + 5 * FAST_MS, driver


# --- the project's local workers ------------------------------------------------------------------

def test_local_workers_close_returns_at_once_after_one_worker_was_sigkilled(runs):
    """``workers.LocalWorkers`` (rrefpipe's stage workers, one RPC thread each): worker2 SIGKILLed;
    the driver's calls to worker1 work and to worker2 fail at once; worker1 reaches worker3 (an
    ``async_execution`` relay: a blocking one holds a stage worker's only RPC thread until the timeout)
    and fails at once to reach worker2; ``close()`` (stop RPCs, then ``shutdown(graceful=False)``,
    then reaping) returns within a second and every worker process is gone."""
    settled, to_1, to_2, w1_to_w3, w1_to_w2, close, alive = facts(
        runs, "local_workers", "before.settled_ms", "after.driver_to_worker1", "after.driver_to_worker2",
        "after.worker1_to_worker3", "after.worker1_to_worker2", "close", "alive_after_close")
    assert None not in settled.values(), settled
    for call in [*to_1, w1_to_w3]:
        assert call["ok"] and call["ms"] < FAST_MS, call
    assert_peer_gone(to_2)
    assert_peer_gone(w1_to_w2)
    assert close["outcome"] == "returned" and close["ms"] < FAST_MS, close
    assert alive == {"worker1": False, "worker2": False, "worker3": False}


# --- dynamic groups ---------------------------------------------------------------------------------

def test_a_dynamic_group_takes_a_late_joiner_and_runs_distributed_autograd_across_workers(runs):
    """``init_rpc(..., world_size=None)``: the group is dynamic (``is_static_group`` False); B joins
    after the driver and A are at work, and a context spanning A and B runs forward and backward with
    the local gradients: distributed autograd works in a dynamic group here (torch 2.13), whatever
    the PR that added dynamic groups (#71571) says."""
    static, before, joined, members, a_b = facts(runs, "dynamic", "is_static_group", "context_a", "B.joined_ms",
                                                 "members", "context_a_b")
    assert static is False
    assert_context_worked(before)
    assert joined is not None and members == ["A", "B", "driver"]
    assert_context_worked(a_b)


def test_no_process_can_join_a_dynamic_group_once_a_member_was_sigkilled(runs):
    """A SIGKILLed member stays in the group (the driver still lists B). A fresh process E then cannot
    join: joining calls every member, the call to B fails (ECONNREFUSED), and torch's clean-up (a
    graceful leave) waits for the membership token E itself holds, so ``init_rpc`` raises only at E's
    store timeout (JOIN_TIMEOUT) with a ``DistStoreError`` about ``Token_for_E_join``. The token is
    never released: the next joiner F fails the same way, waiting on E's token. The driver and A keep
    working throughout (calls and contexts)."""
    after_kill, to_b, ctx_after, e, f, after_joins, to_a, ctx_later = facts(
        runs, "dynamic", "members_after_kill", "after.driver_to_B", "after.context_a", "E.join", "F.join",
        "members_after_joins", "after_joins.driver_to_A", "after_joins.context_a")
    assert after_kill == ["A", "B", "driver"]
    assert_peer_gone(to_b)
    assert_context_worked(ctx_after)
    timeout_ms = probes.JOIN_TIMEOUT * 1000
    for joiner, name in ((e, "E"), (f, "F")):
        assert joiner["ok"] is False, joiner
        assert joiner["error"].startswith("DistStoreError: wait timeout"), joiner
        assert "Token_for_E_join" in joiner["error"], joiner  # F waits on E's token
        assert timeout_ms <= joiner["ms"] < timeout_ms + 5 * FAST_MS, joiner
    assert re.search(r"RPC agent for E encountered error when sending outgoing request #\d+ to B: ECONNREFUSED",
                     runs["dynamic"].stderr())  # TensorPipe's warning: the cause, which the error hides
    assert after_joins == ["A", "B", "driver"]
    assert to_a["ok"]
    assert_context_worked(ctx_later)
