"""Sequential read/write bandwidth of a swap directory, measured with the engine itself.

``fuyou io-bench`` prints these figures; the planner reuses `measure_bandwidth` to learn
how fast the SSD tier is instead of trusting hand-set constants.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from ..config import PAGE
from ..device import alloc_host_buffer
from .aio import IOEngine, filesystem_type
from .rundir import make_run_dir, remove_run_dir

__all__ = ["Bandwidth", "measure_bandwidth"]

# One source/destination buffer is reused for every transfer; bigger files loop over it.
_MAX_WINDOW = 64 * 2**20


@dataclass
class Bandwidth:
    """One io-bench row. Bandwidths in bytes per second."""

    directory: str
    filesystem: str
    direct: bool
    block_size: int
    threads: int
    size: int
    write_bps: float
    read_bps: float

    def as_dict(self) -> dict:
        return asdict(self)


def measure_bandwidth(
    directory: str,
    *,
    size: int = 2**30,
    block_size: int = 2**20,
    threads: int = 4,
    direct_io: str = "auto",
    buffer: torch.Tensor | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> Bandwidth:
    """Write then read a ``size``-byte file in ``directory`` and time both passes (the write pass is a
    rewrite: the first, untimed write fills the preallocated file, as swap files are rewritten each step).

    The write pass ends with ``fdatasync``, so it counts bytes that reached the drive; the
    file lives in a fresh run directory that is removed afterwards. Every transfer goes
    through one page-aligned ``uint8`` buffer: ``buffer`` (e.g. a host pool buffer, to stay
    within a host budget; a whole number of pages) or, by default, one of up to 64 MiB.
    ``on_bytes`` is told the bytes of each completed transfer (a progress bar: 3 x ``size`` in all).
    """
    size = max(PAGE, size // PAGE * PAGE)
    window = min(size, _MAX_WINDOW if buffer is None else buffer.numel() // PAGE * PAGE)
    run_dir = make_run_dir(directory)
    engine = IOEngine([run_dir], threads_per_dir=threads, block_size=block_size, direct_io=direct_io)
    try:
        f = engine.open(0, "bench.bin")
        buf = alloc_host_buffer(window) if buffer is None else buffer[:window]
        buf.copy_(torch.randint(0, 256, (window,), dtype=torch.uint8))
        os.posix_fallocate(f.fd, 0, size)  # measure the data path, not block allocation

        def run(write: bool) -> float:
            start = time.perf_counter()
            futures = []
            for offset in range(0, size, window):
                part = buf[: min(window, size - offset)]
                futures.append(engine.write(f, offset, part) if write else engine.read(f, offset, part))
            for fut, offset in zip(futures, range(0, size, window)):
                fut.result()
                if on_bytes is not None:
                    on_bytes(min(window, size - offset))
            if write:
                os.fdatasync(f.fd)
            elapsed = time.perf_counter() - start
            if not f.direct:  # do not let the read pass be served from the page cache
                os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return size / elapsed

        # Swap files are rewritten every step; the first write into a preallocated file also converts
        # its unwritten extents (ext4: ~1.6x slower here), so it is a warm-up, not the rate to plan with.
        run(write=True)
        write_bps = run(write=True)
        read_bps = run(write=False)
        engine.close_file(f)
        return Bandwidth(directory, filesystem_type(directory), f.direct, block_size, threads, size, write_bps, read_bps)
    finally:
        engine.close()
        remove_run_dir(run_dir)
