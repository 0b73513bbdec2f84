"""Any ``nn.Module`` as pipeline stages: captured with ``torch.export``, cut where named submodules
begin, with the table that says where every stage input comes from (pure: one process, no RPC).

``capture(model, (tokens,), split_points=["blocks.1", "blocks.3"])`` exports the model with dim 0 of
every tensor input dynamic (any micro-batch size runs), cuts the flat aten graph with
``torch.fx.passes.split_module`` at the first operation of each named submodule (the meaning of
``torch.distributed.pipelining``'s ``SplitPoint.BEGINNING``), or where ``set_stage`` marks say, and
returns a :class:`CapturedModel`. For a GPT-style model (``tests/test_capture.py``)::

               stage 0                        stage 1                  stage 2
    input 0 ─► tok, pos, blocks.0 ─output 0─► blocks.1, blocks.2 ─0──► blocks.3, ln_f, + e, head ─► output
                      ├─ output 1 (the batch size, an int) ─► stage 1 and stage 2
                      └─ output 2 (e, the embeddings) ────────────────► stage 2 (a long skip)

``inputs[2] == [Source(1, 0), Source(0, 1), Source(0, 2)]``: a runtime sends stage 0's outputs 1 and 2
straight to stage 2, never through stage 1 (``skips()`` lists such routes). Values crossing a cut are
tensors or Python ints (sizes that depend on the batch); a ``getitem`` goes with the operation it
takes an item of, so no tuple crosses.

The stages are plain ``fx.GraphModule`` objects. They pickle by code (cloudpickle), so a stage worker runs
them without the model's code; regions export keeps whole (``torch.no_grad()`` and ``torch.autocast``
blocks in ``forward``, ``torch.cond``) are called by name so that they survive it (fx rebuilds a
pickled module by tracing its code, which would drop their context). Stages name their parameters and
buffers as the model does (a tied tensor under the name export used it by); ``state_keys`` maps those
names to every ``state_dict()`` key of the model, and ``tied`` lists the parameters several stages use
(an embedding tied to the output head), of which each such stage holds a copy once on its worker.
``run_stages`` runs the stages one after another in one process (the reference the tests compare with).

What a capture fixes (check ``CapturedModel.training`` and see ``flatten_inputs``):

* the training mode: ``torch.export`` writes dropout and batch norm as train- or eval-mode operations,
  so ``.eval()`` on a stage changes nothing; capture once per mode;
* non-tensor inputs (``scale=3.0``) become constants, and tensor dims other than 0 the sample's sizes:
  ``flatten_inputs`` refuses a call that differs;
* devices the model names in ``forward`` (``torch.arange(T, device=x.device)`` becomes ``device='cpu'``).

Errors: a model ``torch.export`` cannot capture (branches on a tensor's value, outputs it cannot
flatten, code that depends on the batch size) raises :class:`CaptureError`, a ``ValueError`` naming the
submodule, torch's reason and what to do; split points or marks that cannot cut the model, or a
submodule with parameters called on both sides of a cut, raise ``ValueError``; a call whose inputs
differ from the sample's in structure, type or dtype raises ``TypeError``. Index names: ``j`` stage,
``k`` a flat input or output.
"""
from __future__ import annotations

import difflib
import inspect
import operator
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch._ops import HigherOrderOperator
from torch.export import Dim
from torch.fx.passes.split_module import split_module
from torch.utils import _pytree as pytree

__all__ = ["INPUT", "CONSTANT", "CaptureError", "Source", "TiedParameter", "CapturedModel", "capture",
           "set_stage", "stage_marks", "run_stages"]

INPUT = -1  # Source.stage of a caller's input (position: among the flat inputs)
CONSTANT = -2  # Source.stage of a constant model output (position: in CapturedModel.output_constants)
_MARK = "_rrefpipe_stage"  # the attribute set_stage writes on a submodule
_SIZE_READS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int,
               torch.ops.aten.sym_storage_offset.default, operator.getitem}

ModuleT = TypeVar("ModuleT", bound=nn.Module)


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


