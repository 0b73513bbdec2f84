"""A captured model (:mod:`rrefpipe.capture`) as pipeline stages: ``Pipe(model, split_points=[...],
sample=x)`` runs any ``nn.Module`` through the machinery built for ``nn.Sequential``.

Each captured stage becomes one layer, a :class:`CapturedStage`, of an ``nn.Sequential`` with one layer
per stage, so every schedule, checkpoint mode, the skip router and the training loop run it unchanged:

* a value stage ``j + 1`` takes from stage ``j`` travels in the activation between them; one that a
  later stage takes (a long skip, or a caller's input needed past stage 0) is a skip stashed where it
  is made and popped where it is used, sent straight there, once per stage that uses it
  (:func:`plan_routes`, pure);
* numbers that cross a cut (sizes that depend on the micro-batch) travel as 0-dim tensors;
* ``torch.export`` writes the training mode into the graph, so each stage holds a train-mode and an
  eval-mode graph over the same tensors and runs the one its ``training`` flag picks;
* a recomputation (checkpointing) puts back the buffers the graph writes (batch norm's running
  statistics), so they are updated once per micro-batch, as in the plain model;
* devices written into the graph (``torch.arange(T, device=x.device)``) follow the stage's device.

:class:`CapturedPipeModel` is what the driver keeps: the inputs' check, the output's structure, the
tied parameters (each stage that uses one holds a copy; the driver sums their gradients) and the
model's state-dict keys.
"""
from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from .capture import CONSTANT, INPUT, CapturedModel, Source, TiedParameter, capture, stage_marks
from .capture.model import TensorSpec, spec_children
from .capture.stages import graph_device, retarget, written_buffers
from .stage_side.checkpoint import is_recomputing
from .skip.namespace import Namespace
from .skip.skippable import Skippable, pop, stash

__all__ = ["Ref", "StageRoutes", "plan_routes", "CapturedStage", "Outputs", "CapturedPipeModel", "wants_capture",
           "captured_stages", "counted_elsewhere", "retarget"]

class Ref(NamedTuple):
    """A value as a stage sees it: ``('input', k)`` the pipe's tensor input ``k`` (stage 0), ``('value', p)``
    position ``p`` of the activation received, ``('skip', name)`` a popped skip, ``('output', k)`` the
    stage graph's output ``k``, ``('constant', v)`` a value the capture fixed."""

    kind: str
    what: Any


@dataclass
class StageRoutes:
    """Where one stage's graph arguments come from and where its values go."""

    args: list[Ref] = field(default_factory=list)
    numbers: set[int] = field(default_factory=set)  # arguments that arrive as 0-dim tensors, taken as numbers
    sends: list[Ref] = field(default_factory=list)  # the activation for the next stage; the last: the model's output
    stashes: list[tuple[Ref, str]] = field(default_factory=list)
    pops: list[str] = field(default_factory=list)


def plan_routes(captured: CapturedModel) -> list[StageRoutes]:
    """Each stage's routes: a value goes in the activation to the next stage when that stage uses it, as
    a skip (named ``'<source> > stage <j>'``) to each later stage that does; the model's outputs made
    before the last stage reach it as skips too. A caller's input counts as made by stage 0."""
    n = captured.num_stages
    tensors = [k for k, e in enumerate(captured._expected) if not _is_constant_input(e)]
    routes = [StageRoutes() for _ in range(n)]

    def made(source: Source) -> Ref:
        if source.stage == INPUT:
            return Ref("input", tensors.index(source.position))
        return Ref("output", source.position)

    def reach(source: Source, j: int) -> Ref:
        """``source`` as stage ``j`` gets it, routing it there."""
        if source.stage == CONSTANT:
            return Ref("constant", captured.output_constants[source.position])
        if source.stage == INPUT and _is_constant_input(captured._expected[source.position]):
            return Ref("constant", captured._expected[source.position])
        maker = max(source.stage, 0)
        if maker == j:
            return made(source)
        if maker == j - 1:
            sends = routes[maker].sends
            if made(source) not in sends:
                sends.append(made(source))
            return Ref("value", sends.index(made(source)))
        name = f"{source} > stage {j}"
        if name not in routes[j].pops:
            routes[maker].stashes.append((made(source), name))
            routes[j].pops.append(name)
        return Ref("skip", name)

    for j, sources in enumerate(captured.inputs):
        for p, source in enumerate(sources):
            routes[j].args.append(reach(source, j))
            if source in captured.numbers:
                routes[j].numbers.add(p)
    last = routes[n - 1]
    for source in captured.outputs:
        if source in captured.numbers:
            raise ValueError(f"the model returns a number computed in forward ({source}, a size): a pipeline's "
                             "outputs are tensors split along dim 0; return it as a tensor, or compute it outside")
        if source.stage != CONSTANT:
            last.sends.append(reach(source, n - 1))
    return routes


