"""FuyouAdamW checkpoints: exact resume, layout independence, checksums, refusals."""

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import decay_groups, kill_at_every_step, killed_before_fs_change, tiny_causal_lm
from fuyou_strategy import FuyouAdamW
from fuyou_strategy.cli import main as fuyou_main
from fuyou_strategy.optim.checkpoint import CheckpointError, newest
from test_optimizer import batches, lm_loss, small_config


def run(model, opt, steps, start=0):
    for step in range(start, start + steps):
        (lm_loss(model, batches(step, 0)) * (1.0 if step % 2 else 0.01)).backward()
        opt.step()
        opt.zero_grad()


def make(tmp_path, model, name, **cfg):
    (tmp_path / name).mkdir(exist_ok=True)
    return FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=0.5, config=small_config(tmp_path / name, **cfg))


@pytest.mark.parametrize("chunk_on_resume", ["24KiB", "48KiB"])
def test_resume_from_a_checkpoint_is_exact(tmp_path, chunk_on_resume):
    model = tiny_causal_lm("llama")
    straight = copy.deepcopy(model)
    opt = make(tmp_path, model, "a")
    run(model, opt, 3)
    sd = opt.state_dict(tmp_path / "ckpt")
    weights = copy.deepcopy(model.state_dict())
    opt.close()

    resumed = tiny_causal_lm("llama", seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(weights)
    opt2 = make(tmp_path, resumed, "b", chunk_size=chunk_on_resume)  # another chunk layout on SSD
    opt2.load_state_dict(sd)
    run(resumed, opt2, 3, start=3)

    opt3 = make(tmp_path, straight, "c")
    run(straight, opt3, 6)
    for p, q in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(resumed.parameters(), straight.parameters()):
        a, b = opt2.read_state(p), opt3.read_state(q)
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert opt2.state[next(resumed.parameters())]["step"].item() == 6
    opt2.close()
    opt3.close()


def test_corrupt_checkpoint_is_refused_and_changes_nothing(tmp_path):
    model = tiny_causal_lm("gpt2")
    opt = make(tmp_path, model, "a")
    run(model, opt, 2)
    sd = opt.state_dict(tmp_path / "ckpt")
    run(model, opt, 1, start=2)  # move on, so loading would visibly change things
    before = [p.detach().clone() for p in model.parameters()]
    state_before = opt.read_state(next(model.parameters()))
    path = newest(tmp_path / "ckpt") / "exp_avg.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in exp_avg.bin parameter \d+; nothing was loaded"):
        opt.load_state_dict(sd)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    after = opt.read_state(next(model.parameters()))
    assert all(torch.equal(after[k], state_before[k]) for k in after)
    opt.close()


def test_state_dict_without_folder_cannot_resume_silently(tmp_path):
    model = tiny_causal_lm("gpt2")
    opt = make(tmp_path, model, "a")
    run(model, opt, 1)
    sd = opt.state_dict()
    assert sd["fuyou"]["folder"] is None and sd["param_groups"][0]["lr"] == 3e-3
    with pytest.raises(CheckpointError, match="holds no SSD state .*state_dict\\(folder\\)"):
        opt.load_state_dict(sd)
    with pytest.raises(CheckpointError, match="does not record which save in .* it belongs to"):
        opt.load_state_dict({"fuyou": {"folder": str(tmp_path)}, "state": {}, "param_groups": []})
    with pytest.raises(CheckpointError, match=r"no saved optimizer state \(no <token>/optimizer.json inside\)"):
        opt.load_folder(tmp_path)
    other = make(tmp_path, torch.nn.Linear(3, 3), "b")
    sd = opt.state_dict(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="holds .* parameters, the optimizer has 2"):
        other.load_state_dict(sd)
    opt.close()
    other.close()


@pytest.mark.parametrize("tier", [{}, dict(host_memory_budget="4MiB", host_state="3MiB"),
                                  dict(device_state="4MiB", host_state=0)], ids=["as-is", "ram", "device"])
