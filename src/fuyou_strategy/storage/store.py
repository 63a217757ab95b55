"""`TensorStore`: named, fixed-size tensor entries on the SSD tier, with two slots each.

An entry is split into chunks of ``chunk_size`` bytes (the last shorter), striped over the swap
directories: chunk ``k`` lives in directory ``(first + k) % D``. In each directory an entry owns one
contiguous region, ``[slot 0 chunks][slot 1 chunks]``, each chunk padded to 4 KiB for ``O_DIRECT``.
Freed regions merge on a first-fit free list, so entries of varying size reuse the file.

Two slots make speculative updates safe: the optimizer reads the *active* slot and writes the
*shadow*; `commit` flips them once every chunk is on disk, `rollback` discards the shadow. A slot is
readable only once all its chunks were written successfully.

An ``in_memory`` entry (moved by `to_memory` and `to_ssd`) keeps both slots in host RAM behind the same
interface and bookkeeping (a speculative update borrows its shadow slot's memory: `LentChunk`). That
memory is lent by the pool, so it counts in ``host_memory_budget``; all in-memory entries together stay
within `memory_limit` (set by `MemoryTiers`, raised by `allow_in_memory`).

An entry on a device (``device=``, moved by `to_device` and `to_ssd`) keeps both slots in that device's memory
(`DeviceMemory`, outside the pool) behind the same interface: lent in place like an in-memory entry, copied to
and from host buffers by `device.transfer` (the late-copy test mode delays those copies). All device entries
together stay within `device_limit` (`allow_on_device`). On the CPU the device is host RAM, and the same code
runs.
"""

from __future__ import annotations

import bisect
import os
import shutil
import threading
import time
import weakref
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch

from ..config import PAGE, FuyouConfig, format_bytes, settled
from ..device import transfer
from .aio import IOEngine, SwapFile, completed, gather, then
from .pool import HostBuffer, HostBufferPool, round_up
from .rundir import make_run_dir, remove_run_dir

__all__ = ["StorageError", "StorageSpaceError", "Entry", "DeviceMemory", "LentChunk", "TensorStore", "ACTIVE", "SHADOW"]

ACTIVE = "active"
SHADOW = "shadow"


class StorageError(RuntimeError):
    """An entry cannot be used as asked (unknown, never written, a failed write, ...)."""


class StorageSpaceError(StorageError, OSError):
    """A swap directory has too little free space; the message says needed vs available."""


