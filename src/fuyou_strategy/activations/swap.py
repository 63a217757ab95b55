"""`ActivationSwapper`: saved-tensor hooks that move activations device → host → SSD (docs/activations.md).

Wrap forward *and* backward::

    swapper = ActivationSwapper(model, FuyouConfig(activations="ssd"))
    for batch in loader:
        with swapper:
            loss = model(**batch).loss
            loss.backward()

Each repeated block gets a forward wrapper by its policy: ``recompute`` runs it under non-reentrant
checkpointing; ``host`` and ``ssd`` under ``saved_tensors_hooks`` whose pack moves each saved tensor out and
whose unpack brings it back; ``keep`` is left alone. Never swapped: parameters and their views, autocast's
copy of a trainable weight (cached for the step), tensors under ``activation_min_bytes``, non-dense
tensors. A tensor saved twice in one forward is swapped once.

Host buffers come from the store's pool, within `host_budget_split`'s shares. Swap-out is asynchronous (the
pack copies into pool buffers; I/O threads write them and hand them back). When backward reaches block
``i``, the SSD chunks of blocks ``i … i-k`` (``activation_prefetch_blocks``) are read into buffers free now
and copied into each tensor's `Upload` as they land; an unpack waits only for its own tensor. SSD space is
freed once a tensor is used.

Outside ``with``, `install` / `uninstall` keep the wrappers for a run and `begin_pass` marks each forward
(as `FuyouEngine` does); a forward and its backward form a *pass* with its own bookkeeping. Swapped
activations serve one backward (``retain_graph=True`` raises). Leaving ``with`` releases everything held.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from .. import trace
from ..cleanup import undo_after
from ..config import ConfigError, FuyouConfig, settled
from ..device import Upload, transfer
from ..storage import HostBudgetError, HostBuffer, HostShares, MemoryTiers, TensorStore, gather, host_budget_split
from .blocks import Policy, discover_blocks, resolve_policies

__all__ = ["ActivationSwapper", "SwapStats", "swappable", "first_tensor", "block_input"]


@dataclass
class SwapStats:
    """Counters over the swapper's lifetime (bytes are the tensors' own sizes)."""

    kept_tensors: int = 0  # saved tensors left on the device (parameters, small, not dense)
    host_bytes: int = 0
    ssd_bytes: int = 0
    host_pool_full: int = 0  # host-policy tensors kept because the pool had no room
    deduplicated: int = 0  # saves of a tensor already swapped in this forward
    prefetched: int = 0  # SSD tensors whose every chunk was being read back before their unpack
    fetched_on_demand: int = 0  # SSD tensors whose unpack had to read chunks itself (no pool room before)
    per_block_bytes: dict[int, int] = field(default_factory=dict)


class _Pass:
    """One forward and its backward: what it swapped, per block, and where backward has been."""

    __slots__ = ("by_id", "by_block", "entered")

    def __init__(self) -> None:
        self.by_id: dict[int, _Saved] = {}  # id(tensor) -> saved, to swap a tensor saved twice once
        self.by_block: dict[int, list[_Saved]] = {}
        self.entered: set[int] = set()  # blocks backward has reached


class _Saved:
    """A swapped-out tensor: where its bytes are and how to rebuild it."""

    __slots__ = ("pass_", "block", "policy", "size", "stride", "dtype", "device", "nbytes", "refs", "buf", "entry",
                 "write", "upload", "reads", "unread", "value", "source", "released", "__weakref__")

    def __init__(self, pass_: _Pass, block: int, policy: Policy, t: torch.Tensor) -> None:
        self.pass_, self.block, self.policy = pass_, block, policy
        self.size, self.stride, self.dtype, self.device = t.size(), t.stride(), t.dtype, t.device
        self.nbytes = t.numel() * t.element_size()
        self.refs = 1
        self.buf: HostBuffer | None = None  # host policy: the bytes, in a pool buffer
        self.entry: str | None = None  # ssd policy: the store entry ...
        self.write: Future | None = None  # ... its swap-out ...
        self.upload: Upload | None = None  # ... and, once read-back starts, the device tensor it fills,
        self.reads: list[Future] = []  # a future per chunk, done when the chunk is in it,
        self.unread: set[int] = set()  # and the chunks whose read is not issued yet (under _ReadBack's lock)
        self.value: torch.Tensor | None = None  # the tensor unpacked, for the other saves of the same tensor
        self.source = weakref.ref(t)
        self.released = False

    def rebuild(self, raw: torch.Tensor) -> torch.Tensor:
        """The tensor, with its original strides, from its ``nbytes`` raw bytes in storage order."""
        return raw.view(self.dtype).as_strided(self.size, self.stride)


class _ReadBack:
    """Reads SSD activations back, chunk by chunk, through host pool buffers. `start` queues a tensor's chunks
    (nearest block first); `pump` reads queued chunks within the read-back share, only into buffers free now
    (never waits), and each landing pumps again; `need` reads what an unpack needs now, waiting for buffers.
    An I/O thread copies each landed chunk into the tensor's `Upload`."""

    def __init__(self, store: TensorStore | None, shares: HostShares) -> None:
        self._store = store
        self._share = shares.activation_readback
        self._keep_free = shares.optimizer_readahead + shares.activation_staging  # theirs, not ours
        self._lock = threading.Lock()
        self._queue: deque[tuple[_Saved, int]] = deque()
        self._inflight = 0  # bytes of queued chunks being read
        self._pumping = False  # one pump at a time: a landed chunk's callback may run inside another

    def start(self, saved: _Saved) -> None:
        """Queue every chunk of ``saved`` (on the thread that will use it); `pump` reads them."""
        saved.write.result()  # long done by backward time; raises if the swap-out failed
        nchunks = self._store.entry(saved.entry).nchunks
        saved.upload = Upload(saved.nbytes, saved.device)
        saved.reads = [Future() for _ in range(nchunks)]
        with self._lock:
            saved.unread = set(range(nchunks))
            self._queue.extend((saved, k) for k in range(nchunks))

    def need(self, saved: _Saved, timeout: float) -> bool:
        """Issue the reads of every chunk of ``saved`` not yet issued, waiting for pool buffers up to
        ``timeout`` seconds each; returns whether all were issued before (prefetched)."""
        with self._lock:
            prefetched = saved.upload is not None and not saved.unread
        if saved.upload is None:
            self.start(saved)
        self.pump()
        while True:
            with self._lock:
                if not saved.unread:
                    return prefetched
                k = min(saved.unread)
                saved.unread.discard(k)
            try:
                buf = self._acquire(self._store.entry(saved.entry).chunk_len(k), saved.block, timeout)
            except BaseException:
                with self._lock:
                    saved.unread.add(k)  # never issued: nobody may wait for it
                raise
            self._issue(saved, k, buf, queued=False)

    def _acquire(self, nbytes: int, block: int, timeout: float) -> HostBuffer:
        """Wait up to ``timeout`` seconds for a pool buffer.

        No deadlock: host-policy activations, the only buffers held until backward, are admitted only while
        `HostShares.reserved` stays free (`_pack`); every other buffer comes back by itself (staging once its
        transfer lands, the optimizer's once its worker, which never waits on backward, updated the chunk), so
        the wait lasts until transfers in flight finish. The timeout catches something else holding the pool.
        """
        try:
            return self._store.pool.acquire(nbytes, timeout=timeout)
        except HostBudgetError as exc:
            raise HostBudgetError(
                f"{exc} (to read back an activation of block {block}); buffers are not coming back to the pool: "
                "a swap drive that stopped answering, or another user of the same pool holding them. Check the "
                "drive, or give that user its own pool or a larger host_memory_budget"
            ) from None

    def pump(self) -> None:
        """Start queued reads while the read-back share and the pool have room (any thread; never waits)."""
        with self._lock:
            if self._pumping:
                return  # the pumping thread looks again before it stops
            self._pumping = True
        try:
            while (item := self._next()) is not None:
                self._issue(*item, queued=True)
        except BaseException:
            with self._lock:
                self._pumping = False
            raise

    def _next(self) -> tuple[_Saved, int, HostBuffer] | None:
        """The next queued chunk and a buffer for it; ``None`` (and pumping stops) when there is no room."""
        with self._lock:
            queue = self._queue
            while queue and (queue[0][0].released or queue[0][1] not in queue[0][0].unread):
                queue.popleft()  # read on demand meanwhile, or released
            buf = None
            if queue:
                saved, k = queue[0]
                nbytes = self._store.entry(saved.entry).chunk_len(k)
                if self._inflight + nbytes <= self._share:
                    buf = self._store.pool.try_acquire(nbytes, keep_free=self._keep_free)
            if buf is None:
                self._pumping = False  # in the same breath as the last look: a landing after it pumps itself
                return None
            queue.popleft()
            saved.unread.discard(k)
            self._inflight += nbytes
            return saved, k, buf

    def _issue(self, saved: _Saved, k: int, buf: HostBuffer, *, queued: bool) -> None:
        """Read chunk ``k`` into ``buf``; when it lands, copy it into the tensor, give ``buf`` back,
        settle the chunk's future, and pump the queue."""
        landed, upload, entry = saved.reads[k], saved.upload, self._store.entry(saved.entry)

        def land(read: Future) -> None:
            try:
                with read.result() as staged:  # a failed read released the buffer already
                    upload.copy(k * entry.chunk_bytes, staged.view())
            except BaseException as exc:  # noqa: BLE001 - handed to the unpack that waits
                error = exc
            else:
                error = None
            if queued:
                with self._lock:
                    self._inflight -= buf.nbytes
            if error is None:
                landed.set_result(None)
            else:
                landed.set_exception(error)
            if queued:
                self.pump()

        try:
            read = self._store.read_chunk(saved.entry, k, into=buf)
        except BaseException as exc:  # noqa: BLE001 - read_chunk released buf; handed to the unpack
            read = Future()
            read.set_exception(exc)
        read.add_done_callback(land)

    def stop(self, saved: _Saved) -> list[Future]:
        """Read nothing more of ``saved``; returns the futures of the reads already issued."""
        with self._lock:
            saved.released = True
            return [fut for k, fut in enumerate(saved.reads) if k not in saved.unread]


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's bytes in storage order (so strides survive the round trip)."""
    return t.detach().as_strided((t.numel(),), (1,), t.storage_offset()).view(torch.uint8)


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (e.g. recomputing a checkpointed block)."""
    return torch._C._current_graph_task_id() != -1


def first_tensor(out: Any) -> torch.Tensor | None:
    """The first tensor of a block's output (a tensor, a tuple, or a ModelOutput-like tuple)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def block_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A block's input as a forward pre-hook (``with_kwargs=True``) sees it: its first positional tensor, else
    ``hidden_states`` (how Hugging Face's decoder layers name it when passed by keyword), else the first tensor among
    its keyword arguments."""
    x = first_tensor(args)
    if x is None:
        x = kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor):
            x = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    return x


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers exactly ``numel`` consecutive elements of its storage, in some order."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _is_autocast_weight(t: torch.Tensor) -> bool:
    """The low-precision copy autocast makes of a trainable weight, or a view of it (``w.t()``): cached for the
    autocast region, so keeping it costs its size once."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    return (fn is not None and fn.name() == "ToCopyBackward0"
            and any(type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt is not None))