class _TensorSpec(NamedTuple):
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
    long ``torch.export`` and the split took.
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
    _expected: list[object] = field(default_factory=list, repr=False)  # a _TensorSpec or the sample's value

    @property
    def num_stages(self) -> int:
        return len(self.stages)

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
        or a non-tensor input unlike the sample's (the capture baked that value in)."""
        kwargs = dict(kwargs or {})
        order = _child(self.in_spec, 1).context
        if set(kwargs) == set(order):  # the sample's keyword order
            kwargs = {key: kwargs[key] for key in order}
        flat, spec = pytree.tree_flatten((tuple(args), kwargs))
        if spec != self.in_spec:
            raise TypeError(f"the inputs are not shaped like the sample's: captured with {_brief(self.in_spec)}, "
                            f"called with {_brief(spec)}; pass the same arguments, by position and by keyword, "
                            "as the sample")
        batch: dict[int, str] = {}
        for name, value, expected in zip(self.input_names, flat, self._expected):
            if isinstance(expected, _TensorSpec):
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


def set_stage(module: ModuleT, stage: int | None) -> ModuleT:
    """Mark ``module`` (a submodule of the model to capture) to run on stage ``stage``, as OneFlow's
    ``module.config.set_stage`` does; ``None`` removes the mark. Returns ``module``.

    An operation runs on the stage of the innermost marked module it is in; unmarked code runs on the
    stage that ran before it (stage 0 at the start). Stages must follow forward order and each of
    ``0 .. n-1`` must get some operation. The mark is an attribute of the module (it survives
    ``copy.deepcopy``); ``capture`` reads it when no ``split_points`` are given."""
    if stage is None:
        module.__dict__.pop(_MARK, None)
        return module
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise TypeError(f"set_stage takes a stage index (an int), got {type(stage).__name__}")
    if stage < 0:
        raise ValueError(f"set_stage takes a stage index >= 0, got {stage}")
    module.__dict__[_MARK] = stage
    return module


def stage_marks(module: nn.Module) -> dict[str, int]:
    """The ``set_stage`` marks on ``module`` and its submodules, by path (``''``: ``module`` itself)."""
    return {path: m.__dict__[_MARK] for path, m in module.named_modules() if _MARK in m.__dict__}


def capture(module: nn.Module, args: tuple[object, ...] | Tensor, kwargs: Mapping[str, object] | None = None, *,
            split_points: Sequence[str] | None = None) -> CapturedModel:
    """Capture ``module(*args, **kwargs)`` with ``torch.export`` and cut it into stages.

    Args:
        module: any ``nn.Module`` whose ``forward`` ``torch.export`` can capture. It is not changed; the
            stages hold its own parameter and buffer tensors (no copy).
        args, kwargs: a sample call. Every tensor is split along dim 0 into micro-batches: the sample's
            tensors must share a dim 0 of at least 2 (export takes a size of 1 for a constant).
        split_points: submodule paths as ``named_modules()`` gives them, in forward order; a new stage
            begins at the first operation of each (a container ``forward`` never calls, such as a
            ``ModuleList``, begins at its first child that runs). Without them, ``set_stage`` marks on
            the submodules cut the model; without either, one stage.

    Raises:
        CaptureError: ``torch.export`` could not capture the model.
        ValueError: a split point that names no submodule, names one twice, is out of forward order,
            leaves a stage empty or falls inside a ``no_grad``/``autocast`` block that begins before it;
            marks out of forward order or with a gap; marks and split points both; a submodule with
            parameters called on both sides of a cut; a sample batch of 1.
        TypeError: a sample that does not fit ``forward``'s signature.
    """
    args = (args,) if isinstance(args, Tensor) else tuple(args)
    kwargs = dict(kwargs or {})
    modules = dict(module.named_modules(remove_duplicate=False))
    marks = stage_marks(module)
    points: list[str] = []
    if split_points is not None:
        if marks:
            raise ValueError(f"give split_points or set_stage marks, not both: {_listing(marks)} are marked; "
                             "remove the marks with set_stage(m, None), or leave split_points out")
        points = _checked_points(module, modules, split_points)
    names, expected = _check_sample(args, kwargs)
    started = time.perf_counter()
    exported = _export(module, args, kwargs)
    exported_at = time.perf_counter()
    graph_module = exported.module(check_guards=False)  # guards do not pickle; flatten_inputs checks instead
    regions = {n: _region(n, graph_module) for n in graph_module.graph.nodes
               if n.op not in ("placeholder", "get_attr", "output")}
    stage_of = _stages_from_marks(regions, marks) if marks else _stages_at_points(regions, points)
    _check_calls_within_stages(regions, stage_of, modules)
    split = split_module(graph_module, module, lambda node: stage_of[node], keep_original_order=True,
                         tuple_return=True)
    stages, inputs, outputs, constants, numbers = _stages_and_routes(split, graph_module, module.training)
    state_keys, tied, unused = _state_keys(module, stages)
    return CapturedModel(stages, inputs, outputs, constants, exported.call_spec.in_spec, exported.call_spec.out_spec,
                         names, state_keys, tied, unused, module.training, frozenset(numbers),
                         {"export": exported_at - started, "split": time.perf_counter() - exported_at}, expected)


