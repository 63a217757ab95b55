"""`HostBufferPool`: page-aligned (pinned on CUDA) host buffers under a hard byte budget."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any, Callable

import torch

from .. import trace
from ..config import PAGE, format_bytes
from ..device import alloc_host_buffer

__all__ = ["HostBudgetError", "HostBuffer", "HostBufferPool"]


class HostBudgetError(MemoryError):
    """A request can never fit in the pool's budget, or waited past its timeout."""


def round_up(nbytes: int, multiple: int = PAGE) -> int:
    return -(-nbytes // multiple) * multiple


class HostBuffer:
    """A buffer lent by a `HostBufferPool`; return it with `release()` or a ``with`` block.

    ``data`` is a page-aligned ``uint8`` tensor of ``capacity`` bytes (``nbytes`` rounded up to 4 KiB, for
    ``O_DIRECT``); ``view(dtype)`` gives the first ``nbytes`` as another dtype. After `release()` ``data`` is
    ``None``, so a kept `HostBuffer` holds no memory and a use after release fails loudly; views of ``data``
    must not outlive the release either.

    ``memo``: views of ``data`` kept by `kept` (an in-memory state entry's slot, whose chunks are lent step
    after step), dropped with ``data`` on release.
    """

    __slots__ = ("data", "nbytes", "capacity", "_pool", "memo")

    def __init__(self, data: torch.Tensor, nbytes: int, pool: "HostBufferPool") -> None:
        self.data: torch.Tensor | None = data
        self.nbytes = nbytes
        self.capacity = data.numel()
        self._pool = pool
        self.memo: dict | None = None

    def kept(self, key: object, make: Callable[[], Any]) -> Any:
        """``make()`` (views of ``data``) the first time ``key`` is asked for, the same object after, until release:
        what a chunk lent every step would otherwise make each time (a run of small parameters lends hundreds).
        Each key's views are a function of ``data`` alone, and their users say whose they are at a time (a chunk's:
        its holder's, `TensorStore.lend_chunks`); two threads making one key at once would keep equal views. Each
        dict operation is atomic under the GIL."""
        memo = self.memo
        if memo is None:
            memo = self.memo = {}
        made = memo.get(key)
        if made is None:
            made = memo[key] = make()
        return made

    def known(self, key: object) -> Any:
        """What `kept` made for ``key``, or ``None``: asked first, a caller makes no ``make`` closure for a kept key."""
        memo = self.memo
        return memo.get(key) if memo is not None else None

    def view(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        data = self.data if self.nbytes == self.capacity else self.data[: self.nbytes]  # no view where none is needed
        return data if dtype == torch.uint8 else data.view(dtype)

    def release(self) -> None:
        data, self.data, self.memo = self.data, None, None
        if data is not None:
            self._pool._give_back(data)

    def __enter__(self) -> "HostBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class HostBufferPool:
    """Page-aligned host buffers drawn from a hard byte budget.

    Buffers are cached by capacity and reused (pinned allocation is slow on CUDA). Lent plus cached bytes never
    exceed ``budget``: cached buffers are dropped first, then ``acquire`` waits for a release; a request larger
    than the budget fails at once with `HostBudgetError`. How users share the total is `host_budget_split`'s.

    Args:
        budget: the cap in bytes.
        name: used in error messages (e.g. ``"host_memory_budget"``).
    """

    def __init__(self, budget: int, *, name: str = "host_memory_budget") -> None:
        if budget < PAGE:
            raise HostBudgetError(f"{name}: got {budget} bytes; a pool needs at least one 4 KiB page")
        self.budget = budget
        self.name = name
        self._cond = threading.Condition()
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._held = 0  # bytes allocated by the pool: lent + cached
        self._lent = 0
        self._high_water = 0
        self._closed = False

    # -- introspection ---------------------------------------------------------------------------
    @property
    def high_water(self) -> int:
        """The most bytes the pool ever held at once (lent plus cached); always <= budget."""
        return self._high_water

    @property
    def held(self) -> int:
        return self._held

    @property
    def lent(self) -> int:
        """Bytes currently lent out to callers."""
        return self._lent

    # -- lending ----------------------------------------------------------------------------------
    def acquire(self, nbytes: int, timeout: float | None = None, keep_free: int = 0) -> HostBuffer:
        """Lend a buffer of at least ``nbytes`` (capacity rounded up to 4 KiB), blocking while it would not fit
        with ``keep_free`` bytes of the budget left for others. Raises `HostBudgetError` at once if ``nbytes``
        plus ``keep_free`` exceeds the budget, or after ``timeout`` seconds of waiting."""
        capacity = self._capacity(nbytes)
        if capacity + keep_free > self.budget:
            raise HostBudgetError(
                f"{self.name}: a buffer of {format_bytes(capacity)} with {format_bytes(keep_free)} kept free for "
                f"others can never fit in the budget of {format_bytes(self.budget)}; raise {self.name}"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        tracer, waited = trace.active(), None
        with self._cond:
            while (data := self._take(capacity, keep_free=keep_free)) is None:
                if tracer is not None and waited is None:
                    waited = tracer.now()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise HostBudgetError(
                        f"{self.name}: waited {timeout:.1f} s for {format_bytes(capacity)}; "
                        f"{format_bytes(self._lent)} of {format_bytes(self.budget)} still lent out"
                    )
                self._cond.wait(remaining)
        if waited is not None:
            lane = "waits" if threading.current_thread() is threading.main_thread() else "optimizer"
            tracer.add(lane, f"wait: {self.name} buffer", waited, tracer.now(), bytes=capacity)
        return self._lend(data, capacity, nbytes)

    def try_acquire(self, nbytes: int, keep_free: int = 0) -> HostBuffer | None:
        """Lend a buffer only if it fits now with ``keep_free`` bytes of the budget to spare; never waits."""
        capacity = self._capacity(nbytes)
        with self._cond:
            data = self._take(capacity, keep_free)
        return None if data is None else self._lend(data, capacity, nbytes)

    def _capacity(self, nbytes: int) -> int:
        capacity = round_up(max(nbytes, 1))
        if capacity > self.budget:
            raise HostBudgetError(
                f"{self.name}: a buffer of {format_bytes(capacity)} can never fit in the budget of "
                f"{format_bytes(self.budget)}; raise {self.name} or lower chunk_size"
            )
        return capacity

    def _take(self, capacity: int, keep_free: int) -> torch.Tensor | bool | None:
        """Under the lock: a cached buffer, True (room reserved: allocate one), or None (no room)."""
        if self._closed:
            raise RuntimeError("HostBufferPool is closed")
        if self._lent + capacity + keep_free > self.budget:
            return None
        cached = self._free.get(capacity)
        if cached:
            self._lent += capacity
            return cached.pop()
        self._evict_until(self.budget - capacity)
        if self._held + capacity > self.budget:
            return None
        self._held += capacity
        self._lent += capacity
        self._high_water = max(self._high_water, self._held)
        return True

    def _lend(self, data: torch.Tensor | bool, capacity: int, nbytes: int) -> HostBuffer:
        if data is True:
            try:  # allocate outside the lock: pinned allocation can take milliseconds
                data = alloc_host_buffer(capacity)
            except BaseException:
                with self._cond:
                    self._held -= capacity
                    self._lent -= capacity
                    self._cond.notify_all()
                raise
        return HostBuffer(data, nbytes, self)

    def _evict_until(self, limit: int) -> None:
        """Drop cached buffers (largest first) until at most ``limit`` bytes are held."""
        for capacity in sorted(self._free, reverse=True):
            cached = self._free[capacity]
            while cached and self._held > limit:
                cached.pop()
                self._held -= capacity
        for capacity in [c for c, v in self._free.items() if not v]:
            del self._free[capacity]

    def _give_back(self, data: torch.Tensor) -> None:
        capacity = data.numel()
        with self._cond:
            self._lent -= capacity
            if self._closed:
                self._held -= capacity
            else:
                self._free[capacity].append(data)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._evict_until(0)
            self._cond.notify_all()
