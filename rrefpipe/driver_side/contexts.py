"""What this process's pipes did in each distributed autograd context, for the one backward it takes.

Distributed autograd runs one backward per context, and that backward waits for a gradient of every
send recorded in the context, whichever pipe recorded it. A forward whose output the loss does not
reach (left out, or detached: a frozen teacher's targets), a forward that failed half-way, or a
second backward would wait until the RPC timeout, or for ever where no RPC is in flight: the driver's
engine waiting for its own send to a first stage. So the ledger is per process, not per pipe: any
pipe's ``backward`` refuses those at once, and reaches the sends of outputs that no loss can use
(integer tensors only) through the phonies kept for them.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .. import _rpc

__all__: list[str] = []

_KEPT = 64  # contexts: one is never told it ended, so older ones are dropped


@dataclass
class Forwards:
    """One pipe's forwards in one context: the pipe's stage workers and the steps (a failure in a
    backward over several pipes' losses is looked up by worker, then by step), the autograd nodes of
    each output that came to the driver, and how many outputs stayed on the last worker
    (``remote_output``)."""

    workers: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    rows: int = 0  # samples forwarded: a replica's weight when gradients are averaged over replicas
    outputs: list[list[Any]] = field(default_factory=list)
    remote: int = 0


@dataclass
class _Context:
    forwards: dict[str, Forwards] = field(default_factory=dict)  # by pipe id
    failed: list[str] = field(default_factory=list)  # pipes whose forward failed here
    unreached: list[Tensor] = field(default_factory=list)  # phonies of outputs no loss can use
    backward_by: str | None = None  # the pipe that ran the context's backward
    trained_by: str | None = None  # a pipe that ran train_step here (its workers' gradients are in)


_contexts: OrderedDict[int, _Context] = OrderedDict()
_lock = threading.Lock()  # pipes may run on several user threads


def _entry(context_id: int) -> _Context:
    entry = _contexts.setdefault(context_id, _Context())
    _contexts.move_to_end(context_id)
    while len(_contexts) > _KEPT:
        _contexts.popitem(last=False)
    return entry


def forwards(context_id: int, pipe_id: str, workers: list[str]) -> Forwards:
    """The record of pipe ``pipe_id``'s forwards in context ``context_id``, for a forward to add to."""
    with _lock:
        return _entry(context_id).forwards.setdefault(pipe_id, Forwards(workers=list(workers)))


def forward_failed(context_id: int, pipe_id: str) -> None:
    """A forward failed after it may have sent: its sends stay in the context, and no gradient reaches them."""
    with _lock:
        _entry(context_id).failed.append(pipe_id)


def keep_unreached(context_id: int, phony: Tensor) -> None:
    """The phony of an output that cannot carry a gradient: the context's backward adds its sum (a zero)."""
    with _lock:
        _entry(context_id).unreached.append(phony)


def check_train_step(context_id: int, pipe_id: str) -> None:
    """Refuse a ``train_step`` in a context where a forward with gradients ran (or a backward): its
    sends are in the workers' contexts, and the step's gradients are installed there by a backward
    that would wait for them until the RPC timeout, and hold a worker thread for good."""
    with _lock:
        entry = _contexts.get(context_id)
        if entry is None:
            return
        who = next(iter(entry.forwards), None) or next(iter(entry.failed), None) or entry.backward_by
        if who is not None:
            raise RuntimeError(f"{_whose(who, pipe_id)} ran a forward with gradients in autograd context "
                               f"{context_id}: train_step needs a context of its own (it runs forward, loss and "
                               "backward itself). Start a new dist_autograd.context() for it, and run forwards "
                               "you only look at under torch.no_grad()")


def trained(context_id: int, pipe_id: str) -> None:
    """``pipe_id`` ran ``train_step`` in the context: its forward, loss and backward are done, and its
    messages left sends in the context that no backward here can reach."""
    with _lock:
        _entry(context_id).trained_by = pipe_id


def begin_backward(context_id: int, pipe_id: str, losses: list[Tensor]) -> tuple[dict[str, Forwards], list[Tensor]]:
    """Check that ``losses`` can end the context's backward; returns the forwards of every pipe there (by
    pipe id, to name a stage that fails in the backward) and the zero losses that reach the sends of
    outputs no loss can use.

    Raises:
        RuntimeError: a forward failed in the context, a backward ran there already, or the losses
            leave out a forward of any pipe there (nothing is changed: a corrected retry may follow).
    """
    if not _rpc.context_exists(context_id):
        raise RuntimeError(f"no dist_autograd context {context_id!r} in this process (its with block has ended?): run "
                           "forward, loss and backward inside one `with dist_autograd.context() as ctx:` block and "
                           "call pipe.backward(ctx, loss) there")
    sends = _rpc.send_functions(context_id)
    with _lock:
        reached = _reachable(t.grad_fn for t in losses)
        _check_loss_context(context_id, reached)
        entry = _entry(context_id)
        if entry.failed:
            raise RuntimeError(f"a forward of {_whose(entry.failed[0], pipe_id)} failed in autograd context "
                               f"{context_id}: distributed autograd would wait for the sends of that forward until "
                               "the RPC timeout, or for ever. Run the step again in a new dist_autograd.context()")
        if entry.trained_by is not None:
            raise RuntimeError(f"{_whose(entry.trained_by, pipe_id)} ran train_step in autograd context {context_id}: "
                               "train_step is forward, loss and backward in one, and its gradients are in the context "
                               "already. Call DistributedOptimizer.step(ctx) now; run a pipe(x) whose loss you "
                               "backpropagate yourself in a context of its own")
        if entry.backward_by is not None:
            raise RuntimeError(f"{_whose(entry.backward_by, pipe_id)} already ran a backward in autograd context "
                               f"{context_id}: distributed autograd takes one backward per context (a second waits "
                               "for the first one's sends until the RPC timeout, or for ever). Run each step in its "
                               "own dist_autograd.context(); to accumulate gradients, sum the losses of several "
                               "forwards into one backward")
        _check_outputs_in_loss(context_id, entry.forwards, pipe_id, reached, sends, entry.unreached)
        entry.backward_by = pipe_id
        unreached, entry.unreached = entry.unreached, []
        by_pipe, entry.forwards = entry.forwards, {}  # the nodes: the graph is spent
    with torch.enable_grad():  # a zero-size phony's sum: a scalar 0 whose gradient reaches its forward's sends
        return by_pipe, [phony.sum() for phony in unreached]


def _reachable(roots: Iterable[Any], reached: set[Any] | None = None) -> set[Any]:
    """Every autograd node reachable from ``roots`` (``None`` roots skipped), added to ``reached``."""
    reached = set() if reached is None else reached
    todo = list(roots)
    while todo:
        node = todo.pop()
        if node is not None and node not in reached:
            reached.add(node)
            todo.extend(next_node for next_node, _ in node.next_functions)
    return reached


def _check_loss_context(context_id: int, seen: set[Any]) -> None:
    """Refuse losses computed from tensors that arrived over RPC in another context (an old loss kept past
    its ``with`` block, or a forward run in one context and the backward in another): distributed
    autograd would fail deep in its engine. ``seen``: the nodes the losses reach. The other context is
    named when a pipe's forward ran there."""
    here = set(_rpc.received(context_id))
    if not any(node.name().endswith("RecvRpcBackward") and node not in here for node in seen):
        return
    origins = [other for other, entry in _contexts.items() if other != context_id and any(
        node in seen for record in entry.forwards.values() for nodes in record.outputs for node in nodes)]
    if origins:
        state = "still open" if _rpc.context_exists(origins[-1]) else "its with block has ended"
        what = f"the loss was computed from the output of a forward run in autograd context {origins[-1]} ({state})"
    else:
        what = "the loss uses tensors that arrived over RPC in another autograd context"
    raise RuntimeError(f"{what}, and the backward is asked of context {context_id}: a backward reaches the stages "
                       "only through the context of the forward. Run forward, loss and backward in the same block:\n"
                       "    with dist_autograd.context() as ctx:\n"
                       "        loss = loss_fn(pipe(x).local_value(), y)\n"
                       "        pipe.backward(ctx, loss)")


def _whose(pipe_id: str, caller: str) -> str:
    return "this pipe" if pipe_id == caller else f"pipe {pipe_id}"


def _check_outputs_in_loss(context_id: int, by_pipe: dict[str, Forwards], caller: str, reached: set[Any],
                           sends: list[Any], unreached: list[Tensor]) -> None:
    """Refuse a backward whose losses leave out a forward of the context, of any pipe.

    ``reached`` holds the nodes the losses reach; those of this process's sends join it here. The graph
    is walked from the losses and from this process's sends, which distributed autograd
    takes as roots too: an output fed into another pipe (``d(g(x))``) gets its gradient back through
    the send of that pipe's input. Each output that came to the driver is checked by its nodes.
    Outputs kept on the last worker are fetched by the caller (``to_here()``), so the driver cannot tell
    them apart: a loss that reaches no received tensor at all leaves every one of them out, and one
    that leaves out a tensor received from that worker in the context (a fetched output detached as a
    target) leaves out its forward. A forward never fetched here is not seen (the RPC timeout ends it)."""
    if not any(f.outputs or f.remote for f in by_pipe.values()):
        return
    _reachable(sends, reached)
    for pipe_id, record in by_pipe.items():
        unused = [k for k, nodes in enumerate(record.outputs) if not any(node in reached for node in nodes)]
        if unused:
            raise RuntimeError(
                f"forward {unused[0] + 1} of {len(record.outputs)} of {_whose(pipe_id, caller)} in autograd context "
                f"{context_id} is not part of the loss (left out, or its output detached): distributed autograd "
                "would wait for its sends until the RPC timeout, or for ever. Run forwards you do not backpropagate "
                "(validation, metrics, a frozen teacher) under torch.no_grad() or outside the context")
    kept = {phony.grad_fn for phony in unreached}  # reached through the sums begin_backward adds
    for pipe_id, record in by_pipe.items():
        if not record.remote:
            continue
        if not any(node.name().endswith("RecvRpcBackward") for node in reached):
            raise RuntimeError(
                f"the loss uses no output of the {record.remote} forward(s) of {_whose(pipe_id, caller)} in autograd "
                f"context {context_id} whose outputs stayed on the last worker (remote_output=True): distributed "
                "autograd would wait for their sends for ever. Use the fetched output (rref.to_here()) in the loss, "
                "or run forwards you do not backpropagate under torch.no_grad() or outside the context")
        fetched = _rpc.received_from(context_id, record.workers[-1])
        detached = sum(node not in reached and node not in kept for node in fetched)
        if detached:
            raise RuntimeError(
                f"{detached} of the {len(fetched)} tensor message(s) fetched in autograd context {context_id} from "
                f"{record.workers[-1]!r}, the last worker of {_whose(pipe_id, caller)} (remote_output=True, "
                f"{record.remote} forward(s) here), are not part of the loss (detached, say, as a frozen teacher's "
                "target): distributed autograd would wait for that forward's sends for ever. Run forwards you do not "
                "backpropagate under torch.no_grad() or outside the context")
