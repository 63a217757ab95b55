"""`Window`: the bookkeeping of one accumulation window (the micro-batches of one optimizer step).

Which updates were queued during backward, with the norms of their gradients; which streamed
gradients hold a partial sum; whether the window's backwards update at all (``no_update``), ran scaled
(fp16), or accumulated a gradient again after its update was queued (an error ``step()`` raises); and
the schedule the window runs under.

Threads, and the rule that makes them safe (CPython's dict and set operations are atomic; no lock is
needed because no two of these touch the same key at the same time):

- a key of ``norms`` is added by the thread that queues the update or keeps the gradient (autograd's
  during backward, or DDP's collective thread for a bucket) *before* the job is submitted; the worker
  then sets its value, once;
- ``partial`` is changed by autograd's thread during backward only;
- the training thread reads and clears ``norms``, ``partial`` and ``late`` only between backwards and
  after draining the worker (`take`, `forget`): no job and no hook runs then;
- ``unmeasured`` (`gradients.PendingNorms`) has a lock of its own; the training thread replaces it in `take` and
  `forget`, and the jobs queued before keep the one they were given;
- ``updates``, ``scaled`` and ``schedule`` are the training thread's.

The optimizer never rebinds its `Window`: a wrapper that borrows the optimizer's methods with a
``__dict__`` of its own (Fabric's ``_FabricOptimizer``) changes this same object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .gradients import PendingNorms

if TYPE_CHECKING:
    from .state import ParamState

__all__ = ["Window"]


class Window:
    """See the module docstring. ``schedule``: the schedule object of the window being accumulated."""

    def __init__(self) -> None:
        self.updates = True  # whether this micro-batch's backward ends the window (`no_update` clears it)
        self.scaled = False  # the window's backward ran scaled (fp16 loss scaling)
        self.late: BaseException | None = None  # a gradient accumulated again after its update was queued
        self.norms: dict[int, torch.Tensor | None] = {}  # index -> gradient norm, of each queued update
        self.unmeasured = PendingNorms()  # the gradients whose norms the worker has still to take for ``norms``
        self.partial: set[int] = set()  # streamed gradients whose entry holds this window's sum so far
        self.schedule: Any = None
        self.reason = ""  # why the schedule was chosen

    def queued(self, ps: "ParamState") -> bool:
        return ps.index in self.norms

    def mark_late(self, ps: "ParamState") -> None:
        """A second accumulation after the update was queued: that update used a partial gradient. Never
        silently wrong: ``step()`` rolls back and raises."""
        self.late = self.late or RuntimeError(
            f"the gradient of {ps.describe()} was accumulated again after its update was queued; wrap every "
            "micro-batch but the last in `with optimizer.no_update():`")

    def pending(self) -> bool:
        """Whether anything of this window is queued, kept or wrong (`zero_grad` must discard it)."""
        return bool(self.norms or self.partial or self.late is not None)

    def take(self) -> tuple[dict[int, torch.Tensor | None], BaseException | None]:
        """The queued norms and the late error, cleared (the training thread, after a drain)."""
        norms, late = self.norms, self.late
        self.norms, self.late, self.unmeasured = {}, None, PendingNorms()  # the jobs queued so far keep the old ones
        return norms, late

    def forget(self) -> None:
        """Drop this window's queued norms, partial sums and late error."""
        self.norms.clear()
        self.unmeasured = PendingNorms()
        self.partial.clear()
        self.late = None
