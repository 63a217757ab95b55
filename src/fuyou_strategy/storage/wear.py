"""What a run costs the swap drives' endurance.

An NVMe drive is rated for a number of terabytes written (TBW) or drive writes per day (DWPD)
over its warranty; Fuyou rewrites the optimizer state every step (12 bytes per trainable
parameter, 24 when a clipping redo writes it twice), plus activations and weights on the SSD
tier. `Wear` turns the bytes written per step into the figures a user compares with the
datasheet. Writes are striped evenly over the swap directories, so each of ``drives`` takes its
share.
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

    def describe(self) -> str:
        """One line: writes per step and hour, DWPD, the run's share of the rating."""
        run = (f"; the run's {self.steps} steps write {format_bytes(self.bytes_per_step * self.steps)}, "
               f"{self.run_fraction:.2%} of the drives' rated {self.endurance_tbw:g} TBW"
               if self.steps is not None else "")
        return (f"SSD wear: {format_bytes(self.bytes_per_step)} written per step, {format_bytes(self.bytes_per_hour)}/h "
                f"over {self.drives} drive(s) of {format_bytes(self.drive_bytes)}: {self.drive_writes_per_day:.2f} "
                f"drive writes per day, rated endurance reached in {self.days_to_rated_endurance:.0f} days of "
                f"training{run}")
