"""Sequential read/write bandwidth of a swap directory, and what its I/O costs the compute beside it,
measured with the engine itself.

`measure_bandwidth` serves ``fuyou io-bench`` and the planner. `measure_io_cpu_cost` (``fuyou doctor``) times
CPU matmuls alone and beside swap I/O: the kernel, and on a VM the hypervisor (``steal`` in ``/proc/stat``),
spend CPU per byte, which comes out of the compute when every core computes.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch

from ..config import PAGE, format_bytes
from ..device import alloc_host_buffer
from .aio import IOEngine, SwapFile, filesystem_type
from .rundir import make_run_dir, remove_run_dir

__all__ = ["Bandwidth", "IOCpuCost", "cpu_shares", "cpu_times", "measure_bandwidth", "measure_io_cpu_cost"]

# One source/destination buffer is reused for every transfer; bigger files loop over it.
_MAX_WINDOW = 64 * 2**20
# Seconds `measure_io_cpu_cost` goes on timing matmuls beside its stream until a piece lands while they run.
IO_CPU_PATIENCE_S = 30.0


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
    """Write then read a ``size``-byte file in a fresh run directory of ``directory`` and time both passes. The
    timed write is a rewrite (swap files are rewritten each step) ending with ``fdatasync``. Transfers go
    through ``buffer`` (page-aligned ``uint8``, whole pages; e.g. a pool buffer, within a host budget) or one of
    up to 64 MiB; ``on_bytes`` is told each completed transfer's bytes (3 x ``size`` in all)."""
    size = max(PAGE, size // PAGE * PAGE)
    window = min(size, _MAX_WINDOW if buffer is None else buffer.numel() // PAGE * PAGE)
    with _probe_file(directory, "bench.bin", size, threads=threads, block_size=block_size,
                     direct_io=direct_io) as (engine, f):
        buf = alloc_host_buffer(window) if buffer is None else buffer[:window]
        buf.copy_(torch.randint(0, 256, (window,), dtype=torch.uint8))

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
        # its unwritten extents (markedly slower on ext4), so it is a warm-up, not the rate to plan with.
        run(write=True)
        write_bps = run(write=True)
        read_bps = run(write=False)
        return Bandwidth(directory, filesystem_type(directory), f.direct, block_size, threads, size, write_bps, read_bps)


@contextlib.contextmanager
def _probe_file(directory: str, name: str, size: int, *, threads: int, block_size: int,
                direct_io: str) -> Iterator[tuple[IOEngine, SwapFile]]:
    """An engine and a ``size``-byte preallocated file ``name`` (the data path is measured, not block allocation)
    in a fresh run directory of ``directory``; the file, the engine and the run directory are gone afterwards."""
    run_dir = make_run_dir(directory)
    engine = IOEngine([run_dir], threads_per_dir=threads, block_size=block_size, direct_io=direct_io)
    f = None
    try:
        f = engine.open(0, name)
        os.posix_fallocate(f.fd, 0, size)
        yield engine, f
    finally:
        if f is not None:
            engine.close_file(f)
        engine.close()
        remove_run_dir(run_dir)


@dataclass
class IOCpuCost:
    """What a stream of swap I/O cost the compute beside it (`measure_io_cpu_cost`). Seconds; bytes."""

    directory: str
    compute_threads: int
    io_threads: int
    alone_s: float  # the matmuls alone, as many as ran beside the stream (the faster of the runs before and after)
    beside_s: float  # the same matmuls with the I/O streaming beside them
    bytes_moved: int  # written plus read while the matmuls ran beside the stream
    steal_share: float | None  # of the machine's CPU time while they ran (``/proc/stat``; None off Linux)
    system_share: float | None

    @property
    def lost_s_per_gb(self) -> float:
        """Compute seconds lost per GB (10**9 bytes) moved: ``(beside - alone) / GB``, 0 when nothing moved."""
        return (self.beside_s - self.alone_s) / (self.bytes_moved / 1e9) if self.bytes_moved else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "lost_s_per_gb": self.lost_s_per_gb}


def cpu_times() -> list[int] | None:
    """``/proc/stat``'s first line: user, nice, system, idle, iowait, irq, softirq, steal (jiffies); ``None``
    off Linux."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def cpu_shares(before: list[int] | None, after: list[int] | None) -> tuple[float | None, float | None]:
    """The system and steal shares of the machine's CPU time between two `cpu_times` readings (``None``
    where either is missing). Steal is what the hypervisor of a virtual machine ran elsewhere."""
    if before is None or after is None:
        return None, None
    delta = [x - y for x, y in zip(after, before)]
    total = sum(delta) or 1
    return delta[2] / total, delta[7] / total


def measure_io_cpu_cost(
    directory: str,
    *,
    seconds: float = 3.0,
    size: int = 512 * 2**20,
    block_size: int = 2**20,
    io_threads: int = 2,
    window: int = 16 * 2**20,
    rate: float | None = None,
    mode: str = "rw",
) -> IOCpuCost:
    """Time fp32 matmuls on every core alone, then beside a stream of ``O_DIRECT`` writes and reads (``mode``:
    ``"rw"``, ``"w"`` or ``"r"``) of ``window``-byte pieces over a ``size``-byte file in a fresh run directory of
    ``directory``, then alone again. ``seconds``: about one run of matmuls alone; ``rate``: the stream's cap in
    bytes per second (``None``: none). The matmuls beside the stream run again, one run at a time, until a piece
    has landed while they ran (a drive slower than one run, or a loaded machine), up to `IO_CPU_PATIENCE_S`
    seconds, and the runs alone are counted to match; a stream that lands nothing in that time is a
    `RuntimeError`, since a cost measured beside no I/O would read as none. Waits time out; a stream failure is
    raised once the matmuls end."""
    if mode not in ("rw", "w", "r"):
        raise ValueError(f"mode: got {mode!r}; expected 'rw', 'w' or 'r'")
    window = max(PAGE, window // PAGE * PAGE)
    size = max(2 * window, size // window * window)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)

    def matmuls(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            torch.mm(a, b)
        return time.perf_counter() - start

    matmuls(3)  # the kernels and the allocator warm
    per = max(matmuls(5) / 5, 1e-6)
    n = max(5, round(seconds / per))
    alone_before = matmuls(n)

    stop = threading.Event()
    failure: list[BaseException] = []
    moved = [0]  # written by the stream thread only; this thread reads snapshots (one int each)
    with _probe_file(directory, "io_cpu.bin", size, threads=io_threads, block_size=block_size,
                     direct_io="auto") as (engine, f):
        src, dst = alloc_host_buffer(window), alloc_host_buffer(window)
        src.copy_(torch.randint(0, 256, (window,), dtype=torch.uint8))
        for offset in range(0, size, window):  # the first write converts unwritten extents: a warm-up
            engine.write(f, offset, src).result(timeout=300)

        def stream() -> None:
            try:
                offset, began = 0, time.perf_counter()
                while not stop.is_set():
                    if rate is not None and moved[0] > rate * (time.perf_counter() - began):
                        time.sleep(0.005)
                        continue
                    pending = ([engine.write(f, offset, src)] if "w" in mode else []) + \
                              ([engine.read(f, (offset + size // 2) % size, dst)] if "r" in mode else [])
                    for fut in pending:
                        fut.result(timeout=300)
                    moved[0] += len(pending) * window
                    offset = (offset + window) % size
            except BaseException as exc:  # noqa: BLE001 - handed to the measuring thread, which raises it
                failure.append(exc)

        io = threading.Thread(target=stream, name="fuyou-io-cpu-probe", daemon=True)
        io.start()
        try:
            time.sleep(0.5)  # the stream at its rate before the matmuls start
            cpu_before, moved_before = cpu_times(), moved[0]
            beside, runs, began = matmuls(n), 1, time.perf_counter()
            while moved[0] == moved_before and not failure and time.perf_counter() - began < IO_CPU_PATIENCE_S:
                beside += matmuls(n)  # no piece landed beside them yet
                runs += 1
            cpu_after, moved_during = cpu_times(), moved[0] - moved_before
        finally:
            stop.set()  # before the file closes, on every path
        io.join(timeout=300)
        if io.is_alive():
            raise RuntimeError(f"the I/O stream in {directory} did not stop within 300 s")
        if failure:
            raise failure[0]
    if not moved_during:
        raise RuntimeError(f"the I/O stream in {directory} landed no {format_bytes(window)} piece in "
                           f"{beside:.0f} s of matmuls beside it; the drive may be hung (check dmesg)")
    alone = min(alone_before, matmuls(n)) * runs  # as many matmuls as ran beside the stream
    system, steal = cpu_shares(cpu_before, cpu_after)
    return IOCpuCost(directory, torch.get_num_threads(), io_threads, alone, beside, moved_during, steal, system)
