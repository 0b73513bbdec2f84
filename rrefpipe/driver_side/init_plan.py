"""What each stage worker reads to build its stage, for ``Pipe(model, init=...)`` and models on the meta
device: planned and checked on the driver, before any worker starts, from what the storage says about
its tensors (:mod:`rrefpipe.weights`); nothing is loaded anywhere if a key is missing, unexpected or of
another shape or dtype."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import cloudpickle
from torch import nn

from ..stage_side.materialize import StageInit, meta_tensors
from ..weights import InitSpec, Reset, StageKeys, TensorMeta, WeightSource, open_source, reset_owners, resolve

__all__ = ["plan_init"]



def plan_init(init: InitSpec, stages: Sequence[nn.Module], keys: Sequence[StageKeys], model: nn.Module, seed: int,
              also_expected: Sequence[str] = ()) -> list[StageInit | None]:
    """Per stage, how its worker builds it: None where the stage travels as it is (no ``init`` and no meta
    tensor). ``keys``: per stage, its state-dict keys to the model's; ``also_expected``: model keys no stage
    holds (a source may have them). Raises ``ValueError`` naming what cannot be initialised."""
    metas = [dict(meta_tensors(stage)) for stage in stages]
    if init is None and not any(metas):
        return [None] * len(stages)
    for j, (stage, stage_keys) in enumerate(zip(stages, keys)):
        loose = [name for name in metas[j] if name not in stage_keys or not stage_keys[name]]
        if loose:
            raise ValueError(f"stage {j}: {loose[:5]} are on the meta device and not in the model's state_dict() "
                             "(non-persistent buffers), so no checkpoint holds them: build them on a real device "
                             "(keep the model's buffers off the meta device and only its parameters on it), or give "
                             "them values in the model before the Pipe is built")
    wanted = [{name: model_keys for name, model_keys in stage_keys.items()
               if model_keys and (init is not None or name in metas[j])} for j, stage_keys in enumerate(keys)]
    if init is None:
        canonical = sorted({model_keys[0] for stage_wanted in wanted for model_keys in stage_wanted.values()})
        source: WeightSource = Reset(reset_owners(model, canonical), seed)
    else:
        source = open_source(init)
    stage_shapes = [{name: TensorMeta.of(t) for name, t in stage.state_dict(keep_vars=True).items()}
                    for stage in stages]
    ignored = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    stored = resolve(source, wanted, stage_shapes, _base_prefix(model), also_expected,
                     ignored=[p for p in ignored if isinstance(p, str)])
    plans: list[StageInit | None] = []
    for stage, stage_wanted in zip(stages, wanted):
        names = {name: _first(name_keys, stored) for name, name_keys in stage_wanted.items()}
        plans.append(StageInit(cloudpickle.dumps(stage), names, source.for_keys(s for _, s in names.values())))
    return plans


def _first(model_keys: tuple[str, ...], stored: Mapping[str, tuple[str, str]]) -> tuple[str, str]:
    return next(stored[k] for k in model_keys if k in stored)


def _base_prefix(model: nn.Module) -> str:
    prefix = getattr(model, "base_model_prefix", "")  # a Hugging Face model's (``transformer`` for GPT-2)
    return prefix if isinstance(prefix, str) else ""
