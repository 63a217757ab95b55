"""`IOEngine`: asynchronous reads and writes of byte ranges, threads per swap directory.

Worker threads call ``os.preadv``/``os.pwritev`` (no C extension, no libaio; they release the GIL), a pool per
swap directory, so a few threads keep a drive's queue full and striped directories run in parallel. Files are
opened ``O_DIRECT`` where the filesystem accepts it, so the page cache does not become an unbudgeted host tier;
elsewhere the directory falls back to buffered I/O (announced once), bounding the cache with ``fdatasync`` +
``posix_fadvise(DONTNEED)``. Every error reaches the future's waiter as a `StorageIOError` naming the file, the
offset and the byte count; short transfers are retried, and one that makes no progress is an error.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import threading
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .. import trace
from ..config import PAGE, format_bytes
from ..device import alloc_host_buffer

__all__ = ["StorageIOError", "SwapFile", "IOEngine", "DONE", "byte_view", "completed", "gather", "then",
           "filesystem_type"]

log = logging.getLogger("fuyou_strategy.storage")

# Indirection points for fault-injection tests; production code always uses the os calls.
_preadv: Callable = os.preadv
_pwritev: Callable = os.pwritev

# In buffered mode, flush and drop a file's pages once this many bytes are dirty.
BUFFERED_DIRTY_LIMIT = 64 * 2**20


class StorageIOError(OSError):
    """A read or write failed; the message names the file, the offset and the byte count."""


def filesystem_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (e.g. ``'ext4'``, ``'tmpfs'``)."""
    path = os.path.realpath(path)
    best, fstype = "", "unknown"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("I/O buffers must be contiguous CPU tensors")
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


@dataclass(eq=False)
class SwapFile:
    """An open swap file. ``direct`` says whether it was opened with ``O_DIRECT``."""

    path: str
    fd: int
    direct: bool
    dir_index: int
    _dirty: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _buffered_fd: int = -1

    def buffered_fd(self) -> int:
        """A second descriptor without ``O_DIRECT``, opened on first use (error paths only)."""
        with self._lock:
            if self._buffered_fd < 0:
                self._buffered_fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            return self._buffered_fd


DONE: Future = Future()  # completed with None: shared, as nothing can change a finished future (`completed`)
DONE.set_result(None)


def completed(result: object = None, error: BaseException | None = None) -> Future:
    """A future completed at once with ``result`` (or ``error``): `DONE` for ``None``, which costs no lock to make
    (a host-tier transfer is a copy made before it returns; a chunk's bookkeeping makes several a step)."""
    if error is None and result is None:
        return DONE
    fut: Future = Future()
    fut.set_exception(error) if error is not None else fut.set_result(result)
    return fut


def gather(futures: Sequence[Future], result: object = None) -> Future:
    """One future that completes when all ``futures`` have, with the first error if any; never early on an
    error, since a sibling transfer may still use its buffer."""
    if all(f.done() for f in futures):  # at once, as the callbacks below would run (in this order): no lock
        errors = (CancelledError() if f.cancelled() else f.exception() for f in futures)
        return completed(result, next((e for e in errors if e is not None), None))
    out: Future = Future()
    lock = threading.Lock()
    state = {"left": len(futures), "error": None}

    def done(f: Future) -> None:
        error = CancelledError() if f.cancelled() else f.exception()  # exception() raises if cancelled
        with lock:
            if error is not None and state["error"] is None:
                state["error"] = error
            state["left"] -= 1
            last = state["left"] == 0
        if last:
            if state["error"] is not None:
                out.set_exception(state["error"])
            else:
                out.set_result(result)

    for f in futures:
        f.add_done_callback(done)
    return out


