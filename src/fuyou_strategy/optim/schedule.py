"""When a step's AdamW updates run: during backward, or ahead of the next forward.

Two schedules give bitwise the same weights (see `FuyouConfig.optimizer_schedule`), as two objects with
one interface — `on_gradient_final` (a gradient is final and its update may run now), `finish` (the
window ends at ``step()``: commit, redo or skip; or queue the exact updates) and `discard` (``zero_grad``
between backward and ``step()``):

- `Speculative` (``"backward"``): each update runs speculatively as its gradient becomes final, into the
  shadow slot; ``step()`` commits, or — clipping bit, or a gradient was not finite — rolls back and
  redoes every update with the clip coefficient (a second pass over the state, not overlapped with
  anything) or skips.
- `Exact` (``"next_forward"``): backward only moves gradients out of the way; ``step()`` knows the global
  norm, queues every exact update in forward order and returns; the next forward waits, module by
  module, only for the updates of the weights it is about to use (`PendingUpdates`). Where every update
  runs on one accelerator (the device tier), the norm stays there: the updates take the clip coefficient
  and a ``found_inf`` flag as device tensors, and the host reads the outcome later (`Parts.decide`,
  `Unsettled`), so ``step()`` never waits for the end of backward.

Both work with the same parts (`Parts`): the state, the updater, the gradients, the window, the sharding
(a do-nothing `Solo` in one process), and neither asks which kind of gradient or process it has.
`ScheduleChooser` picks one per accumulation window for ``"auto"``, from what it measured: each
schedule's window time (one ``step()`` to the next), the seconds a rollback took, and how often clipping
or a non-finite gradient forced one lately.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch

from ..device import read_on_host, to_host
from .gradients import Grad
from .pipeline import ChunkJob, ChunkPipeline, named

if TYPE_CHECKING:
    from .gradients import Gradients
    from .state import OptimizerState, ParamState
    from .updates import Updater
    from .window import Window

__all__ = ["BACKWARD", "NEXT_FORWARD", "Exact", "Order", "Outcome", "Parts", "PendingUpdates", "ScheduleChooser",
           "Speculative", "StepStats", "Unsettled"]

BACKWARD, NEXT_FORWARD = "backward", "next_forward"
TAIL_SHARE = 0.1  # the last tenth of a window's gradient arrivals: the tail whose state is read ahead
# `ScheduleChooser`: how much slower than ``backward`` the planner's cost model must predict ``next_forward``'s
# step before ``next_forward`` is not measured early (see `ScheduleChooser.expect`)
PREDICTED_SLOWER = 1.2
ONE_SLOT_WHY = "one state slot: no shadow slot to speculate into"  # why ``backward`` cannot run with one slot


class PendingUpdates:
    """The updates ``step()`` queued for the next forward: which parameters still wait for theirs.

    `wait` is what a forward pre-hook (or the weight streamer, before it reads a block's tier copy)
    calls for the parameters it is about to read; `wait_all` lands everything (before a checkpoint,
    evaluation, a state dict, or the next backward). Each wait has a way out (`ChunkPipeline.wait_job`),
    and a failed update is raised as what it is: the state on SSD is then partly updated. After one has
    failed, every later wait for an update still queued raises at once (naming the first failure) rather
    than let a forward read weights that were never updated, and `FuyouAdamW.close` lands nothing more.
    """

    def __init__(self, pipeline: ChunkPipeline) -> None:
        self.pipeline = pipeline
        # The training thread adds (at step()) and pops (forward pre-hooks, waits); the weight sender's thread
        # (data parallel) pops too: each pop is one atomic dict operation, and a job is waited for by whoever
        # popped it, so no job is waited for twice or lost.
        self.jobs: dict[torch.nn.Parameter, tuple[ChunkJob, str | Callable[[], str]]] = {}
        self.gated = False  # a forward waits for the weights it reads (`FuyouAdamW.attach_model`), so step() need not
        # The first failure (a wait's, or `Exact.finish` queueing half a step), set once by the thread that saw it
        # (one attribute store) and only read after.
        self.failed: BaseException | None = None
        # Seconds spent in `wait` for the jobs it waited for, ever (the planner's warm-up takes them out of the forward
        # it times); every waiting thread adds under the lock.
        self.waited_s = 0.0
        self._waited_lock = threading.Lock()

    def add(self, param: torch.nn.Parameter, job: ChunkJob, what: str | Callable[[], str]) -> None:
        """``param`` waits for ``job``; ``what`` names the update in errors (a callable: made only for one)."""
        self.jobs[param] = (job, what)

    def add_many(self, params: list["ParamState"], job: ChunkJob) -> None:
        """`add` of each of ``params`` with ``job`` (their grouped update), named by ``ParamState.update_name``."""
        self.jobs.update((ps.param, (job, ps.update_name)) for ps in params)

    def pending(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Whether any of ``params`` still waits for its update (never blocks)."""
        jobs = self.jobs
        return bool(jobs) and any(p in jobs and not jobs[p][0].done.done() for p in params)

    def wait(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Return once the updates of ``params`` have landed (weights written, state written)."""
        jobs = self.jobs
        if not jobs:
            return
        landed = None  # the job waited for last, which landed: the parameters of a group share one
        for p in params:
            entry = jobs.pop(p, None)
            if entry is None:
                continue
            job, what = entry
            if job is landed:
                continue
            if self.failed is not None:
                raise RuntimeError(f"FuyouAdamW: {named(what)} cannot land, because an earlier update failed "
                                   f"({self.failed}); resume from the last checkpoint") from self.failed
            began = time.perf_counter()
            try:
                self.pipeline.wait_job(job, what)
            except Exception as exc:  # a KeyboardInterrupt stays one
                self.failed = exc
                raise RuntimeError(
                    f"FuyouAdamW: {named(what)} failed, so the optimizer state on SSD is partly updated; resume from "
                    f"the last checkpoint (the cause: {type(exc).__name__}: {exc})") from exc
            finally:
                with self._waited_lock:
                    self.waited_s += time.perf_counter() - began
            landed = job

    def wait_all(self) -> None:
        self.wait(list(self.jobs))


class ScheduleChooser:
    """Chooses the schedule of each accumulation window.

    Args:
        setting: ``"auto"``, ``"backward"`` or ``"next_forward"`` (the last two are kept as given).
        can_speculate: whether there is a shadow slot (``state_slots=2``); without one only
            ``"next_forward"`` is possible.
        history: how many recent windows the rollback rate is taken over.
        samples: how many recent window times of each schedule its cost is the median of.
        probe_after: windows under ``backward`` before ``next_forward`` is first measured (nothing rolling
            back); `forget_costs` starts the count again. Small, so that a short run still tries both:
            ``backward``'s cost is known after two windows (the first has no window before it).
        probe_every: windows between measurements of the schedule not in use, so that its cost stays current.
        backward_first: called at each choice; a reason (one sentence) not to measure ``next_forward`` before
            ``probe_every`` windows, or ``None``. `OptimizerControl` gives one that holds while every chunk of the
            state is on the SSD (see below).
        exact_first: called at each choice; a reason (one sentence) to take ``next_forward`` without measuring
            ``backward``, or ``None``. `OptimizerControl` gives one that holds while the model computes on the CPU
            and every chunk of the state is in host RAM: speculation is then more work for the same cores
            (each chunk copied into the shadow slot first) with no SSD transfer to hide, its shadow slot is RAM
            that ``next_forward`` never touches, and window times on a few busy cores are too noisy to show it.

    The choice (``"auto"``): with ``r`` the share of the last ``history`` windows in which clipping bit or a
    gradient was not finite (``backward`` rolled back, or would have), ``R`` the seconds of a rollback, and
    ``W_b``, ``W_n`` each schedule's window wall time (one ``step()`` to the next, a rollback taken out; the
    median of the last ``samples`` windows that followed one of the same schedule), ``backward`` costs
    ``W_b + r * R`` and ``next_forward`` ``W_n``: the cheaper one runs. Until both are known: ``backward``;
    then ``next_forward`` until a window of it is measured (two windows: the first is a transition), at once
    after a rollback, else after ``probe_after`` windows; and every ``probe_every`` windows the schedule not in
    use again. The schedule in use is measured all along, so a probe that flattered the other is corrected
    after a window or two.

    ``next_forward`` waits ``probe_every`` windows instead of ``probe_after`` (while nothing rolls back) when
    the planner's cost model (`expect`) predicts its step at least `PREDICTED_SLOWER` times ``backward``'s, or
    ``backward_first`` gives a reason. With every chunk on the SSD it cannot win without rollbacks: both move
    the same bytes, but ``next_forward`` hides them under forward only (F), ``backward`` under backward too
    (B, about 2F); with U the updates' time, its step is about max(F, U) + B against F + max(B, U).

    Wall time, not the compute thread's waits: the schedules differ in work as well as in overlap (a
    speculative update first copies its chunk into the shadow slot; ``benchmarks/update_phases_bench.py``
    measures that share), and only the window's length sees both. Both give bitwise the same weights, so
    measuring either costs no exactness.
    """

    def __init__(self, setting: str, *, can_speculate: bool, history: int = 8, samples: int = 5,
                 probe_after: int = 3, probe_every: int = 64,
                 exact_first: Callable[[], str | None] | None = None,
                 backward_first: Callable[[], str | None] | None = None) -> None:
        self.setting = setting
        self.exact_first = exact_first
        self.backward_first = backward_first
        self.can_speculate = can_speculate
        self.why_not = ONE_SLOT_WHY  # when it cannot
        self.rolled: deque[bool] = deque(maxlen=history)
        self.rollback_s: float | None = None
        self.window_s: dict[str, deque[float]] = {BACKWARD: deque(maxlen=samples), NEXT_FORWARD: deque(maxlen=samples)}
        self.measured = {BACKWARD: 0, NEXT_FORWARD: 0}  # windows measured of each, ever (the probes count them)
        self.probe_after, self.probe_every = probe_after, probe_every
        self.windows = 0  # windows ended since the costs were last forgotten
        self.last_probe = 0  # `windows` when the last measurement of the schedule not in use ended
        self.probing: tuple[str, int] | None = None  # the schedule being measured, and its `measured` count then
        self._last_end: float | None = None  # when the last window ended (perf_counter), and under what
        self._last_schedule: str | None = None
        self.predicted: dict[str, float] = {}  # the cost model's step under each schedule (`expect`)

    def expect(self, predicted: Mapping[str, float]) -> None:
        """The planner's cost model predicts these steps (seconds) under each schedule for the plan in use
        (`Plan.predicted_by_schedule`; empty: no prediction); see the class docstring."""
        self.predicted = {name: float(predicted[name]) for name in (BACKWARD, NEXT_FORWARD) if name in predicted}

    def _ruled_out(self) -> str | None:
        """Why ``next_forward`` is not measured early (see the class docstring), or ``None``."""
        b, n = self.predicted.get(BACKWARD), self.predicted.get(NEXT_FORWARD)
        if b is not None and n is not None and b > 0 and n >= PREDICTED_SLOWER * b:
            why = f"the planner predicts next_forward {n:.3g} s a step against backward's {b:.3g} s ({n / b:.2f}x)"
        else:
            why = self.backward_first() if self.backward_first is not None else None
        return f"{why}: next_forward not measured before window {self.probe_every}" if why else None

    def cost(self, schedule: str) -> float | None:
        """The median wall seconds of a recent window under ``schedule`` (``None``: not measured)."""
        times = self.window_s[schedule]
        return statistics.median(times) if times else None

    def choose(self) -> tuple[str, str]:
        """The next window's schedule and why (for the logs)."""
        if self.setting != "auto":
            return self.setting, "configured"
        if not self.can_speculate:
            return NEXT_FORWARD, self.why_not
        why = self.exact_first() if self.exact_first is not None else None
        if why is not None:
            return NEXT_FORWARD, why
        if self.probing is not None:
            schedule, before = self.probing
            if self.measured[schedule] == before:
                return schedule, f"measuring {schedule}"
            self.probing, self.last_probe = None, self.windows
        rate = sum(self.rolled) / len(self.rolled) if self.rolled else 0.0
        cost_b, cost_n = self.cost(BACKWARD), self.cost(NEXT_FORWARD)
        if cost_n is None:
            if rate > 0.0 and self.rollback_s is not None:
                return self.probe(NEXT_FORWARD, f"rollback rate {rate:.2f} x {self.rollback_s:.3g} s a rollback: "
                                                 "trying next_forward to measure its window")
            ruled_out = self._ruled_out()
            if cost_b is not None and self.windows >= (self.probe_every if ruled_out else self.probe_after):
                return self.probe(NEXT_FORWARD, f"backward measured at {cost_b:.3g} s a window: trying next_forward "
                                                 "to measure its window")
            return BACKWARD, ruled_out or f"no rollback in the last {len(self.rolled)} steps"
        expected = (cost_b or 0.0) + rate * (self.rollback_s or 0.0)
        best = NEXT_FORWARD if cost_n < expected else BACKWARD
        other = BACKWARD if best == NEXT_FORWARD else NEXT_FORWARD
        why = (f"backward expected {expected:.3g} s (window {cost_b or 0.0:.3g} s + rollback rate {rate:.2f} x "
               f"{self.rollback_s or 0.0:.3g} s) vs next_forward {cost_n:.3g} s")
        if self.windows - self.last_probe >= self.probe_every and (other == NEXT_FORWARD or rate == 0.0):
            return self.probe(other, f"{why}; measuring {other} again")
        return best, why

    def probe(self, schedule: str, why: str) -> tuple[str, str]:
        """Measure ``schedule``: `choose` gives it until a window of it is measured (two windows where the one
        before ran the other schedule: the first is a transition), unless ``next_forward`` is all there is.
        Returns ``(schedule, why)``, the choice."""
        self.probing = (schedule, self.measured[schedule])
        return schedule, why

    def end_step(self, schedule: str, *, rolled: bool, rollback_s: float | None) -> None:
        """A window ended under ``schedule`` (at ``step()``'s end): its wall time, a rollback's ``rollback_s``
        taken out, counts towards the schedule's cost if the window before was one of the same schedule (a
        window after a switch pays for the other schedule's leftovers, or leaves its own to the next);
        ``backward`` rolled back, or would have (``rolled``)."""
        now = time.perf_counter()
        if self._last_end is not None and self._last_schedule == schedule:
            self.record_wait(schedule, now - self._last_end - (rollback_s or 0.0))
        self._last_end, self._last_schedule = now, schedule
        self.windows += 1
        self.record(rolled=rolled, rollback_s=rollback_s)

    def forget_costs(self) -> None:
        """What the windows cost changed (the planner moved state, activations or weights): measure anew."""
        for times in self.window_s.values():
            times.clear()
        self.windows = self.last_probe = 0
        self.probing = None
        self._last_end = self._last_schedule = None

    def record(self, *, rolled: bool, rollback_s: float | None = None) -> None:
        """One window's outcome: whether ``backward`` rolled back (or would have), and how long that took."""
        self.rolled.append(rolled)
        if rollback_s is not None:
            self.rollback_s = rollback_s if self.rollback_s is None else (self.rollback_s + rollback_s) / 2

    def amend_last(self, *, rolled: bool) -> None:
        """The last window's `record` learnt late (a step decided on the device, `Unsettled`)."""
        if self.rolled:
            self.rolled[-1] = rolled

    def record_wait(self, schedule: str, seconds: float) -> None:
        """One window of ``schedule`` took ``seconds`` (what `end_step` records; tests give it directly)."""
        self.window_s[schedule].append(seconds)
        self.measured[schedule] += 1

    def state_dict(self) -> dict[str, Any]:
        """What the choice rests on (checkpoints: a resumed run chooses as the uninterrupted one would)."""
        return {"rolled": list(self.rolled), "rollback_s": self.rollback_s,
                "window_s": {k: list(v) for k, v in self.window_s.items()}, "measured": dict(self.measured),
                "windows": self.windows, "last_probe": self.last_probe,
                "probing": list(self.probing) if self.probing else None, "predicted": dict(self.predicted)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rolled.clear()
        self.rolled.extend(bool(r) for r in state.get("rolled", ()))
        self.rollback_s = state.get("rollback_s")
        for schedule, times in state.get("window_s", {}).items():  # an older checkpoint's wait_s is not read
            self.window_s[schedule].clear()
            self.window_s[schedule].extend(times)
        self.measured.update(state.get("measured", {}))
        self.windows, self.last_probe = state.get("windows", 0), state.get("last_probe", 0)
        probing = state.get("probing")
        self.probing = (probing[0], probing[1]) if probing else None
        self.expect(state.get("predicted", {}))


@dataclass
class StepStats:
    """What happened to the optimizer steps so far (one step: one accumulation window)."""

    commits: int = 0  # backward schedule: the speculative update kept as is
    redos: int = 0  # backward schedule, clipping bit: rolled back, every update recomputed with the coefficient
    deferred: int = 0  # next_forward schedule: exact updates run ahead of the next forward (clipped or not)
    skips: int = 0  # a gradient was not finite: step skipped (a rollback under the backward schedule)
    rollbacks: int = 0  # backward schedule: speculative updates discarded (redos + its skips)
    clipped: int = 0  # steps whose gradients clipping scaled down
    schedules: dict = field(default_factory=lambda: {BACKWARD: 0, NEXT_FORWARD: 0})  # steps per schedule
    last_schedule: str = ""  # the schedule of the last step
    last_reason: str = ""  # why the next step uses the schedule it does ("auto")
    history: deque = field(default_factory=lambda: deque(maxlen=256))  # (schedule, outcome) of recent steps
    last_grad_norm: float = float("nan")  # global L2 norm of the last step's gradients (before clipping)

    @property
    def steps(self) -> int:
        """Steps whose update was applied (skipped ones excluded)."""
        return self.commits + self.redos + self.deferred

    @property
    def rollback_rate(self) -> float:
        """Rollbacks per step taken (applied or skipped): the share of steps that paid a second pass."""
        return self.rollbacks / max(1, self.steps + self.skips)

    def record(self, schedule: str, outcome: str) -> None:
        self.schedules[schedule] += 1
        self.last_schedule = schedule
        self.history.append((schedule, outcome))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (checkpoints)."""
        return {**vars(self), "schedules": dict(self.schedules), "history": [list(h) for h in self.history]}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "StepStats":
        """The inverse of `to_dict`; fields a checkpoint of an older version lacks keep their defaults."""
        known = {f.name for f in fields(cls)} - {"history"}
        stats = cls(**{k: v for k, v in values.items() if k in known})
        stats.history.extend(tuple(h) for h in values.get("history", ()))
        return stats

    def load(self, values: dict[str, Any]) -> None:
        """Take the counts of a checkpoint (`from_dict`), in place."""
        loaded = self.from_dict(values)
        for f in fields(self):
            setattr(self, f.name, getattr(loaded, f.name))


class Order:
    """The orders parameters are visited in: the global norm's sum (``clip_grad_norm_``'s: float sums depend
    on order) and the updates' (forward order once the model is known, so the next forward waits least)."""

    def __init__(self, params: list["ParamState"]) -> None:
        self.params = params
        self.norm = list(params)
        self.update = list(params)

    @staticmethod
    def ranked(params: list["ParamState"], order: Iterable[torch.nn.Parameter]) -> list["ParamState"]:
        """``params`` in the order of ``order``; the others after them, in their own order."""
        rank = {p: i for i, p in enumerate(order)}
        return sorted(params, key=lambda ps: (rank.get(ps.param, len(rank)), ps.index))


