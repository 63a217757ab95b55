"""`FuyouEngine`: the training-step lifecycle that the Lightning and Hugging Face adapters call.

The engine owns everything Fuyou adds to a training loop, so that each adapter only translates
its framework's events into four calls:

- **construction** converts the framework's ``torch.optim.AdamW`` / ``Adam`` into a
  `FuyouAdamW` with the same param groups and hyper-parameters (`optimizer_arguments` says
  exactly what converts and refuses the rest), and installs the activation swapper on the
  model's blocks, sharing the optimizer's tensor store and host buffer pool; with
  ``weights="host"``/``"ssd"`` it also streams the blocks' frozen weights (`WeightStreamer`);
- `begin_micro_batch` (before each forward) says whether this micro-batch ends the
  accumulation window — only then do the overlapped updates run during backward — and starts
  a new activation pass;
- with ``activations="auto"`` the first ``planner_warmup_steps`` steps are profiled, then the
  planner's `Plan` is applied (and logged, with predicted vs measured step time a few steps
  later), with ``weights="auto"`` its weight tiers too (the streamer is installed then);
  ``plan="plan.json"`` applies a pinned plan, policies and weight tiers, from the first step;
- the framework calls ``optimizer.step()`` as usual: the optimizer commits, redoes with the
  clip coefficient, or skips; the engine's step hook then releases whatever activations a
  backward left behind and times the step;
- `save` / `load` stream the SSD-resident state to and from a checkpoint folder; `close`
  removes the hooks and the swap files.

Lightning and transformers are never imported here.
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
import weakref
from functools import wraps
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from . import trace
from .activations import ActivationSwapper, Policy, discover_blocks
from .activations.spans import BlockSpans
from .cleanup import close_all, undo_after
from .config import STATE_BYTES_PER_PARAM, ConfigError, FuyouConfig, format_bytes
from .optim import FuyouAdamW
from .optim.distributed import sync_module_states
from .optim.schedule import NEXT_FORWARD
from .params import WeightStreamer
from .params.streaming import streamed_parameter_names
from .params.materialize import has_meta, materialize, model_device
from .planner import WEIGHT_TIERS, Plan, PlanError, solve
from .planner.profile import WarmupProfiler
from .storage.wear import TB, Wear, drive_capacity

log = logging.getLogger("fuyou_strategy")
log.addHandler(logging.NullHandler())  # the application decides handlers and levels

__all__ = ["FuyouEngine", "ignore_streamed_in_ddp", "optimizer_arguments", "rebind_scheduler"]

# Steps measured (after the first) before the SSD wear of a run is projected and reported.
WEAR_SAMPLE_STEPS = 3

# Options of torch's Adam/AdamW that only choose an implementation: dropped on conversion.
_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")
_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")


def optimizer_arguments(optimizer: torch.optim.Optimizer, *, where: str = "the optimizer") -> tuple[list[dict], dict]:
    """The param groups and defaults a `FuyouAdamW` needs to stand in for ``optimizer`` exactly.

    ``torch.optim.AdamW`` converts as is; ``torch.optim.Adam`` converts when its weight decay is
    0 or decoupled (``decoupled_weight_decay=True``), since Adam's coupled (L2) decay is a
    different update. The kernel follows the optimizer's ``fused`` flag, so updates are
    bitwise those the framework's own optimizer would make. Anything else — another optimizer
    class, ``amsgrad``, ``maximize``, a subclass, an optimizer that already holds moments —
    raises `ConfigError` naming the problem and the fix. Extra group keys (``initial_lr`` from a scheduler, ``name``) are kept.
    """
    kind = type(optimizer)
    if kind not in (torch.optim.AdamW, torch.optim.Adam):
        raise ConfigError(
            f"{where}: got {kind.__module__}.{kind.__qualname__}; Fuyou's out-of-core optimizer is AdamW, so it "
            "converts torch.optim.AdamW or torch.optim.Adam (same hyper-parameters, param groups and schedulers); "
            "use one of those"
        )
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ConfigError(f"{where}: param group {i} has {flag}=True, which FuyouAdamW does not support; remove it")
        if kind is torch.optim.Adam and group.get("weight_decay") and not group.get("decoupled_weight_decay"):
            raise ConfigError(
                f"{where}: torch.optim.Adam with weight_decay={group['weight_decay']} (param group {i}) adds L2 decay "
                "to the gradient, which is not AdamW's decoupled decay; use torch.optim.AdamW (or Adam with "
                "decoupled_weight_decay=True, or weight_decay=0)"
            )
        groups.append(_plain({k: v for k, v in group.items()
                              if k not in _IMPLEMENTATION_KEYS + ("amsgrad", "maximize", "decoupled_weight_decay")}))
    for p, state in optimizer.state.items():
        if any(k in state for k in ("exp_avg", "exp_avg_sq")):
            raise ConfigError(
                f"{where}: already holds Adam moments (it was stepped, or loaded from a checkpoint made without "
                "Fuyou); FuyouAdamW cannot adopt them: start from a fresh optimizer, or resume from a Fuyou checkpoint"
            )
    defaults = _plain({k: optimizer.defaults[k] for k in _HYPER_KEYS})
    defaults["fused"] = bool(optimizer.defaults.get("fused"))  # the same kernel: bitwise the same update
    return groups, defaults


def _plain(hyper: dict) -> dict:
    """``lr`` and ``betas`` as Python floats (torch allows tensors there)."""
    lr = hyper["lr"]
    return {**hyper, "lr": float(lr) if isinstance(lr, torch.Tensor) else lr,
            "betas": tuple(float(b) for b in hyper["betas"])}


def ignore_streamed_in_ddp(model: torch.nn.Module, config: FuyouConfig) -> list[str]:
    """Before ``DistributedDataParallel(model)``: make it leave alone the trainable parameters that
    ``config``'s weight tiers (``weights``, or a pinned ``plan``'s) stream; with ``weights="auto"``
    every block's, since the planner chooses the tiers after the warm-up. A streamed weight's device
    storage is released between uses and its gradient leaves the device as it is made, so DDP could
    neither broadcast nor average it; `FuyouAdamW` sums these gradients over the ranks at ``step()``
    (`FuyouAdamW.reduce_itself`) and makes the tier copies rank 0's at the start. Returns their
    names (none: nothing changed)."""
    weights = config.weights
    if config.plan is not None and weights in ("device", "auto"):
        weights = Plan.load(config.plan).weights
    elif weights == "auto":  # the planner chooses after the wrap: every block may be streamed
        weights = "ssd"
    if weights in ("device", {}):
        return []
    names = streamed_parameter_names(model, config, weights)
    if names:
        ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, sorted(ignored | set(names)))
    return names


def rebind_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point an LR scheduler built for another optimizer at ``optimizer``.

    Torch's schedulers wrap ``optimizer.step`` once, to warn when ``scheduler.step()`` comes
    first; the same marker is put on ``optimizer`` so the warning stays meaningful.
    """
    scheduler.optimizer = optimizer
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    opt_ref = weakref.ref(optimizer)
    step = type(optimizer).step

    @wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True
        return step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper


