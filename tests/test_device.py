"""The device module: copies that land late (the test mode that makes a missing wait show on the CPU),
exact-size pinned host buffers counted in the budget, and the mode's own ways out (errors, a dead engine)."""

import ctypes
import gc
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import tiny_causal_lm
from fuyou_strategy import FuyouConfig, device
from fuyou_strategy.activations import ActivationSwapper
from fuyou_strategy.device import PAGE_SIZE, Upload, alloc_host_buffer, host_buffer_usage, late_copies, start_copy


def _swap_grads(tmp_path, activations):
    """A tiny GPT-2's gradients with every activation swapped under ``activations`` (host or ssd)."""
    model = tiny_causal_lm("gpt2")
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    tmp_path.mkdir()
    config = FuyouConfig(swap_dirs=[str(tmp_path)], activations=activations, activation_min_bytes=0,
                         chunk_size="8KiB", host_memory_budget="2MiB")
    swapper = ActivationSwapper(model, config)
    try:
        with swapper:
            model(input_ids=ids, labels=ids).loss.backward()
    finally:
        swapper.close()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _reference():
    model = tiny_causal_lm("gpt2")
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("activations", ["host", "ssd"])
def test_late_copies_catch_an_upload_that_does_not_wait_for_its_copy(tmp_path, monkeypatch, activations):
    """The mutation the mode exists for: `Upload.copy` without its event wait. With normal CPU copies
    it goes unnoticed (a CPU copy has landed when it returns); with late copies it is caught."""
    monkeypatch.setattr(device, "_late", None)  # normal copies here, also in CI's FUYOU_ASYNC_DEVICE pass
    reference = _reference()
    assert _equal(_swap_grads(tmp_path / "intact", activations), reference)
    with late_copies(max_delay_ms=4, min_delay_ms=2):  # the intact code waits, so it is exact here too
        assert _equal(_swap_grads(tmp_path / "intact-late", activations), reference)

    def copy_without_wait(self, offset, src):
        start_copy(self.tensor[offset : offset + src.numel()], src)  # the mutation: no .wait()

    monkeypatch.setattr(Upload, "copy", copy_without_wait)
    assert _equal(_swap_grads(tmp_path / "mutant", activations), reference), "normal CPU mode cannot see it"
    with late_copies(max_delay_ms=4, min_delay_ms=2):
        with pytest.raises(RuntimeError, match="before its copy landed"):
            _swap_grads(tmp_path / "mutant-late", activations)


def _trained_weights(tmp_path):
    """A tiny Llama's weights after 3 `FuyouAdamW` steps with clipping that bites (resident gradients)."""
    from fuyou_strategy import FuyouAdamW

    model = tiny_causal_lm("llama")
    tmp_path.mkdir()
    config = FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", host_memory_budget="2MiB")
    with FuyouAdamW(model.parameters(), lr=3e-3, max_grad_norm=0.5, config=config) as opt:
        for step in range(3):
            ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_late_copies_catch_an_update_that_reads_its_device_gradient_before_the_copy_landed(tmp_path, monkeypatch):
    """A gradient on an accelerator reaches the host's update through a staged copy (`Gradients.staged`, the
    first GPU run's fix); in the late-copy mode a CPU gradient takes the same path, so an update that skips
    the wait (the mutation: `Grad._landed` a no-op) reads the poisoned buffer, which no normal CPU run sees."""
    from fuyou_strategy.optim.gradients import Grad

    monkeypatch.setattr(device, "_late", None)  # normal copies here, also in CI's FUYOU_ASYNC_DEVICE pass
    reference = _trained_weights(tmp_path / "intact")
    with late_copies(max_delay_ms=4, min_delay_ms=2):
        assert _equal(_trained_weights(tmp_path / "intact-late"), reference)
    monkeypatch.setattr(Grad, "_landed", lambda self: None)
    assert _equal(_trained_weights(tmp_path / "mutant"), reference), "normal CPU mode cannot see it"
    with late_copies(max_delay_ms=4, min_delay_ms=2):
        mutant = _trained_weights(tmp_path / "mutant-late")
    # the poisoned copy (NaN) makes the global norm non-finite: those steps are skipped, the weights wrong
    assert not _equal(mutant, reference), "the update read the poisoned host copy"


