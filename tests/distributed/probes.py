"""Probes of a pipe's stages: their gradients in a dist-autograd context, keyed like the plain model, and
the check that a pipe computes what the plain model does."""
from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc


def _named_grads(pipe_id: str, index: int, context_id: int) -> dict[str, torch.Tensor]:
    """On a stage worker: its gradients in the context, on the CPU (the driver has no device maps)."""
    from rrefpipe.stage_side.server import _server

    grads = dist_autograd.get_gradients(context_id)
    module = _server(pipe_id, index).stage.module
    return {name: grads[p].cpu() for name, p in module.named_parameters() if p in grads}


def _parameter_devices(pipe_id: str, index: int) -> list[str]:
    from rrefpipe.stage_side.server import _server

    return sorted({str(p.device) for p in _server(pipe_id, index).stage.module.parameters()})


def retained_contexts() -> list[int]:
    """On any process: the ids of the distributed-autograd contexts kept past their release."""
    from rrefpipe import _rpc

    return sorted(_rpc._retained)


def fail_skip_arrivals(message: str | None) -> None:
    """On a stage worker: make taking in an arriving skip (with its gradient's phony) raise
    RuntimeError(message) from now on, as a device copy that runs out of memory would; None undoes it."""
    from rrefpipe import dependency
    from rrefpipe.stage_side import server

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(message)

    server.arrival = dependency.arrival if message is None else failing  # type: ignore[assignment]


def stage_count() -> int:
    """On a stage worker: how many stages, of any pipe, it holds."""
    from rrefpipe.stage_side import server

    return len(server._servers)


def stage_gradients(pipe, ctx) -> dict[str, torch.Tensor]:
    """Runs on each stage's worker (inside the context); only the test suite needs this."""
    driver = pipe._driver
    context_id = ctx  # `with dist_autograd.context() as ctx` binds the context id
    out: dict[str, torch.Tensor] = {}
    for j, worker in enumerate(driver.workers):
        out.update(rpc.rpc_sync(worker, _named_grads, args=(driver.pipe_id, j, context_id)))
    return out


def _weighted_sum(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum()


def check_transparent(pipe, model, x, device: str = "cpu", loss_of: Callable[[Any], torch.Tensor] = _weighted_sum,
                      **tolerance) -> None:
    """Output, input gradient and every parameter gradient equal those of ``model`` run whole on
    ``device`` (``tolerance``: ``assert_close``'s, where kernels differ), and each stage's parameters
    live on the stage's device. A parameter that ``loss_of`` the output does not reach has no gradient
    in either."""
    reference = copy.deepcopy(model).to(device)
    x_ref = x.detach().to(device).requires_grad_(x.requires_grad)
    out_ref = reference(x_ref)
    loss_of(out_ref).backward()
    with dist_autograd.context() as ctx:
        out = pipe(x).local_value()
        for t in out if isinstance(out, tuple) else (out,):  # the last stage sends its output to the CPU driver
            assert t.device.type == "cpu", t.device
        dist_autograd.backward(ctx, [loss_of(out)])
        x_grad = dist_autograd.get_gradients(ctx).get(x)
        grads = stage_gradients(pipe, ctx)
    for j, worker in enumerate(pipe._driver.workers):
        devices = rpc.rpc_sync(worker, _parameter_devices, args=(pipe._driver.pipe_id, j))
        assert devices in ([pipe.stages[j].device], []), (j, devices, pipe.stages[j])
    torch.testing.assert_close(out, out_ref.cpu() if isinstance(out_ref, torch.Tensor) else
                               tuple(t.cpu() for t in out_ref), **tolerance)
    if x.requires_grad:
        torch.testing.assert_close(x_grad, x_ref.grad.cpu(), **tolerance)
    expected = {name: p.grad.cpu() for name, p in reference.named_parameters() if p.grad is not None}
    assert expected and grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, **tolerance, msg=lambda m: f"{name}: {m}")


