"""`OptimizerControl`: what the engine and the planner ask of a `FuyouAdamW` and change in it, between steps.

The torch front (`FuyouAdamW`) answers a training loop; this object answers the run around it: the state's
host tier (`hold_state_in_ram`), streamed weights (`attach_weights`, `chunk_elements`), a model built on the
meta device (`initialise_materialized`), DistributedDataParallel (`attach_ddp`, `reduce_itself`), what the
planner's cost model counts (`state_bytes_per_param`, `streams_from_master`, `can_speculate`), the schedule
choice and its costs (`choose`, `expect`), and a snapshot of the optimizer's counters (`figures`). Reached as
``optimizer.control``; built once by the front, over the same parts (none is ever rebound).
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from ..config import ConfigError, FuyouConfig
from ..device import computes_on_host, read_on_host
from ..storage import TensorStore
from .schedule import BACKWARD, NEXT_FORWARD, ONE_SLOT_WHY, Exact, Parts, ScheduleChooser, Speculative
from .state import ParamState
from .weights import StreamedWeights

__all__ = ["OptimizerControl", "OptimizerFigures"]


@dataclass(frozen=True)
class OptimizerFigures:
    """A snapshot of the optimizer's counters (`OptimizerControl.figures`); bytes unless named otherwise.

    Attributes:
        worker_threads: the worker's intra-op threads as it set them (what was asked, until it has).
        threads_reason: why that many (``FuyouConfig.optimizer_threads``), one sentence.
        update_kernel: ``"one_pass"`` or ``"torch"`` (``FuyouConfig.update_kernel``, `onepass`).
        kernel_reason: why, one sentence.
        update_total: ``(seconds, parameters)`` of the worker's CPU time in updates, ever (`UpdateMeter`).
        read_ahead_used, read_ahead_dropped: state chunks on the SSD read ahead and taken by an update, or
            given back unused (stale, or not asked for) (`ChunkPipeline.read_ahead`).
        state_ssd_bytes, state_ram_bytes, state_device_bytes: this rank's state, every slot with padding, on the
            SSD, in host RAM and on the device (``device_state``).
        slot_ssd_bytes: one slot of this rank's state on the SSD (the state format's bytes): what a step's
            updates read and write there.
    """

    worker_threads: int | None
    threads_reason: str
    update_kernel: str
    kernel_reason: str
    update_total: tuple[float, int]
    read_ahead_used: int
    read_ahead_dropped: int
    state_ssd_bytes: int
    state_ram_bytes: int
    slot_ssd_bytes: int
    state_device_bytes: int = 0


class OptimizerControl:
    """The engine's and the planner's handle on one `FuyouAdamW` (module docstring).

    Args:
        params: every trainable parameter's `ParamState`, in param-group order.
        parts: the front's parts (`schedule.Parts`), shared, never rebound.
        config: the optimizer's resolved config.
        can_speculate: a shadow slot, and gradients that land averaged when data parallel.
        gradients_averaged: a DistributedDataParallel model averages the gradients in backward.
        threads: ``(asked, why)``: the worker's intra-op threads asked for (``None``: torch's default).
        kernel: ``(one pass or None, why)``: the update's kernel (`onepass.choose`).
        finalizer: the front's; `closed` once it ran.

    Builds the schedules and their chooser, chooses the first window's schedule, and writes the masters of the
    parameters that have memory (those on the meta device wait for `initialise_materialized`).
    Threads: the training thread, between steps, except `ddp_comm_hook` (DDP's collective thread).
    """

    def __init__(self, params: list[ParamState], parts: Parts, config: FuyouConfig, *, can_speculate: bool,
                 gradients_averaged: bool, threads: tuple[int | None, str], kernel: tuple[Any, str],
                 finalizer: weakref.finalize) -> None:
        self.params, self.config = params, config
        self.state, self.updates, self.gradients = parts.state, parts.updates, parts.gradients
        self._parts = parts
        self.sharding, self.window, self.stats = parts.sharding, parts.window, parts.stats
        self.threads_asked, self.threads_reason = threads  # `FuyouEngine` announces them
        self.kernel = "one_pass" if kernel[0] is not None else "torch"  # and this, with its reason
        self.kernel_reason = kernel[1]
        self._gradients_averaged, self._finalizer = gradients_averaged, finalizer
        self._by_param = {ps.param: ps for ps in params}
        self._schedules = {s.name: s for s in (Speculative(parts), Exact(parts))}
        # Data parallel without DDP's averages: only next_forward (the updates wait for the sum at step()).
        self.chooser = ScheduleChooser(config.optimizer_schedule, can_speculate=can_speculate,
                                       exact_first=self._exact_first, backward_first=self._backward_first)
        self.stats.last_reason = self.choose()
        # Parameters on the meta device (a model built there) get their masters once they have memory, or a tier
        # copy: `initialise_materialized`.
        owned = self.state.owned
        self._pending = [ps for ps in owned if ps.param.is_meta]
        self.state.initialise([ps for ps in owned if not ps.param.is_meta], self._weight)

    @property
    def closed(self) -> bool:
        """The optimizer was closed (or collected): DDP's comm hook averages as DDP does."""
        return not self._finalizer.alive

    # -- the schedule ----------------------------------------------------------------------------------
    def choose(self, *, agree: bool = False) -> str:
        """Set the next window's schedule (``agree``: rank 0's, on every rank, a collective); returns why. Before a
        window that speculates, the masters kept only in the parameters go into their chunks (`OptimizerState.
        heal_masters`: a rollback restores from there), after the updates queued so far."""
        name, reason = self.chooser.choose()
        if agree:
            name, reason = self.sharding.same_choice([name, reason])
        self.window.schedule = self._schedules[name]
        if self.window.schedule.speculates:
            self.state.heal_masters()
        return reason

    @property
    def can_speculate(self) -> bool:
        """Whether ``backward`` is possible at all (a shadow slot; data parallel: DDP's averages, no gradient
        summed at ``step()``): the schedules the planner may count."""
        return self.chooser.can_speculate

    @property
    def state_slots(self) -> int:
        """Copies of the state each entry keeps now: 2, or 1 (``state_slots=1``, or "auto" after `keep_one_slot`)."""
        return self.state.slots

    def expect(self, predicted: Mapping[str, float], *, forget_measured: bool = False) -> None:
        """Give the chooser the planner's predicted step (seconds) under each schedule (`ScheduleChooser.expect`);
        ``forget_measured``: the windows measured so far cost what a new plan no longer does."""
        if forget_measured:
            self.chooser.forget_costs()
        self.chooser.expect(predicted)

    def _exact_first(self) -> str | None:
        """Why ``"auto"`` takes ``next_forward`` without measuring ``backward`` (`ScheduleChooser`), or ``None``:
        the model computes on the CPU, and every state chunk of this rank is in host RAM with no streamed weight
        (whose gradients ``next_forward`` would park on the SSD); or the model computes on an accelerator with the
        whole state on the device tier, where ``next_forward`` decides each step there (`Parts.decides_on_device`)
        and ``backward`` reads the norm on the host at ``step()``."""
        owned, state = self.state.owned, self.state
        if owned and all(read_on_host(ps.param) for ps in owned) and self._parts.can_decide_on_device(owned):
            return ("the whole state is on the device tier: next_forward decides each step on the device without "
                    "waiting for it, where backward reads the gradient norm on the host at step()")
        if not owned or not computes_on_host([ps.param for ps in owned]):
            return None
        if any(ps.index not in state.in_memory or ps.grads is not None for ps in owned):
            return None
        return ("the model computes on the CPU and the whole state is in host RAM: next_forward, without the "
                "shadow-slot copies and RAM of backward's speculation")

    def _backward_first(self) -> str | None:
        """Why ``"auto"`` keeps ``backward`` without measuring ``next_forward`` early (`ScheduleChooser`), or
        ``None``: every state chunk of this rank is on the SSD, where ``next_forward`` hides the same traffic
        under less of the step."""
        owned, state = self.state.owned, self.state
        if not owned or any(ps.index in state.in_memory for ps in owned):
            return None
        return "the whole state is on the SSD, whose traffic next_forward hides under forward only"

    def _summed_at_step(self, which: str) -> None:
        """Some gradients are summed over the ranks only at ``step()``: no speculative updates."""
        if self.config.optimizer_schedule == BACKWARD:
            raise ConfigError(f"optimizer_schedule: got 'backward' with {which}; their gradients are summed over the "
                              "ranks at step(), so their updates cannot run during backward: use 'next_forward' or "
                              "'auto'")
        self._stop_speculating(f"data parallel with {which}: their gradients are summed at step()")

    def _stop_speculating(self, why: str) -> None:
        """No speculative update from now on (``why``, the chooser's reason): the next window and every later one run
        ``next_forward``."""
        self.chooser.can_speculate = False
        self.chooser.why_not = why
        self.stats.last_reason = self.choose()

    # -- between steps ---------------------------------------------------------------------------------
    def check_idle(self, what: str) -> None:
        """Land the updates left for the next forward; refuse ``what`` between backward and ``step()``."""
        self.sharding.land()
        if self.window.norms or self.window.partial:
            raise RuntimeError(f"{what}() between backward and step(): call step() (or zero_grad()) first")

    def check_materialized(self) -> None:
        """Refuse a step while parameters are still on the meta device (`initialise_materialized`)."""
        if self._pending:
            raise RuntimeError(f"FuyouAdamW: {len(self._pending)} parameters are still on the meta device (the first "
                               f"has shape {tuple(self._pending[0].param.shape)}); materialise them and call "
                               "optimizer.control.initialise_materialized() before training (FuyouEngine does both)")

    def hold_state_in_ram(self, nbytes: int) -> int:
        """Let the state's host tier hold ``nbytes`` (of ``host_memory_budget``) and move this rank's
        parameters' state in from the SSD, or out to it when the tier shrinks (`OptimizerState.hold_in_ram`);
        returns the bytes it holds.
        Between steps: the updates left for the next forward land first. Bitwise nothing changes."""
        self.sharding.land()
        self.state.drain()
        return self.state.hold_in_ram(self.sharding.owned(self.params), nbytes)

    def heal_masters(self) -> None:
        """Write the masters that only the parameters hold into the state's chunks (`OptimizerState.heal_masters`),
        after the updates queued so far: before anything frees a parameter's memory (a `WeightStreamer`'s
        ``install``, which `attach_weights` follows). Between steps."""
        self.state.heal_masters()

    def hold_state_on_device(self, nbytes: int, leaving: Iterable[torch.nn.Parameter] = ()) -> int:
        """Let the state's device tier hold ``nbytes`` of the device's memory and move this rank's first parameters'
        state that fits onto it, or off it to the SSD when the tier shrinks (`OptimizerState.hold_on_device`;
        the host tier then takes what it has room for of the rest); returns the bytes on the device. ``leaving``:
        parameters about to be streamed (`attach_weights` next), whose state the tier does not take, so that it is
        not moved there only to leave again. Between steps: the updates left for the next forward land first.
        Bitwise nothing changes on the CPU."""
        self.sharding.land()
        self.state.drain()
        leaving = {id(p) for p in leaving}  # the Parameter objects (the streamer keeps each one)
        owned = self.sharding.owned(self.params)
        return self.state.hold_on_device(owned, nbytes, leaving=[ps for ps in owned if id(ps.param) in leaving])

    def measure_next_forward(self, why: str) -> None:
        """Run ``next_forward`` until a window of it is measured (`ScheduleChooser.probe`: the next two windows where
        this one speculated), then choose as before; ``why`` is the reason the logs and `stats` give. The planner's
        warm-up asks it (``state_slots="auto"``) to time the compute and updates of a run that never speculates.
        Between steps; bitwise nothing changes."""
        self.chooser.probe(NEXT_FORWARD, why)
        self.choose()
        self.stats.last_reason = why

    def keep_one_slot(self) -> int:
        """One slot of state from now on (``state_slots="auto"``, where the warm-up's plan names one): every state
        entry keeps its active slot only (`OptimizerState.drop_shadows`), half the state's bytes in every tier, and
        every window runs ``next_forward``, since no shadow slot is left to speculate into. Between steps: the
        updates left for the next forward land first. Returns the bytes freed; nothing changes bitwise."""
        self.sharding.land()
        self.state.drain()
        freed = self.state.drop_shadows()
        self._stop_speculating(ONE_SLOT_WHY)
        return freed

    def figures(self) -> OptimizerFigures:
        """The optimizer's counters now; reading them waits for nothing (the training thread)."""
        pipeline, state = self.state.pipeline, self.state
        on_ssd, in_ram = state.footprint()
        return OptimizerFigures(pipeline.threads, self.threads_reason, self.kernel, self.kernel_reason,
                                state.meter.total, pipeline.ahead_used,
                                pipeline.ahead_dropped, on_ssd, in_ram, state.slot_bytes(in_memory=False),
                                state.device_bytes())

    # -- what the planner's cost model counts -----------------------------------------------------------
    def state_bytes_per_param(self) -> float:
        """Bytes of optimizer state per trainable parameter and slot as the store holds them (chunks padded to
        their stride): what the planner's cost model counts for the state's host tier and the SSD, so that the
        RAM it plans for the state holds the parameters it planned."""
        padded = sum(TensorStore.footprint(ps.nbytes, ps.stride, 1) for ps in self.params)
        return padded / sum(ps.numel for ps in self.params)

    def streams_from_master(self, param: torch.nn.Parameter) -> bool:
        """Whether trainable ``param``, streamed from the SSD tier, is read from its fp32 master instead of a copy
        of its own (`_stream_from_masters`; the planner's cost model asks too): in one process, an fp32 weight."""
        return self.sharding.world == 1 and param.dtype == torch.float32

    # -- streamed weights and a model built on the meta device -------------------------------------------
    def chunk_elements(self) -> dict[torch.nn.Parameter, int]:
        """Each trainable parameter's state chunk length (elements): a `WeightStreamer` chunks the tier
        copies of the parameters it streams alike, so that `publish` writes whole chunks."""
        return {ps.param: ps.elems_per_chunk for ps in self.params}

    def _weight(self, ps: ParamState) -> torch.Tensor:
        """A parameter's weight as the masters start from (a streamed one's from its tier copy)."""
        streamer = self.updates.weights
        return streamer.value(ps.param) if streamer is not None and streamer.streams(ps.param) else ps.param.detach()

    def initialise_materialized(self) -> None:
        """Write the masters of parameters that were on the meta device when the optimizer was made and
        have memory now (`fuyou_strategy.params.materialize`) or a tier copy (`attach_weights`)."""
        ready = [ps for ps in self._pending if ps.grads is not None or not ps.param.is_meta]
        self.state.initialise(ready, self._weight)
        self._pending[:] = [ps for ps in self._pending if ps not in ready]

    def attach_weights(self, streamer: StreamedWeights) -> None:
        """Publish the parameters ``streamer`` streams (``streamer.streams(p)``) into their tier copies:
        each gradient leaves the device as soon as it is final (`StreamedGradients`) and every new weight
        goes to the tier copy (``streamer.publish``). Call it between steps. Data parallel (a collective):
        each rank keeps a tier copy of every streamed weight, made rank 0's here; a streamed gradient is
        summed onto its owner at ``step()`` (DDP must ignore these parameters: `ignore_streamed_in_ddp`)
        and each new weight goes from its owner's copy into the others' on a sender thread; the updates
        then run under ``next_forward`` only."""
        self.check_idle("attach_weights")
        # a streamed weight is read from its chunks' masters (`_stream_from_masters`), its parameter's memory freed
        streamed = [ps for ps in self.params if streamer.streams(ps.param)]
        self.state.require_current(streamed, "streaming the weight")
        if self.sharding.world > 1 and streamer.streamed():
            self._summed_at_step("weights streamed under data parallelism")
        self.updates.weights = streamer
        streamer.updates = self.sharding.updates_gate()  # it reads a tier copy only once its update landed
        # A streamed parameter's weight and gradient leave the device, and its memory is freed: its state leaves the
        # device tier (before the streamer reads masters from it), and its master is read from its chunks.
        left_device = self.state.stream(streamed)
        changed = set(self.sharding.attach_weights(streamer))  # an owner whose master came from another value
        self.state.initialise([ps for ps in self.sharding.owned(self.params)
                               if ps.param in changed and ps not in self._pending], self._weight)
        self._stream_from_masters()
        # After the copies that masters replace are gone: the gradient entries take their space.
        self.gradients.streamed.attach(streamer, self.params)
        if left_device:  # the room there goes to the next resident parameters, in order, as the planner predicts
            self.state.hold_on_device(self.sharding.owned(self.params))

    def _stream_from_masters(self) -> None:
        """One process: the streamer reads each streamed fp32 weight from its master (`WeightStreamer.use_master`)
        instead of keeping a copy of its own on the SSD. The masters of a model built on the meta device are
        written here first, from those copies, which then go. Data parallel keeps the copies: every rank streams
        every weight, and only the owner has its master."""
        streamer = self.updates.weights
        if streamer is None or self.sharding.world > 1:  # `streams_from_master` is false for every weight
            return
        ready = [ps for ps in self._pending if streamer.streams(ps.param)]
        self.state.initialise(ready, self._weight)
        self._pending[:] = [ps for ps in self._pending if ps not in ready]
        for ps in self.params:
            if streamer.streams(ps.param) and ps not in self._pending and self.streams_from_master(ps.param):
                streamer.use_master(ps.param, ps.entry, ps.elems_per_chunk)

    # -- DistributedDataParallel -----------------------------------------------------------------------
    def reduce_itself(self, params: Iterable[torch.nn.Parameter]) -> None:
        """With ``gradients_averaged``: the DistributedDataParallel model leaves these parameters alone, so
        ``step()`` sums their gradients itself; their updates run under ``next_forward``. Between steps."""
        if self.sharding.world > 1 and self._gradients_averaged and self.sharding.reduce_itself(
                [self._by_param[p] for p in params if p in self._by_param]):
            self._summed_at_step("parameters DistributedDataParallel leaves to the optimizer")

    def attach_ddp(self, ddp_model: Any) -> None:
        """Register the comm hook on a ``DistributedDataParallel`` model (before its first backward): under
        the ``backward`` schedule each rank updates its parameters as their averaged gradients land."""
        if self.sharding.world == 1 or not self._gradients_averaged:
            raise ConfigError("attach_ddp: needs the optimizer built with a process group and "
                              "gradients_averaged=True (a DistributedDataParallel model)")
        self.sharding.attach_ddp(ddp_model, self)

    def ddp_comm_hook(self, state: Any, bucket: Any) -> Future:
        """DDP's averaging, the updates as each bucket lands (`Sharding.comm_hook`; DDP's collective thread)."""
        return self.sharding.comm_hook(bucket, self._on_average)

    def _on_average(self, ps: ParamState, average: torch.Tensor) -> None:
        """A DDP bucket's average of one of this rank's parameters (on DDP's collective thread): only queues."""
        window = self.window
        if window.updates and window.schedule.speculates and not window.queued(ps):
            window.schedule.on_gradient_final(ps, self.gradients.staged(ps, average, kind="bucket"))
