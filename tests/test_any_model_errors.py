"""Any model (issue 43), refused through the public ``Pipe(...)``: bad split points or marks, no sample, a model
torch.export cannot capture, options that cannot apply to a captured model. Each is the right exception with a
message that names the path and says what to do, raised before any worker starts: the RPC state and this
process's children are as they were, and placing stages (which starts local workers) is never reached. Then a
built pipe refuses calls unlike its sample at ``pipe(...)`` and stays usable.

The capture-level errors, without Pipe, are in tests/test_capture.py (whose models this module borrows).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch import Tensor, nn

from examples.tiny_gpt import GPT
from rrefpipe import CaptureError, Pipe, _rpc, set_stage
from rrefpipe.driver_side import placement
from tests.test_capture import Cache, CalledTwice, DataDependent, OneFlowExample, TwoInputs


def child_pids() -> frozenset[int]:
    """This process's live children, from /proc (stage workers are ``subprocess`` children, which
    ``multiprocessing.active_children()`` does not list)."""
    me, found = str(os.getpid()), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if ppid == me and state != "Z":
            found.add(int(entry))
    return frozenset(found)


@contextmanager
def no_worker_started(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The block must raise before any stage is placed: ``placement.stage_workers`` (where local workers
    start, or the RPC group's are picked) fails the test if reached; RPC stays as it was (not initialised,
    when this module runs first or alone), and no child process appears."""
    def reached(*args: object, **kwargs: object) -> None:
        raise AssertionError("Pipe went on to place its stages on workers before refusing")

    monkeypatch.setattr(placement, "stage_workers", reached)
    rpc_before, children_before = _rpc.is_initialized(), child_pids()
    try:
        yield
    finally:
        assert _rpc.is_initialized() == rpc_before, "the failed Pipe(...) changed the RPC state"
        assert child_pids() <= children_before, f"new child processes: {sorted(child_pids() - children_before)}"


def assert_refused(monkeypatch: pytest.MonkeyPatch, build: Callable[[], object], error: type[Exception],
                   match: str) -> pytest.ExceptionInfo[Exception]:
    """``build()`` raises ``error`` matching ``match`` before any worker starts."""
    with no_worker_started(monkeypatch), pytest.raises(error, match=match) as info:
        build()
    return info


def tokens(rows: int = 2) -> Tensor:
    return torch.randint(0, 64, (rows, 8))


@pytest.fixture(scope="module")
def small_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(layers=2)


# -- no sample -------------------------------------------------------------------------------------------


def test_split_points_without_a_sample(monkeypatch, small_gpt):
    assert_refused(monkeypatch, lambda: Pipe(small_gpt, chunks=2, split_points=["blocks.1"]), ValueError,
                   r"Pipe of a GPT cut at split_points or set_stage marks needs sample=: an example input")


def test_set_stage_marks_without_a_sample(monkeypatch):
    model = OneFlowExample()
    set_stage(model.m_stage0, 0)
    set_stage(model.m_stage1, 1)
    assert_refused(monkeypatch, lambda: Pipe(model, chunks=2), ValueError,
                   r"Pipe of a OneFlowExample cut at split_points or set_stage marks needs sample=")


# -- split points that cannot cut the model ----------------------------------------------------------------

SPLIT_POINTS = [
    ("no such submodule", ["blocks.7"], ValueError,
     r"split point 'blocks.7' names no submodule of GPT \(did you mean 'blocks.1'.*module paths as "
     r"named_modules\(\) gives them"),
    ("a parameter", ["head.weight"], ValueError,
     r"'head.weight' names no submodule of GPT \(it is a tensor of 'head'"),
    ("named twice", ["blocks.1", "blocks.1"], ValueError, r"split point 'blocks.1' is named twice.*drop the second"),
    ("a string", "blocks.1", TypeError, r"split_points is a list of submodule paths.*use \['blocks.1'\]"),
    ("out of forward order", ["ln_f", "blocks.1"], ValueError,
     r"split points out of forward order: 'ln_f' is listed before.*in forward order they are \['blocks.1', 'ln_f'\]"),
    ("an empty first stage", ["tok"], ValueError, r"split point 'tok' begins at forward's first operation.*drop it"),
]