class FuyouEngine:
    """Fuyou's optimizer and activation swapping for one model, driven by a training loop.

    Args:
        model: the model being trained (its trainable parameters are those of ``optimizer``).
        optimizer: the ``torch.optim.AdamW`` / ``Adam`` the training loop built; it is
            converted (see `optimizer_arguments`) and no longer used.
        config: `FuyouConfig`; ``None`` means defaults (a temporary swap directory).
        max_grad_norm: clip the global gradient norm exactly, in the optimizer (the framework's
            own clipping must be turned off: gradients are consumed during backward).
        release_grads: let the optimizer drop gradients as soon as their update is written
            (only when no clipping is configured); ``False`` keeps them until ``zero_grad``
            for a framework that reads them after backward (e.g. to log their norm).
        norm_order: the order in which the framework's own clipping sums the global norm, so
            that clipping is bitwise the same: Lightning and Fabric clip the optimizer's
            parameters in param-group order (the default), the HF Trainer clips
            ``model.parameters()``.
        where: how to name the optimizer in error messages.
        report: where messages for the user go (the plan, predicted vs measured step time), one
            text at a time; default: INFO on the ``fuyou_strategy`` logger. The adapters pass
            their framework's channel (Lightning's ``rank_zero_info``, transformers' logger).
        init_weights: for a model built on the meta device (``with torch.device("meta"):``), how to
            initialise each module once it has memory (``module.apply``-style, e.g. a Hugging Face
            model's ``_init_weights``, or `SafetensorsInit` to load a local checkpoint lazily;
            default ``reset_parameters()``). Streamed blocks are
            materialised one at a time straight into their tier, so the model is never whole in
            memory; everything else is materialised on ``device``.
        device: where a meta model's resident parameters go (default: the CPU).
        defer_updates: under the ``next_forward`` schedule, let ``optimizer.step()`` return before its
            updates landed: the next forward waits, module by module, for the weights it reads
            (`FuyouAdamW.attach_model`), and ``state_dict``, checkpoints and `flush` land them first.
            ``False`` for a loop that may read the weights anywhere after ``step()`` (Fabric's):
            ``step()`` then lands them itself.
        loss_scaling: fp16 dynamic loss scaling in the optimizer (`FuyouAdamW`'s ``loss_scaling``);
            the loop must then backward ``optimizer.scale_loss(loss)`` (or ``scale_backward``).
        process_group: data parallelism over a ``torch.distributed`` group (`optim.distributed`):
            each rank keeps ~1/N of the optimizer state on its own swap directories; ``step()`` sums
            the ranks' gradients onto each parameter's owner, clips on the global norm, updates and
            broadcasts the weights. The loop gives each rank its share of the global batch. Without
            ``gradients_averaged`` the model's parameters and buffers are made rank 0's here (as
            ``DistributedDataParallel``'s construction does).
        gradients_averaged: with ``process_group``, the model is a ``DistributedDataParallel`` (or
            the loop reduces otherwise) and the gradients at ``step()`` are the ranks' average already.

    After construction ``engine.optimizer`` is the `FuyouAdamW` to hand to the framework.
    Nothing is left on disk when construction fails.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        config: FuyouConfig | None = None,
        max_grad_norm: float | None = None,
        release_grads: bool = True,
        norm_order: Iterable[torch.nn.Parameter] | None = None,
        where: str = "the optimizer",
        report: Callable[[str], Any] | None = None,
        init_weights: Callable[[torch.nn.Module], None] | None = None,
        device: torch.device | str | None = None,
        defer_updates: bool = True,
        loss_scaling: Any = None,
        process_group: Any = None,
        gradients_averaged: bool = False,
    ) -> None:
        self.config = config = config if config is not None else FuyouConfig()
        self.report = report if report is not None else log.info
        self.model = model
        self.init_weights = init_weights
        self.device = torch.device(device) if device is not None else model_device(model)
        # What close() reads exists before anything can fail: a construction that fails half-way closes
        # what it made, and its own error reaches the caller.
        self.swapper: ActivationSwapper | None = None
        self.streamer: WeightStreamer | None = None
        self.plan: Plan | None = None
        self.profiler: WarmupProfiler | None = None
        self._step_hook: Any = None
        self._step_pre_hook: Any = None
        self._tracer: trace.Tracer | None = None
        self._plan_applied_at: int | None = None
        self._plan_reported = False
        groups, defaults = optimizer_arguments(optimizer, where=where)
        if process_group is not None and not gradients_averaged and dist.get_world_size(process_group) > 1:
            sync_module_states(model, process_group)  # no DDP to make the ranks start alike: rank 0's weights
        self.optimizer = FuyouAdamW(groups, **defaults, max_grad_norm=max_grad_norm, config=config,
                                    release_grads=release_grads, loss_scaling=loss_scaling,
                                    process_group=process_group, gradients_averaged=gradients_averaged)
        try:
            self._ddp = gradients_averaged and self.optimizer.shards is not None  # a DistributedDataParallel model
            if self._ddp:  # what DDP was told to leave alone (`ignore_streamed_in_ddp`), the optimizer sums itself
                ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
                self.optimizer.reduce_itself(p for name, p in model.named_parameters() if name in ignored)
            if norm_order is not None:
                self.optimizer.set_norm_order(norm_order)
            if defer_updates and config.optimizer_schedule != "backward":  # updates land as the next forward needs them
                self.optimizer.attach_model(model)
            if config.plan is not None:  # pinned
                self.plan = Plan.load(config.plan)
            weights = self.plan.weights if self.plan is not None and config.weights in ("device", "auto") \
                else config.weights
            if weights not in ("device", "auto", {}):  # "auto" without a plan: after the warm-up
                self._install_streamer(weights)
            if has_meta(model):  # the rest of a model built on the meta device: resident
                materialize(model, self.device, init_weights)
            self.optimizer.initialise_materialized()
            if self.plan is not None:
                self._install_swapper(self.plan.activations)
                self.report(f"fuyou planner: applying the pinned plan {config.plan}")
            elif config.activations == "auto":
                blocks = discover_blocks(model, config.blocks)
                self.profiler = WarmupProfiler(model, blocks, config, self.optimizer, config.planner_warmup_steps)
            elif config.activations != "keep":
                self._install_swapper(config.activations)
            self._step_hook = self.optimizer.register_step_post_hook(self._after_step)
            self._step_pre_hook = self.optimizer.register_step_pre_hook(self._before_step)
        except BaseException as exc:
            undo_after(exc, self.close)  # the swapper, the streamer (weights resident again), the optimizer
            raise
        self._last_step_end: float | None = None
        self._window_open = False  # a micro-batch of the next step has begun
        self._trace_spans: BlockSpans | None = None
        self._trace_from = 0  # the optimizer step the trace starts at
        self._trace_marks: dict[str, float] = {}  # window start, step() start (tracer clock)
        self._trace_written = config.trace is None
        self._planned_at_step: int | None = None
        self.run_steps: int | None = None  # optimizer steps of the whole run, from the adapter (`expect_steps`)
        self.wear: Wear | None = None
        self._wear_warned = False
        self._written_per_step: list[float] = []
        self._counted = self._counters()  # cumulative counters at the last step's end (`metrics`)
        self._metrics: dict[str, float] = {}
        self.step_times: list[float] = []  # seconds between consecutive optimizer steps
        self.micro_batches = 0

    def _install_streamer(self, weights: str | dict) -> None:
        """Stream the blocks' weights (frozen and trainable) from their tiers; the optimizer publishes
        the trainable ones' updates there."""
        config = self.config.replace(weights=weights, plan=None)
        if self._ddp:  # DistributedDataParallel must leave the streamed parameters to the optimizer
            ignored = set(getattr(self.model, "_ddp_params_and_buffers_to_ignore", ()))
            missing = [n for n in streamed_parameter_names(self.model, config) if n not in ignored]
            if missing:
                raise ConfigError(
                    f"weights: {len(missing)} streamed parameters (the first: {missing[0]!r}) are not ignored by the "
                    "DistributedDataParallel model, which would bring their gradients back to the device; call "
                    "fuyou_strategy.ignore_streamed_in_ddp(model, config) before wrapping the model (the fuyou_ddp "
                    "strategy and FuyouCallback do it)")
        # The last step's updates land first (after a warm-up, `next_forward` leaves them for the next
        # forward): the tier copies are made from the weights, whose device storage is then released.
        self.optimizer.flush()
        self.streamer = WeightStreamer(self.model, config, store=self.optimizer.store,
                                       trainable=self.optimizer.chunk_elements(), device=self.device,
                                       init_weights=self.init_weights)
        self.streamer.install()
        self.optimizer.attach_weights(self.streamer)

    def _install_swapper(self, activations: str | dict) -> None:
        # The swapper applies only the activation policies (the engine applies the plan's weight tiers).
        config = self.config.replace(activations=activations, plan=None, weights="device")
        self.swapper = ActivationSwapper(self.model, config, store=self.optimizer.store)
        self.swapper.install()

    # -- the loop's events -------------------------------------------------------------------------
    def begin_micro_batch(self, update: bool | None = None) -> None:
        """Before a training forward: ``update`` says whether this micro-batch's backward ends the
        window (``None``: leave it to ``optimizer.no_update()``)."""
        if update is not None:
            self.optimizer.updates_enabled = update
        if self.swapper is not None:
            self.swapper.begin_pass()
        if self.profiler is not None:
            self.profiler.begin_micro_batch()
        self.micro_batches += 1
        if self._last_step_end is None:
            self._last_step_end = time.perf_counter()
        if not self._window_open:
            self._window_open = True
            if not self._trace_written:
                self._trace_window()

    # -- the trace ------------------------------------------------------------------------------------
    def _trace_window(self) -> None:
        """At the first micro-batch of a step: start the trace, or end it after ``trace_steps`` steps."""
        steps = self.optimizer.stats.steps
        if self._tracer is None:
            first = self._planned_at_step + 1 if self._planned_at_step is not None else 1
            if self.profiler is not None or steps < first:
                return
            if trace.active() is not None:
                self._trace_written = True
                warnings.warn(f"fuyou: trace={self.config.trace!r} not recorded: another engine in this process is "
                              "recording a trace (one at a time)", stacklevel=3)
                return
            self._tracer = trace.Tracer().start()
            self._trace_spans = BlockSpans(discover_blocks(self.model, self.config.blocks))
            self._trace_from = steps
        elif steps >= self._trace_from + self.config.trace_steps:
            self._write_trace()
            return
        self._trace_marks["window"] = self._tracer.now()

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._tracer is not None:
            self._trace_marks["step"] = self._tracer.now()

    def _trace_step(self) -> None:
        tracer, marks = self._tracer, self._trace_marks
        now, n = tracer.now(), self.optimizer.stats.steps
        if "step" in marks:
            tracer.add("compute", "optimizer.step()", marks.pop("step"), now)
        if "window" in marks:
            tracer.add("steps", f"step {n}", marks.pop("window"), now, step=n,
                       schedule=self.optimizer.stats.last_schedule)

    def end_trace(self) -> None:
        """Write the trace now if one is recording (training ended inside the traced steps: those
        recorded are kept); `close` and the adapters' end of training call it."""
        if self._tracer is not None:
            self._write_trace()

    def _write_trace(self) -> None:
        """Stop recording and write the trace (with the plan's predicted step beside the first traced one)."""
        tracer, self._tracer = self._tracer, None
        tracer.stop()
        self._trace_spans.remove()
        self._trace_written = True
        steps = [e for e in tracer.events if e[0] == "steps"]
        measured = [end - start for _lane, _name, start, end, _args in steps]
        predicted = self.plan.timeline() if self.plan is not None else []
        try:
            tracer.save(self.config.trace, predicted=predicted, predicted_offset=steps[0][2] if steps else 0.0,
                        metadata={"steps": len(steps), "measured_step_s": measured,
                                  "predicted_step_s": self.plan.predicted_step_s if self.plan is not None else None,
                                  "plan": self.plan.policies if self.plan is not None else None,
                                  "weight_tiers": self.plan.weight_tiers if self.plan is not None else None})
        except OSError as exc:  # a lost trace is no reason to stop training
            warnings.warn(f"fuyou: trace={self.config.trace!r} could not be written: {exc}", stacklevel=3)
            return
        self.report(f"fuyou: trace of {len(steps)} step(s) written to {self.config.trace} (open it in "
                    f"https://ui.perfetto.dev, or draw it: fuyou report {self.config.trace} --png)")

    # -- SSD wear -------------------------------------------------------------------------------------
    def expect_steps(self, steps: int | None) -> None:
        """The run's length in optimizer steps (the adapters pass the trainer's), for the SSD wear
        projection. Warns at once if the optimizer state's own writes (12 bytes per trainable
        parameter per step, a floor) would spend more than ``ssd_wear_warning`` of the drives'
        rated endurance; the measured figure follows after the first steps (`wear`)."""
        self.run_steps = int(steps) if steps is not None and steps > 0 else None
        if self.run_steps is None:
            return
        params = sum(p.numel() for g in self.optimizer.param_groups for p in g["params"])
        floor = self._wear(params * STATE_BYTES_PER_PARAM, 0.0)
        self._check_wear(floor, "at least (the optimizer state's writes alone)")

    def _wear(self, bytes_per_step: float, step_seconds: float) -> Wear:
        dirs = self.optimizer.store.run_dirs
        return Wear(bytes_per_step, step_seconds, drives=len(dirs), drive_bytes=drive_capacity(dirs),
                    endurance_tbw=self.config.ssd_endurance_tbw, steps=self.run_steps)

    def _check_wear(self, wear: Wear, how: str) -> None:
        share = wear.run_fraction
        if share is None or share <= self.config.ssd_wear_warning or self._wear_warned:
            return
        self._wear_warned = True
        warnings.warn(
            f"fuyou: this run's {wear.steps} steps write {how} {format_bytes(wear.bytes_per_step * wear.steps)} "
            f"to the swap drives: {share:.1%} of their rated endurance ({self.config.ssd_endurance_tbw:g} TBW each, "
            f"{wear.drives} drive(s)), over ssd_wear_warning={self.config.ssd_wear_warning:g}. Set "
            "FuyouConfig.ssd_endurance_tbw to your drive's rating (its datasheet), add drives (swap_dirs), keep "
            "activations off the SSD, or raise ssd_wear_warning", stacklevel=3)

    def _measure_wear(self, written: float) -> None:
        if self.wear is not None:  # measured once: the sample is not kept growing with the run
            return
        self._written_per_step.append(written)
        if len(self._written_per_step) <= WEAR_SAMPLE_STEPS:
            return
        sample = self._written_per_step[1:]  # the first step includes the warm-up
        self.wear = self._wear(statistics.median(sample), statistics.median(self.step_times[-len(sample):]))
        self.report(f"fuyou: {self.wear.describe()}")
        self._check_wear(self.wear, "about")

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.swapper is not None:
            self.swapper.release()  # every backward of the window is done: anything left is garbage
        now = time.perf_counter()
        if self._last_step_end is not None:
            self.step_times.append(now - self._last_step_end)
            self._metrics = self._step_metrics(now - self._last_step_end)
            self._measure_wear(self._metrics["fuyou/ssd_write_bytes"])
        self._last_step_end = now
        self._window_open = False
        if self._tracer is not None:
            self._trace_step()
        if self.profiler is not None:
            self.profiler.after_step()
            if self.profiler.done:
                self._plan_from_warmup()
            else:  # the warm-up's progress, through the framework's channel
                self.report(f"fuyou planner: warm-up step {self.profiler.steps_seen}/{self.profiler.steps} profiled")
        elif self._plan_applied_at is not None and not self._plan_reported:
            measured = self.step_times[self._plan_applied_at + 1:]  # the first planned step warms the swap path up
            if len(measured) >= 3:
                self._plan_reported = True
                m = statistics.median(measured)
                self.report(f"fuyou planner: predicted {self.plan.predicted_step_s:.3f} s/step, measured {m:.3f} s "
                            f"(median of {len(measured)} steps): {m / self.plan.predicted_step_s:.2f}x")

    def _plan_from_warmup(self) -> None:
        """Solve on the warm-up's profile and switch the activation policies (and, with
        ``weights="auto"``, the weight tiers) to the plan."""
        profiler, self.profiler = self.profiler, None
        profiler.remove()
        self.report(f"fuyou planner: profiled {profiler.steps} warm-up steps; measuring bandwidths and planning ...")
        profile = profiler.profile()
        # On the CPU the device tier *is* host memory: the host policy and the host tier would free nothing.
        cpu = profiler.device.type == "cpu"
        allowed = [p for p in Policy if not (p is Policy.HOST and cpu)]
        tiers = [t for t in WEIGHT_TIERS if not (t == "host" and cpu)] if self.config.weights == "auto" else None
        error = None
        try:
            self.plan = solve(profile, allowed=allowed, weight_tiers=tiers,
                              write_tolerance=self.config.ssd_write_tolerance)
        except PlanError as exc:
            fields = "activations='auto', weights='auto'" if tiers else "activations='auto'"
            error = ConfigError(f"{fields}: {exc}")
        shards = self.optimizer.shards
        if shards is not None:  # data parallel: every rank applies rank 0's plan (the same tiers and collectives)
            chosen = [self.plan, error]
            shards.broadcast_object(chosen)
            self.plan, error = chosen
        if error is not None:
            raise error
        self.report(f"fuyou planner: plan (predicted {self.plan.predicted_step_s:.3f} s/step)\n"
                    f"{self.plan.table(compact=True)}")
        if tiers and self.plan.weights:
            self._install_streamer(self.plan.weights)
        if any(p != Policy.KEEP.value for p in self.plan.policies):
            self._install_swapper(self.plan.activations)
        self._plan_applied_at = len(self.step_times)
        self._planned_at_step = self.optimizer.stats.steps

    def rebind_schedulers(self, schedulers: Iterable[Any]) -> None:
        """Point the framework's LR schedulers at the converted optimizer."""
        for scheduler in schedulers:
            rebind_scheduler(scheduler, self.optimizer)

    def flush(self) -> None:
        """Land the updates the last step left for the next forward (``optimizer_schedule``
        ``"next_forward"``): before anything reads the weights outside a training forward."""
        self.optimizer.flush()

    # -- checkpoints ---------------------------------------------------------------------------------
    def save(self, folder: str, *, keep_previous: bool = False, record: dict[str, Any] | None = None) -> dict[str, Any]:
        """Stream the optimizer's SSD state into a new save in ``folder``; returns the torch-style
        state dict naming it (see `FuyouAdamW.state_dict` for ``keep_previous`` and ``record``)."""
        return self.optimizer.state_dict(folder, keep_previous=keep_previous, record=record)

    def load(self, folder: str, token: str | None = None) -> dict[str, Any]:
        """Restore optimizer state, fp32 masters and weights from the newest save in ``folder`` (or the
        one with ``token``); returns the save's metadata."""
        return self.optimizer.load_folder(folder, token)

    def master_weights(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """The fp32 master weight of every trainable parameter kept in lower precision (bf16). Data
        parallel: a collective that gathers them, one at a time from their owners, on rank 0 (which
        writes checkpoints); the other ranks get ``{}``."""
        opt = self.optimizer
        params = [p for group in opt.param_groups for p in group["params"] if p.dtype != torch.float32]
        if opt.shards is None:
            return {p: opt.read_state(p)["master"] for p in params}
        gathered = opt.shards.gather_to_first([opt._by_param[p] for p in params],
                                              lambda ps: opt.read_state(ps.param)["master"])
        return {ps.param: master for ps, master in gathered.items()}

    # -- reporting ------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """The last optimizer step's figures, for a training logger (keys under ``fuyou/``; empty
        before the first step). Plain floats read from counters the step keeps anyway: reading
        them never waits for the device or the drive.

        Per step (since the previous step ended): ``step_seconds``; ``ssd_read_bytes`` and
        ``ssd_write_bytes`` (completed transfers of every kind: optimizer state, activations,
        weights, gradients) and ``ssd_read_gbps`` / ``ssd_write_gbps`` (those bytes over the step's
        wall time, 1e9 bytes/s); ``activation_bytes_to_ssd`` / ``activation_bytes_to_host``.
        Of the step itself: ``grad_norm`` (global, before clipping), ``clipped``, ``skipped`` and
        ``rolled_back`` (1 or 0), ``schedule_next_forward`` (1: the step's updates ran ahead of the
        next forward, 0: during backward). Over the run: ``rollback_rate``, ``host_pool_peak_bytes``,
        ``device_peak_bytes`` (weights and gradients, with weight streaming), and with a plan
        ``plan_predicted_step_seconds``.
        """
        return dict(self._metrics)

    def _counters(self) -> dict[str, float]:
        stats, engine = self.optimizer.stats, self.optimizer.store.engine
        swap = self.swapper.stats if self.swapper is not None else None
        return {"ssd_read_bytes": engine.bytes_read, "ssd_write_bytes": engine.bytes_written,
                "activation_bytes_to_ssd": swap.ssd_bytes if swap else 0,
                "activation_bytes_to_host": swap.host_bytes if swap else 0,
                "clipped": stats.clipped, "skipped": stats.skips, "rolled_back": stats.rollbacks}

    def _step_metrics(self, seconds: float) -> dict[str, float]:
        now = self._counters()
        # A swapper installed by the planner starts its own counts: never a negative difference.
        delta = {k: max(0, v - self._counted.get(k, 0)) for k, v in now.items()}
        self._counted = now
        stats = self.optimizer.stats
        out = {"step_seconds": seconds, **delta,
               "ssd_read_gbps": delta["ssd_read_bytes"] / seconds / 1e9 if seconds > 0 else 0.0,
               "ssd_write_gbps": delta["ssd_write_bytes"] / seconds / 1e9 if seconds > 0 else 0.0,
               "grad_norm": stats.last_grad_norm, "schedule_next_forward": float(stats.last_schedule == NEXT_FORWARD),
               "rollback_rate": stats.rollback_rate, "host_pool_peak_bytes": self.optimizer.store.pool.high_water,
               # cumulative: the share of each drive's rated endurance the run has written so far
               "ssd_endurance_used": now["ssd_write_bytes"] / max(1, len(self.optimizer.store.run_dirs))
               / (self.config.ssd_endurance_tbw * TB)}
        if self.streamer is not None:
            out["device_peak_bytes"] = self.streamer.meter.high_water
        if self.plan is not None:
            out["plan_predicted_step_seconds"] = self.plan.predicted_step_s
        return {f"fuyou/{k}": float(v) for k, v in out.items()}

    def summary(self) -> dict[str, Any]:
        """What the run did: steps, clipping outcomes, bytes on SSD, peak host memory, step time."""
        opt, store = self.optimizer, self.optimizer.store
        stats = opt.stats
        swap = self.swapper.stats if self.swapper is not None else None
        stream = self.streamer.stats if self.streamer is not None else None
        times = self.step_times[1:] or self.step_times  # the first step includes warm-up
        return {
            "trainable_parameters": sum(p.numel() for g in opt.param_groups for p in g["params"]),
            "optimizer_steps": stats.steps,
            "commits": stats.commits,
            "redos": stats.redos,
            "deferred": stats.deferred,  # next_forward steps: exact at once, no rollback possible
            "skips": stats.skips,
            "clipped": stats.clipped,
            "rollbacks": stats.rollbacks,
            "rollback_rate": stats.rollback_rate,
            "schedule_steps": dict(stats.schedules),
            "schedule_next": opt._window,
            "schedule_reason": stats.last_reason,
            "last_grad_norm": stats.last_grad_norm,
            "loss_scale": opt.scaler.get_scale() if opt.scaler is not None else None,  # fp16 loss scaling
            # Both slots of every parameter's [master | exp_avg | exp_avg_sq] chunks, with padding.
            "ssd_bytes_optimizer_state": sum(e.slots * e.nchunks * e.stride for name, e in store.entries.items()
                                             if name.startswith("adamw.")),
            "ssd_file_bytes": store.bytes_on_disk,  # also the activations' high-water mark
            "activation_bytes_to_ssd": swap.ssd_bytes if swap else 0,
            "activation_bytes_to_host": swap.host_bytes if swap else 0,
            "weight_tiers": stream.tiers if stream else {},  # streamed blocks only: {block index: tier}
            "weight_bytes_streamed": stream.streamed_bytes if stream else 0,
            "weight_device_peak_bytes": stream.high_water_bytes if stream else 0,  # streamed weights on the device
            "weight_bytes_trainable_streamed": stream.trainable_bytes if stream else 0,
            # Weights and gradients on the device at most (activations not counted); None without streaming.
            "device_peak_bytes": self.streamer.meter.high_water if stream else None,
            "ssd_bytes_per_trainable_parameter": store.bytes_on_disk / max(1, sum(
                p.numel() for g in opt.param_groups for p in g["params"])),
            "host_pool_peak_bytes": store.pool.high_water,
            "host_pool_budget_bytes": store.pool.budget,
            "median_step_seconds": statistics.median(times) if times else float("nan"),
            "plan": self.plan.policies if self.plan is not None else None,
            "plan_predicted_step_seconds": self.plan.predicted_step_s if self.plan is not None else None,
            "plan_measured_step_seconds": (statistics.median(self.step_times[self._plan_applied_at + 1:])
                                           if self._plan_applied_at is not None
                                           and len(self.step_times) > self._plan_applied_at + 1 else None),
            "ssd_write_bytes_total": self.optimizer.store.engine.bytes_written,
            # measured after WEAR_SAMPLE_STEPS steps: per step and hour, DWPD, the run's share of the rating
            "wear": self.wear.as_dict() if self.wear is not None else None,
        }

    def format_summary(self) -> str:
        """`summary` as a few human-readable lines."""
        s = self.summary()
        mix = ", ".join(f"{n} {name}" for name, n in s["schedule_steps"].items() if n)
        return "\n".join([
            f"Fuyou: {s['optimizer_steps']} optimizer steps ({s['commits']} committed as computed during backward, "
            f"{s['redos']} redone for clipping, {s['deferred']} updated ahead of the next forward, {s['skips']} "
            f"skipped), {s['clipped']} clipped, last grad norm {s['last_grad_norm']:.4g}",
            f"  schedule: {mix or 'no step yet'}; rollback rate {s['rollback_rate']:.0%} ({s['rollbacks']} "
            f"rollbacks); next step {s['schedule_next']} ({s['schedule_reason']})",
            f"  SSD: optimizer state {format_bytes(s['ssd_bytes_optimizer_state'])} (swap files "
            f"{format_bytes(s['ssd_file_bytes'])}), activations swapped "
            f"{format_bytes(s['activation_bytes_to_ssd'])} to SSD and {format_bytes(s['activation_bytes_to_host'])} to host",
            f"  host pool peak {format_bytes(s['host_pool_peak_bytes'])} of {format_bytes(s['host_pool_budget_bytes'])}; "
            f"median step {s['median_step_seconds']:.3f} s",
        ] + ([f"  weights streamed: {format_bytes(s['weight_bytes_streamed'])} in {len(s['weight_tiers'])} blocks "
              f"{s['weight_tiers']} ({format_bytes(s['weight_bytes_trainable_streamed'])} trainable), device peak "
              f"{format_bytes(s['weight_device_peak_bytes'])} of streamed weights, "
              f"{format_bytes(s['device_peak_bytes'])} of weights and gradients"] if s["weight_tiers"] else []))

    # -- lifetime -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Land pending updates, take the hooks off the model and optimizer and delete the swap files.

        Every part is closed even when an earlier one raises (e.g. a weight that cannot come back because
        its update failed: the workers still stop and the files still go); the first error is raised."""
        close_all(self._remove_hooks, self.end_trace, self._close_swapper, self._close_streamer, self.optimizer.close)

    def _remove_hooks(self) -> None:
        for hook in (self._step_hook, self._step_pre_hook):
            if hook is not None:
                hook.remove()
        self._step_hook = self._step_pre_hook = None
        if self.profiler is not None:
            self.profiler.remove()
            self.profiler = None

    def _close_swapper(self) -> None:
        if self.swapper is not None:
            self.swapper.uninstall()
            self.swapper.close()

    def _close_streamer(self) -> None:
        if self.streamer is not None:
            self.streamer.close()  # every weight resident again before the store goes
