import contextlib
import gc
import glob
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest


def _own_dir(variable: str, prefix: str, *, keep_users: bool = True) -> str | None:
    """A fresh folder in ``variable`` for this test process, unless a process of the same test worker set it (a
    spawned rank, a kill server) or, with ``keep_users``, the user did: returns the folder this process made, to
    remove at the end, else ``None``. The folder is made in the system temp folder (``TMPDIR``'s, if set).

    Each pytest-xdist worker gets its own (``PYTEST_XDIST_WORKER``, inherited by what the worker starts), so
    that two workers never see each other's files: the leftover check below and the drive cache's tests count
    what is in these folders."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    owner = os.environ.get(f"{variable}_OWNER", worker if keep_users else None)
    if os.environ.get(variable) and owner == worker:
        return None
    made = tempfile.mkdtemp(prefix=f"{prefix}{worker}-")
    os.environ[variable], os.environ[f"{variable}_OWNER"] = made, worker
    return made


# The planner's SSD probe and `fuyou doctor` remember what they measured (`fuyou_strategy.drives`): the tests'
# measurements of their temporary folders go to a folder of this session, not the user's cache (it had 431 of
# them). Set before fuyou_strategy is imported, which reads it; spawned ranks and the kill server inherit it.
_OWN_CACHE = _own_dir("FUYOU_CACHE_DIR", "fuyou-test-cache-")
# Under pytest-xdist each worker has its own system temp folder too: default swap folders (`fuyou-swap-*`) and
# Lightning's temporary .ckpt files of one worker are not the other's leftovers.
_OWN_TMP = _own_dir("TMPDIR", "fuyou-test-tmp-", keep_users=False) if "PYTEST_XDIST_WORKER" in os.environ else None
tempfile.tempdir = None  # gettempdir() reads TMPDIR again

# OpenMP threads that wait for work sleep instead of spinning (libgomp reads this when torch loads it, below; every
# process the tests start inherits it). It changes no result, only how idle threads wait: with two test workers on
# two cores, each worker's spinning threads take the cores the other one computes on (test_schedule.py twice at
# once: 57-108 s spinning, 27 s sleeping).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A rank or a child process that dies of a native abort (CI once saw a gloo rank end in "terminate called without
# an active exception", with no Python traceback) prints every thread's Python stack first: spawned ranks and
# subprocesses inherit the variable, and Python enables `faulthandler` at start-up from it.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

from fuyou_strategy import FuyouConfig  # noqa: E402


def _fuyou_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("fuyou"))


def _leftover_dirs(roots: list[str]) -> list[str]:
    found = []
    for root in roots:
        found += glob.glob(os.path.join(root, "**", "fuyou-run-*"), recursive=True)
        found += glob.glob(os.path.join(root, "**", "*.fuyou.tmp-*"), recursive=True)
    return sorted({os.path.realpath(f) for f in found})  # pytest's *current symlinks name some twice


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind(tmp_path_factory):
    """After the whole suite: no fuyou run directory or checkpoint temp folder in any swap
    directory the tests used (pytest's temp tree, and the default ``fuyou-swap-*`` folders in the
    system temp dir), and no fuyou worker or I/O thread still alive."""
    temp_swaps_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "fuyou-swap-*")))
    yield

    def leftovers() -> list[str]:
        new_temp_swaps = set(glob.glob(os.path.join(tempfile.gettempdir(), "fuyou-swap-*"))) - temp_swaps_before
        return _leftover_dirs([str(tmp_path_factory.getbasetemp())]) + sorted(new_temp_swaps)

    # Objects the tests dropped without close() are released by their finalizers once collected;
    # a worker thread may still be finishing its last job. Give that a few seconds, no more.
    deadline = time.monotonic() + 10
    while True:
        gc.collect()
        left, threads = leftovers(), _fuyou_threads()
        if not (left or threads) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"the test session left fuyou files behind: {left[:20]}"
    assert not threads, f"the test session left fuyou threads running: {threads}"


def kill_leaving_a_zombie(process, timeout=30):
    """SIGKILL the `subprocess.Popen` ``process`` and wait until it is a zombie: dead, not reaped yet (as a
    killed rank whose launcher still lives). The caller reaps it (``process.wait()``)."""
    process.kill()
    deadline = time.monotonic() + timeout
    while _proc_state(process.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _proc_state(process.pid) == "Z", "killed and not reaped: a zombie"


def _proc_state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def small_config(tmp_path):
    """A config with small chunks so tiny tensors still span several chunks."""
    return FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", io_block_size="4KiB",
                       host_memory_budget="256KiB", io_threads=3)


def tiny_causal_lm(family: str, seed: int = 0, dtype=None):
    """A randomly initialised GPT-2, Llama or Qwen2 of a few thousand parameters, dropout off."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=101, n_positions=32,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg)
    elif family == "llama":
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=101, max_position_embeddings=32)
        model = LlamaForCausalLM(cfg)
    elif family == "qwen2":
        cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=101, max_position_embeddings=32)
        model = Qwen2ForCausalLM(cfg)
    else:
        raise ValueError(family)
    if dtype is not None:
        model = model.to(dtype)
    return model


