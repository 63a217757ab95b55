"""The host budget is a hard cap: one function splits it, and every host buffer fuyou holds counts against it."""

import contextlib
import copy
import errno
import gc
import time

import pytest
import torch

from conftest import tiny_causal_lm
from fuyou_strategy import FuyouConfig
from fuyou_strategy.activations import ActivationSwapper
from fuyou_strategy.storage import HostShares, host_budget_split
from fuyou_strategy.device import alloc_host_buffer, host_buffer_usage, reset_host_buffer_high_water
from fuyou_strategy.optim import FuyouAdamW
from fuyou_strategy.storage import HostBudgetError, StorageIOError, aio

KiB, MiB = 1024, 2**20


def config(tmp_path, activations, budget, **fields):
    return FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", host_memory_budget=budget,
                       activations=activations, activation_min_bytes=0, **fields)


def ids(seed=0):
    return torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(seed))


def train(model, cfg, steps=3, swap=True):
    """A few clipped steps of FuyouAdamW, with the activation swapper sharing its store when ``swap``."""
    opt = FuyouAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, config=cfg)
    swapper = ActivationSwapper(model, cfg, memory=opt.memory) if swap else None
    try:
        for step in range(steps):
            with swapper if swap else contextlib.nullcontext():
                model(input_ids=ids(step), labels=ids(step)).loss.backward()
            opt.step()
            opt.zero_grad()
        return swapper.stats if swap else None
    finally:
        if swapper is not None:
            swapper.close()
        opt.close()


def test_the_split_of_the_default_budget_and_of_small_ones():
    # The transfers' shares (host_state=0: no state in RAM; its share is tests/test_host_state.py's)
    shares = host_budget_split(FuyouConfig(host_memory_budget="2GiB", host_state=0))
    state_chunk = 16 * MiB // (24 * KiB) * 24 * KiB  # whole groups of 2048 parameters' [master | m | v]
    assert shares == HostShares(budget=2 * 2**30, state_chunk=state_chunk, optimizer_depth=4,
                                optimizer_readahead=5 * state_chunk, activation_staging=32 * MiB,
                                activation_readback=32 * MiB,
                                host_activations=2 * 2**30 - 5 * state_chunk - 64 * MiB)
    assert shares.reserved + shares.host_activations == shares.budget
    small = host_budget_split(FuyouConfig(chunk_size="8KiB", host_memory_budget="96KiB", host_state=0))
    assert small.state_chunk == 24 * KiB, "a state chunk holds at least 2048 parameters"
    assert small.optimizer_depth == 1 and small.host_activations == 96 * KiB - 48 * KiB - 32 * KiB
    drives = host_budget_split(FuyouConfig(swap_dirs=["/tmp", "/var/tmp", "/dev/shm"], chunk_size="8KiB", host_state=0))
    assert drives.activation_staging == drives.activation_readback == 3 * 8 * KiB, "a chunk per drive in flight"
    tiny = host_budget_split(FuyouConfig(chunk_size="16KiB", host_memory_budget="16KiB", host_state=0))
    assert tiny.optimizer_depth == 1 and tiny.host_activations == 0 and tiny.reserved == tiny.budget


def test_the_optimizer_reads_ahead_as_the_split_says(tmp_path):
    cfg = config(tmp_path, "keep", "48KiB")
    opt = FuyouAdamW(torch.nn.Linear(64, 64).parameters(), config=cfg)
    try:
        assert opt.adam_state.pipeline.depth == host_budget_split(cfg).optimizer_depth == 1
    finally:
        opt.close()


def test_host_policy_activations_stay_within_their_share(tmp_path):
    cfg = config(tmp_path, "host", "192KiB")
    shares = host_budget_split(cfg)
    model = tiny_causal_lm("gpt2")
    swapper = ActivationSwapper(model, cfg)
    with swapper:
        loss = model(input_ids=ids(), labels=ids()).loss
        assert swapper.stats.host_bytes > 0 and swapper.stats.host_pool_full > 0, "the share was filled"
        assert swapper.store.pool.lent <= shares.host_activations < shares.budget - 2 * cfg.chunk_size
        loss.backward()
    assert swapper.store.pool.lent == 0
    swapper.close()


@pytest.mark.parametrize("activations, budget", [({0: "ssd", 1: "host"}, 220 * KiB), ("ssd", 48 * KiB), ("ssd", 24 * KiB)],
                         ids=["ssd-and-host", "ssd-tight", "ssd-a-chunk-at-a-time"])
def test_host_buffers_process_wide_never_exceed_the_budget_while_training(tmp_path, activations, budget):
    cfg = config(tmp_path, activations, budget)
    model = tiny_causal_lm("gpt2")
    reference = copy.deepcopy(model)
    gc.collect()
    before = host_buffer_usage().live  # what other tests may still hold is not this run's
    reset_host_buffer_high_water()
    stats = train(model, cfg)
    peak = host_buffer_usage().high_water - before
    assert stats.ssd_bytes > 0 and stats.prefetched + stats.fetched_on_demand > 0, "activations went to SSD and back"
    assert stats.host_bytes > 0 or activations == "ssd"
    assert 0 < peak <= budget, f"fuyou held {peak} bytes of host buffers at once; the budget is {budget}"
    train(reference, cfg.replace(activations="keep"), swap=False)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_a_read_back_that_cannot_get_a_buffer_is_a_clear_error(tmp_path):
    model = tiny_causal_lm("gpt2")
    swapper = ActivationSwapper(model, config(tmp_path, "ssd", "256KiB", io_timeout=0.5))
    pool = swapper.store.pool
    with swapper:
        loss = model(input_ids=ids(), labels=ids()).loss
        hog = pool.acquire(pool.budget, timeout=10)  # someone outside the split holds the whole pool
        start = time.monotonic()
        with pytest.raises(HostBudgetError, match=r"host_memory_budget: waited 0.5 s .* \(to read back an activation "
                                                  r"of block 1\); .*a larger host_memory_budget"):
            loss.backward()
        assert time.monotonic() - start < 5
        hog.release()
    assert swapper.held == 0 and swapper.store.entries == {} and pool.lent == 0
    model.zero_grad(set_to_none=True)  # the failed backward got as far as the head
    with swapper:
        model(input_ids=ids(), labels=ids()).loss.backward()  # works again
    reference = tiny_causal_lm("gpt2")
    reference(input_ids=ids(), labels=ids()).loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    swapper.close()


def test_a_failed_read_back_reaches_backward_and_leaves_nothing(tmp_path, monkeypatch):
    model = tiny_causal_lm("gpt2")
    swapper = ActivationSwapper(model, config(tmp_path, "ssd", "256KiB"))
    with swapper:
        loss = model(input_ids=ids(), labels=ids()).loss
        monkeypatch.setattr(aio, "_preadv", lambda fd, bufs, off: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
        with pytest.raises(StorageIOError, match="read of .* failed: I/O error"):
            loss.backward()
    assert swapper.held == 0 and swapper.store.entries == {} and swapper.store.pool.lent == 0
    swapper.close()


def test_host_buffers_count_until_their_memory_is_freed():
    gc.collect()
    start = host_buffer_usage().live
    reset_host_buffer_high_water()
    buf = alloc_host_buffer(3 * 4096)
    view = buf[4096:]
    del buf
    assert host_buffer_usage().live == start + 3 * 4096, "a view keeps the memory alive"
    del view
    second = alloc_host_buffer(4096)
    assert host_buffer_usage() == type(host_buffer_usage())(start + 4096, start + 3 * 4096)
    del second
    assert host_buffer_usage().live == start
