"""`WeightStreamer`: a block's weights are on the device only while the block runs (docs/weight-streaming.md).

::

    streamer = WeightStreamer(model, FuyouConfig(weights="ssd"), memory=memory)
    streamer.install()          # copies the blocks' weights to their tier, frees their device memory
    ...                         # train / evaluate as usual
    streamer.close()            # every weight resident again, equal to its tier copy

Each repeated block's parameters live in a tier copy (``"host"``: a pool buffer, ``"ssd"``: a store entry,
one per parameter). Frozen ones are written once, at install. Trainable ones (``trainable``) take the
optimizer's updates through `publish`, or, fp32 on the SSD, are read from the head of the optimizer's state
chunks (`use_master`). Parameters outside the blocks, shared (tied) ones and unlisted trainable ones stay
resident.

Release (FSDP's mechanism): ``p.untyped_storage().resize_(0)`` frees a weight; ``resize_(nbytes)`` and a copy
through ``p.data`` refill it. The storage object stays the same, so tensors autograd saved see the bytes
again, and a ``.data`` copy leaves the version counter alone. Reading a released weight outside the hooks is
undefined (on the CPU it can crash): `state_dict` is served from the tier copies, `load_state_dict` writes them.

Schedule, ``k = weight_prefetch_blocks``: the forward of block ``i`` waits for it, uploads ``i+1 … i+k`` ahead
(SSD reads into staging buffers, then the copy on the upload thread) and afterwards releases it unless it is
one of the last ``k`` (backward needs those first). Backward entering ``i`` releases ``i+1``, waits for ``i``
and uploads ``i-1 … i-k``; its end, or an exception in a forward, releases the rest. So at most ``k + 1``
blocks are on the device (``window_bytes``), counted from the start of their upload.

Exactness: the optimizer publishes a parameter only after its gradient is final; a block whose updates are
still running (``updates``) is not uploaded ahead and its forward waits for them (futures, not timing).
`meter` counts device bytes of weights and gradients (not activations) against ``device_memory_budget``."""

from __future__ import annotations

import enum
import functools
import threading
import warnings
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..activations.blocks import discover_blocks, resolve_per_block
from ..activations.swap import first_tensor, in_backward, storage_id
from .. import trace
from ..cleanup import undo_after
from ..config import ConfigError, FuyouConfig, format_bytes, settled
from ..device import claim_for_current_stream, resize_for_copies, transfer
from ..storage import HostBuffer, HostShares, MemoryTiers, host_budget_split, round_up
from .materialize import Init, has_meta, materialize, model_device

__all__ = ["Tier", "WeightStreamer", "StreamStats", "DeviceMeter", "streamed_parameter_names"]


class Tier(str, enum.Enum):
    """Where a block's streamed weights live while the block is not running."""

    DEVICE = "device"  # resident, left alone
    HOST = "host"  # a buffer of the host pool per parameter
    SSD = "ssd"  # an entry of the tensor store per parameter, read through pool buffers


@dataclass
class StreamStats:
    """Counters over the streamer's lifetime; bytes are the weights' own sizes."""

    streamed_bytes: int = 0  # weight bytes of streamed blocks (their sum over blocks)
    trainable_bytes: int = 0  # of which trainable (published by the optimizer)
    resident_bytes: int = 0  # parameter and buffer bytes that stay on the device
    resident_grad_bytes: int = 0  # gradients of the trainable parameters that stay on the device
    window_bytes: int = 0  # the most streamed bytes on the device at once: the k + 1 largest blocks
    materialized_bytes: int = 0  # streamed bytes on the device now
    high_water_bytes: int = 0  # the most streamed bytes ever on the device at once
    reads: int = 0  # block materialisations (ahead or on demand)
    prefetched: int = 0  # blocks put on the device ahead of their use (upload thread)
    from_master: int = 0  # trainable fp32 weights streamed from the optimizer's master (`use_master`): no copy
    tiers: dict[int, str] = field(default_factory=dict)  # block index -> tier, streamed blocks only


