"""What each schedule keeps for backward, as the memory tracker (:mod:`rrefpipe.memory`) counts it on the
stage workers during one ``train_step`` with ``checkpoint='never'``: GPipe keeps every micro-batch's
activations on every stage, 1F1B at most n - j of them on stage j, the zero-bubble schedules no more than
1F1B: InterleavedZeroBubble (ZB1P) per stage, ZBVZeroBubble per worker (its two half-size stages against
1F1B's one on the same workers). Under those two, what the first half of a backward keeps for the second
(the gradients reaching the weights' nodes) is counted with the activations (``memory.count_kept``), and
the bounds hold with it: a micro-batch between its halves keeps its layers' inputs and those gradients,
no more than before its first half.

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
from rrefpipe.schedule import worker_orders

pytestmark = pytest.mark.timeout(120)

WIDTH, ROWS = 64, 512  # features, rows per micro-batch
INPUT_BYTES = ROWS * WIDTH * 4  # one micro-batch's input (float32)
CASES = [(2, 8), (3, 8), (2, 16), (3, 16)]  # (stages n, micro-batches m)
V_CHUNKS = [8, 16]


def model(n: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(layer for _ in range(n) for layer in (nn.Linear(WIDTH, WIDTH), nn.ReLU())))


@dataclass
class Peaks:
    """Peak bytes kept for backward per stage: one micro-batch alone, GPipe's, 1F1B's and ZB1P's steps of m."""

    n: int
    m: int
    one: list[int]
    gpipe: list[int]
    one_f_one_b: list[int]
    zb1p: list[int]


def _peaks(names: list[str], n: int, schedule: str, chunks: int, stages: int | None = None,
           per_worker: int = 1) -> list[int]:
    """Per worker of ``names``: the peak bytes kept for backward in one step of ``model(n)`` (n Linear+ReLU
    pairs) cut into ``stages`` equal stages (n by default), ``per_worker`` of them on each worker."""
    stages = stages or n
    with Pipe(model(n), chunks=chunks, checkpoint="never", workers=names, schedule=schedule,
              balance=[2 * n // stages] * stages, stages_per_worker=per_worker) as pipe:
        assert sorted({s.worker for s in pipe.stages}) == sorted(names)
        x, y = torch.randn(ROWS * chunks, WIDTH), torch.randn(ROWS * chunks, WIDTH)
        memory.worker_reports(names, reset=True)
        with dist_autograd.context() as ctx:
            pipe.train_step(ctx, x, y, F.mse_loss)
        reports = memory.worker_reports(names, reset=True)
    assert [r.saved_now for r in reports] == [0] * len(names), reports  # nothing kept once the step is done
    return [r.saved_peak for r in reports]


@pytest.fixture(scope="module")
def measured(cluster):
    names = cluster.names[:3]
    memory.track_workers(names)  # process-wide on each worker: stopped again below
    try:
        peaks = {}
        for n, m in CASES:
            peaks[n, m] = Peaks(n, m, one=_peaks(names[:n], n, "GPipe", 1), gpipe=_peaks(names[:n], n, "GPipe", m),
                                one_f_one_b=_peaks(names[:n], n, "1F1B", m),
                                zb1p=_peaks(names[:n], n, "InterleavedZeroBubble", m))
            print(f"n={n} m={m}: one micro-batch {peaks[n, m].one}, GPipe {peaks[n, m].gpipe}, "
                  f"1F1B {peaks[n, m].one_f_one_b}, ZB1P {peaks[n, m].zb1p} bytes")
        for m in V_CHUNKS:  # the same 4 Linear+ReLU pairs on 2 workers: 2 stages under 1F1B, 4 in a V under ZBV
            peaks["V", m] = (_peaks(names[:2], 4, "1F1B", m, stages=2),
                             _peaks(names[:2], 4, "ZBVZeroBubble", m, stages=4, per_worker=2))
            print(f"4 layers on 2 workers, m={m}: 1F1B {peaks['V', m][0]}, ZBV {peaks['V', m][1]} bytes")
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


def between_halves(schedule: str, stages: int, m: int, per_worker: int) -> list[int]:
    """Per worker, the most micro-batches (over its stages) between the two halves of their backward at
    once, following the schedule's orders: each keeps a gradient, here the size of a stage's input."""
    peaks = []
    for order in worker_orders(schedule, stages, m, per_worker):
        now = peak = 0
        for a in order:
            now += {"I": 1, "W": -1}.get(a.kind, 0)
            peak = max(peak, now)
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("n, m", CASES)
def test_zb1p_keeps_1f1bs_activations_and_a_gradient_per_micro_batch_between_halves(measured, n, m):
    """InterleavedZeroBubble with one stage per worker: on each stage 1F1B's n - j micro-batches of
    activations, plus the gradient that each micro-batch between the halves of its backward keeps; the
    first half frees the graph above the weights' nodes (here the ReLU's output) where it takes its
    gradient, so only the first stage, whose first half has no input to compute, keeps more than 1F1B."""
    p = measured[n, m]
    between = between_halves("InterleavedZeroBubble", n, m, 1)
    for j in range(n):
        assert p.one[j] <= p.zb1p[j] <= p.one_f_one_b[j] + between[j] * INPUT_BYTES, (j, p, between)
        if j > 0:
            assert p.zb1p[j] == p.one_f_one_b[j], (j, p)


@pytest.mark.parametrize("m", V_CHUNKS)
def test_zbv_keeps_1f1bs_first_worker_peak_on_every_worker(measured, m):
    """ZBVZeroBubble on 2 workers, 4 half-size stages: every worker keeps at most 2p = 4 half-stage
    micro-batches, what 1F1B's first worker keeps in whole-stage ones (p = 2), plus a gradient per
    micro-batch between the halves of its backward. (In bytes the halves keep more here: this model's
    stage boundary tensor is saved on both sides of it, once inside a whole stage.)"""
    one_f_one_b, zbv = measured["V", m]
    unit = measured[2, 8].one[1]  # one micro-batch on one Linear+ReLU pair: a half-size stage
    assert one_f_one_b == [2 * 3 * INPUT_BYTES, 3 * INPUT_BYTES]  # the premise: 1F1B's p - r whole-stage ones
    between = between_halves("ZBVZeroBubble", 4, m, 2)
    for r in range(2):
        assert 2 * unit < zbv[r] <= 4 * unit + between[r] * INPUT_BYTES, (r, zbv, between)