def _global_norm(norms: list[torch.Tensor]) -> torch.Tensor:
    """The global norm as ``clip_grad_norm_`` computes it from the per-tensor norms (0-d, on one device): their norm,
    where they are."""
    return torch.linalg.vector_norm(torch.stack(norms), 2)


class Unsettled:
    """An exact step decided on the device (`Parts.decide`) whose outcome the host has not read yet.

    Its global norm and clip coefficient are device tensors. Its updates were queued with the fused kernel's
    ``found_inf`` flag, and its step counts advanced on the host as if it applied. `Parts.settle` reads the norm: a
    non-finite one makes the step a skip (the counts go back, the statistics move from ``deferred`` to ``skips``);
    then it runs what `when_settled` was given, with the outcome (``"deferred"`` or ``"skip"``) and whether clipping
    bit. Threads: made by the training thread in ``step()``, which then calls `when_settled`; settled by the thread
    that reads it first, under `Parts`'s lock: the training thread, or autograd's at the next backward's first
    hook, while the training thread waits in that backward (one process: `Parts.decides_on_device`)."""

    def __init__(self, total: torch.Tensor, coef: torch.Tensor | None, stepped: list["ParamState"]) -> None:
        self.total, self.coef, self.stepped = total, coef, stepped
        self.outcome: str | None = None  # once settled
        self.clipped = False
        self.grad_norm = math.nan  # once settled: the global norm, before clipping
        self._then: list[Callable[[str, bool], None]] = []

    def when_settled(self, then: Callable[[str, bool], None]) -> None:
        """Call ``then(outcome, clipped)`` once the outcome is read (now, if it was)."""
        if self.outcome is not None:
            then(self.outcome, self.clipped)
        else:
            self._then.append(then)

    def settled(self, outcome: str, clipped: bool) -> None:
        self.outcome, self.clipped = outcome, clipped
        then, self._then = self._then, []
        for f in then:
            f(outcome, clipped)


