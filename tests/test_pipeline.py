"""The optimizer's chunk pipeline: errors reach every waiter, and no wait hangs forever.

Each test that could hang against a broken pipeline runs the waiting call in a thread and
gives it a deadline, so a regression fails the test instead of stalling the suite.
"""

import re
import threading
from concurrent.futures import Future

import pytest
import torch

from fuyou_strategy import ConfigError, FuyouAdamW, FuyouConfig
from fuyou_strategy.optim import ChunkJob, ChunkPipeline
from fuyou_strategy.optim.pipeline import Later
from fuyou_strategy.storage import HostBudgetError, StorageError, TensorStore

DEADLINE = 15.0  # seconds; every failure below is reported after io_timeout = 1 s


def outcome(call, within=DEADLINE):
    """Run ``call()`` in a thread and return what it raised (None if nothing); fail if it is still
    blocked after ``within`` seconds: a wait with no way out."""
    raised = []

    def target():
        try:
            call()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(within)
    assert not thread.is_alive(), f"{getattr(call, '__name__', call)} still blocked after {within} s"
    return raised[0] if raised else None


def config(tmp_path, **changes):
    fields = dict(swap_dirs=[str(tmp_path)], chunk_size="8KiB", io_block_size="4KiB", host_memory_budget="256KiB",
                  io_threads=2, io_timeout=1)
    return FuyouConfig(**{**fields, **changes})


def make_store(cfg):
    store = TensorStore(cfg)
    store.create("x", (5000,), torch.float32)  # 20000 bytes: 3 chunks of 8 KiB
    store.write("x", torch.arange(5000, dtype=torch.float32)).result()
    return store


@pytest.fixture
def store(tmp_path):
    store = make_store(config(tmp_path))
    yield store
    store.close()


@pytest.fixture
def pipe(store):
    pipe = ChunkPipeline(store, depth=2, name="fuyou-test")
    yield pipe
    pipe.close()


def release(k, buf):
    buf.release()


def hang_reads(store, monkeypatch):
    """Make every read's future never complete, as when a completion callback raises (concurrent.futures
    logs and swallows the error). Returns ``end()``, which fails the stuck reads and every later one."""
    real, stuck, over = store.read_chunk, [], threading.Event()

    def read_chunk(name, k, **kwargs):
        inner, out = real(name, k, **kwargs), Future()

        def land(f):
            f.result().release()
            if over.is_set():
                out.set_exception(RuntimeError("test over"))
            raise RuntimeError("injected failure in a read's completion callback")

        stuck.append(out)
        inner.add_done_callback(land)
        return out

    def end():
        over.set()
        unblock(stuck)

    monkeypatch.setattr(store, "read_chunk", read_chunk)
    return end


def unblock(futures):
    for f in list(futures):
        if not f.done():
            f.set_exception(RuntimeError("test over"))


def die(*args):
    raise RuntimeError("injected bug in the worker's bookkeeping")


def test_every_chunk_is_streamed_in_order(pipe):
    seen = []

    def collect(k, buf):
        with buf:
            seen.append((k, buf.view(torch.float32)[0].item()))

    pipe.submit(ChunkJob("x", 3, collect))
    pipe.drain()
    assert seen == [(0, 0.0), (1, 2048.0), (2, 4096.0)]


def test_a_job_error_reaches_drain_once_and_the_pipeline_goes_on(pipe):
    def fail(k, buf):
        raise ValueError("bad chunk")

    pipe.submit(ChunkJob("x", 3, fail))
    with pytest.raises(ValueError, match="bad chunk"):
        pipe.drain()
    pipe.submit(ChunkJob("x", 3, release))
    pipe.drain()


def test_a_dead_worker_hands_its_error_to_every_waiter(pipe, monkeypatch):
    monkeypatch.setattr(pipe, "_process", die)
    pipe.submit(ChunkJob("x", 3, release))
    error = outcome(pipe.drain)
    assert isinstance(error, RuntimeError), error
    assert re.search(r"fuyou-test: the worker thread died of RuntimeError: injected bug", str(error))
    assert "injected bug" in str(error.__cause__)
    # Later waiters get it too, instead of blocking on a thread that is gone.
    for later in (pipe.drain, lambda: pipe.submit(ChunkJob("x", 3, release))):
        error = outcome(later)
        assert isinstance(error, RuntimeError) and "fuyou-test: the worker thread died" in str(error)
    pipe.close()
    assert not pipe._thread.is_alive()


