"""Which stage stashes and which pops each skip tensor, and a stage's router for one micro-batch (pure)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from .tracker import SkipKey

__all__ = ["SkipRoutes", "route", "StageRouter"]


@dataclass(frozen=True)
class SkipRoutes:
    """For one stage: where each skip it stashes goes, and which skips it must receive."""

    outgoing: dict[SkipKey, int]  # stashed here, popped by that later stage
    incoming: frozenset[SkipKey]  # popped here, stashed by an earlier stage


def route(stage_skips: Sequence[tuple[Sequence[SkipKey], Sequence[SkipKey]]]) -> list[SkipRoutes]:
    """Routes for every stage from each stage's (stashed keys, popped keys)."""
    stashed_at = {key: j for j, (stashes, _) in enumerate(stage_skips) for key in stashes}
    popped_at = {key: j for j, (_, pops) in enumerate(stage_skips) for key in pops}
    routes = []
    for j in range(len(stage_skips)):
        outgoing = {key: popped_at[key] for key, at in stashed_at.items() if at == j and popped_at.get(key, j) > j}
        incoming = frozenset(key for key, at in popped_at.items() if at == j and stashed_at.get(key, j) < j)
        routes.append(SkipRoutes(outgoing, incoming))
    return routes


class StageRouter:
    """The skip tracker of one stage for one micro-batch.

    Stashes popped later in the same stage stay here until their pop, so blocks that keep one name inside
    themselves (never routed) stash and pop it in turn; stashes for later stages are collected to be sent
    straight to them; pops of earlier stages' skips are answered from what was received. When
    checkpointing recomputes the stage, pops return the same received tensors and outgoing stashes are
    not collected again (they were sent in the first forward).
    """

    def __init__(self, routes: SkipRoutes, received: dict[SkipKey, Tensor | None], recomputing: bool) -> None:
        self.routes = routes
        self.received = received
        self.recomputing = recomputing
        self.local: dict[SkipKey, Tensor | None] = {}
        self.outgoing: dict[SkipKey, Tensor | None] = {}

    def save(self, key: SkipKey, tensor: Tensor | None) -> None:
        if key in self.routes.outgoing:
            if not self.recomputing:
                self.outgoing[key] = tensor
        else:
            self.local[key] = tensor

    def load(self, key: SkipKey) -> Tensor | None:
        if key in self.local:
            return self.local.pop(key)
        if key in self.received:
            return self.received[key]
        raise KeyError(f"skip {key[1]!r} ({key[0]}) is not available on this stage: popped before it was stashed, "
                       "or stashed by a stage this pipe does not know")
