"""The one module that touches ``torch.cuda``: device detection and pinned host memory.

Everything above this module is written once against these small functions. With CUDA,
host buffers are page-locked so device copies can be asynchronous; on the CPU (every
machine of this project's CI) the compute device is the CPU and the "device" and "host"
tiers share RAM, so the same code runs and is tested. Streams and events join this module
with activation swapping, the first part that overlaps device copies with compute.
"""

from __future__ import annotations

import torch

__all__ = ["PAGE_SIZE", "cuda_available", "alloc_host_buffer"]

PAGE_SIZE = 4096


def cuda_available() -> bool:
    return torch.cuda.is_available()


def alloc_host_buffer(nbytes: int) -> torch.Tensor:
    """A ``uint8`` host tensor of ``nbytes`` whose first byte is page-aligned.

    Page alignment is what ``O_DIRECT`` needs. With CUDA the memory is pinned, so copies
    to and from the device can be asynchronous. ``cudaHostAlloc`` returns page-aligned
    memory; the CPU allocator only promises 64 bytes, so we over-allocate one page and slice.
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes: got {nbytes}; a host buffer needs at least one byte")
    raw = torch.empty(nbytes + PAGE_SIZE, dtype=torch.uint8, pin_memory=cuda_available())
    skip = (-raw.data_ptr()) % PAGE_SIZE
    return raw[skip : skip + nbytes]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (for timing); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of an accelerator; ``None`` for the CPU (the device tier is host RAM)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None
