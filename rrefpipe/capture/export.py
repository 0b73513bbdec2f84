"""The sample call, checked, and ``torch.export`` with dim 0 of every tensor input dynamic; its failures
as :class:`~rrefpipe.capture.model.CaptureError` naming the submodule, torch's reason and what to do."""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.export import Dim
from torch.utils import _pytree as pytree

from .model import CaptureError, TensorSpec

__all__ = ["check_sample", "export"]


def check_sample(args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[list[str], list[object]]:
    """The flat inputs' names (``args[0]``, ``kwargs['mask']``) and what a capture fixes about each."""
    names: list[str] = []
    expected: list[object] = []
    batch: dict[int, str] = {}
    for path, value in pytree.tree_flatten_with_path((args, kwargs))[0]:
        name = ("args" if path[0] == pytree.SequenceKey(0) else "kwargs") + pytree.keystr(path[1:])
        names.append(name)
        if isinstance(value, Tensor):
            if value.dim() == 0:
                raise ValueError(f"sample input {name} is a 0-dim tensor: every tensor input is split along dim 0 "
                                 "into micro-batches; give it a batch dim, or make it a number")
            batch.setdefault(value.shape[0], name)
            expected.append(TensorSpec(value.dtype, tuple(value.shape[1:])))
        else:
            expected.append(value)
    if not batch:
        raise ValueError("the sample has no tensor input: capture splits tensors along dim 0 into micro-batches")
    if len(batch) > 1:
        raise ValueError("the sample's tensor inputs must share their dim 0 (the batch): "
                         + ", ".join(f"{name} has {size}" for size, name in batch.items()))
    if 1 in batch:
        raise ValueError("the sample's batch (dim 0) is 1: torch.export takes a size of 1 for a constant and the "
                         "stages would then run only batches of 1; give a sample of 2 or more rows (after "
                         "capture, micro-batches of any size run)")
    return names, expected


def export(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> torch.export.ExportedProgram:
    """``torch.export.export`` with dim 0 of every tensor input dynamic; its failures as CaptureError."""
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"the sample does not fit {type(module).__name__}.forward: {e}") from e
    dynamic = {name: pytree.tree_map(lambda v: {0: Dim.DYNAMIC} if isinstance(v, Tensor) else None, value)
               for name, value in bound.arguments.items()}
    try:
        with _quiet_failures():
            return torch.export.export(module, args, kwargs, dynamic_shapes=dynamic)
    except Exception as e:
        where = _culprit(module, e)
        place = f"in {type(module).__name__}.forward" if not where else f"in submodule {where!r}"
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:400].rstrip(".")
        raise CaptureError(f"torch.export cannot capture {type(module).__name__} ({place}): {type(e).__name__}: "
                           f"{reason}. {_what_to_do(e)}") from e


@contextlib.contextmanager
def _quiet_failures() -> Iterator[None]:
    """A failed export prints its partial graph to stderr (twice) and logs a warning about the symbol it
    could not place, some 30 lines before the error says what happened: the CaptureError names the
    submodule instead, and the partial graph stays on torch's error (``err.__cause__.partial_fx_graph``)."""
    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes.level
    shapes.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        shapes.setLevel(level)


def _culprit(module: nn.Module, error: BaseException) -> str | None:
    """The path of the innermost submodule whose ``forward`` the error went through, if any."""
    paths = {id(m): path for path, m in module.named_modules()}
    found: str | None = None
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        tb = cause.__traceback__
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if owner is not None and id(owner) in paths:
                found = paths[id(owner)]
            tb = tb.tb_next
        cause = cause.__cause__ or cause.__context__
    return found


def _what_to_do(error: BaseException) -> str:
    text = f"{type(error).__name__} {error}"
    if "data-dependent" in text or "DataDependent" in text:
        hint = ("forward branches on a tensor's value: compute both sides and pick one with torch.where, or use "
                "torch.cond")
    elif "not a known type" in text or "pytree" in text:
        hint = ("forward returns or takes an object torch.export cannot flatten: return tensors in tuples, lists or "
                "dicts, or register the type with torch.utils._pytree (a Hugging Face model: pass use_cache=False)")
    elif "Constraints violated" in text or "specializ" in text:
        hint = ("forward depends on the batch size (dim 0 of an input), as in `if x.shape[0] == 4` or a view with "
                "the batch size written out: use x.shape[0] or -1 instead, and do not branch on it")
    else:
        hint = "see torch's error above (the cause of this one)"
    return f"What to do: {hint}; or build the stages yourself with Pipe.from_factories"
