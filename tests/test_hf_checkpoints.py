"""Hugging Face Trainer checkpoints with FuyouCallback survive a kill at any instant, and a checkpoint's
fuyou state is tied to it (issue 23): an incomplete checkpoint is never resumed from, fuyou state that
belongs to another checkpoint or was changed is refused, naming the files."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from conftest import FsKiller, kill_at_every_step, kill_leaving_a_zombie, tiny_causal_lm
from fuyou_strategy import FuyouCallback
from fuyou_strategy.cli import main as fuyou_main
from fuyou_strategy.integrations import hf_checkpoints
from fuyou_strategy.integrations.hf import STATE_FOLDER
from fuyou_strategy.optim.checkpoint import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

STEPS, SAVE_EVERY = 8, 3  # checkpoints at steps 3 and 6 (and 8, the end); the killed save is step 6's


def dataset(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": (t := torch.randint(0, 101, (16,), generator=g)), "labels": t} for _ in range(n)]


class KillDuringSave(TrainerCallback):
    """Arms an `FsKiller` from the end of step ``at`` (before the Trainer saves its checkpoint) to the
    beginning of the next step: a kill before, inside and after each step of that checkpoint's save."""

    def __init__(self, k, at):
        self.killer, self.at = FsKiller(k, files=True), at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            self.killer.arm()

    def on_step_begin(self, args, state, control, **kwargs):
        self.killer.disarm()

    on_train_end = on_step_begin


def trainer(root, *extra_callbacks, seed=0, **overrides):
    """A tiny GPT-2 trained for `STEPS` steps with FuyouCallback (swap files in ``root/swap``), saving every
    `SAVE_EVERY` steps into ``root/out`` and keeping one checkpoint (rotation removes the older one)."""
    root = Path(root)
    (root / "swap").mkdir(parents=True, exist_ok=True)
    values = dict(output_dir=str(root / "out"), max_steps=STEPS, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=1e-2, warmup_steps=2,
                  weight_decay=0.1, report_to=[], save_strategy="steps", save_steps=SAVE_EVERY, save_total_limit=1,
                  logging_steps=1, use_cpu=True, seed=0, disable_tqdm=True)
    values.update(overrides)
    callback = FuyouCallback(swap_dirs=[str(root / "swap")], chunk_size="8KiB")
    return Trainer(model=tiny_causal_lm("gpt2", seed=seed), args=TrainingArguments(**values), train_dataset=dataset(),
                   callbacks=[*extra_callbacks, callback])


def killed_in_a_save(root, k):
    """Train, killed before the k-th file created, removed or renamed while step 6's checkpoint is saved
    (run by `kill_at_every_step`)."""
    trainer(root, KillDuringSave(k, at=6)).train()


def weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.slow
def test_a_kill_at_any_point_of_a_checkpoint_save_resumes_exactly(tmp_path, caplog):
    """Killed before, inside and after every step of a checkpoint save (the Trainer's files, fuyou's state,
    its rename, trainer_state.json, the rotation that removes the older checkpoint), the run resumes with
    ``resume_from_checkpoint=True`` from the newest complete checkpoint, bitwise equal to a run never
    killed; incomplete checkpoints are set aside with a warning and ``fuyou clean`` removes them."""
    killed = kill_at_every_step(tmp_path, "test_hf_checkpoints", "killed_in_a_save")
    assert len(killed) >= 10, "the save has many steps to be killed between"
    uninterrupted = trainer(tmp_path / "uninterrupted")
    uninterrupted.train()
    expected = weights(uninterrupted.model)
    resumed_from, set_aside = [], []
    for root in killed:
        latest = hf_checkpoints.checkpoints(root / "out")[-1].name
        caplog.clear()
        resumed = trainer(root, seed=1)  # other initial weights: everything must come from the checkpoint
        resumed_from.append(int(get_last_checkpoint(str(root / "out")).rsplit("-", 1)[1]))  # what the Trainer picks
        resumed.train(resume_from_checkpoint=True)
        for name, p in weights(resumed.model).items():
            assert torch.equal(p, expected[name]), (root.name, name)
        moved = sorted(p.name for p in (root / "out").iterdir() if p.name.startswith("incomplete-"))
        if latest == "checkpoint-6" and resumed_from[-1] == 3:  # the kill left an incomplete checkpoint-6
            assert moved == ["incomplete-checkpoint-6"], root.name
            assert any("incomplete-checkpoint-6" in r.getMessage() and "fuyou clean" in r.getMessage()
                       for r in caplog.records), "a warning names it and the way to remove it"
        set_aside += moved
        assert not list(root.rglob("*.tmp-*")), f"{root.name}: no killed save's folder outlives the resumed run"
        assert not list((root / "swap").iterdir()), "swap files removed"
    assert 3 in resumed_from and 6 in resumed_from, "killed early the run resumes from step 3, late from step 6"
    assert resumed_from == sorted(resumed_from), "step 6's checkpoint counts from one kill point on, for good"
    assert set_aside, "some kills left an incomplete checkpoint-6"
    assert fuyou_main(["clean", *[a for r in killed for a in ("--dir", str(r / "out"))]]) == 0
    assert not [p for r in killed for p in (r / "out").iterdir() if p.name.startswith("incomplete-")]


