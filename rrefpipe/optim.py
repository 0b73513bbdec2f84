"""Learning-rate schedules and optimizer checkpoints for torch's ``DistributedOptimizer`` over a pipe.

``DistributedOptimizer`` builds one optimizer on each stage worker and keeps none on the driver, so
``torch.optim.lr_scheduler`` and ``state_dict()`` have nothing to hold on to there. Worse, for the
optimizers TorchScript has a functional twin of (SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, RMSprop,
Rprop), torch builds that twin on the workers, and it has no ``param_groups`` to schedule or state to
save. The classes here are those optimizers under the same names, as subclasses: torch builds them as
the regular ``torch.optim`` optimizer on every worker. (Any optimizer on a stage worker drops its
gradients after each step: see :func:`rrefpipe.stage_side.gradients.drop_after_optimizer_steps`.)
Around those, :class:`RemoteLRScheduler` runs a ``torch.optim.lr_scheduler`` class (or any callable
that builds a scheduler from an optimizer) on every worker, stepped together from the driver, and
:func:`optimizer_state_dict` / :func:`load_optimizer_state_dict` save and restore their state
(momentum, Adam's moments), so a resumed run continues exactly where it stopped::

    opt = DistributedOptimizer(rrefpipe.optim.AdamW, pipe.parameter_rrefs(), lr=1e-3)
    sched = rrefpipe.optim.RemoteLRScheduler(opt, torch.optim.lr_scheduler.StepLR, step_size=10)

Lists of per-worker states follow ``opt.remote_optimizers``: one optimizer per worker, in the order of
the parameters ``DistributedOptimizer`` was given (stage order for ``pipe.parameter_rrefs()``).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer

from . import _rpc
from .driver_side.pipe_optimizer import PipeOptimizer, StageSchedulers
from .stage_side.stage_optim import Scheduled, _shapes, _to_cpu, distributed_optimizer

__all__ = ["SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "RMSprop", "Rprop", "RemoteLRScheduler",
           "optimizer_state_dict", "load_optimizer_state_dict"]


class SGD(torch.optim.SGD):
    """``torch.optim.SGD``, built by ``DistributedOptimizer`` as a regular optimizer (see the module)."""


class Adam(torch.optim.Adam):
    """``torch.optim.Adam``, built by ``DistributedOptimizer`` as a regular optimizer (see the module)."""


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW``, built by ``DistributedOptimizer`` as a regular optimizer (see the module)."""


class Adagrad(torch.optim.Adagrad):
    """``torch.optim.Adagrad``, built by ``DistributedOptimizer`` as a regular optimizer (see the module)."""


class Adadelta(torch.optim.Adadelta):
    """``torch.optim.Adadelta``, built by ``DistributedOptimizer`` as a regular optimizer (see the module)."""


class Adamax(torch.optim.Adamax):
    """``torch.optim.Adamax``, built by ``DistributedOptimizer`` as a regular optimizer (see the module)."""


class RMSprop(torch.optim.RMSprop):
    """``torch.optim.RMSprop``, built by ``DistributedOptimizer`` as a regular optimizer (see the module)."""


class Rprop(torch.optim.Rprop):
    """``torch.optim.Rprop``, built by ``DistributedOptimizer`` as a regular optimizer (see the module)."""


_CLASSES = (SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, RMSprop, Rprop)


