"""Facts about torch's distributed autograd that the 1F1B schedules (issue 41) are designed on, asserted
against the installed torch: a torch that changes one fails here, by name, before a schedule hangs.

Plain torch RPC only (no rrefpipe): a chain of two ``nn.Linear`` stages on the session's stage workers
(``cluster``), driven from this process, every gradient compared with the same model run whole here.
What must hang runs in processes of its own (``run_script``), bounded by a join timeout.
Worker-side functions: tests/distributed/engine_probes.py."""
from __future__ import annotations

import copy
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer

from tests.conftest import ROOT, free_urls
from tests.distributed import engine_probes as probes

pytestmark = pytest.mark.timeout(60)

RPC_TIMEOUT = 10  # seconds, on every call
WITHIN = 10  # seconds a backward that should finish may take before the test calls it hung
HANG_WAIT = 2.0  # seconds a backward that should hang is given (they finish in milliseconds otherwise)


def call(worker: str, fn: Callable[..., Any], *args: Any) -> Any:
    return rpc.rpc_sync(worker, fn, args=args, timeout=RPC_TIMEOUT)


def bounded(fn: Callable[[], Any], within: float = WITHIN) -> tuple[Any, float]:
    """Run ``fn`` on a thread; its result and seconds, or a failure after ``within`` (never a hang)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised below
            box["error"] = e

    start = time.perf_counter()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(within)
    seconds = time.perf_counter() - start
    if t.is_alive():
        pytest.fail(f"did not finish within {within} s")
    if "error" in box:
        raise box["error"]
    return box.get("value"), seconds


def backward(context_id: int, loss: torch.Tensor) -> float:
    """``dist_autograd.backward`` bounded by WITHIN; its seconds."""
    return bounded(lambda: dist_autograd.backward(context_id, [loss]))[1]


class Chain:
    """Linear(4, 5) on the first worker, Linear(5, 3) on the second; ``plain`` is the same model here."""

    def __init__(self, workers: list[str]) -> None:
        torch.manual_seed(41)
        self.workers = workers
        self.plain = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
        self.keys = [f"engine-facts-{uuid.uuid4().hex}-{j}" for j in range(2)]
        for worker, key, layer in zip(workers, self.keys, self.plain):
            call(worker, probes.place, key, copy.deepcopy(layer))
        self.x = torch.randn(8, 4)  # two micro-batches of 4 rows
        self.weights = torch.randn(8, 3)  # the loss: sum(output * weights)

    def micro_batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[4 * i:4 * i + 4], self.weights[4 * i:4 * i + 4]

    def stage0(self, i: int) -> torch.Tensor:
        return call(self.workers[0], probes.forward, self.keys[0], self.micro_batch(i)[0])

    def stage1_loss(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return (call(self.workers[1], probes.forward, self.keys[1], h) * self.micro_batch(i)[1]).sum()

    def loss(self, i: int) -> torch.Tensor:
        """Micro-batch ``i``'s forward through both workers, the loss here (in the current context)."""
        return self.stage1_loss(i, self.stage0(i))

    def gradients(self, context_id: int) -> dict[str, torch.Tensor]:
        """Both workers' gradients in the context, named like ``plain``'s parameters."""
        out = {}
        for j, (worker, key) in enumerate(zip(self.workers, self.keys)):
            out.update({f"{j}.{n}": g for n, g in call(worker, probes.gradients, key, context_id).items()})
        return out

    def parameters(self) -> dict[str, torch.Tensor]:
        out = {}
        for j, (worker, key) in enumerate(zip(self.workers, self.keys)):
            out.update({f"{j}.{n}": p for n, p in call(worker, probes.parameters, key).items()})
        return out

    def plain_gradients(self, *micro_batches: int) -> dict[str, torch.Tensor]:
        """The plain model's gradients of the summed loss of ``micro_batches``, computed here."""
        model = copy.deepcopy(self.plain)
        rows = torch.cat([torch.arange(4 * i, 4 * i + 4) for i in micro_batches])
        (model(self.x[rows]) * self.weights[rows]).sum().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    def close(self) -> None:
        for worker, key in zip(self.workers, self.keys):
            call(worker, probes.drop, key)


