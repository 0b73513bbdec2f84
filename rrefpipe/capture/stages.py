"""The stage modules and the routing table, read from ``split_module``'s root graph: each partition as a
picklable ``fx.GraphModule`` holding the model's tensors under their names, and those names mapped to
the model's state-dict keys, tied parameters found."""
from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._ops import HigherOrderOperator

from .model import CONSTANT, INPUT, Source, TiedParameter
from .pickling import StageGraph, fetch, has, read_attributes

__all__ = ["stages_and_routes", "state_keys", "written_buffers", "graph_device", "retarget"]


def stages_and_routes(split: fx.GraphModule, graph_module: fx.GraphModule, training: bool
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
            attributes[target] = fetch(sub, target) if has(sub, target) else fetch(graph_module, target)
    return _stage_graph(attributes, graph, f"Stage{j}", graph_module), kept


def _stage_graph(attributes: dict[str, Any], graph: fx.Graph, name: str, owner: fx.GraphModule) -> StageGraph:
    """A :class:`StageGraph` of ``graph`` reading ``attributes``; the bodies of the regions it calls become
    StageGraphs too. Tensors ``owner`` (the exported model) leaves out of its state dict stay out."""
    persistent = set(owner.state_dict(keep_vars=True))
    for target, value in attributes.items():
        if isinstance(value, fx.GraphModule):  # a region's body (``no_grad``, ``autocast``, ``cond``)
            body = read_attributes(value)
            for node in value.graph.nodes:
                node.meta = {}
            attributes[target] = _stage_graph(body, value.graph, type(value).__name__, owner)
    transient = frozenset(t for t, v in attributes.items() if isinstance(v, torch.Tensor) and t not in persistent)
    stage = StageGraph(attributes, graph, name, transient)
    _call_regions_by_name(stage)
    return stage


def _higher_order(name: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``torch.ops.higher_order.<name>``: a region export keeps whole (``torch.no_grad()`` and
    ``torch.autocast`` blocks, ``torch.cond``), as stages call it."""
    return getattr(torch.ops.higher_order, name)(*args, **kwargs)


def _call_regions_by_name(module: fx.GraphModule) -> None:
    """Call higher-order ops through ``_higher_order`` and their name, which pickle by reference."""
    changed = False
    for node in module.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, HigherOrderOperator):
            node.args = (node.target.name(), *node.args)
            node.target = _higher_order
            changed = True
    if changed:
        module.recompile()


def state_keys(module: nn.Module, stages: Sequence[fx.GraphModule]
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


# --- what a runtime needs of a stage's graph -----------------------------------------------------

_NORMS_WITH_STATISTICS = {torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default}


def _graphs(graph: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """``graph`` and the bodies of the regions it calls (``no_grad``, ``autocast``, ``cond``)."""
    return (m for m in graph.modules() if isinstance(m, fx.GraphModule))


def written_buffers(graph: fx.GraphModule) -> set[str]:
    """The buffers the graph writes: arguments an operation mutates, and batch norm's statistics."""
    buffers = {name for name, _ in graph.named_buffers()}
    written: set[str] = set()
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        schema = getattr(node.target, "_schema", None)
        if node.target in _NORMS_WITH_STATISTICS:
            candidates = list(node.args[3:5])
        elif schema is not None and schema.is_mutable:
            candidates = [a for a, s in zip(node.args, schema.arguments) if s.alias_info is not None
                          and s.alias_info.is_write]
        else:
            continue
        written.update(str(a.target) for a in candidates if isinstance(a, fx.Node) and a.op == "get_attr"
                       and str(a.target) in buffers)
    return written


def graph_device(graph: fx.GraphModule) -> torch.device:
    tensor = next(iter([*graph.parameters(), *graph.buffers()]), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def retarget(graph: fx.GraphModule, old: torch.device, new: torch.device) -> None:
    """Rewrite the device arguments ``old`` in ``graph`` (and its regions) to ``new``."""
    def move(value: Any) -> Any:
        return new if isinstance(value, torch.device) and value == old else value

    for module in _graphs(graph):
        changed = False
        for node in module.graph.nodes:
            args, kwargs = tuple(map(move, node.args)), {k: move(v) for k, v in node.kwargs.items()}
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
        if changed:
            module.recompile()
