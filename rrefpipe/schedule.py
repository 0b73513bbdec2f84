"""Pure scheduling facts: which micro-batches are checkpointed, GPipe's clock cycles, and each
schedule (GPipe, 1F1B, Interleaved1F1B) as data: the order in which every worker runs its actions.

The schedule is data so that it can be checked and printed without processes: ``worker_orders``
gives the orders, ``check_orders`` the invariants a runtime relies on, ``simulate`` the ticks at
which workers following those orders under the pipeline's dependencies would run each action, and
``format_orders`` a table of them::

    >>> print(format_orders(worker_orders("1F1B", stages=2, chunks=4)))
    tick      0  1  2  3  4  5  6  7  8  9
    worker 0  F0 F1 .  B0 F2 B1 F3 B2 .  B3
    worker 1  .  F0 B0 F1 B1 F2 B2 F3 B3 .

Index names as in the rest of the package: ``i`` micro-batch, ``j`` stage, ``m``/``n`` their counts.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

__all__ = ["CHECKPOINT_MODES", "checkpoint_stop", "clock_cycles", "ideal_efficiency",
           "SCHEDULES", "SPLIT_SCHEDULES", "V_SCHEDULES", "Action", "Simulation", "parse_schedule", "is_split",
           "is_v_shaped", "check_schedule", "stage_layout", "stage_worker", "worker_orders",
           "check_orders", "peak_in_flight", "simulate", "format_orders"]

CHECKPOINT_MODES = ("always", "except_last", "never")
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
             "DualPipeV")  # torch.distributed.pipelining's names
#: The schedules whose backward is split in two actions: ``I`` (the inputs' gradient) and ``W`` (the weights').
SPLIT_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
#: The schedules that place two stages on each worker in a V (see ``stage_layout``).
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


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


class Action(NamedTuple):
    """One unit of a worker's work: the forward (``kind == "F"``) or backward (``"B"``) of
    micro-batch ``i`` on stage ``j``. A tuple, so that it hashes, sorts and prints plainly."""

    kind: str
    i: int
    j: int

    def label(self, with_stage: bool = False) -> str:
        """``"F3"``; ``"5F3"`` (stage 5) where a worker holds several stages, as
        torch.distributed.pipelining prints its actions."""
        return f"{self.j if with_stage else ''}{self.kind}{self.i}"


class Simulation(NamedTuple):
    """What ``simulate`` found: each action's start tick, when the last one ends, and each worker's
    busy time (so that the bubble, the idle share of the workers' time, can be compared)."""

    starts: dict[Action, float]
    makespan: float
    busy: list[float]

    @property
    def bubble(self) -> float:
        """The fraction of the workers' time spent idle before the makespan."""
        return 1 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def parse_schedule(name: str) -> str:
    """The canonical name in ``SCHEDULES`` for ``name``, in any case ("1f1b" -> "1F1B")."""
    names = {s.lower(): s for s in SCHEDULES}
    if not isinstance(name, str) or name.lower() not in names:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)} (any case), got {name!r}")
    return names[name.lower()]


def is_split(schedule: str) -> bool:
    """Whether ``schedule`` splits backward into ``I`` (inputs' gradient) and ``W`` (weights' gradient)."""
    return parse_schedule(schedule) in SPLIT_SCHEDULES


def is_v_shaped(schedule: str) -> bool:
    """Whether ``schedule`` places its stages in a V (two per worker, see ``stage_layout``)."""
    return parse_schedule(schedule) in V_SCHEDULES


def stage_layout(schedule: str, stages: int, stages_per_worker: int = 1) -> list[int]:
    """The worker index of each stage under ``schedule``.

    The loop layout (every schedule but the V-shaped ones): stage j on worker ``j mod p``, p = n / v
    workers (Megatron's), so that a worker's stages are a full pipeline length apart and a micro-batch
    visits each worker once per round. The V layout (``ZBVZeroBubble``, ``DualPipeV``; v = 2): stage j
    on worker j for j < p and on worker ``2p - 1 - j`` after, so that worker 0 holds the first and the
    last stage and the micro-batches go down the workers and back up; a worker's two stages then need
    about as many micro-batches in flight together as any other worker's (the first stages need the
    most, the last the fewest), and the last stage's output turns into the first gradient on the worker
    that will need it last. Raises ValueError where the arguments do not fit (see ``check_schedule``).
    """
    name = parse_schedule(schedule)
    if name in V_SCHEDULES:
        _check_v(name, stages, stages_per_worker)
        p = stages // 2
        return [j if j < p else 2 * p - 1 - j for j in range(stages)]
    _check_layout(stages, stages_per_worker)
    p = stages // stages_per_worker
    return [j % p for j in range(stages)]


