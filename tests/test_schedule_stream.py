"""Continuous pipelines as data (issue 50): the asynchronous rules' names, the stream orders with their
updates ``U``, the weight version each batch uses, the buffers a stage keeps, their invariants, and the
tick simulation of a stream against flushed 1F1B steps. Pure functions: no processes."""
from __future__ import annotations

import itertools

import pytest

from rrefpipe.schedule import (ASYNC_SCHEDULES, SCHEDULES, Action, check_orders, check_schedule, check_stream_orders,
                               format_orders, is_async, parse_schedule, pipemare_forward_version, simulate,
                               stage_layout, step_schedule, stream_order, stream_orders, weight_buffers,
                               weight_version, worker_orders)

pytestmark = pytest.mark.timeout(60)

#: Each rule as (schedule, vertical_sync).
RULES = [("PipeDream", False), ("PipeDream", True), ("PipeDream-2BW", False), ("PipeMare", False)]
COSTS = {"F": 1, "B": 2}


def F(i, j, t):
    return Action("F", i, j, t)


def B(i, j, t):
    return Action("B", i, j, t)


def U(j, t):
    return Action("U", -1, j, t)


def labels(order):
    return " ".join(a.label(with_batch=True) for a in order)


def batch_shapes(m, T):
    """Equal batches, an unequal last batch, and (where m > 1) short batches in the middle."""
    yield T
    if m > 1:
        yield [m] * (T - 1) + [m - 1]
        yield [1, m] * T


def updates_before(order, action):
    return sum(a.kind == "U" for a in order[:order.index(action)])


# -- names -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, canonical", [("pipedream", "PipeDream"), ("PIPEDREAM-2BW", "PipeDream-2BW"),
                                             ("pipemare", "PipeMare")])
def test_async_names_parse_in_any_case_and_stay_out_of_the_synchronous_tuple(name, canonical):
    assert parse_schedule(name) == canonical and is_async(name) and step_schedule(name) == "1F1B"
    assert canonical in ASYNC_SCHEDULES and canonical not in SCHEDULES
    assert not any(is_async(s) for s in SCHEDULES) and [step_schedule(s) for s in SCHEDULES] == list(SCHEDULES)
    with pytest.raises(ValueError, match="PipeDream, PipeDream-2BW, PipeMare .any case., got 'pipedreamx'"):
        parse_schedule("pipedreamx")


@pytest.mark.parametrize("name", ASYNC_SCHEDULES)
def test_one_step_of_a_continuous_schedule_is_1f1b(name):
    """One batch on its own, under any asynchronous rule, is plain 1F1B: what train_step runs."""
    assert check_schedule(name.lower(), 3, 4, 1) == name
    assert worker_orders(name, 3, 4) == worker_orders("1F1B", 3, 4)
    assert stage_layout(name, 3) == stage_layout("1F1B", 3)
    check_orders(worker_orders(name, 3, 4), 3, 4, name)  # 1F1B's in-flight bound checked
    with pytest.raises(ValueError, match="stage 0: 4 micro-batches in flight, 1F1B allows 3"):
        check_orders(worker_orders("GPipe", 3, 4), 3, 4, name)
    with pytest.raises(ValueError, match=f"{name} runs exactly one stage per worker .*use stages_per_worker=1, got 2"):
        check_schedule(name, 4, 4, 2)
    with pytest.raises(ValueError, match="exactly one stage per worker"):
        worker_orders(name, 4, 4, 2)


def test_an_action_without_a_batch_prints_as_before():
    assert Action("F", 1, 0) == Action("F", 1, 0, 0) and Action("F", 1, 0).t == 0
    assert repr(Action("B", 2, 1)) == "Action(kind='B', i=2, j=1)"
    assert repr(Action("B", 2, 1, 3)) == "Action(kind='B', i=2, j=1, t=3)"
    assert [a.label() for a in (Action("F", 3, 0), Action("W", 3, 5))] == ["F3", "W3"]
    assert Action("F", 3, 5).label(with_stage=True) == "5F3"
    assert [Action("F", 2, 0, 1).label(with_batch=True), Action("U", -1, 0, 4).label()] == ["F1.2", "U4"]
    assert format_orders(worker_orders("1F1B", stages=2, chunks=4)) == (
        "tick      0  1  2  3  4  5  6  7  8  9\n"
        "worker 0  F0 F1 .  B0 F2 B1 F3 B2 .  B3\n"
        "worker 1  .  F0 B0 F1 B1 F2 B2 F3 B3 .")


