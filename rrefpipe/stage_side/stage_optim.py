"""The worker side of a pipe's own optimizer (``pipe.optimizer(cls, **kwargs)``; the driver side is
:mod:`rrefpipe.driver_side.pipe_optimizer`): one regular ``torch.optim`` optimizer per stage, over that stage's
parameters, kept in a registry on the stage's worker, and the control calls that build, step, read,
change and drop them.

The optimizers live here, not in torch's ``DistributedOptimizer``, so that code on the worker can step
a stage without the driver: the stream runtime finds a stage's optimizer and its schedulers by
(pipe id, optimizer id, stage) with :func:`optimizer` and :func:`schedulers`, and holds :func:`lock`
while it steps. Every control call here holds the same lock, so none runs in the middle of a step.

The control calls take ``(pipe_id, j, opt_id, ...)``, the order the driver's ``_call_each`` passes.
"""
from __future__ import annotations

import pickle
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.optim import Optimizer

from . import server

__all__ = ["optimizer", "schedulers", "distributed_optimizer", "lock", "owned_parameters", "Scheduled"]


def _to_cpu(value: Any) -> Any:
    """State with every tensor on the CPU: the driver has no device maps to receive GPU tensors."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _shapes(optimizer: Optimizer) -> list[list[int]]:
    """The shapes of the optimizer's parameters, in its order (that of its ``state_dict``'s indices)."""
    return [list(p.shape) for group in optimizer.param_groups for p in group["params"]]


class Scheduled:
    """A learning-rate scheduler built next to an optimizer on this worker, called under the lock that
    the optimizer's steps take (``_LocalOptimizer.global_lock`` for a ``DistributedOptimizer``'s)."""

    def __init__(self, optimizer: Optimizer, lock: Any, factory: bytes) -> None:
        self.lock = lock
        make, args, kwargs = pickle.loads(factory)
        with lock:  # the scheduler's first step sets the groups' learning rates
            self.scheduler = make(optimizer, *args, **kwargs)

    @property
    def on_metric(self) -> bool:
        """Whether it steps on a metric (``ReduceLROnPlateau``), which the driver's ``step()`` has not."""
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def call(self, method: str, *args: Any) -> Any:
        with self.lock:
            result = getattr(self.scheduler, method)(*args)
        return _to_cpu(result) if method == "state_dict" else result


@dataclass
class _Stage:
    """One stage's optimizer, the parameters it steps (in its order) and the schedulers built on it."""

    optimizer: Optimizer
    params: list[nn.Parameter]
    from_server: bool  # built over a stage of this worker's server (not a pipe in the driver's process)
    schedulers: dict[int, Scheduled] = field(default_factory=dict)  # by the driver's id, in the order built


_stages: dict[tuple[str, int, int], _Stage] = {}  # (pipe id, optimizer id, stage)
_locks: dict[tuple[str, int], threading.Lock] = {}  # (pipe id, optimizer id): one per worker per optimizer
_closed: OrderedDict[tuple[str, int], None] = OrderedDict()  # the latest closed: a build still on its way is dropped
_registry = threading.Lock()


def _stage(pipe_id: str, opt_id: int, j: int) -> _Stage:
    try:
        return _stages[(pipe_id, opt_id, j)]
    except KeyError:
        raise LookupError(f"optimizer {opt_id} of pipe {pipe_id!r} has no stage {j} on worker "
                          f"{rpc.get_worker_info().name!r} (closed, or never built)") from None


# -- what code on the worker (the stream runtime) calls --------------------------------------------------
def optimizer(pipe_id: str, opt_id: int, j: int) -> Optimizer:
    """The optimizer of stage ``j``; step it under :func:`lock`."""
    return _stage(pipe_id, opt_id, j).optimizer