@dataclass
class Outcome:
    """How a window ended: ``commit``, ``redo``, ``skip`` or ``deferred``; ``rollback_s``: what undoing took;
    ``unsettled``: a ``deferred`` step decided on the device, which may still turn out a ``skip`` (`Unsettled`)."""

    name: str
    rollback_s: float | None = None
    unsettled: Unsettled | None = None


@dataclass
class Parts:
    """What the schedules work with, built once by `FuyouAdamW` (none of it is ever rebound)."""

    state: "OptimizerState"
    updates: "Updater"
    gradients: "Gradients"
    sharding: Any  # `distributed.Sharding`, or `distributed.Solo` in one process
    window: "Window"
    order: Order
    landing: PendingUpdates
    stats: StepStats
    max_grad_norm: float | None
    # Every parameter's step count, by `ParamState.index` (fp32, as torch keeps one), the one the updates read. The
    # optimizer's ``state[param]["step"]`` is a 0-d view of its element, so that a step's counts advance in one op
    # (`advance`).
    counts: torch.Tensor
    # The step decided on the device whose outcome is unread (`decide`, `settle`): at most one, as `settle` runs
    # before anything reads the counts or the statistics (the next step() or backward, a save or a load, a read of
    # ``FuyouAdamW.stats``). Appended and popped under `_settling` (a backward hook may settle on autograd's thread).
    unsettled: list[Unsettled] = field(default_factory=list)
    _settling: threading.Lock = field(default_factory=threading.Lock)

    def total_norm(self, norms: dict[int, torch.Tensor], counted: list["ParamState"]) -> torch.Tensor | None:
        """The global norm exactly as ``clip_grad_norm_`` computes it (the norm of per-tensor norms, on the host:
        a device-tier gradient's norm is brought there, those of one device in one copy); ``None`` (and the step
        counted as skipped) when it is not finite."""
        total = _global_norm(to_host([norms[ps.index] for ps in counted]))
        self.stats.last_grad_norm = float(total)
        if not math.isfinite(self.stats.last_grad_norm):
            self.stats.skips += 1
            return None
        return total

    def decides_on_device(self, stepped: list["ParamState"]) -> bool:
        """Whether this exact step is decided on the device (`decide`), not on the host (`total_norm`): one
        process, no loss scaling, and every stepped parameter's update a device tier's with the fused kernel on fp32
        moments (`group_job`, `update_job`: the kernel takes the flag) on one device whose work is queued, not done
        (an accelerator's; the late-copy test mode's CPU). Its norm need not reach the host before the updates are
        queued: on an accelerator that read waits for the end of backward, and the device idles while the host then
        queues the updates."""
        if not self.can_decide_on_device(stepped):
            return False
        device = stepped[0].param.device
        for ps in stepped:
            grad = ps.param.grad
            if grad is None or grad.device != device or not read_on_host(grad):
                return False
        return True

    def can_decide_on_device(self, params: list["ParamState"]) -> bool:
        """What `decides_on_device` asks of the parameters before their gradients exist: one process, no loss
        scaling, and each one resident with its state on the device tier, updated by the fused kernel on fp32
        moments."""
        if not params or self.sharding.shards is not None or self.updates.scaler is not None or not self.updates.fused:
            return False
        on_device = self.state.updates_on_device
        return all(ps.grads is None and on_device(ps) and ps.layout.kernel == "torch" and ps.layout.moments == "fp32"
                   for ps in params)

    def decide(self, norms: dict[int, torch.Tensor], counted: list["ParamState"]
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The step's global norm, clip coefficient and ``found_inf`` flag, on the device, read by no one yet.

        As ``clip_grad_norm_`` computes them there: the norm of the per-tensor norms, and its clamped coefficient
        (``None`` without a clip norm), which the updates always apply (1 leaves every gradient's bits as they are,
        as torch's own multiply does). The flag is 1 where the norm is not finite: the fused kernel then leaves
        everything as it was, and `settle` makes the step a skip."""
        total = _global_norm([norms[ps.index] for ps in counted])
        found_inf = torch.isfinite(total).logical_not().to(torch.float32)
        return total, self.clamped_coef(total), found_inf

    def unsettle(self, total: torch.Tensor, coef: torch.Tensor | None, stepped: list["ParamState"]) -> Unsettled:
        """Keep a step decided on the device (`decide`) for `settle`, its updates queued and counts advanced."""
        unsettled = Unsettled(total, coef, stepped)
        with self._settling:
            if self.unsettled:
                raise RuntimeError("Parts.unsettle: the step before was never settled")
            self.unsettled.append(unsettled)
        return unsettled

    def pending(self) -> Unsettled | None:
        """The step decided on the device whose outcome is unread, if there is one; waits for nothing."""
        with self._settling:
            return self.unsettled[-1] if self.unsettled else None

    def settle(self) -> None:
        """Read the outcome of the step decided on the device, if one is unread (`Unsettled`); waits for the device
        to reach its norm, which by the next step() it has long passed."""
        with self._settling:
            if not self.unsettled:
                return
            u = self.unsettled.pop()
            value = u.grad_norm = float(u.total)
            stats = self.stats
            stats.last_grad_norm = value
            if math.isfinite(value):
                outcome, clipped = "deferred", u.coef is not None and bool(u.coef < 1.0)
                stats.clipped += clipped
            else:  # the kernels left the state as it was: so do the counts
                outcome, clipped = "skip", False
                stats.deferred -= 1
                stats.skips += 1
                self.advance(u.stepped, -1.0)
        u.settled(outcome, clipped)

    def clamped_coef(self, total: torch.Tensor) -> torch.Tensor | None:
        """``clip_grad_norm_``'s clamped coefficient of the global norm ``total``, where ``total`` is (``None``
        without a clip norm)."""
        if self.max_grad_norm is None:
            return None
        return torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)

    def clip_coef(self, total: torch.Tensor) -> torch.Tensor | None:
        """`clamped_coef` when it scales the gradients down, else ``None`` (on the host: the test reads it)."""
        coef = self.clamped_coef(total)
        return coef if coef is not None and coef < 1.0 else None

    def advance(self, params: Iterable["ParamState"], by: float = 1.0) -> None:
        """The step counts of ``params`` after their updates were queued (each update read the count it completes),
        each as ``+= by`` adds it (``-1``: a step that turned out skipped), in one op on `counts`: a multi-tensor
        add over one 0-d tensor per parameter costs microseconds each on the CPU."""
        index = [ps.index for ps in params]
        if len(index) == self.counts.numel():
            self.counts.add_(by)  # every parameter (each index once)
        elif index:
            self.counts.index_add_(0, torch.tensor(index), torch.full((len(index),), by))

    def updated(self, norms: Iterable[int]) -> None:
        """The weights with these indices changed: make them every rank's (`Sharding.updated`; in one
        process, land the updates now unless a forward waits for them)."""
        self.sharding.updated([ps for ps in self.order.update if ps.index in norms], gated=self.landing.gated)


class Speculative:
    """The ``backward`` schedule: speculative updates during backward; commit, redo or skip at ``step()``."""

    name = BACKWARD
    speculates = True  # updates run as gradients become final

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        # (parameter, when) of each gradient that became final in this window, in order; appended by the threads
        # that have the gradients (autograd's, DDP's collective thread) under the lock, taken by step() after
        # its drain. `tail` is the last window's: whose state to read ahead in the next.
        self._lock = threading.Lock()
        self._arrivals: list[tuple["ParamState", float]] = []
        self.tail: list["ParamState"] = []

    def on_gradient_final(self, ps: "ParamState", grad: Grad) -> None:
        with self._lock:
            first = not self._arrivals
            self._arrivals.append((ps, time.perf_counter()))
        if first and self.tail:  # the window's last backward has begun: the drive's idle time is from here on
            self.parts.state.read_ahead(self.tail)
        self.parts.updates.speculate(ps, grad)

    def _end_window(self) -> None:
        """Learn the tail from this window's arrivals: the parameters whose gradients became final in the
        last `TAIL_SHARE` of the time from the first to the last, the last one first (whose update is sure
        to wait on the drive once backward is done: a tied embedding's is the last). On the SSD, their state
        is read ahead in the next window while the worker is idle."""
        with self._lock:
            arrivals, self._arrivals = self._arrivals, []
        if len(arrivals) > 1:
            first, last = arrivals[0][1], arrivals[-1][1]
            since = last - TAIL_SHARE * (last - first)
            self.tail = [ps for ps, when in reversed(arrivals) if when >= since]

    def finish(self) -> Outcome | None:
        p = self.parts
        window, sharding = p.window, p.sharding
        for ps in p.gradients.set_by_hand(sharding.owned(p.order.params)):  # no hook fired for them
            p.updates.speculate(ps, p.gradients.at_step(ps))
        p.updates.flush()  # the updates still held for a grouped job
        queued = [ps for ps in p.order.norm if window.queued(ps)]
        norms, late = window.take()
        error = None
        try:
            self._drain_or_undo(queued, late)  # every update ran, every norm is known; shadow writes may still land
        except BaseException as exc:  # noqa: BLE001 - the other ranks must hear of it, not wait (one process: raised)
            error = exc
        self._end_window()
        sharding.agree(error, "the updates of the accumulation window")
        norms = sharding.share_norms(norms, p.order.params)  # every rank: every norm, the same decision everywhere
        if not norms:
            return None
        total = p.total_norm(norms, [ps for ps in p.order.norm if ps.index in norms])
        if total is None:
            start = time.perf_counter()
            self._undo(queued)
            p.stats.rollbacks += 1
            return Outcome("skip", time.perf_counter() - start)
        coef = p.clip_coef(total)
        if coef is not None:
            start = time.perf_counter()
            p.state.rollback()
            p.updates.queue_many(queued, p.gradients.at_step, coef=coef, exact=False)
            self._drain_or_undo(queued)
            self._commit(queued)
            p.updated(norms)
            p.stats.redos += 1
            p.stats.rollbacks += 1
            p.stats.clipped += 1
            return Outcome("redo", time.perf_counter() - start)
        p.stats.commits += 1
        self._commit(queued)
        p.updated(norms)
        return Outcome("commit")

    def discard(self, queued: list["ParamState"]) -> None:
        """``zero_grad`` between backward and ``step()``: the speculative updates are undone."""
        with self._lock:
            self._arrivals.clear()
        self.parts.updates.drop()
        self._undo(queued)

    def _undo(self, queued: list["ParamState"]) -> None:
        """Discard the shadow writes and put the committed weights back into the parameters."""
        p = self.parts
        p.state.rollback()
        p.window.partial.clear()
        p.state.restore_weights(queued, p.updates.publisher())

    def _drain_or_undo(self, queued: list["ParamState"], error: BaseException | None = None) -> None:
        """Wait for every queued update to run, but not for its write to the shadow slot (`_commit` lets those
        land behind it); on any failure (or ``error``), undo them and raise."""
        try:
            self.parts.state.drain(writes=False)
            if error is not None:
                raise error
        except BaseException:
            self._undo(queued)
            raise

    def _commit(self, queued: list["ParamState"]) -> None:
        """Commit the updates with their shadow writes possibly still landing: the next reads of those chunks
        wait for them (`TensorStore.commit`), so the last updates' writes overlap the next forward. A write that
        fails once the drain returned leaves the active slot failed: the next read of it (the next step's
        update, a checkpoint) raises its error, on every rank alike through the next window's agreement."""
        self.parts.state.commit(queued, writes_behind=True)
        self.parts.advance(queued)


class Exact:
    """The ``next_forward`` schedule: at ``step()`` the window's gradients are all known; every update is
    queued exact, in forward order, to land ahead of the next forward (or now, if nothing gates it)."""

    name = NEXT_FORWARD
    speculates = False  # backward only moves the gradients out of the way

    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    def on_gradient_final(self, ps: "ParamState", grad: Grad) -> None:
        raise AssertionError("the next_forward schedule queues no update during backward")

    def finish(self) -> Outcome | None:
        p = self.parts
        window, sharding = p.window, p.sharding
        try:
            p.state.drain()  # streamed gradients written, their norms known
            if window.late is not None:
                raise window.late
            sharding.agree(None, "the end of the accumulation window")  # a rank that cannot step stops the others
        except BaseException as exc:
            window.forget()
            p.gradients.drop_staged()  # the copies backward's hook started
            sharding.agree_on_failure(exc, "the end of the accumulation window")
            raise
        norms, _late = window.take()
        window.partial.clear()
        sharding.sum_at_step(p.order.params, norms, p.updates.inv_scale())  # each gradient, averaged, onto its owner
        try:  # the gradients copied to the host for their norms are kept for their updates until queue_many
            norms.update(p.gradients.resident_norms(p.order.params, p.updates.inv_scale()))
            norms = sharding.share_norms(norms, p.order.params)
            counted = [ps for ps in p.order.norm if ps.index in norms]
            if not counted:
                return None
            stepped = [ps for ps in p.order.update if ps.index in norms]
            found_inf = None  # the device's flag, where the step is decided there
            if p.decides_on_device(stepped):
                total, coef, found_inf = p.decide(norms, counted)
            else:
                total = p.total_norm(norms, counted)
                if total is None:
                    return Outcome("skip")  # nothing was written: state and weights are as they were
                coef = p.clip_coef(total)

            def queued(members: list["ParamState"], job: ChunkJob) -> None:
                p.landing.add_many(members, job)
                p.gradients.handed_over(members)

            try:
                owned = [ps for ps in stepped if sharding.owns(ps)]  # the others' owners update them
                p.updates.queue_many(owned, p.gradients.at_step, coef=coef, exact=True, queued=queued,
                                     found_inf=found_inf)
                p.advance(stepped)  # after queueing: each update read the step it completes
            except Exception as exc:  # (a dead worker): the step is half queued, so what it queued must not land
                p.landing.failed = exc
                raise
        finally:
            p.gradients.drop_staged()  # the copies no update took
        p.stats.deferred += 1
        unsettled = None
        if found_inf is not None:
            unsettled = p.unsettle(total, coef, stepped)  # clipped, or a skip: known once settled
        else:
            p.stats.clipped += coef is not None
        p.updated(norms)
        return Outcome("deferred", unsettled=unsettled)

    def discard(self, queued: list["ParamState"]) -> None:
        """``zero_grad`` between backward and ``step()``: nothing was written yet."""
