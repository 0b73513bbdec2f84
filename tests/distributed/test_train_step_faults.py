"""``Pipe.train_step`` given bad arguments, or failing in a stage, in ``loss_fn`` or in a worker: each is a
clear error that names what to change (or the stage, worker, micro-batch and phase where it happened),
nothing hangs, nothing piles up, and the same pipe runs a correct step right after.

Layers and loss functions are defined here at module level: the workers import this module to unpickle
them (tests/ is on their path)."""
from __future__ import annotations

import copy
import os
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import Tensor, nn

from rrefpipe import Pipe, StageError, WorkerError
from tests.conftest import record_surfacing, run_script
from tests.distributed.probes import all_counts, stage_gradients
from rrefpipe.schedule import worker_orders
from tests.layers import RaiseInBackward

pytestmark = pytest.mark.timeout(120)

FORWARD_FAIL = 1e9  # an input row of this value makes FailsOn raise in forward
BACKWARD_FAIL = -1e9  # ... in backward
HOLD = 7e8  # ... and HoldsOn wait (in forward or backward) until its worker is killed
TARGET_FAIL = 5e8  # a target row of this value makes loss_raising raise
WEIGHT_FAIL = -5e8  # ... and FailsInWeight raise in its weight's gradient (a split backward's W)


# -- layers and losses (imported by the workers) -----------------------------------------------------
class FailsOn(nn.Module):
    """Identity; raises ValueError in forward on a micro-batch holding FORWARD_FAIL, in backward on one
    holding BACKWARD_FAIL."""

    def forward(self, x: Tensor) -> Tensor:
        if bool((x == FORWARD_FAIL).any()):
            raise ValueError(f"forward of a marked micro-batch of {x.size(0)} rows")
        if bool((x == BACKWARD_FAIL).any()):
            return RaiseInBackward("backward of a marked micro-batch")(x)
        return x.clone()


