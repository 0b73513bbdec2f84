"""Counting the bytes kept for backward with saved-tensor hooks, with and without checkpointing."""
from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rrefpipe import memory


@pytest.fixture
def tracking() -> Iterator[None]:
    memory.start_tracking()
    try:
        yield
    finally:
        memory.stop_tracking()


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(100, 200), nn.ReLU(), nn.Linear(200, 10))


def test_counts_saved_activations_until_backward_frees_them(tracking):
    m = model()
    xs = [torch.randn(8, 100) for _ in range(4)]
    outs = [m(x) for x in xs]
    # per micro-batch: Linear keeps its 8x100 input, ReLU its 8x200 output (the next Linear reuses it);
    # the weights are parameters, not activations
    per_microbatch = 8 * 100 * 4 + 8 * 200 * 4
    report = memory.local_report()
    assert report.saved_now == report.saved_peak == 4 * per_microbatch
    sum(o.sum() for o in outs).backward()
    del outs
    report = memory.local_report(reset=True)
    assert report.saved_now == 0 and report.saved_peak == 4 * per_microbatch
    assert memory.local_report().saved_peak == 0  # reset to "now"
    assert report.peak_rss > 0 and report.cuda_allocated is None


def test_checkpointed_microbatches_keep_only_their_inputs_and_still_work(tracking):
    m, reference = model(), model()
    xs = [torch.randn(8, 100) for _ in range(4)]
    outs = [checkpoint(m, x, use_reentrant=False) for x in xs]
    assert memory.local_report().saved_now == 4 * 8 * 100 * 4
    sum(o.sum() for o in outs).backward()  # recomputation under checkpoint's own hooks, untouched by ours
    reference(torch.cat(xs)).sum().backward()
    for a, b in zip(m.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    del outs, xs
    assert memory.local_report().saved_now == 0


def test_no_grad_and_stop_tracking():
    memory.start_tracking()
    with torch.no_grad():
        model()(torch.randn(4, 100))
    assert memory.local_report().saved_peak == 0
    memory.stop_tracking()
    assert memory.local_report().saved_peak is None
    assert "n/a" in str(memory.local_report())


def test_format_bytes():
    assert [memory.format_bytes(n) for n in (12, 2048, 3 * 2**20, None)] == ["12 B", "2.0 KiB", "3.0 MiB", "n/a"]


def test_starting_again_restarts_the_peak(tracking):
    m = model()
    out = m(torch.randn(8, 100))
    peak = memory.local_report().saved_peak
    out.sum().backward()
    del out
    memory.start_tracking()  # a worker serving its next pipe
    assert peak > 0 and memory.local_report().saved_peak == 0
