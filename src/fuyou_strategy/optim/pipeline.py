"""`ChunkPipeline`: one worker thread that streams tensor-store chunks through a function.

Jobs name a store entry and a function ``fn(k, buf)`` called for each of its chunks, in
order, with the chunk's bytes already read into a pool buffer. Reads run ahead of the
function by up to ``depth`` chunks (across jobs), so the drive is busy while the CPU
computes. ``fn`` either hands the buffer on (e.g. to `TensorStore.write_chunk`, which
returns a future and releases it when written) or releases it; returned futures are kept
so `drain()` can wait for them.

The optimizer uses it for the AdamW update (read state → update → write shadow slot), for
restoring weights after a skipped step, and for streaming checkpoints.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from ..storage import ACTIVE, HostBuffer, TensorStore, gather

__all__ = ["ChunkJob", "ChunkPipeline"]


@dataclass
class ChunkJob:
    """Stream every chunk of store entry ``entry`` (slot ``slot``) through ``fn(k, buf)``."""

    entry: str
    nchunks: int
    fn: Callable[[int, HostBuffer], "Future | None"]
    slot: str = ACTIVE


class ChunkPipeline:
    """A worker thread with read-ahead; see the module docstring.

    Args:
        store: where the chunks live.
        depth: chunks read ahead of the one being processed. It must leave room in the
            host pool for one more buffer, or the worker would wait on itself; the caller
            sizes it (`FuyouAdamW` does from the pool budget and the chunk size).
    """

    def __init__(self, store: TensorStore, depth: int, name: str = "fuyou-pipeline") -> None:
        if depth < 1:
            raise ValueError(f"depth: got {depth}; need at least one chunk in flight")
        self.store = store
        self.depth = depth
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: list[Future] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: ChunkJob) -> None:
        self._queue.put(job)

    def drain(self) -> None:
        """Wait until every submitted job ran and every future it returned completed.

        Raises the first error of any read, function call or returned future, and forgets
        it, so the pipeline can be used again (e.g. to restore weights after a failure).
        """
        done = threading.Event()
        self._queue.put(done)
        done.wait()
        futures, self._futures = self._futures, []
        error, self._error = self._error, None
        if futures:
            gathered = gather(futures)
            gathered.exception()  # waits for all of them
            if error is None:
                error = gathered.exception()
        if error is not None:
            raise error

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    # -- the worker ----------------------------------------------------------------------------
    def _loop(self) -> None:
        todo: deque[tuple[ChunkJob, int]] = deque()
        pending: deque[tuple[ChunkJob, int, Future]] = deque()
        waiters: list[threading.Event] = []
        while True:
            try:
                item = self._queue.get(block=not todo and not pending)
            except queue.Empty:
                item = False
            if item is None:
                for _job, _k, fut in pending:
                    fut.add_done_callback(lambda f: f.exception() is None and f.result().release())
                return
            if isinstance(item, threading.Event):
                waiters.append(item)
            elif item is not False:
                todo.extend((item, k) for k in range(item.nchunks))
                continue  # take everything already queued before working
            while todo and len(pending) < self.depth:
                job, k = todo.popleft()
                pending.append((job, k, self._read(job, k)))
            if pending:
                self._process(*pending.popleft())
            if not todo and not pending:
                for w in waiters:
                    w.set()
                waiters.clear()

    def _read(self, job: ChunkJob, k: int) -> Future:
        try:
            return self.store.read_chunk(job.entry, k, slot=job.slot)
        except BaseException as exc:  # noqa: BLE001 - handed to drain()
            failed: Future = Future()
            failed.set_exception(exc)
            return failed

    def _process(self, job: ChunkJob, k: int, fut: Future) -> None:
        if fut.exception() is not None:
            self._error = self._error or fut.exception()
            return
        buf = fut.result()
        if self._error is not None:  # after a failure, only drain what is in flight
            buf.release()
            return
        try:
            out = job.fn(k, buf)
        except BaseException as exc:  # noqa: BLE001 - handed to drain()
            buf.release()
            self._error = exc
            return
        if out is not None:
            self._futures.append(out)
