"""Learning-rate schedules and optimizer checkpoints for torch's ``DistributedOptimizer`` over a pipe.

``DistributedOptimizer`` builds one optimizer on each stage worker and keeps none on the driver, so
``torch.optim.lr_scheduler`` and ``state_dict()`` have nothing to hold on to there. Worse, for the
optimizers TorchScript has a functional twin of (SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, RMSprop,
Rprop), torch builds that twin on the workers, and it has no ``param_groups`` to schedule or state to
save. The classes here are those optimizers under the same names, as subclasses: torch builds them as
the regular ``torch.optim`` optimizer on every worker. Around those, :class:`RemoteLRScheduler` runs any
``torch.optim.lr_scheduler`` class on every worker, stepped together from the driver, and
:func:`optimizer_state_dict` / :func:`load_optimizer_state_dict` save and restore their state
(momentum, Adam's moments), so a resumed run continues exactly where it stopped::

    opt = DistributedOptimizer(rrefpipe.optim.AdamW, pipe.parameter_rrefs(), lr=1e-3)
    sched = rrefpipe.optim.RemoteLRScheduler(opt, torch.optim.lr_scheduler.StepLR, step_size=10)

Lists of per-worker states follow ``opt.remote_optimizers``: one optimizer per worker, in the order of
the parameters ``DistributedOptimizer`` was given (stage order for ``pipe.parameter_rrefs()``).
"""
from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer
from torch.optim import Optimizer

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


def _local(optimizer_rref: rpc.RRef) -> Optimizer:
    """The torch.optim optimizer a ``DistributedOptimizer`` keeps on this worker."""
    return optimizer_rref.local_value().optim


def _to_cpu(value: Any) -> Any:
    """State with every tensor on the CPU: the driver has no device maps to receive GPU tensors."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _state_dict(obj_rref: rpc.RRef, optimizer: bool) -> dict[str, Any]:
    obj = _local(obj_rref) if optimizer else obj_rref.local_value()
    return _to_cpu(obj.state_dict())


def _load_state_dict(obj_rref: rpc.RRef, optimizer: bool, state: dict[str, Any]) -> None:
    obj = _local(obj_rref) if optimizer else obj_rref.local_value()
    obj.load_state_dict(state)  # a torch optimizer moves its state to its parameters' devices


def _new_scheduler(optimizer_rref: rpc.RRef, factory: bytes) -> rpc.RRef:
    scheduler_class, args, kwargs = pickle.loads(factory)
    return rpc.RRef(scheduler_class(_local(optimizer_rref), *args, **kwargs))


def _call(obj_rref: rpc.RRef, method: str) -> Any:
    return getattr(obj_rref.local_value(), method)()


def _on_each(rrefs: list[rpc.RRef], fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(rref, *args)`` on each RRef's owner, all at once; the results in order."""
    futures = [rpc.rpc_async(rref.owner(), fn, args=(rref, *args)) for rref in rrefs]
    return [future.wait() for future in futures]


def optimizer_state_dict(optimizer: DistributedOptimizer) -> list[dict[str, Any]]:
    """The ``state_dict()`` of each worker's optimizer (tensors on the CPU), for a checkpoint."""
    return _on_each(_remote_optimizers(optimizer), _state_dict, True)


def load_optimizer_state_dict(optimizer: DistributedOptimizer, states: list[dict[str, Any]]) -> None:
    """Restore what :func:`optimizer_state_dict` saved, into an optimizer over the same stages."""
    _load_each(_remote_optimizers(optimizer), True, states)


def _load_each(rrefs: list[rpc.RRef], optimizer: bool, states: list[dict[str, Any]]) -> None:
    what = "optimizer" if optimizer else "scheduler"
    if not isinstance(states, list) or len(states) != len(rrefs):
        got = f"a list of {len(states)}" if isinstance(states, list) else type(states).__name__
        raise ValueError(f"expected a list of {len(rrefs)} {what} states, one per worker as saved, got {got}")
    futures = [rpc.rpc_async(rref.owner(), _load_state_dict, args=(rref, optimizer, state))
               for rref, state in zip(rrefs, states)]
    for future in futures:
        future.wait()


class RemoteLRScheduler:
    """A ``torch.optim.lr_scheduler`` class run on every worker of a ``DistributedOptimizer``.

    ``RemoteLRScheduler(opt, torch.optim.lr_scheduler.OneCycleLR, max_lr=0.1, total_steps=1000)`` builds
    ``OneCycleLR(worker_optimizer, max_lr=0.1, total_steps=1000)`` next to each worker's optimizer;
    :meth:`step` steps them all (call it where you would call ``scheduler.step()``, after ``opt.step``).
    The class and its arguments travel by value (cloudpickle), so ``LambdaLR`` with a lambda from your
    script works. Schedulers that read a metric (``ReduceLROnPlateau``) are not supported.
    """

    def __init__(self, optimizer: DistributedOptimizer, scheduler_class: Callable[..., Any], *args: Any,
                 **kwargs: Any) -> None:
        if isinstance(scheduler_class, type) and issubclass(scheduler_class, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError("ReduceLROnPlateau steps on a metric, which RemoteLRScheduler.step() does not take")
        factory = cloudpickle.dumps((scheduler_class, args, kwargs))  # by value: LambdaLR's lambdas too
        self._schedulers = _on_each(_remote_optimizers(optimizer), _new_scheduler, factory)

    def step(self) -> None:
        """``scheduler.step()`` on every worker."""
        _on_each(self._schedulers, _call, "step")

    def get_last_lr(self) -> list[float]:
        """The learning rate of every parameter group, worker after worker."""
        return [lr for lrs in _on_each(self._schedulers, _call, "get_last_lr") for lr in lrs]

    def state_dict(self) -> list[dict[str, Any]]:
        """Each worker's scheduler state, for a checkpoint."""
        return _on_each(self._schedulers, _state_dict, False)

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        """Restore what :meth:`state_dict` saved."""
        _load_each(self._schedulers, False, states)
