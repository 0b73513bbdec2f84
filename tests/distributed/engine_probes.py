"""Functions that tests/distributed/test_engine_facts.py runs on stage workers (and a script that runs
in its own processes): small probes of torch's distributed autograd engine, independent of rrefpipe.

Each worker keeps plain ``nn.Linear`` layers under a key; the driver calls them with ``rpc_sync``, so
every hop is a send/recv pair recorded in the caller's distributed-autograd context."""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

_modules: dict[str, nn.Module] = {}
_kept: dict[str, torch.Tensor] = {}  # outputs kept by forward_kept for backward_kept


def place(key: str, module: nn.Module) -> None:
    """Keep ``module`` on this worker under ``key``."""
    _modules[key] = module


def drop(key: str) -> None:
    _modules.pop(key, None)


def forward(key: str, x: torch.Tensor) -> torch.Tensor:
    return _modules[key](x)


def parameter_rrefs(key: str) -> list[rpc.RRef]:
    return [rpc.RRef(p) for p in _modules[key].parameters()]


def parameters(key: str) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in _modules[key].named_parameters()}


def gradients(key: str, context_id: int) -> dict[str, torch.Tensor]:
    """The module's gradients in the context (copies), by parameter name; absent ones left out."""
    grads = dist_autograd.get_gradients(context_id)
    return {name: grads[p].clone() for name, p in _modules[key].named_parameters() if p in grads}


def add_gradients(key: str, source: int, target: int) -> None:
    """Add the module's gradients in context ``source`` into those in ``target``, in place."""
    src, dst = dist_autograd.get_gradients(source), dist_autograd.get_gradients(target)
    for p in _modules[key].parameters():
        dst[p].add_(src[p])


def stored_gradient_identity(key: str, context_id: int) -> dict[str, object]:
    """Whether get_gradients hands out the context's stored tensor: two calls, then an in-place add
    into the first call's tensor, seen by a third call."""
    weight = _modules[key].weight
    assert isinstance(weight, torch.Tensor)
    first = dist_autograd.get_gradients(context_id)[weight]
    second = dist_autograd.get_gradients(context_id)[weight]
    before = first.clone()
    first.add_(1.0)
    after = dist_autograd.get_gradients(context_id)[weight].clone()
    first.sub_(1.0)  # leave the context as it was
    return {"same_object": first is second, "same_storage": first.data_ptr() == second.data_ptr(),
            "before": before, "after": after}


def current_context(x: torch.Tensor) -> int | str:
    """The id of the context current in this call's body, or the error saying there is none. ``x``
    should require grad: torch attaches the caller's context to a message only when one does."""
    try:
        return dist_autograd._current_context()._context_id()
    except RuntimeError as e:
        return f"RuntimeError: {e}"


def loss_and_backward_here(key: str, h: torch.Tensor, weights: torch.Tensor, on_thread: bool,
                           within: float) -> dict[str, object]:
    """The last stage: output, loss and ``dist_autograd.backward`` on this worker, in the context the
    RPC brought (on the RPC thread, or on a new thread given the context id). Returns the loss
    detached, so nothing that requires grad goes back to the caller."""
    context_id = dist_autograd._current_context()._context_id()
    loss = (_modules[key](h) * weights).sum()
    outcome: dict[str, object] = {"loss": loss.detach(), "thread": "rpc" if not on_thread else "own"}
    start = time.perf_counter()
    if on_thread:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                dist_autograd.backward(context_id, [loss])
            except BaseException as e:  # reported to the caller
                errors.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(within)
        outcome["finished"] = not t.is_alive()
        outcome["error"] = repr(errors[0]) if errors else None
    else:
        dist_autograd.backward(context_id, [loss])
        outcome["finished"], outcome["error"] = True, None
    outcome["seconds"] = time.perf_counter() - start
    return outcome


@rpc.functions.async_execution
def loss_and_backward_async(key: str, h: torch.Tensor, weights: torch.Tensor) -> torch.futures.Future:
    """The last stage, as a stage worker with one RPC thread must run it: output and loss in the
    RPC's body (where its context is current), ``dist_autograd.backward`` on a thread of its own,
    and the RPC thread given back at once; the reply (the loss detached, and the backward's
    seconds) goes when the backward has finished."""
    context_id = dist_autograd._current_context()._context_id()
    loss = (_modules[key](h) * weights).sum()
    future: torch.futures.Future = torch.futures.Future()

    def run() -> None:
        start = time.perf_counter()
        try:
            dist_autograd.backward(context_id, [loss])
            future.set_result({"loss": loss.detach(), "seconds": time.perf_counter() - start,
                               "thread": threading.current_thread().name})
        except BaseException as e:  # to the caller
            future.set_exception(e)

    threading.Thread(target=run, name="last-stage-backward", daemon=True).start()
    return future


def forward_kept(key: str, x: torch.Tensor, returned: bool) -> torch.Tensor | None:
    """Forward on this worker, keeping the output for ``backward_kept``; ``returned``: return it
    (requiring grad) to the caller, a send recorded in the context on this worker."""
    y = _modules[key](x)
    _kept[key] = y
    return y if returned else None