def decay_groups(model, weight_decay=0.1):
    """The usual split: no weight decay for biases and norm weights."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# -- killing a process between two steps of a save ----------------------------------------------------------
# What is visible under a name changes only through these (pathlib and shutil.rmtree call them too); files
# are written, and unlinked by rmtree, inside folders made or renamed under a temporary name.
_FS_CHANGES = ("mkdir", "rename", "replace", "rmdir")


class FsKiller:
    """SIGKILL this process right before its k-th directory change (mkdir, rename, replace, rmdir) while
    armed; with ``files``, opening a file to write counts too (``open`` for writing, ``os.open`` with
    ``O_CREAT``): the Hugging Face Trainer writes its checkpoint files in place. Every k gives a kill
    between another two steps of what happens on disk while armed."""

    def __init__(self, k, *, files=False):
        self.k, self.seen, self.files, self._originals = k, 0, files, {}

    def _counted(self, original, counts=lambda *args, **kwargs: True):
        def change(*args, **kwargs):
            if counts(*args, **kwargs):
                self.seen += 1
                if self.seen == self.k:
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)
        return change

    def arm(self):
        import builtins

        targets = [(os, name, None) for name in _FS_CHANGES]
        if self.files:
            targets += [(os, "open", lambda path, flags, *a, **kw: bool(flags & os.O_CREAT)),
                        (builtins, "open", lambda file, mode="r", *a, **kw: isinstance(file, (str, os.PathLike))
                         and any(c in mode for c in "wxa+"))]
        for module, name, counts in targets:
            original = getattr(module, name)
            self._originals[(module, name)] = original
            setattr(module, name, self._counted(original, counts or (lambda *a, **kw: True)))

    def disarm(self):
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        self._originals.clear()


@contextlib.contextmanager
def killed_before_fs_change(k, *, files=False):
    """SIGKILL this process right before its k-th directory change (mkdir, rename, replace, rmdir) inside
    the block: every k gives a kill between another two steps of what the block does on disk (`FsKiller`)."""
    killer = FsKiller(k, files=files)
    killer.arm()
    try:
        yield
    finally:
        killer.disarm()


def warm_up_first_calls():
    """Run the tests' tiny models once, forward and backward, on one thread, so that no test, and no process the
    kill server forks, is a process's first call of these ops.

    Why: a process's first forward of the tiny GPT-2 sometimes takes another code path in a library below
    fuyou. ``h[0].mlp`` then returns other bits from the same input and weights, and the whole run ends with
    other weights. Plain Lightning (``strategy="auto"``) does it too, and the odd runs agree with each other
    bitwise. ``benchmarks/determinism_stress.py`` shows it: 5 odd runs in 1,560 forked runs without this
    warm-up, 0 in 800 with it (at 0.32%, 0 in 800 has a 0.077 chance: good evidence, not proof). Bitwise
    tests that compare two processes (the kill-and-resume tests) failed on it. One thread: no OpenMP team
    exists before the kill server forks.
    The global RNG is left as it was."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            for family in ("gpt2", "llama", "qwen2"):
                ids = torch.arange(32).remainder(101).view(2, 16)
                tiny_causal_lm(family)(input_ids=ids, labels=ids).loss.backward()
    finally:
        torch.set_num_threads(threads)


# A rank that torch.multiprocessing starts (the tests' mp.spawn, Lightning's and Fabric's spawn launchers) is a
# fresh interpreter too: it imports this module while it unpickles its function, and warms up here, so that its
# first training forward is not its process's first call either. Without it, CI failed once on a two-rank
# bitwise test (a rank's gradient norm 1e-6 off torch's; 4cd6c32): the odd first call, on one rank.
if multiprocessing.parent_process() is not None:
    warm_up_first_calls()


# One fresh interpreter imports the test module once, warms up (`warm_up_first_calls`, on one thread), then
# forks processes that each run scenario(root, k) and die at their k-th change, four at a time (forking happens
# before any other thread runs, so it is safe).
_KILL_SERVER = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
scenario = getattr(__import__(sys.argv[2]), sys.argv[3])
__import__("conftest").warm_up_first_calls()
for first in range(1, 100, 4):
    pids = {}
    for k in range(first, first + 4):
        pids[k] = os.fork()
        if pids[k] == 0:
            try:
                scenario(os.path.join(sys.argv[4], str(k)), k)
            except BaseException:
                import traceback
                traceback.print_exc()
                os._exit(1)
            os._exit(0)  # quick; the scenario closes what it opened
    ran_through = []
    for k, pid in pids.items():
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if status != -signal.SIGKILL:
            assert status == 0, f"scenario {k} failed"
            ran_through.append(k)
    if ran_through:
        print(min(ran_through))
        break
