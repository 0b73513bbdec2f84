"""Scenarios that tests/distributed/test_engine_recovery.py runs, each in processes of its own: a driver
(``python -c "...scenario(...)"``, started by the test in a session of its own) that starts its RPC
group's other members as its children, SIGKILLs one of them and reports what still works.

Plain torch RPC (no rrefpipe) except ``local_workers_scenario``, which runs the project's own
``workers.LocalWorkers``. Every process ends itself after a deadline (``exit_after``), whatever it is
waiting on; the test also kills the driver's whole process group. A driver prints one line per fact,
``FACT <name> <json>``, as soon as it is measured, so a scenario cut short still shows how far it got."""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

RPC_TIMEOUT = 5.0  # seconds: the group's default, and the timeout of every call the scenarios make
JOIN_TIMEOUT = 2.0  # seconds: the RPC (and store) timeout of the processes that join a dynamic group late
GRACEFUL_TIMEOUT = 2.0  # seconds: rpc.shutdown(graceful=True, timeout=) in the graceful_timeout scenario
#: Seconds after which any process of a scenario ends itself. Generous: with two test processes each
#: running every scenario at once (pytest-xdist splitting this module), A took over 25 s to join.
LIMIT = 100.0
START_WAIT = 0.6 * LIMIT  # seconds a driver waits for a process it started to join or exit

_modules: dict[str, nn.Module] = {}
_stop = threading.Event()
_graceful: list[tuple[bool, float]] = []


# --- reporting and bounding ----------------------------------------------------------------------

_T0 = time.perf_counter()


def fact(name: str, value: Any) -> None:
    """Report a measurement: ``FACT <name> <seconds since this process started> <json>``."""
    sys.stdout.flush()  # (one write per line: the processes of a scenario share one output file)
    os.write(1, f"FACT {name} {time.perf_counter() - _T0:.2f} {json.dumps(value)}\n".encode())


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def describe(exc: BaseException) -> str:
    """The exception's type and text, on one line (a remote traceback's lines joined), cut at 1,500."""
    text = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text[:1500]}"


def exit_after(seconds: float, code: int = 3) -> None:
    """End this process after ``seconds`` whatever it is doing (a hung backward or shutdown)."""
    timer = threading.Timer(seconds, os._exit, args=(code,))
    timer.daemon = True
    timer.start()


