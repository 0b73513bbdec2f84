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

from rrefpipe.schedule import (SCHEDULES, Action, check_orders, format_orders, parse_schedule, peak_in_flight,
                               simulate, stage_worker, worker_orders)


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


@pytest.mark.parametrize("name", ["gpipe", "GPIPE", "1f1b", "interleaved1f1b", "Interleaved1F1B"])
def test_schedule_names_in_any_case(name):
    assert parse_schedule(name) in SCHEDULES
    assert parse_schedule(name).lower() == name.lower()


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ValueError, match="GPipe, 1F1B, Interleaved1F1B.*'pipedream'"):
        parse_schedule("pipedream")
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
        for costs in (None, {"F": 1, "B": 2}, {"F": 3, "B": 1}):
            sim = simulate(orders, costs)
            assert len(sim.starts) == 2 * n * m, (name, n, m, v)


def test_gpipe_and_1f1b_take_2_m_plus_n_minus_1_ticks_at_unit_costs():
    for name, n, m, v in grid():
        if name != "Interleaved1F1B":
            assert simulate(worker_orders(name, n, m)).makespan == 2 * (m + n - 1), (name, n, m)


def test_simulated_starts_respect_the_dependencies():
    for name, n, m, v in grid():
        starts = simulate(worker_orders(name, n, m, v), {"F": 1, "B": 2}).starts
        for i, j in itertools.product(range(m), range(n)):
            if j:
                assert starts[Action("F", i, j)] >= starts[Action("F", i, j - 1)] + 1
            after = Action("B", i, j + 1) if j < n - 1 else Action("F", i, j)
            assert starts[Action("B", i, j)] >= starts[after] + (2 if after.kind == "B" else 1)


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
