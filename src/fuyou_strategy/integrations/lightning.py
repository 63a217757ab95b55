"""Lightning: ``Trainer(strategy="fuyou")`` and ``Fabric(strategy="fuyou")`` / ``"fuyou_ddp"``.

`FuyouStrategy` takes any ``devices``/``num_nodes``: one process runs as a single-device
strategy, several are launched and connected as Lightning's ``DDPStrategy`` does (the internals
that takes are in `lightning_internals`), each rank owning a shard of the optimizer state. It
hands the training loop's events to a `FuyouEngine`:

- ``setup_optimizers`` converts the optimizer from ``configure_optimizers`` (``AdamW`` /
  ``Adam``, param groups, any LR scheduler) into `FuyouAdamW`, with the Trainer's
  ``gradient_clip_val`` as its exact ``max_grad_norm``;
- ``training_step`` tells the engine whether this micro-batch ends the accumulation window:
  Lightning runs the last micro-batch inside ``optimizer_step`` (as its closure) and the
  others outside it, which is exactly the signal needed;
- Lightning's own gradient clipping is replaced by a check: clipping after backward would
  act on gradients the optimizer has already consumed, so the optimizer clips instead
  (``"value"`` clipping, or a different value, is refused). As Lightning's DeepSpeed strategy
  does with its own precision plugin, the check lives in the precision plugin: the strategy
  uses its own named subclass of the Lightning plugin that ``precision=`` chose
  (`FuyouPrecision`, `FuyouMixedPrecision`, `FuyouHalfPrecision`); the plugin Lightning made is
  never changed;
- fp16 (``precision="16-true"``/``"16-mixed"``): the optimizer does the loss scaling with
  ``GradScaler``'s rules (`FuyouAdamW`'s ``loss_scaling``): ``backward`` scales the loss, and
  `FuyouMixedPrecision` has no ``GradScaler`` of its own;
- checkpoints: the optimizer's SSD state (fp32 masters and moments) is streamed next to the
  ``.ckpt`` into a new save ``<ckpt>.fuyou/<token>/``, which the ``.ckpt`` names, by the commit
  protocol (`..commit`): the earlier saves go only once the ``.ckpt`` is durable
  (`DurableCheckpointIO` writes it so), ``ckpt_path=`` refuses a ``.ckpt`` whose save is not there,
  and ``remove_checkpoint`` (top-k pruning) removes the save after the ``.ckpt``. Weights kept in
  bf16 are saved as their fp32 masters.

After ``fit`` the optimizer and its state stay available (e.g. for ``trainer.save_checkpoint``)
until the strategy is set up again or the process ends; the activation hooks are removed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.constants import default_pg_timeout
from torch.nn.parallel import DistributedDataParallel

from .._extras import require

require(__name__, "lightning")  # without it: the error says which extra to install
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY  # noqa: E402
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy  # noqa: E402
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDeviceStrategy  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.fabric.utilities.cloud_io import get_filesystem  # noqa: E402
from lightning.fabric.utilities.seed import reset_seed  # noqa: E402
from lightning.pytorch.callbacks import RichProgressBar  # noqa: E402
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision  # noqa: E402
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only  # noqa: E402
from typing_extensions import override  # noqa: E402 (a dependency of lightning)

from .lightning_internals import (_default_backend, _init_dist_connection, _logs_this_step, _MultiProcessingLauncher,
                                  _SubprocessScriptLauncher, _sync_ddp_if_available)

from ..cleanup import undo_after
from ..config import ConfigError, FuyouConfig
from ..engine import FuyouEngine, ignore_streamed_in_ddp
from .. import commit
from ..progress import share_display

__all__ = ["DurableCheckpointIO", "FuyouStrategy", "FuyouDDPStrategy", "FuyouFabricStrategy", "FuyouFabricDDPStrategy", "SIDECAR_SUFFIX", "register"]

SIDECAR_SUFFIX = ".fuyou"  # <checkpoint>.fuyou/ holds the optimizer's SSD state
log = logging.getLogger("fuyou_strategy")
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


def _is_local(path: Any) -> bool:
    return isinstance(get_filesystem(path), LocalFileSystem)


class DurableCheckpointIO(TorchCheckpointIO):
    """Lightning's `TorchCheckpointIO`, writing a local ``.ckpt`` so that it survives a power cut:
    beside the old file, fsynced, renamed over it, the folder fsynced (`commit.write_durably`). A power cut
    at any instant leaves the old ``.ckpt`` or the new one, whole. The fuyou strategies' default; a remote
    path is written as Lightning writes it."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)  # refuses storage_options, as Lightning
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        commit.write_durably(path, lambda f: torch.save(checkpoint, f))


