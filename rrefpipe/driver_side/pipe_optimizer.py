"""A pipe's own optimizer, the driver side: ``pipe.optimizer(torch.optim.AdamW, lr=1e-3)``.

It builds the regular ``torch.optim`` class, one per stage, on every stage's worker
(:mod:`rrefpipe.stage_side.stage_optim`) and drives them from here with control calls: :meth:`PipeOptimizer.step`
is ``DistributedOptimizer.step``'s arithmetic, and unlike that one it has ``param_groups`` to change,
and a ``state_dict`` keyed by the names ``pipe.state_dict()`` gives the parameters, so that a
checkpoint of both reads as one model's. Code on the workers can step the same optimizers without the
driver (the stream runtime). A pipe in one process gets the same optimizers, built here.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import weakref
from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import cloudpickle
import torch
from torch import Tensor

from .. import _rpc
from ..stage_side import control, stage_optim
from .remote import RemoteDriver, _raised_if_failed
from .local import LocalDriver

if TYPE_CHECKING:
    from ..captured import CapturedPipeModel
    from ..pipe import Pipe

__all__ = ["PipeOptimizer", "ParamGroup", "StageSchedulers", "build", "close_all"]

_ids = itertools.count()  # optimizer and scheduler ids: unique in this process, so on every worker with the pipe id
_IN_PROCESS = "in-process"  # the pipe id of every pipe in this process (optimizer ids tell them apart)
Driver = RemoteDriver | LocalDriver
_owned: weakref.WeakKeyDictionary[Any, list[PipeOptimizer]] = weakref.WeakKeyDictionary()  # by the pipe's driver


def build(pipe: Pipe, cls: type[torch.optim.Optimizer], /, **kwargs: Any) -> PipeOptimizer:
    """``cls(stage_parameters, **kwargs)`` on every stage, owned by ``pipe`` (:func:`close_all` closes it)."""
    optimizer = PipeOptimizer(pipe, cls, **kwargs)
    _owned.setdefault(pipe._driver, []).append(optimizer)
    return optimizer


def owned(driver: Any) -> list[PipeOptimizer]:
    """The open optimizers built on the pipe whose driver is ``driver``."""
    return [opt for opt in _owned.get(driver, []) if not opt.closed]


def close_all(pipe: Pipe) -> None:
    """Close every optimizer built on ``pipe``; call it before the pipe's driver closes."""
    driver = getattr(pipe, "_driver", None)  # (none when the pipe's construction failed)
    for optimizer in _owned.pop(driver, []) if driver is not None else []:
        optimizer.close()