def schedulers(pipe_id: str, opt_id: int, j: int) -> list[Any]:
    """The learning-rate schedulers built on stage ``j``'s optimizer (``RemoteLRScheduler``), oldest first."""
    return [scheduled.scheduler for scheduled in _stage(pipe_id, opt_id, j).schedulers.values()]


def scheduler(pipe_id: str, opt_id: int, j: int, scheduler_id: int) -> Any:
    """The learning-rate scheduler ``scheduler_id`` built on stage ``j``'s optimizer."""
    return _stage(pipe_id, opt_id, j).schedulers[scheduler_id].scheduler


def distributed_optimizer(optimizer_rref: rpc.RRef) -> tuple[Optimizer, Any]:
    """The torch.optim optimizer a ``DistributedOptimizer`` keeps on this worker (``optimizer_rref``: one of
    its ``remote_optimizers``), and the lock its ``step`` takes (``_LocalOptimizer.global_lock``)."""
    wrapper = optimizer_rref.local_value()
    return wrapper.optim, type(wrapper).global_lock


def lock(pipe_id: str, opt_id: int) -> threading.Lock:
    """The lock this worker's stages of the optimizer share: whoever steps, reads or changes one holds it."""
    try:
        return _locks[(pipe_id, opt_id)]
    except KeyError:
        raise LookupError(f"optimizer {opt_id} of pipe {pipe_id!r} is not on worker {rpc.get_worker_info().name!r} "
                          "(closed, or never built)") from None


