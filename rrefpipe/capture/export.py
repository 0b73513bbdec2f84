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

__all__ = ["check_sample", "training_keywords", "export"]

#: Keywords a capture passes when the sample call leaves them out and ``forward`` names them. A Hugging
#: Face model returns its key/value cache (``DynamicCache``) by default (``config.use_cache``): it serves
#: generation, a training step never reads it, and torch.export cannot return it from a graph. Passing
#: False here, rather than setting ``model.config.use_cache``, leaves the user's model as it was.
TRAINING_KEYWORDS: dict[str, object] = {"use_cache": False}


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


def training_keywords(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> dict[str, object]:
    """The ``TRAINING_KEYWORDS`` that ``forward`` takes by name and the sample call does not pass, by
    position or by keyword: what a capture adds to the call (a value the caller gives is kept)."""
    try:
        signature = inspect.signature(module.forward)
        given = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):  # no signature to read, or a call that does not fit (export says so)
        return {}
    named = {name for name, p in signature.parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {name: value for name, value in TRAINING_KEYWORDS.items() if name in named and name not in given}


def export(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> torch.export.ExportedProgram:
    """``torch.export.export`` with dim 0 of every tensor input dynamic; its failures as CaptureError."""
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"the sample does not fit {type(module).__name__}.forward: {e}") from e
    dynamic = {name: pytree.tree_map(lambda v: {0: Dim.DYNAMIC} if isinstance(v, Tensor) else None, value)
               for name, value in bound.arguments.items()}
    try:
        with _quiet_failures(), _attributes_kept(module):
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


@contextlib.contextmanager
def _attributes_kept(module: nn.Module) -> Iterator[None]:
    """Give the model back its own attribute objects. Non-strict ``torch.export`` restores every module's
    attributes after tracing from a pytree copy, so a dict, list or tuple attribute (a Hugging Face model's
    ``_tp_plan``, a LayerNorm's ``normalized_shape``) comes back as an equal but new object, and a
    caller's reference to the old one would no longer be the model's."""
    before = [(m, dict(vars(m))) for m in module.modules()]
    try:
        yield
    finally:
        for m, attributes in before:
            for key, value in attributes.items():
                now = m.__dict__.get(key, value)
                if now is not value and _equal(now, value):
                    m.__dict__[key] = value


def _equal(a: object, b: object) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # values whose == is not a plain bool (tensors)
        return False


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
    if "transformers.cache_utils" in text:
        hint = ("forward returns a Hugging Face key/value cache, which serves generation and which torch.export "
                "cannot return from a graph: leave use_cache out of the call (rrefpipe then captures with "
                "use_cache=False) or pass use_cache=False")
    elif "data-dependent" in text or "DataDependent" in text:
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
