"""Mistakes a new user makes: each gets a message that says what to do instead."""
import copy
import gc
import pickle
import threading
import warnings

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn

from rrefpipe import Pipe
from rrefpipe.driver_side.output import PipeRRef, RemotePipeRRef
from tests.conftest import run_script
from tests.distributed.probes import stage_gradients

pytestmark = pytest.mark.timeout(60)

LOCAL_VALUE = r"pipe\(x\) returns an RRef to the output .* pipe\(x\)\.local_value\(\)"
TO_HERE = r"pipe\(x\) returns an RRef to the output .* pipe\(x\)\.to_here\(\)"


def _rref_sum(rref):
    """Runs as an RPC: an RRef that came as an argument (a plain RRef there) still works."""
    return type(rref).__name__, rref.to_here().sum()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))


def test_output_used_as_a_tensor_says_to_call_local_value(cluster):
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    with Pipe(_model(), chunks=2, balance=[2, 1], workers=cluster.names[:2]) as pipe:
        with torch.no_grad():
            out = pipe(x)
        uses = {
            "cross_entropy": lambda: F.cross_entropy(out, y),
            "cat": lambda: torch.cat([out, out]),
            "a layer": lambda: nn.Linear(3, 1)(out),
            "times a number": lambda: out * 2,
            "a tensor times it": lambda: torch.ones(1) * out,
            "indexing": lambda: out[0],
        }
        for what, use in uses.items():
            with pytest.raises(TypeError, match=LOCAL_VALUE):
                use()
        for method in (lambda: out.sum(), lambda: out.shape, lambda: out.argmax(1)):
            with pytest.raises(AttributeError, match=LOCAL_VALUE):
                method()
        with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'$"):  # not a tensor's name
            out.no_such_thing

        # Still an RRef in every way: the messages cost nothing of it.
        assert isinstance(out, rpc.RRef) and isinstance(out, PipeRRef)
        assert out.is_owner() and out.owner().name == rpc.get_worker_info().name
        with torch.no_grad():
            torch.testing.assert_close(out.local_value(), pipe(x).to_here())
        assert not hasattr(out, "sum") and hasattr(out, "local_value")
        # Pickled as an RRef (to this process itself: a stage worker's one RPC thread would wait on to_here)
        kind, total = rpc.rpc_sync(rpc.get_worker_info(), _rref_sum, args=(out,))
        assert kind in ("RRef", "PyRRef")
        torch.testing.assert_close(total, out.local_value().sum())
        with pytest.raises(RuntimeError, match="Can not pickle rref in python pickler"):
            pickle.dumps(out)  # as for any RRef: only RPC calls carry one


def test_remote_output_local_value_says_to_call_to_here(cluster):
    x = torch.randn(4, 4)
    with Pipe(_model(), chunks=2, balance=[2, 1], workers=cluster.names[:2], remote_output=True) as pipe:
        with torch.no_grad():
            out = pipe(x)
            expected = pipe(x).to_here()
        with pytest.raises(RuntimeError, match=r"remote_output=True: .*'worker2'.*Fetch it with pipe\(x\)\.to_here\(\)"):
            out.local_value()
        with pytest.raises(TypeError, match=TO_HERE):
            F.relu(out)
        with pytest.raises(AttributeError, match=TO_HERE):
            out.sum()
        # Every other RRef method is the wrapped RRef's.
        assert isinstance(out, RemotePipeRRef) and not out.is_owner() and out.owner_name() == "worker2"
        torch.testing.assert_close(out.to_here(), expected)
        kind, total = rpc.rpc_sync("worker2", _rref_sum, args=(out,))  # travels as the RRef it wraps
        torch.testing.assert_close(total, expected.sum())
        assert "RRef" in repr(out)
        del out
        gc.collect()  # the wrapped RRef is released as a plain one would be (no leak reported at shutdown)


def test_forward_outside_a_context_shows_the_training_block(cluster):
    with Pipe(_model(), balance=[2, 1], workers=cluster.names[:2]) as pipe:
        with pytest.warns(UserWarning) as record:
            pipe(torch.randn(2, 4))
        text = str(record[0].message)
        assert "outside dist_autograd.context()" in text
        assert "with dist_autograd.context() as ctx:" in text and "pipe.backward(ctx, loss)" in text
        assert "torch.no_grad()" in text and "pipe.eval()" in text
        pipe.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # eval: inference, nothing to warn about
            pipe(torch.randn(2, 4))


