"""rrefpipe.captured in one process: a captured model's stages as the layers of an ``nn.Sequential``, run
outside a pipe (skips then go through the thread's own tracker), equal the model in both training modes;
the routes say which values go in the activation and which travel as skips; the output is rebuilt as the
model gives it; a recomputation leaves the running statistics alone; devices written into the graph follow
the stage's. The multi-process tests are in tests/distributed/test_any_model.py."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import Tensor, nn

from examples.tiny_gpt import GPT
from rrefpipe.captured import CapturedPipeModel, Ref, plan_routes, retarget
from rrefpipe.stage_side.checkpoint import recomputing
from tests.test_capture import TwoInputs, UNet

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def gpt3() -> tuple[GPT, CapturedPipeModel, Tensor]:
    torch.manual_seed(0)
    model = GPT(dropout=0.5)
    x = torch.randint(0, 64, (4, 8))
    return model, CapturedPipeModel.build(copy.deepcopy(model), x, ["blocks.1", "blocks.3"]), x


def test_the_layers_equal_the_model_in_both_modes(gpt3):
    model, captured, x = gpt3
    layers = captured.layers
    assert layers is not None and len(layers) == 3
    for mode in (True, False):
        model.train(mode)
        layers.train(mode)
        torch.manual_seed(5)
        expected = model(x)
        torch.manual_seed(5)
        torch.testing.assert_close(layers(x), expected)  # train: the same dropout draws; eval: no dropout
    model.train()


def test_the_routes_of_the_gpt(gpt3):
    """Stage 0 makes the activation, the batch size (a number) and the embeddings e; stage 1 takes the first
    two in the activation; stage 2 takes the batch size and e as skips straight from stage 0."""
    _, captured, _ = gpt3
    routes = plan_routes(captured.captured)
    assert routes[0].args == [Ref("input", 0)]
    assert routes[0].sends == [Ref("output", 0), Ref("output", 1)]
    assert [name for _, name in routes[0].stashes] == ["stage 0's output 1 > stage 2", "stage 0's output 2 > stage 2"]
    assert routes[1].pops == [] and routes[1].args == [Ref("value", 0), Ref("value", 1)] and routes[1].numbers == {1}
    assert routes[2].pops == [name for _, name in routes[0].stashes]
    assert Ref("skip", "stage 0's output 2 > stage 2") in routes[2].args
    assert routes[2].sends == [Ref("output", 0)]


def test_a_dict_output_and_inputs_past_stage_0():
    """TwoInputs: the mask (an input) is used on stage 1, the output is a dict; the last stage sends its
    tensors, ``Outputs.rebuild`` makes the dict."""
    torch.manual_seed(0)
    model = TwoInputs()
    idx, pos, mask = torch.randint(0, 10, (4, 3)), torch.randint(0, 10, (4, 3)), torch.rand(4, 3)
    captured = CapturedPipeModel.build(model, (idx, pos, mask), ["b"])
    assert captured.layers is not None and not captured.outputs.plain
    out = captured.outputs.rebuild(captured.layers(captured.inputs((idx, pos, mask))))
    expected = model(idx, pos, mask)
    assert out.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(out[key], expected[key])


def test_a_recomputation_does_not_update_running_statistics_again():
    torch.manual_seed(0)
    model = UNet()
    x = torch.randn(4, 3, 8, 8)
    captured = CapturedPipeModel.build(copy.deepcopy(model), x, ["bottom", "dec1"])
    layers = captured.layers
    assert layers is not None
    layers(x)
    model(x)
    before = {k: v.clone() for k, v in layers.state_dict().items()}
    with recomputing(True):
        layers(x)
    after = layers.state_dict()
    assert any("running_mean" in k for k in before)
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, msg=lambda m, k=key: f"{k}: {m}")
    layers(x)  # a first forward does update them, as the model's does
    model(x)
    stats = {k: v for k, v in captured.model_state(layers.state_dict()).items()}
    for key, value in model.state_dict().items():
        torch.testing.assert_close(stats[key], value, msg=lambda m, k=key: f"{k}: {m}")


def test_devices_written_into_the_graph_follow_the_stage(gpt3):
    """export wrote ``torch.arange(T, device=cpu)``; on the meta device the stage runs only once that
    device is rewritten (mixing a CPU arange with meta embeddings fails)."""
    _, captured, x = gpt3
    layers = copy.deepcopy(captured.layers)
    assert layers is not None
    stage = layers[0]
    assert "device(type='cpu')" in stage.graph.code
    stage.to("meta")
    out = stage(x.to("meta"))
    assert all(t.device.type == "meta" for t in out)
    assert "device(type='cpu')" not in stage.graph.code and "device(type='cpu')" not in stage.eval_graph.code


def test_retarget_leaves_other_devices_alone():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    here = graph.call_function(torch.ops.aten.arange.default, (3,), {"device": torch.device("cpu")})
    there = graph.call_function(torch.ops.aten.zeros.default, ([1],), {"device": torch.device("cuda", 1)})
    graph.output((x, here, there))
    module = torch.fx.GraphModule(nn.Module(), graph)
    retarget(module, torch.device("cpu"), torch.device("meta"))
    assert "device(type='meta')" in module.code and "device(type='cuda', index=1)" in module.code


def test_the_state_dict_has_the_models_keys_and_loads_back(gpt3):
    model, captured, _ = gpt3
    assert captured.layers is not None
    state = captured.model_state(captured.layers.state_dict())
    assert list(state) == list(model.state_dict())  # tok.weight and head.weight, in the model's order
    fresh = GPT(dropout=0.5)
    parts, missing, unexpected = captured.stage_state(fresh.state_dict(), "")
    assert not missing and not unexpected
    assert {k.split(".graph.")[1] for k in parts} >= {"head.weight"}
    assert sum(1 for k in parts if k.endswith("head.weight")) == 2  # both copies of the tied weight


class _CountsBatches(nn.Module):
    """A buffer's ``add_`` (batch norm's batch count) and a constant made in forward (``torch.arange``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.bn(self.a(x)) + torch.arange(4.0))


