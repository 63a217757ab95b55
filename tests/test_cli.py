"""The `fuyou` command."""

import json
import os
import socket
import re
import subprocess
import sys

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


# -- answering at once: the parser and --help import no torch ----------------------------------------------------
_HELP = """
import resource, sys
from fuyou_strategy.cli import main
imported = sorted(m for m in ("torch", "lightning", "transformers") if m in sys.modules)
try:
    main(sys.argv[1:])
except SystemExit:
    pass
usage = resource.getrusage(resource.RUSAGE_SELF)
# the peak RSS of this program (VmHWM: ru_maxrss would carry the forking pytest's from before the exec)
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print("RESULT", imported, "torch" in sys.modules, peak, usage.ru_utime + usage.ru_stime, file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["doctor", "--help"]])
def test_help_imports_no_torch_and_answers_at_once(argv):
    """`import fuyou_strategy.cli` imports no torch, Lightning or transformers, and neither does ``--help``: it answers
    in under 100 MB of RSS and 0.5 s of CPU time (CPU time, not wall time: the box may be busy)."""
    proc = subprocess.run([sys.executable, "-c", _HELP, *argv], capture_output=True, text=True, timeout=60)
    assert "usage: fuyou" in proc.stdout
    imported, torch_loaded, rss, cpu_s = proc.stderr.split("RESULT ", 1)[1].rsplit(" ", 3)
    assert imported == "[]" and torch_loaded == "False", proc.stderr
    assert int(rss) < 100 * 2**20 and float(cpu_s) < 0.5, (int(rss) / 2**20, cpu_s)


def test_a_command_that_needs_torch_imports_it():
    code = ("import sys; from fuyou_strategy.cli import main; main(['plan', 'gpt3-13b', '--ssds', '2']); "
            "print('TORCH', 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "TORCH True" in proc.stdout  # the planner's profile: torch is imported when the command runs


# -- fuyou plan: one set of numbers, in units it names --------------------------------------------------------------
PLAN_13B = ["plan", "gpt3-13b", "--gpu", "rtx4090", "--ssds", "12", "--host-memory", "768GB", "--batch", "8"]


def test_plan_counts_the_given_drives_names_its_units_and_takes_every_cheaper_block(tmp_path, capsys):
    """The README's example: 12 drives in the header and at the end; 768 GB is shown as 768 GB with its GiB beside
    it; no block's alternative is cheaper than what the plan chose; the per-block table only with --verbose."""
    assert main(PLAN_13B + ["--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= 20 and "frees device memory" not in out, out  # no per-block rows by default
    assert "host 768 GB (715.26 GiB), 12 drives of 3.84 TB" in out
    assert "GB and TB are powers of 10" in out
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    for name in ("fuyou", "zero-infinity-like"):
        assert results[name]["ssd_drives_needed"] == 1
        assert results[name]["ssd_peak"] < 3.84e12
    assert out.count("within the 12 drives (1 drive would hold it)") == 2 and "1 drive(s)" not in out
    assert main(PLAN_13B + ["--verbose", "--full-table"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "fastest that fits" in line
            or "frees device memory" in line]
    assert len(rows) == 2 * 40  # one per block, per schedule
    costs = [float(c) for row in rows for c in re.findall(r" ([+-]\d+\.\d+) s\b", row)]
    assert costs and min(costs) >= -0.0005, [row for row in rows if " -" in row]  # the solver took every saving