class _NoTorchScriptNotice(logging.Filter):
    """Drops torch's warning that an optimizer built without TorchScript may be slow, for these classes:
    going without it is their point, and the cost is measured (README: learning-rate schedules)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.args, tuple) and record.args and record.args[0] in _CLASSES)


logging.getLogger("torch.distributed.optim.optimizer").addFilter(_NoTorchScriptNotice())


def _remote_optimizers(optimizer: DistributedOptimizer) -> list[rpc.RRef]:
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(f"expected a torch.distributed.optim.DistributedOptimizer, got {type(optimizer).__name__}")
    if optimizer.is_functional_optim:
        raise TypeError("this DistributedOptimizer runs TorchScript's functional optimizer on its workers, which "
                        "has no param_groups or state_dict: build it with the class of the same name from "
                        "rrefpipe.optim (e.g. DistributedOptimizer(rrefpipe.optim.SGD, pipe.parameter_rrefs(), "
                        "lr=0.1)), which torch builds as the regular torch.optim optimizer")
    return list(optimizer.remote_optimizers)



def _optimizer_state(optimizer_rref: rpc.RRef) -> dict[str, Any]:
    optimizer, lock = distributed_optimizer(optimizer_rref)
    with lock:
        return {"state_dict": _to_cpu(optimizer.state_dict()), "shapes": _shapes(optimizer)}


def _refusal(optimizer_rref: rpc.RRef, saved: Any) -> str | None:
    """Why ``saved`` does not fit this worker's optimizer, if it does not."""
    optimizer, _ = distributed_optimizer(optimizer_rref)
    shapes = saved.get("shapes") if isinstance(saved, dict) else None
    if shapes != _shapes(optimizer):
        return f"the state saved is for parameters of shapes {shapes}, this one's are {_shapes(optimizer)}"
    return None


def _load_optimizer_state(optimizer_rref: rpc.RRef, saved: dict[str, Any]) -> None:
    optimizer, lock = distributed_optimizer(optimizer_rref)
    with lock:
        optimizer.load_state_dict(saved["state_dict"])  # moves the state to the parameters' devices


def _new_scheduler(optimizer_rref: rpc.RRef, factory: bytes) -> tuple[rpc.RRef, bool]:
    """The scheduler's RRef, and whether it steps on a metric (refused by the driver)."""
    scheduled = Scheduled(*distributed_optimizer(optimizer_rref), factory)
    return rpc.RRef(scheduled), scheduled.on_metric


def _call(scheduled_rref: rpc.RRef, method: str, *args: Any) -> Any:
    return scheduled_rref.local_value().call(method, *args)


def _on_each(rrefs: list[rpc.RRef], fn: Callable[..., Any], per_rref: list[tuple[Any, ...]] | None = None,
             what: str = "") -> list[Any]:
    """``fn(rref, *args)`` on each RRef's owner, all at once (``args`` from ``per_rref``, or none); the
    results in order. A failure names the worker."""
    calls = per_rref if per_rref is not None else [()] * len(rrefs)
    futures = [(rref.owner().name, rpc.rpc_async(rref.owner(), fn, args=(rref, *args)))
               for rref, args in zip(rrefs, calls)]
    results: list[Any] = []
    failure: tuple[str, Exception] | None = None
    for worker, future in futures:  # wait for every one: nothing is left running behind an error
        try:
            results.append(_rpc.wait(future))
        except Exception as exc:
            failure = failure or (worker, exc)
    if failure is not None:
        worker, cause = failure
        lines = str(cause).strip().splitlines() or [type(cause).__name__]
        detail = lines[1] if len(lines) > 1 and "On WorkerInfo" in lines[0] else lines[0]  # the remote repr
        raise RuntimeError(f"{what} on worker {worker!r} failed: {detail}") from cause
    return results


def _per_worker(states: Any, count: int, what: str, per: str = "worker") -> list[tuple[Any, ...]]:
    if not isinstance(states, list) or len(states) != count:
        got = f"a list of {len(states)}" if isinstance(states, list) else type(states).__name__
        raise ValueError(f"expected a list of {count} {what} states, one per {per} as saved, got {got}")
    return [(state,) for state in states]


def optimizer_state_dict(optimizer: DistributedOptimizer) -> list[dict[str, Any]]:
    """Each worker's optimizer state (its ``state_dict()``, tensors on the CPU), for a checkpoint."""
    return _on_each(_remote_optimizers(optimizer), _optimizer_state, what="saving the optimizer state")