def test_a_stream_table_shows_batches_and_updates():
    """Batch t's update takes no tick: it joins the cell of the backward it follows."""
    assert format_orders(stream_orders("PipeDream", 2, 2, 2)) == (
        "tick      0    1    2    3    4       5       6    7    8       9\n"
        "worker 0  F0.0 F0.1 .    B0.0 F1.0    B0.1+U0 F1.1 B1.0 .       B1.1+U1\n"
        "worker 1  .    F0.0 B0.0 F0.1 B0.1+U0 F1.0    B1.0 F1.1 B1.1+U1 .")


# -- weight versions -------------------------------------------------------------------------------

def test_weight_versions_by_hand():
    """The issue's formulas written out: PipeDream at m = 1 is max(t - (n - 1 - j), 0); with m micro-batches
    per batch the delay is d_j = ceil((n - 1 - j) / m) batches."""
    def versions(name, t, n, m, **kw):
        return [weight_version(name, t, j, n, m, **kw) for j in range(n)]

    assert versions("PipeDream", 5, 4, 1) == [2, 3, 4, 5]       # 5 - 3, 5 - 2, 5 - 1, 5 - 0
    assert versions("PipeDream", 1, 4, 1) == [0, 0, 0, 1]       # max(1 - d, 0)
    assert versions("PipeDream", 5, 4, 2) == [3, 4, 4, 5]       # d = [2, 1, 1, 0]
    assert versions("PipeDream", 5, 4, 4) == [4, 4, 4, 5]       # d = [1, 1, 1, 0]
    assert versions("PipeDream", 5, 4, 1, vertical_sync=True) == [2, 2, 2, 2]  # d_0 = 3 everywhere
    assert versions("PipeDream", 5, 4, 4, vertical_sync=True) == [4, 4, 4, 4]
    assert [weight_version("PipeDream-2BW", t, 1, 3, 2) for t in range(4)] == [0, 0, 1, 2]
    assert [weight_version("1F1B", t, 0, 3, 2) for t in range(4)] == [0, 1, 2, 3]
    # PipeMare: F(t, i) sees max(floor((t m + i - (n - 1 - j)) / m), 0); n = 3, m = 4, stage 0, batch 3:
    assert [pipemare_forward_version(3, i, 0, 3, 4) for i in range(4)] == [2, 2, 3, 3]
    assert [pipemare_forward_version(3, i, 2, 3, 4) for i in range(4)] == [3, 3, 3, 3]
    assert [weight_buffers("PipeDream", 4, j, 1) for j in range(4)] == [4, 3, 2, 1]
    assert [weight_buffers("PipeDream", 4, j, 2, vertical_sync=True) for j in range(4)] == [3, 3, 3, 3]
    assert [weight_buffers(name, 3, 0, 2) for name in ("PipeDream-2BW", "PipeMare", "1F1B")] == [2, 1, 1]