def _exact_optimizer(tmp_path, **config):
    """A tiny Llama and an exact (``next_forward``) `FuyouAdamW` over it, clipping at 0.5, its small pool and swap
    folder in ``tmp_path`` (made here); ``config``: more `FuyouConfig` fields."""
    from fuyou_strategy import FuyouAdamW

    model = tiny_causal_lm("llama")
    tmp_path.mkdir()
    config = FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", host_memory_budget="2MiB",
                         optimizer_schedule="next_forward", **config)
    return model, FuyouAdamW(model.parameters(), lr=3e-3, max_grad_norm=0.5, config=config)


def _exact_steps(tmp_path, update_kernel, *, skip_at=None):
    """A tiny Llama's weights after 3 exact (``next_forward``) `FuyouAdamW` steps with clipping that bites, and
    the pool's lent bytes before each backward and after its step() (``skip_at``: the step whose gradients hold an
    inf, set in place after backward, skipped). Before the backward, not the step(): backward's hook starts the
    copies (`Gradients.copy_ahead`)."""
    model, opt = _exact_optimizer(tmp_path, update_kernel=update_kernel)
    lent = []
    with opt:
        for step in range(3):
            ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(step))
            before = opt.adam_state.store.pool.lent
            model(input_ids=ids, labels=ids).loss.backward()
            if step == skip_at:
                next(model.parameters()).grad[0, 0] = float("inf")
            opt.step()
            lent.append((before, opt.adam_state.store.pool.lent))
            opt.zero_grad()
        assert opt.stats.skips == (skip_at is not None) and opt.stats.clipped >= 1, opt.stats
    return {name: p.detach().clone() for name, p in model.named_parameters()}, lent


def _count_copies(monkeypatch):
    """A list that gets the elements of each gradient copy to a host pool buffer made from now on
    (`StreamedGradients.copy_out`; not one that found no room)."""
    from fuyou_strategy.optim.gradients import StreamedGradients

    copies = []
    real_copy_out = StreamedGradients.copy_out

    def copy_out(self, tensor, **kwargs):
        made = real_copy_out(self, tensor, **kwargs)
        copies.extend([tensor.numel()] if made is not None else [])
        return made

    monkeypatch.setattr(StreamedGradients, "copy_out", copy_out)
    return copies


@pytest.mark.parametrize("update_kernel", ["auto", "torch"])
def test_an_exact_step_copies_each_device_gradient_to_the_host_once_for_its_norm_and_its_update(tmp_path,
                                                                                                   monkeypatch,
                                                                                                   update_kernel):
    """At step() of the next_forward schedule a gradient on an accelerator that the host updates is copied to the
    host once (`Gradients.resident_norms`): its norm is taken from the copy, which is kept for its update
    (`at_step`); it was copied for each. In the late-copy mode a CPU gradient takes that path: the weights are the
    normal mode's bit for bit, clipping biting, with one copy per gradient a step, whichever takes the norms (the
    one pass's kernel, or torch's). A pool without room for every copy copies each twice, as before, with the same
    bits; a skipped step's copies all go back to the pool."""
    from fuyou_strategy.storage import HostBufferPool

    monkeypatch.setattr(device, "_late", None)  # normal copies here, also in CI's FUYOU_ASYNC_DEVICE pass
    reference, _ = _exact_steps(tmp_path / "normal", update_kernel)
    copies = _count_copies(monkeypatch)
    gradients = len(reference)
    with late_copies(max_delay_ms=4, min_delay_ms=2):
        once, _ = _exact_steps(tmp_path / "late", update_kernel)
    assert _equal(once, reference)
    assert len(copies) == 3 * gradients, f"{len(copies)} copies of {gradients} gradients in 3 steps"
    with late_copies(max_delay_ms=4, min_delay_ms=2):
        _skipped, lent = _exact_steps(tmp_path / "skip", update_kernel, skip_at=1)
    assert lent[1][1] == lent[1][0], "the skipped step's copies went back to the pool"
    copies.clear()
    monkeypatch.setattr(HostBufferPool, "try_acquire", lambda self, nbytes, keep_free=0: None)  # never room now
    with late_copies(max_delay_ms=4, min_delay_ms=2):
        twice, _ = _exact_steps(tmp_path / "full", update_kernel)
    assert _equal(twice, reference)
    assert len(copies) == 2 * 3 * gradients, "copied for its norm, then for its update"


