"""The storage tier: host buffer pool, async file I/O, the two-slot tensor store, and their one owner
(`MemoryTiers`)."""

from .aio import IOEngine, StorageIOError, SwapFile, byte_view, filesystem_type, gather
from .pool import HostBudgetError, HostBuffer, HostBufferPool, round_up
from .rundir import StaleRun, find_stale_runs, remove_run_dir
from .store import ACTIVE, SHADOW, Entry, LentChunk, StorageError, StorageSpaceError, TensorStore
from .tiers import HostShares, MemoryTiers, TierFigures, host_budget_split, host_state_bytes, state_chunk_bytes

__all__ = [
    "ACTIVE", "SHADOW", "Entry", "HostBudgetError", "HostShares", "MemoryTiers", "TierFigures",
    "host_budget_split", "host_state_bytes", "state_chunk_bytes", "HostBuffer", "HostBufferPool", "IOEngine", "LentChunk",
    "StaleRun", "StorageError", "byte_view", "StorageIOError", "StorageSpaceError", "SwapFile", "TensorStore",
    "filesystem_type", "find_stale_runs", "gather", "remove_run_dir", "round_up",
]