@dataclass(eq=False)
class Entry:
    """Where an entry's chunks live and which of its two slots is active."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    chunk_bytes: int
    nchunks: int
    first_dir: int
    num_dirs: int
    base: dict[int, int]  # directory index -> offset of this entry's region in that dir's file
    count: dict[int, int]  # directory index -> chunks of this entry in that directory
    slots: int = 2
    active: int = 0
    written: list[set[int]] = field(default_factory=lambda: [set(), set()])
    failed: list[str | None] = field(default_factory=lambda: [None, None])
    inflight: list[int] = field(default_factory=lambda: [0, 0])
    writing: list[dict[int, int]] = field(default_factory=lambda: [{}, {}])  # chunk -> writes in flight, per slot
    version: list[int] = field(default_factory=lambda: [0, 0])  # writes begun into each slot, ever (`slot_version`)
    # Chunks of each slot that `commit(writes_behind=True)` made active while their write was in flight: a read
    # of one waits for it to land (`_wait_behind`); a chunk leaves the set when its last write ends.
    behind: list[set[int]] = field(default_factory=lambda: [set(), set()])
    memory: list[HostBuffer] | None = None  # in_memory or on a device: each physical slot's chunks, padded like on disk
    device: torch.device | None = None  # on a device (`DeviceMemory`): which; None: host RAM or the SSD
    lent: dict = field(default_factory=dict)  # in_memory: chunk -> its open `LentChunk` (shadow slot), under the lock

    @property
    def stride(self) -> int:
        return round_up(self.chunk_bytes)

    @property
    def footprint(self) -> int:
        """Bytes of every slot's chunks, with padding: on the SSD, or in memory."""
        return self.slots * self.nchunks * self.stride

    def chunk_len(self, k: int) -> int:
        return min(self.chunk_bytes, self.nbytes - k * self.chunk_bytes)

    def chunk_memory(self, k: int, slot: int) -> torch.Tensor:
        """The bytes of chunk ``k`` in physical slot ``slot`` of an in-memory entry; made once and kept with the
        slot's memory (`HostBuffer.kept`)."""
        memory = self.memory[slot]
        return memory.kept((k, "chunk"), lambda: memory.data[k * self.stride : k * self.stride + self.chunk_len(k)])

    def chunk_view(self, k: int, slot: int, dtype: torch.dtype) -> torch.Tensor:
        """`chunk_memory` as ``dtype``, kept likewise (a `LentChunk`'s `view` and `source_as`)."""
        if dtype == torch.uint8:
            return self.chunk_memory(k, slot)
        memory = self.memory[slot]
        made = memory.known((k, dtype))
        return made if made is not None else memory.kept((k, dtype), lambda: self.chunk_memory(k, slot).view(dtype))

    def chunk_buffer(self, k: int, slot: int) -> torch.Tensor:
        """`chunk_memory` rounded up to a page, as a pool buffer for the chunk would be (what a `LentChunk` holds)."""
        memory = self.memory[slot]
        made = memory.known((k, "buffer"))
        return made if made is not None else memory.kept(
            (k, "buffer"), lambda: memory.data[k * self.stride : k * self.stride + round_up(self.chunk_len(k))])

    def location(self, k: int, slot: int) -> tuple[int, int]:
        """(directory index, file offset) of chunk ``k`` in physical slot ``slot``."""
        d = (self.first_dir + k) % self.num_dirs
        return d, self.base[d] + (slot * self.count[d] + k // self.num_dirs) * self.stride

    def is_complete(self, slot: int) -> bool:
        return self.failed[slot] is None and self.inflight[slot] == 0 and len(self.written[slot]) == self.nchunks


@dataclass
class _Room:
    """The bytes one kind of memory entry (host RAM, a device) holds, against its limit; changed only under the
    store's lock, where ``held <= limit`` holds except that a lowered limit never drops below what is held."""

    memory: str  # what the bytes are, for messages ("host memory")
    field: str  # the `FuyouConfig` field that sets the limit ("host_state")
    limit: int
    held: int = 0

    def take(self, name: str, need: int, elsewhere: str) -> None:
        """Count ``need`` more bytes for entry ``name`` (under the lock), or raise `StorageSpaceError` saying
        what is left and which field to raise (``elsewhere``: where the entry could go instead)."""
        if self.held + need > self.limit:
            raise StorageSpaceError(
                f"entry {name!r} needs {format_bytes(need)} of {self.memory} but the optimizer state's "
                f"{self.memory.split()[0]} tier ({self.field}) has {format_bytes(self.limit - self.held)} of "
                f"{format_bytes(self.limit)} left; raise {self.field} or keep the entry {elsewhere}")
        self.held += need


class SlotVersion(NamedTuple):
    """`TensorStore.slot_version`'s token: equal tokens mean the slot's bytes did not change in between."""

    entry: Entry
    phys: int  # the physical slot the name resolved to
    writes: int  # writes begun into that slot, ever
    on_ssd: bool


class _FileSpace:
    """Byte ranges in use in one swap file: first fit over sorted, merged free regions below ``tail`` (the
    end of the last region in use); freeing the last region lowers ``tail`` instead."""

    def __init__(self) -> None:
        self.tail = 0
        self.size = 0  # bytes reserved in the file: the high-water mark of ``tail``
        self.free: list[tuple[int, int]] = []  # (start, end), sorted, never touching each other or tail

    def take(self, nbytes: int) -> int | None:
        """The offset of ``nbytes`` in the first free region that holds them, or ``None``."""
        for i, (start, end) in enumerate(self.free):
            if end - start >= nbytes:
                if end - start == nbytes:
                    del self.free[i]
                else:
                    self.free[i] = (start + nbytes, end)
                return start
        return None

    def give(self, offset: int, nbytes: int) -> None:
        """Return ``[offset, offset + nbytes)``, merging it with free neighbours."""
        start, end = offset, offset + nbytes
        i = bisect.bisect(self.free, (start, end))
        if i < len(self.free) and self.free[i][0] == end:
            end = self.free.pop(i)[1]
        if i > 0 and self.free[i - 1][1] == start:
            i -= 1
            start = self.free.pop(i)[0]
        if end == self.tail:
            self.tail = start
        else:
            self.free.insert(i, (start, end))


class _Resources:
    """What must be released even if the store is never closed (run at exit via weakref)."""

    def __init__(self) -> None:
        self.engine: IOEngine | None = None
        self.files: list[SwapFile] = []
        self.run_dirs: list[str] = []  # a temporary parent (swap_dirs=None) goes with its run dir
        self.pool: HostBufferPool | None = None  # only when the store owns it

    def release(self) -> None:
        if self.engine is not None:
            self.engine.close()
            for f in self.files:
                self.engine.close_file(f)
        for path in self.run_dirs:
            remove_run_dir(path)
        if self.pool is not None:
            self.pool.close()
        self.engine, self.files, self.run_dirs, self.pool = None, [], [], None


class TensorStore:
    """Named tensor entries on the SSD tier (layout: module docstring).

    Args:
        config: swap directories, I/O threads, chunk size, direct I/O, preallocation; ``None``: a default
            `FuyouConfig` (a fresh temporary swap directory).
        pool: host buffer pool to stage transfers through; default: one of ``config.host_memory_budget`` bytes.
        memory_limit: bytes all in-memory entries may hold; default ``config.host_state`` if a number, else 0.
        device_limit: bytes all device entries may hold; default ``config.device_state`` if a number, else 0.

    Files live in a 0700 run directory per swap directory, removed by `close()`, ``with``, at exit or on
    SIGTERM (`rundir`).
    """

    def __init__(self, config: FuyouConfig | None = None, *, pool: HostBufferPool | None = None,
                 memory_limit: int | None = None, device_limit: int | None = None) -> None:
        self.config = config = settled(config)
        res = self._res = _Resources()
        self._finalizer = weakref.finalize(self, res.release)
        try:
            for parent in config.swap_dirs or [None]:  # None: a fresh temporary directory
                if parent is not None:
                    parent = rank_path(parent)
                    _check_swap_dir(parent)
                res.run_dirs.append(make_run_dir(parent))
            res.engine = IOEngine(
                res.run_dirs,
                threads_per_dir=config.io_threads,
                block_size=config.io_block_size,
                direct_io=config.direct_io,
            )
            for i in range(len(res.run_dirs)):  # one at a time: a failure closes the files opened before it
                res.files.append(res.engine.open(i, "data.bin"))
            if pool is None:
                pool = res.pool = HostBufferPool(config.host_memory_budget)
        except BaseException:
            self._finalizer()
            raise
        self.pool = pool
        self.engine = res.engine
        self._files = res.files
        self._space = [_FileSpace() for _ in res.files]
        self._entries: dict[str, Entry] = {}
        self._next_dir = 0
        # Bytes of in-memory entries and of device entries, each against its limit (`_Room`: under the lock).
        self._ram = _Room("host memory", "host_state", memory_limit if memory_limit is not None else (
            config.host_state if isinstance(config.host_state, int) else 0))
        self._device = _Room("device memory", "device_state", device_limit if device_limit is not None else (
            config.device_state if isinstance(config.device_state, int) else 0))
        self._lock = threading.Lock()
        # Notified (under the lock) when a chunk committed behind its write lands: readers of it wait on it.
        self._landed = threading.Condition(self._lock)
        self.writes_behind = 0  # chunks committed while their write was in flight, ever (under the lock)
        self.waits_behind = 0  # reads that waited for such a write to land (under the lock)

    # -- entries --------------------------------------------------------------------------------
    @property
    def run_dirs(self) -> list[str]:
        return list(self._res.run_dirs)

    @property
    def entries(self) -> dict[str, Entry]:
        return dict(self._entries)

    @property
    def bytes_on_disk(self) -> int:
        """Bytes reserved in the swap files, to the end of the furthest region ever held (padding and gaps
        included); `delete` keeps space reserved, `to_memory` truncates freed file ends."""
        return sum(space.size for space in self._space)

    @property
    def bytes_in_memory(self) -> int:
        """Bytes the in-memory entries hold (every slot, with padding)."""
        return self._ram.held

    @property
    def memory_limit(self) -> int:
        """Bytes all in-memory entries may hold (`allow_in_memory`)."""
        return self._ram.limit

    def allow_in_memory(self, nbytes: int) -> None:
        """Let in-memory entries hold up to ``nbytes`` in all (never below what they hold)."""
        self._allow(self._ram, nbytes)

    @property
    def bytes_on_device(self) -> int:
        """Bytes the device entries hold (every slot, with padding)."""
        return self._device.held

    @property
    def device_limit(self) -> int:
        """Bytes all device entries may hold (`allow_on_device`)."""
        return self._device.limit

    def allow_on_device(self, nbytes: int) -> None:
        """Let device entries hold up to ``nbytes`` in all (never below what they hold)."""
        self._allow(self._device, nbytes)

    def _allow(self, room: _Room, nbytes: int) -> None:
        with self._lock:
            room.limit = max(nbytes, room.held)

    def _room(self, entry: Entry) -> _Room:
        """The limit an in-memory or device entry's bytes count against."""
        return self._ram if entry.device is None else self._device

    @staticmethod
    def footprint(nbytes: int, chunk_bytes: int, slots: int) -> int:
        """The bytes an entry of ``nbytes`` in chunks of ``chunk_bytes`` takes, every slot, with padding."""
        chunk_bytes = min(chunk_bytes, round_up(nbytes))
        return slots * -(-nbytes // chunk_bytes) * round_up(chunk_bytes)

    def entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise StorageError(f"no entry named {name!r} in the tensor store") from None

    def create(
        self,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        chunk_bytes: int | None = None,
        slots: int = 2,
        in_memory: bool = False,
        device: torch.device | None = None,
    ) -> Entry:
        """Reserve space for a tensor of ``shape`` and ``dtype``; returns its `Entry`.

        ``chunk_bytes``: a multiple of 4 KiB (default ``config.chunk_size``), the unit of striping and of
        `read_chunk`/`write_chunk`. ``slots=1``: no shadow slot (scratch data such as activations).
        ``in_memory``: chunks in host RAM; ``device``: chunks in that device's memory. Raises `StorageSpaceError`
        (bytes needed and available) when a directory, `memory_limit` or `device_limit` is too full.
        """
        self._check_open()
        shape = tuple(int(s) for s in shape)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            raise StorageError(f"entry {name!r}: shape {shape} holds no bytes")
        chunk_bytes = self.config.chunk_size if chunk_bytes is None else chunk_bytes
        if slots not in (1, 2):
            raise StorageError(f"entry {name!r}: slots={slots}; expected 1 or 2")
        if chunk_bytes <= 0 or chunk_bytes % PAGE:
            raise StorageError(f"entry {name!r}: chunk_bytes={chunk_bytes} must be a positive multiple of 4096")
        chunk_bytes = min(chunk_bytes, round_up(nbytes))
        nchunks = -(-nbytes // chunk_bytes)
        if in_memory or device is not None:
            return self._create_in_memory(name, shape, dtype, nbytes, chunk_bytes, nchunks, slots, device)
        with self._lock:
            if name in self._entries:
                raise StorageError(f"entry {name!r} exists already")
            first, base, count = self._place(name, nchunks, chunk_bytes, slots)
            entry = Entry(name, shape, dtype, nbytes, chunk_bytes, nchunks, first, len(self._files), base, count, slots)
            self._entries[name] = entry
        return entry

    def _place(self, name: str, nchunks: int, chunk_bytes: int, slots: int) -> tuple[int, dict[int, int], dict[int, int]]:
        """Reserve an entry's regions, striped from the next directory: (first directory, base offset and
        chunk count per directory). Under the lock; a failure gives back what it reserved."""
        num_dirs = len(self._files)
        first = self._next_dir
        self._next_dir = (self._next_dir + 1) % num_dirs
        count = {d: len(range((d - first) % num_dirs, nchunks, num_dirs)) for d in range(num_dirs)}
        need = {d: slots * c * round_up(chunk_bytes) for d, c in count.items() if c}
        base: dict[int, int] = {}
        try:
            for d, nb in need.items():
                base[d] = self._reserve(d, nb, name)
        except BaseException:
            for d, offset in base.items():
                self._space[d].give(offset, need[d])
            raise
        return first, base, count

    def _create_in_memory(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int,
                          chunk_bytes: int, nchunks: int, slots: int, device: torch.device | None) -> Entry:
        with self._lock:
            if name in self._entries:
                raise StorageError(f"entry {name!r} exists already")
        entry = Entry(name, shape, dtype, nbytes, chunk_bytes, nchunks, 0, 1, {}, {}, slots)
        entry.memory = self._lend_memory(entry) if device is None else self._device_memory(entry, device)
        entry.device = device
        with self._lock:
            self._entries[name] = entry
        return entry

    def _lend_memory(self, entry: Entry, timeout: float | None = None) -> list[HostBuffer]:
        """The pool buffers (one per slot) of an in-memory entry, within `memory_limit`."""
        need = entry.footprint
        with self._lock:
            self._ram.take(entry.name, need, "on the SSD")
        buffers: list[HostBuffer] = []
        try:
            for _ in range(entry.slots):
                buffers.append(self.pool.acquire(entry.nchunks * entry.stride, timeout=timeout))
        except BaseException:
            for buf in buffers:
                buf.release()
            with self._lock:
                self._ram.held -= need
            raise
        return buffers

    def _device_memory(self, entry: Entry, device: torch.device) -> list[HostBuffer]:
        """The memory (one `DeviceMemory` per slot) of an entry on ``device``, within `device_limit`."""
        need = entry.footprint
        with self._lock:
            self._device.take(entry.name, need, "off the device")
        try:
            return [DeviceMemory(torch.empty(entry.nchunks * entry.stride, dtype=torch.uint8, device=device))
                    for _ in range(entry.slots)]
        except BaseException:
            with self._lock:
                self._device.held -= need
            raise

    def to_device(self, name: str, device: torch.device) -> int:
        """Move an entry from the SSD or host RAM into ``device``'s memory (every written chunk, both slots),
        then free where it was; returns the bytes now on the device (0 if there already). Nothing may be in
        flight or lent for it; on failure the entry stays where it was, unchanged."""
        entry = self.entry(name)
        if entry.device is not None:
            return 0
        with self._lock:
            self._wait_all_behind(entry)
            if any(entry.inflight) or entry.lent:
                raise StorageError(f"cannot move entry {name!r} to the device while a write to it is in flight")
            written = [sorted(w) for w in entry.written]
        memory = self._device_memory(entry, device)
        try:
            for phys in range(entry.slots):
                for k in written[phys]:
                    start, length = k * entry.stride, entry.chunk_len(k)
                    target = memory[phys].data[start : start + length]
                    if entry.memory is not None:
                        transfer(target, entry.chunk_memory(k, phys))
                        continue
                    d, offset = entry.location(k, phys)
                    with self.pool.acquire(length, timeout=self.config.io_timeout) as buf:  # the SSD reads into host memory
                        self.engine.read(self._files[d], offset, buf.data).result(timeout=self.config.io_timeout)
                        transfer(target, buf.view())
        except BaseException:
            with self._lock:
                self._device.held -= entry.footprint
            raise
        with self._lock:
            old, entry.memory, entry.device = entry.memory, memory, device
            if old is not None:
                self._ram.held -= entry.footprint
            for d, offset in entry.base.items():
                self._space[d].give(offset, entry.slots * entry.count[d] * entry.stride)
                self._shrink(d)
            entry.base, entry.count = {}, {}
        for buf in old or ():
            buf.release()
        return entry.footprint

    def to_memory(self, name: str, *, timeout: float | None = None) -> int:
        """Move an entry from the SSD into host RAM (every written chunk, both slots), then free its disk
        space (`_shrink`); returns the bytes now in RAM (0 if already there). Nothing may be in flight for
        it; on failure the entry stays on the SSD, unchanged."""
        entry = self.entry(name)
        if entry.memory is not None:
            if entry.device is not None:
                raise StorageError(f"cannot move entry {name!r} from the device to host memory: move it to_ssd first")
            return 0
        with self._lock:
            self._wait_all_behind(entry)
            if any(entry.inflight):
                raise StorageError(f"cannot move entry {name!r} to host memory while a write to it is in flight")
            written = [sorted(w) for w in entry.written]
        memory = self._lend_memory(entry, timeout)
        futures, error = self._copy_slots(entry, memory, written, self.engine.read)
        try:  # every read submitted ends before its memory may be given back
            gather(futures).result(timeout=self.config.io_timeout)
        except FutureTimeout:  # reads may still land in the memory: it stays lent (until close), not reused
            raise StorageError(f"moving entry {name!r} to host memory: the SSD reads took longer than "
                               f"io_timeout={self.config.io_timeout} s") from error
        except BaseException as exc:
            error = error or exc
        if error is not None:
            for buf in memory:
                buf.release()
            with self._lock:
                self._ram.held -= entry.footprint
            raise error
        with self._lock:
            entry.memory = memory
            for d, offset in entry.base.items():
                self._space[d].give(offset, entry.slots * entry.count[d] * entry.stride)
                self._shrink(d)
            entry.base, entry.count = {}, {}
        return entry.footprint

    def to_ssd(self, name: str, *, timeout: float | None = None) -> int:
        """`to_memory`'s inverse: write every written chunk of both slots into new regions of the swap files,
        then give the memory back to the pool; returns the bytes it held in RAM (0 if already on the SSD).
        Nothing may be in flight or lent for it; ``timeout``: seconds to wait for the writes (default
        ``io_timeout``). On failure the entry stays in RAM, unchanged."""
        entry = self.entry(name)
        if entry.memory is None:
            return 0
        with self._lock:
            self._wait_all_behind(entry)
            if any(entry.inflight) or entry.lent:
                raise StorageError(f"cannot move entry {name!r} to the SSD while a write to it is in flight")
            written = [sorted(w) for w in entry.written]
            first, base, count = self._place(name, entry.nchunks, entry.chunk_bytes, entry.slots)
        placed = Entry(name, entry.shape, entry.dtype, entry.nbytes, entry.chunk_bytes, entry.nchunks, first,
                       len(self._files), base, count, entry.slots)  # where the chunks go
        futures, error = self._copy_slots(placed, entry.memory, written, self.engine.write,
                                          staged=entry.device is not None)
        wait = self.config.io_timeout if timeout is None else timeout
        try:  # every write submitted ends before its regions may be given back
            gather(futures).result(timeout=wait)
        except FutureTimeout:  # writes may still land in the regions: they stay reserved (until close), not reused
            raise StorageError(f"moving entry {name!r} to the SSD: the writes took longer than {wait} s "
                               "(io_timeout)") from error
        except BaseException as exc:
            error = error or exc
        with self._lock:
            if error is None:
                entry.first_dir, entry.num_dirs, entry.base, entry.count = first, len(self._files), base, count
                memory, entry.memory = entry.memory, None
                self._room(entry).held -= entry.footprint
                entry.device = None
            else:
                for d, offset in base.items():
                    self._space[d].give(offset, entry.slots * count[d] * entry.stride)
        if error is not None:
            raise error
        for buf in memory:
            buf.release()
        return entry.footprint

    def _copy_slots(self, placed: Entry, memory: list[HostBuffer], written: list[list[int]],
                    submit: Callable[..., Future], *, staged: bool = False) -> tuple[list[Future], BaseException | None]:
        """Submit ``submit(file, offset, chunk memory)`` (`IOEngine.read` or ``write``) for every written chunk
        of every slot between ``memory`` and ``placed``'s regions: (the futures, the error that stopped it).
        ``staged`` (writes from device memory): each chunk is first copied into a pool buffer, given back once
        written."""
        futures, error = [], None
        try:
            for phys in range(placed.slots):
                for k in written[phys]:
                    d, offset = placed.location(k, phys)
                    start = k * placed.stride
                    chunk = memory[phys].data[start : start + round_up(placed.chunk_len(k))]
                    if not staged:
                        futures.append(submit(self._files[d], offset, chunk))
                        continue
                    buf = self.pool.acquire(placed.chunk_len(k), timeout=self.config.io_timeout)
                    try:
                        transfer(buf.view(), chunk[: buf.nbytes])
                        fut = submit(self._files[d], offset, buf.data)
                    except BaseException:
                        buf.release()
                        raise
                    futures.append(then(fut, lambda f, buf=buf: (buf.release(), f.result())[1]))
        except BaseException as exc:
            error = exc
        return futures, error

    def _shrink(self, d: int) -> None:
        """Under the lock: truncate the file past its last region in use. Only `to_memory` does; `delete`
        (every step, for activations) keeps the space for the next entries."""
        space = self._space[d]
        if space.tail < space.size:
            os.ftruncate(self._files[d].fd, space.tail)
            space.size = space.tail

    def drop_shadow(self, name: str) -> int:
        """Keep only the active slot of entry ``name``, which has one slot from then on (`create`'s ``slots=1``): the
        shadow slot's memory goes back (host RAM, a device), or its region of the swap files is given back for later
        entries. No byte is copied: where the second slot is the active one, the entry's first slot becomes where it
        lies. Nothing may be in flight or lent for it. Returns the bytes freed (0 if it had one slot)."""
        entry = self.entry(name)
        with self._lock:
            if entry.slots == 1:
                return 0
            self._wait_all_behind(entry)
            if any(entry.inflight) or entry.lent:
                raise StorageError(f"cannot drop entry {name!r}'s shadow slot while a write to it is in flight")
            keep, freed = entry.active, entry.footprint // 2
            dropped = None
            if entry.memory is not None:
                dropped, entry.memory = entry.memory[1 - keep], [entry.memory[keep]]
                self._room(entry).held -= freed
            for d, offset in entry.base.items():
                region = entry.count[d] * entry.stride  # one slot's chunks in this directory, slot 0's first
                entry.base[d] = offset + keep * region
                self._space[d].give(offset + (1 - keep) * region, region)
            # The kept slot's records become slot 0's; every version token taken before names a slot that no
            # longer holds what it did (`slot_version`), so both counts move past every earlier one.
            version = entry.version[0] + entry.version[1] + 1
            for records, empty in ((entry.written, set()), (entry.failed, None), (entry.inflight, 0),
                                   (entry.writing, {}), (entry.behind, set())):
                records[0], records[1] = records[keep], empty
            entry.version[0] = entry.version[1] = version
            entry.slots, entry.active = 1, 0
        if dropped is not None:
            dropped.release()
        return freed

    def delete(self, name: str) -> None:
        """Forget an entry; later entries reuse its space (see the module docstring)."""
        with self._lock:
            entry = self.entry(name)
            self._wait_all_behind(entry)
            if any(entry.inflight):
                raise StorageError(f"cannot delete entry {name!r} while a write to it is in flight")
            del self._entries[name]
            if entry.memory is not None:
                self._room(entry).held -= entry.footprint
                for buf in entry.memory:
                    buf.release()
            for d, offset in entry.base.items():
                self._space[d].give(offset, entry.slots * entry.count[d] * entry.stride)

    def _reserve(self, d: int, nbytes: int, name: str) -> int:
        space = self._space[d]
        offset = space.take(nbytes)
        if offset is not None:
            return offset
        offset = space.tail
        grow = offset + nbytes - space.size  # the file's end may lie past the tail: reuse that first
        if grow > 0:
            f = self._files[d]
            where = os.path.dirname(f.path)
            free = shutil.disk_usage(where).free
            if not self.config.preallocate and grow > free:
                raise StorageSpaceError(
                    f"entry {name!r} needs {format_bytes(grow)} more in {where} but only {format_bytes(free)} is free; "
                    "free space there, add swap_dirs, or use a larger drive"
                )
            if self.config.preallocate:
                try:
                    os.posix_fallocate(f.fd, space.size, grow)
                except OSError as exc:
                    raise StorageSpaceError(
                        f"entry {name!r} needs {format_bytes(grow)} more in {where} but only {format_bytes(free)} is "
                        f"free ({exc.strerror}); free space there, add swap_dirs, or use a larger drive"
                    ) from exc
            space.size += grow
        space.tail = offset + nbytes
        return offset

    # -- slot bookkeeping ---------------------------------------------------------------------------
    def _slot(self, entry: Entry, slot: str) -> int:
        if slot == ACTIVE:
            return entry.active
        if slot == SHADOW:
            if entry.slots == 1:
                raise StorageError(f"entry {entry.name!r} was created with slots=1: it has no shadow slot")
            return 1 - entry.active
        raise StorageError(f"slot: got {slot!r}; expected 'active' or 'shadow'")

    def slot_version(self, name: str, slot: str = ACTIVE) -> SlotVersion:
        """A token of what ``slot`` of ``name`` holds: equal tokens mean no write began into that physical slot,
        ``slot`` resolved to it and the entry stayed on the SSD in between (`ChunkPipeline.read_ahead`)."""
        with self._lock:
            entry = self.entry(name)
            phys = self._slot(entry, slot)
            return SlotVersion(entry, phys, entry.version[phys], entry.memory is None)

    def _begin_write(self, entry: Entry, phys: int, k: int) -> None:
        with self._lock:
            self._start_write(entry, phys, k)

    @staticmethod
    def _start_write(entry: Entry, phys: int, k: int) -> None:
        """`_begin_write` under the lock."""
        entry.version[phys] += 1
        entry.written[phys].discard(k)
        entry.inflight[phys] += 1
        entry.writing[phys][k] = entry.writing[phys].get(k, 0) + 1

    def _end_write(self, entry: Entry, phys: int, k: int, error: BaseException | None) -> None:
        """A write `_begin_write` began is over: done (``error`` None) or failed with ``error``."""
        with self._lock:
            self._finish_write(entry, phys, k, error)

    def _finish_write(self, entry: Entry, phys: int, k: int, error: BaseException | None) -> None:
        """`_end_write` under the lock."""
        entry.inflight[phys] -= 1
        entry.writing[phys][k] -= 1
        landed = False
        if not entry.writing[phys][k]:
            del entry.writing[phys][k]
            landed = k in entry.behind[phys]
            entry.behind[phys].discard(k)
        if error is None:
            entry.written[phys].add(k)
        elif entry.failed[phys] is None:
            entry.failed[phys] = str(error)
        if landed:  # only a chunk committed behind its write has readers waiting (`_wait_behind`)
            self._landed.notify_all()

    def _wait_behind(self, entry: Entry, phys: int, k: int | None) -> None:
        """Under the lock: wait until chunk ``k`` (None: every chunk) of physical slot ``phys`` has no write in
        flight that `commit` left behind, up to ``io_timeout`` seconds (then `StorageError`)."""
        if _landed_behind(entry.behind[phys], k):  # the usual case: no wait, and no closure made for one
            return
        self.waits_behind += 1
        if not self._landed.wait_for(lambda: _landed_behind(entry.behind[phys], k), timeout=self.config.io_timeout):
            what = f"chunk {k}" if k is not None else f"{len(entry.behind[phys])} chunk(s)"
            raise StorageError(f"entry {entry.name!r}: the write of {what}, committed while in flight, did not land "
                               f"within io_timeout={self.config.io_timeout:g} s; the drive may be hung (check dmesg), "
                               "or raise FuyouConfig.io_timeout")

    def _wait_all_behind(self, entry: Entry) -> None:
        """Under the lock: `_wait_behind` for every chunk of both slots (before the entry moves or goes)."""
        for phys in range(entry.slots):
            self._wait_behind(entry, phys, None)

    def _check_readable(self, entry: Entry, phys: int, k: int | None) -> None:
        with self._lock:
            self._readable(entry, phys, k)

    def _readable(self, entry: Entry, phys: int, k: int | None) -> None:
        """`_check_readable` under the lock."""
        if k is not None and entry.failed[phys] is None and k in entry.written[phys] and k not in entry.writing[phys]:
            return  # the usual case, asked first: written and not being written (so not committed behind a write)
        self._wait_behind(entry, phys, k)
        if entry.failed[phys] is not None:
            raise StorageError(f"entry {entry.name!r}: its last write failed, the data is not valid (resume from the "
                               f"last checkpoint): {entry.failed[phys]}")
        missing = k not in entry.written[phys] if k is not None else len(entry.written[phys]) < entry.nchunks
        busy = entry.inflight[phys] if k is None else k in entry.writing[phys]
        if missing or busy:
            what = f"chunk {k}" if k is not None else "its chunks"
            raise StorageError(f"entry {entry.name!r}: {what} not written yet (or a write is still in flight)")

    # -- chunk I/O ----------------------------------------------------------------------------------
    def read_chunk(self, name: str, k: int, *, slot: str = ACTIVE, timeout: float | None = None,
                   into: HostBuffer | None = None, lend: str | None = None, prefix: int | None = None,
                   skip: int = 0, fill: bool = True) -> Future:
        """Read chunk ``k`` into a pool buffer; the future's result is the `HostBuffer` (``buf.view(dtype)``).

        Args:
            into: a buffer the caller holds, sized for ``chunk_len(k)``; else one is acquired here, waiting up
                to ``timeout`` seconds. The caller owns it once the read succeeds and must `release()` it; a
                failed read (or call) releases it.
            prefix: read only the first ``prefix`` bytes, rounded up to a page (the master weights a
                `WeightStreamer` streams).
            skip: on the SSD, leave the first ``skip`` bytes (rounded down to a page) unread and undefined,
                for a caller that fills them itself (master weights a resident fp32 parameter holds).
            lend: in-memory entries only: lend the chunk's memory (`LentChunk`) instead of copying it.
                ``SHADOW`` copies the active chunk into the shadow slot and lends that; the slot read lends it
                in place. The chunk counts as being written until `write_chunk` takes it back; released
                unwritten, that slot is marked failed (a `rollback` clears a shadow).
            fill: with ``lend=SHADOW``, ``False`` lends the shadow chunk unfilled, the active chunk beside it
                (`LentChunk.source`): for a caller that writes every value of it from the active one (the
                one-pass update reads the active slot and writes the shadow, no copy first).
        """
        try:
            entry = self.entry(name)
            if lend is not None and entry.memory is not None and into is None and prefix is None:
                return completed(self.lend_chunks([(name, k)], slot=slot, lend=lend, fill=fill)[0])  # checks it
            phys = self._slot(entry, slot)
            self._check_readable(entry, phys, k)
            length = entry.chunk_len(k) if prefix is None else min(prefix, entry.chunk_len(k))
            if into is not None:
                self._check_chunk_buffer(entry, k, into, length)
        except BaseException:
            if into is not None:
                into.release()
            raise
        buf = into if into is not None else self.pool.acquire(length, timeout=timeout)
        if entry.memory is not None:  # host RAM or a device: a copy, done when this returns
            try:
                _copy(entry, buf.view(), entry.chunk_memory(k, phys)[:length])
            except BaseException:
                buf.release()
                raise
            return completed(buf)
        d, offset = entry.location(k, phys)
        head = min(skip, length) // PAGE * PAGE
        try:
            inner = self.engine.read(self._files[d], offset + head, buf.data[head:])
        except BaseException:
            buf.release()
            raise

        def done(f: Future) -> HostBuffer:
            try:
                f.result()
            except BaseException:
                buf.release()
                raise
            return buf

        return then(inner, done)

    def lend_chunk(self, name: str, k: int, *, slot: str = ACTIVE, lend: str = ACTIVE, fill: bool = True) -> "LentChunk":
        """`read_chunk`'s ``lend`` of chunk ``k`` of ``slot``, returned rather than as a future: for a caller that
        takes many chunks of an in-memory entry at once. `StorageError` if the entry is on the SSD."""
        return self.lend_chunks([(name, k)], slot=slot, lend=lend, fill=fill)[0]

    def lend_chunks(self, chunks: Sequence[tuple[str, int]], *, slot: str = ACTIVE, lend: str = ACTIVE,
                    fill: bool = True) -> list["LentChunk"]:
        """`lend_chunk` of each ``(name, k)``, in order: the store's lock taken twice for them all, not three
        times a chunk (a run of small parameters lends hundreds of chunks a step, `OptimizerState.group_job`).
        Every chunk is checked before any is lent; a copy that fails (``fill``) gives back every chunk, each
        marked failed, and raises. `StorageError` if an entry is on the SSD."""
        plan = []  # (entry, k, the slot read, the slot lent)
        entries = self._entries
        with self._lock:
            for name, k in chunks:
                entry = entries.get(name) or self.entry(name)  # (raises for a name it lacks)
                src = entry.active if slot == ACTIVE else self._slot(entry, slot)
                self._readable(entry, src, k)
                if entry.memory is None:
                    raise StorageError(f"entry {name!r} is on the SSD: only an in-memory entry lends its chunks")
                plan.append((entry, k, src, src if lend == slot else self._slot(entry, lend)))
            if len({(id(entry), dst, k) for entry, k, _src, dst in plan}) < len(plan):
                raise StorageError("lend_chunks: a chunk is named twice; each is lent to one holder at a time")
            for entry, k, _src, dst in plan:
                self._start_write(entry, dst, k)
        out = []
        try:
            for entry, k, src, dst in plan:
                copy_s, source = 0.0, None
                if dst != src and fill:  # the shadow slot starts as a copy of the active one
                    began = time.perf_counter()
                    entry.chunk_memory(k, dst).copy_(entry.chunk_memory(k, src))
                    copy_s = time.perf_counter() - began
                elif dst != src:
                    source = entry.chunk_memory(k, src)
                out.append(LentChunk(entry.chunk_buffer(k, dst), entry.chunk_len(k), self, entry, dst, k,
                                     copy_s=copy_s, source=source, source_slot=src))
        except BaseException as exc:
            with self._lock:
                for entry, k, _src, dst in plan:
                    self._finish_write(entry, dst, k, exc)
            raise
        with self._lock:
            for chunk in out:
                chunk.entry.lent[chunk.k] = chunk
        return out

    def give_back(self, chunks: Sequence["LentChunk"]) -> None:
        """Each lent chunk back in place, written (`write_chunk` of a `LentChunk`, under one lock for them all)."""
        for chunk in chunks:
            if chunk.store is not self:
                raise StorageError(f"entry {chunk.entry.name!r} chunk {chunk.k}: lent by another tensor store")
        self._close_lends(chunks, None)

    def _close_lends(self, chunks: Sequence["LentChunk"], error: BaseException | None) -> None:
        """Lent chunks came back (``error`` None: written in place) or were given up; each once."""
        with self._lock:
            for chunk in chunks:
                if chunk.entry.lent.get(chunk.k) is not chunk:  # closed already (or by a rollback)
                    continue
                del chunk.entry.lent[chunk.k]
                self._finish_write(chunk.entry, chunk.slot, chunk.k, error)
        for chunk in chunks:
            chunk.data = chunk.source = None

    def write_chunk(self, name: str, k: int, buf: HostBuffer, *, slot: str = ACTIVE, release: bool = True) -> Future:
        """Write chunk ``k`` from ``buf`` (a pool buffer of ``chunk_len(k)`` bytes) into ``slot`` (``"shadow"``:
        a speculative update that `commit` makes visible). The future completes once the bytes are on disk,
        the chunk is recorded as written and, with ``release=True``, ``buf`` is back in the pool."""
        entry = self.entry(name)
        phys = self._slot(entry, slot)
        self._check_chunk_buffer(entry, k, buf)
        if isinstance(buf, LentChunk):  # the chunk's own memory: already in place
            if (buf.entry, buf.slot, buf.k) != (entry, phys, k):
                raise StorageError(f"entry {name!r} chunk {k}: a chunk lent for {buf.entry.name!r} chunk {buf.k} "
                                   "goes back where it was lent")
            buf.written()
            return completed(None)
        if entry.memory is not None:  # host RAM or a device: a copy, recorded as written before the future completes
            self._begin_write(entry, phys, k)
            try:
                _copy(entry, entry.chunk_memory(k, phys), buf.view())
            except BaseException as exc:
                self._end_write(entry, phys, k, exc)
                raise
            finally:
                if release:
                    buf.release()
            self._end_write(entry, phys, k, None)
            return completed(None)
        d, offset = entry.location(k, phys)
        self._begin_write(entry, phys, k)
        try:
            fut = self.engine.write(self._files[d], offset, buf.data)
        except BaseException as exc:
            self._end_write(entry, phys, k, exc)
            if release:
                buf.release()
            raise

        def done(f: Future) -> None:
            try:
                self._end_write(entry, phys, k, CancelledError() if f.cancelled() else f.exception())
            finally:
                if release:
                    buf.release()
            f.result()  # the write's own error, if any

        return then(fut, done)

    @staticmethod
    def _check_chunk_buffer(entry: Entry, k: int, buf: HostBuffer, length: int | None = None) -> None:
        length = entry.chunk_len(k) if length is None else length
        if buf.nbytes != length or buf.capacity != round_up(length):
            raise StorageError(
                f"entry {entry.name!r} chunk {k}: buffer holds {buf.nbytes} bytes (capacity {buf.capacity}), "
                f"the chunk{' prefix' if length != entry.chunk_len(k) else ''} is {length} bytes"
            )

    # -- whole entries ------------------------------------------------------------------------------
    def write(self, name: str, tensor: torch.Tensor, *, slot: str = ACTIVE, timeout: float | None = None) -> Future:
        """Write a whole tensor (any device) chunk by chunk through the pool (chunk ``k+1`` may wait for a
        buffer); the future completes when every chunk is on disk."""
        entry = self.entry(name)
        if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise StorageError(
                f"entry {name!r} holds {entry.dtype} {list(entry.shape)}; got {tensor.dtype} {list(tensor.shape)}"
            )
        phys = self._slot(entry, slot)
        with self._lock:
            entry.failed[phys] = None  # a whole rewrite makes the slot good again if it succeeds
        flat = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
        futures = []
        for k in range(entry.nchunks):
            start = k * entry.chunk_bytes
            buf = self.pool.acquire(entry.chunk_len(k), timeout=timeout)
            transfer(buf.view(), flat[start : start + entry.chunk_len(k)])
            futures.append(self.write_chunk(name, k, buf, slot=slot))
        return gather(futures)

    def read(self, name: str, out: torch.Tensor | None = None, *, slot: str = ACTIVE, timeout: float | None = None) -> Future:
        """Read a whole entry into ``out`` (default: a new CPU tensor); the future gives ``out``."""
        entry = self.entry(name)
        phys = self._slot(entry, slot)
        self._check_readable(entry, phys, None)
        if out is None:
            out = torch.empty(entry.shape, dtype=entry.dtype)
        elif out.dtype != entry.dtype or tuple(out.shape) != entry.shape or not out.is_contiguous():
            raise StorageError(f"entry {name!r}: out must be a contiguous {entry.dtype} tensor of shape {list(entry.shape)}")
        flat = out.view(-1).view(torch.uint8)
        futures = []
        for k in range(entry.nchunks):
            start = k * entry.chunk_bytes

            def land(f: Future, start: int = start) -> None:
                with f.result() as buf:
                    transfer(flat[start : start + buf.nbytes], buf.view())

            futures.append(then(self.read_chunk(name, k, slot=slot, timeout=timeout), land))
        return gather(futures, result=out)

    # -- commit / rollback ---------------------------------------------------------------------------
    def commit(self, names: Iterable[str] | None = None, *, writes_behind: bool = False) -> int:
        """Make the shadow slot active for every named entry (default: all) with shadow writes; returns how
        many flipped. All-or-nothing: a partial, failed or in-flight shadow write flips nothing and
        `StorageError` names it.

        ``writes_behind=True`` (the caller saw every shadow write begin): an SSD entry whose shadow chunks are
        all written or being written flips too, so the last writes of ``step()`` overlap the next forward. A
        read of a chunk still in flight (`read_chunk`, `read`; `to_memory`, `to_ssd`, `delete`) waits for it,
        up to ``io_timeout``; a write that fails leaves the active slot failed, and reads raise its error.
        """
        with self._lock:
            entries = [self.entry(n) for n in names] if names is not None else list(self._entries.values())
            entries = [e for e in entries if e.slots == 2]
            pending = [e for e in entries if e.written[1 - e.active] or e.failed[1 - e.active] or e.inflight[1 - e.active]]
            bad = [e.name for e in pending if not (e.is_complete(1 - e.active)
                                                   or writes_behind and self._lands_complete(e, 1 - e.active))]
            if bad:
                raise StorageError(f"cannot commit: shadow slot incomplete, failed or in flight for {bad[:5]}"
                                   + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
            busy = [e.name for e in pending if e.inflight[e.active]]
            if busy:  # it would become the shadow slot with writes still landing in it
                raise StorageError(f"cannot commit: the active slot of {busy[:5]} still has writes in flight")
            for e in pending:
                e.active = 1 - e.active
                e.written[1 - e.active] = set()  # the old active slot is now a stale shadow
                e.behind[e.active] = set(e.writing[e.active])
                self.writes_behind += len(e.behind[e.active])
            return len(pending)

    @staticmethod
    def _lands_complete(entry: Entry, phys: int) -> bool:
        """Under the lock: every chunk of slot ``phys`` of an entry on the SSD is written or being written, or
        one of its writes failed already (`commit`'s ``writes_behind``: the caller saw every write begin)."""
        return (entry.memory is None and not entry.lent
                and (entry.failed[phys] is not None
                     or len(entry.written[phys] | entry.writing[phys].keys()) == entry.nchunks))

    def rollback(self, names: Iterable[str] | None = None) -> None:
        """Discard shadow writes of the named entries (default: all). Wait for in-flight writes first."""
        with self._lock:
            entries = [self.entry(n) for n in names] if names is not None else list(self._entries.values())
            entries = [e for e in entries if e.slots == 2]
            for e in entries:  # shadow chunks lent in memory and never handed back (a worker that died): given up
                for k, chunk in [(k, c) for k, c in e.lent.items() if c.slot != e.active]:
                    del e.lent[k]
                    self._finish_write(e, chunk.slot, k, StorageError("rolled back"))
            busy = [e.name for e in entries if e.inflight[1 - e.active]]
            if busy:
                raise StorageError(f"cannot roll back while shadow writes are in flight for {busy[:5]}")
            for e in entries:
                e.written[1 - e.active] = set()
                e.failed[1 - e.active] = None

    # -- lifetime -----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._res.engine is None:
            raise StorageError("the tensor store is closed")

    def close(self) -> None:
        """Wait for in-flight transfers, close files and remove the run directories."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "TensorStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DeviceMemory(HostBuffer):
    """One slot of a device entry's memory (`TensorStore.to_device`): a ``uint8`` tensor on the device, outside
    the host pool; `release` drops it (the caching allocator reuses it)."""

    __slots__ = ()

    def __init__(self, data: torch.Tensor) -> None:
        super().__init__(data, data.numel(), None)

    def release(self) -> None:
        self.data = self.memo = None


class LentChunk(HostBuffer):
    """A chunk of an in-memory entry lent by `TensorStore.read_chunk` (``lend=``), updated in place and handed
    back to `write_chunk`; one thread owns it at a time. `release` without that write marks the slot failed.

    ``source``: lent unfilled (``fill=False``), the active chunk's bytes (physical slot ``source_slot``), to be
    read (never written) while the chunk is lent; ``None`` when the chunk itself holds what the update starts from.

    Views of the chunk (`view`, `kept`, `source_as`) are kept with its slot's memory from one lend to the next, so
    that a chunk lent every step makes them once (`HostBuffer.kept`); like any view of a lent chunk, they are the
    holder's only while it is lent, and `view` fails once the chunk is given back."""

    __slots__ = ("store", "entry", "slot", "k", "copy_s", "source", "source_slot")

    def __init__(self, data: torch.Tensor, nbytes: int, store: "TensorStore", entry: Entry, slot: int, k: int,
                 copy_s: float = 0.0, source: torch.Tensor | None = None, source_slot: int | None = None) -> None:
        super().__init__(data, nbytes, None)
        self.store, self.entry, self.slot, self.k = store, entry, slot, k
        self.copy_s = copy_s  # seconds spent copying the active chunk into the shadow slot (CPU work of the lend)
        self.source, self.source_slot = source, source_slot

    def kept(self, key: object, make: Callable[[], Any]) -> Any:
        """``make()`` (views of this chunk) once for the chunk's memory, as `HostBuffer.kept`."""
        self._held()
        return self.entry.memory[self.slot].kept((self.k, "lent", key), make)

    def known(self, key: object) -> Any:
        """What `kept` made for ``key``, or ``None`` (as `HostBuffer.known`)."""
        self._held()
        return self.entry.memory[self.slot].known((self.k, "lent", key))

    def view(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        self._held()
        return self.entry.chunk_view(self.k, self.slot, dtype)  # the chunk's first nbytes, as `HostBuffer.view`

    def _held(self) -> None:
        """Raise unless the chunk is still lent: a given-back chunk's views are not its former holder's."""
        if self.data is None:
            raise StorageError(f"entry {self.entry.name!r}: chunk {self.k} was given back; its views are not yours")

    def source_as(self, dtype: torch.dtype) -> torch.Tensor:
        """``source`` as ``dtype`` (the active slot's chunk, kept as `view`'s)."""
        if self.source is None:
            raise StorageError(f"entry {self.entry.name!r}: chunk {self.k} was lent filled; it has no source")
        return self.entry.chunk_view(self.k, self.source_slot, dtype)

    def written(self) -> None:
        """Back in place: the write that `read_chunk` began is done."""
        self.store._close_lends([self], None)

    def release(self) -> None:
        self.store._close_lends([self], StorageError(
            f"entry {self.entry.name!r}: chunk {self.k} was lent for an update that did not finish"))


def _landed_behind(behind: set[int], k: int | None) -> bool:
    """Whether chunk ``k`` (None: every chunk) of a slot whose chunks committed behind their writes are ``behind``
    has no such write in flight (`TensorStore._wait_behind`)."""
    return not behind if k is None else k not in behind


def _copy(entry: Entry, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy between a host buffer and an in-memory entry's chunk: a plain copy in host RAM; for a device entry
    `device.transfer`, ordered after the kernels queued on the calling thread's stream (the updates that wrote
    or read the chunk)."""
    if entry.device is None:
        dst.copy_(src)
    else:
        transfer(dst, src, after_compute=True)


def rank_path(path: str) -> str:
    """``path`` with ``{rank}`` and ``{local_rank}`` filled in (``torch.distributed`` rank, else ``$RANK``;
    ``$LOCAL_RANK``, else the rank; 0 if not distributed): a swap directory per GPU, ``/nvme{local_rank}/fuyou``."""
    if "{" not in path:
        return path
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
    return path.format(rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", rank)))


def _check_swap_dir(path: str) -> None:
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise StorageError(f"swap_dirs: {path!r} {what}; create it (mkdir -p) or choose another directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise StorageError(f"swap_dirs: {path!r} is not writable by this user; fix its permissions or choose another directory")
