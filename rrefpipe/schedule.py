"""Pure scheduling facts: which micro-batches are checkpointed, and the GPipe clock cycles."""
from __future__ import annotations

from collections.abc import Iterator

__all__ = ["CHECKPOINT_MODES", "checkpoint_stop", "clock_cycles", "ideal_efficiency"]

CHECKPOINT_MODES = ("always", "except_last", "never")


def checkpoint_stop(mode: str, chunks: int, *, enabled: bool = True) -> int:
    """Micro-batches ``i < checkpoint_stop`` are checkpointed (recomputed in backward).

    ``enabled`` is false in eval mode or without autograd: nothing is then checkpointed.
    """
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {mode!r}")
    if not enabled:
        return 0
    return {"always": chunks, "except_last": chunks - 1, "never": 0}[mode]


def clock_cycles(m: int, n: int) -> Iterator[list[tuple[int, int]]]:
    """Yield, per clock tick, the (micro-batch i, partition j) pairs that may run together (i + j = k)."""
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]


def ideal_efficiency(m: int, n: int) -> float:
    """GPipe's bubble model: the fraction of time each of n stages is busy with m micro-batches."""
    return m / (m + n - 1)
