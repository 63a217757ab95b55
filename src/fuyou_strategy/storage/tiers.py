"""`MemoryTiers`: the one owner of a run's memory tiers, and the one division of its host budget.

A run has one host buffer pool (``host_memory_budget``, a hard cap), one tensor store (the swap files of
the SSD tier; the optimizer state's host tier as in-memory entries) and one split of the budget between
the transfers, the optimizer state held in RAM and host-policy activations (`host_budget_split`).
`MemoryTiers` builds them once — `FuyouEngine` does, or a part built on its own — lends them to the
optimizer, the activation swapper and the weight streamer, and closes them last; no borrower closes them.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from ..cleanup import close_all
from ..config import PAGE, STATE_BYTES_PER_PARAM, STATE_CHUNK_ELEMENTS, FuyouConfig, settled
from .pool import HostBufferPool
from .store import TensorStore

__all__ = ["HostShares", "MemoryTiers", "TierFigures", "host_budget_split", "host_state_bytes", "state_chunk_bytes"]


@dataclass(frozen=True)
class HostShares:
    """How `host_budget_split` divides ``host_memory_budget`` between the pool's users (bytes).

    The pool lends to whoever asks while it has room: the shares are guarantees, not
    partitions. Every user but one gives its buffers back as soon as a transfer is done;
    host-policy activations hold theirs until backward, so they are admitted only while the
    ``reserved`` part stays free, which keeps everyone else moving.

    Attributes:
        budget: ``host_memory_budget``.
        state_in_ram: `host_state_bytes`: optimizer state held in host RAM (the pool lends it for the
            entries' life); the rest (`pool`) is the transfers' and host users' share, which the shares
            below divide.
        state_chunk: one optimizer state chunk: the most whole groups of 2048 parameters'
            ``[master | exp_avg | exp_avg_sq]`` (24 KiB each) that ``chunk_size`` holds, at least
            one; so the same parameters' bf16 or fp32 weights or gradients are a whole number of
            pages too (streamed weights and gradients are chunked alike).
        optimizer_depth: state chunks the optimizer reads ahead of the one it updates:
            ``optimizer_prefetch_chunks``, fewer when the budget is small, at least one.
        optimizer_readahead: ``(optimizer_depth + 1) * state_chunk``.
        activation_staging: SSD activations on their way to disk: two chunks, or one per
            swap directory if there are more, so every drive can be busy.
        activation_readback: SSD activations on their way back in backward (as many).
        host_activations: what is left: the most host-policy activations ever hold.
    """

    budget: int
    state_chunk: int
    optimizer_depth: int
    optimizer_readahead: int
    activation_staging: int
    activation_readback: int
    host_activations: int
    state_in_ram: int = 0

    @property
    def pool(self) -> int:
        """The transfer pool's budget: what ``host_state`` leaves of ``host_memory_budget``."""
        return self.budget - self.state_in_ram

    @property
    def reserved(self) -> int:
        """What host-policy activations always leave free (all of the pool if it is that small)."""
        return self.pool - self.host_activations


def state_chunk_bytes(config: FuyouConfig) -> int:
    """Bytes of one optimizer state chunk (`HostShares.state_chunk`): the most whole groups of
    `STATE_CHUNK_ELEMENTS` parameters' fp32 ``[master | exp_avg | exp_avg_sq]`` that ``chunk_size`` holds,
    at least one."""
    unit = STATE_CHUNK_ELEMENTS * STATE_BYTES_PER_PARAM
    return max(1, config.chunk_size // unit) * unit


def _transfers(config: FuyouConfig, pool: int) -> tuple[int, int, int, int]:
    """(state chunk, read-ahead depth, read-ahead bytes, staging = readback bytes) of a pool of ``pool`` bytes."""
    state_chunk = state_chunk_bytes(config)
    staging = max(2, len(config.swap_dirs or ())) * config.chunk_size
    depth = max(1, min(config.optimizer_prefetch_chunks, (pool - 2 * staging) // state_chunk - 1))
    return state_chunk, depth, (depth + 1) * state_chunk, staging




def host_state_bytes(config: FuyouConfig) -> int:
    """``config`` (an unresolved one is resolved first, `settled`): the bytes of ``host_memory_budget`` the optimizer state takes in host RAM from the start.

    A number of ``host_state`` is itself. ``"auto"``: everything the transfers (the optimizer's full
    read-ahead, the staging of SSD activations both ways) leave, when nothing else claims the host
    tier yet. With the planner (``activations="auto"``, ``weights`` ``"device"`` or ``"auto"``) that is the
    warm-up's share, which profiles with every activation kept and every weight resident: `FuyouEngine` then
    gives the state what the plan leaves (`planner.Plan.state_in_ram`), moving the state the plan's host
    activations and weights need out to the SSD, so a state the budget holds is never written there. When
    something claims the host tier from the start (``activations`` naming ``"host"``, streamed weights, or a
    pinned plan), nothing at first: with a plan, the engine gives the state what it leaves."""
    config = settled(config)
    if config.host_state != "auto":
        return config.host_state
    policies = config.activations.values() if isinstance(config.activations, dict) else [config.activations]
    # staging buffers, gradients' host copies, host-tier weights; None is resident (`placement_defaults`)
    streams = config.weights not in ("device", "auto", {}, None)
    if streams or any(p == "host" for p in policies) or config.plan is not None:
        return 0
    _, _, readahead, staging = _transfers(config, config.host_memory_budget)
    free = config.host_memory_budget - readahead - 2 * staging
    return max(0, free // PAGE * PAGE)


def host_budget_split(config: FuyouConfig, state_in_ram: int | None = None) -> HostShares:
    """The one division of ``config.host_memory_budget`` (an unresolved config is resolved first), with
    ``state_in_ram`` bytes of optimizer state in host RAM (default `host_state_bytes`); see `HostShares`.

    `FuyouAdamW` reads ahead ``optimizer_depth`` chunks, the activation swapper admits
    host-policy activations only into ``host_activations`` and stages SSD transfers in the
    rest, and the planner budgets host-policy activations against ``host_activations``.
    A budget smaller than the reserved shares together is still valid: the transfers then
    take turns, and host-policy activations stay on the device.
    """
    config = settled(config)
    return _split(config, host_state_bytes(config) if state_in_ram is None else state_in_ram)


def _split(config: FuyouConfig, state: int) -> HostShares:
    pool = config.host_memory_budget - state
    state_chunk, depth, readahead, staging = _transfers(config, pool)
    host = max(0, pool - readahead - 2 * staging)
    return HostShares(config.host_memory_budget, state_chunk, depth, readahead, staging, staging, host, state)


@dataclass(frozen=True)
class TierFigures:
    """A snapshot of the tiers' counters (`MemoryTiers.figures`); bytes unless named otherwise.

    Attributes:
        ssd_read_bytes, ssd_write_bytes: completed transfers to and from the swap files, ever.
        ssd_reserved_bytes: bytes reserved in the swap files (`TensorStore.bytes_on_disk`).
        state_in_ram_bytes: in-memory entries (the optimizer state's host tier, every slot).
        state_on_device_bytes: device entries (the optimizer state's device tier, every slot).
        pool_held_bytes, pool_peak_bytes: host pool memory held now, and at most so far.
        pool_budget_bytes: the pool's hard cap (``host_memory_budget``).
        writes_behind, waits_behind: chunks committed while their write was in flight, and reads that waited
            for one (`TensorStore.commit`).
    """

    ssd_read_bytes: int
    ssd_write_bytes: int
    ssd_reserved_bytes: int
    state_in_ram_bytes: int
    pool_held_bytes: int
    pool_peak_bytes: int
    pool_budget_bytes: int
    writes_behind: int
    waits_behind: int
    state_on_device_bytes: int = 0


class MemoryTiers:
    """The host pool, the tensor store and the host budget's split of one run (module docstring).

    Args:
        config: the run's config; an unresolved one is resolved here (`settled`).

    Borrowers register what must happen before the store goes with `on_close` (a weight streamer makes
    its weights resident again from their tier copies); `close` runs those, last registered first, then
    closes the store and its pool. A finalizer does the same if the owner forgets ``close()``.
    Threads: built, changed (`state_in_ram`) and closed on the training thread; the store and pool are
    thread-safe themselves.
    """

    def __init__(self, config: FuyouConfig | None = None) -> None:
        self.config = config = settled(config)
        # The optimizer state's share of the budget held in RAM (bytes): `host_state_bytes` at start; the engine
        # sets what a plan leaves it (`FuyouEngine`), after the state moved.
        self.state_in_ram = host_state_bytes(config)
        self._before_close: list[Callable[[], Any]] = []  # LIFO; weak methods are called only while alive
        self.store = TensorStore(config, memory_limit=self.state_in_ram)
        self._finalizer = weakref.finalize(self, _close, self._before_close, self.store)

    @property
    def pool(self) -> HostBufferPool:
        """The one host buffer pool (``host_memory_budget``)."""
        return self.store.pool

    @property
    def shares(self) -> HostShares:
        """The budget's split now (`host_budget_split` with `state_in_ram`)."""
        return _split(self.config, self.state_in_ram)

    def on_close(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` before the store closes (a bound method is held weakly: a borrower that is gone is skipped)."""
        self._before_close.append(weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn))

    def figures(self) -> TierFigures:
        """The tiers' counters now; reading them waits for nothing."""
        store, pool = self.store, self.store.pool
        return TierFigures(store.engine.bytes_read, store.engine.bytes_written, store.bytes_on_disk,
                           store.bytes_in_memory, pool.held, pool.high_water, pool.budget, store.writes_behind,
                           store.waits_behind, store.bytes_on_device)

    def close(self) -> None:
        """Run the borrowers' `on_close` callbacks (last first), then close the store: its swap files are deleted
        and its pool freed. Idempotent; the store closes even when a callback raises (the first error is raised)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "MemoryTiers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_exiting = threading.Event()  # set at interpreter exit: the I/O threads are gone, and so is the model


def _close(before_close: list[Callable[[], Any]], store: TensorStore) -> None:
    """`MemoryTiers.close`: every borrower's callback, last registered first, even when one raises; then the store."""
    refs = before_close[::-1]
    before_close.clear()
    close_all(*(lambda ref=ref: _call(ref) for ref in refs), store.close)


def _call(ref: Callable[[], Any]) -> None:
    fn = ref()
    if fn is not None and not _exiting.is_set():
        fn()


atexit.register(_exiting.set)
