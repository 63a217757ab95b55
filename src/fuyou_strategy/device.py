"""The one module that touches ``torch.cuda``: device detection, host buffers, host → device copies.

Everything above this module is written once against these small functions. With CUDA,
host buffers are page-locked so device copies can be asynchronous, and `Upload` copies on a
side stream; on the CPU (every machine of this project's CI) the compute device is the CPU,
the "device" and "host" tiers share RAM, and the same code runs and is tested.

Every host buffer fuyou allocates comes from `alloc_host_buffer`, which counts the bytes
alive in the process and their high-water mark (`host_buffer_usage`): the figure that
``host_memory_budget`` caps, measured where nothing can bypass it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass

import torch

__all__ = ["PAGE_SIZE", "cuda_available", "accelerator", "alloc_host_buffer", "HostBufferUsage", "host_buffer_usage",
           "reset_host_buffer_high_water", "Upload", "copy_to_device", "claim_for_current_stream"]

PAGE_SIZE = 4096

_usage_lock = threading.Lock()
_live = 0
_high_water = 0


def cuda_available() -> bool:
    return torch.cuda.is_available()


def alloc_host_buffer(nbytes: int) -> torch.Tensor:
    """A ``uint8`` host tensor of ``nbytes`` whose first byte is page-aligned.

    Page alignment is what ``O_DIRECT`` needs. With CUDA the memory is pinned, so copies
    to and from the device can be asynchronous. ``cudaHostAlloc`` returns page-aligned
    memory; the CPU allocator only promises 64 bytes, so we over-allocate one page and slice.
    The ``nbytes`` count towards `host_buffer_usage` until the memory is freed (the last view
    of it is gone).
    """
    global _live, _high_water
    if nbytes <= 0:
        raise ValueError(f"nbytes: got {nbytes}; a host buffer needs at least one byte")
    raw = torch.empty(nbytes + PAGE_SIZE, dtype=torch.uint8, pin_memory=cuda_available())
    skip = (-raw.data_ptr()) % PAGE_SIZE
    with _usage_lock:
        _live += nbytes
        _high_water = max(_high_water, _live)
    # The storage outlives `raw` (the slice below keeps it): count until the storage is freed.
    weakref.finalize(raw.untyped_storage(), _freed, nbytes).atexit = False
    return raw[skip : skip + nbytes]


def _freed(nbytes: int) -> None:
    global _live
    with _usage_lock:
        _live -= nbytes


@dataclass(frozen=True)
class HostBufferUsage:
    """Bytes of `alloc_host_buffer` memory in this process: alive now, and the most alive at once."""

    live: int
    high_water: int


def host_buffer_usage() -> HostBufferUsage:
    """What `alloc_host_buffer` holds process-wide (usable bytes; the alignment page is not counted)."""
    with _usage_lock:
        return HostBufferUsage(_live, _high_water)


def reset_host_buffer_high_water() -> None:
    """Start the high-water mark again from the bytes alive now (to measure one run)."""
    global _high_water
    with _usage_lock:
        _high_water = _live


class Upload:
    """A device tensor of ``nbytes`` bytes filled from host buffers, chunk by chunk, from any thread.

    `copy` may run on any thread (I/O threads do) and returns only once the host bytes were
    copied, so the host buffer may be reused at once; `result`, called where the tensor is
    used once every `copy` returned, gives the tensor. On the CPU it is a plain copy.
    With CUDA the tensor is allocated on a side stream and each `copy` is a ``non_blocking``
    host → device copy on it from pinned memory, waited for through an event; `result` tells
    the caching allocator that the caller's stream uses the tensor, so its memory is not
    reused before that stream is done with it.
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self._stream = _side_stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(self, offset: int, src: torch.Tensor) -> None:
        """Copy the ``uint8`` host tensor ``src`` into the tensor's bytes at ``offset``."""
        copy_to_device(self.tensor[offset : offset + src.numel()], src)

    def result(self) -> torch.Tensor:
        if self._stream is not None:
            self.tensor.record_stream(torch.cuda.current_stream(self.tensor.device))
        return self.tensor


def copy_to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy host tensor ``src`` into device tensor ``dst`` from any thread; returns once the bytes are there.

    With CUDA: a ``non_blocking`` copy on the device's side stream (from pinned memory, as the
    host pool's buffers are), waited for through an event, so the caller's thread — not the
    compute stream — waits. On the CPU a plain copy (it releases the GIL).
    """
    if dst.device.type != "cuda":
        dst.copy_(src)
        return
    stream = _side_stream(dst.device)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()


def claim_for_current_stream(t: torch.Tensor) -> None:
    """Tell CUDA's caching allocator that the current stream uses ``t`` (filled on a side stream), so its
    memory is not handed out again before that stream is done with it; nothing to do on the CPU."""
    if t.device.type == "cuda" and t.untyped_storage().nbytes():
        t.record_stream(torch.cuda.current_stream(t.device))


_side_streams: dict[int, "torch.cuda.Stream"] = {}
_streams_lock = threading.Lock()


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One stream per CUDA device for `Upload` copies (made on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        if index not in _side_streams:
            _side_streams[index] = torch.cuda.Stream(index)
        return _side_streams[index]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (for timing); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def accelerator() -> tuple[str, int] | None:
    """The first CUDA device's name and total memory in bytes, or ``None`` without one."""
    if not cuda_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of an accelerator; ``None`` for the CPU (the device tier is host RAM)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None
