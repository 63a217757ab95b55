"""The `fuyou` command."""

import json

import pytest

from fuyou_strategy.cli import main


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
