"""Watching a run: the step trace and `fuyou report`, SSD wear, `fuyou doctor`, progress bars, and
configuration files for the callback and LightningCLI."""

import dataclasses
import errno
import importlib.util
import json
import logging
import warnings

import pytest
import torch
import yaml

from conftest import tiny_causal_lm
from fuyou_strategy import ConfigError, FuyouCallback, FuyouConfig, FuyouEngine, doctor, drives, progress, run_report
from fuyou_strategy.config import resolve
from fuyou_strategy.cli import main as cli
from fuyou_strategy.doctor import diagnose
from fuyou_strategy.storage import aio, probe
from fuyou_strategy.storage.wear import Wear
from test_lightning import CausalLM, token_batches
from test_metrics import train_engine

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def train(tmp_path, steps=6, expect=None, **fields):
    """test_metrics' engine run: (engine, per-step metrics, one slot of state in bytes, summary)."""
    return train_engine(tmp_path, steps, expect=expect, **fields)


def measured(trace, lane_prefix=""):
    """{lane: [events]} of the measured process (pid 1)."""
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 1}
    lanes = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["pid"] == 1 and names[e["tid"]].startswith(lane_prefix):
            lanes.setdefault(names[e["tid"]], []).append(e)
    return lanes


@pytest.fixture(scope="module")
def planned_trace(tmp_path_factory):
    """A trace of two steps after the planner's warm-up, and the engine that wrote it."""
    tmp = tmp_path_factory.mktemp("trace")
    path = tmp / "trace.json"
    engine, *_ = train(tmp, steps=7, activations="auto", planner_warmup_steps=2, trace=str(path), trace_steps=2,
                         optimizer_schedule="backward")
    return path, engine


def test_a_trace_holds_each_lane_of_the_traced_steps_and_the_plans_prediction(planned_trace):
    path, engine = planned_trace
    trace = json.loads(path.read_text())  # Chrome / Perfetto trace JSON
    lanes = measured(trace)
    assert {"steps", "compute", "optimizer"} <= set(lanes)
    assert any(lane.startswith("ssd fuyou-io0") for lane in lanes), lanes.keys()
    steps = lanes["steps"]
    # recording starts at the step after the first planned one (warm-up 2, plan applied, one step to settle)
    assert [e["args"]["step"] for e in steps] == [4, 5]
    names = [e["name"] for e in lanes["compute"]]
    for i in (0, 1):
        assert names.count(f"forward {i}") == 2 and names.count(f"backward {i}") == 2
    assert names.count("optimizer.step()") == 2
    for e in lanes["compute"]:  # every block's compute lies inside a traced step
        if e["name"].startswith(("forward", "backward")):
            assert any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1 for s in steps), e
    # backward runs block 1 then block 0, after both forwards
    first = [e for e in lanes["compute"] if steps[0]["ts"] <= e["ts"] < steps[0]["ts"] + steps[0]["dur"]]
    order = [e["name"] for e in sorted(first, key=lambda e: e["ts"]) if e["name"].split()[0] in ("forward", "backward")]
    assert order == ["forward 0", "forward 1", "backward 1", "backward 0"]
    ssd = [e for lane, events in lanes.items() if lane.startswith("ssd") for e in events]
    assert {e["name"] for e in ssd} == {"read", "write"} and all(e["args"]["bytes"] > 0 for e in ssd)
    assert trace["otherData"]["steps"] == 2 and len(trace["otherData"]["measured_step_s"]) == 2
    # the planner's simulated step, beside the first measured one, as long as the plan predicted
    predicted = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 2]
    assert predicted and {e["cat"] for e in predicted} == {"predicted"}
    plan = engine.plan
    assert trace["otherData"]["predicted_step_s"] == plan.predicted_step_s
    start = min(e["ts"] for e in predicted)
    # the state writes of the backward schedule land behind step() (`cost.predict`): every other task is in the step
    end = max(e["ts"] + e["dur"] for e in predicted if not e["name"].startswith("write state"))
    assert start >= steps[0]["ts"] - 1  # microseconds
    if plan.profile["redo_fraction"] == 0:
        assert (end - steps[0]["ts"]) / 1e6 == pytest.approx(plan.predicted_step_s, rel=1e-6, abs=1e-6)


