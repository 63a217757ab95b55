"""The cost model: predicted step time and per-tier peak memory for any per-block policy.

A `Profile` describes one step of one model on one machine: per block its forward and backward time,
activation bytes, parameters and weight bytes with their tier; the rest of the model; link and SSD
bandwidths; CPU AdamW throughput; the tiers' budgets. It comes from a warm-up
(`profile.WarmupProfiler.profile`) or from a model and hardware description (`spec.analytic_profile`).

`predict` simulates a step as tasks on four in-order resources:

- ``compute`` (the device): block forwards, recomputation, block backwards, the rest of the model;
- ``link`` (device↔host, both directions): activations out and back, streamed weights in, their gradients out;
- ``ssd`` (every swap directory, reads and writes): activation swaps, ``ssd``-tier weights and the
  optimizer's state traffic, competing as they do;
- ``cpu`` (the optimizer worker): AdamW on each parameter set.

A task starts when its inputs are ready and its resource is free, so overlap is what the dependencies
allow: activations come back ``prefetch_blocks`` ahead in backward, a block's backward waits for them (or
its recomputation), a block's update starts once its gradients exist, and the last updates end the step.
``blocking_swap_out`` and ``blocking_weight_copy`` put device↔host copies on ``compute``, as the runtime does.

Streamed weights (``weight_tier`` ``host`` or ``ssd``) follow `params.WeightStreamer`, ``k =
weight_prefetch_blocks``: read ``k`` blocks ahead in forward and, in reverse, in backward (the last ``k``
blocks stay); gradients leave over the link after each block's backward; the update writes the weight back
to the SSD tier instead of uploading it. ``weights_from_master``: SSD-tier trainable weights are the
state's masters, not stored or written apart; ``masters_in_weights``: a resident weight is its master and
its update reads only the moments.

Under the ``backward`` schedule (`optim.schedule.Speculative`) the state of the updates whose gradients
arrive in the last `TAIL_SHARE` of backward is read ahead from the first gradient on, into spare host
memory (a first pass learns the tail), and ``step()`` does not wait for state writes, which hold up the
next step's drive (a second pass starts with it busy). Under ``next_forward`` an update lands once its
state is written. A clipping redo (``redo_fraction``) adds an unoverlapped pass in proportion;
``overlap_optimizer=False`` runs every update after backward (ZeRO-Infinity's schedule).

The optimizer state has three tiers, filled in the optimizer's order (the rest of the model, then block 0, 1, ...:
the updates whose gradients come last in backward, so the ones hardest to hide): the device
(`Profile.device_state`) takes the first parameters, host RAM (`Profile.host_state`) the next, the SSD the rest. A
device-tier parameter's state counts in the device peak; its update is torch's fused AdamW on ``compute``, right
after its gradients, at `Profile.device_adam_params_per_s`, with no SSD traffic, no CPU time and no upload (master
and weight are both on the device). A streamed block's parameters take none (their state leaves the device, as
their weights and gradients do).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable, Sequence

from ..activations.blocks import Policy
from ..config import STATE_BYTES_PER_PARAM
from ..optim.schedule import TAIL_SHARE
from ..planfile import WEIGHT_TIERS

__all__ = ["BlockProfile", "Profile", "Prediction", "Timings", "predict", "torch_step", "WEIGHT_TIERS"]

# FuyouAdamW reads and writes [master | exp_avg | exp_avg_sq] in fp32 per parameter, and keeps two slots.
OPTIMIZER_SSD_SLOTS = 2  # active + shadow (`Profile.state_slots`' default)


@dataclass
class BlockProfile:
    """One repeated block (a transformer layer) for one micro-batch. ``weight_bytes``: its compute weights,
    of which ``frozen_weight_bytes`` are frozen (no gradients, never written back); ``weight_tier``: where they
    live between uses (``"device"``, with their gradients; ``"host"`` or ``"ssd"``: streamed)."""

    fwd_s: float
    bwd_s: float
    act_bytes: int  # saved activations that a host/ssd policy moves (one micro-batch)
    params: int  # trainable parameters in the block
    weight_bytes: int = 0
    weight_tier: str = "device"
    frozen_weight_bytes: int = 0

    def __post_init__(self) -> None:
        if self.weight_tier not in WEIGHT_TIERS:
            raise ValueError(f"BlockProfile.weight_tier: got {self.weight_tier!r}; expected one of "
                             f"{', '.join(WEIGHT_TIERS)}")
        if not 0 <= self.frozen_weight_bytes <= self.weight_bytes:
            raise ValueError(f"BlockProfile.frozen_weight_bytes: got {self.frozen_weight_bytes}; expected 0 to "
                             f"weight_bytes ({self.weight_bytes})")

    @property
    def recompute_s(self) -> float:
        return self.fwd_s

    @property
    def streamed(self) -> bool:
        return self.weight_tier != "device"

    @property
    def grad_bytes(self) -> int:
        """The gradients of the block's trainable weights."""
        return self.weight_bytes - self.frozen_weight_bytes


