"""What a capture gives: :class:`CapturedModel` (the stages and where each of their inputs comes from),
:class:`Source`, :class:`TiedParameter` and :class:`CaptureError`."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.fx as fx
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["INPUT", "CONSTANT", "CaptureError", "Source", "TiedParameter", "TensorSpec", "CapturedModel",
           "spec_children"]

INPUT = -1  # Source.stage of a caller's input (position: among the flat inputs)
CONSTANT = -2  # Source.stage of a constant model output (position: in CapturedModel.output_constants)


class CaptureError(ValueError):
    """``torch.export`` could not capture the model as one graph (a ``ValueError``: the model and
    sample given cannot be pipelined this way). The message names the submodule whose ``forward`` was
    running, torch's reason and what to do; ``__cause__`` is torch's own error."""


class Source(NamedTuple):
    """Where a value comes from: output ``position`` of stage ``stage``; the caller's flat input ``position``
    when ``stage == INPUT``; ``CapturedModel.output_constants[position]`` when ``stage == CONSTANT``."""

    stage: int
    position: int

    def __str__(self) -> str:
        if self.stage == INPUT:
            return f"input {self.position}"
        if self.stage == CONSTANT:
            return f"constant {self.position}"
        return f"stage {self.stage}'s output {self.position}"


class TiedParameter(NamedTuple):
    """A parameter several stages use: its ``state_dict`` keys in the original module (every alias,
    as ``('tok.weight', 'head.weight')``) and, per stage that holds a copy, its name there. Their
    gradients must be summed among those stages before an optimizer step."""

    keys: tuple[str, ...]
    names: dict[int, str]


class TensorSpec(NamedTuple):
    """What a capture fixed about a tensor input: its dtype and its sizes after dim 0."""

    dtype: torch.dtype
    tail: tuple[int, ...]


@dataclass
class CapturedModel:
    """A model cut into stages, and where every stage input and model output comes from.

    ``stages[j](*values)`` returns a tuple; ``inputs[j][p]`` is the :class:`Source` of its ``p``-th
    argument. ``outputs[k]`` is the source of the model's ``k``-th flat output, rebuilt into the
    model's structure (tuple, dict, ...) by ``unflatten_outputs``. ``state_keys[j]`` maps each
    parameter and buffer name of stage ``j`` to the original ``state_dict`` keys of that tensor
    (empty for tensors the state dict leaves out). ``unused_keys``: original keys no stage holds
    (parameters ``forward`` never uses). ``training``: the mode the graphs were captured in.
    ``numbers``: the stage outputs that are Python numbers, not tensors (sizes that depend on the batch).
    ``input_names``: each flat input as the sample gave it (``args[0]``, ``kwargs['mask']``);
    ``in_spec``/``out_spec``: the pytree structures of the call and of the output. ``seconds``: how
    long ``torch.export`` and the split took. ``fixed``: the keywords the capture added to the sample
    call (``use_cache=False`` for a Hugging Face model), which ``flatten_inputs`` adds to a call that
    leaves them out (a call made as the sample was still fits).
    """

    stages: list[fx.GraphModule]
    inputs: list[list[Source]]
    outputs: list[Source]
    output_constants: list[object]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    input_names: list[str]
    state_keys: list[dict[str, tuple[str, ...]]]
    tied: list[TiedParameter]
    unused_keys: list[str]
    training: bool
    numbers: frozenset[Source] = frozenset()
    seconds: dict[str, float] = field(default_factory=dict)
    _expected: list[object] = field(default_factory=list, repr=False)  # a TensorSpec or the sample's value
    fixed: dict[str, object] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.inputs)  # (a runtime may drop the stages once it has placed them)

    def consumers(self, source: Source) -> list[int]:
        """The stages that take ``source`` as an input, in order (the model's output is not counted)."""
        return [j for j, sources in enumerate(self.inputs) if source in sources]

    def skips(self) -> list[tuple[Source, int]]:
        """``(source, j)`` for each value stage ``j`` takes from further back than stage ``j - 1``
        (a caller's input counts as stage -1's): what a runtime sends straight to ``j``."""
        return [(s, j) for j, sources in enumerate(self.inputs) for s in dict.fromkeys(sources)
                if s.stage < j - 1]

    def flatten_inputs(self, args: Sequence[object], kwargs: Mapping[str, object] | None = None) -> list[object]:
        """The flat inputs of a call ``model(*args, **kwargs)``, checked against the capture.

        Raises ``TypeError`` for another structure, a non-tensor where the sample had a tensor or
        another dtype; ``ValueError`` for other sizes after dim 0, tensors of different dim 0 sizes,
        or a non-tensor input unlike the sample's (the capture baked that value in). The ``fixed``
        keywords a call leaves out are added."""
        kwargs = {**{k: v for k, v in self.fixed.items() if k not in (kwargs or {})}, **(kwargs or {})}
        order = spec_children(self.in_spec)[1].context
        if set(kwargs) == set(order):  # the sample's keyword order
            kwargs = {key: kwargs[key] for key in order}
        flat, spec = pytree.tree_flatten((tuple(args), kwargs))
        if spec != self.in_spec:
            raise TypeError(f"the inputs are not shaped like the sample's: captured with {_brief(self.in_spec)}, "
                            f"called with {_brief(spec)}; pass the same arguments, by position and by keyword, "
                            "as the sample")
        batch: dict[int, str] = {}
        for name, value, expected in zip(self.input_names, flat, self._expected):
            if isinstance(expected, TensorSpec):
                if not isinstance(value, Tensor):
                    raise TypeError(f"input {name} is a {type(value).__name__}; the sample's was a tensor")
                if value.dtype != expected.dtype:
                    raise TypeError(f"input {name} is {value.dtype}; the capture was made with {expected.dtype}: "
                                    f"convert it, or capture with a sample of this dtype")
                if value.dim() == 0 or tuple(value.shape[1:]) != expected.tail:
                    raise ValueError(f"input {name} has shape {tuple(value.shape)}; the capture fixed every dim "
                                     f"but dim 0 to the sample's (B, {', '.join(map(str, expected.tail))}): "
                                     "capture with a sample of this shape")
                batch.setdefault(value.shape[0], name)
            elif not _same(value, expected):
                raise ValueError(f"input {name} is {value!r} but the capture baked in the sample's {expected!r} "
                                 "(torch.export makes non-tensor inputs constants): capture again with this value, "
                                 "or pass it as a tensor")
        if len(batch) > 1:
            raise ValueError("tensor inputs must share their dim 0 (the batch, split into micro-batches): "
                             + ", ".join(f"{name} has {size}" for size, name in batch.items()))
        return flat

    def value(self, source: Source, inputs: Sequence[object], outputs: Sequence[Sequence[object]]) -> object:
        """The value ``source`` names, given the flat inputs and the outputs of the stages run so far."""
        if source.stage == INPUT:
            return inputs[source.position]
        if source.stage == CONSTANT:
            return self.output_constants[source.position]
        return outputs[source.stage][source.position]

    def unflatten_outputs(self, flat: Sequence[object]) -> object:
        """The model's output (tensor, tuple, dict, ...) from its flat outputs."""
        return pytree.tree_unflatten(list(flat), self.out_spec)

    def __str__(self) -> str:
        lines = [f"{self.num_stages} stages captured in {'train' if self.training else 'eval'} mode"]
        for j, sources in enumerate(self.inputs):
            lines.append(f"stage {j} takes " + (", ".join(map(str, sources)) or "nothing"))
        lines.append("output: " + ", ".join(map(str, self.outputs)))
        for tie in self.tied:
            lines.append(f"tied {' = '.join(tie.keys)}: " + ", ".join(f"stage {j} ({n})" for j, n in tie.names.items()))
        return "\n".join(lines)



def spec_children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    """The structures of a pytree node's children (``TreeSpec.child`` from torch 2.9, ``children_specs`` before)."""
    child = getattr(spec, "child", None)
    return [child(k) for k in range(spec.num_children)] if callable(child) else list(spec.children_specs)


def _brief(spec: pytree.TreeSpec) -> str:
    return " ".join(str(spec).split())


def _same(a: object, b: object) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # values whose == is not a plain bool
        return a is b
