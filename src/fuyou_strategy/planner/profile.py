"""Profiling a warm-up: the measured `Profile` of one model, batch and machine.

`WarmupProfiler` watches the steps the training loop runs anyway (it never runs its own):

- per block, forward time (forward pre/post hooks, the device synchronised on CUDA; less any wait for its
  weights' updates under ``next_forward``, `PendingUpdates.waited_s`, which the cost model adds itself), the
  bytes of saved activations a host/ssd policy would move (a counting saved-tensor hook with
  the swapper's own rules), and backward time — the interval between backward entering the
  block and entering the one before it (a hook on the block's output gradient); its weights'
  bytes as the weight streamer holds them, and how many of them are trainable (their gradients),
  with the tier ``weights`` gives them (``"auto"``: device, for the solver to change);
- the rest of the model: from the last block's forward to backward entering it (head, loss
  and their backward);
- then, once: device↔host copy bandwidth, SSD read and write bandwidth of the swap
  directories (an io-bench probe, cached per directory in
  ``~/.cache/fuyou-strategy/bandwidth.json``), CPU AdamW throughput, on an accelerator torch's fused
  AdamW on it (the optimizer state's device tier), and the budgets
  (``device_memory_budget`` or the accelerator's memory, the host pool, the swap
  directories' free space). Both bandwidth probes move their bytes through a buffer of the
  optimizer's host pool, idle between steps, so they stay within ``host_memory_budget``.

The first step's times are discarded (allocator and cache warm-up); medians of the rest are used. Activation bytes
are the largest micro-batch's, the first step's included: memory is sized for the longest batch seen. With
``next_forward_windows`` (``state_slots="auto"``), where those steps speculated, the optimizer then runs two
windows under ``next_forward`` (`OptimizerControl.measure_next_forward`; the first is a transition) and the second's
compute and update rate are `Profile.next_forward_timings`: what the plan with one slot of state is solved on.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import time
import warnings
from typing import Any

import torch

from .. import drives
from ..activations.blocks import resolve_per_block
from ..activations.swap import block_input, first_tensor, storage_id, swappable
from ..cleanup import undo_after
from ..config import PAGE, FuyouConfig
from ..storage import MemoryTiers
from ..device import device_memory_bytes, synchronize
from ..optim import onepass
from ..optim.formats import Layout
from ..optim.schedule import BACKWARD
from ..optim.kernels import adamw_kernel
from ..optim.state import apply_update
from ..params.streaming import Tier
from ..progress import Progress
from ..storage import HostBuffer, HostBufferPool, round_up
from ..storage.probe import measure_bandwidth
from .cost import BlockProfile, Profile, Timings

__all__ = ["BatchGuard", "WarmupProfiler", "ssd_bandwidth", "link_bandwidth", "adam_throughput",
           "device_adam_throughput", "device_state_bytes"]

log = logging.getLogger("fuyou_strategy")


class WarmupProfiler:
    """Hooks on the blocks that record one `Profile` over the first ``steps`` optimizer steps, and two more where
    ``next_forward_windows`` asks for them (module docstring): `steps` counts them once asked."""

    def __init__(self, model: torch.nn.Module, blocks: list[torch.nn.Module], config: FuyouConfig,
                 optimizer: Any, steps: int, memory: MemoryTiers | None = None, *,
                 next_forward_windows: bool = False) -> None:
        self.model, self.blocks, self.config, self.optimizer = model, blocks, config, optimizer
        self.memory = memory  # the run's memory tiers: their store's drives and pool, the budget's split
        self.steps = self._main_steps = steps
        self._next_forward_windows = next_forward_windows
        self._main_end: tuple[tuple[float, int], int, int] | None = None  # update meter, redos, steps: the main end
        self._measured_from: tuple[float, int] | None = None  # the update meter where the measured window began
        self.device = next(model.parameters()).device
        self._param_storages = {storage_id(p) for p in model.parameters()}
        self._micro: list[dict] = []  # one record per micro-batch
        self._steps_seen = 0
        self._first_redos = self._first_steps = 0
        self._first_update: tuple[float, int] = (0.0, 0)  # the update meter after the first step (`adam_rate`)
        self._first_speculative = 0  # the optimizer's windows under backward, after the first step
        self._step_start: float | None = None
        self.step_times: list[float] = []
        self._counting: torch.autograd.graph.saved_tensors_hooks | None = None  # entered while a block runs
        self._handles = []
        try:
            for i, block in enumerate(blocks):
                self._handles.append(block.register_forward_pre_hook(self._pre(i)))
                # always_call: a forward that raises still leaves the counting hook, which is process-global
                self._handles.append(block.register_forward_hook(self._post(i), always_call=True))
        except BaseException as exc:
            undo_after(exc, self.remove)  # the hooks put on the blocks before the failure
            raise

    # -- hooks ----------------------------------------------------------------------------------
    def _now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def begin_micro_batch(self) -> None:
        now = self._now()
        if self._step_start is None:
            self._step_start = now
        n = len(self.blocks)
        self._micro.append({"step": self._steps_seen, "fwd": [0.0] * n, "act": [0] * n, "start": [0.0] * n,
                            "waited": [0.0] * n, "end": [0.0] * n, "enter": [None] * n, "seen": set()})

    def _pre(self, i: int):
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not (torch.is_grad_enabled() and self._micro):
                return
            rec = self._micro[-1]

            def pack(t: torch.Tensor) -> torch.Tensor:
                key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)
                if key not in rec["seen"] and swappable(t, self._param_storages, self.config.activation_min_bytes):
                    rec["seen"].add(key)
                    rec["act"][i] += t.numel() * t.element_size()
                return t

            self._stop_counting()  # left open by a forward that a KeyboardInterrupt ended
            self._counting = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            self._counting.__enter__()
            rec["waited"][i] = self._waited()
            rec["start"][i] = self._now()
        return hook

    def _waited(self) -> float:
        """Seconds the forwards have waited for updates so far (`PendingUpdates.waited_s`; 0 without an optimizer)."""
        landing = getattr(self.optimizer, "landing", None)
        return 0.0 if landing is None else landing.waited_s

    def _stop_counting(self) -> None:
        if self._counting is not None:
            self._counting.__exit__(None, None, None)
            self._counting = None

    def _post(self, i: int):
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            if self._counting is None:
                return
            self._stop_counting()
            rec = self._micro[-1]
            rec["end"][i] = self._now()
            # the block's compute: a wait for its weights' updates (``next_forward``) is the cost model's to add
            rec["fwd"][i] += rec["end"][i] - rec["start"][i] - (self._waited() - rec["waited"][i])
            first = first_tensor(out)
            if first is not None and first.requires_grad:
                def entered(grad: torch.Tensor) -> None:
                    if rec["enter"][i] is None:
                        rec["enter"][i] = self._now()
                first.register_hook(entered)
        return hook

    def after_step(self) -> None:
        """An optimizer step ended: its time, the counters at the first steps' end, and there (module docstring)
        the ``next_forward`` windows asked for."""
        now = self._now()
        if self._step_start is not None:
            self.step_times.append(now - self._step_start)
        self._step_start = now
        self._steps_seen += 1
        stats, control = self.optimizer.stats, self.optimizer.control
        if self._steps_seen == 1:
            self._first_redos, self._first_steps = stats.redos, stats.steps
            self._first_update = control.figures().update_total
            self._first_speculative = stats.schedules[BACKWARD]
        if self._steps_seen == self._main_steps:
            self._main_end = (control.figures().update_total, stats.redos, stats.steps)
            if self._next_forward_windows and stats.schedules[BACKWARD] > self._first_speculative:
                control.measure_next_forward("the planner's warm-up measures next_forward for state_slots='auto'")
                self.steps += 2
        elif self._steps_seen == self._main_steps + 1:
            self._measured_from = control.figures().update_total

    @property
    def done(self) -> bool:
        return self._steps_seen >= self.steps

    @property
    def steps_seen(self) -> int:
        return self._steps_seen

    def remove(self) -> None:
        """Take the hooks off the blocks, and the counting saved-tensor hook off autograd if a forward left it."""
        self._stop_counting()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def adam_rate(self, since: tuple[float, int] | None = None, until: tuple[float, int] | None = None) -> float:
        """Parameters/s of the CPU AdamW update, as the warm-up's steps ran it on their own chunks (`UpdateMeter`)
        from ``since`` (default: the first step's end) to ``until`` (default: now); a micro-benchmark
        (`adam_throughput`) only when they updated nothing (e.g. a data-parallel rank that owns no state)."""
        figures = self.optimizer.control.figures()
        (seconds, params), (seconds0, params0) = until or figures.update_total, since or self._first_update
        seconds, params = seconds - seconds0, params - params0
        if params > 0 and seconds > 0:
            return params / seconds
        return adam_throughput(self.optimizer.fused, layout=self.optimizer.state_format.layout(2**20),
                               kernel=figures.update_kernel)

    # -- the profile ------------------------------------------------------------------------------
    def _main_records(self) -> list[dict]:
        """The micro-batches of the first ``steps`` steps (not the ``next_forward`` windows measured after them)."""
        return [r for r in self._micro if r["step"] < self._main_steps]

    @staticmethod
    def _complete(records: list[dict]) -> list[dict]:
        """``records``' micro-batches with a whole forward and backward through the blocks, after the first step
        (all whole ones if none is): what the medians are taken over."""
        whole = [r for r in records if all(e is not None for e in r["enter"])]
        records = [r for r in whole if r["step"] >= 1] or whole
        if not records:
            raise RuntimeError("the warm-up recorded no complete forward and backward through the blocks")
        return records

    def _timings(self, records: list[dict]) -> tuple[list[float], list[float], float]:
        """Each block's forward and backward seconds, and the rest of the model's (forward and backward together):
        medians over ``records`` (`_complete`)."""
        n, med = len(self.blocks), statistics.median
        fwd = [med(r["fwd"][i] for r in records) for i in range(n)]
        # Backward enters block n-1 first: block i's backward lasts until backward enters block i-1.
        bwd = [med(r["enter"][i - 1] - r["enter"][i] for r in records) if i else 0.0 for i in range(n)]
        bwd[0] = bwd[1] * fwd[0] / fwd[1] if n > 1 and fwd[1] > 0 else 2 * fwd[0]
        return fwd, bwd, med(r["enter"][n - 1] - r["end"][n - 1] for r in records)

    def next_forward_timings(self) -> Timings | None:
        """What the ``next_forward`` window measured after the first ``steps`` (module docstring), or None where
        none ran."""
        if self.steps == self._main_steps or self._steps_seen < self.steps:
            return None
        fwd, bwd, other = self._timings(self._complete([r for r in self._micro if r["step"] == self._main_steps + 1]))
        return Timings(fwd, bwd, other / 3, 2 * other / 3, self.adam_rate(since=self._measured_from))

    def profile(self) -> Profile:
        """The measured profile: times are medians over the micro-batches after the first step; activation bytes the
        largest micro-batch's, the first step's included."""
        main = self._main_records()
        records = self._complete(main)
        fwd, bwd, other = self._timings(records)
        n = len(self.blocks)
        # Memory is sized for the largest micro-batch the warm-up ran, the first step's included (its counts are exact;
        # only its times are not): where batch lengths vary, a plan sized for the median runs the device out of memory
        # at the next long batch (the Trainer's length-grouped sampler puts the longest first).
        act = [max(r["act"][i] for r in main) for i in range(n)]
        params = [sum(p.numel() for p in b.parameters() if p.requires_grad) for b in self.blocks]
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        packed = [_packed_weight_bytes(b) for b in self.blocks]
        tiers = ["device"] * n if self.config.weights == "auto" else \
            [t.value for t in resolve_per_block("weights", self.config.weights, n, Tier, Tier.DEVICE)]
        main = min(self._steps_seen, self._main_steps)
        micro_batches = max(1, round(sum(1 for r in self._main_records() if r["step"] >= 1) / max(1, main - 1)))
        store = self.memory.store
        config = self.config
        device_budget = config.device_memory_budget or device_memory_bytes(self.device)
        weights = sum(_nbytes(p) for p in self.model.parameters())
        grads = sum(_nbytes(p) for p in self.model.parameters() if p.requires_grad)
        in_blocks = {id(p): p for b in self.blocks for p in b.parameters()}.values()
        outside = weights + grads - sum(_nbytes(p) * (1 + p.requires_grad) for p in in_blocks)
        rd, wr = ssd_bandwidth(store.run_dirs, store.pool, io_timeout=config.io_timeout, progress=config.progress)
        control = self.optimizer.control  # what the cost model counts of the optimizer
        # The first steps' end: the update meter, and how often clipping made the optimizer redo after the first.
        update, redos, steps = self._main_end or (None, self.optimizer.stats.redos, self.optimizer.stats.steps)
        redo_fraction = (redos - self._first_redos) / max(1, steps - self._first_steps)
        on_host = self.device.type == "cpu"
        return Profile(
            blocks=[BlockProfile(f, b, a, p, weight_bytes=w, weight_tier=tier, frozen_weight_bytes=frozen)
                    for f, b, a, p, (w, frozen), tier in zip(fwd, bwd, act, params, packed, tiers)],
            other_fwd_s=other / 3, other_bwd_s=2 * other / 3, other_params=trainable - sum(params),
            link_bytes_per_s=link_bandwidth(self.device, store.pool, io_timeout=config.io_timeout), ssd_read_bytes_per_s=rd, ssd_write_bytes_per_s=wr,
            adam_params_per_s=self.adam_rate(until=update), next_forward_timings=self.next_forward_timings(),
            weight_upload_bytes_per_param=0.0 if self.device.type == "cpu" else 2.0,
            device_base_bytes=outside,  # the blocks' weights and gradients count per tier (`cost.predict`)
            # All that host-policy activations must leave free: the optimizer's read-ahead and SSD staging.
            optimizer_host_bytes=self.memory.shares.reserved,
            micro_batches=micro_batches, prefetch_blocks=config.activation_prefetch_blocks,
            weight_prefetch_blocks=config.weight_prefetch_blocks, redo_fraction=redo_fraction,
            # The schedules the optimizer may use (one slot, or data parallel: next_forward only).
            schedule=config.optimizer_schedule if control.can_speculate else "next_forward",
            # The streamer copies prefetched blocks onto the device on its upload thread (a side
            # stream on CUDA), not on the compute thread.
            blocking_weight_copy=False,
            # The optimizer state's host tier: what the budget leaves (auto), or the bytes host_state gives it.
            state_slots=control.state_slots, host_state=None if config.host_state == "auto" else config.host_state,
            state_bytes=control.state_bytes_per_param(),
            # The device tier: what the budget leaves (auto, on an accelerator), or the bytes device_state gives it.
            device_state=device_state_bytes(config.device_state, self.device),
            **({} if on_host else {"device_adam_params_per_s": device_adam_throughput(self.device)}),
            weights_from_master=all(control.streams_from_master(p)
                                    for b in self.blocks for p in b.parameters() if p.requires_grad),
            masters_in_weights=on_host and all(
                p.dtype == torch.float32 for p in self.model.parameters() if p.requires_grad),
            device_budget=device_budget, host_budget=store.pool.budget, host_compute=on_host,
            # The drive's free space, and what the run's swap files hold already (the state the plan counts again).
            ssd_budget=sum(shutil.disk_usage(d).free for d in store.run_dirs) + store.bytes_on_disk,
            source="measured",
            notes={"device": str(self.device), "measured_step_s": self.step_times[1:main] or self.step_times[:main],
                   **({"next_forward_step_s": self.step_times[main + 1:]} if self.steps > self._main_steps else {})},
        )


class BatchGuard:
    """The largest training micro-batch a warm-up ran, as the elements of the first block's first input (its tokens
    times the hidden size); once armed (`arm`: the plan applied), a warning at the first training forward with a
    larger one, and no more checks: the plan's activation policies and the optimizer state's device tier
    (`FuyouEngine._grow_device_tier`) were sized for the warm-up's batches, and a longer one needs more activation
    memory than was measured. A forward without gradients (evaluation) saves no activations: not counted."""

    def __init__(self, block: torch.nn.Module) -> None:
        self.largest = 0  # elements of the warm-up's largest first input to ``block``
        self.armed = False
        self._handle: Any = block.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return
        x = block_input(args, kwargs)
        if x is None:
            return
        n = x.numel()
        if not self.armed:
            self.largest = max(self.largest, n)
        elif n > self.largest:
            self.remove()
            warnings.warn(
                f"fuyou planner: a training micro-batch {n / self.largest:.2f}x the largest of the warm-up's ({n:,} "
                f"elements into the first block against {self.largest:,}): the plan's activation policies and the "
                "optimizer state's device tier were sized for the warm-up's batches, and a longer one can run the "
                "device out of memory. Pad every batch to one length (the longest the run will see), at least "
                "during the warm-up, or give FuyouConfig's activations and device_state explicitly",
                stacklevel=2)

    def arm(self) -> None:
        """From now on warn at the first larger batch (nothing to compare with if the warm-up saw none)."""
        self.armed = True
        if not self.largest:
            self.remove()

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def _packed_weight_bytes(block: torch.nn.Module) -> tuple[int, int]:
    """A block's weights in bytes as the weight streamer holds them (each parameter in whole pages:
    what its host-tier copies, SSD staging buffers and gradients' host copies take), and of them
    the frozen ones'."""
    params = list(block.parameters())
    return sum(round_up(_nbytes(p)) for p in params), sum(round_up(_nbytes(p)) for p in params if not p.requires_grad)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def ssd_bandwidth(directories: list[str], pool: HostBufferPool, size: int = 256 * 2**20, *,
                  io_timeout: float = FuyouConfig.io_timeout, progress: bool = True) -> tuple[float, float]:
    """Read and write bytes/s of the swap directories together (io-bench probe, cached per directory: `drives`),
    through one buffer of ``pool`` (waiting for it at most ``io_timeout`` seconds), with a progress
    bar on a terminal unless ``progress`` is off."""
    read = write = 0.0
    for d in directories:
        parent = os.path.dirname(os.path.realpath(d))  # the swap directory of this run's folder
        rates = drives.measured([parent])
        if rates is None:
            log.info("fuyou planner: measuring SSD bandwidth of %s (%d MiB, cached in %s)", parent, size >> 20,
                     drives.CACHE)
            with _probe_buffer(pool, 64 * 2**20, io_timeout) as buf, \
                    Progress(3 * size, f"fuyou planner: SSD bandwidth of {parent}", enabled=progress) as bar:
                bw = measure_bandwidth(parent, size=size, buffer=buf.data, on_bytes=bar.update)
            rates = [bw.as_dict()]
            drives.remember(drives.cache_key(parent), rates[0])  # a read-only home: measured again next time
        read += rates[0]["read_bps"]
        write += rates[0]["write_bps"]
    return read, write