def storage_id(t: torch.Tensor) -> int:
    """Which storage ``t`` views: the storage object itself, not its address, which changes when a
    streamed weight is released and materialised again (`WeightStreamer` resizes its storage)."""
    return t.untyped_storage()._cdata


def swappable(t: torch.Tensor, param_storages: set[int], min_bytes: int) -> bool:
    """Whether a saved tensor is one a host/ssd policy moves (see the module docstring); ``param_storages``
    holds the parameters' `storage_id`."""
    nbytes = t.numel() * t.element_size()
    return not (nbytes == 0 or nbytes < min_bytes or storage_id(t) in param_storages
                or not _is_dense(t) or _is_autocast_weight(t))


class ActivationSwapper:
    """Per-block activation policies applied through saved-tensor hooks (module docstring).

    Args:
        model: the model; its repeated blocks come from `discover_blocks` (or ``config.blocks``).
        config: ``activations``, ``activation_min_bytes``, ``activation_prefetch_blocks``, the storage knobs;
            ``io_timeout`` bounds every wait for a pool buffer (then `HostBudgetError`).
        memory: the run's `MemoryTiers` to borrow (e.g. the engine's); default: built when a policy needs it,
            closed by `close()`.
        policies: a policy for all blocks or ``{index: policy}``, in place of ``config.activations``.
    """

    def __init__(self, model: torch.nn.Module, config: FuyouConfig | None = None, *, memory: MemoryTiers | None = None,
                 policies: str | dict | None = None) -> None:
        self.config = config = settled(config)
        self.model = model
        if policies is None and (config.activations == "auto" or config.plan is not None):
            raise ConfigError("activations='auto' and plan= are applied by FuyouEngine (the Lightning strategy and the "
                              "HF callback use it); give ActivationSwapper explicit policies")
        self.blocks = discover_blocks(model, config.blocks)
        given = policies if policies is not None else config.activations
        self.policies = resolve_policies(given or "keep", len(self.blocks))  # unset: kept
        needs_store = any(p in (Policy.HOST, Policy.SSD) for p in self.policies)
        self._own_memory = memory is None and needs_store
        self.memory = MemoryTiers(config) if self._own_memory else memory
        self.store = self.memory.store if self.memory is not None else None
        self.stats = SwapStats()
        self._shares = self.memory.shares if self.memory is not None else host_budget_split(config)
        self._readback = _ReadBack(self.store, self._shares)
        self._names = itertools.count()
        self._active = False
        self._live: list[_Saved] = []
        self._pass = _Pass()

    # -- installing the wrappers ---------------------------------------------------------------------
    def __enter__(self) -> "ActivationSwapper":
        self.install()
        self.begin_pass()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def begin_pass(self) -> None:
        """A new forward starts: give it fresh bookkeeping (earlier passes keep theirs until used)."""
        self._live = [s for s in self._live if not s.released]
        self._pass = _Pass()

    def install(self) -> None:
        """Put the forward wrappers on the blocks (``with swapper:`` does this and `uninstall`)."""
        if self._active:
            raise RuntimeError("ActivationSwapper is already installed; it cannot be nested")
        self._param_storages = {storage_id(p) for p in self.model.parameters()}
        # A forward set on the instance by someone else (e.g. another library's hooks) is kept aside
        # and put back on exit; otherwise our instance attribute shadows the class's method.
        self._instance_forwards = {}
        try:
            for i, (block, policy) in enumerate(zip(self.blocks, self.policies)):
                if self._wrapped(policy):
                    wrapped, previous = self._wrap(i, policy, block.forward), vars(block).get("forward")
                    block.forward = wrapped
                    self._instance_forwards[i] = previous  # only once wrapped: `_unwrap` puts it back
        except BaseException as exc:
            undo_after(exc, self._unwrap)  # the blocks wrapped before the failure
            raise
        self._active = True

    def uninstall(self) -> None:
        """Take the wrappers off and release every activation still held."""
        if not self._active:
            return
        self._unwrap()
        self._active = False
        self.release()

    def _unwrap(self) -> None:
        for i, previous in self._instance_forwards.items():
            if previous is None:
                del self.blocks[i].forward
            else:
                self.blocks[i].forward = previous
        self._instance_forwards = {}

    def _wrapped(self, policy: Policy) -> bool:
        # With SSD blocks anywhere, every block reports when backward reaches it (prefetch).
        return policy is not Policy.KEEP or Policy.SSD in self.policies

    def _wrap(self, index: int, policy: Policy, forward: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            pass_ = self._pass

            def pack(t: torch.Tensor) -> Any:
                return self._pack(pass_, index, policy, t)

            if policy is Policy.RECOMPUTE:
                out = checkpoint(self._traced(index, forward), *args, use_reentrant=False, **kwargs)
            elif policy is Policy.KEEP:
                out = forward(*args, **kwargs)
            else:
                with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                    out = forward(*args, **kwargs)
            first = first_tensor(out)
            if first is not None and first.requires_grad:
                # Fires when the gradient of the block's output is ready: backward enters the block.
                first.register_hook(lambda grad: self._enter_backward(pass_, index))
            return out
        return run

    @staticmethod
    def _traced(index: int, forward: Callable) -> Callable:
        """``forward``, whose run inside backward (the recomputation) is a span of a recording trace."""
        def forward_or_recompute(*args: Any, **kwargs: Any) -> Any:
            if trace.active() is None or not in_backward():
                return forward(*args, **kwargs)
            with trace.span("compute", f"recompute {index}", block=index):
                return forward(*args, **kwargs)
        return forward_or_recompute

    # -- forward: pack -----------------------------------------------------------------------------
    def _pack(self, pass_: _Pass, block: int, policy: Policy, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if not swappable(t, self._param_storages, self.config.activation_min_bytes):
            self.stats.kept_tensors += 1
            return t
        seen = pass_.by_id.get(id(t))
        if seen is not None and seen.source() is t and not seen.released:
            seen.refs += 1
            self.stats.deduplicated += 1
            return seen
        saved = _Saved(pass_, block, policy, t)
        if policy is Policy.HOST:
            # Never wait: only backward frees host-held activations. Leave the reserved shares free, so nothing
            # else ever waits on one (_ReadBack._acquire).
            buf = self.store.pool.try_acquire(nbytes, keep_free=self._shares.reserved)
            if buf is None:
                self.stats.host_pool_full += 1
                self.stats.kept_tensors += 1
                return t
            transfer(buf.view(), _storage_bytes(t))
            saved.buf = buf
            self.stats.host_bytes += nbytes
        else:
            saved.entry = f"act.{next(self._names)}"
            self.store.create(saved.entry, (nbytes,), torch.uint8, slots=1)
            saved.write = self.store.write(saved.entry, _storage_bytes(t))  # waits for staging buffers: see _ReadBack._acquire
            self.stats.ssd_bytes += nbytes
        self.stats.per_block_bytes[block] = self.stats.per_block_bytes.get(block, 0) + nbytes
        pass_.by_id[id(t)] = saved
        pass_.by_block.setdefault(block, []).append(saved)
        self._live.append(saved)
        return saved

    # -- backward: prefetch and unpack -----------------------------------------------------------------
    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        if saved.released:
            raise RuntimeError(
                f"an activation of block {saved.block} ({saved.policy.value} policy) was already used by a "
                "backward pass and released, or the `with swapper:` block it was saved in has ended; swapped "
                "activations support one backward per forward, inside the `with` block (retain_graph=True "
                "needs the 'keep' or 'recompute' policy)"
            )
        self._enter_backward(saved.pass_, saved.block)  # normally done already by the block's output hook
        if saved.value is None:
            with trace.span("waits", f"activations of block {saved.block} ({saved.policy.value})"):
                saved.value = saved.rebuild(self._land(saved))
        out = saved.value
        saved.refs -= 1
        if saved.refs == 0:
            self._release(saved)
        return out

    def _land(self, saved: _Saved) -> torch.Tensor:
        """The saved bytes in a device-tier tensor: copied from the host buffer, or read back from SSD."""
        if saved.policy is Policy.HOST:
            upload = Upload(saved.nbytes, saved.device)
            upload.copy(0, saved.buf.view())
            saved.buf.release()
            saved.buf = None
            return upload.result()
        if self._readback.need(saved, self.config.io_timeout):
            self.stats.prefetched += 1
        else:
            self.stats.fetched_on_demand += 1
        gather(saved.reads).result()  # raises the first failed read or copy
        return saved.upload.result()

    def _enter_backward(self, pass_: _Pass, block: int) -> None:
        """Backward reached ``block``: start reading back its SSD activations and the next blocks'."""
        if block in pass_.entered:
            return
        pass_.entered.add(block)
        for j in range(block, block - self.config.activation_prefetch_blocks - 1, -1):
            for saved in pass_.by_block.get(j, ()):
                if saved.policy is Policy.SSD and saved.upload is None and not saved.released:
                    self._readback.start(saved)
        self._readback.pump()

    # -- releasing -----------------------------------------------------------------------------------
    def _release(self, saved: _Saved) -> None:
        issued = self._readback.stop(saved) if saved.entry is not None else []
        saved.released = True
        if saved.buf is not None:
            saved.buf.release()
            saved.buf = None
        if saved.entry is not None:
            for fut in (saved.write, *issued):
                if fut is not None:
                    fut.exception()  # wait: the entry's region and the device tensor must be idle
            self.store.delete(saved.entry)
            saved.entry = None
        saved.reads, saved.upload, saved.value = [], None, None

    def release(self) -> None:
        """Release every activation still held (after an exception, or a graph never run backward)."""
        for saved in self._live:
            if not saved.released:
                self._release(saved)
        self._live = []
        self._pass = _Pass()

    @property
    def held(self) -> int:
        """Swapped activations not yet used by backward."""
        return sum(not s.released for s in self._live)

    def close(self) -> None:
        """Release everything and close the memory tiers if the swapper built them."""
        self.release()
        if self._own_memory:
            self.memory.close()
