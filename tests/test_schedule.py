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