def _exact_window(tmp_path, *, backwards=1, change=None, discard=False, room=True):
    """A tiny Llama's weights after 2 exact (``next_forward``) steps with clipping, each window ``backwards``
    backwards (no `no_update`: each backward may end it), then ``change(model)`` (in place on the gradients) or, with
    ``discard``, a `zero_grad` and one backward more before the second step; and the pool's lent bytes before the
    first backward, after the first backward (before its step) and after the first step. ``room=False``: a copy
    ahead must leave the whole pool free (none fits)."""
    model, opt = _exact_optimizer(tmp_path)
    lent = []
    with opt:
        pool = opt.adam_state.store.pool
        # a copy ahead holds its buffer until step(): it leaves the transfers' reserved share free, as the
        # optimizer's read-ahead does
        assert opt.gradients.ahead_keep_free == opt.adam_state.spare_from > 0
        if not room:
            opt.gradients.ahead_keep_free = pool.budget
        for step in range(2):
            for micro in range(backwards):
                if step == 0 and micro == 0:
                    lent.append(pool.lent)
                ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(10 * step + micro))
                model(input_ids=ids, labels=ids).loss.backward()
                if step == 0 and micro == 0:
                    lent.append(pool.lent)
            if change is not None:
                change(model)
            if discard and step == 0:
                opt.zero_grad()
                assert pool.lent == lent[0], "zero_grad gave the copies backward started back"
                ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(99))
                model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            if step == 0:
                lent.append(pool.lent)
            opt.zero_grad()
        assert opt.stats.clipped >= 1, opt.stats
    return {name: p.detach().clone() for name, p in model.named_parameters()}, lent


@pytest.mark.parametrize("case", ["plain", "accumulated", "changed", "discarded", "no-room"])
def test_an_exact_steps_gradients_are_copied_during_backward_and_one_changed_since_is_copied_again(tmp_path,
                                                                                                   monkeypatch, case):
    """Under ``next_forward`` backward's hook starts each device gradient's copy to the host
    (`Gradients.copy_ahead`), so that it runs beside the rest of backward, not at step(); in the late-copy mode a
    CPU gradient takes that path. The weights are the normal mode's bit for bit (which test_schedule checks against
    torch) when the window's gradients are accumulated over two backwards (the first's copies given back and made
    again), changed in place after backward (the copy no longer the gradient: made again at step()), or discarded
    by `zero_grad` between backward and step() (its copies given back); every copy goes back to the pool by the end
    of the step. A copy ahead leaves the transfers' reserved share of the pool free: where nothing fits beside it,
    none is made ahead and step() copies each gradient, as before."""
    monkeypatch.setattr(device, "_late", None)  # normal copies here, also in CI's FUYOU_ASYNC_DEVICE pass
    kw = {"plain": {}, "accumulated": {"backwards": 2}, "discarded": {"discard": True}, "no-room": {"room": False},
          "changed": {"change": lambda model: [p.grad.mul_(3.0) for p in model.parameters()]}}[case]
    reference, _ = _exact_window(tmp_path / "normal", **kw)
    copies = _count_copies(monkeypatch)
    with late_copies(max_delay_ms=4, min_delay_ms=2):
        weights, lent = _exact_window(tmp_path / "late", **kw)
    assert _equal(weights, reference)
    gradients = len(reference)
    if case == "no-room":
        assert lent[1] == lent[0], "no copy ahead where none fits beside the reserved share"
    else:
        assert lent[1] > lent[0], "the first backward started its gradients' copies"
    assert lent[2] == lent[0], "the step gave every copy back"
    made = {"plain": 2, "accumulated": 2 * 2, "changed": 2 * 2, "discarded": 3, "no-room": 2}[case] * gradients
    assert len(copies) == made, f"{len(copies)} copies of {gradients} gradients"


def test_a_late_copy_poisons_its_destination_reads_its_source_when_it_runs_and_lands_on_wait():
    src = torch.arange(1024, dtype=torch.float32)
    dst = torch.zeros(1024)
    with late_copies(max_delay_ms=30, min_delay_ms=20):
        copy = start_copy(dst, src)
        assert torch.isnan(dst).all(), "poisoned until it lands"
        src.add_(1)  # reused before the wait: the copy takes what the source holds when it runs
        copy.wait(timeout=5)
        assert torch.equal(dst, torch.arange(1024, dtype=torch.float32) + 1)
        ints = torch.zeros(8, dtype=torch.int64)
        start_copy(ints, torch.ones(8, dtype=torch.int64))
        assert (ints == -1).all()
        # the block's copies are waited for by the block's own code, or by leaving it (the engine stops in order)