def run_stages(captured: CapturedModel, *args: object, **kwargs: object) -> object:
    """Run the stages one after another in this process, as the model would run: the reference that
    a pipeline's results are compared with. Autograd records the whole run, as the model's would."""
    flat = captured.flatten_inputs(args, kwargs)
    outputs: list[tuple[object, ...]] = []
    for stage, sources in zip(captured.stages, captured.inputs):
        outputs.append(stage(*(captured.value(s, flat, outputs) for s in sources)))
    return captured.unflatten_outputs([captured.value(s, flat, outputs) for s in captured.outputs])


# --- the sample and torch.export ----------------------------------------------------------------


def _check_sample(args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[list[str], list[object]]:
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
            expected.append(_TensorSpec(value.dtype, tuple(value.shape[1:])))
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


def _export(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> torch.export.ExportedProgram:
    """``torch.export.export`` with dim 0 of every tensor input dynamic; its failures as CaptureError."""
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"the sample does not fit {type(module).__name__}.forward: {e}") from e
    dynamic = {name: pytree.tree_map(lambda v: {0: Dim.DYNAMIC} if isinstance(v, Tensor) else None, value)
               for name, value in bound.arguments.items()}
    try:
        return torch.export.export(module, args, kwargs, dynamic_shapes=dynamic)
    except Exception as e:
        where = _culprit(module, e)
        place = f"in {type(module).__name__}.forward" if not where else f"in submodule {where!r}"
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:400].rstrip(".")
        raise CaptureError(f"torch.export cannot capture {type(module).__name__} ({place}): {type(e).__name__}: "
                           f"{reason}. {_what_to_do(e)}") from e


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


# --- where the cuts go ------------------------------------------------------------------------------


def _checked_points(module: nn.Module, modules: Mapping[str, nn.Module], points: Sequence[str]) -> list[str]:
    """The split points, checked before any capture: strings naming distinct submodules."""
    if isinstance(points, str):
        raise TypeError(f"split_points is a list of submodule paths, got the string {points!r}: use [{points!r}]")
    seen: set[str] = set()
    for point in points:
        if not isinstance(point, str):
            raise TypeError(f"split points are submodule paths (strings), got {type(point).__name__}: {point!r}")
        if point == "":
            raise ValueError("split point '' is the whole model: name the submodule where a stage begins")
        if point not in modules:
            owner, _, attribute = point.rpartition(".")
            close = difflib.get_close_matches(point, [p for p in modules if p], n=3)
            if owner in modules and attribute in dict(modules[owner].named_parameters(recurse=False)) | dict(
                    modules[owner].named_buffers(recurse=False)):
                hint = f" (it is a tensor of {owner!r}: name the module)"
            else:
                hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
            raise ValueError(f"split point {point!r} names no submodule of {type(module).__name__}{hint}: split "
                             "points are module paths as named_modules() gives them, such as 'blocks.2'")
        if point in seen:
            raise ValueError(f"split point {point!r} is named twice: each stage begins at one submodule; drop the "
                             "second")
        seen.add(point)
    return list(points)


