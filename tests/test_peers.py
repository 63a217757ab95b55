"""The peer benchmark's harness (benchmarks/peers) at tiny scale: it trains torch and fuyou alike, and
reports a peer it cannot run as such. No figure is checked (no timing assertions)."""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow  # runs processes that import torch anew, or a benchmark harness (conftest: slow)

ROOT = os.path.join(os.path.dirname(__file__), "..")


def run_peers(tmp_path, *argv):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.peers", "--sizes", "tiny", "--rounds", "1",
                           "--steps", "1", "--warmup", "3", "--swap-dir", str(tmp_path / "swap"),
                           "--out", str(tmp_path / "out"), *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "out" / "peers-gpt2-fp32.json").read_text()), proc.stdout


def test_harness_trains_torch_and_fuyou_alike_and_reports_missing_peers(tmp_path):
    systems = ["torch", "torch-hf", "fuyou-lightning", "fuyou-hf", "fuyou-engine", "ds-offload", "colossal-cpu"]
    result, stdout = run_peers(tmp_path, "--systems", ",".join(systems), "--trace", str(tmp_path / "traces"))
    rows = result["sizes"]["tiny"]
    assert list(rows) == systems
    torch_row = rows["torch"]
    assert torch_row["status"] == "ok" and len(torch_row["losses"]) == 4
    for name in ("fuyou-lightning", "fuyou-hf", "fuyou-engine"):
        row = rows[name]
        assert row["status"] == "ok", row
        # same weights, data and hyper-parameters: FuyouAdamW computes what torch's AdamW does
        # (bitwise here; the reference is the fused kernel, so allow its last-bit differences)
        assert row["losses"] == pytest.approx(torch_row["losses"], rel=1e-6, abs=0)
        assert row["ssd_peak_bytes"] > 0, "the optimizer state was on SSD while it ran"
        assert row["peak_rss"] > 0 and row["median_s"] > 0
    assert rows["torch"]["ssd_peak_bytes"] == 0
    # the HF Trainer without fuyou: the same training as the plain loop's
    assert rows["torch-hf"]["status"] == "ok" and rows["torch-hf"]["ssd_peak_bytes"] == 0
    assert rows["torch-hf"]["losses"] == pytest.approx(torch_row["losses"], rel=1e-6, abs=0)
    for name, module in (("ds-offload", "deepspeed"), ("colossal-cpu", "colossalai")):
        if importlib.util.find_spec(module) is None:
            assert rows[name]["status"] == "unavailable"
            assert f"{module} is not installed" in rows[name]["reason"] and "install.sh" in rows[name]["reason"]
            assert f"| {name} | **unavailable** |" in stdout
    assert not os.listdir(tmp_path / "swap"), "every run's swap files are removed"
    assert sorted(os.listdir(tmp_path / "traces")) == ["fuyou-engine-tiny.json", "fuyou-hf-tiny.json",
                                                       "fuyou-lightning-tiny.json"]
    from fuyou_strategy.report import load_trace

    assert load_trace(tmp_path / "traces" / "fuyou-hf-tiny.json").steps, "a timeline of fuyou's steps"
    assert (tmp_path / "out" / "peers-gpt2-fp32.md").read_text().startswith("# gpt2, fp32")
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "out" / "peers-gpt2-fp32.png").stat().st_size > 0


def test_a_run_past_the_memory_limit_is_stopped_and_not_tried_at_larger_sizes(tmp_path):
    result, stdout = run_peers(tmp_path, "--systems", "torch", "--sizes", "tiny,124M", "--memory-limit", "0.05")
    tiny, larger = result["sizes"]["tiny"]["torch"], result["sizes"]["124M"]["torch"]
    assert tiny["status"] == "out of memory" and "GiB limit" in tiny["reason"]
    assert larger == {"status": "skipped", "reason": "ran out of memory at tiny"}


def _workers_under(path) -> list[int]:
    """Pids of live processes whose command line names ``path`` (the harness's workers get their swap dir there)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(path) in cmd and "--worker" in cmd and state != "Z":
            pids.append(int(pid))
    return pids


_INTERRUPTED_AT_START = r"""
import os, signal, subprocess, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from benchmarks.peers import run as harness
real, started = subprocess.Popen, []
def popen(*args, **kwargs):  # the interrupt arrives as the worker has just started, before watch() has it
    started.append(real(*args, **kwargs))
    os.kill(os.getpid(), signal.SIGTERM)
    return started[-1]
