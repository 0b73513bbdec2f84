"""Pure scheduling facts: which micro-batches are checkpointed, GPipe's clock cycles, and each
schedule as data: the order in which every worker runs its actions.

The schedules (``SCHEDULES``, torch.distributed.pipelining's names): GPipe, 1F1B and Interleaved1F1B
run each micro-batch's backward on a stage as one action ``B``. The zero-bubble ones
(InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; Qi et al. 2023, "Zero Bubble Pipeline
Parallelism", and DeepSeek-V3's DualPipe) split it in two (``is_split``): ``I``, the gradient of the
stage's inputs, which the previous stage waits for, and ``W``, the gradient of its weights, which
nobody waits for before the optimizer step, so that a worker can run it where it would otherwise
idle. ZBVZeroBubble and DualPipeV place two stages on each worker in a V (``is_v_shaped``,
``stage_layout``).

The schedule is data so that it can be checked and printed without processes: ``worker_orders``
gives the orders, ``check_orders`` the invariants a runtime relies on, ``peak_in_flight`` and
``worker_peaks`` the micro-batches whose activations a stage or worker keeps, ``simulate`` the ticks
at which workers following those orders under the pipeline's dependencies would run each action, and
``format_orders`` a table of them::

    >>> print(format_orders(worker_orders("1F1B", stages=2, chunks=4)))
    tick      0  1  2  3  4  5  6  7  8  9
    worker 0  F0 F1 .  B0 F2 B1 F3 B2 .  B3
    worker 1  .  F0 B0 F1 B1 F2 B2 F3 B3 .

The continuous schedules (``ASYNC_SCHEDULES``: PipeDream, PipeDream-2BW, PipeMare) never drain:
``stream_order`` gives a stage's order over a stream of batches, with ``U``, its update with a batch's
gradient; ``weight_version`` and ``pipemare_forward_version`` the weights each batch runs on,
``weight_buffers`` how many versions a stage keeps, ``check_stream_orders`` the invariants; ``simulate``
and ``format_orders`` take these orders too. One batch on its own is 1F1B under every rule
(``step_schedule``).

Index names as in the rest of the package: ``i`` micro-batch, ``j`` stage, ``m``/``n`` their counts,
``t`` batch. Stages are numbered along the pipeline (stage j feeds stage j + 1), whatever worker runs them.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["CHECKPOINT_MODES", "checkpoint_stop", "clock_cycles", "ideal_efficiency",
           "SCHEDULES", "SPLIT_SCHEDULES", "V_SCHEDULES", "ASYNC_SCHEDULES", "PipeMareOptions", "Action", "Simulation", "parse_schedule",
           "is_split", "is_v_shaped", "is_async", "step_schedule", "check_schedule", "stage_layout", "stage_worker",
           "worker_orders", "check_orders", "peak_in_flight", "worker_peaks", "simulate", "format_orders",
           "weight_version", "pipemare_forward_version", "weight_buffers", "stream_order", "stream_orders",
           "check_stream_orders"]

CHECKPOINT_MODES = ("always", "except_last", "never")
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
             "DualPipeV")  # torch.distributed.pipelining's names
#: The schedules whose backward is split in two actions: ``I`` (the inputs' gradient) and ``W`` (the weights').
SPLIT_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
#: The schedules that place two stages on each worker in a V (see ``stage_layout``).
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
#: The continuous (asynchronous) schedules: a pipeline that never drains, each stage applying a batch's
#: gradient as soon as it has it (``stream_order``), under each rule's weight versions (``weight_version``).
ASYNC_SCHEDULES = ("PipeDream", "PipeDream-2BW", "PipeMare")


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
    """One unit of a worker's work on micro-batch ``i`` of batch ``t`` and stage ``j``: its forward
    (``kind == "F"``), its backward (``"B"``), or, where a schedule splits the backward (``is_split``),
    the gradient of the stage's inputs (``"I"``, the paper's B, torch.distributed.pipelining's I) and
    then that of its weights (``"W"``). In a continuous pipeline (``stream_order``), ``"U"`` (with
    ``i = -1``) is stage j's optimizer update with batch t's gradient. One step's orders leave ``t``
    at 0. A tuple, so that it hashes, sorts and prints plainly."""

    kind: str
    i: int
    j: int
    t: int = 0

    def label(self, with_stage: bool = False, with_batch: bool = False) -> str:
        """``"F3"``, ``"I3"``, ``"W3"``; ``"5F3"`` (stage 5) where a worker holds several stages, as
        torch.distributed.pipelining prints its actions; ``"F1.3"`` (batch 1) ``with_batch``, as in a
        stream's table; ``"U1"`` (batch 1's update) always."""
        stage = self.j if with_stage else ""
        if self.kind == "U":
            return f"{stage}U{self.t}"
        return f"{stage}{self.kind}{f'{self.t}.' if with_batch else ''}{self.i}"

    def __repr__(self) -> str:
        """Without ``t`` when it is 0, so that one step's actions print as they always have."""
        batch = f", t={self.t}" if self.t else ""
        return f"Action(kind={self.kind!r}, i={self.i}, j={self.j}{batch})"


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
    """The canonical name in ``SCHEDULES`` or ``ASYNC_SCHEDULES`` for ``name``, in any case
    ("1f1b" -> "1F1B", "pipedream-2bw" -> "PipeDream-2BW")."""
    known = SCHEDULES + ASYNC_SCHEDULES
    names = {s.lower(): s for s in known}
    if not isinstance(name, str) or name.lower() not in names:
        raise ValueError(f"schedule must be one of {', '.join(known)} (any case), got {name!r}")
    return names[name.lower()]


def is_async(schedule: str) -> bool:
    """Whether ``schedule`` is a continuous one (``ASYNC_SCHEDULES``): stages update their weights
    while later batches are in flight, so a batch may run on older weights."""
    return parse_schedule(schedule) in ASYNC_SCHEDULES


