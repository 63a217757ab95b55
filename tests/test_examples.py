"""The examples run end to end (tiny settings) and print their closing summary."""

import os
import re
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
TINY = ["--steps", "3", "--layers", "2", "--hidden", "32", "--seq-len", "16", "--batch-size", "2", "--vocab", "64"]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    yield
    for name in ("common", "lightning_finetune", "hf_trainer_finetune", "local_hf_finetune"):
        sys.modules.pop(name, None)


def test_lightning_example(tmp_path, capsys):
    import lightning_finetune

    lightning_finetune.main(TINY + ["--swap-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert "Lightning + FuyouStrategy: 3 optimizer steps" in out and "activations written" in out
    assert "bos_token_id" not in out + err and "eos_token_id" not in out + err, "no warning about the model's config"
    assert os.listdir(tmp_path) == [], "the swap files are removed at the end"


@pytest.mark.slow
def test_lightning_example_on_two_ranks_streaming_weights(tmp_path, capfd):
    import lightning_finetune

    lightning_finetune.main(TINY + ["--swap-dir", str(tmp_path), "--devices", "2", "--weights", "ssd",
                                    "--activations", "keep"])
    out, err = capfd.readouterr()
    assert "Lightning + FuyouStrategy on 2 ranks: 3 optimizer steps" in out, out + err[-3000:]
    assert os.listdir(tmp_path) == [], "the swap files are removed at the end"


@pytest.mark.parametrize("lora", [False, True])
def test_hf_example(tmp_path, capsys, lora):
    import hf_trainer_finetune

    hf_trainer_finetune.main(TINY + ["--swap-dir", str(tmp_path)] + (["--lora", "--lora-rank", "2"] if lora else []))
    out = capsys.readouterr().out
    assert "HF Trainer + FuyouCallback" in out and "3 optimizer steps" in out
    assert os.listdir(tmp_path) == []


def test_lightning_example_loads_a_local_model(tmp_path, capsys):
    """--model PATH: a local Hugging Face folder (here a tiny Llama saved by the test)."""
    from conftest import tiny_causal_lm

    tiny_causal_lm("llama").save_pretrained(tmp_path / "llama")
    import lightning_finetune

    lightning_finetune.main(["--model", str(tmp_path / "llama"), "--steps", "2", "--seq-len", "16", "--batch-size", "2",
                             "--swap-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "2 optimizer steps" in out
    assert sorted(os.listdir(tmp_path)) == ["llama"]


@pytest.mark.parametrize("lora", [False, True])
def test_local_folder_example_builds_its_model_tokenizer_and_text_offline(tmp_path, capsys, lora):
    import local_hf_finetune

    local_hf_finetune.main(["--steps", "3", "--seq-len", "16", "--batch-size", "2", "--lines", "200",
                            "--activations", "ssd", "--swap-dir", str(tmp_path)] + (["--lora"] if lora else []))
    out = capsys.readouterr().out
    assert "held-out loss" in out and "in 3 steps" in out
    assert ("(LoRA)" in out) == lora
    assert os.listdir(tmp_path) == []


def test_local_folder_example_trains_a_given_folder_and_text_file(tmp_path, capsys):
    import local_hf_finetune

    local_hf_finetune.write_text(str(tmp_path / "notes.txt"), lines=100, seed=1)
    local_hf_finetune.build_folder(str(tmp_path / "model"), str(tmp_path / "notes.txt"), hidden=32, layers=2)
    local_hf_finetune.main(["--model", str(tmp_path / "model"), "--data", str(tmp_path / "notes.txt"), "--steps", "2",
                            "--seq-len", "16", "--batch-size", "2", "--activations", "keep"])
    out = capsys.readouterr().out
    assert f"model {tmp_path / 'model'}" in out and "in 2 steps" in out


# What a warning looks like on stderr, anywhere in a line (a progress bar may come first): Python's (``file:line:
# SomeWarning: ...``), a logger's at WARNING (transformers' ``[transformers] ...``, ``[WARNING]``, torch's
# ``W1125 17:29:03.072000 ...``), torchao's "Failed to load".
WARNING_LINE = re.compile(r"warn|\[transformers\]|\bW\d{4} \d\d:\d\d:|Failed to load", re.IGNORECASE)


# Each example's tiny settings, and what its closing summary says.
RUNS = {"hf_trainer_finetune.py": (TINY, "3 optimizer steps"), "lightning_finetune.py": (TINY, "3 optimizer steps"),
        "local_hf_finetune.py": (["--steps", "3", "--seq-len", "16", "--batch-size", "2", "--lines", "200"],
                                 "in 3 steps")}
# What fuyou may print before the closing summary of a run with its defaults: the one line of its choices
# (`fuyou: chose io_threads=2, ...`; Lightning's logger shows it, the HF Trainer's logs it at INFO, hidden by default).
FUYOU_LINES_AT_MOST = 1


@pytest.mark.slow
@pytest.mark.parametrize("example", sorted(RUNS))
def test_an_example_prints_no_warning(tmp_path, example):
    """As a user runs it (in a subprocess, with the default warning filters) but with UserWarning and FutureWarning
    made errors: our examples' output holds no warning, only their results and progress; and before the closing
    summary at most `FUYOU_LINES_AT_MOST` line of fuyou's own."""
    args, done = RUNS[example]
    cmd = [sys.executable, "-W", "error::UserWarning", "-W", "error::FutureWarning", os.path.join(EXAMPLES, example),
           *args, "--swap-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert done in proc.stdout
    lines = [line for line in proc.stderr.replace("\r", "\n").splitlines() if WARNING_LINE.search(line)]
    assert lines == [], "\n".join(lines)
    before_summary = proc.stdout[:proc.stdout.index(done)].splitlines() + proc.stderr.splitlines()
    ours = [line for line in before_summary if "fuyou:" in line or "fuyou planner:" in line]
    assert len(ours) <= FUYOU_LINES_AT_MOST and all(len(line) <= 160 for line in ours), ours
    assert "fuyou/" not in proc.stdout + proc.stderr, "no per-step metric dicts or progress-bar keys of fuyou's"
