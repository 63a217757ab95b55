"""A power cut at any instant of a save leaves a checkpoint that resumes exactly, from the old step or the new.

A kill keeps everything a process wrote; a power cut keeps only what was made durable. `power_cuts`
records the file-system changes a save makes under a folder and replays every prefix of that record
under the strict model of what survives (data up to its last fsync, folder entries once the folder is
fsynced; its docstring); each distinct crash state is resumed once.
"""

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import TrainerCallback, modeling_utils
from transformers.trainer_utils import get_last_checkpoint

from fuyou_strategy import FuyouCallback, FuyouStrategy
from power_cuts import FsRecorder, crash_states, materialize
from test_hf_checkpoints import trainer as hf_trainer
from test_hf_checkpoints import weights as hf_weights
from test_lightning import CausalLM, fit

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class _RecordsOneSave(FuyouStrategy):
    """Records the file-system changes of the ``nth`` save of ``last.ckpt``."""

    def __init__(self, recorder, nth, **kwargs):
        super().__init__(**kwargs)
        self.recorder, self.nth, self.last_saves = recorder, nth, 0

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        self.last_saves += os.path.basename(filepath) == "last.ckpt"
        recorded = os.path.basename(filepath) == "last.ckpt" and self.last_saves == self.nth
        with self.recorder.recording() if recorded else contextlib.nullcontext():
            super().save_checkpoint(checkpoint, filepath, storage_options)


def _fresh_module():
    module = CausalLM()
    module.model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    return module