def _paths(node: fx.Node) -> list[str]:
    """The module paths a graph node runs in, outermost first (``''``: the model itself)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [v[0] if isinstance(v, tuple) else str(v) for v in stack.values()]


def _within(path: str, point: str) -> bool:
    return path == point or path.startswith(point + ".")


def _region(node: fx.Node, owner: fx.GraphModule) -> list[fx.Node]:
    """``node`` and, when it is a region export keeps whole (a higher-order op: ``torch.no_grad()`` or
    ``torch.autocast`` blocks in ``forward``, ``torch.cond``), the operations inside, in order."""
    found = [node]
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr" and _has(owner, str(arg.target)):
            body = _fetch(owner, str(arg.target))
            if isinstance(body, fx.GraphModule):
                for inner in body.graph.nodes:
                    if inner.op == "call_function":
                        found.extend(_region(inner, body))
    return found


def _producer(node: fx.Node, stage_of: Mapping[fx.Node, int]) -> fx.Node | None:
    """The node a ``getitem`` takes an item of, where its stage is known: the item goes with it, so
    that no tuple crosses a cut."""
    if node.target is operator.getitem and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0] if node.args[0] in stage_of else None
    return None


def _work(region: list[fx.Node]) -> list[fx.Node]:
    return [n for n in region if n.target not in _SIZE_READS]


def _stages_at_points(regions: Mapping[fx.Node, list[fx.Node]], points: list[str]) -> dict[fx.Node, int]:
    """Each operation's stage: how many split points have begun by it (BEGINNING semantics)."""
    ops = list(regions)
    begins: dict[str, int] = {}
    for k, node in enumerate(ops):
        if node.target is operator.getitem:
            continue
        for point in points:
            if point not in begins and any(_within(p, point) for n in regions[node] for p in _paths(n)):
                begins[point] = k
                inner = _work(regions[node][1:])
                if inner and not any(_within(p, point) for p in _paths(inner[0])):
                    raise ValueError(f"split point {point!r} is inside a region torch.export keeps whole (a `with "
                                     "torch.no_grad()` or `torch.autocast` block in forward, or torch.cond) that "
                                     "begins before it: cut where the region begins, or move the block")
    missing = [p for p in points if p not in begins]
    if missing:
        raise ValueError(f"split point {missing[0]!r} names a submodule forward never runs: cut where a submodule "
                         "that runs begins")
    in_order = sorted(points, key=begins.__getitem__)
    if in_order != points:
        late = next(p for p, q in zip(points, in_order) if p != q)
        raise ValueError(f"split points out of forward order: {late!r} is listed before submodules that run "
                         f"earlier; in forward order they are {in_order}")
    stage_of: dict[fx.Node, int] = {}
    for k, node in enumerate(ops):
        producer = _producer(node, stage_of)
        stage_of[node] = stage_of[producer] if producer else sum(1 for p in points if begins[p] <= k)
    for j in _idle_stages(stage_of, len(points) + 1):
        if j == 0:
            raise ValueError(f"split point {points[0]!r} begins at forward's first operation: stage 0 would be empty "
                             "(or only read sizes); drop it")
        raise ValueError(f"split points {points[j - 1]!r} and {points[j]!r} begin at the same operation: the stage "
                         f"between them would be empty; drop one")
    return stage_of


def _idle_stages(stage_of: Mapping[fx.Node, int], n: int) -> list[int]:
    """The stages among ``0 .. n-1`` that no operation but a size read (``x.shape[0]``) runs on."""
    busy = {j for node, j in stage_of.items() if node.target not in _SIZE_READS}
    return [j for j in range(n) if j not in busy]


def _stages_from_marks(regions: Mapping[fx.Node, list[fx.Node]], marks: Mapping[str, int]) -> dict[fx.Node, int]:
    """Each operation's stage from ``set_stage`` marks: the innermost marked module's, else the last."""
    stage_of: dict[fx.Node, int] = {}
    current, by = 0, "the start of forward"
    ran: set[str] = set()
    for node, region in regions.items():
        producer = _producer(node, stage_of)
        if producer:
            stage_of[node] = stage_of[producer]
            continue
        innermost = {[p for p in _paths(n) if p in marks][-1]: None for n in region
                     if any(p in marks for p in _paths(n))}
        if len({marks[p] for p in innermost}) > 1:
            raise ValueError(f"{_listing({p: marks[p] for p in innermost})} run inside one region torch.export keeps "
                             "whole (a `with torch.no_grad()` or `torch.autocast` block in forward, or torch.cond): "
                             "set them to one stage, or move the block")
        for path in innermost:
            ran.add(path)
            if marks[path] < current:
                raise ValueError(f"module {path!r} is set to stage {marks[path]} but runs after {by!r} (stage "
                                 f"{current}): stages must follow forward order; renumber the set_stage marks")
            current, by = marks[path], path
        stage_of[node] = current
    never = sorted(set(marks) - ran)
    if never:
        raise ValueError(f"{_listing({p: marks[p] for p in never})} set by set_stage never run in forward: mark "
                         "submodules that run")
    gaps = _idle_stages(stage_of, max(stage_of.values(), default=0) + 1)
    if gaps:
        raise ValueError(f"no operation runs on stage {gaps[0]}: set_stage marks must number the stages 0, 1, ..., "
                         f"n-1 without a gap (marks: {_listing(marks)})")
    return stage_of


