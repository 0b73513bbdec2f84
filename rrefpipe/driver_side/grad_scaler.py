"""Loss scaling across stages: ``torch.amp.GradScaler`` for gradients in a ``dist_autograd`` context.

Under float16 autocast, small gradients underflow to zero. A scaler multiplies the loss by a large
factor before backward, divides the gradients by it before the optimizer steps, skips a step whose
gradients overflowed and lowers the factor (raising it again after a run of good steps). torch's
``GradScaler`` does that to the ``.grad`` of a local optimizer's parameters; behind a pipe the
gradients live in a distributed autograd context on the stage workers, and ``DistributedOptimizer``
steps them there. So each stage unscales its own gradients in the context, in place, on its worker
and says whether it found an inf or a nan; the driver skips the step on every worker when any stage
did, so that the stages never step apart. The scale stays on the driver, where the loss is. The
arithmetic (a float32 scale, torch's own update op) and the ``state_dict`` are torch's. The stages'
part, ``unscale``, is in :mod:`rrefpipe.stage_side.gradients`: stage workers import it without the ``Pipe``.
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

from .. import _rpc
from ..pipe import Pipe

if TYPE_CHECKING:
    from torch.distributed.optim import DistributedOptimizer  # 0.7 s of imports (FSDP, DTensor, sympy)

__all__ = ["GradScaler"]

Outputs = TypeVar("Outputs", Tensor, list[Tensor], tuple[Tensor, ...])


class GradScaler:
    """``torch.amp.GradScaler`` for a pipe's stages and a ``DistributedOptimizer`` over them::

        scaler = rrefpipe.GradScaler(pipe)
        with dist_autograd.context() as ctx:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(pipe(x).local_value(), y)
            pipe.backward(ctx, scaler.scale(loss))
            scaler.unscale_(ctx)                    # only to clip: pipe.clip_grad_norm_(ctx, 1.0)
            scaler.step(opt, ctx)                   # opt.step(ctx), unless a gradient overflowed
            scaler.update()

    Arguments and defaults as torch's; ``step`` and ``unscale_`` take the context (where ``opt.step``
    does). What it unscales and checks is the gradients of this pipe's stages: an optimizer that also
    holds other parameters (a second pipe's, the driver's) would step theirs scaled. And one overflow
    skips every optimizer stepped in that context, where torch skips only the optimizer that holds it.
    """

    def __init__(self, pipe: Pipe, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True) -> None:
        if not isinstance(pipe, Pipe):
            raise TypeError(f"GradScaler scales the gradients of a rrefpipe.Pipe's stages, got {type(pipe).__name__}")
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}")
        self._pipe = pipe
        self._enabled = enabled
        self._scale = torch.full((1,), float(init_scale), dtype=torch.float32)
        self._growth_tracker = torch.zeros(1, dtype=torch.int32)
        self.set_growth_factor(growth_factor)
        self.set_backoff_factor(backoff_factor)
        self.set_growth_interval(growth_interval)
        self._found_inf: dict[int, bool] = {}  # the contexts unscaled since the last update()
        self._stepped: set[int] = set()  # id() of the optimizers stepped since then
        self._stepped_contexts: set[int] = set()  # unscale_() after step() is refused, as in torch

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        """The scale the next ``scale()`` multiplies by (1.0 when disabled)."""
        return float(self._scale.item()) if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """What ``update()`` multiplies the scale by after ``growth_interval`` good steps in a row."""
        if not new_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {new_factor}")
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """What ``update()`` multiplies the scale by after a step that overflowed."""
        if not 0.0 < new_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {new_factor}")
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """How many good steps in a row make ``update()`` grow the scale."""
        try:
            interval = operator.index(new_interval)
        except TypeError:
            raise TypeError(f"growth_interval must be an int, got {new_interval!r}") from None
        if interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {interval}")
        self._growth_interval = interval

    def scale(self, outputs: Outputs) -> Outputs:
        """The loss (or a list or tuple of losses) times the scale, to pass to backward."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            return outputs * self._scale.to(outputs.device).reshape(())
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"scale() takes a tensor, or a list or tuple of them, got {type(outputs).__name__}")

    def unscale_(self, context_id: int) -> None:
        """Divide every stage's gradients in ``context_id`` by the scale, in place (before clipping them)."""
        if not self._enabled:
            return
        if context_id in self._stepped_contexts:
            raise RuntimeError(f"unscale_() is being called after step() on context {context_id}")
        if context_id in self._found_inf:
            raise RuntimeError(f"unscale_() has already been called on context {context_id} since the last update()")
        if not _rpc.context_exists(context_id):
            raise RuntimeError(f"no dist_autograd context {context_id!r} in this process: unscale inside the "
                               "`with dist_autograd.context() as context_id:` block, after backward")
        inv_scale = float(self._scale.double().reciprocal().float())  # rounded as torch rounds it
        # Counted as overflowed until every stage has answered: a stage failing part-way leaves the
        # gradients half unscaled, and step() must not step them.
        self._found_inf[context_id] = True
        self._found_inf[context_id] = any(self._pipe._driver.unscale_gradients(context_id, inv_scale))

    def step(self, optimizer: DistributedOptimizer, context_id: int) -> None:
        """``optimizer.step(context_id)`` with the unscaled gradients, or nothing on any worker when a
        stage's gradients held an inf or a nan (``update()`` then lowers the scale), or when unscaling
        them failed part-way (``unscale_`` raised)."""
        from torch.distributed.optim import DistributedOptimizer  # imported by the caller, who built one

        if not isinstance(optimizer, DistributedOptimizer):
            raise TypeError(f"expected a torch.distributed.optim.DistributedOptimizer, got {type(optimizer).__name__} "
                            "(in a world of one, with a local optimizer and loss.backward(), use torch.amp.GradScaler)")
        if not self._enabled:
            optimizer.step(context_id)
            return
        if id(optimizer) in self._stepped:
            raise RuntimeError("step() has already been called on this optimizer since the last update()")
        if context_id not in self._found_inf:
            self.unscale_(context_id)
        if not self._found_inf[context_id]:
            optimizer.step(context_id)
        self._stepped.add(id(optimizer))  # after the step: one that failed may be tried again
        self._stepped_contexts.add(context_id)

    def update(self, new_scale: float | None = None) -> None:
        """After ``step``: lower the scale if a step was skipped, raise it after ``growth_interval`` good
        steps in a row (or set it to ``new_scale``)."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale.fill_(float(new_scale))
        elif not self._found_inf:
            raise RuntimeError("no inf checks were recorded before update(): call step(optimizer, context_id) first")
        else:
            found_inf = torch.tensor([float(any(self._found_inf.values()))], dtype=torch.float32)
            torch._amp_update_scale_(self._scale, self._growth_tracker, found_inf, self._growth_factor,
                                     self._backoff_factor, self._growth_interval)
        self._found_inf.clear()
        self._stepped.clear()
        self._stepped_contexts.clear()

    def state_dict(self) -> dict[str, Any]:
        """torch's keys: a checkpoint of ``torch.amp.GradScaler`` loads here, and this one there."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": int(self._growth_tracker.item())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("the state dict is empty: was it saved from a disabled GradScaler?")
        self._scale.fill_(float(state_dict["scale"]))
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker.fill_(int(state_dict["_growth_tracker"]))
