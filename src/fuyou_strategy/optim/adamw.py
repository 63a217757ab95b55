"""`FuyouAdamW`: out-of-core AdamW whose updates overlap backward and stay exact.

fp32 master weights and both Adam moments live in the tensor store (on SSD), interleaved per
chunk — ``[master | exp_avg | exp_avg_sq]`` for each run of elements — so one read fetches
all three. The model keeps only its compute-precision weights (fp32 or bf16).

How a step runs:

1. During backward, a post-accumulate-grad hook fires as each parameter's gradient becomes
   final and queues that parameter on a worker thread (`ChunkPipeline`). The worker computes
   the gradient's norm, reads the parameter's state chunks from the *active* slot (reading
   ahead), applies the fused AdamW kernel, writes the new state into the *shadow* slot and
   writes the new weight straight into the parameter. Backward no longer needs a parameter
   once its gradient is accumulated, so this is safe while backward goes on.
2. `step()` waits for the worker and every write (futures, not timing), then knows the global
   gradient norm and whether every gradient is finite:

   - finite and clipping does not bite (the common case): **commit** — the slots flip, no
     extra I/O;
   - clipping bites: **redo** — the shadow slot is discarded and every update is computed
     again from the active slot with the clip coefficient, exactly as
     ``clip_grad_norm_`` followed by ``AdamW.step`` would;
   - a non-finite gradient: **skip** — the shadow is discarded, weights are restored from
     the active master, and state and step counts are untouched.

That is the ``"backward"`` schedule. Under ``"next_forward"`` (`FuyouConfig.optimizer_schedule`;
see `fuyou_strategy.optim.schedule`) backward only moves gradients out of the way; ``step()``
knows the global norm at once, so every update is exact the first time (no shadow slot, no
redo): it queues them in forward order and — when `attach_model` has given it the model — returns,
the next forward waiting module by module for the weights it reads. ``"auto"`` picks one of the
two per step from measured costs; all three give bitwise the same weights.

The result is bitwise equal to ``torch.optim.AdamW`` with the same kernel applied to the same
gradients after ``clip_grad_norm_``: ``fused=True`` (the default here) to ``AdamW(fused=True)``,
``fused=False`` to the default for-loop ``AdamW()`` (tests check both).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import time
import weakref
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.optim.adamw import adamw as adamw_for_loop

from ..cleanup import undo_after
from ..config import STATE_BYTES_PER_PARAM, ConfigError, FuyouConfig, host_budget_split
from ..storage import ACTIVE, SHADOW, HostBuffer, TensorStore, gather
from . import checkpoint
from .distributed import RankError, Sender, Shards
from .pipeline import _LIVENESS_POLL, ChunkJob, ChunkPipeline
from .scaler import LossScaler
from .schedule import BACKWARD, NEXT_FORWARD, PendingUpdates, ScheduleChooser

log = logging.getLogger(__name__)

__all__ = ["FuyouAdamW", "StepStats", "STATE_BYTES_PER_PARAM", "adamw_kernel"]

_COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
_FLOATS_PER_ELEMENT = 3  # master, exp_avg, exp_avg_sq
_ELEMENT_BYTES = STATE_BYTES_PER_PARAM  # 4 * _FLOATS_PER_ELEMENT; a step reads and writes this much per parameter


def adamw_kernel(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 step: torch.Tensor, *, fused: bool, **hyper: Any) -> None:
    """One AdamW update in place, ``step`` being the count *before* it: torch's fused CPU kernel or
    its for-loop one (``AdamW()``'s default on the CPU), bitwise as ``torch.optim.AdamW`` applies them."""
    if fused:
        torch._fused_adamw_([master], [grad], [exp_avg], [exp_avg_sq], [], [step + 1], amsgrad=False,
                            maximize=False, **hyper)
    else:  # the for-loop kernel increments its step tensor: give it a copy
        adamw_for_loop([master], [grad], [exp_avg], [exp_avg_sq], [], [step.clone()], foreach=False, fused=False,
                       amsgrad=False, maximize=False, **hyper)


@dataclass
class StepStats:
    """What happened to the optimizer steps so far (one step: one accumulation window)."""

    commits: int = 0  # backward schedule: the speculative update kept as is
    redos: int = 0  # backward schedule, clipping bit: rolled back, every update recomputed with the coefficient
    deferred: int = 0  # next_forward schedule: exact updates run ahead of the next forward (clipped or not)
    skips: int = 0  # a gradient was not finite: step skipped (a rollback under the backward schedule)
    rollbacks: int = 0  # backward schedule: speculative updates discarded (redos + its skips)
    clipped: int = 0  # steps whose gradients clipping scaled down
    schedules: dict = field(default_factory=lambda: {BACKWARD: 0, NEXT_FORWARD: 0})  # steps per schedule
    last_schedule: str = ""  # the schedule of the last step
    last_reason: str = ""  # why the next step uses the schedule it does ("auto")
    history: deque = field(default_factory=lambda: deque(maxlen=256))  # (schedule, outcome) of recent steps
    last_grad_norm: float = float("nan")  # global L2 norm of the last step's gradients (before clipping)

    @property
    def steps(self) -> int:
        """Steps whose update was applied (skipped ones excluded)."""
        return self.commits + self.redos + self.deferred

    @property
    def rollback_rate(self) -> float:
        """Rollbacks per step taken (applied or skipped): the share of steps that paid a second pass."""
        return self.rollbacks / max(1, self.steps + self.skips)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (checkpoints)."""
        return {**vars(self), "schedules": dict(self.schedules), "history": [list(h) for h in self.history]}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "StepStats":
        """The inverse of `to_dict`; fields a checkpoint of an older version lacks keep their defaults."""
        known = {f.name for f in fields(cls)} - {"history"}
        stats = cls(**{k: v for k, v in values.items() if k in known})
        stats.history.extend(tuple(h) for h in values.get("history", ()))
        return stats


@dataclass(eq=False)
class _Param:
    index: int  # position across all param groups; the order of the global norm
    param: torch.nn.Parameter
    group: dict
    entry: str
    elems_per_chunk: int
    nchunks: int
    grads: str | None = None  # the store entry of a streamed parameter's gradient (see attach_weights)

    @property
    def numel(self) -> int:
        return self.param.numel()

    def span(self, k: int) -> tuple[int, int]:
        start = k * self.elems_per_chunk
        return start, min(self.elems_per_chunk, self.numel - start)


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
            read-ahead); ``None`` means defaults with a temporary swap directory.
        release_grads: drop each gradient as soon as its update is written when no redo can
            need it (``max_grad_norm is None``); saves a model's worth of gradient memory.
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

    Costs: SSD traffic of 12 bytes read + 12 bytes written per parameter per step; host
    memory of at most ``config.host_memory_budget``. ``amsgrad``, ``maximize``, ``capturable``,
    ``differentiable`` (when true) and fp16 weights without ``loss_scaling`` are refused;
    ``foreach`` is accepted and ignored (chunks are updated one at a time either way).

    ``config.optimizer_schedule`` decides when updates run (module docstring); with
    ``"next_forward"`` chosen, ``step()`` lands its updates before it returns unless
    `attach_model` lets the next forward wait for them (then `flush` before reading weights
    outside a forward; ``state_dict`` and checkpoints do it themselves).

    Statistics are in ``opt.stats`` (`StepStats`: outcomes, rollback rate, schedule per step);
    call ``close()`` (or use ``with``) to release the swap files.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        max_grad_norm: float | None = None,
        config: FuyouConfig | None = None,
        release_grads: bool = True,
        fused: bool = True,
        loss_scaling: "bool | dict | LossScaler | None" = None,
        process_group: Any = None,
        gradients_averaged: bool = False,
        **unsupported: Any,
    ) -> None:
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
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(_trainable(params), defaults)
        self.max_grad_norm = max_grad_norm
        self.release_grads = release_grads and max_grad_norm is None
        self.fused = bool(fused)
        self.scaler = LossScaler.resolve(loss_scaling)
        self.stats = StepStats()
        self.config = config = config if config is not None else FuyouConfig()

        self._params: list[_Param] = []
        self._by_param: dict[torch.nn.Parameter, _Param] = {}
        shares = host_budget_split(config)
        elems = shares.state_chunk // _ELEMENT_BYTES
        for group in self.param_groups:
            for p in group["params"]:
                _check_param(p, len(self._params), scaled=self.scaler is not None)
                n = p.numel()
                ps = _Param(len(self._params), p, group, f"adamw.{len(self._params)}", elems, -(-n // elems))
                self._params.append(ps)
                self._by_param[p] = ps
        self._norm_order = list(self._params)
        if not self._params:
            raise ConfigError("FuyouAdamW: no trainable parameter (all have requires_grad=False, or none were given)")
        self.shards: Shards | None = None  # data parallel: which rank owns each parameter's state
        if process_group is not None and dist.get_world_size(process_group) > 1:
            if config.optimizer_schedule == "backward" and not gradients_averaged:
                raise ConfigError("optimizer_schedule: got 'backward' with a process group that this optimizer reduces "
                                  "itself; speculative updates during backward need each gradient's average as it "
                                  "lands (a DistributedDataParallel model, `attach_ddp`): use 'next_forward' or 'auto'")
            self.shards = Shards(process_group, self._params, config)
        self._gradients_averaged = gradients_averaged  # by DistributedDataParallel: step() moves none
        self._self_reduced: set[int] = set()  # ... but these, which DDP was told to leave alone (`reduce_itself`)
        if self.shards is not None:
            self.release_grads = False  # DistributedDataParallel writes the averaged gradients into .grad
        owned = self._owned()

        # Everything that outlives a forgotten optimizer (the worker thread, the swap files, the
        # hooks on the parameters) is released by one finalizer: on close(), or when the optimizer
        # is garbage collected. The hooks hold the optimizer only weakly, so a model that outlives
        # its optimizer (e.g. after a Trainer is dropped) does not keep the swap files alive.
        self._hooks: list[Any] = []
        self.store = TensorStore(config)
        self._workers: list[Any] = []  # closed by the finalizer: the chunk pipeline, the weight sender
        self._uninstall: list[weakref.WeakMethod] = []  # a streamer's uninstall: its weights come back before the store goes
        self._finalizer = weakref.finalize(self, _release, self._hooks, self.store, self._workers, self._uninstall)
        try:
            self._pipeline = ChunkPipeline(self.store, shares.optimizer_depth, name="fuyou-adamw")
            self._workers.append(self._pipeline)
            for ps in self._params:
                self.state[ps.param]["step"] = torch.tensor(0.0)
            for ps in owned:  # with a process group, only this rank's shard
                self.store.create(ps.entry, (ps.numel * _FLOATS_PER_ELEMENT,), torch.float32,
                                  chunk_bytes=ps.elems_per_chunk * _ELEMENT_BYTES, slots=config.state_slots)
            # Parameters on the meta device (a model built there) get their masters once they have
            # memory, or a tier copy: `initialise_materialized`.
            self._pending = [ps for ps in owned if ps.param.is_meta]
            self._initialise_state([ps for ps in owned if not ps.param.is_meta])
            self._queued: dict[int, torch.Tensor | None] = {}  # index -> grad norm, for this step
            self._partial: set[int] = set()  # streamed parameters whose gradient entry holds this window's sum so far
            self._weights: Any = None  # the WeightStreamer whose tier copies hold streamed parameters (attach_weights)
            self._grad_keep_free = shares.optimizer_readahead  # a streamed gradient's host copy leaves the worker room
            # Switches that the user-facing methods (zero_grad, no_update) change live in a mutable
            # holder, mutated in place: a wrapper that borrows this class's methods but has its own
            # __dict__ (Fabric's _FabricOptimizer) then still changes this optimizer, not itself.
            self._flags: dict[str, Any] = {"updates": True, "late_error": None}
            # The schedule of the window being accumulated now (decided when the last one ended), the
            # updates left for the next forward, and the order they run in (forward order: attach_model).
            # Data parallel: only next_forward (the updates wait for the ranks' gradient sum at step()).
            self.chooser = ScheduleChooser(config.optimizer_schedule, can_speculate=config.state_slots == 2 and (
                self.shards is None or gradients_averaged))
            self._window, self.stats.last_reason = self.chooser.choose()
            self.landing = PendingUpdates(self._pipeline)
            self._update_order = list(self._params)
            self._gated = False  # attach_model: a forward waits for the weights it reads, so step() need not
            self._unsent: list[_Param] = []  # sharded: updated resident weights not yet broadcast from their owners
            self._sender: Sender | None = None  # sharded, streamed weights: moves them from their owners (attach_weights)
            self._sent: dict[torch.nn.Parameter, Future] = {}  # sharded: streamed weights on their way, until waited for
            self._deferred_wait: float | None = None  # step()'s own wait of the last next_forward window
            on_grad_ready = weakref.WeakMethod(self._on_grad_ready)
            self._hooks.extend(ps.param.register_post_accumulate_grad_hook(lambda p: _call_alive(on_grad_ready, p))
                               for ps in self._params)
        except BaseException as exc:
            # Not close(): it reads attributes a half-built optimizer may lack, and nothing can be pending yet.
            undo_after(exc, self._finalizer)
            raise

    # -- state on SSD ---------------------------------------------------------------------------
    def _owns(self, ps: _Param) -> bool:
        """Whether this rank keeps ``ps``'s state (always, without a process group)."""
        return self.shards is None or self.shards.owns(ps)

    def _owned(self) -> list[_Param]:
        """The parameters whose state this rank keeps, in order."""
        return [ps for ps in self._params if self._owns(ps)]

    def _initialise_state(self, params: list[_Param]) -> None:
        """Write ``[master = weight in fp32 | 0 | 0]`` into each entry's active slot (a streamed
        parameter's weight comes from its tier copy, one parameter in memory at a time)."""
        for ps in params:
            flat = (self._weights.value(ps.param) if ps.grads is not None else ps.param.detach()).reshape(-1)
            writes = []
            for k in range(ps.nchunks):
                start, n = ps.span(k)
                buf = self.store.pool.acquire(n * _ELEMENT_BYTES)
                chunk = buf.view(torch.float32)
                chunk[:n].copy_(flat[start : start + n])
                chunk[n:].zero_()
                del chunk  # a view must not outlive the buffer, which the write gives back to the pool
                writes.append(self.store.write_chunk(ps.entry, k, buf, slot="active"))
            gather(writes).result()  # raises if any write failed
            del flat

    def initialise_materialized(self) -> None:
        """Write the masters of parameters that were on the meta device when the optimizer was made and
        have memory now (`fuyou_strategy.params.materialize`) or a tier copy (`attach_weights`)."""
        ready = [ps for ps in self._pending if ps.grads is not None or not ps.param.is_meta]
        self._initialise_state(ready)
        self._pending = [ps for ps in self._pending if ps not in ready]

    # -- streamed weights ---------------------------------------------------------------------------
    def chunk_elements(self) -> dict[torch.nn.Parameter, int]:
        """Each trainable parameter's state chunk length (elements): a `WeightStreamer` chunks the tier
        copies of the parameters it streams alike, so that `publish` writes whole chunks."""
        return {ps.param: ps.elems_per_chunk for ps in self._params}

    def attach_weights(self, streamer: Any) -> None:
        """Publish the parameters ``streamer`` streams (``streamer.streams(p)``) into their tier copies.

        From now on, for those parameters: each gradient leaves the device as soon as it is final
        (copied into a host pool buffer; ``p.grad`` is set to ``None``), partial sums of an
        accumulation window and the gradients a clipping redo (or ``state_slots=1``) needs wait
        in a store entry of the gradient's dtype, and every new weight goes to the tier copy
        (``streamer.publish``), never into the released device storage. Call it between steps.

        Sharded over a process group (a collective: every rank calls it alike), each rank keeps a tier
        copy of every streamed weight, made rank 0's here (as ``DistributedDataParallel`` does for
        resident weights); a streamed gradient is summed onto its owner at ``step()`` from the ranks'
        host copies (``DistributedDataParallel`` must ignore these parameters:
        `fuyou_strategy.engine.ignore_streamed_in_ddp`), and each new weight goes from the owner's tier
        copy into the others' on a sender thread (`Shards.send_streamed`), in update order, as soon as
        its update landed; the next forward reads a block once its weights arrived. The updates then run under
        ``next_forward`` only: a speculative one would need the ranks' sum during backward.
        """
        self._check_idle("attach_weights")
        if self.shards is not None and streamer.streamed():
            self._summed_at_step("weights streamed under data parallelism")
        self._weights = streamer
        # It reads a tier copy only once the update pending for it landed (sharded: was sent by its owner).
        streamer.updates = self.landing if self.shards is None else _SentWeights(self)
        # The tier copies live in this store: a model that outlives the optimizer gets its weights
        # back first. Weakly: the model's hooks keep the streamer alive exactly as long as it matters.
        self._uninstall.append(weakref.WeakMethod(streamer.uninstall))
        for ps in self._params:
            if streamer.streams(ps.param) and ps.grads is None:
                ps.grads = f"grads.{ps.index}"
                self.store.create(ps.grads, (ps.numel,), ps.param.dtype, slots=1,
                                  chunk_bytes=ps.elems_per_chunk * ps.param.element_size())
        if self.shards is not None and streamer.streamed():
            if self._sender is None:
                self._sender = self.shards.open_sender(self.config.io_timeout)
                self._workers.append(self._sender)
            changed = set(self.shards.sync_streamed(streamer))
            # an owner whose master was made from another value than rank 0's makes it again
            self._initialise_state([ps for ps in self._owned() if ps.param in changed and ps not in self._pending])

    # -- the hook: queue an update as soon as a gradient is final -------------------------------------
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        # The last step's updates land before this backward's touch their state (sharded: the same
        # list on every rank, so every rank enters the collective here alike).
        if (self._unsent or self._sent) if self.shards is not None else self.landing.jobs:
            self._land()
        ps = self._by_param[param]
        if ps.grads is not None:  # streamed (sharded: kept for step() to sum over the ranks)
            self._take_grad(ps)
            return
        if self.shards is not None:
            return  # this rank's own gradient, before the ranks' average: `ddp_comm_hook` queues the updates
        if not self._flags["updates"] or self._window != BACKWARD:
            return  # accumulating; or next_forward: the gradient waits on the parameter for step()
        if ps.index in self._queued:
            self._late(ps)
            return
        self._queue_update(ps)

    def _late(self, ps: _Param) -> None:
        # A second accumulation after the update was queued: that update used a partial
        # gradient. Never silently wrong: step() will roll back and raise.
        self._flags["late_error"] = self._flags["late_error"] or RuntimeError(
            f"the gradient of parameter {ps.index} {tuple(ps.param.shape)} was accumulated again after its "
            "update was queued; wrap every micro-batch but the last in `with optimizer.no_update():`"
        )

    def _take_grad(self, ps: _Param) -> None:
        """A streamed parameter's gradient is final for this backward: move it off the device and queue
        what it is for (add to the window's partial sum, then keep it, or update with it)."""
        param = ps.param
        grad, param.grad = param.grad, None
        final = self._window == BACKWARD and self._flags["updates"]
        if final and ps.index in self._queued:
            self._late(ps)
            return
        meter = self._weights.meter
        nbytes = grad.numel() * grad.element_size()
        meter.add(nbytes)  # on the device from its accumulation until this copy
        try:
            host = self.store.pool.acquire(nbytes, timeout=self.config.io_timeout, keep_free=self._grad_keep_free)
            host.view(grad.dtype)[: grad.numel()].copy_(grad.reshape(-1))
        finally:
            del grad
            meter.sub(nbytes)
        flat = host.view(param.dtype)[: ps.numel]
        if ps.index in self._partial:

            def add(k: int, buf: HostBuffer) -> None:  # grad += partial: bitwise autograd's accumulation
                start, n = ps.span(k)
                with buf:
                    flat[start : start + n].add_(buf.view(param.dtype)[:n])

            self._pipeline.submit(ChunkJob(ps.grads, ps.nchunks, add, fence=True))  # after the last write of it
        if final:
            self._partial.discard(ps.index)
            self._queue_update(ps, host=host)
            return
        self._partial.add(ps.index)
        # next_forward: step() needs the window's norm (the last micro-batch's sum: a later one overwrites it)
        norms, norm = self._queued, self._window == NEXT_FORWARD
        if norm:
            norms[ps.index] = None
        last, store, inv = ps.nchunks - 1, self.store, self._inv_scale()

        def keep(k: int) -> Future:
            if k == 0 and norm:
                norms[ps.index] = _grad_norm(flat.view(param.shape), inv)
            start, n = ps.span(k)
            fut = _write_grad(store, ps, k, flat[start : start + n])
            if k == last:
                host.release()
            return fut

        self._pipeline.submit(ChunkJob(None, ps.nchunks, keep))

    def _queue_update(self, ps: _Param, coef: torch.Tensor | None = None, *, host: HostBuffer | None = None,
                      exact: bool = False, grad: torch.Tensor | None = None) -> ChunkJob:
        """Queue ``ps``'s AdamW update, chunk by chunk, on the worker; returns the job.

        The gradient is ``ps.param.grad`` (resident parameters), ``host`` (a streamed one's gradient
        just moved off the device; released at the end), ``grad`` (the ranks' average as a
        `ddp_comm_hook` bucket lands), or the gradient entry in the store (a streamed parameter's
        redo, or its exact update). ``exact=False``: a speculative update
        (backward schedule), into the shadow slot, recording the gradient's norm for step();
        ``exact=True``: the global norm is known (``coef`` applied), the update goes to the active
        slot in place and the job's ``done`` completes once it landed. The weight goes to `_publish`.
        """
        param = ps.param
        from_store = ps.grads is not None and host is None
        grad_flat = (host.view(param.dtype)[: ps.numel] if host is not None
                     else grad.reshape(-1) if grad is not None
                     else None if from_store else param.grad.reshape(-1))
        norms = self._queued  # filled in by the worker, so the hook itself stays cheap
        norm = coef is None and not from_store and not exact
        if norm:
            norms[ps.index] = None
        group = ps.group
        beta1, beta2 = group["betas"]
        step = self.state[param]["step"].clone()  # the count before this update, whenever it runs
        hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"])
        fused = self.fused
        last = ps.nchunks - 1
        slot = ACTIVE if exact else SHADOW
        release = self.release_grads and coef is None and ps.grads is None and not exact
        keep = host is not None and self.max_grad_norm is not None  # a redo may need this gradient again
        weights, store = self._weights, self.store  # the job must not hold the optimizer (see close())
        inv = self._inv_scale()  # loss scaling: the scale is fixed for the window

        def update(k: int, buf: HostBuffer, stored: HostBuffer | None = None) -> Future:
            if k == 0 and norm:
                norms[ps.index] = _grad_norm(grad_flat.view(param.shape), inv)
            start, n = ps.span(k)
            state = buf.view(torch.float32)
            master, exp_avg, exp_avg_sq = state[:n], state[n : 2 * n], state[2 * n :]
            raw = stored.view(param.dtype)[:n] if stored is not None else grad_flat[start : start + n]
            g = raw.to(device="cpu", dtype=torch.float32)
            if inv is not None:
                g = g * inv  # GradScaler.unscale_
            if coef is not None:
                g = g * coef  # as clip_grad_norm_'s in-place g.mul_(clip_coef_clamped)
            adamw_kernel(master, g, exp_avg, exp_avg_sq, step, fused=fused, **hyper)
            futures = [_publish(weights, ps, k, master)]
            if keep:
                futures.append(_write_grad(store, ps, k, raw))
            del state, master, exp_avg, exp_avg_sq, raw, g  # no view may outlive a buffer given back
            if stored is not None:
                stored.release()
            if k == last:
                if host is not None:
                    host.release()
                if release:
                    param.grad = None
            futures.append(store.write_chunk(ps.entry, k, buf, slot=slot))
            return gather([f for f in futures if f is not None])

        job = ChunkJob(ps.entry, ps.nchunks, update, extra=(ps.grads,) if from_store else (),
                       done=Future() if exact else None)
        self._pipeline.submit(job)
        return job

    def _restore_weights(self, params: Iterable[_Param]) -> None:
        """Publish the active master weights again (after a skip or failure, or a checkpoint load)."""
        weights = self._weights
        for ps in params:

            def restore(k: int, buf: HostBuffer, ps: _Param = ps) -> Future | None:
                with buf:
                    return _publish(weights, ps, k, buf.view(torch.float32)[: ps.span(k)[1]])

            self._pipeline.submit(ChunkJob(ps.entry, ps.nchunks, restore))
        self._pipeline.drain()

    # -- loss scaling (fp16) ------------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (``GradScaler.scale``): backward this instead of ``loss`` under ``loss_scaling``."""
        if self.scaler is None:
            raise RuntimeError("FuyouAdamW.scale_loss: no loss scaling configured; pass loss_scaling=True")
        self._flags["scaled"] = True
        return self.scaler.scale(loss)

    def scale_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Make the backward of ``loss`` (or of anything the loop derives from it, e.g. ``loss / k``)
        run as if ``scale_loss(loss)`` had been backwarded: the gradient reaching ``loss`` is multiplied
        by the scale (the same values: the scale is a power of two). For a loop that backwards a loss
        it builds itself (the HF Trainer's); returns ``loss`` unchanged, so logs see the real loss."""
        if self.scaler is None:
            raise RuntimeError("FuyouAdamW.scale_backward: no loss scaling configured; pass loss_scaling=True")
        scale = self.scaler._scale
        loss.register_hook(lambda grad: (grad * scale.to(grad.device)).to(grad.dtype))
        self._flags["scaled"] = True
        return loss

    def _inv_scale(self) -> torch.Tensor | None:
        return self.scaler.inv_scale() if self.scaler is not None else None

    # -- the model: updates left for the next forward ---------------------------------------------------
    def attach_model(self, model: torch.nn.Module) -> None:
        """Let ``step()`` leave the ``next_forward`` schedule's updates to run ahead of the next forward.

        Registers a forward pre-hook on every module that owns trainable parameters of this
        optimizer: the module waits for their updates (and only theirs) before it runs, so the
        forward never reads a stale weight while later blocks' updates still run. A state-dict and
        a load-state-dict pre-hook on ``model`` land every pending update first (`flush`). Updates
        then run in the order of ``model.parameters()`` (forward order for the usual models).
        Without this, ``step()`` runs the ``next_forward`` schedule's updates itself and returns
        when they landed, as ``torch.optim`` does. A weight read outside a module's forward (not
        through the module that owns it) must be preceded by `flush`; such a read saved for
        backward is caught by autograd's version check.
        """
        if self._gated:
            return
        # Weakly: the model's hooks must not keep the optimizer (and its swap files) alive.
        land = weakref.WeakMethod(self._land)
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if p in self._by_param]
            if own:
                self._hooks.append(module.register_forward_pre_hook(lambda m, args, own=own: _call_alive(land, own)))
        self._hooks.append(model.register_state_dict_pre_hook(lambda *args: _call_alive(land)))
        self._hooks.append(model.register_load_state_dict_pre_hook(lambda *args: _call_alive(land)))
        rank = {p: i for i, p in enumerate(model.parameters())}
        self._update_order = sorted(self._params, key=lambda ps: (rank.get(ps.param, len(rank)), ps.index))
        self._gated = True

    def flush(self) -> None:
        """Land every update ``step()`` left for the next forward (``next_forward`` schedule). Reading
        the weights outside a forward (evaluation by hand, saving them) needs it first; the
        integrations, `state_dict`, checkpoints and the model's own ``state_dict`` do it themselves.
        Sharded over a process group, a collective: every rank calls it at the same point."""
        self._land()

    def _land(self, params: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Land the pending updates of ``params`` (default: all). Sharded: the owners land theirs, every
        rank agrees that they did, and each weight is broadcast from its owner, in update order; the
        pending list is the same on every rank, so the ranks issue the same collectives."""
        if self.shards is None:
            self.landing.wait_all() if params is None else self.landing.wait(params)
            return
        if params is not None:
            params = list(params)
        self._wait_sent(params)
        wanted = None if params is None else set(params)
        todo = [ps for ps in self._unsent if wanted is None or ps.param in wanted]
        if not todo:
            return
        error = None
        try:
            self.landing.wait([ps.param for ps in todo if self.shards.owns(ps)])
        except BaseException as exc:  # noqa: BLE001 - the other ranks must hear of it, not wait
            error = exc
        self.shards.agree(error, "the last step's optimizer updates")
        self.shards.broadcast_weights(todo)
        sent = {ps.index for ps in todo}
        self._unsent = [ps for ps in self._unsent if ps.index not in sent]

    # -- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finish the accumulation window: under the ``backward`` schedule commit the updates that ran
        during backward, redo them with clipping, or skip; under ``next_forward`` queue every exact
        update (run here and waited for, unless `attach_model` lets the next forward wait), or skip.

        Parameters whose gradient was set without backward hooks firing (e.g. assigned by hand) are
        updated here. Returns the closure's loss, if a closure was given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._pending:
            raise RuntimeError(f"FuyouAdamW: {len(self._pending)} parameters are still on the meta device (the first has "
                               f"shape {tuple(self._pending[0].param.shape)}); materialise them and call "
                               "initialise_materialized() before training (FuyouEngine does both)")
        self._land()  # normally the forward waited for all of them already
        if self.scaler is not None and not self._flags.get("scaled") and (self._queued or self._partial or any(
                ps.param.grad is not None for ps in self._params)):
            self.zero_grad()  # the updates used gradients taken as scaled: discard them
            raise RuntimeError("FuyouAdamW (loss_scaling): this step's backward was not scaled; backward "
                               "opt.scale_loss(loss) (or call opt.scale_backward(loss) before backward)")
        self._flags["scaled"] = False
        if self._deferred_wait is not None:  # the last next_forward window's wait: its step() and the forward's
            self.chooser.record_wait(NEXT_FORWARD, self._deferred_wait + self.landing.take_stall())
            self._deferred_wait = None
        start = time.perf_counter()
        schedule = self._window
        clipped = self.stats.clipped
        outcome, rollback_s = (self._step_speculative() if schedule == BACKWARD else self._step_exact())
        if outcome is None:
            return loss  # no gradient in this window: nothing happened, the schedule stays
        if self.scaler is not None:  # GradScaler.update: back off after inf/NaN, else count towards growth
            self.scaler.update(found_inf=outcome == "skip")
        wait = time.perf_counter() - start - (rollback_s or 0.0)
        if schedule == BACKWARD:
            self.chooser.record_wait(BACKWARD, wait)
        else:
            self._deferred_wait = wait
            self.landing.take_stall()
        # Whether the backward schedule rolled back, or would have: a non-finite gradient, or clipping bit.
        self.chooser.record(rolled=outcome == "skip" or self.stats.clipped > clipped,
                            rollback_s=rollback_s)
        stats = self.stats
        stats.schedules[schedule] += 1
        stats.last_schedule = schedule
        stats.history.append((schedule, outcome))
        self._window, reason = self.chooser.choose()
        if self.shards is not None:  # each rank's chooser measured its own waits: rank 0's choice holds
            choice = [self._window, reason]
            self.shards.broadcast_object(choice)
            self._window, reason = choice
        if self._window != schedule or reason != stats.last_reason:
            level = logging.INFO if self._window != schedule else logging.DEBUG
            log.log(level, "FuyouAdamW: schedule %s for the next step (%s)", self._window, reason)
        stats.last_reason = reason
        log.debug("FuyouAdamW: step %d used %s: %s", stats.steps + stats.skips, schedule, outcome)
        return loss

    def _step_speculative(self) -> tuple[str | None, float | None]:
        """The ``backward`` schedule's end: commit, redo with the clip coefficient, or skip."""
        shards = self.shards
        for ps in self._params:  # sharded: this rank's own parameters; the others' owners update them
            if ps.grads is None and ps.param.grad is not None and ps.index not in self._queued and self._owns(ps):
                self._queue_update(ps)
        if not self._queued and shards is None:
            return None, None
        queued = [ps for ps in self._norm_order if ps.index in self._queued]
        norms, self._queued = self._queued, {}
        late, self._flags["late_error"] = self._flags["late_error"], None
        if shards is None:
            self._drain_or_undo(queued, late)
            counted = queued
        else:  # every rank: whether all updates ran, then every norm: the same decision everywhere
            error = None
            try:
                self._drain_or_undo(queued, late)
            except BaseException as exc:  # noqa: BLE001 - the other ranks must hear of it, not wait
                error = exc
            shards.agree(error, "the updates of the accumulation window")
            norms = shards.share_norms(norms, self._params)
            if not norms:
                return None, None
            counted = [ps for ps in self._norm_order if ps.index in norms]
        total = self._total_norm(norms, counted)
        if total is None:
            start = time.perf_counter()
            self._undo(queued)
            self.stats.rollbacks += 1
            return "skip", time.perf_counter() - start
        coef = self._clip_coef(total)
        if coef is not None:
            start = time.perf_counter()
            self.store.rollback()
            for ps in queued:
                self._queue_update(ps, coef)
            self._drain_or_undo(queued)
            self._commit(queued)
            self._send_later(norms)
            self.stats.redos += 1
            self.stats.rollbacks += 1
            self.stats.clipped += 1
            return "redo", time.perf_counter() - start
        self.stats.commits += 1
        self._commit(queued)
        self._send_later(norms)
        return "commit", None

    def _send_later(self, updated: Iterable[int]) -> None:
        """Sharded: the weights with these indices go from their owners to every rank before they are
        next read: resident ones at `_land` (the next forward, module by module, or now if nothing
        gates the forward), streamed ones on the sender thread from now on (`_start_sending`)."""
        if self.shards is None:
            return
        order = [ps for ps in self._update_order if ps.index in updated]
        streamed = self._weights is not None and self._sender is not None
        self._unsent = [ps for ps in order if not (streamed and self._weights.streams(ps.param))]
        if streamed:
            self._start_sending([ps for ps in order if self._weights.streams(ps.param)])
        if not self._gated:
            self._land()

    def _start_sending(self, params: list[_Param]) -> None:
        """Hand these streamed weights to the sender: each goes once its owner's update landed, and its
        future (in ``_sent``) completes once this rank's tier copy holds it."""
        if not params:
            return
        futures = {ps.param: Future() for ps in params}
        self._sent.update(futures)
        landing = self.landing  # the sender must not hold the optimizer

        def landed(ps: _Param) -> None:
            landing.wait([ps.param], stall=False)

        def finish(ps: _Param, error: BaseException | None) -> None:
            fut = futures[ps.param]
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(None)

        self._sender.submit(self.shards.send_streamed, self._sender, params, self._weights, landed, finish)

    def _wait_sent(self, params: list[torch.nn.Parameter] | None = None) -> None:
        """Wait until the sender has put these streamed weights (default: all on their way) into this
        rank's tier copies; raises what the send raised (the same `RankError` on every rank). No
        collective: each rank waits for its own copies. A way out: ``io_timeout``, and the sender's
        liveness."""
        if not self._sent:
            return
        keys = list(self._sent) if params is None else [p for p in params if p in self._sent]
        deadline = time.monotonic() + self.config.io_timeout
        for p in keys:
            fut = self._sent[p]
            while not wait([fut], timeout=_LIVENESS_POLL).done:
                if not self._sender.alive():
                    raise RuntimeError("FuyouAdamW: the weight sender thread stopped; the streamed weights "
                                       "of the last step cannot arrive")
                if time.monotonic() >= deadline:
                    index = self._by_param[p].index
                    raise TimeoutError(f"FuyouAdamW: the new weight of parameter {index} did not arrive from rank "
                                       f"{self.shards.owner[index]} within io_timeout={self.config.io_timeout:.0f} s")
            del self._sent[p]
            fut.result()  # what the send raised: the same RankError on every rank

    # -- data parallel: updates as DistributedDataParallel's buckets land ---------------------------------
    def reduce_itself(self, params: Iterable[torch.nn.Parameter]) -> None:
        """With ``gradients_averaged``: the ``DistributedDataParallel`` model leaves these parameters alone
        (``_ddp_params_and_buffers_to_ignore``: those that are or may be streamed, `ignore_streamed_in_ddp`),
        so ``step()`` sums their gradients over the ranks itself; the updates then run under
        ``next_forward`` (a speculative one would need the sum during backward). Call it between steps."""
        if self.shards is None or not self._gradients_averaged:
            return
        indices = {self._by_param[p].index for p in params if p in self._by_param}
        if not indices:
            return
        self._summed_at_step("parameters DistributedDataParallel leaves to the optimizer")
        self._self_reduced |= indices

    def _summed_at_step(self, which: str) -> None:
        """Some gradients are summed over the ranks only at ``step()``: no speculative updates (the
        ``backward`` schedule is refused, ``"auto"`` keeps to ``next_forward``)."""
        if self.config.optimizer_schedule == BACKWARD:
            raise ConfigError(f"optimizer_schedule: got 'backward' with {which}; their gradients are summed over the "
                              "ranks at step(), so their updates cannot run during backward: use 'next_forward' or "
                              "'auto'")
        self.chooser.can_speculate = False
        self.chooser.why_not = f"data parallel with {which}: their gradients are summed at step()"
        self._window, self.stats.last_reason = self.chooser.choose()

    def attach_ddp(self, ddp_model: Any) -> None:
        """Register `ddp_comm_hook` on a ``DistributedDataParallel`` model (before its first backward):
        under the ``backward`` schedule each rank then updates its parameters as their averaged
        gradients land, overlapped with the rest of backward, as one process does."""
        if self.shards is None or not self._gradients_averaged:
            raise ConfigError("attach_ddp: needs the optimizer built with a process group and "
                              "gradients_averaged=True (a DistributedDataParallel model)")
        # DDP takes one hook for its lifetime, and a model may outlive its optimizer (a second train() of
        # the same Trainer): the hook serves whichever optimizer attached last, weakly, and averages as
        # DDP does once there is none.
        target = getattr(ddp_model, "_fuyou_hook_target", None)
        if target is not None:
            target.optimizer = weakref.ref(self)
            return
        target = _HookTarget(weakref.ref(self), self.shards.group, self.shards.world)
        ddp_model._fuyou_hook_target = target
        ddp_model.register_comm_hook(target, _comm_hook)

    def ddp_comm_hook(self, state: Any, bucket: Any) -> Future:
        """DDP's averaging (divide, then sum over the ranks) and, when it completes, the speculative
        updates of this rank's parameters in the bucket with the averaged gradients (``backward``
        schedule, the window's last backward). ``gradient_reduction="owner"``: each run of parameters
        with one owner is summed onto that rank only (a ``reduce``); ``"all"``: one ``all_reduce``.
        The callback runs on the collective's thread; what it touches is the queue of updates, as the
        gradient hooks of one process do."""
        shards = self.shards
        buffer = bucket.buffer().div_(shards.world)
        if self.config.gradient_reduction == "all":
            fut = dist.all_reduce(buffer, group=shards.group, async_op=True).get_future()
        else:
            fut = torch.futures.collect_all([
                dist.reduce(buffer[start:end], dst=shards.ranks[owner], group=shards.group, async_op=True).get_future()
                for owner, start, end in self._owner_runs(bucket)])

        def landed(fut: Future) -> torch.Tensor:
            fut.wait()  # raises if a collective failed
            if self._flags["updates"] and self._window == BACKWARD:
                for param, grad in zip(bucket.parameters(), bucket.gradients()):
                    ps = self._by_param.get(param)
                    if ps is not None and shards.owns(ps) and ps.index not in self._queued:
                        # a view of the bucket: DDP leaves it alone until the next window's backward,
                        # and step() drains every update before that
                        self._queue_update(ps, grad=grad.detach().view_as(param))
            return buffer

        return fut.then(landed)

    def _owner_runs(self, bucket: Any) -> list[tuple[int, int, int]]:
        """``(owner rank index, start, end)`` of each run of consecutive gradients in the bucket's flat
        buffer whose parameters have the same owner (a parameter this optimizer does not train: rank 0)."""
        base, size = bucket.buffer().data_ptr(), bucket.buffer().element_size()
        runs: list[list[int]] = []
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            ps = self._by_param.get(param)
            owner = self.shards.owner[ps.index] if ps is not None else 0
            start = (grad.data_ptr() - base) // size
            if runs and runs[-1][0] == owner and runs[-1][2] == start:
                runs[-1][2] = start + grad.numel()
            else:
                runs.append([owner, start, start + grad.numel()])
        return [tuple(r) for r in runs]

    def _step_exact(self) -> tuple[str | None, None]:
        """The ``next_forward`` schedule's end: the window's gradients are all known; queue every exact
        update in forward order (taking the resident gradients off the parameters), or skip."""
        try:
            self._pipeline.drain()  # streamed gradients written, their norms known
            late = self._flags["late_error"]
            if late is not None:
                raise late
            if self.shards is not None:  # a rank that cannot step stops the others here, before the collectives
                self.shards.agree(None, "the end of the accumulation window")
        except BaseException as exc:
            self._forget_window()
            if self.shards is not None and not isinstance(exc, RankError):
                self.shards.agree(exc, "the end of the accumulation window")
            raise
        norms, self._queued = dict(self._queued), {}
        self._partial.clear()
        if self.shards is not None:  # each gradient, averaged over the ranks, onto its owner
            self._reduce_streamed(norms)
            resident = [ps for ps in self._params if ps.grads is None]
            self.shards.reduce_grads([ps for ps in resident if ps.index in self._self_reduced])
            self.shards.reduce_grads([ps for ps in resident if ps.index not in self._self_reduced],
                                     averaged=self._gradients_averaged)
        inv = self._inv_scale()
        for ps in self._params:
            if ps.grads is None and ps.param.grad is not None:
                norms[ps.index] = _grad_norm(ps.param.grad, inv)
        if self.shards is not None:  # every rank: every norm, the same global norm and decision
            norms = self.shards.share_norms(norms, self._params)
        params = [ps for ps in self._norm_order if ps.index in norms]
        if not params:
            return None, None
        total = self._total_norm(norms, params)
        if total is None:
            return "skip", None  # nothing was written: state and weights are as they were
        coef = self._clip_coef(total)
        for ps in (ps for ps in self._update_order if ps.index in norms):
            if self._owns(ps):  # else its owner updates it
                job = self._queue_update(ps, coef, exact=True)
                self.landing.add(ps.param, job, f"the update of parameter {ps.index} {tuple(ps.param.shape)}")
                if ps.grads is None:
                    ps.param.grad = None  # the job holds it: a new backward accumulates afresh, zero_grad has nothing to do
            self.state[ps.param]["step"] += 1  # after queueing: the update read the step it completes
        self.stats.deferred += 1
        self.stats.clipped += coef is not None
        if self.shards is not None:  # each weight goes from its owner once its update landed
            self._send_later(norms)
        elif not self._gated:  # nothing would make a forward wait: land them here, as torch.optim does
            self._land()
        return "deferred", None

    def _reduce_streamed(self, norms: dict[int, torch.Tensor]) -> None:
        """Sharded: each streamed gradient of the window (this rank's sum, in its store entry), summed
        over the ranks onto its owner and divided by N, back into the owner's entry, where the exact
        update reads it; its norm (in ``norms``) becomes the owner's of the average. One gradient in
        host memory at a time."""
        streamed = [ps for ps in self._params if ps.grads is not None]
        mine = {ps.index for ps in streamed if ps.index in norms}
        for ps in streamed:
            norms.pop(ps.index, None)  # this rank's own: the owner's of the average replaces it
        timeout, store = self.config.io_timeout, self.store

        def read(ps: _Param) -> torch.Tensor:
            if ps.index not in mine:
                return torch.zeros(ps.numel, dtype=ps.param.dtype)
            return store.read(ps.grads, timeout=timeout).result(timeout=timeout)

        for ps, total in self.shards.sum_onto_owners(streamed, lambda ps: ps.index in mine, read, host=True):
            if total is not None:
                total.div_(self.shards.world)
                norms[ps.index] = _grad_norm(total.view(ps.param.shape), self._inv_scale())
                store.write(ps.grads, total, timeout=timeout).result(timeout=timeout)

    def _total_norm(self, norms: dict[int, torch.Tensor], params: list[_Param]) -> torch.Tensor | None:
        """The global norm exactly as clip_grad_norm_ computes it (the norm of per-tensor norms);
        ``None`` (and the step counted as skipped) when it is not finite."""
        total = torch.linalg.vector_norm(torch.stack([norms[ps.index] for ps in params]), 2)
        self.stats.last_grad_norm = float(total)
        if not math.isfinite(self.stats.last_grad_norm):
            self.stats.skips += 1
            return None
        return total

    def _clip_coef(self, total: torch.Tensor) -> torch.Tensor | None:
        """clip_grad_norm_'s clamped coefficient when it scales the gradients down, else ``None``."""
        if self.max_grad_norm is None:
            return None
        coef = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
        return coef if coef < 1.0 else None

    def _forget_window(self) -> None:
        """Drop this window's streamed partial sums and queued norms (one state slot: nothing to undo)."""
        self._queued.clear()
        self._partial.clear()
        self._flags["late_error"] = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; between backward and `step()` this also discards the speculative updates
        (and the streamed gradients accumulated so far)."""
        if self._queued or self._partial or self._flags["late_error"] is not None:
            queued = [ps for ps in self._params if ps.index in self._queued]
            try:
                self._pipeline.drain()  # the worker writes into _queued: clear it only afterwards
            finally:
                self._forget_window()  # in place (see _flags)
                if self._window == BACKWARD:
                    self._undo(queued)
        super().zero_grad(set_to_none=set_to_none)

    def _undo(self, queued: list[_Param]) -> None:
        """Discard the shadow writes and put the committed weights back into the parameters."""
        self.store.rollback()
        self._partial.clear()
        self._restore_weights(queued)

    def _drain_or_undo(self, queued: list[_Param], error: BaseException | None = None) -> None:
        """Wait for every queued update; on any failure (or ``error``), undo them and raise."""
        try:
            self._pipeline.drain()
            if error is not None:
                raise error
        except BaseException:
            self._undo(queued)
            raise

    def _commit(self, queued: list[_Param]) -> None:
        self.store.commit([ps.entry for ps in queued])
        for ps in queued:
            self.state[ps.param]["step"] += 1

    def set_norm_order(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum the global gradient norm over parameters in this order (default: param-group order).

        Float sums depend on order: to clip exactly as ``clip_grad_norm_(model.parameters())``
        does — the Trainers clip in model order, while their AdamW groups decay / no-decay
        parameters apart — pass ``model.parameters()``. Parameters not listed come last.
        """
        rank = {p: i for i, p in enumerate(params)}
        self._norm_order = sorted(self._params, key=lambda ps: (rank.get(ps.param, len(rank)), ps.index))

    @property
    def updates_enabled(self) -> bool:
        """Whether a backward queues updates; a training loop sets it ``False`` for every micro-batch
        but the last of an accumulation window (`no_update` does the same as a context manager)."""
        return self._flags["updates"]

    @updates_enabled.setter
    def updates_enabled(self, enabled: bool) -> None:
        self._flags["updates"] = bool(enabled)

    @contextlib.contextmanager
    def no_update(self) -> Iterator[None]:
        """Accumulate gradients without updating (every micro-batch but the last), like DDP's ``no_sync``."""
        previous, self._flags["updates"] = self._flags["updates"], False
        try:
            yield
        finally:
            self._flags["updates"] = previous

    # -- checkpoints --------------------------------------------------------------------------------
    def state_dict(self, folder: str | os.PathLike | None = None, *, keep_previous: bool = False,
                   record: dict[str, Any] | None = None) -> dict[str, Any]:
        """Torch's optimizer state dict; with ``folder``, also stream the SSD state there.

        The SSD-resident state (fp32 masters, ``exp_avg``, ``exp_avg_sq``) is written chunk by
        chunk with SHA-256 checksums, never whole in RAM, as a new save ``folder/<token>/``; the
        returned dict records the folder, the token and the step count (``sd["fuyou"]``), and
        `load_state_dict` accepts it only with that very save. The earlier saves in ``folder``
        are removed once the new one is complete, so a crash at any point leaves a complete
        save behind. ``keep_previous=True`` leaves them for a caller that first records the new
        token elsewhere and then calls ``checkpoint.remove_versions(folder, keep=token)`` (the
        Lightning strategy, for its ``.ckpt``). ``record`` (plain JSON values) is kept in the save's
        metadata, for a caller that ties the save to its own files (the HF callback: the Trainer's step).
        Without ``folder`` the dict holds only hyper-parameters and step counts, and
        `load_state_dict` refuses it once steps were taken.
        """
        self._check_idle("state_dict")
        sd = super().state_dict()
        sd["fuyou"] = {"folder": None}
        if folder is not None:
            meta = (checkpoint.save_version if keep_previous else checkpoint.save)(self, folder, record)
            sd["fuyou"] = {"folder": str(folder), "token": meta["token"], "steps": meta["steps"]}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a dict from `state_dict`, streaming the SSD state back from the save it names.

        A dict whose save is no longer in its folder (a later ``state_dict(folder)`` replaced
        it) is refused: `CheckpointError` says which of the two is stale. Checksums are
        verified while streaming; the state is written to the shadow slot and committed only
        if every one matches, so a bad checkpoint changes nothing.
        """
        self._check_idle("load_state_dict")
        record = state_dict.get("fuyou", {})
        folder = record.get("folder")
        steps = [float(s.get("step", 0)) for s in state_dict.get("state", {}).values()]
        if folder is None and any(steps):
            raise checkpoint.CheckpointError(
                "this state dict holds no SSD state (masters and moments): it was made by state_dict() "
                "without a folder; save with optimizer.state_dict(folder) to resume exactly"
            )
        if folder is not None:
            fix = ("load the state dict made with that save, or resume from the folder's newest save alone with "
                   "optimizer.load_folder(folder)")
            checkpoint.load(self, checkpoint.find(folder, record.get("token"), record.get("steps"),
                                                  named_by="this state dict", fix=fix))
        else:
            checkpoint.restore_groups(self, state_dict["param_groups"])

    def load_folder(self, folder: str | os.PathLike, token: str | None = None) -> dict[str, Any]:
        """Stream the newest save in ``folder`` (written by ``state_dict(folder)``), or the one with
        ``token``, back: masters, moments, steps, hyper-parameters and weights (checksums verified; a bad
        save changes nothing). Returns the save's metadata."""
        self._check_idle("load_folder")
        return checkpoint.load(self, Path(folder) / token if token is not None else checkpoint.newest(folder))

    def _check_idle(self, what: str) -> None:
        self._land()
        if self._queued or self._partial:
            raise RuntimeError(f"{what}() between backward and step(): call step() (or zero_grad()) first")

    # -- reading state back (tests, checkpoints) -----------------------------------------------------
    def read_state(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """The committed fp32 ``master``, ``exp_avg`` and ``exp_avg_sq`` of one parameter (in RAM)."""
        self.landing.wait_all()
        ps = self._by_param[param]
        if self.shards is not None and not self.shards.owns(ps):
            raise ConfigError(f"read_state: parameter {ps.index} {tuple(ps.param.shape)} is owned by rank "
                              f"{self.shards.owner[ps.index]}, not this rank ({self.shards.rank}); read it there")
        out = {name: torch.empty(ps.numel, dtype=torch.float32) for name in ("master", "exp_avg", "exp_avg_sq")}

        def gather_chunk(k: int, buf: HostBuffer) -> None:
            start, n = ps.span(k)
            with buf:
                state = buf.view(torch.float32)
                for i, name in enumerate(out):
                    out[name][start : start + n].copy_(state[i * n : (i + 1) * n])

        self._pipeline.submit(ChunkJob(ps.entry, ps.nchunks, gather_chunk))
        self._pipeline.drain()
        return {name: t.view(param.shape) for name, t in out.items()}

    # -- lifetime -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Land the updates left for the next forward, remove the hooks, stop the worker and delete the
        swap files (also done when the optimizer is garbage collected)."""
        if self._finalizer.alive:
            try:
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


def _unscaled(grad: torch.Tensor, inv_scale: torch.Tensor | None) -> torch.Tensor:
    """A gradient as the update and the norm see it: in fp32 times ``1/scale`` under loss scaling
    (``GradScaler.unscale_``'s in-place multiply, which is exact: the scale is a power of two)."""
    return grad if inv_scale is None else grad.to(torch.float32) * inv_scale


def _grad_norm(grad: torch.Tensor, inv_scale: torch.Tensor | None) -> torch.Tensor:
    """The per-tensor norm ``clip_grad_norm_`` computes on the CPU (of the unscaled gradient)."""
    return torch.linalg.vector_norm(_unscaled(grad, inv_scale), 2, dtype=torch.float32)


def _publish(weights: Any, ps: _Param, k: int, master: torch.Tensor) -> Future | None:
    """The new value of chunk ``k`` of ``ps``'s weight: into the parameter, or (streamed) its tier copy."""
    if ps.grads is not None:
        return weights.publish(ps.param, k, master)
    start, n = ps.span(k)
    ps.param.detach().view(-1)[start : start + n].copy_(master)  # backward is done with this weight
    return None


def _write_grad(store: TensorStore, ps: _Param, k: int, grad: torch.Tensor) -> Future:
    """Chunk ``k`` of streamed ``ps``'s gradient (its dtype) into its store entry."""
    buf = store.pool.acquire(grad.numel() * grad.element_size(), timeout=store.config.io_timeout)
    buf.view(grad.dtype)[: grad.numel()].copy_(grad)
    return store.write_chunk(ps.grads, k, buf)


def _release(hooks: list[Any], store: TensorStore, workers: list[Any],
             uninstall: list["weakref.WeakMethod"]) -> None:
    """`FuyouAdamW`'s finalizer: hooks off the parameters, workers stopped (the chunk pipeline, the weight
    sender), streamed weights made resident again from their tier copies (a model outliving its optimizer
    keeps its weights), swap files deleted."""
    for hook in hooks:
        hook.remove()
    hooks.clear()
    try:
        for worker in workers:
            worker.close()
        for ref in uninstall:
            fn = ref()
            if fn is not None and not _exiting:  # at exit the I/O threads are gone, and so is the model
                fn()
        uninstall.clear()
    finally:
        store.close()


_exiting = False


@atexit.register
def _at_exit() -> None:
    global _exiting
    _exiting = True


def _call_alive(method: "weakref.WeakMethod", *args: Any) -> None:
    bound = method()
    if bound is not None:
        bound(*args)


def _trainable(params: Iterable[Any]) -> list[Any]:
    """Param groups with frozen parameters dropped. A group left empty is kept, so that group
    indices — which LR schedulers rely on (one lambda per group) — do not shift."""
    params = list(params)
    if params and isinstance(params[0], dict):
        return [{**group, "params": [p for p in group["params"] if p.requires_grad]} for group in params]
    return [p for p in params if p.requires_grad] or [{"params": []}]


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


class _SentWeights:
    """What a `WeightStreamer` waits on under data parallelism: a streamed weight is ready once the
    sender put its owner's new value into this rank's tier copy (`FuyouAdamW._wait_sent`; no
    collective, so the ranks may put blocks on the device ahead at different moments)."""

    def __init__(self, optimizer: FuyouAdamW) -> None:
        self._optimizer = weakref.ref(optimizer)  # the model's hooks must not keep the optimizer alive

    def pending(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Whether any of ``params`` is still on its way (or failed to arrive: `wait` raises that)."""
        opt = self._optimizer()
        if opt is None or not opt._sent:
            return False
        futures = [opt._sent.get(p) for p in params]
        return any(f is not None and (not f.done() or f.exception() is not None) for f in futures)

    def wait(self, params: Iterable[torch.nn.Parameter]) -> None:
        opt = self._optimizer()
        if opt is not None:
            opt._wait_sent(list(params))


class _HookTarget:
    """The state of the comm hook `FuyouAdamW.attach_ddp` registers: the optimizer it serves (weakly)."""

    def __init__(self, optimizer: "weakref.ref[FuyouAdamW]", group: Any, world: int) -> None:
        self.optimizer, self.group, self.world = optimizer, group, world


def _comm_hook(state: _HookTarget, bucket: Any) -> Any:
    opt = state.optimizer()
    if opt is not None and not opt.closed:
        return opt.ddp_comm_hook(state, bucket)
    buffer = bucket.buffer().div_(state.world)  # DDP's own averaging
    return dist.all_reduce(buffer, group=state.group, async_op=True).get_future().then(lambda fut: fut.value()[0])


# DDP checks the annotations as objects (this module's are strings: `from __future__ import annotations`).
_comm_hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