def test_a_stage_pickles_as_its_graph_not_its_code():
    """fx's own pickling traces the generated code again, which would run ``num_batches_tracked.add_(1)``
    and ``torch.arange`` once and keep their results: the count stuck at 1, constants in the state dict."""
    captured = CapturedPipeModel.build(_CountsBatches(), torch.randn(4, 4), ["b"])
    assert captured.layers is not None
    stage = captured.layers[0]
    copy_ = pickle.loads(pickle.dumps(stage))
    assert copy_.graph.code == stage.graph.code and copy_.eval_graph.code == stage.eval_graph.code
    assert list(copy_.state_dict()) == list(stage.state_dict())
    assert copy_.graph.get_parameter("a.weight") is copy_.eval_graph.get_parameter("a.weight")  # still shared
    for _ in range(3):
        copy_(torch.randn(4, 4))
    assert copy_.graph.get_buffer("bn.num_batches_tracked").item() == 3
    copy_.eval()
    copy_(torch.randn(4, 4))
    assert copy_.graph.get_buffer("bn.num_batches_tracked").item() == 3


def test_a_dtype_conversion_reaches_both_graphs(gpt3):
    """``pipe.double()`` converts a stage's tensors in place of the old ones: the eval graph must follow."""
    model, captured, x = gpt3
    layers = copy.deepcopy(captured.layers)
    assert layers is not None
    layers.double()
    reference = copy.deepcopy(model).double()
    for mode in (False, True):  # eval first: dropout 0.5 in training draws alike only under one seed
        layers.train(mode)
        reference.train(mode)
        torch.manual_seed(3)
        out = layers(x)
        torch.manual_seed(3)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, reference(x))