def test_a_tensor_handed_to_compute_before_its_copy_landed_is_named_and_after_it_is_not():
    upload = Upload(4096, torch.device("cpu"))
    with late_copies(max_delay_ms=30, min_delay_ms=20):
        copy = start_copy(upload.tensor[:1024], torch.ones(1024, dtype=torch.uint8))
        with pytest.raises(RuntimeError, match="an upload's tensor was handed to compute before its copy landed"):
            upload.result()
        copy.wait()
        assert upload.result()[:1024].eq(1).all()


def test_a_failed_late_copy_raises_to_its_waiter_and_a_dead_engine_is_not_waited_for_forever():
    with late_copies(max_delay_ms=1):
        bad = start_copy(torch.zeros(4), torch.zeros(5))  # sizes that cannot be copied
        with pytest.raises(RuntimeError):
            bad.wait(timeout=5)
        device._late.stop()  # the engine is gone with a copy still to come
        orphan = start_copy(torch.zeros(4), torch.ones(4))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="engine thread died"):
            orphan.wait(timeout=30)
        assert time.monotonic() - t0 < 5


@pytest.mark.slow
def test_the_environment_variable_turns_the_mode_on_and_a_bad_value_names_itself():
    code = "from fuyou_strategy import device; print(device.late_copies_enabled())"
    env = dict(os.environ, FUYOU_ASYNC_DEVICE="1.5")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr
    env["FUYOU_ASYNC_DEVICE"] = "fast"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "FUYOU_ASYNC_DEVICE: got 'fast'" in out.stderr


class _Recorder:
    """Stands in for cudaHostRegister / cudaHostUnregister."""

    def __init__(self):
        self.registered = {}
        self.unregistered = []

    def register(self, ptr, nbytes):
        self.registered[ptr] = nbytes

    def unregister(self, ptr):
        self.unregistered.append((ptr, ctypes.string_at(ptr, 4)))  # still mapped: the bytes are readable


def test_pinned_host_buffers_pin_exactly_their_page_rounded_size_and_count_it_until_freed(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(device, "_registrar", recorder)
    gc.collect()
    before = host_buffer_usage().live
    nbytes = 16 * 2**20 + 1  # a pool chunk and a byte: the caching host allocator would pin 32 MiB
    buf = alloc_host_buffer(nbytes)
    assert buf.numel() == nbytes and buf.data_ptr() % PAGE_SIZE == 0
    assert recorder.registered == {buf.data_ptr(): 16 * 2**20 + PAGE_SIZE}, "pinned in place, page-rounded"
    assert host_buffer_usage().live - before == 16 * 2**20 + PAGE_SIZE, "the pinned bytes count in the budget"
    ptr = buf.data_ptr()
    buf[:4].fill_(0x5A)
    view = buf[10:20]
    del buf
    gc.collect()
    assert recorder.unregistered == [], "a view keeps the buffer (and its pinning) alive"
    del view
    gc.collect()
    assert recorder.unregistered == [(ptr, b"ZZZZ")], "unpinned before the memory is released"
    assert host_buffer_usage().live == before


# -- intra-op threads ------------------------------------------------------------------------------------------
def _in_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and out, "the thread did not finish"
    return out[0]


def test_intra_op_threads_change_for_the_calling_thread_alone():
    default = torch.get_num_threads()
    torch.ones(1 << 16).sum()  # this thread's own set-up done, as in training

    def worker():
        had = device.use_intra_op_threads(1)
        torch.ones(1 << 20).mul_(2)  # a parallel op: torch must not set the count again on it
        return had, torch.get_num_threads()

    assert _in_thread(worker) == (1, 1)
    assert torch.get_num_threads() == default  # the caller's threads, untouched
    assert _in_thread(torch.get_num_threads) == default  # and the default of threads that start later


def test_computes_on_host_follows_the_parameters():
    assert device.computes_on_host([torch.zeros(2), torch.zeros(2)])
    on_meta = device.computes_on_host([torch.zeros(2, device="meta")])
    assert on_meta == (device.accelerator_type() is None)  # a meta model is materialised on the accelerator
    assert 1 <= device.usable_cores() <= (os.cpu_count() or 1)