@pytest.mark.parametrize("nth", [1, 2], ids=["first-save", "replacing-save"])
def test_a_power_cut_anywhere_in_a_lightning_save_resumes_the_old_or_the_new_step(tmp_path, monkeypatch, nth):
    """Three epochs of one step, ModelCheckpoint(save_last=True); a power cut anywhere in the ``nth`` save of
    last.ckpt. The replacing save: every crash state resumes bitwise from step 1 or step 2. The first save:
    from step 1, or no last.ckpt is there (nothing was durable yet) and Lightning says the file is missing."""
    run, swap = tmp_path / "run", tmp_path / "swap"
    (run / "tmp").mkdir(parents=True)
    swap.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(run / "tmp"))  # a framework's temporary files: recorded too
    recorder = FsRecorder(run)
    every_epoch = ModelCheckpoint(dirpath=run / "ckpts", save_last=True, every_n_epochs=1)
    uninterrupted, trainer = fit(_RecordsOneSave(recorder, nth, swap_dirs=[str(swap)]), steps=-1, max_epochs=3,
                                 batches=2, callbacks=[every_epoch])
    trainer.strategy.engine.close()
    monkeypatch.undo()
    states, enumerated = crash_states(recorder)
    print(f"save {nth} of last.ckpt: {len(recorder.ops)} recorded changes, {enumerated} crash states, "
          f"{len(states)} distinct")
    resumed_from, failures = set(), []
    for n, tree in enumerate(states):
        root = tmp_path / "crash" / str(n)
        materialize(tree, root)
        last = root / "ckpts" / "last.ckpt"
        if not last.exists():
            assert nth == 1, f"crash state {n}: the old last.ckpt was durable, and is gone: {sorted(tree)}"
            with pytest.raises(FileNotFoundError, match="not found"):
                fit(FuyouStrategy(swap_dirs=[str(swap)]), steps=-1, max_epochs=3, batches=2, ckpt_path=str(last),
                    module=_fresh_module())
            continue
        try:
            step = torch.load(last, weights_only=True)["global_step"]
            resumed, _ = fit(FuyouStrategy(swap_dirs=[str(swap)]), steps=-1, max_epochs=3, batches=2,
                             ckpt_path=str(last), module=_fresh_module())
        except Exception as exc:  # noqa: BLE001 - every state that fails is listed below
            failures.append(f"state {n}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        resumed_from.add(step)
        for (name, p), (_, q) in zip(uninterrupted.named_parameters(), resumed.named_parameters()):
            assert torch.equal(p, q), (n, name)
    assert not failures, f"{len(failures)} of {len(states)} crash states do not resume:\n" + "\n".join(failures)
    assert resumed_from == ({1} if nth == 1 else {1, 2}), resumed_from


# -- Hugging Face Trainer + FuyouCallback -----------------------------------------------------------------------

class _RecordsOneTrainerSave(TrainerCallback):
    """Added after FuyouCallback: records the file-system changes under ``output_dir`` from the end of step
    ``step`` (the Trainer's save follows) to the end of FuyouCallback's ``on_save``: the Trainer's files
    (torch.save and safetensors write them natively), fuyou's state, trainer_state.json, the rotation."""

    _NATIVE = ((torch, "save"), (modeling_utils, "safe_save_file"))

    def __init__(self, recorder, step, stack):
        self.recorder, self.step, self.stack = recorder, step, stack

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            assert control.should_save
            self.stack.enter_context(self.recorder.recording(native=self._NATIVE))

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.stack.close()
            root = Path(self.recorder.root)
            on_disk = {str(p.relative_to(root)) for p in root.rglob("*")}
            assert on_disk == self.recorder.live_paths(), "the recording saw every file the save made and removed"


def _trainer_save_crash_states(tmp_path, step, **overrides):
    """Train (`test_hf_checkpoints.trainer`) recording the save of ``step``: the crash states, the count of
    (prefix, outcome) pairs, the number of changes recorded and the uninterrupted run's weights."""
    run = tmp_path / "run"
    (run / "out").mkdir(parents=True)
    recorder = FsRecorder(run / "out")
    t = hf_trainer(run, **overrides)
    with contextlib.ExitStack() as stack:
        t.add_callback(_RecordsOneTrainerSave(recorder, step, stack))  # last: after FuyouCallback's on_save
        t.train()
    assert recorder.ops, "the save was recorded"
    states, enumerated = crash_states(recorder)
    return states, enumerated, len(recorder.ops), hf_weights(t.model)


def _resume_each(tmp_path, states, expected, **overrides):
    """Resume every crash state with ``resume_from_checkpoint=True``: ``{state: step resumed from}`` for the
    states that resume (each checked bitwise against ``expected``), ``{state: exception}`` for the others."""
    resumed_from, refused = {}, {}
    for n, tree in enumerate(states):
        root = tmp_path / "crash" / str(n)
        materialize(tree, root / "out")
        resumed = hf_trainer(root, seed=1, **overrides)  # other initial weights: all must come from the checkpoint
        last = get_last_checkpoint(str(root / "out"))  # what resume_from_checkpoint=True picks
        try:
            resumed.train(resume_from_checkpoint=True)
        except Exception as exc:  # noqa: BLE001 - the callers say which states may fail, and how
            refused[n] = exc
            for callback in resumed.callback_handler.callbacks:
                if isinstance(callback, FuyouCallback):
                    callback.close()  # train() raised: its run is ended here (swap files removed)
            continue
        resumed_from[n] = int(last.rsplit("-", 1)[1])
        for name, p in hf_weights(resumed.model).items():
            assert torch.equal(p, expected[name]), f"state {n}, resumed from step {resumed_from[n]}: {name} differs"
    return resumed_from, refused


def _counts(resumed_from):
    return {step: list(resumed_from.values()).count(step) for step in sorted(set(resumed_from.values()))}


@pytest.mark.slow
def test_a_power_cut_anywhere_in_a_trainer_save_that_rotates_resumes_exactly(tmp_path):
    """save_total_limit=2, a checkpoint every step of 4: a power cut anywhere in step 3's save, which rotates
    checkpoint-1 away. Every crash state resumes (``resume_from_checkpoint=True``) bitwise equal to the
    uninterrupted run, from checkpoint-2 or checkpoint-3: in the window before on_save (trainer_state.json not
    yet durable while the rotation removes checkpoint-1) checkpoint-2 is there, made durable at its on_save."""
    settings = dict(max_steps=4, save_steps=1, save_total_limit=2)
    states, enumerated, changes, expected = _trainer_save_crash_states(tmp_path, 3, **settings)
    resumed_from, refused = _resume_each(tmp_path, states, expected, **settings)
    print(f"step 3's save (limit 2): {changes} recorded changes, {enumerated} crash states, {len(states)} distinct; "
          f"resumed from (step: states) {_counts(resumed_from)}")
    assert not refused, f"{len(refused)} of {len(states)} crash states do not resume:\n" + "\n".join(
        f"state {n}: {type(e).__name__}: {str(e)[:300]}" for n, e in refused.items())
    assert set(resumed_from.values()) == {2, 3}


@pytest.mark.slow
def test_a_power_cut_in_the_window_of_a_save_keeping_one_checkpoint_is_refused_never_wrong(tmp_path):
    """save_total_limit=1, a checkpoint every step of 3: a power cut anywhere in step 2's save, which rotates
    checkpoint-1 away before on_save makes trainer_state.json durable (the window in `hf_checkpoints`). Each
    crash state resumes bitwise equal to the uninterrupted run, from checkpoint-1 or checkpoint-2, or, where
    the window left no complete checkpoint, the Trainer refuses: no valid checkpoint. Never a wrong resume."""
    settings = dict(max_steps=3, save_steps=1, save_total_limit=1)
    states, enumerated, changes, expected = _trainer_save_crash_states(tmp_path, 2, **settings)
    resumed_from, refused = _resume_each(tmp_path, states, expected, **settings)
    print(f"step 2's save (limit 1): {changes} recorded changes, {enumerated} crash states, {len(states)} distinct; "
          f"resumed from (step: states) {_counts(resumed_from)}, refused {len(refused)}")
    assert set(resumed_from.values()) == {1, 2}
    assert refused, "the window is there: some states leave no complete checkpoint"
    whole = {path for path in states[0] if path.startswith("checkpoint-1/")}  # states[0]: the tree before the save
    for n, exc in refused.items():
        assert isinstance(exc, ValueError) and "No valid checkpoint found" in str(exc), (n, exc)
        tree = states[n]
        assert _unreadable(tree.get("checkpoint-2/trainer_state.json")), f"state {n}: refused outside the window"
        assert whole - set(tree), f"state {n}: checkpoint-1 is whole, yet refused"


def _unreadable(file):
    """A crash state's file (``(sha256, bytes)``, or None where it is absent) that does not read as JSON."""
    try:
        json.loads(file[1])
    except (TypeError, ValueError):
        return True
    return False
