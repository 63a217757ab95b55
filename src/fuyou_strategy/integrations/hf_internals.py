"""What `FuyouCallback` needs from transformers, accelerate and torch beyond their documented entry points.

One function per need. Each is exercised for real by ``tests/test_hf_internals.py``, which names what it
relies on and the versions it was checked against (transformers 5.24, accelerate 1.15, torch 2.13).
When what a function relies on is gone, it raises a `RuntimeError` that names it, the installed
versions and what to do, instead of training wrongly:

- `torch_optimizer`: the torch optimizer inside accelerate's ``AcceleratedOptimizer`` (its
  ``.optimizer``; accelerate documents the class as an internal wrapper). The callback hooks that
  optimizer's ``step`` and never replaces it.
- `set_grad_scaler_enabled`: turn accelerate's ``GradScaler`` (fp16 on CUDA) off for a run and on
  again (torch's ``GradScaler._enabled``: torch has no public switch). `FuyouAdamW` scales the loss
  itself, since it consumes the gradients during backward.
- `set_trainer_max_grad_norm`: ``TrainingArguments.max_grad_norm`` is a public field, but the callback
  relies on how the Trainer reads it: at every optimizer step, skipping its own clipping when it is 0.
  The Trainer's clipping must not run (module docstring of `hf`, "gradient clipping").
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import torch

__all__ = ["set_grad_scaler_enabled", "set_trainer_max_grad_norm", "torch_optimizer"]

CHECKED_AGAINST = "transformers 5.24, accelerate 1.15, torch 2.13"


def installed_versions() -> str:
    """The installed versions, e.g. ``transformers 5.24.0, accelerate 1.15.0, torch 2.13.0``."""
    found = []
    for name in ("transformers", "accelerate", "torch"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def _gone(internal: str, used_for: str, instead: str) -> RuntimeError:
    return RuntimeError(
        f"FuyouCallback relies on {internal} ({used_for}), which the installed {installed_versions()} does not "
        f"have (checked against {CHECKED_AGAINST}). {instead}; and please report it to fuyou-strategy with these "
        "versions")


def torch_optimizer(wrapped: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` ``wrapped`` (what the Trainer hands
    to callbacks as ``optimizer``): the one the Trainer built and whose ``step()`` the wrapper calls."""
    inner = getattr(wrapped, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        raise _gone("accelerate's AcceleratedOptimizer.optimizer", "the Trainer's torch optimizer, whose step() "
                    f"FuyouAdamW's replaces; got {type(inner).__name__}",
                    "Install the versions named here (pip install 'transformers==5.24.*' 'accelerate==1.15.*')")
    return inner


def set_grad_scaler_enabled(scaler: Any, enabled: bool) -> bool:
    """Turn a ``torch.amp.GradScaler`` on or off; returns whether it was on. Off, ``scale`` returns the
    loss unchanged and ``unscale_``/``step``/``update`` pass through (``step`` calls ``optimizer.step()``)."""
    if not isinstance(getattr(scaler, "_enabled", None), bool):
        raise _gone("torch.amp.GradScaler._enabled", "turning accelerate's fp16 loss scaler off while FuyouAdamW "
                    "scales the loss", "Train with bf16=True instead of fp16=True, or install the versions named here")
    previous = scaler._enabled
    scaler._enabled = bool(enabled)
    return previous


def set_trainer_max_grad_norm(args: Any, value: float) -> float:
    """Set ``TrainingArguments.max_grad_norm`` (the Trainer reads it at every optimizer step and clips only
    when it is above 0); returns the value it had."""
    previous = getattr(args, "max_grad_norm", None)
    if not isinstance(previous, (int, float)):
        raise _gone("TrainingArguments.max_grad_norm", "the Trainer's gradient clipping, which FuyouAdamW does "
                    f"instead; got {previous!r}", "Install the versions named here")
    args.max_grad_norm = value
    return previous
