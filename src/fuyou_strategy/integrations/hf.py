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
- ``on_step_end``: before an evaluation or a save, the updates that the ``next_forward``
  schedule leaves for the next forward are landed (the model's ``state_dict`` and the
  optimizer's checkpoint would also land them; evaluation forwards would wait per module).
- ``on_save``: the SSD state (fp32 masters and moments) is streamed, checksummed, into
  ``<checkpoint-N>/fuyou_optimizer/``; checkpoint rotation removes it with its folder.
- resume (``trainer.train(resume_from_checkpoint=...)``): ``on_train_begin`` streams it back
  from ``<output_dir>/checkpoint-<global_step>/fuyou_optimizer`` (or ``resume_from=``).
- ``on_train_end``: ``max_grad_norm``, the Trainer's own optimizer (with the current learning
  rates) and the scheduler's are put back, the hook removed and the swap files deleted.
- a ``train()`` that raises: the Trainer has no exception event, so no callback hears of it. The
  run's changes stay until the next ``on_train_begin`` on the same model or arguments, of any
  ``FuyouCallback`` (also the Trainer's own retry with ``auto_find_batch_size``), or
  ``FuyouCallback.close()``, which end it as ``on_train_end`` would, after discarding the updates
  that backward had written for a step that never ran (the weights are the last step's, as with
  torch's AdamW). Ending it lazily at one of these points is the one place that catches every way
  out of ``train()`` (an error in data loading, forward, backward, another callback, a
  ``KeyboardInterrupt``); a finalizer would run at the whim of the garbage collector, after the
  traceback that holds the Trainer's frames is dropped.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
import torch.distributed as dist
from accelerate.state import GradientState
from transformers import TrainerCallback
from transformers.utils import logging as hf_logging

from ..config import ConfigError, FuyouConfig, read_mapping
from ..engine import FuyouEngine, ignore_streamed_in_ddp, rebind_scheduler

__all__ = ["FuyouCallback", "STATE_FOLDER"]

STATE_FOLDER = "fuyou_optimizer"  # inside each checkpoint-N folder
_CALLBACK_OPTIONS = ("resume_from", "log_metrics")  # FuyouCallback.from_file: the rest are FuyouConfig fields
_GROUP_KEYS = ("lr", "initial_lr", "betas", "eps", "weight_decay")
# The engine's messages (the plan, predicted vs measured) follow the Trainer's verbosity (log_level).
log = hf_logging.get_logger(f"transformers.{__name__}")


class _Run:
    """One ``train()``'s changes to the Trainer's objects, made on construction, put back by `end`.

    Changed: the accelerate wrapper's optimizer (the engine's `FuyouAdamW` instead of the
    Trainer's), the LR scheduler's optimizer, ``args.max_grad_norm`` (0: the optimizer clips,
    the Trainer only measures the norm for logging) and a forward pre-hook on the model.
    """

    def __init__(self, engine: FuyouEngine, args: Any, model: torch.nn.Module, wrapper: Any, scheduler: Any) -> None:
        self.engine, self.args, self.model, self.wrapper, self.scheduler = engine, args, model, wrapper, scheduler
        self.max_grad_norm, self.original = args.max_grad_norm, wrapper.optimizer
        self.scheduler_optimizer = scheduler.optimizer if scheduler is not None else None
        wrapper.optimizer = engine.optimizer
        if scheduler is not None:
            rebind_scheduler(scheduler, engine.optimizer)
        self.hook = model.register_forward_pre_hook(self._before_forward)
        self.scaling_hook, self.accelerate_scaler = None, None
        if engine.optimizer.scaler is not None:  # fp16: the optimizer scales, unscales and skips, not accelerate
            self.scaling_hook = model.register_forward_hook(self._scale_loss)
            scaler = getattr(wrapper, "scaler", None)  # accelerate's GradScaler (CUDA), shared with the Accelerator
            if scaler is not None and getattr(scaler, "_enabled", False):
                self.accelerate_scaler, scaler._enabled = scaler, False  # disabled: scale/unscale_/step pass through
        args.max_grad_norm = 0.0
        _unended.append(self)

    def _scale_loss(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        loss = getattr(output, "loss", None) if not isinstance(output, dict) else output.get("loss")
        if module.training and torch.is_grad_enabled() and loss is not None and loss.requires_grad:
            self.engine.optimizer.scale_backward(loss)  # the Trainer logs the real loss, backward runs scaled

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self.engine.begin_micro_batch(update=GradientState().sync_gradients)

    def end(self) -> None:
        """Put everything back (the Trainer's optimizer with the current learning rates), discard the
        updates of a step that never reached ``step()`` and delete the swap files; once."""
        if self not in _unended:
            return
        _unended.remove(self)
        self.hook.remove()
        if self.scaling_hook is not None:
            self.scaling_hook.remove()
        if self.accelerate_scaler is not None:
            self.accelerate_scaler._enabled = True
        self.args.max_grad_norm = self.max_grad_norm
        converted = self.engine.optimizer
        if len(self.original.param_groups) == len(converted.param_groups):
            for theirs, ours in zip(self.original.param_groups, converted.param_groups):
                theirs.update({k: ours[k] for k in _GROUP_KEYS if k in ours})
        self.wrapper.optimizer = self.original
        if self.scheduler is not None:
            self.scheduler.optimizer = self.scheduler_optimizer
        try:
            converted.zero_grad()  # after a normal end nothing is pending: it only clears gradients
        finally:
            self.engine.close()


# Runs that began and have not ended (see the module docstring).
_unended: list[_Run] = []


def _ddp_wrapping(model: Any) -> Any:
    """The ``DistributedDataParallel`` whose module is ``model`` (accelerate made it inside the Trainer,
    which gives callbacks only the model), found among the objects the garbage collector tracks (one
    pass, once per ``train()``). ``None`` if there is none."""
    from torch.nn.parallel import DistributedDataParallel

    # type(), not isinstance(): some tracked objects (lazy proxies) raise when asked for __class__
    return next((o for o in gc.get_objects() if issubclass(type(o), DistributedDataParallel) and o.module is model),
                None)


class FuyouCallback(TrainerCallback):
    """Train a ``transformers.Trainer`` with `FuyouAdamW` and activation swapping.

    Args:
        config: a `FuyouConfig`, a dict, a ``.json``/``.yaml`` path or ``None`` (defaults: a
            temporary swap directory, no activation swapping); keyword ``config_fields``
            override it, e.g. ``FuyouCallback(swap_dirs=["/nvme0"], activations="ssd")``.
        resume_from: the checkpoint folder to resume from when it is not
            ``<output_dir>/checkpoint-<step>`` (the Trainer does not tell callbacks).
        log_metrics: add the last optimizer step's `FuyouEngine.metrics` (``fuyou/...``) to the
            Trainer's training logs (`on_log`).

    Honoured: ``learning_rate``, ``weight_decay`` (with the Trainer's no-decay groups),
    ``adam_beta1/2``, ``adam_epsilon``, ``lr_scheduler_type`` and warm-up,
    ``gradient_accumulation_steps``, ``max_grad_norm`` (exact; ``grad_norm`` still logged),
    ``bf16``, checkpoints and ``resume_from_checkpoint``, PEFT models (only trainable, e.g.
    LoRA, weights are optimised), ``fp16=True`` (the optimizer does the loss scaling with GradScaler's
    rules: a forward hook makes the backward of the model's ``outputs.loss`` run scaled, and
    accelerate's own GradScaler, on CUDA, is disabled for the run). Refused: optimizers other
    than AdamW/Adam, fp16 with label smoothing (the loss must be the model's).
    After training, ``callback.summary`` holds the engine's summary (and ``callback.plan`` the
    planner's `Plan` with ``activations="auto"``).

    Under ``torchrun`` / ``accelerate launch`` each rank owns ~1/N of the optimizer state
    (`fuyou_strategy.optim.distributed`): `on_train_begin` registers `FuyouAdamW.attach_ddp`'s comm
    hook on accelerate's ``DistributedDataParallel`` (each bucket summed onto its owners; the
    ``backward`` schedule's updates as buckets land), and the logged ``grad_norm`` is the
    optimizer's global one. With streamed weights (``weights="ssd"``/``"host"``) `on_init_end` has
    ``DistributedDataParallel`` leave them to the optimizer (pass the callback to
    ``Trainer(callbacks=...)``, not ``add_callback`` after the Trainer was made).

    When ``train()`` raises, the run's changes to the Trainer, the model and
    ``TrainingArguments`` and its swap files stay until the next ``train()`` on the same model or
    arguments (with any ``FuyouCallback``) or `close` ends the run; ``with FuyouCallback(...) as
    fuyou:`` closes it at the block's end. Until then the weights may hold updates of the step
    that did not finish.
    """

    def __init__(self, config: FuyouConfig | dict | str | None = None, *, resume_from: str | None = None,
                 log_metrics: bool = True, **config_fields: Any) -> None:
        self.config = FuyouConfig.resolve(config, **config_fields)
        self.resume_from = resume_from
        self.log_metrics = log_metrics
        self.summary: dict[str, Any] | None = None
        self.plan = None  # the planner's Plan after training with activations="auto"
        self._run: _Run | None = None

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "FuyouCallback":
        """A callback configured by a ``.yaml``/``.yml``/``.json`` file: the callback's own options
        (``resume_from``, ``log_metrics``) and `FuyouConfig` fields side by side, e.g.::

            log_metrics: true
            swap_dirs: [/nvme0/fuyou]
            activations: auto

        An unknown key is a `ConfigError` that suggests the closest field."""
        values = read_mapping(path)
        options = {k: values.pop(k) for k in _CALLBACK_OPTIONS if k in values}
        return cls(values, **options)

    def place_before_integrations(self, trainer: Any) -> None:
        """Move this callback ahead of the Trainer's reporting integrations (``report_to``:
        TensorBoard, W&B, MLflow, ...), right after ``DefaultFlowCallback``, so that they log the
        ``fuyou/`` metrics it adds to the logs in `on_log`. The Trainer puts the callbacks a user
        passes after its integrations, where they only reach ``log_history`` and later callbacks::

            trainer = Trainer(..., callbacks=[fuyou])
            fuyou.place_before_integrations(trainer)
        """
        callbacks = trainer.callback_handler.callbacks
        if self not in callbacks:
            raise ConfigError("place_before_integrations: this FuyouCallback is not one of the Trainer's callbacks; "
                              "pass it in Trainer(callbacks=[...]) or trainer.add_callback(...) first")
        callbacks.remove(self)
        flow = next((i + 1 for i, cb in enumerate(callbacks) if type(cb).__name__ == "DefaultFlowCallback"), 0)
        callbacks.insert(flow, self)

    @property
    def engine(self) -> FuyouEngine | None:
        """The `FuyouEngine` of the run in progress (or of one that raised and was not yet ended)."""
        return self._run.engine if self._run is not None else None

    # -- start -------------------------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        # Under torchrun / accelerate launch, before the Trainer wraps the model in DistributedDataParallel:
        # DDP must leave the streamed weights to FuyouAdamW, which sums their gradients itself.
        if model is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ignore_streamed_in_ddp(model, self.config)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        # A run that raised never reached on_train_end: end it before this one reads what it changed.
        for run in [r for r in _unended if r is self._run or r.model is model or r.args is args]:
            run.end()
        self._run = None
        if args.fp16 and getattr(args, "label_smoothing_factor", 0):
            raise ConfigError(f"fp16: got True with label_smoothing_factor={args.label_smoothing_factor}; FuyouCallback "
                              "scales the loss the model returns (outputs.loss), so the loss must come from the model: "
                              "drop label smoothing, or use bf16=True")
        if optimizer is None or not hasattr(optimizer, "optimizer"):
            raise ConfigError("FuyouCallback: the Trainer gave no accelerate-wrapped optimizer to replace; "
                              "let the Trainer create the optimizer (do not pass optimizers=...)")
        resume = self._resume_folder(args, state)  # before anything is created on disk
        max_norm = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        optim_name = getattr(args.optim, "value", args.optim)
        # Under torchrun / accelerate launch the Trainer's model is a DistributedDataParallel, which averages
        # the gradients in backward: each rank then updates the parameters whose state it owns.
        parallel = (dict(process_group=dist.group.WORLD, gradients_averaged=True)
                    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else {})
        engine = FuyouEngine(model, optimizer.optimizer, config=self.config, max_grad_norm=max_norm,
                             release_grads=False, norm_order=model.parameters(), loss_scaling=True if args.fp16 else None,
                             where=f"TrainingArguments(optim={optim_name!r})", report=log.info, **parallel)
        try:
            if parallel and engine.optimizer.shards is not None:
                ddp = _ddp_wrapping(model)  # the Trainer hands callbacks the model inside accelerate's DDP
                if ddp is not None:  # each bucket summed onto its owners; `backward`: updates as buckets land
                    engine.optimizer.attach_ddp(ddp)
                else:
                    log.warning("FuyouCallback: no DistributedDataParallel wraps the model; the gradients are "
                                "all-reduced by whatever wraps it, and the 'backward' schedule updates at step()")
            if resume is not None:
                engine.load(resume)
            engine.expect_steps(state.max_steps - state.global_step if state.max_steps else None)
        except BaseException:
            engine.close()
            raise
        self._run = _Run(engine, args, model, optimizer, getattr(lr_scheduler, "scheduler", lr_scheduler))

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

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        """Add the last optimizer step's `FuyouEngine.metrics` (``fuyou/...``) to the Trainer's logs of a
        training step, and to the entry the Trainer just put in ``state.log_history``. Reporting
        callbacks placed after this one (``callbacks=[FuyouCallback(...), ...]``) see them; the
        Trainer's own ``report_to`` integrations run before user callbacks and do not."""
        if self.engine is None or logs is None or "loss" not in logs:
            return  # evaluation logs and the closing train_runtime line carry no step
        metrics = self.engine.metrics() if self.log_metrics else {}
        if self.engine.optimizer.shards is not None and "grad_norm" in logs:
            # Data parallel: the Trainer took the norm of this rank's .grad, which holds the average only for
            # the parameters the rank owns (the comm hook sums each bucket onto its owners); the
            # optimizer's is the global one.
            metrics["grad_norm"] = self.engine.optimizer.stats.last_grad_norm
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer's own flow callback ran first: it says whether evaluation or a save follows now.
        # Land the updates left for the next forward before either reads the weights.
        if self.engine is not None and (control.should_evaluate or control.should_save):
            self.engine.flush()

    # -- checkpoints -----------------------------------------------------------------------------------------
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if self.engine is not None and os.path.isdir(checkpoint):
            self.engine.save(os.path.join(checkpoint, STATE_FOLDER))

    # -- end -------------------------------------------------------------------------------------------------
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._run is None:
            return
        self._run.engine.flush()  # every rank, alike: the last step's weights (broadcast when sharded)
        self.summary = self._run.engine.summary()
        self.plan = self._run.engine.plan
        self.close()

    def close(self) -> None:
        """End this callback's run, if one is left: put back ``args.max_grad_norm``, the Trainer's
        optimizer and scheduler, remove the hook, restore the weights of the last completed step
        and delete the swap files. Only needed after ``train()`` raised; a no-op otherwise."""
        run, self._run = self._run, None
        if run is not None:
            run.end()

    def __enter__(self) -> "FuyouCallback":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
