"""Bad input, table-driven: the right exception type and a message naming the problem; afterwards the
workers still run, hold no stray stages, and the RPC group still works."""
import threading

import pytest
import torch
from torch import nn

from rrefpipe import Pipe, StageError
from tests.distributed.probes import all_counts
from tests.layers import ToDict

pytestmark = pytest.mark.timeout(120)


def _shared_layer() -> nn.Sequential:
    layer, model = nn.Linear(2, 2), nn.Sequential()
    model._modules["a"], model._modules["b"] = layer, layer
    return model


class HoldsALock(nn.Identity):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


def _tied_head() -> nn.Sequential:
    """A language-model shape: the output head reuses the embedding's weight."""
    embedding, head = nn.Embedding(20, 4), nn.Linear(4, 20, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(4, 4), nn.Tanh(), head)


def lin(n: int = 2) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


# (id, what to do given the cluster's worker names, exception type, message pattern)
CONSTRUCTION = [
    ("non-Sequential", lambda w: Pipe(nn.Linear(2, 2)), TypeError, "expects an nn.Sequential module, got Linear"),
    ("duplicate children", lambda w: Pipe(_shared_layer()), ValueError, "duplicate children.*'a' and 'b'"),
    ("chunks 0", lambda w: Pipe(lin(), chunks=0), ValueError, "chunks must be a positive int, got 0"),
    ("chunks -1", lambda w: Pipe(lin(), chunks=-1), ValueError, "chunks must be a positive int, got -1"),
    ("chunks '8'", lambda w: Pipe(lin(), chunks="8"), ValueError, "chunks must be a positive int, got '8'"),
    ("unknown checkpoint", lambda w: Pipe(lin(), checkpoint="sometimes"), ValueError, "'sometimes'"),
    ("microbatches_per_message 0", lambda w: Pipe(lin(), microbatches_per_message=0), ValueError,
     "microbatches_per_message must be a positive int, got 0"),
    ("microbatches_per_message True", lambda w: Pipe(lin(), microbatches_per_message=True), ValueError,
     "microbatches_per_message must be a positive int, got True"),
    ("rpc_timeout None", lambda w: Pipe(lin(), rpc_timeout=None), ValueError,
     "rpc_timeout must be positive seconds, got None"),
    ("rpc_timeout 0", lambda w: Pipe(lin(), rpc_timeout=0), ValueError, "rpc_timeout must be positive seconds, got 0"),
    ("no devices", lambda w: Pipe(lin(), devices=[]), ValueError, "devices is empty"),
    ("balance sum", lambda w: Pipe(lin(3), balance=[1, 1], workers=w[:2]), ValueError,
     r"sums to 2 but the module has 3"),
    ("balance zero", lambda w: Pipe(lin(3), balance=[3, 0], workers=w[:2]), ValueError, "positive ints"),
    ("more stages than layers", lambda w: Pipe(lin(2), devices=["cpu"] * 3), ValueError, "more stages than layers"),
    ("unknown worker", lambda w: Pipe(lin(2), balance=[1, 1], workers=["worker1", "ghost"]), ValueError,
     r"unknown worker names \['ghost'\]"),
    ("missing device", lambda w: Pipe(lin(2), balance=[1, 1], devices=["cpu", "cuda:7"], workers=w[:2]),
     ValueError, "device cuda:7 does not exist"),
    ("invalid device", lambda w: Pipe(lin(2), balance=[1, 1], devices=["cpu", "gpu0"], workers=w[:2]),
     ValueError, "invalid device 'gpu0'"),
    ("layer that does not pickle", lambda w: Pipe(nn.Sequential(nn.Linear(2, 2), HoldsALock()), balance=[1, 1],
                                                   workers=w[:2]), TypeError,
     "stage 1 cannot be sent to worker 'worker2': its layers do not pickle .*lock"),
    ("tied weights across stages", lambda w: Pipe(_tied_head(), balance=[2, 2], workers=w[:2]), ValueError,
     "parameter '3.weight' of stage 1 is parameter '0.weight' of stage 0: stages on separate workers cannot share"),
]

FORWARD = [
    ("non-tensor input", [1.0, 2.0], TypeError, "Pipe input must be a Tensor or a tuple of Tensors"),
    ("dict input", {"x": torch.zeros(2, 4)}, TypeError, "got dict"),
    ("batch sizes differ", (torch.zeros(4, 4), torch.zeros(3, 4)), ValueError, r"same batch size.*\[3, 4\]"),
    ("empty batch", torch.zeros(0, 4), ValueError, "batch size 0"),
    ("wrong device", torch.zeros(4, 4, device="meta"), ValueError, "Pipe input is on meta"),
]


@pytest.mark.parametrize("name, make, error, message", CONSTRUCTION, ids=[c[0] for c in CONSTRUCTION])
def test_bad_construction(cluster, name, make, error, message):
    before = all_counts(cluster.names)
    with pytest.raises(error, match=message):
        make(cluster.names)
    assert all_counts(cluster.names)["worker1"]["stages"] == before["worker1"]["stages"]


@pytest.mark.parametrize("name, value, error, message", FORWARD, ids=[f[0] for f in FORWARD])
def test_bad_forward_input_leaves_the_pipe_usable(cluster, name, value, error, message):
    model = lin(2)
    with Pipe(model, chunks=2, balance=[1, 1], workers=cluster.names[:2]) as pipe:
        with pytest.raises(error, match=message):
            pipe(value)
        x = torch.randn(4, 4)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value(), model(x))


def test_stage_returning_a_non_tensor_is_a_type_error(cluster):
    with Pipe(nn.Sequential(nn.Linear(4, 4), ToDict()), balance=[1, 1], workers=cluster.names[:2]) as pipe:
        with pytest.raises(TypeError, match="stage 1 on worker 'worker2'.*output of stage 1 must be a Tensor") as info:
            with torch.no_grad():
                pipe(torch.randn(2, 4))
    assert isinstance(info.value, StageError)


def test_warnings_point_at_the_callers_line(cluster):
    """Not at nn.Module's call wrapper (torch/nn/modules/module.py), which the user cannot act on."""
    with Pipe(lin(2), chunks=2, balance=[1, 1], workers=cluster.names[:2]) as pipe:
        with pytest.warns(UserWarning, match="outside dist_autograd.context") as record:
            pipe(torch.randn(4, 4))
    with pytest.warns(UserWarning, match="no BatchNorm layers") as more:
        Pipe(lin(2), deferred_batch_norm=True, balance=[1, 1], workers=cluster.names[:2]).close()
    assert [w.filename for w in [*record, *more]] == [__file__, __file__]


def test_workers_still_run_after_the_table(cluster):
    assert all(proc.poll() is None for proc in cluster._procs)
    counts = all_counts(cluster.names)
    assert all(c["stages"] == 0 for name, c in counts.items() if name != "driver")


def test_rpc_timeout_may_be_any_real_number(cluster):
    """A NumPy scalar from a config file is seconds too (only Python's int and float were taken)."""
    import numpy as np

    with Pipe(lin(), balance=[1, 1], workers=cluster.names[:2], rpc_timeout=np.int64(30)) as pipe:
        assert pipe.rpc_timeout == 30.0 and type(pipe.rpc_timeout) is float
