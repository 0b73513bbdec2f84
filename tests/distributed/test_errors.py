"""A stage that raises: the caller learns stage, worker, micro-batch and cause; the pipe stays usable."""
import sys

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch import nn

from rrefpipe import Pipe, StageError, WorkerError
from tests.distributed.probes import check_transparent
from tests.layers import (SENTINEL, Boom, DoubleInPlace, Misbehaves, PopAdd, PopAddInPlace, StashInput,
                          StashUnlessSentinel, ToDict, Transpose)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("per_message", [1, 3])
def test_stage_exception_names_stage_worker_microbatch_and_cause(cluster, per_message):
    """With 3 micro-batches per message, 0 and 1 wait for 2 when it fails: they still go on."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Identity(), Boom(), nn.Linear(4, 2))
    with Pipe(model, chunks=4, balance=[1, 2, 1], workers=cluster.names[:3],
              microbatches_per_message=per_message) as pipe:
        x = torch.zeros(8, 4)
        bad = x.clone()
        bad[4:6] = SENTINEL  # micro-batch 2; an identity first layer passes the sentinel on to Boom
        state = {"0.weight": torch.eye(4), "0.bias": torch.zeros(4),
                 "3.weight": torch.ones(2, 4), "3.bias": torch.zeros(2)}
        pipe.load_state_dict(state)
        model.load_state_dict(state)
        with dist_autograd.context():
            with pytest.raises(StageError) as info:
                pipe(bad)
        err = info.value
        assert (err.stage, err.worker, err.microbatch, err.error_type) == (1, "worker2", 2, "ValueError")
        assert "stage 1 on worker 'worker2', micro-batch 2 failed in forward: ValueError: boom" in str(err)
        assert isinstance(err.__cause__, ValueError)
        assert "Boom" in err.remote_traceback or "boom" in err.remote_traceback
        if sys.version_info >= (3, 11):  # an uncaught error shows the layer's frames (tracebacks do not pickle)
            note = "\n".join(err.__notes__)
            assert "tests/layers.py" in note and 'raise ValueError(f"boom' in note and "/rrefpipe/" not in note
        # the same pipe keeps working, and later micro-batches of the failed step were not run
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value(), model(x))
        ran = {e.microbatch for e in pipe.execution_record() if e.stage == 2 and e.step == 0}
        assert ran == {0, 1}


def _fails_then_works(pipe: Pipe, model: nn.Module, bad: torch.Tensor, match: str) -> None:
    """``bad`` fails with a StageError matching ``match``; the same pipe then gives the plain output."""
    with torch.no_grad():
        with pytest.raises(StageError, match=match):
            pipe(bad)
        x = torch.randn(4, 4)
        torch.testing.assert_close(pipe(x).local_value(), model(x))


def _pass_through_first_layer(pipe: Pipe, model: nn.Module) -> torch.Tensor:
    """Give both a first Linear(4, 4) that passes its input on, and return a batch whose micro-batch 0
    holds SENTINEL: it reaches the second layer as it is."""
    state = {"0.weight": torch.eye(4), "0.bias": torch.zeros(4), "2.weight": torch.ones(2, 4), "2.bias": torch.zeros(2)}
    pipe.load_state_dict(state)
    model.load_state_dict(state)
    bad = torch.zeros(4, 4)
    bad[0] = SENTINEL
    return bad


@pytest.mark.parametrize("kind, reported", [
    ("exit", "SystemExit: 3"),
    ("unprintable", "Unprintable: <Unprintable that cannot be printed"),
    ("worker_only", "OnlyOnTheWorker: its class is in a module only the worker has"),
])
def test_odd_exceptions_fail_the_step_not_the_worker(cluster, kind, reported):
    """SystemExit and an unprintable exception had escaped the stage's error handling: its drain never
    ended, the step waited for the RPC timeout, blamed the stage before, and every later step timed out
    too. A class the driver cannot import had made the report itself fail to unpickle: a WorkerError
    saying only "ModuleNotFoundError"."""
    model = nn.Sequential(nn.Linear(4, 4), Misbehaves(kind), nn.Linear(4, 2))
    with Pipe(model, chunks=2, balance=[1, 1, 1], workers=cluster.names[:3]) as pipe:
        _fails_then_works(pipe, model, _pass_through_first_layer(pipe, model),
                          f"stage 1 on worker 'worker2', micro-batch 0 failed in forward: {reported}")


def test_an_unflagged_in_place_first_layer_is_named_in_forward(cluster):
    """A stage whose first layer overwrites its input without an ``inplace`` flag cannot be
    checkpointed: the forward names the stage and the cause, where backward would have failed as
    "python_error"; the stage still works without gradients."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 4), DoubleInPlace(), nn.Linear(4, 2))
    x = torch.randn(4, 4)
    with Pipe(model, chunks=2, balance=[1, 2], workers=cluster.names[:2]) as pipe:
        with dist_autograd.context():
            with pytest.raises(StageError, match="input or a skip tensor it popped in place") as info:
                pipe(x)
        assert (info.value.stage, info.value.worker, info.value.microbatch) == (1, "worker2", 0)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value(), model(x))


