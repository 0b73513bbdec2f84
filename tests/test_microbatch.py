import pytest
import torch

from rrefpipe.microbatch import check, gather, scatter


def test_scatter_splits_along_batch_and_gather_restores():
    x = torch.arange(20.0).view(10, 2)
    parts = scatter(x, 4)
    assert [p.size(0) for p in parts] == [3, 3, 3, 1]
    torch.testing.assert_close(gather(parts), x)


def test_fewer_microbatches_when_batch_smaller_than_chunks():
    assert len(scatter(torch.zeros(3, 5), 8)) == 3


def test_tuple_input_is_split_elementwise():
    a, b = torch.randn(6, 2), torch.randn(6, 3, 4)
    parts = scatter((a, b), 3)
    assert all(isinstance(p, tuple) and p[0].size(0) == 2 and p[1].shape == (2, 3, 4) for p in parts)
    ga, gb = gather(parts)
    torch.testing.assert_close(ga, a)
    torch.testing.assert_close(gb, b)


@pytest.mark.parametrize("bad", [3, "x", [1, 2], None, (torch.zeros(2), 3), ()])
def test_non_tensor_input_raises_type_error(bad):
    with pytest.raises(TypeError, match="Tensor or a tuple of Tensors"):
        scatter(bad, 2)


def test_mismatched_batch_sizes_raise():
    with pytest.raises(ValueError, match=r"same batch size.*\[3, 4\]"):
        scatter((torch.zeros(3, 1), torch.zeros(4, 1)), 2)


def test_empty_batch_and_scalar_raise():
    with pytest.raises(ValueError, match="batch size 0"):
        scatter(torch.zeros(0, 4), 2)
    with pytest.raises(ValueError, match="0-dim"):
        scatter(torch.tensor(1.0), 2)


def test_check_names_where():
    with pytest.raises(TypeError, match="output of stage 2 .* got dict"):
        check({"a": 1}, "output of stage 2")
