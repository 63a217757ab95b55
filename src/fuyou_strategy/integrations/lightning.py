"""Lightning: ``Trainer(strategy="fuyou")`` and ``Fabric(strategy="fuyou")``.

`FuyouStrategy` is a single-device strategy that hands the training loop's events to a
`FuyouEngine`:

- ``setup_optimizers`` converts the optimizer from ``configure_optimizers`` (``AdamW`` /
  ``Adam``, param groups, any LR scheduler) into `FuyouAdamW`, with the Trainer's
  ``gradient_clip_val`` as its exact ``max_grad_norm``;
- ``training_step`` tells the engine whether this micro-batch ends the accumulation window:
  Lightning runs the last micro-batch inside ``optimizer_step`` (as its closure) and the
  others outside it, which is exactly the signal needed;
- Lightning's own gradient clipping is replaced by a check: clipping after backward would
  act on gradients the optimizer has already consumed, so the optimizer clips instead
  (``"value"`` clipping, or a different value, is refused). As Lightning's DeepSpeed strategy
  does with its own precision plugin, the check lives in the precision plugin's class: the
  strategy uses a copy of the plugin Lightning gives it, of a subclass with that check; the
  user's plugin instance is never changed;
- fp16 (``precision="16-true"``/``"16-mixed"``): the optimizer does the loss scaling with
  ``GradScaler``'s rules (`FuyouAdamW`'s ``loss_scaling``): ``backward`` scales the loss, and the
  strategy's copy of a ``16-mixed`` plugin drops Lightning's own ``GradScaler``;
- checkpoints: the optimizer's SSD state (fp32 masters and moments) is streamed next to the
  ``.ckpt`` into a new save ``<ckpt>.fuyou/<token>/`` (checksummed); the ``.ckpt`` records the
  token, and the earlier saves there are removed only once the ``.ckpt`` is written, so the
  ``.ckpt`` on disk always names a complete save, whenever the process dies. ``ckpt_path=``
  streams it back and refuses a ``.ckpt`` whose save is not there (a mismatched pair), and
  ``remove_checkpoint`` (top-k pruning) removes it. Weights kept in bf16 are saved as their
  fp32 masters.

After ``fit`` the optimizer and its state stay available (e.g. for ``trainer.save_checkpoint``)
until the strategy is set up again or the process ends; the activation hooks are removed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import shutil
from typing import Any, Callable

import torch
import torch.distributed as dist
from .._extras import require
require(__name__, "lightning")  # without it: the error says which extra to install
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDeviceStrategy
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.constants import default_pg_timeout

from ..cleanup import undo_after
from ..config import ConfigError, FuyouConfig, auto_host_budget, available_memory, format_bytes, read_mapping
from ..engine import FuyouEngine, ignore_streamed_in_ddp
from ..optim.checkpoint import discard, find, remove_versions
from ..progress import share_display

__all__ = ["FuyouStrategy", "FuyouDDPStrategy", "FuyouFabricStrategy", "SIDECAR_SUFFIX", "register"]

SIDECAR_SUFFIX = ".fuyou"  # <checkpoint>.fuyou/ holds the optimizer's SSD state
_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")
_FP16 = ("16-mixed", "16-true")  # the optimizer scales the loss (FuyouAdamW's loss_scaling), not Lightning's GradScaler
_PRECISION_FIX = {
    "64-true": "FuyouAdamW trains float32, bfloat16 or float16 weights; use precision='32-true'",
}


def _check_precision(precision: str, supported: tuple[str, ...] = _PRECISIONS,
                     fixes: dict[str, str] = _PRECISION_FIX) -> None:
    if precision not in supported:
        fix = fixes.get(precision, f"use one of {list(supported)}")
        raise ConfigError(f"precision: got {precision!r}; the fuyou strategy supports {list(supported)}: {fix}")


class _EngineOwner:
    """A strategy that holds a `FuyouEngine` while it trains."""

    engine: FuyouEngine | None

    def _close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


class _OneDevice(_EngineOwner):
    """What the one-device Trainer and Fabric strategies share: the config, and one device that
    Lightning's connector fills in (``parallel_devices``) from ``accelerator=``/``devices=`` when none
    is given."""

    _root_device: torch.device

    def _init_one_device(self, device: Any, config: Any, config_fields: dict) -> None:
        self.fuyou_config = FuyouConfig.resolve(config, **config_fields)
        self.parallel_devices: list[torch.device] | None = [torch.device(device)] if device is not None else None
        self.engine: FuyouEngine | None = None

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[0] if self.parallel_devices else self._root_device

    def _check_single_device(self) -> None:
        if self.parallel_devices and len(self.parallel_devices) > 1:
            raise ConfigError(f"devices: got {len(self.parallel_devices)} devices; the fuyou strategy trains on one "
                              "device (devices=1); for data parallelism use the Trainer's strategy='fuyou_ddp'")


class _ClipsInOptimizer:
    """Mixed into the class of the Trainer's precision plugin (see `_clipping_in_optimizer`):
    `FuyouAdamW` clips, exactly, in ``step()``, so the plugin's clipping becomes a check that the
    optimizer clips to the value asked for."""

    def clip_gradients(self, optimizer: Any, clip_val: float | int = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if not clip_val or clip_val <= 0:
            return
        if gradient_clip_algorithm is not GradClipAlgorithmType.NORM:
            raise ConfigError("gradient clipping by value is not supported by the fuyou strategy; clip by norm")
        configured = getattr(optimizer, "max_grad_norm", None)
        if configured != float(clip_val):
            raise ConfigError(
                f"clip_gradients: got gradient_clip_val={clip_val} but the optimizer clips to {configured}; with the "
                "fuyou strategy set the norm once, with Trainer(gradient_clip_val=...): gradients are consumed "
                "during backward, so clipping them afterwards is too late"
            )

    def __reduce__(self) -> tuple:
        # The class is made at run time (`_clipping_class`): pickle (e.g. to spawned ranks) the plugin
        # as its own class and mix the check in again on the other side.
        plain = object.__new__(type(self).__bases__[1])
        plain.__dict__.update(self.__dict__)
        return _clipping_in_optimizer, (plain,)


@functools.cache
def _clipping_class(cls: type) -> type:
    # The same __qualname__: Lightning files a plugin's state in checkpoints under it.
    return type(cls.__name__, (_ClipsInOptimizer, cls), {"__qualname__": cls.__qualname__})


def _clipping_in_optimizer(plugin: Precision) -> Precision:
    """A shallow copy of ``plugin`` whose class is its own with `_ClipsInOptimizer` mixed in;
    ``plugin`` itself is left as it is."""
    if isinstance(plugin, _ClipsInOptimizer):
        return plugin
    ours = copy.copy(plugin)
    ours.__class__ = _clipping_class(type(plugin))
    if getattr(ours, "scaler", None) is not None:  # 16-mixed: FuyouAdamW scales, unscales and skips itself
        ours.scaler = None
    return ours


def sidecar(filepath: str | os.PathLike) -> str:
    """Where the optimizer state of the checkpoint at ``filepath`` lives."""
    return os.fspath(filepath) + SIDECAR_SUFFIX


def _other_checkpoints(path: str) -> str:
    """What to resume from instead of the checkpoint at ``path``."""
    where = os.path.dirname(os.path.abspath(path))
    others = sorted(n for n in os.listdir(where) if n.endswith(".ckpt") and n != os.path.basename(path))
    if not others:
        return f"there is no other checkpoint in {where}: start the run afresh"
    return f"resume from another checkpoint in {where} ({', '.join(others)})"


class _FuyouTrainerStrategy(_EngineOwner):
    """What `FuyouStrategy` (one device) and `FuyouDDPStrategy` (data parallel) share: the engine's
    lifecycle in the Trainer's hooks, clipping in the optimizer, metrics, checkpoints and teardown.
    Mixed in before the Lightning strategy it extends, whose methods its ``super()`` calls reach."""

    fuyou_config: FuyouConfig
    log_metrics: bool
    _in_optimizer_step: bool

    def _check_devices(self, trainer: Any) -> None:
        """Refuse a device layout this strategy cannot train (before anything is created on disk)."""

    def _data_parallel(self) -> dict[str, Any]:
        """The `FuyouEngine` arguments of data parallelism (none on one device)."""
        return {}

    def _engine_made(self) -> None:
        """After the engine is made (and the model wrapped): what the layout adds to it."""

    @property
    def precision_plugin(self) -> Precision:
        """The precision plugin Lightning set, as a copy whose clipping checks `FuyouAdamW`'s."""
        return self._precision_plugin if self._precision_plugin is not None else _clipping_in_optimizer(Precision())

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = _clipping_in_optimizer(plugin) if plugin is not None else None

    # -- setup -------------------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_trainer(trainer)  # before anything is created on disk
        self._close_engine()
        bar = trainer.progress_bar_callback
        if type(bar).__name__ == "RichProgressBar":  # fuyou's progress as tasks of Lightning's rich display
            share_display(lambda: getattr(bar, "progress", None))
        super().setup(trainer)

    def _check_trainer(self, trainer: Any) -> None:
        self._check_devices(trainer)
        _check_precision(str(self.precision_plugin.precision))
        algorithm = trainer.gradient_clip_algorithm
        if trainer.gradient_clip_val and algorithm is not None and GradClipAlgorithmType(algorithm) is GradClipAlgorithmType.VALUE:
            raise ConfigError(
                "gradient_clip_algorithm: got 'value'; the fuyou strategy clips the global gradient norm, exactly, "
                "inside the optimizer: use gradient_clip_algorithm='norm'"
            )
        if not self.lightning_module.automatic_optimization:
            raise ConfigError(
                "automatic_optimization: got False; the fuyou strategy drives the optimizer through Lightning's "
                "automatic optimization (manual optimization with FuyouAdamW: use fuyou_strategy.FuyouAdamW directly)"
            )

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ConfigError(
                f"configure_optimizers: returned {len(self.optimizers)} optimizers; the fuyou strategy trains with one "
                "AdamW (use param groups for different hyper-parameters)"
            )
        clip = trainer.gradient_clip_val
        fp16 = str(self.precision_plugin.precision) in _FP16
        self.engine = FuyouEngine(self.lightning_module, self.optimizers[0], config=self.fuyou_config,
                                  max_grad_norm=float(clip) if clip else None, where="configure_optimizers",
                                  report=rank_zero_info, loss_scaling=True if fp16 else None,
                                  **self._data_parallel())
        try:
            self._engine_made()
            self.engine.rebind_schedulers(cfg.scheduler for cfg in self.lr_scheduler_configs)
            if trainer.state.fn == "fit":
                steps = trainer.estimated_stepping_batches  # the run's length, for the SSD wear projection
                self.engine.expect_steps(int(steps) if math.isfinite(steps) else None)
        except BaseException as exc:
            engine, self.engine = self.engine, None
            undo_after(exc, engine.close)  # its own error reaches the user, not one of the clean-up
            raise
        self.optimizers = [self.engine.optimizer]

    # -- the step ------------------------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is not None:
            # The last micro-batch of a window runs as optimizer_step's closure; the others do not.
            self.engine.begin_micro_batch(update=self._in_optimizer_step)
        return super().training_step(*args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.engine is not None and self.engine.scales_loss:  # fp16: GradScaler.scale's place
            closure_loss = self.engine.scale_loss(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        self._in_optimizer_step = True
        try:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            self._in_optimizer_step = False
        self._log_metrics()
        return out

    def _log_metrics(self) -> None:
        """The step's `FuyouEngine.metrics` to the Trainer's loggers (every ``log_every_n_steps``, as
        Lightning logs ``on_step`` values); ``fuyou/ssd_write_gbps`` also on the progress bar."""
        module = self.lightning_module
        metrics = self.engine.metrics() if self.engine is not None and self.log_metrics else {}
        if not metrics or module is None or getattr(module, "_current_fx_name", None) is None:
            return  # no step yet, or called outside the Trainer's loop (nothing to log into)
        to_loggers = bool(module.trainer.loggers)  # without one, Lightning would warn on every key
        for name, value in metrics.items():
            bar = name == "fuyou/ssd_write_gbps"
            if to_loggers or bar:
                module.log(name, value, on_step=True, on_epoch=False, prog_bar=bar, logger=to_loggers)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.engine is None or not checkpoint.get("optimizer_states"):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        folder = sidecar(filepath)
        state = self.engine.save(folder, keep_previous=True)  # the earlier saves still belong to the .ckpt on disk
        state["fuyou"]["folder"] = os.path.basename(folder)  # relative: the pair can be moved together
        checkpoint["optimizer_states"] = [state]
        self._masters_into(checkpoint)
        token = state["fuyou"]["token"]
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options)  # atomic: the old .ckpt or the new one
        except BaseException:
            discard(os.path.join(folder, token))
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # if empty: made by this save
            raise
        if self.is_global_zero:  # data parallel: the ranks share the folder; only rank 0 wrote the .ckpt
            remove_versions(folder, keep=token)

    def _masters_into(self, checkpoint: dict[str, Any]) -> None:
        """Weights kept in bf16 go into the checkpoint as their fp32 masters."""
        masters = self.engine.master_weights()
        if not masters:
            return
        names = {p: name for name, p in self.lightning_module.named_parameters()}
        for p, master in masters.items():
            if names.get(p) in checkpoint.get("state_dict", {}):
                checkpoint["state_dict"][names[p]] = master

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        path = os.fspath(checkpoint_path)
        for state in checkpoint.get("optimizer_states", []):
            record = state.get("fuyou", {})
            if record.get("folder") is None:
                continue
            record["folder"] = os.path.join(os.path.dirname(path), record["folder"])  # unchanged if absolute
            # Refuse a mismatched pair before anything is restored, naming the .ckpt.
            find(record["folder"], record.get("token"), record.get("steps"), named_by=path, fix=_other_checkpoints(path))
        return checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        shutil.rmtree(sidecar(filepath), ignore_errors=True)

    # -- pending updates: landed before anything reads the weights outside a training forward ---------------
    def _flush(self) -> None:
        if self.engine is not None and not self.engine.closed:
            self.engine.flush()

    def on_validation_start(self) -> None:
        self._flush()  # the forward would wait module by module; landing them first is simpler to reason about
        super().on_validation_start()

    def on_test_start(self) -> None:
        self._flush()
        super().on_test_start()

    def on_predict_start(self) -> None:
        self._flush()
        super().on_predict_start()

    def on_train_end(self) -> None:
        self._flush()
        if self.engine is not None:
            self.engine.end_trace()  # a run shorter than the trace window: write what was recorded
        super().on_train_end()

    # -- teardown ----------------------------------------------------------------------------------------------
    def teardown(self) -> None:
        if self.engine is not None:
            self._flush()  # the model outlives fit with its final weights
            self.engine.stop_updates()  # a stray backward after fit queues nothing
            if self.engine.swapper is not None:
                self.engine.swapper.uninstall()
        share_display(None)
        super().teardown()



class FuyouStrategy(_FuyouTrainerStrategy, _OneDevice, SingleDeviceStrategy):
    """Train one device's model with Fuyou: SSD-resident AdamW updated during backward, exact
    clipping, and activation swapping.

    ``Trainer(strategy="fuyou")`` uses the defaults (a temporary swap directory, 2 GiB host
    budget, no activation swapping); ``Trainer(strategy=FuyouStrategy(swap_dirs=["/nvme0"],
    activations="ssd"))`` sets any `FuyouConfig` field, and ``config=`` takes a
    `FuyouConfig`, a dict or a ``.json``/``.yaml`` path (keyword fields override it).

    Supported: automatic optimization with ``torch.optim.AdamW`` / ``Adam`` (+ schedulers),
    precision ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ``accumulate_grad_batches``,
    ``gradient_clip_val`` with the ``"norm"`` algorithm, one device (CPU or one GPU).
    Refused with a clear error: fp16 precisions, ``gradient_clip_algorithm="value"``, manual
    optimization, several optimizers or devices, optimizers other than Adam/AdamW.

    Every optimizer step's `FuyouEngine.metrics` (grad norm, clipping, schedule, SSD bytes and
    GB/s, host and device high-water marks, ...) go to the Trainer's loggers under ``fuyou/``, and
    ``fuyou/ssd_write_gbps`` to the progress bar; ``log_metrics=False`` turns that off.
    """

    strategy_name = "fuyou"

    def __init__(
        self,
        config: FuyouConfig | dict | str | None = None,
        *,
        device: Any = None,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        log_metrics: bool = True,
        **config_fields: Any,
    ) -> None:
        super().__init__(device=device if device is not None else "cpu", accelerator=accelerator,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._init_one_device(device, config, config_fields)
        self._in_optimizer_step = False
        self.log_metrics = log_metrics

    def _check_devices(self, trainer: Any) -> None:
        self._check_single_device()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Fuyou: SSD-offloaded AdamW and activations")


class FuyouDDPStrategy(_FuyouTrainerStrategy, DDPStrategy):
    """Data-parallel Fuyou: ``Trainer(strategy="fuyou_ddp", devices=N)`` (and ``num_nodes``), launched
    by Lightning's own launcher, each rank owning ~1/N of the SSD optimizer state.

    Lightning's ``DDPStrategy`` wraps the model in ``DistributedDataParallel``, which averages the
    gradients during backward (and skips that for the micro-batches that only accumulate); at
    ``step()`` each rank clips on the same global norm and queues the updates of the parameters whose
    state it owns, from its own swap directories (`optim.distributed`): under the ``backward``
    schedule during backward, as each DDP bucket's average lands (`FuyouAdamW.ddp_comm_hook`), under
    ``next_forward`` ahead of the next forward; that forward broadcasts each module's weights from
    their owners as it reaches them. ``"auto"`` chooses per step, rank 0's choice for all ranks. Config fields and
    ``log_metrics`` as for `FuyouStrategy`; the other arguments are ``DDPStrategy``'s
    (``start_method="spawn"`` to launch from a notebook or a test).

    Checkpoints store parameters, not rank shards (every rank writes the state it owns next to the
    ``.ckpt``): one saved with N ranks resumes with M, one included, and ``strategy="fuyou"``'s load
    into N ranks. With ``weights="ssd"``/``"host"`` (or a pinned plan's tiers) every rank streams the
    blocks' weights from its own tier copies; DDP is told to leave those parameters alone (with
    ``weights="auto"`` every block's: the planner applies rank 0's plan after the warm-up), and the
    optimizer sums their gradients over the ranks at ``step()`` (the ``next_forward`` schedule).
    fp16 (``16-true``/``16-mixed``): every rank scales alike and skips alike.
    """

    strategy_name = "fuyou_ddp"

    def __init__(self, config: FuyouConfig | dict | str | None = None, *, log_metrics: bool = True,
                 accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision_plugin: Any = None,
                 process_group_backend: str | None = None, timeout: Any = default_pg_timeout,
                 start_method: str = "popen", **config_fields: Any) -> None:
        self.fuyou_config = FuyouConfig.resolve(config, **config_fields)
        self._auto_budget = _asks_auto_budget(config, config_fields)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self.engine = None
        self._in_optimizer_step = False
        self.log_metrics = log_metrics

    def _data_parallel(self) -> dict[str, Any]:
        return {"process_group": dist.group.WORLD, "gradients_averaged": True}  # DDP averaged them in backward

    def setup_optimizers(self, trainer: Any) -> None:
        self.share_auto_budget()
        super().setup_optimizers(trainer)

    def share_auto_budget(self) -> None:
        """``host_memory_budget="auto"``: this machine's ranks share the RAM. The config was resolved in the
        process that made the strategy, for one process; each rank takes its share instead (`auto_host_budget`
        with ``ranks`` = the processes on this node), once."""
        if not self._auto_budget or self.num_processes <= 1:
            return
        self._auto_budget = False
        budget, why = auto_host_budget(available_memory(), self.num_processes)
        self.fuyou_config = self.fuyou_config.replace(host_memory_budget=budget)
        rank_zero_info(f"fuyou: host_memory_budget='auto' took {format_bytes(budget)} per rank: {why}")

    def configure_ddp(self) -> None:
        # Before the wrap: DDP leaves the streamed weights to FuyouAdamW (it sums their gradients itself).
        ignore_streamed_in_ddp(self.model, self.fuyou_config)
        super().configure_ddp()

    def _engine_made(self) -> None:
        if self.engine.data_parallel:  # updates as DDP's buckets land (backward schedule)
            self.engine.attach_ddp(self.model)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls,
                                   description="Fuyou, data parallel: each rank owns a shard of the SSD optimizer state")


def _asks_auto_budget(config: Any, fields: dict) -> bool:
    """Whether the strategy's config leaves ``host_memory_budget`` at ``"auto"`` (a `FuyouConfig` object has
    resolved it to a number already: that number stands)."""
    if "host_memory_budget" in fields:
        return fields["host_memory_budget"] == "auto"
    if config is None:
        return FuyouConfig.__dataclass_fields__["host_memory_budget"].default == "auto"
    if isinstance(config, dict):
        return config.get("host_memory_budget", "auto") == "auto"
    if isinstance(config, (str, os.PathLike)):
        return read_mapping(config).get("host_memory_budget", "auto") == "auto"
    return False


class FuyouFabricStrategy(_OneDevice, FabricSingleDeviceStrategy):
    """``Fabric(strategy="fuyou")``: ``fabric.setup(model, optimizer)`` converts the AdamW.

    Mark micro-batches that only accumulate with ``with optimizer.no_update():`` (Fabric makes
    ``no_backward_sync`` a no-op on one device; a second backward without ``no_update`` is a
    clear error at ``step()``, never a silent partial update). Set the clipping norm with
    ``FuyouFabricStrategy(max_grad_norm=...)``: ``fabric.clip_gradients`` with the same value
    is accepted, anything else refused. Config fields as for `FuyouStrategy`.
    """

    def __init__(self, config: FuyouConfig | dict | str | None = None, *, device: Any = None,
                 max_grad_norm: float | None = None, accelerator: Any = None, checkpoint_io: Any = None,
                 precision: Any = None, **config_fields: Any) -> None:
        super().__init__(device=device if device is not None else "cpu", accelerator=accelerator,
                         checkpoint_io=checkpoint_io, precision=precision)
        self._init_one_device(device, config, config_fields)
        self.max_grad_norm = max_grad_norm
        self._hook: Any = None  # the forward pre-hook on the set-up module

    def setup_module_and_optimizers(self, module: Any, optimizers: list, scheduler: Any = None) -> tuple:
        self._check_single_device()
        fp16_fix = ("with Fabric, fp16 loss scaling is not wired yet: use bf16, the Trainer's strategy, or "
                    "FuyouAdamW(loss_scaling=True) directly")
        _check_precision(str(self.precision.precision), tuple(p for p in _PRECISIONS if p not in _FP16),
                         {**_PRECISION_FIX, **dict.fromkeys(_FP16, fp16_fix)})
        if len(optimizers) != 1:
            raise ConfigError(f"fabric.setup: got {len(optimizers)} optimizers; the fuyou strategy trains with one AdamW")
        module = self.setup_module(module)
        self._close_engine()  # a second setup replaces the first one's engine and hook
        # Fabric's loop is the user's own and may read the weights anywhere after optimizer.step(), as
        # torch.optim promises: step() lands every update itself (next_forward then saves the redo, not the wait).
        self.engine = FuyouEngine(module, optimizers[0], config=self.fuyou_config, max_grad_norm=self.max_grad_norm,
                                  where="fabric.setup", report=rank_zero_info, defer_updates=False)
        if scheduler is not None:
            self.engine.rebind_schedulers([scheduler])
        self._hook = module.register_forward_pre_hook(self._before_forward)
        return module, [self.engine.optimizer], scheduler

    def _before_forward(self, module: Any, args: Any) -> None:
        if module.training and torch.is_grad_enabled() and self.engine is not None:
            self.engine.begin_micro_batch()  # updates stay as `optimizer.no_update()` sets them

    def clip_gradients_norm(self, module: Any, optimizer: Any, max_norm: float | int, norm_type: float | int = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        if self.max_grad_norm != float(max_norm) or norm_type != 2.0:
            raise ConfigError(
                f"fabric.clip_gradients: got max_norm={max_norm} (norm_type={norm_type}); with the fuyou strategy the "
                "optimizer clips the L2 norm exactly, set once with FuyouFabricStrategy(max_grad_norm=...)"
            )
        return torch.tensor(float("nan"))  # known only at optimizer.step(): see optimizer.stats.last_grad_norm

    def clip_gradients_value(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError("fabric.clip_gradients(clip_val=...): clipping by value is not supported by the fuyou strategy")

    def _close_engine(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        super()._close_engine()

    def teardown(self) -> None:
        self._close_engine()
        super().teardown()


def register() -> None:
    """Register ``"fuyou"`` with Lightning's Trainer and Fabric (done on ``import fuyou_strategy``)."""
    if "fuyou" not in StrategyRegistry:
        FuyouStrategy.register_strategies(StrategyRegistry)
    if "fuyou_ddp" not in StrategyRegistry:
        FuyouDDPStrategy.register_strategies(StrategyRegistry)
    if "fuyou" not in FABRIC_REGISTRY:
        FABRIC_REGISTRY.register("fuyou", FuyouFabricStrategy, description="Fuyou: SSD-offloaded AdamW and activations")
