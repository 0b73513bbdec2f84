"""Weight versions of one stage in a continuous pipeline (PipeDream, PipeDream-2BW, PipeMare).

A stage's ``nn.Parameter`` objects always hold the newest weights (the optimizer steps them and keys
its state by them). A batch runs through ``torch.func.functional_call`` on *leaves*: tensors that
alias the storage of the version it must use, each with a version counter and ``.grad`` of its own,
so that the batch's micro-batches sum their gradients there whatever the optimizer does meanwhile.

An update replaces the live storage by a copy before stepping (copy-on-write): the old storage then
lives exactly as long as something references it (a batch still in flight, a later batch's forward,
the stream's undo record), and nothing is ever copied back. The copy costs about 1.3 ms per 12 MiB of
weights, once per update.

PipeMare keeps no versions: its leaves alias the live storage, which the optimizer steps in place, so
a backward reads the weights current when it runs (autograd saved the alias, whose version counter
the step does not touch); its undo record is a copy.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["StageWeights"]


class StageWeights:
    """The live weights of a stage's module, the older versions later forwards need, and the updates.

    ``stash=False`` (PipeMare): every batch uses the live storage, updated in place."""

    def __init__(self, module: nn.Module, *, stash: bool = True) -> None:
        self.params = dict(module.named_parameters())  # tied names collapse to one (functional_call ties them)
        self.stash = stash
        self.updates = 0  # W(updates) is live
        self.kept: dict[int, dict[str, Tensor]] = {}  # older versions a later forward needs

    def leaves(self, version: int) -> dict[str, Tensor]:
        """Fresh leaves aliasing ``version`` (the live weights, or a kept one) for one batch's forwards
        and backwards on this stage; their ``.grad`` sums the batch's gradients."""
        if not self.stash or version == self.updates:
            source = {name: p.data for name, p in self.params.items()}
        elif version in self.kept:
            source = self.kept[version]
        else:
            raise RuntimeError(f"weight version {version} is gone (live: {self.updates}, kept: {sorted(self.kept)})")
        return {name: t.detach().requires_grad_(True) for name, t in source.items()}

    def update(self, leaves: dict[str, Tensor], step: Callable[[], None], *, keep: bool, record: bool = True
               ) -> dict[str, Tensor]:
        """Apply one update: the gradients summed in ``leaves`` become the parameters' ``.grad`` and
        ``step()`` (the stage's optimizer step) runs on the live weights. ``keep``: a later forward needs
        the weights as they were before it, so they stay available as version ``updates``.

        Returns those weights, untouched by the step (for an undo record); without ``record``, under
        PipeMare (which would have to copy them), nothing."""
        before = {name: p.data for name, p in self.params.items()}
        if self.stash:
            if keep:
                self.kept[self.updates] = before
            for p in self.params.values():
                p.data = p.data.clone()  # the old storage stays with those who read it, and as the record
        else:
            before = {name: t.clone() for name, t in before.items()} if record else {}  # (steps in place)
        for name, p in self.params.items():
            p.grad = leaves[name].grad
        try:
            step()
        finally:
            for p in self.params.values():
                p.grad = None
        self.updates += 1
        return before

    def forget_below(self, version: int) -> None:
        """No later forward needs a version older than ``version``: drop those kept."""
        self.kept = {v: w for v, w in self.kept.items() if v >= version}

    def buffers(self) -> int:
        """Distinct weight storages this stage holds itself (the live one and each kept version); batches
        in flight may keep older ones alive until their backward."""
        return 1 + len(self.kept)

    @torch.no_grad()
    def weights(self, version: int) -> dict[str, Tensor]:
        """The weights of ``version`` (live or kept), as they are: for tests and checks."""
        if version == self.updates:
            return {name: p.detach() for name, p in self.params.items()}
        return dict(self.kept[version])