def test_zero_grad_between_backward_and_step_discards_the_update(tmp_path, tier):
    """Also the speculative updates of state in RAM or on the device tier held for a grouped job, never queued
    (`Updater.drop`)."""
    model = tiny_causal_lm("gpt2")
    before = [p.detach().clone() for p in model.parameters()]
    opt = make(tmp_path, model, "a", optimizer_schedule="backward", **tier)
    lm_loss(model, batches(0, 0)).backward()  # updates run speculatively during backward
    with pytest.raises(RuntimeError, match="between backward and step"):
        opt.state_dict(tmp_path / "x")
    opt.zero_grad()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.step()  # nothing queued: a no-op
    assert opt.stats.commits == 0 and opt.stats.redos == 0
    opt.close()


def test_a_state_dict_whose_save_was_replaced_is_refused(tmp_path):
    """A state dict kept from an earlier save of the same folder (the newer one's dict was lost,
    e.g. the process died before writing it) does not silently load the newer state."""
    model = tiny_causal_lm("gpt2")
    opt = make(tmp_path, model, "a")
    run(model, opt, 2)
    sd = opt.state_dict(tmp_path / "ckpt")
    run(model, opt, 1, start=2)
    opt.state_dict(tmp_path / "ckpt")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=r"this state dict belongs to optimizer save \w{8} \(step 2\), but "
                       r".*ckpt holds save \w{8} \(step 3\): this state dict is stale.*optimizer.load_folder\(folder\)"):
        opt.load_state_dict(sd)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "nothing was loaded"
    assert opt.state[next(model.parameters())]["step"].item() == 3
    opt.close()


def linear_training(root, seed=0):
    """A small linear model, its FuyouAdamW (swap in ``root/swap``) and one training step."""
    Path(root).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    opt = make(root, model, "swap")

    def step(i):
        data = torch.randn(4, 32, generator=torch.Generator().manual_seed(i))
        model(data).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def save_twice_killed_at(root, k):
    """Save after one step and again after a second one into the same folder, killed before the
    k-th file-system change of that second save (run by `kill_at_every_step`)."""
    root = Path(root)
    model, opt, step = linear_training(root)
    step(0)
    opt.state_dict(root / "ckpt")
    step(1)
    with killed_before_fs_change(k):
        opt.state_dict(root / "ckpt")
    opt.close()


def snapshot(model, opt):
    return [(p.detach().clone(), opt.read_state(p)) for p in model.parameters()]


def same(a, b):
    return all(torch.equal(p, q) and all(torch.equal(s[k], t[k]) for k in s) for (p, s), (q, t) in zip(a, b))


@pytest.mark.slow
def test_a_kill_at_any_step_of_a_save_leaves_a_complete_save(tmp_path):
    """Killed between any two steps of overwriting a checkpoint folder, the folder still holds
    a complete save: the old one or the new one; `fuyou clean` removes what the kill left."""
    killed = kill_at_every_step(tmp_path, "test_optimizer_checkpoint", "save_twice_killed_at")
    model, opt, step = linear_training(tmp_path)
    saved = []
    for i in range(2):
        step(i)
        saved.append(snapshot(model, opt))
    opt.close()
    resumed_from = []
    for root in killed:
        model, opt, _ = linear_training(root / "resume", seed=1)
        with opt:
            opt.load_folder(root / "ckpt")
            resumed_from += [i for i, state in enumerate(saved) if same(snapshot(model, opt), state)]
    assert len(resumed_from) == len(killed), "every kill left one of the two saves"
    assert resumed_from == sorted(resumed_from) and set(resumed_from) == {0, 1}, "the old one until the new one is in"
    argv = ["clean", "--dir", str(tmp_path / "killed")] + [a for r in killed for a in ("--dir", str(r / "swap"))]
    assert fuyou_main(argv) == 0
    assert not [p for p in (tmp_path / "killed").rglob("*") if ".tmp-" in p.name or p.name.startswith("fuyou-run-")]


