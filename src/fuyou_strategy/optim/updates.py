"""`Updater`: queues one parameter's AdamW update on the state's worker — the one place an update is built.

An update is speculative (the ``backward`` schedule, into the shadow slot, recording its gradient's norm
for ``step()``), a redo (with the clip coefficient, after a rollback) or exact (``next_forward``, the
global norm known, into the active slot in place). Its new weight is published into the parameter, or
into a streamed parameter's tier copy (`WeightStreamer.publish`). Whichever `Grad` it reads, the job
gives the gradient's buffer back when it is done.

Threads: `queue` runs on the thread that has the gradient (autograd's, DDP's collective thread, or the
training thread at ``step()``); the job runs on the state's worker. The jobs hold no reference to the
optimizer, so that a forgotten optimizer is collected and its finalizer deletes the swap files.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

import torch

from ..device import read_on_host, transfer
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
        steps: the optimizer's per-parameter state (``steps[param]["step"]``, the count before the update).
        window: where a speculative update records its gradient's norm.
        streamed: the streamed gradients (a redo under clipping keeps a streamed gradient in its entry).
        fused: the kernel (`adamw_kernel`).
        release_grads: drop a resident ``.grad`` as its speculative update is queued (the update holds it).
        clipping: a clip norm is set (a redo may read the gradients again).
        scaler: fp16 loss scaling, or None (the gradient is unscaled in the update).
        one_pass: the one-pass update (`onepass`), used with ``fused`` on fp32 moments; None: torch's kernel.
    """

    def __init__(self, state: OptimizerState, steps: Mapping[torch.nn.Parameter, dict], window: "Window",
                 streamed: "StreamedGradients", *, fused: bool, release_grads: bool, clipping: bool,
                 scaler: "LossScaler | None", one_pass: "OnePass | None" = None) -> None:
        self.state, self.steps, self.window, self.streamed = state, steps, window, streamed
        self.one_pass = one_pass
        self.fused, self.release_grads, self.clipping, self.scaler = fused, release_grads, clipping, scaler
        self.weights: StreamedWeights | None = None  # the WeightStreamer whose tier copies take streamed parameters' weights

    def inv_scale(self) -> torch.Tensor | None:
        """``1 / scale`` of this window under loss scaling (the scale is fixed for a window), else None."""
        return self.scaler.inv_scale() if self.scaler is not None else None

    def queue(self, ps: ParamState, grad: "Grad", *, coef: torch.Tensor | None = None, exact: bool = False) -> ChunkJob:
        """Queue ``ps``'s update with ``grad``; ``coef`` is the clip coefficient of a redo or an exact update.
        Returns the job (an exact one's ``done`` completes once it landed)."""
        speculative = coef is None and not exact
        record = speculative and grad.kind != "stored"  # its norm goes into the window's, for step()
        inv_scale, kernel = self.inv_scale(), self.one_pass
        norm = None  # takes the norm on the worker, before the first chunk
        if record:
            norms = self.window.norms
            norms[ps.index] = None

            def put(value: torch.Tensor) -> None:
                norms[ps.index] = value

            if kernel is not None and kernel.reads(grad.flat):  # with the other queued gradients' (`PendingNorms`)
                unmeasured = self.window.unmeasured
                unmeasured.keep(ps.index, grad, inv_scale, put)

                def norm() -> None:
                    unmeasured.take(ps.index, kernel)
            else:  # one the kernel does not read (a device tier's, taken on the device): alone, never scanned again

                def norm() -> None:
                    put(grad.norm(inv_scale, kernel))

        param = ps.param
        keep = self.streamed.write if grad.host is not None and self.clipping else None
        job = self.state.update_job(ps, grad, step=self.steps[param]["step"].clone(), fused=self.fused, exact=exact,
                                    coef=coef, inv_scale=inv_scale, publish=self.publisher(), keep=keep,
                                    norm=norm, finished=grad.release,
                                    one_pass=self.one_pass)
        if self.release_grads and speculative and ps.grads is None:  # no redo can need it
            # Dropped here, on the thread that has the gradient, never by the worker: ``.grad`` belongs to the
            # training side (a worker's write raced step()'s reads of it and crashed the process). The `Grad`
            # keeps the tensor (or its host copy) alive until the update is done with it.
            param.grad = None
        return self.state.run(job)

    def queue_many(self, params: Iterable[ParamState], grad_of: Callable[[ParamState], "Grad"], *,
                   coef: torch.Tensor | None, exact: bool,
                   queued: Callable[[ParamState, ChunkJob], None] | None = None) -> None:
        """Queue the updates of ``params``, in this order, with the clip coefficient known (``coef``: a redo, or
        ``exact``), each with ``grad_of(ps)`` taken just before it is queued; ``queued(ps, job)`` once its job is.
        Consecutive parameters of one `OptimizerState.group_kind` share a job (`OptimizerState.group_job`) until it
        holds `GROUP_ELEMENTS` elements; the others take a job each (`queue`). The same bits either way."""
        state, publish, one_pass = self.state, self.publisher(), self.one_pass
        run: list[tuple[ParamState, Grad, torch.Tensor]] = []
        kind, elems = None, 0

        def flush() -> None:
            if run:
                members = run[:]  # the job keeps its own list
                run.clear()
                job = state.run(state.group_job(members, exact=exact, coef=coef, inv_scale=self.inv_scale(),
                                                publish=publish, one_pass=one_pass))
                if queued is not None:
                    for ps, _grad, _step in members:
                        queued(ps, job)

        for ps in params:
            grad = grad_of(ps)
            now = state.group_kind(ps, grad, fused=self.fused, publish=publish, one_pass=one_pass)
            if now is None or now != kind or elems >= GROUP_ELEMENTS:
                flush()
                kind, elems = now, 0
            if now is None:
                job = self.queue(ps, grad, coef=coef, exact=exact)
                if queued is not None:
                    queued(ps, job)
                continue
            run.append((ps, grad, self.steps[ps.param]["step"]))  # read when the run's job is built
            elems += ps.numel
        flush()

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
        ps.param.detach().view(-1)[start : start + n].copy_(master)
        return None

    def many(self, chunks: list[tuple[ParamState, int, torch.Tensor]]) -> None:
        """Copy each ``(ps, k, master)``'s new master into its resident parameter's elements: one
        ``torch._foreach_copy_`` (on an accelerator one kernel for the list, on the worker's current stream), each
        element as `__call__`'s ``copy_`` casts it."""
        targets = []
        for ps, k, _master in chunks:
            if ps.grads is not None:
                raise ValueError(f"Publisher.many: {ps.describe()} is streamed; its weights go to its tier copy")
            start, n = ps.span(k)
            targets.append(ps.param.detach().view(-1)[start : start + n])
        torch._foreach_copy_(targets, [master for _ps, _k, master in chunks])

    def into(self, ps: ParamState) -> torch.Tensor | None:
        """A resident parameter's elements (flat) when they are in host memory (a one-pass update writes each
        chunk's in its pass); ``None`` for a streamed one, one on an accelerator, or one whose weights are
        `staged`."""
        p = ps.param
        if ps.grads is not None or p.device.type != "cpu" or not p.is_contiguous() or self.staged(ps):
            return None
        return p.detach().view(-1)

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
    def land(ps: ParamState, k: int, weight: torch.Tensor) -> None:
        """Copy chunk ``k``'s new ``weight`` (a host buffer's, in the parameter's dtype) into the parameter; returns
        once it is there. Ordered after the kernels already queued on the worker's current stream, which may
        still read the old weight, as ``copy_`` on that stream is (`device.transfer`'s ``after_compute``)."""
        start, n = ps.span(k)
        transfer(ps.param.detach().view(-1)[start : start + n], weight, after_compute=True)