def test_a_malformed_job_is_refused_at_submit(pipe):
    def submit_and_drain():
        pipe.submit(ChunkJob("x", "3", release))
        pipe.drain()

    error = outcome(submit_and_drain)
    assert isinstance(error, TypeError) and "int nchunks" in str(error)
    pipe.submit(ChunkJob("x", 3, release))  # the worker is unharmed
    pipe.drain()


def test_a_read_that_never_completes_is_a_timeout(store, pipe, monkeypatch):
    end = hang_reads(store, monkeypatch)
    pipe.submit(ChunkJob("x", 3, release))
    try:
        error = outcome(pipe.drain)
    finally:
        end()
    assert isinstance(error, TimeoutError), error
    assert "reading chunk 0 of entry 'x' did not complete within 1 s" in str(error)


def test_a_returned_future_that_never_completes_is_a_timeout(pipe):
    never = Future()

    def hand_on(k, buf):
        buf.release()
        return never

    pipe.submit(ChunkJob("x", 1, hand_on))
    try:
        error = outcome(pipe.drain)
    finally:
        unblock([never])
    assert isinstance(error, TimeoutError) and "1 write(s) still not done 1 s after" in str(error)


def test_a_job_that_keeps_its_buffers_gets_a_pool_timeout(tmp_path):
    kept = []

    def keep(k, buf):
        kept.append(buf)

    with make_store(config(tmp_path, host_memory_budget="16KiB")) as store:  # two 8 KiB chunks, not three
        pipe = ChunkPipeline(store, depth=1, name="fuyou-test")
        pipe.submit(ChunkJob("x", 3, keep))
        try:
            error = outcome(pipe.drain)
        finally:
            for buf in kept:
                buf.release()
        pipe.close()
    assert isinstance(error, HostBudgetError) and "host_memory_budget: waited 1.0 s" in str(error)


def test_close_wakes_a_waiting_drain_and_later_calls_are_refused(pipe):
    gate, started = threading.Event(), threading.Event()

    def slow(k, buf):
        started.set()
        gate.wait(DEADLINE)
        buf.release()

    pipe.submit(ChunkJob("x", 3, slow))
    waiting = threading.Thread(target=lambda: errors.append(outcome(pipe.drain)))
    errors = []
    waiting.start()
    assert started.wait(DEADLINE)
    closing = threading.Thread(target=pipe.close)
    closing.start()
    while pipe._queue.qsize() == 0 and closing.is_alive():  # close() has queued its stop
        threading.Event().wait(0.01)
    gate.set()
    closing.join(DEADLINE)
    waiting.join(DEADLINE)
    assert isinstance(errors[0], RuntimeError) and "fuyou-test is closed" in str(errors[0])
    for later in (pipe.drain, lambda: pipe.submit(ChunkJob("x", 3, release))):
        error = outcome(later)
        assert isinstance(error, RuntimeError) and "fuyou-test is closed" in str(error)
    assert not pipe._thread.is_alive()