@dataclass(frozen=True)
class Timings:
    """The compute and update figures a warm-up measured in its ``next_forward`` windows (`Profile.
    next_forward_timings`): each block's forward and backward seconds, the rest of the model's, and the CPU AdamW
    rate (parameters per second). Where the warm-up speculated, its own figures carry the speculative updates
    that ran beside backward on the same cores; these are what a run that never speculates (one slot of state)
    computes and updates at."""

    fwd_s: list[float]
    bwd_s: list[float]
    other_fwd_s: float
    other_bwd_s: float
    adam_params_per_s: float


@dataclass
class Profile:
    """Everything the cost model needs about a model, a batch and a machine (see module docstring)."""

    blocks: list[BlockProfile]
    other_fwd_s: float = 0.0  # embeddings, head and loss: forward
    other_bwd_s: float = 0.0  # ... and backward
    other_params: int = 0  # trainable parameters outside the blocks (embeddings, head, final norm)
    link_bytes_per_s: float = 20e9  # device <-> host, each direction
    ssd_read_bytes_per_s: float = 3e9  # all swap directories together
    ssd_write_bytes_per_s: float = 2e9
    adam_params_per_s: float = 1e9  # CPU AdamW throughput (parameters per second)
    weight_upload_bytes_per_param: float = 0.0  # copying an updated resident weight to the device (0: device is host)
    # What stays on the device whatever the policies: weights outside the blocks, their gradients, the runtime
    # (`predict` adds the blocks' weights).
    device_base_bytes: int = 0
    optimizer_host_bytes: int = 0  # host pool bytes host-policy activations leave free (HostShares.reserved)
    micro_batches: int = 1
    # Data-parallel ranks on this machine: each runs these micro-batches, gradients are all-reduced over the
    # link in the last backward (ring), and the machine's shared CPU and SSDs update the model once.
    data_parallel: int = 1
    prefetch_blocks: int = 2  # activations read back ahead in backward
    weight_prefetch_blocks: int | None = None  # streamed weights read ahead; None: prefetch_blocks
    redo_fraction: float = 0.0  # share of steps where clipping bites: the optimizer makes a second pass
    # When the updates run (`FuyouConfig.optimizer_schedule`): "backward", "next_forward" (each block's forward
    # waits for its update; no redo) or "auto" (the faster, by `predict`).
    schedule: str = "backward"
    # The runtime copies a swapped tensor out on the compute thread (the pack hook); False: a side stream.
    blocking_swap_out: bool = True
    # Likewise streamed weights in and their gradients out; False: side-stream copies over the link.
    blocking_weight_copy: bool = True
    # The backward schedule's tail read-ahead and state writes behind step() (module docstring); False models
    # Fuyou's paper (`fuyou plan --paper-runtime`).
    tail_read_ahead: bool = True
    writes_behind: bool = True
    state_slots: int = OPTIMIZER_SSD_SLOTS  # FuyouConfig.state_slots: copies of the state kept per parameter
    # Bytes of optimizer state per parameter and slot (FuyouConfig.state_format: 12 fp32, 8 bf16, ~6.03 8bit)
    state_bytes: float = STATE_BYTES_PER_PARAM
    # Optimizer state held in host RAM (FuyouConfig.host_state): bytes (every slot), or None: whatever the
    # host budget leaves (all of it without a host budget); 0: all of the state on the SSD. It takes the
    # parameters the device tier (below) left.
    host_state: int | None = 0
    # Optimizer state held in the compute device's memory (FuyouConfig.device_state), the first parameters in the
    # optimizer's order: bytes (every slot), or None: whatever device_budget leaves beside the device peak
    # (nothing without a device budget); 0: none.
    device_state: int | None = 0
    # torch's fused AdamW on the device (parameters per second), the device tier's update; measured on an
    # accelerator (`profile.device_adam_throughput`), else an assumption the tier's absence makes moot.
    device_adam_params_per_s: float = 50e9
    # The SSD tier's trainable weights are the fp32 masters in their state chunks (`WeightStreamer.use_master`):
    # no copy of their own, no write-back; frozen weights keep their copies.
    weights_from_master: bool = False
    # A resident trainable weight holds its fp32 master (`OptimizerState.param_holds`): its update reads only
    # the moments from the SSD.
    masters_in_weights: bool = False
    device_budget: int | None = None
    host_budget: int | None = None
    ssd_budget: int | None = None
    # The model computes on the host (a warm-up on the CPU): the CPU updates run on the compute's cores, which the
    # cost model, counting them on a resource of their own, does not see (`planner.holds_state_in_ram`).
    host_compute: bool = False
    # What a warm-up measured in next_forward windows where its own figures are speculative windows' (the warm-up of
    # FuyouConfig(state_slots="auto")); None: not measured apart. `planner.with_one_slot` takes them.
    next_forward_timings: Timings | None = None
    source: str = "synthetic"  # "measured", "analytic", "synthetic"
    notes: dict = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def params(self) -> int:
        return self.other_params + sum(b.params for b in self.blocks)

    @property
    def weight_window(self) -> int:
        """``k`` of the weight streaming: blocks read ahead, and kept from forward into backward."""
        return self.prefetch_blocks if self.weight_prefetch_blocks is None else self.weight_prefetch_blocks

    def with_weight_tiers(self, tiers: Sequence[str]) -> list[BlockProfile]:
        """The blocks with these weight tiers, one per block."""
        if len(tiers) != self.num_blocks:
            raise ValueError(f"{len(tiers)} weight tiers for {self.num_blocks} blocks")
        return [b if b.weight_tier == t else replace(b, weight_tier=t) for b, t in zip(self.blocks, tiers)]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "Profile":
        values = dict(values)
        values["blocks"] = [BlockProfile(**b) for b in values["blocks"]]
        if values.get("next_forward_timings") is not None:
            values["next_forward_timings"] = Timings(**values["next_forward_timings"])
        return cls(**values)


