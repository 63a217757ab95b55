"""The checkpoint commit protocol (`fuyou_strategy.commit`), alone: a framework file and fuyou's save stay a
loadable pair whenever the power goes, and a pair that does not match is refused, naming both files."""

import contextlib
import json
import os

import pytest
import torch

from fuyou_strategy import FuyouConfig, FuyouEngine, commit
from fuyou_strategy.optim.checkpoint import CheckpointError, save_dirs
from power_cuts import FsRecorder, crash_states, materialize

STATE = "ckpt.json.fuyou"  # the save folder beside the framework file, as Lightning's strategy names it


@pytest.fixture
def make_engine(tmp_path):
    """``make_engine(name)``: a small model and its engine (swap files in ``tmp_path/name``), closed after the test."""
    made = []

    def make(name):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        (tmp_path / name).mkdir()
        config = FuyouConfig(swap_dirs=[str(tmp_path / name)], chunk_size="8KiB", host_memory_budget="4MiB",
                             activations="keep", weights="device", io_threads=1)
        made.append(FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config))
        return model, made[-1]

    yield make
    for engine in made:
        engine.close()


def _step(model, engine, n):
    engine.begin_micro_batch(update=True)
    model(torch.randn(8, 16, generator=torch.Generator().manual_seed(n))).square().mean().backward()
    engine.optimizer.step()
    engine.optimizer.zero_grad()


def _state(model, engine):
    return [{k: v.clone() for k, v in engine.optimizer.read_state(p).items()} for p in model.parameters()]


def _write_in_place_then_rename(path, text):
    """A framework's own writer (a user's CheckpointIO): beside, renamed over, nothing fsynced."""
    with open(f"{path}.new", "w") as f:
        f.write(text)
    os.replace(f"{path}.new", path)


def _save(root, engine, durably):
    """One checkpoint by the protocol: fuyou's save, the framework file naming it, the commit."""
    pending = commit.begin(engine, root / STATE)
    text = json.dumps({"token": pending.token, "steps": pending.steps})
    if durably:
        commit.write_durably(root / "ckpt.json", lambda f: f.write(text.encode()))
        commit.commit(pending)
    else:
        _write_in_place_then_rename(root / "ckpt.json", text)
        commit.commit(pending, [root / "ckpt.json"])


@pytest.mark.parametrize("durably", [True, False], ids=["written-durably", "made-durable-by-commit"])
def test_a_power_cut_anywhere_in_a_save_leaves_the_old_pair_or_the_new_each_loadable(tmp_path, make_engine, durably):
    """Every crash state of the second save (`power_cuts`): the framework file names the old save or the new,
    and that save is there and loads, bitwise the state of its step. With a framework writer that fsyncs
    nothing, this holds only because `commit` makes the file durable before the old save goes."""
    model, engine = make_engine("swap")
    root = tmp_path / "run"
    root.mkdir()
    expected, recorder = {}, FsRecorder(root)
    for n in (1, 2):
        _step(model, engine, n)
        expected[n] = _state(model, engine)
        with recorder.recording() if n == 2 else contextlib.nullcontext():
            _save(root, engine, durably)
    assert [p.name for p in save_dirs(root / STATE)] == [json.loads((root / "ckpt.json").read_text())["token"]]

    states, _ = crash_states(recorder)
    fresh_model, fresh = make_engine("swap-fresh")
    loaded = set()
    for n, tree in enumerate(states):
        at = tmp_path / "crash" / str(n)
        materialize(tree, at)
        try:
            record = json.loads((at / "ckpt.json").read_text())
        except ValueError:  # renamed in, its data not yet fsynced: a broken framework file, not a split pair
            assert not durably, f"state {n}: a durably written file cut short"
            continue
        save = commit.resolve_for_load(at / STATE, record["token"], record["steps"], named_by="ckpt.json", fix="-")
        fresh.load(at / STATE, save.name)
        assert all(torch.equal(a[k], b[k]) for a, b in zip(_state(fresh_model, fresh), expected[record["steps"]])
                   for k in a), f"state {n}"
        loaded.add(record["steps"])
    assert loaded == {1, 2}, f"{len(states)} crash states: the old pair and the new both occur"


