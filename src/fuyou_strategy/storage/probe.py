"""Sequential read/write bandwidth of a swap directory, and what its I/O costs the compute beside it,
measured with the engine itself.

``fuyou io-bench`` prints the bandwidth; the planner reuses `measure_bandwidth` to learn how fast the
SSD tier is instead of trusting hand-set constants. `measure_io_cpu_cost` (``fuyou doctor``) times CPU
matmuls alone and beside a stream of swap I/O: a drive moves bytes without the CPU, but the kernel,
and in a virtual machine the hypervisor that emulates the disk, spend CPU per byte, and where every core
computes that CPU comes out of the compute (``steal`` in ``/proc/stat`` on a VM).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch

from ..config import PAGE
from ..device import alloc_host_buffer
from .aio import IOEngine, SwapFile, filesystem_type
from .rundir import make_run_dir, remove_run_dir

__all__ = ["Bandwidth", "IOCpuCost", "cpu_shares", "cpu_times", "measure_bandwidth", "measure_io_cpu_cost"]

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
    alone_s: float  # the matmuls alone (the faster of the runs before and after)
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
    """Time fp32 matmuls on every core (``torch.get_num_threads()``) alone, then beside a stream of
    ``O_DIRECT`` writes and reads (``mode``: ``"rw"``, ``"w"`` or ``"r"``) of ``window``-byte pieces
    cycling over a ``size``-byte file in ``directory`` (the optimizer's pattern: a chunk written while
    another is read), then alone again. ``seconds``: about how long each run of matmuls takes alone;
    ``rate``: bytes per second the stream keeps to at most (``None``: as fast as the drive takes them).

    Each wait has a timeout; a failure of the stream is raised here once the matmuls end. The file
    lives in a fresh run directory that is removed afterwards."""
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
            beside = matmuls(n)
            cpu_after, moved_during = cpu_times(), moved[0] - moved_before
        finally:
            stop.set()  # before the file closes, on every path
        io.join(timeout=300)
        if io.is_alive():
            raise RuntimeError(f"the I/O stream in {directory} did not stop within 300 s")
        if failure:
            raise failure[0]
    alone = min(alone_before, matmuls(n))
    system, steal = cpu_shares(cpu_before, cpu_after)
    return IOCpuCost(directory, torch.get_num_threads(), io_threads, alone, beside, moved_during, steal, system)