def _check_calls_within_stages(regions: Mapping[fx.Node, list[fx.Node]], stage_of: Mapping[fx.Node, int],
                               modules: Mapping[str, nn.Module]) -> None:
    """Refuse a submodule called several times with calls on both sides of a cut (its parameters would
    be needed by both). ``nn_module_stack`` has one key per call (``'L__self__shared@1'``)."""
    calls: dict[str, dict[str, set[int]]] = {}  # path -> call key -> stages
    for node, region in regions.items():
        for inner in region:
            for key, entry in (inner.meta.get("nn_module_stack") or {}).items():
                path = entry[0] if isinstance(entry, tuple) else str(entry)
                if path and path in modules and _holds_tensors(modules[path]):  # a shared ReLU may cross
                    calls.setdefault(path, {}).setdefault(str(key), set()).add(stage_of[node])
    across = {path: sorted(set().union(*per_call.values())) for path, per_call in calls.items()
              if len(per_call) > 1 and len(set().union(*per_call.values())) > 1}
    outermost = [p for p in across if not any(_within(p, q) and p != q for q in across)]
    if outermost:
        listed = "; ".join(f"{p!r} (stages {', '.join(map(str, across[p]))})" for p in outermost)
        raise ValueError(f"submodules called on both sides of a cut: {listed}. Move the cuts so that all calls of "
                         "each fall in one stage, or give each call a module of its own (tie their parameters if "
                         "they must share them)")


def _holds_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _listing(marks: Mapping[str, int]) -> str:
    return ", ".join(f"{p or '<root>'!r} (stage {j})" for p, j in marks.items())


# --- stages, routes and state ---------------------------------------------------------------------


def _stages_and_routes(split: fx.GraphModule, graph_module: fx.GraphModule, training: bool
                       ) -> tuple[list[fx.GraphModule], list[list[Source]], list[Source], list[object], set[Source]]:
    """The stage modules and the routing table, read from ``split_module``'s root graph; the stage
    outputs that are numbers."""
    stages: list[fx.GraphModule] = []
    inputs: list[list[Source]] = []
    source_of: dict[fx.Node, Source] = {}
    stage_index: dict[fx.Node, int] = {}
    outputs: list[Source] = []
    constants: list[object] = []
    numbers: set[Source] = set()
    placeholders = 0
    for node in split.graph.nodes:
        if node.op == "placeholder":
            source_of[node] = Source(INPUT, placeholders)
            placeholders += 1
        elif node.op == "call_module":
            sub = split.get_submodule(str(node.target))
            assert isinstance(sub, fx.GraphModule)
            numbers.update(Source(len(stages), k) for k in _number_outputs(sub))
            stage, kept = _stage_module(sub, node.args, graph_module, len(stages))
            stage.train(training)
            stage_index[node] = len(stages)
            inputs.append([source_of[a] for a in kept])
            stages.append(stage)
        elif node.op == "call_function" and node.target is operator.getitem:
            producer, k = node.args
            assert isinstance(producer, fx.Node) and isinstance(k, int)
            source_of[node] = Source(stage_index[producer], k)
        elif node.op == "output":
            result = node.args[0]
            for value in (result if isinstance(result, (tuple, list)) else [result]):
                if isinstance(value, fx.Node):
                    if value not in source_of:
                        raise ValueError(f"the model returns {value.target!r}, a parameter or buffer itself: return "
                                         "values computed from it (a stage output), or return it outside the pipe")
                    outputs.append(source_of[value])
                else:
                    outputs.append(Source(CONSTANT, len(constants)))
                    constants.append(value)
    return stages, inputs, outputs, constants, numbers


def _number_outputs(sub: fx.GraphModule) -> list[int]:
    """The positions of a partition's outputs that export traced as numbers (``SymInt``), read before
    the graph's metadata is dropped."""
    (result,) = [n.args[0] for n in sub.graph.nodes if n.op == "output"]
    values = result if isinstance(result, (tuple, list)) else [result]
    return [k for k, v in enumerate(values)
            if isinstance(v, fx.Node) and isinstance(v.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool,
                                                                          int, float, bool))]