@dataclass
class Prediction:
    """What `predict` expects one optimizer step to cost."""

    step_s: float
    device_peak: int
    host_peak: int
    ssd_peak: int
    compute_s: float  # busy time of each resource
    link_s: float
    ssd_s: float
    cpu_s: float
    optimizer_tail_s: float  # from the end of backward to the end of the step
    over: dict[str, int]  # tier -> bytes over its budget (empty when it fits)
    # With predict(timeline=True): every task as (resource, name, start s, end s), the clipping redo excluded.
    timeline: list[tuple[str, str, float, float]] = field(default_factory=list)
    schedule: str = "backward"  # the optimizer schedule this prediction modelled (see `Profile.schedule`)
    # Bytes written to the SSD per step (optimizer state, SSD activations, streamed weights' write-back):
    # what the drives' endurance pays (the clipping redo's second write excluded).
    ssd_write_bytes: float = 0.0
    state_in_ram: int = 0  # bytes of optimizer state (every slot) held in host RAM; counted in host_peak
    state_on_device: int = 0  # bytes of optimizer state (every slot) held on the device; counted in device_peak

    @property
    def fits(self) -> bool:
        return not self.over


class _Schedule:
    """In-order resources: a task starts when its inputs are done and its resource is free.
    With ``record``, every task is kept as ``(resource, name, start, end)`` (`Prediction.timeline`)."""

    def __init__(self, record: bool = False) -> None:
        self.free = {"compute": 0.0, "link": 0.0, "ssd": 0.0, "cpu": 0.0}
        self.busy = dict.fromkeys(self.free, 0.0)
        self.tasks: list[tuple[str, str, float, float]] | None = [] if record else None

    def occupy(self, resource: str, until: float, name: str = "") -> None:
        """The resource is busy until ``until`` with work counted elsewhere (kept on the timeline, not in `busy`)."""
        if self.tasks is not None and until > self.free[resource]:
            self.tasks.append((resource, name, self.free[resource], until))
        self.free[resource] = max(self.free[resource], until)

    def run(self, resource: str, seconds: float, *after: float, name: str = "") -> float:
        start = max([self.free[resource], *after])
        end = start + seconds
        self.free[resource] = end
        self.busy[resource] += seconds
        if self.tasks is not None and seconds > 0:
            self.tasks.append((resource, name, start, end))
        return end