def stage_worker(j: int, stages: int, stages_per_worker: int = 1, schedule: str | None = None) -> int:
    """The worker of stage ``j``: ``stage_layout(schedule, stages, stages_per_worker)[j]``; without a
    V-shaped ``schedule``, ``j mod (n / v)``, Megatron's layout."""
    if schedule is not None and is_v_shaped(schedule):
        return stage_layout(schedule, stages, stages_per_worker)[j]
    return j % (stages // stages_per_worker)


def _check_v(name: str, stages: int, stages_per_worker: int) -> None:
    """A V-shaped schedule puts exactly two stages on each worker, so the stage count is even."""
    if stages_per_worker != 2:
        raise ValueError(f"{name} puts two stages on each worker in a V (worker r runs stages r and "
                         f"2p - 1 - r): use stages_per_worker=2, got {stages_per_worker}")
    if stages % 2:
        raise ValueError(f"{name} puts two stages on each worker in a V, so the stage count must be even, "
                         f"got stages={stages}: use stages={stages + 1}" + (f" or {stages - 1}" if stages > 1 else ""))


def _check_layout(stages: int, stages_per_worker: int) -> None:
    """``stages_per_worker`` must split the stages evenly over the workers."""
    v = stages_per_worker
    if v < 1 or stages % v:
        raise ValueError(f"stages_per_worker={v} must be a positive divisor of the stage count {stages}; "
                         f"divisors: {[d for d in range(1, stages + 1) if stages % d == 0]}")


def check_schedule(schedule: str, stages: int, chunks: int, stages_per_worker: int) -> str:
    """The canonical schedule name once the arguments fit it; a ValueError saying what to change.

    GPipe and 1F1B run one stage per worker; Interleaved1F1B and InterleavedZeroBubble any number v
    dividing the stage count (InterleavedZeroBubble with v = 1 is the paper's ZB-H1); the V-shaped
    ZBVZeroBubble and DualPipeV exactly two, so an even stage count. Interleaved1F1B needs chunks a
    multiple of the worker count, DualPipeV at least as many micro-batches as stages."""
    name = parse_schedule(schedule)
    if stages < 1 or chunks < 1:
        raise ValueError(f"a schedule needs at least one stage and one micro-batch, got stages={stages}, "
                         f"chunks={chunks}")
    v = stages_per_worker
    if name in V_SCHEDULES:
        _check_v(name, stages, v)
    _check_layout(stages, v)
    if v > 1 and name in ("GPipe", "1F1B"):
        raise ValueError(f"stages_per_worker={v} needs a schedule that runs several stages on a worker: "
                         f"schedule='Interleaved1F1B' or 'InterleavedZeroBubble' (any divisor of the stage "
                         f"count), 'ZBVZeroBubble' or 'DualPipeV' (2); {name} runs one stage per worker (use "
                         f"stages_per_worker=1)")
    p = stages // v
    if name == "Interleaved1F1B" and chunks % p:
        lower, upper = chunks // p * p, (chunks // p + 1) * p
        raise ValueError(f"Interleaved1F1B runs micro-batches in rounds of the worker count ({p} = {stages} "
                         f"stages / {v} per worker), so chunks must be a multiple of {p}, got {chunks}: use "
                         f"chunks={upper}" + (f" or {lower}" if lower else ""))
    if name == "DualPipeV" and chunks < stages:
        raise ValueError(f"too few micro-batches for DualPipeV: chunks >= {stages} (the stage count; each "
                         f"worker's steady phase pairs a forward of one of its stages with a backward of the "
                         f"other, which needs the pipeline full both ways), got chunks={chunks}")
    return name


def worker_orders(schedule: str, stages: int, chunks: int, stages_per_worker: int = 1) -> list[list[Action]]:
    """Per worker, the order in which it runs its actions under ``schedule``.

    - ``"GPipe"``: every forward (micro-batches ascending), then every backward, micro-batches
      *descending*: the current runtime runs a step's backward as one autograd task in decreasing
      sequence number, so micro-batch m-1's backward runs first (ARCHITECTURE.md, "One RPC thread per
      stage worker"). A stage holds all m micro-batches' activations.
    - ``"1F1B"`` (PipeDream-Flush): stage j runs w = min(n - j, m) warm-up forwards, then alternates
      one backward and one forward (B0 F(w) B1 F(w+1) ...), then the remaining backwards, ascending.
      It never holds more than n - j micro-batches forwarded but not yet backwarded, which bounds its
      activations without recomputation. (The same order as Megatron's ``F B`` steady state after
      n - j - 1 warm-ups.)
    - ``"Interleaved1F1B"`` (Megatron-LM): ``stages_per_worker = v`` stages per worker, stage j on
      worker ``j mod p`` (p = n / v workers). Micro-batches go in rounds of p: a worker's k-th forward
      is of its local stage ``(k // p) mod v`` and micro-batch ``(k // (p v)) p + k mod p``, its k-th
      backward of local stage ``v - 1 - (k // p) mod v`` and the same micro-batch; worker r runs
      ``min((v - 1) p + 2 (p - 1 - r), m v)`` warm-up forwards, then one forward and one backward,
      then the remaining backwards. The warm-up lets the later stages' forwards arrive before a
      worker needs them, and the bubble shrinks by about v. With v = 1 this order has more warm-up
      forwards than ``"1F1B"`` (2 (p - 1 - r)), as in torch.distributed.pipelining.

    Raises ValueError (saying what to change) for an unknown schedule, stages or chunks below 1,
    ``stages_per_worker`` not dividing ``stages`` or above 1 with another schedule, and
    Interleaved1F1B with ``chunks`` not a multiple of the worker count.
    """
    name = check_schedule(schedule, stages, chunks, stages_per_worker)
    n, m = stages, chunks
    if name == "GPipe":
        return [[Action("F", i, j) for i in range(m)] + [Action("B", i, j) for i in reversed(range(m))]
                for j in range(n)]
    if name == "1F1B":
        return [_one_f_one_b(m, j, warmup=min(n - j, m)) for j in range(n)]
    if name != "Interleaved1F1B":
        raise NotImplementedError(f"{name}'s orders are not written yet")
    return [_interleaved(m, stages_per_worker, n // stages_per_worker, r) for r in range(n // stages_per_worker)]


def _one_f_one_b(m: int, j: int, warmup: int) -> list[Action]:
    order = [Action("F", i, j) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("B", i, j), Action("F", warmup + i, j)]
    return order + [Action("B", i, j) for i in range(m - warmup, m)]


def _interleaved(m: int, v: int, p: int, r: int) -> list[Action]:
    """Worker r's order of Megatron's interleaved schedule (see ``worker_orders``)."""
    total = m * v

    def forward(k: int) -> Action:
        return Action("F", k // (p * v) * p + k % p, (k // p) % v * p + r)

    def backward(k: int) -> Action:
        return Action("B", k // (p * v) * p + k % p, (v - 1 - (k // p) % v) * p + r)

    warmup = min((v - 1) * p + 2 * (p - 1 - r), total)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    return order + [backward(k) for k in range(total - warmup, total)]


def peak_in_flight(orders: Sequence[Sequence[Action]], stages: int) -> list[int]:
    """Per stage, the most micro-batches forwarded and not yet backwarded at once, following the
    orders: what bounds the activations a stage keeps when it does not checkpoint."""
    now, peak = [0] * stages, [0] * stages
    for order in orders:
        for a in order:
            now[a.j] += 1 if a.kind == "F" else -1
            peak[a.j] = max(peak[a.j], now[a.j])
    return peak


def check_orders(orders: Sequence[Sequence[Action]], stages: int, chunks: int, schedule: str | None = None,
                 stages_per_worker: int = 1) -> None:
    """Raise ValueError listing every broken invariant that a runtime following ``orders`` relies on:
    one order per worker; every ``F``/``B`` of every (i, j) exactly once, on stage j's worker; on that
    worker F(i, j) before B(i, j); under 1F1B at most n - j micro-batches in flight on stage j."""
    n, m, v = stages, chunks, stages_per_worker
    problems: list[str] = []
    _check_layout(n, v)
    if len(orders) != n // v:
        problems.append(f"{len(orders)} worker orders for {n // v} workers")
    seen: dict[Action, int] = {}
    for w, order in enumerate(orders):
        for a in order:
            if a.kind not in ("F", "B") or not (0 <= a.i < m and 0 <= a.j < n):
                problems.append(f"worker {w}: {a} is not an action of {m} micro-batches on {n} stages")
            elif a in seen:
                problems.append(f"worker {w}: {a} appears again")
            elif stage_worker(a.j, n, v) != w:
                problems.append(f"worker {w}: {a} belongs to worker {stage_worker(a.j, n, v)}")
            elif a.kind == "B" and Action("F", a.i, a.j) not in seen:
                problems.append(f"worker {w}: {a} comes before its forward")
            seen.setdefault(a, w)
    missing = [Action(k, i, j) for j in range(n) for i in range(m) for k in "FB" if Action(k, i, j) not in seen]
    if missing:
        problems.append(f"{len(missing)} actions in no order, first {missing[:4]}")
    if schedule is not None and parse_schedule(schedule) == "1F1B":
        valid = [[a for a in order if a.kind in ("F", "B") and 0 <= a.j < n] for order in orders]
        problems += [f"stage {j}: {peak} micro-batches in flight, 1F1B allows {n - j}"
                     for j, peak in enumerate(peak_in_flight(valid, n)) if peak > n - j]
    if problems:
        shown = "\n  ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise ValueError(f"the orders break {len(problems)} schedule invariant(s):\n  {shown}")


def _needs(a: Action, n: int) -> Action | None:
    """The action of another stage that ``a`` waits for: the previous stage's forward of the same
    micro-batch, the next stage's backward, or (for the last stage's backward) its own forward."""
    if a.kind == "F":
        return Action("F", a.i, a.j - 1) if a.j > 0 else None
    return Action("B", a.i, a.j + 1) if a.j < n - 1 else Action("F", a.i, a.j)


def simulate(orders: Sequence[Sequence[Action]], costs: Mapping[str, float] | None = None) -> Simulation:
    """The ticks at which workers following ``orders`` would start each action: a worker runs its
    actions one at a time, in its order, each as soon as the action it needs (``_needs``) has ended.
    ``costs`` gives the duration per kind (default 1 tick each, e.g. ``{"F": 1, "B": 2}``); transfers
    are free. Raises ValueError naming what each stuck worker waits for if an order can never proceed
    (a deadlock: a runtime following it would hang)."""
    cost = {"F": 1.0, "B": 1.0, **(costs or {})}
    if any(c <= 0 for c in cost.values()):
        raise ValueError(f"costs must be positive, got {dict(cost)}")
    n = 1 + max((a.j for order in orders for a in order), default=-1)
    ends: dict[Action, float] = {}
    starts: dict[Action, float] = {}
    nexts, free_at, busy = [0] * len(orders), [0.0] * len(orders), [0.0] * len(orders)
    t = 0.0
    while True:
        for w, order in enumerate(orders):
            if nexts[w] < len(order) and free_at[w] <= t:
                a = order[nexts[w]]
                need = _needs(a, n)
                if need is None or ends.get(need, t + 1) <= t:
                    starts[a], ends[a] = t, t + cost[a.kind]
                    free_at[w] = ends[a]
                    busy[w] += cost[a.kind]
                    nexts[w] += 1
        later = [f for f in free_at if f > t]
        if later:
            t = min(later)
            continue
        stuck = [(w, order[nexts[w]]) for w, order in enumerate(orders) if nexts[w] < len(order)]
        if not stuck:
            return Simulation(starts, max(ends.values(), default=0.0), busy)
        waits = "; ".join(f"worker {w} at {a} waits for {_needs(a, n)}" for w, a in stuck)
        raise ValueError(f"deadlock at tick {t:g}: {waits}")


def format_orders(orders: Sequence[Sequence[Action]]) -> str:
    """A printable table of ``orders`` at unit costs: one row per worker, one column per tick of
    ``simulate``, "." where the worker waits. Actions read "F3" (forward of micro-batch 3), or
    "5F3" (stage 5) where a worker holds several stages."""
    sim = simulate(orders)
    with_stage = any(len({a.j for a in order}) > 1 for order in orders)
    ticks = int(sim.makespan)
    rows = [["."] * ticks for _ in orders]
    for w, order in enumerate(orders):
        for a in order:
            rows[w][int(sim.starts[a])] = a.label(with_stage)
    width = max([len(str(ticks - 1))] + [len(cell) for row in rows for cell in row])
    names = ["tick"] + [f"worker {w}" for w in range(len(orders))]
    first = max(len(s) for s in names)
    lines = [[str(k) for k in range(ticks)]] + rows
    return "\n".join(f"{name:<{first}}  " + " ".join(f"{c:<{width}}" for c in cells).rstrip()
                     for name, cells in zip(names, lines))
