"""Stage side: one micro-batch's backward on a stage in two halves, as the zero-bubble schedules run it.

The first half (:func:`input_gradients`, the schedules' ``I``, the paper's B) computes the gradients of
the stage's inputs, which the previous stage waits for; the second (:meth:`WeightGradients.run`, ``W``)
computes the parameters' gradients, which nobody waits for until the optimizer step, so a schedule
can put it where the worker would otherwise idle.

Neither half repeats the other's work. The graph's nodes split in two sets: those from which an
input is reachable (the *input side*: every node the first half must run) and the others. The first
half runs the engine towards the inputs only, so a node such as a linear layer's ``AddmmBackward``
computes only its input's gradient there, and a hook on each input-side node with an edge into the
other set keeps the gradient that arrived at it (this is what the split keeps for the second half,
:attr:`WeightGradients.held_bytes`). The second half runs each of those nodes once more, asking only
for the outputs along its edges into the other set (the weight's gradient, ``mm(grad.T, input)``),
then the engine from there to the parameters, which never leads back to the input side, accumulating
into their ``.grad`` (:data:`_FLUSH_BYTES` says how often). One engine call per such node, not one for
all: started together, a node's gradient for an earlier input-side node would be computed again and
added to what that node got.

A node written in Python (a custom ``autograd.Function``) computes all its outputs whatever is asked,
so one on the border between the sets runs in both halves. The graph must be kept between them
(``keep_graph`` in the first), and a checkpointed stage must keep its recomputed activations until the
second half has run (``Recomputable(keep_unpacked=True)``): both halves read them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGradients", "input_gradients"]

# The engine call behind torch.autograd.grad and backward, without their Python check of the given
# gradients, which imports sympy once per process (0.3 s of a worker's first step, issue 48); the
# engine validates each gradient against its root as well. A private name: where a torch lacks it,
# the public calls below do the same, sympy's import included.
try:
    from torch.autograd.graph import _engine_run_backward as _engine
except ImportError:  # tested by replacing it with None
    _engine = None  # type: ignore[assignment]


def _run(outputs: Sequence[Tensor | GradientEdge], grads: Sequence[Tensor], inputs: Sequence[Tensor | GradientEdge],
         *, keep_graph: bool, accumulate: bool) -> tuple[Tensor | None, ...]:
    if _engine is not None:
        return _engine(tuple(outputs), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate)
    if accumulate:
        torch.autograd.backward(list(outputs), list(grads), retain_graph=keep_graph, inputs=list(inputs))
        return ()
    return torch.autograd.grad(list(outputs), list(inputs), list(grads), retain_graph=keep_graph, allow_unused=True)


@dataclass
class WeightGradients:
    """What the first half of a micro-batch's backward kept for the second: per border node, the
    gradient that reached it and its edges out of the input side; the roots that never reach an input,
    with their gradients; the parameters to accumulate into."""

    border: list[tuple[Node, tuple[Tensor | None, ...], list[GradientEdge]]] = field(default_factory=list)
    roots: list[tuple[GradientEdge, Tensor]] = field(default_factory=list)
    params: list[Tensor] = field(default_factory=list)

    def kept(self) -> list[Tensor]:
        """The gradients kept between the halves, each once (the activations the graph keeps for the
        second half are the forward's, counted where it saved them)."""
        grads = [g for _, gs, _ in self.border for g in gs if g is not None] + [g for _, g in self.roots]
        return list({id(g): g for g in grads}.values())

    @property
    def held_bytes(self) -> int:
        """The bytes of :meth:`kept` (storages counted once)."""
        return sum(s.nbytes() for s in {t.untyped_storage().data_ptr(): t.untyped_storage() for t in self.kept()}.values())

    def run(self) -> None:
        """Accumulate the parameters' gradients into their ``.grad`` and free the graph's rest."""
        border, self.border = self.border, []
        onward: list[tuple[GradientEdge, Tensor]] = []  # gradients past the border, not yet accumulated
        for node, arrived, edges in border:
            given = [(GradientEdge(node, k), g) for k, g in enumerate(arrived) if g is not None]
            if not given:
                continue
            got = _run([e for e, _ in given], [g for _, g in given], edges, keep_graph=False, accumulate=False)
            onward += [(e, g) for e, g in zip(edges, got) if g is not None]
            del given, got
            if sum(g.nbytes for _, g in onward) >= _FLUSH_BYTES:
                # Kept: the nodes past the border may be shared (a weight used twice, which accumulates
                # from each call); the last call below frees them.
                self._accumulate(onward, keep_graph=True)
                onward = []
        roots, self.roots = self.roots, []
        self._accumulate(onward + roots, keep_graph=False)
        self.params = []

    def _accumulate(self, starts: list[tuple[GradientEdge, Tensor]], keep_graph: bool) -> None:
        if starts and self.params:
            _run([e for e, _ in starts], [g for _, g in starts], self.params, keep_graph=keep_graph, accumulate=True)


#: Weight gradients computed past the border are accumulated once they reach this size, and not all of a
#: stage's at the end: a weight's gradient is the size of the weight, and holding all of an MLP stage's
#: (4 x 16 MiB) took 25% longer (fresh pages for each); one call for many small ones saves the engine's
#: overhead per call (30 us).
_FLUSH_BYTES = 4 << 20


def input_gradients(roots: Sequence[Tensor], grads: Sequence[Tensor], inputs: Sequence[Tensor],
                    params: Sequence[Tensor]) -> tuple[list[Tensor | None], WeightGradients]:
    """Backward from ``roots`` (given ``grads``) to ``inputs`` only: their gradients (None where none
    reached one), and what :meth:`WeightGradients.run` needs to give ``params`` theirs later. The caller
    drops ``roots`` (the graph above the border) before it counts :meth:`WeightGradients.kept` as memory
    kept for backward (``rrefpipe.memory.count_kept``): never both at once."""
    params = [p for p in params if p.requires_grad]
    param_nodes = {get_gradient_edge(p).node for p in params}
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    root_edges = [get_gradient_edge(r) for r in roots]
    input_side, border = _sides([e.node for e in root_edges], input_nodes, param_nodes)
    later = WeightGradients(params=list(params))
    for edge, g in zip(root_edges, grads):
        if edge.node not in input_side:
            later.roots.append((edge, g))
    arrived: dict[Node, tuple[Tensor | None, ...]] = {}
    hooks = [node.register_prehook(_keeper(arrived, node)) for node in border]
    try:
        into = [(e, g) for e, g in zip(root_edges, grads) if e.node in input_side]
        got: Sequence[Tensor | None] = (
            _run([e for e, _ in into], [g for _, g in into], inputs, keep_graph=True, accumulate=False)
            if into and inputs else [None] * len(inputs))
    finally:
        for hook in hooks:
            hook.remove()
    later.border = [(node, arrived[node], edges) for node, edges in border.items() if node in arrived]
    return list(got), later


def _keeper(arrived: dict[Node, tuple[Tensor | None, ...]], node: Node):  # type: ignore[no-untyped-def]
    def keep(grad_outputs: tuple[Tensor | None, ...]) -> None:
        arrived[node] = tuple(grad_outputs)
    return keep


def _sides(roots: Sequence[Node], input_nodes: set[Node], param_nodes: set[Node]
           ) -> tuple[set[Node], dict[Node, list[GradientEdge]]]:
    """The nodes from which an input is reachable, and those of them with edges to nodes from which
    only parameters are: each with those edges."""
    children: dict[Node, list[tuple[Node, int]]] = {}
    order: list[Node] = []  # children before parents
    stack: list[tuple[Node, bool]] = [(n, False) for n in roots if n is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in children:
            continue
        children[node] = [(c, k) for c, k in node.next_functions if c is not None]
        stack.append((node, True))
        stack.extend((c, False) for c, _ in children[node] if c not in children)
    to_input: dict[Node, bool] = {}
    to_param: dict[Node, bool] = {}
    for node in order:  # each node once, after its children
        kids = children[node]
        to_input[node] = node in input_nodes or any(to_input.get(c, False) for c, _ in kids)
        to_param[node] = node in param_nodes or any(to_param.get(c, False) for c, _ in kids)
    input_side = {n for n, yes in to_input.items() if yes}
    border: dict[Node, list[GradientEdge]] = {}
    for node in input_side:
        edges = {(c, k) for c, k in children[node] if c not in input_side and to_param.get(c, False)}
        if edges:
            border[node] = [GradientEdge(c, k) for c, k in edges]
    return input_side, border
