"""The `fuyou` command."""

import json
import os
import socket
import subprocess

import pytest

from fuyou_strategy.cli import main
from fuyou_strategy.storage.rundir import write_owner


def test_io_bench_prints_a_row_per_setting_and_writes_json(tmp_path, capsys):
    out_json = tmp_path / "io.json"
    assert main(["io-bench", "--dir", str(tmp_path), "--size", "8MiB", "--block-sizes", "1MiB",
                 "--threads", "1,2", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("1.00 MiB") == 2
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["threads"] for r in rows] == [1, 2]
    assert all(r["read_bps"] > 0 and r["write_bps"] > 0 and r["size"] == 8 * 2**20 for r in rows)
    assert [p.name for p in tmp_path.iterdir()] == ["io.json"], "the bench file and run dir are removed"


@pytest.mark.parametrize("argv,words", [
    (["io-bench", "--block-sizes", "5000"], "multiple of 4 KiB"),
    (["io-bench", "--size", "lots"], "--size: got 'lots'"),
    (["io-bench", "--threads", "two"], "comma-separated integers"),
])
def test_bad_arguments_are_clear_errors(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_io_bench_on_a_missing_directory(tmp_path, capsys):
    assert main(["io-bench", "--dir", str(tmp_path / "nope"), "--size", "4MiB"]) == 2
    assert "fuyou io-bench: error:" in capsys.readouterr().err


def test_clean_removes_checkpoint_temp_folders_whose_writer_is_gone(tmp_path, capsys):
    """Saves cut short leave ``*.tmp-<pid>`` folders beside (or inside) checkpoints; ``fuyou clean``
    finds them at any depth and removes those whose process is gone, and nothing else."""
    gone = subprocess.Popen(["true"])
    gone.wait()

    def temp(path, owner=None):
        path.mkdir(parents=True)
        (path / "master.bin").write_bytes(b"state")
        if owner == "this process":
            write_owner(path)
        elif owner is not None:
            (path / "owner.json").write_text(json.dumps(owner))
        return path

    ckpts = tmp_path / "run" / "checkpoints"
    here = socket.gethostname()
    stale = [temp(ckpts / "last.ckpt.fuyou" / f"{'a' * 32}.tmp-{gone.pid}", {"host": here, "pid": gone.pid}),
             temp(ckpts / f"epoch=0.ckpt.fuyou.tmp-{gone.pid}")]  # format 1's name, no owner.json
    kept = [temp(ckpts / "epoch=1.ckpt.fuyou" / f"{'b' * 32}.tmp-{os.getpid()}", "this process"),  # a save going on
            temp(ckpts / "x.ckpt.fuyou" / f"{'c' * 32}.tmp-{gone.pid}", {"host": "elsewhere", "pid": gone.pid}),
            ckpts / f"notes.tmp-{gone.pid}"]  # not a checkpoint folder
    (kept[-1] / "notes.txt").parent.mkdir()
    (kept[-1] / "notes.txt").write_text("mine")
    assert main(["clean", "--dir", str(tmp_path), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert all(f"would remove {p} " in printed and f"process {gone.pid} is not running" in printed for p in stale), printed
    assert all(p.exists() for p in stale + kept)
    assert main(["clean", "--dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert all(f"removing {p} " in printed for p in stale)
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)