class _EngineOwner:
    """What the Trainer's and Fabric's fuyou strategies share: the config, the engine they hold while they
    train, and the layout, one process or several, which Lightning fills in (``parallel_devices``,
    ``num_nodes``) from ``devices=``/``num_nodes=`` after the strategy is made."""

    engine: FuyouEngine | None
    fuyou_config: FuyouConfig
    parallel_devices: list[torch.device] | None
    num_processes: int
    num_nodes: int
    local_rank: int

    def _init_fuyou(self, config: Any, config_fields: dict, device: Any,
                    parallel_devices: list[torch.device] | None) -> list[torch.device] | None:
        """Merge the config (a value: each rank's engine resolves it, `config.resolve`); returns the strategy's
        ``parallel_devices`` (``device=`` is one of them)."""
        self.fuyou_config = FuyouConfig.merge(config, **config_fields)
        self.engine = None
        if device is None:
            return parallel_devices
        if parallel_devices is not None:
            raise ConfigError(f"device: got {device!r} together with parallel_devices={parallel_devices!r}; "
                              "give one of them (device= is parallel_devices=[device])")
        return [torch.device(device)]

    @property
    def data_parallel(self) -> bool:
        """Whether this run has more than one process (known once Lightning set the devices and nodes)."""
        return self.num_processes * self.num_nodes > 1

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank] if self.parallel_devices else torch.device("cpu")

    def _parallel_engine_arguments(self) -> dict[str, Any]:
        """The `FuyouEngine` arguments of the layout: this node's processes share its RAM (``host_memory_budget=
        "auto"``); data parallelism's process group (none in one process), whose gradients DDP averaged."""
        layout = {"local_ranks": max(1, self.num_processes)}
        if self.data_parallel:
            layout.update(process_group=dist.group.WORLD, gradients_averaged=True)
        return layout

    def _ddp_wrap(self, module: torch.nn.Module, ddp_kwargs: dict[str, Any]) -> DistributedDataParallel:
        ignore_streamed_in_ddp(module, self.fuyou_config)  # DDP leaves the streamed weights to FuyouAdamW
        device_ids = None if self.root_device.type == "cpu" else [self.root_device.index]
        return DistributedDataParallel(module, device_ids=device_ids, **ddp_kwargs)

    def _close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    @property
    def checkpoint_io(self) -> Any:
        """Lightning's, unless none was given: then `DurableCheckpointIO`."""
        if self._checkpoint_io is None:
            self._checkpoint_io = DurableCheckpointIO()
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io


class _ClipsInOptimizer:
    """The precision plugins' clipping, for `FuyouAdamW`: it clips, exactly, in ``step()``, so the
    plugin's clipping becomes a check that the optimizer clips to the value asked for."""

    @override
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


class FuyouPrecision(_ClipsInOptimizer, Precision):
    """``precision="32-true"`` with the fuyou strategy: Lightning's `Precision`, clipping in the optimizer."""


class FuyouMixedPrecision(_ClipsInOptimizer, MixedPrecision):
    """``"bf16-mixed"`` / ``"16-mixed"``: Lightning's `MixedPrecision` (autocast), clipping in the optimizer
    and, for ``16-mixed``, no GradScaler of its own: `FuyouAdamW` scales, unscales and skips itself."""

    def __init__(self, precision: str, device: str) -> None:
        super().__init__(precision, device)
        self.scaler = None


class FuyouHalfPrecision(_ClipsInOptimizer, HalfPrecision):
    """``"bf16-true"`` / ``"16-true"``: Lightning's `HalfPrecision`, clipping in the optimizer."""