def bounded(fn: Callable[[], Any], within: float) -> dict[str, Any]:
    """Run ``fn`` on a thread of its own for at most ``within`` seconds: {"outcome": "returned" |
    "raised" | "hung", "ms", "error"?, "value"?}. A hung thread is left behind (daemon)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # the outcome we report
            box["error"] = describe(e)

    start = time.perf_counter()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(within)
    out: dict[str, Any] = {"ms": ms(time.perf_counter() - start)}
    if t.is_alive():
        out["outcome"] = "hung"
    elif "error" in box:
        out.update(outcome="raised", error=box["error"])
    else:
        out.update(outcome="returned", value=box.get("value"))
    return out


def poll(done: Callable[[], bool], within: float) -> float | None:
    """Milliseconds until ``done()``; None if it is still false after ``within`` seconds."""
    start = time.perf_counter()
    while not done():
        if time.perf_counter() - start > within:
            return None
        time.sleep(0.01)
    return ms(time.perf_counter() - start)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def sigkill(proc: subprocess.Popen[bytes], within: float = 10.0) -> float:
    """SIGKILL a child and reap it; the seconds until it was gone."""
    start = time.perf_counter()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=within)
    return time.perf_counter() - start


# --- worker side: RPC targets ----------------------------------------------------------------------

def place(key: str, module: nn.Module) -> int:
    """Keep ``module`` on this worker under ``key`` (a stage built here); how many are kept."""
    _modules[key] = module
    return len(_modules)


def getpid() -> int:
    return os.getpid()


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


def hop(key: str, x: torch.Tensor, rest: list[tuple[str, str]], timeout: float) -> torch.Tensor:
    """This worker's layer on ``x``, then the rest of the chain, worker to worker: each hop an
    ``rpc_sync`` from this function's body (recorded in the caller's distributed-autograd context)."""
    y = _modules[key](x)
    if not rest:
        return y
    (worker, next_key), later = rest[0], rest[1:]
    return rpc.rpc_sync(worker, hop, args=(next_key, y, later, timeout), timeout=timeout)


def gradients(key: str, context_id: int) -> dict[str, torch.Tensor]:
    grads = dist_autograd.get_gradients(context_id)
    return {name: grads[p].clone() for name, p in _modules[key].named_parameters() if p in grads}


def context_alive(context_id: int) -> bool:
    """Whether this worker still holds the context (cleanup messages not yet arrived, or lost)."""
    try:
        dist_autograd._retrieve_context(context_id)
        return True
    except RuntimeError:
        return False


def relay(to: str, timeout: float) -> dict[str, Any]:
    """From this worker: an ``rpc_sync`` echo to ``to`` (worker to worker), timed."""
    start = time.perf_counter()
    try:
        rpc.rpc_sync(to, echo, args=(torch.ones(4),), timeout=timeout)
        return {"ok": True, "ms": ms(time.perf_counter() - start)}
    except Exception as e:  # reported to the caller
        return {"ok": False, "ms": ms(time.perf_counter() - start), "error": describe(e)}


@rpc.functions.async_execution
def relay_async(to: str, timeout: float) -> torch.futures.Future:
    """:func:`relay` for a worker with one RPC thread (rrefpipe's stage workers), where a body that
    waits on its own RPC holds the only thread that could complete it: the echo is sent from the body
    and the reply goes back when it arrives (the callback only computes)."""
    start = time.perf_counter()

    def done(fut: torch.futures.Future) -> dict[str, Any]:
        try:
            fut.wait()
            return {"ok": True, "ms": ms(time.perf_counter() - start)}
        except Exception as e:  # reported to the caller
            return {"ok": False, "ms": ms(time.perf_counter() - start), "error": describe(e)}

    return rpc.rpc_async(to, echo, args=(torch.ones(4),), timeout=timeout).then(done)


def request_stop(graceful: bool, timeout: float = 0.0) -> None:
    """Make this worker leave: ``rpc.shutdown(graceful, timeout)`` once it has answered (0: torch's
    default, no timeout)."""
    _graceful.append((graceful, timeout))
    _stop.set()


def worker_main(name: str, rank: int, world_size: int | None, url: str, timeout: float = RPC_TIMEOUT,
                wait_for_go: bool = False) -> None:
    """A plain torch RPC worker: join (once its driver writes a line to its stdin, with ``wait_for_go``:
    a process ready to join at once), serve until ``request_stop``, then ``rpc.shutdown`` as asked;
    prints ``FACT <name>.join`` and ``FACT <name>.shutdown`` with how long each took."""
    exit_after(LIMIT)
    if wait_for_go:
        sys.stdin.readline()
    options = rpc.TensorPipeRpcBackendOptions(init_method=url, rpc_timeout=timeout, num_worker_threads=4,
                                              _transports=["uv"])
    start = time.perf_counter()
    try:
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    except BaseException as e:  # a dynamic join that fails: reported, then this process ends
        fact(f"{name}.join", {"ok": False, "ms": ms(time.perf_counter() - start), "error": describe(e)})
        os._exit(0)
    fact(f"{name}.join", {"ok": True, "ms": ms(time.perf_counter() - start)})
    _stop.wait()
    graceful, timeout = _graceful[0]
    fact(f"{name}.shutdown", {"graceful": graceful, "timeout": timeout,
                              **bounded(lambda: rpc.shutdown(graceful=graceful, timeout=timeout), LIMIT)})
    os._exit(0)


def start_worker(name: str, rank: int, world_size: int | None, url: str, timeout: float = RPC_TIMEOUT,
                 wait_for_go: bool = False) -> subprocess.Popen[bytes]:
    code = ("from tests.distributed.recovery_probes import worker_main; "
            f"worker_main({name!r}, {rank}, {world_size!r}, {url!r}, {timeout!r}, {wait_for_go!r})")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE if wait_for_go else None)


def go(proc: subprocess.Popen[bytes]) -> None:
    """Let a worker started with ``wait_for_go`` join now."""
    assert proc.stdin is not None
    proc.stdin.write(b"go\n")
    proc.stdin.flush()


def stop(names: list[str], graceful: bool, timeout: float = 0.0) -> None:
    """Ask each worker to leave (it shuts down as asked once it has answered); errors ignored."""
    futures = []
    for name in names:
        try:
            futures.append(rpc.rpc_async(name, request_stop, args=(graceful, timeout), timeout=RPC_TIMEOUT))
        except Exception:
            pass
    for f in futures:
        try:
            f.wait()
        except Exception:
            pass


def options(url: str) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(init_method=url, rpc_timeout=RPC_TIMEOUT, num_worker_threads=8,
                                           _transports=["uv"])


def call(worker: str, fn: Callable[..., Any], *args: Any) -> Any:
    return rpc.rpc_sync(worker, fn, args=args, timeout=RPC_TIMEOUT)


def timed_call(worker: str, fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        value = call(worker, fn, *args)
        kept = value if isinstance(value, (int, bool, dict)) else None  # tensors are not reported
        return {"ok": True, "ms": ms(time.perf_counter() - start), "value": kept}
    except Exception as e:  # reported
        return {"ok": False, "ms": ms(time.perf_counter() - start), "error": describe(e)}


def scenario(kind: str, url: str, hang_wait: float) -> None:
    """Run one scenario as its driver; ``kind`` names a function below."""
    exit_after(LIMIT)
    try:
        {"static": static_scenario, "graceful": graceful_scenario, "graceful_timeout": graceful_timeout_scenario,
         "dynamic": dynamic_scenario, "local_workers": local_workers_scenario}[kind](url, hang_wait)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    fact("done", True)
    os._exit(0)


# --- a chain of layers and its gradients -----------------------------------------------------------

class Chain:
    """One Linear per worker key; ``run(ctx, path)`` sends x through the path worker to worker, the loss
    here; ``check(ctx, path)`` compares every layer's gradients with the same layers run here."""

    def __init__(self, shapes: dict[str, tuple[int, int]]) -> None:
        torch.manual_seed(52)
        self.layers = {key: nn.Linear(*shape) for key, shape in shapes.items()}
        self.x = torch.randn(6, 4)
        self.weights = torch.randn(6, 8)  # the loss: sum(output * weights[:, :output's width])

    def place(self, worker: str, key: str) -> Any:
        return timed_call(worker, place, key, copy.deepcopy(self.layers[key]))

    def forward(self, path: list[tuple[str, str]]) -> torch.Tensor:
        (first, key), rest = path[0], path[1:]
        out = rpc.rpc_sync(first, hop, args=(key, self.x, rest, RPC_TIMEOUT), timeout=RPC_TIMEOUT)
        return (out * self.weights[:, :out.shape[1]]).sum()

    def expected(self, path: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
        layers = {key: copy.deepcopy(self.layers[key]) for _, key in path}
        h = self.x
        for _, key in path:
            h = layers[key](h)
        (h * self.weights[:, :h.shape[1]]).sum().backward()
        return {f"{key}.{n}": p.grad for key, layer in layers.items() for n, p in layer.named_parameters()
                if p.grad is not None}

    def gradients(self, context_id: int, path: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
        out = {}
        for worker, key in path:
            out.update({f"{key}.{n}": g for n, g in call(worker, gradients, key, context_id).items()})
        return out

    def max_error(self, context_id: int, path: list[tuple[str, str]]) -> float | None:
        """The largest absolute difference from the local gradients; None when a gradient is missing."""
        actual, expected = self.gradients(context_id, path), self.expected(path)
        if sorted(actual) != sorted(expected):
            return None
        return max(float((actual[n] - expected[n]).abs().max()) for n in expected)


def context_run(chain: Chain, path: list[tuple[str, str]], within: float) -> dict[str, Any]:
    """A new context (on a thread of its own, bounded): forward along ``path``, backward, gradients
    checked; each phase's outcome and milliseconds."""
    report: dict[str, Any] = {}

    def body() -> None:
        with dist_autograd.context() as ctx:
            start = time.perf_counter()
            try:
                loss = chain.forward(path)
            except Exception as e:  # reported
                report["forward"] = {"ok": False, "ms": ms(time.perf_counter() - start), "error": describe(e)}
                return
            report["forward"] = {"ok": True, "ms": ms(time.perf_counter() - start)}
            report["backward"] = bounded(lambda: dist_autograd.backward(ctx, [loss]), within)
            if report["backward"]["outcome"] == "returned":
                report["max_grad_error"] = chain.max_error(ctx, path)

    start = time.perf_counter()
    report["whole"] = bounded(body, 2 * within + 4 * RPC_TIMEOUT)
    report["whole"].pop("value", None)
    report["whole"]["ms"] = ms(time.perf_counter() - start)
    return report


# --- scenario: a static group of a driver and workers A, B, C and a spare D; B is SIGKILLed --------

def static_scenario(url: str, hang_wait: float) -> None:
    names = ["A", "B", "C", "D"]
    procs = {name: start_worker(name, rank, 5, url) for rank, name in enumerate(names, start=1)}
    try:
        _static(procs, url, hang_wait)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


def _static(procs: dict[str, subprocess.Popen[bytes]], url: str, hang_wait: float) -> None:
    rpc.init_rpc("driver", rank=0, world_size=5, rpc_backend_options=options(url))
    fact("pids", {name: p.pid for name, p in procs.items()} | {"driver": os.getpid()})
    chain = Chain({"a": (4, 5), "b": (5, 5), "c": (5, 3), "d": (5, 5)})
    for worker, key in [("A", "a"), ("B", "b"), ("C", "c")]:
        assert chain.place(worker, key)["ok"]
    through_b = [("A", "a"), ("B", "b"), ("C", "c")]
    fact("before.context_a_b_c", context_run(chain, through_b, hang_wait))  # the pipeline works at all
    fact("before.driver_to_A", timed_call("A", echo, torch.ones(4)))

    # A context that touches B, B killed between its forward and its backward (context X).
    x_forward_done, x_killed, x_done = threading.Event(), threading.Event(), threading.Event()
    x: dict[str, Any] = {}

    def context_x() -> None:
        try:
            with dist_autograd.context() as ctx:
                x["id"] = ctx
                loss = chain.forward(through_b)
                x_forward_done.set()
                x_killed.wait(RPC_TIMEOUT * 4)
                x["backward"] = bounded(lambda: dist_autograd.backward(ctx, [loss]), hang_wait)
                x["A_holds_context_before_release"] = call("A", context_alive, ctx)
                x["release_started"] = time.perf_counter()
            x["release_ms"] = ms(time.perf_counter() - x.pop("release_started"))
        except Exception as e:  # reported
            x["error"] = describe(e)
        finally:
            x_done.set()

    x_thread = threading.Thread(target=context_x, daemon=True)
    x_thread.start()
    assert x_forward_done.wait(RPC_TIMEOUT * 2), x

    fact("kill_ms", ms(sigkill(procs["B"])))
    killed = time.perf_counter()

    # 1. RPCs right after the kill: to live A, to dead B (twice), A to C, A to B.
    fact("after.driver_to_B_first", timed_call("B", echo, torch.ones(4)))
    fact("after.driver_to_B_second", timed_call("B", echo, torch.ones(4)))
    fact("after.driver_to_A", [timed_call("A", echo, torch.ones(4)) for _ in range(3)])
    fact("after.A_to_C", call("A", relay, "C", RPC_TIMEOUT))
    fact("after.A_to_B", call("A", relay, "B", RPC_TIMEOUT))
    fact("after.C_to_A", call("C", relay, "A", RPC_TIMEOUT))
    fact("after.rpc_ms_since_kill", ms(time.perf_counter() - killed))

    # 3. Context X: its backward, its release, A's copy of it.
    x_killed.set()
    x_thread.join(2 * hang_wait + 4 * RPC_TIMEOUT)
    x["thread_finished"] = x_done.is_set()
    if "id" in x:  # the release reaches A by a cleanup message of its own (not awaited): poll for it
        x["A_dropped_context_ms"] = poll(lambda: not call("A", context_alive, x["id"]), RPC_TIMEOUT)
    fact("x", x)

    # 2. New contexts: driver -> A -> C (never B) and driver -> A -> B -> C.
    fact("new.context_a_c", context_run(chain, [("A", "a"), ("C", "c")], hang_wait))
    fact("new.context_a_b_c", context_run(chain, through_b, hang_wait))
    fact("new.context_b_direct", context_run(chain, [("B", "b"), ("C", "c")], hang_wait))
    fact("new.context_a_c_again", context_run(chain, [("A", "a"), ("C", "c")], hang_wait))

    # 5. The spare D: build B's stage there, then A -> D -> C.
    chain.layers["d"] = chain.layers["b"]  # D takes over B's stage (its weights, as from a checkpoint)
    fact("spare.place", chain.place("D", "d"))
    fact("spare.context_a_d_c", context_run(chain, [("A", "a"), ("D", "d"), ("C", "c")], hang_wait))
    fact("spare.context_a_d_c_again", context_run(chain, [("A", "a"), ("D", "d"), ("C", "c")], hang_wait))

    # 4. Shutdown, none graceful: the live workers (told by RPC), then the driver.
    start = time.perf_counter()
    stop(["A", "C", "D"], graceful=False)
    fact("shutdown.stop_rpcs_ms", ms(time.perf_counter() - start))
    fact("shutdown.driver", bounded(lambda: rpc.shutdown(graceful=False), hang_wait))
    deadline = time.monotonic() + 10
    while any(p.poll() is None for n, p in procs.items()) and time.monotonic() < deadline:
        time.sleep(0.02)
    fact("shutdown.workers_exited_ms", ms(time.perf_counter() - start))
    fact("shutdown.returncodes", {n: p.poll() for n, p in procs.items()})


# --- scenario: graceful shutdown after a peer died -------------------------------------------------

def graceful_scenario(url: str, hang_wait: float, timeout: float = 0.0) -> None:
    """A driver and workers P, Q; Q is SIGKILLed; the driver and P then call ``rpc.shutdown()``
    (graceful) with ``timeout`` (0: torch's default, none). Whether each returns within ``hang_wait``
    seconds. (P, not the driver, leads torch's all-gather: the smallest name, capitals first.)"""
    procs = {name: start_worker(name, rank, 3, url) for rank, name in enumerate(["P", "Q"], start=1)}
    try:
        rpc.init_rpc("driver", rank=0, world_size=3, rpc_backend_options=options(url))
        fact("pids", {name: p.pid for name, p in procs.items()} | {"driver": os.getpid()})
        assert timed_call("P", echo, torch.ones(4))["ok"]
        fact("kill_ms", ms(sigkill(procs["Q"])))
        stop(["P"], graceful=True, timeout=timeout)  # P shuts down so once it has answered
        fact("shutdown.driver", bounded(lambda: rpc.shutdown(graceful=True, timeout=timeout), hang_wait))
        fact("P_alive_after_wait", procs["P"].poll() is None)
        if timeout:  # P's shutdown ends too: its FACT line comes before it exits
            fact("P_exit", bounded(lambda: procs["P"].wait(), hang_wait))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


def graceful_timeout_scenario(url: str, hang_wait: float) -> None:
    """:func:`graceful_scenario` with ``timeout=GRACEFUL_TIMEOUT``; each shutdown given 4 RPC timeouts."""
    graceful_scenario(url, max(hang_wait, 4 * RPC_TIMEOUT), timeout=GRACEFUL_TIMEOUT)


# --- scenario: a dynamic group (no world size) ----------------------------------------------------

def dynamic_scenario(url: str, hang_wait: float) -> None:
    """A dynamic group (no world size): the driver (rank 0, holding the store) and A; B joins later, and
    a context spanning A and B runs forward and backward. Then B is SIGKILLed, and a fresh process E
    tries to join, then (once E has given up) another, F. Every process starts at once; B, E and F join
    when told. E and F wait JOIN_TIMEOUT for the store."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["A"] = start_worker("A", 1, None, url)
        for rank, name in [(2, "B"), (3, "E"), (4, "F")]:
            procs[name] = start_worker(name, rank, None, url, JOIN_TIMEOUT if name in "EF" else RPC_TIMEOUT,
                                       wait_for_go=True)
        fact("pids", {name: p.pid for name, p in procs.items()} | {"driver": os.getpid()})
        start = time.perf_counter()
        rpc.init_rpc("driver", rank=0, world_size=None, rpc_backend_options=options(url))
        agent = rpc._get_current_rpc_agent()
        fact("driver.join_ms", ms(time.perf_counter() - start))
        fact("is_static_group", agent.is_static_group)  # type: ignore[attr-defined]  # a TensorPipeAgent
        _wait_for_members({"driver", "A"}, START_WAIT)
        chain = Chain({"a": (4, 5), "b": (5, 3)})
        assert chain.place("A", "a")["ok"]
        fact("context_a", context_run(chain, [("A", "a")], hang_wait))
        go(procs["B"])  # joins a group that is already at work
        fact("B.joined_ms", _wait_for_members({"driver", "A", "B"}, START_WAIT))
        fact("members", sorted(w.name for w in agent.get_worker_infos()))
        placed = _until_ok(lambda: chain.place("B", "b"), START_WAIT)  # (listed is not yet callable, under load)
        fact("B.place", placed)
        assert placed["ok"], placed
        fact("context_a_b", context_run(chain, [("A", "a"), ("B", "b")], hang_wait))
        fact("kill_ms", ms(sigkill(procs["B"])))
        fact("members_after_kill", sorted(w.name for w in agent.get_worker_infos()))
        fact("after.driver_to_A", timed_call("A", echo, torch.ones(4)))
        fact("after.driver_to_B", timed_call("B", echo, torch.ones(4)))
        fact("after.context_a", context_run(chain, [("A", "a")], hang_wait))
        for name in ["E", "F"]:  # one after the other
            start = time.perf_counter()
            go(procs[name])
            procs[name].wait(timeout=START_WAIT)
            fact(f"{name}.exited_ms", ms(time.perf_counter() - start))
        fact("members_after_joins", sorted(w.name for w in agent.get_worker_infos()))
        fact("after_joins.driver_to_A", timed_call("A", echo, torch.ones(4)))
        fact("after_joins.context_a", context_run(chain, [("A", "a")], hang_wait))
        stop(["A"], graceful=False)
        fact("shutdown.driver", bounded(lambda: rpc.shutdown(graceful=False), hang_wait))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


def _until_ok(attempt: Callable[[], dict[str, Any]], within: float) -> dict[str, Any]:
    """``attempt()`` (a :func:`timed_call`) again until it is ok or ``within`` seconds have passed: its last
    result, with the attempts made and the errors of those that failed."""
    deadline, errors = time.monotonic() + within, []
    while True:
        result = attempt()
        if result["ok"] or time.monotonic() > deadline:
            return dict(result, attempts=len(errors) + 1, errors=errors)
        errors.append(result["error"])


def _wait_for_members(names: set[str], within: float) -> float:
    """Milliseconds until the driver's agent lists ``names``."""
    agent = rpc._get_current_rpc_agent()
    waited = poll(lambda: names <= {w.name for w in agent.get_worker_infos()}, within)
    assert waited is not None, f"members {agent.get_worker_infos()} after {within} s"
    return waited


# --- scenario: the project's LocalWorkers, one of them SIGKILLed ---------------------------------

def local_workers_scenario(url: str, hang_wait: float) -> None:
    """rrefpipe's own local stage workers (``python -m workers``): worker2 is SIGKILLed; RPCs to the
    others, then ``LocalWorkers.close()`` (stop RPCs, then ``rpc.shutdown(graceful=False)``)."""
    from workers import LocalWorkers

    group = LocalWorkers(3, threads=1, rpc_timeout=RPC_TIMEOUT).start()
    pids = dict(zip(group.names, group.pids))
    fact("pids", pids | {"driver": os.getpid()})
    # A stage worker is busy for a while after it joins (it freezes its start-up objects for the garbage
    # collector, holding the GIL: calls took 0.5-0.8 s then): wait until calls to it are quick again.
    fact("before.settled_ms", {name: poll(lambda: timed_call(name, echo, torch.ones(4))["ms"] < 50, 20)
                               for name in ("worker1", "worker3")})
    fact("kill_ms", ms(sigkill(group._procs[1])))
    fact("after.driver_to_worker1", [timed_call("worker1", echo, torch.ones(4)) for _ in range(3)])
    fact("after.driver_to_worker2", timed_call("worker2", echo, torch.ones(4)))
    fact("after.worker1_to_worker3", call("worker1", relay_async, "worker3", RPC_TIMEOUT))
    fact("after.worker1_to_worker2", call("worker1", relay_async, "worker2", RPC_TIMEOUT))
    fact("close", bounded(group.close, hang_wait))
    fact("alive_after_close", {name: pid_alive(pid) for name, pid in pids.items()})