def assert_gradients(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], **tolerance: Any) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=lambda m: f"{name}: {m}", **tolerance)


@pytest.fixture
def chain(cluster):
    c = Chain(list(cluster.names[:2]))
    yield c
    c.close()


class ContextOnThread:
    """A distributed-autograd context entered on a thread of its own (one current context per thread),
    running ``body(context_id)`` and then kept open until ``release()``."""

    def __init__(self, body: Callable[[int], Any]) -> None:
        self.body, self.done, self.released = body, threading.Event(), threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.context_id: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with dist_autograd.context() as ctx:
                self.context_id = ctx
                try:
                    self.result = self.body(ctx)
                finally:
                    self.done.set()
                    self.released.wait(WITHIN)
        except BaseException as e:  # re-raised by wait()
            self.error = e
            self.done.set()

    def wait(self) -> Any:
        assert self.done.wait(WITHIN), "the context's thread did not finish its body"
        if self.error is not None:
            raise self.error
        return self.result

    def release(self) -> None:
        self.released.set()
        self.thread.join(WITHIN)
        assert not self.thread.is_alive(), "the context's thread did not leave its context"
        if self.error is not None:
            raise self.error


def test_one_context_per_micro_batch_a_backward_finishes_while_another_contexts_forward_is_in_flight(chain):
    """1F1B runs micro-batch k's backward while later micro-batches' forwards are in flight. In one
    context that hangs (see the several-backwards test below); the schedules therefore give each
    micro-batch its own context. Here micro-batch 1 (context B) has run stage 0, so B holds a recorded
    send on worker 0 and a recv here, when micro-batch 0 (context A) runs forward and backward through
    both workers; then B finishes. Both contexts get the plain model's gradients of their micro-batch."""
    stage0_done, a_done = threading.Event(), threading.Event()

    def micro_batch_1(b: int) -> tuple[int, float, dict[str, torch.Tensor]]:
        h = chain.stage0(1)
        recvs = len(dist_autograd._retrieve_context(b)._recv_functions())
        stage0_done.set()
        assert a_done.wait(WITHIN)
        seconds = backward(b, chain.stage1_loss(1, h))
        return recvs, seconds, chain.gradients(b)

    b = ContextOnThread(micro_batch_1)
    try:
        assert stage0_done.wait(WITHIN)
        with dist_autograd.context() as a:
            a_seconds = backward(a, chain.loss(0))
            a_grads = chain.gradients(a)
        a_done.set()
        b_recvs, b_seconds, b_grads = b.wait()
    finally:
        a_done.set()
        b.release()
    assert b_recvs >= 1  # B's forward was recorded (in flight) while A ran its backward
    assert a_seconds < WITHIN and b_seconds < WITHIN
    assert_gradients(a_grads, chain.plain_gradients(0))
    assert_gradients(b_grads, chain.plain_gradients(1))
    print(f"backward A {a_seconds * 1000:.1f} ms with B in flight, then B {b_seconds * 1000:.1f} ms")


def test_get_gradients_returns_the_stored_tensors_not_copies(chain):
    """The schedules accumulate micro-batch contexts into one on each worker through the tensors
    ``dist_autograd.get_gradients`` returns: an in-place add into one must change the context."""
    with dist_autograd.context() as ctx:
        backward(ctx, chain.loss(0))
        seen = call(chain.workers[0], probes.stored_gradient_identity, chain.keys[0], ctx)
        after_probe = chain.gradients(ctx)
    assert seen["same_storage"], "two get_gradients calls gave tensors with different storage"
    assert seen["same_object"], "two get_gradients calls gave different tensor objects"
    expected = chain.plain_gradients(0)["0.weight"]
    torch.testing.assert_close(seen["before"], expected)
    torch.testing.assert_close(seen["after"], seen["before"] + 1, rtol=0, atol=0)  # the add persisted
    torch.testing.assert_close(after_probe["0.weight"], expected)  # and its undo too


