"""Data parallelism for `FuyouAdamW`: each rank owns a shard of the optimizer state.

With a ``torch.distributed`` process group of N ranks, every trainable parameter has one owner
rank (greedy by size, the same on every rank), and only the owner keeps its fp32 master and
moments on its own swap directories: a rank's SSD holds ~1/N of the state. A data-parallel step
(``next_forward`` schedule: the updates run once the window's gradients are known):

1. each rank's accumulated gradient of each parameter is summed onto the parameter's owner
   (``reduce``, in parameter order; a rank without a gradient sends zeros) and divided by N: the
   gradient of the mean loss over the global batch, when every rank's micro-batches are the same size
   (with a ``DistributedDataParallel`` model, which reduced them during backward —
   `FuyouAdamW.ddp_comm_hook` sums each bucket onto the owners only — nothing moves). A streamed
   weight's gradient (`WeightStreamer`; DDP leaves those parameters alone) is summed from the
   ranks' host copies, one at a time;
2. the owners' per-parameter norms are shared (one ``all_reduce`` of a vector holding each norm
   once and zeros elsewhere, so every rank has every norm exactly), and each rank computes the
   same global norm in the same order as a single process would: one decision to commit, clip or
   skip, everywhere;
3. each owner queues the updates of its parameters from its shard of the state: under the
   ``backward`` schedule with a ``DistributedDataParallel`` model, during backward, as each
   bucket's average lands (`FuyouAdamW.ddp_comm_hook`), then commits, redoes or skips at ``step()``
   like every rank; under ``next_forward``, at ``step()``, to run ahead of the next forward;
4. when the next forward reaches a module (or at `FuyouAdamW.flush`, a checkpoint, the next
   backward), its parameters' owners wait for their updates, the ranks agree that they landed
   (`agree`), and each weight is broadcast from its owner (`FuyouAdamW._land`); a streamed
   weight goes from the owner's tier copy into the others' on a sender thread as soon as its
   update landed (`send_streamed`).

The collectives are ``torch.distributed``'s, on the group given (gloo on the CPU, NCCL on GPUs);
host tensors (flags, norms, objects, streamed weights and gradients) go over gloo: the group
itself, or a gloo group of the same ranks made next to an NCCL one. Their timeout is the
group's (``init_process_group(timeout=...)``).
"""

from __future__ import annotations

import queue
import threading
import warnings
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from ..config import ConfigError

__all__ = ["RankError", "Sender", "Shards", "sync_module_states"]


class RankError(RuntimeError):
    """Raised on every rank when a step (or a save) failed on some of them."""


def _describe(error: BaseException) -> str:
    """The error and what caused it (the root cause is what a user acts on: a full disk, an I/O error)."""
    text, cause = f"{type(error).__name__}: {error}", error.__cause__ or error.__context__
    while cause is not None and cause is not error:
        text += f" <- {type(cause).__name__}: {cause}"
        error, cause = cause, cause.__cause__ or cause.__context__
    return text


def sync_module_states(model: torch.nn.Module, group: Any) -> None:
    """Every parameter and buffer of ``model`` (those with memory) made the first rank's of ``group``, as
    ``DistributedDataParallel``'s construction does; for a loop without DDP (`FuyouEngine` with a
    ``process_group`` that reduces the gradients itself). A collective."""
    src = dist.get_process_group_ranks(group)[0] if group is not None else 0
    for t in [*model.parameters(), *model.buffers()]:
        if not t.is_meta:
            dist.broadcast(t.data, src=src, group=group)