def predict(profile: Profile, policies: Sequence[Policy], *, weight_tiers: Sequence[str] | None = None,
            overlap_optimizer: bool = True, timeline: bool = False, schedule: str | None = None) -> Prediction:
    """Predicted step time and peaks for one policy per block (module docstring), with the profile's weight
    tiers or ``weight_tiers``; ``timeline``: every task in `Prediction.timeline` (``fuyou report`` draws it).

    ``schedule`` (default: the profile's): ``"backward"`` (two passes: the first learns the tail and how long
    the writes outlast the step); ``"next_forward"`` (the step starts with the previous step's updates in
    forward order, each block's forward waiting for its own, and ends with backward; no redo); ``"auto"``:
    the faster of the two."""
    schedule = schedule or profile.schedule
    if schedule == "auto" and overlap_optimizer:
        both = [predict(profile, policies, weight_tiers=weight_tiers, timeline=timeline, schedule=name)
                for name in ("backward", "next_forward")]
        return min(both, key=lambda pred: pred.step_s)
    blocks = profile.blocks if weight_tiers is None else profile.with_weight_tiers(weight_tiers)
    if len(policies) != len(blocks):
        raise ValueError(f"{len(policies)} policies for {len(blocks)} blocks")
    speculative = schedule != "next_forward" and overlap_optimizer
    if not speculative or not (profile.tail_read_ahead or profile.writes_behind):
        return _simulate(profile, blocks, policies, overlap_optimizer=overlap_optimizer,
                         ahead=schedule == "next_forward", timeline=timeline)[0]
    _, arrivals, behind = _simulate(profile, blocks, policies)
    tail = _tail(arrivals) if profile.tail_read_ahead else []
    return _simulate(profile, blocks, policies, timeline=timeline, tail=tail, behind=behind)[0]


def torch_step(profile: Profile) -> tuple[float, int]:
    """torch's step with the whole model on the device (what ``fuyou plan`` compares with): every micro-batch's
    forward and backward, activations kept, then torch's fused AdamW of every parameter at
    `Profile.device_adam_params_per_s`, in seconds; and the device bytes that takes: 16-bit weights and gradients
    with fp32 master and moments (16 B per parameter), beside one micro-batch's activations of every block."""
    compute = sum(b.fwd_s + b.bwd_s for b in profile.blocks) + profile.other_fwd_s + profile.other_bwd_s
    seconds = profile.micro_batches * compute + profile.params / profile.device_adam_params_per_s
    return seconds, 16 * profile.params + sum(b.act_bytes for b in profile.blocks)


def _tail(arrivals: dict) -> list:
    """The updates (``"rest"`` or block index) whose gradients arrived in the last `TAIL_SHARE` of the arrivals'
    span, last first: whose state the runtime reads ahead (`optim.schedule.Speculative._end_window`)."""
    if len(arrivals) < 2:
        return []
    first, last = min(arrivals.values()), max(arrivals.values())
    since = last - TAIL_SHARE * (last - first)
    latest_first = sorted(reversed(list(arrivals.items())), key=lambda item: -item[1])  # ties: the later one first
    return [key for key, when in latest_first if when >= since]


