"""`ActivationSwapper`: saved-tensor hooks that move activations device → host → SSD.

Wrap forward *and* backward::

    swapper = ActivationSwapper(model, FuyouConfig(activations="ssd"))
    for batch in loader:
        with swapper:
            loss = model(**batch).loss
            loss.backward()

On entering, each repeated block (see `discover_blocks`) gets a forward wrapper chosen by its
policy: ``recompute`` runs the block under non-reentrant activation checkpointing; ``host``
and ``ssd`` run it under ``torch.autograd.graph.saved_tensors_hooks`` whose pack hook moves
each saved tensor out and whose unpack hook brings it back; ``keep`` is left alone.

What is never swapped: parameters and views of them; the low-precision copy of a trainable
weight that autocast saves (it is cached per step, so it is kept once); tensors smaller than
``activation_min_bytes``; tensors that are not dense (they would lose their layout). A
tensor saved twice by one forward (e.g. the input of the q, k and v projections) is
swapped once.

Swap-out is asynchronous: the pack hook copies the bytes into host pool buffers and returns;
I/O threads write them to the tensor store and hand the buffers back to the pool as soon as
they are on disk, so the host budget is never exceeded. When backward reaches block ``i``,
reads for blocks ``i-1 … i-k`` are already issued (``activation_prefetch_blocks``); an unpack
waits only for its own tensor. SSD space and buffers are released as soon as a tensor is used.

Outside a ``with`` block, `install` / `uninstall` keep the wrappers in place for a whole
training run and `begin_pass` marks the start of each forward (what `FuyouEngine` does for
Lightning and Hugging Face); each forward and its backward form one *pass* with its own
bookkeeping, so gradient accumulation and a second forward before a backward both work.

Swapped activations serve one backward per forward: a second backward through the same graph
(``retain_graph=True``) raises a clear error instead of reading released memory. Leaving the
``with`` block — normally or by an exception — releases everything still held.
"""

from __future__ import annotations

import itertools
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from ..config import ConfigError, FuyouConfig
from ..device import alloc_host_buffer
from ..storage import HostBuffer, TensorStore, round_up
from .blocks import Policy, discover_blocks, resolve_policies

__all__ = ["ActivationSwapper", "SwapStats", "swappable", "first_tensor"]


@dataclass
class SwapStats:
    """Counters over the swapper's lifetime (bytes are the tensors' own sizes)."""

    kept_tensors: int = 0  # saved tensors left on the device (parameters, small, not dense)
    host_bytes: int = 0
    ssd_bytes: int = 0
    host_pool_full: int = 0  # host-policy tensors kept because the pool had no room
    deduplicated: int = 0  # saves of a tensor already swapped in this forward
    prefetched: int = 0  # SSD tensors whose read was issued before their unpack
    fetched_on_demand: int = 0
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
                 "write", "read", "source", "released", "__weakref__")

    def __init__(self, pass_: _Pass, block: int, policy: Policy, t: torch.Tensor) -> None:
        self.pass_, self.block, self.policy = pass_, block, policy
        self.size, self.stride, self.dtype, self.device = t.size(), t.stride(), t.dtype, t.device
        self.nbytes = t.numel() * t.element_size()
        self.refs = 1
        self.buf: HostBuffer | None = None
        self.entry: str | None = None
        self.write: Future | None = None
        self.read: Future | None = None
        self.source = weakref.ref(t)
        self.released = False

    def rebuild(self, raw: torch.Tensor) -> torch.Tensor:
        """The tensor, with its original strides, from its raw bytes in storage order."""
        return raw[: self.nbytes].view(self.dtype).as_strided(self.size, self.stride).to(self.device)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's bytes in storage order (so strides survive the round trip)."""
    return t.detach().as_strided((t.numel(),), (1,), t.storage_offset()).view(torch.uint8)


