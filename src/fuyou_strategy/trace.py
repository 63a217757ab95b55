"""A timeline of a few training steps, written as Chrome / Perfetto trace JSON.

``FuyouConfig(trace="trace.json")`` makes the engine record ``trace_steps`` optimizer steps in the Trace Event
Format that ``torch.profiler`` exports (https://ui.perfetto.dev shows it; ``fuyou report trace.json --png``
draws it beside the planner's prediction). The lanes (`LANES`, then one per I/O thread) are described in
docs/observability.md.

A span costs a clock read and a list append; with no trace recording, `span` is a no-op. Spans are taken only
where the code runs anyway: tracing never adds a synchronisation (on CUDA the compute lane shows when the host
issued the work).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any, Iterator

__all__ = ["Tracer", "span", "active", "LANES"]

# Lane order in the viewer and in `fuyou report`; I/O thread lanes ("ssd ...") follow.
LANES = ("steps", "compute", "waits", "optimizer")

_active: "Tracer | None" = None
_NOOP = contextlib.nullcontext()


def active() -> "Tracer | None":
    """The recording tracer, if any."""
    return _active


def span(lane: str, name: str, **args: Any) -> contextlib.AbstractContextManager:
    """Record the enclosed code as ``name`` on ``lane`` while a trace is recording; else a no-op."""
    tracer = _active
    if tracer is None:
        return _NOOP
    return tracer.span(lane, name, **args)


class Tracer:
    """Spans on named lanes, in seconds from the tracer's creation; thread-safe. ``start()`` makes it the
    process's one recording tracer (a second is refused), ``stop()`` ends that; `save` writes `chrome` atomically."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self._lock = threading.Lock()
        self.events: list[tuple[str, str, float, float, dict]] = []  # lane, name, start, end, args
        self.marks: list[tuple[str, float, dict]] = []  # instant events: name, time, args

    # -- recording ----------------------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self.origin

    def add(self, lane: str, name: str, start: float, end: float, **args: Any) -> None:
        """A span from ``start`` to ``end`` (seconds on this tracer's clock, `now`)."""
        with self._lock:
            self.events.append((lane, name, start, end, args))

    def mark(self, name: str, **args: Any) -> None:
        with self._lock:
            self.marks.append((name, self.now(), args))

    @contextlib.contextmanager
    def span(self, lane: str, name: str, **args: Any) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.add(lane, name, start, self.now(), **args)

    def start(self) -> "Tracer":
        global _active
        if _active is not None and _active is not self:
            raise RuntimeError("another fuyou trace is recording in this process; one at a time")
        _active = self
        return self

    def stop(self) -> None:
        global _active
        if _active is self:
            _active = None

    @property
    def recording(self) -> bool:
        return _active is self

    # -- output -------------------------------------------------------------------------------------
    def lanes(self) -> list[str]:
        """Lanes in display order: `LANES` first, then the others (the I/O threads) sorted."""
        seen = {lane for lane, *_ in self.events}
        return [lane for lane in LANES if lane in seen] + sorted(seen - set(LANES))

    def chrome(self, *, metadata: dict | None = None, predicted: list[tuple[str, str, float, float]] | None = None,
               predicted_offset: float = 0.0) -> dict:
        """The Trace Event Format: process 1 the measured run (a thread per lane, ``"X"`` events in microseconds),
        process 2 the planner's ``predicted`` tasks (``(resource, name, start, end)``, seconds from the predicted
        step's start) shifted to ``predicted_offset`` on this tracer's clock."""
        with self._lock:
            events, marks = list(self.events), list(self.marks)
        lanes = self.lanes()
        tid = {lane: i + 1 for i, lane in enumerate(lanes)}
        out: list[dict] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "fuyou (measured)"}},
                           {"ph": "M", "pid": 1, "name": "process_sort_index", "args": {"sort_index": 1}}]
        for lane, i in tid.items():
            out.append({"ph": "M", "pid": 1, "tid": i, "name": "thread_name", "args": {"name": lane}})
            out.append({"ph": "M", "pid": 1, "tid": i, "name": "thread_sort_index", "args": {"sort_index": i}})
        for lane, name, start, end, args in sorted(events, key=lambda e: e[2]):
            out.append({"ph": "X", "pid": 1, "tid": tid[lane], "name": name, "cat": lane.split()[0],
                        "ts": round(start * 1e6, 3), "dur": round(max(0.0, end - start) * 1e6, 3), "args": args})
        for name, t, args in marks:
            out.append({"ph": "i", "s": "p", "pid": 1, "tid": tid.get("steps", 1), "name": name,
                        "ts": round(t * 1e6, 3), "args": args})
        if predicted:
            out += [{"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "planner (predicted)"}},
                    {"ph": "M", "pid": 2, "name": "process_sort_index", "args": {"sort_index": 2}}]
            resources = list(dict.fromkeys(r for r, *_ in predicted))
            for i, r in enumerate(resources, 1):
                out.append({"ph": "M", "pid": 2, "tid": i, "name": "thread_name", "args": {"name": f"predicted {r}"}})
            for r, name, start, end in predicted:
                out.append({"ph": "X", "pid": 2, "tid": resources.index(r) + 1, "name": name, "cat": "predicted",
                            "ts": round((predicted_offset + start) * 1e6, 3),
                            "dur": round(max(0.0, end - start) * 1e6, 3)})
        return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"generator": "fuyou-strategy",
                                                                           **(metadata or {})}}

    def save(self, path: str | os.PathLike, **kwargs: Any) -> None:
        """Write `chrome` (``kwargs`` go there) to ``path``: a temporary file, then a rename."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.chrome(**kwargs), f)
        os.replace(tmp, path)