def _edit_meta(save, old, new):
    meta = save / "optimizer.json"
    text = meta.read_text()
    assert old in text, old
    meta.write_text(text.replace(old, new, 1))
    return meta


@pytest.mark.parametrize("field", ["lr", "weight_decay", "step"])
def test_a_changed_value_in_optimizer_json_is_refused_naming_the_file(tmp_path, field):
    """One digit of ``lr``, ``weight_decay`` or a parameter's ``step`` changed by hand (or by bit rot):
    the metadata's own checksum refuses it, through `load_state_dict` and `load_folder`, and nothing loads."""
    model = tiny_causal_lm("gpt2")
    opt = make(tmp_path, model, "a")
    run(model, opt, 2)
    sd = opt.state_dict(tmp_path / "ckpt")
    run(model, opt, 1, start=2)
    before = [p.detach().clone() for p in model.parameters()]
    old = {"lr": '"lr": 0.003', "weight_decay": '"weight_decay": 0.1', "step": '"step": 2.0'}[field]
    meta = _edit_meta(newest(tmp_path / "ckpt"), old, old[:-1] + str(int(old[-1]) + 1))
    for load in (lambda: opt.load_state_dict(sd), lambda: opt.load_folder(tmp_path / "ckpt")):
        with pytest.raises(CheckpointError, match=rf"{meta}: its contents do not match the checksum written with them"):
            load()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "nothing was loaded"
    assert opt.state[next(model.parameters())]["step"].item() == 3
    opt.close()


def test_a_state_file_of_another_size_is_refused(tmp_path):
    """Bytes appended to ``master.bin`` (or a file from another save): refused before a byte is read."""
    model = tiny_causal_lm("gpt2")
    opt = make(tmp_path, model, "a")
    run(model, opt, 2)
    opt.state_dict(tmp_path / "ckpt")
    master = newest(tmp_path / "ckpt") / "master.bin"
    size = master.stat().st_size
    with open(master, "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(CheckpointError, match=rf"{master}: {size + 16} bytes, but the save's optimizer.json records "
                                              rf"{size} \(\d+ parameters\)"):
        opt.load_folder(tmp_path / "ckpt")
    opt.close()


def test_an_earlier_format_without_a_metadata_checksum_still_loads(tmp_path, caplog):
    model, opt, expected = resaved_as(tmp_path, 2)
    opt.load_folder(tmp_path / "ckpt")
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))
    assert any("no checksum" in r.getMessage() for r in caplog.records), "said once"
    opt.close()


def test_a_format_3_save_still_loads(tmp_path):
    """The format before per-file offsets (every file fp32 at one offset per parameter) loads exactly."""
    model, opt, expected = resaved_as(tmp_path, 3)
    opt.load_folder(tmp_path / "ckpt")
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))
    opt.close()


def resaved_as(tmp_path, fmt: int):
    """Train 2 steps and save; rewrite the save's optimizer.json as format ``fmt`` wrote it (3: one byte offset
    per parameter for every file, 4 bytes per element, no per-file offsets and sizes, no list of files; 2: also
    without its checksum); train one more step. Returns the model, the optimizer and the saved weights."""
    from fuyou_strategy.optim.checkpoint import _meta_digest

    model = tiny_causal_lm("gpt2")
    opt = make(tmp_path, model, "a")
    run(model, opt, 2)
    opt.state_dict(tmp_path / "ckpt")
    meta = newest(tmp_path / "ckpt") / "optimizer.json"
    values = json.loads(meta.read_text())
    assert values["format"] == 4 and values["state_format"] == "fp32"
    values = {k: v for k, v in values.items() if k not in ("kinds", "meta_sha256")}
    values["params"] = [dict({k: v for k, v in pm.items() if k not in ("offsets", "bytes")},
                             offset=pm["offsets"]["master"]) for pm in values["params"]]
    values["format"] = fmt
    if fmt == 3:
        values["meta_sha256"] = _meta_digest(values)
    meta.write_text(json.dumps(values))
    expected = [p.detach().clone() for p in model.parameters()]
    run(model, opt, 1, start=2)
    return model, opt, expected


