import torch
from torch import nn

from rrefpipe.stage_side import transfer
from rrefpipe.dependency import arrival, fence, hop, join, mark, new_phony


def test_join_is_an_identity_that_passes_gradients():
    x = torch.randn(3, requires_grad=True)
    p = new_phony()
    z = join(x * 2, p)
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


def test_mark_passes_no_gradient_on_for_a_tensor_nothing_used():
    """As plain autograd does: the marker node (several tensors; in-process stages mark their outputs)
    had handed the layers before an unused tensor zeros, and their parameters got zero gradients."""
    a, b, calls = torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True), []
    x, _ = mark((a * 2, b * 2), lambda: calls.append(1))
    x.sum().backward()
    assert calls == [1] and a.grad is not None and b.grad is None


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


def test_a_gradient_free_output_stays_so_and_its_phony_reaches_the_incoming_phonies():
    """As in the plain module, the output needs no gradient; backward reaches the hop (and, through it,
    the incoming hops) by the phony that travels with the output."""
    p, calls = new_phony(), []
    y, phony = hop(torch.ones(2), [p], lambda: calls.append(1))
    assert not y.requires_grad and phony.requires_grad
    phony.sum().backward()
    assert calls == [1] and p.grad is not None


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


def _log_every_node(out: torch.Tensor, log: list, tag: object) -> int:
    nodes = _nodes(out)
    for node in nodes:
        node.register_hook(lambda *_: log.append(tag))
    return len(nodes)


def test_fence_calls_back_after_every_node_of_the_later_forward_ran():
    """The stage input needs no gradient (the first stage); the fence is made before the forward and
    joined into its output's hop. A parameter-only branch (``scale``) is ready early, and still runs first."""
    module, log, p = _Branchy(), [], new_phony()
    wall = fence(lambda: log.append("end"), [p], torch.device("cpu"))
    assert wall.numel() == 0 and wall.requires_grad
    out = module(torch.randn(3, 4))
    count = _log_every_node(out, log, "node")
    y, _ = hop(out, [wall], lambda: None)
    y.sum().backward()
    assert log == ["node"] * count + ["end"]
    assert p.grad is not None  # the fenced phonies are still reached


def test_fences_of_several_microbatches_in_one_backward_end_each_in_turn():
    """The last stage runs a whole step's backward as one task: micro-batch 1 (made later) first, its
    fence, then micro-batch 0 and its fence."""
    module, log, outs = _Branchy(), [], []
    for i in range(2):
        wall = fence(lambda i=i: log.append(f"end{i}"), [new_phony()], torch.device("cpu"))
        out = module(torch.randn(3, 4))
        counts = _log_every_node(out, log, i)
        outs.append(hop(out, [wall], lambda: None)[0])
    sum(y.sum() for y in outs).backward()
    assert log == [1] * counts + ["end1"] + [0] * counts + ["end0"]


def test_a_fence_without_parameters_ends_at_once():
    """No input or parameter needs a gradient: backward is the hop alone, and the fence right after it."""
    log: list = []
    wall = fence(lambda: log.append("end"), [new_phony()], torch.device("cpu"))
    _, phony = hop(nn.ReLU()(torch.randn(2)), [wall], lambda: log.append("start"))
    phony.sum().backward()
    assert log == ["start", "end"]


class _Wire(torch.autograd.Function):
    """Stands in for an RPC message: as distributed autograd's receive node does, it fills the gradient
    of every tensor that the receiving side left unused with zeros."""

    @staticmethod
    def forward(ctx, *tensors):
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return grads


def test_a_masked_hop_gives_no_gradient_to_what_its_receiver_left_unused():
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    calls = []
    (ya, yb), phony = hop((a * 2, b * 3), [], None, masked=True)
    assert phony.shape == (2,) and phony.requires_grad
    *crossed, crossed_phony = _Wire.apply(ya, yb, phony)
    (ra, rb), joined = arrival(tuple(crossed), crossed_phony, lambda: calls.append(1), torch.device("cpu"))
    assert joined.numel() == 0 and joined.requires_grad
    (ra.sum() * 5 + joined.sum()).backward()
    assert calls == [1]
    torch.testing.assert_close(a.grad, torch.full((3,), 10.0))
    assert b.grad is None  # not the zeros the wire sent back


def test_a_received_tensor_that_needs_no_gradient_stays_so_and_backward_still_reaches_the_sender():
    """An integer tensor beside the activation: the receiver answers the sender's phony through the phony
    it joins into its output, so the sender's hop runs (and the hops before it)."""
    x, p, calls = torch.randn(2, requires_grad=True), new_phony(), []
    value, phony = hop((x * 2, torch.arange(2)), [p], lambda: calls.append("sent"), masked=True)
    (rx, labels), joined = arrival(value, phony, lambda: calls.append("received"), torch.device("cpu"))
    assert rx.requires_grad and not labels.requires_grad
    joined.sum().backward()  # the receiver's output used neither tensor
    assert calls == ["received", "sent"] and x.grad is None and p.grad is not None


def test_a_gpu_stages_copy_to_the_host_passes_no_gradient_on_as_none(monkeypatch):
    """A GPU last stage copies its output to the host before the masked hop to the driver: that copy's
    node got zeros for an output the loss left out (autograd's default for a Python node), and the head
    that made it got zero gradients. (No CUDA here: the copy back is the identity.)"""
    monkeypatch.setattr(transfer, "_pinned_to", lambda t, device: t)
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    host = tuple(transfer._DeviceToHost.apply(t * 2) for t in (a, b))
    value, phony = hop(host, [], None, masked=True)
    *crossed, crossed_phony = _Wire.apply(*value, phony)
    (ra, _), _ = arrival(tuple(crossed), crossed_phony, None, torch.device("cpu"))
    ra.sum().backward()
    torch.testing.assert_close(a.grad, torch.full((3,), 2.0))
    assert b.grad is None
