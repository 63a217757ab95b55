"""``fuyou report TRACE``: where a traced step's time went, measured against the planner's prediction.

Prints each lane's busy share per step of a ``FuyouConfig(trace=...)`` trace (I/O threads merged into "ssd
read" and "ssd write"); ``png`` draws the measured steps above the planner's simulated step, on one time axis.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .config import ConfigError
from .trace import LANES

__all__ = ["TraceReport", "load_trace", "draw"]

# Colours per kind of span (the name's first word).
_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "recompute": "#c44e52", "optimizer.step()": "#8172b3",
            "read": "#55a868", "write": "#937860", "wait": "#da8bc3", "weights": "#da8bc3", "activations": "#da8bc3",
            "step": "#bbbbbb", "adamw": "#8c8c8c", "head": "#64b5cd", "gradients": "#937860"}


def _colour(name: str) -> str:
    """A span's colour by the first word of its name ("wait: ..." is a wait, "adamw..." an update)."""
    kind = name.split()[0].rstrip(":") if name.split() else ""
    if kind.startswith("adamw"):
        kind = "adamw"
    return _COLOURS.get(kind, "#999999")


@dataclass
class TraceReport:
    """A trace's lanes as ``{lane: [(name, start s, end s)]}``, measured and predicted, on one clock."""

    measured: dict[str, list[tuple[str, float, float]]] = field(default_factory=dict)
    predicted: dict[str, list[tuple[str, float, float]]] = field(default_factory=dict)
    steps: list[tuple[str, float, float]] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)

    def busy(self, lane: str, start: float, end: float, *, predicted: bool = False) -> float:
        """Seconds within ``[start, end)`` in which ``lane`` had at least one span open."""
        spans = (self.predicted if predicted else self.measured).get(lane, [])
        return _union([(max(s, start), min(e, end)) for _n, s, e in spans if e > start and s < end])

    def table(self) -> str:
        """Per step: its time and each measured lane's busy share; then the predicted step's."""
        lanes = [lane for lane in self.measured if lane != "steps"]
        header = f"{'':<14}{'seconds':>9}" + "".join(f"{lane:>14}" for lane in lanes)
        lines = [header, "-" * len(header)]
        for name, start, end in self.steps:
            lines.append(f"{name:<14}{end - start:>9.3f}" + "".join(
                f"{self.busy(lane, start, end) / (end - start):>14.0%}" for lane in lanes))
        if self.predicted:
            start = min(s for spans in self.predicted.values() for _n, s, _e in spans)
            end = max(e for spans in self.predicted.values() for _n, _s, e in spans)
            shares = ", ".join(f"{lane.removeprefix('predicted ')} {self.busy(lane, start, end, predicted=True) / (end - start):.0%}"
                               for lane in self.predicted)
            lines += ["", f"{'predicted':<14}{end - start:>9.3f}  busy: {shares}"]
            measured = [e - s for _n, s, e in self.steps]
            if measured:
                median = sorted(measured)[len(measured) // 2]
                lines.append(f"measured / predicted step: {median:.3f} s / {end - start:.3f} s = "
                             f"{median / (end - start):.2f}x")
        else:
            lines += ["", "no planner prediction in this trace (it has one when the run had a plan: "
                      "activations='auto' or plan=...)"]
        return "\n".join(lines)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def load_trace(path: str | os.PathLike) -> TraceReport:
    """Read a fuyou trace JSON; `ConfigError` naming the file if it is not one."""
    name = os.fspath(path)
    try:
        with open(name) as f:
            data = json.load(f)
        events = data["traceEvents"]
    except FileNotFoundError:
        raise ConfigError(f"trace: {name!r} does not exist; write one with FuyouConfig(trace=...)") from None
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"trace: {name!r} is not a Chrome trace JSON written by fuyou ({exc})") from None
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    report = TraceReport(metadata=data.get("otherData", {}))
    for e in events:
        if e.get("ph") != "X":
            continue
        lane = lanes.get((e["pid"], e["tid"]), str(e["tid"]))
        if e["pid"] == 1 and lane.startswith("ssd "):
            lane = f"ssd {e['name']}"  # every I/O thread's requests on one lane per direction
        span = (e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
        (report.measured if e["pid"] == 1 else report.predicted).setdefault(lane, []).append(span)
    order = {lane: i for i, lane in enumerate(LANES + ("ssd read", "ssd write"))}
    report.measured = dict(sorted(report.measured.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))
    report.steps = sorted(report.measured.get("steps", []), key=lambda s: s[1])
    if not report.steps:
        raise ConfigError(f"trace: {name!r} holds no complete step; record at least one (trace_steps)")
    return report


def draw(report: TraceReport, path: str | os.PathLike, *, title: str = "") -> None:
    """The lanes as horizontal bars: measured on top, predicted below, seconds from the first traced step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--png: needs matplotlib; pip install matplotlib (or fuyou-strategy[bench])") from None
    origin = report.steps[0][1]
    panels = [("measured", report.measured)] + ([("predicted by the planner", report.predicted)]
                                                if report.predicted else [])
    heights = [len(lanes) for _t, lanes in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 1.2 + 0.45 * sum(heights)), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (label, lanes) in zip(axes[:, 0], panels):
        names = list(lanes)
        for row, lane in enumerate(names):
            for name, start, end in lanes[lane]:
                ax.broken_barh([(start - origin, max(end - start, 1e-6))], (row - 0.4, 0.8),
                               facecolors=_colour(name), edgecolor="none", alpha=0.85)
        ax.set_yticks(range(len(names)), [n.removeprefix("predicted ") for n in names], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(label, fontsize=9, loc="right")
        ax.grid(axis="x", alpha=0.3)
    for _n, start, end in report.steps:
        for ax in axes[:, 0]:
            ax.axvline(start - origin, color="black", linewidth=0.6, alpha=0.5)
    from matplotlib.patches import Patch

    legend = {"forward": "forward", "backward": "backward", "recompute": "recompute", "optimizer.step()": "step()",
              "adamw": "AdamW chunk", "read": "SSD read", "write": "SSD write", "wait": "wait", "head": "head + loss"}
    axes[0, 0].legend(handles=[Patch(color=_COLOURS[k], label=v) for k, v in legend.items()], fontsize=7, ncol=9,
                      loc="lower left", bbox_to_anchor=(0, 1.02), frameon=False)
    axes[-1, 0].set_xlabel("seconds from the first traced step")
    fig.suptitle(title or "fuyou step timeline", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)
    plt.close(fig)
