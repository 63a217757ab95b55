"""The SSD tier: round trips, striping, slots, errors, fallback, cleanup, permissions."""

import errno
import re
import logging
import os
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import CancelledError, Future

import pytest
import torch

from conftest import kill_leaving_a_zombie
from fuyou_strategy import FuyouConfig
from fuyou_strategy.cli import main as fuyou_main
from fuyou_strategy.storage import (HostBuffer, StorageError, StorageIOError, StorageSpaceError, TensorStore, aio,
                                    find_stale_runs, gather)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]
# Element counts chosen to straddle pages and the 8 KiB chunk: 1 element, odd sizes, chunk +- 1.
SIZES = [1, 3, 1023, 2048, 2049, 4097, 10_007]


def random_tensor(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(n, generator=g, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype_and_awkward_size(small_config, dtype):
    with TensorStore(small_config) as store:
        tensors = {}
        for i, n in enumerate(SIZES):
            x = random_tensor(n, dtype, seed=i).reshape(-1, 1) if n % 2 else random_tensor(n, dtype, seed=i)
            store.create(f"t{i}", x.shape, dtype)
            store.write(f"t{i}", x).result()
            tensors[f"t{i}"] = x
        for name, x in tensors.items():
            y = store.read(name).result()
            assert y.dtype == dtype and y.shape == x.shape
            assert torch.equal(y.view(torch.uint8), x.view(torch.uint8)), "bytes must round-trip exactly"


def test_chunk_round_trip(small_config):
    with TensorStore(small_config) as store:
        x = torch.randn(5000)  # 20000 bytes: chunks of 8192, 8192, 3616
        entry = store.create("x", x.shape, x.dtype)
        assert entry.nchunks == 3 and entry.chunk_len(2) == 3616
        store.write("x", x).result()
        parts = []
        for k in range(entry.nchunks):
            with store.read_chunk("x", k).result() as buf:
                parts.append(buf.view(torch.float32).clone())
        assert torch.equal(torch.cat(parts), x)


def test_many_concurrent_reads_and_writes(small_config):
    with TensorStore(small_config) as store:
        xs = {f"e{i}": torch.randn(3000 + 17 * i) for i in range(24)}
        for name, x in xs.items():
            store.create(name, x.shape, x.dtype)
        errors = []

        def writer_reader(names):
            try:
                for name in names:
                    store.write(name, xs[name]).result()
                for _ in range(3):
                    futures = {name: store.read(name) for name in names}
                    for name, fut in futures.items():
                        assert torch.equal(fut.result(), xs[name])
            except Exception as exc:  # noqa: BLE001 - asserted below
                errors.append(exc)

        names = list(xs)
        threads = [threading.Thread(target=writer_reader, args=(names[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert store.pool.high_water <= store.pool.budget


def test_striping_over_three_directories(tmp_path):
    dirs = [tmp_path / f"ssd{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    cfg = FuyouConfig(swap_dirs=[str(d) for d in dirs], chunk_size="8KiB", host_memory_budget="1MiB")
    with TensorStore(cfg) as store:
        x = torch.randn(7 * 2048)  # 7 chunks of 8 KiB
        entry = store.create("x", x.shape, x.dtype)
        dirs_used = [entry.location(k, 0)[0] for k in range(entry.nchunks)]
        assert sorted(set(dirs_used)) == [0, 1, 2]
        assert [dirs_used.count(d) for d in range(3)] in ([3, 2, 2], [2, 3, 2], [2, 2, 3])
        store.write("x", x).result()
        assert torch.equal(store.read("x").result(), x)
        # Every directory's file really holds this entry's chunks.
        for d, run_dir in enumerate(store.run_dirs):
            assert run_dir.startswith(str(dirs[d]))
            assert os.path.getsize(os.path.join(run_dir, "data.bin")) >= 2 * entry.count[d] * 8192
        # Small single-chunk entries are spread round-robin too.
        firsts = {store.create(f"s{i}", (10,), torch.float32).first_dir for i in range(3)}
        assert firsts == {0, 1, 2}


def test_shadow_slot_commit_and_rollback(small_config):
    with TensorStore(small_config) as store:
        old, new = torch.randn(4000), torch.randn(4000)
        store.create("w", old.shape, old.dtype)
        store.write("w", old).result()
        store.write("w", new, slot="shadow").result()
        assert torch.equal(store.read("w").result(), old), "shadow writes must not be visible before commit"
        assert torch.equal(store.read("w", slot="shadow").result(), new)
        store.rollback()
        assert torch.equal(store.read("w").result(), old)
        with pytest.raises(StorageError, match="not written yet"):
            store.read("w", slot="shadow").result()
        store.write("w", new, slot="shadow").result()
        assert store.commit() == 1
        assert torch.equal(store.read("w").result(), new)
        assert store.commit() == 0, "nothing pending: commit is a no-op"


@pytest.mark.parametrize("where", ["ssd", "memory", "device"])
@pytest.mark.parametrize("active", [0, 1])
def test_dropping_the_shadow_slot_keeps_the_active_bytes_and_frees_the_other(tmp_path, where, active):
    """`drop_shadow`, whichever physical slot is active (1: after a commit) and wherever the entry lives (striped
    over two swap directories, host RAM, a device's memory: here the CPU's): the active bytes read back unchanged,
    the entry has no shadow slot from then on, writes and reads go on, and the other slot's room is given back (the
    next entries take the swap files' freed regions, and the entry's bytes stay its own; the RAM and device limits
    count half)."""
    config = FuyouConfig(swap_dirs=[str(tmp_path / "a"), str(tmp_path / "b")], chunk_size="8KiB",
                         io_block_size="4KiB", host_memory_budget="1MiB", io_threads=3)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    place = {"ssd": {}, "memory": {"in_memory": True}, "device": {"device": torch.device("cpu")}}[where]
    with TensorStore(config, memory_limit=2**20, device_limit=2**20) as store:
        old, new, later = torch.randn(5000), torch.randn(5000), torch.randn(5000)  # 3 chunks of 8 KiB
        entry = store.create("w", old.shape, old.dtype, **place)
        store.write("w", old).result()
        store.write("w", new, slot="shadow").result()
        if active:
            assert store.commit() == 1
        footprint = entry.footprint
        held = {"ssd": lambda: store.bytes_on_disk, "memory": lambda: store.bytes_in_memory,
                "device": lambda: store.bytes_on_device}[where]
        before = held()
        assert store.drop_shadow("w") == footprint // 2 and store.drop_shadow("w") == 0
        assert entry.slots == 1 and entry.footprint == footprint // 2
        assert torch.equal(store.read("w").result(), new if active else old)
        with pytest.raises(StorageError, match="no shadow slot"):
            store.read("w", slot="shadow").result()
        store.write("w", later).result()
        assert torch.equal(store.read("w").result(), later)
        if where == "ssd":  # the freed regions (a chunk in each directory at least) hold the next entries' chunks
            one = [torch.randn(2048), torch.randn(2048)]  # a chunk each, one in each directory
            for i, x in enumerate(one):
                store.create(f"v{i}", x.shape, x.dtype, slots=1)
                store.write(f"v{i}", x).result()
            assert store.bytes_on_disk == before
            assert all(torch.equal(store.read(f"v{i}").result(), x) for i, x in enumerate(one))
            assert torch.equal(store.read("w").result(), later)
        else:
            assert held() == before - footprint // 2


def test_commit_refuses_a_partial_shadow(small_config):
    with TensorStore(small_config) as store:
        x = torch.randn(5000)
        store.create("a", x.shape, x.dtype)
        store.create("b", x.shape, x.dtype)
        store.write("a", x).result()
        store.write("b", x).result()
        store.write("a", x + 1, slot="shadow").result()
        buf = store.pool.acquire(store.entry("b").chunk_len(0))
        buf.view().zero_()
        store.write_chunk("b", 0, buf, slot="shadow").result()  # only 1 of 3 chunks
        with pytest.raises(StorageError, match=r"shadow slot incomplete.*'b'"):
            store.commit()
        # All-or-nothing: 'a' did not flip either.
        assert torch.equal(store.read("a").result(), x)


def test_unknown_entry_and_unwritten_entry(small_config):
    with TensorStore(small_config) as store:
        with pytest.raises(StorageError, match="no entry named 'nope'"):
            store.read("nope")
        store.create("x", (10,), torch.float32)
        with pytest.raises(StorageError, match="not written yet"):
            store.read("x")
        with pytest.raises(StorageError, match="holds torch.float32 \\[10\\]; got torch.float64"):
            store.write("x", torch.zeros(10, dtype=torch.float64))


@pytest.mark.parametrize("code,words", [(errno.ENOSPC, "No space left"), (errno.EIO, "I/O error")])
def test_write_error_reaches_the_caller_and_entry_is_not_good(small_config, monkeypatch, code, words):
    with TensorStore(small_config) as store:
        x = torch.randn(5000)
        store.create("x", x.shape, x.dtype)
        store.write("x", x).result()
        calls = {"n": 0}
        real = aio._pwritev

        def failing(fd, bufs, offset):
            calls["n"] += 1
            if calls["n"] == 2:  # the second block of the rewrite fails
                raise OSError(code, os.strerror(code))
            return real(fd, bufs, offset)

        monkeypatch.setattr(aio, "_pwritev", failing)
        with pytest.raises(StorageIOError) as info:
            store.write("x", x + 1).result()
        message = str(info.value)
        assert info.value.errno == code and words in message
        assert "data.bin" in message and "at offset" in message and "bytes" in message
        monkeypatch.setattr(aio, "_pwritev", real)
        # The half-rewritten entry is never served as good data.
        with pytest.raises(StorageError, match="last write failed"):
            store.read("x")
        # A complete rewrite makes it good again.
        store.write("x", x).result()
        assert torch.equal(store.read("x").result(), x)


def test_read_error_and_zero_progress_short_read(small_config, monkeypatch):
    with TensorStore(small_config) as store:
        x = torch.randn(5000)
        store.create("x", x.shape, x.dtype)
        store.write("x", x).result()
        monkeypatch.setattr(aio, "_preadv", lambda fd, bufs, off: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
        with pytest.raises(StorageIOError, match="read of .* bytes at offset .* failed: Input/output error; the drive"):
            store.read("x").result()
        monkeypatch.setattr(aio, "_preadv", lambda fd, bufs, off: 0)
        with pytest.raises(StorageIOError, match="short read: 0 of 4096 bytes, then no progress"):
            store.read("x").result()
        assert store.pool.lent == 0, "buffers of failed reads go back to the pool"


def test_short_transfers_are_completed(small_config, monkeypatch):
    """The kernel may move fewer bytes than asked; the engine must loop, not truncate."""
    real_w, real_r = aio._pwritev, aio._preadv

    def half(real):
        def call(fd, bufs, offset):
            view = bufs[0]
            n = len(view)
            return real(fd, [view[: max(4096, n // 2 // 4096 * 4096)]], offset)
        return call

    monkeypatch.setattr(aio, "_pwritev", half(real_w))
    monkeypatch.setattr(aio, "_preadv", half(real_r))
    cfg = small_config.replace(io_block_size="16KiB", chunk_size="64KiB")
    with TensorStore(cfg) as store:
        x = torch.randn(40_000)
        store.create("x", x.shape, x.dtype)
        store.write("x", x).result()
        assert torch.equal(store.read("x").result(), x)


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_real_kernel_error_from_a_file_size_limit(tmp_path, direct_io):
    """No mocks: RLIMIT_FSIZE makes the kernel refuse the write mid-entry.

    Under O_DIRECT the kernel answers EINVAL (the limit trims the count to an unaligned
    length); the engine must still report the real cause, EFBIG.
    """
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from fuyou_strategy import FuyouConfig
        from fuyou_strategy.storage import StorageError, StorageIOError, TensorStore
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        cfg = FuyouConfig(swap_dirs=[{str(tmp_path)!r}], chunk_size="64KiB", host_memory_budget="1MiB",
                          preallocate=False, direct_io={direct_io!r})
        with TensorStore(cfg) as store:
            store.create("x", (100_000,), torch.float32)
            resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
            try:
                store.write("x", torch.randn(100_000)).result()
            except StorageIOError as exc:
                print("ERR", exc.errno, exc)
            try:
                store.read("x")
            except StorageError as exc:
                print("NOTGOOD", exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"ERR {errno.EFBIG}" in out.stdout and "File too large" in out.stdout, out.stdout
    # Blocks are written concurrently; whichever failed first is reported, with its offset.
    assert re.search(r"write of \d+ bytes at offset \d+ in .*data\.bin failed", out.stdout), out.stdout
    assert "NOTGOOD" in out.stdout and "last write failed" in out.stdout


def test_not_enough_space_is_reported_at_allocation(small_config, tmp_path):
    huge = (2**46,)  # 256 TiB of fp32: more than any test machine's disk
    for preallocate in (True, False):
        with TensorStore(small_config.replace(preallocate=preallocate)) as store:
            with pytest.raises(StorageSpaceError, match=r"entry 'huge' needs .* TiB more in .* but only .* is free"):
                store.create("huge", huge, torch.float32)
            assert "huge" not in store.entries
            assert store.bytes_on_disk == 0


def _force_odirect_refusal(monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):  # shutil.rmtree passes dir_fd=
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)


def assert_buffered_round_trip(store, numel):
    assert not store.engine.is_direct(0)
    x = torch.randn(numel)
    store.create("x", x.shape, x.dtype)
    store.write("x", x).result()
    assert torch.equal(store.read("x").result(), x)


def test_buffered_fallback_when_odirect_is_refused(small_config, monkeypatch, caplog):
    _force_odirect_refusal(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="fuyou_strategy.storage"):
        with TensorStore(small_config) as store:
            assert_buffered_round_trip(store, 9999)
    announced = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
    assert len(announced) == 1, "the fallback is announced once per directory"
    with pytest.raises(StorageIOError, match="direct_io='on' but .* refuses O_DIRECT"):
        TensorStore(small_config.replace(direct_io="on"))


def test_buffered_io_under_dev_shm():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    cfg = FuyouConfig(swap_dirs=["/dev/shm"], chunk_size="8KiB", host_memory_budget="1MiB", direct_io="off")
    with TensorStore(cfg) as store:
        assert_buffered_round_trip(store, 12345)
        run_dir = store.run_dirs[0]
    assert not os.path.exists(run_dir)


def test_permissions(small_config):
    with TensorStore(small_config) as store:
        store.create("x", (10,), torch.float32)
        run_dir = store.run_dirs[0]
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        for name in os.listdir(run_dir):
            assert stat.S_IMODE(os.stat(os.path.join(run_dir, name)).st_mode) == 0o600, name


def test_close_removes_files_and_later_use_is_an_error(small_config):
    store = TensorStore(small_config)
    store.create("x", (10,), torch.float32)
    store.write("x", torch.ones(10)).result()
    run_dir = store.run_dirs[0]
    store.close()
    store.close()  # idempotent
    assert store.closed and not os.path.exists(run_dir)
    with pytest.raises(StorageError, match="closed"):
        store.create("y", (10,), torch.float32)


def test_default_swap_dir_is_a_temporary_dir_removed_on_close():
    store = TensorStore(FuyouConfig(chunk_size="8KiB", host_memory_budget="1MiB"))
    parent = os.path.dirname(store.run_dirs[0])
    assert os.path.basename(parent).startswith("fuyou-swap-")
    store.close()
    assert not os.path.exists(parent)


def test_missing_swap_dir_is_a_clear_error_and_leaves_nothing(tmp_path):
    missing = tmp_path / "nope"
    ok = tmp_path / "ok"
    ok.mkdir()
    with pytest.raises(StorageError, match=r"swap_dirs: '.*nope' does not exist; create it"):
        TensorStore(FuyouConfig(swap_dirs=[str(ok), str(missing)]))
    assert list(ok.iterdir()) == [], "the run dir made in the first directory is removed again"


_CHILD = """
import sys, torch
from fuyou_strategy import FuyouConfig
from fuyou_strategy.storage import TensorStore
store = TensorStore(FuyouConfig(swap_dirs=[sys.argv[1]], chunk_size="8KiB", host_memory_budget="1MiB"))
store.create("x", (5000,), torch.float32)
store.write("x", torch.randn(5000)).result()
print(store.run_dirs[0], flush=True)
mode = sys.argv[2]
if mode == "raise":
    raise RuntimeError("boom")
if mode == "hang":
    import time; time.sleep(60)
"""


@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_cleanup_at_exit_and_after_an_exception(tmp_path, mode):
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), mode], capture_output=True, text=True, timeout=120)
    run_dir = out.stdout.strip()
    assert run_dir.startswith(str(tmp_path)), out.stderr
    assert (out.returncode != 0) == (mode == "raise")
    assert not os.path.exists(run_dir)
    assert list(tmp_path.iterdir()) == []


def test_crashed_run_is_found_and_cleaned_by_the_command(tmp_path, capsys):
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), "hang"], stdout=subprocess.PIPE, text=True)
    run_dir = child.stdout.readline().strip()
    # A live run is never reported as stale.
    assert find_stale_runs([str(tmp_path)]) == []
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert os.path.isdir(run_dir), "SIGKILL leaves the run directory behind"
    stale = find_stale_runs([str(tmp_path)])
    assert [s.path for s in stale] == [run_dir] and "not running" in stale[0].reason
    assert fuyou_main(["clean", "--dir", str(tmp_path), "--dry-run"]) == 0
    assert os.path.isdir(run_dir) and "would remove" in capsys.readouterr().out
    assert fuyou_main(["clean", "--dir", str(tmp_path)]) == 0
    assert not os.path.exists(run_dir)


def test_a_zombie_owner_counts_as_gone(tmp_path, capsys):
    """A killed process its parent has not reaped yet (a dead rank whose launcher lives) will never write
    again: its run directory is stale, and a new store in the same swap directory removes it."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), "hang"], stdout=subprocess.PIPE, text=True)
    try:
        run_dir = child.stdout.readline().strip()
        assert find_stale_runs([str(tmp_path)]) == []
        kill_leaving_a_zombie(child)
        stale = find_stale_runs([str(tmp_path)])
        assert [s.path for s in stale] == [run_dir]
        with TensorStore(FuyouConfig(swap_dirs=[str(tmp_path)])) as store:
            assert not os.path.exists(run_dir), "a new run in the same swap directory removed it"
            assert [os.path.dirname(d) for d in store.run_dirs] == [str(tmp_path)]
    finally:
        child.kill()
        child.wait(timeout=30)


def test_single_slot_entries_delete_and_space_reuse(small_config):
    with TensorStore(small_config) as store:
        x = torch.randn(3000)
        store.create("a", x.shape, x.dtype, slots=1)
        used = store.bytes_on_disk
        assert used == 2 * 8192, "one slot: two 8 KiB chunks"
        store.write("a", x).result()
        with pytest.raises(StorageError, match="slots=1: it has no shadow slot"):
            store.write("a", x, slot="shadow")
        store.delete("a")
        assert "a" not in store.entries
        store.create("b", x.shape, x.dtype, slots=1)  # same size: the freed region is reused
        assert store.bytes_on_disk == used
        store.write("b", x + 1).result()
        assert torch.equal(store.read("b").result(), x + 1)


def test_read_chunk_into_a_buffer_the_caller_holds(small_config):
    with TensorStore(small_config) as store:
        x = torch.randn(5000)  # 20000 bytes over three chunks of 8 KiB
        store.create("x", x.shape, x.dtype)
        store.write("x", x).result()
        buf = store.pool.try_acquire(8192)
        assert store.read_chunk("x", 1, into=buf).result() is buf
        assert torch.equal(buf.view(torch.float32), x[2048:4096])
        buf.release()
        wrong = store.pool.acquire(8192)  # chunk 2 holds 3616 bytes
        with pytest.raises(StorageError, match="chunk 2: buffer holds 8192 bytes .* the chunk is 3616 bytes"):
            store.read_chunk("x", 2, into=wrong)
        assert store.pool.lent == 0, "a refused buffer is released"


def test_swap_file_levels_off_when_activation_sizes_vary(small_config):
    """Activations of padded batches whose length changes every step, as the swapper stores
    them (slots=1; created and written in forward, read and deleted in backward), next to
    long-lived optimizer state: the file must stop growing once the longest batch was seen."""
    g = torch.Generator().manual_seed(0)
    seq_lens = [64] + torch.randint(4, 64, (59,), generator=g).tolist()  # the longest batch comes first
    with TensorStore(small_config) as store:
        state = store.create("adamw.w", (6000,), torch.float32)
        state_bytes = state.slots * state.nchunks * state.stride
        peak_live, history = 0, []
        for step, n in enumerate(seq_lens):
            acts, writes = {}, {}
            for block in range(3):
                for kind, numel in (("hidden", n * 512), ("attn", n * n)):
                    name = f"act.{step}.{block}.{kind}"
                    acts[name] = torch.randn(numel, generator=g)
                    store.create(name, (numel,), torch.float32, slots=1)
                    writes[name] = store.write(name, acts[name])  # in flight while forward goes on
            live = [store.entry(name) for name in acts]
            peak_live = max(peak_live, sum(e.nchunks * e.stride for e in live))
            # Backward frees blocks last to first, but not in creation order within a block.
            for block in reversed(range(3)):
                for kind in ("attn", "hidden"):
                    name = f"act.{step}.{block}.{kind}"
                    writes[name].result(timeout=30)
                    assert torch.equal(store.read(name).result(timeout=30), acts[name])
                    store.delete(name)
            history.append(store.bytes_on_disk)
        assert history[-1] == history[2], f"the swap file kept growing: {history}"
        assert max(history) <= state_bytes + peak_live, (history, state_bytes, peak_live)


def test_adjacent_free_regions_merge_and_take_a_larger_entry(small_config):
    page = 8192  # the chunk size: an 8 KiB entry with slots=1 owns one 8 KiB region
    with TensorStore(small_config) as store:
        for name in "abcd":
            store.create(name, (2048,), torch.float32, slots=1)
        assert [store.entry(n).base[0] for n in "abcd"] == [0, page, 2 * page, 3 * page]
        store.delete("b")
        store.delete("a")  # merges with b's region after it
        assert store.create("e", (2 * 2048,), torch.float32, slots=1).base[0] == 0
        store.delete("c")
        store.delete("e")  # merges with c's region after it
        assert store.create("f", (3 * 2048,), torch.float32, slots=1).base[0] == 0
        assert store.bytes_on_disk == 4 * page, "every entry fit into freed space"
        # Space freed at the end of the file is used before the file grows.
        store.delete("d")
        assert store.create("g", (2 * 2048,), torch.float32, slots=1).base[0] == 3 * page
        assert store.bytes_on_disk == 5 * page
        x = torch.randn(2 * 2048)
        store.write("g", x).result()
        assert torch.equal(store.read("g").result(), x)


def test_a_failed_create_gives_its_regions_back(tmp_path, monkeypatch):
    dirs = [tmp_path / "ssd0", tmp_path / "ssd1"]
    for d in dirs:
        d.mkdir()
    cfg = FuyouConfig(swap_dirs=[str(d) for d in dirs], chunk_size="8KiB", host_memory_budget="256KiB")
    real = os.posix_fallocate
    calls = []

    def second_fails(fd, offset, nbytes):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, nbytes)

    with TensorStore(cfg) as store:
        monkeypatch.setattr(os, "posix_fallocate", second_fails)
        with pytest.raises(StorageSpaceError, match="entry 'x' needs .* in .*ssd1"):
            store.create("x", (4 * 2048,), torch.float32)  # two chunks in each directory
        monkeypatch.setattr(os, "posix_fallocate", real)
        used = store.bytes_on_disk
        entry = store.create("y", (4 * 2048,), torch.float32)
        assert entry.base == {0: 0, 1: 0}, "the region reserved in ssd0 for 'x' was given back"
        assert store.bytes_on_disk == used + 2 * 2 * 8192, "only ssd1's file had to grow"


def test_write_chunk_completes_after_its_bookkeeping(small_config, monkeypatch):
    """CPython wakes a future's waiters before it runs the future's callbacks: a waiter that
    sees write_chunk's future done must find the write recorded, so `commit` succeeds."""
    with TensorStore(small_config) as store:
        x = torch.randn(1000)  # one chunk
        store.create("w", x.shape, x.dtype)
        store.write("w", x).result()
        real_write = store.engine.write
        engine_future, returned, outcome = Future(), [], []
        committed = threading.Event()

        def write_now_complete_later(f, offset, data):
            real_write(f, offset, data).result()  # the bytes are on disk; completion comes below
            engine_future.add_done_callback(window)  # registered before the store's own callback
            return engine_future

        def window(_):
            # The engine's future is done and its waiters are awake; the store's callback has
            # not run yet. If the future write_chunk returned is done too, its waiter commits now.
            if returned[0].done():
                committed.wait(timeout=30)

        def waiter():
            try:
                returned[0].result(timeout=30)
                outcome.append(store.commit())
            except Exception as exc:  # noqa: BLE001 - asserted below
                outcome.append(exc)
            finally:
                committed.set()

        monkeypatch.setattr(store.engine, "write", write_now_complete_later)
        buf = store.pool.acquire(store.entry("w").chunk_len(0))
        buf.view().copy_((x + 1).view(torch.uint8))
        returned.append(store.write_chunk("w", 0, buf, slot="shadow"))
        threads = [threading.Thread(target=waiter), threading.Thread(target=engine_future.set_result, args=(None,))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert outcome == [1], f"commit right after write_chunk(...).result(): {outcome}"
        assert torch.equal(store.read("w").result(timeout=30), x + 1)
        assert store.pool.lent == 0


def test_write_chunk_defaults_to_the_active_slot_like_write(small_config):
    with TensorStore(small_config) as store:
        x = torch.randn(1000)  # one chunk
        store.create("a", x.shape, x.dtype, slots=1)
        buf = store.pool.acquire(store.entry("a").chunk_len(0))
        buf.view().copy_(x.view(torch.uint8))
        store.write_chunk("a", 0, buf).result(timeout=30)
        assert torch.equal(store.read("a").result(timeout=30), x)


def test_an_error_in_the_read_callback_reaches_the_caller(small_config, monkeypatch):
    with TensorStore(small_config) as store:
        x = torch.randn(5000)  # three chunks
        store.create("x", x.shape, x.dtype)
        store.write("x", x).result()

        def broken_view(self, dtype=torch.uint8):
            raise RuntimeError("injected failure while landing a chunk")

        monkeypatch.setattr(HostBuffer, "view", broken_view)  # used by the copy out of each chunk
        with pytest.raises(RuntimeError, match="injected failure while landing a chunk"):
            store.read("x").result(timeout=5)
        assert store.pool.lent == 0, "the chunks' buffers went back to the pool"


def test_gather_completes_when_a_future_is_cancelled():
    cancelled, finished = Future(), Future()
    cancelled.cancel()
    finished.set_result(None)
    with pytest.raises(CancelledError):
        gather([finished, cancelled]).result(timeout=5)


def test_gather_and_then_of_futures_already_done_complete_at_once_as_their_callbacks_would():
    """Done futures (a host-tier transfer's) are gathered without callbacks or a lock: the first error in their
    order, else the result; `then` runs its function at once on the calling thread. A result of None is the one
    shared `aio.DONE`, which nothing can change."""
    ok, bad, worse = Future(), Future(), Future()
    ok.set_result(1)
    bad.set_exception(ValueError("first"))
    worse.set_exception(KeyError("second"))
    assert gather([ok, ok], result="r").result(timeout=0) == "r"
    with pytest.raises(ValueError, match="first"):
        gather([ok, bad, worse]).result(timeout=0)
    assert gather([ok]) is aio.DONE and aio.completed() is aio.DONE and aio.completed("x").result(timeout=0) == "x"
    assert not aio.DONE.cancel() and aio.DONE.result(timeout=0) is None
    seen = []
    out = aio.then(ok, lambda f: seen.append(threading.current_thread()) or f.result() + 1)
    assert seen == [threading.current_thread()] and out.result(timeout=0) == 2
    with pytest.raises(ZeroDivisionError):
        aio.then(ok, lambda f: 1 / 0).result(timeout=0)
    later, other = Future(), Future()  # not all done: the first to fail, whenever it completes
    gathered = gather([later, other, ok])
    assert not gathered.done()
    other.set_exception(KeyError("done first"))
    later.set_exception(ValueError("done second"))
    with pytest.raises(KeyError, match="done first"):
        gathered.result(timeout=5)


def test_a_run_directory_that_cannot_be_removed_is_reported(tmp_path, monkeypatch, caplog):
    from fuyou_strategy.storage import rundir

    path = rundir.make_run_dir(str(tmp_path))
    monkeypatch.setattr(os, "unlink", lambda *a, **k: (_ for _ in ()).throw(PermissionError(errno.EPERM, "denied")))
    with caplog.at_level(logging.WARNING, logger="fuyou_strategy.storage"):
        rundir.remove_run_dir(path)
    assert any("could not remove run directory" in r.getMessage() and "fuyou clean" in r.getMessage()
               for r in caplog.records), "a silent failure would leave the swap files behind unnoticed"
    monkeypatch.undo()
    rundir.remove_run_dir(path)
    assert not os.path.exists(path)


def test_a_chunk_can_be_read_while_another_chunk_of_the_same_slot_is_being_written(small_config, monkeypatch):
    """With one slot (state_slots=1) the optimizer writes chunk k in place while it reads chunk k+1 ahead."""
    release = threading.Event()
    real = aio._pwritev
    monkeypatch.setattr(aio, "_pwritev", lambda fd, bufs, off: (release.wait(10), real(fd, bufs, off))[1])
    with TensorStore(small_config) as store:
        store.create("x", (2 * small_config.chunk_size // 4,), torch.float32, slots=1)
        release.set()
        store.write("x", torch.arange(2 * small_config.chunk_size // 4, dtype=torch.float32)).result(timeout=10)
        release.clear()
        buf = store.pool.acquire(small_config.chunk_size)
        buf.view(torch.float32).fill_(-1)
        writing = store.write_chunk("x", 0, buf)  # held in flight until released
        with store.read_chunk("x", 1).result(timeout=10) as other:  # another chunk: readable
            assert other.view(torch.float32)[0].item() == small_config.chunk_size // 4
        with pytest.raises(StorageError, match="chunk 0 not written yet"):  # the chunk being written: refused
            store.read_chunk("x", 0)
        release.set()
        writing.result(timeout=10)
        with store.read_chunk("x", 0).result(timeout=10) as chunk:
            assert chunk.view(torch.float32)[0].item() == -1


def _held_writes(monkeypatch, fail=False):
    """Hold every write until the returned event is set (then fail it with EIO, with ``fail``)."""
    release, real = threading.Event(), aio._pwritev

    def held(fd, bufs, off):
        release.wait(30)
        if fail:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, off)

    monkeypatch.setattr(aio, "_pwritev", held)
    return release


def test_a_chunk_with_two_writes_in_flight_is_read_only_once_both_have_landed(small_config, monkeypatch):
    """One chunk written twice at once (rewritten before its first write landed): once the first lands the chunk is
    still refused to a reader, since the second is in flight; a commit that flips it behind the second makes a read
    wait for that write and get its bytes."""
    n = small_config.chunk_size // 4  # one chunk
    with TensorStore(small_config) as store:
        store.create("w", (n,), torch.float32)
        store.write("w", torch.zeros(n)).result(timeout=10)
        release = {1.0: threading.Event(), 2.0: threading.Event()}  # each write held by its value until released
        real = aio._pwritev

        def held(fd, bufs, off):
            release[struct.unpack("<f", bytes(bufs[0][:4]))[0]].wait(30)
            return real(fd, bufs, off)

        monkeypatch.setattr(aio, "_pwritev", held)
        writes = []
        for value in (1.0, 2.0):
            buf = store.pool.acquire(small_config.chunk_size)
            buf.view(torch.float32).fill_(value)
            writes.append(store.write_chunk("w", 0, buf, slot="shadow"))
        release[1.0].set()
        writes[0].result(timeout=10)
        with pytest.raises(StorageError, match="chunk 0 not written yet"):  # the second write is still in flight
            store.read_chunk("w", 0, slot="shadow")
        assert store.commit(writes_behind=True) == 1 and store.writes_behind == 1
        threading.Timer(0.3, release[2.0].set).start()
        with store.read_chunk("w", 0).result(timeout=10) as chunk:  # waits for the second write
            assert torch.equal(chunk.view(torch.float32), torch.full((n,), 2.0))
        assert writes[1].done() and store.waits_behind == 1


def test_a_commit_with_writes_behind_flips_and_reads_wait_for_the_writes(small_config, monkeypatch):
    """`commit(writes_behind=True)`: the shadow chunks still being written become active; a read of one waits
    for its write and gets the new bytes; a plain commit still refuses while they are in flight."""
    old, new = torch.randn(5000), torch.randn(5000)  # 3 chunks of 8 KiB
    with TensorStore(small_config) as store:
        store.create("w", old.shape, old.dtype)
        store.write("w", old).result(timeout=10)
        release = _held_writes(monkeypatch)
        writes = store.write("w", new, slot="shadow")
        with pytest.raises(StorageError, match="shadow slot incomplete, failed or in flight"):
            store.commit()
        assert store.commit(writes_behind=True) == 1 and store.writes_behind == 3
        threading.Timer(0.3, release.set).start()
        began = time.monotonic()
        read = store.read("w")  # blocks until the writes land
        assert time.monotonic() - began >= 0.25 and writes.done() and store.waits_behind == 1
        assert torch.equal(read.result(timeout=10), new), "the read waited for the writes and got the new bytes"
        with store.read_chunk("w", 2).result(timeout=10) as chunk:  # landed: no wait
            assert torch.equal(chunk.view(torch.float32), new[4096:])
        assert store.waits_behind == 1 and store.commit() == 0


def test_a_write_that_fails_after_a_commit_behind_leaves_the_slot_failed(small_config, monkeypatch):
    old = torch.randn(5000)
    with TensorStore(small_config) as store:
        store.create("w", old.shape, old.dtype)
        store.write("w", old).result(timeout=10)
        release = _held_writes(monkeypatch, fail=True)
        writes = store.write("w", old + 1, slot="shadow")
        assert store.commit(writes_behind=True) == 1
        release.set()
        with pytest.raises(StorageError, match=r"last write failed.*resume from the last checkpoint.*Input/output"):
            store.read("w").result(timeout=30)
        assert isinstance(writes.exception(timeout=10), OSError)


def test_a_write_behind_that_never_lands_is_a_timeout_and_the_entry_waits_before_it_moves(tmp_path, monkeypatch):
    cfg = FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", io_threads=2, io_timeout=0.5,
                      host_state="1MiB", host_memory_budget="4MiB")
    with TensorStore(cfg) as store:
        store.create("w", (5000,), torch.float32)
        store.write("w", torch.zeros(5000)).result(timeout=10)
        release = _held_writes(monkeypatch)
        store.write("w", torch.ones(5000), slot="shadow")
        store.commit(writes_behind=True)
        with pytest.raises(StorageError, match=r"chunk 0, committed while in flight, did not land within io_timeout"):
            store.read_chunk("w", 0)
        with pytest.raises(StorageError, match="did not land within io_timeout"):
            store.to_memory("w")
        threading.Timer(0.2, release.set).start()
        assert store.to_memory("w") > 0, "to_memory waited for the writes behind, then moved the entry"
        assert torch.equal(store.read("w").result(timeout=10), torch.ones(5000))


def test_a_commit_refuses_while_the_active_slot_still_has_writes_in_flight(small_config, monkeypatch):
    """The slot that would become the shadow must have no write landing in it."""
    x = torch.randn(5000)
    with TensorStore(small_config) as store:
        store.create("w", x.shape, x.dtype)
        store.write("w", x).result(timeout=10)
        store.write("w", x + 1, slot="shadow").result(timeout=10)
        release = _held_writes(monkeypatch)
        buf = store.pool.acquire(store.entry("w").chunk_len(0))
        buf.view().zero_()
        active = store.write_chunk("w", 0, buf)
        with pytest.raises(StorageError, match="active slot of \\['w'\\] still has writes in flight"):
            store.commit(writes_behind=True)
        release.set()
        active.result(timeout=10)
        assert store.commit() == 1