def _simulate(profile: Profile, blocks: list[BlockProfile], policies: Sequence[Policy], *,
              overlap_optimizer: bool = True, ahead: bool = False, timeline: bool = False, tail: Sequence = (),
              behind: float = 0.0) -> tuple[Prediction, dict, float]:
    """One simulated step. ``ahead``: the ``next_forward`` schedule; else, with ``overlap_optimizer``, the
    ``backward`` one, ``tail`` read ahead and the drive busy for the first ``behind`` seconds. Returns the
    prediction, when each update's gradients were ready (``"rest"`` or block index -> seconds; ``backward``
    only) and how long the drive stayed busy after the step."""
    n = len(blocks)
    speculative = overlap_optimizer and not ahead
    # when an update of the step is finished for step(): computed and published, its state written unless the
    # write may land behind the step (`Profile.writes_behind`)
    finished: Callable[[tuple[float, float]], float] = (lambda times: times[0]) if (
        speculative and profile.writes_behind) else max
    k, kw = profile.prefetch_blocks, profile.weight_window
    link, rd, wr = profile.link_bytes_per_s, profile.ssd_read_bytes_per_s, profile.ssd_write_bytes_per_s
    device_peak, host_peak, ssd_peak = _peaks(profile, blocks, policies)
    # "rest" or block index -> parameters whose state is on the device, then in RAM (of those the device left)
    dev = _state_on_device(profile, blocks, device_peak)
    state_dev = _state_bytes(profile, dev)
    device_peak += state_dev
    ram = _state_in_ram(profile, blocks, host_peak, dev)
    state_ram = _state_bytes(profile, ram)
    host_peak += state_ram
    ssd_peak -= state_ram + state_dev
    off_ssd = {key: ram[key] + dev[key] for key in ram}  # what the tail's read-ahead need not read
    s = _Schedule(record=timeline)
    if behind > 0:
        s.occupy("ssd", behind, name="state writes of the step before")
    t = 0.0  # end of the previous phase on the compute resource
    backward_end = 0.0
    landed: dict[int, float] = {}  # next_forward: when each block's update (of the step before) landed
    if ahead:
        t = max(_update(s, profile, profile.other_params, 0.0, ram=ram["rest"], device=dev["rest"],
                        name="rest"))  # embeddings first
        landed = {i: max(_update(s, profile, b.params, 0.0, b, ram=ram[i], device=dev[i], name=f"block {i}"))
                  for i, b in enumerate(blocks)}
    arrivals: dict = {}  # backward: "rest" or block index -> when its update's gradients were ready
    read_ahead: dict | None = None  # the tail's keys -> (state bytes read ahead, when read), once issued
    spare = None if profile.host_budget is None else max(0, profile.host_budget - host_peak)

    def ahead_of(key) -> tuple[float, float] | None:
        """What of ``key``'s state was read ahead: the whole tail's reads are issued when the first of it is due
        (the worker is idle from there on), from the window's first gradient on."""
        nonlocal read_ahead
        if key in tail and read_ahead is None:
            read_ahead = _read_ahead(s, profile, blocks, tail, off_ssd, min(arrivals.values()), spare)
        return (read_ahead or {}).get(key)
    for micro in range(profile.micro_batches):
        last = micro == profile.micro_batches - 1
        # -- forward: blocks in order; streamed weights arrive k blocks ahead; each swapped block's
        #    activations leave asynchronously.
        out_done = [0.0] * n
        weights = _WeightReads(s, profile, blocks, issued=[not b.streamed for b in blocks])
        weights.not_before = landed if micro == 0 else {}  # a weight is read once its update wrote it
        for i, (b, p) in enumerate(zip(blocks, policies)):
            weights.issue(range(i, min(n, i + kw + 1)), t)  # entering block i issues the reads for i .. i+k
            t = weights.wait(i, max(t, landed.get(i, 0.0)) if micro == 0 else t)
            t = s.run("compute", b.fwd_s, t, name=f"forward {i}")
            if p in (Policy.HOST, Policy.SSD):
                if profile.blocking_swap_out:
                    copied = t = s.run("compute", b.act_bytes / link, t, name=f"activations out {i}")
                else:
                    copied = s.run("link", b.act_bytes / link, t, name=f"activations out {i}")
                out_done[i] = (s.run("ssd", b.act_bytes / wr, copied, name=f"write activations {i}") if p is Policy.SSD
                               else copied)
        t = s.run("compute", profile.other_fwd_s + profile.other_bwd_s, t, name="head and loss")  # and their backward
        # -- backward: blocks in reverse; prefetch k blocks ahead; updates follow each block's gradients.
        back_ready = [0.0] * n
        issued = [False] * n
        weights = _WeightReads(s, profile, blocks, issued=[not b.streamed or i >= n - kw for i, b in enumerate(blocks)])
        updates_done = []
        for i in range(n - 1, -1, -1):
            weights.issue(range(i, max(-1, i - kw - 1), -1), t)  # entering block i issues the reads for i .. i-k
            for j in range(i, max(-1, i - k - 1), -1):  # ... and the activations' for i .. i-k
                if not issued[j] and policies[j] in (Policy.HOST, Policy.SSD):
                    issued[j] = True
                    ready = max(out_done[j], t)
                    if policies[j] is Policy.SSD:
                        ready = s.run("ssd", blocks[j].act_bytes / rd, ready, name=f"read activations {j}")
                    back_ready[j] = s.run("link", blocks[j].act_bytes / link, ready, name=f"activations in {j}")
            b, p = blocks[i], policies[i]
            t = weights.wait(i, t)
            if p is Policy.RECOMPUTE:
                t = s.run("compute", b.recompute_s, t, name=f"recompute {i}")
            t = s.run("compute", b.bwd_s, t, back_ready[i], name=f"backward {i}")
            grads = t
            if b.streamed and b.grad_bytes:  # a streamed block's gradients leave
                if profile.blocking_weight_copy:
                    grads = t = s.run("compute", b.grad_bytes / link, t, name=f"gradients out {i}")
                else:
                    grads = s.run("link", b.grad_bytes / link, t, name=f"gradients out {i}")
            if last and profile.data_parallel > 1 and b.grad_bytes:  # the ranks' average, before the update
                grads = s.run("link", _ring(profile) * b.grad_bytes / link, grads, name=f"all-reduce {i}")
            if last and speculative:
                arrivals[i] = grads
                updates_done.append(finished(_update(s, profile, b.params, grads, b, ram=ram[i], device=dev[i],
                                                     name=f"block {i}", ahead=ahead_of(i))))
        backward_end = t
    # The rest of the model (embeddings get their gradients last), and every update when not overlapped.
    if profile.data_parallel > 1 and profile.other_params:
        bytes_per_param = profile.weight_upload_bytes_per_param or 0.0  # 0: the device is host memory, no link
        backward_end = s.run("link", _ring(profile) * bytes_per_param * profile.other_params / link, backward_end,
                             name="all-reduce rest")
    if ahead:
        updates_done = []  # they run ahead of the next forward: the next step's start, above
    elif overlap_optimizer:
        arrivals["rest"] = backward_end
        updates_done.append(finished(_update(s, profile, profile.other_params, backward_end, ram=ram["rest"],
                                             device=dev["rest"], name="rest", ahead=ahead_of("rest"))))
    else:
        updates_done = [max(_update(s, profile, b.params, backward_end, b, ram=ram[i], device=dev[i],
                                    name=f"block {i}")) for i, b in reversed(list(enumerate(blocks)))]
        updates_done.append(max(_update(s, profile, profile.other_params, backward_end, ram=ram["rest"],
                                        device=dev["rest"], name="rest")))
    step = max([backward_end, *updates_done])
    outlasts = max(0.0, s.free["ssd"] - step) if speculative and profile.writes_behind else 0.0  # the writes behind
    timeline, s.tasks = s.tasks or [], None  # the redo below is a share of a pass, not a task on the timeline
    if profile.redo_fraction > 0 and not ahead:
        # Clipping bit: every update is computed again after the step, from the committed state.
        redo = s.run("compute", 0.0, step)
        for i, b in reversed(list(enumerate(blocks))):
            redo = max(redo, finished(_update(s, profile, b.params, step, b, ram=ram[i], device=dev[i])))
        redo = max(redo, finished(_update(s, profile, profile.other_params, step, ram=ram["rest"], device=dev["rest"])))
        step += profile.redo_fraction * (redo - step)

    ssd_writes = ((profile.params - sum(off_ssd.values())) * profile.state_bytes
                  + profile.micro_batches * sum(b.act_bytes for b, p in zip(blocks, policies) if p is Policy.SSD)
                  + _own_copies(profile, blocks, lambda b: b.grad_bytes))
    over = {}
    for tier, peak, budget in (("device", device_peak, profile.device_budget), ("host", host_peak, profile.host_budget),
                               ("ssd", ssd_peak, profile.ssd_budget)):
        if budget is not None and peak > budget:
            over[tier] = peak - budget
    prediction = Prediction(step, device_peak, host_peak, ssd_peak, s.busy["compute"], s.busy["link"], s.busy["ssd"],
                            s.busy["cpu"], step - backward_end, over, timeline,
                            ("next_forward" if ahead else "backward"), ssd_writes, state_ram, state_dev)
    return prediction, arrivals, outlasts


