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
- with ``activations="auto"`` the first ``planner_warmup_steps`` steps are profiled (two more under
  ``next_forward`` with ``state_slots="auto"``, where those speculated), then the
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
import sys
import weakref
from functools import wraps
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from .activations import ActivationSwapper, Policy, discover_blocks
from .cleanup import close_all, undo_after
from .config import ConfigError, FuyouConfig, Settings, format_bytes, resolve
from .device import device_memory_allocated, device_memory_headroom, device_memory_left, release_cached_memory
from .optim import FuyouAdamW
from .optim.distributed import sync_module_states
from .params import WeightStreamer
from .params.materialize import has_meta, materialize, model_device
from .params.streaming import streamed_parameter_names
from .planner import WEIGHT_TIERS, Plan, PlanError, one_slot, one_slot_faster, solve, worth_one_slot
from .planner.profile import BatchGuard, WarmupProfiler
from .run_report import RunReport
from .storage import MemoryTiers
from .storage.wear import Wear

log = logging.getLogger("fuyou_strategy")
log.addHandler(logging.NullHandler())  # the application decides handlers and levels

__all__ = ["FuyouEngine", "ignore_streamed_in_ddp", "optimizer_arguments", "rebind_scheduler"]

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


def _short(value: Any) -> str:
    """A chosen value as the one-line announcement shows it: sizes as ``10.00GiB``, other strings quoted."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 2**20:
        value = format_bytes(value)
    if isinstance(value, str) and value.endswith("iB") and value[:1].isdigit():  # a size, as format_bytes writes it
        return value.replace(" ", "")
    return repr(value) if isinstance(value, str) and value != "torch's default" else str(value)


def _kernel_hint(where: str) -> str:
    """What a user whose optimizer left ``fused`` unset should know: fuyou keeps torch's choice (the
    for-loop kernel on the CPU), and the fused kernel is the fast one for an update that runs there."""
    return (f"fuyou: {where} leaves fused=None, so its updates run torch's for-loop AdamW kernel on the CPU, as "
            "torch.optim.AdamW would; fuyou's update runs on the CPU, where the fused kernel is several times "
            "faster: pass fused=True (the update is then bitwise AdamW(fused=True))")


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
    (`OptimizerControl.reduce_itself`) and makes the tier copies rank 0's at the start. Returns their
    names (none: nothing changed)."""
    weights = weight_tiers(config, pinned_plan(config))
    if weights == "auto":  # the planner chooses after the wrap: every block may be streamed
        weights = "ssd"
    if weights in ("device", {}, None):  # None: resident with several ranks (`placement_defaults`)
        return []
    names = streamed_parameter_names(model, config, weights)
    if names:
        ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, sorted(ignored | set(names)))
    return names


def pinned_plan(config: FuyouConfig) -> Plan | None:
    """The plan ``config.plan`` pins, loaded here, where it is used (`Plan.load`: a file that is not a whole,
    valid plan raises `PlanError` naming it); ``None`` without one."""
    return Plan.load(config.plan) if config.plan is not None else None


def weight_tiers(config: FuyouConfig, plan: Plan | None) -> str | dict:
    """The weight tiers to start with: a pinned plan's when ``weights`` leaves them to it (``"device"`` or
    ``"auto"``), else ``weights``."""
    return plan.weights if plan is not None and config.weights in ("device", "auto", None) else config.weights


def _one_slot_why(two: Plan | None, one: Plan) -> str:
    """Why the plan with one slot of state, ``one``, is worth taking or naming beside ``two``, the plan with two (None:
    two do not fit; `worth_one_slot`): one clause, for the report and ``summary()["choices"]``."""
    if two is None:
        return "two slots do not fit and one does"
    if one_slot_faster(two, one):
        return f"the plan with one slot is predicted {two.predicted_step_s / one.predicted_step_s:.2f}x faster"
    return ("the model computes on the CPU, whose cores its updates share, and one slot holds the whole optimizer "
            f"state in host RAM, where two slots leave {format_bytes(two.state_on_ssd)} on the SSD")


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