def _is_constant_input(expected: object) -> bool:
    return not isinstance(expected, TensorSpec)  # capture fixed a non-tensor input's value


class CapturedStage(Skippable):
    """One captured stage as a layer: pops its skips, runs the graph of its mode, stashes and returns
    what later stages take. Its parameters and buffers are those of the train-mode graph, ``graph``
    (the eval-mode one shares them and is not registered, so each is listed once)."""

    graph: fx.GraphModule

    def __init__(self, index: int, train_graph: fx.GraphModule, eval_graph: fx.GraphModule, routes: StageRoutes,
                 namespace: Namespace, single_output: bool, counted_elsewhere: Sequence[str] = (),
                 parts: Sequence[str] = ()) -> None:
        super().__init__()
        self.index = index
        self.description = f"CapturedStage({', '.join(parts)})"  # what ``pipe.stages`` lists
        self.graph = train_graph
        self.__dict__["_eval_graph"] = eval_graph
        self.routes = routes
        self.single_output = single_output  # a lone tensor goes on as itself, not as a 1-tuple
        self.counted_elsewhere = frozenset(counted_elsewhere)  # tied copies another stage counts in norms
        self.stashable_names = frozenset(name for _, name in routes.stashes)  # type: ignore[misc]
        self.poppable_names = frozenset(routes.pops)  # type: ignore[misc]
        self.isolate(namespace)
        self._written = sorted(written_buffers(train_graph))
        self._device = graph_device(train_graph)

    @property
    def eval_graph(self) -> fx.GraphModule:
        graph: fx.GraphModule = self.__dict__["_eval_graph"]
        return graph

    def forward(self, *values: Any) -> Any:
        if len(values) == 1 and isinstance(values[0], tuple):  # a tuple reaches a layer whole (Pipe's call rule)
            values = values[0]
        return self._drive(self._run(values))

    def _run(self, values: Sequence[Any]) -> Generator[Any, Any, Any]:
        routes = self.routes
        popped: dict[str, Any] = {}
        for name in routes.pops:
            popped[name] = yield pop(name)
        args = []
        for p, ref in enumerate(routes.args):
            value = _resolve(ref, values, popped, ())
            args.append(value.item() if p in routes.numbers else value)
        self._follow_device(args)
        graph = self.graph if self.training else self.eval_graph
        with self._buffers_kept() if self.training and is_recomputing() else contextlib.nullcontext():
            outputs = graph(*args)
        for ref, name in routes.stashes:
            yield stash(name, _as_tensor(_resolve(ref, values, popped, outputs), self._device))
        sent = tuple(_as_tensor(_resolve(ref, values, popped, outputs), self._device) for ref in routes.sends)
        if not sent:  # the next stage takes nothing from this one: it still follows it
            return torch.zeros((), device=self._device)
        return sent[0] if self.single_output and len(sent) == 1 else sent

    @contextlib.contextmanager
    def _buffers_kept(self) -> Iterator[None]:
        """A recomputation must not update the running statistics a first forward updated already."""
        kept = [(buffer, buffer.clone()) for buffer in map(self.graph.get_buffer, self._written)]
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in kept:
                    buffer.copy_(value)

    def _follow_device(self, args: Sequence[Any]) -> None:
        """Devices export wrote into the graphs become the stage's, the first time it runs elsewhere."""
        here = next((a.device for a in args if isinstance(a, Tensor)), None)
        if here is None:
            here = next((t.device for t in self.graph.parameters()), None)
        if here is not None and here != self._device:
            for graph in (self.graph, self.eval_graph):
                retarget(graph, self._device, here)
            self._device = here

    def _apply(self, fn: Any, recurse: bool = True) -> CapturedStage:
        """``.to()`` may replace parameters and buffers with new tensors (a move to another kind of device,
        any buffer): the eval graph takes the train graph's again."""
        super()._apply(fn, recurse)
        for kind, named in (("_parameters", self.graph.named_parameters), ("_buffers", self.graph.named_buffers)):
            for name, tensor in named(remove_duplicate=False):
                owner, _, attribute = name.rpartition(".")
                slots = getattr(self.eval_graph.get_submodule(owner) if owner else self.eval_graph, kind)
                if attribute in slots:
                    slots[attribute] = tensor
        return self

    def extra_repr(self) -> str:
        return f"stage {self.index}: {len(self.routes.args)} inputs, {len(self.routes.sends)} sent on"


def _resolve(ref: Ref, values: Sequence[Any], popped: Mapping[str, Any], outputs: Sequence[Any]) -> Any:
    if ref.kind in ("input", "value"):
        return values[ref.what]
    if ref.kind == "skip":
        return popped[ref.what]
    if ref.kind == "output":
        return outputs[ref.what]
    return ref.what


