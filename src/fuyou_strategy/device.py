"""The one module that touches ``torch.cuda``: streams, events, pinned memory.

Everything above this module is written once against these small functions. On a CUDA
machine they use side streams, events and page-locked host memory; on the CPU (every
machine of this project's CI) the compute device is the CPU, "device" and "host" tiers
share RAM, streams are no-ops and events are already complete, so the same code runs and
is tested.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = [
    "PAGE_SIZE",
    "cuda_available",
    "compute_device",
    "alloc_host_buffer",
    "Stream",
    "Event",
    "use_stream",
    "copy_async",
    "device_free_memory",
]

PAGE_SIZE = 4096


def cuda_available() -> bool:
    return torch.cuda.is_available()


def compute_device() -> torch.device:
    """The device that runs forward and backward: the current CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")


def alloc_host_buffer(nbytes: int) -> torch.Tensor:
    """A ``uint8`` host tensor of ``nbytes`` whose first byte is page-aligned.

    Page alignment is what ``O_DIRECT`` needs. With CUDA the memory is pinned, so copies
    to and from the device can be asynchronous. ``cudaHostAlloc`` returns page-aligned
    memory; the CPU allocator only promises 64 bytes, so we over-allocate one page and slice.
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes: got {nbytes}; a host buffer needs at least one byte")
    pin = cuda_available()
    raw = torch.empty(nbytes + PAGE_SIZE, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % PAGE_SIZE
    buf = raw[skip : skip + nbytes]
    assert buf.data_ptr() % PAGE_SIZE == 0
    return buf


class Stream:
    """A side stream on CUDA; on the CPU a placeholder whose work is always synchronous."""

    def __init__(self) -> None:
        self._stream = torch.cuda.Stream() if cuda_available() else None

    def wait_event(self, event: "Event") -> None:
        if self._stream is not None and event._event is not None:
            self._stream.wait_event(event._event)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


class Event:
    """A CUDA event recorded on a stream; on the CPU it is complete as soon as recorded."""

    def __init__(self) -> None:
        self._event = torch.cuda.Event() if cuda_available() else None

    def record(self, stream: Stream | None = None) -> "Event":
        if self._event is not None:
            self._event.record(stream._stream if stream is not None else torch.cuda.current_stream())
        return self

    def query(self) -> bool:
        return True if self._event is None else self._event.query()

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait for this event, without blocking the host."""
        if self._event is not None:
            (stream._stream if stream is not None else torch.cuda.current_stream()).wait_event(self._event)


@contextlib.contextmanager
def use_stream(stream: Stream | None) -> Iterator[None]:
    """Run the enclosed work on ``stream`` (CUDA), or just run it (CPU)."""
    if stream is None or stream._stream is None:
        yield
    else:
        with torch.cuda.stream(stream._stream):
            yield


def copy_async(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, non-blocking when one side is pinned host memory and the other CUDA."""
    dst.copy_(src, non_blocking=dst.device.type != src.device.type)


def device_free_memory() -> int:
    """Free bytes on the compute device (CUDA: ``mem_get_info``; CPU: MemAvailable)."""
    if cuda_available():
        free, _total = torch.cuda.mem_get_info()
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("could not read MemAvailable from /proc/meminfo")
