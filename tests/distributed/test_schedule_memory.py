"""What each schedule keeps for backward, as the memory tracker (:mod:`rrefpipe.memory`) counts it on the
stage workers during one ``train_step`` with ``checkpoint='never'``: GPipe keeps every micro-batch's
activations on every stage, 1F1B at most n - j of them on stage j.

The model's activations dominate: per stage a Linear(64, 64) (16 KiB of weights) and a ReLU on micro-batches
of 512 rows, which keep 2 x 128 KiB per micro-batch (the Linear's input, the ReLU's output). One
micro-batch's worth is measured on its own (a GPipe step of one micro-batch), so that "GPipe keeps m of
them" can fail.

Stage 0 is bounded like the others: it splits the mini-batch the driver sent into micro-batches of their
own storage, so a micro-batch's input goes with its backward (views of the whole batch kept all of it, and
all m inputs, until the step's last backward)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn

from rrefpipe import Pipe, memory

pytestmark = pytest.mark.timeout(120)

WIDTH, ROWS = 64, 512  # features, rows per micro-batch
INPUT_BYTES = ROWS * WIDTH * 4  # one micro-batch's input (float32)
CASES = [(2, 8), (3, 8), (2, 16), (3, 16)]  # (stages n, micro-batches m)


def model(n: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(layer for _ in range(n) for layer in (nn.Linear(WIDTH, WIDTH), nn.ReLU())))


@dataclass
class Peaks:
    """Peak bytes kept for backward per stage: one micro-batch alone, GPipe's and 1F1B's steps of m."""

    n: int
    m: int
    one: list[int]
    gpipe: list[int]
    one_f_one_b: list[int]


def _peaks(names: list[str], n: int, schedule: str, chunks: int) -> list[int]:
    with Pipe(model(n), chunks=chunks, checkpoint="never", workers=names, schedule=schedule) as pipe:
        assert [s.worker for s in pipe.stages] == names
        x, y = torch.randn(ROWS * chunks, WIDTH), torch.randn(ROWS * chunks, WIDTH)
        memory.worker_reports(names, reset=True)
        with dist_autograd.context() as ctx:
            pipe.train_step(ctx, x, y, F.mse_loss)
        reports = memory.worker_reports(names, reset=True)
    assert [r.saved_now for r in reports] == [0] * n, reports  # nothing kept once the step is done
    return [r.saved_peak for r in reports]


@pytest.fixture(scope="module")
def measured(cluster):
    names = cluster.names[:3]
    memory.track_workers(names)  # process-wide on each worker: stopped again below
    try:
        peaks = {}
        for n, m in CASES:
            peaks[n, m] = Peaks(n, m, one=_peaks(names[:n], n, "GPipe", 1), gpipe=_peaks(names[:n], n, "GPipe", m),
                                one_f_one_b=_peaks(names[:n], n, "1F1B", m))
            print(f"n={n} m={m}: one micro-batch {peaks[n, m].one}, GPipe {peaks[n, m].gpipe}, "
                  f"1F1B {peaks[n, m].one_f_one_b} bytes")
    finally:
        for future in [rpc.rpc_async(name, memory.stop_tracking) for name in names]:
            future.wait()
    return peaks


@pytest.mark.parametrize("n, m", CASES)
def test_one_microbatch_keeps_what_the_model_saves(measured, n, m):
    """The Linear's input and the ReLU's output (the next Linear saves that same tensor), no weights."""
    assert measured[n, m].one == [2 * INPUT_BYTES] * n


@pytest.mark.parametrize("n, m", CASES)
def test_gpipe_keeps_every_microbatch(measured, n, m):
    p = measured[n, m]
    for j in range(n):
        assert (m - 1) * p.one[j] <= p.gpipe[j] <= m * p.one[j], (j, p)


@pytest.mark.parametrize("n, m", CASES)
def test_1f1b_keeps_at_most_n_minus_j_microbatches(measured, n, m):
    """On stage j, stage 0 included: at most (n - j) / m of GPipe's peak, and one micro-batch's worth
    (GPipe's peak / m) of slack."""
    p = measured[n, m]
    for j in range(n):
        gpipe = p.gpipe[j]
        bound = (n - j) / m * gpipe + gpipe / m
        kept = p.one_f_one_b[j]
        assert 0 < kept <= bound, (j, kept, bound, p)
        assert kept < gpipe / 2, (j, kept, gpipe)  # the bound says something: m >= 2 (n - j) + 2 here
        assert kept == (n - j) * p.one[j], (j, kept, p)  # exactly n - j micro-batches in flight
