"""What this machine's swap directories measured: the bandwidth cache.

The planner's SSD probe (`planner.profile.ssd_bandwidth`) and `fuyou doctor` remember each swap directory's
read and write rates in ``~/.cache/fuyou-strategy/bandwidth.json`` (``$XDG_CACHE_HOME`` if set;
``$FUYOU_CACHE_DIR/bandwidth.json`` if that is set), keyed by the directory and its filesystem;
``optimizer_prefetch_chunks="auto"`` reads them back (`measured`). ``fuyou doctor`` also remembers what a GB of
swap I/O cost the compute (`remember_io_cpu`), which a run reads back (`io_cpu_cost`).

This module imports nothing of fuyou's, so that `fuyou_strategy.config` can use it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterable

__all__ = ["CACHE", "cache_key", "io_cpu_cost", "load", "measured", "remember", "remember_io_cpu", "slowest"]

CACHE = (Path(os.environ["FUYOU_CACHE_DIR"]) if os.environ.get("FUYOU_CACHE_DIR") else
         Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fuyou-strategy") / "bandwidth.json"


def cache_key(directory: str | os.PathLike) -> str:
    """The key of ``directory``'s measurement: its filesystem's device and its real path."""
    real = os.path.realpath(directory)
    return f"{os.stat(real).st_dev}:{real}"


def load() -> dict[str, dict[str, Any]]:
    """Every measurement remembered (``{key: {"read_bps", "write_bps", "direct"}}``); none if the cache is missing
    or unreadable."""
    try:
        cache = json.loads(CACHE.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def remember(key: str, rates: dict[str, Any]) -> None:
    """Add one bandwidth measurement (whatever else ``key`` has remembered is kept)."""
    _update(key, {"read_bps": float(rates["read_bps"]), "write_bps": float(rates["write_bps"]),
                  "direct": bool(rates.get("direct", True))})


def remember_io_cpu(key: str, s_per_gb: float, steal_share: float | None) -> None:
    """Add what a GB of swap I/O in ``key``'s directory cost the compute beside it (`storage.probe.IOCpuCost`),
    the hypervisor's steal share meanwhile, and when."""
    _update(key, {"io_cpu_s_per_gb": max(0.0, float(s_per_gb)), "io_cpu_steal_share": steal_share,
                  "io_cpu_measured_at": time.strftime("%Y-%m-%d %H:%M", time.localtime())})


def _update(key: str, fields: dict[str, Any]) -> None:
    """Merge ``fields`` into ``key``'s entry (read-modify-write of the whole file; a read-only home keeps
    nothing: the next run measures again)."""
    cache = load()
    entry = cache.get(key)
    cache[key] = {**(entry if isinstance(entry, dict) else {}), **fields}
    try:
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = CACHE.with_name(f"{CACHE.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, CACHE)  # a reader never sees half a file
    except OSError:
        pass


def measured(directories: Iterable[str | os.PathLike]) -> list[dict[str, Any]] | None:
    """The remembered rates of every directory, in order, or ``None`` when any has none (not measured yet, not
    a directory yet, or a ``{rank}`` template)."""
    cache, found = load(), []
    for d in directories:
        try:
            entry = cache.get(cache_key(d))
        except OSError:
            return None
        if not isinstance(entry, dict) or not {"read_bps", "write_bps"} <= entry.keys():
            return None
        found.append(entry)
    return found


def slowest(rates: Iterable[dict[str, Any]]) -> float:
    """The slowest read or write rate, in bytes/s, of some directories' measurements: what sets the pace."""
    return min(min(r["read_bps"], r["write_bps"]) for r in rates)


def io_cpu_cost(directories: Iterable[str | os.PathLike]) -> dict[str, Any] | None:
    """The costliest I/O CPU measurement (``{"io_cpu_s_per_gb", "io_cpu_steal_share", "io_cpu_measured_at"}``)
    remembered for any directory on the filesystems ``directories`` live on (the cost is the device's, not the
    folder's); ``None`` if none was."""
    try:
        devices = {cache_key(d).split(":", 1)[0] for d in directories}
    except OSError:
        return None
    found = [e for k, e in load().items() if isinstance(e, dict) and k.split(":", 1)[0] in devices
             and isinstance(e.get("io_cpu_s_per_gb"), (int, float))]
    return max(found, key=lambda e: e["io_cpu_s_per_gb"]) if found else None