def test_the_earlier_saves_go_only_at_commit_after_the_framework_files_are_durable(tmp_path, make_engine, monkeypatch):
    model, engine = make_engine("swap")
    _step(model, engine, 1)
    old = commit.begin(engine, tmp_path / STATE)
    commit.commit(old)
    new = commit.begin(engine, tmp_path / STATE)
    assert {p.name for p in save_dirs(tmp_path / STATE)} == {old.token, new.token}, "begin keeps the earlier save"
    made_durable = []
    monkeypatch.setattr(commit, "make_durable", lambda *paths: made_durable.append(
        (paths, {p.name for p in save_dirs(tmp_path / STATE)})))
    commit.commit(new, ["ckpt.json"], writer=False)
    assert made_durable == [] and len(save_dirs(tmp_path / STATE)) == 2, "a rank that wrote no file does nothing"
    commit.commit(new, ["ckpt.json"])
    assert made_durable == [(("ckpt.json",), {old.token, new.token})], "durable first, the old save still there"
    assert [p.name for p in save_dirs(tmp_path / STATE)] == [new.token]


def test_a_failed_framework_write_abandons_the_new_save_and_keeps_the_old(tmp_path, make_engine):
    model, engine = make_engine("swap")
    _step(model, engine, 1)
    first = commit.begin(engine, tmp_path / "a")
    commit.abandon(first)
    assert not (tmp_path / "a").exists(), "the folder the save made goes with it"
    old = commit.begin(engine, tmp_path / STATE)
    commit.commit(old)
    commit.abandon(commit.begin(engine, tmp_path / STATE))
    assert [p.name for p in save_dirs(tmp_path / STATE)] == [old.token]


def test_a_pair_that_does_not_match_is_refused_naming_both_sides(tmp_path, make_engine):
    model, engine = make_engine("swap")
    _step(model, engine, 1)
    old = commit.begin(engine, tmp_path / STATE, framework_step=1)
    commit.commit(old)
    _step(model, engine, 2)
    new = commit.begin(engine, tmp_path / STATE, framework_step=2)
    commit.commit(new)
    with pytest.raises(CheckpointError, match=rf"ckpt.json belongs to optimizer save {old.token[:8]} \(step 1\), but "
                                              rf".*{STATE} holds save {new.token[:8]} \(step 2\): ckpt.json is stale: "
                                              "a later save replaced the state it belongs to; use another"):
        commit.resolve_for_load(tmp_path / STATE, old.token, old.steps, named_by="ckpt.json", fix="use another")
    # A framework file without the token (written before the save): the newest save, if made at its step.
    newest = commit.resolve_for_load(tmp_path / STATE, None, named_by="t.json", fix="-", framework_step=2)
    assert newest.name == new.token
    with pytest.raises(CheckpointError, match=r"state of the Trainer's step 2, but t.json resumes at step 1"):
        commit.resolve_for_load(tmp_path / STATE, None, named_by="t.json", fix="-", framework_step=1)


def test_a_removed_checkpoint_loses_its_file_durably_before_its_save(tmp_path, make_engine):
    """Every crash state of `remove` after the framework removed its file: never the file without its save."""
    model, engine = make_engine("swap")
    _step(model, engine, 1)
    root = tmp_path / "run"
    root.mkdir()
    _save(root, engine, durably=True)
    recorder = FsRecorder(root)
    with recorder.recording():
        os.unlink(root / "ckpt.json")
        commit.remove(root / STATE, removed=[root / "ckpt.json"])
    assert not (root / STATE).exists()
    states, _ = crash_states(recorder)
    for n, tree in enumerate(states):
        materialize(tree, tmp_path / "crash" / str(n))
        assert "ckpt.json" not in tree or commit.holds_save(tmp_path / "crash" / str(n) / STATE), f"state {n}"
    assert any("ckpt.json" in tree for tree in states) and any("ckpt.json" not in tree for tree in states)


def test_clean_removes_what_a_killed_writer_left_and_holds_save_sees_only_complete_saves(tmp_path):
    folder = tmp_path / STATE
    (folder / f"{'0' * 32}.tmp-999999999").mkdir(parents=True)  # no such process
    (folder / f"{'0' * 32}.tmp-999999999" / "master.bin").write_bytes(b"x")
    assert not commit.holds_save(folder)
    commit.clean(folder)
    assert os.listdir(folder) == []
