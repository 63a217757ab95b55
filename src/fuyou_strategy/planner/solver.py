"""The solver: per-block policies that minimise predicted step time within the budgets, as a `Plan`.

Search, on the cost model of `cost.predict`:

1. **Fit.** Start with every block kept. While a tier is over budget, apply the single-block
   change that frees the most over-budget bytes per second of predicted step time it adds.
2. **Improve.** Apply the single-block change that lowers the predicted step time the most
   and keeps every tier within budget; repeat until none does.

Blocks with the same activation size are interchangeable except for their position, so each
round tries, per (current policy, new policy), the earliest and the latest such block — early
blocks' activations are needed last in backward, so they are the cheapest to send to SSD —
and the whole group at once (the device peak can sit on a plateau, such as the prefetch
window, that no single change lowers). That keeps a 96-layer search to seconds.

If no assignment fits, `PlanError` says which tier is short and by how much at best.
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Iterable, Sequence

from ..activations.blocks import Policy
from ..config import did_you_mean, format_bytes
from .cost import Prediction, Profile, predict

__all__ = ["Plan", "PlanError", "solve", "fixed_plan"]

_TOLERANCE = 1e-9


class PlanError(RuntimeError):
    """No assignment of policies fits the budgets."""


@dataclass
class Plan:
    """Per-block activation policies, why, and what the cost model predicts for them."""

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

    @property
    def activations(self) -> dict[int, str]:
        """The `FuyouConfig.activations` mapping that applies this plan."""
        return dict(enumerate(self.policies))

    def table(self, *, compact: bool = False) -> str:
        """One row per block (block, activation size, policy, reason); ``compact`` merges runs of
        consecutive blocks with the same row into one ``first-last`` row."""
        rows = [(str(i), format_bytes(nbytes), policy, reason)
                for i, (nbytes, policy, reason) in enumerate(zip(self.act_bytes, self.policies, self.reasons))]
        if compact:
            merged: list[list] = []
            for i, row in enumerate(rows):
                if merged and merged[-1][1:] == list(row[1:]):
                    merged[-1][0] = f"{merged[-1][0].split('-')[0]}-{i}"
                else:
                    merged.append(list(row))
            rows = [tuple(r) for r in merged]
        lines = [f"{'block':>7}  {'activations':>12}  {'policy':<9}  reason", "-" * 78]
        lines += [f"{b:>7}  {a:>12}  {p:<9}  {r}" for b, a, p, r in rows]
        budget = {k: (format_bytes(v) if v is not None else "no limit") for k, v in self.budgets.items()}
        counts = {p.value: self.policies.count(p.value) for p in Policy if self.policies.count(p.value)}
        lines += [
            "-" * 78,
            f"policies: {', '.join(f'{v} {k}' for k, v in counts.items())}; predicted step {self.predicted_step_s:.3f} s",
            f"peaks: device {format_bytes(self.device_peak)} (budget {budget.get('device')}), host "
            f"{format_bytes(self.host_peak)} (budget {budget.get('host')}), ssd {format_bytes(self.ssd_peak)} "
            f"(budget {budget.get('ssd')})",
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table(compact=True)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, for `load` and ``FuyouConfig(plan=...)``."""
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        """Read a plan written by `save` (or ``fuyou plan --save``).

        Raises `PlanError` naming the file and what is wrong: missing or unreadable, not JSON (with
        line and column), an unknown field (with the nearest field name) or a missing one, a value
        of the wrong type, a policy that is not one of `Policy`, lists of different lengths.
        """
        name = os.fspath(path)
        try:
            with open(path) as f:
                values = json.load(f)
        except FileNotFoundError:
            problem = "does not exist"
        except json.JSONDecodeError as exc:
            problem = f"is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        except (OSError, UnicodeDecodeError) as exc:
            problem = f"cannot be read ({exc})"
        else:
            problem = _shape_problem(values)
        if problem is not None:
            raise PlanError(f"{name!r} {problem}; write a plan with Plan.save or `fuyou plan --save`")
        return cls(**values)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# What each field of a plan file holds (a description and a test); the per-block fields are lists of such values.
_BYTES = ("a byte count (int)", _is_int)
_TEXT = ("a string", lambda v: isinstance(v, str))
_FIELDS = {
    "policies": (f"one of {[p.value for p in Policy]}", lambda v: v in [p.value for p in Policy]),
    "act_bytes": _BYTES,
    "reasons": _TEXT,
    "predicted_step_s": ("seconds (a number)", lambda v: _is_int(v) or isinstance(v, float)),
    "device_peak": _BYTES,
    "host_peak": _BYTES,
    "ssd_peak": _BYTES,
    "budgets": ("an object of byte counts (or null) per tier",
                lambda v: isinstance(v, dict) and all(b is None or _is_int(b) for b in v.values())),
    "source": _TEXT,
    "profile": ("an object", lambda v: isinstance(v, dict)),
}
_PER_BLOCK = ("policies", "act_bytes", "reasons")


