"""How a value reaches a layer: whole (PyTorch 1.8's Pipe) or spread over its parameters (2.x's).

PyTorch 1.8's partitions were plain ``nn.Sequential``: a tuple reached each layer as one argument.
PyTorch 2.x called the first layer as ``layer(*inputs)`` and spread every tuple between layers
(``PipeSequential``). Both kinds of script run here, told apart by the call (pure, no RPC):

* ``pipe(a, b)``, several inputs: 2.x style, ``spread=True``: every tuple is spread, the inputs
  included (``first(a, b)``); a tensor or a list goes whole, as in 2.x.
* ``pipe(x)`` or ``pipe((a, b))``, one input: 1.8 style, ``spread=False``: a tuple reaches a layer whole,
  except a layer whose ``forward`` cannot take one argument (two or more required positional
  parameters), which gets it spread, so 2.x single-input models that pass ``(x, mask)`` on also run.

``Pipe(..., call_style="2.x")`` spreads every call, one input included: 2.x's rule exactly, for 2.x
models whose layers take ``*args`` or an optional second argument, which the signature cannot tell.
"""
from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

__all__ = ["CALL_STYLES", "check_call_style", "needs_spread", "call_layer", "run_layers", "LayerSequence", "as_layer_sequence"]

CALL_STYLES = ("auto", "2.x")

_one_argument: dict[type, bool] = {}  # by layer class: whether its forward can take a single argument


def _takes_one_argument(forward: Callable[..., Any]) -> bool:
    """Whether ``forward`` (bound) can be called with one positional argument."""
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): call it as 1.8 did
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty]
    return len(required) <= 1


def check_call_style(style: object) -> str:
    """``style`` if it is one of :data:`CALL_STYLES`, else ``ValueError`` saying what each means."""
    if style not in CALL_STYLES:
        raise ValueError(f"call_style must be 'auto' (PyTorch 1.8's whole tuples for a call with one input, 2.x's "
                         f"spread ones for several) or '2.x' (every tuple spread, as PyTorch 2.x), got {style!r}")
    return str(style)


def _unwrapped(layer: nn.Module) -> nn.Module:
    """The module a wrapper calls: ``torch.compile``'s and ``checkpoint_wrapper``'s forward take ``*args``,
    which says nothing about the wrapped layer's parameters."""
    for attribute in ("_orig_mod", "_checkpoint_wrapped_module"):
        inner = getattr(layer, attribute, None)
        if isinstance(inner, nn.Module):
            return _unwrapped(inner)
    return layer


def needs_spread(layer: nn.Module) -> bool:
    """Whether ``layer``'s forward requires two or more positional arguments (so a tuple must be spread).

    Read from the signature (``@skippable`` keeps the decorated forward's), once per class unless the
    instance has a ``forward`` of its own. A ``torch.compile``d or ``checkpoint_wrapper``ed layer is read
    through to the layer it wraps."""
    layer = _unwrapped(layer)
    if "forward" in vars(layer):
        return not _takes_one_argument(layer.forward)
    cls = type(layer)
    if cls not in _one_argument:
        _one_argument[cls] = _takes_one_argument(layer.forward)
    return not _one_argument[cls]


def call_layer(layer: nn.Module, value: Any, spread: bool) -> Any:
    """``layer(*value)`` where ``value`` is a tuple and the call is 2.x style (``spread``) or the layer
    requires several arguments (:func:`needs_spread`); else ``layer(value)``."""
    if isinstance(value, tuple) and (spread or needs_spread(layer)):
        return layer(*value)
    return layer(value)


def run_layers(layers: Iterable[nn.Module], value: Any, spread: bool) -> Any:
    """Run ``layers`` in order, each on the previous one's output, through :func:`call_layer`.

    In 2.x style an ``nn.Sequential`` among them (a subclass too) is run layer by layer, as 2.x flattened
    nested ``nn.Sequential`` modules into its partitions (its own forward and hooks then do not run)."""
    for layer in layers:
        if spread and isinstance(layer, nn.Sequential):
            value = run_layers(layer, value, spread)
        else:
            value = call_layer(layer, value, spread)
    return value


class LayerSequence(nn.Sequential):
    """A stage's layers: an ``nn.Sequential`` whose forward runs them by :func:`run_layers`. Called as a
    module, so hooks on it (and module-wide ones, such as :mod:`rrefpipe.memory`'s) see the stage's input."""

    def forward(self, input: Any, spread: bool = False) -> Any:  # noqa: A002 (nn.Sequential's name)
        return run_layers(self, input, spread)


def as_layer_sequence(module: nn.Sequential) -> LayerSequence:
    """``module`` itself as a :class:`LayerSequence` where it is a plain ``nn.Sequential`` (its class is
    changed: the same object, layers and state-dict keys), else a LayerSequence of its children."""
    if isinstance(module, LayerSequence):
        return module
    if type(module) is nn.Sequential:
        module.__class__ = LayerSequence
        return module  # type: ignore[return-value]  # (its class is LayerSequence now)
    return LayerSequence(OrderedDict(module.named_children()))