def save_killed_before_its_rename(root, k):
    """Save once, then again killed just before the second save's folder is renamed into place: its
    ``<token>.tmp-<pid>/`` holds a full copy of the state (run by `killed_once`)."""
    root = Path(root)
    model, opt, step = linear_training(root)
    step(0)
    opt.state_dict(root / "ckpt")
    step(1)
    original = os.rename

    def rename(src, dst, *args, **kwargs):
        if ".tmp-" in os.fspath(src):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(src, dst, *args, **kwargs)

    os.rename = rename
    opt.state_dict(root / "ckpt")


def killed_once(root, scenario):
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                          f"import test_optimizer_checkpoint as m; m.{scenario}({str(root)!r}, 0)"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == -signal.SIGKILL, out.stderr


@pytest.mark.parametrize("then", ["save", "load"])
def test_a_killed_saves_temporary_folder_is_removed_by_the_next_save_or_load(tmp_path, then, caplog):
    killed_once(tmp_path, "save_killed_before_its_rename")
    (temp,) = [p for p in (tmp_path / "ckpt").iterdir() if ".tmp-" in p.name]
    assert {p.name for p in temp.iterdir()} >= {"master.bin", "optimizer.json"}, "a full copy of the state"
    model, opt, step = linear_training(tmp_path)  # the resumed run: its swap dir is the killed one's
    with opt:
        opt.load_folder(tmp_path / "ckpt") if then == "load" else opt.state_dict(tmp_path / "ckpt")
        assert not temp.exists()
        assert any(temp.name in r.getMessage() and "interrupted checkpoint save" in r.getMessage()
                   for r in caplog.records), "a warning names it"
        assert [p.name.startswith("fuyou-run-") for p in (tmp_path / "swap").iterdir()] == [True], \
            "the killed run's swap directory went too"


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("fmt", [2, 3, 4])
def test_a_checkpoint_written_by_an_earlier_version_still_loads(tmp_path, fmt):
    """Committed saves of a small model after 3 steps, written by the version that landed before issue 23
    (format 2), by the one before the optimizer's redesign (format 3) and by the one before the seam's
    redesign (format 4, commit 3cc5786), with the weights, masters, moments and step counts they held: all of
    it comes back bitwise."""
    fixture = FIXTURES / f"checkpoint-format{fmt}"
    shutil.copytree(fixture / "ckpt", tmp_path / "ckpt")  # a load tidies its folder: never the committed one
    expected = torch.load(fixture / "expected.pt")
    torch.manual_seed(123)  # other initial weights: everything must come from the checkpoint
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8))
    (tmp_path / "swap").mkdir()
    with FuyouAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=1.0,
                    config=small_config(tmp_path / "swap")) as opt:
        meta = opt.load_folder(tmp_path / "ckpt")
        assert meta["format"] == fmt
        for name, p in model.state_dict().items():
            assert torch.equal(p, expected["weights"][name]), name
        for p, state, step in zip(model.parameters(), expected["state"], expected["steps"]):
            got = opt.read_state(p)
            assert all(torch.equal(got[k], state[k]) for k in state)
            assert float(opt.state[p]["step"]) == step


def test_an_optimizer_json_copied_from_another_save_is_refused(tmp_path):
    """A save's metadata names its own save (the folder's token): one copied in from another save, whole and with a
    valid checksum, is refused rather than read against this save's bytes."""
    from fuyou_strategy.optim.checkpoint import META

    model = tiny_causal_lm("gpt2")
    opt = make(tmp_path, model, "a")
    run(model, opt, 1)
    opt.state_dict(tmp_path / "one")
    run(model, opt, 1, start=1)
    opt.state_dict(tmp_path / "two")
    first, second = newest(tmp_path / "one"), newest(tmp_path / "two")
    assert first.name != second.name
    shutil.copy(first / META, second / META)
    with pytest.raises(CheckpointError, match=r"lies in the folder of save \w{8}: the file was copied from another save"):
        opt.load_folder(tmp_path / "two")
    opt.close()