def _fuyou_precision(plugin: Precision) -> Precision:
    """The fuyou counterpart of the precision plugin Lightning made for ``Trainer(precision=...)`` (the
    strategy's own instance: the one given is left as it is). Lightning's own plugins only: a custom
    subclass may change what backward or the optimizer step do, which FuyouAdamW takes over."""
    if isinstance(plugin, _ClipsInOptimizer):
        return plugin
    kind = type(plugin)
    if kind is Precision:
        return FuyouPrecision()
    if kind is MixedPrecision:
        return FuyouMixedPrecision(plugin.precision, plugin.device)
    if kind is HalfPrecision:
        return FuyouHalfPrecision(plugin.precision)
    _check_precision(str(getattr(plugin, "precision", None)))  # 64-true and the like: refused with their fix
    raise ConfigError(
        f"precision_plugin: got {kind.__qualname__}; the fuyou strategy takes Lightning's own precision plugins, "
        f"chosen with Trainer(precision=...) from {list(_PRECISIONS)}; drop the custom plugin")


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


class FuyouStrategy(_EngineOwner, ParallelStrategy):
    """Train with Fuyou on one device or several: SSD-resident AdamW updated during backward, exact
    clipping, activation swapping and weight streaming.

    ``Trainer(strategy="fuyou")`` works with any ``devices=``/``num_nodes=``, as ``strategy="ddp"`` or
    ``"deepspeed"`` do; ``Trainer(strategy=FuyouStrategy(swap_dirs=["/nvme0"], activations="ssd"))``
    sets any `FuyouConfig` field, and ``config=`` takes a `FuyouConfig`, a dict or a
    ``.json``/``.yaml`` path (keyword fields override it).

    **One process** (one device, one node): a single-device strategy, as ``strategy="auto"`` picks on
    one device: no process group, no ``DistributedDataParallel``, and the data loaders keep their own
    samplers (a ``strategy="ddp"`` at ``devices=1`` would swap in a shuffling ``DistributedSampler``).

    **Several** (``devices=N``, ``num_nodes``): launched by Lightning's own launchers as ``"ddp"`` is
    (``start_method="spawn"`` to launch from a notebook or a test; ``"popen"``, the default, re-runs
    the script), each rank owning ~1/N of the SSD optimizer state (`fuyou_strategy.optim.distributed`).
    The model is wrapped in ``DistributedDataParallel``, which averages the gradients during backward
    (and skips that for micro-batches that only accumulate); at ``step()`` each rank clips on the same
    global norm and updates the parameters whose state it owns, from its own swap directories: under
    the ``backward`` schedule during backward, as each DDP bucket's sum lands on its owners
    (`OptimizerControl.ddp_comm_hook`), under ``next_forward`` ahead of the next forward, which broadcasts
    each module's weights from their owners as it reaches them. Checkpoints store parameters, not rank
    shards: one saved with N ranks resumes with M, one included. With streamed weights
    (``weights="ssd"``/``"host"``/``"auto"``) DDP is told to leave them to the optimizer, which sums
    their gradients over the ranks. ``"fuyou_ddp"`` and `FuyouDDPStrategy` are other names of this
    strategy, kept for scripts written before it took any device count.

    Supported: automatic optimization with ``torch.optim.AdamW`` / ``Adam`` (+ schedulers),
    precision ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"16-mixed"``, ``"16-true"`` (the
    optimizer scales the loss), ``accumulate_grad_batches``, ``gradient_clip_val`` with the
    ``"norm"`` algorithm. Refused with a clear error: ``gradient_clip_algorithm="value"``, manual
    optimization, several optimizers, optimizers other than Adam/AdamW, a compiled model
    (``torch.compile``: the fuyou hooks must run eagerly).

    Every optimizer step's `FuyouEngine.metrics` (grad norm, clipping, schedule, SSD bytes and
    GB/s, host and device high-water marks, ...) go to the Trainer's loggers under ``fuyou/``, and
    ``log_metrics=False`` turns that off (nothing goes to the progress bar).
    """

    strategy_name = "fuyou"

    def __init__(self, config: FuyouConfig | dict | str | None = None, *, device: Any = None,
                 log_metrics: bool = True, accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision_plugin: Any = None,
                 process_group_backend: str | None = None, timeout: Any = default_pg_timeout,
                 start_method: str = "popen", ddp_kwargs: dict[str, Any] | None = None, **config_fields: Any) -> None:
        parallel_devices = self._init_fuyou(config, config_fields, device, parallel_devices)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._num_nodes = 1
        self._trainer: Any = None  # the Trainer this strategy is set up for (setup), for its public state
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self._in_optimizer_step = False
        self.log_metrics = log_metrics

    # -- the layout: one process, or Lightning's DDP launch ------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def is_distributed(self) -> bool:
        """Lightning's question to a strategy it does not know: whether the data loaders need a
        ``DistributedSampler``. Only with several processes."""
        return self.data_parallel

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """Called by Lightning once the devices and nodes are known (as ``DDPStrategy.set_world_ranks``)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def _configure_launcher(self) -> None:
        if not self.data_parallel:
            self._launcher = None  # one process: run in this one, as SingleDeviceStrategy does
        elif self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.data_parallel:
            reset_seed()
            self.set_world_ranks()
            backend = self._process_group_backend or _default_backend(self.root_device)
            _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout,
                                  device_id=self.root_device if self.root_device.type != "cpu" else None)

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Called by ``Strategy.setup`` after the model is on its device. One process: the model as it is.
        Several, fitting: wrapped in ``DistributedDataParallel``, which first leaves the streamed weights
        to FuyouAdamW (it sums their gradients itself); not fitting: rank 0's weights for every rank."""
        if not self.data_parallel:
            return model
        if self._trainer is not None and self._trainer.state.fn != TrainerFn.FITTING:
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
            return model
        return self._ddp_wrap(model, self._ddp_kwargs)

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- what the layout adds to the engine ------------------------------------------------------------------
    def _engine_made(self) -> None:
        if self.engine.data_parallel:  # updates as DDP's buckets land (backward schedule)
            self.engine.attach_ddp(self.model)

    @property
    @override
    def precision_plugin(self) -> Precision:
        """The fuyou counterpart of the precision plugin Lightning set (`_fuyou_precision`)."""
        if self._precision_plugin is None:
            self._precision_plugin = FuyouPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = _fuyou_precision(plugin) if plugin is not None else None

    # -- setup -------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_trainer(trainer)  # before anything is created on disk
        self._close_engine()
        self._trainer = trainer
        bar = trainer.progress_bar_callback
        if isinstance(bar, RichProgressBar):  # fuyou's progress as tasks of Lightning's rich display
            share_display(lambda: getattr(bar, "progress", None))
        super().setup(trainer)

    def _check_trainer(self, trainer: Any) -> None:
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

    @override
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
                                  **self._parallel_engine_arguments())
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
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is not None:
            # The last micro-batch of a window runs as optimizer_step's closure; the others do not.
            self.engine.begin_micro_batch(update=self._in_optimizer_step)
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.engine is not None and self.engine.scales_loss:  # fp16: GradScaler.scale's place
            closure_loss = self.engine.scale_loss(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        self._in_optimizer_step = True
        try:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            self._in_optimizer_step = False
        self._log_metrics()
        return out

    def _log_metrics(self) -> None:
        """The step's `FuyouEngine.metrics` to the Trainer's loggers, read only in the steps whose ``on_step`` values
        they write (every ``log_every_n_steps``): a read can wait for the device (a step decided there). None on the
        progress bar, which has room for the user's own."""
        module, trainer = self.lightning_module, self._trainer
        if (self.engine is None or not self.log_metrics or module is None or trainer is None or not trainer.training
                or not trainer.loggers or not _logs_this_step(trainer)):
            return  # outside the training loop, no logger (Lightning would warn on every key), or not logged now
        metrics = self.engine.metrics()
        if not metrics:
            return  # no step yet
        for name, value in metrics.items():
            module.log(name, value, on_step=True, on_epoch=False, prog_bar=False, logger=True)

    # -- checkpoints ------------------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.engine is None or not checkpoint.get("optimizer_states"):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        pending = commit.begin(self.engine, sidecar(filepath))  # the earlier saves still belong to the .ckpt on disk
        state = pending.state
        state["fuyou"]["folder"] = os.path.basename(pending.folder)  # relative: the pair can be moved together
        checkpoint["optimizer_states"] = [state]
        self._masters_into(checkpoint)
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options)  # atomic: the old .ckpt or the new one
        except BaseException:
            commit.abandon(pending)
            raise
        # A CheckpointIO of the user's: the .ckpt is made durable before the old state goes. Data parallel: only
        # rank 0 wrote the .ckpt.
        fsynced = isinstance(self.checkpoint_io, DurableCheckpointIO)
        commit.commit(pending, [] if fsynced else [filepath], writer=self.is_global_zero)

    def _masters_into(self, checkpoint: dict[str, Any]) -> None:
        """Weights kept in bf16 go into the checkpoint as their fp32 masters."""
        masters = self.engine.master_weights()
        if not masters:
            return
        names = {p: name for name, p in self.lightning_module.named_parameters()}
        for p, master in masters.items():
            if names.get(p) in checkpoint.get("state_dict", {}):
                checkpoint["state_dict"][names[p]] = master

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        path = os.fspath(checkpoint_path)
        for state in checkpoint.get("optimizer_states", []):
            record = state.get("fuyou", {})
            if record.get("folder") is None:
                continue
            record["folder"] = os.path.join(os.path.dirname(path), record["folder"])  # unchanged if absolute
            # Refuse a mismatched pair before anything is restored, naming the .ckpt.
            commit.resolve_for_load(record["folder"], record.get("token"), record.get("steps"), named_by=path,
                                    fix=_other_checkpoints(path))
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        commit.remove(sidecar(filepath), removed=[filepath] if self.is_global_zero and _is_local(filepath) else [])

    # -- pending updates: landed before anything reads the weights outside a training forward ---------------
    def _flush(self) -> None:
        if self.engine is not None and not self.engine.closed:
            self.engine.flush()

    @override
    def on_validation_start(self) -> None:
        self._flush()  # the forward would wait module by module; landing them first is simpler to reason about
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._flush()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._flush()
        super().on_predict_start()

    @override
    def on_train_end(self) -> None:
        self._flush()
        if self.engine is not None:
            self.engine.end_trace()  # a run shorter than the trace window: write what was recorded
        super().on_train_end()

    # -- teardown ----------------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        if self.engine is not None:
            self._flush()  # the model outlives fit with its final weights
            self.engine.stop_updates()  # a stray backward after fit queues nothing
            if self.engine.swapper is not None:
                self.engine.swapper.uninstall()
            if self.engine.streamer is not None and self.root_device.type != "cpu":
                # Lightning's teardown moves the module to the CPU: streamed weights (released on the device,
                # their values in their tier copies) go there empty instead of being copied (``module.cpu()`` on
                # a released storage fails with "CUDA error: invalid argument")
                self.engine.streamer.move_to(torch.device("cpu"))
        share_display(None)
        self._trainer = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Fuyou: SSD-offloaded AdamW and activations, "
                                   "on one device or data parallel")
        strategy_registry.register("fuyou_ddp", cls, description="another name of strategy='fuyou'")


