import dataclasses
import json

import pytest

from fuyou_strategy import ConfigError, FuyouConfig
from fuyou_strategy.config import format_bytes, parse_bytes, resolve


@pytest.mark.parametrize("text,expected", [
    (4096, 4096), ("4KiB", 4096), ("1.5GB", 1_500_000_000), ("8GiB", 8 * 2**30), (" 2 MiB ", 2 * 2**20), ("512", 512),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["8XB", "-1GiB", "", True, [1]])
def test_parse_bytes_rejects_and_names_the_field(bad):
    with pytest.raises(ConfigError, match="^host_memory_budget: got"):
        parse_bytes(bad, name="host_memory_budget")


def test_defaults_are_valid_and_normalised(monkeypatch):
    import fuyou_strategy.config as config_module

    monkeypatch.setattr(config_module, "available_memory", lambda: 20 * 2**30)
    cfg = resolve(FuyouConfig()).config
    assert cfg.swap_dirs is None
    assert cfg.host_memory_budget == 10 * 2**30, "host_memory_budget='auto': half the available RAM"
    assert cfg.host_state == "auto"
    assert cfg.chunk_size == 16 * 2**20 and cfg.io_block_size == 2**20


@pytest.mark.parametrize("field,value,fix", [
    ("chunk_size", "5000", "multiple of 4 KiB"),
    ("io_block_size", 0, "multiple of 4 KiB"),
    ("io_threads", 0, "from 1 to 64"),
    ("direct_io", "maybe", "'auto', 'on' or 'off'"),
    ("swap_dirs", [], "at least one directory"),
    ("host_memory_budget", "1KiB", "at least one"),
])
def test_bad_values_name_field_value_and_fix(field, value, fix):
    with pytest.raises(ConfigError) as info:
        FuyouConfig(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{field}: ") and (repr(value) in message or str(value) in message)
    assert fix in message


def test_chunk_larger_than_host_budget_is_refused():
    with pytest.raises(ConfigError, match="chunk_size: .* larger than host_memory_budget"):
        FuyouConfig(chunk_size="64MiB", host_memory_budget="32MiB")


def test_duplicate_swap_dir_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="listed twice"):
        FuyouConfig(swap_dirs=[str(tmp_path), str(tmp_path) + "/"])


def test_single_swap_dir_string_becomes_list(tmp_path):
    assert FuyouConfig(swap_dirs=str(tmp_path)).swap_dirs == [str(tmp_path)]


def test_from_dict_suggests_the_closest_field():
    with pytest.raises(ConfigError, match="host_memory_budgt: not a FuyouConfig field; did you mean 'host_memory_budget'"):
        FuyouConfig.from_dict({"host_memory_budgt": "1GiB"})


def test_from_json_and_yaml(tmp_path):
    values = {"host_memory_budget": "64MiB", "chunk_size": "4MiB", "io_threads": 2}
    (tmp_path / "c.json").write_text(json.dumps(values))
    (tmp_path / "c.yaml").write_text("host_memory_budget: 64MiB\nchunk_size: 4MiB\nio_threads: 2\n")
    for name in ("c.json", "c.yaml"):
        cfg = FuyouConfig.from_file(tmp_path / name)
        assert (cfg.host_memory_budget, cfg.chunk_size, cfg.io_threads) == (64 * 2**20, 4 * 2**20, 2)
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(ConfigError, match="expected a .json, .yaml or .yml"):
        FuyouConfig.from_file(tmp_path / "c.toml")


def test_format_bytes():
    assert format_bytes(3 * 2**30) == "3.00 GiB" and format_bytes(10) == "10 B"


def test_to_dict_round_trips_through_from_dict(tmp_path):
    cfg = FuyouConfig(swap_dirs=[str(tmp_path)], host_memory_budget="64MiB", activations={0: "ssd", 2: "recompute"})
    assert FuyouConfig.from_dict(cfg.to_dict()) == cfg
    assert json.loads(json.dumps(cfg.to_dict()))["host_memory_budget"] == 64 * 2**20


def test_the_optimizers_read_ahead_defaults_to_two_chunks_per_drive_and_a_number_is_kept(tmp_path):
    """``optimizer_prefetch_chunks="auto"``: 4 with one swap directory (the value before "auto"), two more per
    further directory, at most 8, chosen again when a copy changes the directories; the depth the optimizer
    reads ahead follows (within the budget); a number, 0 or a string other than "auto" as before."""
    from fuyou_strategy.config import auto_prefetch_chunks
    from fuyou_strategy.storage import host_budget_split

    dirs = [tmp_path / str(i) for i in range(4)]
    for d in dirs:
        d.mkdir()
    one = FuyouConfig(swap_dirs=[str(dirs[0])], host_memory_budget="1GiB", chunk_size="1MiB")
    assert resolve(one).config.optimizer_prefetch_chunks == 4 == auto_prefetch_chunks(1)[0]
    assert resolve(one).choices["optimizer_prefetch_chunks"] == (4, auto_prefetch_chunks(1)[1])
    assert "(1 here)" in auto_prefetch_chunks(1)[1]
    assert resolve(FuyouConfig(host_memory_budget="1GiB")).config.optimizer_prefetch_chunks == 4, \
        "a temporary folder: one drive"
    two = one.replace(swap_dirs=[str(d) for d in dirs[:2]])
    assert resolve(two).config.optimizer_prefetch_chunks == 6 and resolve(two).choices["optimizer_prefetch_chunks"][0] == 6
    assert resolve(FuyouConfig.merge(one, swap_dirs=[str(d) for d in dirs])).config.optimizer_prefetch_chunks == 8, \
        "at most 8"
    assert host_budget_split(two).optimizer_depth == 6 > host_budget_split(one).optimizer_depth == 4
    fixed = FuyouConfig(swap_dirs=[str(d) for d in dirs[:2]], optimizer_prefetch_chunks=3, host_memory_budget="1GiB")
    assert resolve(fixed).config.optimizer_prefetch_chunks == 3 and "optimizer_prefetch_chunks" not in resolve(fixed).choices
    assert resolve(fixed.replace(swap_dirs=[str(dirs[0])])).config.optimizer_prefetch_chunks == 3, \
        "a number stays through copies"
    for bad in (0, "many", True):
        with pytest.raises(ConfigError, match=r"optimizer_prefetch_chunks: got .*; expected 'auto' or an int >= 1"):
            FuyouConfig(optimizer_prefetch_chunks=bad, host_memory_budget="1GiB")


def test_the_read_ahead_follows_the_drives_measured_speed_once_it_is_cached(tmp_path, monkeypatch, capsys):
    """``optimizer_prefetch_chunks="auto"`` times the drives when the planner's probe or `fuyou doctor` measured
    them (the bandwidth cache, `drives`): ~20 ms of the slowest drive in flight plus a double buffer, at least 2,
    at most 8; by their number until then; `fuyou doctor` measures, caches, and recommends what "auto" takes."""
    from fuyou_strategy import drives
    from fuyou_strategy.cli import main as cli
    from fuyou_strategy.config import auto_prefetch_chunks

    monkeypatch.setattr(drives, "CACHE", tmp_path / "cache" / "bandwidth.json")
    fast, slow, probed = tmp_path / "fast", tmp_path / "slow", tmp_path / "probed"
    for d in (fast, slow, probed):
        d.mkdir()

    def auto(*dirs):
        settings = resolve(FuyouConfig(swap_dirs=[str(d) for d in dirs], host_memory_budget="1GiB"))
        return settings.config.optimizer_prefetch_chunks, settings.choices["optimizer_prefetch_chunks"][1]

    chunks, why = auto(fast)
    assert chunks == 4 and "not measured yet" in why, "unmeasured: by the number of drives, as before"
    assert "temporary swap folder is new every run" in resolve(FuyouConfig(host_memory_budget="1GiB")).choices[
        "optimizer_prefetch_chunks"][1]
    drives.remember(drives.cache_key(fast), {"read_bps": 7e9, "write_bps": 6e9})
    drives.remember(drives.cache_key(slow), {"read_bps": 0.9e9, "write_bps": 0.5e9})
    chunks, why = auto(fast)
    assert chunks == 8 and "6.00 GB/s" in why, "6 GB/s x 20 ms is 7 chunks of 16 MiB: deeper than by count, capped"
    assert auto(slow)[0] == 2, "0.5 GB/s x 20 ms is under one chunk: the double buffer"
    assert auto(fast, slow)[0] == auto_prefetch_chunks(2, 16 * 2**20, 0.5e9)[0] == 3, "the slowest drive sets the pace"
    assert auto(fast, probed)[0] == 6, "one drive unmeasured: by count"
    assert resolve(FuyouConfig(swap_dirs=[str(fast)], optimizer_prefetch_chunks=3,
                               host_memory_budget="1GiB")).config.optimizer_prefetch_chunks == 3, "a number is kept"
    assert cli(["doctor", "--dir", str(probed), "--size", "8MiB", "--cpu-probe-seconds", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rate = report["bandwidth"][str(probed)]
    measured = auto_prefetch_chunks(1, 16 * 2**20, min(rate["read_bps"], rate["write_bps"]))[0]
    assert drives.measured([probed]) is not None, "the doctor's measurement is cached"
    assert auto(probed)[0] == measured
    assert report["config"]["optimizer_prefetch_chunks"] == "auto"
    assert report["reasons"]["optimizer_prefetch_chunks"].startswith(f"takes {measured}:")


def test_auto_defaults_fit_the_machine_are_announced_once_by_the_engine_and_numbers_stay_hard(tmp_path, monkeypatch,
                                                                                             caplog):
    """``io_threads`` and ``host_memory_budget`` default to ``"auto"``: a config keeps ``"auto"`` through
    ``replace``/``merge`` copies and is resolved once from the machine (`resolve`, at the engine's start), announced in one short line through the ``report`` the integration
    passes (Lightning's rank-zero logger, the Trainer's logger), each with its reason at DEBUG and in
    ``summary()["choices"]``; an explicit number is kept and not announced."""
    import os

    import torch

    import fuyou_strategy.config as config_module
    from fuyou_strategy import FuyouEngine
    from fuyou_strategy.config import auto_io_threads

    monkeypatch.setattr(config_module, "available_memory", lambda: 20 * 1024**3)
    cores = os.cpu_count() or 1
    auto = FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB")
    resolved = resolve(auto).config
    assert resolved.io_threads == min(4, cores) == auto_io_threads(cores)[0]
    assert set(resolve(auto).choices) == {"host_memory_budget", "io_threads", "optimizer_prefetch_chunks"}
    assert auto_io_threads(64)[0] == 4 and auto_io_threads(1)[0] == 1
    copy = FuyouConfig.merge(auto, activations="keep")
    assert set(resolve(copy).choices) == {"host_memory_budget", "io_threads", "optimizer_prefetch_chunks"}, \
        "carried through copies"
    fixed = auto.replace(io_threads=3)
    assert resolve(fixed).config.io_threads == 3 \
        and set(resolve(fixed).choices) == {"host_memory_budget", "optimizer_prefetch_chunks"}, "a number is hard"
    said = []
    model = torch.nn.Linear(4, 4)
    with caplog.at_level("DEBUG", logger="fuyou_strategy"):  # each choice's reason, at DEBUG
        engine = FuyouEngine(model, torch.optim.AdamW(model.parameters()), config=auto, report=said.append)
    debug = caplog.text
    try:
        # the framework's logger gets one short line of the choices; the reasons go to DEBUG and summary()
        from fuyou_strategy.config import auto_optimizer_threads
        from fuyou_strategy.device import usable_cores
        took, why = auto_optimizer_threads(True, usable_cores(), torch.get_num_threads())
        chose = [m for m in said if m.startswith("fuyou: chose ")]
        assert len(chose) == 1 and len(chose[0]) <= 160, chose
        assert f"io_threads={resolved.io_threads}" in chose[0] and "host_memory_budget=10.00GiB" in chose[0]
        assert f"optimizer_threads={took}" in chose[0] and not [m for m in said if "='auto' took" in m]
        assert debug.count(f"fuyou: io_threads='auto' took {resolved.io_threads}: {auto_io_threads(cores)[1]}") == 1
        assert debug.count("fuyou: host_memory_budget='auto' took 10.00 GiB: 50% of") >= 1
        # resolved by the optimizer, from where the model computes (the CPU here)
        assert f"fuyou: optimizer_threads='auto' took {took}: {why}" in debug
        choices = engine.summary()["choices"]
        assert choices["io_threads"] == {"value": resolved.io_threads, "why": auto_io_threads(cores)[1]}
        assert choices["optimizer_threads"] == {"value": took, "why": why}
        assert engine.summary()["optimizer_threads"] == took and engine.summary()["optimizer_threads_reason"] == why
    finally:
        engine.close()
    said.clear()
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters()), config=FuyouConfig(
        swap_dirs=[str(tmp_path)], chunk_size="8KiB", io_threads=2, host_memory_budget="64MiB",
        optimizer_prefetch_chunks=4, optimizer_threads=1), report=said.append)
    engine.close()
    assert not [m for m in said if "='auto' took" in m or "io_threads=" in m or "host_memory_budget=" in m]


def test_placement_left_unset_is_decided_from_the_device_and_a_value_given_stays():
    """``activations`` and ``weights`` left unset (``None``): the planner where the device's memory is bounded,
    the weights with it in one process; every value given is kept (`placement_defaults`, issue 27)."""
    import torch

    from fuyou_strategy.config import placement_defaults

    def placed(device, ranks=1, **fields):
        config, said = placement_defaults(FuyouConfig(host_memory_budget="64MiB", **fields), torch.device(device), ranks)
        return config.activations, config.weights, said

    activations, weights, said = placed("cuda:0")
    assert (activations, weights) == ("auto", "auto")
    assert said[0].startswith("fuyou: activations (unset) took 'auto': the memory of cuda:0 is bounded: the planner")
    assert said[1].startswith("fuyou: weights (unset) took 'auto'")
    activations, weights, said = placed("cuda:0", ranks=2)
    assert (activations, weights) == ("auto", "device") and "with 2 ranks" in said[1], "DDP keeps its overlap"
    assert placed("cpu")[:2] == ("keep", "device")
    assert placed("cpu", device_memory_budget="1GiB")[:2] == ("auto", "auto")
    assert placed("cpu", weights="auto")[:2] == ("auto", "auto"), "weights='auto' asks for the planner"
    activations, weights, said = placed("cuda:0", weights="ssd")
    assert (activations, weights) == ("keep", "ssd") and "weights='ssd'" in said[0], "placed by hand"
    assert placed("cuda:0", activations="keep") == ("keep", "device", []), "a value given is kept, silently"
    assert placed("cuda:0", activations="ssd", weights="host") == ("ssd", "host", [])


@pytest.mark.parametrize("value", [0, -1, "two", True, 2.0, 1025])
def test_optimizer_threads_must_be_auto_or_a_count(value):
    with pytest.raises(ConfigError, match=r"^optimizer_threads: got .*expected 'auto' or an int from 1 to 1024"):
        FuyouConfig(optimizer_threads=value)


def test_auto_optimizer_threads_leaves_the_training_threads_their_cores():
    from fuyou_strategy.config import auto_optimizer_threads
    assert auto_optimizer_threads(True, 2, 2)[0] == 1  # this project's CPUs: the training thread has both cores
    assert auto_optimizer_threads(True, 16, 4)[0] == 12  # a user who gave training 4 of 16 threads
    assert auto_optimizer_threads(True, 8, 16)[0] == 1  # never fewer than one
    threads, why = auto_optimizer_threads(False, 16, 16)
    assert threads is None and "accelerator" in why  # on a GPU host the cores are the worker's


def test_the_readme_says_where_the_state_lives_by_default_as_fuyouconfig_does(tmp_path):
    """The README's paragraph on the defaults: each `field=value` it names is FuyouConfig's default (but
    ``host_state=0``, which it tells a user to set for the whole state on the SSD), its figures are the rule
    "auto" applies, and a default run keeps a state that fits in RAM and none of it on the SSD."""
    import re
    from pathlib import Path

    import torch

    from fuyou_strategy import FuyouEngine
    from fuyou_strategy.config import auto_host_budget

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    paragraph = readme[readme.index("By default AdamW"):].split("\n\n", 1)[0]
    defaults = {name: f.default for name, f in FuyouConfig.__dataclass_fields__.items()}
    named = re.findall(r"`(\w+)=([^`]+)`", paragraph)
    assert ("host_state", '"auto"') in named and ("host_memory_budget", '"auto"') in named
    for name, value in named:
        if (name, value) != ("host_state", "0"):
            assert value == repr(defaults[name]).replace("'", '"'), (name, value, defaults[name])
    assert defaults["state_format"] == "fp32" and "fp32 master weights and both moments stay in host RAM" in paragraph
    assert defaults["swap_dirs"] is None and "(default: a temporary folder)" in paragraph
    GiB = 2**30  # "half the RAM available at start, at least 4 GiB left to the rest"
    assert "half the RAM available at start, at least 4 GiB left" in paragraph
    assert auto_host_budget(20 * GiB)[0] == 10 * GiB and auto_host_budget(6 * GiB)[0] == 2 * GiB
    # "only what does not fit goes to the SSD": a default run of a small model writes none of its state there
    model = torch.nn.Linear(64, 64)
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), fused=True),
                         config=FuyouConfig(swap_dirs=[str(tmp_path)]), report=lambda _line: None)
    try:
        engine.begin_micro_batch(update=True)
        model(torch.randn(4, 64)).square().mean().backward()
        engine.optimizer.step()
        summary = engine.summary()
        assert summary["ssd_bytes_optimizer_state"] == 0 and summary["host_bytes_optimizer_state"] > 0
    finally:
        engine.close()


