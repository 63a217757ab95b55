"""`ChunkPipeline`: one worker thread that streams tensor-store chunks through a function.

A job names a store entry and ``fn(k, buf)``, called for each chunk in order with its bytes read into a pool
buffer (``fn(k, buf, *extra)`` with ``extra`` entries chunked alike; ``fn(k)`` with no entry: a write-only
job). Reads run up to ``depth`` chunks ahead (across jobs), so the drive works while the CPU computes. ``fn``
hands the buffer on (`TensorStore.write_chunk` releases it when written) or releases it; the futures it
returns are kept for `drain()`, and a returned `Later(now, later)` lets ``later`` (a shadow-slot write that
`TensorStore.commit` can commit in flight) outlast a `drain(writes=False)`.

Every wait has a way out: the worker's waits and `drain()`'s give up after ``io_timeout`` seconds; if the
worker stops (`close()`, or an error in its own bookkeeping) every waiter, present and later, gets a
`PipelineError` naming the cause, and `drain()` checks that the thread is alive while it waits.

`read_ahead` names chunks jobs will probably read later (the state of the last gradients' parameters): while
idle, the worker reads at most two at a time into buffers the pool spares, and a job takes such a buffer
instead of reading again if nothing wrote the slot since (`TensorStore.slot_version`). The next `drain()`
gives back the ones no job took.

The worker's ops run on ``threads`` intra-op threads when given (`device.use_intra_op_threads`). The optimizer
uses it for the AdamW update, restoring weights after a skipped step, and streaming checkpoints.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from .. import trace
from ..device import use_intra_op_threads
from ..storage import ACTIVE, HostBuffer, StorageError, TensorStore, gather
from ..storage.store import SlotVersion
from ..storage.aio import completed, then

__all__ = ["ChunkJob", "ChunkPipeline", "Later", "PipelineError"]

_LIVENESS_POLL = 1.0  # seconds between checks that the worker is alive while drain() waits
_AHEAD_IN_FLIGHT = 2  # read-ahead reads on the drive at once: a job's own read waits behind at most these
_WAKE = object()  # queued by a read-ahead read as it lands: the idle worker may start the next one


class PipelineError(RuntimeError):
    """The pipeline's worker stopped (closed, or died of an unexpected error); it runs no more jobs."""


@dataclass
class ChunkJob:
    """Stream every chunk of store entry ``entry`` (slot ``slot``) through ``fn(k, buf)``. ``extra`` entries
    (same chunking, active slot) are read alongside and passed after ``buf``; ``entry=None`` reads nothing for
    the entry. ``fence=True``: nothing of this job is read before every earlier job ran and its writes
    completed (a job reading what they write). ``done``: completed once every chunk ran and its futures
    completed, or with the error that stopped the job (its own, an earlier job's, or the worker stopping).
    ``lent``: the entry is in memory (host RAM or a device) and lends its chunks in place (``lend``), each returned
    at once (`TensorStore.lend_chunk`) rather than through a read's future. ``batch``: chunks per call of such a
    job: ``fn(k, *bufs)`` gets the lent chunks ``k`` to ``k + len(bufs) - 1`` (up to ``batch`` of them), so that the
    worker's bookkeeping per call is paid once for several chunks; they take no pool buffer, and a batch counts once
    toward ``depth``."""

    entry: str | None
    nchunks: int
    fn: Callable[..., "Future | None"]
    slot: str = ACTIVE
    extra: tuple[str, ...] = ()
    fence: bool = False
    done: Future | None = None
    lend: str | None = None  # fn writes each chunk back to this slot: `TensorStore.read_chunk`'s ``lend``
    fill: bool = True  # False: a lent shadow chunk comes unfilled, fn reads the active one (`read_chunk`'s ``fill``)
    skip: Callable[[int], int] | None = None  # bytes at the head of chunk k that fn fills itself (`read_chunk`'s)
    lent: bool = False
    batch: int = 1
    _outs: list = field(default_factory=list, init=False, repr=False)  # what the chunks returned so far


