"""Balancing: the exact partition against brute force, the profilers, the sandbox, errors, Pipe(balance='time')."""
from __future__ import annotations

import itertools
import random
import sys
import weakref

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch import nn

from rrefpipe import Pipe
from rrefpipe.balance import balance_by_size, balance_by_time, balance_cost, layer_sizes, layer_times, stage_costs
from rrefpipe.balance.partition import solve
from rrefpipe.partition import uniform_balance
from rrefpipe.skip import pop, skippable, stash, verify_skippables
from tests.layers import Merge, Split, mlp


def brute_force(costs: list[float], partitions: int) -> tuple[float, float]:
    """Over every way to cut ``costs`` into ``partitions`` non-empty runs: the least maximum stage cost,
    and the least sum of squared stage costs among the splits attaining it (up to rounding)."""
    n = len(costs)
    splits = []
    for cuts in itertools.combinations(range(1, n), partitions - 1):
        bounds = [0, *cuts, n]
        splits.append([sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])])
    best = min(max(split) for split in splits)
    even = min(sum(c * c for c in split) for split in splits if max(split) <= best * (1 + 1e-9) + 1e-12)
    return best, even


def check_split(costs: list[float], partitions: int) -> list[int]:
    balance = solve(costs, partitions)
    assert len(balance) == partitions and all(b >= 1 for b in balance) and sum(balance) == len(costs)
    return balance


@pytest.mark.parametrize("kind", ["int", "float", "zeros"])
def test_solve_equals_brute_force_on_random_cases(kind):
    rng = random.Random(kind)
    for _ in range(300):
        n = rng.randint(1, 9)
        partitions = rng.randint(1, n)
        if kind == "int":
            costs = [float(rng.randint(0, 20)) for _ in range(n)]
        elif kind == "float":
            costs = [rng.expovariate(1.0) for _ in range(n)]
        else:  # many zero-cost layers (activations, reshapes)
            costs = [rng.choice([0.0, 0.0, rng.random()]) for _ in range(n)]
        balance = check_split(costs, partitions)
        best, even = brute_force(costs, partitions)
        found = stage_costs(costs, balance)
        assert max(found) == pytest.approx(best, rel=1e-12, abs=1e-12)
        assert sum(c * c for c in found) == pytest.approx(even, rel=1e-9, abs=1e-12)


def test_solve_examples_and_ties():
    assert solve([1, 1, 1, 1, 10], 2) == [4, 1]
    assert solve([10, 1, 1, 10], 3) == [1, 2, 1]
    assert solve([5], 1) == [1]
    for n in range(1, 12):  # equal costs, zero ones too: the same split as uniform_balance
        for partitions in range(1, n + 1):
            assert solve([1.0] * n, partitions) == uniform_balance(n, partitions)
            assert solve([0.0] * n, partitions) == uniform_balance(n, partitions)
            assert solve([0.3] * n, partitions) == uniform_balance(n, partitions)  # its sums round
    assert balance_by_size(3, nn.Sequential(*[nn.Identity() for _ in range(7)]), torch.randn(2, 4)) == [3, 2, 2]
    assert balance_cost([3, 1, 1, 1], 2) == [1, 3]


def test_costs_near_the_float_limits_split_as_their_scaled_twins():
    """Sums and squares of costs near 1e308 overflowed (the solver failed its own assertion); the split
    does not depend on the unit, so huge and tiny costs split as the same costs scaled (by powers of
    two, which keep ties exact)."""
    rng = random.Random(0)
    for _ in range(100):
        n = rng.randint(1, 9)
        partitions = rng.randint(1, n)
        costs = [float(rng.randint(0, 20)) for _ in range(n)]
        for unit in (2.0 ** 1015, 2.0 ** -1074):  # ~3.7e305, ~4.9e-324
            assert solve([c * unit for c in costs], partitions) == solve(costs, partitions), (costs, unit)
    assert solve([1.7e308] * 4, 3) == uniform_balance(4, 3)


def test_solve_rejects_bad_arguments():
    with pytest.raises(ValueError, match="more partitions than layers"):
        solve([1, 2], 3)
    with pytest.raises(ValueError, match="positive int"):
        solve([1, 2], 0)
    with pytest.raises(ValueError, match="non-negative"):
        solve([1, -2], 1)
    with pytest.raises(ValueError, match="non-negative"):
        solve([1, float("nan")], 1)