subprocess.Popen = popen
signal.signal(signal.SIGTERM, harness._interrupt)
swap = Path(sys.argv[2])
try:
    harness.watch(["--worker", "torch", "--sizes", "tiny", "--swap-dir", str(swap)], swap, 2**40, 600, False)
except KeyboardInterrupt:
    print(started[0].pid, started[0].poll(), flush=True)
"""


def test_an_interrupt_as_the_worker_starts_still_takes_the_worker_down(tmp_path):
    """A SIGTERM (or Ctrl-C) that reaches the harness between starting a worker and watching it: the worker
    (its own session) is killed all the same, not left running."""
    out = subprocess.run([sys.executable, "-c", _INTERRUPTED_AT_START, ROOT, str(tmp_path / "swap")],
                         capture_output=True, text=True, timeout=300)
    pid, code = out.stdout.split()
    try:
        assert code == str(-signal.SIGKILL), out.stderr[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def test_a_stopped_harness_kills_its_worker_and_reports_what_ran(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.peers", "--sizes", "tiny", "--rounds", "1",
                             "--steps", "1", "--warmup", "3", "--systems", "torch,fuyou-lightning",
                             "--swap-dir", str(tmp_path / "swap"), "--out", str(tmp_path / "out")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stderr:  # wait until the second run's worker is up
            seen.append(line)
            if "fuyou-lightning ..." in line:
                break
        deadline = time.monotonic() + 120
        while not _workers_under(tmp_path / "swap") and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert _workers_under(tmp_path / "swap"), "".join(seen)
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == 130, rest[-3000:]
    finally:
        proc.kill()
    assert not _workers_under(tmp_path / "swap"), "the running worker went down with the harness"
    result = json.loads((tmp_path / "out" / "peers-gpt2-fp32.json").read_text())
    assert result["partial"] == "interrupted after 1 of 2 runs"
    assert result["sizes"]["tiny"]["torch"]["status"] == "ok"
    assert "fuyou-lightning" not in result["sizes"]["tiny"]
    assert "[PARTIAL: interrupted after 1 of 2 runs]" in (tmp_path / "out" / "peers-gpt2-fp32.md").read_text()
    assert not list((tmp_path / "out").glob(".*tmp*")), "no temporary report file is left"


def test_a_host_budget_sweep_runs_fuyou_hf_at_each_budget_and_draws_step_time_against_rss(tmp_path):
    result, stdout = run_peers(tmp_path, "--systems", "torch,fuyou-hf@16MiB,fuyou-hf@1GiB")
    rows = result["sizes"]["tiny"]
    assert [rows[n]["status"] for n in rows] == ["ok", "ok", "ok"], rows
    held = {n: result["runs"]["tiny"][n][0]["summary"]["host_bytes_optimizer_state"] for n in rows if n != "torch"}
    assert held["fuyou-hf@16MiB"] == 0 < held["fuyou-hf@1GiB"], "the budget decides how much state is in RAM"
    for n in ("fuyou-hf@16MiB", "fuyou-hf@1GiB"):
        assert result["runs"]["tiny"][n][0]["summary"]["host_pool_budget_bytes"] == (16 if "16" in n else 1024) * 2**20
        assert rows[n]["losses"] == rows["torch"]["losses"], "every split trains as torch does"
        assert f"host_memory_budget='{n.split('@')[1]}'" in stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "out" / "peers-gpt2-fp32-sweep.png").stat().st_size > 0
    bad = subprocess.run([sys.executable, "-m", "benchmarks.peers", "--systems", "fuyou-hf@lots"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "unknown ['fuyou-hf@lots']" in bad.stderr


def test_a_system_name_can_set_one_fuyou_config_field_on_the_hf_callback():
    """``fuyou-hf@<field>=<value>``: the HF callback with one `FuyouConfig` field set (a chunk size, a schedule);
    a name that is no field is unknown, as a bad budget is."""
    sys.path.insert(0, ROOT)
    try:
        from benchmarks.peers.systems import system
    finally:
        sys.path.remove(ROOT)
    run, what = system("fuyou-hf@chunk_size=64MiB")
    assert callable(run) and "chunk_size='64MiB'" in what
    assert "optimizer_schedule='next_forward'" in system("fuyou-hf@optimizer_schedule=next_forward")[1]
    assert system("fuyou-hf@chunk_sizes=64MiB") is None and system("fuyou-hf@lots") is None
    assert "host_memory_budget='4GiB'" in system("fuyou-hf@4GiB")[1]


def test_every_fuyou_system_takes_config_fields_and_keeps_its_own():
    """``<fuyou system>@<field>=<value>[,...]``: e.g. the state-on-SSD system with the schedule pinned; the
    peers and torch take none."""
    sys.path.insert(0, ROOT)
    try:
        from benchmarks.peers.systems import system
    finally:
        sys.path.remove(ROOT)
    _run, what = system("fuyou-state-ssd@optimizer_schedule=backward,chunk_size=8MiB")
    assert "(host_state=0)" in what and "optimizer_schedule='backward', chunk_size='8MiB'" in what
    assert system("torch@chunk_size=8MiB") is None and system("ds-offload@chunk_size=8MiB") is None
    assert system("fuyou-state-ssd@4GiB") is None, "a bare budget is the HF sweep's only"
    assert system("fuyou-state-ssd@optimizer_schedule=backward,chunk_size") is None


def test_a_names_fields_reach_the_config_of_every_placement():
    """The fields after ``@`` reach `FuyouConfig` whatever the system's placement: ``fuyou-ssd@state_format=bf16``
    once ran the fp32 state, its field dropped where everything is on the SSD."""
    sys.path.insert(0, ROOT)
    try:
        from benchmarks.peers.systems import Job, _fuyou_fields
    finally:
        sys.path.remove(ROOT)
    job = Job("gpt2", "124M", None, "fp32", 1, 64, 1, "/tmp/swap")
    for everything_on_ssd in (True, False):
        fields = _fuyou_fields(job, everything_on_ssd, state_format="bf16", host_state="auto")
        assert fields["state_format"] == "bf16" and fields["host_state"] == "auto", fields
        assert fields["swap_dirs"] == ["/tmp/swap"]
    assert _fuyou_fields(job, True)["host_state"] == 0 and _fuyou_fields(job, True)["weights"] == "ssd"


def test_the_systems_option_keeps_a_variants_fields_together():
    """``--systems`` splits at commas, but a variant's second field stays with it."""
    sys.path.insert(0, ROOT)
    try:
        from benchmarks.peers.run import split_systems
    finally:
        sys.path.remove(ROOT)
    assert split_systems("torch,fuyou-engine@optimizer_schedule=next_forward,optimizer_threads=8,fuyou-hf@4GiB,ds") == [
        "torch", "fuyou-engine@optimizer_schedule=next_forward,optimizer_threads=8", "fuyou-hf@4GiB", "ds"]


