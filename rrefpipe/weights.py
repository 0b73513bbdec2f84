"""Where a stage's weights come from when the driver does not hold them: ``Pipe(model, init=...)``.

A :class:`WeightSource` is opened on the driver (:func:`open_source`), which reads only what the storage
says about its tensors (names, shapes, dtypes: a safetensors header, an index file, DCP's metadata) to
check every stage's keys before any worker starts; it then travels to each stage worker, which reads
only the tensors of its own stages (:meth:`WeightSource.read`). Names are the model's ``state_dict()``
keys. Sources:

* a safetensors file, or a directory of Hugging Face shards (``model.safetensors.index.json``);
* a file of ``torch.save(state_dict)`` or a directory with ``pytorch_model.bin`` (read memory-mapped);
* a DCP checkpoint (a directory with ``.metadata``; ``pipe.save`` writes the weights under ``model.``);
* a ``Mapping`` of tensors (each stage is sent its own);
* a callable run on each worker: given ``{key: meta tensor}`` (the shapes and dtypes wanted) it returns
  ``{key: tensor}``;
* ``None``: every meta tensor's module runs ``reset_parameters()`` on the worker (:class:`Reset`).

A Hugging Face model saved without its head's prefix (``h.0.attn...`` for ``transformer.h.0.attn...``)
loads as ``from_pretrained`` loads it: keys are looked up with the model's ``base_model_prefix`` dropped
when the checkpoint has them so.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from . import dcp_parts

__all__ = ["meta_parameters", "TensorMeta", "WeightSource", "SafetensorsFiles", "TorchFile", "DCPCheckpoint", "InMemory", "Initializer",
           "Reset", "open_source", "InitSpec", "resolve"]

StageKeys = Mapping[str, tuple[str, ...]]  # a stage's state-dict key -> the model's keys for that tensor
InitSpec = str | os.PathLike[str] | Mapping[str, Tensor] | Callable[[dict[str, Tensor]], Mapping[str, Tensor]] | None


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Build a model whose parameters are on the meta device (no memory) and whose buffers are real.

    ``with torch.device("meta")`` puts buffers there too, and a non-persistent buffer computed in
    ``__init__`` (a rotary embedding's ``inv_freq``, a causal mask) is in no checkpoint, so ``Pipe(init=)``
    could not give it a value. Here each parameter moves to the meta device as it is registered (its
    uninitialised CPU memory is never touched), while buffers are computed for real::

        with rrefpipe.meta_parameters():
            model = LlamaForCausalLM(config)
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@dataclass(frozen=True)
class TensorMeta:
    """A tensor's shape and dtype (a stored one's, as the storage's header says)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: Tensor) -> TensorMeta:
        return cls(tuple(tensor.shape), tensor.dtype)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


