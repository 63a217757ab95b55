"""When a step's AdamW updates run: during backward, or ahead of the next forward.

Two schedules give bitwise the same weights (see `FuyouConfig.optimizer_schedule`):

- ``"backward"``: each update runs speculatively as its gradient becomes final, into the shadow
  slot; ``step()`` commits, or — clipping bit, or a gradient was not finite — rolls back and
  redoes every update with the clip coefficient (a second pass over the state, not overlapped
  with anything) or skips.
- ``"next_forward"``: backward only moves gradients out of the way; ``step()`` knows the global
  norm, queues every exact update in forward order and returns; the next forward waits, module by
  module, only for the updates of the weights it is about to use (`PendingUpdates`).

`ScheduleChooser` picks one per accumulation window for ``"auto"``, from what it measured: the
seconds the compute thread waited for the optimizer under each schedule, the seconds a rollback
took, and how often clipping or a non-finite gradient forced one lately.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Iterable

import torch

from .pipeline import ChunkJob, ChunkPipeline

__all__ = ["BACKWARD", "NEXT_FORWARD", "PendingUpdates", "ScheduleChooser"]

BACKWARD, NEXT_FORWARD = "backward", "next_forward"


class PendingUpdates:
    """The updates ``step()`` queued for the next forward: which parameters still wait for theirs.

    `wait` is what a forward pre-hook (or the weight streamer, before it reads a block's tier copy)
    calls for the parameters it is about to read; `wait_all` lands everything (before a checkpoint,
    evaluation, a state dict, or the next backward). Each wait has a way out (`ChunkPipeline.wait_job`),
    and a failed update is raised as what it is: the state on SSD is then partly updated.
    ``stall`` adds up the seconds spent waiting, for `ScheduleChooser`.
    """

    def __init__(self, pipeline: ChunkPipeline) -> None:
        self.pipeline = pipeline
        self.jobs: dict[torch.nn.Parameter, tuple[ChunkJob, str]] = {}
        self.stall = 0.0

    def add(self, param: torch.nn.Parameter, job: ChunkJob, what: str) -> None:
        self.jobs[param] = (job, what)

    def pending(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Whether any of ``params`` still waits for its update (never blocks)."""
        jobs = self.jobs
        return bool(jobs) and any(p in jobs and not jobs[p][0].done.done() for p in params)

    def wait(self, params: Iterable[torch.nn.Parameter], *, stall: bool = True) -> None:
        """Return once the updates of ``params`` have landed (weights written, state written).
        ``stall=False``: not the training thread's wait (not counted in ``stall``)."""
        jobs = self.jobs
        if not jobs:
            return
        start = time.perf_counter() if stall else None
        try:
            for p in params:
                entry = jobs.pop(p, None)
                if entry is None:
                    continue
                job, what = entry
                try:
                    self.pipeline.wait_job(job, what)
                except BaseException as exc:
                    raise RuntimeError(
                        f"FuyouAdamW: {what} failed, so the optimizer state on SSD is partly updated; resume from "
                        "the last checkpoint") from exc
        finally:
            if start is not None:
                self.stall += time.perf_counter() - start

    def wait_all(self) -> None:
        self.wait(list(self.jobs))

    def take_stall(self) -> float:
        stall, self.stall = self.stall, 0.0
        return stall


class ScheduleChooser:
    """Chooses the schedule of each accumulation window.

    Args:
        setting: ``"auto"``, ``"backward"`` or ``"next_forward"`` (the last two are kept as given).
        can_speculate: whether there is a shadow slot (``state_slots=2``); without one only
            ``"next_forward"`` is possible.
        history: how many recent windows the rollback rate is taken over.

    For ``"auto"``, with ``r`` the share of the last ``history`` windows in which clipping bit or a
    gradient was not finite (``backward`` would have rolled back), ``R`` the measured seconds of a
    rollback and ``W_b``, ``W_n`` the measured seconds the compute thread waited for the optimizer
    per window under each schedule (exponential averages): ``backward`` is expected to cost
    ``W_b + r * R`` and ``next_forward`` ``W_n``; the cheaper one is chosen, ``backward`` while
    nothing has rolled back lately, and ``next_forward`` once, to measure it, when a rollback has
    been seen and ``W_n`` is not known yet.
    """

    def __init__(self, setting: str, *, can_speculate: bool, history: int = 8, smoothing: float = 0.5) -> None:
        self.setting = setting
        self.can_speculate = can_speculate
        self.why_not = "one state slot: no shadow slot to speculate into"  # when it cannot
        self.smoothing = smoothing
        self.rolled: deque[bool] = deque(maxlen=history)
        self.rollback_s: float | None = None
        self.wait_s: dict[str, float | None] = {BACKWARD: None, NEXT_FORWARD: None}

    def choose(self) -> tuple[str, str]:
        """The next window's schedule and why (for the logs)."""
        if self.setting != "auto":
            return self.setting, "configured"
        if not self.can_speculate:
            return NEXT_FORWARD, self.why_not
        rate = sum(self.rolled) / len(self.rolled) if self.rolled else 0.0
        if rate == 0.0 or self.rollback_s is None:
            return BACKWARD, f"no rollback in the last {len(self.rolled)} steps"
        wait_b, wait_n = self.wait_s[BACKWARD] or 0.0, self.wait_s[NEXT_FORWARD]
        expected = wait_b + rate * self.rollback_s
        if wait_n is None:
            return NEXT_FORWARD, (f"rollback rate {rate:.2f} x {self.rollback_s:.3g} s a rollback: trying next_forward "
                                  "to measure its wait")
        why = (f"backward expected {expected:.3g} s (wait {wait_b:.3g} s + rollback rate {rate:.2f} x "
               f"{self.rollback_s:.3g} s) vs next_forward {wait_n:.3g} s")
        return (NEXT_FORWARD if wait_n < expected else BACKWARD), why

    def record(self, *, rolled: bool, rollback_s: float | None = None) -> None:
        """One window's outcome: whether ``backward`` rolled back (or would have), and how long that took."""
        self.rolled.append(rolled)
        if rollback_s is not None:
            self.rollback_s = self._average(self.rollback_s, rollback_s)

    def record_wait(self, schedule: str, seconds: float) -> None:
        """The seconds the compute thread waited for one window's updates under ``schedule``."""
        self.wait_s[schedule] = self._average(self.wait_s[schedule], seconds)

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def state_dict(self) -> dict[str, Any]:
        """What the choice rests on (checkpoints: a resumed run chooses as the uninterrupted one would)."""
        return {"rolled": list(self.rolled), "rollback_s": self.rollback_s, "wait_s": dict(self.wait_s)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rolled.clear()
        self.rolled.extend(bool(r) for r in state.get("rolled", ()))
        self.rollback_s = state.get("rollback_s")
        self.wait_s.update(state.get("wait_s", {}))