def counts() -> dict[str, int]:
    """What a process holds: stages, RRefs, autograd contexts, RPC calls in flight, Python threads."""
    from rrefpipe.stage_side.server import _servers

    rrefs = rpc._rref_context_get_debug_info()
    agent = rpc.api._get_current_rpc_agent().get_debug_info()
    return {
        "stages": len(_servers),
        "owner_rrefs": int(rrefs["num_owner_rrefs"]),
        "pending_users": int(rrefs["num_pending_users"]),
        "contexts": int(dist_autograd._get_debug_info()["num_autograd_contexts"]),
        "active_calls": int(agent["agent.server_active_calls"]) + int(agent["agent.client_active_calls"]),
        "threads": threading.active_count(),
    }


def all_counts(names: list[str]) -> dict[str, dict[str, int]]:
    """``counts()`` of this process and of every named worker."""
    out = {"driver": counts()}
    for name in names:
        out[name] = rpc.rpc_sync(name, counts)
    return out


def loaded(modules: list[str]) -> list[str]:
    """Which of ``modules`` the process this runs in has imported."""
    import sys

    return [name for name in modules if name in sys.modules]


def environment(keys: list[str]) -> dict[str, str | None]:
    """The named environment variables of the process this runs in."""
    import os

    return {key: os.environ.get(key) for key in keys}


def interop_threads() -> int:
    """This worker's inter-op threads (where distributed autograd runs backward tasks)."""
    return torch.get_num_interop_threads()


def frozen_objects() -> int:
    """How many objects this process hid from the garbage collector (``gc.freeze``)."""
    import gc

    return gc.get_freeze_count()


_leave_late_context = threading.Event()


@rpc.functions.async_execution
def deliver_late_in_a_new_context(driver: str, pipe_id: str) -> torch.futures.Future[None]:
    """On a worker: deliver an output for a step the driver has no record of, inside a context the driver
    has never seen, as a hung last stage does after the user left the step's context. Resolves once
    delivered, and stays in the context until :func:`leave_late_context` (its end would release the
    driver's copy too, and so would any other call to the driver from inside it). On a thread of its
    own: the worker's one RPC thread completes its calls."""
    from rrefpipe.driver_side.remote import deliver

    delivered: torch.futures.Future[None] = torch.futures.Future()

    def run() -> None:
        try:
            with dist_autograd.context():
                rpc.rpc_sync(driver, deliver, args=(pipe_id, 0, torch.ones(2, requires_grad=True)))
                delivered.set_result(None)
                _leave_late_context.wait(timeout=60)
        except Exception as exc:
            delivered.set_exception(exc)
        finally:
            _leave_late_context.clear()

    threading.Thread(target=run, daemon=True).start()
    return delivered


def leave_late_context() -> None:
    _leave_late_context.set()


@rpc.functions.async_execution
def deliver_late_in_the_callers_context(driver: str, pipe_id: str, tensor: torch.Tensor) -> torch.futures.Future[None]:
    """On a worker, called with ``tensor`` from inside the driver's context: a late delivery in that
    context (not awaited on the worker's one RPC thread, which completes the call)."""
    from rrefpipe.driver_side.remote import deliver

    return rpc.rpc_async(driver, deliver, args=(pipe_id, 0, tensor * 2))


def stream_threads() -> list[str]:
    """On a stage worker: the threads of continuous pipelines still running (none once a stream ended)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("rrefpipe-stream")]


_buffer_peaks: dict[str, int] = {}


def track_weight_buffers() -> None:
    """On a stage worker: from now on, record the most weight buffers each stage's ``StageWeights`` holds
    right after an update (keyed by its first parameter's name); idempotent."""
    from rrefpipe.stage_side import versions

    _buffer_peaks.clear()
    if getattr(versions.StageWeights.update, "tracked", False):
        return
    update = versions.StageWeights.update

    def tracked(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[no-untyped-def]
        result = update(self, *args, **kwargs)
        key = next(iter(self.params), "")
        _buffer_peaks[key] = max(_buffer_peaks.get(key, 0), self.buffers())
        return result

    tracked.tracked = True  # type: ignore[attr-defined]
    versions.StageWeights.update = tracked  # type: ignore[method-assign]


def weight_buffer_peaks() -> dict[str, int]:
    return dict(_buffer_peaks)
