"""Where the cuts go: split points checked against the model, ``set_stage`` marks, and each operation's
stage in the exported graph (BEGINNING semantics: a stage begins at a split point's first operation)."""
from __future__ import annotations

import difflib
import operator
from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch
import torch.fx as fx
from torch import nn

from .pickling import fetch, has

__all__ = ["set_stage", "stage_marks", "checked_points", "regions_of", "stages_at_points", "stages_from_marks",
           "check_calls_within_stages", "listing"]

_MARK = "_rrefpipe_stage"  # the attribute set_stage writes on a submodule
_SIZE_READS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int,
               torch.ops.aten.sym_storage_offset.default, operator.getitem}

ModuleT = TypeVar("ModuleT", bound=nn.Module)


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



def checked_points(module: nn.Module, modules: Mapping[str, nn.Module], points: Sequence[str]) -> list[str]:
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
        if isinstance(arg, fx.Node) and arg.op == "get_attr" and has(owner, str(arg.target)):
            body = fetch(owner, str(arg.target))
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


def stages_at_points(regions: Mapping[fx.Node, list[fx.Node]], points: list[str]) -> dict[fx.Node, int]:
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


def stages_from_marks(regions: Mapping[fx.Node, list[fx.Node]], marks: Mapping[str, int]) -> dict[fx.Node, int]:
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
            raise ValueError(f"{listing({p: marks[p] for p in innermost})} run inside one region torch.export keeps "
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
        raise ValueError(f"{listing({p: marks[p] for p in never})} set by set_stage never run in forward: mark "
                         "submodules that run")
    gaps = _idle_stages(stage_of, max(stage_of.values(), default=0) + 1)
    if gaps:
        raise ValueError(f"no operation runs on stage {gaps[0]}: set_stage marks must number the stages 0, 1, ..., "
                         f"n-1 without a gap (marks: {listing(marks)})")
    return stage_of


def check_calls_within_stages(regions: Mapping[fx.Node, list[fx.Node]], stage_of: Mapping[fx.Node, int],
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


def listing(marks: Mapping[str, int]) -> str:
    return ", ".join(f"{p or '<root>'!r} (stage {j})" for p, j in marks.items())




def regions_of(graph_module: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """Every operation of the exported graph with the operations of the region it stands for."""
    return {n: _region(n, graph_module) for n in graph_module.graph.nodes
            if n.op not in ("placeholder", "get_attr", "output")}
