"""Code written for torch.distributed.pipeline.sync runs with an import change; documented errors hold."""
import pytest
import torch
from torch import nn


def test_public_module_paths():
    from rrefpipe import Pipe  # noqa: F401
    from rrefpipe.batchnorm import DeferredBatchNorm  # noqa: F401
    from rrefpipe.skip import Namespace, pop, skippable, stash, verify_skippables  # noqa: F401
    from rrefpipe.skip.skippable import pop as pop2, skippable as skippable2, stash as stash2  # noqa: F401
    from rrefpipe.skip.skippable import verify_skippables as verify2

    assert verify2 is verify_skippables and skippable2 is skippable


@pytest.mark.parametrize("module, kwargs, error, message", [
    (nn.Linear(2, 2), {}, TypeError, "Pipe expects an nn.Sequential module, got Linear"),
    (nn.Sequential(), {}, ValueError, "Pipe expects a non-empty nn.Sequential"),
    (nn.Sequential(nn.Linear(2, 2)), {"chunks": 0}, ValueError, "chunks must be a positive int, got 0"),
    # torchgpipe's GPipe(module, balance, chunks): the balance lands in chunks here
    (nn.Sequential(nn.Linear(2, 2)), {"chunks": [1]}, ValueError,
     r"got \[1\] \(layers per stage go by keyword: Pipe\(module, chunks=\.\.\., balance=\[1\]\)\)"),
    (nn.Sequential(nn.Linear(2, 2)), {"checkpoint": "x"}, ValueError, "checkpoint must be one of"),
    (nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to("meta")), {"balance": [2]}, ValueError,
     "stage 0 has parameters on several devices"),
])
def test_documented_errors_before_any_worker_starts(module, kwargs, error, message):
    from rrefpipe import Pipe

    with pytest.raises(error, match=message):
        Pipe(module, **kwargs)


def test_duplicate_children_message():
    from rrefpipe import Pipe

    layer = nn.Linear(2, 2)
    model = nn.Sequential()
    model._modules["a"] = layer
    model._modules["b"] = layer
    with pytest.raises(ValueError, match="duplicate children is not supported: layers 'a' and 'b'"):
        Pipe(model)
