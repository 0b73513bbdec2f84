import pytest

from rrefpipe.schedule import checkpoint_stop, clock_cycles, ideal_efficiency


def test_clock_cycles_cover_every_pair_once_in_dependency_order():
    m, n = 4, 3
    seen = {}
    for tick, pairs in enumerate(clock_cycles(m, n)):
        for i, j in pairs:
            assert i + j == tick
            seen[(i, j)] = tick
    assert sorted(seen) == [(i, j) for i in range(m) for j in range(n)]
    assert all(seen[(i, j)] > seen[(i, j - 1)] for i in range(m) for j in range(1, n))


@pytest.mark.parametrize("mode, expected", [("always", 5), ("except_last", 4), ("never", 0)])
def test_checkpoint_stop(mode, expected):
    assert checkpoint_stop(mode, 5) == expected
    assert checkpoint_stop(mode, 5, enabled=False) == 0


def test_ideal_efficiency():
    assert ideal_efficiency(8, 2) == pytest.approx(8 / 9)


# The schedule as data (issue 41): orders per worker, their invariants, a tick simulation, a table.

import itertools

from rrefpipe.schedule import (SCHEDULES, Action, check_orders, check_schedule, format_orders, is_split, is_v_shaped,
                               parse_schedule, peak_in_flight, simulate, stage_layout, stage_worker, worker_orders,
                               worker_peaks)


def labels(orders, with_stage=False):
    return [" ".join(a.label(with_stage) for a in order) for order in orders]


def grid():
    """Every schedule over small (stages, chunks, stages_per_worker) that it accepts."""
    for n, m in itertools.product(range(1, 7), range(1, 9)):
        yield "GPipe", n, m, 1
        yield "1F1B", n, m, 1
        for v in range(1, n + 1):
            if n % v == 0 and m % (n // v) == 0:
                yield "Interleaved1F1B", n, m, v
            if n % v == 0:
                yield "InterleavedZeroBubble", n, m, v
        if n % 2 == 0:
            yield "ZBVZeroBubble", n, m, 2
            if m >= n:
                yield "DualPipeV", n, m, 2


def ends(orders):
    """Per (i, j), the kind of action that carries its gradient back: "B", or "I" where it is split."""
    return {(a.i, a.j): a.kind for order in orders for a in order if a.kind in "BI"}


@pytest.mark.parametrize("name", ["gpipe", "GPIPE", "1f1b", "interleaved1f1b", "Interleaved1F1B"])
def test_schedule_names_in_any_case(name):
    assert parse_schedule(name) in SCHEDULES
    assert parse_schedule(name).lower() == name.lower()


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ValueError, match="GPipe, 1F1B, Interleaved1F1B.*'pipedream-3bw'"):
        parse_schedule("pipedream-3bw")
    with pytest.raises(ValueError, match="must be one of"):
        worker_orders("1F1B-interleaved", 2, 4)


@pytest.mark.parametrize("args, message", [
    (("GPipe", 0, 4), "at least one stage and one micro-batch, got stages=0"),
    (("1F1B", 2, 0), "got stages=2, chunks=0"),
    (("Interleaved1F1B", 4, 4, 3), r"stages_per_worker=3 must be a positive divisor .* \[1, 2, 4\]"),
    (("Interleaved1F1B", 4, 4, 0), "stages_per_worker=0 must be a positive divisor"),
    (("1F1B", 4, 4, 2), "stages_per_worker=2 needs a schedule that runs several stages on a worker: "
                        "schedule='Interleaved1F1B' or 'InterleavedZeroBubble'.*; 1F1B runs one stage"),
    (("gpipe", 4, 4, 2), "GPipe runs one stage per worker"),
    (("Interleaved1F1B", 8, 6, 2), r"rounds of the worker count \(4 = 8 stages / 2 per worker\).*multiple of 4, "
                                   r"got 6: use chunks=8 or 4"),
    (("Interleaved1F1B", 8, 3, 2), "multiple of 4, got 3: use chunks=4$"),
])
def test_arguments_that_do_not_fit_say_what_to_change(args, message):
    with pytest.raises(ValueError, match=message):
        worker_orders(*args)