def save_twice(root, **overrides):
    """Checkpoints at steps 3 and 6 kept (no rotation), fuyou state in each."""
    t = trainer(root, save_total_limit=None, max_steps=6, **overrides)
    t.train()
    return Path(root) / "out"


def test_a_resumed_runs_first_logged_step_reports_its_own_counts_not_the_checkpoints(tmp_path):
    """The ``fuyou/`` metrics of the first step after a resume count that step alone, not the clipped and
    rolled-back steps the checkpoint restored."""
    def logged(t, step):
        (entry,) = [e for e in t.state.log_history if e.get("step") == step and "fuyou/clipped" in e]
        return {k: entry[k] for k in ("fuyou/clipped", "fuyou/rolled_back", "fuyou/skipped")}

    uninterrupted = trainer(tmp_path / "uninterrupted")
    uninterrupted.train()
    out = save_twice(tmp_path / "saved")
    resumed = trainer(tmp_path / "saved", seed=1)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert logged(uninterrupted, 1)["fuyou/clipped"] == 1, "clipping bites in the first steps: counts to restore"
    assert logged(resumed, 4) == logged(uninterrupted, 4) == {"fuyou/clipped": 0, "fuyou/rolled_back": 0,
                                                              "fuyou/skipped": 0}


def test_fuyou_state_of_another_checkpoint_is_refused_naming_both_files(tmp_path):
    out = save_twice(tmp_path)
    shutil.rmtree(out / "checkpoint-3" / STATE_FOLDER)
    shutil.copytree(out / "checkpoint-6" / STATE_FOLDER, out / "checkpoint-3" / STATE_FOLDER)
    with pytest.raises(CheckpointError, match=r"checkpoint-3/trainer_state.json belongs to optimizer save \w{8} "
                                              r"\(step 3\), but .*checkpoint-3/fuyou_optimizer holds save \w{8} "
                                              r"\(step 6\)"):
        trainer(tmp_path, seed=1).train(resume_from_checkpoint=str(out / "checkpoint-3"))


def test_a_changed_value_in_fuyou_state_metadata_is_refused(tmp_path):
    out = save_twice(tmp_path)
    (save,) = (out / "checkpoint-6" / STATE_FOLDER).iterdir()
    meta = save / "optimizer.json"
    text = meta.read_text()
    assert json.loads(text)["param_groups"][0]["weight_decay"] == 0.1
    meta.write_text(text.replace('"weight_decay": 0.1', '"weight_decay": 0.2', 1))
    with pytest.raises(CheckpointError, match=rf"{meta}: its contents do not match the checksum"):
        trainer(tmp_path, seed=1).train(resume_from_checkpoint=True)


def test_an_incomplete_checkpoint_is_set_aside_and_the_newest_complete_one_resumed(tmp_path):
    """Without trainer_state.json (the Trainer's save cut short) or without the fuyou save it records."""
    out = save_twice(tmp_path)
    (out / "checkpoint-6" / "trainer_state.json").unlink()
    shutil.copytree(out / "checkpoint-3", out / "checkpoint-9")
    shutil.rmtree(out / "checkpoint-9" / STATE_FOLDER)
    assert hf_checkpoints.why_incomplete(out / "checkpoint-6").startswith("no trainer_state.json")
    assert "records fuyou save" in hf_checkpoints.why_incomplete(out / "checkpoint-9")
    assert hf_checkpoints.why_incomplete(out / "checkpoint-3") is None
    resumed = trainer(tmp_path, seed=1, max_steps=6)
    assert get_last_checkpoint(str(out)).endswith("checkpoint-3"), "what resume_from_checkpoint=True picks"
    resumed.train(resume_from_checkpoint=True)
    assert [h["step"] for h in resumed.state.log_history if "loss" in h] == [1, 2, 3, 4, 5, 6], "3 restored, 3 new"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("incomplete-")) == [
        "incomplete-checkpoint-6", "incomplete-checkpoint-9"]


_CLAIMS = """
import sys, time
from fuyou_strategy.integrations import hf_checkpoints
assert hf_checkpoints.claim(sys.argv[1])
print("claimed", flush=True)
time.sleep(120)
"""


def test_fuyou_clean_leaves_a_live_runs_incomplete_checkpoint_alone(tmp_path, capsys):
    """A checkpoint being written (no trainer_state.json yet) is kept while the run writing into the output
    directory lives; once it is gone (a zombie included: killed, not yet reaped), ``fuyou clean`` removes it."""
    out = tmp_path / "out"
    (out / "checkpoint-4" / STATE_FOLDER).mkdir(parents=True)
    run = subprocess.Popen([sys.executable, "-c", _CLAIMS, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout.readline().strip() == "claimed"
        assert hf_checkpoints.live_writer(out) == run.pid
        assert hf_checkpoints.find_leftovers(out) == []
        assert fuyou_main(["clean", "--dir", str(out)]) == 0
        assert (out / "checkpoint-4").exists(), "a live run's checkpoint is kept"
        assert hf_checkpoints.set_aside_incomplete(out) == [], "and not set aside by another run"
        kill_leaving_a_zombie(run)
        assert [Path(s.path).name for s in hf_checkpoints.find_leftovers(out)] == ["checkpoint-4"]
        assert fuyou_main(["clean", "--dir", str(out)]) == 0
        assert not (out / "checkpoint-4").exists()
        assert "an incomplete checkpoint" in capsys.readouterr().out
    finally:
        run.kill()
        run.wait(timeout=30)