def test_adding_a_contexts_gradients_into_another_gives_the_gpipe_gradients_and_the_optimizer_applies_them(chain):
    """The schedules run each micro-batch in its own context and, once a micro-batch's backward has
    finished on a worker, add its gradients into the step's context there; the step's context must
    then hold what GPipe's single context holds (the summed loss's gradients, bit for bit) and
    ``DistributedOptimizer.step(step_context)`` must apply them (plain SGD on the plain model)."""
    with dist_autograd.context() as g:  # GPipe: both micro-batches, one backward, one context
        gpipe_seconds = backward(g, chain.loss(0) + chain.loss(1))
        gpipe = chain.gradients(g)
    expected = chain.plain_gradients(0, 1)
    assert_gradients(gpipe, expected)

    def micro_batch_0(a: int) -> None:
        backward(a, chain.loss(0))

    a = ContextOnThread(micro_batch_0)
    try:
        a.wait()  # A's backward has finished (on every worker: backward returns after all of them)
        with dist_autograd.context() as b:
            backward(b, chain.loss(1))
            for worker, key in zip(chain.workers, chain.keys):
                call(worker, probes.add_gradients, key, a.context_id, b)
            summed = chain.gradients(b)
            rrefs = [r for w, k in zip(chain.workers, chain.keys) for r in call(w, probes.parameter_rrefs, k)]
            optimizer = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.5)
            bounded(lambda: optimizer.step(b))
    finally:
        a.release()
    assert_gradients(summed, gpipe, rtol=0, atol=0)  # exactly GPipe's context
    assert_gradients(summed, expected)  # and the plain model's
    plain = copy.deepcopy(chain.plain)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.5)
    rows = torch.arange(8)
    (plain(chain.x[rows]) * chain.weights[rows]).sum().backward()
    sgd.step()
    assert_gradients(chain.parameters(), dict(plain.named_parameters()))
    print(f"GPipe backward of 2 micro-batches {gpipe_seconds * 1000:.1f} ms")


def test_contexts_are_per_thread_an_rpc_from_another_thread_carries_no_context(chain):
    """The schedules enter each micro-batch's context on the thread that issues its RPCs: a thread
    has one current context, and an RPC from a thread that did not enter it is not recorded (no send
    in the context, nothing to backpropagate into) and arrives at the worker with no context."""
    worker = chain.workers[0]
    x = torch.randn(2, 4, requires_grad=True)
    with dist_autograd.context() as ctx:
        context = dist_autograd._retrieve_context(ctx)

        def from_new_thread() -> dict[str, Any]:
            out: dict[str, Any] = {}
            try:
                dist_autograd._current_context()
                out["current"] = "yes"
            except RuntimeError as e:
                out["current"] = str(e)
            out["worker_saw"] = call(worker, probes.current_context, x)
            out["result_grad_fn"] = call(worker, probes.forward, chain.keys[0], x).grad_fn
            return out

        sends_before = len(context._send_functions())
        other, _ = bounded(from_new_thread)
        sends_after_thread = len(context._send_functions())
        y = call(worker, probes.forward, chain.keys[0], x)
        sends_after_here = len(context._send_functions())
        with pytest.raises(RuntimeError):
            dist_autograd._new_context()  # a second context on this thread is refused
        # Every recorded send must feed the loss, or the backward hangs: it finishes only because the
        # new thread's two RPCs were not recorded in ctx.
        backward(ctx, y.sum())
        x_grad = dist_autograd.get_gradients(ctx)[x]
    with dist_autograd.context() as ctx2:  # the same probe from the thread that entered the context
        worker_saw_here = call(worker, probes.current_context, x)
    assert "autograd context" in other["current"]  # the new thread has no current context
    assert "autograd context" in str(other["worker_saw"]), other["worker_saw"]
    assert other["result_grad_fn"] is None  # a leaf: nothing connects it to the worker's graph
    assert sends_after_thread == sends_before == 0  # the thread's RPCs were not recorded in ctx
    assert worker_saw_here == ctx2
    assert "RecvRpcBackward" in y.grad_fn.name() and sends_after_here == sends_before + 1
    print(f"new thread: {other['current']!r}; the worker saw: {other['worker_saw']!r}")
    model = copy.deepcopy(chain.plain[0])
    x_ref = x.detach().clone().requires_grad_()
    model(x_ref).sum().backward()
    torch.testing.assert_close(x_grad, x_ref.grad)


