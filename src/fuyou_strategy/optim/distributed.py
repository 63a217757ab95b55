"""Data parallelism for `FuyouAdamW`: each rank owns a shard of the optimizer state.

With a ``torch.distributed`` process group of N ranks, every trainable parameter has one owner
rank (greedy by size, the same on every rank), and only the owner keeps its fp32 master and
moments on its own swap directories: a rank's SSD holds ~1/N of the state. A data-parallel step
(``next_forward`` schedule: the updates run once the window's gradients are known):

1. each rank's accumulated gradient of each parameter is summed onto the parameter's owner
   (``reduce``, in parameter order; a rank without a gradient sends zeros) and divided by N: the
   gradient of the mean loss over the global batch, when every rank's micro-batches are the same size
   (with a ``DistributedDataParallel`` model, which reduced them during backward —
   `OptimizerControl.ddp_comm_hook` sums each bucket onto the owners only — nothing moves). A streamed
   weight's gradient (`WeightStreamer`; DDP leaves those parameters alone) is summed from the
   ranks' host copies, one at a time;
2. the owners' per-parameter norms are shared (one ``all_reduce`` of a vector holding each norm
   once and zeros elsewhere, so every rank has every norm exactly), and each rank computes the
   same global norm in the same order as a single process would: one decision to commit, clip or
   skip, everywhere;
3. each owner queues the updates of its parameters from its shard of the state: under the
   ``backward`` schedule with a ``DistributedDataParallel`` model, during backward, as each
   bucket's average lands (`OptimizerControl.ddp_comm_hook`), then commits, redoes or skips at ``step()``
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
import time
import warnings
import weakref
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from ..config import ConfigError
from .gradients import grad_norm

if TYPE_CHECKING:
    from .weights import StreamedWeights, UpdatesGate

__all__ = ["RankError", "Sender", "Sharding", "Shards", "Solo", "sync_module_states"]

_SENDER_POLL = 1.0  # seconds between checks that the sender thread lives, while a wait for a weight goes on


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
        """Every rank must train the same parameters with the same configuration (swap directories,
        traces and host budgets aside); a mismatch is an error on every rank that names it."""
        values = config.to_dict()
        # Each rank's own: its drives, its trace, its host memory ("auto" resolves on each rank: a few pages
        # apart, or another machine's RAM; the plan's state in RAM is capped by each rank's budget).
        for key in ("swap_dirs", "trace", "host_memory_budget"):
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
                                  f"{', '.join(fields)}; give every rank the same configuration (swap_dirs, "
                                  "trace and host_memory_budget may differ)")

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

    def send_streamed(self, sender: "Sender", params: list, streamer: StreamedWeights, landed: Callable[[Any], None],
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

    def sync_streamed(self, streamer: StreamedWeights) -> list[torch.nn.Parameter]:
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


# -- the optimizer's collaborator: one process, or a shard of a process group ------------------------------------
class Solo:
    """One process: every parameter's state is here, and there is nothing to send, sum or agree on. The
    do-nothing `Sharding`, so that a one-process step reads straight through."""

    shards = None
    rank, world = 0, 1

    def __init__(self, landing: Any) -> None:
        self.landing = landing  # `schedule.PendingUpdates`

    def owns(self, ps: Any) -> bool:
        return True

    def owned(self, params: Iterable[Any]) -> list:
        return list(params)

    def pending(self) -> bool:
        """Whether the last step left updates for the next forward (the next backward lands them first)."""
        return bool(self.landing.jobs)

    def land(self, params: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Land the pending updates of ``params`` (default: all)."""
        self.landing.wait_all() if params is None else self.landing.wait(params)

    def updated(self, params: list, *, gated: bool) -> None:
        """These weights changed; unless a forward waits for them, land their updates now (as torch.optim does)."""
        if not gated:
            self.land()

    def agree(self, error: BaseException | None, what: str) -> None:
        if error is not None:
            raise error

    def agree_on_failure(self, error: BaseException, what: str) -> None:
        """The caller raises ``error`` itself."""

    def share_norms(self, norms: dict, params: list) -> dict:
        return norms

    def sum_at_step(self, params: list, norms: dict, inv_scale: torch.Tensor | None) -> None:
        """The gradients are this process's own: nothing to sum."""

    def same_choice(self, choice: list) -> list:
        return choice

    def updates_gate(self) -> UpdatesGate:
        """What a `WeightStreamer` waits on before it reads a block's tier copies: the pending updates."""
        return self.landing

    def attach_weights(self, streamer: StreamedWeights) -> list[torch.nn.Parameter]:
        """Nothing to make alike: returns the parameters whose value changed (none)."""
        return []

    def check_owner(self, ps: Any, what: str) -> None:
        pass

    def gather_to_first(self, params: list, read: Callable[[Any], torch.Tensor]) -> dict:
        return {ps: read(ps) for ps in params}

    # what a checkpoint save needs of a group (`checkpoint.Group`)
    def broadcast_object(self, values: list) -> None:
        pass

    def all_gather_object(self, value: Any) -> list:
        return [value]

    def barrier(self) -> None:
        pass