class DeviceMeter:
    """Device bytes of weights and gradients now, and the most ever (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = self.high_water = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.now += nbytes
            self.high_water = max(self.high_water, self.now)

    def sub(self, nbytes: int) -> None:
        with self._lock:
            self.now -= nbytes


class _Weight:
    """One streamed parameter: where its tier copy is and how it is chunked there."""

    def __init__(self, name: str, param: torch.nn.Parameter, chunk_elems: int, trainable: bool) -> None:
        self.name, self.param, self.trainable = name, param, trainable
        self.numel, self.dtype = param.numel(), param.dtype
        self.nbytes = _nbytes(param)
        self.chunk_elems = min(chunk_elems, self.numel)
        self.nchunks = -(-self.numel // self.chunk_elems)
        self.host: HostBuffer | None = None  # the host tier's copy
        self.block = -1  # the index of the block it belongs to (set by `_Block`)
        self.entry: str | None = None  # the SSD tier's store entry
        # The SSD tier's copy is the optimizer's fp32 master (`use_master`): ``entry`` is its state entry, the
        # weight is the head of each state chunk, and the optimizer's update writes it (no copy of its own).
        self.master = False

    def span(self, k: int) -> tuple[int, int]:
        start = k * self.chunk_elems
        return start, min(self.chunk_elems, self.numel - start)

    def flat(self) -> torch.Tensor:
        return self.param.data.view(-1)


class _Block:
    """One block's streamed weights and the reads in flight for them."""

    def __init__(self, index: int, tier: Tier, weights: list[_Weight]) -> None:
        self.index, self.tier, self.weights = index, tier, weights
        for w in weights:
            w.block = index
        self.params = [(w.name, w.param) for w in weights]
        self.nbytes = sum(w.nbytes for w in weights)
        self.staging = sum(round_up(w.span(k)[1] * w.param.element_size()) for w in weights for k in range(w.nchunks))
        self.trainable = [w.param for w in weights if w.trainable]  # their tier copies take the optimizer's updates
        self.upload: Future | None = None  # the weights on their way to the device (`WeightStreamer._prefetch`)
        self.resident = True  # the weights' device storage holds their bytes (or will, once ``upload`` is done)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> int:
    """What tells storages apart: `storage_id`, or for a meta tensor (no storage) the tensor itself."""
    return id(t) if t.is_meta else storage_id(t)


def _streamable(model: torch.nn.Module, blocks: list[torch.nn.Module], tiers: list[Tier],
                trainable: Any) -> list[tuple[int, str, torch.nn.Parameter]]:
    """``(block index, name in the block, parameter)`` of every parameter a streamer with these tiers releases:
    in a block not on the device tier, used by that block only, owning its whole storage, frozen or ``trainable(p)``."""
    prefixes: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for i, block in enumerate(blocks):
            if module is block:
                prefixes.setdefault(i, []).append(name + "." if name else "")
    owners: dict[int, set[int]] = {}  # id(param) -> blocks using it (-1: outside every block)
    storages: dict[int, int] = {}  # storage address -> parameters and buffers using it
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = next((i for i, pre in prefixes.items() if any(name.startswith(x) for x in pre)), -1)
        owners.setdefault(id(p), set()).add(owner)
    for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values():
        ptr = _storage_key(t)
        storages[ptr] = storages.get(ptr, 0) + 1
    out = []
    for i, (block, tier) in enumerate(zip(blocks, tiers)):
        if tier is Tier.DEVICE:
            continue
        for name, p in block.named_parameters():
            streamable = (owners.get(id(p)) == {i} and p.numel() > 0 and p.is_contiguous()
                          and p.storage_offset() == 0 and p.untyped_storage().nbytes() == _nbytes(p)
                          and storages[_storage_key(p)] == 1)
            if streamable and (not p.requires_grad or trainable(p)):
                out.append((i, name, p))
    return out


def streamed_parameter_names(model: torch.nn.Module, config: FuyouConfig, weights: Any = None) -> list[str]:
    """Names (as ``model.named_parameters()``) of the trainable parameters a `WeightStreamer` with ``weights``
    (default ``config.weights``) streams when the optimizer owns every parameter that requires grad: what
    ``DistributedDataParallel`` must leave alone (`FuyouAdamW` sums them itself)."""
    weights = (config.weights or "device") if weights is None else weights  # unset: resident (`placement_defaults`)
    blocks = discover_blocks(model, config.blocks)
    tiers = resolve_per_block("weights", weights, len(blocks), Tier, Tier.DEVICE)
    streamed = {id(p) for _i, _name, p in _streamable(model, blocks, tiers, lambda p: True) if p.requires_grad}
    return [name for name, p in model.named_parameters() if id(p) in streamed]