def _shape_problem(values: object) -> str | None:
    """What keeps ``values`` (a parsed plan file) from being a `Plan`, or ``None``."""
    if not isinstance(values, dict):
        return f"expected a JSON object of plan fields ({', '.join(_FIELDS)}), got {type(values).__name__}"
    for key in values:
        if key not in _FIELDS:
            return f"has an unknown field {key!r} ({did_you_mean(key, _FIELDS)})"
    required = [f.name for f in fields(Plan) if f.default is MISSING and f.default_factory is MISSING]
    missing = [key for key in required if key not in values]
    if missing:
        return f"is missing the field{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}"
    for key, value in values.items():
        what, ok = _FIELDS[key]
        if key not in _PER_BLOCK:
            items = [(key, value)]
        elif isinstance(value, list):
            items = [(f"{key}[{i}]", v) for i, v in enumerate(value)]
        else:
            return f"{key}: got {value!r} ({type(value).__name__}); expected a list, one entry per block, each {what}"
        for where, item in items:
            if not ok(item):
                return f"{where}: got {item!r} ({type(item).__name__}); expected {what}"
    blocks = len(values["policies"])
    for key in _PER_BLOCK[1:]:
        if len(values[key]) != blocks:
            return f"policies has {blocks} entries but {key} has {len(values[key])}: one entry per block"
    return None


def fixed_plan(profile: Profile, policies: Sequence[Policy | str], *, reason: str = "given",
               overlap_optimizer: bool = True) -> Plan:
    """A `Plan` for given policies (e.g. all-ssd), with the cost model's prediction."""
    policies = [Policy(p) for p in policies]
    return _plan(profile, policies, predict(profile, policies, overlap_optimizer=overlap_optimizer),
                 [reason] * len(policies), "fixed")


def solve(profile: Profile, *, allowed: Iterable[Policy | str] = tuple(Policy), overlap_optimizer: bool = True) -> Plan:
    """The policies that minimise predicted step time within the budgets (see the module docstring)."""
    allowed = [Policy(p) for p in allowed]
    n = profile.num_blocks
    if n == 0:
        raise PlanError("the profile has no blocks to plan")

    def evaluate(policies: list[Policy]) -> Prediction:
        return predict(profile, policies, overlap_optimizer=overlap_optimizer)

    current = [Policy.KEEP if Policy.KEEP in allowed else allowed[0]] * n
    best = evaluate(current)
    # 1. Fit.
    while not best.fits:
        choice = None
        for candidate, pred in _moves(profile, current, allowed, evaluate):
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
                f"does not fit: {short} (with the best policies found: "
                f"{_counts(current)}; device peak {format_bytes(best.device_peak)}, host {format_bytes(best.host_peak)}, "
                f"ssd {format_bytes(best.ssd_peak)}); raise that budget, shorten the sequence or shrink the batch"
            )
        _, current, best = choice
    # 2. Improve.
    while True:
        choice = None
        for candidate, pred in _moves(profile, current, allowed, evaluate):
            if pred.fits and pred.step_s < best.step_s - _TOLERANCE * max(1.0, best.step_s):
                if choice is None or pred.step_s < choice[1].step_s:
                    choice = (candidate, pred)
        if choice is None:
            break
        current, best = choice
    return _plan(profile, current, best, _reasons(profile, current, best, allowed, evaluate), "solver")


def _moves(profile: Profile, current: list[Policy], allowed: list[Policy], evaluate) -> Iterable[tuple[list[Policy], Prediction]]:
    """Single-block changes worth trying: per (size, current policy, new policy), the first and last block."""
    groups: dict[tuple[int, Policy], list[int]] = {}
    for i, (b, p) in enumerate(zip(profile.blocks, current)):
        groups.setdefault((b.act_bytes, p), []).append(i)
    for (_size, policy), indices in groups.items():
        for target in allowed:
            if target is policy:
                continue
            # One block (the first or the last of its group), or the whole group at once: the
            # device peak can sit on a plateau (e.g. the prefetch window) that no single move lowers.
            for change in dict.fromkeys(((indices[0],), (indices[-1],), tuple(indices))):
                candidate = list(current)
                for index in change:
                    candidate[index] = target
                yield candidate, evaluate(candidate)
    for target in allowed:  # and every block at once: the uniform plans are always considered
        if any(p is not target for p in current):
            candidate = [target] * len(current)
            yield candidate, evaluate(candidate)


def _reasons(profile: Profile, policies: list[Policy], best: Prediction, allowed: list[Policy], evaluate) -> list[str]:
    """Why each block has its policy: what each alternative would cost or break."""
    reasons = []
    for i, policy in enumerate(policies):
        alternatives = []
        for other in allowed:
            if other is policy:
                continue
            candidate = list(policies)
            candidate[i] = other
            pred = evaluate(candidate)
            if not pred.fits:
                tier, nbytes = next(iter(pred.over.items()))
                alternatives.append(f"{other.value}: {tier} over by {format_bytes(nbytes)}")
            else:
                alternatives.append(f"{other.value} {pred.step_s - best.step_s:+.3f} s")
        why = "fastest that fits" if policy is Policy.KEEP else "frees device memory at least cost"
        reasons.append(f"{why} ({'; '.join(alternatives)})")
    return reasons


def _plan(profile: Profile, policies: list[Policy], pred: Prediction, reasons: list[str], source: str) -> Plan:
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
    )


def _counts(policies: Sequence[Policy]) -> str:
    return ", ".join(f"{sum(p is q for p in policies)} {q.value}" for q in Policy if any(p is q for p in policies))