class Later(NamedTuple):
    """What a job function returns when one of its writes may land after a `ChunkPipeline.drain` with
    ``writes=False``: ``now`` (waited for by every drain, or None) and ``later`` (waited for by a full drain, or
    by the next drain of either kind)."""

    now: Future | None
    later: Future


@dataclass
class ReadAhead:
    """Chunks ``(entry, k, skip)`` of the active slot that jobs will probably read, in the order to read them,
    each without its first ``skip`` bytes (`ChunkJob.skip`); the buffers come from the pool only while
    ``keep_free`` bytes of its budget stay free for everyone else."""

    chunks: list[tuple[str, int, int]]
    keep_free: int


class ChunkPipeline:
    """A worker thread with read-ahead (module docstring).

    Args:
        store: where the chunks live; ``store.config.io_timeout`` bounds every wait.
        depth: chunks read ahead of the one being processed; the pool must hold one more buffer, or the worker
            waits on itself (`FuyouAdamW` sizes it from the budget and the chunk size).
        name: the worker thread's name, used in errors.
        threads: the intra-op threads of the worker's own ops; ``None``: torch's default.
    """

    def __init__(self, store: TensorStore, depth: int, name: str = "fuyou-pipeline", *,
                 threads: int | None = None) -> None:
        if depth < 1:
            raise ValueError(f"depth: got {depth}; need at least one chunk in flight")
        self.store = store
        self.depth = depth
        self.name = name
        self.timeout = store.config.io_timeout
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # Owned by the worker thread; handed to a drain() waiter when everything before it ran: the futures the
        # jobs returned, and apart from them the `Later` writes, which a partial drain may leave in flight.
        self._futures: list[Future] = []
        self._later: list[Future] = []
        # Owned by the thread that drains (the training loop's): the `Later` writes a `drain(writes=False)` left in
        # flight, waited for by the next drain.
        self._landing: list[Future] = []
        self._error: BaseException | None = None
        self._todo: deque[tuple[ChunkJob, int]] = deque()
        self._pending: deque[tuple[ChunkJob, int, Future]] = deque()
        self._waiters: list[Future] = []
        self._stopped: tuple[str, BaseException | None] | None = None  # (why, cause) once the worker stopped
        self._progress = time.monotonic()  # when the worker last processed a chunk (`wait_job`)
        # The read-ahead, owned by the worker thread: chunks still to read, the reads made (the slot's version
        # token when the read began, and the read), the chunks jobs read themselves since (never read ahead).
        self._ahead_todo: deque[tuple[str, int, int]] = deque()
        self._ahead: dict[tuple[str, int], tuple[SlotVersion, Future, int]] = {}  # and the bytes the read skipped
        self._claimed: set[tuple[str, int]] = set()
        self._stale: list[Future] = []  # read-ahead reads found stale when a job asked, given back at the drain
        self._ahead_keep_free = 0
        self.ahead_used = 0  # read-ahead chunks a job took (written by the worker only; read for reports)
        self.ahead_dropped = 0  # read-ahead chunks no job took, or stale when one asked
        self.threads: int | None = threads  # the worker's intra-op threads, as it set them (written by it once)
        self._thread = threading.Thread(target=self._run, args=(threads,), name=name, daemon=True)
        self._thread.start()

    def submit(self, job: ChunkJob) -> None:
        """Queue ``job``; raises `PipelineError` if the worker stopped, `TypeError` for a malformed job."""
        if not isinstance(job, ChunkJob) or not isinstance(job.nchunks, int) or job.nchunks < 0 or not callable(job.fn):
            raise TypeError(f"{self.name}: got {job!r}; expected a ChunkJob with an int nchunks >= 0 and a callable fn")
        if (not isinstance(job.batch, int) or job.batch < 1 or job.batch > 1 and not job.lent
                or job.lent and (job.entry is None or job.lend is None or job.extra or job.skip is not None)):
            raise TypeError(f"{self.name}: got batch={job.batch!r}, lent={job.lent} for entry {job.entry!r} (lend "
                            f"{job.lend!r}, extra {job.extra!r}); a batch of chunks per call is an int >= 1, more than "
                            "1 only of lent chunks: an entry's, with a lend slot, no extra entries and no skip")
        self._put(job)
        if job.nchunks == 0 and job.done is not None:
            job.done.set_result(None)

    def read_ahead(self, chunks: list[tuple[str, int] | tuple[str, int, int]], *, keep_free: int) -> None:
        """Read these chunks ``(entry, k)`` or ``(entry, k, skip)`` (without the first ``skip`` bytes: `ChunkJob.skip`)
        of the active slot ahead while the worker is idle, replacing any earlier list; ``keep_free``: pool bytes
        the read-ahead never takes. Raises `PipelineError` if the worker stopped."""
        self._put(ReadAhead([(name, k, *skip) if skip else (name, k, 0) for name, k, *skip in chunks], keep_free))

    def wait_job(self, job: ChunkJob, what: str | Callable[[], str]) -> None:
        """Wait for ``job.done`` while later jobs go on; raises the job's error, `PipelineError` if the worker
        stops, `TimeoutError` if it processed no chunk for ``io_timeout`` seconds. ``what`` names the job in the
        errors and the trace (e.g. "the update of parameter 3"; a callable: made only when needed, since a run's
        job is waited for once per parameter of it and is mostly done)."""
        if job.done is None:
            raise ValueError(f"{self.name}: wait_job needs a job submitted with done=Future(); got {job!r}")
        if not job.done.done():
            since = time.monotonic()
            with trace.span("waits", f"wait: {named(what)}"):
                self._wait_done(job, named(what), since)
        error = job.done.exception()
        if isinstance(error, TimeoutError):
            raise TimeoutError(f"{self.name}: {named(what)} did not complete: {error}") from error
        job.done.result()

    def _wait_done(self, job: ChunkJob, what: str, since: float) -> None:
        while not wait([job.done], timeout=_LIVENESS_POLL).done:
            if not self._thread.is_alive() and not job.done.done():
                raise self._stopped_error()
            if time.monotonic() - max(since, self._progress) > self.timeout:
                raise TimeoutError(f"{self.name}: {what} is not done and the worker has made no progress for "
                                   f"{self.timeout:g} s; the drive may be hung (check dmesg), or raise "
                                   "FuyouConfig.io_timeout")

    def drain(self, *, writes: bool = True) -> None:
        """Wait until every submitted job ran and every future it returned completed. Raises (and forgets, so the
        pipeline stays usable) the first error of a read, call or future; `TimeoutError` if a future is not done
        ``io_timeout`` after the jobs ran; `PipelineError` if the worker stopped. ``writes=False``: `Later` writes
        in flight are left to the next drain, unless something failed. Only one thread drains."""
        barrier: Future = Future()
        self._put(barrier)
        while not wait([barrier], timeout=_LIVENESS_POLL).done:
            if not self._thread.is_alive() and not barrier.done():
                raise self._stopped_error()
        error, futures, later = barrier.result()  # PipelineError if the worker stopped first
        earlier, self._landing = self._landing, []  # the last partial drain's
        if not writes and error is None and not any(f.done() and f.exception() is not None for f in earlier + later):
            error = self._wait_futures(futures + earlier)
            if error is None:
                self._landing = [f for f in later if not f.done() or f.exception() is not None]
                return
        error = self._wait_futures(futures + later + earlier, error)
        if error is not None:
            raise error

    def land(self) -> None:
        """Wait up to ``io_timeout`` for the `Later` writes the last `drain(writes=False)` left in flight, and
        forget them and their errors: for a caller about to discard what they wrote (a rollback of the shadow
        slot). Only the thread that drains calls it."""
        landing, self._landing = self._landing, []
        wait(landing, timeout=self.timeout)

    def _wait_futures(self, futures: list[Future], error: BaseException | None = None) -> BaseException | None:
        """Wait up to ``io_timeout`` for ``futures``; the first error (``error`` if given), or a `TimeoutError`."""
        if futures:
            gathered = gather(futures)
            if not wait([gathered], timeout=self.timeout).done:
                error = error or TimeoutError(
                    f"{self.name}: {sum(not f.done() for f in futures)} write(s) still not done "
                    f"{self.timeout:g} s after the jobs ran; the drive may be hung (check dmesg), "
                    "or raise FuyouConfig.io_timeout"
                )
            error = error or gathered.exception(timeout=0)
        return error

    def close(self) -> None:
        """Stop the worker (queued jobs dropped, waiters get `PipelineError`), waiting up to ``io_timeout`` for the
        job function running now."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(self.timeout)
            if self._thread.is_alive():
                raise PipelineError(f"{self.name}: the worker did not stop within {self.timeout:g} s "
                                    "(a job function is still running)")

    def _put(self, item: ChunkJob | Future | ReadAhead) -> None:
        if self._stopped is not None:
            raise self._stopped_error()
        self._queue.put(item)

    def _stopped_error(self) -> PipelineError:
        why, cause = self._stopped or (f"{self.name}: the worker thread is gone", None)
        error = PipelineError(why)
        error.__cause__ = cause
        return error

    # -- the worker ----------------------------------------------------------------------------
    def _run(self, threads: int | None) -> None:
        try:
            self.threads = use_intra_op_threads(threads) if threads is not None else torch.get_num_threads()
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            self._stop(f"{self.name}: the worker thread died of {type(exc).__name__}: {exc}; "
                       "this pipeline cannot run jobs any more: close it", exc)

    def _loop(self) -> None:
        todo, pending = self._todo, self._pending
        while True:
            try:
                item = self._queue.get(block=not todo and not pending)
            except queue.Empty:
                item = False
            if item is None:
                self._stop(f"{self.name} is closed", None)
                return
            if isinstance(item, Future):
                self._waiters.append(item)
            elif isinstance(item, ReadAhead):
                self._drop_ahead()
                self._ahead_todo.extend(item.chunks)
                self._ahead_keep_free = item.keep_free  # and on: an idle worker starts reading now
            elif isinstance(item, ChunkJob):
                todo.extend((item, k) for k in range(0, item.nchunks, item.batch))
                continue  # take everything already queued before working
            while todo and len(pending) < self.depth:
                job, k = todo[0]
                if job.fence and k == 0 and (pending or not self._writes_done()):
                    break
                todo.popleft()
                pending.append((job, k, self._read(job, k)))
            if pending:
                self._process(*pending.popleft())
            elif todo:  # a fenced job waits for the writes before it
                self._wait_writes(todo[0][0])
            if not todo and not pending and self._waiters:
                self._drop_ahead(wait_reads=True)  # a drain ends the window the read-ahead was for
                first, *rest = self._waiters
                first.set_result((self._error, self._futures, self._later))
                for w in rest:
                    w.set_result((None, [], []))
                self._waiters, self._futures, self._later, self._error = [], [], [], None
            elif not todo and not pending and self._ahead_todo:
                self._issue_ahead()

    def _stop(self, why: str, cause: BaseException | None) -> None:
        """Refuse further work, fail every waiter (queued ones too) and give back read buffers."""
        self._stopped = (why, cause)
        jobs = [job for job, _k, _fut in self._pending] + [job for job, _k in self._todo]
        for _job, _k, fut in self._pending:
            fut.add_done_callback(_release_buffer)
        self._todo.clear()
        self._pending.clear()
        self._drop_ahead()
        waiters, self._waiters = self._waiters, []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Future):
                waiters.append(item)
            elif isinstance(item, ChunkJob):
                jobs.append(item)
        for job in jobs:
            _fail(job, self._stopped_error())
        for w in waiters:
            if not w.done():
                w.set_exception(self._stopped_error())

    def _writes_done(self) -> bool:
        return self._error is not None or all(f.done() for f in self._futures + self._later)

    def _wait_writes(self, job: ChunkJob) -> None:
        if not wait(self._futures + self._later, timeout=self.timeout).not_done:
            return
        self._error = self._error or TimeoutError(
            f"{self.name}: the writes before job {job.entry or '(write-only)'!r} did not complete within "
            f"{self.timeout:g} s; the drive may be hung (check dmesg), or raise FuyouConfig.io_timeout"
        )

    # -- the read-ahead (worker thread only) ----------------------------------------------------------
    def _issue_ahead(self) -> None:
        """Start the next read-ahead reads, up to `_AHEAD_IN_FLIGHT` on the drive, while the pool spares a
        buffer; a chunk that cannot be read now (in host RAM, being written, gone) is skipped: its job
        reads it as always."""
        in_flight = sum(not fut.done() for _token, fut, _skip in self._ahead.values())
        while self._ahead_todo and in_flight < _AHEAD_IN_FLIGHT:
            name, k, skip = self._ahead_todo.popleft()
            key = (name, k)
            if key in self._ahead or key in self._claimed:
                continue
            try:
                token = self.store.slot_version(name)
                if not token.on_ssd:  # in host RAM: a job's read is a copy, nothing to gain
                    continue
                buf = self.store.pool.try_acquire(token.entry.chunk_len(k), keep_free=self._ahead_keep_free)
                if buf is None:  # the pool has nothing to spare: no more read-ahead in this window
                    self._ahead_todo.clear()
                    return
                fut = self.store.read_chunk(name, k, into=buf, skip=skip)  # releases the buffer if it fails
            except StorageError:
                continue
            self._ahead[key] = (token, fut, skip)
            fut.add_done_callback(lambda _f: self._queue.put(_WAKE))  # the idle worker starts the next one
            in_flight += 1

    def _take_ahead(self, job: ChunkJob, k: int) -> Future | None:
        """The read-ahead of chunk ``k`` of ``job``'s entry if it still holds what the job would read now, else
        None (and the chunk is never read ahead from here on)."""
        if not self._ahead and not self._ahead_todo:
            return None
        key = (job.entry, k)
        self._claimed.add(key)
        made = self._ahead.pop(key, None)
        if made is None:
            return None
        token, fut, skipped = made
        try:
            usable = (job.slot == ACTIVE and not job.fence and self.store.slot_version(job.entry) == token
                      and skipped <= (job.skip(k) if job.skip is not None else 0))  # the job fills what was skipped
        except StorageError:
            usable = False
        if usable and not (fut.done() and fut.exception() is not None):
            self.ahead_used += 1
            return fut
        self._stale.append(fut)  # given back by the next `_drop_ahead`
        self.ahead_dropped += 1
        return None

    def _drop_ahead(self, *, wait_reads: bool = False) -> None:
        """Forget the read-ahead: every buffer goes back to the pool (a read in flight's when it lands;
        ``wait_reads``: wait for those, up to ``io_timeout``, so a drain leaves no read of the window behind)."""
        made = [fut for _token, fut, _skip in self._ahead.values()]
        self.ahead_dropped += len(made)
        made += self._stale
        self._ahead.clear()
        self._ahead_todo.clear()
        self._claimed.clear()
        self._stale = []
        if wait_reads and made:
            wait(made, timeout=self.timeout)  # a read that failed or hangs is no one's: its chunk is read again
        for fut in made:  # one release each: now if landed (a drain's were waited for), else as it lands
            fut.add_done_callback(_release_buffer)

    def _read(self, job: ChunkJob, k: int) -> Future:
        """A future of the chunk's buffers: the entry's (if it names one; read ahead, if it was), then the
        extras'; a lent job's chunks, lent (`_lend`)."""
        if job.lent:
            return self._lend(job, k)
        reads = []
        try:
            if job.entry is not None:
                ahead = self._take_ahead(job, k)
                reads.append(ahead if ahead is not None else self.store.read_chunk(
                    job.entry, k, slot=job.slot, timeout=self.timeout, lend=job.lend, fill=job.fill,
                    skip=job.skip(k) if job.skip is not None else 0))
            for name in job.extra:
                reads.append(self.store.read_chunk(name, k, timeout=self.timeout))
        except BaseException as exc:  # noqa: BLE001 - handed to drain()
            for fut in reads:
                fut.add_done_callback(_release_buffer)
            failed: Future = Future()
            failed.set_exception(exc)
            return failed

        def collect(f: Future) -> tuple[HostBuffer, ...]:
            if f.exception() is not None:  # a failed read released its own buffer: give back the others
                for r in reads:
                    if r.exception() is None:
                        r.result().release()
                f.result()
            return tuple(r.result() for r in reads)

        return then(gather(reads), collect)

    def _lend(self, job: ChunkJob, k: int) -> Future:
        """A completed future of the chunks of the batch from ``k`` (`ChunkJob.lent`, ``batch``), lent at once by
        their in-memory entry (`TensorStore.lend_chunk`), or of the error that stopped the lending (what was lent is
        given back, marked failed)."""
        lent = []
        try:
            for i in range(k, min(k + job.batch, job.nchunks)):
                lent.append(self.store.lend_chunk(job.entry, i, slot=job.slot, lend=job.lend, fill=job.fill))
        except BaseException as exc:  # noqa: BLE001 - handed to drain()
            for chunk in lent:
                chunk.release()
            return completed(None, exc)
        return completed(tuple(lent))

    def _process(self, job: ChunkJob, k: int, fut: Future) -> None:
        self._progress = time.monotonic()
        self._process_chunk(job, k, fut)
        if self._error is not None:
            _fail(job, self._error)
        elif k + job.batch >= job.nchunks and job.done is not None:  # its last call
            then(gather(job._outs), lambda f, done=job.done: _complete(done, f))
            job._outs = []

    def _process_chunk(self, job: ChunkJob, k: int, fut: Future) -> None:
        if self._error is not None:  # after a failure, only give back what is in flight
            fut.add_done_callback(_release_buffer)
            return
        with trace.span("optimizer", "wait for read"):
            landed = fut.done() or wait([fut], timeout=self.timeout).done  # an in-memory chunk's is done at once
        if not landed:
            fut.add_done_callback(_release_buffer)
            self._error = TimeoutError(
                f"{self.name}: reading chunk {k} of entry {job.entry!r} did not complete within "
                f"{self.timeout:g} s; the drive may be hung (check dmesg), or raise FuyouConfig.io_timeout"
            )
            return
        if fut.exception() is not None:
            self._error = fut.exception()
            return
        bufs = fut.result()
        try:
            with trace.span("optimizer", job.entry or "write-only job", chunk=k):
                out = job.fn(k, *bufs)
        except BaseException as exc:  # noqa: BLE001 - handed to drain()
            for buf in bufs:
                buf.release()
            self._error = exc
            return
        if isinstance(out, Later):
            self._later.append(out.later)
            if job.done is not None:
                job._outs.append(out.later)
            out = out.now
        if isinstance(out, Future):
            self._futures.append(out)
            if job.done is not None:
                job._outs.append(out)
        elif out is not None:
            self._error = TypeError(f"{self.name}: the function of job {job.entry!r} returned {type(out).__name__} "
                                    f"for chunk {k}; it must return a Future, a Later or None")


def named(what: str | Callable[[], str]) -> str:
    """A job's name given as a string or as the callable that makes it (`ChunkPipeline.wait_job`)."""
    return what() if callable(what) else what


def _fail(job: ChunkJob, error: BaseException) -> None:
    """The job will not (all) run: its ``done`` gets the error that stopped it."""
    if job.done is not None and not job.done.done():
        job.done.set_exception(error)
        job._outs = []


def _complete(done: Future, written: Future) -> None:
    """``done`` of a job whose chunks all ran: once their futures completed, with their first error."""
    if not done.done():
        if written.exception() is not None:
            done.set_exception(written.exception())
        else:
            done.set_result(None)


def _release_buffer(fut: Future) -> None:
    """Done-callback of a read whose buffers nobody will use: give them back to the pool."""
    if not fut.cancelled() and fut.exception() is None:
        for buf in fut.result() if isinstance(fut.result(), tuple) else (fut.result(),):
            buf.release()