def test_a_skip_popped_from_another_stage_and_changed_in_place_is_named_in_forward(cluster):
    """A checkpointed stage recomputes from the skip tensors it received: one changed in place would
    recompute other activations, and the gradients came out wrong without an error. The forward names
    the stage and the cause; without checkpointing the result is the plain module's."""
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(6, 6), StashInput(), nn.Tanh(), PopAddInPlace(), nn.Linear(6, 3))
    x = torch.randn(4, 6, requires_grad=True)
    with Pipe(model, chunks=2, checkpoint="always", balance=[3, 2], workers=cluster.names[:2]) as pipe:
        with dist_autograd.context():
            with pytest.raises(StageError, match="input or a skip tensor it popped in place") as info:
                pipe(x)
        assert (info.value.stage, info.value.worker, info.value.microbatch) == (1, "worker2", 0)
    with Pipe(model, chunks=2, checkpoint="never", balance=[3, 2], workers=cluster.names[:2]) as pipe:
        check_transparent(pipe, model, x)


def test_backward_in_a_context_whose_forward_failed_is_refused_at_once(cluster):
    """The failed forward's sends stay in the context and distributed autograd would wait for them until
    the RPC timeout, then fail with a bare error; pipe.backward says so at once, and a new context works."""
    model = nn.Sequential(nn.Linear(4, 4), Boom(), nn.Linear(4, 2))
    with Pipe(model, chunks=2, balance=[1, 1, 1], workers=cluster.names[:3]) as pipe:
        bad = _pass_through_first_layer(pipe, model)
        x = torch.randn(4, 4)
        with dist_autograd.context() as ctx:
            with pytest.raises(StageError):
                pipe(bad)
            out = pipe(x).local_value()
            with pytest.raises(RuntimeError, match=f"a forward of this pipe failed in autograd context {ctx}"):
                pipe.backward(ctx, out.sum())
        with dist_autograd.context() as ctx:
            out = pipe(x).local_value()
            torch.testing.assert_close(out, model(x))
            pipe.backward(ctx, out.sum())  # at once, as in any step


def test_a_declared_stash_left_out_fails_its_stage_at_once(cluster):
    """The popping stage would wait for the skip until the RPC timeout (120 s); the stashing layer
    raises instead, and the pipe goes on."""
    model = nn.Sequential(StashUnlessSentinel(), nn.Linear(4, 4), PopAdd())
    with Pipe(model, chunks=2, balance=[1, 1, 1], workers=cluster.names[:3]) as pipe:
        bad = torch.zeros(4, 4)
        bad[3] = SENTINEL  # micro-batch 1
        _fails_then_works(pipe, model, bad, r"stage 0 on worker 'worker1', micro-batch 1 failed in forward: "
                                            r"RuntimeError: StashUnlessSentinel declares stash=\['skip'\]")


def test_non_tensor_stage_output_is_a_type_error_naming_the_stage(cluster):
    model = nn.Sequential(nn.Linear(4, 4), ToDict(), nn.Identity())
    with Pipe(model, chunks=2, balance=[1, 1, 1], workers=cluster.names[:3]) as pipe:
        with pytest.raises(StageError, match="stage 1 .* TypeError: output of stage 1 must be a Tensor"):
            with torch.no_grad():
                pipe(torch.randn(4, 4))