def step_schedule(schedule: str) -> str:
    """The synchronous schedule that runs one step of ``schedule``: "1F1B" for a continuous one (one
    batch on its own, under any asynchronous rule, is plain 1F1B: every update comes after its last
    backward), else ``schedule``'s canonical name. What the one-step functions (``worker_orders``,
    ``check_orders``) dispatch on."""
    name = parse_schedule(schedule)
    return "1F1B" if name in ASYNC_SCHEDULES else name


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
    multiple of the worker count, DualPipeV at least as many micro-batches as stages. The continuous
    schedules (``ASYNC_SCHEDULES``) run one stage per worker and a step as 1F1B's (``step_schedule``)."""
    name = parse_schedule(schedule)
    if stages < 1 or chunks < 1:
        raise ValueError(f"a schedule needs at least one stage and one micro-batch, got stages={stages}, "
                         f"chunks={chunks}")
    v = stages_per_worker
    if name in V_SCHEDULES:
        _check_v(name, stages, v)
    _check_layout(stages, v)
    if v > 1 and name in ASYNC_SCHEDULES:
        raise ValueError(f"{name} runs exactly one stage per worker (each stage keeps its own weight versions and "
                         f"steps its own optimizer): use stages_per_worker=1, got {v}")
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
        raise ValueError(f"too few micro-batches for DualPipeV: chunks >= {stages} (the stage count, as "
                         f"torch.distributed.pipelining requires: each worker's steady phase pairs a forward of "
                         f"one of its stages with a backward of the other, and needs the pipeline full both "
                         f"ways), got chunks={chunks}")
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

    The zero-bubble schedules run ``I`` and ``W`` (``is_split``). Their bubbles shrink because a
    worker waiting for a gradient can run a ``W`` instead, and because only ``I`` is on the path
    the gradients travel back; they are bounded by memory, since a stage keeps a micro-batch's
    activations until its ``W`` (``peak_in_flight``). InterleavedZeroBubble and ZBVZeroBubble are
    played out at F = I = W = 1 by one greedy rule (``_zero_bubble``: ``I`` first, then the highest
    stage's ``F`` while the stage is under its bound, else a ``W``), and differ in layout and bounds:

    - ``"InterleavedZeroBubble"``: the loop layout of Interleaved1F1B, any v dividing n, any m. Each
      stage holds at most what Interleaved1F1B with the same v holds on it (v = 1: 1F1B's n - j;
      this is the paper's ZB-H1); a worker with v > 1 stages holds their sum, which can exceed
      Interleaved1F1B's worker, whose stages do not peak together (p = 4, v = 3: 17 against 13
      stage-micro-batches). With v = 1 the bubble is 2 (p - 1) ticks per worker against
      1F1B's 3 (p - 1) at F = I = W = 1, B = 2 (the paper's ZB-H1 reaches p - 1 by counting a
      micro-batch that waits only for its ``W`` as lighter, and keeping more of them than 1F1B
      keeps); with v > 1 it is well below Interleaved1F1B's.
    - ``"ZBVZeroBubble"`` (the paper's ZB-V): v = 2, n = 2p, the V layout (``stage_layout``): worker
      r runs stages r and 2p - 1 - r, so the last stage's gradient starts on worker 0, which needs it
      last. Stage j holds at most 2p - 1 - j micro-batches for j < p and 2p - j after, each worker
      2p stage-halves: 1F1B's worker 0's p full stages, on every worker. Any m. At m >= 2p the
      bubble measures p - 1 ticks per worker for p <= 4 (the least possible: worker p - 1 waits
      that long for its first forward, and all workers end together), at most p + 1 up to p = 6,
      against 6m ticks of work: close to zero.
    - ``"DualPipeV"`` (DeepSeek-V3's DualPipe cut in half, as torch.distributed.pipelining has it):
      v = 2 in the V layout, m >= n. Worker r runs, over its stages a = r and b = 2p - 1 - r,
      2 (p - 1 - r) forwards of a; r + 1 pairs of forwards a, b; p - 1 - r rounds of b's ``I``, a
      ``W`` and a forward of b; then the steady phase, m - 2p + r + 1 rounds of ``B`` of b,
      forward of a, ``B`` of a, forward of b, where DualPipe overlaps each forward with the other
      stage's backward (the runtime runs one action at a time, so the backward goes first: it frees
      a micro-batch before the forward takes one); then p - 1 - r rounds of ``B`` of b, ``B`` of a,
      forward of b (a has no forwards left); then the last backwards, the later half of them split
      and their ``W`` left to fill the tail. So most micro-batches end with a fused ``B``, and
      2p - 1 - r on worker r with ``I`` and ``W``: the first p - 1 - r of stage b and p of the
      worker's last backwards. Each worker holds at most 2p stage-halves, as ZBVZeroBubble.

    A continuous schedule (``ASYNC_SCHEDULES``) gives 1F1B's orders: one step on its own
    (``step_schedule``); its stream's orders are ``stream_order``'s.

    Raises ValueError (saying what to change) for an unknown schedule, stages or chunks below 1,
    ``stages_per_worker`` not dividing ``stages``, above 1 for GPipe, 1F1B or a continuous schedule, or
    not 2 (or an odd stage count) for the V-shaped schedules, Interleaved1F1B with ``chunks`` not a
    multiple of the worker count, and DualPipeV with fewer micro-batches than stages.
    """
    name = step_schedule(check_schedule(schedule, stages, chunks, stages_per_worker))
    n, m = stages, chunks
    if name == "GPipe":
        return [[Action("F", i, j) for i in range(m)] + [Action("B", i, j) for i in reversed(range(m))]
                for j in range(n)]
    if name == "1F1B":
        return [_one_f_one_b(m, j, warmup=min(n - j, m)) for j in range(n)]
    if name == "Interleaved1F1B":
        return [_interleaved(m, stages_per_worker, n // stages_per_worker, r)
                for r in range(n // stages_per_worker)]
    if name == "DualPipeV":
        return [_dual_pipe_v(m, n // 2, r) for r in range(n // 2)]
    caps = _in_flight_caps(name, n, m, stages_per_worker)
    return _zero_bubble(m, stage_layout(name, n, stages_per_worker), caps.stages)


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


class _Caps(NamedTuple):
    """The most micro-batches in flight a schedule allows per stage and per worker (``_in_flight_caps``)."""

    stages: list[int]
    workers: list[int]


def _in_flight_caps(name: str, n: int, m: int, v: int) -> _Caps:
    """The most micro-batches that ``name``'s orders keep in flight (``peak_in_flight``) per stage,
    and per worker over all its stages (``worker_peaks``): what ``_zero_bubble`` holds them to, and
    what ``check_orders`` checks.

    - 1F1B and InterleavedZeroBubble with v = 1: 1F1B's n - j.
    - InterleavedZeroBubble with v > 1: what Interleaved1F1B with the same v reaches on each stage
      (with ``chunks`` rounded up to a multiple of the worker count p, where Interleaved1F1B is
      defined; never more than m): from 2p on the first stages to 1 on the last. Not its workers'
      peaks: Interleaved1F1B's stages do not peak together, InterleavedZeroBubble's do, so its
      worker holds the sum, up to 4 stage-micro-batches more at p = 4, v = 3 (17 against 13).
      Holding the workers to Interleaved1F1B's as well was measured to cost most of the gain
      (p = 4, v = 2, m = 12 at F = I = W = 1: 79 ticks against 75, Interleaved1F1B 81 at B = 2).
    - ZBVZeroBubble: 2p - 1 - j on stage j < p, 2p - j after (the 2p-stage 1F1B's 2p - j, one less
      on the first half), so that each worker holds at most 2p stage-halves (one micro-batch on a
      stage counted once): what 1F1B's worker 0 holds of the same model cut in p stages, p full
      stages, and 1F1B's peak over its workers.
    - DualPipeV (its workers only; what its phases reach): 2p.
    Where no bound is stated, a worker's is the sum of its stages'."""
    layout = stage_layout(name, n, v)
    p = 1 + max(layout)

    def summed(stages: list[int]) -> list[int]:
        return [sum(c for j, c in enumerate(stages) if layout[j] == w) for w in range(p)]

    if name == "1F1B" or (name == "InterleavedZeroBubble" and v == 1):
        stages = [min(m, n - j) for j in range(n)]
        return _Caps(stages, summed(stages))
    if name == "InterleavedZeroBubble":
        rounded = -(-m // p) * p
        stages = [min(m, peak) for peak in peak_in_flight([_interleaved(rounded, v, p, r) for r in range(p)], n)]
        return _Caps(stages, summed(stages))
    if name == "ZBVZeroBubble":
        stages = [min(m, n - 1 - j if j < p else n - j) for j in range(n)]
        return _Caps(stages, summed(stages))
    if name == "DualPipeV":
        return _Caps([m] * n, [n] * p)
    raise ValueError(f"{name} holds its stages to no in-flight bound of its own")


def _zero_bubble(m: int, layout: Sequence[int], caps: Sequence[int]) -> list[list[Action]]:
    """The orders of the split-backward schedules built by playing them out at unit costs
    (F = I = W = 1 tick): at each tick every idle worker takes, of its stages' actions that are ready,
    the first by these rules:

    1. an ``I`` (its forward done and, except on the last stage, the next stage's ``I``): the
       gradients are the critical path back to stage 0 and the only thing other workers wait for.
       Lowest micro-batch first, then the highest stage.
    2. an ``F`` (the previous stage's forward done) on a stage holding fewer than ``caps[j]``
       micro-batches in flight (forwarded, ``W`` not yet run); the highest stage first, so that each
       micro-batch reaches the last stage and turns into gradients soon. A stage forwards its
       micro-batches in order, and so runs its ``I`` in order.
    3. a pending ``W``: first one of a stage whose next forward waits only for the room it frees,
       else the oldest. Nobody waits for a ``W``, so it fills the ticks a worker would idle, and
       at the end the gradient's tail.

    Every ``F`` runs once its stage has room, so the lowest unfinished micro-batch can always move
    on: the play never stalls and the orders never deadlock, at any costs (whether an order can
    proceed does not depend on the durations, only the ticks do)."""
    n, p = len(layout), 1 + max(layout)
    stages_of = [[j for j in range(n) if layout[j] == w] for w in range(p)]
    forwarded, input_done = [0] * n, [0] * n  # per stage: micro-batches past F, past I
    in_flight = [0] * n
    pending: list[list[Action]] = [[] for _ in range(p)]  # per worker: its Ws not run, oldest first
    done: set[Action] = set()
    orders: list[list[Action]] = [[] for _ in range(p)]
    left = 3 * n * m
    while left:
        ran: list[Action] = []
        for w, mine in enumerate(stages_of):
            grads = [Action("I", input_done[j], j) for j in mine if input_done[j] < forwarded[j]
                     and (j == n - 1 or Action("I", input_done[j], j + 1) in done)]
            forwards = [Action("F", forwarded[j], j) for j in mine if forwarded[j] < m and in_flight[j] < caps[j]
                        and (j == 0 or Action("F", forwarded[j], j - 1) in done)]
            if grads:
                a = min(grads, key=lambda a: (a.i, -a.j))
            elif forwards:
                a = max(forwards, key=lambda a: a.j)
            elif pending[w]:
                held = {j for j in mine if forwarded[j] < m and in_flight[j] >= caps[j]}
                a = pending[w].pop(next((k for k, x in enumerate(pending[w]) if x.j in held), 0))
            else:
                continue
            orders[w].append(a)
            ran.append(a)
            if a.kind == "F":
                forwarded[a.j] += 1
                in_flight[a.j] += 1
            elif a.kind == "I":
                input_done[a.j] += 1
                pending[w].append(Action("W", a.i, a.j))
            else:
                in_flight[a.j] -= 1
        if not ran:
            raise AssertionError(f"the zero-bubble play stalled with {left} actions left")  # see the docstring
        done.update(ran)
        left -= len(ran)
    return orders


def _dual_pipe_v(m: int, p: int, r: int) -> list[Action]:
    """Worker r's order of DualPipeV (see ``worker_orders``): its stages a = r (down the V) and
    b = 2p - 1 - r (back up), in DeepSeek's eight phases. Each stage runs its forwards and its
    backwards (B or I) in micro-batch order; a ``W`` runs the oldest ``I`` not yet followed by one."""
    a, b = r, 2 * p - 1 - r
    forwarded = {a: 0, b: 0}
    backwarded = {a: 0, b: 0}
    pending: list[Action] = []
    order: list[Action] = []

    def f(j: int) -> None:
        order.append(Action("F", forwarded[j], j))
        forwarded[j] += 1

    def back(j: int, split: bool) -> None:
        order.append(Action("I" if split else "B", backwarded[j], j))
        if split:
            pending.append(Action("W", backwarded[j], j))
        backwarded[j] += 1

    def w() -> None:
        if pending:
            order.append(pending.pop(0))

    for _ in range(2 * (p - 1 - r)):  # 1. down the V only: the micro-batches the later workers need
        f(a)
    for _ in range(r + 1):            # 2. both stages, until b has the first micro-batch back
        f(a)
        f(b)
    for _ in range(p - 1 - r):        # 3. b's first gradients split, their W at once (zero-bubble warm-up)
        back(b, True)
        w()
        f(b)
    for _ in range(m - 2 * p + r + 1):  # 4. steady: each forward paired with the other stage's B
        back(b, False)
        f(a)
        back(a, False)
        f(b)
    for _ in range(p - 1 - r):        # 5. a's forwards are done: b's B, then b's last forwards with a's B
        back(b, False)
        back(a, False)
        f(b)
    split = False                     # 6. the last backwards; the second half split, their Ws left for the tail
    for k in range(r + 1):
        split = split or (k == (r + 1) // 2 and r % 2 == 1)
        back(b, split)
        split = split or (k == (r + 1) // 2 and r % 2 == 0)
        back(a, split)
    for _ in range(p - 1 - r):        # 7. a's last backwards, each after a pending W
        w()
        back(a, split)
    while pending:                    # 8. the remaining Ws
        w()
    return order


#: What each kind of action does to the micro-batches a stage holds: a forward takes one on, the action
#: that ends its backward there (a fused ``B``, or ``W`` of a split one) lets it go (``I`` frees nothing).
_HELD = {"F": 1, "B": -1, "W": -1}


def peak_in_flight(orders: Sequence[Sequence[Action]], stages: int) -> list[int]:
    """Per stage, the most micro-batches in flight at once, following the orders: forwarded and not
    yet ended, where the action that ends a micro-batch on a stage is its fused backward ``B`` or, when
    the backward is split, its weights' gradient ``W`` (``I`` frees nothing: ``W`` reads the inputs of
    the stage's layers, so the stage keeps the micro-batch until then). What bounds the activations a
    stage keeps when it does not checkpoint. (Counting is in stages: where stages differ in size, as
    a V-shaped schedule's halves against a 1F1B stage, compare in the same unit.)"""
    now, peak = [0] * stages, [0] * stages
    for order in orders:
        for a in order:
            now[a.j] += _HELD.get(a.kind, 0)
            peak[a.j] = max(peak[a.j], now[a.j])
    return peak


def worker_peaks(orders: Sequence[Sequence[Action]], stages: int) -> list[int]:
    """Per worker, the most micro-batches in flight at once over all its stages together (each
    micro-batch counted once per stage that holds it), following its order: what bounds the
    activations a worker keeps, for a worker that holds several stages."""
    peaks = []
    for order in orders:
        now = peak = 0
        for a in order:
            now += _HELD.get(a.kind, 0)
            peak = max(peak, now)
        peaks.append(peak)
    return peaks


def check_orders(orders: Sequence[Sequence[Action]], stages: int, chunks: int, schedule: str | None = None,
                 stages_per_worker: int = 1) -> None:
    """Raise ValueError listing every broken invariant that a runtime following ``orders`` relies on:
    one order per worker; every ``F`` of every (i, j) exactly once, on stage j's worker (by
    ``schedule``'s layout: ``stage_layout``; without a schedule the loop layout); every (i, j) ended
    either by one fused ``B`` or by one ``I`` and one ``W``, never both ways; on that worker F(i, j)
    before B(i, j) or I(i, j), and I(i, j) before W(i, j); once those hold, the in-flight bounds the
    schedule promises (``peak_in_flight``, ``worker_peaks``): 1F1B n - j micro-batches on stage j,
    InterleavedZeroBubble and ZBVZeroBubble their stages' bounds (``worker_orders``), the V-shaped
    schedules 2p = n stage-micro-batches per worker."""
    n, m, v = stages, chunks, stages_per_worker
    problems: list[str] = []
    name = step_schedule(schedule) if schedule is not None else None
    layout = stage_layout(name or "GPipe", n, v)  # without a schedule, the loop layout
    workers = n // v
    if len(orders) != workers:
        problems.append(f"{len(orders)} worker orders for {workers} workers")
    seen: dict[Action, int] = {}
    for w, order in enumerate(orders):
        for a in order:
            owner = layout[a.j] if 0 <= a.j < n else None
            if a.kind not in ("F", "B", "I", "W") or not (0 <= a.i < m and 0 <= a.j < n):
                problems.append(f"worker {w}: {a} is not an action of {m} micro-batches on {n} stages")
            elif a in seen:
                problems.append(f"worker {w}: {a} appears again")
            elif owner != w:
                problems.append(f"worker {w}: {a} belongs to worker {owner}")
            elif a.kind in ("B", "I") and Action("F", a.i, a.j) not in seen:
                problems.append(f"worker {w}: {a} comes before its forward")
            elif a.kind == "W" and Action("I", a.i, a.j) not in seen:
                problems.append(f"worker {w}: {a} comes before its input gradient {Action('I', a.i, a.j)}")
            elif a.kind in ("B", "I") and Action("I" if a.kind == "B" else "B", a.i, a.j) in seen:
                problems.append(f"worker {w}: {a} after {Action('I' if a.kind == 'B' else 'B', a.i, a.j)}: "
                                f"a micro-batch's backward on a stage is either B or I and W")
            seen.setdefault(a, w)
    missing = [Action("F", i, j) for j in range(n) for i in range(m) if Action("F", i, j) not in seen]
    for i, j in ((i, j) for j in range(n) for i in range(m)):
        b, i_, w_ = (Action(k, i, j) in seen for k in "BIW")
        if not (b or i_):
            missing.append(Action("B", i, j))
        elif i_ and not w_:
            missing.append(Action("W", i, j))
    if missing:
        problems.append(f"{len(missing)} actions in no order, first {missing[:4]}")
    if name is not None and not problems:
        problems += _bound_problems(orders, name, n, m, v)
    _raise_problems("the orders", problems)


def _raise_problems(what: str, problems: Sequence[str]) -> None:
    """Raise one ValueError listing the first ten ``problems`` (if any) that ``what`` has."""
    if problems:
        shown = "\n  ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise ValueError(f"{what} break {len(problems)} schedule invariant(s):\n  {shown}")


def _bound_problems(orders: Sequence[Sequence[Action]], name: str, n: int, m: int, v: int) -> list[str]:
    """The stages and, where a worker holds several, the workers holding more micro-batches in flight
    than ``name`` promises (``_in_flight_caps``); none for a schedule that promises no bound."""
    problems: list[str] = []
    if name not in ("1F1B",) + SPLIT_SCHEDULES:
        return problems
    caps = _in_flight_caps(name, n, m, v)
    problems += [f"stage {j}: {peak} micro-batches in flight, {name} allows {caps.stages[j]}"
                 for j, peak in enumerate(peak_in_flight(orders, n)) if peak > caps.stages[j]]
    if v > 1:
        problems += [f"worker {w}: {peak} stage-micro-batches in flight, {name} allows {caps.workers[w]}"
                     for w, peak in enumerate(worker_peaks(orders, n)) if peak > caps.workers[w]]
    return problems


def _needs(a: Action, n: int, grad: Mapping[tuple[int, int, int], str]) -> Action | None:
    """The action of another stage (or an earlier one of the same stage) that ``a`` waits for: the
    previous stage's forward of the same micro-batch (of the same batch); for a backward (``B`` or
    ``I``), the next stage's backward of it (``B`` or ``I``, whichever that stage runs: ``grad``, by
    (t, i, j)), or on the last stage its own forward; for ``W``, its ``I``. An update ``U`` waits only
    for its own stage's earlier actions, which its worker's order runs first."""
    if a.kind == "U":
        return None
    if a.kind == "F":
        return Action("F", a.i, a.j - 1, a.t) if a.j > 0 else None
    if a.kind == "W":
        return Action("I", a.i, a.j, a.t)
    if a.j == n - 1:
        return Action("F", a.i, a.j, a.t)
    return Action(grad.get((a.t, a.i, a.j + 1), "B"), a.i, a.j + 1, a.t)


def simulate(orders: Sequence[Sequence[Action]], costs: Mapping[str, float] | None = None) -> Simulation:
    """The ticks at which workers following ``orders`` would start each action: a worker runs its
    actions one at a time, in its order, each as soon as the action it needs (``_needs``) has ended.
    Stages are numbered along the pipeline (stage j feeds stage j + 1) whatever worker runs them.
    ``costs`` gives the duration per kind, ``F``, ``B``, ``I``, ``W`` (default 1 tick each, e.g.
    ``{"F": 1, "B": 2}``; a fused B costs what is given for it, not I + W: pass ``{"B": 2}`` to compare
    a fused schedule with a split one fairly), and ``U``, a stream's update (default 0, or any
    duration >= 0); transfers are free. Stream orders (``stream_orders``) are one per stage, their
    actions keyed by batch and micro-batch. Raises ValueError naming what each stuck worker waits for
    if an order can never proceed (a deadlock: a runtime following it would hang)."""
    cost = {"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0, "U": 0.0, **(costs or {})}
    if any(c <= 0 for kind, c in cost.items() if kind != "U") or cost["U"] < 0:
        raise ValueError(f"costs must be positive (U's at least 0), got {dict(cost)}")
    n = 1 + max((a.j for order in orders for a in order), default=-1)
    grad = {(a.t, a.i, a.j): a.kind for order in orders for a in order if a.kind in ("B", "I")}
    ends: dict[Action, float] = {}
    starts: dict[Action, float] = {}
    nexts, free_at, busy = [0] * len(orders), [0.0] * len(orders), [0.0] * len(orders)
    t = 0.0
    while True:
        for w, order in enumerate(orders):
            while nexts[w] < len(order) and free_at[w] <= t:  # more than one only after a free action (U)
                a = order[nexts[w]]
                need = _needs(a, n, grad)
                if need is not None and ends.get(need, t + 1) > t:
                    break
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
        waits = "; ".join(f"worker {w} at {a} waits for {_needs(a, n, grad)}" for w, a in stuck)
        raise ValueError(f"deadlock at tick {t:g}: {waits}")


def format_orders(orders: Sequence[Sequence[Action]]) -> str:
    """A printable table of ``orders`` at unit costs: one row per worker, one column per tick of
    ``simulate``, "." where the worker waits. Actions read "F3" (forward of micro-batch 3), "B3"
    (its backward), "I3" and "W3" (the halves of a split backward), or "5F3" (stage 5) where a
    worker holds several stages. Stream orders (``stream_orders``) read "F1.3" (micro-batch 3 of
    batch 1), and batch 1's update, which takes no time, joins the cell of the backward before it:
    "B1.3+U1"; their columns are each as wide as they need."""
    sim = simulate(orders)
    with_stage = any(len({a.j for a in order}) > 1 for order in orders)
    stream = any(a.kind == "U" or a.t for order in orders for a in order)
    ticks = int(sim.makespan)
    rows = [["."] * ticks for _ in orders]
    for w, order in enumerate(orders):
        tick = 0
        for a in order:
            if a.kind == "U" and rows[w][tick] != ".":  # no duration: with the action it follows
                rows[w][tick] += "+" + a.label(with_stage)
                continue
            tick = int(sim.starts[a])
            rows[w][tick] = a.label(with_stage, with_batch=stream)
    names = ["tick"] + [f"worker {w}" for w in range(len(orders))]
    first = max(len(s) for s in names)
    lines = [[str(k) for k in range(ticks)]] + rows
    width = max(len(cell) for cells in lines for cell in cells) if lines[0] else 0
    widths = [max(len(cells[k]) for cells in lines) for k in range(ticks)] if stream else [width] * ticks
    return "\n".join(f"{name:<{first}}  " + " ".join(f"{c:<{w}}" for c, w in zip(cells, widths)).rstrip()
                     for name, cells in zip(names, lines))


# Continuous pipelines (ASYNC_SCHEDULES): batch after batch without a flush, each stage applying batch
# t's gradient (U(t)) as soon as its last backward of t is done, while later batches are in flight.

def _check_stream(schedule: str, stages: int, chunks: int, vertical_sync: bool) -> str:
    """The canonical name once a stream's arguments fit it: vertical sync is PipeDream's only."""
    name = parse_schedule(schedule)
    if stages < 1 or chunks < 1:
        raise ValueError(f"a stream needs at least one stage and one micro-batch, got stages={stages}, chunks={chunks}")
    if vertical_sync and name != "PipeDream":
        raise ValueError(f"vertical_sync=True goes with schedule='PipeDream' only (every stage then uses the "
                         f"version stage 0 uses), got schedule={name!r}")
    return name


def _delay(stages: int, j: int, chunks: int) -> int:
    """d_j = ceil((n - 1 - j) / m): how many batches stage j's newest weights lag behind the batch that
    starts on it in continuous 1F1B, n - 1 - j micro-batches ahead of its backwards."""
    return -(-(stages - 1 - j) // chunks)


def weight_version(schedule: str, t: int, j: int, stages: int, chunks: int, *, vertical_sync: bool = False) -> int:
    """The weight version (the number of updates applied on stage j) that batch t's forward and
    backward use on stage j, with n = ``stages``, m = ``chunks`` (the pipe's) and
    d_j = ceil((n - 1 - j) / m):

    - "PipeDream": max(t - d_j, 0), the newest version when batch t's first micro-batch enters
      stage j, stashed until its backward; with ``vertical_sync``, max(t - d_0, 0) on every stage,
      so that a batch uses one version throughout the pipeline.
    - "PipeDream-2BW": max(t - 1, 0) with n >= 2, on every stage: one update behind, so that a stage
      keeps two versions (double-buffered: the live one and one stashed); t with one stage, which is
      then synchronous.
    - a synchronous schedule: t (every update comes after the batch before).

    PipeMare keeps no version (its forward reads the weights current when it runs, its backward the
    ones after t updates): see ``pipemare_forward_version``; it raises ValueError here, as does
    ``vertical_sync`` with anything but PipeDream."""
    name = _check_stream(schedule, stages, chunks, vertical_sync)
    if not 0 <= j < stages or t < 0:
        raise ValueError(f"no stage {j} of {stages} or batch {t}")
    if name == "PipeMare":
        raise ValueError("PipeMare stashes no weight version: a forward reads the weights current when it runs "
                         "(pipemare_forward_version), every backward of batch t the weights after t updates")
    if name == "PipeDream":
        return max(t - _delay(stages, 0 if vertical_sync else j, chunks), 0)
    if name == "PipeDream-2BW" and stages > 1:
        return max(t - 1, 0)
    return t


def pipemare_forward_version(t: int, i: int, j: int, stages: int, chunks: int) -> int:
    """Under PipeMare, the updates applied on stage j when F(t, i, j) runs in ``stream_order``:
    max(floor((t m + i - (n - 1 - j)) / m), 0). The forward runs n - j micro-batches of the global
    sequence after the backward that frees its slot, and every m-th backward ends a batch with an
    update. A batch's micro-batches may see different versions; its backwards all see t."""
    if not 0 <= j < stages or t < 0 or not 0 <= i < chunks:
        raise ValueError(f"no micro-batch {i} of {chunks}, stage {j} of {stages} or batch {t}")
    return max((t * chunks + i - (stages - 1 - j)) // chunks, 0)


@dataclass(frozen=True)
class PipeMareOptions:
    """PipeMare's two techniques (Yang et al., "PipeMare: Asynchronous Pipeline Parallel DNN Training",
    MLSys 2021, section 3), both off by default, with stage j's delay tau_j = max(d_j, 1) updates
    (d_j = ceil((n - 1 - j) / m), the most updates between a micro-batch's forward and its backward):

    - ``warmup_updates = K`` > 0, learning-rate rescheduling (T1): stage j's update k (k = 0, 1, ...)
      steps with lr * tau_j ** -p_k, p_k = max(1 - k / K, 0): early updates, whose gradients are the
      most stale relative to the weights they change, are damped by the delay, annealed to the plain lr.
    - ``discrepancy_correction=True`` (T2): a backward reads, instead of the current weights W, the
      forward's weights as predicted from the recent updates: W - delta_f * v, where delta_f is the
      number of updates since the micro-batch's forward and v an exponential moving average of the
      stage's per-update weight change, v <- g v + (1 - g) (W_new - W_old), g = ``decay`` ** (1 / tau_j).
    """

    warmup_updates: int = 0
    discrepancy_correction: bool = False
    decay: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.warmup_updates, int) or self.warmup_updates < 0:
            raise ValueError(f"warmup_updates must be a non-negative int, got {self.warmup_updates!r}")
        if not 0 <= self.decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {self.decay!r}")

    def lr_factor(self, j: int, update: int, stages: int, chunks: int) -> float:
        """T1's factor on stage j's learning rate for its update number ``update`` (1 when off)."""
        if not self.warmup_updates:
            return 1.0
        p = max(1 - update / self.warmup_updates, 0.0)
        return float(max(_delay(stages, j, chunks), 1) ** -p)

    def ema_decay(self, j: int, stages: int, chunks: int) -> float:
        """T2's g on stage j."""
        return float(self.decay ** (1 / max(_delay(stages, j, chunks), 1)))


def weight_buffers(schedule: str, stages: int, j: int, chunks: int, *, vertical_sync: bool = False) -> int:
    """The most weight versions stage j keeps at once in a stream (the live one, the ones batches in
    flight use and the ones later batches will need): PipeDream d_j + 1 (n - j at m = 1), with
    ``vertical_sync`` d_0 + 1, PipeDream-2BW 2 (1 with one stage), PipeMare and a synchronous
    schedule 1."""
    name = _check_stream(schedule, stages, chunks, vertical_sync)
    if not 0 <= j < stages:
        raise ValueError(f"no stage {j} of {stages}")
    if name == "PipeDream":
        return _delay(stages, 0 if vertical_sync else j, chunks) + 1
    return 2 if name == "PipeDream-2BW" and stages > 1 else 1


def _chunk_count(t: int, count: int | None, chunks: int) -> int | None:
    """Batch t's micro-batch count, checked: between 1 and the pipe's chunks, or None (the end)."""
    if count is not None and not 1 <= count <= chunks:
        raise ValueError(f"batch {t} has {count} micro-batches; a batch has between 1 and chunks={chunks}")
    return count


def stream_order(schedule: str, stages: int, j: int, chunks_of: Callable[[int], int | None], *, chunks: int,
                 vertical_sync: bool = False, forward_only: bool = False) -> Iterator[Action]:
    """Stage j's actions in a continuous pipeline, lazily: ``chunks_of(t)`` is batch t's micro-batch
    count, or None when the stream ends before batch t; it is called at most once per t, and only when
    the next action depends on it (a runtime's may block until the batch is announced).

    ``forward_only``: F(t, i, j) for every micro-batch, batch after batch. Otherwise 1F1B over the
    global micro-batch sequence: the next forward while fewer than n - j micro-batches are forwarded
    and not backwarded (1F1B's activation bound) and that forward is allowed, else the oldest pending
    backward, and U(t) right after batch t's last backward. A batch's first forward is allowed once
    its batch exists and, under PipeDream and PipeDream-2BW, once the weight version it uses
    (``weight_version``) exists: 2BW with m < n - 1 waits here, running backwards instead, which never
    deadlocks since a backward waits only for later stages. Ends once the stream has ended and no
    backward is pending. Deterministic: a pure function of the arguments and ``chunks_of``'s values."""
    name = _check_stream(schedule, stages, chunks, vertical_sync)
    if not 0 <= j < stages:
        raise ValueError(f"no stage {j} of {stages}")
    counts: dict[int, int | None] = {}

    def count(t: int) -> int | None:
        if t not in counts:
            counts[t] = _chunk_count(t, chunks_of(t), chunks)
        return counts[t]

    if forward_only:
        t = 0
        while (m := count(t)) is not None:
            yield from (Action("F", i, j, t) for i in range(m))
            t += 1
        return
    version = _stashed_version(name, j, stages, chunks, vertical_sync)
    pending: deque[tuple[int, int, bool]] = deque()  # (t, i, i is t's last) forwarded here, not backwarded
    t, i, updates, ended = 0, 0, 0, False
    while True:
        waits = version is not None and i == 0 and version(t) > updates
        if not ended and len(pending) < stages - j and not waits:
            m = count(t)
            ended = m is None
            if m is not None:
                yield Action("F", i, j, t)
                pending.append((t, i, i == m - 1))
                t, i = (t, i + 1) if i + 1 < m else (t + 1, 0)
                continue
        if not pending:
            return
        bt, bi, last = pending.popleft()
        yield Action("B", bi, j, bt)
        if last:
            yield Action("U", -1, j, bt)
            updates += 1


def _stashed_version(name: str, j: int, stages: int, chunks: int,
                     vertical_sync: bool) -> Callable[[int], int] | None:
    """Batch t -> the version it uses on stage j, under the rules that stash one (PipeDream and
    PipeDream-2BW); None under the others, whose forwards need no version to exist first."""
    if name not in ("PipeDream", "PipeDream-2BW"):
        return None
    return lambda t: weight_version(name, t, j, stages, chunks, vertical_sync=vertical_sync)


def _batch_counts(chunks: int, batches: int | Sequence[int]) -> list[int]:
    """Each batch's micro-batch count: ``batches`` batches of ``chunks``, or the counts given."""
    counts = [chunks] * batches if isinstance(batches, int) else list(batches)
    for t, c in enumerate(counts):
        _chunk_count(t, c, chunks)
    return counts


def stream_orders(schedule: str, stages: int, chunks: int, batches: int | Sequence[int], *,
                  vertical_sync: bool = False, forward_only: bool = False) -> list[list[Action]]:
    """Every stage's ``stream_order`` over a finite stream: ``batches`` batches of ``chunks``
    micro-batches, or a micro-batch count per batch (such as an unequal last batch)."""
    counts = _batch_counts(chunks, batches)

    def chunks_of(t: int) -> int | None:
        return counts[t] if t < len(counts) else None

    return [list(stream_order(schedule, stages, j, chunks_of, chunks=chunks, vertical_sync=vertical_sync,
                              forward_only=forward_only)) for j in range(stages)]


def check_stream_orders(schedule: str, orders: Sequence[Sequence[Action]], stages: int, chunks: int,
                        batches: int | Sequence[int], *, vertical_sync: bool = False,
                        forward_only: bool = False) -> None:
    """Raise ValueError listing every broken invariant that a runtime following the stream ``orders``
    (one per stage) relies on: every F(t, i, j) and B(t, i, j) exactly once, on stage j; forwards and
    backwards each in (t, i) order (BatchNorm's statistics and the versions rely on it); F before its
    B; U(t) exactly once, after batch t's last backward and before B(t + 1, 0) (so a backward of
    batch t sees t updates); at most n - j micro-batches in flight on stage j; the versions: under
    PipeDream and PipeDream-2BW, F(t, 0, j) after the updates that create ``weight_version`` (exactly
    that many under PipeDream without vertical sync: the newest), and at most ``weight_buffers``
    versions in use at once (the live one and those of the batches in flight); under PipeMare,
    ``pipemare_forward_version`` updates before F(t, i, j) (while the batches before t are full: the
    closed form counts in whole batches) and t before B(t, i, j). ``forward_only``: the forwards only."""
    name = _check_stream(schedule, stages, chunks, vertical_sync)
    counts = _batch_counts(chunks, batches)
    problems = [f"{len(orders)} stage orders for {stages} stages"] if len(orders) != stages else []
    for j, order in enumerate(orders[:stages]):
        problems += [f"stage {j}: {p}" for p in _stream_problems(name, list(order), j, stages, chunks, counts,
                                                                 vertical_sync, forward_only)]
    _raise_problems("the stream orders", problems)


def _stream_problems(name: str, order: list[Action], j: int, n: int, m: int, counts: list[int],
                     vertical_sync: bool, forward_only: bool) -> list[str]:
    """What breaks ``check_stream_orders``'s invariants in stage j's order."""
    micro = [(t, i) for t, c in enumerate(counts) for i in range(c)]
    kinds = "F" if forward_only else "FBU"
    expected = {k: [Action(k, i, j, t) for t, i in micro] for k in "FB"}
    expected["U"] = [Action("U", -1, j, t) for t in range(len(counts))]
    known = {a for k in kinds for a in expected[k]}
    foreign = [a for a in order if a not in known]
    if foreign:
        return [f"{a} is not an action of stage {j} in this stream" for a in foreign[:4]]
    problems = [problem for k in kinds for problem in _sequence_problems(k, order, expected[k])]
    if problems:
        return problems
    return [] if forward_only else _timing_problems(name, order, j, n, m, counts, vertical_sync)


def _sequence_problems(kind: str, order: list[Action], expected: list[Action]) -> list[str]:
    """Where stage j's actions of one ``kind`` differ from the ``expected`` sequence: repeats, gaps,
    or the (t, i) order broken."""
    got = [a for a in order if a.kind == kind]
    seen = set()
    for a in got:
        if a in seen:
            return [f"{a} appears again"]
        seen.add(a)
    missing = [a for a in expected if a not in seen]
    if missing:
        return [f"{len(missing)} {kind} actions in no order, first {missing[:4]}"]
    wrong = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    return [] if wrong is None else [f"{got[wrong]} out of (t, i) order: {expected[wrong]} comes first"]


def _timing_problems(name: str, order: list[Action], j: int, n: int, m: int, counts: list[int],
                     vertical_sync: bool) -> list[str]:
    """The invariants that depend on where the actions sit in stage j's order (each action present
    once, forwards and backwards in order): F before its B, each U after its batch's backwards and
    before the next batch's, the in-flight bound, and the versions."""
    problems: list[str] = []
    forwarded: set[tuple[int, int]] = set()
    backwarded = [0] * len(counts)
    in_flight, updates, newest = 0, 0, -1  # newest: the last batch forwarded here
    version = _stashed_version(name, j, n, m, vertical_sync)
    buffers = weight_buffers(name, n, j, m, vertical_sync=vertical_sync)
    full = [all(c == m for c in counts[:t]) for t in range(len(counts))]  # PipeMare's form counts whole batches
    for a in order:
        if a.kind == "F":
            if version is not None and a.i == 0:
                if updates < version(a.t):
                    problems.append(f"{a} after {updates} updates: it uses version {version(a.t)}, not made yet")
                elif name == "PipeDream" and not vertical_sync and updates != version(a.t):
                    problems.append(f"{a} after {updates} updates: it uses version {version(a.t)}, not the newest")
            if name == "PipeMare" and full[a.t] and updates != pipemare_forward_version(a.t, a.i, j, n, m):
                problems.append(f"{a} after {updates} updates, pipemare_forward_version says "
                                f"{pipemare_forward_version(a.t, a.i, j, n, m)}")
            forwarded.add((a.t, a.i))
            newest = a.t
            in_flight += 1
            if in_flight > n - j:
                problems.append(f"{in_flight} micro-batches in flight at {a}, at most n - j = {n - j}")
        elif a.kind == "B":
            if (a.t, a.i) not in forwarded:
                problems.append(f"{a} comes before its forward")
            if updates != a.t:
                problems.append(f"{a} after {updates} updates: it comes "
                                + (f"before U({a.t - 1})" if updates < a.t else f"after U({a.t})"))
            backwarded[a.t] += 1
            in_flight -= 1
        else:
            if backwarded[a.t] != counts[a.t]:
                problems.append(f"{a} after {backwarded[a.t]} of batch {a.t}'s {counts[a.t]} backwards")
            updates += 1
        if version is not None:
            in_use = {version(t) for t in range(updates, newest + 1)} | {updates}
            if len(in_use) > buffers:
                problems.append(f"{len(in_use)} weight versions in use at {a} ({sorted(in_use)}), {name} keeps "
                                f"{buffers}")
    return problems[:4]