def backward_kept(key: str, within: float) -> str:
    """``dist_autograd.backward`` of the kept output's sum on a new thread, in the RPC's context;
    "finished", "error ..." or "hung" after ``within`` seconds."""
    context_id = dist_autograd._current_context()._context_id()
    loss = _kept.pop(key).sum()
    box: list[str] = []

    def run() -> None:
        try:
            dist_autograd.backward(context_id, [loss])
            box.append("finished")
        except BaseException as e:  # the outcome we report
            box.append(f"error {type(e).__name__}")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(within)
    return box[0] if box else "hung"


# --- several backwards in one context: run by ``several_backwards_script`` in its own processes ---

def _exit_after(seconds: float, code: int) -> None:
    """End this process after ``seconds`` whatever it is doing (a hung backward, a dead peer)."""
    import os

    timer = threading.Timer(seconds, os._exit, args=(code,))
    timer.daemon = True
    timer.start()


def _scenario_worker(rank: int, url: str, threads: int) -> None:
    _exit_after(30, 0)  # graceful shutdown waits forever for a driver that died
    options = rpc.TensorPipeRpcBackendOptions(init_method=url, rpc_timeout=5, num_worker_threads=threads,
                                              _transports=["uv"])
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    rpc.shutdown(graceful=True)


def several_backwards_script(url: str, scenario: str, wait: float) -> None:
    """Driver side of one scenario, with one worker forked here (this runs in a fresh interpreter).
    Prints one line ``OUTCOME <finished|error|hung> <seconds> <detail>`` per backward attempted,
    then ``DONE``, and ends both processes without releasing the context (a hung backward holds it)."""
    import os

    import torch.multiprocessing as mp

    _exit_after(30, 3)

    threads = 1 if scenario.endswith("_1_rpc_thread") else 4
    # forked before any RPC state exists; the worker's code is this module's
    worker = mp.get_context("fork").Process(target=_scenario_worker, args=(1, url, threads), daemon=True)
    worker.start()
    options = rpc.TensorPipeRpcBackendOptions(init_method=url, rpc_timeout=5, num_worker_threads=4,
                                              _transports=["uv"])
    rpc.init_rpc("w0", rank=0, world_size=2, rpc_backend_options=options)
    torch.manual_seed(0)
    rpc.rpc_sync("w1", place, args=("lin", nn.Linear(4, 3)), timeout=5)
    x0, x1 = torch.randn(2, 4), torch.randn(2, 4)

    def attempt(context_id: int, loss: torch.Tensor, retain: bool) -> bool:
        box: list[str] = []

        def run() -> None:
            try:
                dist_autograd.backward(context_id, [loss], retain_graph=retain)
                box.append("finished -")
            except BaseException as e:  # the outcome we report
                box.append(f"error {type(e).__name__}:{str(e).splitlines()[0][:120] if str(e) else ''}")

        start = time.perf_counter()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(wait)
        outcome = box[0] if box else "hung -"
        status, detail = outcome.split(" ", 1)
        print(f"OUTCOME {status} {time.perf_counter() - start:.3f} {detail}", flush=True)
        return status == "finished"

    retain = scenario.endswith("_retain")
    with dist_autograd.context() as ctx:
        if scenario.startswith("interleaved"):
            # both micro-batches' forwards, then micro-batch 0's backward: 1F1B's order in one context
            loss0 = rpc.rpc_sync("w1", forward, args=("lin", x0), timeout=5).sum()
            loss1 = rpc.rpc_sync("w1", forward, args=("lin", x1), timeout=5).sum()
            if attempt(ctx, loss0, retain):
                attempt(ctx, loss1, retain)
        elif scenario.startswith("sequential"):
            loss0 = rpc.rpc_sync("w1", forward, args=("lin", x0), timeout=5).sum()
            if attempt(ctx, loss0, retain):
                loss1 = rpc.rpc_sync("w1", forward, args=("lin", x1), timeout=5).sum()
                attempt(ctx, loss1, retain)
        elif scenario in ("returned", "not_returned"):
            # the last stage returns its output (requiring grad) to the driver, then starts the
            # backward of a loss on that output itself: the send to the driver is never reached
            rpc.rpc_sync("w1", forward_kept, args=("lin", x0, scenario == "returned"), timeout=5)
            start = time.perf_counter()
            outcome = rpc.rpc_sync("w1", backward_kept, args=("lin", wait), timeout=wait + 5)
            print(f"OUTCOME {outcome.split()[0]} {time.perf_counter() - start:.3f} -", flush=True)
        elif scenario.startswith("last_stage_blocks"):
            # the last stage's RPC body starts the backward on a thread and waits for it there
            x = x0.clone().requires_grad_()
            start = time.perf_counter()
            outcome = rpc.rpc_sync("w1", loss_and_backward_here, args=("lin", x, torch.ones(2, 3), True, wait),
                                   timeout=wait + 5)
            status = "finished" if outcome["finished"] and outcome["error"] is None else "hung"
            print(f"OUTCOME {status} {time.perf_counter() - start:.3f} -", flush=True)
        else:
            raise ValueError(scenario)
        print("DONE", flush=True)
        rpc.shutdown(graceful=False)
        worker.kill()
        os._exit(0)
