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
* ``use_cache=False`` where ``forward`` takes a ``use_cache`` the sample leaves out (a Hugging Face
  model would return its generation cache, which export cannot capture); the model and its config are
  not changed, and ``flatten_inputs`` adds the keyword to a call without it.

Errors: a model ``torch.export`` cannot capture (branches on a tensor's value, outputs it cannot
flatten, code that depends on the batch size) raises :class:`CaptureError`, a ``ValueError`` naming the
submodule, torch's reason and what to do; split points or marks that cannot cut the model, or a
submodule with parameters called on both sides of a cut, raise ``ValueError``; a call whose inputs
differ from the sample's in structure, type or dtype raises ``TypeError``. Index names: ``j`` stage,
``k`` a flat input or output.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from torch import Tensor, nn
from torch.fx.passes.split_module import split_module

from .cuts import (check_calls_within_stages, checked_points, listing, regions_of, set_stage, stage_marks,
                   stages_at_points, stages_from_marks)
from .export import check_sample, export, training_keywords
from .model import CONSTANT, INPUT, CaptureError, CapturedModel, Source, TiedParameter
from .stages import stages_and_routes, state_keys

__all__ = ["INPUT", "CONSTANT", "CaptureError", "Source", "TiedParameter", "CapturedModel", "capture",
           "set_stage", "stage_marks", "run_stages"]


def capture(module: nn.Module, args: tuple[object, ...] | Tensor, kwargs: Mapping[str, object] | None = None, *,
            split_points: Sequence[str] | None = None) -> CapturedModel:
    """Capture ``module(*args, **kwargs)`` with ``torch.export`` and cut it into stages.

    Args:
        module: any ``nn.Module`` whose ``forward`` ``torch.export`` can capture. It is not changed; the
            stages hold its own parameter and buffer tensors (no copy).
        args: the sample call's positional arguments (a tensor alone is ``(tensor,)``). Every tensor is
            split along dim 0 into micro-batches: the sample's tensors must share a dim 0 of at least 2
            (export takes a size of 1 for a constant).
        kwargs: the sample call's keyword arguments, alike.
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
            raise ValueError(f"give split_points or set_stage marks, not both: {listing(marks)} are marked; "
                             "remove the marks with set_stage(m, None), or leave split_points out")
        points = checked_points(module, modules, split_points)
    fixed = training_keywords(module, args, kwargs)  # use_cache=False: see TRAINING_KEYWORDS
    kwargs.update(fixed)
    names, expected = check_sample(args, kwargs)
    started = time.perf_counter()
    exported = export(module, args, kwargs)
    exported_at = time.perf_counter()
    graph_module = exported.module(check_guards=False)  # guards do not pickle; flatten_inputs checks instead
    regions = regions_of(graph_module)
    stage_of = stages_from_marks(regions, marks) if marks else stages_at_points(regions, points)
    check_calls_within_stages(regions, stage_of, modules)
    split = split_module(graph_module, module, lambda node: stage_of[node], keep_original_order=True,
                         tuple_return=True)
    stages, inputs, outputs, constants, numbers = stages_and_routes(split, graph_module, module.training)
    keys, tied, unused = state_keys(module, stages)
    return CapturedModel(stages, inputs, outputs, constants, exported.call_spec.in_spec, exported.call_spec.out_spec,
                         names, keys, tied, unused, module.training, frozenset(numbers),
                         {"export": exported_at - started, "split": time.perf_counter() - exported_at}, expected,
                         fixed)


def run_stages(captured: CapturedModel, *args: object, **kwargs: object) -> object:
    """Run the stages one after another in this process, as the model would run: the reference that
    a pipeline's results are compared with. Autograd records the whole run, as the model's would."""
    flat = captured.flatten_inputs(args, kwargs)
    outputs: list[tuple[object, ...]] = []
    for stage, sources in zip(captured.stages, captured.inputs):
        outputs.append(stage(*(captured.value(s, flat, outputs) for s in sources)))
    return captured.unflatten_outputs([captured.value(s, flat, outputs) for s in captured.outputs])