def test_a_backward_started_on_the_last_stages_worker_leaves_the_plain_gradients(chain):
    """Under ``train_step`` the loss is computed on the last stage's worker and its backward starts
    there, in the context the micro-batch's RPC brought, returning only the detached loss to the
    driver. Every worker must end with the plain model's gradients. The stage workers have one RPC
    thread: the backward runs on a thread of its own and the RPC body returns a future at once
    (``async_execution``); a body that waits for the backward on the only RPC thread does not finish,
    and returning an output that requires grad hangs too (the ``last_stage_blocks_*`` and ``returned``
    scenarios of the several-backwards test)."""
    x, weights = chain.micro_batch(0)
    with dist_autograd.context() as ctx:
        h = chain.stage0(0)
        outcome = call(chain.workers[1], probes.loss_and_backward_async, chain.keys[1], h, weights)
        grads = chain.gradients(ctx)
    assert outcome["thread"] == "last-stage-backward"
    assert not outcome["loss"].requires_grad
    plain = copy.deepcopy(chain.plain)
    plain_loss = (plain(x) * weights).sum()
    plain_loss.backward()
    torch.testing.assert_close(outcome["loss"], plain_loss.detach())
    assert_gradients(grads, {n: p.grad for n, p in plain.named_parameters()})
    print(f"backward from the last stage's worker {outcome['seconds'] * 1000:.1f} ms")


def test_several_backwards_in_one_context_hang(tmp_path):
    """Why 1F1B needs a context per micro-batch: in one context, ``dist_autograd.backward`` waits for
    every send recorded in the context, so micro-batch 0's backward after micro-batch 1's forward
    (``interleaved``) and a second backward after a finished one (``sequential``) never complete,
    with or without ``retain_graph``. Also the last stage returning an output that requires grad to
    the driver and starting the backward itself (``returned``) hangs, where keeping the output
    (``not_returned``) finishes. And a last stage whose RPC body waits for the backward it started
    on another thread does not finish while that body holds the worker's only RPC thread
    (``last_stage_blocks_1_rpc_thread``; with 4 RPC threads it finishes in milliseconds). Each
    scenario runs in two processes of its own (a driver and a forked worker; all scenarios at once),
    each backward on a thread given HANG_WAIT seconds (milliseconds suffice when it works); the
    processes are then ended."""
    scenarios = {  # the outcome of each backward attempted, in order
        "interleaved": ["hung"], "interleaved_retain": ["hung"],
        "sequential": ["finished", "hung"], "sequential_retain": ["finished", "hung"],
        "returned": ["hung"], "not_returned": ["finished"],
        "last_stage_blocks_1_rpc_thread": ["hung"], "last_stage_blocks_4_rpc_threads": ["finished"],
    }
    procs = {}
    for name, url in zip(scenarios, free_urls(len(scenarios))):
        code = ("from tests.distributed.engine_probes import several_backwards_script\n"
                f"several_backwards_script({url!r}, {name!r}, {HANG_WAIT})\n")
        procs[name] = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    outcomes, timings = {}, {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=40)
            lines = [line.split() for line in stdout.splitlines() if line.startswith("OUTCOME")]
            assert "DONE" in stdout, f"{name}: the script did not finish\n{stdout}\n{stderr[-3000:]}"
            outcomes[name] = [fields[1] for fields in lines]
            timings[name] = [float(fields[2]) for fields in lines]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert outcomes == scenarios
    for name, expected in scenarios.items():
        for outcome, seconds in zip(expected, timings[name]):
            assert seconds < 1.0 if outcome == "finished" else seconds >= HANG_WAIT
    print("outcomes (seconds):", {n: list(zip(outcomes[n], timings[n])) for n in scenarios})