def link_bandwidth(device: torch.device, pool: HostBufferPool, nbytes: int = 64 * 2**20, *,
                   io_timeout: float = FuyouConfig.io_timeout) -> float:
    """Bytes/s of a device → host copy into a buffer of ``pool`` (pinned on CUDA) of ``nbytes``, or of the
    whole budget if smaller; best of 3."""
    with _probe_buffer(pool, nbytes, io_timeout) as buf:
        src = torch.empty(buf.capacity, dtype=torch.uint8, device=device).fill_(1)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            buf.data.copy_(src)
            synchronize(device)
            best = min(best, time.perf_counter() - start)
    return buf.capacity / best


def _probe_buffer(pool: HostBufferPool, nbytes: int, io_timeout: float) -> HostBuffer:
    """A pool buffer of ``nbytes`` or of what the pool has not lent, whichever is smaller (the pool is idle
    between steps but for the optimizer state it holds in RAM, `host_state`), at least a page."""
    return pool.acquire(max(PAGE, min(nbytes, (pool.budget - pool.lent) // PAGE * PAGE)), timeout=io_timeout)


def adam_throughput(fused: bool, n: int = 2**20, layout: Layout = Layout("fp32"), kernel: str = "torch") -> float:
    """Parameters/s of the CPU AdamW update FuyouAdamW runs on a chunk of ``layout`` (its state format's:
    the compact ones cost more CPU time) with its ``kernel`` (``OptimizerFigures.update_kernel``: the one pass,
    in place, or torch's); best of 3."""
    buf = torch.zeros(layout.nbytes(n), dtype=torch.uint8)
    state = layout.views(buf, n)
    state["master"].copy_(torch.rand(n))
    g = torch.rand(n)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
    one = onepass.load()[0] if kernel == "one_pass" else None
    best = float("inf")
    for step in range(3):
        start = time.perf_counter()
        if one is not None:
            kinds = (state["master"], state["exp_avg"], state["exp_avg_sq"])
            one.update(*kinds, g, *kinds, None, step=torch.tensor(float(step)), inv_scale=None, coef=None, **hyper)
        else:
            apply_update(layout, state, g, torch.tensor(float(step)), fused=fused, **hyper)
        best = min(best, time.perf_counter() - start)
    return n / best


def device_state_bytes(device_state: int | str, device: torch.device) -> int | None:
    """`Profile.device_state` for ``FuyouConfig.device_state`` on ``device``: its bytes, or for ``"auto"``
    ``None`` (what the plan leaves) on an accelerator and 0 on the CPU, whose device memory is host RAM (the
    host tier's, `host_state`)."""
    if device_state != "auto":
        return int(device_state)
    return 0 if device.type == "cpu" else None


def device_adam_throughput(device: torch.device, n: int = 2**22, reps: int = 5) -> float:
    """Parameters/s of torch's fused AdamW on ``device`` (`optim.kernels.adamw_kernel`, as the state's device tier
    runs it): ``n`` fp32 elements each of master, gradient and moments there, the device synchronised around
    each update; median of ``reps`` after one untimed."""
    # constants, not torch.rand: drawing would move the device's random stream (the training's dropout)
    master, grad, exp_avg, exp_avg_sq = (torch.full((n,), value, device=device) for value in (0.5, 0.01, 0.001, 1e-4))
    step = torch.zeros((), dtype=torch.float32, device=device)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
    times = []
    for rep in range(reps + 1):
        synchronize(device)
        start = time.perf_counter()
        adamw_kernel(master, grad, exp_avg, exp_avg_sq, step, fused=True, **hyper)
        synchronize(device)
        elapsed = time.perf_counter() - start
        if rep:  # not the first: the kernel's load and cold caches
            times.append(elapsed)
    return n / statistics.median(times)
