import gc
import time

import pytest
import torch
from torch import nn

from rrefpipe.dependency import new_phony
from rrefpipe.stage_side.stage import Stage, StepMeta
from tests.layers import RaiseInRecompute


def _meta(grad: bool, stop: int) -> StepMeta:
    return StepMeta(step=0, chunks=2, checkpoint_stop=stop, grad_enabled=grad, driver="driver", timeout=1.0)


def _stage() -> Stage:
    torch.manual_seed(0)
    return Stage(0, nn.Sequential(nn.Linear(4, 4), nn.Tanh()), torch.device("cpu"), "here")


@pytest.mark.parametrize("stop, recomputes", [(2, 1), (0, 0)])
def test_checkpointed_microbatch_is_recomputed_in_backward(stop, recomputes):
    stage = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    out = stage.run(_meta(True, stop), 0, x).value
    out.sum().backward()
    kinds = [e.kind for e in stage.recorder.snapshot()]
    assert kinds.count("forward") == 1 and kinds.count("recompute") == recomputes
    assert kinds.count("backward") == 1
    ref = x.detach().clone().requires_grad_()
    stage.module(ref).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


def test_recompute_failures_are_kept_by_step_and_taken_once():
    """The driver asks a stage for the failures of its failed backward's steps: those of another step,
    or ones reported already, must not come back as the cause (every micro-batch of a step can fail)."""
    stage = Stage(0, nn.Sequential(nn.Linear(4, 4), RaiseInRecompute()), torch.device("cpu"), "here")
    for step in (0, 1):
        meta = StepMeta(step=step, chunks=2, checkpoint_stop=2, grad_enabled=True, driver="driver", timeout=1.0)
        for i in range(2):
            out = stage.run(meta, i, torch.randn(2, 4)).value
            with pytest.raises(IndexError, match="only on recompute"):
                out.sum().backward()
    assert stage.take_backward_failure([2]) is None
    latest = stage.take_backward_failure([0])
    assert latest is not None and (latest.phase, latest.microbatch, latest.error_type) == ("recompute", 1, "IndexError")
    assert stage.take_backward_failure([0]) is None  # step 0's other failure went with it
    assert stage.take_backward_failure([1, 0]).microbatch == 1  # step 1's are still there
    assert stage.take_backward_failure([1]) is None


def test_without_grad_no_autograd_state_is_kept():
    stage = _stage()
    result = stage.run(_meta(False, 2), 0, torch.randn(2, 4, requires_grad=True))
    assert result.value.grad_fn is None and result.phony is None
    assert [e.kind for e in stage.recorder.snapshot()] == ["forward"]


def test_non_tensor_output_names_the_stage():
    stage = Stage(3, nn.Sequential(nn.Flatten(0), nn.Module()), torch.device("cpu"), "here")
    stage.module[1].forward = lambda x: "nope"  # type: ignore[method-assign]
    with pytest.raises(TypeError, match="output of stage 3 .* got str"):
        stage.run(_meta(True, 0), 0, torch.randn(2, 2))


@pytest.mark.parametrize("input_grad", [True, False])
def test_backward_is_recorded_with_or_without_input_gradient(input_grad):
    """Without an input gradient (the first stage), backward ends after the last node of its forward."""
    stage = _stage()
    for i in range(3):
        x = torch.randn(3, 4, requires_grad=input_grad)
        stage.run(_meta(True, 0), i, x).value.sum().backward()
    backward = [e for e in stage.recorder.snapshot() if e.kind == "backward"]
    assert [e.microbatch for e in backward] == [0, 1, 2]
    assert all(e.end >= e.start for e in backward)
    assert not stage._backward_starts  # nothing left behind


class _Stamped(torch.autograd.Function):
    """``x * w``; its backward notes when it ran (first in the forward, so last in backward)."""

    @staticmethod
    def forward(ctx, x, w, log):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, w)
        ctx.log = log
        return x * w

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        x, w = ctx.saved_tensors
        ctx.log.append(time.time())
        return grad * w, (grad * x).sum(0), None


class _Scale(nn.Module):
    def __init__(self, log: list) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Stamped.apply(x, self.w, self.log)


@pytest.mark.parametrize("crosses", [True, False])
def test_first_stage_backward_ends_after_its_first_layer(crosses):
    """The first layer's backward runs last; the recorded end of backward may not come before it,
    whether the output goes to another worker (phonies) or stays in this process."""
    log: list = []
    stage = Stage(0, nn.Sequential(_Scale(log), nn.Linear(4, 4), nn.Tanh()), torch.device("cpu"), "here")
    phonies = [new_phony()] if crosses else []
    for i in range(2):
        stage.run(_meta(True, 0), i, torch.randn(3, 4), phonies).value.sum().backward()
    backward = [e for e in stage.recorder.snapshot() if e.kind == "backward"]
    assert [e.microbatch for e in backward] == [0, 1] and len(log) == 2
    assert all(e.end >= stamp for e, stamp in zip(backward, log))


def test_the_execution_record_keeps_only_recent_events():
    from rrefpipe.trace import CAPACITY, Recorder

    recorder = Recorder(0, "here")
    for k in range(CAPACITY + 100):
        recorder.add("forward", k, 0, 0.0, 1.0)
    events = recorder.snapshot()
    assert len(events) == CAPACITY and events[0].step == 100 and events[-1].step == CAPACITY + 99


def _ahead_stage(module: nn.Sequential) -> Stage:
    torch.manual_seed(0)
    return Stage(0, module, torch.device("cpu"), "here", recompute_ahead=True)


def test_a_recomputation_ahead_is_dropped_when_another_forward_comes_first():
    """Several forwards before one backward: each keeps its inputs only, as checkpointing promises."""
    stage = _ahead_stage(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    meta = StepMeta(step=0, chunks=1, checkpoint_stop=1, grad_enabled=True, driver="driver", timeout=1.0)
    x = torch.randn(3, 4, requires_grad=True)
    first = stage.run(meta, 0, x).value
    run = stage._ahead._runs[(0, 0)]()
    stage.recompute_soon(0, 0)
    run.recompute()  # returns once the activations are back, whichever thread brought them
    assert all(slot.tensor is not None for slot in run._slots)
    second = stage.run(StepMeta(**{**meta.__dict__, "step": 1}), 0, x).value
    assert all(slot.tensor is None for slot in run._slots)
    (first + second).sum().backward()  # the first comes back for backward
    ref = x.detach().clone().requires_grad_()
    (2 * stage.module(ref)).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


def test_a_checkpointed_forward_with_a_stash_goes_with_its_graph():
    """The stashed tensor the stage sends on belongs to the graph, which owns the recomputation: the
    forward kept for recomputing must not hold it too, a cycle through autograd's C++ nodes that would
    keep a step whose backward never comes (a failed step, say) for good."""
    from rrefpipe.skip.layout import SkipRoutes
    from rrefpipe.skip.namespace import DEFAULT
    from tests.layers import StashInput

    stage = _ahead_stage(nn.Sequential(nn.Linear(4, 4), StashInput(), nn.Tanh()))
    key = (DEFAULT, "skip")
    stage.routes = SkipRoutes({key: 1}, frozenset())
    meta = StepMeta(step=0, chunks=1, checkpoint_stop=1, grad_enabled=True, driver="driver", timeout=1.0)
    gc.disable()
    try:
        result = stage.run(meta, 0, torch.randn(3, 4), [new_phony()])
        kept = stage._ahead._runs[(0, 0)]
        assert kept() is not None and result.skips[key].grad_fn is not None
        del result
        assert kept() is None
    finally:
        gc.enable()
