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
