"""A construction that fails at any step raises its own error and leaves nothing behind.

Each case injects one failure at one step of building `FuyouAdamW` (store, run directories, I/O
engine, swap files, host pool, state entries, the first state writes, the worker, the hooks) or
`FuyouEngine` (the optimizer's model hooks, a pinned plan, the weight streamer, materialisation,
the activation swapper, the warm-up profiler), and checks that the caller gets the injected
exception itself — not an ``AttributeError`` from a ``close()`` run on a half-built object, nor an
error of the clean-up — and that no run directory, open swap file, fuyou thread or hook outlives it.
The checks run while the exception (and through its traceback the half-built object) is still
alive: what the construction made must be gone already, not left to a finalizer at collection.
"""

import errno
import gc
import glob
import inspect
import os
import re
import threading
import time

import pytest
import torch

import fuyou_strategy.engine as engine_module
import fuyou_strategy.optim.state as state_module
import fuyou_strategy.storage.aio as aio
import fuyou_strategy.storage.store as store_module
from conftest import tiny_causal_lm
from fuyou_strategy import FuyouAdamW, FuyouConfig, FuyouEngine
from fuyou_strategy.activations import ActivationSwapper
from fuyou_strategy.optim.control import OptimizerControl
from fuyou_strategy.optim.pipeline import ChunkPipeline, PipelineError
from fuyou_strategy.params import WeightStreamer
from fuyou_strategy.planner import Plan, PlanError
from fuyou_strategy.planner.profile import WarmupProfiler
from fuyou_strategy.storage import IOEngine, StorageIOError, StorageSpaceError


class Injected(RuntimeError):
    """The failure a test injects where no real error is at hand."""


def fail_at(monkeypatch, owner, name, error, call=1, after=False):
    """Make ``owner.name`` raise ``error`` at its ``call``-th call (``after=True``: once the real one ran)."""
    real = getattr(owner, name)
    calls = [0]

    def patched(*args, **kwargs):
        calls[0] += 1
        if calls[0] != call:
            return real(*args, **kwargs)
        if after:
            real(*args, **kwargs)
        raise error

    static = inspect.isclass(owner) and isinstance(inspect.getattr_static(owner, name), staticmethod)
    monkeypatch.setattr(owner, name, staticmethod(patched) if static else patched)


def failing(owner, name, error, call=1):
    """A step that fails when ``owner.name`` raises ``error`` at its ``call``-th call: (inject, type, match)."""
    return (lambda mp, *_config: fail_at(mp, owner, name, error, call=call)), type(error), re.escape(str(error))


def eio(step):
    return OSError(errno.EIO, f"injected EIO at {step}")


def drive_fails(mp, *_config):
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


# step -> (inject(monkeypatch), the error's type, a pattern its message matches)
OPTIMIZER_STEPS = {
    "run directory in the second swap dir": failing(store_module, "make_run_dir", eio("the second run directory"),
                                                    call=2),
    "O_DIRECT probe of the second swap dir": failing(
        IOEngine, "_probe_direct", StorageIOError(errno.EIO, "injected EIO at the second probe"), call=2),
    "swap file in the second swap dir": failing(IOEngine, "open", eio("the second swap file"), call=2),
    "host buffer pool": failing(store_module, "HostBufferPool", Injected("the host pool could not be made")),
    "chunk pipeline worker": failing(state_module, "ChunkPipeline", Injected("can't start new thread")),
    "gradient hook on the second parameter": failing(
        torch.Tensor, "register_post_accumulate_grad_hook", Injected("the second hook could not be registered"), call=2),
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

    cfg = FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", host_memory_budget="256KiB", preallocate=False,
                      host_state=0)
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


# -- FuyouEngine -------------------------------------------------------------------------------------------------
def _plan_file(tmp_path):
    """A valid plan file, for a config that pins it (the engine reads it again)."""
    path = tmp_path / "plan.json"
    Plan(policies=["keep", "ssd"], act_bytes=[0, 0], reasons=["given"] * 2, predicted_step_s=1.0, device_peak=0,
         host_peak=0, ssd_peak=0, budgets={}).save(path)
    return str(path)


def _remove_plan_file(mp, cfg):
    os.remove(cfg.plan)  # the config checked it; the engine finds it gone: the real PlanError


# step -> (inject(monkeypatch, config), the error's type, a pattern its message matches)
ENGINE_STEPS = {
    "the optimizer's first state write gets EIO": (drive_fails, StorageIOError, EIO_MESSAGE),
    "the optimizer's model hooks": failing(FuyouAdamW, "attach_model", Injected("attach_model failed")),
    "a pinned plan that is gone": (_remove_plan_file, PlanError, "does not exist"),
    "weight streamer": failing(engine_module, "WeightStreamer", Injected("the streamer could not be made")),
    "the second block's tier copy": failing(WeightStreamer, "_to_tier", eio("the second block's tier copy"), call=2),
    "a tier copy write gets EIO": (lambda mp, cfg: _drive_fails_once_installing(mp), StorageIOError, EIO_MESSAGE),
    "the optimizer takes the streamed weights": failing(OptimizerControl, "attach_weights", Injected("attach_weights failed")),
    "materialising the masters": failing(OptimizerControl, "initialise_materialized", Injected("initialise failed")),
    "activation swapper": failing(engine_module, "ActivationSwapper", Injected("the swapper could not be made")),
    "the second block's activation wrapper": failing(ActivationSwapper, "_wrap", Injected("the second wrapper failed"),
                                                     call=2),
    "warm-up profiler": failing(engine_module, "WarmupProfiler", Injected("the profiler could not be made")),
    "the warm-up profiler's second block": failing(WarmupProfiler, "_post", Injected("the second profiling hook failed"),
                                                   call=2),
    "the engine's step hooks": failing(FuyouAdamW, "register_step_pre_hook", Injected("step hook failed")),
}
# The config of a step, where it is not the default of `fail_building_an_engine`.
ENGINE_CONFIG = {"a pinned plan that is gone": {"plan": True}, "warm-up profiler": {"activations": "auto"},
                 "the warm-up profiler's second block": {"activations": "auto"}}