class WeightStreamer:
    """Streams the repeated blocks' weights from host memory or SSD (module docstring).

    Args:
        model: the model; its repeated blocks come from `discover_blocks` (or ``config.blocks``).
        config: ``weights``, ``weight_prefetch_blocks``, ``device_memory_budget`` and the storage knobs.
        memory: the run's `MemoryTiers` to borrow (e.g. the engine's), which calls `uninstall` before it
            closes; default: the streamer builds its own when a block is streamed, closed by `close()`.
        weights: the tiers (one for all, or ``{index: tier}``), in place of ``config.weights``.
        blocks: the blocks in forward order, instead of discovering them.
        trainable: trainable parameters to stream -> the optimizer's chunk length (elements); the optimizer
            must `publish` their updates.
        device: where materialised weights live (default: the model's first non-meta parameter's, else CPU).
        init_weights: for a model on the meta device (`materialize`): each streamed block is materialised,
            initialised with this, written to its tier and released before the next.

    Raises `ConfigError` at `install` when the host tier, the staging buffers and the largest gradient's host
    copy do not fit ``host_memory_budget``, or resident bytes, the window and the largest streamed gradient
    do not fit ``device_memory_budget``.
    """

    def __init__(self, model: torch.nn.Module, config: FuyouConfig | None = None, *, memory: MemoryTiers | None = None,
                 weights: str | dict | None = None, blocks: list[torch.nn.Module] | None = None,
                 trainable: Mapping[torch.nn.Parameter, int] | None = None, device: torch.device | None = None,
                 init_weights: Init | None = None) -> None:
        self.config = config = settled(config)
        self.model = model
        self.blocks = list(blocks) if blocks is not None else discover_blocks(model, config.blocks)
        self.weights = (weights if weights is not None else config.weights) or "device"  # as given: one, or {block: tier}
        self.tiers = resolve_per_block("weights", self.weights, len(self.blocks), Tier, Tier.DEVICE)
        self.k = config.weight_prefetch_blocks
        self.timeout = config.io_timeout  # a weight read, or a wait for a pool buffer, longer than this is an error
        self.trainable = dict(trainable or {})
        self.device = device if device is not None else model_device(model)
        self.init_weights = init_weights
        self._own_memory = memory is None and any(t is not Tier.DEVICE for t in self.tiers)
        self.memory = MemoryTiers(config) if self._own_memory else memory
        self.store = self.memory.store if self.memory is not None else None
        if memory is not None:
            memory.on_close(self.uninstall)
        # SSD prefetches never take the optimizer's read-ahead share: its worker must always move.
        self._keep_free = self._shares().optimizer_readahead if self.trainable else 0
        self.stats = StreamStats()
        self.meter = DeviceMeter()
        self._units: dict[int, _Block] = {}
        self._all: dict[torch.nn.Parameter, _Weight] = {}  # every streamed parameter, in block order
        self._weights: dict[torch.nn.Parameter, _Weight] = {}  # trainable streamed parameters
        self._handles: list[Any] = []
        self._lock = threading.RLock()  # backward hooks may run on another thread (CUDA's autograd engine)
        self._callback_queued = False
        self._active = False
        self._uploader: ThreadPoolExecutor | None = None
        # Updates still to land in the tier copies (`OptimizerControl.attach_weights` sets its PendingUpdates):
        # anything with ``pending(params) -> bool`` and ``wait(params)``.
        self.updates: Any = None

    # -- installing --------------------------------------------------------------------------------
    def install(self) -> None:
        """Copy each streamed block's weights to its tier, free their device memory, add the hooks."""
        if self._active:
            raise RuntimeError("WeightStreamer is already installed")
        units = self._plan_units()
        self._check_budgets(units)
        self._units = {}
        self._uploader = ThreadPoolExecutor(1, thread_name_prefix="fuyou-weights")  # copies onto the device ahead
        try:
            for unit in units.values():
                self._to_tier(unit)
                self._units[unit.index] = unit
                self._release(unit)
            for i, block in enumerate(self.blocks):
                self._handles.append(block.register_forward_pre_hook(lambda m, args, i=i: self._before_forward(i)))
                self._handles.append(block.register_forward_hook(lambda m, args, out, i=i: self._after_forward(i, out),
                                                                 always_call=True))
                if i in self._units:
                    unit = self._units[i]
                    self._handles.append(block.register_state_dict_post_hook(self._state_dict_hook(unit)))
                    self._handles.append(block.register_load_state_dict_pre_hook(
                        lambda *args, unit=unit: self._load_begin(unit)))
                    self._handles.append(block.register_load_state_dict_post_hook(
                        lambda module, keys, unit=unit: self._load_end(unit)))
        except BaseException as exc:
            self._units.update(units)
            # The hooks off, the weights made resident again from their tier copies, the entries gone.
            undo_after(exc, functools.partial(self.uninstall, force=True))
            raise
        self._all = {w.param: w for u in self._units.values() for w in u.weights}
        self._weights = {p: w for p, w in self._all.items() if w.trainable}
        self.stats.tiers = {i: u.tier.value for i, u in self._units.items()}
        self.meter.add(self.stats.resident_bytes + self.stats.resident_grad_bytes)
        self._active = True

    def _plan_units(self) -> dict[int, _Block]:
        """Per streamed block, its parameters that are safe to release (see the module docstring)."""
        frozen_elems = max(1, self.config.chunk_size)  # bytes; per parameter below
        weights: dict[int, list[_Weight]] = {}
        for i, name, p in _streamable(self.model, self.blocks, self.tiers, lambda p: p in self.trainable):
            weights.setdefault(i, []).append(_Weight(name, p, self.trainable[p], trainable=True) if p.requires_grad
                                             else _Weight(name, p, frozen_elems // p.element_size(), trainable=False))
        return {i: _Block(i, self.tiers[i], ws) for i, ws in weights.items()}

    def _check_budgets(self, units: dict[int, _Block]) -> None:
        streamed = {id(w.param) for u in units.values() for w in u.weights}
        resident = {_storage_key(t): t.untyped_storage().nbytes()
                    for t in [*self.model.parameters(), *self.model.buffers()] if id(t) not in streamed}
        largest = sorted((u.nbytes for u in units.values()), reverse=True)
        grad = max((w.nbytes for u in units.values() for w in u.weights if w.trainable), default=0)
        s = self.stats
        s.streamed_bytes = sum(largest)
        s.trainable_bytes = sum(w.nbytes for u in units.values() for w in u.weights if w.trainable)
        s.resident_bytes = sum(resident.values())
        s.window_bytes = sum(largest[: self.k + 1])
        s.resident_grad_bytes = resident_grads = sum(_nbytes(p) for p in self.model.parameters()
                                                     if p.requires_grad and id(p) not in streamed)
        need = s.resident_bytes + resident_grads + s.window_bytes + grad
        budget = self.config.device_memory_budget
        if budget is not None and need > budget:
            raise ConfigError(
                f"device_memory_budget: got {format_bytes(budget)}, but the resident weights "
                f"({format_bytes(s.resident_bytes)}) and their gradients ({format_bytes(resident_grads)}), plus "
                f"{self.k + 1} streamed blocks' weights ({format_bytes(s.window_bytes)}) and the largest streamed "
                f"gradient ({format_bytes(grad)}) need {format_bytes(need)}; raise device_memory_budget, lower "
                "weight_prefetch_blocks, or stream more blocks (weights='ssd')"
            )
        if not units:
            return
        pool = self.store.pool
        host = sum(round_up(w.nbytes) for u in units.values() if u.tier is Tier.HOST for w in u.weights)
        staging = max((u.staging for u in units.values() if u.tier is Tier.SSD), default=0)
        # Weights draw on the host activations' share (`host_budget_split`); a streamed gradient's host
        # copy waits for room (the optimizer frees them as it goes), so one must fit.
        free = min(self._shares().host_activations, pool.budget - pool.lent)
        if host + staging + round_up(grad) > free:
            raise ConfigError(
                f"host_memory_budget: the host tier needs {format_bytes(host)}, SSD reads a staging buffer of "
                f"{format_bytes(staging)} and the largest streamed gradient's host copy {format_bytes(grad)}, but only "
                f"{format_bytes(free)} of {format_bytes(pool.budget)} is left after the optimizer's and the "
                "activations' shares (host_budget_split); raise host_memory_budget or put fewer blocks on the host "
                "tier (weights={block: 'ssd'})"
            )

    def _to_tier(self, unit: _Block) -> None:
        block = self.blocks[unit.index]
        if has_meta(block):  # built on the meta device: this block gets memory now, and only until released
            materialize(block, self.device, self.init_weights)
        for w in unit.weights:
            if unit.tier is Tier.HOST:
                w.host = self.store.pool.acquire(w.nbytes, timeout=self.timeout)
            else:
                w.entry = f"weights.{unit.index}.{w.name}"
                self.store.create(w.entry, (w.numel,), w.dtype, slots=1,
                                  chunk_bytes=round_up(w.chunk_elems * w.param.element_size()))
            self._write_tier(w, w.param.detach().reshape(-1))

    # -- hooks ---------------------------------------------------------------------------------------
    def _before_forward(self, i: int) -> None:
        with self._lock:
            if in_backward():  # activation checkpointing re-runs the block: its backward follows at once
                self._materialize(i)
                return
            if i == 0:  # a new pass: nothing from an earlier one is needed on the device any more
                self._callback_queued = False
                for j, unit in self._units.items():
                    if j > self.k:
                        self._release(unit)
            self._materialize(i)
            for j in range(i + 1, i + self.k + 1):
                if not self._prefetch(j):
                    break

    def _after_forward(self, i: int, out: Any) -> None:
        with self._lock:
            if out is None:  # the block raised (``always_call``): let nothing stay materialised
                self.release_all()
                return
            if in_backward():
                return
            if not torch.is_grad_enabled() or i < len(self.blocks) - self.k:
                if i in self._units:
                    self._release(self._units[i])
            first = first_tensor(out)
            if torch.is_grad_enabled() and first is not None and first.requires_grad:
                # Fires when the gradient of the block's output is ready: backward enters the block.
                first.register_hook(lambda grad: self._enter_backward(i))

    def _enter_backward(self, i: int) -> None:
        with self._lock:
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            if i + 1 in self._units:  # block i+1's backward is over
                self._release(self._units[i + 1])
            self._materialize(i)
            for j in range(i - 1, i - self.k - 1, -1):
                if j < 0 or not self._prefetch(j):
                    break

    def _backward_done(self) -> None:
        with self._lock:
            self._callback_queued = False
            self.release_all()

    # -- moving bytes --------------------------------------------------------------------------------
    def _chunks(self, unit: _Block) -> list[tuple[_Weight, int, int]]:
        return [(w, k, w.span(k)[1] * w.param.element_size()) for w in unit.weights for k in range(w.nchunks)]

    def _prefetch(self, i: int) -> bool:
        """Start putting block ``i`` on the device ahead: SSD reads into staging buffers (only if the pool has
        room now; never waits), then the copy on the upload thread. False: no room, or its updates pending."""
        unit = self._units.get(i)
        if unit is None or unit.resident:
            return True
        if self.updates is not None and self.updates.pending(unit.trainable):
            return False  # its tier copies are still being updated: its forward reads them once they landed
        reads = None
        if unit.tier is Tier.SSD:
            bufs = self._staging(unit, wait=False)  # never wait here: our own reads may hold the pool
            if bufs is None:
                return False
            reads = self._read(unit, bufs)
        self._count_resident(unit)  # the device bytes are taken from now on
        unit.upload = self._uploader.submit(self._upload, unit, reads)
        self.stats.prefetched += 1
        return True

    def _staging(self, unit: _Block, *, wait: bool) -> list[HostBuffer] | None:
        """A pool buffer per chunk of the block's SSD copies: waiting up to ``io_timeout`` for them, or
        (``wait=False``) only if they fit now beside the optimizer's share, else ``None``."""
        bufs: list[HostBuffer] = []
        complete = False
        try:
            for _w, _k, nbytes in self._chunks(unit):
                buf = (self.store.pool.acquire(nbytes, timeout=self.timeout) if wait
                       else self.store.pool.try_acquire(nbytes, keep_free=self._keep_free))
                if buf is None:
                    return None
                bufs.append(buf)
            complete = True
            return bufs
        finally:
            if not complete:
                for b in bufs:
                    b.release()

    def _read(self, unit: _Block, bufs: list[HostBuffer]) -> list[tuple[_Weight, int, Future]]:
        # Each future gives its buffer back, or releases it on failure.
        return [(w, k, self.store.read_chunk(w.entry, k, into=buf, prefix=nbytes if w.master else None))
                for (w, k, nbytes), buf in zip(self._chunks(unit), bufs)]

    def _wait_reads(self, unit: _Block, reads: list[tuple[_Weight, int, Future]]) -> list[tuple[_Weight, int, HostBuffer]]:
        """The block's finished SSD reads; on any failure every buffer is given back and the error raised."""
        done, error = [], None
        for w, k, fut in reads:
            try:
                if error is None:
                    done.append((w, k, fut.result(timeout=self.timeout)))
                    continue
            except FutureTimeout:
                error = TimeoutError(f"weights of block {unit.index}: the read of store entry {w.entry!r} "
                                     f"({format_bytes(w.nbytes)}) took over {self.timeout:.0f} s")
            except BaseException as exc:  # noqa: BLE001 - raised once every buffer is accounted for
                error = exc
            fut.add_done_callback(_release_read)
        if error is not None:
            for _w, _k, buf in done:
                buf.release()
            raise error
        return done

    def _upload(self, unit: _Block, reads: list[tuple[_Weight, int, Future]] | None) -> None:
        """Fill the block's device storage from its host copies or its SSD reads (any thread)."""
        try:
            done = self._wait_reads(unit, reads) if reads is not None else []
        except BaseException:
            for w in unit.weights:
                w.param.untyped_storage().resize_(0)
            raise
        try:
            for w in unit.weights:
                resize_for_copies(w.param, w.nbytes)  # from the copy stream's memory (device.py says why)
            for w in unit.weights if unit.tier is Tier.HOST else ():
                transfer(w.flat(), w.host.view(w.dtype)[: w.numel])
            for w, k, buf in done:
                start, n = w.span(k)
                transfer(w.flat()[start: start + n], buf.view(w.dtype)[:n])
        except BaseException:
            for w in unit.weights:
                w.param.untyped_storage().resize_(0)
            raise
        finally:
            for _w, _k, buf in done:
                buf.release()

    def _count_resident(self, unit: _Block) -> None:
        unit.resident = True
        if self._active:
            self.stats.reads += 1
            self.stats.materialized_bytes += unit.nbytes
            self.stats.high_water_bytes = max(self.stats.high_water_bytes, self.stats.materialized_bytes)
            self.meter.add(unit.nbytes)

    def _wait_upload(self, unit: _Block) -> None:
        """Wait for the block's upload; it may not be left running (its storage is about to be used or freed)."""
        try:
            unit.upload.result(timeout=self.timeout)
        except FutureTimeout:
            raise TimeoutError(f"weights of block {unit.index}: putting {format_bytes(unit.nbytes)} on the device "
                               f"took over {self.timeout:.0f} s (the SSD reads or the copy are stuck)") from None
        finally:
            if unit.upload.done():
                unit.upload = None

    def _materialize(self, i: int) -> None:
        """Block ``i``'s weights on the device now: its upload waited for, or done here."""
        unit = self._units.get(i)
        if unit is None:
            return
        with trace.span("waits", f"weights of block {i} ({unit.tier.value})"):
            self._materialize_unit(unit)

    def _materialize_unit(self, unit: _Block) -> None:
        if unit.upload is not None:
            try:
                self._wait_upload(unit)
            except BaseException:
                if unit.upload is None:  # it failed (and freed the storage): count it released
                    self._release(unit)
                raise
        elif not unit.resident:
            if self.updates is not None:
                self.updates.wait(unit.trainable)
            reads = self._read(unit, self._staging(unit, wait=True)) if unit.tier is Tier.SSD else None
            self._upload(unit, reads)
            self._count_resident(unit)
        for w in unit.weights:
            claim_for_current_stream(w.param, w.name)

    def _release(self, unit: _Block) -> None:
        """Free the block's device bytes (an upload in flight is waited for first)."""
        if unit.upload is not None:
            try:
                self._wait_upload(unit)
            except TimeoutError:
                raise
            except BaseException:  # noqa: BLE001 - the bytes are not needed; a later read reports a real fault
                pass
        if unit.resident:
            for w in unit.weights:
                w.param.untyped_storage().resize_(0)
            unit.resident = False
            if self._active:
                self.stats.materialized_bytes -= unit.nbytes
                self.meter.sub(unit.nbytes)

    def release_all(self) -> None:
        """Free every streamed block's device bytes (after an exception, or a forward never run backward)."""
        with self._lock:
            for unit in self._units.values():
                self._release(unit)

    def move_to(self, device: torch.device) -> None:
        """Make ``device`` the streamed weights' home, every block released to an empty tensor there, so a
        framework moving the module (Lightning's ``module.cpu()``) never copies a released storage (on an
        accelerator, from a null pointer). Between steps, with no update in flight."""
        with self._lock:
            for unit in self._units.values():
                self._release(unit)  # waits for an upload in flight
                for w in unit.weights:
                    if w.param.device != device:
                        empty = torch.empty(w.param.shape, dtype=w.dtype, device=device)
                        empty.untyped_storage().resize_(0)
                        w.param.data = empty
            self.device = device

    # -- the optimizer's side --------------------------------------------------------------------------
    def streams(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param`` is a trainable parameter whose value lives in a tier copy."""
        return param in self._weights

    def publish(self, param: torch.nn.Parameter, k: int, values: torch.Tensor) -> Future | None:
        """Make ``values`` chunk ``k`` of trainable ``param``'s tier copy (cast to its dtype), once its gradient
        is final. Returns the SSD write's future, or ``None`` (host tier: copied at once)."""
        w = self._weights[param]
        start, n = w.span(k)
        if w.master:  # the update writes ``values`` into the state chunk this copy is the head of
            return None
        if w.host is not None:
            w.host.view(w.dtype)[start: start + n].copy_(values)
            return None
        buf = self.store.pool.acquire(n * param.element_size(), timeout=self.timeout)
        buf.view(w.dtype)[:n].copy_(values)
        return self.store.write_chunk(w.entry, k, buf)

    def use_master(self, param: torch.nn.Parameter, entry: str, chunk_elems: int) -> bool:
        """Let trainable ``param``'s SSD copy be the fp32 master at the head of each chunk of state entry ``entry``
        (call once the master is written) and delete its own: 4 bytes per parameter less on the SSD and per
        step. Only an fp32 SSD weight chunked like the state (``chunk_elems``) qualifies; returns whether it
        did. Between steps."""
        w = self._weights.get(param)
        if (w is None or w.master or w.entry is None or w.dtype != torch.float32
                or w.chunk_elems != min(chunk_elems, w.numel)):
            return False
        with self._lock:
            unit = self._units[w.block]
            if unit.upload is not None:
                self._wait_upload(unit)
            old, w.entry, w.master = w.entry, entry, True
            self.store.delete(old)
            self.stats.from_master += 1
        return True

    def value(self, param: torch.nn.Parameter) -> torch.Tensor:
        """Streamed ``param``'s value, from its tier copy (a new CPU tensor)."""
        return self._tier_copy(self._all[param])

    @property
    def device_peak_bytes(self) -> int:
        """The most bytes of weights and gradients on the device at once so far (`DeviceMeter`)."""
        return self.meter.high_water

    def streamed(self) -> list[torch.nn.Parameter]:
        """Every streamed parameter (frozen and trainable), in block order."""
        return list(self._all)

    def assign(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Make ``value`` streamed ``param``'s tier copy (data parallelism's non-owners take their owner's weights).
        Any thread, without the streamer's lock (the training thread may hold it waiting for this weight); the
        block's reads wait for it through ``updates``."""
        w = self._all[param]
        self._write_tier(w, value.reshape(-1))
        if self._units[w.block].resident:  # e.g. kept from a forward that had no backward: its bytes too
            transfer(w.flat(), value.reshape(-1), after_compute=True)  # kernels queued may still read them

    def _write_tier(self, w: _Weight, source: torch.Tensor) -> None:
        """Overwrite the weight's tier copy with ``source`` (flat, any device; returns once written)."""
        if w.host is not None:
            w.host.view(w.dtype)[: w.numel].copy_(source)
        elif w.master:  # the head of each state chunk, the moments kept: read, overwrite, write back
            for k in range(w.nchunks):
                start, n = w.span(k)
                buf = self.store.read_chunk(w.entry, k, timeout=self.timeout).result(timeout=self.timeout)
                buf.view(torch.float32)[:n].copy_(source[start: start + n])
                self.store.write_chunk(w.entry, k, buf).result(timeout=self.timeout)
        else:
            self.store.write(w.entry, source, timeout=self.timeout).result(timeout=self.timeout)

    # -- state dicts -----------------------------------------------------------------------------------
    def _tier_copy(self, w: _Weight) -> torch.Tensor:
        """The weight's value from its tier copy, as a new CPU tensor."""
        if w.host is not None:
            return w.host.view(w.dtype)[: w.numel].clone().view(w.param.shape)
        if w.master:
            out = torch.empty(w.numel, dtype=w.dtype)
            for k in range(w.nchunks):
                start, n = w.span(k)
                with self.store.read_chunk(w.entry, k, prefix=4 * n, timeout=self.timeout).result(
                        timeout=self.timeout) as buf:
                    out[start: start + n].copy_(buf.view(torch.float32)[:n])
            return out.view(w.param.shape)
        return self.store.read(w.entry, timeout=self.timeout).result(timeout=self.timeout).view(w.param.shape)

    def _state_dict_hook(self, unit: _Block) -> Any:
        def hook(module: torch.nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
            with self._lock:
                if unit.resident or not self._active:
                    return
                for w in unit.weights:
                    if prefix + w.name in state:  # a released weight is served from its tier copy, on the CPU
                        state[prefix + w.name] = self._tier_copy(w)
        return hook

    def _load_begin(self, unit: _Block) -> None:
        """Before ``load_state_dict`` reaches the block: its weights are there to be copied into."""
        with self._lock:
            self._materialize(unit.index)

    def _load_end(self, unit: _Block) -> None:
        """After the block loaded: the loaded values become the tier copies; the block is released."""
        with self._lock:
            for w in unit.weights:
                self._write_tier(w, w.flat())
            self._release(unit)

    # -- removing --------------------------------------------------------------------------------------
    def uninstall(self, *, force: bool = False) -> None:
        """Remove the hooks and make every streamed weight resident again, bitwise its tier copy: on its device,
        or, with a warning, on the CPU for blocks that no longer fit there."""
        if not self._active and not force:
            return
        with self._lock:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self._active = False
            on_host = 0
            for unit in self._units.values():
                if unit.upload is not None:
                    self._release(unit)  # waits for the upload in flight
                copies = all(w.host is not None or w.entry in self.store.entries for w in unit.weights)
                if not unit.resident and copies:
                    try:
                        self._materialize(unit.index)
                    except torch.OutOfMemoryError:  # the upload freed what it had taken: the block is released
                        for w in unit.weights:
                            w.param.data = self._tier_copy(w)
                        on_host += 1
                for w in unit.weights:
                    if w.host is not None:
                        w.host.release()
                        w.host = None
                    if w.entry is not None and not w.master and w.entry in self.store.entries:
                        self.store.delete(w.entry)  # a master belongs to the optimizer's state
                    w.entry, w.master = None, False
            if on_host:
                warnings.warn(f"fuyou: {on_host} of {len(self._units)} streamed blocks did not fit on {self.device} at "
                              "the end of training and are resident on the CPU instead (their final weights, bitwise): "
                              "move the model to one device yourself before using it", RuntimeWarning, stacklevel=3)
            self._units = {}
            self._all = {}
            self._weights = {}
            self.stats.materialized_bytes = 0
            self.meter.sub(self.meter.now)
            if self._uploader is not None:
                self._uploader.shutdown(wait=True)  # every upload was waited for above
                self._uploader = None

    def _shares(self) -> HostShares:
        """The host budget's split now (the memory tiers', which a plan may have changed)."""
        return self.memory.shares if self.memory is not None else host_budget_split(self.config)

    def close(self) -> None:
        """`uninstall`, and close the memory tiers if the streamer built them."""
        self.uninstall()
        if self._own_memory:
            self.memory.close()


def _release_read(fut: Future) -> None:
    """Done-callback of a weight read nobody will use: give its buffer back."""
    if not fut.cancelled() and fut.exception() is None:
        fut.result().release()
