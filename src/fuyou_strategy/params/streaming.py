"""`WeightStreamer`: a block's frozen weights are on the device only while the block runs.

::

    streamer = WeightStreamer(model, FuyouConfig(weights="ssd"), store=store)
    streamer.install()          # copies the frozen weights to their tier, frees their device memory
    ...                         # train / evaluate as usual
    streamer.close()            # every weight resident again, equal to the original bits

Only *frozen* parameters (``requires_grad=False`` at install, e.g. a LoRA base model) of the
repeated blocks are streamed, read-only: their tier copy is written once at install and never
written back. A block's trainable parameters (LoRA adapters), parameters outside the blocks
(embeddings, final norm, head) and parameters shared by two places (tied weights) stay resident.

Mechanism (FSDP's): a weight is released with ``p.untyped_storage().resize_(0)`` and
rematerialised with ``resize_(nbytes)`` and a copy through ``p.data``. The storage object stays
the same, so every tensor autograd saved for backward (the weight, ``w.t()``) sees the bytes
again; a ``.data`` copy does not bump the parameter's version counter, so autograd does not
refuse them. Reading a released weight outside the hooks is undefined (on the CPU it can crash):
`state_dict` is served from the tier copies, `load_state_dict` into a streamed block is refused.

Schedule with ``k = config.weight_prefetch_blocks``:

- forward of block ``i``: wait for its weights, issue reads for blocks ``i+1 … i+k``; after the
  block, release its weights unless it is one of the last ``k`` blocks (backward needs them first,
  when grad is enabled). The first block's forward releases whatever an earlier pass left.
- backward entering block ``i`` (the gradient of its output is ready): release block ``i+1``,
  wait for block ``i``, issue reads for ``i-1 … i-k``; the end of backward releases the rest.
- an exception inside a block's forward releases everything.

So the device holds at most ``k + 1`` blocks' streamed weights (``window_bytes``); the streamer
counts the bytes materialised and their high-water mark (`stats`). Host copies ("host" tier)
and the staging buffers of SSD reads come from the store's host buffer pool.
"""

from __future__ import annotations

import enum
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..activations.blocks import discover_blocks, resolve_per_block
from ..activations.swap import first_tensor
from ..config import ConfigError, FuyouConfig, format_bytes, host_budget_split
from ..storage import HostBuffer, TensorStore, round_up

__all__ = ["Tier", "WeightStreamer", "StreamStats"]

_ALIGN = 64  # each weight's offset in its block's packed bytes: any dtype can view it


class Tier(str, enum.Enum):
    """Where a block's frozen weights live while the block is not running."""

    DEVICE = "device"  # resident, left alone
    HOST = "host"  # a buffer of the host pool
    SSD = "ssd"  # an entry of the tensor store, read through a pool buffer


@dataclass
class StreamStats:
    """Counters over the streamer's lifetime; bytes are the weights' own sizes."""

    streamed_bytes: int = 0  # frozen weight bytes of streamed blocks (their sum over blocks)
    resident_bytes: int = 0  # parameter and buffer bytes that stay on the device
    window_bytes: int = 0  # the most streamed bytes on the device at once: the k + 1 largest blocks
    materialized_bytes: int = 0  # streamed bytes on the device now
    high_water_bytes: int = 0  # the most streamed bytes ever on the device at once
    reads: int = 0  # block materialisations
    prefetched: int = 0  # SSD reads issued ahead of their block
    tiers: dict[int, str] = field(default_factory=dict)  # block index -> tier, streamed blocks only


