"""`FuyouAdamW`: out-of-core AdamW whose updates overlap backward and stay exact.

fp32 master weights and both Adam moments live in the tensor store (on SSD), interleaved per chunk
(`OptimizerState`, the one owner of that layout), so one read fetches all three. The model keeps only
its compute-precision weights (fp32 or bf16).

How a step runs:

1. During backward, a post-accumulate-grad hook fires as each parameter's gradient becomes final;
   the hook takes the gradient from where it is (`Gradients`: the ``.grad``, a streamed gradient's
   host copy) and, under the ``backward`` schedule, queues the update on the state's worker thread,
   which reads the parameter's state from the *active* slot (reading ahead), applies the fused AdamW
   kernel, writes the new state into the *shadow* slot and the new weight into the parameter. Backward
   no longer needs a parameter once its gradient is accumulated, so this is safe while backward goes on.
2. `step()` waits for the worker and every write (futures, not timing), then knows the global
   gradient norm and whether every gradient is finite:

   - finite and clipping does not bite (the common case): **commit** — the slots flip, no extra I/O;
   - clipping bites: **redo** — the shadow slot is discarded and every update is computed again
     from the active slot with the clip coefficient, exactly as ``clip_grad_norm_`` followed by
     ``AdamW.step`` would;
   - a non-finite gradient: **skip** — the shadow is discarded, weights are restored from the
     active master, and state and step counts are untouched.

That is the ``"backward"`` schedule (`schedule.Speculative`). Under ``"next_forward"``
(`schedule.Exact`) backward only moves gradients out of the way; ``step()`` knows the global norm at
once, so every update is exact the first time (no shadow slot, no redo): it queues them in forward
order and — when `attach_model` has given it the model — returns, the next forward waiting module by
module for the weights it reads. ``"auto"`` picks one of the two per step from measured costs
(`ScheduleChooser`); all three give bitwise the same weights.

The parts, each with one job (this class owns the torch contract — param groups, ``state["step"]``,
``state_dict`` — and delegates the rest)::

    FuyouAdamW ── Window (one accumulation window) ── Speculative | Exact (schedules, `Parts`)
       │             Gradients (resident / streamed / DDP bucket → Grad) ── Updater (builds an update)
       │             Solo | Sharding (one process / a shard of a process group)
       ├── OptimizerControl (``opt.control``: what the engine and the planner ask and change; `figures`)
       ├── Saves (what a save holds, how it is restored) ── checkpoint (the file format)
       └── OptimizerState (layout, slots, worker)

The result is bitwise equal to ``torch.optim.AdamW`` with the same kernel applied to the same
gradients after ``clip_grad_norm_``: ``fused=True`` (the default here) to ``AdamW(fused=True)``,
``fused=False`` to the default for-loop ``AdamW()`` (tests check both).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from ..cleanup import undo_after
from ..config import STATE_BYTES_PER_PARAM, ConfigError, FuyouConfig, auto_optimizer_threads, settled
from ..device import computes_on_host, usable_cores
from ..storage import MemoryTiers, TensorStore, state_chunk_bytes
from . import onepass
from .control import OptimizerControl
from .distributed import Sharding, Shards, Solo
from .gradients import Gradients, StreamedGradients
from .scaler import LossScaler
from .schedule import BACKWARD, Order, Parts, PendingUpdates, StepStats, Unsettled
from .formats import StateFormat
from .saves import Saves
from .state import ELEMENT_BYTES, OptimizerState, ParamState, adamw_kernel, balanced_chunk
from .updates import Updater
from .window import Window

log = logging.getLogger(__name__)

__all__ = ["FuyouAdamW", "StepStats", "STATE_BYTES_PER_PARAM", "adamw_kernel"]

_COMPUTE_DTYPES = (torch.float32, torch.bfloat16)


class FuyouAdamW(torch.optim.Optimizer):
    """AdamW with fp32 master weights and moments on SSD, updated during backward, exactly.

    Use it like ``torch.optim.AdamW`` — ``loss.backward(); opt.step(); opt.zero_grad()`` —
    with two differences: clip with ``max_grad_norm`` (gradients are consumed during
    backward, so ``clip_grad_norm_`` after backward comes too late), and wrap micro-batches
    that must only accumulate in ``with opt.no_update():``. Stock LR schedulers work.

    Args:
        params: parameters or param groups (per-group ``lr``, ``betas``, ``eps``,
            ``weight_decay`` overrides). Frozen parameters (``requires_grad=False``) are
            ignored; trainable ones must be fp32 or bf16 and contiguous.
        lr, betas, eps, weight_decay: as in ``torch.optim.AdamW`` (decoupled decay;
            default ``weight_decay=0.01``).
        max_grad_norm: clip the global L2 gradient norm to this value, exactly (see the
            module docstring); ``None`` disables clipping.
        config: `FuyouConfig` (swap directories, host budget, chunk size, I/O threads,
            read-ahead); ``None`` means defaults with a temporary swap directory. An unresolved config
            (``"auto"`` fields) is resolved here (`config.resolve`).
        memory: the run's memory tiers (`storage.MemoryTiers`) to borrow (`FuyouEngine` lends its own);
            ``None``: the optimizer builds its own and closes them in `close`.
        release_grads: drop each ``.grad`` as its update is queued (the update holds the tensor until
            it is written) when no redo can need it (``max_grad_norm is None``); saves a model's worth
            of gradient memory.
            Otherwise gradients are kept until ``zero_grad``, as usual.
        fused: the kernel, as in ``torch.optim.AdamW``: ``True`` uses torch's fused CPU kernel
            (fastest; bitwise equal to ``AdamW(fused=True)``), ``False`` the for-loop kernel
            (bitwise equal to the default ``AdamW()`` on the CPU). The update is elementwise,
            so chunking never changes a bit.
        loss_scaling: dynamic loss scaling with ``torch.amp.GradScaler``'s semantics (`LossScaler`):
            ``True`` for GradScaler's defaults, or a dict of its arguments. Needed for fp16
            weights (fp32 and bf16 may use it too). Backward ``opt.scale_loss(loss)``; ``step()``
            unscales, clips the unscaled gradients, skips on inf/NaN and updates the scale —
            bitwise as ``scaler.unscale_``, ``clip_grad_norm_``, ``scaler.step``, ``scaler.update``.
        process_group, gradients_averaged: data parallelism (`distributed`): each rank keeps the
            state of the parameters it owns; ``gradients_averaged`` when a DistributedDataParallel
            model averaged the gradients in backward.

    Costs: SSD traffic of 12 bytes read + 12 bytes written per parameter per step; host
    memory of at most ``config.host_memory_budget``. ``amsgrad``, ``maximize``, ``capturable``,
    ``differentiable`` (when true) and fp16 weights without ``loss_scaling`` are refused;
    ``foreach`` is accepted and ignored (chunks are updated one at a time either way).

    ``config.optimizer_schedule`` decides when updates run (module docstring); with
    ``"next_forward"`` chosen, ``step()`` lands its updates before it returns unless
    `attach_model` lets the next forward wait for them (then `flush` before reading weights
    outside a forward; ``state_dict`` and checkpoints do it themselves).

    Statistics are in ``opt.stats`` (`StepStats`: outcomes, rollback rate, schedule per step), the counters
    in ``opt.control.figures()``; what the engine and the planner change between steps (the state's host
    tier, streamed weights, DDP's comm hook) is ``opt.control`` (`OptimizerControl`). Call ``close()`` (or
    use ``with``) to release the swap files. Attributes are never rebound after
    construction: a wrapper that borrows these methods (Fabric's) changes the same parts.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, max_grad_norm: float | None = None,
                 config: FuyouConfig | None = None, release_grads: bool = True, fused: bool = True,
                 loss_scaling: "bool | dict | LossScaler | None" = None, process_group: Any = None,
                 gradients_averaged: bool = False, memory: MemoryTiers | None = None, **unsupported: Any) -> None:
        _check_arguments(lr, betas, max_grad_norm, unsupported)
        super().__init__(_trainable(params), dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.max_grad_norm, self.fused = max_grad_norm, bool(fused)
        self.scaler = LossScaler.resolve(loss_scaling)
        self._stats = StepStats()
        # Called, on the training thread, after a checkpoint was loaded (`load_folder`, `load_state_dict`):
        # the run's reporting takes the restored counts as its new starting point.
        self.on_loaded: list[Callable[[], None]] = []
        self.config = config = settled(config if config is not None else memory.config if memory is not None else None)
        # The memory tiers: borrowed from the engine, or built here (below) and closed by `close`.
        self.memory: MemoryTiers | None = memory
        elems = state_chunk_bytes(config) // ELEMENT_BYTES
        self.state_format = StateFormat(config.state_format)
        self._params: list[ParamState] = []
        for group in self.param_groups:
            for p in group["params"]:
                _check_param(p, len(self._params), scaled=self.scaler is not None)
                i = len(self._params)
                chunk = balanced_chunk(p.numel(), elems)
                self._params.append(ParamState(i, p, group, f"adamw.{i}", chunk, -(-p.numel() // chunk),
                                               layout=self.state_format.layout(p.numel())))
        if not self._params:
            raise ConfigError("FuyouAdamW: no trainable parameter (all have requires_grad=False, or none were given)")
        self._by_param = {ps.param: ps for ps in self._params}
        shards = None  # data parallel: which rank owns each parameter's state
        if process_group is not None and dist.get_world_size(process_group) > 1:
            if config.optimizer_schedule == BACKWARD and not gradients_averaged:
                raise ConfigError("optimizer_schedule: got 'backward' with a process group that this optimizer reduces "
                                  "itself; speculative updates during backward need each gradient's average as it "
                                  "lands (a DistributedDataParallel model, `attach_ddp`): use 'next_forward' or 'auto'")
            shards = Shards(process_group, self._params, config)
        owned = [ps for ps in self._params if shards is None or shards.owns(ps)]
        # the worker's intra-op threads asked for (None: torch's default) and why (`OptimizerControl.threads_asked`)
        threads = _worker_threads(config, [ps.param for ps in self._params])
        # the update's kernel: the one pass where it builds here (`onepass`), else torch's; and why
        kernel = onepass.choose(config.update_kernel, fused=self.fused, state_format=config.state_format)
        owns = memory is None
        if owns:
            memory = self.memory = MemoryTiers(config)
        shares = memory.shares
        try:  # stops its worker if it fails; its read-ahead leaves the transfers' reserved share of the pool free
            self.adam_state = OptimizerState(owned, config, memory.store, shares.optimizer_depth,
                                             spare_from=shares.reserved, threads=threads[0])
        except BaseException as exc:
            if owns:
                undo_after(exc, memory.close)
            raise
        # Everything that outlives a forgotten optimizer (the worker thread, the hooks on the parameters, the
        # tiers it built) is released by one finalizer: on close(), or when the optimizer is collected. The
        # hooks hold the optimizer only weakly, so a model that outlives its optimizer does not keep the swap
        # files alive.
        self._hooks: list[Any] = []
        self._workers: list[Any] = [self.adam_state.pipeline]  # closed by the finalizer, in this order
        self._finalizer = weakref.finalize(self, _release, self._hooks, self._workers, memory if owns else None)
        try:
            self.landing = PendingUpdates(self.adam_state.pipeline)
            self.sharding: Solo | Sharding = Solo(self.landing) if shards is None else Sharding(
                shards, self._params, config, self.landing, self.adam_state.store, gradients_averaged=gradients_averaged)
            if shards is not None:
                self._workers.append(self.sharding)  # its sender
            # Torch's contract: ``state[param]["step"]``, a 0-d fp32 tensor. Here a view of the parameter's count in
            # `Parts.counts`, which the updates read and advance in one op: to be read, not replaced (a tensor put in
            # its place would not be read or advanced; a load restores the counts).
            self._counts = torch.zeros(len(self._params))
            for ps in self._params:
                self.state[ps.param]["step"] = self._counts[ps.index]
            self.window = Window()
            streamed = StreamedGradients(self.adam_state, self.window, keep_free=shares.optimizer_readahead,
                                         timeout=config.io_timeout, norm_kernel=kernel[0])
            self.updates = Updater(self.adam_state, self._counts, self.window, streamed, fused=self.fused,
                                   release_grads=release_grads and max_grad_norm is None and shards is None,
                                   clipping=max_grad_norm is not None, scaler=self.scaler, one_pass=kernel[0])
            self.gradients = Gradients(streamed, self.window, sharded=shards is not None,
                                       updates_on_device=self.adam_state.updates_on_device, norm_kernel=kernel[0],
                                       ahead_keep_free=shares.reserved)
            self._order = Order(self._params)
            parts = Parts(self.adam_state, self.updates, self.gradients, self.sharding, self.window, self._order,
                          self.landing, self._stats, max_grad_norm, self._counts)
            self._parts = parts
            # The engine's and the planner's handle (`OptimizerControl`): it chooses the first window's schedule
            # and writes the masters of the parameters that have memory.
            self.control = OptimizerControl(self._params, parts, config, can_speculate=config.state_slots != 1 and (
                shards is None or gradients_averaged), gradients_averaged=gradients_averaged,
                threads=threads, kernel=kernel, finalizer=self._finalizer)
            self.chooser = self.control.chooser
            self._saves = Saves(self._params, parts, self.control, config, state_format=self.state_format,
                               scaler=self.scaler, on_loaded=self.on_loaded)
            on_grad_ready = weakref.WeakMethod(self._on_grad_ready)
            self._hooks.extend(ps.param.register_post_accumulate_grad_hook(lambda p: _call_alive(on_grad_ready, p))
                               for ps in self._params)
        except BaseException as exc:
            # Not close(): it reads attributes a half-built optimizer may lack, and nothing can be pending yet.
            undo_after(exc, self._finalizer)
            raise

    @property
    def store(self) -> TensorStore:
        """The tensor store holding the state (and streamed weights' and gradients' entries): the tiers'."""
        return self.memory.store

    @property
    def stats(self) -> StepStats:
        """What happened to the steps so far (`StepStats`). A step decided on the device (`schedule.Unsettled`) is
        read first: that waits for the device to reach the step's gradient norm."""
        self._parts.settle()
        return self._stats

    def recorded(self) -> tuple[StepStats, Unsettled | None]:
        """The statistics as recorded so far, and the last step if it was decided on the device and is unread; waits
        for nothing. Until that step is read (`stats`, the next step() or backward), it counts as applied and unclipped,
        and ``last_grad_norm`` is the step's before it; `Unsettled.when_settled` tells what it was. Between steps,
        on the training thread: the same object `stats` returns."""
        return self._stats, self._parts.pending()

    @property
    def shards(self) -> Shards | None:
        """Data parallel: who owns each parameter's state; ``None`` in one process."""
        return self.sharding.shards

    @property
    def next_schedule(self) -> str:
        """The schedule of the accumulation window being accumulated now."""
        return self.window.schedule.name

    # -- the hooks: they only queue ----------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        # The last step's updates land before this backward's touch their state (sharded: the same list on
        # every rank, so every rank enters the collective here alike).
        if self.sharding.pending():
            self.sharding.land()
        if self._parts.unsettled:  # the last step's counts are read before this backward's updates read them
            self._parts.settle()
        ps, schedule = self._by_param[param], self.window.schedule
        grad = self.gradients.on_backward(ps, speculating=schedule.speculates, inv_scale=self.updates.inv_scale)
        if grad is not None:
            schedule.on_gradient_final(ps, grad)

    # -- the step ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finish the accumulation window: under the ``backward`` schedule commit the updates that ran
        during backward, redo them with clipping, or skip; under ``next_forward`` queue every exact
        update (run here and waited for, unless `attach_model` lets the next forward wait), or skip.
        Parameters whose gradient was set without backward hooks firing (by hand) are updated here.
        Returns the closure's loss, if a closure was given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.control.check_materialized()
        self._land()  # normally the forward waited for all of them already
        window, stats = self.window, self.stats
        if self.scaler is not None and not window.scaled and (window.norms or window.partial or any(
                ps.param.grad is not None for ps in self._params)):
            self.zero_grad()  # the updates used gradients taken as scaled: discard them
            raise RuntimeError("FuyouAdamW (loss_scaling): this step's backward was not scaled; backward "
                               "opt.scale_loss(loss) (or call opt.scale_backward(loss) before backward)")
        window.scaled = False
        clipped, schedule = stats.clipped, window.schedule.name
        outcome = window.schedule.finish()
        if outcome is None:
            return loss  # no gradient in this window: nothing happened, the schedule stays
        if self.scaler is not None:  # GradScaler.update: back off after inf/NaN, else count towards growth
            self.scaler.update(found_inf=outcome.name == "skip")
        # Whether the backward schedule rolled back, or would have: a non-finite gradient, or clipping bit.
        self.chooser.end_step(schedule, rolled=outcome.name == "skip" or stats.clipped > clipped,
                              rollback_s=outcome.rollback_s)
        stats.record(schedule, outcome.name)
        if outcome.unsettled is not None:  # decided on the device: clipped, or a skip after all, once read
            outcome.unsettled.when_settled(self._settled)
        reason = self.control.choose(agree=True)  # each rank's chooser measured its own windows: rank 0's choice holds
        if window.schedule.name != schedule or reason != stats.last_reason:
            level = logging.INFO if window.schedule.name != schedule else logging.DEBUG
            log.log(level, "FuyouAdamW: schedule %s for the next step (%s)", window.schedule.name, reason)
        stats.last_reason = reason
        log.debug("FuyouAdamW: step %d used %s: %s", stats.steps + stats.skips, schedule, outcome.name)
        return loss

    def _settled(self, outcome: str, clipped: bool) -> None:
        """A step decided on the device was read (`schedule.Unsettled`): what `step` recorded of it, amended."""
        if outcome == "skip" and self._stats.history:
            self._stats.history[-1] = (self._stats.history[-1][0], outcome)
        if outcome == "skip" or clipped:
            self.chooser.amend_last(rolled=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; between backward and `step()` this also discards the speculative updates
        (and the streamed gradients accumulated so far)."""
        window = self.window
        if window.pending():
            queued = [ps for ps in self._params if window.queued(ps)]
            try:
                self.adam_state.drain()  # the worker writes into the window: clear it only afterwards
            finally:
                window.forget()
                window.schedule.discard(queued)
        try:
            self.gradients.drop_staged()  # the copies backward's hook started for a step() that will not come
        finally:
            super().zero_grad(set_to_none=set_to_none)

    @property
    def updates_enabled(self) -> bool:
        """Whether a backward queues updates; a training loop sets it ``False`` for every micro-batch
        but the last of an accumulation window (`no_update` does the same as a context manager)."""
        return self.window.updates

    @updates_enabled.setter
    def updates_enabled(self, enabled: bool) -> None:
        self.window.updates = bool(enabled)

    @contextlib.contextmanager
    def no_update(self) -> Iterator[None]:
        """Accumulate gradients without updating (every micro-batch but the last), like DDP's ``no_sync``."""
        previous, self.window.updates = self.window.updates, False
        try:
            yield
        finally:
            self.window.updates = previous

    def set_norm_order(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum the global gradient norm over parameters in this order (default: param-group order): float
        sums depend on order, and the Trainers clip in model order while their AdamW groups decay /
        no-decay parameters apart — pass ``model.parameters()``. Parameters not listed come last."""
        self._order.norm = Order.ranked(self._params, params)

    # -- loss scaling (fp16) ------------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (``GradScaler.scale``): backward this instead of ``loss`` under ``loss_scaling``."""
        self._scaler("scale_loss")
        self.window.scaled = True
        return self.scaler.scale(loss)

    def scale_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Make the backward of ``loss`` (or of anything the loop derives from it, e.g. ``loss / k``) run as
        if ``scale_loss(loss)`` had been backwarded (for a loop that backwards a loss it builds itself, the
        HF Trainer's); returns ``loss`` unchanged, so logs see the real loss."""
        self._scaler("scale_backward").scale_backward(loss)
        self.window.scaled = True
        return loss

    def _scaler(self, what: str) -> LossScaler:
        if self.scaler is None:
            raise RuntimeError(f"FuyouAdamW.{what}: no loss scaling configured; pass loss_scaling=True")
        return self.scaler

    # -- the model: updates left for the next forward ---------------------------------------------------
    def attach_model(self, model: torch.nn.Module) -> None:
        """Let ``step()`` leave the ``next_forward`` schedule's updates to run ahead of the next forward: a
        forward pre-hook on every module that owns parameters of this optimizer waits for their updates
        (and only theirs); state-dict pre-hooks on ``model`` land them all (`flush`). Updates then run in
        the order of ``model.parameters()``. A weight read outside its module's forward needs `flush`
        first; such a read saved for backward is caught by autograd's version check."""
        if self.landing.gated:
            return
        land = weakref.WeakMethod(self._land)  # the model's hooks must not keep the optimizer alive
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if p in self._by_param]
            if own:
                self._hooks.append(module.register_forward_pre_hook(lambda m, args, own=own: _call_alive(land, own)))
        self._hooks.append(model.register_state_dict_pre_hook(lambda *args: _call_alive(land)))
        self._hooks.append(model.register_load_state_dict_pre_hook(lambda *args: _call_alive(land)))
        self._order.update = Order.ranked(self._params, model.parameters())
        self.landing.gated = True

    def flush(self) -> None:
        """Land every update ``step()`` left for the next forward: before the weights are read outside a
        forward (integrations, `state_dict` and the model's own ``state_dict`` do it). A collective under
        data parallelism: every rank calls it at the same point."""
        self._land()

    def _land(self, params: Iterable[torch.nn.Parameter] | None = None) -> None:
        self.sharding.land(params)

    # -- checkpoints (`Saves`) -----------------------------------------------------------------------------
    def state_dict(self, folder: str | os.PathLike | None = None, *, keep_previous: bool = False,
                   record: dict[str, Any] | None = None) -> dict[str, Any]:
        """Torch's optimizer state dict; with ``folder``, also stream the SSD state there as a new save
        ``folder/<token>/`` (checksummed, never whole in RAM; `checkpoint`), named by ``sd["fuyou"]``:
        `load_state_dict` accepts the dict only with that very save. The earlier saves in ``folder`` go
        once the new one is complete; ``keep_previous`` leaves them for a caller that records the token
        elsewhere first (the Lightning ``.ckpt``). ``record`` is kept in the save's metadata. Without
        ``folder`` the dict holds hyper-parameters and step counts only."""
        self.control.check_idle("state_dict")
        sd = super().state_dict()
        sd["fuyou"] = {"folder": None} if folder is None else self._saves.write(
            folder, self.param_groups, keep_previous=keep_previous, record=record)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a dict from `state_dict`, streaming the SSD state back from the save it names (a dict whose
        save is no longer in its folder is refused, saying which side is stale). Checksums are verified
        while streaming and nothing is committed unless every one matches."""
        self.control.check_idle("load_state_dict")
        self._saves.load_dict(state_dict, self.param_groups)

    def load_folder(self, folder: str | os.PathLike, token: str | None = None) -> dict[str, Any]:
        """Stream the newest save in ``folder`` (or the one with ``token``) back: masters, moments, steps,
        hyper-parameters and weights (checksums verified; a bad save changes nothing); returns its metadata."""
        self.control.check_idle("load_folder")
        return self._saves.load_folder(folder, token, self.param_groups)

    # -- reading state back ----------------------------------------------------------------------------
    def read_state(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """The committed fp32 ``master``, ``exp_avg`` and ``exp_avg_sq`` of one parameter (in RAM)."""
        self.landing.wait_all()
        ps = self._by_param[param]
        self.sharding.check_owner(ps, "read_state")
        return self.adam_state.read(ps)

    def master_weights(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """The fp32 master of every parameter kept in lower precision (bf16). Data parallel: a collective
        that gathers them from their owners on rank 0, one at a time; the other ranks get ``{}``."""
        params = [ps for ps in self._params if ps.param.dtype != torch.float32]
        gathered = self.sharding.gather_to_first(params, lambda ps: self.read_state(ps.param)["master"])
        return {ps.param: master for ps, master in gathered.items()}

    # -- lifetime -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Land the updates left for the next forward (none once one has failed: its error was raised), remove the
        hooks, stop the worker and delete the swap files (also done when the optimizer is garbage collected)."""
        if self._finalizer.alive:
            try:
                if self.landing.failed is None:
                    self.landing.wait_all()
            finally:
                self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "FuyouAdamW":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release(hooks: list[Any], workers: list[Any], memory: MemoryTiers | None) -> None:
    """`FuyouAdamW`'s finalizer: hooks off the parameters, workers stopped (the chunk pipeline, the weight
    sender), then the tiers closed when the optimizer built them (`MemoryTiers.close`: streamed weights made
    resident again from their tier copies, so a model outliving its optimizer keeps its weights; swap files
    deleted)."""
    for hook in hooks:
        hook.remove()
    hooks.clear()
    try:
        for worker in workers:
            worker.close()
    finally:
        if memory is not None:
            memory.close()


def _call_alive(method: "weakref.WeakMethod", *args: Any) -> None:
    bound = method()
    if bound is not None:
        bound(*args)


def _worker_threads(config: FuyouConfig, params: list[torch.Tensor]) -> tuple[int | None, str]:
    """The intra-op threads of the optimizer's worker (`FuyouConfig.optimizer_threads`; ``None``: torch's
    default), and why (one sentence; `FuyouEngine` announces it, `summary()` reports it)."""
    if config.optimizer_threads != "auto":
        return config.optimizer_threads, "optimizer_threads was given"
    return auto_optimizer_threads(computes_on_host(params), usable_cores(), torch.get_num_threads())


def _trainable(params: Iterable[Any]) -> list[Any]:
    """Param groups with frozen parameters dropped. A group left empty is kept, so that group
    indices — which LR schedulers rely on (one lambda per group) — do not shift."""
    params = list(params)
    if params and isinstance(params[0], dict):
        return [{**group, "params": [p for p in group["params"] if p.requires_grad]} for group in params]
    return [p for p in params if p.requires_grad] or [{"params": []}]


def _check_arguments(lr: float, betas: tuple[float, float], max_grad_norm: float | None,
                     unsupported: dict[str, Any]) -> None:
    for name, value in unsupported.items():
        if name in ("amsgrad", "maximize", "capturable", "differentiable") and not value:
            continue
        if name == "foreach" and value in (None, False, True):
            continue  # chunks are updated one at a time either way
        raise ConfigError(
            f"FuyouAdamW: {name}={value!r} is not supported; remove it "
            "(supported: lr, betas, eps, weight_decay, max_grad_norm, config, release_grads, fused, loss_scaling)"
        )
    if not 0.0 <= lr:
        raise ConfigError(f"lr: got {lr}; expected a learning rate >= 0")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ConfigError(f"betas: got {betas}; each must be in [0, 1)")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ConfigError(f"max_grad_norm: got {max_grad_norm}; expected a positive number, or None to disable")


def _check_param(p: torch.Tensor, index: int, *, scaled: bool) -> None:
    if p.dtype == torch.float16 and not scaled:
        raise ConfigError(
            f"parameter {index} {tuple(p.shape)} is float16: fp16 compute weights need loss scaling; pass "
            "loss_scaling=True (torch.amp.GradScaler's defaults, or a dict of its arguments) and scale the loss with "
            "opt.scale_loss(loss), or use bfloat16 weights"
        )
    if p.dtype not in _COMPUTE_DTYPES and p.dtype != torch.float16:
        raise ConfigError(f"parameter {index} {tuple(p.shape)} is {p.dtype}; FuyouAdamW trains float32, bfloat16 "
                          "or (with loss_scaling) float16 weights")
    if not p.is_contiguous():
        raise ConfigError(f"parameter {index} {tuple(p.shape)} is not contiguous; call .contiguous() on it before training")
    if p.numel() == 0:
        raise ConfigError(f"parameter {index} {tuple(p.shape)} has no elements, so no state to keep; leave it out of the "
                          "optimizer's parameters or set requires_grad=False on it")
