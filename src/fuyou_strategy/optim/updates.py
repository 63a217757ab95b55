"""`Updater`: queues AdamW updates on the state's worker — the one place an update is built.

An update is speculative (the ``backward`` schedule, into the shadow slot, recording its gradient's norm
for ``step()``), a redo (with the clip coefficient, after a rollback) or exact (``next_forward``, the
global norm known, into the active slot in place). Its new weight is published into the parameter, or
into a streamed parameter's tier copy (`WeightStreamer.publish`). Whichever `Grad` it reads, the job
gives the gradient's buffer back when it is done. Consecutive updates of state in host RAM or on the device tier
share one job (`OptimizerState.group_job`, up to `GROUP_ELEMENTS` elements): a transformer's many small parameters
then pay the Python of a job once per run, not once each; any other update is a job of its own.

Threads: `queue` and `speculate` run on the thread that has the gradient (autograd's, DDP's collective thread, or
the training thread at ``step()``), `queue_many`, `flush` and `drop` on the training thread; the jobs run on the
state's worker. The jobs hold no reference to the
optimizer, so that a forgotten optimizer is collected and its finalizer deletes the swap files.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from ..device import Copy, read_on_host, start_copy
from .gradients import NormTake
from .pipeline import ChunkJob
from .state import OptimizerState, ParamState

if TYPE_CHECKING:
    from .gradients import Grad, StreamedGradients
    from .onepass import OnePass
    from .scaler import LossScaler
    from .weights import StreamedWeights
    from .window import Window

__all__ = ["GROUP_ELEMENTS", "Publisher", "Updater"]

# Elements of the updates one grouped job takes (`Updater.queue_many`) before the next job begins: enough that the
# per-job bookkeeping of a transformer's small parameters (norms, biases, most of a layer's matrices) is paid a few
# times per layer, few enough that the next forward's first module waits for little more than its own weights.
GROUP_ELEMENTS = 1 << 22


class Updater:
    """Builds and queues AdamW updates (module docstring).

    Args:
        state: the masters and moments, and the worker.
        counts: every parameter's step count by `ParamState.index` (`schedule.Parts.counts`), the count before the
            update.
        window: where a speculative update records its gradient's norm.
        streamed: the streamed gradients (a redo under clipping keeps a streamed gradient in its entry).
        fused: the kernel (`adamw_kernel`).
        release_grads: drop a resident ``.grad`` as its speculative update is queued (the update holds it).
        clipping: a clip norm is set (a redo may read the gradients again).
        scaler: fp16 loss scaling, or None (the gradient is unscaled in the update).
        one_pass: the one-pass update (`onepass`), used with ``fused`` on fp32 moments; None: torch's kernel.
    """

    def __init__(self, state: OptimizerState, counts: torch.Tensor, window: "Window",
                 streamed: "StreamedGradients", *, fused: bool, release_grads: bool, clipping: bool,
                 scaler: "LossScaler | None", one_pass: "OnePass | None" = None) -> None:
        self.state, self.counts, self.window, self.streamed = state, counts, window, streamed
        self.one_pass = one_pass
        self.fused, self.release_grads, self.clipping, self.scaler = fused, release_grads, clipping, scaler
        self.weights: StreamedWeights | None = None  # the WeightStreamer whose tier copies take streamed parameters' weights
        # The run of updates held for one grouped job (`speculate`, `queue_many`): (param, gradient, what takes its
        # norm or None), their `OptimizerState.group_kind` and elements (each step count is read as the job is built).
        # Under _run_lock.
        self._run_lock = threading.Lock()
        self._run: list[tuple[ParamState, Grad, Callable[[], None] | None]] = []
        self._run_kind: tuple | None = None
        self._run_elems = 0

    def inv_scale(self) -> torch.Tensor | None:
        """``1 / scale`` of this window under loss scaling (the scale is fixed for a window), else None."""
        return self.scaler.inv_scale() if self.scaler is not None else None

    def queue(self, ps: ParamState, grad: "Grad", *, coef: torch.Tensor | None = None, exact: bool = False,
              found_inf: torch.Tensor | None = None) -> ChunkJob:
        """Queue ``ps``'s update with ``grad`` as a job of its own; ``coef`` is the clip coefficient of a redo or an
        exact update, ``found_inf`` the device's flag of an exact one decided there (`queue_many`). Returns the job
        (an exact one's ``done`` completes once it landed)."""
        speculative = coef is None and not exact
        # its norm goes into the window's, for step(): taken on the worker, before the first chunk
        norm = self._recorder(ps, grad) if speculative and grad.kind != "stored" else None
        keep = self.streamed.write if grad.host is not None and self.clipping else None
        job = self.state.update_job(ps, grad, step=self.counts[ps.index].clone(), fused=self.fused,
                                    exact=exact, coef=coef, inv_scale=self.inv_scale(), publish=self.publisher(),
                                    keep=keep, norm=norm, finished=grad.release, one_pass=self.one_pass,
                                    found_inf=found_inf)
        if speculative:
            self._release(ps)
        return self.state.run(job)

    def _recorder(self, ps: ParamState, grad: "Grad") -> Callable[[], None]:
        """Mark ``ps``'s speculative update queued in the window (``window.norms``) and return what takes its
        gradient's norm into it, on the worker: with the other queued gradients' where the norm kernel reads them
        (`PendingNorms`); alone otherwise (a device tier's, taken on the device), never scanned again."""
        norms, inv_scale, kernel = self.window.norms, self.inv_scale(), self.one_pass
        norms[ps.index] = None

        def put(value: torch.Tensor) -> None:
            norms[ps.index] = value

        if kernel is not None and kernel.reads(grad.flat):
            unmeasured = self.window.unmeasured
            unmeasured.keep(ps.index, grad, inv_scale, put)
            return NormTake(unmeasured, ps.index, kernel)  # the update's pass may take it beside (`claim`)
        return lambda: put(grad.norm(inv_scale, kernel))

    def _release(self, ps: ParamState) -> None:
        """Drop ``ps``'s resident ``.grad`` once its speculative update holds it, where no redo can need it."""
        if self.release_grads and ps.grads is None:
            # Dropped here, on the thread that has the gradient, never by the worker: ``.grad`` belongs to the
            # training side (a worker's write raced step()'s reads of it and crashed the process). The `Grad`
            # keeps the tensor (or its host copy) alive until the update is done with it.
            ps.param.grad = None

    def speculate(self, ps: ParamState, grad: "Grad") -> None:
        """``ps``'s speculative update (the ``backward`` schedule) with ``grad``, final now. One of a
        `OptimizerState.group_kind` is held in a run of consecutive ones of that kind, queued as one job
        (`OptimizerState.group_job`) once the run holds `GROUP_ELEMENTS` elements, once one of another kind comes,
        or at `flush` (``step()``, before its drain); any other is queued at once (`queue`). The same bits either
        way; a run's updates start when it is queued (at most `GROUP_ELEMENTS` elements late).
        Threads: the thread that has the gradient (autograd's, DDP's collective thread); the run is under
        ``_run_lock``, which `flush` and `drop` (the training thread) take too."""
        kind = self.state.group_kind(ps, grad, fused=self.fused, publish=self.publisher(), one_pass=self.one_pass)
        with self._run_lock:
            self._join(kind)
            if kind is None:
                self.queue(ps, grad)
                return
            self._run.append((ps, grad, self._recorder(ps, grad)))
            self._run_elems += ps.numel
            self._release(ps)

    def flush(self) -> None:
        """Queue the speculative updates `speculate` holds (the training thread, at ``step()``)."""
        with self._run_lock:
            self._flush_run(None)

    def drop(self) -> None:
        """Forget the speculative updates `speculate` holds, never queued (``zero_grad`` between backward and
        ``step()``: the window's updates are discarded)."""
        with self._run_lock:
            run, self._run, self._run_kind, self._run_elems = self._run, [], None, 0
        for _ps, grad, _norm in run:
            grad.release()

    def _join(self, kind: tuple | None, queued: Callable[[list[ParamState], ChunkJob], None] | None = None, *,
              coef: torch.Tensor | None = None, exact: bool = False, found_inf: torch.Tensor | None = None) -> None:
        """Before an update of `OptimizerState.group_kind` ``kind`` (None: one of a job of its own) joins the held
        run: queue the run first where the update cannot join it (another kind, or the run is full). Under
        ``_run_lock``."""
        if kind is None or kind != self._run_kind or self._run_elems >= GROUP_ELEMENTS:
            self._flush_run(queued, coef=coef, exact=exact, found_inf=found_inf)
            self._run_kind = kind

    def _flush_run(self, queued: Callable[[list[ParamState], ChunkJob], None] | None, *,
                   coef: torch.Tensor | None = None,
                   exact: bool = False, found_inf: torch.Tensor | None = None) -> None:
        """Queue the held run (`speculate`'s, or `queue_many`'s) as one job, and empty it."""
        run, self._run, self._run_elems = self._run, [], 0
        if not run:
            return
        job = self.state.run(self.state.group_job([member[:2] for member in run], self.counts, exact=exact,
                                                  coef=coef, inv_scale=self.inv_scale(), publish=self.publisher(),
                                                  one_pass=self.one_pass, norms=[member[2] for member in run],
                                                  found_inf=found_inf))
        if queued is not None:
            queued([member[0] for member in run], job)

    def queue_many(self, params: Iterable[ParamState], grad_of: Callable[[ParamState], "Grad"], *,
                   coef: torch.Tensor | None, exact: bool,
                   queued: Callable[[list[ParamState], ChunkJob], None] | None = None,
                   found_inf: torch.Tensor | None = None) -> None:
        """Queue the updates of ``params``, in this order, with the clip coefficient known (``coef``: a redo, or
        ``exact``), each with ``grad_of(ps)`` taken just before it is queued; ``queued(members, job)`` once a job is
        queued, with the parameters it updates.
        Consecutive parameters of one `OptimizerState.group_kind` share a job (`OptimizerState.group_job`) until it
        holds `GROUP_ELEMENTS` elements; the others take a job each (`queue`). The same bits either way.
        ``found_inf``: the device's flag of a step decided there (`OptimizerState.group_job`, `update_job`), for
        device-tier updates. The training thread, with no speculative run held (`flush`)."""
        with self._run_lock:
            if self._run:
                raise RuntimeError("Updater.queue_many: speculative updates are still held; flush() them first")
            publish = self.publisher()
            try:
                for ps in params:
                    grad = grad_of(ps)
                    kind = self.state.group_kind(ps, grad, fused=self.fused, publish=publish, one_pass=self.one_pass)
                    self._join(kind, queued, coef=coef, exact=exact, found_inf=found_inf)
                    if kind is None:
                        job = self.queue(ps, grad, coef=coef, exact=exact, found_inf=found_inf)
                        if queued is not None:
                            queued([ps], job)
                        continue
                    self._run.append((ps, grad, None))  # its count is read as its job is built
                    self._run_elems += ps.numel
                self._flush_run(queued, coef=coef, exact=exact, found_inf=found_inf)
            finally:  # a step that failed half-queued (a dead worker) leaves no run for a later step to queue
                self._run, self._run_kind, self._run_elems = [], None, 0

    def publisher(self) -> "Publisher":
        """Where new weights go, held by jobs instead of the updater."""
        return Publisher(self.weights)


class Publisher:
    """Where a chunk's new weight goes (`state.Publish`): a streamed parameter's tier copy
    (`WeightStreamer.publish`), else the parameter's own elements."""

    def __init__(self, weights: "StreamedWeights | None") -> None:
        self.weights = weights

    def __call__(self, ps: ParamState, k: int, master: torch.Tensor) -> Future | None:
        if ps.grads is not None:  # streamed: its tier copy
            return self.weights.publish(ps.param, k, master)
        start, n = ps.span(k)
        # Backward is done with this weight. From a host master to an accelerator a synchronous copy: an
        # asynchronous one (a cast into a pinned buffer, copied on the side stream, landed by a helper thread) is
        # faster alone (benchmarks/update_phases_bench.py --device cuda) but slower in the update pipeline. A
        # device-tier master is on the device already: a copy there, on the update's stream.
        ps.flat_weight()[start : start + n].copy_(master)
        return None

    def many(self, chunks: list[tuple[ParamState, int, torch.Tensor]]) -> None:
        """Copy each ``(ps, k, master)``'s new master into its resident parameter's elements: one
        ``torch._foreach_copy_`` (on an accelerator one kernel for the list, on the worker's current stream), each
        element as `__call__`'s ``copy_`` casts it."""
        targets = []
        for ps, k, _master in chunks:
            if ps.grads is not None:
                raise ValueError(f"Publisher.many: {ps.describe()} is streamed; its weights go to its tier copy")
            targets.append(ps.of_chunk(ps.flat_weight(), k))
        torch._foreach_copy_(targets, [master for _ps, _k, master in chunks])

    def into(self, ps: ParamState) -> torch.Tensor | None:
        """A resident parameter's elements (flat) when they are in host memory (a one-pass update writes each
        chunk's in its pass); ``None`` for a streamed one, one on an accelerator, or one whose weights are
        `staged`."""
        return ps.flat_weight() if self.writes_into(ps) else None

    def writes_into(self, ps: ParamState) -> bool:
        """Whether `into` gives ``ps``'s elements (without making the view)."""
        p = ps.param
        return ps.grads is None and p.is_cpu and p.is_contiguous() and not self.staged(ps)

    @staticmethod
    def staged(ps: ParamState) -> bool:
        """Whether a one-pass update writes this resident parameter's new weights in its compute dtype into a host
        buffer, for `land` to copy in: a bf16 or fp16 parameter on an accelerator (in the late-copy test mode, on
        the CPU too: `device.read_on_host`). The device then takes 2 bytes per parameter from pinned memory,
        where ``copy_`` of the fp32 master first casts it on the host into a fresh pageable tensor. An fp32
        parameter takes the master itself (`__call__`)."""
        p = ps.param
        return ps.grads is None and p.dtype != torch.float32 and p.is_contiguous() and read_on_host(p)

    @staticmethod
    def start_land(ps: ParamState, k: int, weight: torch.Tensor) -> Copy:
        """Start copying chunk ``k``'s new ``weight`` (a host buffer's, in the parameter's dtype) into the parameter;
        `Copy.wait` before the buffer is reused, and before the update counts as done. Ordered after the kernels
        already queued on the worker's current stream, which may still read the old weight, as ``copy_`` on that
        stream is (`device.start_copy`'s ``after_compute``). On an accelerator the copy runs on the side stream while
        the worker's next pass runs on the host."""
        start, n = ps.span(k)
        return start_copy(ps.flat_weight()[start : start + n], weight, after_compute=True)