def test_pool_divides_each_round_by_the_same_runs_torch_round_and_pools_every_step(tmp_path, capsys):
    from benchmarks.peers import pool

    def run(folder, torch_steps, fuyou_steps):
        rounds = lambda steps: [{"status": "ok", "step_s": s} for s in steps]  # noqa: E731
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "peers.json"
        path.write_text(json.dumps({"runs": {"350M": {"torch": rounds(torch_steps), "fuyou-hf": rounds(fuyou_steps)}}}))
        return path

    first = run("a", [[10.0, 10.0, 10.0], [20.0, 20.0, 20.0]], [[11.0, 11.0, 12.0], [18.0, 19.0, 30.0]])
    second = run("b", [[10.0, 10.0, 10.0]], [[9.0, 9.0, 9.0]])
    pool.main([str(first), str(second), "--out", str(tmp_path / "pooled.json")])
    hf = json.loads((tmp_path / "pooled.json").read_text())["pooled"]["350M"]["fuyou-hf"]
    assert [r["ratio"] for r in hf["rounds"]] == [1.1, 0.95, 0.9], "each round over its own run and round's torch"
    assert [(r["run"], r["round"]) for r in hf["rounds"]] == [("a", 1), ("a", 2), ("b", 1)]
    assert hf["median_ratio"] == 0.95 and (hf["min"], hf["max"]) == (0.9, 1.1)
    # every timed step: fuyou 9, 9, 9, 11, 11, 12, 18, 19, 30 (median 11) over torch's 10 x 6, 20 x 3 (median 10)
    assert hf["pooled"] == 1.1
    assert "| 350M | fuyou-hf | 3 | 1.10, 0.95, 0.90 | 0.95 (0.90–1.10) | 1.10 |" in capsys.readouterr().out