@pytest.mark.parametrize("points, error, match", [c[1:] for c in SPLIT_POINTS], ids=[c[0] for c in SPLIT_POINTS])
def test_split_points_that_cannot_cut_the_model(monkeypatch, small_gpt, points, error, match):
    assert_refused(monkeypatch, lambda: Pipe(small_gpt, chunks=2, split_points=points, sample=tokens()), error, match)


def test_set_stage_marks_out_of_forward_order(monkeypatch):
    model = OneFlowExample()
    set_stage(model.m_stage0, 1)
    set_stage(model.m_stage1, 0)
    assert_refused(monkeypatch, lambda: Pipe(model, chunks=2, sample=torch.randn(2, 1, 28, 28)), ValueError,
                   r"'m_stage1' is set to stage 0 but runs after 'm_stage0' \(stage 1\).*renumber the set_stage marks")


def test_a_submodule_with_parameters_called_on_both_sides_of_a_cut(monkeypatch):
    assert_refused(monkeypatch, lambda: Pipe(CalledTwice(), chunks=2, split_points=["b"], sample=torch.randn(2, 4)),
                   ValueError, r"called on both sides of a cut: 'shared' \(stages 0, 1\)\. Move the cuts")


# -- models torch.export cannot capture -------------------------------------------------------------------


def test_a_data_dependent_branch_is_a_capture_error(monkeypatch):
    info = assert_refused(
        monkeypatch, lambda: Pipe(DataDependent(), chunks=2, split_points=["b"], sample=torch.randn(2, 4)),
        CaptureError, r"torch.export cannot capture DataDependent \(in submodule 'gate'\): \w+: .*data-dependent.*"
                      r"What to do: .*torch.where.*torch.cond.*Pipe.from_factories")
    assert isinstance(info.value, ValueError)
    assert info.value.__cause__ is not None  # torch's own error, with its full text and traceback


class CacheAfter(nn.Module):
    """Two stages whose output holds an object torch.export cannot flatten (as a Hugging Face cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Cache]:
        y = self.b(self.a(x))
        return y, Cache(y)


def test_an_output_export_cannot_flatten_is_a_capture_error(monkeypatch):
    assert_refused(monkeypatch, lambda: Pipe(CacheAfter(), chunks=2, split_points=["b"], sample=torch.randn(2, 4)),
                   CaptureError, r"cannot capture CacheAfter.*What to do: .*return tensors in tuples, lists or dicts.*"
                                 r"use_cache=False.*Pipe.from_factories")


# -- options that do not apply to a captured model, and bad samples -----------------------------------------

OPTIONS = [
    ("balance", dict(balance=[1, 1]), r"balance= and split_points: the split points say where stages begin; drop "
                                      r"balance"),
    ("deferred_batch_norm", dict(deferred_batch_norm=True),
     r"deferred_batch_norm=True with split_points: torch.export traces BatchNorm.*leave it False"),
]


@pytest.mark.parametrize("options, match", [c[1:] for c in OPTIONS], ids=[c[0] for c in OPTIONS])
def test_options_that_do_not_apply_to_split_points(monkeypatch, small_gpt, options, match):
    assert_refused(monkeypatch, lambda: Pipe(small_gpt, chunks=2, split_points=["blocks.1"], sample=tokens(),
                                             **options), ValueError, match)


def test_remote_output_with_a_dict_output(monkeypatch):
    ids = torch.randint(0, 10, (2, 5))
    assert_refused(monkeypatch, lambda: Pipe(TwoInputs(), chunks=2, split_points=["b"], remote_output=True,
                                             sample=(ids, ids, torch.ones(2, 5))), ValueError,
                   r"remote_output=True needs a model whose output is a tensor or a tuple of tensors; this one returns "
                   r"dict: leave remote_output False")


@pytest.mark.parametrize("sample", [None, torch.randn(2, 1, 28, 28)], ids=["no sample", "a sample"])
def test_a_module_that_is_not_sequential_without_split_points_or_marks(monkeypatch, sample):
    """Pipe's docstring: TypeError when ``module`` is not an nn.Sequential and has no split points or marks
    (``partition.verify_module`` words it: wrap the layers, or name split_points, or set_stage)."""
    assert_refused(monkeypatch, lambda: Pipe(OneFlowExample(), chunks=2, sample=sample), TypeError,
                   r"Pipe expects an nn.Sequential module, got OneFlowExample.*split_points=.*set_stage")


def test_a_sample_batch_of_one(monkeypatch, small_gpt):
    assert_refused(monkeypatch, lambda: Pipe(small_gpt, chunks=2, split_points=["blocks.1"], sample=tokens(1)),
                   ValueError, r"the sample's batch \(dim 0\) is 1.*give a sample of 2 or more rows")


def test_a_sample_that_does_not_fit_forward(monkeypatch, small_gpt):
    assert_refused(monkeypatch, lambda: Pipe(small_gpt, chunks=2, split_points=["blocks.1"],
                                             sample=(tokens(), tokens())), TypeError,
                   r"the sample does not fit GPT.forward: too many positional arguments")


# -- a built pipe refuses calls unlike its sample, and stays usable -----------------------------------------
# (last in this module: the session's workers initialise RPC in this process)


class Scaled(nn.Module):
    """A number among the positional arguments: torch.export bakes the sample's value in."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor, scale: float) -> Tensor:
        return self.b(torch.relu(self.a(x)) * scale)


