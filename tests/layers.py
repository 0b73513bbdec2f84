"""Layers used by the multi-process tests; importable on the stage workers (tests/ is on PYTHONPATH)."""
from __future__ import annotations

import copy
import sys
import types

import torch
from torch import Tensor, nn

SENTINEL = 1e9  # a micro-batch containing this value makes Boom raise


class BoomOnHuge(nn.Module):
    """Identity, except that it raises ValueError on a micro-batch with a value above 1e6 (a SENTINEL
    in the model's input, after linear layers)."""

    def forward(self, x: Tensor) -> Tensor:
        if bool((x.abs() > 1e6).any()):
            raise ValueError(f"boom: sentinel in a batch of {x.size(0)}")
        return x


class Boom(nn.Module):
    """Identity, except that it raises ValueError on a micro-batch that contains SENTINEL."""

    def forward(self, x: Tensor) -> Tensor:
        if bool((x == SENTINEL).any()):
            raise ValueError(f"boom: sentinel in a batch of {x.size(0)}")
        return x


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def _worker_only_error() -> type[Exception]:
    """An exception class in a module that exists only in the process that calls this (a stage worker
    here): it pickles there and cannot be unpickled by the driver."""
    module = sys.modules.setdefault("worker_only_errors", types.ModuleType("worker_only_errors"))
    if not hasattr(module, "OnlyOnTheWorker"):
        setattr(module, "OnlyOnTheWorker", type("OnlyOnTheWorker", (Exception,), {"__module__": module.__name__}))
    error: type[Exception] = getattr(module, "OnlyOnTheWorker")
    return error


class Misbehaves(nn.Module):
    """Identity, except on a micro-batch that contains SENTINEL: raises SystemExit, an exception whose
    ``str`` raises, or one whose class the driver cannot import (``kind``). None may cost the stage
    worker its service or the report its cause."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: Tensor) -> Tensor:
        if bool((x == SENTINEL).any()):
            if self.kind == "exit":
                raise SystemExit(3)
            if self.kind == "worker_only":
                raise _worker_only_error()("its class is in a module only the worker has")
            raise Unprintable()
        return x


class ToDict(nn.Module):
    """Returns a non-tensor: the stage must reject it with a TypeError."""

    def forward(self, x: Tensor) -> dict:  # type: ignore[type-arg]
        return {"x": x}


class Transpose(nn.Module):
    """Puts the batch in dim 1: micro-batches of different sizes give outputs that do not concatenate."""

    def forward(self, x: Tensor) -> Tensor:
        return x.t()


class Split(nn.Module):
    """Tensor -> tuple of two tensors (a tuple boundary between stages)."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x[:, : x.size(1) // 2], x[:, x.size(1) // 2:] * 2


class DetachFirst(nn.Module):
    """Tensor -> (its detached copy: features to log, needing no gradient; the tensor times two)."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x.detach(), x * 2


class ReadFirst(nn.Module):
    """Reads the first tensor as NumPy (which refuses a tensor that requires grad), returns the second."""

    def forward(self, xs: tuple[Tensor, Tensor]) -> Tensor:
        xs[0].numpy()
        return xs[1]


class Merge(nn.Module):
    def forward(self, xs: tuple[Tensor, Tensor]) -> Tensor:
        a, b = xs
        return torch.cat([a * b, a + b], dim=1)


class AutocastProbe(nn.Module):
    """Adds 1 where autocast's weight cache is on: shows whether a stage got the caller's setting."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + float(torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled())


class AppendRandom(nn.Module):
    """Appends one column of ``torch.rand`` (drawn from the process's generator, as dropout draws)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.rand(x.shape[0], 1)], dim=1)


def manual_seed(seed: int) -> None:
    """``torch.manual_seed`` as a Python function: over RPC, torch's own resolves to a builtin operator
    whose empty return the RPC layer rejects."""
    torch.manual_seed(seed)


class Parent(nn.Module):
    """Holds a pipe beside a layer of its own, so that state dicts nest: keys ``head.*`` and ``pipe.*``."""

    def __init__(self, pipe: nn.Module, width: int) -> None:
        super().__init__()
        self.head, self.pipe = nn.Linear(width, width), pipe


def mlp(widths: list[int], seed: int = 0) -> nn.Sequential:
    """Linear+Tanh layers: every other child has parameters."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def make_tail(width: int = 8) -> nn.Sequential:
    """A stage factory (module-level, so workers can import it)."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3))


def make_head(width: int = 8) -> nn.Sequential:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(5, width), nn.Tanh())


class WideOnly(nn.Module):
    """Adds its bias to batches of more than 4 rows only: narrow batches leave it without a gradient."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.bias if x.shape[0] > 4 else x


