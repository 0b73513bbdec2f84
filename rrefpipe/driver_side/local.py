"""In-process execution, for the PyTorch-1.8 way: ``init_rpc`` with world size 1, modules placed on devices.

Stages run in this process in GPipe clock-cycle order; plain autograd applies, so ``loss.backward()``
works on the output, and so does ``dist_autograd.backward`` inside a context.
"""
from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
from torch import Tensor, nn

from .. import _rpc, microbatch
from ..stage_side import gradients
from ..loss import checked_loss, mean_loss, split_target, weights
from ..microbatch import TensorOrTensors
from .output import PipeRRef
from ..schedule import checkpoint_stop, clock_cycles
from ..skip.layout import route
from ..skip.tracker import SkipKey
from ..stage_side.stage import Stage, StageInfo, StepMeta
from ..trace import Event

__all__ = ["InProcessWarning", "warn_in_process"]


class InProcessWarning(UserWarning):
    """A Pipe runs its stages in the driver's process: RPC was initialised with world size 1.

    Code ported from ``torch.distributed.pipeline.sync`` keeps its ``init_rpc(..., world_size=1)`` and
    runs, but on no stage worker. Silence it where that is what you want::

        warnings.filterwarnings("ignore", category=rrefpipe.InProcessWarning)
    """


_warned_in_process = False


def warn_in_process(stages: int) -> None:
    """Say once per process that a pipe's stages run here, and how to get stage workers instead."""
    global _warned_in_process
    if _warned_in_process:
        return
    _warned_in_process = True
    warnings.warn(f"RPC is initialised with world size 1, so this Pipe runs its {stages} stage(s) in this process, "
                  "one after another, as PyTorch's Pipe did: no stage workers. For stage workers, leave out "
                  "rpc.init_rpc (rrefpipe then starts local ones), or start them (python -m workers, torchrun) "
                  "and init_rpc with their world size; see the porting guide. (This warning comes once; "
                  "silence it with warnings.filterwarnings('ignore', category=rrefpipe.InProcessWarning).)",
                  InProcessWarning, stacklevel=3)


class LocalDriver:
    """Runs every stage in the calling process."""

    def __init__(self, modules: Sequence[nn.Sequential], devices: Sequence[torch.device], *, chunks: int,
                 checkpoint: str) -> None:
        name = _rpc.self_name()
        self.stages = [Stage(j, module, device, name) for j, (module, device) in enumerate(zip(modules, devices))]
        infos = [stage.info() for stage in self.stages]
        for stage, routes in zip(self.stages, route([(info.stashes, info.pops) for info in infos])):
            stage.routes = routes
        self.chunks = chunks
        self.checkpoint = checkpoint
        self._steps = itertools.count()
        self.closed = False

    def close(self) -> None:
        """The layers stay the pipe's (its state dict still reads them); forwards are refused, as on
        workers, so code written for one world behaves the same in the other."""
        self.closed = True

    @property
    def infos(self) -> list[StageInfo]:
        return [stage.info() for stage in self.stages]

    def _gradients(self, context_id: int) -> list[Tensor]:
        return [g for stage in self.stages for g in gradients.context_gradients(stage.module, context_id)]

    def gradient_norms(self, context_id: int, norm_type: float) -> list[Tensor | None]:
        return [gradients.gradient_norm(self._gradients(context_id), norm_type)]

    def scale_gradients(self, context_id: int, factor: float) -> None:
        gradients.scale(self._gradients(context_id), factor)

    def unscale_gradients(self, context_id: int, inv_scale: float) -> list[bool]:
        return [gradients.unscale(self._gradients(context_id), inv_scale)]

    def forward(self, value: TensorOrTensors, *, training: bool, spread: bool = False) -> PipeRRef:
        if self.closed:
            raise RuntimeError("this Pipe is closed; build a new Pipe")
        if not self.stages:  # an empty nn.Sequential: the input is the output, as in PyTorch's Pipe
            microbatch.check(value, "Pipe input")
            return PipeRRef(tuple(value) if isinstance(value, list) else value)
        batches = microbatch.scatter(value, self.chunks)
        m, grad = len(batches), torch.is_grad_enabled()
        meta = StepMeta(step=next(self._steps), chunks=m,
                        checkpoint_stop=checkpoint_stop(self.checkpoint, m, enabled=training and grad),
                        grad_enabled=grad, driver=_rpc.self_name(), timeout=0.0, spread=spread)
        values: list[TensorOrTensors] = list(batches)
        skips: list[dict[SkipKey, Tensor | None]] = [{} for _ in range(m)]
        for tick in clock_cycles(m, len(self.stages)):
            for i, j in tick:
                stage = self.stages[j]
                received = {key: skips[i].pop(key) for key in stage.routes.incoming}
                out = stage.run(meta, i, values[i], (), received)
                values[i] = out.value
                skips[i].update(out.skips)
        return PipeRRef(microbatch.gather(values))

    def train_step(self, context_id: int, value: TensorOrTensors, target: TensorOrTensors, loss_fn: Any, *,
                   training: bool, spread: bool, loss_scale: float) -> Tensor:
        """In this process the stages run GPipe's order whatever the schedule: every forward, then one
        backward of the micro-batch losses' row-weighted mean."""
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")
        rows = split_target(value, target, self.chunks)
        output = self.forward(value, training=training, spread=spread).local_value()
        outputs = microbatch.scatter(output, len(rows))
        targets = microbatch.scatter(target, len(rows), "train_step target")
        losses = [checked_loss(loss_fn(out, t)) for out, t in zip(outputs, targets)]
        total = torch.stack([w * loss for w, loss in zip(weights(rows), losses)]).sum()
        dist_autograd.backward(context_id, [total * loss_scale])
        return mean_loss(torch.stack([loss.detach() for loss in losses]), rows)

    def events(self, clear: bool) -> list[Event]:
        return [e for stage in self.stages for e in stage.recorder.snapshot(clear)]