def load_optimizer_state_dict(optimizer: DistributedOptimizer, states: list[dict[str, Any]]) -> None:
    """Restore what :func:`optimizer_state_dict` saved, into an optimizer over the same stages (checked
    by the shapes of each worker's parameters)."""
    rrefs = _remote_optimizers(optimizer)
    states_each = _per_worker(states, len(rrefs), "optimizer")
    refusals = _on_each(rrefs, _refusal, states_each, what="checking the optimizer state")
    for k, (rref, refusal) in enumerate(zip(rrefs, refusals)):
        if refusal is not None:  # checked everywhere before anything is loaded
            raise ValueError(f"optimizer state {k} does not fit the optimizer on worker {rref.owner().name!r}: "
                             f"{refusal}. Save and load over the same stages, in the same order")
    _on_each(rrefs, _load_optimizer_state, states_each, what="loading the optimizer state")


_ON_METRIC = "ReduceLROnPlateau steps on a metric, which RemoteLRScheduler.step() does not take"


class RemoteLRScheduler:
    """A learning-rate scheduler next to every worker's optimizer of a ``DistributedOptimizer``, or every
    stage's optimizer of a pipe's own (``pipe.optimizer(...)``, a
    :class:`~rrefpipe.driver_side.pipe_optimizer.PipeOptimizer`).

    ``RemoteLRScheduler(opt, torch.optim.lr_scheduler.OneCycleLR, max_lr=0.1, total_steps=1000)`` builds
    ``OneCycleLR(worker_optimizer, max_lr=0.1, total_steps=1000)`` on each worker (on each stage, for a
    ``PipeOptimizer``: lists below are then per stage); :meth:`step` steps them all (call it where you
    would call ``scheduler.step()``, after ``opt.step``). Any callable that
    takes the optimizer first works, so schedulers made of schedulers go as a function:
    ``RemoteLRScheduler(opt, lambda o: SequentialLR(o, [LinearLR(o, 0.1), CosineAnnealingLR(o, 90)], [10]))``.
    The callable and its arguments are cloudpickled: lambdas and what your script (``__main__``) defines
    travel by value, anything importable by reference (it must import on the workers).
    ``ReduceLROnPlateau``, which steps on a metric, is refused.
    """

    def __init__(self, optimizer: DistributedOptimizer | PipeOptimizer, scheduler: Callable[..., Any], *args: Any,
                 **kwargs: Any) -> None:
        self._stages: StageSchedulers | None = None
        self._schedulers: list[rpc.RRef] = []
        if isinstance(optimizer, PipeOptimizer):
            self._stages = optimizer.add_scheduler(cloudpickle.dumps((scheduler, args, kwargs)))
            if self._stages.on_metric:
                self._stages.close()
                raise TypeError(_ON_METRIC)
            return
        rrefs = _remote_optimizers(optimizer)
        factory = cloudpickle.dumps((scheduler, args, kwargs))
        built = _on_each(rrefs, _new_scheduler, [(factory,)] * len(rrefs), what="building the scheduler")
        if any(on_metric for _, on_metric in built):
            raise TypeError(_ON_METRIC)
        self._schedulers = [rref for rref, _ in built]

    def stage_scheduler_id(self, optimizer: PipeOptimizer) -> int | None:
        """The id under which the stage workers keep this scheduler, if it was built on ``optimizer``
        (an asynchronous ``train_stream`` has each stage step it after its own update)."""
        return self._stages.id if self._stages is not None and self._stages.owner is optimizer else None

    def _each(self, method: str, per_worker: list[tuple[Any, ...]] | None = None) -> list[Any]:
        if self._stages is not None:
            return self._stages.call(method, per_worker)
        calls = [(method, *args) for args in per_worker] if per_worker else [(method,)] * len(self._schedulers)
        return _on_each(self._schedulers, _call, calls, what=f"scheduler.{method}()")

    def step(self) -> None:
        """``scheduler.step()`` on every worker."""
        self._each("step")

    def get_last_lr(self) -> list[float]:
        """The learning rate of every parameter group, worker (or stage) after worker."""
        return [lr for lrs in self._each("get_last_lr") for lr in lrs]

    def state_dict(self) -> list[dict[str, Any]]:
        """Each worker's (or stage's) scheduler state, for a checkpoint."""
        return self._each("state_dict")

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        """Restore what :meth:`state_dict` saved."""
        count, per = (len(self._stages), "stage") if self._stages is not None else (len(self._schedulers), "worker")
        self._each("load_state_dict", _per_worker(states, count, "scheduler", per))
