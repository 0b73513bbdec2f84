"""Stage modules that pickle as their graph, not as their code.

``fx.GraphModule`` pickles its generated Python code and, when unpickled, traces that code again. The
trace runs every operation none of whose inputs is traced for real, once, and keeps the result: in an
exported graph that is ``torch.arange(T)`` and a causal mask (which became constant tensors), and a
buffer's ``add_(1)`` (batch norm's ``num_batches_tracked``, which then counted one batch for ever). A
:class:`StageGraph` pickles its nodes (each operation, its target and arguments) and the tensors and
modules they read, and is rebuilt from them node for node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch import nn
from torch._ops import OpOverload

__all__ = ["StageGraph", "read_attributes", "fetch", "has"]


@dataclass(frozen=True)
class _Ref:
    """An argument that is the value of the node so named (not a tuple: fx maps into tuples)."""

    name: str


class _Op(NamedTuple):
    """An operator overload (``torch.ops.aten.arange.default``), which pickle cannot take itself."""

    namespace: str
    name: str
    overload: str

    def resolve(self) -> OpOverload:
        op: OpOverload = getattr(getattr(getattr(torch.ops, self.namespace), self.name), self.overload)
        return op


class _Record(NamedTuple):
    op: str
    name: str
    target: Any
    args: Any
    kwargs: Any


class StageGraph(fx.GraphModule):
    """An ``fx.GraphModule`` that pickles as its nodes and attributes (see the module's docstring).
    ``transient``: names of buffers left out of its state dict (non-persistent buffers and constant
    tensors of the model), which ``GraphModule`` would otherwise register as persistent ones."""

    def __init__(self, root: nn.Module | dict[str, Any], graph: fx.Graph, class_name: str = "GraphModule",
                 transient: frozenset[str] = frozenset()) -> None:
        super().__init__(root, graph, class_name)
        for name in transient:
            owner, _, attribute = name.rpartition(".")
            module = self.get_submodule(owner) if owner else self
            if attribute in module._buffers:
                module._non_persistent_buffers_set.add(attribute)

    def __reduce__(self) -> tuple[Any, ...]:
        attributes = read_attributes(self)
        persistent = set(self.state_dict(keep_vars=True))
        transient = frozenset(name for name, _ in self.named_buffers() if name not in persistent)
        records = [_Record(n.op, n.name, _Op(n.target.namespace, n.target._opname, n.target._overloadname)
                           if isinstance(n.target, OpOverload) else n.target,
                           fx.node.map_arg(n.args, _ref), fx.node.map_arg(n.kwargs, _ref)) for n in self.graph.nodes]
        return _rebuild, (attributes, records, type(self).__name__, transient, self.training)


def _ref(node: fx.Node) -> Any:  # (an argument of fx's own type to map_arg)
    return _Ref(node.name)


def _rebuild(attributes: dict[str, Any], records: list[_Record], class_name: str, transient: frozenset[str],
             training: bool) -> StageGraph:
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}

    def value(a: Any) -> Any:
        return nodes[a.name] if isinstance(a, _Ref) else a

    for r in records:
        target = r.target.resolve() if isinstance(r.target, _Op) else r.target
        nodes[r.name] = graph.create_node(r.op, target, fx.node.map_aggregate(r.args, value),
                                          fx.node.map_aggregate(r.kwargs, value), name=r.name)
    module = StageGraph(attributes, graph, class_name, transient)
    module.train(training)
    return module


def read_attributes(module: fx.GraphModule) -> dict[str, Any]:
    """What ``module``'s graph reads of it (tensors, region bodies), by target: all a rebuild needs."""
    return {str(n.target): fetch(module, str(n.target)) for n in module.graph.nodes
            if n.op in ("get_attr", "call_module")}


def has(module: nn.Module, target: str) -> bool:
    """Whether ``module`` has the attribute at the dotted path ``target``."""
    try:
        fetch(module, target)
    except AttributeError:
        return False
    return True


def fetch(module: nn.Module, target: str) -> Any:
    """The attribute at the dotted path ``target`` of ``module`` (a submodule, parameter, buffer or tensor)."""
    value: Any = module
    for atom in target.split("."):
        value = getattr(value, atom)
    return value
