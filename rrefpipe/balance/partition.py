"""The optimal contiguous split of per-layer costs into stages: minimise the costliest stage (pure)."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["check_partitions", "solve", "stage_costs"]


def check_partitions(partitions: object, num_layers: int) -> int:
    """``partitions`` is a positive int no larger than the number of layers (every stage gets one)."""
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions <= 0:
        raise ValueError(f"partitions must be a positive int, got {partitions!r}")
    if partitions > num_layers:
        raise ValueError(f"cannot balance {num_layers} layers over {partitions} partitions: more partitions than "
                         f"layers (every stage needs at least one layer); use at most {num_layers}")
    return partitions


def stage_costs(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """The cost of each stage: the sum of its layers' costs."""
    out, start = [], 0
    for count in balance:
        out.append(float(sum(costs[start:start + count])))
        start += count
    return out


def solve(costs: Sequence[float], partitions: int) -> list[int]:
    """Layer counts per stage that minimise the largest stage cost, every stage non-empty. Exact.

    Two dynamic programmes over prefixes, with ``P[i]`` the sum of the first ``i`` costs and ``c(s, i) =
    P[i] - P[s]`` the cost of a stage of layers ``s..i-1``:

    1. ``best[k][i]``, the least achievable maximum when the first ``i`` layers form ``k`` stages::

           best[1][i] = P[i]
           best[k][i] = min over k-1 <= s < i of  max(best[k-1][s], c(s, i))

       Every split of ``i`` layers into ``k`` stages is a last stage ``s..i-1`` after a split of the first
       ``s`` layers into ``k - 1``, and its maximum is the larger of the two parts' maxima; so the
       recurrence ranges over all splits and ``T = best[partitions][n]`` is the optimum.
    2. Among the splits whose stages all cost at most ``T`` (the optimal ones), the most even: least sum of
       squared stage costs, by the same decomposition (a sum decomposes like a maximum). Ties (up to
       rounding) go to the latest start of the last stage, so equal costs give ``uniform_balance``'s split.

    Step 2 allows ``T`` a slack of 1e-12 of the total cost, for rounding (sums of equal costs such as 0.3
    round differently along different splits), and costs are first scaled below 1, by a power of two. Time
    O(partitions * n^2), the inner minimum vectorised: instantaneous for models of hundreds of layers.
    """
    n = len(costs)
    check_partitions(partitions, n)
    values = [float(c) for c in costs]
    bad = [c for c in values if not math.isfinite(c) or c < 0]
    if bad:
        raise ValueError(f"layer costs must be finite and non-negative, got {bad[:5]}")
    top = max(values)
    if top > 0:  # scaled below 1 by a power of two, which is exact (ties stay ties): sums and squares of
        # costs near the float maximum (1e308) would overflow to inf and nan
        exponent = math.frexp(top)[1]
        values = [math.ldexp(c, -exponent) for c in values]
    else:  # every split is optimal and as even as any other: split as for equal costs
        values = [1.0] * n
    prefix = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
    limit = _least_maximum(prefix, partitions)
    return _most_even(prefix, partitions, limit)


def _least_maximum(prefix: np.ndarray, partitions: int) -> float:
    n = len(prefix) - 1
    best = prefix.copy()  # k = 1: one stage holds the first i layers
    for k in range(2, partitions + 1):
        nxt = np.full(n + 1, np.inf)
        for i in range(k, n + 1):
            starts = np.arange(k - 1, i)  # where the last stage may start
            nxt[i] = np.min(np.maximum(best[k - 1:i], prefix[i] - prefix[starts]))
        best = nxt
    return float(best[n])


def _most_even(prefix: np.ndarray, partitions: int, limit: float) -> list[int]:
    n = len(prefix) - 1
    limit += 1e-12 * prefix[n]  # a stage cost is a difference of rounded sums: 0.3 + 0.3 > 0.9 - 0.3
    squares = np.where(prefix <= limit, prefix ** 2, np.inf)  # k = 1
    cuts = np.zeros((partitions + 1, n + 1), dtype=np.int64)
    for k in range(2, partitions + 1):
        nxt = np.full(n + 1, np.inf)
        for i in range(k, n + 1):
            starts = np.arange(k - 1, i)
            last_cost = prefix[i] - prefix[starts]
            candidates = np.where(last_cost <= limit, squares[k - 1:i] + last_cost ** 2, np.inf)
            # the latest start within rounding of the least: sums of equal costs such as 0.3 round
            pick = int(np.flatnonzero(candidates <= candidates.min() * (1 + 1e-12))[-1])
            nxt[i], cuts[k, i] = candidates[pick], starts[pick]
        squares = nxt
    if not math.isfinite(float(squares[n])):
        raise AssertionError(f"no split within the optimum {limit}: a bug in the partition solver")
    balance: list[int] = []
    i = n
    for k in range(partitions, 1, -1):
        start = int(cuts[k, i])
        balance.append(i - start)
        i = start
    balance.append(i)
    return balance[::-1]
