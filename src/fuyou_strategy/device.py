"""The one module that touches the accelerator: device detection, host buffers, host ↔ device copies.

With an accelerator (CUDA, through ``torch.accelerator`` / ``torch.Stream`` / ``torch.Event``), host buffers
are page-locked and copies run asynchronously on a side stream, waited for through events; on the CPU the
"device" and "host" tiers share RAM and the same code runs.

Copies: `start_copy` returns a `Copy` whose `wait` says it landed (`transfer` does both); reuse the source or
read the destination only after the wait. On the CPU a copy lands before `start_copy` returns, so a missing
wait cannot show; the late-copy test mode (``FUYOU_ASYNC_DEVICE=<ms>``, or `late_copies`) makes it show: each
copy runs on a copy-engine thread after a random delay of up to ``<ms>`` ms, its destination poisoned (all
bits set) until it lands and its source read only then, and `Upload.result` and `claim_for_current_stream`
raise if a copy into the tensor has not landed.

Host buffers: all come from `alloc_host_buffer`, which counts the bytes alive and their high-water mark
(`host_buffer_usage`), the figure ``host_memory_budget`` caps. With CUDA each is pinned at its exact
page-rounded size (``cudaHostRegister``): torch's caching host allocator rounds up to a power of two, which
could exceed the budget twice over.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import random
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["PAGE_SIZE", "accelerator_type", "cuda_available", "accelerator", "alloc_host_buffer", "HostBufferUsage",
           "host_buffer_usage", "reset_host_buffer_high_water", "Copy", "start_copy", "transfer", "Upload",
           "resize_for_copies", "claim_for_current_stream", "late_copies", "COPY_TIMEOUT", "read_on_host",
           "computes_on_host", "to_device", "to_host", "usable_cores", "use_intra_op_threads", "current_stream", "on_stream"]

log = logging.getLogger("fuyou_strategy")

PAGE_SIZE = 4096
COPY_TIMEOUT = 600.0  # seconds a copy may take before its wait gives up (a stuck device or copy engine)


def accelerator_type() -> str | None:
    """The accelerator's device type (``"cuda"``, ``"xpu"``, ...) or ``None`` on a CPU-only machine."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None else None


def cuda_available() -> bool:
    return accelerator_type() == "cuda"


def _accelerated(device: torch.device) -> bool:
    return device.type not in ("cpu", "meta")


def _on_accelerator(t: torch.Tensor) -> bool:
    """`_accelerated` of ``t``'s device, from the tensor's flags (a tenth of the time of making its ``device``)."""
    return not (t.is_cpu or t.is_meta)


def read_on_host(t: torch.Tensor) -> bool:
    """Whether the host must copy ``t`` into a host buffer (`start_copy`) before it reads it: ``t`` is on an
    accelerator; or, in the late-copy test mode, on the CPU too, so that the copy and its wait run there. (Asked of
    every gradient a step: `_on_accelerator` inline.)"""
    return _late is not None or not (t.is_cpu or t.is_meta)