class FailsInWeight(nn.Module):
    """The identity as a Linear(4, 4); on a micro-batch holding WEIGHT_FAIL, the gradient of its weight
    raises and its input's does not: under a zero-bubble schedule, in the second half of backward (W)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(4))

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if bool((x == WEIGHT_FAIL).any()):
            w = RaiseInBackward("the weight's gradient of a marked micro-batch")(w)
        return x @ w


def _hold(folder: str, phase: str) -> None:
    """Say so with a file (holding this worker's pid), then wait for a file that never comes: the test
    kills this process meanwhile. A deadline ends the wait if it does not."""
    Path(folder, f"held-{phase}-{os.getpid()}").touch()
    deadline = time.monotonic() + 30
    while not Path(folder, "never").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"held in {phase} for 30 s and not killed")
        time.sleep(0.01)


class _HoldInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer):  # type: ignore[no-untyped-def]
        ctx.layer, ctx.marked = layer, bool((x == HOLD).any())
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        if ctx.marked and ctx.layer.phase == "backward":
            _hold(ctx.layer.folder, "backward")
        return grad, None


class _HoldInWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, folder):  # type: ignore[no-untyped-def]
        ctx.folder = folder
        return w.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        _hold(ctx.folder, "weight")
        return grad, None


class HoldsInWeight(nn.Module):
    """The identity as a Linear(4, 4); on a micro-batch holding HOLD, the gradient of its weight (W, under a
    zero-bubble schedule, after its I has sent the input's gradient on) waits until the test kills its worker."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder
        self.weight = nn.Parameter(torch.eye(4))

    def forward(self, x: Tensor) -> Tensor:
        return x @ (_HoldInWeight.apply(self.weight, self.folder) if bool((x == HOLD).any()) else self.weight)


class HoldsOn(nn.Module):
    """Identity, except on a micro-batch holding HOLD: in its forward or backward (``phase``), it leaves
    a file in ``folder`` and waits there until the test kills its worker."""

    def __init__(self, folder: str, phase: str) -> None:
        super().__init__()
        self.folder, self.phase = folder, phase

    def forward(self, x: Tensor) -> Tensor:
        if self.phase == "forward" and bool((x == HOLD).any()):
            _hold(self.folder, "forward")
        return _HoldInBackward.apply(x, self)


class LossOutOfRange(ValueError):
    """A user's own error type, raised by a loss function."""


def loss_raising(output: Tensor, target: Tensor) -> Tensor:
    if bool((target == TARGET_FAIL).any()):
        raise LossOutOfRange(f"target out of range in a micro-batch of {target.size(0)} rows")
    return F.mse_loss(output, target)


def loss_raising_builtin(output: Tensor, target: Tensor) -> Tensor:
    if bool((target == TARGET_FAIL).any()):
        raise ValueError("a plain ValueError from loss_fn")
    return F.mse_loss(output, target)


def _no_such_module() -> None:
    raise ModuleNotFoundError("No module named 'only_on_the_driver'")


class UnpicklesBadly:
    """A loss that pickles on the driver and cannot be unpickled on the worker (a module it needs is
    missing there)."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return _no_such_module, ()

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(output, target)


def failing_model(middle: nn.Module | None = None) -> nn.Sequential:
    """Three stages ([1, 2, 2]) with ``middle`` (FailsOn) first in stage 1; the first layer is the
    identity, so that a marked row reaches it."""
    torch.manual_seed(0)
    first = nn.Linear(4, 4)
    with torch.no_grad():
        first.weight.copy_(torch.eye(4))
        first.bias.zero_()
    return nn.Sequential(first, middle or FailsOn(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def four_stage_model() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))


def batch(rows: int = 8, seed: int = 2) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 4, generator=g)


def marked(x: Tensor, value: float, microbatch: int, chunks: int = 4) -> Tensor:
    """``x`` with every value of micro-batch ``microbatch``'s rows set to ``value``."""
    rows = x.size(0) // chunks
    out = x.clone()
    out[microbatch * rows:(microbatch + 1) * rows] = value
    return out


def check_good_step(pipe: Pipe, model: nn.Module, rows: int = 8) -> None:
    """A correct step: its loss and every stage's gradients are the plain model's."""
    x, y = batch(rows)
    reference = copy.deepcopy(model)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    with dist_autograd.context() as ctx:
        loss = pipe.train_step(ctx, x, y, F.mse_loss)
        grads = stage_gradients(pipe, ctx)
    torch.testing.assert_close(loss, expected.detach())
    want = {name: p.grad for name, p in reference.named_parameters()}
    assert grads.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, msg=lambda m: f"{name}: {m}")


def step(pipe: Pipe, x: Tensor, y: object, loss_fn: object = F.mse_loss) -> Tensor:
    with dist_autograd.context() as ctx:
        return pipe.train_step(ctx, x, y, loss_fn)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def failing(cluster):
    """A 1F1B pipe over three workers of the session group, and its plain model."""
    model = failing_model()
    with Pipe(model, chunks=4, checkpoint="never", balance=[1, 2, 2], workers=cluster.names[:3],
              schedule="1F1B") as pipe:
        yield pipe, model


# -- the schedule's arguments ----------------------------------------------------------------------
@pytest.mark.parametrize("name, canonical", [("1f1b", "1F1B"), ("gpipe", "GPipe"), ("INTERLEAVED1F1B",
                                                                                      "Interleaved1F1B")])
def test_schedule_names_in_any_case(cluster, name, canonical):
    model = four_stage_model()
    v = 2 if canonical == "Interleaved1F1B" else 1
    with Pipe(model, chunks=4, balance=[1, 1, 1, 1], workers=cluster.names[:4 // v], schedule=name,
              stages_per_worker=v) as pipe:
        assert pipe.schedule == canonical
        check_good_step(pipe, model)


def _lin4(chunks=4, workers=None, **kwargs):
    return lambda names: Pipe(four_stage_model(), chunks=chunks, balance=[1, 1, 1, 1], workers=workers or names[:2],
                              **kwargs)


CONSTRUCTION = [
    ("unknown schedule", _lin4(schedule="PipeDream-3BW"), ["schedule must be one of GPipe, 1F1B, Interleaved1F1B",
                                                           "(any case)", "got 'PipeDream-3BW'"]),
    ("stages_per_worker not dividing", _lin4(schedule="Interleaved1F1B", stages_per_worker=3),
     ["stages_per_worker=3 must be a positive divisor of the stage count 4", "divisors: [1, 2, 4]"]),
    ("stages_per_worker 0", _lin4(schedule="Interleaved1F1B", stages_per_worker=0),
     ["stages_per_worker must be a positive int, got 0"]),
    ("schedule not a string", _lin4(schedule=None), ["schedule must be one of", "got None"]),
    ("stages_per_worker without Interleaved1F1B", _lin4(schedule="1F1B", stages_per_worker=2),
     ["stages_per_worker=2 needs a schedule that runs several stages on a worker: schedule='Interleaved1F1B'",
      "use stages_per_worker=1"]),
    ("stages_per_worker with GPipe by default", _lin4(stages_per_worker=2),
     ["stages_per_worker=2 needs a schedule that runs several stages on a worker"]),
    ("a V with one stage per worker", _lin4(schedule="ZBVZeroBubble"),
     ["ZBVZeroBubble puts two stages on each worker in a V", "use stages_per_worker=2, got 1"]),
    ("too few micro-batches for DualPipeV", _lin4(chunks=3, schedule="DualPipeV", stages_per_worker=2),
     ["too few micro-batches for DualPipeV: chunks >= 4", "got chunks=3"]),
    ("workers per stage not in the V", _lin4(schedule="ZBVZeroBubble", stages_per_worker=2,
                                             workers=["worker1", "worker2", "worker1", "worker2"]),
     ["ZBVZeroBubble puts stage j on worker j for j < 2 and on worker 3 - j after (a V)",
      "['w0', 'w1', 'w1', 'w0']", "got ['worker1', 'worker2', 'worker1', 'worker2']"]),
    ("chunks not a multiple of the workers", _lin4(chunks=3, schedule="Interleaved1F1B", stages_per_worker=2),
     ["chunks must be a multiple of 2, got 3", "use chunks=4 or 2"]),
    ("chunks below the workers", _lin4(chunks=1, schedule="Interleaved1F1B", stages_per_worker=2),
     ["chunks must be a multiple of 2, got 1", "use chunks=2"]),
    ("workers per stage in the wrong layout", _lin4(schedule="Interleaved1F1B", stages_per_worker=2,
                                                    workers=["worker1", "worker2", "worker2", "worker1"]),
     ["stages_per_worker=2 puts stage j on worker j mod 2", "['w0', 'w1', 'w0', 'w1']",
      "got ['worker1', 'worker2', 'worker2', 'worker1']"]),
    ("one worker named twice", _lin4(schedule="Interleaved1F1B", stages_per_worker=2,
                                     workers=["worker1", "worker1"]),
     ["name 2 distinct workers", "got ['worker1', 'worker1']"]),
    ("three workers for two", _lin4(schedule="Interleaved1F1B", stages_per_worker=2,
                                    workers=["worker1", "worker2", "worker3"]),
     ["stage j on worker j mod 2", "got ['worker1', 'worker2', 'worker3']"]),
]


@pytest.mark.parametrize("name, make, pieces", CONSTRUCTION, ids=[c[0] for c in CONSTRUCTION])
def test_bad_schedule_arguments_at_construction(cluster, name, make, pieces):
    before = all_counts(cluster.names)
    with pytest.raises(ValueError) as info:
        make(cluster.names)
    for piece in pieces:
        assert piece in str(info.value), (piece, str(info.value))
    after = all_counts(cluster.names)
    assert [c["stages"] for c in after.values()] == [c["stages"] for c in before.values()]  # nothing built


def test_interleaved_pipe_works_in_the_corrected_layout(cluster):
    """What the errors above ask for runs: 2 workers, one per stage in the j mod 2 layout; and a batch of 2
    rows, which makes 2 micro-batches for chunks=4, one round of the 2 workers."""
    model = four_stage_model()
    with Pipe(model, chunks=4, balance=[1, 1, 1, 1], workers=["worker1", "worker2", "worker1", "worker2"],
              schedule="Interleaved1F1B", stages_per_worker=2) as pipe:
        assert [s.worker for s in pipe.stages] == ["worker1", "worker2", "worker1", "worker2"]
        check_good_step(pipe, model)
        check_good_step(pipe, model, rows=2)


@pytest.mark.parametrize("rows, microbatches", [(3, 3), (6, 3), (1, 1)])
def test_a_batch_too_small_for_interleaved_is_refused_at_train_step(cluster, rows, microbatches):
    """Interleaved1F1B runs micro-batches in rounds of its 2 workers: 3 rows, 1 row, or 6 (which torch.chunk
    splits into 3 micro-batches of 2 for chunks=4) make a count that is not a multiple of 2. The error says
    why there are fewer micro-batches than chunks; the next full batch runs."""
    model = four_stage_model()
    with Pipe(model, chunks=4, balance=[1, 1, 1, 1], workers=cluster.names[:2], schedule="Interleaved1F1B",
              stages_per_worker=2) as pipe:
        x, y = batch(rows)
        with pytest.raises(ValueError) as info:
            step(pipe, x, y)
        message = str(info.value)
        for piece in [f"the batch of {rows} rows splits into only {microbatches} micro-batches",
                      "(torch.chunk into chunks=4), which Interleaved1F1B cannot run",
                      "in rounds of the worker count (2 = 4 stages / 2 per worker)", "a batch of at least 4 rows"]:
            assert piece in message, (piece, message)
        check_good_step(pipe, model)


def test_a_batch_smaller_than_chunks_runs_under_1f1b(failing):
    """1F1B runs any number of micro-batches: 2 rows make 2 of them."""
    pipe, model = failing
    check_good_step(pipe, model, rows=2)


# -- the target and loss_fn, refused on the driver -------------------------------------------------
def _closes_over_a_lock():
    lock = threading.Lock()
    return lambda output, target: (lock, F.mse_loss(output, target))[1]


DRIVER_REFUSALS = [
    ("target rows differ", lambda x, y: (x, y[:6], F.mse_loss), ValueError,
     ["the target has 6 rows and the input 8", "must share their batch size (dim 0)"]),
    ("target longer", lambda x, y: (x, torch.cat([y, y]), F.mse_loss), ValueError,
     ["the target has 16 rows and the input 8"]),
    ("target a list", lambda x, y: (x, y.tolist(), F.mse_loss), TypeError,
     ["train_step target must be a Tensor or a tuple of Tensors", "got a list"]),
    ("target a dict", lambda x, y: (x, {"y": y}, F.mse_loss), TypeError,
     ["train_step target must be a Tensor or a tuple of Tensors, got dict"]),
    ("target 0-dim", lambda x, y: (x, y.sum(), F.mse_loss), ValueError,
     ["train_step target tensors need a batch dimension, got a 0-dim tensor"]),
    ("target tuple of two batch sizes", lambda x, y: (x, (y, y[:4]), F.mse_loss), ValueError,
     ["all train_step target tensors must have the same batch size (dim 0), got sizes [4, 8]"]),
    ("target not on the CPU", lambda x, y: (x, y.to("meta"), F.mse_loss), ValueError,
     ["train_step got a tensor on meta", "pass CPU tensors"]),
    ("input a list", lambda x, y: (x.tolist(), y, F.mse_loss), TypeError, ["must be a Tensor or a tuple of Tensors"]),
    ("input of 0 rows", lambda x, y: (x[:0], y[:0], F.mse_loss), ValueError, ["Pipe input has batch size 0"]),
    pytest.param("target None", lambda x, y: (x, None, F.mse_loss), TypeError,
                 ["train_step target must be a Tensor or a tuple of Tensors, got NoneType"], id="target None"),
    pytest.param("target an int", lambda x, y: (x, 3, F.mse_loss), TypeError,
                 ["train_step target must be a Tensor or a tuple of Tensors, got int"], id="target an int"),
    pytest.param("input None", lambda x, y: (None, y, F.mse_loss), TypeError,
                 ["must be a Tensor or a tuple of Tensors, got NoneType"], id="input None"),
    ("loss_fn not callable", lambda x, y: (x, y, "mse"), TypeError,
     ["loss_fn must be callable as loss_fn(output, target)", "got str"]),
    ("loss_fn None", lambda x, y: (x, y, None), TypeError, ["loss_fn must be callable", "got NoneType"]),
    ("loss_fn that does not pickle", lambda x, y: (x, y, _closes_over_a_lock()), TypeError,
     ["loss_fn cannot be sent to the last stage's worker: it does not pickle", "lock",
      "pass a module-level function"]),
]


@pytest.mark.parametrize("name, make, error, pieces", DRIVER_REFUSALS,
                         ids=[r[0] if isinstance(r, tuple) else r.id for r in DRIVER_REFUSALS])
def test_bad_target_or_loss_fn_is_refused_before_any_stage_runs(failing, name, make, error, pieces):
    pipe, model = failing
    x, y = batch()
    x, y, loss_fn = make(x, y)
    with pytest.raises(error) as info:
        step(pipe, x, y, loss_fn)
    assert not isinstance(info.value, StageError)  # refused here, not on a worker
    for piece in pieces:
        assert piece in str(info.value), (piece, str(info.value))
    check_good_step(pipe, model)


# -- loss_fn failing on the last stage -------------------------------------------------------------
def test_loss_fn_raising_names_the_last_stage_worker_and_microbatch(failing, cluster):
    pipe, model = failing
    x, y = batch()
    t = time.monotonic()
    with pytest.raises(StageError) as info:
        step(pipe, x, marked(y, TARGET_FAIL, 2), loss_raising)
    record_surfacing("train_step: loss_fn raised", "StageError", time.monotonic() - t)
    exc = info.value
    assert (exc.stage, exc.worker, exc.microbatch, exc.phase) == (2, cluster.names[2], 2, "loss_fn")
    assert exc.error_type == "LossOutOfRange" and "target out of range in a micro-batch of 2 rows" in exc.error_message
    assert isinstance(exc.__cause__, LossOutOfRange) and isinstance(exc.__cause__, ValueError)
    assert f"stage 2 on worker '{cluster.names[2]}', micro-batch 2 failed in loss_fn" in str(exc)
    check_good_step(pipe, model)


def test_loss_fn_raising_a_builtin_error_keeps_its_type(failing, cluster):
    pipe, model = failing
    x, y = batch()
    with pytest.raises(ValueError) as info:  # `except ValueError` around train_step still catches it
        step(pipe, x, marked(y, TARGET_FAIL, 0), loss_raising_builtin)
    exc = info.value
    assert isinstance(exc, StageError) and not isinstance(exc, WorkerError)
    assert (exc.stage, exc.worker, exc.microbatch, exc.phase) == (2, cluster.names[2], 0, "loss_fn")
    assert exc.error_message == "a plain ValueError from loss_fn"
    check_good_step(pipe, model)


@pytest.mark.parametrize("name, loss_fn, error_type, pieces", [
    ("non-scalar", lambda o, t: F.mse_loss(o, t, reduction="none"), "ValueError",
     ["loss_fn must return a scalar tensor (one element), got a tensor of shape (2, 4)", ".mean() or .sum()"]),
    ("not a tensor", lambda o, t: float(F.mse_loss(o, t)), "ValueError",
     ["loss_fn must return a scalar tensor (one element), got a float"]),
    ("no grad", lambda o, t: F.mse_loss(o.detach(), t), "RuntimeError",
     ["loss_fn returned a tensor that does not require grad", "not from a detached copy"]),
])
def test_loss_fn_returning_what_backward_cannot_start_from(failing, cluster, name, loss_fn, error_type, pieces):
    pipe, model = failing
    x, y = batch()
    with pytest.raises(StageError) as info:
        step(pipe, x, y, loss_fn)
    exc = info.value
    assert (exc.stage, exc.worker, exc.microbatch, exc.phase) == (2, cluster.names[2], 0, "loss_fn")
    assert exc.error_type == error_type
    for piece in pieces:
        assert piece in exc.error_message, (piece, exc.error_message)
    if error_type == "ValueError":
        assert isinstance(exc, ValueError)
    check_good_step(pipe, model)


def test_loss_fn_that_does_not_unpickle_on_the_worker(failing, cluster):
    pipe, model = failing
    x, y = batch()
    with pytest.raises(StageError) as info:
        step(pipe, x, y, UnpicklesBadly())
    exc = info.value
    assert (exc.stage, exc.worker, exc.phase) == (2, cluster.names[2], "train_step")
    assert exc.error_type == "ModuleNotFoundError" and "only_on_the_driver" in exc.error_message
    check_good_step(pipe, model)


# -- a layer failing --------------------------------------------------------------------------------
@pytest.mark.parametrize("mark, phase, message", [
    (FORWARD_FAIL, "forward", "forward of a marked micro-batch of 2 rows"),
    (BACKWARD_FAIL, "backward", "backward of a marked micro-batch")])
def test_a_middle_stage_raising_under_1f1b(failing, cluster, mark, phase, message):
    """Stage 1 runs F0 F1 B0 F2 ... under 1F1B (n=3, m=4): micro-batch 2 fails after a backward ran."""
    pipe, model = failing
    x, y = batch()
    t = time.monotonic()
    with pytest.raises(ValueError) as info:
        step(pipe, marked(x, mark, 2), y)
    record_surfacing(f"train_step: layer raised in {phase}", "StageError", time.monotonic() - t)
    exc = info.value
    assert isinstance(exc, StageError) and not isinstance(exc, WorkerError)
    assert (exc.stage, exc.worker, exc.microbatch, exc.phase) == (1, cluster.names[1], 2, phase)
    assert exc.error_message == message
    check_good_step(pipe, model)


@pytest.mark.parametrize("schedule, checkpoint", [("GPipe", "except_last"), ("1F1B", "always"),
                                                  ("Interleaved1F1B", "never"), ("Interleaved1F1B", "always")])
def test_a_layer_raising_under_other_schedules_and_checkpointing(cluster, schedule, checkpoint):
    """The same faults under GPipe (3 workers) and Interleaved1F1B (4 stages, [1, 2, 1, 1]: stages 0 and 2 on
    the first worker, 1 and 3 on the second), and with checkpointed micro-batches, whose backward
    recomputes the forward first."""
    model = failing_model()
    v = 2 if schedule == "Interleaved1F1B" else 1
    balance = [1, 2, 1, 1] if v == 2 else [1, 2, 2]
    with Pipe(model, chunks=4, checkpoint=checkpoint, balance=balance, workers=cluster.names[:len(balance) // v],
              schedule=schedule, stages_per_worker=v) as pipe:
        x, y = batch()
        for value, phase in [(FORWARD_FAIL, "forward"), (BACKWARD_FAIL, "backward")]:
            with pytest.raises(StageError) as info:
                step(pipe, marked(x, value, 3), y)
            exc = info.value
            assert (exc.stage, exc.worker, exc.microbatch, exc.phase) == (1, cluster.names[1], 3, phase)
            check_good_step(pipe, model)
        with pytest.raises(StageError) as info:
            step(pipe, x, marked(y, TARGET_FAIL, 1), loss_raising)
        last = len(balance) - 1
        assert (info.value.stage, info.value.worker, info.value.microbatch, info.value.phase) == (
            last, cluster.names[last % (len(balance) // v)], 1, "loss_fn")
        check_good_step(pipe, model)


@pytest.mark.parametrize("schedule, checkpoint", [("ZBVZeroBubble", "never"), ("InterleavedZeroBubble", "always"),
                                                  ("DualPipeV", "except_last")])
def test_a_layer_raising_in_either_half_of_a_split_backward(cluster, schedule, checkpoint):
    """Under the zero-bubble schedules (4 stages, 2 per worker; stage 1 on the second worker in the loop and
    in the V), a layer raising in the inputs' gradient (I) and one raising in the weight's (W) are each
    named with the half they failed in; the next step is exact."""
    model = failing_model(nn.Sequential(FailsOn(), FailsInWeight()))
    kinds = {a.kind for order in worker_orders(schedule, 4, 4, 2) for a in order if (a.i, a.j) == (3, 1)}
    split = "I" in kinds  # DualPipeV runs some backwards whole
    with Pipe(model, chunks=4, checkpoint=checkpoint, balance=[1, 2, 1, 1], workers=cluster.names[:2],
              schedule=schedule, stages_per_worker=2) as pipe:
        x, y = batch()
        check_good_step(pipe, model)  # warm: first-use allocations are not leaks
        before = all_counts(cluster.names[:2])
        for value, phase in [(BACKWARD_FAIL, "backward (input gradient)"), (WEIGHT_FAIL, "backward (weight gradient)")]:
            with pytest.raises(StageError) as info:
                step(pipe, marked(x, value, 3), y)
            exc = info.value
            assert (exc.stage, exc.worker, exc.microbatch, exc.phase) == (
                1, cluster.names[1], 3, phase if split else "backward"), kinds
            check_good_step(pipe, model)
        after = all_counts(cluster.names[:2])  # nothing left of the failed steps: contexts, threads, messages
        for process in before:
            assert after[process]["contexts"] == 0, (process, before[process], after[process])
            assert after[process]["threads"] <= before[process]["threads"] + 2, (process, before[process], after[process])
        for worker in cluster.names[:2]:
            assert rpc.rpc_sync(worker, left_in_mailbox, args=(pipe._driver.pipe_id,)) == 0, worker


# -- the autograd context --------------------------------------------------------------------------
def test_train_step_outside_its_context(failing):
    pipe, model = failing
    x, y = batch()
    with pytest.raises(RuntimeError, match=r"train_step\(context_id=0\) must run inside that context's block"):
        pipe.train_step(0, x, y, F.mse_loss)
    with dist_autograd.context() as ctx:
        with pytest.raises(RuntimeError, match=rf"train_step\(context_id={ctx + 1000}\) must run inside") as info:
            pipe.train_step(ctx + 1000, x, y, F.mse_loss)
    assert "with dist_autograd.context() as context_id:" in str(info.value)
    with dist_autograd.context() as ended:
        pass
    with pytest.raises(RuntimeError, match=rf"train_step\(context_id={ended}\) must run inside"):
        pipe.train_step(ended, x, y, F.mse_loss)
    check_good_step(pipe, model)


def test_train_step_under_no_grad(failing):
    pipe, model = failing
    x, y = batch()
    with dist_autograd.context() as ctx, torch.no_grad():
        with pytest.raises(RuntimeError) as info:
            pipe.train_step(ctx, x, y, F.mse_loss)
    assert "train_step under torch.no_grad(): a training step needs gradients" in str(info.value)
    assert "call pipe(x) under torch.no_grad()" in str(info.value)
    check_good_step(pipe, model)


def test_backward_after_train_step_in_the_same_context_is_refused(failing):
    pipe, model = failing
    x, y = batch()
    with dist_autograd.context() as ctx:
        pipe.train_step(ctx, x, y, F.mse_loss)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pipe(x) under 1F1B runs GPipe's order, and says so once
            out = pipe(x).local_value()
        with pytest.raises(RuntimeError) as info:
            pipe.backward(ctx, F.mse_loss(out, y))
    message = str(info.value)
    for piece in [f"this pipe ran train_step in autograd context {ctx}", "its gradients are in the context already",
                  "Call DistributedOptimizer.step(ctx) now"]:
        assert piece in message, (piece, message)
    check_good_step(pipe, model)


CONTEXT_SCRIPT = """
import time, warnings
import torch, torch.distributed.autograd as dist_autograd, torch.nn.functional as F
from rrefpipe import Pipe, StageError
from workers import LocalWorkers
from tests.distributed.probes import all_counts
from tests.distributed.test_train_step_faults import batch, failing_model

warnings.simplefilter("ignore")  # pipe(x) under 1F1B runs GPipe's order, and says so
x, y = batch()
model = failing_model()
with LocalWorkers(3, threads=1) as group:
    pipe = Pipe(model, chunks=4, checkpoint="never", balance=[1, 2, 2], workers=group.names, schedule="1F1B",
                rpc_timeout=2)
    with dist_autograd.context() as ctx:
        pipe.train_step(ctx, x, y, F.mse_loss)
    before = all_counts(group.names)
    for case in ("forward", "forward_backward"):
        t = time.monotonic()
        try:
            with dist_autograd.context() as ctx:
                out = pipe(x).local_value()
                if case == "forward_backward":
                    pipe.backward(ctx, F.mse_loss(out, y))
                pipe.train_step(ctx, x, y, F.mse_loss)
            print(f"{{case}}_raised=nothing")
        except Exception as exc:
            print(f"{{case}}_raised={{type(exc).__name__}}")
            print(f"{{case}}_stage_error={{isinstance(exc, StageError)}}")
            print(f"{{case}}_message={{str(exc).splitlines()[0]}}")
        print(f"{{case}}_seconds={{time.monotonic() - t}}")
        with dist_autograd.context() as ctx:
            loss = pipe.train_step(ctx, x, y, F.mse_loss)
        print(f"{{case}}_good_after={{bool(torch.allclose(loss, F.mse_loss(model(x), y)))}}")
    time.sleep(1)  # what a failed step leaves is released within this (a stuck thread is not)
    after = all_counts(group.names)
    print("extra_threads=" + str({{k: after[k]["threads"] - before[k]["threads"] for k in before}}))
    pipe.close()
"""


def test_train_step_in_a_context_where_a_forward_ran_is_refused_at_once():
    """A user who logs pipe(x) in the step's context, or runs pipe.backward and then train_step there: as
    pipe.backward after train_step is refused at once (contexts.py), so should this order be. In its own
    group, with a 2 s RPC timeout: a worker thread stays stuck."""
    proc = run_script(CONTEXT_SCRIPT.format(), timeout=100)
    values = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    print(proc.stdout, proc.stderr[-3000:])
    for case in ("forward", "forward_backward"):
        assert values[f"{case}_good_after"] == "True", values  # holds today: the next step runs
    assert values["extra_threads"] == "{'driver': 0, 'worker1': 0, 'worker2': 0, 'worker3': 0}", values
    for case in ("forward", "forward_backward"):
        assert (values[f"{case}_raised"], values[f"{case}_stage_error"]) == ("RuntimeError", "False"), values
        assert "context" in values[f"{case}_message"], values
        assert float(values[f"{case}_seconds"]) < 1, values


# -- a worker killed during a step -----------------------------------------------------------------
KILL_SCRIPT = """
import os, signal, threading, time
from pathlib import Path
import torch, torch.distributed.autograd as dist_autograd, torch.nn.functional as F
from rrefpipe import Pipe, StageError
from workers import LocalWorkers
from tests.distributed.test_train_step_faults import HOLD, HoldsInWeight, HoldsOn, batch, failing_model, marked

folder, phase = {folder!r}, {phase!r}
killed = {{}}

def killer():  # kills the worker that says it is held, as soon as it says so
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        held = list(Path(folder).glob("held-*"))
        if held:
            pid = int(held[0].name.rsplit("-", 1)[1])
            os.kill(pid, signal.SIGKILL)
            killed.update(pid=pid, at=time.monotonic())
            return
        time.sleep(0.002)

split = phase == "weight"  # between the two halves of a split backward: ZBV, 4 stages on 2 workers
stream = phase == "stream"  # in pipe.train_stream under PipeDream-2BW, in a forward
with LocalWorkers(2 if split else 3, threads=1) as group:
    middle = HoldsInWeight(folder) if split else HoldsOn(folder, "forward" if stream else phase)
    schedule = "ZBVZeroBubble" if split else "PipeDream-2BW" if stream else "1F1B"
    pipe = Pipe(failing_model(middle), chunks=4, checkpoint="never", balance=[1, 2, 1, 1] if split else [1, 2, 2],
                workers=group.names, schedule=schedule, stages_per_worker=1 + split, rpc_timeout=60)
    x, y = batch()
    with dist_autograd.context() as ctx:  # a good step first: the fault comes in a warm pipe
        pipe.train_step(ctx, x, y, F.mse_loss)
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        if stream:  # batch 3 of a continuous pipeline holds stage 1's forward
            data = [(marked(x, HOLD, 2) if t == 3 else x, y) for t in range(6)]
            for loss in pipe.train_stream(data, F.mse_loss, pipe.optimizer(torch.optim.SGD, lr=0.0)):  # (HOLD must reach stage 1 as it is)
                pass
        else:
            with dist_autograd.context() as ctx:
                pipe.train_step(ctx, marked(x, HOLD, 2), y, F.mse_loss)
        print("raised=nothing")
    except StageError as exc:
        print(f"raised={{type(exc).__name__}}")
        print(f"stage={{exc.stage}}")
        print(f"worker={{exc.worker}}")
        print(f"phase={{exc.phase}}")
        print(f"message={{exc.error_message.splitlines()[0]}}")
        print(f"surfaced={{time.monotonic() - killed['at']}}")
    print(f"killed={{killed.get('pid') == group.pids[1]}}")
    t = time.monotonic()
    pipe.close()
    print(f"closed={{time.monotonic() - t}}")
    t = time.monotonic()
print(f"left={{time.monotonic() - t}}")
"""


@pytest.mark.parametrize("phase", ["forward", "backward", "weight", "stream"])
def test_a_worker_killed_during_a_1f1b_step_is_named_at_once(tmp_path, phase):
    """The stage-1 worker is SIGKILLed while it holds micro-batch 2 in its forward (after B0) or its
    backward (after F3), or (``weight``, under ZBVZeroBubble) in the weight half of its backward, after it
    sent the input's gradient back, or (``stream``) in the forward of batch 3 of a PipeDream-2BW stream: a
    WorkerError names it within seconds, and the pipe and group close promptly. Its own group in a fresh
    interpreter: the session group must keep its workers."""
    proc = run_script(KILL_SCRIPT.format(folder=str(tmp_path), phase=phase), timeout=100)
    values = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    print(proc.stderr[-4000:])
    assert values.get("killed") == "True", proc.stdout
    assert (values["raised"], values["stage"], values["worker"]) == ("WorkerError", "1", "worker2"), values
    assert values["phase"].startswith("stream" if phase == "stream" else "train_step"), values
    assert values["message"].startswith("the worker is unreachable"), values
    surfaced, closed, left = float(values["surfaced"]), float(values["closed"]), float(values["left"])
    record_surfacing(f"train_step: worker killed in {phase}", "WorkerError", surfaced)
    record_surfacing(f"train_step: worker killed in {phase}", "closed", closed)
    assert surfaced < 10 and closed < 15 and left < 20, values


# -- nothing piles up --------------------------------------------------------------------------------
def test_twenty_steps_with_failures_leak_nothing(failing, cluster):
    """Failing loss_fn, failing forward, failing backward and good steps in turn, 20 in all: the driver and
    workers hold as many contexts, calls in flight, threads and stages as after the first good step."""
    pipe, model = failing
    x, y = batch()
    check_good_step(pipe, model)  # warm: first-use allocations are not leaks
    before = all_counts(cluster.names)
    faults = [
        lambda: step(pipe, x, marked(y, TARGET_FAIL, 1), loss_raising),
        lambda: step(pipe, marked(x, FORWARD_FAIL, 2), y),
        lambda: step(pipe, marked(x, BACKWARD_FAIL, 3), y),
        lambda: step(pipe, x, y, lambda o, t: F.mse_loss(o, t, reduction="none")),
    ]
    for k in range(20):
        if k % 2:
            check_good_step(pipe, model)
        else:
            with pytest.raises(StageError):
                faults[k // 2 % len(faults)]()
    check_good_step(pipe, model)
    after = all_counts(cluster.names)
    for process in before:
        b, a = before[process], after[process]
        assert a["stages"] == b["stages"], (process, b, a)
        assert a["contexts"] == 0, (process, b, a)
        # in flight at any moment: at most each worker's liveness ping and this probe; nothing piles up
        assert a["active_calls"] <= len(cluster.names) + 1, (process, b, a)
        assert a["owner_rrefs"] <= b["owner_rrefs"] + 2, (process, b, a)
        assert a["threads"] <= b["threads"] + 2, (process, b, a)
    for j, worker in enumerate(pipe._driver.workers):
        assert rpc.rpc_sync(worker, left_in_mailbox, args=(pipe._driver.pipe_id,)) == 0, worker


def left_in_mailbox(pipe_id: str) -> int:
    """On a worker: the messages of a pipe's steps that nobody took."""
    from rrefpipe.stage_side import scheduled

    box = scheduled._mailboxes.get(pipe_id)
    return 0 if box is None else len(box.items)