def test_gpipe_runs_backwards_last_micro_batch_first_as_the_runtime_does():
    assert labels(worker_orders("GPipe", 2, 3)) == ["F0 F1 F2 B2 B1 B0"] * 2


def test_1f1b_order_two_stages_four_micro_batches():
    # Hand-checked: stage 0 warms up with n - 0 = 2 forwards, stage 1 with 1; then B, F alternate.
    orders = worker_orders("1F1B", 2, 4)
    assert labels(orders) == ["F0 F1 B0 F2 B1 F3 B2 B3",
                              "F0 B0 F1 B1 F2 B2 F3 B3"]
    assert format_orders(orders) == (
        "tick      0  1  2  3  4  5  6  7  8  9\n"
        "worker 0  F0 F1 .  B0 F2 B1 F3 B2 .  B3\n"
        "worker 1  .  F0 B0 F1 B1 F2 B2 F3 B3 .")


def test_interleaved_order_four_stages_two_per_worker_four_micro_batches():
    # Hand-checked against Megatron's rule: worker r warms up with (v-1)p + 2(p-1-r) forwards (4, 2),
    # forwards go in rounds of p = 2 micro-batches through the worker's stages (0 then 2; 1 then 3),
    # backwards through them in reverse. Same as torch.distributed.pipelining 2.13's
    # ScheduleInterleaved1F1B (see test_interleaved_order_is_torch_pipelinings).
    orders = worker_orders("Interleaved1F1B", 4, 4, stages_per_worker=2)
    assert labels(orders, with_stage=True) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]
    assert format_orders(orders) == (
        "tick      0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17\n"
        "worker 0  0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 .   2B2 .   2B3 0B2 0B3\n"
        "worker 1  .   1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 .")
    assert [stage_worker(j, 4, 2) for j in range(4)] == [0, 1, 0, 1]