class PipeOptimizer:
    """One ``torch.optim`` optimizer per stage, over that stage's parameters, on the stage's worker.

    A Parameter that two stages of one worker share belongs to the lower stage's optimizer only, so it
    is stepped once. A captured model's tied parameter has a copy on each stage that uses it, each in
    its stage's optimizer; their gradients are summed before a step, so the copies and their states
    stay equal: :meth:`state_dict` saves the first holder's, :meth:`load_state_dict` loads it into all.

    Every call is a control call to all stages at once, under the pipe's ``rpc_timeout``; a stage that
    fails raises a :class:`~rrefpipe.StageError` naming the stage and worker.
    """

    def __init__(self, pipe: Pipe, cls: type[torch.optim.Optimizer], /, **kwargs: Any) -> None:
        self._driver_ref = weakref.ref(pipe._driver)
        self._remote = isinstance(pipe._driver, RemoteDriver)
        self._pipe_id = pipe._driver.pipe_id if isinstance(pipe._driver, RemoteDriver) else _IN_PROCESS
        self._id = next(_ids)
        self._closed = False
        self._stages = list(range(len(pipe._driver.infos)))
        self.schedulers: dict[int, bytes] = {}  # the schedulers built on it, by id: their factories (for a rebuild)
        try:
            payload = cloudpickle.dumps((cls, kwargs))
        except Exception as exc:
            raise TypeError(f"the optimizer class and its arguments cannot be sent to the stage workers: they do not "
                            f"pickle ({type(exc).__name__}: {exc})") from exc
        try:
            built = self._each(stage_optim.build_optimizer, {j: (payload, *self._in_process(pipe, j))
                                                               for j in self._stages}, by_value=False)
        except BaseException:
            self._free()  # nothing is left half-built
            raise
        self.payload = payload  # the class and its arguments, as the workers build it (a rebuild builds it again)
        self._names: list[list[list[str]]] = []  # per stage, per group: the parameters' names in pipe.state_dict()
        self._shapes: dict[str, list[int]] = {}
        for j, (groups, shapes) in built.items():
            named = [[_pipe_name(pipe._captured, j, name) for name in group] for group in groups]
            self._names.append(named)
            self._shapes.update(zip((name for group in named for name in group), shapes))

    def _in_process(self, pipe: Pipe, j: int) -> tuple[Any, ...]:
        """For a pipe in this process, stage ``j``'s parameters (a worker finds its own)."""
        if self._remote:
            return ()
        stages = [stage.module for stage in pipe._driver.stages]  # type: ignore[union-attr]
        return (stage_optim.owned_parameters(stages[j], stages[:j]),)

    # -- calls ------------------------------------------------------------------------------------------
    def _driver(self) -> Driver:
        if self._closed:
            raise RuntimeError("this PipeOptimizer is closed (by close(), or by its pipe's): build a new one with "
                               "pipe.optimizer(cls, **kwargs)")
        driver = self._driver_ref()
        if driver is None or driver.closed:
            raise RuntimeError("the Pipe of this PipeOptimizer is closed: its stages, and their optimizers, are gone")
        return driver

    def _each(self, fn: Any, args: dict[int, tuple[Any, ...]], by_value: bool = True) -> dict[int, Any]:
        """``fn(pipe_id, j, opt_id, *args[j])`` on each stage j, all at once; the results by stage. In this
        process, arguments and results are copies (``by_value``), as they are over RPC."""
        driver = self._driver()
        if isinstance(driver, RemoteDriver):
            return driver._call_each(fn, {j: (self._id, *more) for j, more in args.items()})
        copied = copy.deepcopy if by_value else (lambda value: value)
        return {j: copied(_raised_if_failed(j, control.reporting(fn, self._pipe_id, j, self._id, *copied(more))))
                for j, more in args.items()}

    def _all(self, fn: Any, *args: Any) -> list[Any]:
        return list(self._each(fn, {j: args for j in self._stages}).values())

    def _free(self) -> None:
        """Drop the stages' optimizers; a dead worker, or a closed pipe, holds none any more."""
        with contextlib.suppress(Exception):
            self._each(stage_optim.close_optimizer, {j: () for j in self._stages})

    # -- torch.optim's API ----------------------------------------------------------------------------
    def step(self, context_id: int) -> None:
        """Step every stage with its gradients in the ``dist_autograd`` context, as ``DistributedOptimizer``
        does: ``.grad`` of each parameter becomes its gradient there (None where it has none), the
        optimizer steps, and the ``.grad`` are dropped."""
        if not _rpc.context_exists(context_id):
            raise RuntimeError(f"no dist_autograd context {context_id!r} in this process: call step inside the "
                               "`with dist_autograd.context() as context_id:` block, after backward")
        peers = getattr(self._driver(), "peers", None)  # spares with replicas (driver_side.replica_spares)
        try:
            self._all(stage_optim.step, context_id)
        except Exception as exc:
            if peers is not None:
                peers.recover(exc, updating=True)
            raise
        if peers is not None:
            peers.applied()

    def zero_grad(self) -> None:
        """Drop the parameters' ``.grad`` on the workers (``set_to_none``: the gradients :meth:`step` uses
        live in the autograd contexts, so there is nothing to zero)."""
        self._all(stage_optim.zero_grad)

    @property
    def param_groups(self) -> list[ParamGroup]:
        """One :class:`ParamGroup` per group per stage, in stage order (a stage without parameters of its
        own has one, empty); ``for g in opt.param_groups: g["lr"] *= 0.1`` works. What they read is a
        snapshot, taken now: read ``param_groups`` again to see what a scheduler or code on the workers
        changed since."""
        snapshots = self._all(stage_optim.hyperparameters)
        return [ParamGroup(self, j, g, {**settings, "names": list(self._names[j][g])})
                for j, groups in zip(self._stages, snapshots) for g, settings in enumerate(groups)]

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer format keyed by the names ``pipe.state_dict()`` gives the parameters:
        ``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``, one group per group per
        stage, CPU tensors. A parameter with copies on several stages (tied) is saved from the first."""
        saved: dict[str, Any] = {"state": {}, "param_groups": []}
        seen: set[str] = set()
        for j, stage in zip(self._stages, self._all(stage_optim.state)):
            names = [name for group in self._names[j] for name in group]  # the index torch's state_dict gives each
            for group in stage["param_groups"]:
                kept = [k for k in group["params"] if names[k] not in seen]
                seen.update(names[k] for k in kept)
                saved["state"].update((names[k], stage["state"][k]) for k in kept if k in stage["state"])
                saved["param_groups"].append({**{key: v for key, v in group.items() if key != "params"},
                                              "params": [names[k] for k in kept]})
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, into an optimizer of the same class over the same model
        and stages; each copy of a tied parameter gets the state saved for it. Checked before anything
        is loaded, the first misfit raising ``ValueError``: the groups and their names, and the shape of
        every state tensor with as many dimensions as its parameter (a step count is not told apart)."""
        groups, state = self._checked(state_dict)
        per_stage: dict[int, tuple[Any, ...]] = {}
        k = 0
        for j in self._stages:
            names = [name for group in self._names[j] for name in group]
            indices = iter(range(len(names)))
            stage_groups = []
            for group in self._names[j]:
                stage_groups.append({**{key: v for key, v in groups[k].items() if key != "params"},
                                     "params": [next(indices) for _ in group]})
                k += 1
            per_stage[j] = ({"state": {i: state[name] for i, name in enumerate(names) if name in state},
                             "param_groups": stage_groups},)
        self._each(stage_optim.load_state, per_stage)

    def _checked(self, state_dict: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The saved groups and state, after checking that they fit: the first misfit raises."""
        if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)
                and isinstance(state_dict.get("param_groups"), list)):
            raise ValueError("expected what PipeOptimizer.state_dict() saves: a dict of 'state' (a dict) and "
                             "'param_groups' (a list)")
        groups, state = state_dict["param_groups"], state_dict["state"]
        expected = [group["params"] for group in self._layout()]
        if len(groups) != len(expected):
            raise ValueError(f"the state has {len(groups)} parameter groups, this optimizer {len(expected)} (one per "
                             "group per stage): save and load over the same stages")
        for k, (names, group) in enumerate(zip(expected, groups)):
            saved = list(group.get("params", ())) if isinstance(group, dict) else None
            if saved != names:
                first = next((i for i, (a, b) in enumerate(zip(saved or [], names)) if a != b),
                             min(len(saved or []), len(names)))
                theirs = saved[first] if saved is not None and first < len(saved) else None
                ours = names[first] if first < len(names) else None
                raise ValueError(f"parameter group {k} of the state holds {theirs!r} where this optimizer's holds "
                                 f"{ours!r} (position {first}): save and load over the same model and stages")
        for name, entry in state.items():
            shape = self._shapes.get(name)
            if shape is None:
                raise ValueError(f"the state has an entry for {name!r}, which is no parameter of this optimizer")
            for key, value in entry.items():
                if isinstance(value, Tensor) and not _fits(value, shape):
                    raise ValueError(f"the state's {key!r} of {name!r} has shape {list(value.shape)}, the parameter "
                                     f"{shape}")
        return groups, state

    def _layout(self) -> list[dict[str, list[str]]]:
        """The groups :meth:`state_dict` saves, with only their names: a tied copy under its first holder."""
        seen: set[str] = set()
        layout = []
        for j in self._stages:
            for group in self._names[j]:
                kept = [name for name in group if name not in seen]
                seen.update(kept)
                layout.append({"params": kept})
        return layout

    # -- schedulers and life cycle ------------------------------------------------------------------------
    def add_scheduler(self, factory: bytes) -> StageSchedulers:
        """A scheduler built on every stage's optimizer (``RemoteLRScheduler(pipe_optimizer, ...)``)."""
        return StageSchedulers(self, factory)

    @property
    def id(self) -> int:
        """Its id on the workers, with the pipe's: ``stage_optim.optimizer(pipe_id, id, j)``."""
        return self._id

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Drop the stages' optimizers from their workers; every call raises from now on. Closing the pipe
        closes it too."""
        if self._closed:
            return
        self._free()
        self._closed = True
        driver = self._driver_ref()
        owned = _owned.get(driver, []) if driver is not None else []
        if self in owned:
            owned.remove(self)

    def __enter__(self) -> PipeOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._stages)} stages"
        return f"PipeOptimizer({state})"


class ParamGroup(MutableMapping[str, Any]):
    """One parameter group of one stage's optimizer: its settings as read when ``opt.param_groups`` was,
    with ``"names"`` (the parameters' names in ``pipe.state_dict()``) in place of ``"params"``. Setting a
    key sets it on the worker at once (a control call); reading never asks the worker again."""

    def __init__(self, owner: PipeOptimizer, stage: int, group: int, snapshot: dict[str, Any]) -> None:
        self.stage, self.group = stage, group
        self._owner = owner
        self._snapshot = snapshot

    def __getitem__(self, key: str) -> Any:
        return self._snapshot[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in ("names", "params"):
            raise KeyError(f"{key!r} cannot be set: a stage's optimizer keeps the parameters it was built with")
        self._owner._each(stage_optim.set_hyperparameter, {self.stage: (self.group, key, value)})
        self._snapshot[key] = value

    def __delitem__(self, key: str) -> None:
        raise KeyError(f"a parameter group's {key!r} cannot be deleted")

    def __iter__(self) -> Iterator[str]:
        return iter(self._snapshot)

    def __len__(self) -> int:
        return len(self._snapshot)

    def __repr__(self) -> str:
        return f"ParamGroup(stage={self.stage}, group={self.group}, {self._snapshot!r})"


class StageSchedulers:
    """A learning-rate scheduler on every stage's optimizer, built from a cloudpickled ``(scheduler, args,
    kwargs)``; what :class:`rrefpipe.optim.RemoteLRScheduler` holds for a :class:`PipeOptimizer`. Code on
    the workers finds them with ``stage_optim.schedulers`` or, by its ``id``, ``stage_optim.scheduler``."""

    def __init__(self, owner: PipeOptimizer, factory: bytes) -> None:
        self._owner = owner
        self._id = next(_ids)
        try:
            built = owner._each(stage_optim.add_scheduler, {j: (self._id, factory) for j in owner._stages})
        except BaseException:
            self.close()  # nothing is left half-built
            raise
        self.on_metric = any(built.values())
        owner.schedulers[self._id] = factory

    def __len__(self) -> int:
        return len(self._owner._stages)

    @property
    def id(self) -> int:
        """The scheduler's key on the workers (``stage_optim.scheduler``)."""
        return self._id

    @property
    def owner(self) -> PipeOptimizer:
        return self._owner

    def call(self, method: str, per_stage: list[tuple[Any, ...]] | None = None) -> list[Any]:
        """``scheduler.method(*per_stage[j])`` on every stage j (no arguments without ``per_stage``)."""
        stages = self._owner._stages
        args = {j: (self._id, method, *(per_stage[k] if per_stage else ())) for k, j in enumerate(stages)}
        return list(self._owner._each(stage_optim.call_scheduler, args).values())

    def close(self) -> None:
        self._owner.schedulers.pop(self._id, None)
        with contextlib.suppress(Exception):
            self._owner._each(stage_optim.drop_scheduler, {j: (self._id,) for j in self._owner._stages})


def _pipe_name(captured: CapturedPipeModel | None, j: int, name: str) -> str:
    """Stage ``j``'s parameter ``name`` as ``pipe.state_dict()`` names it: the same for an ``nn.Sequential``
    cut into stages; a captured model's stage names it ``'<j>.graph.<name in the graph>'``, and
    ``pipe.state_dict()`` by the model's first key for it (``CapturedPipeModel.model_state``)."""
    if captured is None:
        return name
    keys = captured.state_keys[j].get(name.removeprefix(f"{j}.graph."), ())
    return keys[0] if keys else name


def _fits(value: Tensor, shape: list[int]) -> bool:
    """Whether a state tensor can belong to a parameter of ``shape``: one with as many dimensions as the
    parameter matches it in each (or is 1 there: a factored moment); others (a step count) are not told."""
    return value.dim() != len(shape) or all(a in (b, 1) for a, b in zip(value.shape, shape))