def test_backward_of_a_loss_from_another_context_says_what_happened(cluster):
    model = _model()
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    with Pipe(model, chunks=2, balance=[2, 1], workers=cluster.names[:2]) as pipe:
        with dist_autograd.context() as first:
            old_loss = F.cross_entropy(pipe(x).local_value(), y)
        with dist_autograd.context() as ctx:  # the first context has ended
            with pytest.raises(RuntimeError, match=rf"(?s)forward run in autograd context {first} \(its with block has "
                               rf"ended\), and the backward is asked of context {ctx}.*"
                               r"with dist_autograd.context\(\) as ctx:"):
                pipe.backward(ctx, old_loss)
        with pytest.raises(RuntimeError, match=rf"no dist_autograd context {ctx} in this process"):
            pipe.backward(ctx, old_loss)

        with dist_autograd.context() as open_one:
            loss = F.cross_entropy(pipe(x).local_value(), y)
            refused: list[BaseException] = []

            def backward_elsewhere():  # contexts are per thread: another one is open on this thread
                with dist_autograd.context() as other:
                    try:
                        pipe.backward(other, loss)
                    except RuntimeError as exc:
                        refused.append(exc)

            thread = threading.Thread(target=backward_elsewhere)
            thread.start()
            thread.join()
            assert len(refused) == 1 and f"context {open_one} (still open)" in str(refused[0])
            pipe.backward(open_one, loss)  # refused before anything ran: the right context still works
            norm = pipe.clip_grad_norm_(open_one, float("inf"))
        F.cross_entropy(model(x), y).backward()
        torch.testing.assert_close(norm, nn.utils.clip_grad_norm_(model.parameters(), float("inf")))



def test_train_step_refuses_microbatches_per_message_and_the_pipe_still_trains(cluster):
    """``microbatches_per_message`` groups the messages of ``pipe(x)``; ``train_step`` sends micro-batches
    one by one, so it refuses the option (issue 48) where it ignored it, before any stage runs, and
    says what to do. ``pipe(x)`` with ``pipe.backward`` then trains the same pipe as the plain model."""
    x, y = torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    model = _model()
    with Pipe(copy.deepcopy(model), chunks=4, balance=[2, 1], workers=cluster.names[:2],
              microbatches_per_message=2) as pipe:
        for _ in range(2):  # the same answer again: a refusal changes nothing
            with dist_autograd.context() as ctx:
                with pytest.raises(ValueError) as info:
                    pipe.train_step(ctx, x, y, F.cross_entropy)
            text = str(info.value)
            assert "Pipe(microbatches_per_message=2) groups the messages of pipe(x)" in text
            assert "microbatches_per_message=1" in text and "pipe.backward(ctx, loss)" in text
        assert pipe.execution_record() == []  # no stage ran
        assert all(t == (0, 0) for kinds in pipe.traffic() for t in kinds.values())  # nothing was sent
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, F.cross_entropy(pipe(x).local_value(), y))
            grads = stage_gradients(pipe, ctx)
    F.cross_entropy(model(x), y).backward()
    assert grads.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m: f"{name}: {m}")

def test_in_a_world_of_one_the_output_says_the_same():
    """Stages in this process (RPC initialised with world size 1, PyTorch 1.8's way): the same RRef class."""
    proc = run_script("""
        import os, warnings
        import torch, torch.nn.functional as F
        import torch.distributed.rpc as rpc
        from torch import nn
        import workers
        from rrefpipe import Pipe
        from rrefpipe.driver_side.output import PipeRRef

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(workers.free_port()))
        rpc.init_rpc("solo", rank=0, world_size=1)
        warnings.simplefilter("ignore")
        pipe = Pipe(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 3)), chunks=2)
        out = pipe(torch.randn(4, 4))
        assert isinstance(out, PipeRRef) and isinstance(out, rpc.RRef)
        try:
            F.cross_entropy(out, torch.tensor([0, 1, 2, 0]))
        except TypeError as exc:
            print(exc)
        F.cross_entropy(out.local_value(), torch.tensor([0, 1, 2, 0])).backward()  # PyTorch 1.8's way works
        rpc.shutdown()
    """)
    assert "cross_entropy() was given a PipeRRef: pipe(x) returns an RRef" in proc.stdout
    assert "pipe(x).local_value()" in proc.stdout
