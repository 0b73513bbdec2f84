"""Reading a pipe's gradients out of a dist-autograd context, keyed like the plain model."""
from __future__ import annotations

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc


def _named_grads(pipe_id: str, index: int, context_id: int) -> dict[str, torch.Tensor]:
    from rrefpipe.server import _server

    grads = dist_autograd.get_gradients(context_id)
    module = _server(pipe_id, index).stage.module
    return {name: grads[p] for name, p in module.named_parameters() if p in grads}


def stage_gradients(pipe, ctx) -> dict[str, torch.Tensor]:
    """Runs on each stage's worker (inside the context); only the test suite needs this."""
    driver = pipe._driver
    context_id = ctx  # `with dist_autograd.context() as ctx` binds the context id
    out: dict[str, torch.Tensor] = {}
    for j, worker in enumerate(driver.workers):
        out.update(rpc.rpc_sync(worker, _named_grads, args=(driver.pipe_id, j, context_id)))
    return out


def counts() -> dict[str, int]:
    """What a process holds: stages, RRefs, autograd contexts, RPC calls in flight, Python threads."""
    import threading

    from rrefpipe.server import _servers

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


def environment(keys: list[str]) -> dict[str, str | None]:
    """The named environment variables of the process this runs in."""
    import os

    return {key: os.environ.get(key) for key in keys}


def interop_threads() -> int:
    """This worker's inter-op threads (where distributed autograd runs backward tasks)."""
    return torch.get_num_interop_threads()