def model_with_state() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("how", ["time", "size"])
def test_profiling_leaves_the_model_and_rng_untouched(how, training):
    model = model_with_state().train(training)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [m.training for m in model.modules()]
    sample = torch.randn(8, 6)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    if how == "time":
        balance = balance_by_time(2, model, sample, timeout=0.05)
    else:
        balance = balance_by_size(2, model, sample, chunks=2)
    assert sum(balance) == 5 and len(balance) == 2
    assert torch.equal(torch.get_rng_state(), rng)  # dropout ran on the copies without consuming our RNG
    assert [m.training for m in model.modules()] == flags
    assert all(p.grad is None for p in model.parameters())
    after = model.state_dict()
    assert before.keys() == after.keys()
    for key in before:  # BatchNorm running statistics and the weights unchanged
        assert torch.equal(before[key], after[key]), key


class _CountsCopies(nn.Linear):
    """Counts its copies alive at once: each one, when it runs, joins a set that forgets the dropped."""

    alive: weakref.WeakSet[nn.Module] = weakref.WeakSet()
    most = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).alive.add(self)
        type(self).most = max(type(self).most, len(type(self).alive))
        return torch.tanh(super().forward(x))


@pytest.mark.parametrize("how", ["time", "size"])
def test_profiling_copies_one_layer_at_a_time(how):
    """A model balanced because it is too large for one device never goes to the profiling device whole:
    each layer's copy is dropped before the next is made (all were copied at once, 2× the model)."""
    model = nn.Sequential(*[_CountsCopies(8, 8) for _ in range(6)])
    _CountsCopies.most = 0
    sample = torch.randn(4, 8)
    if how == "time":
        layer_times(model, sample, timeout=0.05)
    else:
        layer_sizes(model, sample, chunks=2)
    assert _CountsCopies.most == 1


def tuple_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), Split(), Merge(), nn.Linear(8, 3))


def test_tuples_flow_through_profiling():
    model = tuple_model()
    x = torch.randn(8, 4)
    assert len(layer_times(model, x, timeout=0.01)) == 4
    balance = balance_by_time(3, model, x, timeout=0.01)
    assert sum(balance) == 4 and len(balance) == 3
    # bytes saved for backward, params left out: Linear keeps its 8x4 input; Split keeps nothing; Merge's
    # a * b keeps a (a view of the 8x8 Linear output) and b (8x4); the last Linear keeps its 8x8 input
    assert layer_sizes(model, x, param_scale=0) == [8 * 4 * 4, 0, 8 * 8 * 4 + 8 * 4 * 4, 8 * 8 * 4]
    # a tuple as the model's own input, with a tensor that does not require grad
    tuple_in = nn.Sequential(Merge(), nn.Linear(8, 2))
    pair = (torch.randn(5, 4, requires_grad=True), torch.randn(5, 4))
    assert balance_by_size(2, tuple_in, pair) == [1, 1]
    assert len(layer_times(tuple_in, pair, timeout=0.01)) == 2


def test_size_counts_activations_of_one_microbatch_and_scaled_parameters():
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 20))
    x = torch.randn(8, 10)
    # micro-batch of 4: Linear keeps its 4x10 input, ReLU its 4x20 output (which the next Linear reuses)
    assert layer_sizes(model, x, chunks=2, param_scale=0) == [160, 320, 0]
    params = [(10 * 20 + 20) * 4, 0, (20 * 20 + 20) * 4]
    assert layer_sizes(model, x, chunks=2, param_scale=4) == [a + 4 * p for a, p in zip([160, 320, 0], params)]


def test_size_separates_a_parameter_heavy_layer():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 512), nn.Linear(512, 4), nn.Linear(4, 4))
    assert balance_by_size(3, model, torch.randn(2, 4)) == [2, 1, 2]


def test_time_isolates_a_layer_a_hundred_times_slower():
    # ~10 ms against tens of microseconds for the rest together: the median per layer is robust to a
    # pass in which another process took the core
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 4), *[nn.ReLU() for _ in range(3)])
    assert balance_by_time(2, model, torch.randn(256, 1024), timeout=0.3) == [1, 4]


class _Doubles(nn.Module):
    """Doubles its input, in place if ``in_place``, without saying so (no ``inplace`` attribute)."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2) if self.in_place else x * 2


def test_in_place_layers_are_profiled_on_a_copy_of_their_input():
    """Each layer's input is a detached leaf that requires grad, which ``nn.ReLU(inplace=True)`` may not
    overwrite, nor a custom layer that does so unannounced: profiling gives every layer a copy (ResNets use
    such layers everywhere). Sizes equal those of the out-of-place model (ReLU saves its result either
    way, a product by a number nothing), the copies counted as the tensors they stand for."""
    torch.manual_seed(0)
    def build(inplace):
        return nn.Sequential(nn.Linear(8, 16), _Doubles(inplace), nn.ReLU(inplace=inplace), nn.Linear(16, 16),
                             nn.Sequential(nn.ReLU(inplace=inplace)), nn.Linear(16, 2))
    x = torch.randn(12, 8)
    inplace, plain = build(True), build(False)
    assert layer_sizes(inplace, x, chunks=3) == layer_sizes(plain, x, chunks=3)
    times = layer_times(inplace, x, timeout=0.05)
    assert len(times) == 6 and all(t > 0 for t in times)
    assert len(balance_by_time(2, inplace, x, timeout=0.05)) == 2
    assert balance_by_size(2, inplace, x, chunks=3) == balance_by_size(2, plain, x, chunks=3)


@skippable(stash=["hidden"])
class _StashHidden(nn.Module):
    """Stashes a tensor it computes (not its input): the stash belongs to this layer's graph."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        hidden = self.linear(x)
        yield stash("hidden", hidden)
        return torch.tanh(hidden)


