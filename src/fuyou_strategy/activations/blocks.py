"""Finding a model's repeated blocks, and per-block settings (activation policy, weight tier)."""

from __future__ import annotations

import enum
from collections import Counter
from typing import Mapping, Sequence, TypeVar

import torch

from ..config import ConfigError

__all__ = ["Policy", "discover_blocks", "resolve_per_block", "resolve_policies"]


class Policy(str, enum.Enum):
    """What happens to a block's saved activations between its forward and its backward."""

    KEEP = "keep"  # saved as usual, on the device
    HOST = "host"  # copied to the host buffer pool (falls back to keep when the pool is full)
    SSD = "ssd"  # written through the host pool to the tensor store, prefetched in backward
    RECOMPUTE = "recompute"  # not saved: the block's forward runs again in backward


def discover_blocks(model: torch.nn.Module, names: Sequence[str] | str | None = None) -> list[torch.nn.Module]:
    """The model's repeated blocks, in forward order: ``names`` (a dotted path to a ``ModuleList``, or a list of
    dotted paths to modules), else the largest ``ModuleList`` of one class (GPT-2's ``transformer.h``, Llama's
    ``model.layers``; also through PEFT wrappers)."""
    if names is not None:
        paths = [names] if isinstance(names, str) else list(names)
        modules = []
        for path in paths:
            try:
                module = model.get_submodule(path)
            except AttributeError:
                raise ConfigError(f"blocks: {path!r} is not a submodule of {type(model).__name__}") from None
            modules.extend(module if isinstance(module, torch.nn.ModuleList) else [module])
        return modules
    best: list[torch.nn.Module] = []
    for _name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) >= 2:
            classes = Counter(type(child) for child in module)
            if len(classes) == 1 and len(module) > len(best):
                best = list(module)
    if not best:
        raise ConfigError(
            f"blocks: found no ModuleList of repeated blocks in {type(model).__name__}; name them, e.g. "
            "FuyouConfig(blocks='model.layers')"
        )
    return best


def resolve_policies(spec: str | Mapping[int, str], num_blocks: int) -> list[Policy]:
    """One policy per block from ``"ssd"`` (all blocks) or ``{index: policy}`` (others: keep)."""
    return resolve_per_block("activations", spec, num_blocks, Policy, Policy.KEEP)


E = TypeVar("E", bound=enum.Enum)


def resolve_per_block(field: str, spec: str | Mapping[int, str], num_blocks: int, kind: type[E], default: E) -> list[E]:
    """One ``kind`` value per block from a value for all blocks or ``{index: value}`` (others:
    ``default``); errors name ``field`` (the `FuyouConfig` field the spec came from)."""
    def parse(value: object, where: str) -> E:
        try:
            return kind(value)
        except ValueError:
            raise ConfigError(f"{field}{where}: got {value!r}; expected one of {[k.value for k in kind]}") from None

    if isinstance(spec, str):
        return [parse(spec, "")] * num_blocks
    values = [default] * num_blocks
    for index, value in spec.items():
        i = int(index)
        if not -num_blocks <= i < num_blocks:
            raise ConfigError(f"{field}[{index}]: the model has {num_blocks} blocks (0..{num_blocks - 1})")
        values[i] = parse(value, f"[{index}]")
    return values