def compiled_modules(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s modules (``""``: the model itself) that ``torch.compile`` wraps: those made by
    ``torch.compile(module)`` (an ``OptimizedModule``, which torch does not export) and those compiled in
    place by ``module.compile()`` (they hold a ``_compiled_call_impl``). Both checked with torch 2.13
    (``tests/test_compile.py``). Nothing was compiled if dynamo was never imported."""
    if not hasattr(torch.nn.Module, "_compiled_call_impl"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.Module._compiled_call_impl (checked with torch "
                           "2.13), which tells whether module.compile() compiled a module; fuyou refuses compiled "
                           "models: do not compile the model, or use the torch version fuyou-strategy was tested with")
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", ()) if eval_frame is not None else ()
    return [name for name, m in model.named_modules(remove_duplicate=False)
            if (optimized and isinstance(m, optimized)) or getattr(m, "_compiled_call_impl", None) is not None]


def refuse_compiled(model: torch.nn.Module, where: str) -> None:
    """A compiled model is refused up front: dynamo would trace fuyou's forward hooks (the schedule's
    micro-batch signal, activation swapping, weight streaming) into graphs, and their side effects would
    run once at trace time, not every step; training would not be exact."""
    names = compiled_modules(model)
    if names:
        shown = ", ".join(repr(n) if n else "the model itself" for n in names[:3]) + (" ..." if len(names) > 3 else "")
        raise ConfigError(
            f"torch.compile: {len(names)} module(s) of the model given to {where} are compiled ({shown}); fuyou's "
            "hooks (optimizer schedule, activation swapping, weight streaming) run in eager mode: pass the module "
            "without torch.compile / module.compile() (HF: TrainingArguments(torch_compile=False))")


class FuyouEngine:
    """Fuyou's optimizer and activation swapping for one model, driven by a training loop.

    Args:
        model: the model being trained (its trainable parameters are those of ``optimizer``).
        optimizer: the ``torch.optim.AdamW`` / ``Adam`` the training loop built; it is
            converted (see `optimizer_arguments`) and no longer used.
        config: `FuyouConfig`; ``None`` means defaults (a temporary swap directory).
        max_grad_norm: clip the global gradient norm exactly, in the optimizer (the framework's
            own clipping must be turned off: gradients are consumed during backward).
        release_grads: let the optimizer drop gradients as soon as their update is queued
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
        local_ranks: the processes of this training on this machine, which share its RAM when
            ``host_memory_budget="auto"`` (default ``$LOCAL_WORLD_SIZE``, else 1); the Lightning strategy
            passes its node's.

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
        local_ranks: int | None = None,
    ) -> None:
        refuse_compiled(model, where)  # before anything is made on disk
        self.device = torch.device(device) if device is not None else model_device(model)
        ranks = dist.get_world_size(process_group) if process_group is not None else 1
        # The config resolved once, here: every part receives this value (`config.resolve`).
        self.settings: Settings = resolve(config, device=self.device, ranks=ranks, local_ranks=local_ranks)
        self.config = config = self.settings.config
        self.report = report if report is not None else log.info
        # What fuyou chose for the fields left to it, {field: (value, why)}: one line through the framework's
        # logger once the optimizer is made (`_announce_choices`); each reason at DEBUG and in summary()["choices"].
        self.choices: dict[str, tuple[Any, str]] = dict(self.settings.choices)
        for said in self.settings.said:  # "fuyou: activations (unset) took 'keep': why"
            name = said.split()[1]
            self._chose(name, getattr(config, name), said.split(": ", 2)[2], said)
        self.model = model
        self.init_weights = init_weights
        # What close() reads exists before anything can fail: a construction that fails half-way closes
        # what it made, and its own error reaches the caller.
        self.memory: MemoryTiers | None = None
        self.optimizer: FuyouAdamW | None = None
        self.swapper: ActivationSwapper | None = None
        self.streamer: WeightStreamer | None = None
        self.plan: Plan | None = None
        self.profiler: WarmupProfiler | None = None
        self._batch_guard: BatchGuard | None = None  # the warm-up's largest batch, then a larger one warned of
        # The device tier the plan asked for, until the first step under it measured what it leaves
        # (`_grow_device_tier`).
        self._device_tier_asked: int | None = None
        self._step_hook: Any = None
        self._step_pre_hook: Any = None
        self.reporting: RunReport | None = None  # made once the optimizer is: it reads its counters
        groups, defaults = optimizer_arguments(optimizer, where=where)
        if optimizer.defaults.get("fused") is None:  # converted as fused=False, torch's choice on the CPU
            self.report(_kernel_hint(where))
        if process_group is not None and not gradients_averaged and dist.get_world_size(process_group) > 1:
            sync_module_states(model, process_group)  # no DDP to make the ranks start alike: rank 0's weights
        # The run's memory tiers: built first, lent to the optimizer, the swapper and the streamer, closed last.
        self.memory = MemoryTiers(config)
        try:
            self.optimizer = FuyouAdamW(groups, **defaults, max_grad_norm=max_grad_norm, config=config,
                                        release_grads=release_grads, loss_scaling=loss_scaling,
                                        process_group=process_group, gradients_averaged=gradients_averaged,
                                        memory=self.memory)
            if config.optimizer_threads == "auto":  # chosen by the optimizer, from where the model computes
                took = self.optimizer.control.threads_asked  # what was asked, not what the worker has set yet (a race)
                took = "torch's default" if took is None else took
                self._chose("optimizer_threads", took, self.optimizer.control.threads_reason)
            self._announce_choices()
            self.reporting = RunReport(self)
            self._ddp = gradients_averaged and self.optimizer.shards is not None  # a DistributedDataParallel model
            if self._ddp:  # what DDP was told to leave alone (`ignore_streamed_in_ddp`), the optimizer sums itself
                ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
                self.optimizer.control.reduce_itself(p for name, p in model.named_parameters() if name in ignored)
            if norm_order is not None:
                self.optimizer.set_norm_order(norm_order)
            if defer_updates and config.optimizer_schedule != "backward":  # updates land as the next forward needs them
                self.optimizer.attach_model(model)
            self.plan = pinned_plan(config)
            weights = weight_tiers(config, self.plan)
            if weights not in ("device", "auto", {}):  # "auto" without a plan: after the warm-up
                self._install_streamer(weights)
            if has_meta(model):  # the rest of a model built on the meta device: resident
                materialize(model, self.device, init_weights)
            self.optimizer.control.initialise_materialized()
            if self.plan is not None:
                self.optimizer.control.expect(self.plan.predicted_by_schedule())
                self._place_state(self.plan, measured=False)  # its weights are streamed already
                self._install_swapper(self.plan.activations)
                self.report(f"fuyou planner: applying the pinned plan {config.plan}")
            elif config.activations == "auto":
                blocks = discover_blocks(model, config.blocks)
                # state_slots="auto" compares a run that speculates with one that never does: both timed
                self._batch_guard = BatchGuard(blocks[0]) if blocks else None
                self.profiler = WarmupProfiler(model, blocks, config, self.optimizer, config.planner_warmup_steps,
                                               memory=self.memory, next_forward_windows=config.state_slots == "auto"
                                               and config.optimizer_schedule == "auto" and self.optimizer.shards is None)
                if config.host_state == "auto":
                    self._report_state_split("for the warm-up (what the transfers leave); the plan then says how "
                                             "much stays")
            elif config.activations != "keep":
                self._install_swapper(config.activations)
            self._step_hook = self.optimizer.register_step_post_hook(self._after_step)
            self._step_pre_hook = self.optimizer.register_step_pre_hook(self._before_step)
        except BaseException as exc:
            undo_after(exc, self.close)  # the swapper, the streamer (weights resident again), the optimizer
            raise

    def _install_streamer(self, weights: str | dict) -> None:
        """Stream the blocks' weights (frozen and trainable) from their tiers; the optimizer publishes
        the trainable ones' updates there."""
        if self._ddp:  # DistributedDataParallel must leave the streamed parameters to the optimizer
            ignored = set(getattr(self.model, "_ddp_params_and_buffers_to_ignore", ()))
            missing = [n for n in streamed_parameter_names(self.model, self.config, weights) if n not in ignored]
            if missing:
                raise ConfigError(
                    f"weights: {len(missing)} streamed parameters (the first: {missing[0]!r}) are not ignored by the "
                    "DistributedDataParallel model, which would bring their gradients back to the device; call "
                    "fuyou_strategy.ignore_streamed_in_ddp(model, config) before wrapping the model (the Lightning "
                    "strategy and FuyouCallback do it)")
        # The last step's updates land first (after a warm-up, `next_forward` leaves them for the next
        # forward): the tier copies are made from the weights, whose device storage is then released, and the
        # masters only they held go into the optimizer's state first (streamed weights are read from there).
        self.optimizer.flush()
        self.optimizer.control.heal_masters()
        self.streamer = WeightStreamer(self.model, self.config, memory=self.memory, weights=weights,
                                       trainable=self.optimizer.control.chunk_elements(), device=self.device,
                                       init_weights=self.init_weights)
        self.streamer.install()
        self.optimizer.control.attach_weights(self.streamer)

    def _place_state(self, plan: Plan, weights: dict | None = None, *, measured: bool = True) -> None:
        """Hold the optimizer state ``plan`` leaves the device and host RAM (``device_state`` and ``host_state``
        "auto"), then stream ``weights`` (the plan's, where the streamer is not installed yet): a streamed
        parameter's state leaves the device tier, whose room goes to the next parameters (`OptimizerState.stream`),
        as the plan predicts. From then on the engine's config says what each tier took, and the host budget's
        split counts the state's share (the streamer's and the swapper's derive from it); both are said. The
        device's cached memory is then released, so that what the first step under the plan reserves measures what
        that step takes, and the device tier grows to what it leaves (`_grow_device_tier`). Without a ``measured``
        step (a pinned plan, before its first) the tier leaves free what the plan counts its steps to take."""
        leaving = []  # the parameters the streamer is about to take
        if weights:
            named = dict(self.model.named_parameters())
            leaving = [named[name] for name in streamed_parameter_names(self.model, self.config, weights)]
        device_why = self._hold_state_on_device(plan, leaving, measured)
        in_ram = self._hold_state_in_ram(plan)
        if weights:
            self._install_streamer(weights)
        self._record_state_tiers(device_why, in_ram, "beside the plan's activations and weights")
        if device_why is not None:
            release_cached_memory(self.device)
            self._device_tier_asked = plan.state_on_device

    def _record_state_tiers(self, device_why: str | None, in_ram: bool, beside: str) -> None:
        """Record what the device tier (where ``device_why`` says why it holds that much) and the host tier (where
        ``in_ram``: ``host_state="auto"``) hold now: the engine's config, the host budget's split; and say so."""
        figures = self.optimizer.control.figures()
        total = figures.state_ssd_bytes + figures.state_ram_bytes + figures.state_device_bytes
        if device_why is not None:
            self.config = self.config.replace(device_state=figures.state_device_bytes)
            self.report(f"fuyou planner: device_state='auto': {format_bytes(figures.state_device_bytes)} of the "
                        f"optimizer state's {format_bytes(total)} on the device ({device_why}), updated there")
        if in_ram:
            self.memory.state_in_ram = figures.state_ram_bytes  # the budget's split from now on
            self.config = self.config.replace(host_state=figures.state_ram_bytes)  # as applied, as summary() says
            self._report_state_split(f"(what host_memory_budget={format_bytes(self.config.host_memory_budget)} "
                                     f"leaves {beside}), the rest on the SSD")

    def _grow_device_tier(self) -> None:
        """After the first step under the plan: let the device tier take what that step left free, up to what the
        plan asked (`device_memory_left`: `_place_state` released the allocator's cache, so what is reserved now is
        what the step took). At the plan the tier was bounded by the warm-up's peak, whose steps kept every activation
        and weight on the device, which the plan may not. The memory that frees is measured here, not predicted: a
        cost model that counts short cannot run the device out of memory. The host tier then takes what it has room
        for of the rest. Every rank calls it once (data parallel: the tier lands the pending updates, a collective),
        each within its own device's memory."""
        asked, self._device_tier_asked = self._device_tier_asked, None
        held = self.optimizer.control.figures().state_device_bytes
        room = device_memory_left(self.device) or 0
        want = max(held, min(asked, held + room))
        if self.optimizer.control.hold_state_on_device(want) > held:
            self._record_state_tiers(f"the plan asked {format_bytes(asked)}; the first step under it left "
                                     f"{format_bytes(room)} of the device's memory free",
                                     self.settings.config.host_state == "auto", "beside the plan")
            self.reporting.plan_moved()  # its predicted step against the steps after the tier grew

    def _hold_state_on_device(self, plan: Plan, leaving: list[torch.nn.Parameter], measured: bool) -> str | None:
        """With ``device_state="auto"`` on an accelerator, hold as much optimizer state on the device as ``plan``
        leaves it (`Plan.state_on_device`: the first parameters' state, updated there), before the host tier
        takes its share of the rest; not the state of ``leaving``, the parameters the plan is about to stream, whose
        state the planner leaves off the device; without a ``measured`` step (a pinned plan, before its first) no more
        than leaves free what the plan counts its steps to take, until `_grow_device_tier` reads what that step left.
        Returns why that much (None: the tier is not the plan's to place). On the CPU the device is host RAM, which
        ``host_state`` holds already: nothing moves."""
        if self.config.device_state != "auto" or self.device.type in ("cpu", "meta") or not plan.state_on_device:
            return None
        # The plan counts weights, gradients, activations and the streaming window, not the runtime's context, the
        # logits or the allocator's slack: no more than the warm-up's measured peak leaves free, less 5% of the device.
        # With no step measured yet (a pinned plan), the free memory less 5% and less what the plan counts its steps
        # to take beyond what is allocated now; after the first step, what it left (`_grow_device_tier`).
        room = device_memory_headroom(self.device)
        if room is not None and not measured:
            steps_take = plan.device_peak - plan.state_on_device - (device_memory_allocated(self.device) or 0)
            room = max(0, room - max(0, steps_take))
        want = plan.state_on_device if room is None else min(plan.state_on_device, room)
        self.optimizer.control.hold_state_on_device(want, leaving)
        if want == plan.state_on_device:
            return "what the plan leaves of its memory"
        return f"the plan left {format_bytes(plan.state_on_device)}, " + (
            f"the warm-up's measured peak {format_bytes(room)}" if measured else
            f"the device's free memory beside what the plan's steps take {format_bytes(room)}")

    def _hold_state_in_ram(self, plan: Plan) -> bool:
        """With ``host_state="auto"``, let the state's host tier hold what ``plan`` leaves it (`Plan.state_in_ram`):
        moved in from the SSD, or (what the warm-up held beyond it) out to the SSD, before the plan's other host
        users start, which until `_place_state` records what it took count the tier's whole room as the state's.
        Returns whether ``host_state`` is "auto"."""
        if self.config.host_state != "auto":
            return False
        # Rank 0's plan: on another rank (its own budget) no more than its budget leaves beside the plan's other users.
        room = self.config.host_memory_budget - (plan.host_peak - plan.state_in_ram)
        want = max(0, min(plan.state_in_ram, room))
        self.optimizer.control.hold_state_in_ram(want)  # its limit too, which a streamed block's state may fill
        self.memory.state_in_ram = want
        return True

    def _report_state_split(self, why: str) -> None:
        """Say how much of the optimizer state is in host RAM (``host_state="auto"``), and ``why``."""
        figures = self.optimizer.control.figures()
        on_ssd, in_ram = figures.state_ssd_bytes, figures.state_ram_bytes
        self.report(f"fuyou planner: host_state='auto': {format_bytes(in_ram)} of the optimizer state's "
                    f"{format_bytes(on_ssd + in_ram)} in host RAM {why}")

    def _install_swapper(self, activations: str | dict) -> None:
        # The swapper applies only the activation policies (the engine applies the plan's weight tiers).
        self.swapper = ActivationSwapper(self.model, self.config, memory=self.memory, policies=activations)
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
        self.reporting.begin_micro_batch()

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.reporting.before_step()

    def expect_steps(self, steps: int | None) -> None:
        """The run's length in optimizer steps (the adapters pass the trainer's), for the SSD wear
        projection. Warns at once if the optimizer state's own writes (12 bytes per trainable
        parameter per step, a floor) would spend more than ``ssd_wear_warning`` of the drives'
        rated endurance; the measured figure follows after the first steps (`wear`)."""
        self.reporting.expect_steps(steps)

    def end_trace(self) -> None:
        """Write the trace now if one is recording (training ended inside the traced steps: those
        recorded are kept); `close` and the adapters' end of training call it."""
        if self.reporting is not None:
            self.reporting.end_trace()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.swapper is not None:
            self.swapper.release()  # every backward of the window is done: anything left is garbage
        self.reporting.after_step()
        if self.profiler is not None:
            steps = self.profiler.steps
            self.profiler.after_step()
            if self.profiler.done:
                self._plan_from_warmup()
            else:  # the warm-up's progress, through the framework's channel
                more = self.profiler.steps - steps
                self.report(f"fuyou planner: warm-up step {self.profiler.steps_seen}/{self.profiler.steps} profiled" + (
                    f"; {more} more under next_forward, to time a run that never speculates (state_slots='auto')"
                    if more else ""))
        else:
            if self._device_tier_asked is not None:
                self._grow_device_tier()
            self.reporting.report_plan()

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
        how = {"allowed": allowed, "weight_tiers": tiers, "write_tolerance": self.config.ssd_write_tolerance}
        try:
            self.plan = solve(profile, **how)
        except PlanError as exc:
            fields = "activations='auto', weights='auto'" if tiers else "activations='auto'"
            error = ConfigError(f"{fields}: {exc}")
        shards = self.optimizer.shards
        two = None if error else self.plan
        one = self._one_slot(profile, two, how) if shards is None else None
        if one is not None and self.config.state_slots == "auto":  # taken: the state keeps one slot from now on
            why = _one_slot_why(two, one)
            self.plan, error, one = one, None, None
            freed = self.optimizer.control.keep_one_slot()
            self.config = self.config.replace(state_slots=1)  # the settings as applied, as the summary reports them
            self._chose("state_slots", 1, f"{why}; the state's shadow slots freed ({format_bytes(freed)})")
            self.report(f"fuyou planner: state_slots='auto' took 1: {why}; the optimizer state keeps one slot "
                        f"({format_bytes(freed)} freed), each update landing before its block's next forward")
        elif one is not None and error is not None:
            error = ConfigError(f"{error}. With one slot of state it fits: FuyouConfig(state_slots=1) holds half the "
                                f"optimizer state, each update landing before its block's next forward (predicted "
                                f"{one.predicted_step_s:.3f} s/step)")
        if shards is not None:  # data parallel: every rank applies rank 0's plan (the same tiers and collectives)
            chosen = [self.plan, error]
            shards.broadcast_object(chosen)
            self.plan, error = chosen
        if error is not None:
            raise error
        self.report(f"fuyou planner: plan (predicted {self.plan.predicted_step_s:.3f} s/step)\n"
                    f"{self.plan.table(compact=True)}")
        if one is not None:
            faster = self.plan.predicted_step_s / one.predicted_step_s
            said = (f"the predicted step is {one.predicted_step_s:.3f} s, {faster:.2f}x faster"
                    if one_slot_faster(self.plan, one) else
                    f"{_one_slot_why(self.plan, one)} (predicted {one.predicted_step_s:.3f} s against "
                    f"{self.plan.predicted_step_s:.3f} s)")
            self.report(f"fuyou planner: with one slot of state, FuyouConfig(state_slots=1), {said}: half the "
                        "optimizer state in every tier, each update landing before its block's next forward instead "
                        "of during backward (state_slots='auto' takes it)")
        self._place_state(self.plan, self.plan.weights if tiers else None)
        if any(p != Policy.KEEP.value for p in self.plan.policies):
            self._install_swapper(self.plan.activations)
        # the warm-up's windows cost what the plan no longer does
        self.optimizer.control.expect(self.plan.predicted_by_schedule(), forget_measured=True)
        self.reporting.plan_applied()
        if self._batch_guard is not None:  # a larger batch is warned of where the device's memory bounds the plan
            if self.plan.budgets.get("device") is not None:
                self._batch_guard.arm()
            else:
                self._batch_guard.remove()

    def _one_slot(self, profile: Any, two: Plan | None, how: dict[str, Any]) -> Plan | None:
        """The plan with one slot of state, where this run has two (``state_slots`` 2 or "auto") and one is worth
        naming or taking (`worth_one_slot`: it fits where two do not, or is predicted faster, or on the CPU holds the
        whole state in RAM where two do not); None otherwise, or where the schedule is pinned to ``backward``, which
        one slot cannot run. One more solve, at the end of the warm-up."""
        if self.config.state_slots == 1 or self.config.optimizer_schedule == "backward":
            return None
        one = one_slot(profile, **how)
        return one if one is not None and worth_one_slot(two, one) else None

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
        return self.optimizer.master_weights()

    # -- reporting (`run_report.RunReport`) ---------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """The last optimizer step's figures, for a training logger (keys under ``fuyou/``; empty
        before the first step). Plain floats from counters the step keeps anyway, taken at its end
        without waiting for the drive or the device. A step decided on the device (the whole state on
        an accelerator's device tier, docs/device-state.md) is read here, not at its end: that waits for the
        device to reach the step's gradient norm, so read them at the logger's interval (the Lightning
        strategy and the HF callback do).

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
        return self.reporting.metrics()

    def _chose(self, name: str, value: Any, why: str, said: str | None = None) -> None:
        """Record a choice and say it, with its reason, at DEBUG."""
        self.choices[name] = (value, why)
        log.debug(said or f"fuyou: {name}='auto' took {value}: {why}")

    def _announce_choices(self) -> None:
        """One short line of what fuyou chose; the reasons are in summary()["choices"] and at DEBUG."""
        if self.choices:
            shown = ", ".join(f"{name}={_short(value)}" for name, (value, _why) in self.choices.items())
            self.report(f"fuyou: chose {shown} (why: summary()['choices'])")

    def summary(self) -> dict[str, Any]:
        """What the run did: steps, clipping outcomes, bytes on SSD, peak host memory, step time."""
        return self.reporting.summary()

    def format_summary(self) -> str:
        """`summary` as a few human-readable lines."""
        return self.reporting.format_summary()

    @property
    def step_times(self) -> list[float]:
        """Seconds between consecutive optimizer steps."""
        return self.reporting.step_times

    @property
    def micro_batches(self) -> int:
        return self.reporting.micro_batches

    @property
    def wear(self) -> Wear | None:
        """The run's SSD wear, measured after the first steps."""
        return self.reporting.wear

    # -- what the adapters ask of the run --------------------------------------------------------------------
    @property
    def scales_loss(self) -> bool:
        """fp16 loss scaling is on: the loop's loss must be backwarded scaled (`scale_loss`, `scale_backward`)."""
        return self.optimizer.scaler is not None

    @property
    def data_parallel(self) -> bool:
        """The optimizer state is sharded over several ranks."""
        return self.optimizer.shards is not None

    @property
    def last_grad_norm(self) -> float:
        """The global gradient norm of the last step (over every rank's parameters), before clipping."""
        return self.optimizer.stats.last_grad_norm

    @property
    def closed(self) -> bool:
        return self.optimizer.closed

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale, to backward (`FuyouAdamW.scale_loss`)."""
        return self.optimizer.scale_loss(loss)

    def scale_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Make the backward of ``loss`` run scaled; returns it unchanged (`FuyouAdamW.scale_backward`)."""
        return self.optimizer.scale_backward(loss)

    def attach_ddp(self, ddp_model: Any) -> None:
        """Updates as a ``DistributedDataParallel`` model's buckets land (`OptimizerControl.attach_ddp`)."""
        self.optimizer.control.attach_ddp(ddp_model)

    def stop_updates(self) -> None:
        """No backward queues an update from now on (a stray backward after training)."""
        self.optimizer.updates_enabled = False

    # -- lifetime -------------------------------------------------------------------------------------
    def __enter__(self) -> "FuyouEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Land pending updates, take the hooks off the model and optimizer and delete the swap files.

        Every part is closed even when an earlier one raises (e.g. a weight that cannot come back because
        its update failed: the workers still stop and the files still go); the first error is raised."""
        close_all(self._remove_hooks, self.end_trace, self._close_swapper, self._close_streamer, self._close_optimizer,
                  self._close_memory)

    def _remove_hooks(self) -> None:
        for hook in (self._step_hook, self._step_pre_hook):
            if hook is not None:
                hook.remove()
        self._step_hook = self._step_pre_hook = None
        if self.profiler is not None:
            self.profiler.remove()
            self.profiler = None
        if self._batch_guard is not None:
            self._batch_guard.remove()

    def _close_swapper(self) -> None:
        if self.swapper is not None:
            self.swapper.uninstall()
            self.swapper.close()

    def _close_streamer(self) -> None:
        if self.streamer is not None:
            self.streamer.close()  # every weight resident again before the store goes

    def _close_optimizer(self) -> None:
        if self.optimizer is not None:
            self.optimizer.close()  # its updates landed, its worker stopped

    def _close_memory(self) -> None:
        if self.memory is not None:
            self.memory.close()  # last: the swap files and the host pool