def test_constructing_a_config_reads_no_file_and_no_proc(tmp_path, monkeypatch):
    """A `FuyouConfig` is a value: constructing, copying and merging one validate its fields and read nothing of
    the machine (no ``/proc/meminfo``, no drive cache, no plan file, no stat of a folder); `resolve` reads the
    machine, once, and reports there what only it can tell (a plan file that is missing)."""
    import builtins
    import io
    import os

    calls = []

    def refuse(name, real):
        def call(*args, **kwargs):
            calls.append((name, args[:1]))
            return real(*args, **kwargs)
        return call

    for module, names in ((builtins, ["open"]), (io, ["open"]),
                          (os, ["open", "stat", "lstat", "scandir", "listdir", "access"])):
        for name in names:
            monkeypatch.setattr(module, name, refuse(f"{module.__name__}.{name}", getattr(module, name)))
    plan, trace = str(tmp_path / "missing-plan.json"), str(tmp_path / "missing" / "trace.json")
    fields = dict(swap_dirs=[str(tmp_path / "a"), str(tmp_path / "b")], plan=plan, trace=trace,
                  activations={0: "ssd"}, weights="device", state_slots=1, optimizer_schedule="next_forward")
    config = FuyouConfig(**fields)
    copy = config.replace(io_threads=2)
    merged = FuyouConfig.merge({"host_memory_budget": "2GiB", "chunk_size": "8MiB"}, io_threads=3)
    FuyouConfig()
    assert calls == [], calls
    assert (config.host_memory_budget, config.io_threads, config.optimizer_prefetch_chunks) == ("auto",) * 3
    assert copy.io_threads == 2 and merged.host_memory_budget == 2 * 2**30 and merged.io_threads == 3
    with pytest.raises(dataclasses.FrozenInstanceError):  # a value: a changed field is a new config (`replace`)
        config.io_threads = 2
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="^plan: "):
        resolve(config)