FuyouDDPStrategy = FuyouStrategy  # the name of the data-parallel strategy before "fuyou" took any device count


class _FuyouSyncControl:
    """``fabric.no_backward_sync(model, enabled=True)`` with the fuyou strategy: the micro-batch only
    accumulates, so the optimizer does not update (`FuyouAdamW.no_update`) and, with several processes,
    ``DistributedDataParallel`` does not all-reduce (its ``no_sync``). Fabric's accumulation idiom then
    works the same on one device and on several."""

    def __init__(self, strategy: "FuyouFabricDDPStrategy") -> None:
        self.strategy = strategy

    @contextlib.contextmanager
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> Iterator[None]:
        engine = self.strategy.engine
        if not enabled or engine is None:
            yield
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(engine.optimizer.no_update())
            if isinstance(module, DistributedDataParallel):
                stack.enter_context(module.no_sync())
            yield


class _FabricEngine(_EngineOwner):
    """What Fabric's fuyou strategies share: ``fabric.setup(model, optimizer)`` converts the AdamW into the
    engine's `FuyouAdamW`, a forward pre-hook counts micro-batches, and clipping is the optimizer's."""

    max_grad_norm: float | None
    _hook: Any  # the forward pre-hook on the set-up module

    @override
    def setup_module_and_optimizers(self, module: Any, optimizers: list, scheduler: Any = None) -> tuple:
        fp16_fix = ("with Fabric, fp16 loss scaling is not wired yet: use bf16, the Trainer's strategy, or "
                    "FuyouAdamW(loss_scaling=True) directly")
        _check_precision(str(self.precision.precision), tuple(p for p in _PRECISIONS if p not in _FP16),
                         {**_PRECISION_FIX, **dict.fromkeys(_FP16, fp16_fix)})
        if len(optimizers) != 1:
            raise ConfigError(f"fabric.setup: got {len(optimizers)} optimizers; the fuyou strategy trains with one AdamW")
        self._close_engine()  # a second setup replaces the first one's engine and hook
        wrapped = self.setup_module(module)
        # Fabric's loop is the user's own and may read the weights anywhere after optimizer.step(), as
        # torch.optim promises: step() lands every update itself (next_forward then saves the redo, not the wait).
        self.engine = FuyouEngine(module, optimizers[0], config=self.fuyou_config, max_grad_norm=self.max_grad_norm,
                                  where="fabric.setup", report=rank_zero_info, defer_updates=False,
                                  **self._parallel_engine_arguments())
        try:
            if self.engine.data_parallel:  # updates as DDP's buckets land (backward schedule)
                self.engine.attach_ddp(wrapped)
            if scheduler is not None:
                self.engine.rebind_schedulers([scheduler])
        except BaseException as exc:
            engine, self.engine = self.engine, None
            undo_after(exc, engine.close)
            raise
        self._hook = module.register_forward_pre_hook(self._before_forward)
        return wrapped, [self.engine.optimizer], scheduler

    def _before_forward(self, module: Any, args: Any) -> None:
        if torch.compiler.is_compiling():
            # Fabric compiles the module again after setup (fabric.setup(torch.compile(model))), out of this
            # strategy's sight. Dynamo replays this attribute write on every call of the compiled graph, so the
            # first fabric.backward() sees it and refuses, before any gradient or update exists.
            self._compiled_forward = True
            return
        if module.training and torch.is_grad_enabled() and self.engine is not None:
            self.engine.begin_micro_batch()  # updates stay as `no_backward_sync` / `optimizer.no_update()` set them

    @override
    def backward(self, tensor: torch.Tensor, module: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_compiled_forward", False):
            raise ConfigError(
                "fabric.setup: got a compiled model (torch.compile); fuyou's hooks (optimizer schedule, activation "
                "swapping, weight streaming) run in eager mode: pass fabric.setup the model without torch.compile")
        return super().backward(tensor, module, *args, **kwargs)

    @override
    def clip_gradients_norm(self, module: Any, optimizer: Any, max_norm: float | int, norm_type: float | int = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        if self.max_grad_norm != float(max_norm) or norm_type != 2.0:
            raise ConfigError(
                f"fabric.clip_gradients: got max_norm={max_norm} (norm_type={norm_type}); with the fuyou strategy the "
                "optimizer clips the L2 norm exactly, set once with FuyouFabricStrategy(max_grad_norm=...)"
            )
        return torch.tensor(float("nan"))  # known only at optimizer.step(): see optimizer.stats.last_grad_norm

    @override
    def clip_gradients_value(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError("fabric.clip_gradients(clip_val=...): clipping by value is not supported by the fuyou strategy")

    def _close_engine(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        super()._close_engine()

    @override
    def teardown(self) -> None:
        self._close_engine()
        super().teardown()



class FuyouFabricStrategy(_FabricEngine, FabricSingleDeviceStrategy):
    """``Fabric(strategy="fuyou")``: one device; ``fabric.setup(model, optimizer)`` converts the AdamW.

    Mark micro-batches that only accumulate with ``with optimizer.no_update():`` (Fabric makes
    ``no_backward_sync`` a no-op on one device; a second backward without ``no_update`` is a clear
    error at ``step()``, never a silent partial update). Set the clipping norm with
    ``FuyouFabricStrategy(max_grad_norm=...)``: ``fabric.clip_gradients`` with the same value is
    accepted, anything else refused. Config fields as for `FuyouStrategy`. Several devices:
    ``Fabric(strategy="fuyou_ddp", devices=N)`` and ``fabric.launch()`` (`FuyouFabricDDPStrategy`).
    """

    num_processes = num_nodes = 1  # one process (`data_parallel` is False)

    def __init__(self, config: FuyouConfig | dict | str | None = None, *, device: Any = None,
                 max_grad_norm: float | None = None, accelerator: Any = None, checkpoint_io: Any = None,
                 precision: Any = None, **config_fields: Any) -> None:
        super().__init__(device=device if device is not None else "cpu", accelerator=accelerator,
                         checkpoint_io=checkpoint_io, precision=precision)
        # Fabric's connector fills in parallel_devices from accelerator=/devices= when no device is given
        self.parallel_devices = self._init_fuyou(config, config_fields, device, None)
        self.max_grad_norm = max_grad_norm
        self._hook = None

    @override
    def setup_module_and_optimizers(self, module: Any, optimizers: list, scheduler: Any = None) -> tuple:
        if self.parallel_devices and len(self.parallel_devices) > 1:
            raise ConfigError(f"devices: got {len(self.parallel_devices)} devices; Fabric(strategy='fuyou') trains on "
                              "one device; for data parallelism use Fabric(strategy='fuyou_ddp', devices=N) and "
                              "fabric.launch(), as with Fabric's 'ddp' (the Trainer's strategy='fuyou' takes any devices)")
        return super().setup_module_and_optimizers(module, optimizers, scheduler)


class FuyouFabricDDPStrategy(_FabricEngine, FabricDDPStrategy):
    """``Fabric(strategy="fuyou_ddp", devices=N)`` (and ``num_nodes``), launched with ``fabric.launch()`` as
    Fabric's ``"ddp"`` is: ``fabric.setup(model, optimizer)`` converts the AdamW.

    Mark micro-batches that only accumulate as Fabric users do, with ``with fabric.no_backward_sync(model,
    enabled=True):`` (the optimizer then does not update, and DDP does not all-reduce), or with ``with
    optimizer.no_update():``; a second backward without either is a clear error at ``step()``, never a
    silent partial update. Set the clipping norm with ``FuyouFabricStrategy(max_grad_norm=...)``:
    ``fabric.clip_gradients`` with the same value is accepted, anything else refused. Config fields as
    for `FuyouStrategy`.

    Fabric's launchers start the ranks as for ``strategy="ddp"`` (``start_method="spawn"`` from a notebook
    or a test), the model is wrapped in ``DistributedDataParallel`` and each rank owns ~1/N of the SSD
    state, as with the Trainer's `FuyouStrategy`. With one process it runs like `FuyouFabricStrategy`
    (no process group, no DDP, ``fabric.setup_dataloaders`` keeps the samplers), after ``fabric.launch()``.

    Why a second name, when the Trainer has one: Fabric asks every strategy that is not a single-device
    one to be launched (``fabric.launch()``), so a one-device ``Fabric(strategy="fuyou")`` script, which
    has no launch, keeps working only if ``"fuyou"`` stays a single-device strategy.
    """

    def __init__(self, config: FuyouConfig | dict | str | None = None, *, device: Any = None,
                 max_grad_norm: float | None = None, accelerator: Any = None,
                 parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision: Any = None, process_group_backend: str | None = None,
                 timeout: Any = default_pg_timeout, start_method: str = "popen",
                 ddp_kwargs: dict[str, Any] | None = None, **config_fields: Any) -> None:
        parallel_devices = self._init_fuyou(config, config_fields, device, parallel_devices)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
                         **(ddp_kwargs or {}))
        self._backward_sync_control = _FuyouSyncControl(self)
        self.max_grad_norm = max_grad_norm
        self._hook: Any = None  # the forward pre-hook on the set-up module

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        # None: Fabric keeps the loaders' samplers (one process)
        return super().distributed_sampler_kwargs if self.data_parallel else None

    @override
    def _configure_launcher(self) -> None:
        if self.data_parallel:
            super()._configure_launcher()
        else:
            self._launcher = None  # one process: run in this one

    @override
    def setup_environment(self) -> None:
        if self.data_parallel:
            super().setup_environment()  # the process group
        else:
            self.accelerator.setup_device(self.root_device)

    @override
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self._ddp_wrap(module, self._ddp_kwargs) if self.data_parallel else module


def register() -> None:
    """Register ``"fuyou"`` with Lightning's Trainer and Fabric (done when this module is imported, which
    ``import fuyou_strategy`` does once Lightning is imported)."""
    if "fuyou" not in StrategyRegistry:
        FuyouStrategy.register_strategies(StrategyRegistry)  # and its other name, "fuyou_ddp"
    if "fuyou" not in FABRIC_REGISTRY:
        FABRIC_REGISTRY.register("fuyou", FuyouFabricStrategy, description="Fuyou: SSD-offloaded AdamW and activations")
    if "fuyou_ddp" not in FABRIC_REGISTRY:  # Fabric launches a multi-process strategy only after fabric.launch()
        FABRIC_REGISTRY.register("fuyou_ddp", FuyouFabricDDPStrategy, description="Fuyou, data parallel")


register()  # idempotent: strategy="fuyou" works once this module is imported