def owned_parameters(module: nn.Module, earlier: Iterable[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """A stage's named parameters less those that an ``earlier`` stage of the same process holds too:
    a Parameter shared by two stages belongs to the lowest, so that it is stepped once."""
    taken = {id(p) for m in earlier for p in m.parameters()}
    return [(name, p) for name, p in module.named_parameters() if id(p) not in taken]


def _server_parameters(pipe_id: str, j: int) -> list[tuple[str, nn.Parameter]]:
    here = server._server(pipe_id, j)
    workers = here.workers  # per stage (``server.connect``)
    return owned_parameters(here.stage.module,
                            [server._server(pipe_id, k).stage.module for k in range(j) if workers[k] == workers[j]])


def _sweep() -> None:
    """Drop the optimizers of pipes whose stages left this worker: a pipe dropped without ``close()`` is
    closed by its driver later (``placement.close_abandoned``), which frees its stages, not these."""
    with _registry:
        gone = [key for key, stage in _stages.items() if stage.from_server and not server.has_stages(key[0])]
        for key in gone:
            del _stages[key]
        for pipe_opt in {key[:2] for key in gone} - {key[:2] for key in _stages}:
            _locks.pop(pipe_opt, None)


# -- control calls from the driver -----------------------------------------------------------------------
def build_optimizer(pipe_id: str, j: int, opt_id: int, payload: bytes,
                    named: list[tuple[str, nn.Parameter]] | None = None) -> tuple[list[list[str]], list[list[int]]]:
    """Build ``cls(stage_parameters, **kwargs)`` (``payload``: both, cloudpickled) for stage ``j``: the
    parameters of its server here, or ``named`` (a pipe in the driver's process). A stage without
    parameters of its own gets one empty group, so that every stage has an optimizer to step. Returns
    each group's parameter names in the stage and the parameters' shapes, in the optimizer's order."""
    cls, kwargs = pickle.loads(payload)
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(f"pipe.optimizer takes a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW), got {cls!r}")
    from_server = named is None
    if named is None:
        _sweep()
        named = _server_parameters(pipe_id, j)
    params = [p for _, p in named]
    built = cls(params if params else [{"params": []}], **kwargs)
    names = {id(p): name for name, p in named}
    with _registry:
        if (pipe_id, opt_id) not in _closed:  # else its driver gave up on it while this was being built
            _stages[(pipe_id, opt_id, j)] = _Stage(built, params, from_server)
            _locks.setdefault((pipe_id, opt_id), threading.Lock())
    return [[names[id(p)] for p in group["params"]] for group in built.param_groups], _shapes(built)


def close_optimizer(pipe_id: str, j: int, opt_id: int) -> None:
    """Drop stage ``j``'s optimizer and its schedulers; one still being built is dropped once built."""
    with _registry:
        _stages.pop((pipe_id, opt_id, j), None)
        _closed[(pipe_id, opt_id)] = None
        while len(_closed) > 64:
            _closed.popitem(last=False)
        if not any(key[:2] == (pipe_id, opt_id) for key in _stages):
            _locks.pop((pipe_id, opt_id), None)


def step(pipe_id: str, j: int, opt_id: int, context_id: int) -> None:
    """``torch.distributed.optim``'s ``_LocalOptimizer.step``: each parameter's ``.grad`` is its gradient in
    the context (None where it has none), then ``optimizer.step()``; then the ``.grad`` are dropped."""
    stage = _stage(pipe_id, opt_id, j)
    grads = dist_autograd.get_gradients(context_id)
    with lock(pipe_id, opt_id):
        for p in stage.params:
            p.grad = grads[p] if p in grads else None
        try:
            stage.optimizer.step()
        finally:
            for p in stage.params:
                p.grad = None


def zero_grad(pipe_id: str, j: int, opt_id: int) -> None:
    stage = _stage(pipe_id, opt_id, j)
    with lock(pipe_id, opt_id):
        stage.optimizer.zero_grad(set_to_none=True)


def hyperparameters(pipe_id: str, j: int, opt_id: int) -> list[dict[str, Any]]:
    """Each group's settings, without its parameters (the driver names them)."""
    stage = _stage(pipe_id, opt_id, j)
    with lock(pipe_id, opt_id):
        return [_to_cpu({k: v for k, v in group.items() if k != "params"}) for group in stage.optimizer.param_groups]


def set_hyperparameter(pipe_id: str, j: int, opt_id: int, group: int, key: str, value: Any) -> None:
    stage = _stage(pipe_id, opt_id, j)
    with lock(pipe_id, opt_id):
        stage.optimizer.param_groups[group][key] = value


def state(pipe_id: str, j: int, opt_id: int) -> dict[str, Any]:
    """The optimizer's ``state_dict()`` (parameters as indices), tensors on the CPU."""
    stage = _stage(pipe_id, opt_id, j)
    with lock(pipe_id, opt_id):
        return _to_cpu(stage.optimizer.state_dict())


def load_state(pipe_id: str, j: int, opt_id: int, saved: dict[str, Any]) -> None:
    """``load_state_dict`` (checked by the driver first); it moves the state to the parameters' devices."""
    stage = _stage(pipe_id, opt_id, j)
    with lock(pipe_id, opt_id):
        stage.optimizer.load_state_dict(saved)


def add_scheduler(pipe_id: str, j: int, opt_id: int, scheduler_id: int, factory: bytes) -> bool:
    """Build a scheduler on stage ``j``'s optimizer; whether it steps on a metric (the driver refuses it)."""
    stage = _stage(pipe_id, opt_id, j)
    scheduled = Scheduled(stage.optimizer, lock(pipe_id, opt_id), factory)
    with _registry:
        stage.schedulers[scheduler_id] = scheduled
    return scheduled.on_metric


def drop_scheduler(pipe_id: str, j: int, opt_id: int, scheduler_id: int) -> None:
    stage = _stages.get((pipe_id, opt_id, j))
    if stage is not None:
        with _registry:
            stage.schedulers.pop(scheduler_id, None)


def call_scheduler(pipe_id: str, j: int, opt_id: int, scheduler_id: int, method: str, *args: Any) -> Any:
    try:
        scheduled = _stage(pipe_id, opt_id, j).schedulers[scheduler_id]
    except KeyError:
        raise LookupError(f"scheduler {scheduler_id} of optimizer {opt_id} is not on stage {j}") from None
    return scheduled.call(method, *args)