@pytest.mark.parametrize("schedule", ["backward", "next_forward"])
@pytest.mark.parametrize("fault", ["worker dies", "read never completes"])
def test_optimizer_step_raises_instead_of_hanging_and_close_leaves_nothing(tmp_path, monkeypatch, fault, schedule):
    before = set(threading.enumerate())
    model = torch.nn.Linear(64, 32)
    # A read that can hang is the SSD's: state in memory is lent in place, with no read to wait for (`ChunkJob.lent`)
    tiers = dict(host_state=0) if fault == "read never completes" else {}
    opt = FuyouAdamW(model.parameters(), lr=0.1, config=config(tmp_path, optimizer_schedule=schedule, **tiers))
    end = lambda: None  # noqa: E731
    if fault == "worker dies":
        monkeypatch.setattr(opt.adam_state.pipeline, "_process", die)
    else:
        end = hang_reads(opt.store, monkeypatch)

    def train_step():  # the hooks queue each update on the worker; the error comes from a hook or step()
        model(torch.randn(2, 64)).sum().backward()
        opt.step()

    try:
        error = outcome(train_step)
    finally:
        end()
    if schedule == "next_forward" and fault == "read never completes":
        # step() queued the update and waits on it: the error names the update, says so, and chains the cause
        # (a dead worker is found when step() queues, and raised as it is)
        assert isinstance(error, RuntimeError) and "partly updated; resume from the last checkpoint" in str(error)
        assert str(error.__cause__) in str(error), "the cause is in the message, not only in the chain"
        error = error.__cause__
    if fault == "worker dies":
        assert isinstance(error, RuntimeError) and "fuyou-adamw: the worker thread died" in str(error), error
    elif schedule == "next_forward":
        # step() waits in `wait_job`, whose progress check and the worker's read wait both give up after
        # io_timeout: which notices first is a race (test_wait_job_has_a_way_out_when_the_worker_stops_or_hangs;
        # CI's loaded machine lost it once). Either way: a TimeoutError after 1 s that names what hung.
        assert isinstance(error, TimeoutError), error
        assert ("reading chunk" in str(error) and "did not complete within 1 s" in str(error)
                or "the update of parameter 0" in str(error) and "no progress for 1 s" in str(error)), error
    else:
        assert isinstance(error, TimeoutError) and "did not complete within 1 s" in str(error), error
    opt.close()
    assert set(threading.enumerate()) <= before, "a thread was left behind"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", [0, -1, "10", True, float("inf"), float("nan")])
def test_io_timeout_is_validated(value):
    with pytest.raises(ConfigError, match=r"io_timeout: got .*; expected seconds > 0, e.g. 600"):
        FuyouConfig(io_timeout=value)


# -- one job's completion (`ChunkJob.done`, `wait_job`): what the next_forward schedule waits on --------------
def test_a_job_completes_after_its_writes_while_later_jobs_wait(pipe, store):
    store.create("y", (5000,), torch.float32)
    written = []

    def copy(k, buf):
        fut = store.write_chunk("y", k, buf)
        written.append(fut)
        return fut

    first, second = ChunkJob("x", 3, copy, done=Future()), ChunkJob("x", 3, release, done=Future())
    pipe.submit(first)
    pipe.submit(second)
    pipe.wait_job(first, "the first job")
    assert len(written) == 3 and all(f.done() for f in written), "done only after every write it returned"
    assert torch.equal(store.read("y").result(), torch.arange(5000, dtype=torch.float32))
    pipe.wait_job(second, "the second job")
    pipe.drain()


def test_a_failed_job_and_the_jobs_it_makes_the_worker_skip_fail_their_waiters(pipe):
    def fail(k, buf):
        buf.release()
        raise ValueError("bad chunk")

    bad, skipped = ChunkJob("x", 3, fail, done=Future()), ChunkJob("x", 3, release, done=Future())
    pipe.submit(bad)
    pipe.submit(skipped)
    assert isinstance(outcome(lambda: pipe.wait_job(bad, "the bad job")), ValueError)
    assert isinstance(outcome(lambda: pipe.wait_job(skipped, "the skipped job")), ValueError)
    with pytest.raises(ValueError, match="bad chunk"):
        pipe.drain()  # the error is forgotten once drain() raised it: the pipeline goes on
    after = ChunkJob("x", 3, release, done=Future())
    pipe.submit(after)
    assert outcome(lambda: pipe.wait_job(after, "a later job")) is None


@pytest.mark.parametrize("poll", [0.05, 3.0], ids=["poll-50ms", "poll-3s"])
def test_wait_job_has_a_way_out_when_the_worker_stops_or_hangs(store, monkeypatch, poll):
    # The worker's read wait and wait_job's progress check both give up after io_timeout (1 s); which
    # notices first is a race (with a 3 s poll, always the worker). Either way the error names what
    # was waited for. (A hang only wait_job can notice: test_wait_job_times_out_when_the_job_function_hangs.)
    monkeypatch.setattr("fuyou_strategy.optim.pipeline._LIVENESS_POLL", poll)
    pipe = ChunkPipeline(store, depth=2, name="fuyou-test")
    end = hang_reads(store, monkeypatch)
    try:
        job = ChunkJob("x", 3, release, done=Future())
        pipe.submit(job)
        error = outcome(lambda: pipe.wait_job(job, "the update of parameter 7"))
        assert isinstance(error, TimeoutError) and "the update of parameter 7" in str(error)
    finally:
        end()
        pipe.close()
    assert job.done.done() and job.done.exception() is not None, "a stopped worker fails the jobs it holds"
    with pytest.raises(ValueError, match="done=Future"):
        pipe.wait_job(ChunkJob("x", 3, release), "a job without done")


