"""Building a model larger than memory: construct it on the meta device, give it memory block by block.

::

    with torch.device("meta"):
        model = GPT2LMHeadModel(config)          # no memory: shapes only
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters()), config=FuyouConfig(weights="ssd"),
                         init_weights=model._init_weights)

The engine materialises what lies outside the streamed blocks on the device; the `WeightStreamer`
materialises, initialises, writes to its tier and releases one streamed block at a time. `materialize` keeps
every ``Parameter`` object (``torch.utils.swap_tensors``), so the optimizer and tied weights keep them.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["materialize", "has_meta", "model_device", "Init"]

_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")  # hooks a Parameter holds (e.g. FuyouAdamW's)
Init = Callable[[torch.nn.Module], None]  # called on each materialised module, as ``module.apply(init)`` does


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s weights live: its first parameter not on the meta device, else the CPU."""
    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))


def has_meta(module: torch.nn.Module, recurse: bool = True) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)])


def materialize(module: torch.nn.Module, device: torch.device, init: Init | None, *, recurse: bool = True) -> int:
    """Give ``module``'s meta parameters and buffers (``recurse=False``: its own only) memory on ``device``, in
    place, and call ``init`` on each module materialised, like ``module.apply(init)`` (``None``: its
    ``reset_parameters()``); returns the bytes materialised. `ValueError` for a module with neither."""
    nbytes = 0
    for mod in module.modules() if recurse else [module]:
        metas = [(n, p) for n, p in mod.named_parameters(recurse=False) if p.is_meta]
        buffers = [(n, b) for n, b in mod.named_buffers(recurse=False) if b.is_meta]
        if not metas and not buffers:
            continue
        for _name, p in metas:  # the same Parameter object, now with memory: optimizers and ties keep it
            nbytes += p.numel() * p.element_size()
            real = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            real.__dict__.update(p.__dict__)  # swap_tensors swaps these too: p keeps its attributes
            hooks = {name: getattr(p, name) for name in _HOOKS if getattr(p, name) is not None}
            torch.utils.swap_tensors(p, real)
            for name, value in hooks.items():  # setting them registers them with autograd again
                setattr(p, name, value)
        for name, b in buffers:
            nbytes += b.numel() * b.element_size()
            mod._buffers[name] = torch.empty_like(b, device=device)
        with torch.no_grad():
            if init is not None:
                init(mod)
            elif hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
            elif metas:
                raise ValueError(
                    f"init_weights: {type(mod).__name__} was built on the meta device and has no reset_parameters(); "
                    "pass init_weights (e.g. the Hugging Face model's _init_weights) to initialise it")
    return nbytes
