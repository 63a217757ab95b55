"""Where a parameter's gradient is when its update runs, behind one shape (`Grad`).

Three kinds of gradient feed the updates, and the schedules never ask which one they have:

- **resident**: the parameter's own ``.grad`` (a one-process model, or a DistributedDataParallel one whose
  bucket averaged it in place);
- **a DDP bucket's average**, as the comm hook hands it over (a view of the bucket: DDP leaves it alone
  until the next window's backward, and every update has drained by then);
- **streamed** (`StreamedGradients`): a streamed weight's gradient leaves the device as soon as it is
  final, into a host pool buffer, and either feeds the update at once or waits in a store entry of its
  dtype — the window's partial sum, a gradient that a clipping redo or the ``next_forward`` schedule
  reads at ``step()``.

`Grad` gives an update job each chunk (`Grad.chunk`) and the gradient's norm (`Grad.norm`), and releases
what it holds when the job is done (`Grad.release`).

A resident or bucket gradient whose update runs on the device (its state on the device tier,
`OptimizerState.updates_on_device`) is read where it is, its norm taken there. Any other one on an
accelerator is read by the host's update, so it is first copied whole
into a host pool buffer (`Gradients.staged`): the copy starts where the gradient is handed over (autograd's
thread, DDP's hook, or ``step()``), ordered after the kernels that computed it, and the job waits for it
before its first read. The norm is then taken on the host, as ``clip_grad_norm_`` takes it of host
gradients (at ``step()`` of the ``next_forward`` schedule from the same copy, made once for both:
`Gradients.resident_norms`), and the chunks are slices of the host copy (slicing the device tensor and multiplying it by the
host's clip coefficient fails on the first clipped step).

Threads: `StreamedGradients.take` runs on the autograd thread, during backward; the jobs it queues run on
the state's worker. What it records for the window (``Window.partial``, ``Window.norms``) follows the
`Window`'s rules.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable

import torch

from ..device import Copy, read_on_host, start_copy
from ..storage import HostBuffer
from .formats import scratch
from .pipeline import ChunkJob

if TYPE_CHECKING:
    from .onepass import OnePass
    from .state import OptimizerState, ParamState
    from .weights import StreamedWeights
    from .window import Window

__all__ = ["Beside", "Grad", "Gradients", "NormClaim", "NormTake", "PendingNorms", "StreamedGradients",
           "grad_norm", "unscaled"]


def unscaled(grad: torch.Tensor, inv_scale: torch.Tensor | None) -> torch.Tensor:
    """A gradient as the update and the norm see it: in fp32 times ``1/scale`` under loss scaling
    (``GradScaler.unscale_``'s in-place multiply, which is exact: the scale is a power of two)."""
    return grad if inv_scale is None else grad.to(torch.float32) * inv_scale


def version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: autograd's, bumped by every in-place change of its elements (torch has no
    public name for it; autograd reads it to refuse a saved tensor changed since)."""
    return tensor._version


NORM_UPCAST_MAX = 64 * 2**20  # bytes of fp32: a bf16/fp16 gradient up to this size is upcast for its norm


def grad_norm(grad: torch.Tensor, inv_scale: torch.Tensor | None, kernel: "OnePass | None" = None) -> torch.Tensor:
    """The per-tensor norm ``clip_grad_norm_`` computes on the CPU (of the unscaled gradient), in fp32.

    With ``kernel`` (the one pass's build, `onepass.OnePass.norms`) and a gradient it `reads`, the same bits from
    one read of the gradient in its own dtype.

    A bf16 or fp16 gradient of up to `NORM_UPCAST_MAX` bytes in fp32 is upcast first, into the thread's scratch
    (`formats.scratch`: kept, so no page faults): torch's fp32 norm then takes its vectorised path, faster than
    ``vector_norm(..., dtype=float32)`` on the half-width tensor, with the same bits (``tests/test_onepass.py``
    checks it over sizes, shapes and dtypes). Larger ones are not, so that the scratch stays bounded; nor is
    one on an accelerator (the scratch is host memory)."""
    if kernel is not None and kernel.reads(grad):
        return kernel.norms([grad], inv_scale)[0]
    if grad.dtype == torch.float32 or grad.numel() * 4 > NORM_UPCAST_MAX or not grad.is_cpu:
        return torch.linalg.vector_norm(unscaled(grad, inv_scale), 2, dtype=torch.float32)
    g = scratch(grad.numel(), torch.float32)[0].view(grad.shape)
    g.copy_(grad)
    if inv_scale is not None:
        g.mul_(inv_scale)  # as `unscaled`'s multiply, in fp32
    return torch.linalg.vector_norm(g, 2, dtype=torch.float32)


def device_norms(params: list["ParamState"], inv_scale: torch.Tensor | None) -> dict[int, torch.Tensor]:
    """The norms of these resident gradients where they are (the device tier's), as ``clip_grad_norm_`` takes them
    by default: one ``torch._foreach_norm`` per device and dtype (on an accelerator one kernel for the list, where a
    norm per tensor is a launch each; on the CPU each tensor's ``vector_norm``, the same bits). In fp32: an fp32
    gradient's as torch's call takes it, a bf16 or fp16 one's widened (``dtype=float32``, `grad_norm`'s), an unscaled
    one's of its fp32 product (`unscaled`). Keyed by `ParamState.index`."""
    groups: dict[tuple, list["ParamState"]] = {}
    for ps in params:
        grad = ps.param.grad
        groups.setdefault((grad.device, grad.dtype), []).append(ps)
    norms = {}
    for (_device, dtype), members in groups.items():
        grads = [unscaled(ps.param.grad, inv_scale) for ps in members]
        values = (torch._foreach_norm(grads, 2) if inv_scale is not None or dtype == torch.float32
                  else torch._foreach_norm(grads, 2, dtype=torch.float32))
        norms.update(zip((ps.index for ps in members), values))
    return norms


class Grad:
    """One gradient an update reads, chunk by chunk.

    ``tensor``: a gradient in memory (``.grad``, a DDP bucket's view, a host buffer's view), shaped like
    the parameter or flat; ``host``: the pool buffer ``tensor`` lives in, given back by `release`;
    ``entry``: the store entry holding it instead (read alongside the state chunks, `extra`).
    ``kind`` names where it came from (for tests and traces).
    """

    # One is made per parameter per step: slots make it smaller and quicker to make than a dict-backed object.
    __slots__ = ("param", "kind", "flat", "host", "entry", "staging", "landing", "final")

    def __init__(self, ps: "ParamState", tensor: torch.Tensor | None = None, *, host: HostBuffer | None = None,
                 entry: str | None = None, kind: str = "resident", staging: HostBuffer | None = None,
                 landing: Copy | None = None, final: bool = True) -> None:
        self.param, self.kind = ps.param, kind  # its shape and dtype are the gradient's, asked only where needed
        self.flat = tensor if tensor is None or tensor.dim() == 1 else tensor.reshape(-1)
        self.host, self.entry = host, entry
        # ``staging``: the host copy of a device gradient (``tensor`` is a view of it), released with the
        # Grad; ``landing``: its copy, waited for before the first read. Set before the Grad is handed to
        # the worker, then read and cleared by the worker alone (the job queue orders the two threads), or
        # by the thread that made it before it hands it over (`Gradients.resident_norms`).
        self.staging, self.landing = staging, landing
        # False: a job queued on the worker before the update still adds to the bytes (a streamed gradient's
        # partial sum), so that only the update's own job may read them (`ready`).
        self.final = final

    @property
    def shape(self) -> torch.Size:
        return self.param.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype

    @classmethod
    def stored(cls, ps: "ParamState") -> "Grad":
        """A streamed parameter's gradient, kept in its store entry for ``step()``."""
        return cls(ps, entry=ps.grads, kind="stored")

    @property
    def extra(self) -> tuple[str, ...]:
        """The store entries an update job reads alongside the state (`ChunkJob.extra`)."""
        return (self.entry,) if self.entry is not None else ()

    def chunk(self, start: int, n: int, stored: HostBuffer | None) -> torch.Tensor:
        """Elements ``[start, start + n)``: from memory, or from ``stored`` (the entry's chunk just read)."""
        if stored is not None:
            return stored.view(self.dtype)[:n]
        self._landed()
        flat = self.flat
        return flat if start == 0 and n == flat.numel() else flat[start : start + n]  # the whole one: no view to make

    def norm(self, inv_scale: torch.Tensor | None, kernel: "OnePass | None" = None) -> torch.Tensor:
        """The gradient's norm (`grad_norm`, with ``kernel``), taken where the gradient is: a device tier's stays on
        the device (the worker does not wait for it; at ``step()`` `Parts.total_norm` brings the norms to the host, or
        `Parts.decide` keeps them there)."""
        self._landed()
        return grad_norm(self.flat.view(self.shape), inv_scale, kernel)

    def _landed(self) -> None:
        """Wait until the gradient's bytes are in place (a staged copy landed); the worker's."""
        if self.landing is not None:
            self.landing.wait()  # raises the copy's error, or TimeoutError if the device is stuck
            self.landing = None

    def ready(self) -> bool:
        """Whether the gradient's bytes are all in place now, without waiting: it is ``final`` and its copy
        landed; a copy that failed is not (the update that reads it raises its error). The worker's."""
        if not self.final or self.landing is not None and not self.landing.landed():
            return False
        try:
            self._landed()
        except BaseException:  # noqa: BLE001 - left for the update that reads this gradient to raise
            return False
        return True

    def release(self) -> None:
        if self.host is not None:
            self.host.release()
        if self.staging is not None:
            # A buffer goes back to the pool only once no copy can still write into it: an update that
            # never ran (undone, discarded) waits for its gradient's copy here. A copy that failed is over;
            # one that timed out may still land, so its buffer is kept out of the pool (and the error raised).
            try:
                self._landed()
            except TimeoutError:
                self.staging = None
                raise
            except BaseException:  # noqa: BLE001 - the copy is over: its error was the update's to report
                pass
            self.staging.release()
            self.staging = None


class PendingNorms:
    """The gradients of one window's queued speculative updates whose norms are still to be taken, for the worker
    to take several at once (`take`), or beside an update's pass (`claim`, `Beside`). torch's norm of one gradient
    is one thread's, so one taken per update ran on one of the worker's threads while its others waited; the norm
    kernel shares several gradients out among them, one thread each, and the pass takes them in its own parallel
    region, its other threads updating meanwhile, with the same bits.

    Threads: `keep` runs on the thread that queues the update, before the job is submitted; `take` on the worker.
    ``_lock`` guards ``_kept`` (index -> gradient, unscale factor, that factor as a float, and where its norm
    goes): each gradient is taken out of it once, by whichever `take` finds it first, and its norm recorded once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[int, tuple[Grad, torch.Tensor | None, float | None, Callable[[torch.Tensor], None]]] = {}

    def keep(self, index: int, grad: Grad, inv_scale: torch.Tensor | None,
             record: Callable[[torch.Tensor], None]) -> None:
        """Gradient ``index``'s norm is to be taken before its update, unscaled by ``inv_scale``, and handed to
        ``record``. The updater keeps only gradients the kernel reads: every `take` scans what is kept."""
        scale = None if inv_scale is None else float(inv_scale)
        with self._lock:
            self._kept[index] = (grad, inv_scale, scale, record)

    def take(self, index: int, kernel: "OnePass | None") -> None:
        """Record the norm of gradient ``index`` (`Grad.norm`) unless an earlier `take` did. With ``kernel`` and a
        gradient it reads, every other kept one it reads under the same unscale factor whose bytes are in place
        (`Grad.ready`) is taken in the same call of the kernel."""
        claim = self.claim(index, kernel)
        if claim is not None:
            claim.take(kernel)

    def claim(self, index: int, kernel: "OnePass | None") -> "NormClaim | None":
        """Take gradient ``index`` out of what is kept, with the others `take` would take beside it; ``None`` if an
        earlier claim took it. The caller takes their norms (`NormClaim.landed`, then `NormClaim.record`), or
        gives the others back (`NormClaim.give_back`)."""
        with self._lock:
            mine = self._kept.pop(index, None)
            if mine is None:
                return None  # taken with an earlier update's
            grad, _inv_scale, scale, _record = mine
            batch = {index: mine}
            if kernel is not None and kernel.reads(grad.flat):
                for i, (g, _t, s, _r) in list(self._kept.items()):
                    if s == scale and kernel.reads(g.flat) and g.ready():
                        batch[i] = self._kept.pop(i)
        return NormClaim(self, index, batch)

    def _restore(self, batch: dict) -> None:
        """Keep these again (`NormClaim.give_back`)."""
        with self._lock:
            self._kept.update(batch)


class NormClaim:
    """Gradients `PendingNorms.claim` took out for one update's worker to take the norms of, its own first. The
    worker's alone, from the claim to `record` or `give_back`."""

    __slots__ = ("pending", "index", "batch", "settled")

    def __init__(self, pending: PendingNorms, index: int, batch: dict) -> None:
        self.pending, self.index, self.batch = pending, index, batch
        self.settled = False  # recorded or given back: a claim does either once

    @property
    def mine(self) -> Grad:
        """The claiming update's own gradient."""
        return self.batch[self.index][0]

    @property
    def inv_scale(self) -> torch.Tensor | None:
        """The unscale factor every gradient of the claim shares."""
        return self.batch[self.index][1]

    @property
    def scale(self) -> float | None:
        """`inv_scale` as a float (what `PendingNorms.claim` compares)."""
        return self.batch[self.index][2]

    def take(self, kernel: "OnePass | None") -> None:
        """Take the norms now, on this thread (the kernel's threads for several), and `record` them; on an error
        `give_back` the others."""
        if len(self.batch) == 1:
            self.record([self.mine.norm(self.inv_scale, kernel)])
            return
        try:
            norms = kernel.norms(self.landed(), self.inv_scale)
        except BaseException:
            self.give_back()
            raise
        self.record(norms)

    def landed(self) -> list[torch.Tensor]:
        """The gradients (flat), in the claim's order, once the claiming update's own is in place (the others were
        when claimed)."""
        self.mine._landed()
        return [kept[0].flat for kept in self.batch.values()]

    def record(self, norms: list[torch.Tensor]) -> None:
        """Hand each gradient's norm, in the claim's order, to where it goes."""
        self.settled = True
        for kept, value in zip(self.batch.values(), norms):
            kept[3](value)

    def give_back(self) -> None:
        """The others' norms were not taken (the claiming update failed): keep them again, for their own updates
        to take (and raise their own errors). Nothing once recorded or given back."""
        if not self.settled:
            self.settled = True
            self.pending._restore({i: kept for i, kept in self.batch.items() if i != self.index})


class Beside:
    """The norms a pass takes beside its updates (`onepass.OnePass.update_chunks`): the gradients claimed for one
    job's updates (`claim`), all under one unscale factor. The job's worker's alone."""

    __slots__ = ("claims", "_grads", "progress")

    def __init__(self, claims: list[NormClaim]) -> None:
        self.claims = claims
        self._grads: list[torch.Tensor] | None = None
        # How far each norm got (the compiled pass's ``NormProgress``, one per gradient in `grads`' order), made by
        # the first pass that takes them, carried on by each later one until the last finishes them
        # (`onepass.OnePass.update_chunks`' ``last``).
        self.progress: list | None = None

    @classmethod
    def claim(cls, takes: "list[Callable[[], None] | None]", kernel: "OnePass | None") -> "Beside | None":
        """The norms of these speculative updates' gradients (each one's ``norm``: a `NormTake`, or what takes it
        alone) that ``kernel``'s pass can take beside the job's updates: the kept gradients it reads, under one
        unscale factor; ``None`` if none. The rest are taken now. On an error, the claims made so far are given
        back."""
        claims: list[NormClaim] = []
        try:
            for take in takes:
                if take is None:
                    continue
                if kernel is None or not isinstance(take, NormTake):
                    take()
                    continue
                claim = take.claim()
                if claim is None:
                    continue  # taken with an earlier update's
                if claims and claim.scale != claims[0].scale:
                    claim.take(kernel)
                    continue
                claims.append(claim)
        except BaseException:
            for claim in claims:
                claim.give_back()
            raise
        return cls(claims) if claims else None

    @property
    def inv_scale(self) -> torch.Tensor | None:
        """The unscale factor of every gradient."""
        return self.claims[0].inv_scale

    def grads(self) -> list[torch.Tensor]:
        """Every claimed gradient (flat), in order, once in place (`NormClaim.landed`; asked once)."""
        if self._grads is None:
            self._grads = [g for claim in self.claims for g in claim.landed()]
        return self._grads

    def record(self, norms: list[torch.Tensor]) -> None:
        """Hand each norm (in `grads`' order) to where it goes."""
        at = 0
        for claim in self.claims:
            claim.record(norms[at : at + len(claim.batch)])
            at += len(claim.batch)

    @property
    def settled(self) -> bool:
        """Whether the norms were recorded (or given back)."""
        return all(claim.settled for claim in self.claims)

    def give_back(self) -> None:
        """Give back every claim not recorded (`NormClaim.give_back`)."""
        for claim in self.claims:
            claim.give_back()


class NormTake:
    """What takes a queued speculative update's gradient norm on the worker, beside other kept ones
    (`PendingNorms`): called, it takes them now; `claim`, for the update's pass to take them beside it
    (`onepass.OnePass.update_chunks`'s ``beside``)."""

    __slots__ = ("pending", "index", "kernel")

    def __init__(self, pending: PendingNorms, index: int, kernel: "OnePass") -> None:
        self.pending, self.index, self.kernel = pending, index, kernel

    def __call__(self) -> None:
        self.pending.take(self.index, self.kernel)

    def claim(self) -> NormClaim | None:
        """`PendingNorms.claim` of this update's gradient."""
        return self.pending.claim(self.index, self.kernel)


class StreamedGradients:
    """The gradients of streamed parameters (`WeightStreamer`): off the device as soon as they are final.

    ``take`` moves one off the device into a host pool buffer (counted in the streamer's device meter
    until then), adds the window's partial sum kept so far (bitwise autograd's accumulation), and then
    either hands it on for an update now (a `Grad` holding the buffer) or keeps it in the parameter's
    gradient entry for ``step()``.
    """

    def __init__(self, state: "OptimizerState", window: "Window", *, keep_free: int, timeout: float,
                 norm_kernel: "OnePass | None" = None) -> None:
        self.state, self.window = state, window
        self.norm_kernel = norm_kernel  # takes the norms where it reads the gradient (`grad_norm`)
        self.keep_free = keep_free  # a gradient's host copy leaves the worker room to read ahead
        self.timeout = timeout
        self.streamer: StreamedWeights | None = None  # the WeightStreamer whose meter counts the device bytes (`attach`)

    def attach(self, streamer: StreamedWeights, params: list["ParamState"]) -> None:
        """Make a gradient entry (its dtype, chunked like the state) for each parameter ``streamer`` streams."""
        self.streamer = streamer
        for ps in params:
            if streamer.streams(ps.param) and ps.grads is None:
                ps.grads = f"grads.{ps.index}"
                self.state.store.create(ps.grads, (ps.numel,), ps.param.dtype, slots=1,
                                        chunk_bytes=ps.elems_per_chunk * ps.param.element_size())

    def take(self, ps: "ParamState", *, now: bool, norm: bool, inv_scale: torch.Tensor | None) -> Grad | None:
        """``ps``'s gradient of this backward, off the device. ``now``: it is final for this window and its
        update runs now: returned as a `Grad` (released by the update). Else it is kept in the gradient
        entry as the window's sum so far (``norm``: its norm recorded for ``step()``) and ``None`` returned."""
        param, window = ps.param, self.window
        grad, param.grad = param.grad, None
        meter = self.streamer.meter
        nbytes = grad.numel() * grad.element_size()
        meter.add(nbytes)  # on the device from its accumulation until this copy
        try:
            host, copy = self.copy_out(grad)
            copy.wait()
        finally:
            del grad
            meter.sub(nbytes)
        flat = host.view(param.dtype)[: ps.numel]
        if ps.index in window.partial:

            def add(k: int, buf: HostBuffer) -> None:  # grad += partial: bitwise autograd's accumulation
                start, n = ps.span(k)
                with buf:
                    flat[start : start + n].add_(buf.view(param.dtype)[:n])

            self.state.run(ChunkJob(ps.grads, ps.nchunks, add, fence=True))  # after the last write of it
        if now:
            final = ps.index not in window.partial  # else the job above adds the partial sum first
            window.partial.discard(ps.index)
            return Grad(ps, flat, host=host, kind="streamed", final=final)
        window.partial.add(ps.index)
        if norm:  # next_forward: step() needs the window's norm (the last micro-batch's sum: a later one overwrites it)
            window.norms[ps.index] = None
        last, norms = ps.nchunks - 1, window.norms

        def keep(k: int) -> Future:
            if k == 0 and norm:
                norms[ps.index] = grad_norm(flat.view(param.shape), inv_scale, self.norm_kernel)
            start, n = ps.span(k)
            fut = self.write(ps, k, flat[start : start + n])
            if k == last:
                host.release()
            return fut

        self.state.run(ChunkJob(None, ps.nchunks, keep))
        return None

    def copy_out(self, tensor: torch.Tensor, *, wait: bool = True,
                 keep_free: int | None = None) -> tuple[HostBuffer, Copy] | None:
        """Start copying ``tensor`` (a gradient, on any device) into a host pool buffer lent for it, leaving the
        worker room to read ahead (``self.keep_free``, or ``keep_free`` when given); the buffer (``tensor``'s bytes
        at its head once the copy landed) and the copy. ``wait=False``: ``None`` if the pool has no room for it
        now. A copy that cannot start gives the buffer back."""
        nbytes = tensor.numel() * tensor.element_size()
        keep_free = self.keep_free if keep_free is None else keep_free
        if wait:
            host = self.state.pool.acquire(nbytes, timeout=self.timeout, keep_free=keep_free)
        elif (host := self.state.pool.try_acquire(nbytes, keep_free=keep_free)) is None:
            return None
        try:
            return host, start_copy(host.view(tensor.dtype)[: tensor.numel()], tensor.detach().reshape(-1))
        except BaseException:
            host.release()
            raise

    def write(self, ps: "ParamState", k: int, grad: torch.Tensor) -> Future:
        """Chunk ``k`` of ``ps``'s gradient (its dtype) into its entry (a redo reads it from there)."""
        store = self.state.store
        buf = store.pool.acquire(grad.numel() * grad.element_size(), timeout=self.timeout)
        buf.view(grad.dtype)[: grad.numel()].copy_(grad)
        return store.write_chunk(ps.grads, k, buf)


class Gradients:
    """Every parameter's gradient, by kind: resident ones are their ``.grad``, streamed ones pass through
    `StreamedGradients`. With several ranks (``sharded``) a rank's own resident gradient is never the one to
    update with: DDP's comm hook hands over the ranks' average as its bucket lands, or ``step()`` sums it."""

    def __init__(self, streamed: StreamedGradients, window: "Window", *, sharded: bool,
                 updates_on_device: Callable[["ParamState"], bool], norm_kernel: "OnePass | None" = None,
                 ahead_keep_free: int = 0) -> None:
        self.streamed, self.window, self.sharded = streamed, window, sharded
        # What a copy made ahead of step() leaves free of the pool: it holds its buffer until step(), so it is
        # admitted, as host-policy activations and the optimizer's read-ahead are, only while the transfers'
        # reserved share stays free (`HostShares.reserved`).
        self.ahead_keep_free = ahead_keep_free
        self.norm_kernel = norm_kernel  # takes the resident gradients' norms it reads (`resident_norms`)
        # Whether a parameter's update runs on its device (`OptimizerState.updates_on_device`): its gradient stays.
        self.updates_on_device = updates_on_device
        # Host copies of accelerator gradients made at step() for their norms and kept for their updates
        # (`resident_norms` fills it, `at_step` takes each, `drop_staged` releases what is left): the training
        # thread's alone, within one step().
        self._staged: dict[int, Grad] = {}
        # Host copies started by backward's hook under the next_forward schedule (`copy_ahead`), for `resident_norms`
        # to take if the gradient is still the one copied: index -> (the parameter, the copy, the ``.grad`` tensor
        # it copied, that tensor's version then). Written by the thread that runs backward's hooks (autograd's),
        # read and emptied by the training thread in `resident_norms` or `drop_staged`: backward returns only once
        # every hook ran, and neither runs during a backward, so one thread at a time.
        self._early: dict[int, tuple["ParamState", Grad, torch.Tensor, int]] = {}

    def on_backward(self, ps: "ParamState", *, speculating: bool,
                    inv_scale: Callable[[], torch.Tensor | None]) -> Grad | None:
        """``ps``'s gradient has accumulated in this backward (autograd's thread): the `Grad` to update with
        now, or ``None`` — the window accumulates on, the schedule updates at ``step()``, or the gradient was
        accumulated again after its update was queued (recorded in the window: ``step()`` raises)."""
        window = self.window
        now = window.updates and speculating
        if ps.grads is not None:  # streamed: off the device now, whatever happens next
            if now and window.queued(ps):
                ps.param.grad = None
                window.mark_late(ps)
                return None
            return self.streamed.take(ps, now=now, norm=not speculating, inv_scale=inv_scale())
        if self.sharded or not now:
            if not self.sharded and not speculating and window.updates:
                self.copy_ahead(ps)
            return None  # the ranks' average comes later; or it waits on the parameter for step()
        if window.queued(ps):
            window.mark_late(ps)
            return None
        return self.staged(ps, ps.param.grad)

    def staged(self, ps: "ParamState", tensor: torch.Tensor, kind: str = "resident", *,
               wait: bool = True, keep_free: int | None = None) -> Grad | None:
        """A `Grad` of ``tensor`` that the host can read: ``tensor`` itself on the CPU; from an accelerator,
        a host pool buffer that a copy started now fills (ordered after the kernels the calling thread's
        stream queued, which computed the gradient), waited for at the update's first read. The buffer
        is lent like a streamed gradient's (leaving the worker room to read ahead) and released with the
        Grad. A gradient whose update runs on its device is never copied. ``wait=False``: ``None`` where the
        pool has no room for the copy now (``keep_free``: what it must leave free, else the worker's read-ahead)."""
        if not self.through_copy(ps, tensor):
            return Grad(ps, tensor, kind=kind)
        copy = self.streamed.copy_out(tensor, wait=wait, keep_free=keep_free)
        if copy is None:
            return None
        host, landing = copy
        return Grad(ps, host.view(tensor.dtype)[: tensor.numel()], kind=kind, staging=host, landing=landing)

    def through_copy(self, ps: "ParamState", tensor: torch.Tensor) -> bool:
        """Whether the host reads ``ps``'s gradient ``tensor`` through a copy (`staged`): it is on an accelerator
        (`device.read_on_host`) and its update runs on the host."""
        return read_on_host(tensor) and not self.updates_on_device(ps)

    def copy_ahead(self, ps: "ParamState") -> None:
        """Under ``next_forward``, in the backward that ends the window: start copying ``ps``'s resident gradient to
        the host now, so that the copy runs beside the rest of backward rather than at ``step()`` (the device idles
        there until the next forward), for `resident_norms` to take. Only a gradient the host updates and can read
        once copied (an accelerator's; `staged`), and only where the pool has room now beyond `ahead_keep_free`
        (the copy holds its buffer until step(): the transfers' reserved share stays theirs, for the activations
        read back in this backward); a model with streamed weights copies none ahead (their gradients take the pool
        during backward). A copy made earlier in this window is released first: the gradient was accumulated again
        since (the window's micro-batches ran without `FuyouAdamW.no_update`)."""
        old = self._early.pop(ps.index, None)
        if old is not None:
            old[1].release()
        grad = ps.param.grad
        if grad is None or self.streamed.streamer is not None or not self.through_copy(ps, grad):
            return
        kept = self.staged(ps, grad, wait=False, keep_free=self.ahead_keep_free)
        if kept is not None:
            self._early[ps.index] = (ps, kept, grad, version(grad))

    def _take_early(self) -> None:
        """Keep each copy `copy_ahead` made whose gradient is still the tensor it copied, unchanged since (its
        version: an in-place change between backward and ``step()``, by the user or another library, bumps it), for
        `resident_norms`; release the others, whose gradients are then copied afresh."""
        early, self._early = self._early, {}
        for ps, kept, tensor, copied in early.values():
            if ps.index not in self._staged and ps.param.grad is tensor and version(tensor) == copied:
                self._staged[ps.index] = kept
            else:
                kept.release()

    def at_step(self, ps: "ParamState") -> Grad:
        """``ps``'s gradient of the whole window, at ``step()`` (an exact update, or a redo): the host copy
        `resident_norms` made of it in this step(), if it made one."""
        if self._staged:
            kept = self._staged.pop(ps.index, None)
            if kept is not None:
                return kept
        return Grad.stored(ps) if ps.grads is not None else self.staged(ps, ps.param.grad)

    def drop_staged(self) -> None:
        """Release the host copies `resident_norms` made that no update took (a skipped step, another rank's
        parameters, a step that failed), at the end of the step() that made them, and those backward's hook
        started that no step() took (`zero_grad` between backward and ``step()``, a step that failed first)."""
        staged = [*self._staged.values(), *(early[1] for early in self._early.values())]
        self._staged, self._early = {}, {}
        error = None
        for grad in staged:
            try:
                grad.release()
            except BaseException as exc:  # noqa: BLE001 - every copy is released; the first error is raised
                error = error or exc
        if error is not None:
            raise error

    def set_by_hand(self, params: list["ParamState"]) -> list["ParamState"]:
        """The resident parameters with a gradient but no update queued: set without backward hooks firing."""
        return [ps for ps in params if ps.grads is None and ps.param.grad is not None and not self.window.queued(ps)]

    def resident_norms(self, params: list["ParamState"], inv_scale: torch.Tensor | None) -> dict[int, torch.Tensor]:
        """The norms of the resident gradients at ``step()`` (a streamed one's was taken as it was kept), on the
        host: those the norm kernel reads all at once, shared out among the calling thread's intra-op threads (torch's
        norm of one tensor is one thread's). A copy backward's hook started (`copy_ahead`) serves where the
        gradient is unchanged since.

        A gradient on an accelerator whose update runs on the host is copied to the host once: every such copy is
        started first, its norm taken from it, and the copy kept for the update (`at_step`; `drop_staged` releases
        the copies no update took). If the pool has no room now for every copy (``keep_free`` left for the
        worker), the copies made go back once their norms are taken, and each of the rest is copied for its norm
        alone, one at a time, and again for its update: a copy kept for a later update could otherwise hold the
        room an earlier update's copy waits for. A device-tier gradient's norm is taken on its device, those of one
        device and dtype in one call (`device_norms`)."""
        self._take_early()
        resident = [ps for ps in params if ps.grads is None and ps.param.grad is not None]
        copied = {ps.index for ps in resident if self.through_copy(ps, ps.param.grad)}
        every = True  # whether every gradient the host updates found room for its copy
        for ps in resident:
            grad = ps.param.grad
            if ps.index in copied and ps.index not in self._staged:
                kept = self.staged(ps, grad, wait=False)
                if kept is None:
                    every = False
                    break
                self._staged[ps.index] = kept
        kernel = self.norm_kernel
        held = {}  # index -> the gradient on the host: its own tensor, or its kept copy once landed
        for ps in resident:
            kept = self._staged.get(ps.index)
            if kept is not None:
                kept._landed()  # not handed to the worker yet: this thread's to wait for
                held[ps.index] = kept.flat
            elif ps.index not in copied:
                held[ps.index] = ps.param.grad
        read = [i for i, g in held.items() if kernel is not None and kernel.reads(g)]
        norms = {}
        if read:
            norms = dict(zip(read, kernel.norms([held[i] for i in read], inv_scale)))
        for i, kept in self._staged.items():
            if i not in norms:
                norms[i] = kept.norm(inv_scale)
        if not every:
            self.drop_staged()
        norms.update(device_norms([ps for ps in resident if ps.index not in norms and self.updates_on_device(ps)],
                                  inv_scale))
        for ps in resident:
            if ps.index in norms:
                continue
            grad = self.staged(ps, ps.param.grad)
            try:
                norms[ps.index] = grad.norm(inv_scale)
            finally:
                grad.release()
        return norms

    def handed_over(self, params: list["ParamState"]) -> None:
        """Exact updates now hold these parameters' gradients: a resident ``.grad`` is dropped, so that the next
        backward accumulates afresh and ``zero_grad`` has nothing to do."""
        for ps in params:
            if ps.grads is None:
                ps.param.grad = None