"""


def kill_at_every_step(tmp_path, module, scenario):
    """Run ``module.scenario(root, k)`` for k = 1, 2, ... in a process killed before the k-th file-system
    change its `killed_before_fs_change(k)` block makes, until one runs through; return the killed roots."""
    killed = tmp_path / "killed"
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))  # Lightning writes a .ckpt in the temp dir first
    out = subprocess.run([sys.executable, "-c", _KILL_SERVER, str(Path(__file__).parent), module, scenario, str(killed)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return [killed / str(k) for k in range(1, int(out.stdout.split()[-1]))]


@pytest.fixture(scope="session")
def compute_device():
    """The device the device-dependent tests (tests/test_on_device.py) compute on: ``FUYOU_TEST_DEVICE``
    (``cpu`` by default; ``cuda`` on a GPU machine, as benchmarks/gpu_check.py sets it)."""
    import torch
    name = os.environ.get("FUYOU_TEST_DEVICE", "cpu")
    if name not in ("cpu", "cuda"):
        pytest.fail(f"FUYOU_TEST_DEVICE: got {name!r}; use cpu or cuda")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.fail("FUYOU_TEST_DEVICE=cuda, but torch sees no CUDA device (a CPU build of torch, or no driver)")
    return torch.device(name)


# The suites that move tensors between the device and the host: each of their tests runs twice, with copies as
# they are (``[now]``) and with every copy landing late (``[late]``, marker ``late_copies``: the late-copy test
# mode, set by `copies` below, with FUYOU_ASYNC_DEVICE set for the processes the test starts), where
# a missing wait fails (docs/gpu.md). The optimizer, activation swapping, weight streaming, schedules and the
# device module; data parallel (test_distributed.py) passed in the mode too but is left out (its ranks make it
# the slowest). A run with FUYOU_ASYNC_DEVICE already set runs them once, in that mode.
DEVICE_SUITES = {"test_device.py", "test_on_device.py", "test_optimizer.py", "test_schedule.py", "test_pipeline.py",
                 "test_activations.py", "test_weights.py", "test_weights_trainable.py"}
LATE_COPY_MS = "2"  # the largest delay of a late copy, in milliseconds (FUYOU_ASYNC_DEVICE's value)


def pytest_generate_tests(metafunc):
    if metafunc.definition.path.name in DEVICE_SUITES and not os.environ.get("FUYOU_ASYNC_DEVICE"):
        metafunc.parametrize("copies", ["now", "late"], indirect=True)


# Autouse, so that pytest keeps it in every test's fixtures: a fixture a parametrization alone names (inserted into
# ``metafunc.fixturenames``) is pruned from a parametrized test's fixtures, and its ``[late]`` variant then ran
# exactly as ``[now]`` (from 2026-11-29 to 2026-12-06).
@pytest.fixture(autouse=True)
def copies(request, monkeypatch):
    """The device suites' copy mode for one test: ``now`` as they are, ``late`` in the late-copy test mode; any
    other test as it is."""
    if getattr(request, "param", "now") == "now":
        yield
        return
    from fuyou_strategy import device

    monkeypatch.setenv("FUYOU_ASYNC_DEVICE", LATE_COPY_MS)
    # Through monkeypatch, not `late_copies`' block: a test that sets the mode itself (``monkeypatch.setattr(device,
    # "_late", None)``, test_device.py) is undone first, and this after it, so the mode before the test comes back.
    engine = device._LateCopies(0.0, float(LATE_COPY_MS) / 1000, seed=None)
    monkeypatch.setattr(device, "_late", engine)
    try:
        yield
    finally:
        engine.stop()


def pytest_unconfigure(config):
    import ranks

    ranks.stop()
    for made in (_OWN_CACHE, _OWN_TMP):  # this process made it (a spawned rank inherits the variable and leaves it)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def pytest_configure(config):
    warm_up_first_calls()  # before any test: no test is this process's first call (see the function)
    config.addinivalue_line("markers", "device: moves tensors between device and host (run again with late copies)")
    config.addinivalue_line("markers", "late_copies: a device test run in the late-copy test mode")
    config.addinivalue_line("markers", "slow: takes 8 s or more (processes that import torch anew, benchmark "
                            "harnesses, kills at every step of a save); run first, so that two workers end together")
    config.addinivalue_line("markers", "venv: builds a fresh virtual environment from the package index (test_install.py)")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow first, else as collected
    for item in items:
        if item.path.name in DEVICE_SUITES:
            item.add_marker(pytest.mark.device)
            if getattr(item, "callspec", None) is not None and item.callspec.params.get("copies") == "late":
                item.add_marker(pytest.mark.late_copies)
