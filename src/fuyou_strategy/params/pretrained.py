"""`SafetensorsInit`: a model built on the meta device takes its weights from a local checkpoint, module by module.

::

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder))   # shapes only
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters()), config=FuyouConfig(weights="ssd"),
                         init_weights=SafetensorsInit(model, folder))

A shard is memory-mapped (``safe_open``) for one module's tensors and closed again: a mapping's pages count
in RSS until it is closed, and ``save_pretrained`` writes up to 50 GB per shard.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from safetensors import safe_open

from .materialize import Init

__all__ = ["SafetensorsInit"]

log = logging.getLogger(__name__)

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"  # what save_pretrained writes
_SHOWN = 5  # names listed in a message; the rest are counted


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


class SafetensorsInit:
    """Initialise the modules of a model built on the meta device from a local safetensors checkpoint.

    As ``init_weights`` (`FuyouEngine`, `WeightStreamer`, `materialize`), called on a module as it gets memory,
    it copies the module's own parameters and persistent buffers from the checkpoint, cast to their dtype; no
    file stays open between calls. Files, keys and shapes are checked at construction.

    Args:
        model: the model on the meta device, before any wrapper renames its modules (build this before
            ``peft.get_peft_model``). Its names are the checkpoint's keys, with or without its
            ``base_model_prefix``; tied parameters are read under whichever name the checkpoint has.
        folder: what ``save_pretrained`` wrote: ``model.safetensors``, or the index and its shards.
        fallback: called on the module first, for what the checkpoint lacks (missing parameters, modules added
            later such as LoRA adapters); ``None``: a missing parameter is an error.

    Non-persistent buffers (a rotary ``inv_freq``) are recomputed by the model's ``_init_weights``, else by
    ``fallback``. ``missing_keys`` (with a ``fallback``) and ``unexpected_keys`` (less the model's
    ``_keys_to_ignore_on_load_unexpected``) are logged as warnings when not empty.

    Raises `FileNotFoundError` when the folder, its checkpoint or a shard is missing, and `ValueError` when a
    key is missing (without ``fallback``) or a shape differs from the model's.
    """

    def __init__(self, model: torch.nn.Module, folder: str | Path, *, fallback: Init | None = None) -> None:
        self.folder = folder = Path(folder)
        self.fallback = fallback
        self._model = model  # to name a module in an error
        # Non-persistent buffers are computed, never saved: by the model's own init where it has one.
        self._buffer_init: Init | None = getattr(model, "_init_weights", None) or fallback
        self._where = self._weight_map(folder)  # key -> shard file name
        self._plan_modules(model)
        if self.missing_keys:
            log.warning("%s: not in the checkpoint, initialised by the fallback: %s", folder,
                        _listed(self.missing_keys))
        if self.unexpected_keys:
            log.warning("%s: checkpoint keys the model does not have, not loaded: %s", folder,
                        _listed(self.unexpected_keys))

    def _open(self, shard: str) -> Any:
        return safe_open(str(self.folder / shard), framework="pt")

    def _weight_map(self, folder: Path) -> dict[str, str]:
        """The index's ``weight_map`` (key -> shard), or a single ``model.safetensors``'s keys."""
        if not folder.is_dir():
            raise FileNotFoundError(f"SafetensorsInit: the checkpoint folder {folder} does not exist; pass the folder "
                                    "model.save_pretrained() wrote")
        if (folder / INDEX).is_file():
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
            for shard in sorted(set(weight_map.values())):
                if not (folder / shard).is_file():
                    raise FileNotFoundError(f"SafetensorsInit: {folder / INDEX} names the shard {shard}, which is "
                                            f"not in {folder}; copy the whole checkpoint folder")
            return weight_map
        if (folder / SINGLE).is_file():
            with self._open(SINGLE) as handle:  # its keys are in its header
                return dict.fromkeys(handle.keys(), SINGLE)
        raise FileNotFoundError(f"SafetensorsInit: {folder} holds neither {SINGLE} nor {INDEX}; save the model with "
                                "model.save_pretrained(folder) (safetensors, its default)")

    def _plan_modules(self, model: torch.nn.Module) -> None:
        """For each module, the checkpoint key of each of its own parameters and persistent buffers."""
        tensors: dict[int, torch.Tensor] = {}
        aliases: dict[int, list[str]] = {}  # id(tensor) -> every qualified name it has (tied weights: several)
        owned: list[tuple[torch.nn.Module, str, int]] = []
        for prefix, module in model.named_modules(remove_duplicate=False):
            own = [*module.named_parameters(recurse=False),
                   *((n, b) for n, b in module.named_buffers(recurse=False)
                     if n not in module._non_persistent_buffers_set)]
            for name, tensor in own:
                tensors[id(tensor)] = tensor
                aliases.setdefault(id(tensor), []).append(f"{prefix}.{name}" if prefix else name)
                owned.append((module, name, id(tensor)))
        to_key = self._key_convention(model, [n for names in aliases.values() for n in names])
        keys = {tid: next((to_key(n) for n in names if to_key(n) in self._where), None)
                for tid, names in aliases.items()}

        self.missing_keys = [names[0] for tid, names in aliases.items() if keys[tid] is None]
        if self.missing_keys and self.fallback is None:
            raise ValueError(f"SafetensorsInit: {_listed(self.missing_keys)} not in the checkpoint {self.folder}; "
                             "check that the model was built from the checkpoint's config, or pass fallback= "
                             "(e.g. model._init_weights) to initialise them")
        for shard, shard_keys in self._by_shard(keys.items()).items():
            with self._open(shard) as handle:  # shapes are in the header: nothing is read
                for tid, key in shard_keys:
                    shape = tuple(handle.get_slice(key).get_shape())
                    if shape != tuple(tensors[tid].shape):
                        raise ValueError(
                            f"SafetensorsInit: {key} in {self.folder / shard} has shape {shape}, the model's "
                            f"{aliases[tid][0]} {tuple(tensors[tid].shape)}; build the model from the checkpoint's "
                            "config.json")
        ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
        used = set(keys.values())
        self.unexpected_keys = sorted(k for k in self._where if k not in used and not any(p.search(k) for p in ignore))
        # Keyed by the module itself (not its id): a module created later is never mistaken for one planned here.
        self._plan: dict[torch.nn.Module, dict[str, str | None]] = {}
        for module, name, tid in owned:
            self._plan.setdefault(module, {})[name] = keys[tid]

    def _by_shard(self, items: Iterable[tuple[Any, str | None]]) -> dict[str, list[tuple[Any, str]]]:
        """``(x, key)`` pairs grouped by the shard that holds the key; ``None`` keys left out."""
        shards: dict[str, list[tuple[Any, str]]] = {}
        for x, key in items:
            if key is not None:
                shards.setdefault(self._where[key], []).append((x, key))
        return shards

    def _key_convention(self, model: torch.nn.Module, names: list[str]) -> Callable[[str], str]:
        """How a model name reads in the checkpoint: Hugging Face saves a base model without its
        ``base_model_prefix`` (``transformer.``, ``model.``) and a ``*ForCausalLM`` with it."""
        prefix = getattr(model, "base_model_prefix", "")
        dot = f"{prefix}."
        model_has = bool(prefix) and any(n.startswith(dot) for n in names)
        file_has = bool(prefix) and any(k.startswith(dot) for k in self._where)
        if model_has and not file_has:
            return lambda name: name.removeprefix(dot)
        if file_has and not model_has:
            return lambda name: dot + name
        return lambda name: name

    def __call__(self, module: torch.nn.Module) -> None:
        """Initialise ``module``'s own parameters and buffers (they have memory): from the checkpoint,
        and with ``fallback`` (or the model's ``_init_weights``) what the checkpoint does not hold."""
        keys = self._plan.get(module, {})
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        unfilled = [n for n, _ in tensors if keys.get(n) is None]
        computed = [n for n in unfilled if n in module._non_persistent_buffers_set]
        with torch.no_grad():
            if unfilled:
                init = self.fallback if len(computed) < len(unfilled) else self._buffer_init
                if init is None:
                    where = next((f"{n}." for n, m in self._model.named_modules() if m is module), "")
                    raise ValueError(
                        f"SafetensorsInit: {_listed([where + n for n in unfilled])} ({type(module).__name__}) not in "
                        f"the checkpoint {self.folder}: a module added after SafetensorsInit was built (e.g. a LoRA "
                        "adapter) or a non-persistent buffer; pass fallback= to initialise them")
                init(module)
            for shard, shard_keys in self._by_shard((t, keys.get(n)) for n, t in tensors).items():
                with self._open(shard) as handle:
                    for tensor, key in shard_keys:
                        tensor.copy_(handle.get_tensor(key))
