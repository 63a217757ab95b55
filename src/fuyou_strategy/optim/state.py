"""`OptimizerState`: every parameter's fp32 master weight and Adam moments, chunk by chunk.

This module is the one owner of the state's storage. Each parameter's state is one tensor-store
entry (on the SSD tier) of chunks; chunk ``k`` covers the parameter's elements
``[k * E, k * E + n)`` as ``[master | exp_avg | exp_avg_sq]`` in the parameter's `formats.Layout`
(``3 n`` fp32 values by default; bf16 or 8-bit moments with ``state_format``), so that one read
fetches all three. Nothing outside this module and `formats` slices a chunk: the layout hands out the
tensors by name, and checkpoints stream its pieces through `export` and `load` without knowing where
they sit.

Everything that touches the state runs as a `ChunkJob` on one worker thread (`pipeline`), reading
ahead: the AdamW update (`update_job`; of a run of parameters in RAM or on the device tier, `group_job`),
restoring weights from the masters, reading a parameter's state back, checkpoints. ``state_slots=2`` gives
every entry a second (*shadow*) slot that speculative updates write into; `commit` flips it in, `rollback`
drops it. ``state_slots="auto"`` starts with two, and `drop_shadows` keeps one from the end of the engine's warm-up
where its plan says so.

Tiers: with ``FuyouConfig.host_state`` the entries of the first parameters that fit live in host RAM
(`TensorStore` ``in_memory`` entries, same chunks, same slots), the rest on the SSD; `hold_in_ram`
moves state in or out between steps (the engine, once the planner says what the host budget leaves). Nothing else
changes: the same jobs read and write the same bytes, so the results are bitwise those of the state
all on the SSD.

The device tier (``FuyouConfig.device_state``, `hold_on_device`): the state of the first parameters that fit,
before the host tier takes any, lives in their device's memory (`TensorStore` device entries, same chunks, same
slots) and their updates run there, with torch's kernel (`kernels.adamw_kernel`) on the device's gradient as it
is (no copy to the host), the new weight copied on the device. The same arithmetic, so on the CPU (where the
device is host RAM) bitwise the host tier's; on an accelerator, torch's fused AdamW on that device, bitwise where
the gradient norms agree (a device-tier gradient's norm is taken on the device: docs/device-state.md).
Streamed parameters (their weights are off the device) and parameters not yet materialised stay off it.

The parameter as the master's source: where a resident fp32 parameter in host RAM holds its committed master
bit for bit (``param_holds``: fp32 compute on the CPU, every update published into it, every rollback restored),
its update leaves the chunk's master bytes unread on the SSD and copies them from the parameter (8 of 12 bytes
per parameter read); the new master is still written, so the active slot stays the whole state. A parameter
written outside the optimizer between steps (a misuse: weights load with the optimizer's state, which restores
them) is then the master its next update starts from, as in torch's AdamW, where the state is on the SSD (and in
host RAM under the one pass, below).

The parameter as the master's only copy: an exact one-pass update of such a parameter whose state is in host RAM
updates the master where the parameter holds it, in place, and leaves the chunk's master as it was
(``masters_behind``): 28 bytes per element, as torch's kernel moves, not 32 (the master written into the chunk and
the parameter). Whatever reads a chunk's master otherwise first writes the parameter's into it (`heal_masters`):
a checkpoint, a read of the state, a restore of the weights, a move to another tier or to streamed weights, and a
window whose updates speculate (their rollback restores from the chunk, and their publish overwrites the
parameter).

Threads: the pipeline's worker runs every job function; the training thread submits jobs, drains,
commits and rolls back — the last two only after a drain, when no job runs.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import torch

from ..config import STATE_BYTES_PER_PARAM, STATE_CHUNK_ELEMENTS, FuyouConfig, format_bytes
from ..device import Copy, current_stream, on_stream, to_device
from ..progress import Progress
from ..storage import ACTIVE, SHADOW, HostBuffer, LentChunk, TensorStore, byte_view, gather
from ..storage.aio import DONE
from ..storage.pool import round_up
from .formats import KINDS, Layout, fp32_values, scratch, tiles, update_compact
from .gradients import Beside
from .kernels import adamw_kernel, fp32_gradient, fp32_gradients, fused_adamw
from .onepass import OnePass, step_count
from .pipeline import ChunkJob, ChunkPipeline, Later

if TYPE_CHECKING:
    from .gradients import Grad

__all__ = ["ELEMENT_BYTES", "balanced_chunk", "ParamState", "OptimizerState", "Publish", "UpdateMeter",
           "adamw_kernel", "apply_update"]

log = logging.getLogger(__name__)

ELEMENT_BYTES = STATE_BYTES_PER_PARAM  # fp32: 4 bytes per kind; the chunk size is set in elements at this rate
FP32 = Layout("fp32")


def balanced_chunk(numel: int, most: int) -> int:
    """Elements per state chunk of a parameter of ``numel`` elements, chunks of at most ``most`` (a multiple
    of `STATE_CHUNK_ELEMENTS`): as many chunks as ``most`` needs, all of one length in whole groups of
    `STATE_CHUNK_ELEMENTS` but the last, which is shorter by less than one group per chunk. Every chunk takes
    a whole stride on the SSD and in RAM, so chunks of ``most`` would pad the last one to a full stride, up to
    nearly a chunk of padding per parameter. Chunk boundaries change no result: the update is elementwise."""
    chunks = -(-numel // most)
    return min(most, round_up(-(-numel // chunks), STATE_CHUNK_ELEMENTS))


@dataclass(eq=False)
class ParamState:
    """One trainable parameter as the optimizer sees it: its place in the global-norm order, its
    param group, its state entry and chunking, and (streamed) the entry holding its gradient."""

    index: int  # position across all param groups; the order of the global norm
    param: torch.nn.Parameter
    group: dict
    entry: str
    elems_per_chunk: int
    nchunks: int
    grads: str | None = None  # the store entry of a streamed parameter's gradient (`StreamedGradients`)
    layout: Layout = FP32  # how its chunks hold the state (`formats`, ``state_format``)

    def __post_init__(self) -> None:
        self.numel = self.param.numel()  # elements; fixed, as the state's size is (read per chunk: kept, not asked)
        # (the parameter's data pointer, its flat detached view): `flat_weight`'s. Replaced whole by any thread
        # (one attribute store) and read whole: a race only makes the view twice.
        self._flat: tuple[int, torch.Tensor] | None = None

    def flat_weight(self) -> torch.Tensor:
        """The parameter's elements, flat and detached (``param.detach().view(-1)``), kept from call to call while
        the parameter's data pointer is the same: a run of small parameters asks for hundreds a step, and each torch
        call is a handoff of the GIL. Made afresh once ``param.data`` was replaced (``module.to`` does that): the kept
        view holds the old memory, which can therefore not come back at the same address, until the next call."""
        ptr, flat = self._flat or (None, None)
        if ptr != self.param.data_ptr() or flat is None:
            flat = self.param.detach().view(-1)
            self._flat = (flat.data_ptr(), flat)
        return flat

    @property
    def stride(self) -> int:
        """Bytes from one chunk of the entry to the next (a whole chunk's layout, padded to a page)."""
        return round_up(self.layout.nbytes(self.elems_per_chunk))

    @property
    def nbytes(self) -> int:
        """Bytes of the state entry, one slot (the last chunk unpadded)."""
        return (self.nchunks - 1) * self.stride + self.layout.nbytes(self.span(self.nchunks - 1)[1])

    def chunk_nbytes(self, k: int) -> int:
        """Bytes of chunk ``k`` in the store (as `TensorStore` lends it)."""
        return self.stride if k < self.nchunks - 1 else self.nbytes - k * self.stride

    def views(self, buf: HostBuffer, k: int) -> dict[str, Any]:
        """The ``master``, ``exp_avg`` and ``exp_avg_sq`` of chunk ``k`` held in ``buf`` (`Layout.views`;
        views: none may outlive the buffer once it is handed on)."""
        return self.layout.views(buf.view(), self.span(k)[1])

    def pieces(self, buf: HostBuffer, k: int) -> dict[str, memoryview]:
        """Chunk ``k``'s bytes per checkpoint file (`Layout.pieces`)."""
        return {kind: byte_view(t) for kind, t in self.layout.split(buf.view(), self.span(k)[1]).items()}

    def master_nbytes(self, k: int) -> int:
        """Bytes of chunk ``k``'s fp32 master, at the head of the chunk in every format (`formats.Layout`)."""
        return 4 * self.span(k)[1]

    def span(self, k: int) -> tuple[int, int]:
        """``(first element, elements)`` of chunk ``k``."""
        start = k * self.elems_per_chunk
        return start, min(self.elems_per_chunk, self.numel - start)

    def of_chunk(self, elements: torch.Tensor, k: int) -> torch.Tensor:
        """Chunk ``k``'s part of ``elements`` (the parameter's, flat): ``elements`` itself where the chunk is the
        whole parameter, no view made (a run of small parameters makes hundreds a step)."""
        if self.nchunks == 1:
            return elements
        start, n = self.span(k)
        return elements[start : start + n]

    def describe(self) -> str:
        return f"parameter {self.index} {tuple(self.param.shape)}"

    def update_name(self) -> str:
        """What errors call this parameter's update (`schedule.PendingUpdates`)."""
        return f"the update of {self.describe()}"


def apply_update(layout: Layout, state: dict[str, Any], grad: torch.Tensor, step: torch.Tensor, *, fused: bool,
                 found_inf: torch.Tensor | None = None, **hyper: Any) -> None:
    """One AdamW update of a chunk's ``state`` (`Layout.views`) in place, as its layout says: torch's kernel
    (`adamw_kernel`) on fp32 moments, or on fp32 copies of bf16 moments rounded back to bf16 (round to
    nearest even, as ``Tensor.copy_`` casts), or torchao's update (`formats.update_compact`). ``found_inf``: the
    fused kernel's flag, on fp32 moments only (`schedule.Parts.decides_on_device`)."""
    if layout.kernel != "torchao" and layout.moments == "fp32":
        adamw_kernel(state["master"], grad, state["exp_avg"], state["exp_avg_sq"], step, fused=fused,
                     found_inf=found_inf, **hyper)
        return
    if found_inf is not None:
        raise ValueError(f"apply_update: found_inf is the fused kernel's on fp32 moments, not {layout}'s")
    for part, g in tiles(state, grad):  # cache-sized tiles: a compact update passes over its elements many times
        if layout.kernel == "torchao":
            update_compact(part, g, step, **hyper)
            continue
        master, exp_avg, exp_avg_sq = part["master"], part["exp_avg"], part["exp_avg_sq"]
        m, v = scratch(master.numel(), torch.float32, torch.float32)  # the moments upcast
        m.copy_(exp_avg)
        v.copy_(exp_avg_sq)
        adamw_kernel(master, g, m, v, step, fused=fused, **hyper)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)


