"""What each stage worker reads to build its stage, for ``Pipe(model, init=...)`` and models on the meta
device: planned and checked on the driver, before any worker starts, from what the storage says about
its tensors (:mod:`rrefpipe.weights`); nothing is loaded anywhere if a key is missing, unexpected or of
another shape or dtype."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import cloudpickle
from torch import nn

from ..stage_side.materialize import StageInit, meta_tensors
from ..weights import InitSpec, Reset, TensorMeta, WeightSource, open_source, reset_owners

__all__ = ["plan_init", "resolve"]

StageKeys = Mapping[str, tuple[str, ...]]  # a stage's state-dict key -> the model's keys for that tensor


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
    likes: dict[str, TensorMeta] = {}
    for stage, stage_wanted in zip(stages, wanted):
        state = stage.state_dict(keep_vars=True)
        for name, model_keys in stage_wanted.items():
            for key in model_keys:
                likes.setdefault(key, TensorMeta(tuple(state[name].shape), state[name].dtype))
    stored = resolve(source, wanted, likes, _base_prefix(model), also_expected)
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


def resolve(source: WeightSource, wanted: Sequence[StageKeys], shapes: Mapping[str, TensorMeta], base: str = "",
            also_expected: Sequence[str] = ()) -> dict[str, tuple[str, str]]:
    """Each wanted model key -> (model key, stored key), checked against the source's catalog when it has
    one: missing and unexpected keys, then shapes and dtypes (``shapes``: the model's, by model key), named
    as ``load_state_dict`` would. ``base``: a prefix the source may have left out (Hugging Face's)."""
    catalog = source.catalog()
    if catalog is None:  # read on the worker, which checks what it got
        return {key: (key, key) for key in shapes}
    stored: dict[str, tuple[str, str]] = {}
    missing: list[str] = []
    for stage_wanted in wanted:
        for model_keys in stage_wanted.values():
            found = [(k, s) for k in model_keys for s in (k, _without(k, base)) if s is not None and s in catalog]
            if found:
                for k in model_keys:
                    stored.setdefault(k, found[0])
            else:
                missing.extend(k for k in model_keys[:1] if k not in missing)
    used = {s for _, s in stored.values()}
    expected = set(also_expected) | {_without(k, base) for k in also_expected} | set(shapes)
    unexpected = [k for k in catalog if k not in used and k not in expected]
    errors = []
    if missing:
        errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
    if unexpected:
        errors.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
    for key, (_, s) in stored.items():
        errors.extend(_misfit(key, catalog[s], shapes[key]))
    if errors:
        raise ValueError(f"Error(s) in loading the stages from {source.describe()}:\n\t" + "\n\t".join(errors[:20])
                         + ("\n\t..." if len(errors) > 20 else "") + "\nNothing was loaded; check that the checkpoint "
                         "is this model's (same architecture, config and dtype)")
    return stored


def _without(key: str, base: str) -> str | None:
    return key[len(base) + 1:] if base and key.startswith(base + ".") else None


def _misfit(key: str, stored: TensorMeta, like: TensorMeta) -> list[str]:
    if tuple(stored.shape) != tuple(like.shape):
        return [f"size mismatch for {key}: copying a param with shape {list(stored.shape)} from checkpoint, the shape "
                f"in current model is {list(like.shape)}."]
    if stored.dtype != like.dtype:
        return [f"dtype mismatch for {key}: the checkpoint holds {stored.dtype}, the model {like.dtype}; cast the "
                "model (model.to(dtype)) or convert the checkpoint"]
    return []