def test_wait_job_times_out_when_the_job_function_hangs(pipe):
    # The worker is alive but stuck inside a job's function: only wait_job's progress check notices.
    stuck = threading.Event()

    def hang(k, buf):
        buf.release()
        stuck.wait(DEADLINE)

    job = ChunkJob("x", 3, hang, done=Future())
    pipe.submit(job)
    try:
        error = outcome(lambda: pipe.wait_job(job, "the update of parameter 2"))
        assert isinstance(error, TimeoutError) and "no progress" in str(error) and "parameter 2" in str(error)
    finally:
        stuck.set()


# -- read-ahead (`ChunkPipeline.read_ahead`): chunks read while the worker is idle, taken by the job --------------
def counting_reads(store, monkeypatch):
    """Count the store's chunk reads; returns the list of (entry, k) read so far."""
    real, reads = store.read_chunk, []

    def read_chunk(name, k, **kwargs):
        reads.append((name, k))
        return real(name, k, **kwargs)

    monkeypatch.setattr(store, "read_chunk", read_chunk)
    return reads


def until(predicate, within=DEADLINE):
    """Poll ``predicate`` until it holds; fail after ``within`` seconds."""
    deadline = threading.Event()
    timer = threading.Timer(within, deadline.set)
    timer.start()
    try:
        while not predicate():
            assert not deadline.wait(0.005), f"still not true after {within} s"
    finally:
        timer.cancel()


def chunk_values(seen):
    def collect(k, buf):
        with buf:
            seen.append((k, buf.view(torch.float32)[0].item()))
    return collect


def test_chunks_read_ahead_are_taken_by_the_job_that_reads_them_and_not_read_again(pipe, store, monkeypatch):
    reads = counting_reads(store, monkeypatch)
    pipe.read_ahead([("x", 0), ("x", 1), ("x", 2)], keep_free=0)
    until(lambda: len(reads) == 3)  # the idle worker read all three, two at a time
    seen = []
    pipe.submit(ChunkJob("x", 3, chunk_values(seen)))
    pipe.drain()
    assert seen == [(0, 0.0), (1, 2048.0), (2, 4096.0)]
    assert len(reads) == 3, "the job took the chunks read ahead instead of reading them again"
    assert (pipe.ahead_used, pipe.ahead_dropped) == (3, 0)
    assert store.pool.lent == 0


def test_a_chunk_read_ahead_and_then_written_is_read_again(pipe, store, monkeypatch):
    reads = counting_reads(store, monkeypatch)
    pipe.read_ahead([("x", 0), ("x", 1)], keep_free=0)
    until(lambda: len(reads) == 2)
    buf = store.pool.acquire(8192)
    buf.view(torch.float32).fill_(-1.0)
    store.write_chunk("x", 0, buf).result()  # the active slot changes after it was read ahead
    seen = []
    pipe.submit(ChunkJob("x", 3, chunk_values(seen)))
    pipe.drain()
    assert seen == [(0, -1.0), (1, 2048.0), (2, 4096.0)], "a stale read-ahead must never reach a job"
    # A write to any chunk of the slot makes every read-ahead of it stale (per slot, not per chunk).
    assert reads == [("x", 0), ("x", 1), ("x", 0), ("x", 1), ("x", 2)]
    assert (pipe.ahead_used, pipe.ahead_dropped) == (0, 2)
    assert store.pool.lent == 0