class Shards:
    """Who owns each parameter's optimizer state in ``group``, and the step's collectives."""

    def __init__(self, group: Any, params: list, config: Any) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("process_group: torch.distributed is not initialised; call "
                              "torch.distributed.init_process_group first (or let the launcher do it)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world))
        # Host tensors (the step's flags and norms, streamed weights' tier copies and gradients) travel
        # over gloo: the group itself when it is gloo, else (NCCL, which moves device tensors only) a
        # gloo group of the same ranks, made here, where every rank is.
        self.host_group = group if dist.get_backend(group) == "gloo" else dist.new_group(self.ranks, backend="gloo")
        self._check_same_everywhere(params, config)
        loads = [0] * self.world
        self.owner: dict[int, int] = {}
        for ps in sorted(params, key=lambda ps: (-ps.numel, ps.index)):
            r = min(range(self.world), key=lambda r: (loads[r], r))
            self.owner[ps.index] = r
            loads[r] += ps.numel
        self.loads = loads  # parameters owned per rank

    def owns(self, ps: Any) -> bool:
        return self.owner[ps.index] == self.rank

    def _check_same_everywhere(self, params: list, config: Any) -> None:
        """Every rank must train the same parameters with the same configuration (swap directories
        aside); a mismatch is an error on every rank that names it."""
        values = config.to_dict()
        for key in ("swap_dirs", "trace"):  # may differ per rank
            values.pop(key, None)
        mine = {"params": [list(ps.param.shape) for ps in params], "values": values}
        for r, theirs in enumerate(self.all_gather_object(mine)):
            if theirs["params"] != mine["params"]:
                raise ConfigError(f"process_group: rank {r} trains {len(theirs['params'])} parameters shaped "
                                  f"differently from rank {self.rank}'s {len(mine['params'])}; every rank must "
                                  "build the same model and optimizer")
            if theirs["values"] != values:
                fields = sorted(k for k in values if theirs["values"].get(k) != values.get(k))
                raise ConfigError(f"process_group: rank {r}'s FuyouConfig differs from rank {self.rank}'s in "
                                  f"{', '.join(fields)}; give every rank the same configuration (swap_dirs "
                                  "may differ)")

    def reduce_grads(self, params: Iterable[Any], *, averaged: bool = False) -> None:
        """Each parameter's gradient, averaged over the ranks, on its owner; ``None`` elsewhere.
        ``averaged``: the gradients are the ranks' average already (a ``DistributedDataParallel``
        model): nothing moves, the other ranks' copies are dropped."""
        params = list(params)
        if not params:  # the same on every rank: the lists come from the model
            return
        if averaged:
            for ps in params:
                if not self.owns(ps):
                    ps.param.grad = None
            return
        has = lambda ps: ps.param.grad is not None  # noqa: E731
        get = lambda ps: ps.param.grad if has(ps) else torch.zeros_like(ps.param)  # noqa: E731
        for ps, total in self.sum_onto_owners(params, has, get):  # a gradient no rank has stays None
            ps.param.grad = total.div_(self.world) if total is not None else None

    def sum_onto_owners(self, params: list, has: Callable[[Any], bool], get: Callable[[Any], torch.Tensor], *,
                        host: bool = False) -> Iterator[tuple[Any, torch.Tensor | None]]:
        """Each parameter's tensor summed over the ranks onto its owner, in order, for the parameters
        some rank has one for (``has(ps)``; ``get(ps)`` gives it, or zeros where this rank has none):
        yields ``(ps, sum)``, ``sum`` being ``None`` off the owner. One tensor at a time; ``host``:
        host tensors (streamed gradients), over `host_group`."""
        group = self.host_group if host else self.group
        flags = torch.tensor([has(ps) for ps in params], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.host_group)
        for ps, anywhere in zip(params, flags.tolist()):
            if anywhere:
                buf = get(ps)
                dist.reduce(buf, dst=self.ranks[self.owner[ps.index]], op=dist.ReduceOp.SUM, group=group)
                yield ps, (buf if self.owns(ps) else None)

    def share_norms(self, norms: dict[int, torch.Tensor], params: list) -> dict[int, torch.Tensor]:
        """Every parameter's gradient norm on every rank (each from its owner, bitwise: one non-zero
        term per entry), for the parameters whose gradient some rank had."""
        vec = torch.zeros(len(params), dtype=torch.float32)
        seen = torch.zeros(len(params), dtype=torch.int32)
        for i, ps in enumerate(params):
            if ps.index in norms:
                vec[i] = norms[ps.index]
                seen[i] = 1
        dist.all_reduce(vec, group=self.host_group)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.host_group)
        return {ps.index: vec[i] for i, ps in enumerate(params) if seen[i]}

    def broadcast_object(self, values: list) -> None:
        """``values`` (a list, changed in place) from rank 0 of the group to every rank."""
        dist.broadcast_object_list(values, src=self.ranks[0], group=self.host_group)

    def all_gather_object(self, value: Any) -> list:
        """Every rank's ``value``, in rank order, on every rank."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.host_group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.host_group)

    def agree(self, error: BaseException | None, what: str, *, group: Any = None) -> None:
        """Whether ``what`` succeeded on every rank (one small ``all_reduce``): if it failed anywhere, every
        rank raises, naming the ranks and their errors (a failed rank's own error is chained), instead of
        the others waiting for it in the next collective until the group's timeout. ``group``: a gloo
        group of these ranks other than `host_group` (the sender's)."""
        group = group if group is not None else self.host_group
        failed = torch.tensor([error is not None], dtype=torch.int32)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
        if not failed.item():
            return
        reports: list[Any] = [None] * self.world
        dist.all_gather_object(reports, None if error is None else _describe(error), group=group)
        named = "; ".join(f"rank {r}: {e}" for r, e in enumerate(reports) if e is not None)
        raise RankError(f"{what} failed on {sum(e is not None for e in reports)} of {self.world} ranks ({named}); "
                        "every rank stops here") from error

    def broadcast_weights(self, params: Iterable[Any]) -> None:
        """Each updated resident weight from its owner to every rank, in parameter order (streamed ones
        travel on the sender: `send_streamed`)."""
        for ps in params:
            dist.broadcast(ps.param.data, src=self.ranks[self.owner[ps.index]], group=self.group)

    def gather_to_first(self, params: list, read: Callable[[Any], torch.Tensor]) -> dict[Any, torch.Tensor]:
        """Each parameter's tensor (``read(ps)``, on its owner; shaped like the parameter, float32) on the
        group's first rank, one at a time (point to point over `host_group`); ``{}`` on the others. A
        collective: every rank calls it with the same ``params``."""
        out: dict[Any, torch.Tensor] = {}
        first = self.ranks[0]
        for ps in params:
            owner = self.owner[ps.index]
            if self.rank == 0:
                if owner == 0:
                    out[ps] = read(ps)
                else:
                    out[ps] = torch.empty(ps.param.shape, dtype=torch.float32)
                    dist.recv(out[ps], src=self.ranks[owner], group=self.host_group)
            elif self.owns(ps):
                dist.send(read(ps), dst=first, group=self.host_group)
        return out

    def open_sender(self, timeout: float) -> "Sender":
        """A `Sender` with a gloo group of its own (a collective: every rank calls it at the same point);
        its `Sender.close` waits up to ``timeout`` seconds for the sends already submitted."""
        return Sender(dist.new_group(self.ranks, backend="gloo"), timeout)

    def send_streamed(self, sender: "Sender", params: list, streamer: Any, landed: Callable[[Any], None],
                      finish: Callable[[Any, BaseException | None], None]) -> None:
        """On ``sender``'s thread: each streamed weight of ``params``, in order, from its owner's tier copy
        into the others' (`WeightStreamer.assign`), every rank in lockstep on the sender's own group (so
        it never meets the training thread's collectives). Per weight: the owner waits for its update
        (``landed(ps)``, raising if it failed) and says whether it can send; then the value; then every
        rank says whether its part worked (one small ``all_reduce``), so a failure anywhere is known
        everywhere: ``finish(ps, error)`` gets the same `RankError` on every rank, or ``None``. The
        ranks go on with the next weight either way. Never raises: an unexpected error (a collective that
        failed) finishes this and every later weight with it."""
        group, it = sender.group, iter(params)
        try:
            for ps in it:
                src, owner, error = self.ranks[self.owner[ps.index]], self.owns(ps), None
                value = None
                if owner:
                    try:
                        landed(ps)
                        value = streamer.value(ps.param).view(-1)
                    except BaseException as exc:  # noqa: BLE001 - told to every rank below
                        error = exc
                ok = torch.tensor([int(error is None)], dtype=torch.int32)
                dist.broadcast(ok, src=src, group=group)
                if ok.item():
                    if not owner:
                        value = torch.empty(ps.numel, dtype=ps.param.dtype)
                    dist.broadcast(value, src=src, group=group)
                    if not owner:
                        try:
                            streamer.assign(ps.param, value)
                        except BaseException as exc:  # noqa: BLE001 - told to every rank below
                            error = exc
                del value
                finish(ps, self._agree_on(error, f"sending the new weight of parameter {ps.index}", group))
        except BaseException as exc:  # noqa: BLE001 - the waiters hear of it through the futures
            finish(ps, exc)
            for ps in it:
                finish(ps, exc)

    def _agree_on(self, error: BaseException | None, what: str, group: Any) -> RankError | None:
        """`agree`, on ``group``, returning the `RankError` instead of raising it."""
        try:
            self.agree(error, what, group=group)
        except RankError as exc:
            return exc
        return None

    def sync_streamed(self, streamer: Any) -> list[Any]:
        """Every streamed weight's tier copy made rank 0's (as ``DistributedDataParallel``'s construction
        makes the resident weights rank 0's; it leaves the streamed ones alone). Returns the parameters
        whose value changed on this rank."""
        changed = []
        for param in streamer.streamed():
            mine = streamer.value(param).view(-1)
            value = mine if self.rank == 0 else torch.empty_like(mine)
            dist.broadcast(value, src=self.ranks[0], group=self.host_group)
            if value is not mine and not torch.equal(value, mine):
                streamer.assign(param, value)
                changed.append(param)
        return changed


class Sender:
    """A daemon thread that runs the sends it is given, one after another, on a gloo group of its own
    (`Shards.send_streamed`). A daemon: a send stuck on a rank that died must not hold the process
    at exit (the group's timeout ends it otherwise)."""

    def __init__(self, group: Any, timeout: float) -> None:
        self.group, self.timeout = group, timeout
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="fuyou-send", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` after what was submitted before (``fn`` reports through futures; never raises)."""
        self._queue.put((fn, args))

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args = item
            fn(*args)

    def close(self) -> None:
        """Stop after the sends already submitted, and wait for them (up to ``timeout``): the other ranks
        send in lockstep, and the process group must not be destroyed under a send. Warns if one is
        still running then."""
        self._queue.put(None)
        self._thread.join(self.timeout)
        if self._thread.is_alive():
            warnings.warn(f"fuyou: the weight sender was still sending after {self.timeout:.0f} s (another rank "
                          "stopped taking part?); destroying the process group now may abort the process",
                          stacklevel=2)