def _device_flag(found_inf: torch.Tensor | None, on_device: bool, job: str) -> None:
    """Refuse a step's ``found_inf`` flag for a host update: it is the device tier's kernel's (`Parts.decide`)."""
    if found_inf is not None and not on_device:
        raise ValueError(f"OptimizerState.{job}: found_inf is for the device tier's kernel; a host update is queued "
                         "once the step's decision is known on the host")


def _hyper(group: dict) -> dict[str, Any]:
    """A param group's AdamW hyperparameters as the kernels take them."""
    beta1, beta2 = group["betas"]
    return dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"])


class Publish(Protocol):
    """Where a chunk's new weight goes (`updates.Updater.publisher`)."""

    def __call__(self, ps: ParamState, k: int, master: torch.Tensor) -> Future | None:
        """Copy chunk ``k``'s new ``master`` into the weight; a future if that completes later."""

    def many(self, chunks: list[tuple[ParamState, int, torch.Tensor]]) -> None:
        """Copy each ``(ps, k, master)``'s new master into its parameter, as `__call__` does, together; resident
        parameters only (nothing to wait for)."""

    def into(self, ps: ParamState) -> torch.Tensor | None:
        """The parameter's elements (flat) the chunks' weights are copied into, when a one-pass update may write
        them itself (a resident host parameter's); ``None``: call the publisher, or stage them (`staged`)."""

    def writes_into(self, ps: ParamState) -> bool:
        """Whether `into` gives ``ps``'s elements."""

    def staged(self, ps: ParamState) -> bool:
        """Whether a one-pass update writes the new weights into a host buffer in the parameter's dtype, for
        `start_land`."""

    def start_land(self, ps: ParamState, k: int, weight: torch.Tensor) -> Copy:
        """Start copying chunk ``k``'s new weight, written into a host buffer, into the parameter; `Copy.wait` before
        the buffer is reused or the update is done."""


class GradChunks(Protocol):
    """What an update reads of its gradient (`gradients.Grad`): the store entries to read alongside the state,
    and each chunk."""

    extra: tuple[str, ...]

    def chunk(self, start: int, n: int, stored: HostBuffer | None) -> torch.Tensor: ...


class UpdateMeter:
    """The worker's CPU time in the updates: each chunk's upcast, unscale, clip, AdamW kernel and publish
    (the copy into the parameter, or a streamed one's tier copy) and, for state in host RAM updated
    speculatively, the copy of the active chunk into the shadow slot; not its SSD reads or writes (the planner
    models the SSD apart). The planner takes its CPU rate from it: the run's own chunks, read from memory
    rather than the cache, beside the run's own compute, which a micro-benchmark on one cached buffer
    overstates (``benchmarks/update_phases_bench.py`` times each phase).

    Threads: only the worker calls `add`; any thread may read ``total`` at any time (under ``next_forward``
    the worker may still be updating when the planner reads). ``total`` is rebound whole, once per call of an
    update's job (a chunk, or a batch of them), so a reader sees a consistent ``(seconds, parameters)`` pair."""

    def __init__(self) -> None:
        self.total: tuple[float, int] = (0.0, 0)

    def add(self, seconds: float, params: int) -> None:
        done, counted = self.total
        self.total = (done + seconds, counted + params)