def _drive_fails_once_installing(mp):
    """EIO on every write from the moment the streamer starts copying weights to their tier (the
    optimizer's state is written by then)."""
    real = WeightStreamer.install

    def install(self):
        drive_fails(mp)
        return real(self)

    mp.setattr(WeightStreamer, "install", install)


def _hooks(model):
    """Every hook and instance attribute the engine's parts put on modules and parameters."""
    out = []
    for name, module in model.named_modules():
        for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_state_dict_hooks",
                     "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"):
            out += [(name, kind, len(getattr(module, kind)))]
        out.append((name, "forward", "forward" in vars(module)))
    for name, p in model.named_parameters():
        out.append((name, "grad hooks", len(p._post_accumulate_grad_hooks or {})))
    return out


def fail_building_an_engine(tmp_path, monkeypatch, inject, kind, message, **overrides):
    """Build a FuyouEngine (weights and activations on SSD) with ``inject`` applied, expect ``kind``
    matching ``message``, and check that the model is as it was before and nothing is left behind."""
    swap = tmp_path / "swap"
    swap.mkdir()
    values = dict(swap_dirs=[str(swap)], weights="ssd", activations="ssd", weight_prefetch_blocks=1,
                  chunk_size="8KiB", host_memory_budget="4MiB", activation_min_bytes=0,
                  optimizer_schedule="next_forward")
    if overrides.pop("plan", False):
        values.update(plan=_plan_file(tmp_path), weights="device", activations="keep")
    values.update(overrides)
    cfg = FuyouConfig(**values)
    model = tiny_causal_lm("gpt2")
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    hooks = _hooks(model)
    before = fuyou_threads()
    inject(monkeypatch, cfg)
    with pytest.raises(kind, match=message) as excinfo:
        FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg)
    monkeypatch.undo()
    assert_nothing_left(swap, before, excinfo)
    assert _hooks(model) == hooks, "every hook and wrapper is off the model again"
    for name, p in model.named_parameters():  # streamed weights came back from their tier copies, bitwise
        assert torch.equal(p.detach(), weights[name]), name
    # The model trains with plain torch.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert all(p.grad is not None for p in model.parameters())
    return excinfo


@pytest.mark.parametrize("step", list(ENGINE_STEPS))
def test_a_failed_engine_construction_raises_its_own_error_and_leaves_the_model_as_it_was(tmp_path, monkeypatch,
                                                                                           step):
    inject, kind, message = ENGINE_STEPS[step]
    fail_building_an_engine(tmp_path, monkeypatch, inject, kind, message, **ENGINE_CONFIG.get(step, {}))


def test_a_failing_engine_clean_up_is_noted_on_the_original_error(tmp_path, monkeypatch, caplog):
    """Materialising fails, and then the streamer cannot give the weights back either (it raises once it
    did): the caller gets the first error, the second is noted on it and logged, and the optimizer is
    closed all the same."""
    def inject(mp, cfg):
        fail_at(mp, OptimizerControl, "initialise_materialized", Injected("initialise failed"))
        fail_at(mp, WeightStreamer, "uninstall", Injected("uninstall failed too"), after=True)

    excinfo = fail_building_an_engine(tmp_path, monkeypatch, inject, Injected, "^initialise failed")
    assert "uninstall failed too" in "\n".join(excinfo.value.__notes__)
    assert "uninstall failed too" in caplog.text


# -- the adapters: a failure right after the engine is built ---------------------------------------------------
def _lightning_fit(tmp_path):
    from test_lightning import fit

    from fuyou_strategy import FuyouStrategy

    fit(FuyouStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB"), steps=1)


def _hf_train(tmp_path):
    from test_hf import train

    from fuyou_strategy import FuyouCallback

    train(tmp_path, FuyouCallback(swap_dirs=[str(tmp_path)], chunk_size="8KiB"), steps=1)


@pytest.mark.parametrize("run,step", [(_lightning_fit, "rebind_schedulers"), (_hf_train, "expect_steps")],
                         ids=["lightning setup", "hf train begin"])
def test_an_adapter_failing_after_the_engine_is_built_closes_it_and_raises_its_own_error(tmp_path, monkeypatch,
                                                                                       run, step):
    fail_at(monkeypatch, FuyouEngine, step, eio(step))
    fail_at(monkeypatch, FuyouEngine, "close", Injected("closing failed too"), after=True)
    threads_before = fuyou_threads()
    with pytest.raises(OSError, match=f"injected EIO at {step}") as excinfo:
        run(tmp_path)
    assert any("closing failed too" in note for note in excinfo.value.__notes__), "the clean-up's error is noted"
    assert_nothing_left(tmp_path, threads_before, excinfo)