def to_host(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """``values`` (0-d tensors, in order) on the host: those on each accelerator stacked there and copied in one
    transfer, so that the host waits once per device rather than once per value (a GPU's many gradient norms)."""
    out = list(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, value in enumerate(values):
        if _on_accelerator(value):
            by_device.setdefault(value.device, []).append(i)
    for where in by_device.values():
        for i, value in zip(where, torch.stack([values[i] for i in where]).to("cpu").unbind()):
            out[i] = value
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (step counts, a clip or unscale factor) on ``device`` without the calling thread waiting
    for the device: ``.to(device)`` from pageable memory synchronises with the device's current stream, so a
    thread queueing updates during backward would wait for every kernel queued before. On a CUDA device it is
    pinned and copied ``non_blocking`` on the current stream (torch's caching host allocator keeps the pinned block
    until the copy has run); otherwise ``t.to(device)`` (another accelerator's pinned memory is not assumed)."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def computes_on_host(params: list[torch.Tensor]) -> bool:
    """Whether a model with these parameters computes on the CPU: none is on an accelerator, and a model built
    on the meta device is materialised on the CPU (no accelerator) — the device tier is host RAM."""
    if any(_on_accelerator(p) for p in params):
        return False
    return not (params and all(p.is_meta for p in params) and accelerator_type() is not None)


# -- intra-op threads -----------------------------------------------------------------------------------------
# torch's CPU ops run on OpenMP (libgomp): each thread running a parallel op gets a team of its own, kept for
# the process's life. Once the teams hold more threads than the process has cores, libgomp sleeps at its
# barriers instead of spinning, in every team; on the CPU the training thread's team holds every core, so a
# second team (the optimizer worker's) costs the training thread that spinning for the whole run.


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: what OpenMP counts as available)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _omp_set_num_threads() -> "ctypes._CFuncPtr | None":
    try:
        return ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError, TypeError):  # no such symbol; or no process handle (Windows)
        return None


def use_intra_op_threads(n: int) -> int:
    """Give the calling thread's own ops ``n`` intra-op threads (OpenMP's ``omp_set_num_threads``), leaving other
    threads' counts and the default for new ones alone, as ``torch.set_num_threads`` would not; returns the
    thread's count now. Under a thread pool other than OpenMP nothing changes."""
    have = torch.get_num_threads()  # torch's lazy per-thread set-up, which would otherwise undo what follows
    setter = _omp_set_num_threads()
    if setter is not None and n != have:
        setter(ctypes.c_int(n))
        have = torch.get_num_threads()
    if have != n:
        log.debug("fuyou: this thread keeps %d intra-op threads (asked %d): torch's parallel backend is not OpenMP",
                  have, n)
    return have


# -- host buffers ---------------------------------------------------------------------------------------------

_usage_lock = threading.Lock()  # guards _live and _high_water: _high_water >= _live >= 0 at every release
_live = 0
_high_water = 0


class _CudaRegistrar:
    """Pins and unpins host memory in place (``cudaHostRegister``), at exactly the size asked."""

    def register(self, ptr: int, nbytes: int) -> None:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}: the host "
                               "cannot lock that much memory (ulimit -l, or lower host_memory_budget)")

    def unregister(self, ptr: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(ptr)


_registrar: _CudaRegistrar | None = None  # set on first use with CUDA; tests put a recorder here


def _pinning() -> _CudaRegistrar | None:
    global _registrar
    if _registrar is None and cuda_available():
        _registrar = _CudaRegistrar()
    return _registrar


def alloc_host_buffer(nbytes: int) -> torch.Tensor:
    """A ``uint8`` host tensor of ``nbytes`` whose first byte is page-aligned (for ``O_DIRECT``; the CPU allocator
    promises 64 bytes, so one page more is allocated and sliced). With CUDA it is pinned in place at the
    page-rounded size; another accelerator's comes from its pinned allocator. Counted in `host_buffer_usage`
    (``nbytes``, or the pinned size) until its last view is gone."""
    global _live, _high_water
    if nbytes <= 0:
        raise ValueError(f"nbytes: got {nbytes}; a host buffer needs at least one byte")
    registrar = _pinning()
    span = -(-nbytes // PAGE_SIZE) * PAGE_SIZE if registrar is not None else nbytes
    other_pinned = registrar is None and accelerator_type() is not None  # not CUDA: its pinned allocator
    raw = torch.empty(span + PAGE_SIZE, dtype=torch.uint8, pin_memory=other_pinned)
    skip = (-raw.data_ptr()) % PAGE_SIZE
    ptr = raw.data_ptr() + skip
    if registrar is not None:
        registrar.register(ptr, span)
    with _usage_lock:
        _live += span
        _high_water = max(_high_water, _live)
    # The storage outlives `raw` (the slice below keeps it): count until the storage is freed. The finalizer
    # runs before the storage's memory is released, so the pages are unpinned while still mapped (tested).
    weakref.finalize(raw.untyped_storage(), _freed, span, ptr, registrar).atexit = False
    return raw[skip : skip + nbytes]


def _freed(nbytes: int, ptr: int, registrar: _CudaRegistrar | None) -> None:
    global _live
    if registrar is not None:
        registrar.unregister(ptr)
    with _usage_lock:
        _live -= nbytes


@dataclass(frozen=True)
class HostBufferUsage:
    """Bytes of `alloc_host_buffer` memory in this process: alive now, and the most alive at once."""

    live: int
    high_water: int


def host_buffer_usage() -> HostBufferUsage:
    """What `alloc_host_buffer` holds process-wide (usable bytes, page-rounded where pinned; the
    alignment page is not counted)."""
    with _usage_lock:
        return HostBufferUsage(_live, _high_water)


def reset_host_buffer_high_water() -> None:
    """Start the high-water mark again from the bytes alive now (to measure one run)."""
    global _high_water
    with _usage_lock:
        _high_water = _live


# -- copies ---------------------------------------------------------------------------------------------------

class Copy:
    """A started host ↔ device copy; `wait` returns once its bytes landed (or raises its error)."""

    def __init__(self, event: torch.Event | None = None, late: "_LateCopy | None" = None) -> None:
        self._event, self._late = event, late

    def landed(self) -> bool:
        """Whether the copy is over (landed or failed: `wait` says which) now, without waiting."""
        if self._late is not None:
            return self._late.done.is_set()
        return self._event is None or self._event.query()

    def wait(self, timeout: float = COPY_TIMEOUT) -> None:
        """Block the calling thread (not the device's compute stream) until the copy landed; raises
        `TimeoutError` after ``timeout`` seconds, and the copy's own error if it failed."""
        if self._late is not None:
            self._late.wait(timeout)
        elif self._event is not None:
            _wait_event(self._event, timeout)


def _wait_event(event: torch.Event, timeout: float) -> None:
    if event.query():
        return
    deadline = time.monotonic() + timeout
    pause = 10e-6
    while not event.query():  # polled rather than synchronize(), which could wait forever
        if time.monotonic() > deadline:
            raise TimeoutError(f"a device copy did not land within {timeout:.0f} s (is the device hung?)")
        time.sleep(pause)  # releases the GIL; at most 100 us late (a 16 MiB chunk takes ~0.6 ms over PCIe 4)
        pause = min(pause * 2, 100e-6)


def start_copy(dst: torch.Tensor, src: torch.Tensor, *, after_compute: bool = False) -> Copy:
    """Start copying ``src`` into ``dst`` (same shape and dtype; host ↔ device, or both on the CPU) from any
    thread; `Copy.wait` before reusing ``src`` or reading ``dst``. With an accelerator it runs on the side
    stream, ``non_blocking`` where the host side is pinned. A device → host copy first waits for the caller's
    current stream; so does host → device with ``after_compute``, for a destination that queued kernels may
    still read (side streams do not order with others)."""
    if _late is not None:
        return _late.start(dst, src)
    device_side = dst if _on_accelerator(dst) else src if _on_accelerator(src) else None
    if device_side is None:
        dst.copy_(src)
        return Copy()
    device = device_side.device
    stream = _side_stream(device)
    host_side = src if device_side is dst else dst
    if device_side is src or after_compute:
        stream.wait_stream(torch.accelerator.current_stream(device))
    with stream:
        dst.copy_(src, non_blocking=host_side.is_pinned())
        # The device tensor's memory is not handed out again until the side stream is past this copy, even
        # if the caller drops its last reference before it lands (a gradient set to None, say).
        device_side.record_stream(stream)
        event = torch.Event(device=device)
        event.record(stream)
    return Copy(event)


def transfer(dst: torch.Tensor, src: torch.Tensor, timeout: float = COPY_TIMEOUT, *, after_compute: bool = False) -> None:
    """Copy ``src`` into ``dst`` (host ↔ device) from any thread; returns once the bytes are there
    (``after_compute``: see `start_copy`). The calling thread waits, not the compute stream. On the CPU
    a plain copy (it releases the GIL)."""
    start_copy(dst, src, after_compute=after_compute).wait(timeout)


class Upload:
    """A device tensor of ``nbytes`` bytes filled from host buffers chunk by chunk. `copy` runs on any thread and
    returns once the host bytes were copied (the buffer may be reused); `result`, once every `copy` returned,
    gives the tensor, allocated on the side stream and claimed for the caller's stream."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self._stream = _side_stream(device) if _accelerated(device) else None
        with self._stream if self._stream is not None else contextlib.nullcontext():
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(self, offset: int, src: torch.Tensor) -> None:
        """Copy the ``uint8`` host tensor ``src`` into the tensor's bytes at ``offset``."""
        transfer(self.tensor[offset : offset + src.numel()], src)

    def result(self) -> torch.Tensor:
        claim_for_current_stream(self.tensor, "an upload's tensor")
        return self.tensor


def resize_for_copies(t: torch.Tensor, nbytes: int) -> None:
    """Give ``t``'s released storage ``nbytes`` again from the side stream's allocator pool, as FSDP allocates on
    its unshard stream: memory compute freed may be handed out at once on compute while queued kernels still
    read it, and a side-stream copy into it would overtake them. `claim_for_current_stream` marks compute's use."""
    storage = t.untyped_storage()
    with _side_stream(t.device) if _on_accelerator(t) else contextlib.nullcontext():
        storage.resize_(nbytes)


def claim_for_current_stream(t: torch.Tensor, what: str = "a device tensor") -> None:
    """``t`` (filled on the side stream) is handed to compute on the current stream: tell the caching
    allocator, so its memory is not handed out again before that stream is done with it. In the
    late-copy test mode, raise if a copy into ``t`` has not landed yet (a missing wait)."""
    if _late is not None:
        _late.check_landed(t, what)
    if _on_accelerator(t) and t.untyped_storage().nbytes():
        t.record_stream(torch.accelerator.current_stream(t.device))


_side_streams: dict[tuple[str, int], torch.Stream] = {}
_streams_lock = threading.Lock()  # guards _side_streams: one stream per device, made once


def _side_stream(device: torch.device) -> torch.Stream:
    """One stream per accelerator device for copies (made on first use)."""
    index = device.index if device.index is not None else torch.accelerator.current_device_index()
    with _streams_lock:
        key = (device.type, index)
        if key not in _side_streams:
            _side_streams[key] = torch.Stream(device=torch.device(device.type, index))
        return _side_streams[key]


def current_stream(device: torch.device) -> torch.Stream | None:
    """The calling thread's current stream on ``device`` (``None`` on the CPU): captured where a gradient is handed
    over, so that work another thread runs on it (`on_stream`) is ordered after the kernels that computed it, and
    the kernels queued after that work (the next forward's) after it."""
    return torch.accelerator.current_stream(device) if _accelerated(device) else None


def on_stream(stream: torch.Stream | None) -> "contextlib.AbstractContextManager":
    """Run the kernels the block queues on ``stream`` (`current_stream`'s); nothing to switch on the CPU."""
    return stream if stream is not None else contextlib.nullcontext()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (for timing); nothing to wait for on the CPU."""
    if _accelerated(device):
        torch.accelerator.synchronize(device)


def accelerator() -> tuple[str, int] | None:
    """The first CUDA device's name and total memory in bytes, or ``None`` without one."""
    if not cuda_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory


DEVICE_MARGIN = 0.05  # of an accelerator's memory left free beside the step's measured peak (`device_memory_headroom`)


def device_memory_headroom(device: torch.device) -> int | None:
    """Bytes of an accelerator's memory this process can still take and keep through a step like the ones so far:
    free now, less what its peak reserved beyond what it reserves now (a step's activations and workspaces, given
    back between steps), less `DEVICE_MARGIN` of the total (the allocator's fragmentation): `device_memory_left`
    less the peak's excess. ``None`` on the CPU."""
    left = device_memory_left(device)
    if left is None:
        return None
    return max(0, left - (torch.cuda.max_memory_reserved(device) - torch.cuda.memory_reserved(device)))


def release_cached_memory(device: torch.device) -> None:
    """Give the blocks the caching allocator holds unused back to the accelerator (``torch.cuda.empty_cache``):
    from here on what this process reserves is what the steps that follow take (`device_memory_left`), not what
    the steps before took, such as the activations a warm-up kept. The allocator's peak statistics, which a user may
    read for the whole run, are left as they are. Nothing on the CPU, or before CUDA holds anything."""
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def device_memory_left(device: torch.device) -> int | None:
    """Bytes of an accelerator's memory free beside all this process reserves now, less `DEVICE_MARGIN` of the total.
    After `release_cached_memory` and a step, that is what the step's peak left: the caching allocator keeps the
    blocks a step reserved. ``None`` on the CPU."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return max(0, free - int(DEVICE_MARGIN * total))


def device_memory_allocated(device: torch.device) -> int | None:
    """Bytes of an accelerator's memory this process's tensors hold now (the caching allocator's count). ``None`` on
    the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_allocated(device)


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of an accelerator; ``None`` for the CPU (the device tier is host RAM)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


# -- the late-copy test mode ----------------------------------------------------------------------------------

class _LateCopy:
    """One copy queued on the late copy engine. ``done`` is set only after the engine's bookkeeping
    (the pending count) is updated, so a woken waiter sees the destination counted as landed."""

    def __init__(self, engine: "_LateCopies", dst: torch.Tensor, src: torch.Tensor, delay: float) -> None:
        self.engine, self.dst, self.src, self.delay = engine, dst, src, delay
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.done.wait(0.05):  # a liveness check every 50 ms: a dead engine never sets `done`
            if not self.engine.alive():
                raise RuntimeError("the late-copy engine thread died with copies still queued")
            if time.monotonic() > deadline:
                raise TimeoutError(f"a late copy did not land within {timeout:.0f} s")
        if self.error is not None:
            raise self.error


class _LateCopies:
    """The late-copy test mode's copy engine: one thread that runs copies in order, as a stream would,
    each after a random delay, and knows which storages have copies not landed yet."""

    def __init__(self, min_delay: float, max_delay: float, seed: int | None) -> None:
        self._delays = random.Random(seed)
        self._min, self._max = min_delay, max_delay
        self._queue: queue.SimpleQueue[_LateCopy | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _pending: storage pointer -> copies into it not landed (> 0)
        self._pending: dict[int, int] = {}
        self._thread = threading.Thread(target=self._run, name="late-copy-engine", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self, dst: torch.Tensor, src: torch.Tensor) -> Copy:
        key = dst.untyped_storage().data_ptr()
        with self._lock:
            self._pending[key] = self._pending.get(key, 0) + 1
            delay = self._delays.uniform(self._min, self._max)
        _poison(dst)
        late = _LateCopy(self, dst, src, delay)
        self._queue.put(late)
        return Copy(late=late)

    def check_landed(self, t: torch.Tensor, what: str) -> None:
        with self._lock:
            pending = self._pending.get(t.untyped_storage().data_ptr(), 0)
        if pending:
            raise RuntimeError(f"{what} was handed to compute before its copy landed ({pending} copies into it "
                               "still in flight): a missing wait on a device copy (late-copy test mode)")

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=COPY_TIMEOUT)

    def _run(self) -> None:
        while (late := self._queue.get()) is not None:
            time.sleep(late.delay)
            try:
                late.dst.copy_(late.src)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for this copy
                late.error = exc
            key = late.dst.untyped_storage().data_ptr()
            with self._lock:
                if self._pending[key] == 1:
                    del self._pending[key]
                else:
                    self._pending[key] -= 1
            late.dst = late.src = None  # type: ignore[assignment]  # the engine holds no tensor once it landed
            late.done.set()


def _poison(t: torch.Tensor) -> None:
    """Every bit set: NaN for float dtypes, -1 or the maximum for integers."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(-1 if t.dtype.is_signed else torch.iinfo(t.dtype).max)


def _late_from_env() -> _LateCopies | None:
    value = os.environ.get("FUYOU_ASYNC_DEVICE", "").strip()
    if value in ("", "0"):
        return None
    try:
        max_ms = float(value)
    except ValueError:
        raise ValueError(f"FUYOU_ASYNC_DEVICE: got {value!r}; set it to the late-copy test mode's largest delay "
                         "in milliseconds (e.g. 2), or 0 / unset for normal copies") from None
    if max_ms <= 0:
        raise ValueError(f"FUYOU_ASYNC_DEVICE: got {value!r}; a delay must be positive (0 turns the mode off)")
    return _LateCopies(0.0, max_ms / 1000, seed=None)


_late: _LateCopies | None = _late_from_env()  # set at import, or for a `with late_copies():` block


@contextlib.contextmanager
def late_copies(max_delay_ms: float = 2.0, min_delay_ms: float = 0.0, seed: int | None = 0) -> Iterator[None]:
    """The late-copy test mode for the ``with`` block (see the module's docstring); for tests. Copies
    started inside must be waited for inside; the mode in force before is restored after."""
    global _late
    before, _late = _late, _LateCopies(min_delay_ms / 1000, max_delay_ms / 1000, seed)
    try:
        yield
    finally:
        engine, _late = _late, before
        engine.stop()


def late_copies_enabled() -> bool:
    """Whether the late-copy test mode is on (for tests that must know)."""
    return _late is not None

