"""The RRef that ``Pipe.forward`` returns, which says what to call when it is used as a tensor.

``pipe(x)`` returns an RRef to the output, as PyTorch's ``Pipe`` did. Used in its place, a plain RRef
gives torch's "must be Tensor, not RRef" or "can't call localValue() on user". These classes keep
the RRef and answer such uses with what to call instead: ``.local_value()`` for an output held by
this process, ``.to_here()`` for one kept on the last stage's worker (``remote_output=True``).

* :class:`PipeRRef` is a ``torch.distributed.rpc.RRef`` (a subclass; everything of an RRef works).
* :class:`RemotePipeRRef` wraps the RRef that ``rpc.remote`` made, whose C++ type cannot be
  subclassed from Python, and passes every RRef method on to it (the RRef itself: ``.rref``).

Both travel through RPC calls as the RRef they hold (a receiver gets a plain RRef).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NoReturn

import torch
import torch.distributed.rpc as rpc

from .. import _rpc

__all__ = ["PipeRRef", "RemotePipeRRef"]


class _AsTensorAdvice:
    """Refuse tensor uses (torch functions, tensor methods and operators) with what to call instead."""

    __slots__ = ()
    _fetch: ClassVar[str] = ".local_value()"
    _where: ClassVar[str] = "held by this process"

    @classmethod
    def _mistake(cls, what: str) -> str:
        return (f"{what}: pipe(x) returns an RRef to the output ({cls._where}), not the output itself. Take the output "
                f"with pipe(x){cls._fetch} and use that, e.g. F.cross_entropy(pipe(x){cls._fetch}, y)")

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> NoReturn:
        """Any torch function given this RRef (``F.cross_entropy(out, y)``, ``torch.cat``, a layer's call)."""
        name = getattr(func, "__name__", str(func))
        raise TypeError(cls._mistake(f"{name}() was given a {cls.__name__}"))

    def __getattr__(self, name: str) -> Any:
        # Called only for names the RRef does not have: a tensor's (out.sum(), out.shape) gets the advice.
        if not name.startswith("_") and hasattr(torch.Tensor, name):
            raise AttributeError(self._mistake(f"{type(self).__name__!r} object has no attribute {name!r}"))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _operator(self, *_: Any) -> NoReturn:
        raise TypeError(self._mistake(f"a {type(self).__name__} cannot take part in arithmetic, indexing or unpacking"))

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _operator
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _operator
    __pow__ = __rpow__ = __matmul__ = __rmatmul__ = __neg__ = __pos__ = __abs__ = _operator
    __lt__ = __le__ = __gt__ = __ge__ = __getitem__ = __iter__ = _operator


class PipeRRef(_AsTensorAdvice, rpc.RRef):
    """An RRef to a pipe's output held by this process: ``.local_value()`` (or ``.to_here()``) gives it."""

    __slots__ = ()


class RemotePipeRRef(_AsTensorAdvice):
    """The RRef to a pipe's output kept on its last stage's worker (``remote_output=True``):
    ``.to_here()`` fetches it. Every RRef method is the wrapped RRef's (``.rref``), except
    ``.local_value()``, which this process cannot call: it says to call ``.to_here()``."""

    __slots__ = ("rref",)
    _fetch = ".to_here()"
    _where = "kept on the last stage's worker, as remote_output=True asks"

    def __init__(self, rref: rpc.RRef) -> None:
        self.rref = rref

    def local_value(self) -> NoReturn:
        """Refused: the output is owned by the last stage's worker, not by this process."""
        raise RuntimeError(f"this pipe has remote_output=True: its output stays on the last stage's worker "
                           f"{self.rref.owner_name()!r}, and only the owner can call local_value(). Fetch it with "
                           "pipe(x).to_here()")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "rref":  # (``rref`` unset: a copy being built)
            raise AttributeError(name)
        try:
            return getattr(self.rref, name)
        except AttributeError:
            return super().__getattr__(name)

    def __repr__(self) -> str:
        return f"RemotePipeRRef({self.rref!r})"

    def __reduce__(self) -> NoReturn:
        raise TypeError("an RRef pickles only inside RPC calls (rpc_sync, rpc_async, remote), where it travels as "
                        "the RRef it wraps")


_rpc.pickle_rref_as(PipeRRef, lambda rref: rref)
_rpc.pickle_rref_as(RemotePipeRRef, lambda remote: remote.rref)