@pytest.mark.parametrize("call, message", [
    (lambda: weight_version("PipeMare", 2, 0, 3, 2), "PipeMare stashes no weight version"),
    (lambda: weight_version("PipeDream-2BW", 2, 0, 3, 2, vertical_sync=True), "vertical_sync=True goes with "
                                                                             "schedule='PipeDream' only"),
    (lambda: weight_buffers("PipeMare", 3, 0, 2, vertical_sync=True), "got schedule='PipeMare'"),
    (lambda: stream_orders("1F1B", 3, 2, 2, vertical_sync=True), "vertical_sync=True goes with"),
    (lambda: weight_version("PipeDream", 0, 3, 3, 2), "no stage 3 of 3"),
    (lambda: stream_orders("PipeDream", 2, 2, [2, 3]), "batch 1 has 3 micro-batches; .* between 1 and chunks=2"),
])
def test_versions_refuse_what_does_not_fit(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("name, vertical_sync", RULES)
def test_one_stage_or_no_delay_is_plain_synchronous_training(name, vertical_sync):
    """\"With one stage, or a delay of 0, each rule is plain synchronous training": batch t runs on the
    weights after t updates, in the order F, B of each micro-batch, then U."""
    for m, T in itertools.product((1, 2, 4), (1, 3, 6)):
        (order,) = stream_orders(name, 1, m, T, vertical_sync=vertical_sync)
        steps = [[a for i in range(m) for a in (F(i, 0, t), B(i, 0, t))] + [U(0, t)] for t in range(T)]
        assert order == [a for step in steps for a in step]
        for t in range(T):
            if name == "PipeMare":
                assert [pipemare_forward_version(t, i, 0, 1, m) for i in range(m)] == [t] * m
            else:
                assert weight_version(name, t, 0, 1, m, vertical_sync=vertical_sync) == t
        assert weight_buffers(name, 1, 0, m, vertical_sync=vertical_sync) == 1
    if not vertical_sync and name == "PipeDream":  # the last stage: d = 0
        assert [weight_version(name, t, 3, 4, 1) for t in range(5)] == list(range(5))
        assert weight_buffers(name, 4, 3, 1) == 1


@pytest.mark.parametrize("name, vertical_sync", RULES)
def test_the_closed_forms_are_the_updates_counted_in_the_orders(name, vertical_sync):
    """Counted before each action: PipeDream's F(t, 0) sees exactly its version (the newest), with
    vertical sync or 2BW at least it; PipeMare's F(t, i) sees pipemare_forward_version and every B(t, i)
    exactly t. Equal batches and an unequal last one (the closed forms count whole batches)."""
    for n, m, T in itertools.product(range(1, 5), (1, 2, 4), (1, 3, 6)):
        for batches in list(batch_shapes(m, T))[:2]:
            counts = [m] * T if isinstance(batches, int) else batches
            for j, order in enumerate(stream_orders(name, n, m, batches, vertical_sync=vertical_sync)):
                for t, c in enumerate(counts):
                    assert all(updates_before(order, Action("B", i, j, t)) == t for i in range(c))
                    seen = [updates_before(order, Action("F", i, j, t)) for i in range(c)]
                    if name == "PipeMare":
                        assert seen == [pipemare_forward_version(t, i, j, n, m) for i in range(c)], (n, m, j, t)
                        continue
                    v = weight_version(name, t, j, n, m, vertical_sync=vertical_sync)
                    assert seen[0] == v if name == "PipeDream" and not vertical_sync else seen[0] >= v, (n, m, j, t)


@pytest.mark.parametrize("name, vertical_sync", RULES[:3])
def test_weight_buffers_are_the_versions_counted_in_use(name, vertical_sync):
    """At each point of stage j's order, the versions it must hold: the live one, those of the batches
    forwarded and not yet updated, and those later batches will need that exist already. Their most is
    weight_buffers, reached once the stream is long enough (T = 6 here)."""
    for n, m, T in itertools.product(range(1, 5), (1, 2, 4), (1, 3, 6)):
        for j, order in enumerate(stream_orders(name, n, m, T, vertical_sync=vertical_sync)):
            version = [weight_version(name, t, j, n, m, vertical_sync=vertical_sync) for t in range(T)]
            started, updates, peak = set(), 0, 0
            for a in order:
                started |= {a.t} if a.kind == "F" else set()
                updates += a.kind == "U"
                in_use = ({version[t] for t in started if t >= updates} | {updates}
                          | {version[t] for t in range(T) if t not in started and version[t] <= updates})
                peak = max(peak, len(in_use))
            buffers = weight_buffers(name, n, j, m, vertical_sync=vertical_sync)
            assert peak <= buffers and (peak == buffers or T < 6), (n, m, T, j, peak, buffers)


# -- the orders and their invariants ---------------------------------------------------------------

@pytest.mark.parametrize("name, vertical_sync", RULES + [("1F1B", False)])
def test_stream_orders_keep_every_invariant_and_never_deadlock(name, vertical_sync):
    for n, m, T in itertools.product(range(1, 5), (1, 2, 4), (1, 3, 6)):
        for batches in batch_shapes(m, T):
            orders = stream_orders(name, n, m, batches, vertical_sync=vertical_sync)
            check_stream_orders(name, orders, n, m, batches, vertical_sync=vertical_sync)
            simulate(orders, COSTS)  # raises on a deadlock
            forwards = stream_orders(name, n, m, batches, vertical_sync=vertical_sync, forward_only=True)
            check_stream_orders(name, forwards, n, m, batches, vertical_sync=vertical_sync, forward_only=True)
            assert forwards == [[a for a in order if a.kind == "F"] for order in orders]


def test_a_stage_alternates_after_n_minus_j_warm_up_forwards():
    orders = stream_orders("PipeDream", 3, 2, 3)
    assert labels(orders[0]) == ("F0.0 F0.1 F1.0 B0.0 F1.1 B0.1 U0 F2.0 B1.0 F2.1 B1.1 U1 B2.0 B2.1 U2")
    assert labels(orders[2]) == ("F0.0 B0.0 F0.1 B0.1 U0 F1.0 B1.0 F1.1 B1.1 U1 F2.0 B2.0 F2.1 B2.1 U2")


class Recorder:
    """A chunks_of that logs its calls into the same list as the actions pulled from the generator."""

    def __init__(self, counts):
        self.counts, self.log = counts, []

    def __call__(self, t):
        self.log.append(f"chunks_of({t})")
        return self.counts[t] if t < len(self.counts) else None

    def pull(self, actions):
        for a in actions:
            self.log.append(a.label(with_batch=True))
        return self.log


def test_the_lazy_order_asks_for_a_batch_only_when_its_next_step_depends_on_it():
    """Stage 0 of 2, batches of 2: it asks for batch t + 1 only when its forward is next and allowed
    (not while the in-flight bound holds it back), and for the end once, with a backward still pending."""
    rec = Recorder([2, 2, 2])
    log = rec.pull(stream_order("PipeDream", 2, 0, rec, chunks=2))
    assert log == ["chunks_of(0)", "F0.0", "F0.1", "B0.0",
                   "chunks_of(1)", "F1.0", "B0.1", "U0", "F1.1", "B1.0",
                   "chunks_of(2)", "F2.0", "B1.1", "U1", "F2.1", "B2.0",
                   "chunks_of(3)", "B2.1", "U2"]


def test_a_forward_waiting_for_its_version_asks_for_its_batch_only_once_it_may_run():
    """PipeDream-2BW, 4 stages, m = 1: stage 0's batch t needs U(t - 2), so it asks for batch 2 only
    after U(0) (though only 2 of 4 micro-batches are in flight) and runs B1 before F3."""
    rec = Recorder([1] * 4)
    log = rec.pull(stream_order("PipeDream-2BW", 4, 0, rec, chunks=1))
    assert log == ["chunks_of(0)", "F0.0", "chunks_of(1)", "F1.0", "B0.0", "U0", "chunks_of(2)", "F2.0", "B1.0",
                   "U1", "chunks_of(3)", "F3.0", "B2.0", "U2", "chunks_of(4)", "B3.0", "U3"]


@pytest.mark.parametrize("name, vertical_sync", RULES)
def test_the_lazy_order_is_the_finite_one_and_asks_once_per_batch(name, vertical_sync):
    """Every prefix the runtime pulls is the finite order's; chunks_of(t) is called once, in order, never
    after the end, and never before the stage's last forward of batch t - 1."""
    for n, m, T in itertools.product(range(1, 5), (1, 2, 4), (1, 3, 6)):
        for batches in batch_shapes(m, T):
            counts = [m] * T if isinstance(batches, int) else batches
            finite = stream_orders(name, n, m, batches, vertical_sync=vertical_sync)
            for j in range(n):
                rec = Recorder(counts)
                log = rec.pull(stream_order(name, n, j, rec, chunks=m, vertical_sync=vertical_sync))
                assert [x for x in log if not x.startswith("chunks_of")] == labels(finite[j]).split()
                calls = [x for x in log if x.startswith("chunks_of")]
                assert calls == [f"chunks_of({t})" for t in range(len(counts) + 1)]
                for t in range(1, len(counts) + 1):
                    assert log.index(f"chunks_of({t})") > log.index(f"F{t - 1}.{counts[t - 1] - 1}")


def test_the_lazy_order_stops_asking_once_the_stream_ended_and_pulls_a_prefix_only():
    rec = Recorder([2, 2])
    order = stream_order("PipeMare", 3, 1, rec, chunks=2)
    assert [next(order) for _ in range(3)] == [Action("F", 0, 1, 0), Action("F", 1, 1, 0), Action("B", 0, 1, 0)]
    assert rec.log == ["chunks_of(0)"]  # batch 1 is not needed yet: the in-flight bound (2) holds
    with pytest.raises(ValueError, match="batch 0 has 0 micro-batches"):
        list(stream_order("PipeDream", 2, 0, lambda t: 0, chunks=2))


# -- check_stream_orders refuses broken orders ------------------------------------------------------

def tampered(name, n, m, T, j, edit):
    orders = stream_orders(name, n, m, T)
    orders[j] = edit(list(orders[j]))
    return orders


def move(order, action, after):
    order.remove(action)
    order.insert(order.index(after) + 1, action)
    return order


def swap(order, a, b):
    x, y = order.index(a), order.index(b)
    order[x], order[y] = order[y], order[x]
    return order


@pytest.mark.parametrize("name, n, m, T, j, edit, messages", [
    ("PipeDream", 3, 2, 3, 0, lambda o: swap(o, F(0, 0, 0), F(1, 0, 0)),
     ["stage 0: Action(kind='F', i=1, j=0) out of (t, i) order: Action(kind='F', i=0, j=0) comes first"]),
    ("PipeDream", 3, 2, 3, 2, lambda o: swap(o, F(0, 2, 1), B(0, 2, 1)),
     ["stage 2: Action(kind='B', i=0, j=2, t=1) comes before its forward"]),
    ("PipeDream", 3, 2, 3, 1, lambda o: swap(o, F(0, 1, 1), B(0, 1, 1)),
     ["stage 1: Action(kind='F', i=1, j=1, t=1) out of (t, i) order: Action(kind='F', i=0, j=1, t=1) comes first",
      "stage 1: Action(kind='B', i=0, j=1, t=1) out of (t, i) order: Action(kind='B', i=1, j=1) comes first"]),
    ("PipeDream-2BW", 3, 2, 3, 2, lambda o: [a for a in o if a != U(2, 1)],
     ["stage 2: 1 U actions in no order, first [Action(kind='U', i=-1, j=2, t=1)]"]),
    ("PipeDream", 3, 2, 3, 0, lambda o: o + [o[0]], ["stage 0: Action(kind='F', i=0, j=0) appears again"]),
    ("PipeMare", 3, 2, 3, 1, lambda o: move(o, U(1, 0), B(0, 1, 1)),
     ["stage 1: Action(kind='B', i=0, j=1, t=1) after 0 updates: it comes before U(0)"]),
    ("PipeMare", 3, 2, 3, 1, lambda o: move(o, U(1, 0), B(0, 1, 0)),
     ["stage 1: Action(kind='U', i=-1, j=1) after 1 of batch 0's 2 backwards",
      "Action(kind='B', i=1, j=1) after 1 updates: it comes after U(0)"]),
    ("PipeDream", 3, 2, 3, 0, lambda o: move(o, F(1, 0, 1), F(0, 0, 1)),
     ["stage 0: 4 micro-batches in flight at Action(kind='F', i=1, j=0, t=1), at most n - j = 3"]),
    ("PipeDream", 2, 1, 3, 1, lambda o: move(o, F(0, 1, 1), F(0, 1, 0)),
     ["stage 1: 2 micro-batches in flight at Action(kind='F', i=0, j=1, t=1), at most n - j = 1",
      "2 weight versions in use at Action(kind='F', i=0, j=1, t=1) ([0, 1]), PipeDream keeps 1",
      "Action(kind='F', i=0, j=1, t=1) after 0 updates: it uses version 1, not made yet"]),
    ("PipeDream", 2, 1, 3, 0, lambda o: move(o, F(0, 0, 2), U(0, 1)),
     ["stage 0: Action(kind='F', i=0, j=0, t=2) after 2 updates: it uses version 1, not the newest"]),
    ("PipeMare", 2, 2, 2, 0, lambda o: move(o, U(0, 0), F(1, 0, 1)),
     ["stage 0: Action(kind='F', i=1, j=0, t=1) after 0 updates, pipemare_forward_version says 1"]),
])
def test_check_stream_orders_names_each_broken_invariant(name, n, m, T, j, edit, messages):
    orders = tampered(name, n, m, T, j, edit)
    with pytest.raises(ValueError, match="the stream orders break") as err:
        check_stream_orders(name, orders, n, m, T)
    for message in messages:
        assert message in str(err.value), str(err.value)


def test_check_stream_orders_refuses_foreign_actions_and_a_missing_stage():
    orders = stream_orders("PipeDream", 2, 2, 2)
    with pytest.raises(ValueError, match="1 stage orders for 2 stages"):
        check_stream_orders("PipeDream", orders[:1], 2, 2, 2)
    with pytest.raises(ValueError, match=r"stage 0: Action\(kind='F', i=0, j=1\) is not an action of stage 0"):
        check_stream_orders("PipeDream", [orders[0] + [Action("F", 0, 1)], orders[1]], 2, 2, 2)
    with pytest.raises(ValueError, match=r"stage 0: Action\(kind='B', i=0, j=0\) is not an action of stage 0"):
        check_stream_orders("PipeDream", orders, 2, 2, 2, forward_only=True)
    with pytest.raises(ValueError, match=r"Action\(kind='F', i=0, j=0, t=2\) is not an action of stage 0"):
        check_stream_orders("PipeDream", stream_orders("PipeDream", 2, 2, 3), 2, 2, 2)


# -- simulate: a stream against flushed steps --------------------------------------------------------

@pytest.mark.parametrize("n, m, flushed, stream, ratio, of_limit", [
    (2, 4, 600, 483, 1.242, 0.994), (2, 8, 1080, 963, 1.121, 0.997), (3, 4, 720, 486, 1.481, 0.988),
    (3, 8, 1200, 966, 1.242, 0.994), (4, 4, 840, 489, 1.718, 0.982)])
def test_a_continuous_stream_against_flushed_1f1b_steps(n, m, flushed, stream, ratio, of_limit):
    """The design note's table (40 batches, F = 1, B = 2): flushed = 40 one-step 1F1B makespans,
    3 (m + n - 1) each; the stream fills and drains once, 3 (40 m + n - 1). The physical limit is the
    work of one stage, 3 * 40 m ticks."""
    assert 40 * simulate(worker_orders("1F1B", n, m), COSTS).makespan == flushed == 3 * 40 * (m + n - 1)
    for name in ASYNC_SCHEDULES:  # m >= n - 1: no forward waits for its version
        sim = simulate(stream_orders(name, n, m, 40), COSTS)
        assert sim.makespan == stream == 3 * (40 * m + n - 1)
    assert (round(flushed / stream, 3), round(3 * 40 * m / stream, 3)) == (ratio, of_limit)


def test_simulate_keys_a_stream_by_batch_and_micro_batch_and_updates_cost_nothing():
    n, m, T = 3, 2, 4
    orders = stream_orders("PipeDream-2BW", n, m, T)
    sim = simulate(orders, COSTS)
    s = sim.starts
    for t, i in itertools.product(range(T), range(m)):
        for j in range(1, n):
            assert s[F(i, j, t)] >= s[F(i, j - 1, t)] + 1
        for j in range(n - 1):
            assert s[B(i, j, t)] >= s[B(i, j + 1, t)] + 2
        assert s[B(i, n - 1, t)] >= s[F(i, n - 1, t)] + 1
    assert all(s[U(j, t)] == s[B(m - 1, j, t)] + 2 for j in range(n) for t in range(T))
    assert sim.busy == [3 * m * T] * n
    assert simulate(orders, {**COSTS, "U": 1}).makespan > sim.makespan
    with pytest.raises(ValueError, match="costs must be positive .U's at least 0."):
        simulate(orders, {"U": -1})


def test_2bw_with_fewer_micro_batches_than_stages_minus_one_waits_but_ends():
    """m < n - 1: stage 0's batch t waits for U(t - 2), running its backwards first; it never
    deadlocks, but streams far slower than PipeDream (the design note's 357 against 129 ticks)."""
    orders = stream_orders("PipeDream-2BW", 4, 1, 40)
    check_stream_orders("PipeDream-2BW", orders, 4, 1, 40)
    slow, fast = simulate(orders, COSTS).makespan, simulate(stream_orders("PipeDream", 4, 1, 40), COSTS).makespan
    assert (slow, fast) == (357, 129)
    assert labels(orders[0]).startswith("F0.0 F1.0 B0.0 U0 F2.0 B1.0 U1 F3.0")  # 2 in flight, not 4
    assert simulate(stream_orders("PipeDream-2BW", 4, 4, 40), COSTS).makespan == 489  # m >= n - 1: no wait