class _Overflow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, threshold: float, into: str) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.into = into if bool(x.abs().max() > threshold) else None
        return x * weight

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x, grad_weight = grad * weight, (grad * x).sum(0)
        if ctx.into == "input":
            grad_x = grad_x * float("inf")
        elif ctx.into == "weight":
            grad_weight = grad_weight * float("inf")
        return grad_x, grad_weight, None, None


class Overflow(nn.Module):
    """``x * weight`` (the weight starts at ones); in backward, when the input exceeded ``threshold``
    somewhere, an inf gradient for the layers before it (``into='input'``: earlier stages overflow) or
    for its own weight (``into='weight'``: this stage overflows, the earlier ones do not)."""

    def __init__(self, width: int, threshold: float, into: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.threshold, self.into = threshold, into

    def forward(self, x: Tensor) -> Tensor:
        return _Overflow.apply(x, self.weight, self.threshold, self.into)


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


# -- skip connections ----------------------------------------------------------------------------
from rrefpipe.skip import Namespace, pop, skippable, stash  # noqa: E402


@skippable(stash=["skip"])
class StashInput(nn.Module):
    """Stashes its input (scaled, so the skip carries a real autograd path)."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", x * 0.5)
        return x


@skippable(stash=["skip"])
class StashUnlessSentinel(nn.Module):
    """A user's bug: declares a stash it leaves out on a micro-batch that contains SENTINEL."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        if not bool((x == SENTINEL).any()):
            yield stash("skip", x * 0.5)
        return x


@skippable(pop=["skip"])
class PopAdd(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return x + skip


@skippable(pop=["skip"])
class PopAddInPlace(nn.Module):
    """Adds its input to the popped skip in place (plain PyTorch allows it)."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return skip.add_(x)


@skippable(stash=["skip"])
class StashLinear(nn.Module):
    """Stashes a linear map of its input (its parameters reach the loss only through the skip)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", self.fc(x))
        return x


@skippable(pop=["skip"])
class PopIgnore(nn.Module):
    """Pops the skip and leaves it unused."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield pop("skip")
        return x


@skippable(stash=["skip"])
class StashNone(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", None)
        return x


@skippable(pop=["skip"])
class PopMaybe(nn.Module):
    """Adds the skip if there is one; a stashed None must arrive as None."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return x if skip is None else x + skip


@skippable(stash=["a", "b"], pop=["c"])
class StashStashPop(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("a", torch.tanh(x))
        yield stash("b", self.fc(x))
        c = yield pop("c")
        return x + c


@skippable(stash=["c"])
class StashC(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("c", x * 2)
        return x


@skippable(pop=["a", "b"])
class PopAB(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        a = yield pop("a")
        b = yield pop("b")
        return x * a + b


@skippable(stash=["sign"])
class StashSign(nn.Module):
    """Stashes where its input is positive: a skip tensor that needs no gradient."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("sign", (x > 0).float())
        return x


@skippable(pop=["sign"])
class PopSignFirst(nn.Module):
    """Tensor -> (integer mask popped from StashSign, tensor): an output whose first tensor cannot
    carry a gradient, on a stage whose only path back to the skip's sender is its phony."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        sign = yield pop("sign")
        return sign.long(), x


def skip_model(width: int = 6, seed: int = 0) -> nn.Sequential:
    """Seven layers, two skips of different lengths and one in a repeated (isolated) namespace pair."""
    torch.manual_seed(seed)
    ns1, ns2 = Namespace(), Namespace()
    return nn.Sequential(
        StashInput().isolate(ns1), nn.Linear(width, width), StashInput().isolate(ns2), nn.Tanh(),
        PopAdd().isolate(ns2), nn.Linear(width, width), PopAdd().isolate(ns1),
    )


def residual_model(width: int = 8, blocks: int = 3, seed: int = 0) -> nn.Sequential:
    """ResNet-style: each block is stash -> Linear -> ReLU -> Linear -> pop+add, namespaced per block."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        ns = Namespace()
        layers += [StashInput().isolate(ns), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                   PopAdd().isolate(ns)]
    return nn.Sequential(*layers)


class NestedResidual(nn.Module):
    """stash -> Linear -> Tanh -> pop+add inside one block, with the default skip name: repeated blocks
    each keep theirs inside themselves (no namespace needed, as in PyTorch's Pipe)."""

    def __init__(self, width: int, pop_registered_first: bool = False) -> None:
        super().__init__()
        if pop_registered_first:
            self.add = PopAdd()
        self.fork = StashInput()
        self.fc = nn.Linear(width, width)
        if not pop_registered_first:
            self.add = PopAdd()

    def forward(self, x: Tensor) -> Tensor:
        return self.add(torch.tanh(self.fc(self.fork(x))))


class PopRegisteredFirst(NestedResidual):
    """A block whose pop layer is registered before its stash layer but runs after it: only its forward
    knows the order."""

    def __init__(self, width: int) -> None:
        super().__init__(width, pop_registered_first=True)


def nested_skip_models(width: int = 6, seed: int = 0) -> dict[str, nn.Sequential]:
    """Skips kept inside blocks: a pop registered before its stash, and repeated blocks of one default
    name around an (isolated) skip that crosses them."""
    torch.manual_seed(seed)
    ns = Namespace()
    return {
        "pop registered first": nn.Sequential(nn.Linear(width, width), PopRegisteredFirst(width), nn.Tanh(),
                                              PopRegisteredFirst(width)),
        "repeated blocks": nn.Sequential(StashInput().isolate(ns), NestedResidual(width), NestedResidual(width),
                                         NestedResidual(width), PopAdd().isolate(ns)),
    }


# -- faults ----------------------------------------------------------------------------------------
import os  # noqa: E402
import signal  # noqa: E402

from rrefpipe.stage_side.checkpoint import is_recomputing  # noqa: E402


class DieInForward(nn.Module):
    """SIGKILLs its own worker process in the middle of a forward pass."""

    def forward(self, x: Tensor) -> Tensor:
        os.kill(os.getpid(), signal.SIGKILL)
        return x


class _DieInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        os.kill(os.getpid(), signal.SIGKILL)
        return grad


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, message):  # type: ignore[no-untyped-def]
        ctx.message = message
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        raise ValueError(ctx.message)


class DieInBackward(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return _DieInBackward.apply(x)


class RaiseInBackward(nn.Module):
    def __init__(self, message: str = "gradient of the wrong shape") -> None:
        super().__init__()
        self.message = message

    def forward(self, x: Tensor) -> Tensor:
        return _RaiseInBackward.apply(x, self.message)


class RaiseInBackwardOn(nn.Module):
    """``x * scale`` (a parameter, 1 at first, so that the output has a backward even where ``x`` needs no
    gradient); on a micro-batch that holds ``value``, its backward raises ValueError."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        y = x * self.scale
        if bool((x == self.value).any()):
            return _RaiseInBackward.apply(y, f"backward of a micro-batch holding {self.value}")
        return y


class RaiseInRecompute(nn.Module):
    """Fine in forward; raises when checkpointing recomputes it in backward."""

    def forward(self, x: Tensor) -> Tensor:
        if is_recomputing():
            raise IndexError("only on recompute")
        return torch.tanh(x)  # saves its output, so backward needs the recomputation


class DiffersOnRecompute(nn.Module):
    """Saves other tensors for backward when checkpointing runs it again: not the same work twice."""

    def forward(self, x: Tensor) -> Tensor:
        return x * x if is_recomputing() else torch.tanh(x)  # saves (x, x), then its output


class DoubleInPlace(nn.Module):
    """Modifies its input in place, with nothing on the module to say so (no ``inplace`` flag)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2)


class InterruptDriver(nn.Module):
    """Sends SIGINT (a Ctrl-C) to the driver, the process that built it, in its first forward on a worker
    only: the driver is then certainly waiting for this step. (Not the worker's parent: local workers
    are forked from a warm process.) Never fires in the process that built it."""

    def __init__(self) -> None:
        super().__init__()
        self.fired = False
        self.built_in = os.getpid()

    def interrupt_once(self) -> bool:
        """Send the SIGINT if this is the first forward on a worker; True when it was sent."""
        if self.fired or os.getpid() == self.built_in:
            return False
        self.fired = True
        os.kill(self.built_in, signal.SIGINT)
        return True

    def forward(self, x: Tensor) -> Tensor:
        self.interrupt_once()
        return x * 1


# -- recomputation ahead of backward ------------------------------------------------------------------
import time  # noqa: E402
from pathlib import Path  # noqa: E402


class SignalsRecompute(nn.Module):
    """Leaves a file in ``folder`` each time checkpointing recomputes it: another process can tell."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder
        self.count = 0

    def forward(self, x: Tensor) -> Tensor:
        if is_recomputing():
            self.count += 1
            (Path(self.folder) / f"recomputed-{os.getpid()}-{self.count}").touch()
        return torch.tanh(x)  # saves its output, so backward needs the recomputation


class _AwaitFiles(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer):  # type: ignore[no-untyped-def]
        ctx.layer = layer
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        layer = ctx.layer
        layer.calls += 1
        wanted = layer.calls - layer.offset
        deadline = time.monotonic() + layer.timeout
        while len(list(Path(layer.folder).iterdir())) < wanted:  # waits on a condition, with a deadline
            if time.monotonic() > deadline:
                raise TimeoutError(f"backward call {layer.calls} waited {layer.timeout} s for {wanted} files in "
                                   f"{layer.folder}; {len(list(Path(layer.folder).iterdir()))} came")
            time.sleep(0.005)
        return grad, None


class AwaitsFiles(nn.Module):
    """In its k-th backward (k = 1, 2, ...), before the gradient goes on to earlier stages, waits until
    ``folder`` holds ``k - offset`` files: left by another process's :class:`SignalsRecompute`, or by
    the test's driver."""

    def __init__(self, folder: str, offset: int = 0, timeout: float = 20.0) -> None:
        super().__init__()
        self.folder, self.offset, self.timeout = folder, offset, timeout
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        return _AwaitFiles.apply(x, self)


# -- Ctrl-C while a step is held ----------------------------------------------------------------------
class _HoldsDriver(InterruptDriver):
    """Where a subclass says, the first time on a worker: sends SIGINT to the driver that built it,
    then holds until that process creates ``folder/released`` (30 s at most), and then leaves
    ``folder/left``: a driver whose wait Ctrl-C interrupts sees KeyboardInterrupt while it is held (no
    file yet). Its forward does nothing else."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def interrupt_and_hold(self) -> None:
        if self.interrupt_once():
            released, deadline = Path(self.folder) / "released", time.monotonic() + 30
            while not released.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            (Path(self.folder) / "left").touch()

    def forward(self, x: Tensor) -> Tensor:
        return x * 1


class InterruptDriverAndHold(_HoldsDriver):
    """Interrupts the driver and holds the step in its first forward on a worker."""

    def forward(self, x: Tensor) -> Tensor:
        self.interrupt_and_hold()
        return super().forward(x)


class InterruptDriverInStateDict(_HoldsDriver):
    """Interrupts the driver and holds the call in its first ``state_dict()`` on a worker (a control call)."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        self.interrupt_and_hold()
        super()._save_to_state_dict(destination, prefix, keep_vars)


class InterruptDriverWhenBuilt(_HoldsDriver):
    """Interrupts the driver and holds while its worker builds its stage (unpickles it)."""

    def __setstate__(self, state):  # type: ignore[no-untyped-def]
        super().__setstate__(state)
        self.interrupt_and_hold()


class TwoHeads(nn.Module):
    """Tensor -> (head a's output, head b's output): a loss may leave one head out."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, out), nn.Linear(width, out)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.a(x), self.b(x)


class TakeFirst(nn.Module):
    """(a, b) -> a: what a layer does that leaves part of its input unused."""

    def forward(self, xs: tuple[Tensor, Tensor]) -> Tensor:
        return xs[0]


class Detach(nn.Module):
    """Cuts the graph: the layers before it get no gradient (a frozen backbone, done by detaching)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.detach()


#: Models part of which the loss does not reach (see :func:`partly_unreached`).
UNREACHED_CASES = ("detached", "output left out", "input left out", "skip left out")


def partly_unreached(case: str) -> tuple[nn.Sequential, list[int]]:
    """A model part of which a cross-entropy loss on its (first) output does not reach, and a balance
    for 2 stages that puts that part on a stage before the one that leaves it out, or on the last."""
    manual_seed(11)
    if case == "detached":  # stage 1 detaches its input: stage 0 trains nothing
        return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), Detach(), nn.Linear(16, 4)), [2, 2]
    if case == "output left out":  # the loss uses the last stage's first output only
        return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), TwoHeads(16, 4)), [2, 1]
    if case == "input left out":  # stage 1 uses stage 0's first output only
        return nn.Sequential(TwoHeads(10, 16), TakeFirst(), nn.ReLU(), nn.Linear(16, 4)), [1, 3]
    assert case == "skip left out", case  # stage 1 pops stage 0's skip and leaves it unused
    return nn.Sequential(nn.Linear(10, 16), StashLinear(16), PopIgnore(), nn.Linear(16, 4)), [2, 2]
