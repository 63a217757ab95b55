import json

import pytest

from fuyou_strategy import ConfigError, FuyouConfig
from fuyou_strategy.config import format_bytes, parse_bytes


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
    cfg = FuyouConfig()
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