def test_a_chunk_read_ahead_without_its_head_goes_only_to_a_job_that_fills_the_head_itself(pipe, store, monkeypatch):
    """`ChunkJob.skip`: the optimizer leaves a chunk's master bytes unread where the parameter holds the master. A
    read-ahead made so serves a job that skips as much, never one that reads the whole chunk."""
    reads = counting_reads(store, monkeypatch)
    read_before = store.engine.bytes_read
    pipe.read_ahead([("x", 0, 4096), ("x", 1, 4096)], keep_free=0)
    until(lambda: len(reads) == 2)
    until(lambda: store.engine.bytes_read - read_before == 2 * 4096)  # only the second page of each 8 KiB chunk
    seen = []

    def tail_values(k, buf):
        with buf:
            seen.append((k, buf.view(torch.float32)[1024].item()))

    pipe.submit(ChunkJob("x", 2, tail_values, skip=lambda k: 4096))
    pipe.drain()
    assert seen == [(0, 1024.0), (1, 3072.0)] and len(reads) == 2 and pipe.ahead_used == 2
    pipe.read_ahead([("x", 0, 4096)], keep_free=0)
    until(lambda: len(reads) == 3)
    seen.clear()
    pipe.submit(ChunkJob("x", 1, chunk_values(seen)))  # reads the whole chunk: the head read ahead is missing
    pipe.drain()
    assert seen == [(0, 0.0)] and len(reads) == 4 and pipe.ahead_dropped == 1
    assert store.pool.lent == 0


def test_read_ahead_that_no_job_takes_is_given_back_at_the_drain(pipe, store, monkeypatch):
    reads = counting_reads(store, monkeypatch)
    pipe.read_ahead([("x", 0), ("x", 1), ("x", 2)], keep_free=0)
    until(lambda: len(reads) == 3)
    pipe.drain()
    assert store.pool.lent == 0 and pipe.ahead_dropped == 3
    pipe.submit(ChunkJob("x", 3, release))  # the window is over: the job reads for itself
    pipe.drain()
    assert len(reads) == 6 and pipe.ahead_used == 0


def test_read_ahead_takes_only_what_the_pool_spares_and_a_shadow_read_never_takes_it(pipe, store, monkeypatch):
    reads = counting_reads(store, monkeypatch)
    spare_one = store.pool.budget - 8192  # room for one 8 KiB chunk beyond what is kept free
    pipe.read_ahead([("x", 0), ("x", 1), ("x", 2)], keep_free=spare_one)
    until(lambda: len(reads) == 1)
    pipe.submit(ChunkJob("x", 1, release, slot="shadow"))  # another slot than the one read ahead
    with pytest.raises(Exception, match="not written yet"):
        pipe.drain()  # the shadow slot was never written: the job read it itself and failed
    assert reads == [("x", 0), ("x", 0)] and pipe.ahead_dropped == 1 and store.pool.lent == 0


def test_a_partial_drain_leaves_later_writes_landing_and_the_next_drain_raises_their_error(pipe):
    """`Later` writes (a speculative update's shadow write) are not waited for by ``drain(writes=False)``; the
    other futures are. The next drain, of either kind, waits for them and raises the first that failed."""
    now, later = Future(), Future()

    def hand_on(k, buf):
        buf.release()
        return Later(now if k == 0 else None, later)

    pipe.submit(ChunkJob("x", 1, hand_on))
    blocked = outcome(lambda: pipe.drain(writes=False))
    assert isinstance(blocked, TimeoutError), "a partial drain still waits for what is not Later (io_timeout 1 s)"
    pipe.submit(ChunkJob("x", 1, hand_on))
    now.set_result(None)
    assert outcome(lambda: pipe.drain(writes=False)) is None and not later.done(), "the Later write is left landing"
    later.set_exception(OSError(5, "Input/output error"))
    error = outcome(lambda: pipe.drain(writes=False))
    assert isinstance(error, OSError) and "Input/output error" in str(error), "the next drain raises its error"
    assert outcome(pipe.drain) is None, "raised once, then forgotten"


