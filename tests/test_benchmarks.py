"""The benchmark harnesses run end to end at tiny scale (their figures are not checked: no timing assertions)."""

import json
import statistics
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # runs processes that import torch anew, or a benchmark harness (conftest: slow)

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
WEIGHTS_BENCH = os.path.join(BENCHMARKS, "weights_bench.py")


@pytest.fixture
def weights_bench(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import weights_bench

    yield weights_bench
    for name in ("common", "weights_bench"):  # examples/ has a `common` module too
        sys.modules.pop(name, None)


def run_bench(*argv, out):
    proc = subprocess.run([sys.executable, WEIGHTS_BENCH, *argv, "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_weights_bench_quick_compare_streams_trainable_blocks_exactly(tmp_path):
    out = run_bench("compare", out=tmp_path)
    result = json.loads((tmp_path / "weights_compare_quick.json").read_text())
    rows = result["results"]
    assert list(rows) == ["device", "host", "ssd"]
    assert rows["device"]["summary"]["weight_bytes_streamed"] == 0
    for tier in ("host", "ssd"):
        summary = rows[tier]["summary"]
        assert summary["weight_tiers"] == {str(i): tier for i in range(4)}
        assert summary["weight_bytes_trainable_streamed"] == summary["weight_bytes_streamed"], "full fine-tune"
        # --quick: 4 blocks, weight_prefetch_blocks=1, so at most 2 blocks' weights at once
        assert 0 < summary["weight_device_peak_bytes"] <= summary["weight_bytes_streamed"] // 2
        assert rows[tier]["losses"] == rows["device"]["losses"], "streaming changes no bit"
        assert len(rows[tier]["step_s"]) == 2 and rows[tier]["peak_rss"] > 0
    assert "x device" in out and "losses = device" in out and "NO" not in out.split("losses = device")[1]
    assert sorted(p.name for p in tmp_path.iterdir()) in (["weights_compare_quick.json"],
                                                          ["weights_compare_quick.json", "weights_compare_quick.png"]), \
        "the temporary swap directory is removed"


def test_weights_bench_quick_scale_one_size_built_on_the_meta_device(tmp_path):
    out = run_bench("scale", "--sizes", "tiny-1", out=tmp_path)
    result = json.loads((tmp_path / "weights_scale_quick.json").read_text())
    assert result["args"]["build"] == "meta"
    (row,) = result["rows"]
    assert row["size"] == "tiny-1" and row["summary"]["ssd_file_bytes"] > 0 and row["free_disk"] > 0
    assert row["summary"]["weight_tiers"] == {"0": "ssd", "1": "ssd"}
    assert result["stopped"] is None
    assert "tiny-1" in out and "steps RSS GiB" in out


def test_size_presets_are_exact_gpt2_parameter_counts(weights_bench):
    import argparse

    import torch

    for name, (layers, hidden, heads) in weights_bench.SIZES.items():
        args = argparse.Namespace(layers=layers, hidden=hidden, heads=heads, vocab=50257, seq=256)
        model = weights_bench.build_model(weights_bench.gpt2_config(args), torch.bfloat16, meta=True)
        count = sum(p.numel() for p in model.parameters())
        assert count == weights_bench.gpt2_param_count(layers, hidden, 50257, 256), name
        if name.endswith("B"):
            assert abs(count / (float(name[:-1]) * 1e9) - 1) < 0.03, (name, count)


def test_scale_stops_before_a_size_that_does_not_fit(weights_bench):
    gib, too_big = 2**30, weights_bench.too_big
    assert too_big(10**9, 2, 2, free_disk=30 * gib, mem_available=8 * gib) is None  # 28 B/param x 1.1: 28.7 GiB
    assert "28 B/param" in too_big(10**9, 2, 2, free_disk=28 * gib, mem_available=8 * gib)
    assert too_big(10**9, 2, 1, free_disk=28 * gib, mem_available=8 * gib) is None  # one slot: 16 B/param
    assert "--build meta" in too_big(10**9, 2, 2, free_disk=30 * gib, mem_available=gib)
    assert too_big(10**9, 2, 2, free_disk=30 * gib, mem_available=None) is None  # built on the meta device


def test_dtype_is_bf16_only_where_the_cpu_computes_it(weights_bench, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor : 0\nflags : fpu sse avx2 avx512f\n")
    assert weights_bench.choose_dtype("auto", str(cpuinfo))[0] == "fp32"
    cpuinfo.write_text("processor : 0\nflags : fpu avx512f amx_bf16 amx_tile\n")
    assert weights_bench.choose_dtype("auto", str(cpuinfo)) == ("bf16", "/proc/cpuinfo flags include amx_bf16")
    assert weights_bench.choose_dtype("fp32", str(cpuinfo)) == ("fp32", "--dtype")


def test_dp_bench_quick_two_ranks_each_hold_half_the_state(tmp_path):
    """benchmarks/dp_bench.py end to end: one process and 2 gloo ranks streaming from the SSD."""
    out = tmp_path / "dp.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "dp_bench.py"), "--quick", "--rounds", "1",
                           "--configs", "one-ssd,ranks2-ssd", "--json", str(out), "--swap-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads(out.read_text())["merged"]
    one, ranks = merged["one-ssd"], merged["ranks2-ssd"]
    assert len(ranks["state"]) == 2 and sum(ranks["state"]) == one["state"][0]  # the state split, none lost
    assert all(0.3 < s / one["state"][0] < 0.7 for s in ranks["state"])
    assert ranks["streamed"] > 0 and "ranks2-ssd" in proc.stdout


def test_state_format_bench_runs_a_format_and_reports_its_bytes(tmp_path):
    """The convergence benchmark's child: a few steps of each task in a compact format, finite losses, and the
    state's bytes on the SSD below fp32's 24 per parameter (two slots)."""
    bench = os.path.join(BENCHMARKS, "state_format_bench.py")
    for task, fmt in (("counting", "8bit"), ("language", "bf16")):
        proc = subprocess.run([sys.executable, bench, "--child", task, fmt, "--steps", "3"], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        assert run["format"] == fmt and len(run["losses"]) == 3
        assert all(x == x and x < 10 for x in run["losses"]), run["losses"]  # finite
        assert 12 <= run["state_bytes_per_parameter"] < 24 - 4  # 8-bit ~12.1 (embeddings' fp32 moments aside), bf16 16


def _gpu_check(*argv, out):
    root = os.path.join(os.path.dirname(__file__), "..")
    code = ("import sys; from benchmarks import gpu_check; rc = gpu_check.main(sys.argv[1:]); "
            "print('torch imported:', 'torch' in sys.modules); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *argv, "--out", str(out)], cwd=root, capture_output=True,
                          text=True, timeout=600)


def test_gpu_check_dry_run_announces_every_step_and_touches_nothing(tmp_path):
    proc = _gpu_check("--dry-run", out=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    names = [s["name"] for s in result["steps"]]
    assert names[:3] == ["environment", "install", "tests"]
    assert names[3:] == ["plan gpt2-1.5B", "bench gpt2-1.5B", f"plan {names[5][5:]}", f"bench {names[5][5:]}"]
    assert names[5].startswith("plan llama-")
    assert {s["status"] for s in result["steps"]} == {"dry-run"}
    for i, step in enumerate(result["steps"], 1):
        assert f"[{i}/7] {step['name']}:" in proc.stdout and " ".join(step["command"]) in proc.stdout
    assert "FUYOU_TEST_DEVICE=cuda" in proc.stdout and "--device cuda" in proc.stdout
    assert "torch imported: False" in proc.stdout, "a dry run imports no torch (so it touches no CUDA)"
    assert not (tmp_path / "environment.json").exists()


def test_gpu_check_smoke_runs_the_whole_pipeline_on_the_cpu_and_reports_it(tmp_path):
    proc = _gpu_check("--smoke", "--budget-min", "8", out=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(s["name"], s["status"]) for s in result["steps"]] == [
        ("environment", "ok"), ("install", "skipped"), ("tests", "ok"), ("plan gpt2-tiny", "ok"),
        ("bench gpt2-tiny", "ok")]
    assert result["environment"]["gpu"] is None and result["environment"]["swap_free_bytes"] > 0
    model = result["models"]["gpt2-tiny"]
    assert model["plan"]["results"]["fuyou"]["fits"]
    rows = model["bench"]["sizes"]["tiny"]
    assert rows["torch"]["status"] == rows["fuyou-hf"]["status"] == "ok"
    assert rows["fuyou-hf"]["losses"] == rows["torch"]["losses"], "bitwise torch's losses"
    assert rows["torch"]["params"] > 0
    assert (tmp_path / "gpu_check.png").stat().st_size > 0
    assert "| bench gpt2-tiny | ok |" in proc.stdout and "| fuyou-hf |" in proc.stdout


def test_gpu_check_stops_a_step_at_its_share_and_keeps_going(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks import gpu_check
    step = gpu_check.Step("sleep", "a step that overruns", [sys.executable, "-c", "import time; time.sleep(60)"], 0.1)
    gpu_check.run_step(step, 6)
    assert step.status.startswith("stopped (ran past its 6 s share)") and step.seconds < 40
    skipped = gpu_check.Step("late", "no time left", ["true"], 0.1)
    gpu_check.run_step(skipped, 1)
    assert skipped.status == "skipped (the time budget is spent)"


def test_gpu_check_stopped_by_sigterm_stops_its_step_and_reports_what_ran(tmp_path):
    import signal
    import time
    root = os.path.join(os.path.dirname(__file__), "..")
    code = "import sys; from benchmarks import gpu_check; sys.exit(gpu_check.main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "--smoke", "--out", str(tmp_path)], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while True:  # until the tests step has started (its child runs; SIGTERM must stop it too)
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, "gpu_check never reached its tests step"
        if line.startswith("[3/5] tests"):
            break
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 or proc.returncode == 1, out[-2000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["note"] == "interrupted: what ran is kept"
    statuses = {s["name"]: s["status"] for s in result["steps"]}
    assert statuses["environment"] == "ok" and statuses["tests"] == "stopped (interrupted)"
    assert statuses["bench gpt2-tiny"] == "pending", "nothing started after the interruption"


def test_the_before_after_summary_pools_steps_and_gives_each_rounds_ratios(tmp_path):
    """`benchmarks/ab.py --summarise`: medians of the pooled timed steps per variant, and per round new/old."""
    steps = {("torch", 1): [10.0, 10.0, 12.0], ("new", 1): [11.0, 11.0, 11.0], ("old", 1): [12.0, 13.0, 13.0],
             ("torch", 2): [20.0, 20.0, 20.0], ("new", 2): [21.0, 22.0, 22.0], ("old", 2): [30.0, 30.0, 30.0]}
    for (variant, r), times in steps.items():
        row = {"step_s": times, "median_s": sorted(times)[1], "peak_rss": 2**30 * r, "losses": [3.0, 2.5]}
        (tmp_path / f"{variant}-r{r}.json").write_text(json.dumps({"sizes": {"350M": {"x": row}}}))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.ab", "--summarise", str(tmp_path)], capture_output=True,
                          text=True, timeout=60, cwd=os.path.join(BENCHMARKS, ".."))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["variants"]["torch"]["median_s"] == 16.0 and summary["variants"]["old"]["x_torch"] == 21.5 / 16.0
    assert summary["variants"]["old"]["peak_rss_gib"] == 2.0 and summary["variants"]["new"]["last_losses"] == [2.5]
    assert summary["per_round"]["1"]["new/old"] == 11.0 / 13.0 and summary["per_round"]["2"]["old"] == 1.5
    assert "round 2: new 1.10, old 1.50, new/old 0.73" in proc.stdout


def test_update_rate_bench_times_each_system_and_writes_its_table(tmp_path):
    """benchmarks/update_rate_bench.py end to end on a small state: each system in its own process, a rate
    for each, the bandwidth measured in the same run, and the table with the ratio to the bare kernel."""
    out = tmp_path / "rate.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "update_rate_bench.py"), "--params", "2e6",
                           "--rounds", "1", "--steps", "1", "--systems", "bandwidth,torch-bare,fuyou-exact",
                           "--copy-bytes", str(16 * 2**20), "--swap-dir", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["bandwidth_bytes_per_s"] > 0
    assert set(result["summary"]) == {"torch-bare", "fuyou-exact"}
    assert all(row["params_per_s"] > 0 for row in result["summary"].values())
    assert "| fuyou-exact |" in proc.stdout and "| torch-bare | " in proc.stdout and "| 1.00 |" in proc.stdout


def test_update_rate_bench_reports_fuyous_update_alone_with_each_kernel_and_torch_with_the_norms(tmp_path):
    """The bench's rows beside the bare kernel: torch with clip_grad_norm_'s norms, and fuyou with each kernel, whose
    rows give the update alone (the worker's time) beside the whole step, and which kernel ran."""
    out = tmp_path / "rate.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "update_rate_bench.py"), "--params", "2e6",
                           "--rounds", "1", "--steps", "1", "--copy-bytes", str(16 * 2**20), "--swap-dir", str(tmp_path),
                           "--systems", "torch-bare,torch-norm+bare,fuyou-speculative,fuyou-speculative-torch",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"torch-bare", "torch-norm+bare", "fuyou-speculative", "fuyou-speculative-torch"}
    assert summary["fuyou-speculative-torch"]["update_kernel"] == "torch"
    assert summary["fuyou-speculative"]["update_kernel"] in ("one_pass", "torch")
    for system in ("fuyou-speculative", "fuyou-speculative-torch"):
        assert 0 < summary[system]["median_update_s"] < summary[system]["median_step_s"], summary[system]
    assert "| torch-norm+bare |" in proc.stdout and "update alone" in proc.stdout


def test_update_rate_bench_runs_fuyou_with_the_state_on_the_device_tier(tmp_path):
    """The device tier's rows (the whole state on it: host RAM on the CPU): a step timed, no host update counted."""
    out = tmp_path / "rate.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "update_rate_bench.py"), "--params", "2e6",
                           "--rounds", "1", "--steps", "1", "--copy-bytes", str(16 * 2**20), "--swap-dir", str(tmp_path),
                           "--systems", "torch-bare,fuyou-exact-device", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["fuyou-exact-device"]["params_per_s"] > 0
    assert "median_update_s" not in summary["fuyou-exact-device"], "the host's meter counts no device-tier update"


def test_update_rate_bench_runs_deepspeeds_rows_in_the_python_it_is_given(tmp_path):
    """``deepspeed`` (the kernel alone, on parameters cut as fuyou's) and ``deepspeed-offload`` (ZeRO-2 Offload's host
    step, on one flat partition) run in ``--deepspeed-python``'s process: here a Python that alone finds a stand-in
    ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (torch's AdamW), so a row the bench ran in its own Python would fail."""
    adam = tmp_path / "stub" / "deepspeed" / "ops" / "adam.py"
    adam.parent.mkdir(parents=True)
    for package in (adam.parent, adam.parent.parent):
        (package / "__init__.py").write_text("")
    adam.write_text("import torch\n\n\nclass DeepSpeedCPUAdam(torch.optim.AdamW):\n"
                    "    def __init__(self, params, *, adamw_mode, **hyper):\n"
                    "        assert adamw_mode\n        super().__init__(params, **hyper)\n")
    python = tmp_path / "dspython"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'stub'}:$PYTHONPATH exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    out = tmp_path / "rate.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "update_rate_bench.py"), "--params", "2e6",
                           "--rounds", "1", "--steps", "1", "--swap-dir", str(tmp_path), "--param-elems", "65536",
                           "--dtype", "bf16", "--deepspeed-python", str(python),
                           "--systems", "torch-bare,deepspeed,deepspeed-offload", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["summary"]) == {"torch-bare", "deepspeed", "deepspeed-offload"}, result["runs"]
    assert result["runs"]["deepspeed"][0]["parameters"] == 31
    assert result["runs"]["deepspeed-offload"][0]["parameters"] == 1
    assert "| deepspeed-offload |" in proc.stdout


def test_update_rate_bench_runs_a_python_loop_beside_the_steps_with_small_state_chunks_and_parameters(tmp_path):
    """``--beside-python``: the loop's rate during each system's steps, as a share of its rate alone; ``--state-chunk``,
    ``--threads`` and ``--param-elems`` reach fuyou's worker (its chunks, its threads, its parameters) and
    ``torch-adamw`` (torch's optimizer on as many parameters)."""
    out = tmp_path / "rate.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "update_rate_bench.py"), "--params", "2e6",
                           "--rounds", "1", "--steps", "2", "--swap-dir", str(tmp_path), "--beside-python",
                           "--state-chunk", "64KiB", "--threads", "1", "--param-elems", "65536",
                           "--systems", "torch-bare,torch-adamw,fuyou-exact", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["runs"]["fuyou-exact"][0]["parameters"] == result["runs"]["torch-adamw"][0]["parameters"] == 31
    for system in ("torch-bare", "torch-adamw", "fuyou-exact"):  # a loaded machine may give the loop no op in a short step
        run = result["runs"][system][0]
        assert run["threads"] == 1 and run["beside_ops_per_s_alone"] > 0 and len(run["beside_ops_per_s"]) == 2
        share = statistics.median(rate / run["beside_ops_per_s_alone"] for rate in run["beside_ops_per_s"])
        assert result["summary"][system]["beside_share"] == pytest.approx(share)
    assert result["runs"]["fuyou-exact"][0]["worker_threads"] == 1
    assert result["runs"]["fuyou-exact"][0]["state_chunks"] >= 2e6 / (64 * 1024 / 12)  # 64 KiB of state each
    assert "ops beside: x alone" in proc.stdout and "fuyou's chunk_size 64KiB" in proc.stdout
