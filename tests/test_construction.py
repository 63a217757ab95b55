"""A construction that fails at any step raises its own error and leaves nothing behind.

Each case injects one failure at one step of building `FuyouAdamW` (store, run directories, I/O
engine, swap files, host pool, state entries, the first state writes, the worker, the hooks) and
checks that the caller gets the injected exception itself — not an ``AttributeError`` from a
``close()`` run on a half-built object, nor an error of the clean-up — and that no run directory,
open swap file, fuyou thread or hook outlives it. The checks run while the exception (and through
its traceback the half-built object) is still alive: what the construction made must be gone
already, not left to a finalizer at collection.
"""

import errno
import gc
import glob
import inspect
import os
import threading
import time

import pytest
import torch

import fuyou_strategy.optim.adamw as adamw_module
import fuyou_strategy.storage.aio as aio
import fuyou_strategy.storage.store as store_module
from fuyou_strategy import FuyouAdamW, FuyouConfig
from fuyou_strategy.optim.pipeline import ChunkPipeline, PipelineError
from fuyou_strategy.storage import IOEngine, StorageIOError, StorageSpaceError


class Injected(RuntimeError):
    """The failure a test injects where no real error is at hand."""


def fail_at(monkeypatch, owner, name, error, call=1, after=False):
    """Make ``owner.name`` raise ``error`` at its ``call``-th call (``after=True``: once the real one ran)."""
    real = getattr(owner, name)
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] != call:
            return real(*args, **kwargs)
        if after:
            real(*args, **kwargs)
        raise error

    static = inspect.isclass(owner) and isinstance(inspect.getattr_static(owner, name), staticmethod)
    monkeypatch.setattr(owner, name, staticmethod(failing) if static else failing)


def eio(step):
    return OSError(errno.EIO, f"injected EIO at {step}")