def test_interleaved_order_is_torch_pipelinings():
    """Compared with torch.distributed.pipelining's ScheduleInterleaved1F1B (torch 2.13,
    ``_calculate_single_rank_operations``, its padding dropped) for p = 1..4 workers, v = 1..3, m = p..3p.
    1F1B was compared by reading ``Schedule1F1B._step_microbatches`` (min(m, n - j) warm-ups, then
    B, F until the forwards run out, then B): its ``_get_pipeline_order`` table numbers the last
    stage's forwards from 1 (F1..F4 for m = 4) and so was not usable."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = schedules.ScheduleInterleaved1F1B
    if not hasattr(cls, "_calculate_single_rank_operations"):
        pytest.skip("this torch computes its interleaved order elsewhere")
    for p, v in itertools.product(range(1, 5), range(1, 4)):
        for m in range(p, 3 * p + 1, p):
            theirs = cls.__new__(cls)
            theirs.pp_group_size, theirs.n_local_stages, theirs._n_microbatches = p, v, m
            theirs.number_of_rounds, theirs.microbatches_per_round = m // p, p
            expected = [[Action(a.computation_type.value, a.microbatch_index, a.stage_index)
                         for a in theirs._calculate_single_rank_operations(r) if a is not None] for r in range(p)]
            assert worker_orders("Interleaved1F1B", p * v, m, v) == expected, (p, v, m)


def test_every_order_keeps_the_invariants_and_never_deadlocks():
    for name, n, m, v in grid():
        orders = worker_orders(name, n, m, v)
        check_orders(orders, n, m, name, stages_per_worker=v)
        split = sum(kind == "I" for kind in ends(orders).values())
        assert (split > 0) == is_split(name) and len(ends(orders)) == n * m, (name, n, m, v)
        for costs in (None, {"F": 1, "B": 2}, {"F": 3, "B": 1, "I": 2, "W": 1}, {"F": 1, "I": 1, "W": 4}):
            sim = simulate(orders, costs)
            assert len(sim.starts) == 2 * n * m + split, (name, n, m, v)


def test_gpipe_and_1f1b_take_2_m_plus_n_minus_1_ticks_at_unit_costs():
    for name, n, m, v in grid():
        if name in ("GPipe", "1F1B"):
            assert simulate(worker_orders(name, n, m)).makespan == 2 * (m + n - 1), (name, n, m)


def test_simulated_starts_respect_the_dependencies():
    costs = {"F": 1, "B": 2, "I": 3, "W": 1}
    for name, n, m, v in grid():
        orders = worker_orders(name, n, m, v)
        starts, back = simulate(orders, costs).starts, ends(orders)
        for i, j in itertools.product(range(m), range(n)):
            if j:
                assert starts[Action("F", i, j)] >= starts[Action("F", i, j - 1)] + 1
            after = Action(back[i, j + 1], i, j + 1) if j < n - 1 else Action("F", i, j)
            assert starts[Action(back[i, j], i, j)] >= starts[after] + costs[after.kind], (name, n, m, v, i, j)
            if back[i, j] == "I":
                assert starts[Action("W", i, j)] >= starts[Action("I", i, j)] + costs["I"]


def test_1f1b_holds_at_most_n_minus_j_micro_batches_gpipe_all_m():
    for n, m in itertools.product(range(1, 7), range(1, 9)):
        assert peak_in_flight(worker_orders("1F1B", n, m), n) == [min(n - j, m) for j in range(n)]
        assert peak_in_flight(worker_orders("GPipe", n, m), n) == [m] * n


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("m", [4, 8])
@pytest.mark.parametrize("costs", [None, {"F": 1, "B": 2}])
def test_interleaved_has_a_smaller_bubble_than_1f1b_on_the_same_workers(workers, m, costs):
    one = simulate(worker_orders("1F1B", workers, m), costs)
    two = simulate(worker_orders("Interleaved1F1B", 2 * workers, m, stages_per_worker=2), costs)
    assert two.bubble < one.bubble
    half = {k: c / 2 for k, c in {"F": 1, "B": 1, **(costs or {})}.items()}  # the same model cut finer
    assert simulate(worker_orders("Interleaved1F1B", 2 * workers, m, 2), half).makespan < one.makespan


def test_check_orders_lists_every_broken_invariant():
    orders = worker_orders("1F1B", 2, 2)  # F0 F1 B0 B1 / F0 B0 F1 B1
    broken = [[Action("B", 0, 0), Action("F", 0, 0), Action("F", 1, 0), Action("F", 1, 0), Action("F", 0, 1)],
              orders[1][1:] + [Action("F", 5, 1)]]
    with pytest.raises(ValueError) as e:
        check_orders(broken, 2, 2)
    text = str(e.value)
    assert "worker 0: Action(kind='B', i=0, j=0) comes before its forward" in text
    assert "worker 0: Action(kind='F', i=1, j=0) appears again" in text
    assert "worker 0: Action(kind='F', i=0, j=1) belongs to worker 1" in text
    assert "worker 1: Action(kind='F', i=5, j=1) is not an action of 2 micro-batches on 2 stages" in text
    assert "1 actions in no order" in text and "B', i=1, j=0" in text
    with pytest.raises(ValueError, match="1 worker orders for 2 workers"):
        check_orders(orders[:1], 2, 2)


def test_check_orders_holds_1f1b_to_its_in_flight_bound():
    gpipe = worker_orders("GPipe", 3, 4)
    check_orders(gpipe, 3, 4, "GPipe")
    with pytest.raises(ValueError, match="stage 1: 4 micro-batches in flight, 1F1B allows 2"):
        check_orders(gpipe, 3, 4, "1f1b")
    with pytest.raises(ValueError, match="Action.kind='F', i=0, j=7. is not an action"):
        check_orders([gpipe[0] + [Action("F", 0, 7)]] + gpipe[1:], 3, 4, "1F1B")


def test_an_order_that_cannot_proceed_is_a_deadlock():
    orders = [[Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)],
              [Action("F", 1, 1), Action("B", 1, 1), Action("F", 0, 1), Action("B", 0, 1)]]
    check_orders(orders, 2, 2)  # each action once, forwards first: only the simulation sees it
    with pytest.raises(ValueError, match=r"deadlock at tick 1: worker 0 at Action\(kind='B', i=0, j=0\) waits "
                                         r"for Action\(kind='B', i=0, j=1\); worker 1 at .*'F', i=1, j=1.* waits"):
        simulate(orders)
    with pytest.raises(ValueError, match="waits for Action"):
        simulate([[Action("B", 0, 0)], []])  # backward of stage 0 of 2 needs stage 1's, which no order holds
    with pytest.raises(ValueError, match="costs must be positive"):
        simulate(orders, {"B": 0})


# The zero-bubble schedules (issue 49): split backward (I, W), the V layout, their bubbles and memory.

UNIT = {"F": 1, "I": 1, "W": 1}
FUSED_AS_SPLIT = {"F": 1, "I": 1, "W": 1, "B": 2}  # a fused backward weighs its two halves


def valid(name, n, v, chunks=range(1, 17)):
    for m in chunks:
        try:
            check_schedule(name, n, m, v)
        except ValueError:
            continue
        yield m


@pytest.mark.parametrize("name, v, split, fused, v_shaped", [
    ("GPipe", 1, False, True, False), ("1F1B", 1, False, True, False), ("Interleaved1F1B", 2, False, True, False),
    ("interleavedzerobubble", 2, True, False, False), ("ZBVZEROBUBBLE", 2, True, False, True),
    ("dualpipev", 2, True, True, True)])
def test_which_schedules_split_backward_and_which_are_v_shaped(name, v, split, fused, v_shaped):
    assert parse_schedule(name) in SCHEDULES
    assert is_split(name) is split and is_v_shaped(name) is v_shaped
    kinds = {a.kind for order in worker_orders(name, 4, 8, v) for a in order}
    assert ({"I", "W"} <= kinds, bool({"I", "W"} & kinds), "B" in kinds) == (split, split, fused)


def test_v_layout_puts_stage_j_and_2p_minus_1_minus_j_on_one_worker():
    for name, p in itertools.product(("ZBVZeroBubble", "DualPipeV"), range(1, 6)):
        layout = stage_layout(name, 2 * p, 2)
        assert layout[0] == layout[-1] == 0 and layout[p - 1] == layout[p] == p - 1
        assert all(layout[j] == layout[2 * p - 1 - j] == min(j, 2 * p - 1 - j) for j in range(2 * p))
        assert sorted(layout) == sorted(list(range(p)) * 2)
        assert [stage_worker(j, 2 * p, 2, name) for j in range(2 * p)] == layout
    for name in ("GPipe", "Interleaved1F1B", "InterleavedZeroBubble"):  # the loop layout, as stage_worker had it
        for n, v in ((4, 1), (6, 2), (6, 3)):
            if name == "GPipe" and v > 1:
                continue
            assert stage_layout(name, n, v) == [stage_worker(j, n, v) for j in range(n)] == [j % (n // v)
                                                                                             for j in range(n)]
    assert stage_worker(3, 4, 2) == 1 and stage_worker(3, 4, 2, "ZBVZeroBubble") == 0


@pytest.mark.parametrize("args, message", [
    (("ZBVZeroBubble", 4, 8, 1), "ZBVZeroBubble puts two stages on each worker in a V .*: use stages_per_worker=2, "
                                 "got 1"),
    (("DualPipeV", 8, 8, 4), "DualPipeV puts two stages on each worker .*use stages_per_worker=2, got 4"),
    (("ZBVZeroBubble", 5, 8, 2), "the stage count must be even, got stages=5: use stages=6 or 4"),
    (("DualPipeV", 6, 5, 2), "too few micro-batches for DualPipeV: chunks >= 6 .*got chunks=5"),
    (("InterleavedZeroBubble", 6, 4, 4), "stages_per_worker=4 must be a positive divisor .* \\[1, 2, 3, 6\\]"),
    (("GPipe", 4, 4, 2), "'Interleaved1F1B' or 'InterleavedZeroBubble' .* 'ZBVZeroBubble' or 'DualPipeV' \\(2\\); "
                         "GPipe runs one stage"),
])
def test_zero_bubble_arguments_that_do_not_fit_say_what_to_change(args, message):
    with pytest.raises(ValueError, match=message):
        worker_orders(*args)
    with pytest.raises(ValueError, match=message):
        check_schedule(*args)


def test_what_each_zero_bubble_schedule_accepts():
    assert list(valid("DualPipeV", 6, 2)) == list(range(6, 17))  # torch.distributed.pipelining's minimum
    assert list(valid("ZBVZeroBubble", 6, 2)) == list(range(1, 17))
    assert list(valid("InterleavedZeroBubble", 6, 2)) == list(range(1, 17))  # no rounds: any m
    assert list(valid("InterleavedZeroBubble", 3, 1)) == list(range(1, 17))  # v = 1: ZB-H1


def zero_bubble_cases():
    """(name, stages, chunks, v) of the split schedules for p = 1..4 workers, chunks up to 16."""
    for p in range(1, 5):
        for v in (1, 2, 3):
            yield from (("InterleavedZeroBubble", p * v, m, v) for m in valid("InterleavedZeroBubble", p * v, v))
        for name in ("ZBVZeroBubble", "DualPipeV"):
            yield from ((name, 2 * p, m, 2) for m in valid(name, 2 * p, 2))


def test_zero_bubble_orders_keep_the_invariants_and_never_deadlock():
    for name, n, m, v in zero_bubble_cases():
        orders = worker_orders(name, n, m, v)
        check_orders(orders, n, m, name, v)
        for costs in (UNIT, FUSED_AS_SPLIT, {"F": 1, "I": 2, "W": 3, "B": 5}, {"F": 3, "I": 1, "W": 0.5}):
            simulate(orders, costs)  # raises on a deadlock
        kinds = {(a.kind, a.j) for order in orders for a in order}
        if name == "DualPipeV":
            # fused B for most micro-batches, I/W for 2p - 1 - r on worker r (its docstring)
            assert [sum(a.kind == "I" for a in order) for order in orders] == [n - 1 - r for r in range(n // 2)]
        else:
            assert not any(kind == "B" for kind, _ in kinds)


def test_each_stage_runs_its_forwards_backwards_and_weight_gradients_in_micro_batch_order():
    """What a runtime may rely on: on each stage, the Fs, the backwards (B or I) and the Ws each go
    micro-batch 0, 1, 2, ... (a W may come long after its I, but never before an older W)."""
    for name, n, m, v in zero_bubble_cases():
        for order in worker_orders(name, n, m, v):
            for j in {a.j for a in order}:
                for kinds in ("F", "BI", "W"):
                    seen = [a.i for a in order if a.j == j and a.kind in kinds]
                    assert seen == sorted(seen), (name, n, m, v, j, kinds)


def test_zb_h1_bubble_is_two_thirds_of_1f1bs_on_1f1bs_memory():
    """InterleavedZeroBubble with one stage per worker: 2 (p - 1) idle ticks per worker against 1F1B's
    3 (p - 1) when its B weighs I + W, each stage holding no more than 1F1B's n - j."""
    for p, m in itertools.product(range(1, 6), range(1, 17)):
        zb, one = worker_orders("InterleavedZeroBubble", p, m), worker_orders("1F1B", p, m)
        assert simulate(zb, UNIT).makespan == 3 * m + 2 * (p - 1), (p, m)
        assert simulate(one, FUSED_AS_SPLIT).makespan == 3 * m + 3 * (p - 1), (p, m)
        if p > 1:
            assert simulate(zb, UNIT).bubble < simulate(one, FUSED_AS_SPLIT).bubble
            assert simulate(zb, UNIT).bubble < simulate(one).bubble  # and than 1F1B at F = B = 1
        assert peak_in_flight(zb, p) == peak_in_flight(one, p) == [min(m, p - j) for j in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_interleaved_zero_bubble_beats_interleaved_1f1b_on_its_per_stage_memory(p):
    for v in (2, 3):
        n = p * v
        for m in range(p, 4 * p + 1, p):
            zb, base = worker_orders("InterleavedZeroBubble", n, m, v), worker_orders("Interleaved1F1B", n, m, v)
            assert all(a <= b for a, b in zip(peak_in_flight(zb, n), peak_in_flight(base, n))), (p, v, m)
            assert simulate(zb, UNIT).bubble < simulate(base, FUSED_AS_SPLIT).bubble, (p, v, m)
            if m >= 2 * p:
                assert simulate(zb, UNIT).bubble < 0.75 * simulate(base, FUSED_AS_SPLIT).bubble, (p, v, m)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_zbv_is_near_zero_bubble_with_1f1bs_peak_on_every_worker(p):
    """ZBVZeroBubble: from m = 2p on, p - 1 idle ticks per worker (the least: worker p - 1 waits that long
    for its first forward) out of 6m; each worker holds at most 2p stage-halves, what 1F1B's worker 0
    holds of the same model in p stages (2 x p), its peak over the workers."""
    one_peak = max(peak_in_flight(worker_orders("1F1B", p, 4 * p), p))
    assert one_peak == p
    for m in range(1, 4 * p + 1):
        orders = worker_orders("ZBVZeroBubble", 2 * p, m, 2)
        sim = simulate(orders, UNIT)
        if m >= 2 * p:
            assert sim.makespan == 6 * m + p - 1, m
            assert sim.bubble == pytest.approx((p - 1) / (6 * m + p - 1)) and sim.bubble < 0.06
            if p > 1:
                assert sim.bubble < simulate(worker_orders("1F1B", p, m), FUSED_AS_SPLIT).bubble / 3
                if m % p == 0:
                    assert sim.bubble < simulate(worker_orders("Interleaved1F1B", 2 * p, m, 2), FUSED_AS_SPLIT).bubble
        peaks = worker_peaks(orders, 2 * p)
        assert max(peaks) <= 2 * one_peak, (m, peaks)
        if m >= 2 * p:
            assert peaks == [2 * p] * p, (m, peaks)
        assert peak_in_flight(orders, 2 * p) == [min(m, 2 * p - 1 - j if j < p else 2 * p - j) for j in range(2 * p)]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_dual_pipe_v_bubble_and_peak(p):
    """DualPipeV holds 2p stage-halves per worker at most (its backward runs before the forward DualPipe
    overlaps it with), as ZBVZeroBubble; its bubble is ZBVZeroBubble's when B weighs I + W."""
    for m in range(2 * p, 17):
        orders = worker_orders("DualPipeV", 2 * p, m, 2)
        assert worker_peaks(orders, 2 * p) == [2 * p] * p
        zbv = simulate(worker_orders("ZBVZeroBubble", 2 * p, m, 2), UNIT)
        assert simulate(orders, FUSED_AS_SPLIT).makespan <= zbv.makespan
        if p > 1:
            assert simulate(orders, FUSED_AS_SPLIT).bubble < simulate(worker_orders("1F1B", p, m),
                                                                      FUSED_AS_SPLIT).bubble / 3


def test_dual_pipe_v_is_torch_pipelinings_with_each_pair_backward_first():
    """torch.distributed.pipelining's ScheduleDualPipeV (torch 2.13) pairs a forward with the other stage's
    full backward (OVERLAP_F_B, forward listed first), and runs the last worker's first such pair unpaired,
    forward first. Run one action at a time, worker_orders puts the backward first in all of them (a
    micro-batch freed before the next is taken: 2p per worker, not 2p + 1); otherwise the same orders."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = schedules.ScheduleDualPipeV
    if not hasattr(cls, "_calculate_single_rank_operations"):
        pytest.skip("this torch computes its DualPipeV order elsewhere")
    for p in range(1, 5):
        for m in range(2 * p, 2 * p + 5):
            theirs = cls.__new__(cls)
            theirs.pp_group_size, theirs._n_microbatches = p, m
            expected = []
            for r in range(p):
                order = []
                for a in theirs._calculate_single_rank_operations(r):
                    subs = [Action(x.computation_type.value, x.microbatch_index, x.stage_index)
                            for x in (a.sub_actions or (a,))] if a is not None else []
                    order += subs[::-1]  # a pair: backward first
                if r == p - 1:  # the unpaired forward, backward of the first steady round
                    k = next(k for k, a in enumerate(order) if a.kind == "B")
                    order[k - 1:k + 1] = order[k - 1:k + 1][::-1]
                expected.append(order)
            assert worker_orders("DualPipeV", 2 * p, m, 2) == expected, (p, m)


def test_zero_bubble_tables_show_i_and_w():
    table = format_orders(worker_orders("ZBVZeroBubble", 4, 4, 2)).splitlines()
    assert table[0].startswith("tick      0 ") and len(table) == 3
    assert all(cell in table[1].split() for cell in ("0F0", "3F0", "3I0", "3W0", "0I3", "0W3"))
    assert all(cell in table[2].split() for cell in ("1F0", "2F0", "2I0", "1W3"))
    zb1 = format_orders(worker_orders("InterleavedZeroBubble", 2, 2)).splitlines()
    # Hand-checked: worker 1 (the last stage, 1 in flight) must run F I W per micro-batch; worker 0 may
    # hold 2, and between the I0 and I1 that worker 1 sends back it has only W0 to run.
    assert zb1[1].split()[2:] == ["F0", "F1", ".", "I0", "W0", ".", "I1", "W1"]
    assert zb1[2].split()[2:] == [".", "F0", "I0", "W0", "F1", "I1", "W1", "."]
    assert Action("I", 3, 5).label() == "I3" and Action("W", 3, 5).label(with_stage=True) == "5W3"


def test_peak_in_flight_ends_a_split_micro_batch_at_its_w():
    order = [[Action("F", 0, 0), Action("F", 1, 0), Action("I", 0, 0), Action("F", 2, 0), Action("W", 0, 0),
              Action("I", 1, 0), Action("W", 1, 0), Action("I", 2, 0), Action("W", 2, 0)]]
    assert peak_in_flight(order, 1) == worker_peaks(order, 1) == [3]
    fused = [[Action("F", 0, 0), Action("F", 1, 0), Action("B", 0, 0), Action("F", 2, 0), Action("B", 1, 0),
              Action("B", 2, 0)]]
    assert peak_in_flight(fused, 1) == [2]
    two = [[Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 1), Action("B", 0, 0)]]
    assert peak_in_flight(two, 2) == [1, 1] and worker_peaks(two, 2) == [2]


def test_check_orders_lists_broken_split_invariants():
    F, I, W, B = (lambda i, j, k=k: Action(k, i, j) for k in "FIWB")
    # 2 stages, 2 micro-batches, one stage per worker
    broken = [[F(0, 0), W(0, 0), I(0, 0), F(1, 0), B(1, 0), I(1, 0), W(1, 0)],
              [F(0, 1), I(0, 1), F(1, 1), B(1, 1)]]
    with pytest.raises(ValueError) as e:
        check_orders(broken, 2, 2)
    text = str(e.value)
    assert "worker 0: Action(kind='W', i=0, j=0) comes before its input gradient Action(kind='I', i=0, j=0)" in text
    assert "worker 0: Action(kind='I', i=1, j=0) after Action(kind='B', i=1, j=0): a micro-batch's backward" in text
    assert "actions in no order" in text and "Action(kind='W', i=0, j=1)" in text  # I without W
    # the V layout: stage 3 of 4 is worker 0's
    orders = worker_orders("ZBVZeroBubble", 4, 2, 2)
    check_orders(orders, 4, 2, "zbvzerobubble", 2)
    with pytest.raises(ValueError, match="Action.kind='F', i=0, j=3. belongs to worker 1"):
        check_orders(orders, 4, 2, None, 2)  # without the schedule: the loop layout


def test_check_orders_holds_zero_bubble_schedules_to_their_bounds():
    gpipe_like = [[Action("F", i, 0) for i in range(4)] + [a for i in range(4) for a in
                                                         (Action("I", i, 0), Action("W", i, 0))]]
    check_orders(gpipe_like, 1, 4)
    with pytest.raises(ValueError, match="stage 0: 4 micro-batches in flight, InterleavedZeroBubble allows 1"):
        check_orders(gpipe_like, 1, 4, "InterleavedZeroBubble")  # the last stage: 1F1B's n - j = 1
    two = worker_orders("InterleavedZeroBubble", 2, 4)
    late = [[a for a in two[0] if a.kind != "W"] + [a for a in two[0] if a.kind == "W"], two[1]]
    check_orders(late, 2, 4)
    with pytest.raises(ValueError, match="stage 0: 4 micro-batches in flight, InterleavedZeroBubble allows 2"):
        check_orders(late, 2, 4, "InterleavedZeroBubble")
    zbv = worker_orders("ZBVZeroBubble", 4, 6, 2)
    w0 = [a for a in zbv[0] if a.kind == "F"] + [a for a in zbv[0] if a.kind != "F"]  # every forward first
    with pytest.raises(ValueError, match=r"stage 0: 6 micro-batches in flight, ZBVZeroBubble allows 3(.|\n)*"
                                         r"worker 0: 12 stage-micro-batches in flight, ZBVZeroBubble allows 4"):
        check_orders([w0, zbv[1]], 4, 6, "ZBVZeroBubble", 2)
    dual = worker_orders("DualPipeV", 4, 6, 2)
    w0 = [a for a in dual[0] if a.kind == "F"] + [a for a in dual[0] if a.kind != "F"]
    with pytest.raises(ValueError, match="the orders break 1 .*\n  worker 0: 12 stage-micro-batches in flight, "
                                         "DualPipeV allows 4$"):
        check_orders([w0, dual[1]], 4, 6, "DualPipeV", 2)


def test_simulate_waits_for_the_next_stages_input_gradient_and_w_for_its_i():
    mixed = [[Action("F", 0, 0), Action("B", 0, 0)], [Action("F", 0, 1), Action("I", 0, 1), Action("W", 0, 1)]]
    sim = simulate(mixed, {"F": 1, "I": 2, "W": 5, "B": 1})
    assert sim.starts[Action("B", 0, 0)] == 4 and sim.makespan == 9  # after I(0, 1), not after its W
    with pytest.raises(ValueError, match=r"worker 0 at Action\(kind='W', i=0, j=0\) waits for "
                                         r"Action\(kind='I', i=0, j=0\)"):
        simulate([[Action("F", 0, 0), Action("W", 0, 0), Action("I", 0, 0)]])
    with pytest.raises(ValueError, match="costs must be positive"):
        simulate(mixed, {"W": 0})