@skippable(pop=["hidden"])
class _PopTimes(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        hidden = yield pop("hidden")
        return x * hidden


def test_a_stash_the_layer_computed_is_profiled_with_the_layer_that_pops_it():
    """Each layer runs alone, its graph freed by its own backward: the popping layer gets the stash cut
    from the stashing layer's graph, as it gets its input (it had raised "backward through the graph a
    second time"). The product saves both factors: the popped one, 4x8 floats, is counted there, once."""
    model = nn.Sequential(_StashHidden(), nn.Linear(8, 8), _PopTimes(), nn.Linear(8, 2))
    x = torch.randn(8, 8)
    verify_skippables(model)
    times = layer_times(model, x, timeout=0.05)
    assert len(times) == 4 and all(t > 0 for t in times)
    assert balance_by_time(2, model, x, timeout=0.05) in ([1, 3], [2, 2], [3, 1])
    # micro-batch of 4, 4x8 floats (128 bytes) each: Linear saves its input and tanh its output, which the
    # next Linear saves too; the product saves both factors, the last Linear the product
    assert layer_sizes(model, x, chunks=2, param_scale=0) == [128 + 128, 0, 128 + 128, 128]


def test_clear_errors():
    model = mlp([4, 8, 4])  # 3 layers
    with pytest.raises(ValueError, match="more partitions than layers"):
        balance_by_time(4, model, torch.randn(2, 4))
    with pytest.raises(ValueError, match="more partitions than layers"):
        balance_by_size(4, model, torch.randn(2, 4))
    with pytest.raises(TypeError, match="nn.Sequential"):
        balance_by_time(1, nn.Linear(4, 4), torch.randn(2, 4))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nn.Sequential"):
        balance_by_size(1, nn.Linear(4, 4), torch.randn(2, 4))  # type: ignore[arg-type]
    model(torch.randn(2, 4)).sum().backward()
    for fn in (balance_by_time, balance_by_size):
        with pytest.raises(ValueError, match="already have gradients.*zero_grad"):
            fn(2, model, torch.randn(2, 4))
    model.zero_grad(set_to_none=True)
    with pytest.raises(TypeError, match="sample must be a Tensor"):
        balance_by_time(2, model, "not a tensor")  # type: ignore[arg-type]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
@pytest.mark.parametrize("fn", [balance_by_time, balance_by_size])
def test_a_layer_that_fails_while_profiled_is_named(fn):
    """The user's exception, its type kept, with a note naming the layer (it had surfaced from deep
    inside the profiler with no layer named)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(4, 2))  # layer 2 expects 4 features, gets 8
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied") as info:
        fn(2, model, torch.randn(3, 4))
    assert info.value.__notes__ == ["rrefpipe.balance: raised by layer 2 (Linear) while profiling it"]


def test_pipe_balance_argument_errors_before_any_worker_starts():
    model = mlp([4, 8, 4])
    with pytest.raises(ValueError, match="sample="):
        Pipe(model, balance="time", devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="devices=.*workers="):
        Pipe(model, balance="size", sample=torch.randn(4, 4))
    with pytest.raises(ValueError, match="'time' or 'size'"):
        Pipe(model, balance="memory", sample=torch.randn(4, 4), devices=["cpu"])
    with pytest.raises(ValueError, match="more partitions than layers"):
        Pipe(model, balance="time", sample=torch.randn(4, 4), devices=["cpu"] * 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["time", "size"])
def test_pipe_balances_itself_and_stays_transparent(cluster, how):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 512), nn.Linear(512, 4), nn.Linear(4, 4))
    x = torch.randn(8, 4)
    with Pipe(model, chunks=2, balance=how, sample=x, workers=cluster.names[:3]) as pipe:
        assert len(pipe.balance) == 3 and sum(pipe.balance) == 5
        if how == "size":  # the same measurement as the function, on one micro-batch of the sample
            assert pipe.balance == balance_by_size(3, model, x, chunks=2) == [3, 1, 1]
        with dist_autograd.context():
            out = pipe(x).local_value()
    torch.testing.assert_close(out, model(x))
