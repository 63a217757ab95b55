"""The plan file format (``Plan.save``, ``fuyou plan --save``): read and checked, below everything else.

A plan file is JSON: an object of the fields of `planner.Plan`. Reading one is a leaf concern — the
configuration checks a pinned plan when it is resolved (`config.resolve`, at the engine's start, so that a
bad file fails before anything is made) and the engine loads it where it is used (`planner.Plan.load`); both go
through `read`, and neither has to import the other. This module imports nothing of the package: it
also owns the vocabulary both use, the activation policies and the weight tiers.
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any, Callable, Iterable

__all__ = ["POLICIES", "WEIGHT_TIERS", "FIELDS", "REQUIRED", "PlanError", "did_you_mean", "read", "streamed_tiers"]

POLICIES = ("keep", "host", "ssd", "recompute")  # what happens to a block's saved activations (`activations.Policy`)
WEIGHT_TIERS = ("device", "host", "ssd")  # where a block's compute weights live between uses

FIX = "write a plan with Plan.save or `fuyou plan --save`"


class PlanError(RuntimeError):
    """A plan file that cannot be used, or (the solver) no assignment of policies that fits the budgets."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """For an "unknown field" error: ``"did you mean 'x'?"`` for a near miss, else the known fields."""
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1)
    return f"did you mean {close[0]!r}?" if close else f"known fields: {', '.join(known)}"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# What each field of a plan file holds (a description and a test); the per-block fields are lists of such values.
_BYTES = ("a byte count (int)", _is_int)
_TEXT = ("a string", lambda v: isinstance(v, str))
FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "policies": (f"one of {list(POLICIES)}", lambda v: v in POLICIES),
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
    "weight_tiers": (f"one of {list(WEIGHT_TIERS)}", lambda v: v in WEIGHT_TIERS),
    "note": _TEXT,
    "state_in_ram": _BYTES,
    "state_on_device": _BYTES,
}
REQUIRED = ("policies", "act_bytes", "reasons", "predicted_step_s", "device_peak", "host_peak", "ssd_peak", "budgets")
_PER_BLOCK = ("policies", "act_bytes", "reasons", "weight_tiers")


def read(path: str | os.PathLike) -> dict[str, Any]:
    """The fields of the plan file at ``path``. Raises `PlanError` naming the file, what is wrong and the fix:
    missing or unreadable, not JSON (with line and column), an unknown field (with the nearest field name)
    or a missing one, a value of the wrong type, a policy or tier not in the vocabulary, lists of different
    lengths."""
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
        raise PlanError(f"{name!r} {problem}; {FIX}")
    return values


def streamed_tiers(values: dict[str, Any]) -> dict[int, str]:
    """The weight tiers of the blocks a plan streams (``{block: tier}``; none: every block on the device)."""
    return {i: tier for i, tier in enumerate(values.get("weight_tiers") or []) if tier != "device"}


def _shape_problem(values: object) -> str | None:
    """What keeps ``values`` (a parsed plan file) from being a plan, or ``None``."""
    if not isinstance(values, dict):
        return f"expected a JSON object of plan fields ({', '.join(FIELDS)}), got {type(values).__name__}"
    for key in values:
        if key not in FIELDS:
            return f"has an unknown field {key!r} ({did_you_mean(key, FIELDS)})"
    missing = [key for key in REQUIRED if key not in values]
    if missing:
        return f"is missing the field{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}"
    for key, value in values.items():
        what, ok = FIELDS[key]
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
        if key in values and len(values[key]) != blocks:
            return f"policies has {blocks} entries but {key} has {len(values[key])}: one entry per block"
    return None