def test_a_full_drain_waits_for_later_writes_and_land_forgets_them(pipe):
    later = [Future(), Future()]

    def hand_on(k, buf):
        buf.release()
        return Later(None, later[k])

    pipe.submit(ChunkJob("x", 2, hand_on))
    threading.Timer(0.2, later[0].set_result, (None,)).start()
    threading.Timer(0.3, later[1].set_exception, (OSError(5, "Input/output error"),)).start()
    error = outcome(pipe.drain)
    assert all(f.done() for f in later) and isinstance(error, OSError), "a full drain waits for every Later write"
    fresh = Future()
    pipe.submit(ChunkJob("x", 1, lambda k, buf: (buf.release(), Later(None, fresh))[1]))
    assert outcome(lambda: pipe.drain(writes=False)) is None
    threading.Timer(0.2, fresh.set_exception, (OSError(5, "Input/output error"),)).start()
    assert outcome(pipe.land) is None and fresh.done(), "land() waits, and forgets the error (a rollback discards them)"
    assert outcome(pipe.drain) is None


@pytest.fixture
def ram_store(tmp_path):
    """``"x"`` on the SSD and ``"m"`` in host memory, each 5000 fp32 values in 3 chunks."""
    store = make_store(config(tmp_path, host_state="64KiB"))
    store.create("m", (5000,), torch.float32, in_memory=True)
    store.write("m", torch.arange(5000, dtype=torch.float32)).result()
    yield store
    store.close()


def test_a_batch_hands_an_in_memory_entrys_chunks_lent_together_and_the_job_completes_after_its_last(ram_store):
    pipe = ChunkPipeline(ram_store, depth=1, name="fuyou-test")
    calls = []

    def add_one(k, *bufs):
        calls.append((k, [buf.view(torch.float32)[0].item() for buf in bufs]))
        for i, buf in enumerate(bufs):
            buf.view(torch.float32).add_(1)
            ram_store.write_chunk("m", k + i, buf)

    try:
        job = ChunkJob("m", 3, add_one, lend="active", lent=True, batch=2, done=Future())
        pipe.submit(job)
        pipe.wait_job(job, "the batch")
        pipe.drain()
    finally:
        pipe.close()
    assert calls == [(0, [0.0, 2048.0]), (2, [4096.0])]  # chunks 0 and 1 in one call, then the last alone
    assert torch.equal(ram_store.read("m").result(), torch.arange(5000, dtype=torch.float32) + 1)


def test_a_batch_that_cannot_be_lent_gives_back_what_it_lent_and_fails_its_job(ram_store, monkeypatch):
    pipe = ChunkPipeline(ram_store, depth=1, name="fuyou-test")
    real, lent = ram_store.lend_chunk, []

    def lend_chunk(name, k, **kwargs):
        if k == 1:
            raise RuntimeError("injected: chunk 1 cannot be lent")
        lent.append(real(name, k, **kwargs))
        return lent[-1]

    monkeypatch.setattr(ram_store, "lend_chunk", lend_chunk)
    try:
        job = ChunkJob("m", 3, lambda k, *bufs: pytest.fail("called with chunks that were not all lent"),
                       lend="shadow", lent=True, batch=3, done=Future())
        pipe.submit(job)
        with pytest.raises(RuntimeError, match="chunk 1 cannot be lent"):
            pipe.drain()
        assert isinstance(job.done.exception(timeout=DEADLINE), RuntimeError)
        assert [chunk.data for chunk in lent] == [None]  # chunk 0 went back to the store
        assert ram_store.entry("m").lent == {}
    finally:
        pipe.close()


@pytest.mark.parametrize("changes", [
    dict(batch=0), dict(batch=2, lend="active"), dict(lent=True), dict(lent=True, lend="active", extra=("x",)),
    dict(lent=True, lend="active", skip=len),
], ids=["zero", "not-lent", "no-lend-slot", "extra", "skip"])
def test_a_batch_is_only_of_an_entrys_lent_chunks(pipe, changes):
    with pytest.raises(TypeError, match=r"got batch=\d+, lent=\w+ for entry 'x' .*a batch of chunks per call"):
        pipe.submit(ChunkJob("x", 3, release, **changes))
    pipe.submit(ChunkJob("x", 3, release))  # the worker is unharmed
    pipe.drain()


def test_only_an_in_memory_entry_lends_a_chunk(ram_store):
    with pytest.raises(StorageError, match="entry 'x' is on the SSD"):
        ram_store.lend_chunk("x", 0)
    chunk = ram_store.lend_chunk("m", 2)
    assert chunk.view(torch.float32)[0].item() == 4096.0
    ram_store.write_chunk("m", 2, chunk).result()
