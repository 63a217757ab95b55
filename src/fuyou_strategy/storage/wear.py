"""What a run costs the swap drives' endurance.

A drive is rated in terabytes written (TBW) or drive writes per day (DWPD); Fuyou rewrites the optimizer state
every step, plus SSD-tier activations and weights. `Wear` turns bytes per step into those figures, each of
``drives`` taking an even share (writes are striped).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from ..config import format_bytes

__all__ = ["Wear", "drive_capacity"]

TB = 1e12
_DAY = 86400.0


def drive_capacity(directories: list[str]) -> int:
    """The smallest total size of the filesystems holding ``directories`` (bytes): the drive-write
    unit of DWPD, assuming one filesystem per drive."""
    return min(shutil.disk_usage(d if os.path.isdir(d) else os.path.dirname(d) or ".").total for d in directories)


@dataclass(frozen=True)
class Wear:
    """Bytes written per step over time, against the drives' rating.

    Args:
        bytes_per_step: bytes written to the swap directories per optimizer step (all drives).
        step_seconds: seconds per optimizer step.
        drives: swap directories (one per drive), over which writes are striped.
        drive_bytes: one drive's capacity in bytes (`drive_capacity`).
        endurance_tbw: one drive's rated endurance, terabytes written.
        steps: optimizer steps of the whole run, if known.
    """

    bytes_per_step: float
    step_seconds: float
    drives: int
    drive_bytes: int
    endurance_tbw: float
    steps: int | None = None

    @property
    def bytes_per_hour(self) -> float:
        """Bytes written per hour of training, all drives together."""
        return self.bytes_per_step / self.step_seconds * 3600 if self.step_seconds > 0 else 0.0

    @property
    def drive_writes_per_day(self) -> float:
        """Full-drive writes per day of training, per drive (the datasheet's DWPD)."""
        return self.bytes_per_hour * 24 / self.drives / self.drive_bytes

    @property
    def days_to_rated_endurance(self) -> float:
        """Days of continuous training until each drive has written its rated TBW."""
        per_drive_day = self.bytes_per_hour * 24 / self.drives
        return self.endurance_tbw * TB / per_drive_day if per_drive_day > 0 else float("inf")

    def fraction(self, steps: int) -> float:
        """The share of each drive's rated endurance that ``steps`` steps write."""
        return self.bytes_per_step * steps / self.drives / (self.endurance_tbw * TB)

    @property
    def run_fraction(self) -> float | None:
        """`fraction` of the whole run (``steps``), or ``None`` when the run's length is unknown."""
        return self.fraction(self.steps) if self.steps is not None else None

    def as_dict(self) -> dict:
        return {"ssd_write_bytes_per_step": self.bytes_per_step, "ssd_write_bytes_per_hour": self.bytes_per_hour,
                "ssd_drive_writes_per_day": self.drive_writes_per_day,
                "ssd_days_to_rated_endurance": self.days_to_rated_endurance,
                "ssd_endurance_run_fraction": self.run_fraction}

    def describe(self, warn_share: float | None = None) -> str:
        """One line: the share of each drive's rated TBW the run writes, against ``warn_share``
        (``ssd_wear_warning``); then the rate (per step, per hour, drive writes per day) and the days of continuous
        training that would write the rated TBW. Without the run's length, the rate and the days only."""
        drives = f"{self.drives} drive{'s' if self.drives != 1 else ''} of {format_bytes(self.drive_bytes)}"
        rate = (f"{format_bytes(self.bytes_per_step)} per step ({format_bytes(self.bytes_per_hour)}/h, "
                f"{self.drive_writes_per_day:.2f} drive writes per day over {drives})")
        days = f"{self.days_to_rated_endurance:,.0f} days"
        if self.steps is None:
            return (f"SSD wear: {rate}; the run's length is unknown: continuous training at this rate would write each "
                    f"drive's rated {self.endurance_tbw:g} TBW in {days} (for a run that long, set ssd_endurance_tbw "
                    "to your drive's datasheet figure)")
        share = self.run_fraction
        verdict = ("" if warn_share is None else
                   f" (over ssd_wear_warning={warn_share:g}: see the warning)" if share > warn_share else
                   f" (under ssd_wear_warning={warn_share:g}: nothing to do)")
        return (f"SSD wear: the run's {self.steps:,} steps ({_duration(self.steps * self.step_seconds)} at this rate) "
                f"write {format_bytes(self.bytes_per_step * self.steps)}, {_percent(share)} of each drive's rated "
                f"{self.endurance_tbw:g} TBW{verdict}. Rate: {rate}; continuous training at this rate would write "
                f"the rated TBW in {days}")


def _percent(share: float) -> str:
    """``share`` as a percentage with its first digits showing, however small: 1.00%, 0.0003%."""
    percent = share * 100
    return f"{percent:.2f}%" if percent >= 0.01 or percent == 0 else f"{percent:.1g}%"


def _duration(seconds: float) -> str:
    """``seconds`` in the unit a reader thinks in: 40 s, 12 min, 3.5 h, 2.1 days."""
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}" if unit != "min" else f"{seconds / size:.0f} min"
    return f"{seconds:.0f} s"