def _as_tensor(value: Any, device: torch.device) -> Tensor:
    return value if isinstance(value, Tensor) else torch.tensor(value, device=device)


class Outputs:
    """The model's output rebuilt from the last stage's tensors (tuple, dict, ModelOutput, constants put
    back); picklable, so that a loss function on the last stage gets the output as the model gives it."""

    def __init__(self, captured: CapturedModel) -> None:
        self.spec = captured.out_spec
        self.slots: list[tuple[bool, Any]] = []  # (from the stage, index) or (constant, value)
        k = 0
        for source in captured.outputs:
            if source.stage == CONSTANT:
                self.slots.append((False, captured.output_constants[source.position]))
            else:
                self.slots.append((True, k))
                k += 1
        leaves_only = all(from_stage for from_stage, _ in self.slots)
        self.single = self.spec.is_leaf() and leaves_only
        tuple_of_leaves = self.spec.type is tuple and all(c.is_leaf() for c in spec_children(self.spec))
        self.plain = self.single or (tuple_of_leaves and leaves_only and k > 0)  # the stage's value is the output

    def __getstate__(self) -> dict[str, Any]:
        """The structure travels as a skeleton (the output with its leaves numbered): torch's ``TreeSpec``
        warns when it is unpickled (a FutureWarning of its own making, on every ``train_step``)."""
        state = dict(self.__dict__)
        state["spec"] = pytree.tree_unflatten(list(range(self.spec.num_leaves)), self.spec)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["spec"] = pytree.tree_flatten(state["spec"])[1]
        self.__dict__.update(state)

    def rebuild(self, value: Any) -> Any:
        if self.plain:
            return value
        tensors = (value,) if isinstance(value, Tensor) else tuple(value)
        return pytree.tree_unflatten([tensors[v] if from_stage else v for from_stage, v in self.slots], self.spec)


class StructuredLoss:
    """``loss_fn(model_output, target)`` given the last stage's tensors: the output rebuilt first."""

    def __init__(self, loss_fn: Any, outputs: Outputs) -> None:
        self.loss_fn, self.outputs = loss_fn, outputs

    def __call__(self, value: Any, target: Any) -> Any:
        return self.loss_fn(self.outputs.rebuild(value), target)