def _stage_module(sub: torch.nn.Module, args: Iterable[object], graph_module: fx.GraphModule,
                  j: int) -> tuple[fx.GraphModule, list[fx.Node]]:
    """One partition as a stage: the parameters and buffers ``split_module`` passes in as arguments
    become attributes again, under the model's names; graph metadata (fake tensors) is dropped so that
    the stage pickles. Returns the stage and the root-graph values it takes."""
    assert isinstance(sub, fx.GraphModule)
    graph = sub.graph
    kept: list[fx.Node] = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for placeholder, arg in zip(placeholders, args):
        assert isinstance(arg, fx.Node)
        if arg.op == "get_attr":
            with graph.inserting_before(placeholder):
                attribute = graph.create_node("get_attr", str(arg.target))  # not get_attr(): sub lacks it
            placeholder.replace_all_uses_with(attribute)
            graph.erase_node(placeholder)
        else:
            kept.append(arg)
    attributes: dict[str, Any] = {}
    for node in graph.nodes:
        node.meta = {}
        if node.op in ("get_attr", "call_module"):
            target = str(node.target)
            attributes[target] = _fetch(sub, target) if _has(sub, target) else _fetch(graph_module, target)
    stage = fx.GraphModule(attributes, graph, class_name=f"Stage{j}")
    for part in stage.modules():
        if isinstance(part, fx.GraphModule):
            _call_regions_by_name(part)
    return stage, kept


def _higher_order(name: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``torch.ops.higher_order.<name>``: a region export keeps whole (``torch.no_grad()`` and
    ``torch.autocast`` blocks, ``torch.cond``), as stages call it."""
    return getattr(torch.ops.higher_order, name)(*args, **kwargs)


class _StageTracer(fx.Tracer):
    """The tracer fx runs on a stage's code to rebuild it from a pickle: it records ``_higher_order``
    as one call. The default tracer would run the region's body outside its ``no_grad``/``autocast``
    context and record only the body (silently wrong gradients and dtypes), or fail on ``torch.cond``."""

    def __init__(self) -> None:
        super().__init__(autowrap_functions=(_higher_order,))


def _call_regions_by_name(module: fx.GraphModule) -> None:
    """Call higher-order ops through ``_higher_order``, so that the module survives fx's pickling."""
    changed = False
    for node in module.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, HigherOrderOperator):
            node.args = (node.target.name(), *node.args)
            node.target = _higher_order
            changed = True
    if changed:
        module.recompile()
    module._tracer_cls = _StageTracer  # export's own tracer class cannot be built again when unpickled


def _has(module: nn.Module, target: str) -> bool:
    try:
        _fetch(module, target)
    except AttributeError:
        return False
    return True


def _fetch(module: nn.Module, target: str) -> Any:
    value: Any = module
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def _state_keys(module: nn.Module, stages: Sequence[fx.GraphModule]
                ) -> tuple[list[dict[str, tuple[str, ...]]], list[TiedParameter], list[str]]:
    """Per stage, each tensor's original state-dict keys; the parameters several stages hold; the
    original keys no stage holds. Tensors are matched by identity (the stages hold the model's own)."""
    original = module.state_dict(keep_vars=True)
    by_id: dict[int, tuple[str, ...]] = {}
    for key, tensor in original.items():
        by_id[id(tensor)] = (*by_id.get(id(tensor), ()), key)
    by_name = {key: by_id[id(tensor)] for key, tensor in original.items()}  # should export ever copy a tensor
    state_keys: list[dict[str, tuple[str, ...]]] = []
    holders: dict[int, dict[int, str]] = {}
    for j, stage in enumerate(stages):
        named = [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]
        state_keys.append({name: by_id.get(id(t)) or by_name.get(name, ()) for name, t in named})
        for name, parameter in stage.named_parameters(remove_duplicate=False):
            holders.setdefault(id(parameter), {}).setdefault(j, name)
    tied = [TiedParameter(by_id.get(i, ()), names) for i, names in holders.items() if len(names) > 1]
    held = {key for keys in state_keys for ks in keys.values() for key in ks}
    return state_keys, tied, [key for key in original if key not in held]


def _child(spec: pytree.TreeSpec, k: int) -> pytree.TreeSpec:
    child = getattr(spec, "child", None)  # torch >= 2.9; children_specs before
    return child(k) if callable(child) else spec.children_specs[k]


def _brief(spec: pytree.TreeSpec) -> str:
    return " ".join(str(spec).split())


def _same(a: object, b: object) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # values whose == is not a plain bool
        return a is b
