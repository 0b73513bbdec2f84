import torch

from rrefpipe.dependency import fork, join, mark, new_phony


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