def _read_ahead(s: _Schedule, profile: Profile, blocks: list[BlockProfile], tail: Sequence, off_ssd: dict,
                after: float, spare: int | None) -> dict:
    """Read the ``tail``'s state that lies on the SSD (all but ``off_ssd``'s parameters per key: those on the
    device or in RAM), in that order, from ``after`` on and as far as ``spare`` host bytes (``None``: no limit)
    hold it: ``tail`` key -> (bytes read ahead, when read)."""
    done = {}
    for key in tail:
        params = profile.other_params if key == "rest" else blocks[key].params
        nbytes = (params - off_ssd[key]) * _state_read_bytes(profile, None if key == "rest" else blocks[key])
        if spare is not None:
            nbytes = min(nbytes, spare)
            spare -= nbytes
        if nbytes > 0:
            done[key] = (nbytes, s.run("ssd", nbytes / profile.ssd_read_bytes_per_s, after, name=f"read ahead {key}"))
    return done


def _state_on_device(profile: Profile, blocks: list[BlockProfile], device_peak: int) -> dict:
    """Per update (``"rest"``, then each block index), the parameters whose optimizer state is on the device:
    ``profile.device_state`` bytes, or what the device budget leaves beside ``device_peak`` (nothing without a
    budget), the first in the optimizer's order. A streamed block's are not (its weights and gradients leave the
    device, and so does its state: `OptimizerState.leave_device`)."""
    if profile.device_state is not None:
        room = profile.device_state
    else:
        room = 0 if profile.device_budget is None else max(0, profile.device_budget - device_peak)
    return _in_order(profile, blocks, room, {i: b.params for i, b in enumerate(blocks) if b.streamed})


