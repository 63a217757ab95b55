"""`RunReport`: what a `FuyouEngine` run reports — per-step metrics, the summary, SSD wear, what its swap I/O
costs the compute, the step trace, and the planner's predicted against measured step time.

The engine owns one and calls it at the loop's events (`begin_window`, `before_step`, `after_step`); it
reads the engine's parts (snapshots of the optimizer's and the memory tiers' counters, the swapper, the streamer,
the plan) and never changes them. Everything here runs on the training thread, but for `_amend` (see `_lock`).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import warnings
from typing import Any, Callable, Protocol

from . import drives, trace
from .activations import discover_blocks
from .activations.spans import BlockSpans
from .config import format_bytes
from .optim.control import OptimizerFigures
from .optim.schedule import NEXT_FORWARD, StepStats, Unsettled
from .storage.probe import cpu_shares, cpu_times
from .storage.tiers import TierFigures
from .storage.wear import TB, Wear, drive_capacity

__all__ = ["IO_CPU_WARN_SHARE", "RunReport", "WEAR_SAMPLE_STEPS"]

log = logging.getLogger("fuyou_strategy")

# Steps measured (after the first) before the SSD wear of a run, and what its swap I/O costs the compute, are
# reported.
WEAR_SAMPLE_STEPS = 3
# The share of the step that the swap I/O's compute cost (`fuyou doctor`'s measurement per GB, times the bytes the
# run moves per step) must reach for a warning.
IO_CPU_WARN_SHARE = 0.10


class Run(Protocol):
    """What a report reads of its run (`FuyouEngine`'s parts, which the engine may swap as it goes: the
    planner installs a swapper, a streamer, a plan)."""

    config: Any
    model: Any
    memory: Any  # `storage.MemoryTiers`: `figures()`
    optimizer: Any  # `FuyouAdamW`: ``control.figures()``, ``stats``, ``recorded()``
    swapper: Any
    streamer: Any
    profiler: Any
    plan: Any
    choices: dict[str, tuple[Any, str]]
    report: Callable[[str], Any]


class RunReport:
    """The figures of one engine's run (module docstring)."""

    def __init__(self, engine: Run) -> None:
        self.engine, self.config = engine, engine.config
        self.step_times: list[float] = []  # seconds between consecutive optimizer steps
        self.micro_batches = 0
        self.run_steps: int | None = None  # optimizer steps of the whole run, from the adapter (`expect_steps`)
        self.wear: Wear | None = None
        self.io_cpu: dict[str, Any] | None = None  # what the swap I/O costs the compute (`_measure_io_cpu`)
        self._last_step_end: float | None = None
        self._window_open = False  # a micro-batch of the next step has begun
        self._tracer: trace.Tracer | None = None
        self._trace_spans: BlockSpans | None = None
        self._trace_from = 0  # the optimizer step the trace starts at
        self._trace_marks: dict[str, float] = {}  # window start, step() start (tracer clock)
        self._trace_written = self.config.trace is None
        self._plan_applied_at: int | None = None  # the step (index into step_times) the planner's plan began at
        self._planned_at_step: int | None = None
        self._plan_reported = False
        self._wear_warned = False
        self._written_per_step: list[float] = []
        self._moved_per_step: list[float] = []  # read + written
        self._cpu_from: list[int] | None = None  # `cpu_times` at the first step's end: the sample's CPU time starts
        # `_counted`, `_metrics` and `_unread` are amended (`_amend`) by the thread that reads a step decided on the
        # device: this one, or autograd's at the next backward's first hook while this one waits in that backward.
        self._lock = threading.Lock()
        self._counted = self._counters(engine.memory.figures(), self._optimizer.stats)  # at the last step's end
        # A resumed run's first step reports its own counts, not the checkpoint's (restored clipped and
        # rollback counts) nor the bytes the load wrote into the store.
        self._optimizer.on_loaded.append(self._rebase)
        self._metrics: dict[str, float] = {}
        # The step of `_metrics` while it is decided on the device and unread: its clipped, skipped and grad_norm
        # are known once it is read (`metrics`, or the next step), not at its end, which never waits for the device.
        self._unread: Unsettled | None = None

    @property
    def _optimizer(self) -> Any:
        return self.engine.optimizer

    def _figures(self) -> OptimizerFigures:
        """The optimizer's counters now (`OptimizerControl.figures`)."""
        return self._optimizer.control.figures()

    # -- the loop's events -------------------------------------------------------------------------------
    def begin_micro_batch(self) -> None:
        """A training forward begins (the first of a step starts the step's clock and trace)."""
        self.micro_batches += 1
        if self._last_step_end is None:
            self._last_step_end = time.perf_counter()
        if not self._window_open:
            self._window_open = True
            if not self._trace_written:
                self._trace_window()

    def before_step(self) -> None:
        if self._tracer is not None:
            self._trace_marks["step"] = self._tracer.now()

    def after_step(self) -> None:
        """``optimizer.step()`` returned: the step's time, metrics, wear sample and trace."""
        now = time.perf_counter()
        if self._last_step_end is not None:
            self.step_times.append(now - self._last_step_end)
            stats, unread = self._optimizer.recorded()
            metrics = self._step_metrics(now - self._last_step_end, stats, unread is not None)
            with self._lock:
                self._metrics, self._unread = metrics, unread
            if unread is not None:
                unread.when_settled(lambda outcome, clipped: self._amend(unread, outcome, clipped))
            self._measure_wear(metrics["fuyou/ssd_write_bytes"], metrics["fuyou/ssd_read_bytes"])
        self._last_step_end = now
        self._window_open = False
        if self._tracer is not None:
            self._trace_step()

    def plan_applied(self) -> None:
        """The planner's plan applies from the next step on (predicted vs measured is reported after it)."""
        self._plan_applied_at = len(self.step_times)
        self._planned_at_step = self._optimizer.stats.steps

    def plan_moved(self) -> None:
        """The plan's optimizer state moved after its first step (`FuyouEngine._grow_device_tier`): where the
        predicted step is being compared with the measured one, the comparison starts again after the move."""
        if self._plan_applied_at is not None and not self._plan_reported:
            self.plan_applied()

    def report_plan(self) -> None:
        """Once a few planned steps ran: the plan's predicted step time against the measured one."""
        plan = self.engine.plan
        if self._plan_applied_at is None or self._plan_reported:
            return
        measured = self.step_times[self._plan_applied_at + 1:]  # the first planned step warms the swap path up
        if len(measured) >= 3:
            self._plan_reported = True
            m = statistics.median(measured)
            self.engine.report(f"fuyou planner: predicted {plan.predicted_step_s:.3f} s/step, measured {m:.3f} s "
                               f"(median of {len(measured)} steps): {m / plan.predicted_step_s:.2f}x")

    # -- the trace ------------------------------------------------------------------------------------
    def _trace_window(self) -> None:
        """At the first micro-batch of a step: start the trace, or end it after ``trace_steps`` steps. The trace
        counts the steps as recorded (`FuyouAdamW.recorded`): reading a step decided on the device would wait for it
        in every traced step."""
        steps = self._optimizer.recorded()[0].steps
        if self._tracer is None:
            first = self._planned_at_step + 1 if self._planned_at_step is not None else 1
            if self.engine.profiler is not None or steps < first:
                return
            if trace.active() is not None:
                self._trace_written = True
                warnings.warn(f"fuyou: trace={self.config.trace!r} not recorded: another engine in this process is "
                              "recording a trace (one at a time)", stacklevel=4)
                return
            self._tracer = trace.Tracer().start()
            self._trace_spans = BlockSpans(discover_blocks(self.engine.model, self.config.blocks))
            self._trace_from = steps
        elif steps >= self._trace_from + self.config.trace_steps:
            self._write_trace()
            return
        self._trace_marks["window"] = self._tracer.now()

    def _trace_step(self) -> None:
        tracer, marks, stats = self._tracer, self._trace_marks, self._optimizer.recorded()[0]
        now, n = tracer.now(), stats.steps
        if "step" in marks:
            tracer.add("compute", "optimizer.step()", marks.pop("step"), now)
        if "window" in marks:
            tracer.add("steps", f"step {n}", marks.pop("window"), now, step=n, schedule=stats.last_schedule)

    def end_trace(self) -> None:
        """Write the trace now if one is recording (training ended inside the traced steps: those
        recorded are kept)."""
        if self._tracer is not None:
            self._write_trace()

    def _write_trace(self) -> None:
        """Stop recording and write the trace (with the plan's predicted step beside the first traced one)."""
        tracer, self._tracer = self._tracer, None
        tracer.stop()
        self._trace_spans.remove()
        self._trace_written = True
        plan = self.engine.plan
        steps = [e for e in tracer.events if e[0] == "steps"]
        measured = [end - start for _lane, _name, start, end, _args in steps]
        predicted = plan.timeline() if plan is not None else []
        try:
            tracer.save(self.config.trace, predicted=predicted, predicted_offset=steps[0][2] if steps else 0.0,
                        metadata={"steps": len(steps), "measured_step_s": measured,
                                  "predicted_step_s": plan.predicted_step_s if plan is not None else None,
                                  "plan": plan.policies if plan is not None else None,
                                  "weight_tiers": plan.weight_tiers if plan is not None else None})
        except OSError as exc:  # a lost trace is no reason to stop training
            warnings.warn(f"fuyou: trace={self.config.trace!r} could not be written: {exc}", stacklevel=4)
            return
        self.engine.report(f"fuyou: trace of {len(steps)} step(s) written to {self.config.trace} (open it in "
                           f"https://ui.perfetto.dev, or draw it: fuyou report {self.config.trace} --png)")

    # -- SSD wear -------------------------------------------------------------------------------------
    def expect_steps(self, steps: int | None) -> None:
        """The run's length in optimizer steps, for the SSD wear projection; warns at once if the optimizer
        state's own writes (a floor) would spend more than ``ssd_wear_warning`` of the drives' rating."""
        self.run_steps = int(steps) if steps is not None and steps > 0 else None
        if self.run_steps is None:
            return
        floor = self._wear(self._figures().slot_ssd_bytes, 0.0)
        self._check_wear(floor, "at least (the optimizer state's writes alone)")

    def _wear(self, bytes_per_step: float, step_seconds: float) -> Wear:
        dirs = self._optimizer.store.run_dirs
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
            "activations off the SSD, or raise ssd_wear_warning", stacklevel=4)

    def _measure_wear(self, written: float, read: float) -> None:
        """Sample the first steps' bytes (and the machine's CPU time); after ``WEAR_SAMPLE_STEPS`` of them, past
        the first, report the wear and what the I/O costs the compute, once."""
        if self.wear is not None:  # measured once: the sample is not kept growing with the run
            return
        self._written_per_step.append(written)
        self._moved_per_step.append(written + read)
        if len(self._written_per_step) == 1:
            self._cpu_from = cpu_times()
        if len(self._written_per_step) <= WEAR_SAMPLE_STEPS:
            return
        sample = self._written_per_step[1:]  # the first step includes the warm-up
        step_s = statistics.median(self.step_times[-len(sample):])
        self.wear = self._wear(statistics.median(sample), step_s)
        # The figures at DEBUG and in summary()["wear"]; a warning only when the run spends more than ssd_wear_warning
        log.debug("fuyou: %s", self.wear.describe(self.config.ssd_wear_warning))
        self._check_wear(self.wear, "about")
        # the CPU time of the sampled steps: from the end of the first to the end of the last
        self._measure_io_cpu(statistics.median(self._moved_per_step[1:]), step_s,
                             cpu_shares(self._cpu_from, cpu_times())[1])

    def _measure_io_cpu(self, moved: float, step_s: float, steal: float | None) -> None:
        """What the swap I/O of a step costs the compute: the bytes it moves times what `fuyou doctor` measured a
        GB to cost on this filesystem (`drives.io_cpu_cost`; on a virtual machine the hypervisor serves the disk
        on the training's own CPUs); reported, and warned of from ``IO_CPU_WARN_SHARE`` of the step."""
        if moved <= 0:
            return
        cost = drives.io_cpu_cost(self._optimizer.store.run_dirs)
        s_per_gb = cost["io_cpu_s_per_gb"] if cost is not None else None
        compute_s = moved / 1e9 * s_per_gb if s_per_gb is not None else None
        share = compute_s / step_s if compute_s is not None and step_s > 0 else None
        self.io_cpu = {"bytes_per_step": moved, "s_per_gb": s_per_gb, "compute_s_per_step": compute_s,
                       "share_of_step": share, "steal_share": steal,
                       "measured_at": cost.get("io_cpu_measured_at") if cost is not None else None}
        stolen = f"the hypervisor took {steal:.0%} of the CPU time over these steps" if steal else None
        if compute_s is None:
            if stolen:
                log.debug("fuyou: swap I/O: %s per step; %s. On a virtual machine swap I/O can cost the compute: "
                          "`fuyou doctor` measures how much, and runs then report it", format_bytes(moved), stolen)
            return
        cost_line = (f"{format_bytes(moved)} per step at {s_per_gb:.2f} s of compute per GB (`fuyou "
                     f"doctor`, {self.io_cpu['measured_at']}): ~{compute_s:.2f} s of each {step_s:.2f} s step "
                     f"({share:.0%})")
        log.debug("fuyou: swap I/O: %s", cost_line + (f"; {stolen}" if stolen else ""))  # summary()["io_cpu"]
        if share is not None and share >= IO_CPU_WARN_SHARE:
            state = self._figures().slot_ssd_bytes
            warnings.warn(
                f"fuyou: this run's swap I/O costs its compute: {cost_line}, {IO_CPU_WARN_SHARE:.0%} or more of "
                "the step. No overlap hides a cost paid in compute; fewer bytes do. The optimizer "
                f"state on the SSD reads and writes about {format_bytes(state)} each per step: hold it in RAM "
                "(host_state='auto' with a larger host_memory_budget), or take state_format='bf16'; keep "
                "activations off the SSD", stacklevel=4)

    # -- metrics and the summary --------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """`FuyouEngine.metrics`. A step decided on the device is read first (`_amend` completes its figures)."""
        with self._lock:
            unread = self._unread
        if unread is not None:
            _ = self._optimizer.stats  # reads it: waits for the device to reach the step's gradient norm
        with self._lock:
            return dict(self._metrics)

    def _counters(self, tiers: TierFigures, stats: StepStats) -> dict[str, float]:
        swapper = self.engine.swapper
        swap = swapper.stats if swapper is not None else None
        return {"ssd_read_bytes": tiers.ssd_read_bytes, "ssd_write_bytes": tiers.ssd_write_bytes,
                "activation_bytes_to_ssd": swap.ssd_bytes if swap else 0,
                "activation_bytes_to_host": swap.host_bytes if swap else 0,
                "clipped": stats.clipped, "skipped": stats.skips, "rolled_back": stats.rollbacks}

    def _rebase(self) -> None:
        counted = self._counters(self.engine.memory.figures(), self._optimizer.stats)
        with self._lock:
            self._counted = counted

    def _step_metrics(self, seconds: float, stats: StepStats, unread: bool) -> dict[str, float]:
        """The step's metrics from the statistics as recorded (`FuyouAdamW.recorded`): a step decided on the device is
        not read here (``unread``), which would wait for the device; `_amend` fills in its clipped, skipped and
        grad_norm once it is."""
        tiers = self.engine.memory.figures()
        opt = self._optimizer
        now = self._counters(tiers, stats)
        with self._lock:
            # A swapper installed by the planner starts its own counts: never a negative difference.
            delta = {k: max(0, v - self._counted.get(k, 0)) for k, v in now.items()}
            self._counted = now
        out = {"step_seconds": seconds, **delta,
               "ssd_read_gbps": delta["ssd_read_bytes"] / seconds / 1e9 if seconds > 0 else 0.0,
               "ssd_write_gbps": delta["ssd_write_bytes"] / seconds / 1e9 if seconds > 0 else 0.0,
               "grad_norm": stats.last_grad_norm, "schedule_next_forward": float(stats.last_schedule == NEXT_FORWARD),
               "rollback_rate": stats.rollback_rate, "host_pool_peak_bytes": tiers.pool_peak_bytes,
               # the optimizer state on the device tier (FuyouConfig.device_state), updated there
               "optimizer_state_device_bytes": tiers.state_on_device_bytes,
               # cumulative: the share of each drive's rated endurance the run has written so far
               "ssd_endurance_used": now["ssd_write_bytes"] / max(1, len(opt.store.run_dirs))
               / (self.config.ssd_endurance_tbw * TB)}
        if self.engine.streamer is not None:
            out["device_peak_bytes"] = self.engine.streamer.device_peak_bytes
        if self.engine.plan is not None:
            out["plan_predicted_step_seconds"] = self.engine.plan.predicted_step_s
        if unread:
            out["grad_norm"] = float("nan")  # until it is read
        return {f"fuyou/{k}": float(v) for k, v in out.items()}

    def _amend(self, step: Unsettled, outcome: str, clipped: bool) -> None:
        """A step decided on the device was read (`schedule.Unsettled`): the counts it added go into `_counted`,
        taken before it was read (else the next step's metrics would carry them), and into its metrics."""
        skipped = outcome == "skip"
        with self._lock:
            self._counted["clipped"] += clipped
            self._counted["skipped"] += skipped
            if self._unread is step:
                self._unread = None
                self._metrics.update({"fuyou/clipped": float(clipped), "fuyou/skipped": float(skipped),
                                      "fuyou/grad_norm": step.grad_norm})

    def summary(self) -> dict[str, Any]:
        """`FuyouEngine.summary`."""
        engine, opt = self.engine, self._optimizer
        stats, plan = opt.stats, engine.plan
        tiers, figures = engine.memory.figures(), self._figures()
        swap = engine.swapper.stats if engine.swapper is not None else None
        stream = engine.streamer.stats if engine.streamer is not None else None
        times = self.step_times[1:] or self.step_times  # the first step includes warm-up
        trainable = sum(p.numel() for g in opt.param_groups for p in g["params"])
        return {
            "trainable_parameters": trainable,
            "optimizer_steps": stats.steps,
            "commits": stats.commits,
            "redos": stats.redos,
            "deferred": stats.deferred,  # next_forward steps: exact at once, no rollback possible
            "skips": stats.skips,
            "clipped": stats.clipped,
            "rollbacks": stats.rollbacks,
            "rollback_rate": stats.rollback_rate,
            "schedule_steps": dict(stats.schedules),
            "schedule_next": opt.next_schedule,
            "schedule_reason": stats.last_reason,
            "last_grad_norm": stats.last_grad_norm,
            "loss_scale": opt.scaler.get_scale() if opt.scaler is not None else None,  # fp16 loss scaling
            "state_format": opt.state_format.name,  # FuyouConfig.state_format: the bytes per parameter of the state
            # FuyouConfig.optimizer_threads: the worker's intra-op threads as it set them, and why
            "optimizer_threads": figures.worker_threads,
            "optimizer_threads_reason": figures.threads_reason,
            # FuyouConfig.update_kernel: the host update's kernel ("one_pass" or "torch"), and why
            "update_kernel": figures.update_kernel,
            "update_kernel_reason": figures.kernel_reason,
            # the fields left to fuyou ("auto", or unset placement) and why each took its value
            "choices": {name: {"value": value, "why": why} for name, (value, why) in engine.choices.items()},
            # Both slots of every parameter's [master | exp_avg | exp_avg_sq] chunks, with padding: on the SSD, and in
            # host RAM (FuyouConfig.host_state), and on the device (FuyouConfig.device_state)
            "ssd_bytes_optimizer_state": figures.state_ssd_bytes,
            "host_bytes_optimizer_state": figures.state_ram_bytes,
            "device_bytes_optimizer_state": figures.state_device_bytes,
            "ssd_file_bytes": tiers.ssd_reserved_bytes,  # also the activations' high-water mark
            "activation_bytes_to_ssd": swap.ssd_bytes if swap else 0,
            "activation_bytes_to_host": swap.host_bytes if swap else 0,
            "weight_tiers": stream.tiers if stream else {},  # streamed blocks only: {block index: tier}
            "weight_bytes_streamed": stream.streamed_bytes if stream else 0,
            "weight_device_peak_bytes": stream.high_water_bytes if stream else 0,  # streamed weights on the device
            "weight_bytes_trainable_streamed": stream.trainable_bytes if stream else 0,
            # Weights and gradients on the device at most (activations not counted); None without streaming.
            "device_peak_bytes": engine.streamer.device_peak_bytes if stream else None,
            "ssd_bytes_per_trainable_parameter": tiers.ssd_reserved_bytes / max(1, trainable),
            "host_pool_peak_bytes": tiers.pool_peak_bytes,
            # State chunks on the SSD read ahead in backward for the last gradients' updates
            # (`ChunkPipeline.read_ahead`): taken by an update, or given back unused (stale, or not asked for)
            "state_chunks_read_ahead": figures.read_ahead_used,
            "state_chunks_read_ahead_unused": figures.read_ahead_dropped,
            # State chunks on the SSD that step() committed while their write was in flight (`TensorStore.commit`'s
            # ``writes_behind``), and the reads that then had to wait for one to land
            "state_chunks_written_behind": tiers.writes_behind,
            "state_reads_waited_behind": tiers.waits_behind,
            "host_pool_budget_bytes": tiers.pool_budget_bytes,
            "median_step_seconds": statistics.median(times) if times else float("nan"),
            "plan": plan.policies if plan is not None else None,
            "plan_predicted_step_seconds": plan.predicted_step_s if plan is not None else None,
            "plan_measured_step_seconds": (statistics.median(self.step_times[self._plan_applied_at + 1:])
                                           if self._plan_applied_at is not None
                                           and len(self.step_times) > self._plan_applied_at + 1 else None),
            "ssd_write_bytes_total": tiers.ssd_write_bytes,
            # measured after WEAR_SAMPLE_STEPS steps: per step and hour, DWPD, the run's share of the rating
            "wear": self.wear.as_dict() if self.wear is not None else None,
            # measured with the wear: swap bytes per step, what fuyou doctor measured a GB to cost the compute here
            # (s_per_gb, None if it did not), their product and its share of the step, the hypervisor's steal share
            "io_cpu": dict(self.io_cpu) if self.io_cpu is not None else None,
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
            f"  SSD: optimizer state {format_bytes(s['ssd_bytes_optimizer_state'])}"
            + (f" (and {format_bytes(s['host_bytes_optimizer_state'])} in host RAM)" if s["host_bytes_optimizer_state"]
               else "")
            + (f" (and {format_bytes(s['device_bytes_optimizer_state'])} on the device)"
               if s["device_bytes_optimizer_state"] else "") + " (swap files "
            f"{format_bytes(s['ssd_file_bytes'])}), activations swapped "
            f"{format_bytes(s['activation_bytes_to_ssd'])} to SSD and {format_bytes(s['activation_bytes_to_host'])} to host",
            f"  host pool peak {format_bytes(s['host_pool_peak_bytes'])} of {format_bytes(s['host_pool_budget_bytes'])}; "
            f"median step {s['median_step_seconds']:.3f} s",
        ] + ([f"  weights streamed: {format_bytes(s['weight_bytes_streamed'])} in {len(s['weight_tiers'])} blocks "
              f"{s['weight_tiers']} ({format_bytes(s['weight_bytes_trainable_streamed'])} trainable), device peak "
              f"{format_bytes(s['weight_device_peak_bytes'])} of streamed weights, "
              f"{format_bytes(s['device_peak_bytes'])} of weights and gradients"] if s["weight_tiers"] else []))
