"""The cost model: predicted step time and per-tier peak memory for any per-block policy.

A `Profile` describes one training step of one model on one machine: per block its forward
and backward time, saved-activation bytes and parameters; the rest of the model; the
device↔host and SSD bandwidths; the CPU AdamW throughput; and the budgets of each tier. It
comes from a warm-up measurement (`profile.measure`) or from a model and hardware
description (`spec.analytic_profile`, for ``fuyou plan``) — the model below is the same.

`predict` simulates a step as tasks on four resources, each serving its tasks in the order
the runtime issues them:

- ``compute`` (the device): block forwards, recomputation, block backwards, the rest of the model;
- ``link`` (device↔host copies): activations out in forward and back in backward;
- ``ssd`` (all swap directories, reads and writes sharing the drives): activation writes and
  prefetch reads, and the optimizer's state traffic — so the two compete, as they do;
- ``cpu`` (the optimizer worker): AdamW on each parameter's chunks.

A task starts when its inputs are ready and its resource is free, so compute and data
movement overlap exactly as far as the dependencies allow (with ``blocking_swap_out``, as the
runtime does today, the copy out of a swapped activation runs on the compute resource; the
SSD write after it is asynchronous): an activation is prefetched when
backward enters the block ``prefetch_blocks`` later, a block's backward waits for its
activations (or its recomputation), and the optimizer update of a block's parameters starts
when its backward has produced their gradients (Fuyou's overlap). What cannot overlap — the
updates of the blocks that receive their gradients last, and of the rest of the model — ends
the step. When gradient clipping bites (``redo_fraction`` of the steps), FuyouAdamW makes a
second, unoverlapped pass over every parameter; that is added in proportion. With
``overlap_optimizer=False`` every update waits for the end of backward (the ZeRO-Infinity
schedule, for comparison).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

from ..activations.blocks import Policy
from ..optim.adamw import STATE_BYTES_PER_PARAM

__all__ = ["BlockProfile", "Profile", "Prediction", "predict"]

# FuyouAdamW reads and writes [master | exp_avg | exp_avg_sq] in fp32 per parameter, and keeps two slots.
OPTIMIZER_SSD_SLOTS = 2  # active + shadow


@dataclass
class BlockProfile:
    """One repeated block (a transformer layer) for one micro-batch."""

    fwd_s: float
    bwd_s: float
    act_bytes: int  # saved activations that a host/ssd policy moves (one micro-batch)
    params: int  # trainable parameters in the block

    @property
    def recompute_s(self) -> float:
        return self.fwd_s


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
    weight_upload_bytes_per_param: float = 0.0  # copying an updated weight to the device (0 when device is host)
    device_base_bytes: int = 0  # what stays on the device regardless of policies (weights, grads, runtime)
    optimizer_host_bytes: int = 0  # host pool bytes host-policy activations leave free (HostShares.reserved)
    micro_batches: int = 1
    prefetch_blocks: int = 2
    redo_fraction: float = 0.0  # share of steps where clipping bites: the optimizer makes a second pass
    # The runtime copies a swapped tensor out inside the forward (the pack hook), on the compute
    # thread or stream; only the SSD write is asynchronous. False models a side-stream copy.
    blocking_swap_out: bool = True
    device_budget: int | None = None
    host_budget: int | None = None
    ssd_budget: int | None = None
    source: str = "synthetic"  # "measured", "analytic", "synthetic"
    notes: dict = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def params(self) -> int:
        return self.other_params + sum(b.params for b in self.blocks)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "Profile":
        values = dict(values)
        values["blocks"] = [BlockProfile(**b) for b in values["blocks"]]
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

    @property
    def fits(self) -> bool:
        return not self.over


class _Schedule:
    """In-order resources: a task starts when its inputs are done and its resource is free."""

    def __init__(self) -> None:
        self.free = {"compute": 0.0, "link": 0.0, "ssd": 0.0, "cpu": 0.0}
        self.busy = dict.fromkeys(self.free, 0.0)

    def run(self, resource: str, seconds: float, *after: float) -> float:
        start = max([self.free[resource], *after])
        end = start + seconds
        self.free[resource] = end
        self.busy[resource] += seconds
        return end


def predict(profile: Profile, policies: Sequence[Policy], *, overlap_optimizer: bool = True) -> Prediction:
    """Predicted step time and peaks for one policy per block (see the module docstring)."""
    blocks, n = profile.blocks, profile.num_blocks
    if len(policies) != n:
        raise ValueError(f"{len(policies)} policies for {n} blocks")
    k = profile.prefetch_blocks
    link, rd, wr = profile.link_bytes_per_s, profile.ssd_read_bytes_per_s, profile.ssd_write_bytes_per_s
    s = _Schedule()
    t = 0.0  # end of the previous phase on the compute resource
    backward_end = 0.0
    for micro in range(profile.micro_batches):
        last = micro == profile.micro_batches - 1
        # -- forward: blocks in order; each swapped block's activations leave asynchronously.
        out_done = [0.0] * n
        for i, (b, p) in enumerate(zip(blocks, policies)):
            t = s.run("compute", b.fwd_s, t)
            if p in (Policy.HOST, Policy.SSD):
                if profile.blocking_swap_out:
                    copied = t = s.run("compute", b.act_bytes / link, t)
                else:
                    copied = s.run("link", b.act_bytes / link, t)
                out_done[i] = s.run("ssd", b.act_bytes / wr, copied) if p is Policy.SSD else copied
        t = s.run("compute", profile.other_fwd_s + profile.other_bwd_s, t)  # head, loss and their backward
        # -- backward: blocks in reverse; prefetch k blocks ahead; updates follow each block's gradients.
        back_ready = [0.0] * n
        issued = [False] * n
        updates_done = []
        for i in range(n - 1, -1, -1):
            for j in range(i, max(-1, i - k - 1), -1):  # entering block i issues the reads for i .. i-k
                if not issued[j] and policies[j] in (Policy.HOST, Policy.SSD):
                    issued[j] = True
                    ready = max(out_done[j], t)
                    if policies[j] is Policy.SSD:
                        ready = s.run("ssd", blocks[j].act_bytes / rd, ready)
                    back_ready[j] = s.run("link", blocks[j].act_bytes / link, ready)
            b, p = blocks[i], policies[i]
            if p is Policy.RECOMPUTE:
                t = s.run("compute", b.recompute_s, t)
            t = s.run("compute", b.bwd_s, t, back_ready[i])
            if last and overlap_optimizer:
                updates_done.append(_update(s, profile, b.params, t))
        backward_end = t
    # The rest of the model (embeddings get their gradients last), and every update when not overlapped.
    if overlap_optimizer:
        updates_done.append(_update(s, profile, profile.other_params, backward_end))
    else:
        updates_done = [_update(s, profile, b.params, backward_end) for b in reversed(blocks)]
        updates_done.append(_update(s, profile, profile.other_params, backward_end))
    step = max([backward_end, *updates_done])
    if profile.redo_fraction > 0:
        # Clipping bit: every update is computed again after the step, from the committed state.
        redo = s.run("compute", 0.0, step)
        for b in reversed(blocks):
            redo = max(redo, _update(s, profile, b.params, step))
        redo = max(redo, _update(s, profile, profile.other_params, step))
        step += profile.redo_fraction * (redo - step)

    device_peak, host_peak, ssd_peak = _peaks(profile, policies)
    over = {}
    for tier, peak, budget in (("device", device_peak, profile.device_budget), ("host", host_peak, profile.host_budget),
                               ("ssd", ssd_peak, profile.ssd_budget)):
        if budget is not None and peak > budget:
            over[tier] = peak - budget
    return Prediction(step, device_peak, host_peak, ssd_peak, s.busy["compute"], s.busy["link"], s.busy["ssd"],
                      s.busy["cpu"], step - backward_end, over)


def _update(s: _Schedule, profile: Profile, params: int, grads_ready: float) -> float:
    """One parameter set's AdamW: read state, update on the CPU, write state, upload the weight."""
    if params == 0:
        return grads_ready
    read = s.run("ssd", params * STATE_BYTES_PER_PARAM / profile.ssd_read_bytes_per_s, grads_ready)
    done = s.run("cpu", params / profile.adam_params_per_s, read)
    written = s.run("ssd", params * STATE_BYTES_PER_PARAM / profile.ssd_write_bytes_per_s, done)
    if profile.weight_upload_bytes_per_param:
        done = s.run("link", params * profile.weight_upload_bytes_per_param / profile.link_bytes_per_s, done)
    return max(written, done)


def _peaks(profile: Profile, policies: Sequence[Policy]) -> tuple[int, int, int]:
    """Peak bytes per tier. The device's is the largest of the moments of the step:

    - forward at block ``i``: kept activations of blocks ``<= i`` plus block ``i``'s own
      (present while it runs, whatever its policy);
    - backward at block ``i``: kept activations of blocks ``<= i`` (later ones are freed), the
      activations of swapped blocks ``i-k .. i`` already read back, and block ``i``'s own
      (recomputed, if so).
    """
    blocks, k = profile.blocks, profile.prefetch_blocks
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
    device = profile.device_base_bytes + peak
    host = profile.optimizer_host_bytes + sum(a for a, p in zip(acts, policies) if p is Policy.HOST)
    ssd = (OPTIMIZER_SSD_SLOTS * STATE_BYTES_PER_PARAM * profile.params
           + sum(a for a, p in zip(acts, policies) if p is Policy.SSD))
    return device, host, ssd