@dataclass
class CapturedPipeModel:
    """What a pipe of a captured model keeps on the driver: the layers to place (one per stage, dropped
    once placed), the inputs' check, the output's structure, the tied parameters and the state keys."""

    layers: nn.Sequential | None
    captured: CapturedModel
    outputs: Outputs
    unused: dict[str, Tensor]
    key_order: list[str] = field(default_factory=list)  # the model's state_dict order

    @property
    def tied(self) -> list[TiedParameter]:
        return self.captured.tied

    @property
    def state_keys(self) -> list[dict[str, tuple[str, ...]]]:
        return self.captured.state_keys

    @classmethod
    def build(cls, module: nn.Module, sample: Any, split_points: Sequence[str] | None) -> CapturedPipeModel:
        """Capture ``module`` in both training modes on ``sample`` and make its stages' layers."""
        if sample is None:
            raise ValueError(f"Pipe of a {type(module).__name__} cut at split_points or set_stage marks needs "
                             "sample=: an example input (a tensor, or a tuple of the forward's positional "
                             "arguments), which torch.export runs the model on to capture it")
        args = sample if isinstance(sample, tuple) else (sample,)
        mode = module.training
        try:
            module.train(True)
            train = capture(module, args, split_points=split_points)
            module.train(False)
            evaluate = capture(module, args, split_points=split_points)
        finally:
            module.train(mode)
        _check_same_routes(train, evaluate)
        routes = plan_routes(train)
        namespace = Namespace()
        outputs = Outputs(train)
        state = module.state_dict()
        layers = nn.Sequential(*(
            CapturedStage(j, train.stages[j], evaluate.stages[j], routes[j], namespace,
                          single_output=j < train.num_stages - 1 or outputs.single,
                          counted_elsewhere=[t.names[j] for t in train.tied if j in t.names and j != min(t.names)],
                          parts=_parts(train.state_keys[j], list(state)))
            for j in range(train.num_stages)))
        unused = {key: state[key].detach().clone() for key in train.unused_keys}
        result = cls(layers, train, outputs, unused, list(state))
        train.stages = []  # the driver keeps no stage: the layers go to the workers
        return result

    def inputs(self, args: Sequence[Any]) -> Any:
        """The tensors of a call ``pipe(*args)``, checked against the capture: what stage 0 receives."""
        flat = self.captured.flatten_inputs(tuple(args), {})
        tensors = tuple(v for v in flat if isinstance(v, Tensor))
        return tensors[0] if len(tensors) == 1 else tensors

    # -- state dict: the model's keys --------------------------------------------------------------
    def stage_keys(self) -> list[dict[str, tuple[str, ...]]]:
        """Per stage, each key of its state dict (``'<j>.graph.<name>'``) to the model's keys for it."""
        return [{f"{j}.graph.{name}": keys for name, keys in names.items()} for j, names in enumerate(self.state_keys)]

    def model_state(self, stage_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The pipe's state dict under the model's keys from the stages' (``'<j>.graph.<name>'``); a tied
        parameter once, from the first stage that holds it, under each of its keys."""
        state: dict[str, Tensor] = {}
        for j, names in enumerate(self.state_keys):
            for name, keys in names.items():
                value = stage_state.get(f"{j}.graph.{name}")
                for key in keys:
                    if value is not None and key not in state:
                        state[key] = value
        state.update(self.unused)
        order = {key: k for k, key in enumerate(self.key_order)}
        return dict(sorted(state.items(), key=lambda item: order.get(item[0], len(order))))

    def stage_state(self, state: Mapping[str, Any], prefix: str) -> tuple[dict[str, Any], list[str], list[str]]:
        """The stages' state dict (``'<j>.graph.<name>'`` keys) from one under the model's keys, every copy
        of a tied parameter included; the model keys missing and those unexpected (``prefix`` kept)."""
        parts: dict[str, Any] = {}
        expected: set[str] = set(self.unused)
        for j, names in enumerate(self.state_keys):
            for name, keys in names.items():
                expected.update(keys)
                found = next((prefix + key for key in keys if prefix + key in state), None)
                if found is not None:
                    parts[f"{j}.graph.{name}"] = state[found]
        for key in self.unused:
            if prefix + key in state:
                self.unused[key] = state[prefix + key].detach().clone()
        ours = [key for key in state if key.startswith(prefix)]
        missing = [prefix + key for key in sorted(expected) if prefix + key not in state]
        unexpected = [key for key in ours if key[len(prefix):] not in expected]
        return parts, missing, unexpected


def _parts(names: Mapping[str, tuple[str, ...]], keys: Sequence[str]) -> list[str]:
    """The model's submodules a stage holds whole, outermost first (``['tok', 'pos', 'blocks.0']``): for each
    of its keys, the shortest module path all of whose keys the stage holds."""
    held = {key for ks in names.values() for key in ks}
    parts: list[str] = []
    for key in keys:
        if key not in held:
            continue
        atoms = key.split(".")[:-1]
        for depth in range(1, len(atoms) + 1):
            prefix = ".".join(atoms[:depth]) + "."
            if all(k in held for k in keys if k.startswith(prefix)):
                if prefix[:-1] not in parts:
                    parts.append(prefix[:-1])
                break
    return parts


def _check_same_routes(train: CapturedModel, evaluate: CapturedModel) -> None:
    """Both modes' graphs must take and give the same values at every cut: one routing serves both. The
    eval graph may use fewer tensors (batch norm counts its batches in training only)."""
    same = (train.inputs == evaluate.inputs and train.outputs == evaluate.outputs
            and train.numbers == evaluate.numbers
            and all(set(e) <= set(t) for t, e in zip(train.state_keys, evaluate.state_keys)))
    if not same:
        where = next((j for j, (a, b) in enumerate(zip(train.inputs, evaluate.inputs)) if a != b), None)
        raise ValueError("the model's train-mode and eval-mode graphs differ in what crosses the cuts"
                         + (f" (stage {where} takes {train.inputs[where]} in training, {evaluate.inputs[where]} in "
                            "eval)" if where is not None else "") + ": forward branches on self.training across a "
                         "cut; move the cut, or build the stages with Pipe.from_factories")


def wants_capture(module: nn.Module, split_points: Sequence[str] | None) -> bool:
    """Whether ``Pipe`` captures ``module``: split points given, or ``set_stage`` marks on it. (Any other
    module must be an ``nn.Sequential``, which ``Pipe`` cuts between its layers.)"""
    return split_points is not None or (isinstance(module, nn.Module) and bool(stage_marks(module)))


def captured_stages(module: nn.Module) -> list[CapturedStage]:
    return [m for m in module.modules() if isinstance(m, CapturedStage)]


def counted_elsewhere(module: nn.Module) -> set[Tensor]:
    """The tied copies in ``module`` whose gradient norm another stage counts (each tied parameter
    counts once in ``clip_grad_norm_``)."""
    return {stage.graph.get_parameter(name) for stage in captured_stages(module) for name in stage.counted_elsewhere}
