import torch
from torch import nn

from rrefpipe.dependency import after_parameter_grads, fork, hop, join, mark, new_phony


def test_fork_join_are_identities_that_pass_gradients():
    x = torch.randn(3, requires_grad=True)
    y, phony = fork(x * 2)
    assert phony.numel() == 0 and phony.requires_grad
    p = new_phony()
    z = join(y, p)
    z.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    assert p.grad is not None and p.grad.numel() == 0  # the phony's producer is reached in backward


def test_join_makes_a_gradient_free_value_depend_on_the_phony():
    p = new_phony()
    z = join(torch.ones(2), p)
    assert z.requires_grad
    z.sum().backward()
    assert p.grad is not None


def test_mark_calls_back_once_all_gradients_arrived():
    calls = []
    a = torch.randn(2, requires_grad=True)
    b = torch.randn(2)
    ma, mb = mark((a, b), lambda: calls.append(1))
    assert ma.requires_grad and not mb.requires_grad
    (ma * 3).sum().backward()
    assert calls == [1]
    torch.testing.assert_close(a.grad, torch.full((2,), 3.0))


def test_mark_on_one_intermediate_tensor_calls_back_without_a_new_node():
    calls = []
    x = torch.randn(2, requires_grad=True)
    h = x * 2
    assert mark(h, lambda: calls.append(1)) is h  # a hook, not a node: the value is the same tensor
    (h * 3).sum().backward()
    assert calls == [1]
    torch.testing.assert_close(x.grad, torch.full((2,), 6.0))


def test_mark_leaves_no_hook_on_a_leaf():
    calls = []
    x = torch.randn(2, requires_grad=True)
    marked = mark(x, lambda: calls.append(1))
    assert marked is not x and not x._backward_hooks  # the user's tensor keeps nothing of this step
    marked.sum().backward()
    assert calls == [1]


def test_hop_joins_forks_and_marks_in_one_node():
    calls = []
    x = torch.randn(3, requires_grad=True)
    p = new_phony()
    (y, extra), phony = hop((x * 2, torch.ones(1)), [p], lambda: calls.append(1))
    assert phony.numel() == 0 and phony.requires_grad and not extra.requires_grad
    assert y.grad_fn is phony.grad_fn  # one node for the join, the fork and the marker
    y.sum().backward()
    assert calls == [1]
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    assert p.grad is not None and p.grad.numel() == 0  # the incoming hop is reached in backward


def test_hop_makes_a_gradient_free_output_depend_on_its_phonies():
    p = new_phony()
    y, _ = hop(torch.ones(2), [p], lambda: None)
    assert y.requires_grad
    y.sum().backward()
    assert p.grad is not None


class _Branchy(nn.Module):
    """A residual graph with a parameter-only branch, created before anything on the input's path."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale * 3
        h = torch.relu(self.a(x))
        return (self.b(h) + h) * scale


def _nodes(out: torch.Tensor) -> list:
    stack, seen = [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen or type(node).__name__ == "AccumulateGrad":
            continue
        seen.append(node)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return seen


def test_after_parameter_grads_calls_back_after_every_node_ran():
    """The stage input needs no gradient; the callback comes once, after every node of the graph ran."""
    module, log = _Branchy(), []
    out = module(torch.randn(3, 4))
    nodes = _nodes(out)
    for k, node in enumerate(nodes):  # registered first, so on a shared node they run before the callback
        node.register_hook(lambda *_, k=k: log.append(k))
    assert after_parameter_grads(out, lambda: log.append("end"))
    out.sum().backward()
    assert sorted(log[:-1]) == list(range(len(nodes))) and log[-1] == "end"


def test_after_parameter_grads_without_parameters_says_so():
    """A stage with no parameters and an input that needs no gradient has no graph: the caller marks it."""
    assert not after_parameter_grads(nn.ReLU()(torch.randn(2)), lambda: None)
