"""Hugging Face: ``transformers.Trainer(..., callbacks=[FuyouCallback()])``.

The callback translates the Trainer's events into `FuyouEngine` calls:

- ``on_train_begin``: the Trainer has built its ``torch.optim.AdamW`` (with its no-decay
  groups), the LR scheduler and, on resume, loaded both, and hands callbacks the optimizer inside
  accelerate's ``AcceleratedOptimizer``. The callback converts that AdamW into a `FuyouAdamW`
  and hooks it (``register_step_pre_hook``, torch's public API): the Trainer's ``optimizer.step()``
  runs FuyouAdamW's step, then finds no gradient left and changes nothing. The Trainer's optimizer,
  its LR scheduler (whose learning rates FuyouAdamW takes before each training forward and step)
  and the ``optimizer.pt`` of its checkpoints (hyper-parameters, no state: fuyou's is on SSD) stay
  its own. Activation swapping is installed.
- gradient clipping: ``max_grad_norm`` moves into the optimizer, which clips exactly, and the
  Trainer's is set to 0 for the run (`hf_internals.set_trainer_max_grad_norm`). Gradients are
  consumed during backward, and the optimizer reads the kept ``.grad`` again at ``step()`` (a
  clipping redo, the ``next_forward`` schedule): the Trainer's in-place clipping before that
  would clip twice or commit updates made from unclipped gradients. The Trainer still
  measures and logs ``grad_norm`` from the gradients, which are kept until ``zero_grad`` for that
  (fp16 and data parallel: the optimizer's own norm is logged, `on_log`).
- fp16: FuyouAdamW scales the loss (a forward hook makes the backward of ``outputs.loss`` run
  scaled); accelerate's GradScaler (CUDA) is off for the run (`hf_internals.set_grad_scaler_enabled`).
- data parallel: the Trainer hands callbacks the model, and accelerate wraps it in a
  ``DistributedDataParallel`` inside ``train()``. Torch's global forward pre-hook
  (``register_module_forward_pre_hook``) sees that wrapper's first forward, before the first
  backward: FuyouAdamW's comm hook is registered on it then, and the global hook removed.
- before each training forward (a forward pre-hook on the model): accelerate's
  ``GradientState.sync_gradients``, which the Trainer sets per micro-batch, says whether the
  micro-batch ends the accumulation window, i.e. whether its backward runs the updates.
- ``on_step_end``: before an evaluation or a save, the updates that the ``next_forward``
  schedule leaves for the next forward are landed (the model's ``state_dict`` and the
  optimizer's checkpoint would also land them; evaluation forwards would wait per module).
- checkpoints: the SSD state (fp32 masters and moments) is streamed, checksummed, into
  ``<checkpoint-N>/fuyou_optimizer/<token>/`` *inside* the Trainer's save, after its model files and
  before its ``trainer_state.json``, which records the token (`state`: the callback is an
  ``ExportableState``); under data parallelism every rank writes its part at ``on_step_end``, just
  before the Trainer's save. The order is the commit protocol's (`..commit`): the Trainer fsyncs
  nothing, so the callback makes the checkpoint durable in ``state`` and again at ``on_save``, where it
  commits. A checkpoint is complete only when both halves are, decided from the files
  (`hf_checkpoints`, with the window a power cut can still hit); ``on_init_end`` sets incomplete ones
  aside, so that ``resume_from_checkpoint=True`` picks the newest complete one. Rotation removes the
  state with its folder, after the new checkpoint is complete.
- resume (``trainer.train(resume_from_checkpoint=...)``): ``on_train_begin`` streams the save that
  the checkpoint's ``trainer_state.json`` records back from
  ``<output_dir>/checkpoint-<global_step>/fuyou_optimizer`` (or ``resume_from=``), and refuses
  state that belongs to another checkpoint, naming both files.
- ``on_train_end``: the hooks are removed, ``max_grad_norm`` (and accelerate's GradScaler) put
  back and the swap files deleted.
- ``torch.compile`` is refused up front (``on_init_end``, again at ``on_train_begin``, before
  anything is made): ``TrainingArguments(torch_compile=True)`` (also implied by
  ``torch_compile_backend``/``torch_compile_mode``), ``accelerate launch --dynamo_backend``, or a
  model compiled before it reached the Trainer (``torch.compile(model)``, ``module.compile()``), each
  a `ConfigError` naming the setting and the fix. TorchDynamo traces into fuyou's hooks and breaks
  its graphs inside fuyou's own code (the I/O queue, the host buffer pool, the weight streamer, the
  run report), not at block boundaries, and with ``inductor`` the weights are not bitwise those of
  the uncompiled run. Supporting it needs fuyou's hooks kept out of the graphs
  (``torch.compiler.disable``) in the engine's modules, shared with Lightning.
- a ``train()`` that raises: the Trainer has no exception event, so no callback hears of it. The
  run's changes stay until the next ``on_train_begin`` on the same model or arguments, of any
  ``FuyouCallback`` (also the Trainer's own retry with ``auto_find_batch_size``), or
  ``FuyouCallback.close()``, which end it as ``on_train_end`` would, after discarding the updates
  that backward had written for a step that never ran (the weights are the last step's, as with
  torch's AdamW). Ending it lazily at one of these points is the one place that catches every way
  out of ``train()`` (an error in data loading, forward, backward, another callback, a
  ``KeyboardInterrupt``); a finalizer would run at the whim of the garbage collector, after the
  traceback that holds the Trainer's frames is dropped. The runs that began and did not end are
  kept in ``_unended`` for that: the lookup relies on the Trainer handing ``on_train_begin`` the
  same ``model`` and ``args`` objects on every ``train()`` (`tests/test_hf.py` checks both ways back in).

What the callback needs beyond the Trainer's, accelerate's and torch's documented entry points is in
`hf_internals`, one function each, each with a test naming the versions it was checked against.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel

from .._extras import require

require(__name__, "transformers", "accelerate")  # without them: the error says which extra to install
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.state import GradientState  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import DefaultFlowCallback, ExportableState  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from ..cleanup import undo_after
from ..config import ConfigError, FuyouConfig, read_mapping
from ..engine import FuyouEngine, compiled_modules, ignore_streamed_in_ddp
from .. import commit
from . import hf_checkpoints, hf_internals
from .hf_checkpoints import STATE_FOLDER, TRAINER_STATE

__all__ = ["FuyouCallback", "STATE_FOLDER"]
_CALLBACK_OPTIONS = ("resume_from", "log_metrics")  # FuyouCallback.from_file: the rest are FuyouConfig fields
_GROUP_KEYS = ("lr", "initial_lr", "betas", "eps", "weight_decay")
# The engine's messages (the plan, predicted vs measured) follow the Trainer's verbosity (log_level).
log = hf_logging.get_logger(f"transformers.{__name__}")


class _Run:
    """One ``train()``'s changes, made on construction, undone by `end`: hooks, and two settings.

    - a step pre-hook on the Trainer's torch optimizer (inside accelerate's wrapper): its ``step()`` runs
      `FuyouAdamW`'s and then finds no gradient left, so the Trainer's optimizer, its LR scheduler and
      its checkpoints stay the Trainer's own; the learning rates follow its param groups;
    - a forward pre-hook on the model (and, fp16, a forward hook that makes backward run scaled);
    - data parallel: until the first training forward, torch's global forward pre-hook, which finds the
      ``DistributedDataParallel`` that accelerate wrapped around the model (its comm hook is registered
      then, before the first backward);
    - ``args.max_grad_norm`` 0 (the optimizer clips; the Trainer only measures the norm for logging) and,
      fp16 on CUDA, accelerate's GradScaler off (`hf_internals`).
    """

    def __init__(self, engine: FuyouEngine, args: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: Any) -> None:
        self.engine, self.args, self.model, self.optimizer = engine, args, model, optimizer
        if len(optimizer.param_groups) != len(engine.optimizer.param_groups):
            raise ConfigError(f"FuyouCallback: the Trainer's optimizer has {len(optimizer.param_groups)} param groups, "
                              f"FuyouAdamW {len(engine.optimizer.param_groups)}; drop the empty param groups")
        self.max_grad_norm = hf_internals.set_trainer_max_grad_norm(args, 0.0)
        self.accelerate_scaler = None
        try:
            if engine.scales_loss and scaler is not None and hf_internals.set_grad_scaler_enabled(scaler, False):
                self.accelerate_scaler = scaler  # off: scale/unscale_/step pass through; FuyouAdamW scales
        except BaseException:
            hf_internals.set_trainer_max_grad_norm(args, self.max_grad_norm)
            raise
        self.step_hook = optimizer.register_step_pre_hook(self._step)
        self.hook = model.register_forward_pre_hook(self._before_forward)
        self.scaling_hook = model.register_forward_hook(self._scale_loss) if engine.scales_loss else None
        self.ddp_watch = register_module_forward_pre_hook(self._find_ddp) if engine.data_parallel else None
        _unended.append(self)

    def _hyperparameters(self) -> None:
        """The Trainer's learning rates (its scheduler steps its own optimizer) into FuyouAdamW's groups."""
        for theirs, ours in zip(self.optimizer.param_groups, self.engine.optimizer.param_groups):
            for key in _GROUP_KEYS:
                if key in theirs:
                    value = theirs[key]
                    ours[key] = float(value) if isinstance(value, torch.Tensor) else value

    def _step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before the Trainer's optimizer steps: FuyouAdamW's step (the Trainer has measured the gradients'
        norm); then the gradients are cleared, so that the Trainer's own step finds none and changes nothing."""
        self._hyperparameters()
        self.engine.optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def _scale_loss(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        loss = getattr(output, "loss", None) if not isinstance(output, dict) else output.get("loss")
        if module.training and torch.is_grad_enabled() and loss is not None and loss.requires_grad:
            self.engine.scale_backward(loss)  # the Trainer logs the real loss, backward runs scaled

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self._hyperparameters()  # the backward schedule updates during this micro-batch's backward
            self.engine.begin_micro_batch(update=GradientState().sync_gradients)

    def _find_ddp(self, module: torch.nn.Module, args: Any) -> None:
        """torch's global forward pre-hook, until the first training forward: the Trainer hands callbacks the
        model, and accelerate wraps it in a ``DistributedDataParallel`` inside ``train()``."""
        if isinstance(module, DistributedDataParallel) and module.module is self.model:
            self._stop_watching()  # each bucket summed onto its owners; `backward`: updates as buckets land
            self.engine.attach_ddp(module)
        elif module is self.model and module.training and torch.is_grad_enabled():
            self._stop_watching()
            log.warning("FuyouCallback: no DistributedDataParallel wraps the model; the gradients are all-reduced "
                        "by whatever wraps it, and the 'backward' schedule updates at step()")

    def _stop_watching(self) -> None:
        if self.ddp_watch is not None:
            self.ddp_watch.remove()
            self.ddp_watch = None

    def end(self) -> None:
        """Remove the hooks, put the settings back, discard the updates of a step that never reached
        ``step()`` and delete the swap files; once."""
        if self not in _unended:
            return
        _unended.remove(self)
        self._stop_watching()
        self.step_hook.remove()
        self.hook.remove()
        if self.scaling_hook is not None:
            self.scaling_hook.remove()
        if self.accelerate_scaler is not None:
            hf_internals.set_grad_scaler_enabled(self.accelerate_scaler, True)
        hf_internals.set_trainer_max_grad_norm(self.args, self.max_grad_norm)
        try:
            self.engine.optimizer.zero_grad()  # after a normal end nothing is pending: it only clears gradients
        finally:
            try:
                self.engine.close()
            finally:
                if self.args.should_save:
                    hf_checkpoints.release(self.args.output_dir)


# Runs that began and have not ended (see the module docstring).
_unended: list[_Run] = []


def _refuse_compiled(args: Any, model: Any) -> None:
    """torch.compile, refused before anything is made (module docstring: "torch.compile")."""
    why = ("FuyouCallback does not train compiled models: TorchDynamo traces into fuyou's hooks (activation "
           "swapping, weight streaming, the optimizer's waits), breaking graphs inside fuyou's I/O code, and the "
           "weights are not bitwise those of the uncompiled run")
    if getattr(args, "torch_compile", False):
        raise ConfigError(f"TrainingArguments.torch_compile: got True (torch_compile_backend="
                          f"{getattr(args, 'torch_compile_backend', None)!r}); {why}; set torch_compile=False and "
                          "leave torch_compile_backend and torch_compile_mode unset")
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no")
    if backend.lower() != "no":
        raise ConfigError(f"ACCELERATE_DYNAMO_BACKEND: got {backend!r} (accelerate launch --dynamo_backend); {why}; "
                          "launch with --dynamo_backend no (or unset ACCELERATE_DYNAMO_BACKEND)")
    if model is not None and compiled_modules(model):
        raise ConfigError("model: got a model compiled with torch.compile (or module.compile()); " + why + "; pass "
                          "the model uncompiled (torch.compile(model) returns a wrapper: pass the model itself)")


class FuyouCallback(TrainerCallback, ExportableState):
    """Train a ``transformers.Trainer`` with `FuyouAdamW` and activation swapping.

    Args:
        config: a `FuyouConfig`, a dict, a ``.json``/``.yaml`` path or ``None`` (defaults: a
            temporary swap directory, no activation swapping); keyword ``config_fields``
            override it, e.g. ``FuyouCallback(swap_dirs=["/nvme0"], activations="ssd")``.
        resume_from: the checkpoint folder to resume from when it is not
            ``<output_dir>/checkpoint-<step>`` (the Trainer does not tell callbacks).
        log_metrics: add the last optimizer step's `FuyouEngine.metrics` (``fuyou/...``) to
            ``trainer.state.log_history`` (and, after `place_before_integrations`, to the logs; `on_log`).

    Honoured: ``learning_rate``, ``weight_decay`` (with the Trainer's no-decay groups),
    ``adam_beta1/2``, ``adam_epsilon``, ``lr_scheduler_type`` and warm-up,
    ``gradient_accumulation_steps``, ``max_grad_norm`` (exact; ``grad_norm`` still logged),
    ``bf16``, checkpoints and ``resume_from_checkpoint``, PEFT models (only trainable, e.g.
    LoRA, weights are optimised), ``fp16=True`` (the optimizer does the loss scaling with GradScaler's
    rules: a forward hook makes the backward of the model's ``outputs.loss`` run scaled, and
    accelerate's own GradScaler, on CUDA, is off for the run). The Trainer's optimizer and scheduler
    stay its own: the callback hooks its AdamW's ``step()`` (module docstring). Refused: optimizers
    other than AdamW/Adam, fp16 with label smoothing (the loss must be the model's), and
    ``torch.compile`` in any form (``TrainingArguments(torch_compile=True)``, a compiled model),
    when the Trainer is made.
    After training, ``callback.summary`` holds the engine's summary (and ``callback.plan`` the
    planner's `Plan` with ``activations="auto"``).

    Under ``torchrun`` / ``accelerate launch`` each rank owns ~1/N of the optimizer state
    (`fuyou_strategy.optim.distributed`): `OptimizerControl.attach_ddp`'s comm hook is registered on
    accelerate's ``DistributedDataParallel`` at its first forward (each bucket summed onto its owners; the
    ``backward`` schedule's updates as buckets land), and the logged ``grad_norm`` is the
    optimizer's global one. With streamed weights (``weights="ssd"``/``"host"``) `on_init_end` has
    ``DistributedDataParallel`` leave them to the optimizer (pass the callback to
    ``Trainer(callbacks=...)``, not ``add_callback`` after the Trainer was made).

    Checkpoints survive a kill at any instant: pass the callback to ``Trainer(callbacks=...)`` (its
    ``on_init_end`` sets incomplete checkpoints aside before ``resume_from_checkpoint=True`` picks
    one) and resume; a checkpoint's fuyou state is tied to its ``trainer_state.json`` (module
    docstring, `hf_checkpoints`).

    When ``train()`` raises, the run's hooks on the Trainer's optimizer and the model, its
    ``TrainingArguments.max_grad_norm`` and its swap files stay until the next ``train()`` on the same model or
    arguments (with any ``FuyouCallback``) or `close` ends the run; ``with FuyouCallback(...) as
    fuyou:`` closes it at the block's end. Until then the weights may hold updates of the step
    that did not finish.
    """

    def __init__(self, config: FuyouConfig | dict | str | None = None, *, resume_from: str | None = None,
                 log_metrics: bool = True, **config_fields: Any) -> None:
        self.config = FuyouConfig.merge(config, **config_fields)
        self.resume_from = resume_from
        self.log_metrics = log_metrics
        self._metrics_in_logs = False  # the fuyou/ metrics join the logs the integrations see once placed before them
        self.summary: dict[str, Any] | None = None
        self.plan = None  # the planner's Plan after training with activations="auto"
        self._run: _Run | None = None
        self.fuyou_save: dict[str, Any] | None = None  # the last save made for a checkpoint (token, steps, global_step)
        self._pending: commit.Pending | None = None  # that save, until on_save commits it
        self._at: tuple[Any, Any] | None = None  # the Trainer's (args, state) of the run in progress
        self._save_due = False  # a step ended that the Trainer may save now (until on_save or the next step)

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
        ``fuyou/`` metrics it then adds to the logs in `on_log` (the console shows them too). The Trainer
        puts the callbacks a user passes after its integrations; there the metrics reach ``log_history``
        only::

            trainer = Trainer(..., callbacks=[fuyou])
            fuyou.place_before_integrations(trainer)
        """
        callbacks = trainer.callback_handler.callbacks
        if self not in callbacks:
            raise ConfigError("place_before_integrations: this FuyouCallback is not one of the Trainer's callbacks; "
                              "pass it in Trainer(callbacks=[...]) or trainer.add_callback(...) first")
        callbacks.remove(self)
        flow = next((i + 1 for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)), 0)
        callbacks.insert(flow, self)
        self._metrics_in_logs = True

    @property
    def engine(self) -> FuyouEngine | None:
        """The `FuyouEngine` of the run in progress (or of one that raised and was not yet ended)."""
        return self._run.engine if self._run is not None else None

    # -- start -------------------------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        _refuse_compiled(args, model)  # at Trainer(...), before anything is made (on_train_begin checks again)
        # Under torchrun / accelerate launch, before the Trainer wraps the model in DistributedDataParallel:
        # DDP must leave the streamed weights to FuyouAdamW, which sums their gradients itself.
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if model is not None and distributed:
            ignore_streamed_in_ddp(model, self.config)
        # Before train(resume_from_checkpoint=True) picks the newest checkpoint: set the incomplete ones aside.
        if args.should_save:
            hf_checkpoints.set_aside_incomplete(args.output_dir)
        if distributed:
            dist.barrier()  # no rank looks for a checkpoint before they are set aside

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        # A run that raised never reached on_train_end: end it before this one reads what it changed.
        for run in [r for r in _unended if r is self._run or r.model is model or r.args is args]:
            run.end()
        self._run, self._at, self._save_due, self._pending = None, None, False, None
        _refuse_compiled(args, model)
        if args.fp16 and getattr(args, "label_smoothing_factor", 0):
            raise ConfigError(f"fp16: got True with label_smoothing_factor={args.label_smoothing_factor}; FuyouCallback "
                              "scales the loss the model returns (outputs.loss), so the loss must come from the model: "
                              "drop label smoothing, or use bf16=True")
        if not isinstance(optimizer, AcceleratedOptimizer):
            raise ConfigError(f"FuyouCallback: the Trainer gave callbacks the optimizer {type(optimizer).__name__}, "
                              "not accelerate's AcceleratedOptimizer around a torch optimizer; train without "
                              "DeepSpeed, FSDP or SageMaker model parallelism")
        trainers = hf_internals.torch_optimizer(optimizer)  # the Trainer's AdamW: converted, then hooked
        resume = self._resume_folder(args, state)  # before anything is created on disk
        if resume is not None:
            token = self._resume_token(resume, state)  # refuses state that belongs to another checkpoint
        max_norm = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        optim_name = getattr(args.optim, "value", args.optim)
        # Under torchrun / accelerate launch the Trainer's model is a DistributedDataParallel, which averages
        # the gradients in backward: each rank then updates the parameters whose state it owns.
        parallel = (dict(process_group=dist.group.WORLD, gradients_averaged=True)
                    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else {})
        engine = FuyouEngine(model, trainers, config=self.config, max_grad_norm=max_norm,
                             release_grads=False, norm_order=model.parameters(), loss_scaling=True if args.fp16 else None,
                             where=f"TrainingArguments(optim={optim_name!r})", report=log.info, **parallel)
        try:
            if resume is not None:
                engine.load(resume, token)
            engine.expect_steps(state.max_steps - state.global_step if state.max_steps else None)
            self._run = _Run(engine, args, model, trainers, getattr(optimizer, "scaler", None))
        except BaseException as exc:
            undo_after(exc, engine.close)  # its own error reaches the user, not one of the clean-up
            raise
        self._at = (args, state)
        if args.should_save:
            hf_checkpoints.claim(args.output_dir)  # `fuyou clean` leaves this run's checkpoints alone

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

    @staticmethod
    def _resume_token(folder: str, state: Any) -> str:
        """The save in ``folder`` that belongs to the checkpoint the Trainer resumed from: the one its
        ``trainer_state.json`` records (``state.stateful_callbacks``), or else the one made for its step;
        anything else is refused, naming both files."""
        trainer_state = os.path.join(os.path.dirname(folder), TRAINER_STATE)
        fix = ("resume from a checkpoint whose fuyou_optimizer/ was written with it, or pass FuyouCallback(resume_from="
               "<checkpoint folder>) when the Trainer resumed from another folder than <output_dir>/checkpoint-<step>")
        saved = hf_checkpoints.recorded_save(state.stateful_callbacks)
        saved = saved if isinstance(saved, dict) else {}  # without a token: a save that followed the Trainer's files
        return commit.resolve_for_load(folder, saved.get("token") or None, saved.get("steps"), named_by=trainer_state,
                                       fix=fix, framework_step=state.global_step).name

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        """Add the last optimizer step's `FuyouEngine.metrics` (``fuyou/...``) to the entry the Trainer just
        put in ``state.log_history`` (``trainer_state.json``); after `place_before_integrations`, to the logs of
        the step too, which the ``report_to`` integrations and the console then show. Not by default: the
        Trainer's progress callback runs after the user's and would print every key at every logging step."""
        if self.engine is None or logs is None or "loss" not in logs:
            return  # evaluation logs and the closing train_runtime line carry no step
        metrics = self.engine.metrics() if self.log_metrics else {}
        if (self.engine.data_parallel or self.engine.scales_loss) and "grad_norm" in logs:
            # Data parallel: the Trainer took the norm of this rank's .grad, which holds the average only for
            # the parameters the rank owns (the comm hook sums each bucket onto its owners); fp16: of the
            # gradients as scaled by FuyouAdamW's loss scale. The optimizer's is the global, unscaled one.
            logs["grad_norm"] = metrics["grad_norm"] = self.engine.last_grad_norm
        if self._metrics_in_logs:
            logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_due = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer's own flow callback ran first: it says whether evaluation or a save follows now.
        # Land the updates left for the next forward before either reads the weights.
        if self.engine is not None and (control.should_evaluate or control.should_save):
            self.engine.flush()
        self._step_done(args, state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_done(args, state, control)

    # -- checkpoints -----------------------------------------------------------------------------------------
    def _step_done(self, args: Any, state: Any, control: Any) -> None:
        """The Trainer may save this step's checkpoint now (``control.should_save``, or an evaluation that
        finds a new best). Data parallel: every rank writes its part of fuyou's state first (a collective;
        the Trainer's save runs its callbacks' `state` on one rank only)."""
        if self.engine is None:
            return
        self._at, self._save_due = (args, state), bool(control.should_save or control.should_evaluate)
        if control.should_save and self.engine.data_parallel and not self._saved_for(state):
            self._save_state(args, state)

    def _checkpoint_dir(self, args: Any, state: Any) -> str:
        return os.path.join(args.output_dir, f"checkpoint-{state.global_step}")

    def _save_state(self, args: Any, state: Any) -> None:
        """Stream fuyou's state into ``checkpoint-<step>/fuyou_optimizer/<token>/``, recording the step."""
        folder = os.path.join(self._checkpoint_dir(args, state), STATE_FOLDER)
        self._pending = commit.begin(self.engine, folder, framework_step=state.global_step)
        self.fuyou_save = {"token": self._pending.token, "steps": self._pending.steps, "global_step": state.global_step}

    def _saved_for(self, state: Any) -> bool:
        return self.fuyou_save is not None and self.fuyou_save.get("global_step") == state.global_step \
            and self.fuyou_save.get("token") is not None

    def state(self) -> dict[str, Any]:
        """What the Trainer records of this callback in a checkpoint's ``trainer_state.json``
        (``ExportableState``): the fuyou save that belongs to the checkpoint (``fuyou_save``), the
        checkpoint's files and their sizes (``files``: `hf_checkpoints.checkpoint_files`) and the arguments
        that rebuild the callback (``restore_callback_states_from_checkpoint``).

        The Trainer calls it inside its save, after its model files and before ``trainer_state.json``
        (and before rotation removes older checkpoints): one process, fuyou's state is written here,
        so that a ``trainer_state.json`` on disk always names a complete save. Data parallel: the
        ranks wrote it at ``on_step_end``; if the Trainer saves a step it did not announce there
        (``save_strategy="best"``), the record says the state follows (`on_save` writes it)."""
        if self.engine is not None and self._at is not None and not self._saved_for(self._at[1]):
            args, state = self._at
            if self._save_due and not self.engine.data_parallel and os.path.isdir(self._checkpoint_dir(args, state)):
                self._save_state(args, state)
            else:  # a save this callback did not see coming: written after the Trainer's files, by on_save
                self.fuyou_save = {"pending": True, "global_step": state.global_step}
        files = {}
        if self.engine is not None and self._at is not None and os.path.isdir(self._checkpoint_dir(*self._at)):
            commit.make_durable(self._checkpoint_dir(*self._at))  # the Trainer's files so far, before rotation
            if isinstance(self.fuyou_save, dict):  # a removal cut short is told by a file missing (`hf_checkpoints`)
                files = hf_checkpoints.checkpoint_files(self._checkpoint_dir(*self._at))
        return {"args": {"config": self.config.to_dict(), "resume_from": self.resume_from,
                         "log_metrics": self.log_metrics},
                "attributes": {"fuyou_save": self.fuyou_save}, "files": files}

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Normally written inside the Trainer's save (`state`) or just before it (`_step_done`); else now.
        self._save_due = False
        if self.engine is not None and os.path.isdir(self._checkpoint_dir(args, state)):
            if not self._saved_for(state):
                self._save_state(args, state)
            # trainer_state.json and the rotation made durable; then the earlier saves in fuyou_optimizer/ go
            pending, self._pending = self._pending, None
            commit.commit(pending, [self._checkpoint_dir(args, state)], writer=args.should_save)

    # -- end -------------------------------------------------------------------------------------------------
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._run is None:
            return
        self._run.engine.flush()  # every rank, alike: the last step's weights (broadcast when sharded)
        self.summary = self._run.engine.summary()
        self.plan = self._run.engine.plan
        self.close()

    def close(self) -> None:
        """End this callback's run, if one is left: remove the hooks, put back ``args.max_grad_norm``
        (and accelerate's GradScaler), restore the weights of the last completed step and delete the
        swap files. Only needed after ``train()`` raised; a no-op otherwise."""
        run, self._run, self._at, self._save_due = self._run, None, None, False
        if run is not None:
            run.end()

    def __enter__(self) -> "FuyouCallback":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