def first_tensor(out: Any) -> torch.Tensor | None:
    """The first tensor of a block's output (a tensor, a tuple, or a ModelOutput-like tuple)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers exactly ``numel`` consecutive elements of its storage, in some order."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _is_autocast_weight(t: torch.Tensor) -> bool:
    """The low-precision copy autocast makes of a trainable weight, or a view of it (``w.t()``).

    Autocast caches that copy for the whole autocast region, so it is one tensor per step:
    keeping it costs its size once, swapping it would move weights for every use.
    """
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    return (fn is not None and fn.name() == "ToCopyBackward0"
            and any(type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt is not None))


def swappable(t: torch.Tensor, param_storages: set[int], min_bytes: int) -> bool:
    """Whether a saved tensor is one a host/ssd policy moves (see the module docstring)."""
    nbytes = t.numel() * t.element_size()
    return not (nbytes == 0 or nbytes < min_bytes or t.untyped_storage().data_ptr() in param_storages
                or not _is_dense(t) or _is_autocast_weight(t))


class ActivationSwapper:
    """Per-block activation policies applied through saved-tensor hooks; see the module docstring.

    Args:
        model: the model; its repeated blocks are found by `discover_blocks` (or named by
            ``config.blocks``).
        config: ``activations`` (a policy for all blocks or ``{index: policy}``),
            ``activation_min_bytes``, ``activation_prefetch_blocks``, and the storage knobs.
        store: a tensor store to share (e.g. with the optimizer); by default the swapper
            makes its own and closes it in `close()`.
    """

    def __init__(self, model: torch.nn.Module, config: FuyouConfig | None = None, *, store: TensorStore | None = None) -> None:
        self.config = config = config if config is not None else FuyouConfig()
        self.model = model
        if config.activations == "auto" or config.plan is not None:
            raise ConfigError("activations='auto' and plan= are applied by FuyouEngine (the Lightning strategy and the "
                              "HF callback use it); give ActivationSwapper explicit policies")
        self.blocks = discover_blocks(model, config.blocks)
        self.policies = resolve_policies(config.activations, len(self.blocks))
        needs_store = any(p in (Policy.HOST, Policy.SSD) for p in self.policies)
        self._own_store = store is None and needs_store
        self.store = TensorStore(config) if self._own_store else store
        self.stats = SwapStats()
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
        self._param_storages = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        # A forward set on the instance by someone else (e.g. another library's hooks) is kept aside
        # and put back on exit; otherwise our instance attribute shadows the class's method.
        self._instance_forwards = {}
        for i, (block, policy) in enumerate(zip(self.blocks, self.policies)):
            if self._wrapped(policy):
                self._instance_forwards[i] = vars(block).get("forward")
                block.forward = self._wrap(i, policy, block.forward)
        self._active = True

    def uninstall(self) -> None:
        """Take the wrappers off and release every activation still held."""
        if not self._active:
            return
        for i, previous in self._instance_forwards.items():
            if previous is None:
                del self.blocks[i].forward
            else:
                self.blocks[i].forward = previous
        self._active = False
        self.release()

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
                out = checkpoint(forward, *args, use_reentrant=False, **kwargs)
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
            # Never wait for the pool here: only backward frees host-held activations, so
            # waiting could wait forever. Keep a few chunks free for SSD staging.
            buf = self.store.pool.try_acquire(nbytes, keep_free=2 * self.config.chunk_size)
            if buf is None:
                self.stats.host_pool_full += 1
                self.stats.kept_tensors += 1
                return t
            buf.view().copy_(_storage_bytes(t))
            saved.buf = buf
            self.stats.host_bytes += nbytes
        else:
            saved.entry = f"act.{next(self._names)}"
            self.store.create(saved.entry, (nbytes,), torch.uint8, slots=1)
            saved.write = self.store.write(saved.entry, _storage_bytes(t))
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
        if saved.policy is Policy.HOST:
            out = saved.rebuild(saved.buf.view().clone())
        else:
            out = saved.rebuild(saved.read.result())
        saved.refs -= 1
        if saved.refs == 0:
            self._release(saved)
        return out

    def _enter_backward(self, pass_: _Pass, block: int) -> None:
        """Backward reached ``block``: fetch what it needs now and read ahead for the next blocks."""
        if block in pass_.entered:
            return
        pass_.entered.add(block)
        for j in range(block, block - self.config.activation_prefetch_blocks - 1, -1):
            for saved in pass_.by_block.get(j, ()):
                if saved.policy is Policy.SSD and saved.read is None and not saved.released:
                    self._fetch(saved)
                    if j == block:
                        self.stats.fetched_on_demand += 1
                    else:
                        self.stats.prefetched += 1

    def _fetch(self, saved: _Saved) -> None:
        saved.write.result()  # long done by backward time; raises if the swap-out failed
        dest = alloc_host_buffer(round_up(saved.nbytes))  # the device tier on the CPU; pinned staging on CUDA
        saved.read = self.store.read_into(saved.entry, dest)

    # -- releasing -----------------------------------------------------------------------------------
    def _release(self, saved: _Saved) -> None:
        saved.released = True
        if saved.buf is not None:
            saved.buf.release()
            saved.buf = None
        if saved.entry is not None:
            for fut in (saved.write, saved.read):
                if fut is not None:
                    fut.exception()  # wait: the entry's region must be idle before reuse
            self.store.delete(saved.entry)
            saved.entry = None
        saved.read = None

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
        """Release everything and close the store if the swapper made it."""
        self.release()
        if self._own_store and self.store is not None:
            self.store.close()