def drive_fails(mp):
    """Every write to a swap file from now on gets EIO from the kernel (the documented injection point)."""
    def pwritev(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    mp.setattr(aio, "_pwritev", pwritev)


EIO_MESSAGE = (r"write of \d+ bytes at offset \d+ in .*data\.bin failed: Input/output error; the drive reported an "
               r"I/O error")


def fuyou_threads():
    return {t for t in threading.enumerate() if t.name.startswith("fuyou")}


def open_files_under(root):
    """This process's open file descriptors on files under ``root``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root)):
            found.append(target)
    return found


def assert_nothing_left(root, threads_before, excinfo):
    """No run directory or open file under ``root``, no fuyou thread started since ``threads_before``;
    ``excinfo`` is held on purpose: the half-built object stays alive, so its finalizer cannot have
    done the work. A thread being joined gets a few seconds."""
    assert excinfo.value is not None
    deadline = time.monotonic() + 5
    while True:
        gc.collect()
        dirs = glob.glob(os.path.join(str(root), "**", "fuyou-run-*"), recursive=True)
        files = open_files_under(root)
        threads = sorted(t.name for t in fuyou_threads() - threads_before if t.is_alive())
        if not (dirs or files or threads) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not dirs, f"run directories left behind: {dirs}"
    assert not files, f"swap files left open: {files}"
    assert not threads, f"threads left running: {threads}"


def swap_dirs(tmp_path, n):
    dirs = [tmp_path / f"ssd{i}" for i in range(n)]
    for d in dirs:
        d.mkdir()
    return [str(d) for d in dirs]


def assert_no_grad_hooks(params):
    for p in params:
        assert not p._post_accumulate_grad_hooks, "a gradient hook of the failed optimizer is left on a parameter"


# -- FuyouAdamW ------------------------------------------------------------------------------------------------
def _optimizer_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))


# (step, inject(monkeypatch), expected type, expected message)
OPTIMIZER_STEPS = {
    "run directory in the second swap dir": (
        lambda mp: fail_at(mp, store_module, "make_run_dir", eio("the second run directory"), call=2),
        OSError, "injected EIO at the second run directory"),
    "O_DIRECT probe of the second swap dir": (
        lambda mp: fail_at(mp, IOEngine, "_probe_direct",
                           StorageIOError(errno.EIO, "injected EIO at the second probe"), call=2),
        StorageIOError, "injected EIO at the second probe"),
    "swap file in the second swap dir": (
        lambda mp: fail_at(mp, IOEngine, "open", eio("the second swap file"), call=2),
        OSError, "injected EIO at the second swap file"),
    "host buffer pool": (
        lambda mp: fail_at(mp, store_module, "HostBufferPool", Injected("the host pool could not be made")),
        Injected, "the host pool could not be made"),
    "chunk pipeline worker": (
        lambda mp: fail_at(mp, adamw_module, "ChunkPipeline", Injected("can't start new thread")),
        Injected, "can't start new thread"),
    "gradient hook on the second parameter": (
        lambda mp: fail_at(mp, torch.Tensor, "register_post_accumulate_grad_hook",
                           Injected("the second hook could not be registered"), call=2),
        Injected, "the second hook could not be registered"),
    "first state write gets EIO": (drive_fails, StorageIOError, EIO_MESSAGE),
    "state does not fit the drive (fallocate)": (
        lambda mp: fail_at(mp, os, "posix_fallocate", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), call=3),
        StorageSpaceError, r"entry 'adamw\.\d' needs .* more in .* but only .* is free \(No space left on device\)"),
}


@pytest.mark.parametrize("step", list(OPTIMIZER_STEPS))
def test_a_failed_optimizer_construction_raises_its_own_error_and_leaves_nothing(tmp_path, monkeypatch, step):
    inject, kind, message = OPTIMIZER_STEPS[step]
    model = _optimizer_model()
    cfg = FuyouConfig(swap_dirs=swap_dirs(tmp_path, 2), chunk_size="8KiB", io_block_size="4KiB",
                      host_memory_budget="256KiB", io_threads=2)
    before = fuyou_threads()
    inject(monkeypatch)
    with pytest.raises(kind, match=message) as excinfo:
        FuyouAdamW(model.parameters(), config=cfg)
    monkeypatch.undo()
    assert_nothing_left(tmp_path, before, excinfo)
    assert_no_grad_hooks(model.parameters())


def test_optimizer_state_that_does_not_fit_the_free_space_says_what_it_needs(tmp_path, monkeypatch):
    """Without preallocation the store compares with the free space up front (a 64 MiB volume, say)."""
    real = store_module.shutil.disk_usage

    def nearly_full(path):
        usage = real(path)
        return usage._replace(total=64 * 2**20, used=64 * 2**20 - 8192, free=8192)

    cfg = FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", host_memory_budget="256KiB", preallocate=False)
    before = fuyou_threads()
    monkeypatch.setattr(store_module.shutil, "disk_usage", nearly_full)
    with pytest.raises(StorageSpaceError, match=r"entry 'adamw\.0' needs 96\.00 KiB more in .* but only 8\.00 KiB "
                                                r"is free; free space there") as excinfo:
        FuyouAdamW(_optimizer_model().parameters(), config=cfg)
    monkeypatch.undo()
    assert_nothing_left(tmp_path, before, excinfo)


def test_a_failing_clean_up_never_replaces_the_construction_error(tmp_path, monkeypatch, caplog):
    """The first state write gets EIO, and then the worker does not stop either: the caller gets the
    write's error (the worker's is noted on it and logged), and the swap files still go."""
    model = _optimizer_model()
    cfg = FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", host_memory_budget="256KiB")
    before = fuyou_threads()
    drive_fails(monkeypatch)
    fail_at(monkeypatch, ChunkPipeline, "close", PipelineError("fuyou-adamw: the worker did not stop"), after=True)
    with pytest.raises(StorageIOError, match=EIO_MESSAGE) as excinfo:
        FuyouAdamW(model.parameters(), config=cfg)
    monkeypatch.undo()
    assert "the worker did not stop" in "\n".join(getattr(excinfo.value, "__notes__", []))
    assert "the worker did not stop" in caplog.text
    assert_nothing_left(tmp_path, before, excinfo)
    assert_no_grad_hooks(model.parameters())
