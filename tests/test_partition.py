import pytest
import torch
from torch import nn

from rrefpipe.partition import (balance_by_placement, check_balance, check_checkpoint, check_chunks, split_module,
                                split_state_dict, uniform_balance, verify_module)


def test_verify_module_rejects_non_sequential_and_duplicates():
    with pytest.raises(TypeError, match="nn.Sequential.*got Linear"):
        verify_module(nn.Linear(2, 2))
    verify_module(nn.Sequential())  # PyTorch's Pipe took an empty one
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="duplicate children.*'0' and '1'"):
        verify_module(nn.Sequential(layer, layer))


@pytest.mark.parametrize("chunks", [0, -1, "8", 2.5, 0.0, True, None])
def test_bad_chunks(chunks):
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        check_chunks(chunks)


def test_bad_checkpoint_mode_names_the_value():
    with pytest.raises(ValueError, match="'sometimes'"):
        check_checkpoint("sometimes")
    assert check_checkpoint("never") == "never"


@pytest.mark.parametrize("balance, match", [
    ([2, 2], "sums to 4 but the module has 3"),
    ([3, 0], "positive ints"),
    ([], "non-empty"),
    ("21", "non-empty list"),
    ([1.5, 1.5], "positive ints"),
])
def test_bad_balance(balance, match):
    with pytest.raises(ValueError, match=match):
        check_balance(balance, 3)


def test_uniform_balance_and_too_many_stages():
    assert uniform_balance(7, 3) == [3, 2, 2]
    with pytest.raises(ValueError, match="more stages than layers"):
        uniform_balance(2, 3)


def test_split_keeps_layer_names():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    first, second = split_module(model, [2, 1])
    assert list(first.state_dict()) == ["0.weight", "0.bias"]
    assert list(second.state_dict()) == ["2.weight", "2.bias"]
    assert second[0] is model[2]


def test_balance_by_placement_groups_consecutive_devices():
    model = nn.Sequential(nn.ReLU(), nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2).to(torch.float64))
    balance, devices = balance_by_placement(model)
    assert balance == [4] and devices == [torch.device("cpu")]


def test_a_state_dict_is_cut_by_the_layers_each_stage_owns():
    """Keys under the prefix go to the stage owning their layer, without the prefix; keys of no layer come
    back as unexpected (with the prefix, as nn.Module reports them); keys outside the prefix are not the
    pipe's. Each stage gets its layers' metadata (their versions) and the pipe's own under ''."""
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    state = nn.Sequential(model).state_dict()  # the pipe as child '0' of a parent: prefix '0.'
    state["0.7.weight"] = torch.zeros(1)
    state["other.weight"] = torch.zeros(1)
    parts, metadata, unexpected = split_state_dict(state, "0.", [["0", "1"], ["2"]], {"version": 9})
    assert sorted(parts[0]) == sorted(k for k in model.state_dict() if k.split(".")[0] in ("0", "1"))
    assert sorted(parts[1]) == ["2.bias", "2.weight"]
    torch.testing.assert_close(parts[1]["2.weight"], model[2].weight)
    assert unexpected == ["0.7.weight"]
    assert metadata[0][""] == metadata[1][""] == {"version": 9}
    assert metadata[0]["1"]["version"] == nn.BatchNorm1d._version
    assert set(metadata[0]) == {"", "0", "1"} and set(metadata[1]) == {"", "2"}
