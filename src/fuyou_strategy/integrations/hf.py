"""Hugging Face: ``transformers.Trainer(..., callbacks=[FuyouCallback()])``.

The callback translates the Trainer's events into `FuyouEngine` calls:

- ``on_train_begin``: the Trainer has built its ``torch.optim.AdamW`` (with its no-decay
  groups), the LR scheduler and, on resume, loaded both. The callback converts the optimizer
  into a `FuyouAdamW` and puts it inside the Trainer's ``AcceleratedOptimizer``, points the
  scheduler at it, and installs activation swapping. ``max_grad_norm`` moves into the
  optimizer, which clips exactly (gradients are consumed during backward, so the Trainer's
  clipping would come too late); the Trainer still computes and logs ``grad_norm`` from the
  gradients, which are kept until ``zero_grad`` for that.
- before each training forward (a forward pre-hook on the model): accelerate's
  ``GradientState.sync_gradients``, which the Trainer sets per micro-batch, says whether the
  micro-batch ends the accumulation window, i.e. whether its backward runs the updates.
- ``on_save``: the SSD state (fp32 masters and moments) is streamed, checksummed, into
  ``<checkpoint-N>/fuyou_optimizer/``; checkpoint rotation removes it with its folder.
- resume (``trainer.train(resume_from_checkpoint=...)``): ``on_train_begin`` streams it back
  from ``<output_dir>/checkpoint-<global_step>/fuyou_optimizer`` (or ``resume_from=``).
- ``on_train_end``: ``max_grad_norm`` and the Trainer's own optimizer are put back (with the
  current learning rates) and the swap files are deleted.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate.state import GradientState
from transformers import TrainerCallback
from transformers.utils import logging as hf_logging

from ..config import ConfigError, FuyouConfig
from ..engine import FuyouEngine, rebind_scheduler

__all__ = ["FuyouCallback", "STATE_FOLDER"]

STATE_FOLDER = "fuyou_optimizer"  # inside each checkpoint-N folder
_GROUP_KEYS = ("lr", "initial_lr", "betas", "eps", "weight_decay")
# The engine's messages (the plan, predicted vs measured) follow the Trainer's verbosity (log_level).
log = hf_logging.get_logger(f"transformers.{__name__}")


class FuyouCallback(TrainerCallback):
    """Train a ``transformers.Trainer`` with `FuyouAdamW` and activation swapping.

    Args:
        config: a `FuyouConfig`, a dict, a ``.json``/``.yaml`` path or ``None`` (defaults: a
            temporary swap directory, no activation swapping); keyword ``config_fields``
            override it, e.g. ``FuyouCallback(swap_dirs=["/nvme0"], activations="ssd")``.
        resume_from: the checkpoint folder to resume from when it is not
            ``<output_dir>/checkpoint-<step>`` (the Trainer does not tell callbacks).

    Honoured: ``learning_rate``, ``weight_decay`` (with the Trainer's no-decay groups),
    ``adam_beta1/2``, ``adam_epsilon``, ``lr_scheduler_type`` and warm-up,
    ``gradient_accumulation_steps``, ``max_grad_norm`` (exact; ``grad_norm`` still logged),
    ``bf16``, checkpoints and ``resume_from_checkpoint``, PEFT models (only trainable, e.g.
    LoRA, weights are optimised). Refused: ``fp16=True``, optimizers other than AdamW/Adam.
    After training, ``callback.summary`` holds the engine's summary (and ``callback.plan`` the
    planner's `Plan` with ``activations="auto"``).
    """

    def __init__(self, config: FuyouConfig | dict | str | None = None, *, resume_from: str | None = None,
                 **config_fields: Any) -> None:
        self.config = FuyouConfig.resolve(config, **config_fields)
        self.resume_from = resume_from
        self.engine: FuyouEngine | None = None
        self.summary: dict[str, Any] | None = None
        self.plan = None  # the planner's Plan after training with activations="auto"
        self._restore: dict[str, Any] = {}

    # -- start -------------------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        if args.fp16:
            raise ConfigError("fp16: got True; fp16 needs loss scaling, which FuyouAdamW does not do: use bf16=True")
        if optimizer is None or not hasattr(optimizer, "optimizer"):
            raise ConfigError("FuyouCallback: the Trainer gave no accelerate-wrapped optimizer to replace; "
                              "let the Trainer create the optimizer (do not pass optimizers=...)")
        resume = self._resume_folder(args, state)  # before anything is created on disk
        original = optimizer.optimizer
        max_norm = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        optim_name = getattr(args.optim, "value", args.optim)
        self.engine = FuyouEngine(model, original, config=self.config, max_grad_norm=max_norm, release_grads=False,
                                  norm_order=model.parameters(), where=f"TrainingArguments(optim={optim_name!r})",
                                  report=log.info)
        try:
            if resume is not None:
                self.engine.load(resume)
        except BaseException:
            self.engine.close()
            self.engine = None
            raise
        scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)
        optimizer.optimizer = self.engine.optimizer
        if scheduler is not None:
            rebind_scheduler(scheduler, self.engine.optimizer)
        self._restore = {"args": args, "max_grad_norm": args.max_grad_norm, "wrapper": optimizer,
                         "original": original, "scheduler": scheduler,
                         "hook": model.register_forward_pre_hook(self._before_forward)}
        args.max_grad_norm = 0.0  # the optimizer clips; the Trainer only measures the norm for logging

    def _resume_folder(self, args: Any, state: Any) -> str | None:
        if not state.global_step:
            return None
        candidates = [self.resume_from] if self.resume_from else []
        if isinstance(args.resume_from_checkpoint, str):
            candidates.append(args.resume_from_checkpoint)
        candidates.append(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        for checkpoint in candidates:
            folder = os.path.join(checkpoint, STATE_FOLDER)
            if os.path.isdir(folder):
                return folder
        raise ConfigError(
            f"resume: the Trainer resumed at step {state.global_step} but no FuyouAdamW state was found (looked for "
            f"{[os.path.join(c, STATE_FOLDER) for c in candidates]}); pass FuyouCallback(resume_from=<checkpoint folder>) "
            "if the checkpoint is elsewhere"
        )

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled() and self.engine is not None:
            self.engine.begin_micro_batch(update=GradientState().sync_gradients)

    # -- checkpoints -----------------------------------------------------------------------------------------
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if self.engine is not None and os.path.isdir(checkpoint):
            self.engine.save(os.path.join(checkpoint, STATE_FOLDER))

    # -- end -------------------------------------------------------------------------------------------------
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.engine is None:
            return
        self.summary = self.engine.summary()
        self.plan = self.engine.plan
        restore, self._restore = self._restore, {}
        restore["hook"].remove()
        restore["args"].max_grad_norm = restore["max_grad_norm"]
        original, converted = restore["original"], self.engine.optimizer
        if len(original.param_groups) == len(converted.param_groups):
            for theirs, ours in zip(original.param_groups, converted.param_groups):
                theirs.update({k: ours[k] for k in _GROUP_KEYS if k in ours})
        restore["wrapper"].optimizer = original
        if restore["scheduler"] is not None:
            restore["scheduler"].optimizer = original
        self.engine.close()
        self.engine = None