CALLS = [
    ("another dtype", (torch.randn(4, 4, dtype=torch.float64), 2.0), TypeError,
     r"input args\[0\] is torch.float64; the capture was made with torch.float32: convert it"),
    ("another shape after dim 0", (torch.randn(4, 5), 2.0), ValueError,
     r"input args\[0\] has shape \(4, 5\); the capture fixed every dim but dim 0 to the sample's \(B, 4\)"),
    ("another number", (torch.randn(4, 4), 3.0), ValueError,
     r"input args\[1\] is 3.0 but the capture baked in the sample's 2.0.*capture again with this value"),
    ("an argument missing", (torch.randn(4, 4),), TypeError,
     r"the inputs are not shaped like the sample's.*pass the same arguments"),
    ("a number for the tensor", (1.0, 2.0), TypeError, r"input args\[0\] is a float; the sample's was a tensor"),
]


@pytest.fixture(scope="module")
def scaled_pipe(cluster) -> Iterator[tuple[Pipe, Scaled]]:
    torch.manual_seed(0)
    model = Scaled()
    with Pipe(model, chunks=2, split_points=["b"], sample=(torch.randn(2, 4), 2.0), workers=cluster.names[:2]) as pipe:
        yield pipe, model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, error, match", [c[1:] for c in CALLS], ids=[c[0] for c in CALLS])
def test_a_call_unlike_the_sample_is_refused_and_the_pipe_stays_usable(scaled_pipe, args, error, match):
    pipe, model = scaled_pipe
    with torch.no_grad():
        with pytest.raises(error, match=match):
            pipe(*args)
        x = torch.randn(6, 4)  # another batch size than the sample's
        torch.testing.assert_close(pipe(x, 2.0).local_value(), model(x, 2.0))


@pytest.mark.timeout(120)
def test_a_train_step_unlike_the_sample_is_refused_and_the_next_one_trains(scaled_pipe):
    pipe, model = scaled_pipe
    x, target = torch.randn(4, 4), torch.randn(4, 3)
    loss_fn = nn.functional.mse_loss
    with dist_autograd.context() as ctx:
        with pytest.raises(ValueError, match=r"input args\[1\] is 0.5 but the capture baked in the sample's 2.0"):
            pipe.train_step(ctx, (x, 0.5), target, loss_fn)
    with dist_autograd.context() as ctx:
        loss = pipe.train_step(ctx, (x, 2.0), target, loss_fn)
    torch.testing.assert_close(loss, loss_fn(model(x, 2.0), target).detach())