class Sharding:
    """Data parallel: each rank owns ~1/N of the optimizer state (`Shards`), and the step's collectives.

    What it adds to a one-process step (module docstring): the gradients summed onto their owners and the
    norms shared (`sum_at_step`, `share_norms`, or DDP's comm hook: `attach_ddp`), one decision on every rank
    (`agree`, `same_choice`), and each updated weight sent from its owner (`updated`): resident weights
    broadcast when the next forward reaches their module (`land`), streamed ones by the sender thread.

    Threads: the training thread owns ``unsent`` and adds to and pops from ``sent``; the sender thread only
    completes the futures in ``sent`` (and pops `landing`'s jobs, see `PendingUpdates`); DDP's collective
    thread runs `comm_hook`, which only reads (owners, the window) and queues updates."""

    def __init__(self, shards: Shards, params: list, config: Any, landing: Any, store: Any, *,
                 gradients_averaged: bool) -> None:
        self.shards = shards
        self.rank, self.world = self.shards.rank, self.shards.world
        self.landing, self.store = landing, store
        self.timeout, self.reduction = config.io_timeout, config.gradient_reduction
        self.averaged = gradients_averaged  # by DistributedDataParallel: step() moves none
        self.self_reduced: set[int] = set()  # ... but these, which DDP was told to leave alone (`reduce_itself`)
        self.by_param = {ps.param: ps for ps in params}
        self.unsent: list = []  # updated resident weights not yet broadcast from their owners
        self.sent: dict[torch.nn.Parameter, Future] = {}  # streamed weights on their way, until waited for
        self.sender: Sender | None = None  # moves streamed weights from their owners (`attach_weights`)
        self.streamer: StreamedWeights | None = None

    def owns(self, ps: Any) -> bool:
        return self.shards.owns(ps)

    def owned(self, params: Iterable[Any]) -> list:
        return [ps for ps in params if self.shards.owns(ps)]

    def pending(self) -> bool:
        return bool(self.unsent or self.sent)

    def land(self, params: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Land the pending updates of ``params`` (default: all): the owners land theirs, every rank agrees
        that they did, and each weight is broadcast from its owner, in update order; the pending list is the
        same on every rank, so the ranks issue the same collectives."""
        if params is not None:
            params = list(params)
        self.wait_sent(params)
        wanted = None if params is None else set(params)
        todo = [ps for ps in self.unsent if wanted is None or ps.param in wanted]
        if not todo:
            return
        error = None
        try:
            self.landing.wait([ps.param for ps in todo if self.owns(ps)])
        except BaseException as exc:  # noqa: BLE001 - the other ranks must hear of it, not wait
            error = exc
        self.shards.agree(error, "the last step's optimizer updates")
        self.shards.broadcast_weights(todo)
        sent = {ps.index for ps in todo}
        self.unsent = [ps for ps in self.unsent if ps.index not in sent]

    def updated(self, params: list, *, gated: bool) -> None:
        """These weights (in update order) changed on their owners: they go to every rank before they are
        next read — resident ones at `land` (the next forward, module by module, or now if nothing gates the
        forward), streamed ones on the sender thread from now on."""
        streamer = self.streamer if self.sender is not None else None
        self.unsent = [ps for ps in params if not (streamer is not None and streamer.streams(ps.param))]
        if streamer is not None:
            self._start_sending([ps for ps in params if streamer.streams(ps.param)])
        if not gated:
            self.land()

    def _start_sending(self, params: list) -> None:
        """Hand these streamed weights to the sender: each goes once its owner's update landed, and its
        future (in ``sent``) completes once this rank's tier copy holds it."""
        if not params:
            return
        futures = {ps.param: Future() for ps in params}
        self.sent.update(futures)
        landing = self.landing

        def landed(ps: Any) -> None:
            landing.wait([ps.param])

        def finish(ps: Any, error: BaseException | None) -> None:
            fut = futures[ps.param]
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(None)

        self.sender.submit(self.shards.send_streamed, self.sender, params, self.streamer, landed, finish)

    def wait_sent(self, params: list[torch.nn.Parameter] | None = None) -> None:
        """Wait until the sender has put these streamed weights (default: all on their way) into this
        rank's tier copies; raises what the send raised (the same `RankError` on every rank). No
        collective: each rank waits for its own copies. A way out: ``io_timeout``, and the sender's
        liveness."""
        if not self.sent:
            return
        keys = list(self.sent) if params is None else [p for p in params if p in self.sent]
        deadline = time.monotonic() + self.timeout
        for p in keys:
            fut = self.sent[p]
            while not wait([fut], timeout=_SENDER_POLL).done:
                if not self.sender.alive():
                    raise RuntimeError("FuyouAdamW: the weight sender thread stopped; the streamed weights "
                                       "of the last step cannot arrive")
                if time.monotonic() >= deadline:
                    index = self.by_param[p].index
                    raise TimeoutError(f"FuyouAdamW: the new weight of parameter {index} did not arrive from rank "
                                       f"{self.shards.owner[index]} within io_timeout={self.timeout:.0f} s")
            del self.sent[p]
            fut.result()  # what the send raised: the same RankError on every rank

    def agree(self, error: BaseException | None, what: str) -> None:
        self.shards.agree(error, what)

    def agree_on_failure(self, error: BaseException, what: str) -> None:
        """This rank failed at ``what``: the others hear of it (a `RankError` raised everywhere), unless the
        failure is that agreement itself."""
        if not isinstance(error, RankError):
            self.shards.agree(error, what)

    def share_norms(self, norms: dict, params: list) -> dict:
        return self.shards.share_norms(norms, params)

    def sum_at_step(self, params: list, norms: dict, inv_scale: torch.Tensor | None) -> None:
        """Each gradient of the window, averaged over the ranks, onto its owner: streamed ones from the ranks'
        gradient entries (one in host memory at a time; its norm in ``norms`` becomes the owner's of the
        average), resident ones in ``.grad`` (nothing moves for those DistributedDataParallel averaged)."""
        self.sum_streamed([ps for ps in params if ps.grads is not None], norms, inv_scale)
        resident = [ps for ps in params if ps.grads is None]
        self.shards.reduce_grads([ps for ps in resident if ps.index in self.self_reduced])
        self.shards.reduce_grads([ps for ps in resident if ps.index not in self.self_reduced], averaged=self.averaged)

    def sum_streamed(self, streamed: list, norms: dict, inv_scale: torch.Tensor | None) -> None:
        """The streamed gradients of `sum_at_step`, each back into its owner's gradient entry."""
        mine = {ps.index for ps in streamed if ps.index in norms}
        for ps in streamed:
            norms.pop(ps.index, None)  # this rank's own: the owner's of the average replaces it
        timeout, store = self.timeout, self.store

        def read(ps: Any) -> torch.Tensor:
            if ps.index not in mine:
                return torch.zeros(ps.numel, dtype=ps.param.dtype)
            return store.read(ps.grads, timeout=timeout).result(timeout=timeout)

        for ps, total in self.shards.sum_onto_owners(streamed, lambda ps: ps.index in mine, read, host=True):
            if total is not None:
                total.div_(self.world)
                norms[ps.index] = grad_norm(total.view(ps.param.shape), inv_scale)
                store.write(ps.grads, total, timeout=timeout).result(timeout=timeout)

    def same_choice(self, choice: list) -> list:
        """Rank 0's choice of the next schedule on every rank (each rank's chooser measured its own waits)."""
        self.shards.broadcast_object(choice)
        return choice

    def updates_gate(self) -> UpdatesGate:
        return _SentWeights(self)

    def attach_weights(self, streamer: StreamedWeights) -> list[torch.nn.Parameter]:
        """Each rank streams every streamed weight from its own tier copy, made rank 0's here (a collective);
        new values reach the other ranks on a sender thread of its own group. Returns the parameters whose
        value changed on this rank."""
        self.streamer = streamer
        if not streamer.streamed():
            return []
        if self.sender is None:
            self.sender = self.shards.open_sender(self.timeout)
        return self.shards.sync_streamed(streamer)

    def reduce_itself(self, params: Iterable[Any]) -> bool:
        """The DistributedDataParallel model leaves these parameters alone: ``step()`` sums their gradients
        itself. Returns whether there are any (the updates then run at ``step()``)."""
        indices = {ps.index for ps in params}
        self.self_reduced |= indices
        return bool(indices)

    def check_owner(self, ps: Any, what: str) -> None:
        if not self.owns(ps):
            raise ConfigError(f"{what}: parameter {ps.index} {tuple(ps.param.shape)} is owned by rank "
                              f"{self.shards.owner[ps.index]}, not this rank ({self.rank}); read it there")

    def gather_to_first(self, params: list, read: Callable[[Any], torch.Tensor]) -> dict:
        return self.shards.gather_to_first(params, read)

    # -- DistributedDataParallel: updates as its buckets land --------------------------------------------------
    def attach_ddp(self, ddp_model: Any, optimizer: Any) -> None:
        """Register the comm hook on a ``DistributedDataParallel`` model (before its first backward): each
        bucket's average goes to `comm_hook` through the ``ddp_comm_hook`` of the optimizer's control
        (`OptimizerControl`) that attached last (weakly: DDP takes one hook for its lifetime and a model may
        outlive its optimizer; with none left, or closed, it averages as DDP does)."""
        target = getattr(ddp_model, "_fuyou_hook_target", None)
        if target is not None:
            target.optimizer = weakref.ref(optimizer)
            return
        target = _HookTarget(weakref.ref(optimizer), self.shards.group, self.world)
        ddp_model._fuyou_hook_target = target
        ddp_model.register_comm_hook(target, _comm_hook)

    def comm_hook(self, bucket: Any, deliver: Callable[[Any, torch.Tensor], None]) -> Future:
        """DDP's averaging (divide, then sum over the ranks) and, when it completes, ``deliver(ps, average)``
        for each of this rank's parameters in the bucket. ``gradient_reduction="owner"``: each run of
        parameters with one owner is summed onto that rank only (a ``reduce``); ``"all"``: one ``all_reduce``.
        The callback runs on the collective's thread."""
        shards = self.shards
        buffer = bucket.buffer().div_(self.world)
        if self.reduction == "all":
            fut = dist.all_reduce(buffer, group=shards.group, async_op=True).get_future()
        else:
            fut = torch.futures.collect_all([
                dist.reduce(buffer[start:end], dst=shards.ranks[owner], group=shards.group, async_op=True).get_future()
                for owner, start, end in self._owner_runs(bucket)])

        def landed(fut: Future) -> torch.Tensor:
            fut.wait()  # raises if a collective failed
            for param, grad in zip(bucket.parameters(), bucket.gradients()):
                ps = self.by_param.get(param)
                if ps is not None and self.owns(ps):
                    # a view of the bucket: DDP leaves it alone until the next window's backward, and step()
                    # drains every update before that
                    deliver(ps, grad.detach().view_as(param))
            return buffer

        return fut.then(landed)

    def _owner_runs(self, bucket: Any) -> list[tuple[int, int, int]]:
        """``(owner rank index, start, end)`` of each run of consecutive gradients in the bucket's flat
        buffer whose parameters have the same owner (a parameter this optimizer does not train: rank 0)."""
        base, size = bucket.buffer().data_ptr(), bucket.buffer().element_size()
        runs: list[list[int]] = []
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            ps = self.by_param.get(param)
            owner = self.shards.owner[ps.index] if ps is not None else 0
            start = (grad.data_ptr() - base) // size
            if runs and runs[-1][0] == owner and runs[-1][2] == start:
                runs[-1][2] = start + grad.numel()
            else:
                runs.append([owner, start, start + grad.numel()])
        return [tuple(r) for r in runs]

    # what a checkpoint save needs of a group (`checkpoint.Group`)
    def broadcast_object(self, values: list) -> None:
        self.shards.broadcast_object(values)

    def all_gather_object(self, value: Any) -> list:
        return self.shards.all_gather_object(value)

    def barrier(self) -> None:
        self.shards.barrier()

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class _SentWeights:
    """What a `WeightStreamer` waits on under data parallelism: a streamed weight is ready once the sender
    put its owner's new value into this rank's tier copy (`Sharding.wait_sent`; no collective, so the ranks
    may put blocks on the device ahead at different moments)."""

    def __init__(self, sharding: Sharding) -> None:
        self._sharding = weakref.ref(sharding)  # the model's hooks must not keep the optimizer's parts alive

    def pending(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Whether any of ``params`` is still on its way (or failed to arrive: `wait` raises that)."""
        sharding = self._sharding()
        if sharding is None or not sharding.sent:
            return False
        futures = [sharding.sent.get(p) for p in params]
        return any(f is not None and (not f.done() or f.exception() is not None) for f in futures)

    def wait(self, params: Iterable[torch.nn.Parameter]) -> None:
        sharding = self._sharding()
        if sharding is not None:
            sharding.wait_sent(list(params))


class _HookTarget:
    """The state of the comm hook `Sharding.attach_ddp` registers: the optimizer's control it serves (weakly)."""

    def __init__(self, optimizer: "weakref.ref", group: Any, world: int) -> None:
        self.optimizer, self.group, self.world = optimizer, group, world


def _comm_hook(state: _HookTarget, bucket: Any) -> Any:
    opt = state.optimizer()
    if opt is not None and not opt.closed:
        return opt.ddp_comm_hook(state, bucket)
    buffer = bucket.buffer().div_(state.world)  # DDP's own averaging
    return dist.all_reduce(buffer, group=state.group, async_op=True).get_future().then(lambda fut: fut.value()[0])


# DDP checks the annotations as objects (this module's are strings: `from __future__ import annotations`).
_comm_hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