def _state_in_ram(profile: Profile, blocks: list[BlockProfile], host_peak: int, on_device: dict) -> dict:
    """Per update (``"rest"``, then each block index), the parameters whose optimizer state is in host RAM, of
    those ``on_device`` left: ``profile.host_state`` bytes, or what the host budget leaves beside ``host_peak``
    (the other host users; all of them without a budget), the next in the optimizer's order."""
    if profile.host_state is not None:
        room: float = profile.host_state
    else:
        room = math.inf if profile.host_budget is None else max(0, profile.host_budget - host_peak)
    return _in_order(profile, blocks, room, on_device)


def _in_order(profile: Profile, blocks: list[BlockProfile], room: float, taken: dict) -> dict:
    """Per update key, in the optimizer's order (the rest of the model first, then block 0, 1, ...), the
    parameters whose state (every slot) ``room`` bytes hold, of those a faster tier has not ``taken``."""
    per_param = profile.state_slots * profile.state_bytes
    left = [(key, n - taken.get(key, 0)) for key, n in
            [("rest", profile.other_params), *((i, b.params) for i, b in enumerate(blocks))]]
    total = sum(n for _key, n in left)
    # Room for all of it holds every parameter: ``total * per_param // per_param`` can come out one short in
    # floating point (a non-integral ``per_param``).
    params = total if room >= total * per_param else int(room // per_param)
    if params * per_param > room:  # and never one over
        params -= 1
    counts: dict = {}
    for key, n in left:
        counts[key] = min(n, params)
        params -= counts[key]
    return counts


def _state_bytes(profile: Profile, counts: dict) -> int:
    """The state's bytes (every slot) of the parameters ``counts`` gives per key: never a byte short."""
    return math.ceil(sum(counts.values()) * profile.state_slots * profile.state_bytes)


def _ring(profile: Profile) -> float:
    """A ring all-reduce's bytes through each GPU's link, per byte of gradient: 2 (N - 1) / N."""
    n = profile.data_parallel
    return 2 * (n - 1) / n


class _WeightReads:
    """Streamed blocks' weights on their way to the device during one pass (forward or backward)."""

    def __init__(self, s: _Schedule, profile: Profile, blocks: list[BlockProfile], issued: list[bool]) -> None:
        self.s, self.profile, self.blocks, self.issued = s, profile, blocks, issued
        self.ready: dict[int, float] = {}  # block -> when its read ahead is done
        self.not_before: dict[int, float] = {}  # block -> when its tier copy holds the updated weight

    def issue(self, indices: Iterable[int], after: float) -> None:
        """Read ahead the weights of these blocks that are not on the device: from SSD first for the
        ``ssd`` tier, then over the link (or, with ``blocking_weight_copy``, when the block starts)."""
        for j in indices:
            if self.issued[j]:
                continue
            self.issued[j] = True
            block, ready = self.blocks[j], max(after, self.not_before.get(j, 0.0))
            if block.weight_tier == "ssd":
                ready = self.s.run("ssd", block.weight_bytes / self.profile.ssd_read_bytes_per_s, ready, name=f"read weights {j}")
            if not self.profile.blocking_weight_copy:
                ready = self.s.run("link", block.weight_bytes / self.profile.link_bytes_per_s, ready, name=f"weights in {j}")
            self.ready[j] = ready

    def wait(self, i: int, t: float) -> float:
        """When block ``i`` can start on the compute resource, free at ``t``: its weights are there."""
        if i not in self.ready:
            return t
        ready = self.ready.pop(i)
        if self.profile.blocking_weight_copy:
            return self.s.run("compute", self.blocks[i].weight_bytes / self.profile.link_bytes_per_s, t, ready,
                              name=f"weights in {i}")
        return max(t, ready)


def _state_read_bytes(profile: Profile, block: BlockProfile | None) -> float:
    """Bytes per parameter an update reads of its state on the SSD: all of it, less the fp32 master where the
    resident weight holds it (`Profile.masters_in_weights`; ``block`` None: the weights outside the blocks)."""
    resident = block is None or block.weight_tier == "device"
    return profile.state_bytes - (4.0 if profile.masters_in_weights and resident else 0.0)


def _update(s: _Schedule, profile: Profile, params: int, grads_ready: float, block: BlockProfile | None = None,
            ram: int = 0, name: str = "", ahead: tuple[float, float] | None = None,
            device: int = 0) -> tuple[float, float]:
    """One parameter set's AdamW. ``device`` of the ``params`` have their state on the device (resident weights
    only, `_state_on_device`): torch's fused AdamW on ``compute`` as soon as the gradients are ready, the weight
    updated where it is. The others read their state, update on the CPU, write
    their state and publish the weight (uploaded when resident, in place for ``host``); ``ram`` of them have
    their state in host RAM; ``ahead``: (bytes, when) read ahead (`_read_ahead`). An ``ssd``-tier block's own
    weight copies are written back once all are computed. Returns when the weights are published and when the
    state is written."""
    if params == 0:
        return grads_ready, grads_ready
    tier = block.weight_tier if block is not None else "device"
    host = params - device
    on_device = grads_ready
    if device:
        on_device = s.run("compute", device / profile.device_adam_params_per_s, grads_ready,
                          name=f"adamw on device {name}")
    computed = done = written = on_device
    on_ssd, to_read = (host - ram) * profile.state_bytes, (host - ram) * _state_read_bytes(profile, block)
    if host:
        pre_read, pre_done = ahead or (0.0, 0.0)
        read = grads_ready
        if to_read > pre_read:
            read = s.run("ssd", (to_read - pre_read) / profile.ssd_read_bytes_per_s, grads_ready,
                         name=f"read state {name}")
        computed = done = s.run("cpu", host / profile.adam_params_per_s, read, pre_done, name=f"adamw {name}")
    if tier == "ssd":  # the trainable weights' own copies (frozen ones are never written back): before the state's
        own = _own_copies(profile, [block], lambda b: b.grad_bytes)
        if own:
            done = s.run("ssd", own / profile.ssd_write_bytes_per_s, max(computed, on_device),
                         name=f"write weights {name}")
    elif tier == "device" and profile.weight_upload_bytes_per_param and host:
        done = s.run("link", host * profile.weight_upload_bytes_per_param / profile.link_bytes_per_s, computed,
                     name=f"weights up {name}")
    if host:
        written = s.run("ssd", on_ssd / profile.ssd_write_bytes_per_s, computed, name=f"write state {name}")
    return max(done, on_device), max(written, on_device)


def _peaks(profile: Profile, blocks: list[BlockProfile], policies: Sequence[Policy]) -> tuple[int, int, int]:
    """Peak bytes (device, host, ssd). The device's is the largest of forward at block ``i`` (kept activations
    of blocks ``<= i`` plus block ``i``'s own) and backward at block ``i`` (kept of ``<= i``, swapped ``i-k ..
    i`` read back, block ``i``'s own if recomputed), plus device-tier weights and gradients and the streamed
    window (``k + 1`` largest blocks' weights, the largest one's gradients). The host's adds host-tier weights
    and one staging buffer each for SSD-tier weight reads and streamed gradients."""
    k = profile.prefetch_blocks
    acts = [b.act_bytes for b in blocks]
    kept_upto, total = [], 0
    for a, p in zip(acts, policies):
        total += a if p is Policy.KEEP else 0
        kept_upto.append(total)
    peak = 0
    for i, p in enumerate(policies):
        own = 0 if p is Policy.KEEP else acts[i]
        peak = max(peak, kept_upto[i] + own)  # forward
        fetched = sum(acts[j] for j in range(max(0, i - k), i + 1) if policies[j] in (Policy.HOST, Policy.SSD))
        peak = max(peak, kept_upto[i] + fetched + (own if p is Policy.RECOMPUTE else 0))  # backward
    streamed = [b for b in blocks if b.streamed]
    window = ((profile.weight_window + 1) * max((b.weight_bytes for b in streamed), default=0)
              + max((b.grad_bytes for b in streamed), default=0))
    resident = sum(b.weight_bytes + b.grad_bytes for b in blocks if not b.streamed)
    device = profile.device_base_bytes + resident + window + peak
    host = (profile.optimizer_host_bytes + sum(a for a, p in zip(acts, policies) if p is Policy.HOST)
            + sum(b.weight_bytes for b in blocks if b.weight_tier == "host")
            + max((b.weight_bytes for b in blocks if b.weight_tier == "ssd"), default=0)
            + max((b.grad_bytes for b in streamed), default=0))
    ssd = int(profile.state_slots * profile.state_bytes * profile.params
           + sum(a for a, p in zip(acts, policies) if p is Policy.SSD)
           + _own_copies(profile, blocks, lambda b: b.weight_bytes))
    return device, host, ssd


def _own_copies(profile: Profile, blocks: list[BlockProfile], size: Callable[[BlockProfile], int]) -> int:
    """``size`` summed over SSD-tier blocks, less trainable bytes where those are the state's masters
    (`Profile.weights_from_master`): the weights' own copies on the SSD (``weight_bytes``) or written per step
    (``grad_bytes``)."""
    return sum(size(b) - (b.grad_bytes if profile.weights_from_master else 0)
               for b in blocks if b.weight_tier == "ssd")