def then(fut: Future, fn: Callable[[Future], object]) -> Future:
    """A future for ``fn(fut)``, called once ``fut`` completes: its return value, or what it raises. For
    bookkeeping that must precede any waiter: CPython wakes waiters *before* running callbacks, and drops a
    callback's exception."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            result = fn(f)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on `out`
            out.set_exception(exc)
        else:
            out.set_result(result)

    if fut.done():  # what add_done_callback would do, in this thread, without keeping the callback
        done(fut)
    else:
        fut.add_done_callback(done)
    return out


class _Failed(OSError):
    """A transfer failed at ``offset`` with ``nbytes`` still to move."""

    def __init__(self, code: int | None, why: str | None, offset: int, nbytes: int) -> None:
        super().__init__(code or errno.EIO, why)
        self.offset, self.nbytes = offset, nbytes


def _move(fd: int, direct: bool, block: memoryview, offset: int, write: bool) -> None:
    """Move all of ``block`` at ``offset``, resuming after short transfers."""
    done, total = 0, len(block)
    restarted_at = -1
    while done < total:
        try:
            n = (_pwritev if write else _preadv)(fd, [block[done:]], offset + done)
        except OSError as exc:
            raise _Failed(exc.errno, exc.strerror, offset + done, total - done) from exc
        stalled = n == 0
        done += n
        if direct and done % PAGE and done < total:
            # O_DIRECT cannot resume at an unaligned offset: redo the last partial page,
            # and give up if that gains nothing.
            aligned = done - done % PAGE
            stalled, restarted_at = aligned <= restarted_at, aligned
            if not stalled:
                done = aligned
        if stalled:
            op = "write" if write else "read"
            why = f"short {op}: {done} of {total} bytes, then no progress (disk full or a file size limit?)"
            raise _Failed(errno.EIO, why, offset, total)


class _Directory:
    def __init__(self, index: int, path: str, threads: int, direct: bool) -> None:
        self.index = index
        self.path = path
        self.direct = direct
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"fuyou-io{index}")


class IOEngine:
    """Asynchronous byte-range I/O over one or more directories.

    Args:
        dirs: directories to hold swap files, one per drive; each gets its own threads.
        threads_per_dir: worker threads per directory.
        block_size: the largest request handed to the kernel; larger transfers are split
            into blocks of this size, spread over the directory's threads.
        direct_io: ``"auto"`` (``O_DIRECT`` where accepted, else buffered, announced once),
            ``"on"`` (refusal is an error), or ``"off"``.
    """

    def __init__(
        self,
        dirs: Sequence[str],
        *,
        threads_per_dir: int = 4,
        block_size: int = 2**20,
        direct_io: str = "auto",
    ) -> None:
        if block_size < PAGE or block_size % PAGE:
            raise ValueError(f"block_size: got {block_size}; expected a positive multiple of 4096")
        self.block_size = block_size
        self._dirs = [
            _Directory(i, d, threads_per_dir, self._probe_direct(d, direct_io)) for i, d in enumerate(dirs)
        ]
        self._closed = False
        # One uncontended lock per transfer, on the thread that submits it: `+=` is not atomic.
        self._count_lock = threading.Lock()
        self._bytes = [0, 0]  # [read, written], counted when submitted (`bytes_written`)

    @property
    def bytes_read(self) -> int:
        """Bytes read from the swap files so far (transfers submitted; for metrics, like `bytes_written`)."""
        return self._bytes[0]

    @property
    def bytes_written(self) -> int:
        """Bytes written to the swap files so far (for metrics), counted at submission, so a step's figure holds
        the writes it began even if they land after it; failed transfers count too."""
        return self._bytes[1]

    def is_direct(self, index: int) -> bool:
        return self._dirs[index].direct

    # -- O_DIRECT probe ----------------------------------------------------------------------------
    @staticmethod
    def _probe_direct(path: str, mode: str) -> bool:
        """Whether ``path`` accepts an aligned ``O_DIRECT`` write and read."""
        if mode == "off":
            return False
        probe = os.path.join(path, f".fuyou-odirect-probe-{os.getpid()}-{threading.get_ident()}")
        buf = alloc_host_buffer(PAGE)
        reason = None
        try:
            fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC, 0o600)
            try:
                os.pwritev(fd, [byte_view(buf)], 0)
                os.preadv(fd, [byte_view(buf)], 0)
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise StorageIOError(exc.errno, f"cannot write a probe file in swap directory {path!r}: {exc.strerror}") from exc
            reason = exc.strerror
        finally:
            try:
                os.unlink(probe)
            except FileNotFoundError:
                pass
        fstype = filesystem_type(path)
        if reason is not None:
            if mode == "on":
                raise StorageIOError(
                    errno.EINVAL,
                    f"direct_io='on' but {path!r} ({fstype}) refuses O_DIRECT ({reason}); "
                    "use direct_io='auto' to fall back to buffered I/O, or a directory on a real drive",
                )
            log.warning(
                "fuyou: %s (%s) refuses O_DIRECT (%s); using buffered I/O there, with page-cache "
                "use bounded by fdatasync + fadvise(DONTNEED)", path, fstype, reason,
            )
            return False
        if fstype in ("tmpfs", "ramfs"):
            log.warning("fuyou: swap directory %s is on %s: the 'SSD' tier is RAM there", path, fstype)
        return True

    # -- files ----------------------------------------------------------------------------------------
    def open(self, dir_index: int, name: str) -> SwapFile:
        """Create (0600) and open ``name`` inside directory ``dir_index``."""
        d = self._dirs[dir_index]
        path = os.path.join(d.path, name)
        flags = os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if d.direct else 0)
        fd = os.open(path, flags, 0o600)
        return SwapFile(path, fd, d.direct, dir_index)

    def close_file(self, f: SwapFile) -> None:
        for fd in (f.fd, f._buffered_fd):
            if fd >= 0:
                os.close(fd)
        f.fd = f._buffered_fd = -1

    # -- transfers ------------------------------------------------------------------------------------
    def read(self, f: SwapFile, offset: int, buf: torch.Tensor) -> Future:
        """Fill ``buf`` (a contiguous CPU tensor) from ``f`` at ``offset``; returns a future."""
        return self._submit(f, offset, buf, write=False)

    def write(self, f: SwapFile, offset: int, buf: torch.Tensor) -> Future:
        """Write all of ``buf`` to ``f`` at ``offset``; returns a future."""
        return self._submit(f, offset, buf, write=True)

    def _submit(self, f: SwapFile, offset: int, buf: torch.Tensor, *, write: bool) -> Future:
        if self._closed:
            raise RuntimeError("IOEngine is closed")
        view = byte_view(buf)
        nbytes = len(view)
        if f.direct and (offset % PAGE or nbytes % PAGE or buf.data_ptr() % PAGE):
            raise ValueError(
                f"O_DIRECT transfer on {f.path} must be 4 KiB aligned: offset={offset}, "
                f"nbytes={nbytes}, address%4096={buf.data_ptr() % PAGE}"
            )
        pool = self._dirs[f.dir_index].pool
        futures = []
        for start in range(0, nbytes, self.block_size):
            block = view[start : start + self.block_size]
            # `buf` rides along so the tensor outlives the transfer; `_transfer` lets go of it before
            # the future completes, so a buffer handed back on completion is nobody else's.
            futures.append(pool.submit(self._transfer, f, offset + start, block, write, [buf]))
        with self._count_lock:
            self._bytes[write] += nbytes
        return gather(futures)

    def _transfer(self, f: SwapFile, offset: int, block: memoryview, write: bool, keepalive: list) -> None:
        try:
            self._move_block(f, offset, block, write)
        finally:
            keepalive.clear()

    def _move_block(self, f: SwapFile, offset: int, block: memoryview, write: bool) -> None:
        op = "write" if write else "read"
        tracer = trace.active()
        start = tracer.now() if tracer is not None else 0.0
        try:
            try:
                _move(f.fd, f.direct, block, offset, write)
            except OSError as exc:
                if not (f.direct and exc.errno == errno.EINVAL):
                    raise
                # The transfer is aligned (checked at submit), so EINVAL hides the real cause,
                # e.g. a file size limit that cut the count to an unaligned length. Retry it
                # once without O_DIRECT: that either succeeds or surfaces the true errno.
                _move(f.buffered_fd(), False, block, offset, write)
        except _Failed as exc:
            raise self._error(exc.errno, exc.strerror, op, f, exc.offset, exc.nbytes) from exc
        if tracer is not None:
            tracer.add(f"ssd {threading.current_thread().name}", op, start, tracer.now(),
                       file=os.path.basename(f.path), offset=offset, bytes=len(block))
        if not f.direct:
            self._bound_page_cache(f, offset, len(block), write)

    def _bound_page_cache(self, f: SwapFile, offset: int, nbytes: int, write: bool) -> None:
        if not write:
            os.posix_fadvise(f.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
            return
        with f._lock:
            f._dirty += nbytes
            flush = f._dirty >= BUFFERED_DIRTY_LIMIT
            if flush:
                f._dirty = 0
        if flush:
            os.fdatasync(f.fd)
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _error(self, code: int | None, why: str | None, op: str, f: SwapFile, offset: int, nbytes: int) -> StorageIOError:
        hint = ""
        if code == errno.ENOSPC:
            free = shutil.disk_usage(os.path.dirname(f.path)).free
            hint = f"; {format_bytes(free)} free there: free space, or add/choose larger swap_dirs"
        elif code == errno.EIO:
            hint = "; the drive reported an I/O error: check it (dmesg, smartctl) or use another swap dir"
        return StorageIOError(code or errno.EIO, f"{op} of {nbytes} bytes at offset {offset} in {f.path} failed: {why}{hint}")

    def close(self) -> None:
        """Wait for queued transfers, then stop the threads."""
        if self._closed:
            return
        self._closed = True
        for d in self._dirs:
            d.pool.shutdown(wait=True)