def test_outputs_that_do_not_concatenate_name_the_last_stage(cluster):
    """The last stage gathers the micro-batches' outputs along dim 0 before sending them to the driver."""
    model = nn.Sequential(nn.Linear(4, 4), Transpose())
    with Pipe(model, chunks=2, balance=[1, 1], workers=cluster.names[:2]) as pipe:
        with torch.no_grad():
            with pytest.raises(StageError, match="stage 1 on worker 'worker2' failed in gather: RuntimeError"):
                pipe(torch.randn(3, 4))  # micro-batches of 2 and 1: outputs of 4x2 and 4x1
            x = torch.randn(4, 4)  # equal micro-batches concatenate: the pipe is still usable
            torch.testing.assert_close(pipe(x).local_value(), torch.cat([model(x[:2]), model(x[2:])]))


def test_outputs_kept_on_the_last_worker_that_do_not_concatenate_name_it(cluster):
    model = nn.Sequential(nn.Linear(4, 4), Transpose())
    with Pipe(model, chunks=2, balance=[1, 1], workers=cluster.names[:2], remote_output=True) as pipe:
        with torch.no_grad():
            with pytest.raises(RuntimeError, match="stage 1 on worker 'worker2' failed in gather: RuntimeError"):
                pipe(torch.randn(3, 4)).to_here()


def test_non_tensor_input_raises_type_error_before_any_rpc(cluster):
    with Pipe(nn.Sequential(nn.Linear(2, 2)), workers=cluster.names[:1], balance=[1]) as pipe:
        with pytest.raises(TypeError, match="Pipe input must be a Tensor"):
            pipe([1, 2, 3])
        with torch.no_grad():  # nothing was sent: the pipe still works
            pipe(torch.ones(1, 2)).local_value()


def test_bad_worker_names_and_stage_counts(cluster):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"unknown worker names \['nope'\]"):
        Pipe(model, balance=[1, 1], workers=["worker1", "nope"])
    with pytest.raises(ValueError, match="4 workers named for 2 stages"):
        Pipe(model, balance=[1, 1], workers=cluster.names)
    with pytest.raises(ValueError, match="3 workers named for a model of 2 layers"):
        Pipe(model, workers=cluster.names[:3])  # no balance: a stage per named worker
    with pytest.raises(ValueError, match="more stages than layers"):
        Pipe(model, devices=["cpu", "cpu", "cpu"])


def _factory_that_raises() -> nn.Module:
    raise ValueError("I/O operation on closed file")  # a builtin error in words that could name a connection


def test_a_factory_error_is_the_factorys_not_a_lost_worker(cluster):
    with pytest.raises(StageError) as info:
        Pipe.from_factories([lambda: nn.Linear(2, 2), _factory_that_raises], workers=cluster.names[:2])
    error = info.value
    assert isinstance(error, ValueError) and not isinstance(error, WorkerError)
    assert (error.stage, error.worker, error.phase) == (1, cluster.names[1], "create_stage")
    assert error.error_message == "I/O operation on closed file"  # not torch's "On WorkerInfo(...)" wrapping
    assert isinstance(error.__cause__, ValueError)


def _factory_missing_a_key() -> nn.Module:
    return nn.Linear({"width": 2}["height"], 2)


def test_a_factory_error_keeps_its_type_and_cause(cluster):
    """Torch's RPC re-raises a KeyError from a remote function as a RuntimeError whose message is the
    remote traceback's text; a stage built on its worker reports its own error as any layer's."""
    with pytest.raises(StageError) as info:
        Pipe.from_factories([_factory_missing_a_key, lambda: nn.Linear(2, 2)], workers=cluster.names[:2])
    error = info.value
    assert (error.stage, error.worker, error.phase) == (0, cluster.names[0], "create_stage")
    assert error.error_type == "KeyError"
    assert error.error_message == "'height'" and isinstance(error.__cause__, KeyError)

