"""The solver: per-block policies (and weight tiers) that minimise predicted step time within the budgets,
as a `Plan`.

A search on `cost.predict` over each block's activation policy and, with ``weight_tiers``, its weight tier:

1. **Fit.** From every block kept with its weights on the device, while a tier is over budget apply the
   single-block change that frees the most over-budget bytes per second of step time it adds.
2. **Improve.** Apply the change that lowers the predicted step most within budget, until none does; ties go
   to weights on cheaper tiers (device, then host, then ssd).
3. **Spare the drives** (``write_tolerance`` > 0): apply the change that writes the fewest SSD bytes per step
   while the step stays within ``1 + write_tolerance`` of the fastest; the plan's ``note`` says the trade.

Blocks of equal size differ only by position, so each round tries, per (current, new) value, the earliest and
the latest such block (early blocks' activations are needed last in backward) and the whole group at once (a
plateau such as the prefetch window yields to no single change). That keeps a 96-layer search to seconds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

from ..activations.blocks import Policy
from ..config import format_bytes
from ..planfile import PlanError, read
from .cost import WEIGHT_TIERS, Prediction, Profile, predict

__all__ = ["ONE_SLOT_HINT", "Plan", "PlanError", "solve", "fixed_plan", "holds_state_in_ram", "one_slot",
           "one_slot_faster", "with_one_slot", "worth_one_slot"]

# One slot of state is named beside a two-slot plan (`one_slot`) where its predicted step is below this share of two's.
ONE_SLOT_HINT = 0.95

_TOLERANCE = 1e-9


@dataclass
class Plan:
    """Per-block activation policies and weight tiers, why, and what the cost model predicts for them.
    ``weight_tiers``: one of `cost.WEIGHT_TIERS` per block; absent from a plan file, all on the device."""

    policies: list[str]
    act_bytes: list[int]
    reasons: list[str]
    predicted_step_s: float
    device_peak: int
    host_peak: int
    ssd_peak: int
    budgets: dict[str, int | None]
    source: str = "solver"
    profile: dict = field(default_factory=dict, repr=False)
    weight_tiers: list[str] = field(default_factory=list)
    note: str = ""  # e.g. what sparing the drives' endurance (write_tolerance) saved and cost
    # Bytes of optimizer state (every slot) the plan holds in host RAM (FuyouConfig.host_state): what the host
    # budget leaves with host_state="auto"; counted in host_peak. The engine moves that much state there.
    state_in_ram: int = 0
    # Bytes of optimizer state (every slot) the plan holds in the device's memory (FuyouConfig.device_state): what
    # the device budget leaves with device_state="auto"; counted in device_peak. The engine moves that much there.
    state_on_device: int = 0

    def __post_init__(self) -> None:
        if not self.weight_tiers:
            self.weight_tiers = ["device"] * len(self.policies)

    @property
    def activations(self) -> dict[int, str]:
        """The `FuyouConfig.activations` mapping that applies this plan."""
        return dict(enumerate(self.policies))

    @property
    def weights(self) -> dict[int, str]:
        """The `FuyouConfig.weights` mapping that applies this plan: the streamed blocks' tiers."""
        return {i: tier for i, tier in enumerate(self.weight_tiers) if tier != "device"}

    def table(self, *, compact: bool = False) -> str:
        """One row per block (block, activation size, policy, weight tier, reason); ``compact`` merges
        runs of consecutive blocks with the same row into one ``first-last`` row."""
        rows = [(str(i), format_bytes(nbytes), policy, tier, reason) for i, (nbytes, policy, tier, reason)
                in enumerate(zip(self.act_bytes, self.policies, self.weight_tiers, self.reasons))]
        if compact:
            merged: list[list] = []
            for i, row in enumerate(rows):
                if merged and merged[-1][1:] == list(row[1:]):
                    merged[-1][0] = f"{merged[-1][0].split('-')[0]}-{i}"
                else:
                    merged.append(list(row))
            rows = [tuple(r) for r in merged]
        lines = [f"{'block':>7}  {'activations':>12}  {'policy':<9}  {'weights':<7}  reason", "-" * 78]
        lines += [f"{b:>7}  {a:>12}  {p:<9}  {w:<7}  {r}" for b, a, p, w, r in rows]
        return "\n".join(lines + ["-" * 78] + self.totals())

    def totals(self) -> list[str]:
        """The lines under `table`'s rows: how many blocks take each policy and tier, the predicted step, the
        peak per tier against its budget, the optimizer state on the device and in host RAM."""
        budget = {k: (format_bytes(v) if v is not None else "no limit") for k, v in self.budgets.items()}
        return [
            f"policies: {_counts(self.policies, [p.value for p in Policy])}; weights: "
            f"{_counts(self.weight_tiers, WEIGHT_TIERS)}; predicted step {self.predicted_step_s:.3f} s",
            f"peaks: device {format_bytes(self.device_peak)} (budget {budget.get('device')}), host "
            f"{format_bytes(self.host_peak)} (budget {budget.get('host')}), ssd {format_bytes(self.ssd_peak)} "
            f"(budget {budget.get('ssd')})",
        ] + ([f"optimizer state on the device: {format_bytes(self.state_on_device)}{self._share(self.state_on_device)} "
              "(in the device peak; updated there)"] if self.state_on_device else []) + (
            [f"optimizer state in host RAM: {format_bytes(self.state_in_ram)} (in the host peak; the rest on the SSD)"]
            if self.state_in_ram else []) + ([self.note] if self.note else [])

    def _state_bytes(self) -> float:
        """The optimizer state's bytes (every slot), from the saved profile; 0 without one."""
        p = self.profile
        return (p["other_params"] + sum(b["params"] for b in p["blocks"])) * p["state_slots"] * p["state_bytes"] \
            if p else 0.0

    def _share(self, nbytes: int) -> str:
        """``", 42% of it"``: ``nbytes`` against the optimizer state's bytes (every slot), from the saved profile."""
        total = self._state_bytes()
        return f", {nbytes / total:.0%} of it" if total else ""

    @property
    def state_on_ssd(self) -> int:
        """Bytes of optimizer state (every slot) the plan leaves on the SSD: neither in host RAM nor on the device
        (0 for a plan file saved without its profile)."""
        return max(0, math.ceil(self._state_bytes()) - self.state_in_ram - self.state_on_device)

    def __str__(self) -> str:
        return self.table(compact=True)

    def timeline(self) -> list[tuple[str, str, float, float]]:
        """The cost model's simulated step under this plan: ``(resource, task, start s, end s)`` per task
        (`cost.predict`'s ``timeline``); empty for a plan file saved without its profile."""
        return self._predict(timeline=True).timeline if self.profile else []

    def predicted_by_schedule(self) -> dict[str, float]:
        """The cost model's step under each optimizer schedule for this plan, ``{"backward": s, "next_forward":
        s}`` (what `ScheduleChooser.expect` weighs); empty for a plan file saved without its profile."""
        if not self.profile:
            return {}
        return {name: self._predict(schedule=name).step_s for name in ("backward", "next_forward")}

    def _predict(self, **options) -> Prediction:
        """`cost.predict` on the saved profile with this plan's policies and weight tiers."""
        return predict(Profile.from_dict(self.profile), [Policy(p) for p in self.policies],
                       weight_tiers=self.weight_tiers, **options)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, for `load` and ``FuyouConfig(plan=...)``."""
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        """Read a plan written by `save` (or ``fuyou plan --save``); `PlanError` names the file and what is
        wrong with it (`planfile.read`)."""
        return cls(**read(path))


def fixed_plan(profile: Profile, policies: Sequence[Policy | str], *, weight_tiers: Sequence[str] | None = None,
               reason: str = "given", overlap_optimizer: bool = True) -> Plan:
    """A `Plan` for given policies (e.g. all-ssd) and weight tiers (default: the profile's), with the
    cost model's prediction."""
    state = ([Policy(p) for p in policies],
             list(weight_tiers) if weight_tiers is not None else [b.weight_tier for b in profile.blocks])
    pred = predict(profile, state[0], weight_tiers=state[1], overlap_optimizer=overlap_optimizer)
    return _plan(profile, state, pred, [reason] * len(state[0]), "fixed")


def solve(profile: Profile, *, allowed: Iterable[Policy | str] = tuple(Policy),
          weight_tiers: Iterable[str] | None = None, overlap_optimizer: bool = True,
          write_tolerance: float = 0.0) -> Plan:
    """The policies that minimise predicted step time within the budgets (module docstring). ``allowed``: the
    activation policies to choose from; ``weight_tiers``: the tiers to choose each block's weights from (``None``
    keeps each block's); ``write_tolerance``: the share of step time worth giving up for fewer SSD writes (0:
    the fastest). Raises `PlanError` when nothing fits, naming the tier that is short and by how much."""
    allowed = [Policy(p) for p in allowed]
    tiers = None if weight_tiers is None else list(weight_tiers)
    if tiers is not None and (not tiers or any(t not in WEIGHT_TIERS for t in tiers)):
        raise ValueError(f"weight_tiers: got {tiers!r}; expected some of {list(WEIGHT_TIERS)}")
    tiers = [t for t in WEIGHT_TIERS if t in tiers] if tiers is not None else []  # cheapest first
    n = profile.num_blocks
    if n == 0:
        raise PlanError("the profile has no blocks to plan")

    def evaluate(state: _State) -> Prediction:
        return predict(profile, state[0], weight_tiers=state[1], overlap_optimizer=overlap_optimizer)

    current = ([Policy.KEEP if Policy.KEEP in allowed else allowed[0]] * n,
               [tiers[0]] * n if tiers else [b.weight_tier for b in profile.blocks])
    best = evaluate(current)
    # 1. Fit.
    while not best.fits:
        choice = None
        for candidate, pred in _moves(profile, current, allowed, tiers, evaluate):
            freed = sum(best.over.values()) - sum(pred.over.values())
            if freed <= 0:
                continue
            cost = max(pred.step_s - best.step_s, 1e-12)
            score = freed / cost
            if choice is None or score > choice[0]:
                choice = (score, candidate, pred)
        if choice is None:
            short = ", ".join(f"{tier} needs {format_bytes(nbytes)} more" for tier, nbytes in best.over.items())
            raise PlanError(
                f"does not fit: {short} (with the best policies found: {_counts(current[0], list(Policy))}; "
                f"weights {_counts(current[1], WEIGHT_TIERS)}; device peak {format_bytes(best.device_peak)}, host "
                f"{format_bytes(best.host_peak)}, ssd {format_bytes(best.ssd_peak)}); raise that budget, shorten the "
                "sequence or shrink the batch"
            )
        _, current, best = choice
    # 2. Improve: faster, or as fast with the weights on cheaper tiers. Every block is tried alone here: a block's
    # cost depends on where it sits (the prefetch window, the drive's queue), so the middle of a run of alike
    # blocks can gain where its ends do not (the plan's reasons list each alternative; none is then faster).
    while True:
        choice = None
        for candidate, pred in _moves(profile, current, allowed, tiers, evaluate, every_block=True):
            if not pred.fits:
                continue
            faster = pred.step_s < best.step_s - _TOLERANCE * max(1.0, best.step_s)
            if faster or pred.step_s <= best.step_s and _tier_rank(candidate) < _tier_rank(current):
                if choice is None or (pred.step_s, _tier_rank(candidate)) < (choice[1].step_s, _tier_rank(choice[0])):
                    choice = (candidate, pred)
        if choice is None:
            break
        current, best = choice
    # 3. Spare the drives: fewer bytes written per step, within write_tolerance of the fastest step.
    fastest, note = best, ""
    while write_tolerance > 0:
        limit = fastest.step_s * (1 + write_tolerance)
        choice = None
        for candidate, pred in _moves(profile, current, allowed, tiers, evaluate):
            if pred.fits and pred.step_s <= limit and pred.ssd_write_bytes < best.ssd_write_bytes - 0.5:
                if choice is None or (pred.ssd_write_bytes, pred.step_s) < (choice[1].ssd_write_bytes, choice[1].step_s):
                    choice = (candidate, pred)
        if choice is None:
            break
        current, best = choice
    if best is not fastest:
        note = (f"sparing the drives (write_tolerance {write_tolerance:g}): {format_bytes(best.ssd_write_bytes)} "
                f"written per step instead of {format_bytes(fastest.ssd_write_bytes)} "
                f"({1 - best.ssd_write_bytes / fastest.ssd_write_bytes:.0%} less), predicted step "
                f"{best.step_s:.3f} s instead of {fastest.step_s:.3f} s ({best.step_s / fastest.step_s - 1:+.1%})")
    plan = _plan(profile, current, best, _reasons(current, best, allowed, tiers, evaluate), "solver")
    plan.note = note
    return plan


_State = tuple[list[Policy], list[str]]  # per block: activation policy, weight tier


def _tier_rank(state: _State) -> int:
    """How far the weights are from the device, in all (0: every block's on the device)."""
    return sum(WEIGHT_TIERS.index(t) for t in state[1])


def _moves(profile: Profile, current: _State, allowed: list[Policy], tiers: list[str],
           evaluate, every_block: bool = False) -> Iterable[tuple[_State, Prediction]]:
    """Single-block changes worth trying, of a policy or of a weight tier (see `_changes`)."""
    policies, weights = current
    for candidate in _changes([b.act_bytes for b in profile.blocks], policies, allowed, every_block):
        yield (candidate, weights), evaluate((candidate, weights))
    for candidate in _changes([b.weight_bytes for b in profile.blocks], weights, tiers, every_block):
        yield (policies, candidate), evaluate((policies, candidate))


def _changes(sizes: list[int], current: list, allowed: list, every_block: bool = False) -> Iterable[list]:
    """Per (size, current value, new value), the first and the last block of that size and value
    changed (``every_block``: each block of it), and all of them; then every block at once to each allowed
    value."""
    groups: dict[tuple, list[int]] = {}
    for i, (size, value) in enumerate(zip(sizes, current)):
        groups.setdefault((size, value), []).append(i)
    for (_size, value), indices in groups.items():
        for target in allowed:
            if target == value:
                continue
            # One block (the first or the last of its group), or the whole group at once: the
            # device peak can sit on a plateau (e.g. the prefetch window) that no single move lowers.
            singles = [(i,) for i in indices] if every_block else [(indices[0],), (indices[-1],)]
            for change in dict.fromkeys((*singles, tuple(indices))):
                candidate = list(current)
                for index in change:
                    candidate[index] = target
                yield candidate
    for target in allowed:  # and every block at once: the uniform plans are always considered
        if any(v != target for v in current):
            yield [target] * len(current)


def _reasons(state: _State, best: Prediction, allowed: list[Policy], tiers: list[str], evaluate) -> list[str]:
    """Why each block has its policy (and, when the solver chose them, its weight tier): what each
    alternative would cost or break."""
    policies, weights = state
    reasons = []
    for i, policy in enumerate(policies):
        why = "fastest that fits" if policy is Policy.KEEP else "frees device memory at least cost"
        reason = f"{why} ({_alternatives(state, i, 0, allowed, best, evaluate)})"
        if tiers:
            why = "resident, fastest that fits" if weights[i] == "device" else "streamed, frees device memory"
            reason += f"; weights {why} ({_alternatives(state, i, 1, tiers, best, evaluate) or 'no other tier'})"
        reasons.append(reason)
    return reasons


def _alternatives(state: _State, i: int, which: int, options: list, best: Prediction, evaluate) -> str:
    """What giving block ``i`` each other of ``options`` (for ``state[which]``) would cost or break."""
    notes = []
    for other in options:
        if other == state[which][i]:
            continue
        values = list(state[which])
        values[i] = other
        pred = evaluate((values, state[1]) if which == 0 else (state[0], values))
        name = getattr(other, "value", other)
        if not pred.fits:
            tier, nbytes = next(iter(pred.over.items()))
            notes.append(f"{name}: {tier} over by {format_bytes(nbytes)}")
        else:
            notes.append(f"{name} {pred.step_s - best.step_s:+.3f} s")
    return "; ".join(notes)


def _plan(profile: Profile, state: _State, pred: Prediction, reasons: list[str], source: str) -> Plan:
    policies, weights = state
    return Plan(
        policies=[p.value for p in policies],
        act_bytes=[b.act_bytes for b in profile.blocks],
        reasons=reasons,
        predicted_step_s=pred.step_s,
        device_peak=pred.device_peak,
        host_peak=pred.host_peak,
        ssd_peak=pred.ssd_peak,
        budgets={"device": profile.device_budget, "host": profile.host_budget, "ssd": profile.ssd_budget},
        source=source,
        profile=profile.to_dict(),
        weight_tiers=list(weights),
        state_in_ram=pred.state_in_ram,
        state_on_device=pred.state_on_device,
    )


def _counts(values: Sequence[str], order: Iterable[str]) -> str:
    """``"6 keep, 2 ssd"``: how many of ``values`` are each of ``order`` (those that occur)."""
    return ", ".join(f"{values.count(v)} {getattr(v, 'value', v)}" for v in order if values.count(v))


def with_one_slot(profile: Profile) -> Profile:
    """``profile`` with one slot of state (``FuyouConfig(state_slots=1)``): half the state's bytes in every tier, and
    the ``next_forward`` schedule, since without a rollback slot no update runs during backward. Where the warm-up
    measured its ``next_forward`` windows apart (`Profile.next_forward_timings`), their compute and update rate
    replace the profile's, which speculative updates beside backward slowed."""
    timed = profile.next_forward_timings
    measured = {} if timed is None else {
        "blocks": [dataclasses.replace(b, fwd_s=fwd, bwd_s=bwd)
                   for b, fwd, bwd in zip(profile.blocks, timed.fwd_s, timed.bwd_s)],
        "other_fwd_s": timed.other_fwd_s, "other_bwd_s": timed.other_bwd_s,
        "adam_params_per_s": timed.adam_params_per_s}
    return dataclasses.replace(profile, state_slots=1, schedule="next_forward", **measured)


def one_slot(profile: Profile, **solve_args) -> Plan | None:
    """The plan with one slot of state (`with_one_slot`, solved with ``solve_args``), or None where it does not fit
    or ``profile`` has one slot already."""
    if profile.state_slots == 1:
        return None
    try:
        return solve(with_one_slot(profile), **solve_args)
    except PlanError:
        return None


def worth_one_slot(two: Plan | None, one: Plan) -> bool:
    """Whether ``one`` (`one_slot`) is worth naming beside ``two``, the plan with two slots (None: two do not fit):
    one slot fits where two do not, or is predicted faster (`one_slot_faster`), or the model computes on the CPU and
    one slot holds the whole state off the SSD where two do not (`holds_state_in_ram`)."""
    return two is None or one_slot_faster(two, one) or holds_state_in_ram(two, one)


def one_slot_faster(two: Plan, one: Plan) -> bool:
    """Whether ``one``'s predicted step is below `ONE_SLOT_HINT` of ``two``'s."""
    return one.predicted_step_s < ONE_SLOT_HINT * two.predicted_step_s


def holds_state_in_ram(two: Plan, one: Plan) -> bool:
    """Whether the model computes on the CPU (`Profile.host_compute`) and ``one`` holds the whole optimizer state off
    the SSD where ``two`` leaves some there, and is not predicted slower than ``two`` by more than `ONE_SLOT_HINT`
    allows. Where the model computes on the CPU its updates run on the compute's cores, so speculation (two slots)
    overlaps no arithmetic: it only hides the state's SSD traffic under backward, and costs a shadow copy. With no
    SSD traffic left, one slot does the same work with less (the case where the schedule chooser runs
    ``next_forward`` with two slots too, `OptimizerControl._exact_first`); the cost model does not see it, since it
    counts those updates on cores of their own."""
    return bool(one.profile.get("host_compute")) and one.state_on_ssd == 0 < two.state_on_ssd and \
        one.predicted_step_s * ONE_SLOT_HINT <= two.predicted_step_s
