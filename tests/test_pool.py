import threading
import time

import pytest

from fuyou_strategy.storage import HostBudgetError, HostBufferPool


def test_buffers_are_page_aligned_and_rounded_up():
    pool = HostBufferPool(64 * 1024)
    with pool.acquire(5000) as buf:
        assert buf.data.data_ptr() % 4096 == 0
        assert buf.capacity == 8192 and buf.nbytes == 5000 and buf.view().numel() == 5000


def test_request_that_can_never_fit_fails_at_once():
    pool = HostBufferPool(16 * 1024, name="host_memory_budget")
    start = time.monotonic()
    with pytest.raises(HostBudgetError, match="host_memory_budget: a buffer of 20.00 KiB can never fit"):
        pool.acquire(20 * 1024)
    assert time.monotonic() - start < 1


def test_request_that_fits_later_waits_for_a_release():
    pool = HostBufferPool(16 * 1024)
    first = pool.acquire(12 * 1024)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(8 * 1024)))
    waiter.start()
    time.sleep(0.2)
    assert not got, "acquire must wait while the budget is lent out"
    first.release()
    waiter.join(timeout=5)
    assert got and got[0].capacity == 8192
    assert pool.held <= pool.budget


def test_timeout_raises_with_what_is_lent():
    pool = HostBufferPool(8192)
    held = pool.acquire(8192)
    with pytest.raises(HostBudgetError, match="waited 0.1 s"):
        pool.acquire(4096, timeout=0.1)
    held.release()


def test_cached_buffers_are_reused_and_evicted_for_other_sizes():
    pool = HostBufferPool(16 * 1024)
    a = pool.acquire(16 * 1024)
    ptr = a.data.data_ptr()
    a.release()
    b = pool.acquire(16 * 1024)
    assert b.data.data_ptr() == ptr  # reused from the cache
    b.release()
    c = pool.acquire(4096)  # needs the cached 16 KiB buffer dropped
    assert pool.held == 4096
    c.release()


def test_budget_never_exceeded_under_concurrency():
    budget = 64 * 1024
    pool = HostBufferPool(budget)
    peak = []
    errors = []

    def worker(seed):
        try:
            for i in range(200):
                size = 4096 * (1 + (seed * 7 + i) % 8)
                with pool.acquire(size) as buf:
                    buf.view().fill_(seed)
                    peak.append(pool.held)
                    assert bool((buf.view() == seed).all()), "buffer shared between two holders"
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert max(peak) <= budget and pool.high_water <= budget
    assert pool.lent == 0


def test_try_acquire_never_waits_and_keeps_room():
    pool = HostBufferPool(32 * 1024)
    held = pool.acquire(16 * 1024)
    assert pool.try_acquire(8 * 1024, keep_free=16 * 1024) is None, "would leave less than keep_free"
    buf = pool.try_acquire(8 * 1024, keep_free=8 * 1024)
    assert buf is not None and buf.capacity == 8192
    assert pool.try_acquire(16 * 1024) is None, "no room now: returns at once"
    buf.release()
    held.release()
    assert pool.lent == 0


def test_a_released_buffer_lets_go_of_its_memory():
    from fuyou_strategy.device import host_buffer_usage

    pool = HostBufferPool(16 * 1024)
    buf = pool.acquire(16 * 1024)
    buf.release()
    assert buf.data is None, "a use after release fails loudly"
    kept = host_buffer_usage().live
    other = pool.acquire(8 * 1024)  # evicts the cached 16 KiB buffer; `buf` (say, in a finished future) must not pin it
    assert host_buffer_usage().live == kept - 8 * 1024
    other.release()
    pool.close()
