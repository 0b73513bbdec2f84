"""Checking a Pipe's arguments and cutting an ``nn.Sequential``, and its state dict, into stages (pure, no RPC)."""
from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .schedule import CHECKPOINT_MODES

__all__ = ["verify_module", "check_chunks", "check_checkpoint", "check_balance", "uniform_balance",
           "balance_by_placement", "split_module", "split_state_dict", "module_device", "check_unshared"]


def verify_module(module: object) -> None:
    """Pipe wraps an ``nn.Sequential`` whose children are distinct modules (an empty one too, as PyTorch's did)."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"Pipe expects an nn.Sequential module, got {type(module).__name__} (module must be "
                        "nn.Sequential to be partitioned): wrap the layers in order, Pipe(nn.Sequential(a, b, c)), or "
                        "list the children of a model whose forward runs them one after another, "
                        "Pipe(nn.Sequential(*model.children())); for any other model, name where stages begin, "
                        "Pipe(model, chunks, split_points=['blocks.2'], sample=x), or mark submodules with "
                        "rrefpipe.set_stage(model.blocks[2], 1), and torch.export cuts the model there")
    seen: dict[int, str] = {}
    for name, child in module._modules.items():  # named_children() would hide the duplicates
        if id(child) in seen:
            raise ValueError(
                f"module with duplicate children is not supported: layers {seen[id(child)]!r} and {name!r} "
                "are the same module object; use separate instances"
            )
        seen[id(child)] = name


def check_chunks(value: object, name: str = "chunks") -> int:
    """A positive whole number, as an int: ``42.0`` is 42, as PyTorch's Pipe took ``int(chunks)``; a bool,
    a string or a fraction is refused. ``name`` says which argument in the error."""
    whole = isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer()
    if not whole or value <= 0:  # type: ignore[operator]  # (a real number here)
        hint = ""
        if name == "chunks" and isinstance(value, (list, tuple)):  # torchgpipe's GPipe(module, balance, chunks)
            hint = f" (layers per stage go by keyword: Pipe(module, chunks=..., balance={list(value)!r}))"
        if name == "chunks":  # PyTorch's wording, which its tests match
            hint += " (number of chunks must be positive integer)"
        raise ValueError(f"{name} must be a positive int, got {value!r}{hint}")
    return int(value)  # type: ignore[call-overload]  # (a whole real number)


def check_checkpoint(checkpoint: object) -> str:
    """One of the modes, as a plain ``str`` (a ``str`` subclass or an object whose ``str()`` is one is
    taken, as PyTorch's Pipe took ``str(checkpoint)``)."""
    mode = checkpoint if isinstance(checkpoint, str) else str(checkpoint)
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))}, got {checkpoint!r} "
                         "(checkpoint is not one of 'always', 'except_last', or 'never')")
    return str.__str__(mode)


def check_balance(balance: Sequence[int], num_layers: int) -> list[int]:
    """A balance is a list of positive layer counts per stage summing to the number of layers."""
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence) or not balance:
        raise ValueError(f"balance must be a non-empty list of layer counts per stage, got {balance!r}")
    if any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in balance):
        raise ValueError(f"balance entries must be positive ints (no empty stages), got {list(balance)}")
    if sum(balance) != num_layers:
        raise ValueError(f"balance {list(balance)} sums to {sum(balance)} but the module has {num_layers} layers")
    return list(balance)


def uniform_balance(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts as even as possible, earlier stages taking the remainder."""
    if num_stages > num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {num_stages} stages: more stages than layers")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if j < extra else 0) for j in range(num_stages)]


def module_device(module: nn.Module, where: str) -> torch.device | None:
    """The one device holding ``module``'s parameters and buffers (None when it has none). A module whose
    parameters are all on the meta device (made on the stage's worker, ``Pipe(init=)``) may keep real
    buffers (``rrefpipe.meta_parameters()``); parameters on the meta device and elsewhere are refused,
    as PyTorch's Pipe refused them."""
    devices = {t.device for t in [*module.parameters(), *module.buffers()]}
    meta = torch.device("meta")
    if len(devices) > 1 and meta in devices and all(p.is_meta for p in module.parameters()):
        devices.discard(meta)
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"{where} has parameters on several devices ({names}); all of one stage must be on one device "
                         "(should have all parameters on a single device, please use .to() to place the module on a "
                         "single device)")
    return next(iter(devices), None)


def balance_by_placement(module: nn.Sequential) -> tuple[list[int], list[torch.device]]:
    """PyTorch-1.8 style: consecutive layers on the same device form one stage."""
    balance: list[int] = []
    devices: list[torch.device] = []
    for name, layer in module.named_children():
        device = module_device(layer, f"layer {name!r}")
        if device is None or (devices and device == devices[-1]):
            if not balance:
                balance.append(0)
                devices.append(torch.device("cpu") if device is None else device)
            balance[-1] += 1
        else:
            balance.append(1)
            devices.append(device)
    return balance, devices


def split_module(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut into stages that keep the layers' names, so state_dict keys match the whole module."""
    items = list(module.named_children())
    stages, start = [], 0
    for count in balance:
        stages.append(nn.Sequential(OrderedDict(items[start:start + count])))
        start += count
    return stages


def check_unshared(stages: Sequence[nn.Module]) -> None:
    """Stages on separate workers hold copies of their layers: a parameter shared by two stages (tied
    weights, e.g. an output head tied to the embedding) would become two parameters trained apart, so
    it is refused, as PyTorch's Pipe refused it."""
    owners: dict[int, tuple[int, str]] = {}
    for j, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            if id(param) in owners and owners[id(param)][0] != j:
                k, first = owners[id(param)]
                raise ValueError(f"parameter {name!r} of stage {j} is parameter {first!r} of stage {k}: stages on "
                                 "separate workers cannot share parameters (tied weights); put the layers that "
                                 "share it in one stage (balance=...) (module with duplicate parameters on distinct "
                                 "devices is not supported)")
            owners.setdefault(id(param), (j, name))


def split_state_dict(state_dict: Mapping[str, Any], prefix: str, owners: Sequence[Sequence[str]],
                     local_metadata: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """A state dict cut by stage, ``owners[j]`` naming the layers of stage ``j``: each stage's entries
    under ``prefix`` (keys without it), each stage's metadata, and the keys under ``prefix`` that no
    layer owns.

    The metadata carries each layer's version, by which a layer reads old checkpoints (BatchNorm before
    version 2 had no ``num_batches_tracked``). ``nn.Module`` hands it only to the module it loads: a pipe
    inside a parent gets a plain dict, and its layers load as from one (no versions)."""
    owner = {layer: j for j, layers in enumerate(owners) for layer in layers}
    parts: list[dict[str, Any]] = [{} for _ in owners]
    unexpected: list[str] = []
    for key, value in state_dict.items():
        if key.startswith(prefix):
            j = owner.get(key[len(prefix):].split(".", 1)[0])
            if j is None:
                unexpected.append(key)
            else:
                parts[j][key[len(prefix):]] = value
    metadata: list[dict[str, Any]] = [{"": local_metadata} for _ in owners]
    for key, value in getattr(state_dict, "_metadata", {}).items():
        layer = key[len(prefix):].split(".", 1)[0]
        if key.startswith(prefix) and layer in owner:
            metadata[owner[layer]][key[len(prefix):]] = value
    return parts, metadata, unexpected