class _Block:
    """One block's streamed weights: their layout in the packed bytes and where the bytes are."""

    def __init__(self, index: int, tier: Tier, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        self.index, self.tier, self.params = index, tier, params
        self.offsets: list[int] = []
        offset = 0
        for _, p in params:
            self.offsets.append(offset)
            offset = round_up(offset + _nbytes(p), _ALIGN)
        self.nbytes = offset
        self.host: HostBuffer | None = None  # the host tier's copy
        self.entry: str | None = None  # the SSD tier's store entry
        self.read: Future | None = None  # an SSD read in flight: its result is a pool buffer
        self.resident = True  # the weights' device storage holds their bytes

    def packed(self) -> torch.Tensor:
        """The weights' bytes in the block's layout (a new CPU tensor)."""
        out = torch.zeros(self.nbytes, dtype=torch.uint8)
        for (_, p), offset in zip(self.params, self.offsets):
            out[offset: offset + _nbytes(p)].copy_(p.detach().reshape(-1).view(torch.uint8).cpu())
        return out

    def weights_from(self, raw: torch.Tensor) -> list[tuple[str, torch.nn.Parameter, torch.Tensor]]:
        """(relative name, parameter, its bytes in ``raw`` viewed as the parameter)."""
        return [(name, p, raw[offset: offset + _nbytes(p)].view(p.dtype).view(p.shape))
                for (name, p), offset in zip(self.params, self.offsets)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (e.g. recomputing a checkpointed block)."""
    return torch._C._current_graph_task_id() != -1


class WeightStreamer:
    """Streams the repeated blocks' frozen weights from host memory or SSD; see the module docstring.

    Args:
        model: the model; its repeated blocks are found by `discover_blocks` (or ``config.blocks``).
        config: ``weights`` (a tier for all blocks or ``{index: tier}``), ``weight_prefetch_blocks``,
            ``device_memory_budget`` (checked at install: resident bytes plus the window must fit)
            and the storage knobs.
        store: the tensor store (and its host pool) to use, e.g. the optimizer's; by default the
            streamer makes its own and closes it in `close()`.
        blocks: the blocks, in forward order, instead of discovering them.

    Raises `ConfigError` at `install` when the host tier or the staging buffers cannot fit
    ``host_memory_budget``, or the window cannot fit ``device_memory_budget``.
    """

    def __init__(self, model: torch.nn.Module, config: FuyouConfig | None = None, *, store: TensorStore | None = None,
                 blocks: list[torch.nn.Module] | None = None) -> None:
        self.config = config = config if config is not None else FuyouConfig()
        self.model = model
        self.blocks = list(blocks) if blocks is not None else discover_blocks(model, config.blocks)
        self.tiers = resolve_per_block("weights", config.weights, len(self.blocks), Tier, Tier.DEVICE)
        self.k = config.weight_prefetch_blocks
        self.timeout = config.io_timeout  # a weight read, or a wait for a pool buffer, longer than this is an error
        self._own_store = store is None and any(t is not Tier.DEVICE for t in self.tiers)
        self.store = TensorStore(config) if self._own_store else store
        self.stats = StreamStats()
        self._units: dict[int, _Block] = {}
        self._handles: list[Any] = []
        self._lock = threading.RLock()  # backward hooks may run on another thread (CUDA's autograd engine)
        self._callback_queued = False
        self._active = False

    # -- installing --------------------------------------------------------------------------------
    def install(self) -> None:
        """Copy each streamed block's frozen weights to its tier, free their device memory, add the hooks."""
        if self._active:
            raise RuntimeError("WeightStreamer is already installed")
        units = self._plan_units()
        self._check_budgets(units)
        self._units = {}
        try:
            for unit in units.values():
                self._to_tier(unit)
                self._units[unit.index] = unit
                self._release(unit)
        except BaseException:
            self._units.update(units)
            self.uninstall(force=True)
            raise
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(lambda m, args, i=i: self._before_forward(i)))
            self._handles.append(block.register_forward_hook(lambda m, args, out, i=i: self._after_forward(i, out),
                                                             always_call=True))
            if i in self._units:
                self._handles.append(block.register_state_dict_post_hook(self._state_dict_hook(self._units[i])))
                self._handles.append(block.register_load_state_dict_pre_hook(self._refuse_load(i)))
        self.stats.tiers = {i: u.tier.value for i, u in self._units.items()}
        self._active = True

    def _plan_units(self) -> dict[int, _Block]:
        """Per streamed block, its frozen parameters that are safe to release (see the module docstring)."""
        prefixes = {}
        for name, module in self.model.named_modules(remove_duplicate=False):
            for i, block in enumerate(self.blocks):
                if module is block:
                    prefixes.setdefault(i, []).append(name + "." if name else "")
        owners: dict[int, set[int]] = {}  # id(param) -> blocks using it (-1: outside every block)
        storages: dict[int, int] = {}  # storage address -> parameters and buffers using it
        for name, p in self.model.named_parameters(remove_duplicate=False):
            owner = next((i for i, pre in prefixes.items() if any(name.startswith(x) for x in pre)), -1)
            owners.setdefault(id(p), set()).add(owner)
        for t in {id(t): t for t in [*self.model.parameters(), *self.model.buffers()]}.values():
            ptr = t.untyped_storage().data_ptr()
            storages[ptr] = storages.get(ptr, 0) + 1
        units = {}
        for i, (block, tier) in enumerate(zip(self.blocks, self.tiers)):
            if tier is Tier.DEVICE:
                continue
            params = [(name, p) for name, p in block.named_parameters()
                      if not p.requires_grad and owners.get(id(p)) == {i} and p.numel() > 0 and p.is_contiguous()
                      and p.storage_offset() == 0 and p.untyped_storage().nbytes() == _nbytes(p)
                      and storages[p.untyped_storage().data_ptr()] == 1]
            if params:
                units[i] = _Block(i, tier, params)
        return units

    def _check_budgets(self, units: dict[int, _Block]) -> None:
        streamed = {id(p) for u in units.values() for _, p in u.params}
        resident = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in [*self.model.parameters(), *self.model.buffers()] if id(t) not in streamed}
        largest = sorted((u.nbytes for u in units.values()), reverse=True)
        s = self.stats
        s.streamed_bytes = sum(largest)
        s.resident_bytes = sum(resident.values())
        s.window_bytes = sum(largest[: self.k + 1])
        budget = self.config.device_memory_budget
        if budget is not None and s.resident_bytes + s.window_bytes > budget:
            raise ConfigError(
                f"device_memory_budget: got {format_bytes(budget)}, but the resident weights "
                f"({format_bytes(s.resident_bytes)}) plus {self.k + 1} streamed blocks' weights "
                f"({format_bytes(s.window_bytes)}) need {format_bytes(s.resident_bytes + s.window_bytes)}; raise "
                "device_memory_budget, lower weight_prefetch_blocks, or stream more blocks (weights='ssd')"
            )
        if not units:
            return
        pool = self.store.pool
        host = sum(round_up(u.nbytes) for u in units.values() if u.tier is Tier.HOST)
        staging = max((round_up(u.nbytes) for u in units.values() if u.tier is Tier.SSD), default=0)
        # Weights draw on the share host-policy activations would otherwise use: the optimizer's
        # read-ahead and the activation staging keep theirs (`host_budget_split`).
        free = min(host_budget_split(self.config).host_activations, pool.budget - pool.lent)
        if host + staging > free:
            raise ConfigError(
                f"host_memory_budget: the host tier needs {format_bytes(host)} and SSD reads a staging buffer of "
                f"{format_bytes(staging)}, but only {format_bytes(free)} of {format_bytes(pool.budget)} is left after "
                "the optimizer's and the activations' shares (host_budget_split); raise host_memory_budget or put "
                "fewer blocks on the host tier (weights={block: 'ssd'})"
            )

    def _to_tier(self, unit: _Block) -> None:
        packed = unit.packed()
        if unit.tier is Tier.HOST:
            unit.host = self.store.pool.acquire(unit.nbytes, timeout=self.timeout)
            unit.host.view().copy_(packed)
        else:
            name = f"weights.{unit.index}"
            # One chunk: a block's weights are read whole into one staging buffer (the engine still
            # splits the transfer over the directory's I/O threads; blocks alternate directories).
            self.store.create(name, (unit.nbytes,), torch.uint8, slots=1, chunk_bytes=round_up(unit.nbytes))
            unit.entry = name
            self.store.write(name, packed, timeout=self.timeout).result(timeout=self.timeout)

    # -- hooks ---------------------------------------------------------------------------------------
    def _before_forward(self, i: int) -> None:
        with self._lock:
            if _in_backward():  # activation checkpointing re-runs the block: its backward follows at once
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
            if _in_backward():
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
    def _prefetch(self, i: int) -> bool:
        """Issue the read of block ``i``'s SSD copy if there is a staging buffer now; False if not."""
        unit = self._units.get(i)
        if unit is None or unit.resident or unit.tier is not Tier.SSD or unit.read is not None:
            return True
        buf = self.store.pool.try_acquire(unit.nbytes)  # never wait here: our own reads may hold the pool
        if buf is None:
            return False
        self._read(unit, buf)
        self.stats.prefetched += 1
        return True

    def _read(self, unit: _Block, buf: HostBuffer) -> None:
        # One chunk per block (see `_to_tier`): the future gives ``buf`` back, or releases it on failure.
        unit.read = self.store.read_chunk(unit.entry, 0, into=buf)

    def _take_read(self, unit: _Block) -> HostBuffer:
        """Wait for the block's SSD read (issuing it now if it was not); the caller releases the buffer."""
        if unit.read is None:
            self._read(unit, self.store.pool.acquire(unit.nbytes, timeout=self.timeout))
        read, unit.read = unit.read, None
        try:
            return read.result(timeout=self.timeout)
        except FutureTimeout:
            read.add_done_callback(lambda f: f.exception() is None and f.result().release())
            raise TimeoutError(f"weights of block {unit.index}: the read of store entry {unit.entry!r} "
                               f"({format_bytes(unit.nbytes)}) took over {self.timeout:.0f} s") from None

    def _materialize(self, i: int) -> None:
        unit = self._units.get(i)
        if unit is None or unit.resident:
            return
        buf = unit.host if unit.tier is Tier.HOST else self._take_read(unit)
        try:
            for _, p, src in unit.weights_from(buf.view()):
                p.untyped_storage().resize_(_nbytes(p))
                p.data.copy_(src)  # through .data: the version counter autograd checks is not bumped
        finally:
            if unit.tier is Tier.SSD:
                buf.release()
        unit.resident = True
        if self._active:
            self.stats.reads += 1
            self.stats.materialized_bytes += unit.nbytes
            self.stats.high_water_bytes = max(self.stats.high_water_bytes, self.stats.materialized_bytes)

    def _release(self, unit: _Block) -> None:
        """Free the block's device bytes; a read in flight is waited for and its buffer returned."""
        if unit.read is not None:
            read, unit.read = unit.read, None
            try:
                read.result(timeout=self.timeout).release()
            except Exception:  # noqa: BLE001 - the bytes are not needed; a later read reports a real fault
                pass
        if unit.resident:
            for _, p in unit.params:
                p.untyped_storage().resize_(0)
            unit.resident = False
            if self._active:
                self.stats.materialized_bytes -= unit.nbytes

    def release_all(self) -> None:
        """Free every streamed block's device bytes (after an exception, or a forward never run backward)."""
        with self._lock:
            for unit in self._units.values():
                self._release(unit)

    # -- state dicts -----------------------------------------------------------------------------------
    def _state_dict_hook(self, unit: _Block) -> Any:
        def hook(module: torch.nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
            with self._lock:
                if unit.resident or not self._active:
                    return
                buf = unit.host if unit.tier is Tier.HOST else None
                if buf is None:
                    raw = self.store.read(unit.entry, timeout=self.timeout).result(timeout=self.timeout)
                for name, p, src in unit.weights_from(buf.view() if buf is not None else raw):
                    if prefix + name in state:  # a released weight is served from its tier copy, on the CPU
                        state[prefix + name] = src.clone()
        return hook

    def _refuse_load(self, i: int) -> Any:
        def hook(module: torch.nn.Module, state: dict, prefix: str, *args: Any) -> None:
            names = [prefix + name for name, _ in self._units[i].params]
            if any(n in state for n in names):
                raise ConfigError(f"weights: block {i} streams its frozen weights ({self._units[i].tier.value} tier), "
                                  "so loading a state dict into them is not supported yet; load the weights before "
                                  "the streamer is installed, or use weights='device'")
        return hook

    # -- removing --------------------------------------------------------------------------------------
    def uninstall(self, *, force: bool = False) -> None:
        """Remove the hooks and make every streamed weight resident again (bitwise its original bytes)."""
        if not self._active and not force:
            return
        with self._lock:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self._active = False
            for unit in self._units.values():
                if unit.read is not None:
                    self._release(unit)  # returns the buffer of a read in flight
                if not unit.resident and (unit.host is not None or unit.entry in self.store.entries):
                    self._materialize(unit.index)
                if unit.host is not None:
                    unit.host.release()
                    unit.host = None
                if unit.entry is not None and unit.entry in self.store.entries:
                    self.store.delete(unit.entry)
                unit.entry = None
            self._units = {}
            self.stats.materialized_bytes = 0

    def close(self) -> None:
        """`uninstall`, and close the store if the streamer made it."""
        self.uninstall()
        if self._own_store and self.store is not None:
            self.store.close()
