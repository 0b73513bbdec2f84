"""PyTorch's ``blockpartition.solve``: a sequence of costs cut into contiguous blocks, the blocks themselves.

Tests and tools written for ``torch.distributed.pipeline.sync._balance.blockpartition`` import it from
here. The cut is rrefpipe's exact one (:func:`rrefpipe.balance.partition.solve`: the least largest block,
then the most even), where PyTorch's heuristic could miss the optimum.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from .partition import solve as solve_counts

__all__ = ["solve"]

T = TypeVar("T", int, float)


def solve(sequence: Sequence[T], partitions: int = 1) -> list[list[T]]:
    """Split ``sequence`` into ``partitions`` non-empty contiguous blocks with the smallest largest sum.

    ``solve([1, 2, 3, 4, 5, 6], partitions=2) == [[1, 2, 3, 4], [5, 6]]``. Layer counts per stage (a
    ``balance``) are ``[len(block) for block in solve(costs, n)]``.

    Raises:
        ValueError: ``partitions`` is not a positive integer, or exceeds the length of ``sequence``
            (PyTorch's wordings included); a cost is negative or not finite.
    """
    if isinstance(partitions, bool) or not isinstance(partitions, int):
        raise ValueError(f"partitions must be a positive integer, got {partitions!r}")
    if partitions < 1:
        raise ValueError(f"partitions must be a positive integer ({partitions} < 1)")
    items = list(sequence)
    if len(items) < partitions:
        raise ValueError(f"sequence is shorter than intended partitions ({len(items)} < {partitions})")
    blocks, start = [], 0
    for count in solve_counts(items, partitions):
        blocks.append(items[start:start + count])
        start += count
    return blocks