def test_a_trace_shows_recomputation_and_the_waits_for_activations_read_back(tmp_path):
    path = tmp_path / "t.json"
    train(tmp_path, steps=3, activations={0: "ssd", 1: "recompute"}, activation_min_bytes=0, trace=str(path),
          trace_steps=1)
    lanes = measured(json.loads(path.read_text()))
    assert [e["args"]["step"] for e in lanes["steps"]] == [2]  # after the first step, without a plan
    assert [e["name"] for e in lanes["compute"]].count("recompute 1") == 1
    assert "forward 1" in [e["name"] for e in lanes["compute"]]
    waits = [e["name"] for e in lanes["waits"]]
    assert "activations of block 0 (ssd)" in waits


def test_a_run_that_ends_inside_the_traced_steps_writes_what_it_recorded(tmp_path):
    path = tmp_path / "t.json"
    train(tmp_path, steps=3, trace=str(path), trace_steps=5)  # steps 2 and 3 recorded, then close()
    lanes = measured(json.loads(path.read_text()))
    assert [e["args"]["step"] for e in lanes["steps"]] == [2, 3]


def test_fuyou_report_prints_busy_shares_and_draws_the_timeline(planned_trace, tmp_path, capsys):
    path, engine = planned_trace
    png = tmp_path / "timeline.png"
    assert cli(["report", str(path), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "step 4" in out and "step 5" in out and "compute" in out and "ssd read" in out and "ssd write" in out
    assert "measured / predicted step:" in out and "predicted" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == PNG_MAGIC
    assert cli(["report", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_report_busy_time_merges_overlapping_requests():
    from fuyou_strategy.report import TraceReport

    r = TraceReport(measured={"ssd read": [("read", 0.0, 2.0), ("read", 1.0, 3.0), ("read", 5.0, 6.0)]},
                    steps=[("step 1", 0.0, 10.0)])
    assert r.busy("ssd read", 0.0, 10.0) == pytest.approx(4.0)  # [0, 3] and [5, 6]
    assert r.busy("ssd read", 2.5, 5.5) == pytest.approx(1.0)


def test_wear_figures_against_hand_computed_values():
    w = Wear(bytes_per_step=1.2e9, step_seconds=2.0, drives=2, drive_bytes=10**12, endurance_tbw=600, steps=10_000)
    assert w.bytes_per_hour == pytest.approx(2.16e12)  # 1.2 GB / 2 s * 3600
    assert w.drive_writes_per_day == pytest.approx(25.92)  # 2.16e12 * 24 / 2 drives / 1e12
    assert w.days_to_rated_endurance == pytest.approx(600 / 25.92)
    assert w.run_fraction == pytest.approx(0.01)  # 1.2e13 bytes / 2 drives / 6e14
    assert "25.92 drive writes per day" in w.describe() and "1.00%" in w.describe()


def test_the_wear_line_of_a_toy_run_says_its_share_first_and_that_nothing_is_to_be_done():
    """The example's 3M-parameter run on one 252 GiB drive: 112 MiB per step, 65 drive writes per day. Its 8
    steps spend a few millionths of the rating; the days to the rating come last, as the rate's context."""
    toy = Wear(bytes_per_step=112 * 2**20, step_seconds=0.6, drives=1, drive_bytes=252 * 2**30, endurance_tbw=300,
               steps=8)
    line = toy.describe(0.05)
    assert line.startswith("SSD wear: the run's 8 steps (5 s at this rate) write 896.00 MiB, 0.0003% of each "
                           "drive's rated 300 TBW (under ssd_wear_warning=0.05: nothing to do). Rate: 112.00 MiB per "
                           "step"), line
    assert line.endswith(f"continuous training at this rate would write the rated TBW in "
                         f"{toy.days_to_rated_endurance:,.0f} days") and "reached in" not in line
    long = dataclasses.replace(toy, steps=2_000_000).describe(0.05)  # 14 days at this rate: 78% of the rating
    assert long.startswith("SSD wear: the run's 2,000,000 steps (13.9 days at this rate) write 213.62 TiB, 78.29% of "
                           "each drive's rated 300 TBW (over ssd_wear_warning=0.05: see the warning)"), long
    unknown = dataclasses.replace(toy, steps=None).describe(0.05)
    assert unknown.startswith("SSD wear: 112.00 MiB per step") and "the run's length is unknown" in unknown
    assert "set ssd_endurance_tbw to your drive's datasheet figure" in unknown


def test_the_engine_reports_the_wear_line_against_its_warning_share(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="fuyou_strategy"):  # at DEBUG: nothing to act on (summary()["wear"])
        engine, *_ = train(tmp_path, steps=5, expect=10)
    (line,) = [r.getMessage() for r in caplog.records if "SSD wear" in r.getMessage()]
    assert line.startswith("fuyou: SSD wear: the run's 10 steps")
    assert "(under ssd_wear_warning=0.05: nothing to do)" in line


def test_the_engine_measures_wear_and_warns_when_a_run_would_spend_too_much(tmp_path):
    slot = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # 1 MB of rated endurance: even the optimizer state's writes of 100 steps are far over 5%
        engine, metrics, slot, summary = train(tmp_path, steps=5, expect=100, ssd_endurance_tbw=1e-6,
                                               optimizer_schedule="backward")
    wear_warnings = [w for w in caught if "rated endurance" in str(w.message)]
    assert len(wear_warnings) == 1, "warned once, at the start"
    assert "at least" in str(wear_warnings[0].message) and "ssd_endurance_tbw" in str(wear_warnings[0].message)
    assert engine.wear is not None and engine.wear.bytes_per_step == slot  # committed steps write one slot
    assert engine.wear.steps == 100 and engine.wear.run_fraction == pytest.approx(slot * 100 / 1e6)
    assert summary["wear"]["ssd_drive_writes_per_day"] == engine.wear.drive_writes_per_day
    # everything written so far (the initial state too), on one drive, against its 1e6 rated bytes
    assert metrics[-1]["fuyou/ssd_endurance_used"] == pytest.approx(summary["ssd_write_bytes_total"] / 1e6)


def test_no_wear_warning_for_a_short_run_on_a_rated_drive(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = train(tmp_path, steps=5, expect=10)
    assert not [w for w in caught if "rated endurance" in str(w.message)]
    assert engine.wear is not None and engine.wear.run_fraction < 1e-6


@pytest.mark.parametrize("field, value, fix", [
    ("trace", "/no/such/folder/t.json", "does not exist"),
    ("trace_steps", 0, "expected an int >= 1"),
    ("ssd_endurance_tbw", 0, "datasheet"),
    ("ssd_wear_warning", 1.5, "(0, 1]"),
    ("progress", "yes", "True or False"),
])
def test_bad_observability_settings_name_the_field(field, value, fix):
    with pytest.raises(ConfigError, match=rf"^{field}: got .*") as err:
        resolve(FuyouConfig(**{field: value}))
    assert fix in str(err.value)


def test_fuyou_doctor_checks_a_directory_and_recommends_a_config_that_loads(tmp_path, capsys, monkeypatch):
    reading = doctor._meminfo()  # one reading for both runs: another process's memory moves MemAvailable between them
    monkeypatch.setattr(doctor, "_meminfo", lambda: dict(reading))
    assert cli(["doctor", "--dir", str(tmp_path), "--size", "8MiB", "--cpu-probe-seconds", "0.2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    mine = {c["name"]: c for c in report["checks"] if c["subject"] == str(tmp_path)}
    assert {"free space", "filesystem", "O_DIRECT", "bandwidth"} <= set(mine)
    assert "I/O CPU cost" in {c["name"] for c in report["checks"] if c["subject"] == "cpu"}
    assert report["io_cpu"]["bytes_moved"] > 0 and report["io_cpu"]["alone_s"] > 0
    assert all(c["status"] in ("ok", "warn") for c in mine.values())
    assert {"cores", "RAM"} <= {c["name"] for c in report["checks"]}
    assert "accelerator" in {c["subject"] for c in report["checks"]}
    assert report["config"]["swap_dirs"] == [str(tmp_path)]
    assert set(report["reasons"]) == set(report["config"])
    assert str(tmp_path) in report["bandwidth"] and report["bandwidth"][str(tmp_path)]["read_bps"] > 0
    FuyouConfig.from_dict(report["config"])  # the recommendation is a valid configuration
    assert not list(tmp_path.iterdir()), "the probe's files are gone"
    # the text form: the same configuration, as YAML with a reason per line
    assert cli(["doctor", "--dir", str(tmp_path), "--size", "8MiB", "--cpu-probe-seconds", "0"]) == 0
    text = capsys.readouterr().out
    config_lines = text.split("# recommended FuyouConfig", 1)[1].split("\n", 1)[1]
    measured_again = ("optimizer_prefetch_chunks",)  # from a second bandwidth measurement
    loaded = {k: v for k, v in yaml.safe_load(config_lines).items() if k not in measured_again}
    assert loaded == {k: v for k, v in report["config"].items() if k not in measured_again}
    assert all("  # " in line for line in config_lines.strip().splitlines())


@pytest.mark.parametrize("found", [None, ("NVIDIA H200", 141 * 2**30)])
def test_fuyou_doctor_reports_only_what_applies_to_the_machine(tmp_path, monkeypatch, found):
    """Without an accelerator: no accelerator warning and no locked-memory check (nothing is pinned); with CUDA,
    the device, and the memlock limit that pinning needs."""
    monkeypatch.setattr(doctor, "accelerator", lambda: found)
    checks = diagnose([str(tmp_path)], probe_bytes=8 * 2**20, cpu_probe_seconds=0).checks
    device = [c for c in checks if c.subject in ("accelerator", "limits")]
    if found is None:
        assert [(c.name, c.status) for c in device] == [("none", "ok")], device
        assert "CPU" in device[0].detail
    else:
        assert [c.name for c in device] == ["cuda", "memlock"] and "NVIDIA H200" in device[0].detail


def test_fuyou_doctor_says_whether_the_one_pass_update_runs_here(tmp_path, monkeypatch):
    """The doctor builds (or loads) the one-pass update and says ok with what it checked, or warns naming why not."""
    from fuyou_strategy.optim import onepass

    checks = diagnose([str(tmp_path)], probe_bytes=8 * 2**20, cpu_probe_seconds=0).checks
    [check] = [c for c in checks if c.name == "one-pass update"]
    one, why = onepass.load()
    if one is not None:
        assert (check.status, check.detail) == ("ok", why)
    else:
        assert check.status == "warn" and why in check.detail
    monkeypatch.setattr(onepass, "_found", {torch.backends.cpu.get_cpu_capability(): (None, "no C++ compiler here")})
    [check] = [c for c in diagnose([str(tmp_path)], probe_bytes=8 * 2**20, cpu_probe_seconds=0).checks
               if c.name == "one-pass update"]
    assert check.status == "warn" and "no C++ compiler here" in check.detail and "torch's kernel" in check.detail


def _cost(lost_s_per_gb: float, steal: float | None) -> probe.IOCpuCost:
    """An I/O-CPU probe's result that lost ``lost_s_per_gb`` compute seconds per GB over 2 GB moved."""
    return probe.IOCpuCost("/x", 2, 2, alone_s=3.0, beside_s=3.0 + 2 * lost_s_per_gb, bytes_moved=2 * 10**9,
                           steal_share=steal, system_share=0.06)


@pytest.mark.parametrize("lost, steal, status", [(0.9, 0.26, "warn"), (0.9, None, "warn"), (0.05, 0.0, "ok")])
def test_fuyou_doctor_warns_where_swap_io_takes_the_computes_cpu(tmp_path, monkeypatch, lost, steal, status):
    """Where each GB of swap I/O costs busy cores a measured share of a second (a VM's disk emulation), the doctor
    warns, names the fixes, and says so in the host-state recommendation; where it costs little, it says ok."""
    seen = {}

    def fake(directory, **kwargs):
        seen.update(kwargs, directory=directory)
        return _cost(lost, steal)

    monkeypatch.setattr(probe, "measure_io_cpu_cost", fake)
    monkeypatch.setattr(drives, "CACHE", tmp_path / "cache" / "bandwidth.json")  # the suite's cache keeps no fake
    d = diagnose([str(tmp_path)], probe_bytes=8 * 2**20, cpu_probe_seconds=0.5)
    check = next(c for c in d.checks if c.name == "I/O CPU cost")
    assert check.status == status and seen["directory"] == str(tmp_path) and seen["seconds"] == 0.5
    # remembered for the runs on this filesystem (`RunReport` reads it), beside the bandwidth
    remembered = drives.io_cpu_cost([str(tmp_path / "cache")])
    assert remembered["io_cpu_s_per_gb"] == pytest.approx(lost) and remembered["io_cpu_steal_share"] == steal
    assert drives.measured([str(tmp_path)]) is not None
    assert f"{lost:.2f} s of compute" in check.detail and d.io_cpu["lost_s_per_gb"] == pytest.approx(lost)
    assert ("host_state" in check.detail and "state_format='bf16'" in check.detail) == (status == "warn")
    assert ("virtual machine" in check.detail) == (status == "warn" and steal is not None)
    assert (f"costs {lost:.2f} s of compute here" in d.reasons["host_state"]) == (status == "warn")
    assert not any(c.name == "I/O CPU cost" for c in diagnose([str(tmp_path)], probe_bytes=8 * 2**20,
                                                              cpu_probe_seconds=0).checks), "0 skips the probe"


def test_a_run_reports_what_its_swap_io_costs_the_compute_and_warns_from_a_share_of_the_step(tmp_path, monkeypatch,
                                                                                             caplog):
    """After the wear's sample steps a run with the state on the SSD multiplies its swap bytes per step by what
    `fuyou doctor` measured a GB to cost the compute on that filesystem, reports it with the hypervisor's steal
    share over those steps, and warns from IO_CPU_WARN_SHARE of the step; without a measurement it only reports
    the steal. The figures are the run's own: checked against its summary and metrics."""
    monkeypatch.setattr(drives, "CACHE", tmp_path / "cache" / "bandwidth.json")
    steal = iter(range(0, 10**6, 10))  # /proc/stat as a VM that steals 10 of every 100 jiffies
    monkeypatch.setattr(run_report, "cpu_times", lambda: [90 * (n := next(steal)) // 10, 0, 0, 0, 0, 0, 0, n])

    def run(name, s_per_gb):
        swap, measured_in = tmp_path / name, tmp_path / f"{name}-doctor"  # measured in another folder of the same disk
        swap.mkdir(), measured_in.mkdir()
        if s_per_gb is not None:
            drives.remember_io_cpu(drives.cache_key(measured_in), s_per_gb, 0.25)
        caplog.clear()
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG, logger="fuyou_strategy"):
            warnings.simplefilter("always")  # the figures at DEBUG (summary()["io_cpu"]); a warning from the share
            engine, metrics, slot, summary = train(swap, steps=5)
        lines = [r.getMessage() for r in caplog.records if "swap I/O" in r.getMessage()]
        return summary, metrics, lines, [str(w.message) for w in caught if "swap I/O costs" in str(w.message)]

    summary, metrics, lines, warned = run("unmeasured", None)
    moved = [m["fuyou/ssd_read_bytes"] + m["fuyou/ssd_write_bytes"] for m in metrics]
    io = summary["io_cpu"]
    assert io["bytes_per_step"] == sorted(moved[1:4])[1] > 0, "the median of the sampled steps, the first left out"
    assert io["s_per_gb"] is None and io["compute_s_per_step"] is None and not warned
    assert io["steal_share"] == pytest.approx(0.1)
    assert len(lines) == 1 and "the hypervisor took 10% of the CPU time" in lines[0] and "fuyou doctor" in lines[0]

    drives.CACHE.unlink(missing_ok=True)  # one measurement at a time: the costliest on a filesystem counts
    summary, metrics, lines, warned = run("cheap", 1e-6)  # a drive that costs the CPUs nothing to speak of
    io = summary["io_cpu"]
    assert io["s_per_gb"] == 1e-6 and io["compute_s_per_step"] == pytest.approx(io["bytes_per_step"] / 1e9 * 1e-6)
    assert 0 < io["share_of_step"] < run_report.IO_CPU_WARN_SHARE and not warned and len(lines) == 1
    assert "s of compute per GB (`fuyou doctor`" in lines[0] and io["measured_at"] in lines[0]

    drives.CACHE.unlink(missing_ok=True)  # one measurement at a time: the costliest on a filesystem counts
    summary, metrics, lines, warned = run("costly", 1e3)
    io, step_s = summary["io_cpu"], sorted(m["fuyou/step_seconds"] for m in metrics[1:4])[1]
    assert io["share_of_step"] == pytest.approx(io["compute_s_per_step"] / step_s)
    assert io["share_of_step"] >= run_report.IO_CPU_WARN_SHARE
    assert len(warned) == 1, "warned once"
    assert "host_state" in warned[0] and "state_format='bf16'" in warned[0] and "1000.00 s of compute per GB" in warned[0]
    assert f"{io['share_of_step']:.0%}" in warned[0]


def test_the_io_cpu_probe_times_compute_beside_a_real_stream_and_hands_on_its_failure(tmp_path, monkeypatch):
    cost = probe.measure_io_cpu_cost(str(tmp_path), seconds=0.2, size=32 * 2**20, window=4 * 2**20, io_threads=1)
    assert cost.alone_s > 0 and cost.beside_s > 0 and cost.bytes_moved % (4 * 2**20) == 0 and cost.bytes_moved > 0
    assert cost.lost_s_per_gb == pytest.approx((cost.beside_s - cost.alone_s) / (cost.bytes_moved / 1e9))
    assert not list(tmp_path.iterdir()), "the probe's files are gone"
    with pytest.raises(ValueError, match="^mode: got 'x'"):
        probe.measure_io_cpu_cost(str(tmp_path), mode="x")
    # the stream's thread dies on a write error after the warm-up: the caller gets that error, and no file stays
    calls = {"n": 0}
    real = aio._pwritev

    def failing(fd, buffers, offset):
        calls["n"] += 1
        if calls["n"] > 8 * 4:  # the warm-up's 8 windows of 4 one-MiB requests pass
            raise OSError(errno.EIO, "injected")
        return real(fd, buffers, offset)

    monkeypatch.setattr(aio, "_pwritev", failing)
    with pytest.raises(Exception, match="injected"):
        probe.measure_io_cpu_cost(str(tmp_path), seconds=0.2, size=32 * 2**20, window=4 * 2**20, io_threads=1)
    assert not list(tmp_path.iterdir())


def test_the_io_cpu_probe_times_compute_until_a_piece_lands_beside_it_and_refuses_a_stream_that_lands_none(
        tmp_path, monkeypatch):
    """A stream slower than one run of matmuls (a slow drive, a loaded machine): the matmuls beside it run again until
    a piece has landed, so the cost is measured beside I/O, never read as none; a stream that lands nothing within
    the probe's patience is an error the doctor reports as not measured."""
    window = 4 * 2**20
    # one piece at once, the next only after 1.5 s: none lands during the first 0.2 s of matmuls, which start at 0.5 s
    cost = probe.measure_io_cpu_cost(str(tmp_path), seconds=0.2, size=8 * window, window=window, io_threads=1,
                                     rate=window / 1.5, mode="w")
    assert cost.bytes_moved >= window and cost.beside_s > 0.5, cost
    assert cost.lost_s_per_gb == pytest.approx((cost.beside_s - cost.alone_s) / (cost.bytes_moved / 1e9))
    monkeypatch.setattr(probe, "IO_CPU_PATIENCE_S", 0.5)
    with pytest.raises(RuntimeError, match="landed no 4.00 MiB piece in .* s of matmuls beside it"):
        probe.measure_io_cpu_cost(str(tmp_path), seconds=0.2, size=8 * window, window=window, io_threads=1,
                                  rate=window / 1000, mode="w")
    assert not list(tmp_path.iterdir()), "the probe's files are gone"


def test_fuyou_doctor_fails_a_directory_it_cannot_use(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert cli(["doctor", "--dir", str(missing), "--size", "8MiB", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["config"]["swap_dirs"] is None
    assert any(c["subject"] == str(missing) and c["status"] == "fail" for c in report["checks"])


def test_progress_bars_only_on_a_terminal_and_when_enabled(monkeypatch):
    assert not progress.Progress(2**30, "x").shown  # pytest's captured stderr is no terminal
    monkeypatch.setattr(progress, "_interactive", lambda: True)
    assert not progress.Progress(2**30, "x", enabled=False).shown
    assert not progress.Progress(1024, "x").shown  # too small to be worth a bar
    with progress.Progress(2**30, "x") as bar:
        assert bar.shown
        bar.update(2**29)


def test_checkpoint_save_and_load_show_progress_on_a_terminal(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress, "_interactive", lambda: True)
    monkeypatch.setattr(progress, "MIN_BYTES", 0)
    (tmp_path / "swap").mkdir()
    torch.manual_seed(0)
    model = tiny_causal_lm("gpt2")
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters()),
                         config=FuyouConfig(swap_dirs=[str(tmp_path / "swap")], chunk_size="8KiB"))
    try:
        engine.save(str(tmp_path / "ckpt"))
        engine.load(str(tmp_path / "ckpt"))
    finally:
        engine.close()
    err = capsys.readouterr().err
    assert "fuyou: saving optimizer state" in err and "fuyou: loading optimizer state" in err


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_fuyou_callback_from_a_yaml_or_json_file(tmp_path, suffix):
    values = {"log_metrics": False, "swap_dirs": [str(tmp_path)], "activations": "auto", "ssd_endurance_tbw": 1200}
    path = tmp_path / f"fuyou{suffix}"
    path.write_text(yaml.safe_dump(values) if suffix == ".yaml" else json.dumps(values))
    cb = FuyouCallback.from_file(path)
    assert cb.log_metrics is False
    assert (cb.config.swap_dirs, cb.config.activations, cb.config.ssd_endurance_tbw) == ([str(tmp_path)], "auto", 1200)
    path.write_text(yaml.safe_dump({"activation": "auto"}) if suffix == ".yaml" else '{"activation": "auto"}')
    with pytest.raises(ConfigError, match="activation: not a FuyouConfig field; did you mean 'activations'"):
        FuyouCallback.from_file(path)
    path.write_text("{not: [valid" if suffix == ".yaml" else "{nope")
    with pytest.raises(ConfigError, match=f"not valid {'YAML' if suffix == '.yaml' else 'JSON'}"):
        FuyouCallback.from_file(path)


def test_lightning_cli_configures_the_fuyou_strategy_from_yaml(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["fit"])  # LightningCLI reads only args=
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse (the test extra installs it)")
    from lightning.pytorch.cli import LightningCLI

    from fuyou_strategy import FuyouStrategy

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 3, "logger": False, "enable_checkpointing": False,
                    "enable_progress_bar": False, "enable_model_summary": False,
                    "default_root_dir": str(tmp_path),
                    "strategy": {"class_path": "fuyou_strategy.FuyouStrategy",
                                 "init_args": {"config": {"swap_dirs": [str(tmp_path / "swap")], "chunk_size": "8KiB",
                                                          "activations": "ssd", "activation_min_bytes": 0},
                                               "log_metrics": False}}},
    }))
    (tmp_path / "swap").mkdir()
    cli_run = LightningCLI(CLIModule, args=["fit", "--config", str(config)], save_config_callback=None)
    strategy = cli_run.trainer.strategy
    strategy.engine.close()  # kept open after fit for its summary
    assert isinstance(strategy, FuyouStrategy) and strategy.log_metrics is False
    cfg = strategy.fuyou_config
    assert (cfg.swap_dirs, cfg.chunk_size, cfg.activations) == ([str(tmp_path / "swap")], 8192, "ssd")
    assert cli_run.trainer.global_step == 3


class CLIModule(CausalLM):
    """test_lightning's tiny GPT-2 with its own data, as LightningCLI builds it (no arguments)."""

    def __init__(self) -> None:
        super().__init__()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(token_batches(), batch_size=2)


def test_lightning_writes_the_trace_when_fit_ends_inside_the_traced_steps(tmp_path):
    from fuyou_strategy import FuyouStrategy
    from test_lightning import fit

    path = tmp_path / "t.json"
    strategy = FuyouStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB", trace=str(path), trace_steps=10)
    fit(strategy, steps=3)
    try:
        lanes = measured(json.loads(path.read_text()))  # written at the end of fit, the engine still open
        assert [e["args"]["step"] for e in lanes["steps"]] == [2, 3]
        # two micro-batches per step (accumulate_grad_batches=2), each block forward and backward in each
        assert [e["name"] for e in lanes["compute"]].count("forward 0") == 4
    finally:
        strategy.engine.close()


def test_under_lightnings_rich_bar_checkpoint_progress_is_a_task_of_its_display(tmp_path, monkeypatch):
    pytest.importorskip("rich")
    from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
    from lightning.pytorch.callbacks.progress.rich_progress import CustomProgress

    from fuyou_strategy import FuyouStrategy
    from test_lightning import fit

    monkeypatch.setattr(progress, "MIN_BYTES", 0)
    tasks = []
    add_task = CustomProgress.add_task
    monkeypatch.setattr(CustomProgress, "add_task",
                        lambda self, description, *a, **k: tasks.append(description) or add_task(self, description, *a, **k))
    strategy = FuyouStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB")
    fit(strategy, steps=2, enable_progress_bar=True, root=str(tmp_path / "root"),
        callbacks=[RichProgressBar(), ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1)])
    strategy.engine.close()
    assert any(t.startswith("fuyou: saving optimizer state") for t in tasks), tasks
    assert progress._display is None, "the display is given back at teardown"