class WeightSource:
    """Tensors by the model's keys: ``catalog()`` on the driver, ``read()`` on a stage worker."""

    def describe(self) -> str:
        raise NotImplementedError

    def catalog(self) -> dict[str, TensorMeta] | None:
        """Every stored key with its shape and dtype, or None when only reading tells (a callable)."""
        raise NotImplementedError

    def read(self, keys: Mapping[str, str], like: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``keys`` maps a model key to the key it is stored under; ``like`` gives each model key's shape
        and dtype (meta tensors). Returns CPU tensors by model key."""
        raise NotImplementedError

    def for_keys(self, keys: Iterable[str]) -> WeightSource:
        """What one stage is sent: the whole source, or only its keys where the source is in memory."""
        return self


_F = TypeVar("_F", bound="_Files")


class _Files(WeightSource):
    """Tensors in a file, or in shards an index names (``{"weight_map": {key: file}}``; ``files``: key ->
    shard, empty for one file, ``where``)."""

    def __init__(self, files: Mapping[str, Path], where: Path) -> None:
        self.files = {key: Path(path) for key, path in files.items()}
        self.where = where

    @classmethod
    def single(cls: type[_F], path: Path) -> _F:
        return cls({}, path)

    @classmethod
    def indexed(cls: type[_F], index: Path) -> _F:
        """The shards a Hugging Face index file (``*.index.json``) names, beside it."""
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read the index {index}: {type(exc).__name__}: {exc}") from None
        return cls({key: index.parent / name for key, name in weight_map.items()}, index)

    def _paths(self) -> list[Path]:
        return sorted(set(self.files.values())) if self.files else [self.where]

    def _by_file(self, keys: Mapping[str, str]) -> dict[Path, list[str]]:
        """The model keys of ``keys`` (model key -> stored key) grouped by the file that holds them."""
        by_file: dict[Path, list[str]] = {}
        for model_key, stored in keys.items():
            by_file.setdefault(self.files.get(stored, self.where), []).append(model_key)
        return by_file

    def _unreadable(self, path: Path, exc: BaseException) -> ValueError:
        return ValueError(f"cannot read {path} (in {self.describe()}): {type(exc).__name__}: {exc}")


class SafetensorsFiles(_Files):
    """A safetensors file, or shards named by an index."""

    def describe(self) -> str:
        return f"the safetensors {'shards of ' if self.files else 'file '}{self.where}"

    def catalog(self) -> dict[str, TensorMeta]:
        safe_open = _safetensors()
        found: dict[str, TensorMeta] = {}
        for path in self._paths():
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        piece = f.get_slice(key)
                        found[key] = TensorMeta(tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(piece.get_dtype(),
                                                                                                  torch.uint8))
            except Exception as exc:  # a missing or truncated file: safetensors' own error types
                raise self._unreadable(path, exc) from None
        stray = [key for key, path in self.files.items() if key not in found]
        if stray:
            raise ValueError(f"{self.describe()} names {stray[:5]} in its index, which its files do not hold")
        return found

    def read(self, keys: Mapping[str, str], like: Mapping[str, Tensor]) -> dict[str, Tensor]:
        safe_open = _safetensors()
        out: dict[str, Tensor] = {}
        for path, wanted in self._by_file(keys).items():
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for model_key in wanted:
                        out[model_key] = f.get_tensor(keys[model_key])
            except Exception as exc:
                raise self._unreadable(path, exc) from None
        return out


def _safetensors() -> Any:
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover (a dependency of rrefpipe)
        raise ImportError("reading safetensors needs the safetensors package: pip install safetensors") from None
    return safe_open


class TorchFile(_Files):
    """A ``torch.save``'d state dict (or Hugging Face ``pytorch_model*.bin`` shards), memory-mapped: a
    worker's reads touch only its tensors' pages."""

    def describe(self) -> str:
        return f"the torch.save file{'s of ' if self.files else ' '}{self.where}"

    def _open(self, path: Path) -> Mapping[str, Any]:
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:
            raise self._unreadable(path, exc) from None
        if not isinstance(state, Mapping):
            raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict")
        return state

    def catalog(self) -> dict[str, TensorMeta]:
        found: dict[str, TensorMeta] = {}
        for path in self._paths():
            found.update((k, TensorMeta(tuple(v.shape), v.dtype)) for k, v in self._open(path).items()
                         if isinstance(v, Tensor))
        return found

    def read(self, keys: Mapping[str, str], like: Mapping[str, Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for path, wanted in self._by_file(keys).items():
            state = self._open(path)
            out.update((model_key, state[keys[model_key]]) for model_key in wanted)
        return out


class DCPCheckpoint(WeightSource):
    """A ``torch.distributed.checkpoint`` directory: keys under ``model.`` (what ``pipe.save`` and the
    usual ``dcp.save({"model": model.state_dict(), ...})`` write) or at the top."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def describe(self) -> str:
        return f"the DCP checkpoint {self.path}"

    def _tensors(self) -> tuple[str, dict[str, Any]]:
        """The prefix the model's keys are stored under (``'model.'`` or none), and its tensors' entries."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        entries = {key: m for key, m in dcp_parts.read_metadata(self.path).state_dict_metadata.items()
                   if isinstance(m, TensorStorageMetadata)}
        model = {key[len("model."):]: m for key, m in entries.items() if key.startswith("model.")}
        return ("model.", model) if model else ("", entries)

    def catalog(self) -> dict[str, TensorMeta]:
        return {key: TensorMeta(tuple(m.size), m.properties.dtype) for key, m in self._tensors()[1].items()}

    def read(self, keys: Mapping[str, str], like: Mapping[str, Tensor]) -> dict[str, Tensor]:
        prefix = self._tensors()[0]
        wanted = {prefix + stored: torch.empty(like[model_key].shape, dtype=like[model_key].dtype)
                  for model_key, stored in keys.items()}
        read = dcp_parts.read_entries(self.path, wanted)
        return {model_key: read[prefix + stored] for model_key, stored in keys.items()}


class InMemory(WeightSource):
    """A mapping of tensors on the driver; each stage is sent its own."""

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        self.tensors = tensors

    def describe(self) -> str:
        return "the state dict given as init"

    def catalog(self) -> dict[str, TensorMeta]:
        return {k: TensorMeta(tuple(v.shape), v.dtype) for k, v in self.tensors.items() if isinstance(v, Tensor)}

    def for_keys(self, keys: Iterable[str]) -> InMemory:
        return InMemory({k: self.tensors[k].detach().cpu() for k in keys if k in self.tensors})

    def read(self, keys: Mapping[str, str], like: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {model_key: self.tensors[stored] for model_key, stored in keys.items()}


class Initializer(WeightSource):
    """``init(like)`` called on the worker: ``like`` maps each key the stage needs to a meta tensor of its
    shape and dtype; it returns those keys' values."""

    def __init__(self, fn: Callable[[dict[str, Tensor]], Mapping[str, Tensor]]) -> None:
        self.fn = fn

    def describe(self) -> str:
        return f"init={getattr(self.fn, '__qualname__', type(self.fn).__name__)}"

    def catalog(self) -> None:
        return None

    def read(self, keys: Mapping[str, str], like: Mapping[str, Tensor]) -> dict[str, Tensor]:
        values = self.fn({k: torch.empty(like[k].shape, dtype=like[k].dtype, device="meta") for k in keys})
        if not isinstance(values, Mapping):
            raise TypeError(f"{self.describe()} returned a {type(values).__name__}, not a mapping of tensors")
        return {k: values[k] for k in keys if k in values}


class Reset(WeightSource):
    """``init=None``: each module that directly holds a wanted tensor is built empty on the worker's CPU
    and runs its ``reset_parameters()``, seeded from the driver's seed and the module's name (so the
    copies of a tied parameter on two workers agree, and seeded runs repeat)."""

    def __init__(self, owners: Mapping[str, nn.Module], seed: int) -> None:
        self.owners = dict(owners)  # module path -> a copy without children, on the meta device
        self.seed = seed

    def describe(self) -> str:
        return "init=None (each module's reset_parameters())"

    def catalog(self) -> None:
        return None

    def for_keys(self, keys: Iterable[str]) -> Reset:
        paths = {key.rpartition(".")[0] for key in keys}
        return Reset({p: m for p, m in self.owners.items() if p in paths}, self.seed)

    def read(self, keys: Mapping[str, str], like: Mapping[str, Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for path, owner in self.owners.items():
            built = owner.to_empty(device="cpu", recurse=False)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((self.seed + zlib.crc32(path.encode())) % 2**63)
                with torch.no_grad():
                    built.reset_parameters()  # type: ignore[operator]
            state = built.state_dict()
            out.update((key, state[key.rpartition(".")[2]]) for key in keys if key.rpartition(".")[0] == path)
        return out


def reset_owners(model: nn.Module, keys: Sequence[str]) -> dict[str, nn.Module]:
    """For ``init=None``: each module directly holding one of ``keys``, copied without its children
    (meta tensors copy for free). Raises ``ValueError`` naming a key whose module has no
    ``reset_parameters``."""
    owners: dict[str, nn.Module] = {}
    for key in keys:
        path = key.rpartition(".")[0]
        if path in owners:
            continue
        module = model.get_submodule(path)
        if not callable(getattr(module, "reset_parameters", None)):
            raise ValueError(f"init=None: {key!r} is on the meta device and its module {path or 'the model'!r} "
                             f"({type(module).__name__}) has no reset_parameters() to initialise it; give init= a "
                             "checkpoint (a safetensors file or directory, a DCP checkpoint), a state dict or a "
                             "callable, or build that module on a real device")
        shallow = module.__new__(type(module))
        shallow.__dict__ = {**module.__dict__, "_modules": {}}
        shallow._parameters = dict(module._parameters)
        shallow._buffers = dict(module._buffers)
        owners[path] = shallow
    return owners


def open_source(init: InitSpec) -> WeightSource:
    """The source ``init`` names (see the module's docstring); ``ValueError`` for a path it cannot use."""
    if isinstance(init, WeightSource):
        return init
    if isinstance(init, Mapping):
        return InMemory(init)
    if isinstance(init, (str, os.PathLike)):
        path = Path(init)
        if path.is_dir():
            for name, make in (("model.safetensors.index.json", SafetensorsFiles.indexed),
                               ("model.safetensors", SafetensorsFiles.single),
                               ("pytorch_model.bin.index.json", TorchFile.indexed),
                               ("pytorch_model.bin", TorchFile.single)):
                if (path / name).exists():
                    return make(path / name)
            if (path / ".metadata").exists():
                return DCPCheckpoint(path)
            raise ValueError(f"init={str(init)!r}: the directory holds no checkpoint rrefpipe reads (a DCP "
                             "checkpoint's .metadata, model.safetensors, model.safetensors.index.json, pytorch_model.bin)")
        if not path.exists():
            raise ValueError(f"init={str(init)!r}: no such file or directory")
        if path.name.endswith(".index.json"):
            return SafetensorsFiles.indexed(path) if ".safetensors" in path.name else TorchFile.indexed(path)
        return SafetensorsFiles.single(path) if path.suffix == ".safetensors" else TorchFile.single(path)
    if callable(init):
        return Initializer(init)
    raise TypeError(f"init= takes a path, a mapping of tensors, a callable or None, got {type(init).__name__}")


def resolve(source: WeightSource, wanted: Sequence[StageKeys], stage_shapes: Sequence[Mapping[str, TensorMeta]],
            base: str = "", also_expected: Sequence[str] = (), ignored: Iterable[str] = ()) -> dict[str, tuple[str, str]]:
    """Each wanted model key -> (model key, stored key), checked against the source's catalog when it has
    one: missing and unexpected keys, then shapes and dtypes, named as ``load_state_dict`` would.
    ``wanted``: per stage, its state-dict keys to the model's; ``stage_shapes``: per stage, each of its keys'
    shape and dtype. ``base``: a prefix the source may have left out (Hugging Face's); ``ignored``: patterns
    of stored keys that are not unexpected (Hugging Face's ``_keys_to_ignore_on_load_unexpected``, such as
    old GPT-2 checkpoints' attention masks)."""
    shapes: dict[str, TensorMeta] = {}  # the model's, by model key
    for stage_wanted, stage_shape in zip(wanted, stage_shapes):
        for name, model_keys in stage_wanted.items():
            for key in model_keys:
                shapes.setdefault(key, stage_shape[name])
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
    patterns = [re.compile(p) for p in ignored]  # a Hugging Face model's keys to ignore, as from_pretrained does
    unexpected = [k for k in catalog if k not in used and k not in expected and not any(p.search(k) for p in patterns)]
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