class OptimizerState:
    """The masters and moments of ``owned`` (this rank's parameters; all of them in one process).

    Args:
        owned: the parameters whose state this process keeps.
        config: ``state_slots``, ``io_timeout`` and ``progress``.
        store: the run's tensor store (`storage.MemoryTiers`), borrowed: its owner closes it.
        depth: chunks the worker reads ahead (`ChunkPipeline`).
        threads: the worker's intra-op threads (`ChunkPipeline`); ``None``: torch's default.

    A construction that fails part-way stops the worker it started and raises its own error (the entries it
    made go with the store).
    """

    def __init__(self, owned: list[ParamState], config: FuyouConfig, store: TensorStore, depth: int, *,
                 spare_from: int = 0, threads: int | None = None) -> None:
        self.config, self.owned = config, owned
        self.slots = 1 if config.state_slots == 1 else 2  # "auto" starts with two (`drop_shadows`)
        # the largest chunk's elements: a staged weight's host buffer holds one chunk of any parameter (`update_job`)
        self.most_elems = max((ps.elems_per_chunk for ps in owned), default=0)
        self.spare_from = spare_from  # pool bytes the read-ahead of `read_ahead` leaves to the pool's other users
        self.meter = UpdateMeter()
        # The parameters (indices) whose own tensor holds their active master bitwise (`_can_hold`): a resident
        # fp32 parameter on the host, its update committed or its weights restored since. Their updates read only
        # the moments from the SSD and take the master from the parameter (a third less read). Taken out when a
        # speculative update publishes ahead of the active slot; put back by `commit`, an exact update and
        # `restore_weights`. Under ``_holds_lock``: the threads that queue updates (autograd's, DDP's) and the
        # training thread between steps each change only the parameters they hold at the time.
        self.param_holds: set[int] = set()
        # The parameters (indices) whose active chunks' masters are older than the parameter, which holds the active
        # master (an exact one-pass update in host RAM updated it there, in place: `group_job`). A subset of
        # ``param_holds``, empty while a window's updates speculate (`heal_masters` before any does); every reader
        # of a chunk's master heals it first. Under ``_holds_lock``; changed by the threads that queue updates and
        # by the training thread between steps, each for the parameters it holds at the time.
        self.masters_behind: set[int] = set()
        self._holds_lock = threading.Lock()
        self.store = store
        # The parameters whose state lives in their device's memory, then those in host RAM (indices): the first
        # that the store's device limit holds, then those its memory limit holds of the rest.
        self.on_device = self._tier(owned, self.store.device_limit, device=True)
        self.in_memory = self._tier(owned, self.store.memory_limit)
        self.pipeline = ChunkPipeline(self.store, depth, name="fuyou-adamw", threads=threads)
        try:
            for ps in owned:
                self.store.create(ps.entry, (ps.nbytes,), torch.uint8, chunk_bytes=ps.stride, slots=self.slots,
                                  in_memory=ps.index in self.in_memory,
                                  device=ps.param.device if ps.index in self.on_device else None)
        except BaseException:
            self.pipeline.close()
            raise

    @staticmethod
    def _can_hold(ps: ParamState) -> bool:
        """Whether ``ps``'s parameter can hold its master: a resident (not streamed) fp32 tensor in host RAM,
        which `publish` sets to every new master, bit for bit (the CPU's fp32 compute; on an accelerator or
        in another dtype the parameter is a copy, and the state keeps the only master)."""
        p = ps.param
        return ps.grads is None and p.is_cpu and p.dtype == torch.float32 and p.is_contiguous()

    def _hold(self, params: Iterable[ParamState], holds: bool) -> None:
        """Record that these parameters hold (or no longer hold) their active master (``param_holds``)."""
        with self._holds_lock:
            for ps in params:
                if holds and self._can_hold(ps):
                    self.param_holds.add(ps.index)
                else:
                    self.param_holds.discard(ps.index)

    def heal_masters(self, params: Iterable[ParamState] | None = None) -> None:
        """Write each of these parameters' master (default: every parameter's) into its active chunks where those
        are older (``masters_behind``), and wait: before anything reads a chunk's master other than the exact
        one-pass update that keeps it in the parameter. On the worker, after the jobs queued before (the updates that
        made them older); on the thread that queues jobs, between steps or before a window's first update."""
        with self._holds_lock:  # none behind (every step of a speculating window): no walk over the parameters
            behind = set(self.masters_behind)
        todo = [ps for ps in (self.owned if params is None else params) if ps.index in behind] if behind else []
        if not todo:
            return
        store = self.store
        chunks = [(ps, k) for ps in todo for k in range(ps.nchunks)]

        def heal(_k: int) -> Future:
            bufs = store.lend_chunks([(ps.entry, k) for ps, k in chunks], slot=ACTIVE, lend=ACTIVE, fill=False)
            try:
                for (ps, k), buf in zip(chunks, bufs):
                    n = ps.span(k)[1]
                    buf.view(torch.float32)[:n].copy_(ps.of_chunk(ps.flat_weight(), k))  # fp32: the layout's head
                store.give_back(bufs)  # written in place
            except BaseException:
                for buf in bufs:  # no-op for a chunk already given back
                    buf.release()
                raise
            return DONE

        self.pipeline.submit(ChunkJob(None, 1, heal))
        self.drain()
        with self._holds_lock:
            self.masters_behind.difference_update(ps.index for ps in todo)

    def require_current(self, params: Iterable[ParamState], why: str) -> None:
        """Raise if the chunks' master of one of these parameters is older than the parameter (``masters_behind``),
        which `why` would read (or whose memory it frees) before `heal_masters` ran: it would start from an older
        master."""
        with self._holds_lock:
            behind = [ps.describe() for ps in params if ps.index in self.masters_behind]
        if behind:
            raise RuntimeError(f"fuyou internal error: {why} of {', '.join(behind[:3])} would read a master older "
                               "than the parameter's (heal_masters was not called first); please report it")

    def _tier(self, owned: list[ParamState], nbytes: int, chosen: set[int] | None = None, *,
              device: bool = False) -> set[int]:
        """The parameters (indices) whose state ``nbytes`` of a tier holds beside ``chosen`` (those there already,
        within ``nbytes``): whole, in order, each that still fits (an HF model's embedding comes first; its update
        is the last in backward, where the SSD's time is hardest to hide). The host tier (``device=False``) takes
        none of the device tier's; the device tier only parameters it can hold (`_device_eligible`)."""
        chosen = set(chosen or ())
        need = {ps.index: TensorStore.footprint(ps.nbytes, ps.stride, self.slots) for ps in owned}
        left = nbytes - sum(need[i] for i in chosen)
        for ps in owned:
            skip = not self._device_eligible(ps) if device else ps.index in self.on_device
            if not skip and ps.index not in chosen and need[ps.index] <= left:
                chosen.add(ps.index)
                left -= need[ps.index]
        return chosen

    @staticmethod
    def _device_eligible(ps: ParamState) -> bool:
        """Whether ``ps``'s state may live on its device: resident (a streamed one's weights are off the device,
        its gradient leaves it) and materialised."""
        return ps.grads is None and not ps.param.is_meta

    def hold_in_ram(self, owned: list[ParamState], nbytes: int) -> int:
        """Let the host tier hold ``nbytes`` of state: move the next parameters' state (in order, whole, those
        that fit) from the SSD into it or, when it holds more than ``nbytes``, the state of those the smaller
        tier no longer takes (`_tier` afresh) out to the SSD; returns the bytes it holds now. Bitwise
        nothing changes. Only between steps, with nothing in flight (after `drain`)."""
        if nbytes < self.store.bytes_in_memory:
            keep = self._tier(owned, nbytes)
            leaving = [ps for ps in owned if ps.index in self.in_memory and ps.index not in keep]
            self.heal_masters(leaving)
            for ps in leaving:
                self.store.to_ssd(ps.entry, timeout=self.config.io_timeout)
                self.in_memory.discard(ps.index)
        self.store.allow_in_memory(nbytes)
        chosen = self._tier(owned, self.store.memory_limit, self.in_memory)
        for ps in owned:
            if ps.index in chosen and ps.index not in self.in_memory:
                self.store.to_memory(ps.entry, timeout=self.config.io_timeout)
                self.in_memory.add(ps.index)
        return self.store.bytes_in_memory

    def hold_on_device(self, owned: list[ParamState], nbytes: int | None = None, *,
                       leaving: Iterable[ParamState] = ()) -> int:
        """Let the device tier hold ``nbytes`` of state (None: its present size): move the first parameters' state
        that fits (in order, whole, `_tier` afresh) onto their devices, from the SSD or the host tier, and the state
        of those it no longer takes (a smaller tier; a parameter now streamed, or ``leaving``: about to be, `stream`)
        out to the SSD; then the host tier takes what it has room for of the rest (`hold_in_ram` at its present
        size). Returns the bytes on the device now.
        A device that runs out of memory part-way (``torch.OutOfMemoryError``: memory the plan counted is taken)
        stops the tier's growth there, with a warning: the entry that did not fit stays where it was, whole.
        Bitwise nothing changes on the CPU. Only between steps, with nothing in flight (after `drain`)."""
        nbytes = self.store.device_limit if nbytes is None else nbytes
        skip = {ps.index for ps in leaving}
        keep = self._tier([ps for ps in owned if ps.index not in skip], nbytes, device=True)
        self.heal_masters([ps for ps in owned if ps.index in keep])  # their masters leave the parameters
        self.leave_device([ps for ps in owned if ps.index not in keep])
        self.store.allow_on_device(nbytes)
        for ps in owned:
            if ps.index in keep and ps.index not in self.on_device:
                try:
                    self.store.to_device(ps.entry, ps.param.device)
                except torch.OutOfMemoryError as exc:
                    log.warning("fuyou: the optimizer state's device tier stops at %s of the %s asked: %s's state "
                                "(%s) did not fit in the device's memory (%s); it stays where it was",
                                format_bytes(self.store.bytes_on_device), format_bytes(nbytes), ps.describe(),
                                format_bytes(TensorStore.footprint(ps.nbytes, ps.stride, self.slots)),
                                str(exc).splitlines()[0] if str(exc) else "out of memory")
                    break
                self.on_device.add(ps.index)
                self.in_memory.discard(ps.index)
        with self._holds_lock:
            self.param_holds -= self.on_device
        self.hold_in_ram(owned, self.store.memory_limit)
        return self.store.bytes_on_device

    def drop_shadows(self) -> int:
        """Keep one slot of state from now on: every entry's active slot only (`TensorStore.drop_shadow`), so the
        tiers hold half the bytes each and no update may be speculative. Only between steps, with nothing in flight
        (after `drain`). Returns the bytes freed."""
        if self.slots == 1:
            return 0
        freed = sum(self.store.drop_shadow(ps.entry) for ps in self.owned)
        self.slots = 1
        return freed

    def stream(self, params: Iterable[ParamState]) -> bool:
        """These parameters' weights are about to be streamed (`OptimizerControl.attach_weights`): their tensors,
        whose memory the streamer frees, hold no master any more (``param_holds``: each update reads its master from
        its chunks, which `require_current` found current), and their state leaves the device tier (`leave_device`).
        Returns whether any did: the room it leaves there is then the next parameters' (`hold_on_device` at the
        tier's present size, once the parameters are streamed). Only between steps, with nothing in flight."""
        params = list(params)
        self._hold(params, False)
        left = any(ps.index in self.on_device for ps in params)
        self.leave_device(params)
        return left

    def leave_device(self, params: Iterable[ParamState]) -> None:
        """Move the state of these parameters that is on the device tier out to the SSD (a parameter about to be
        streamed: its weight and gradient leave the device). Only between steps, with nothing in flight."""
        for ps in params:
            if ps.index in self.on_device:
                self.store.to_ssd(ps.entry, timeout=self.config.io_timeout)
                self.on_device.discard(ps.index)

    def updates_on_device(self, ps: ParamState) -> bool:
        """Whether ``ps``'s update runs on its device (its state is on the device tier): its gradient is read
        there, not copied to the host."""
        return ps.index in self.on_device

    @property
    def pool(self) -> Any:
        return self.store.pool

    def footprint(self) -> tuple[int, int]:
        """Bytes of state (every slot, with padding) on the SSD and in host RAM (the device tier's: `device_bytes`)."""
        entries = [e for name, e in self.store.entries.items() if name.startswith("adamw.") and e.device is None]
        return (sum(e.footprint for e in entries if e.memory is None),
                sum(e.footprint for e in entries if e.memory is not None))

    def device_bytes(self) -> int:
        """Bytes of state (every slot, with padding) on the device tier: the store's device entries, which only
        the state makes."""
        return self.store.bytes_on_device

    def slot_bytes(self, in_memory: bool) -> int:
        """Bytes of one slot of the state in host RAM (``True``) or on the SSD: what a step's updates read
        and write there (the state format's bytes, `formats`)."""
        return sum(ps.nbytes for ps in self.owned
                   if ps.index not in self.on_device and (ps.index in self.in_memory) == in_memory)

    # -- initialising ---------------------------------------------------------------------------------
    def initialise(self, params: Iterable[ParamState], weight: Callable[[ParamState], torch.Tensor]) -> None:
        """Write ``[master = weight in fp32 | 0 | 0]`` into each entry's active slot, one parameter's
        weight (``weight(ps)``) in memory at a time (zero bytes are zero moments in every format)."""
        params = list(params)
        with self._holds_lock:
            self.masters_behind.difference_update(ps.index for ps in params)
        for ps in params:
            flat = weight(ps).reshape(-1)
            writes = []
            for k in range(ps.nchunks):
                start, n = ps.span(k)
                buf = self.pool.acquire(ps.chunk_nbytes(k))
                buf.view().zero_()
                ps.views(buf, k)["master"].copy_(flat[start : start + n])  # a view must not outlive the buffer
                writes.append(self.store.write_chunk(ps.entry, k, buf, slot=ACTIVE))
            gather(writes).result()  # raises if any write failed
            del flat

    # -- the update -----------------------------------------------------------------------------------
    def update_job(self, ps: ParamState, grad: GradChunks, *, step: torch.Tensor, fused: bool, exact: bool,
                   coef: torch.Tensor | None, inv_scale: torch.Tensor | None, publish: Publish,
                   keep: Callable[[ParamState, int, torch.Tensor], Future] | None = None,
                   norm: Callable[[], None] | None = None,
                   finished: Callable[[], None] | None = None, one_pass: OnePass | None = None,
                   found_inf: torch.Tensor | None = None) -> ChunkJob:
        """A job applying ``ps``'s AdamW update chunk by chunk on the worker.

        ``grad`` gives each chunk of the gradient (`Grad`); ``step`` is the count before the update.
        ``exact=False`` (speculative): the new state goes to the shadow slot; ``exact=True``: the global
        norm is known, it goes to the active slot in place, and the job's ``done`` completes once it
        landed. Per chunk: the gradient is unscaled (``inv_scale``, `GradScaler.unscale_`) and clipped
        (``coef``, ``clip_grad_norm_``'s in-place multiply) in fp32, the kernel runs, the new master goes
        to ``publish`` and, with ``keep``, the raw gradient chunk to ``keep`` (a redo may need it again).
        ``norm`` takes the gradient's norm (`gradients.NormTake`): beside the one passes of the first call's
        chunks (`gradients.Beside`; every chunk's where they are lent in one call), else before them; ``finished``
        runs after the last chunk (it releases what the gradient held).

        ``one_pass`` (`onepass.OnePass`; with ``fused`` and fp32 moments): each chunk is one pass over memory,
        the same bits: the master and moments read where they are (the active chunk, lent unfilled into the
        shadow slot, or the parameter holding the master), the gradient in its dtype, and the new weight written
        straight into a resident host parameter (``publish.into``) in the same pass. A one-pass update of state in
        host RAM, and an update of state on the device, takes all its chunks in one call of the job's function
        (`ChunkJob.batch`). ``found_inf``: as `group_job`'s, on the device tier only."""
        hyper = _hyper(ps.group)
        last, store, slot, meter = ps.nchunks - 1, self.store, ACTIVE if exact else SHADOW, self.meter
        # The master from the parameter, not the SSD, where the parameter holds it (``param_holds``); from here on
        # it holds the new one only once an exact update lands (a speculative one is ahead until `commit`).
        on_device = ps.index in self.on_device
        _device_flag(found_inf, on_device, "update_job")
        if not exact:  # its rollback restores the chunk's master, its publish overwrites the parameter's
            self.require_current([ps], "a speculative update")
        with self._holds_lock:  # in host RAM too where the chunk's master is older (its update writes it afresh)
            from_param = ps.index in self.param_holds and not on_device and (
                ps.index not in self.in_memory or ps.index in self.masters_behind)
            self.masters_behind.discard(ps.index)
        self._hold([ps], exact)
        flat = ps.flat_weight() if from_param else None
        if on_device or not (fused and ps.layout.kernel == "torch" and ps.layout.moments == "fp32"):
            one_pass = None  # its arithmetic is the fused kernel's on fp32 moments, on the host
        # Once per parameter, not per chunk: the count the update completes, and the parameter's elements a one-pass
        # update writes the new weight into itself, or else whether it writes them into a host buffer to copy in
        # (`Publish.staged`: a bf16/fp16 parameter on an accelerator), each chunk's buffer of one size, so that the
        # pool's cache lends the same (pinned) one again.
        count = step_count(step) if one_pass is not None else None
        into = publish.into(ps) if one_pass is not None else None
        staging = self.most_elems * ps.param.element_size() if one_pass is not None and publish.staged(ps) else 0
        # On the device: its kernel takes the step count, clip and unscale factors there, and runs on the stream of
        # the thread that queues the update (the one backward computed the gradient on, which the next forward's
        # kernels follow too); the master and moments stay on the device.
        stream = current_stream(ps.param.device) if on_device else None
        if on_device:
            step, coef, inv_scale = (to_device(t, ps.param.device) if t is not None else None
                                     for t in (step, coef, inv_scale))

        # The chunks of state in host RAM or on the device are lent in place and take no pool buffer: a one-pass
        # update of the one, or any update of the other, takes them all in one call (`ChunkJob.batch`), so that the
        # worker's bookkeeping per call, the pipeline's and this function's, is paid once per parameter. (Entries
        # move between tiers only between steps.)
        lent = (on_device or one_pass is not None and ps.index in self.in_memory) and not grad.extra
        batch = ps.nchunks if lent else 1

        def update(k: int, *bufs: HostBuffer) -> Future:
            # On failure the pipeline releases every buffer of the call: a chunk already written back is not
            # lent any more, and the others are marked failed (`LentChunk.release`).
            futures: list[Future] = []
            writes: list[Future] = []
            seconds, elems = 0.0, 0
            # Staged weights still copying in, the oldest first: at most one between two chunks (`compute`)
            landing: list[tuple[HostBuffer, Copy]] = []
            with on_stream(stream):
                # The norm, taken beside this call's passes where they are the one pass's (else now): from the first
                # chunk's to the last's of the call, going on only while each pass lasts until the last (`compute`).
                beside = Beside.claim([norm], one_pass) if k == 0 and norm is not None else None
                if lent:  # chunks k, k + 1, ... (no stored gradient: `ChunkJob.lent` takes no extra entry)
                    calls = [(k + i, buf, None) for i, buf in enumerate(bufs)]
                else:  # chunk k, with the stored gradient's chunk when there is one (`ChunkJob.extra`)
                    calls = [(k, bufs[0], bufs[1] if len(bufs) > 1 else None)]
                try:
                    for j, buf, stored in calls:
                        took, n = compute(j, buf, stored, futures, landing, beside, last=j == calls[-1][0])
                        if beside is not None and beside.settled:
                            beside = None
                        writes.append(store.write_chunk(ps.entry, j, buf, slot=slot))
                        seconds, elems = seconds + took, elems + n
                except BaseException:
                    if beside is not None:  # not taken: the others go back for their own updates to take
                        beside.give_back()
                    raise
                finally:  # the last chunk's weight is in the parameter before the update is done (or fails)
                    land(landing)
                if not on_device:  # the host's CPU time: the device's kernels are only queued here
                    meter.add(seconds, elems)
                if j == last and finished is not None:
                    finished()
            futures = [f for f in futures if f is not None]
            written = writes[0] if len(writes) == 1 else gather(writes)
            if exact:
                return gather([*futures, written])
            # A speculative update's write to the shadow slot may land after step()'s drain: `commit` waits
            # for it only where the chunk is read next (`TensorStore.commit`'s ``writes_behind``).
            return Later(gather(futures), written)

        def land(landing: list[tuple[HostBuffer, Copy]]) -> None:
            """Wait for the oldest staged weight still copying in, then give its buffer back. A copy that timed out
            may still read the buffer: it is kept out of the pool."""
            if landing:
                staged, copy = landing.pop(0)
                copy.wait()
                staged.release()

        def compute(k: int, buf: HostBuffer, stored: HostBuffer | None, futures: list[Future],
                    landing: list[tuple[HostBuffer, Copy]], beside: Beside | None, *,
                    last: bool) -> tuple[float, int]:
            """Chunk ``k``'s update into ``buf``, which `update` then writes back: the publish's and the kept
            gradient's futures go into ``futures``; a staged weight's copy into ``landing``, where it runs beside
            the next chunk's pass (`land` waits for it after that pass, or at the end of the call); ``beside``'s
            norms taken beside the pass and recorded once finished (by the ``last`` of the call's passes at the
            latest; before it they pause where each pass ends, for the next to carry on), or taken first and
            recorded without a pass. Returns the seconds of CPU work and the chunk's elements."""
            start, n = ps.span(k)
            raw = grad.chunk(start, n, stored)
            began = time.perf_counter()
            source = buf.source if isinstance(buf, LentChunk) else None  # lent unfilled: the active chunk
            by_pass = one_pass is not None and raw.is_cpu and raw.is_contiguous()
            if beside is not None and not by_pass:
                beside.record(one_pass.norms(beside.grads(), beside.inv_scale))
                beside = None
            if by_pass:
                state = buf.view(torch.float32)  # the fp32 layout: master, exp_avg, exp_avg_sq, n each
                weight = into[start : start + n] if into is not None else None
                # None when the pool spares no buffer now: the publisher copies the master in, as without staging
                staged = store.pool.try_acquire(staging) if staging else None
                if staged is None and landing:  # the buffer the pool would lend is still copying in: that first
                    land(landing)
                    staged = store.pool.try_acquire(staging)
                copying = False  # ``staged`` is copying in: `land` gives it back
                try:
                    if staged is not None:
                        weight = staged.view(ps.param.dtype)[:n]
                    taken = one_pass.update_chunk(state, buf.source_as(torch.float32) if source is not None else None,
                                                  flat[start : start + n] if flat is not None else None, raw, weight,
                                                  n=n, step=step, count=count, inv_scale=inv_scale, coef=coef,
                                                  beside=beside, last=last, **hyper)
                    if taken:  # the norms finished: recorded, and the next calls take none
                        beside.record(taken)
                    if staged is not None:
                        landing.append((staged, publish.start_land(ps, k, weight)))
                        copying = True
                        if len(landing) > 1:
                            land(landing)  # the chunk before's copy, which ran beside this chunk's pass
                finally:
                    del weight  # no view may outlive its buffer
                    if staged is not None and not copying:
                        staged.release()
                if into is None and staged is None:
                    futures.append(publish(ps, k, state[:n]))  # None: nothing to wait for
            else:
                state = ps.views(buf, k)
                if source is not None:  # lent unfilled: the device tier's (its copy on the stream), or a one-pass
                    buf.view().copy_(source)  # update's that cannot run on this gradient
                if flat is not None:  # the chunk's master bytes were left unread (`read_chunk`'s ``skip``)
                    state["master"].copy_(flat[start : start + n])
                g = fp32_gradient(raw, inv_scale, coef)  # on the host: a device gradient was staged
                apply_update(ps.layout, state, g, step, fused=fused, found_inf=found_inf, **hyper)
                futures.append(publish(ps, k, state["master"]))
                del g
            # With the copy that lent a host-tier chunk's shadow slot (`backward` schedule): CPU work of this update.
            took = time.perf_counter() - began + (buf.copy_s if isinstance(buf, LentChunk) else 0.0)
            if keep is not None:
                futures.append(keep(ps, k, raw))
            del state, raw, source  # no view may outlive a buffer given back
            if stored is not None:
                stored.release()
            return took, n

        # An in-memory or device entry lends its chunk (`TensorStore.read_chunk`): speculative, its shadow slot, filled
        # with a copy of the active chunk, or unfilled for a one-pass update that reads the active one (or a device
        # one, which copies it on its stream); exact, the active chunk itself, updated in place (no copy).
        return ChunkJob(ps.entry, ps.nchunks, update, extra=grad.extra, done=Future() if exact else None,
                        lend=slot, fill=one_pass is None and not on_device, skip=ps.master_nbytes if from_param else None,
                        lent=lent, batch=batch)

    def group_kind(self, ps: ParamState, grad: "Grad", *, fused: bool, publish: Publish,
                   one_pass: OnePass | None) -> tuple | None:
        """What `group_job` may update ``ps`` with ``grad`` beside (parameters of the same kind share a job), or
        ``None``: its update is a job of its own (`update_job`). A group takes a resident parameter's state in host
        RAM updated by the one pass into the parameter itself (``publish.into``), or on the device tier; the fp32
        layout, torch's fused arithmetic, and a gradient in memory that holds no pool buffer (no stored, staged or
        kept gradient). The kind: the tier, the device and the param group (one set of hyperparameters)."""
        layout = ps.layout
        if (not fused or layout.kernel != "torch" or layout.moments != "fp32" or ps.grads is not None
                or grad.flat is None or grad.entry is not None or grad.host is not None or grad.staging is not None):
            return None
        if ps.index in self.on_device:
            return ("device", ps.param.device, id(ps.group))
        flat = grad.flat
        if (one_pass is not None and ps.index in self.in_memory and flat.is_cpu and flat.is_contiguous()
                and publish.writes_into(ps)):
            return ("ram", id(ps.group))
        return None

    def group_job(self, members: list[tuple[ParamState, "Grad"]], counts: torch.Tensor, *, exact: bool,
                  coef: torch.Tensor | None, inv_scale: torch.Tensor | None, publish: Publish,
                  one_pass: OnePass | None, norms: list[Callable[[], None] | None] | None = None,
                  found_inf: torch.Tensor | None = None) -> ChunkJob:
        """One job applying the AdamW updates of several parameters of one `group_kind`, each ``(ps, grad)`` as
        `update_job` takes them (``counts``: every parameter's step count, each member's read at its ``ps.index``
        now, before its update; ``norms``: each one's `update_job` ``norm``, or None), speculative or with the clip
        coefficient ``coef`` (a redo) or exact; the same bits as a job per parameter. ``found_inf`` (the device
        tier's exact updates of a step decided on the device, `schedule.Parts.decide`): the fused kernel's flag,
        where 1 leaves the state and weights as they were. What it saves is the worker's and the queueing thread's
        bookkeeping per parameter (a job, its closures and futures, the pipeline's per-job work), which a
        transformer's many small parameters pay more for than for their arithmetic.

        State in host RAM: each chunk lent in place (a redo's shadow chunk unfilled, read from the active one) and
        updated by the one pass, the new weight written into the parameter in the same pass; every chunk of the run
        in one call of the compiled pass (`OnePass.update_chunks`), the members' norms taken beside it
        (`gradients.Beside`). On the device tier:
        every chunk's update in one call of torch's fused kernel over the lists of chunks (torch's own
        multi-tensor call: its ``AdamW(fused=True)`` arithmetic, element for element), an exact update's gradients
        unscaled and clipped in place, the shadow chunks filled and the new weights published by one
        ``_foreach_copy_`` each, all on the stream of the thread that queues the job. ``exact``: into the active
        slot in place, the job's ``done`` completing once it landed; else the shadow slot (a speculative update's
        shadow chunk, lent unfilled, read from the active one, as a redo's). A failure part-way gives back every
        chunk still lent, marked failed."""
        pss = [ps for ps, _grad in members]
        hyper = _hyper(pss[0].group)
        store, meter, slot = self.store, self.meter, ACTIVE if exact else SHADOW
        on_device = pss[0].index in self.on_device
        _device_flag(found_inf, on_device, "group_job")
        if not exact:  # a speculative update or a redo: its rollback restores the chunk's master
            self.require_current(pss, "a speculative update")
        # Exact in host RAM, a parameter that holds its active master (``param_holds``) is updated where it is, in
        # place, and its chunk's master left older (``masters_behind``), until something else reads it
        # (`heal_masters`): 4 bytes per element fewer written.
        with self._holds_lock:
            in_place = [exact and not on_device and ps.index in self.param_holds for ps in pss]
            self.masters_behind.update(ps.index for ps, own in zip(pss, in_place) if own)
        self._hold(pss, exact)
        elems = sum(ps.numel for ps in pss)
        # each count the update completes: the count now (the caller advances them next) plus one, in one op
        counts = counts[torch.tensor([ps.index for ps in pss])] + 1
        if on_device:
            device = pss[0].param.device
            stream = current_stream(device)
            counts = to_device(counts, device).unbind()
            coef, inv_scale = (to_device(t, device) if t is not None else None for t in (coef, inv_scale))
            into = None
        else:
            stream = None
            counts = counts.tolist()  # `step_count`'s floats
            # `publish.into` (`group_kind` checked `writes_into`); a whole parameter as it is: the compiled pass takes
            # its contiguous elements by pointer, outside autograd, so no detached flat view need be made for it
            into = [ps.param if ps.nchunks == 1 else ps.flat_weight() for ps in pss]

        chunks = [(i, k) for i, ps in enumerate(pss) for k in range(ps.nchunks)]  # (member, chunk), in order

        def update(_k: int) -> Future | Later:
            bufs: list[LentChunk] = []
            beside: Beside | None = None  # the norms the host pass takes beside its updates; the others first, here
            try:
                with on_stream(stream):
                    beside = Beside.claim(norms or (), None if on_device else one_pass)
                    bufs = store.lend_chunks([(pss[i].entry, k) for i, k in chunks], slot=ACTIVE, lend=slot,
                                             fill=False)
                    lent = [(i, k, buf) for (i, k), buf in zip(chunks, bufs)]
                    began = time.perf_counter()
                    if on_device:
                        device_pass(lent)
                    else:
                        host_pass(lent, beside)
                    took = time.perf_counter() - began
                    store.give_back(bufs)  # written in place: each chunk's write is done
                if not on_device:  # the host's CPU time: the device's kernels are only queued here
                    meter.add(took, elems)
                for _ps, grad in members:
                    grad.release()
            except BaseException:
                if beside is not None:  # not taken: the other updates' norms go back for their own updates to take
                    beside.give_back()
                for buf in bufs:  # no-op for a chunk already given back
                    buf.release()
                raise
            return DONE if exact else Later(None, DONE)

        def host_pass(lent: list[tuple[int, int, LentChunk]], beside: Beside | None) -> None:
            outs, sources, grads, weights, ns, chunk_counts, masters, owns = [], [], [], [], [], [], [], []
            for i, k, buf in lent:
                ps, grad = members[i]
                outs.append(buf.view(torch.float32))
                sources.append(buf.source_as(torch.float32) if buf.source is not None else None)
                start, n = ps.span(k)
                grads.append(grad.chunk(start, n, None))
                own = in_place[i]  # the master read and written where the parameter holds it, no weight besides
                weights.append(None if own else ps.of_chunk(into[i], k))
                masters.append(ps.of_chunk(into[i], k) if own else None)
                owns.append(own)
                ns.append(n)
                chunk_counts.append(counts[i])
            taken = one_pass.update_chunks(outs, sources, grads, weights, ns, counts=chunk_counts, master_ins=masters,
                                           masters_in_place=owns, inv_scale=inv_scale, coef=coef, beside=beside,
                                           **hyper)
            if beside is not None:
                beside.record(taken)

        def device_pass(lent: list[tuple[int, int, LentChunk]]) -> None:
            masters, avgs, sqs, raws, steps, fill, sources, published = [], [], [], [], [], [], [], []
            for i, k, buf in lent:
                ps, grad = members[i]
                start, n = ps.span(k)
                # the fp32 layout: master, exp_avg, exp_avg_sq, n each (3n values), kept with the chunk's memory
                master, exp_avg, exp_avg_sq = buf.kept("fp32 state", lambda buf=buf, n=n: buf.view(torch.float32)
                                                       .view(3, n).unbind())
                if buf.source is not None:  # a redo's shadow chunk, lent unfilled: the active one copied in first
                    fill.append(buf.view())
                    sources.append(buf.source)
                masters.append(master)
                avgs.append(exp_avg)
                sqs.append(exp_avg_sq)
                raws.append(grad.chunk(start, n, None))
                steps.append(counts[i])
                published.append((ps, k, master))
            if fill:
                torch._foreach_copy_(fill, sources)
            # exact: the gradients are final and read by nothing after this, so they are unscaled and clipped in
            # place, as ``clip_grad_norm_`` does (a speculative update's may be read again by its redo)
            grads = fp32_gradients(raws, inv_scale, coef, consume=exact)
            fused_adamw(masters, grads, avgs, sqs, steps, found_inf=found_inf, **hyper)
            publish.many(published)

        return ChunkJob(None, 1, update, done=Future() if exact else None)

    def read_ahead(self, params: Iterable[ParamState]) -> None:
        """Have the worker read the state of ``params`` that lives on the SSD ahead, in this order, while it is
        idle, into pool buffers it can spare beyond ``spare_from`` (`ChunkPipeline.read_ahead`): for updates
        whose gradients come when nothing is left to overlap them."""
        with self._holds_lock:
            held = set(self.param_holds)
        chunks = [(ps.entry, k, ps.master_nbytes(k) if ps.index in held else 0)
                  for ps in params if ps.index not in self.in_memory and ps.index not in self.on_device
                  for k in range(ps.nchunks)]
        if chunks:
            self.pipeline.read_ahead(chunks, keep_free=self.spare_from)

    def run(self, job: ChunkJob) -> ChunkJob:
        """Queue ``job`` on the worker; returns it."""
        self.pipeline.submit(job)
        return job

    def drain(self, *, writes: bool = True) -> None:
        """Wait for every job queued so far (and the writes they made; ``writes=False``: not the speculative
        updates' writes to the shadow slot, `ChunkPipeline.drain`); raises the first error."""
        self.pipeline.drain(writes=writes)

    def commit(self, params: Iterable[ParamState], *, writes_behind: bool = False) -> None:
        """The shadow slot of these parameters becomes the active one (after a drain; ``writes_behind``: one
        that left the shadow writes in flight, which land behind the commit, `TensorStore.commit`)."""
        params = list(params)
        self.store.commit([ps.entry for ps in params], writes_behind=writes_behind)
        self._hold(params, True)  # each published the master it committed

    def rollback(self) -> None:
        """Drop every shadow write (after a drain; the shadow writes a partial drain left in flight land first)."""
        self.pipeline.land()
        self.store.rollback()

    def restore_weights(self, params: Iterable[ParamState],
                        publish: Publish) -> None:
        """Publish the active masters again (after a skip or a failure, or a checkpoint load)."""
        params = list(params)
        self.heal_masters(params)
        for ps in params:

            def restore(k: int, buf: HostBuffer, ps: ParamState = ps) -> Future | None:
                with buf:
                    return publish(ps, k, ps.views(buf, k)["master"])

            self.pipeline.submit(ChunkJob(ps.entry, ps.nchunks, restore))
        self.pipeline.drain()
        self._hold(params, True)

    # -- reading it back -------------------------------------------------------------------------------
    def read(self, ps: ParamState) -> dict[str, torch.Tensor]:
        """The committed master and moments of one parameter, in RAM, shaped like it (fp32; compact
        moments dequantised)."""
        self.heal_masters([ps])
        out = {kind: torch.empty(ps.numel, dtype=torch.float32) for kind in KINDS}

        def gather_chunk(k: int, buf: HostBuffer) -> None:
            start, n = ps.span(k)
            with buf:
                for kind, view in ps.views(buf, k).items():
                    out[kind][start : start + n].copy_(fp32_values(view)[:n])

        self.pipeline.submit(ChunkJob(ps.entry, ps.nchunks, gather_chunk))
        self.pipeline.drain()
        return {kind: t.view(ps.param.shape) for kind, t in out.items()}

    # -- checkpoints: the state as bytes per kind, never whole in RAM ----------------------------------------
    def export(self, params: list[ParamState], write: Callable[[ParamState, dict[str, memoryview]], None]) -> None:
        """Stream the committed state of ``params`` in order: ``write(ps, {kind: bytes})`` per chunk (the
        layout's pieces), on the worker thread, chunks in element order (a checkpoint's files do not
        depend on the chunk size)."""
        self.heal_masters(params)
        for ps in params:

            def write_chunk(k: int, buf: HostBuffer, ps: ParamState = ps) -> None:
                with buf:
                    write(ps, ps.pieces(buf, k))

            self.pipeline.submit(ChunkJob(ps.entry, ps.nchunks, write_chunk))
        self.pipeline.drain()

    def load(self, params: list[ParamState], read: Callable[[ParamState, int, dict[str, memoryview]], None],
             finish: Callable[[ParamState], None], check: Callable[[], None], *, what: str,
             progress: bool) -> None:
        """Stream saved state into the store and commit it only if it all checks out.

        For each chunk, ``read(ps, start, {kind: bytes})`` fills the chunk's bytes (raising on a short file);
        after each parameter ``finish(ps)``; after all of them ``check()`` raises if anything failed its
        checksum. Two slots: the state goes to the shadow slot and is committed after ``check``; one slot: a
        first pass reads without writing (``check`` must pass) and a second one writes in place. On any error
        nothing is committed and the store is as before."""
        if self.slots == 1:  # no shadow slot to stage in: verify every checksum first, then write
            self._load_pass(params, read, finish, write=False, what=what, progress=progress)
            check()
        self._load_pass(params, read, finish, write=True, what=what, progress=progress)
        if self.slots == 2:
            try:
                check()
            except BaseException:
                self.store.rollback()
                raise
        self.commit(params)
        with self._holds_lock:  # the chunks hold the loaded masters; the parameters only once `restore_weights` ran
            self.masters_behind.difference_update(ps.index for ps in params)
        self._hold(params, False)

    def _load_pass(self, params: list[ParamState], read: Callable, finish: Callable, *, write: bool, what: str,
                   progress: bool) -> None:
        slot = ACTIVE if self.slots == 1 else SHADOW
        writes: list[Future] = []
        bar = Progress(sum(ps.nbytes for ps in params),
                       f"fuyou: {'loading' if write else 'checking'} optimizer state from {what}", enabled=progress)
        try:
            for ps in params:
                for k in range(ps.nchunks):
                    start, n = ps.span(k)
                    buf = self.pool.acquire(ps.chunk_nbytes(k))
                    try:
                        read(ps, start, ps.pieces(buf, k))
                    except BaseException:
                        buf.release()
                        raise
                    if write:
                        writes.append(self.store.write_chunk(ps.entry, k, buf, slot=slot))
                    else:
                        buf.release()
                    bar.update(ps.chunk_nbytes(k))
                finish(ps)
        except BaseException:
            gather(writes).exception()
            self.store.rollback()
            raise
        finally:
            bar.close()
        error = gather(writes).exception()
        if error is not None:
            self.store.rollback()
            raise error

    def close(self) -> None:
        """Stop the worker (up to ``io_timeout`` for the job running now) and delete the swap files."""
        try:
            self.pipeline.close()
        finally:
            self.store.close()
