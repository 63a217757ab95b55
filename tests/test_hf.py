"""Hugging Face Trainer with FuyouCallback against the same Trainer without it."""

import logging
import os

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainerCallback, TrainingArguments

from conftest import tiny_causal_lm
from fuyou_strategy import ConfigError, FuyouCallback
from fuyou_strategy.integrations.hf import STATE_FOLDER
from fuyou_strategy.optim.checkpoint import newest

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TOLERANCE = 1e-5  # relative, per tensor (measured: bitwise equal)


def dataset(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": (t := torch.randint(0, 101, (16,), generator=g)), "labels": t} for _ in range(n)]


def trainer_for(tmp_path, callbacks=(), *, model=None, steps=6, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=1e-2, warmup_steps=2,
                  weight_decay=0.1, report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, seed=0,
                  disable_tqdm=True)
    values.update(overrides)
    return Trainer(model=model if model is not None else tiny_causal_lm("gpt2"), args=TrainingArguments(**values),
                   train_dataset=dataset(), callbacks=list(callbacks))


def train(tmp_path, callback=None, *, model=None, steps=6, resume=None, **overrides):
    trainer = trainer_for(tmp_path, [callback] if callback is not None else [], model=model, steps=steps, **overrides)
    trainer.train(resume_from_checkpoint=resume)
    return trainer.model, trainer


def max_relative_difference(a, b):
    return max(((p - q).abs().max() / p.abs().max().clamp_min(1e-12)).item()
               for p, q in zip(a.parameters(), b.parameters()))


def grad_norms(trainer):
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


def swap_config(tmp_path, **fields):
    return dict(swap_dirs=[str(tmp_path)], chunk_size="8KiB", **fields)


def run_dirs(tmp_path):
    return [p.name for p in tmp_path.iterdir() if p.name.startswith("fuyou-run")]


class Fault(TrainerCallback):
    """Raises once, in the second optimizer step: in the second block's forward (of the step's first
    micro-batch), or just before the optimizer step, when backward has already written the step's
    updates into the weights."""

    def __init__(self, where):
        self.where, self.armed, self.hook = where, True, None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.armed and self.where == "forward":
            self.hook = model.transformer.h[1].register_forward_pre_hook(lambda *_: self.fire(state))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.armed and self.where == "before the optimizer step":
            self.fire(state)

    def fire(self, state):
        if state.global_step == 1:
            self.armed = False
            if self.hook is not None:
                self.hook.remove()
            raise RuntimeError("injected fault")


@pytest.mark.parametrize("activations", ["keep", "ssd"])
def test_same_weights_and_logged_grad_norms_as_without_the_callback(tmp_path, activations):
    reference, ref_trainer = train(tmp_path)
    # backward pinned: the redo path is checked below ("auto" takes next_forward on the CPU with the state in RAM)
    callback = FuyouCallback(**swap_config(tmp_path, activations=activations, activation_min_bytes=0,
                                           optimizer_schedule="backward"))
    ours, trainer = train(tmp_path, callback)
    assert max_relative_difference(reference, ours) <= TOLERANCE
    assert grad_norms(trainer) == pytest.approx(grad_norms(ref_trainer), rel=1e-6) and len(grad_norms(trainer)) == 6
    summary = callback.summary
    assert summary["optimizer_steps"] == 6 and summary["redos"] > 0, "clipping bit and was honoured"
    if activations == "ssd":
        assert summary["activation_bytes_to_ssd"] > 0
    assert trainer.args.max_grad_norm == 1.0, "the Trainer's arguments are put back"
    assert type(trainer.optimizer.optimizer) is torch.optim.AdamW, "and its own optimizer"
    assert not run_dirs(tmp_path), "swap files removed at the end"


def test_resume_from_checkpoint_is_exact(tmp_path):
    """Resume from checkpoint-3 to step 6 == 6 uninterrupted steps (the model starts from other weights)."""
    uninterrupted, _ = train(tmp_path / "a", FuyouCallback(**swap_config(tmp_path)))
    train(tmp_path / "b", FuyouCallback(**swap_config(tmp_path)), save_strategy="steps", save_steps=3)
    checkpoint = tmp_path / "b" / "out" / "checkpoint-3"
    assert (newest(checkpoint / STATE_FOLDER) / "optimizer.json").exists()
    callback = FuyouCallback(**swap_config(tmp_path))
    resumed, _ = train(tmp_path / "b", callback, model=tiny_causal_lm("gpt2", seed=1), resume=str(checkpoint))
    assert callback.summary["optimizer_steps"] == 6, "3 restored + 3 new"
    for (name, p), q in zip(uninterrupted.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_checkpoint_rotation_removes_the_optimizer_state_too(tmp_path):
    train(tmp_path, FuyouCallback(**swap_config(tmp_path)), save_strategy="steps", save_steps=2, save_total_limit=1)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-6"]
    assert (newest(out / "checkpoint-6" / STATE_FOLDER) / "master.bin").exists()


def test_lora_trains_only_the_adapters_and_matches(tmp_path):
    def lora_model():
        return get_peft_model(tiny_causal_lm("gpt2"), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                                   lora_dropout=0.0, fan_in_fan_out=True))

    reference, _ = train(tmp_path, model=lora_model())
    base = {n: p.detach().clone() for n, p in lora_model().named_parameters() if not p.requires_grad}
    callback = FuyouCallback(**swap_config(tmp_path, activations="ssd", activation_min_bytes=0))
    ours, _ = train(tmp_path, callback, model=lora_model())
    assert max_relative_difference(reference, ours) <= TOLERANCE
    trainable = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    assert callback.summary["trainable_parameters"] == trainable < sum(p.numel() for p in ours.parameters()) / 10
    for name, p in ours.named_parameters():
        if name in base:
            assert torch.equal(p, base[name]), f"frozen {name} changed"


def test_bf16_trains(tmp_path):
    callback = FuyouCallback(**swap_config(tmp_path))
    model, _ = train(tmp_path, callback, bf16=True, steps=3)
    assert callback.summary["optimizer_steps"] == 3 and callback.summary["skips"] == 0
    assert all(p.dtype == torch.float32 for p in model.parameters())


# -- a train() that raises leaves nothing behind ------------------------------------------------------------------
@pytest.mark.parametrize("where, again", [("forward", "the same Trainer"),
                                          ("before the optimizer step", "a new Trainer and callback")])
def test_training_again_after_an_exception_is_a_clean_run(tmp_path, where, again):
    """The next train() ends the run that raised (the Trainer has no exception event) and then trains as a
    fresh Trainer would from the weights of the last completed step: one step, like the reference's."""
    one_step, _ = train(tmp_path, steps=1)
    reference, _ = train(tmp_path, FuyouCallback(**swap_config(tmp_path)), model=one_step)
    model = tiny_causal_lm("gpt2")
    callback = FuyouCallback(**swap_config(tmp_path, activations="ssd", activation_min_bytes=0))
    trainer = trainer_for(tmp_path, [callback, Fault(where)], model=model)
    with pytest.raises(RuntimeError, match="injected fault"):
        trainer.train()
    if again == "a new Trainer and callback":  # on the same model and TrainingArguments
        callback = FuyouCallback(**swap_config(tmp_path))
        trainer = Trainer(model=model, args=trainer.args, train_dataset=dataset(), callbacks=[callback])
    trainer.train()
    assert callback.summary["optimizer_steps"] == 6
    assert max_relative_difference(reference, model) <= TOLERANCE
    assert trainer.args.max_grad_norm == 1.0 and type(trainer.optimizer.optimizer) is torch.optim.AdamW
    assert not model._forward_pre_hooks, "no hook of either run is left on the model"
    assert not run_dirs(tmp_path), "the swap files of both runs are removed"


@pytest.mark.parametrize("schedule", ["backward", "next_forward"])
def test_closing_the_callback_after_an_exception_puts_everything_back(tmp_path, schedule):
    one_step, _ = train(tmp_path, steps=1)
    model = tiny_causal_lm("gpt2")
    with FuyouCallback(**swap_config(tmp_path, optimizer_schedule=schedule)) as callback:
        trainer = trainer_for(tmp_path, [callback, Fault("before the optimizer step")], model=model)
        with pytest.raises(RuntimeError, match="injected fault"):
            trainer.train()
        assert run_dirs(tmp_path) and trainer.args.max_grad_norm == 0.0, "the run that raised is not ended yet"
        if schedule == "backward":  # the worker runs them beside training: wait until it has (no commit)
            callback.engine.optimizer.adam_state.drain()
            assert max_relative_difference(one_step, model) > 0, "backward wrote the unfinished step's updates"
    assert trainer.args.max_grad_norm == 1.0 and type(trainer.optimizer.optimizer) is torch.optim.AdamW
    assert trainer.lr_scheduler.optimizer is trainer.optimizer
    assert not model._forward_pre_hooks and not run_dirs(tmp_path)
    assert max_relative_difference(one_step, model) <= TOLERANCE, "the weights are the last completed step's"


# -- refused ---------------------------------------------------------------------------------------------------
def test_non_adam_optimizer_is_refused_and_leaves_nothing(tmp_path):
    with pytest.raises(ConfigError, match="optim='sgd'"):
        train(tmp_path, FuyouCallback(**swap_config(tmp_path)), optim="sgd")
    assert not run_dirs(tmp_path)


def test_missing_swap_dir_is_refused_and_creates_nothing(tmp_path):
    missing = tmp_path / "nvme0"
    with pytest.raises(Exception, match="does not exist"):
        train(tmp_path, FuyouCallback(swap_dirs=[str(missing)]), steps=1)
    assert not missing.exists()


def test_resume_without_fuyou_state_is_a_clear_error(tmp_path):
    _, trainer = train(tmp_path, save_strategy="steps", save_steps=3, steps=3)  # no callback: no Fuyou state
    checkpoint = os.path.join(trainer.args.output_dir, "checkpoint-3")
    with pytest.raises(ConfigError, match="no FuyouAdamW state was found"):
        train(tmp_path, FuyouCallback(**swap_config(tmp_path)), resume=checkpoint)


@pytest.mark.slow
def test_auto_plans_after_the_warm_up_and_changes_no_number(tmp_path, caplog):
    reference, _ = train(tmp_path)
    fields = swap_config(tmp_path, activations="auto", planner_warmup_steps=2, activation_min_bytes=0)
    roomy = FuyouCallback(**fields)
    with caplog.at_level(logging.INFO, logger="transformers"):  # as TrainingArguments(log_level="info") sets it
        train(tmp_path, roomy)
    assert roomy.plan.policies == ["keep", "keep"], "no device budget on the CPU: everything kept"
    assert any(r.name.startswith("transformers.") and "fuyou planner: plan" in r.getMessage() for r in caplog.records)
    budget = roomy.plan.device_peak - roomy.plan.act_bytes[0] // 2  # no room for both blocks' activations
    callback = FuyouCallback(**fields, device_memory_budget=budget)
    ours, _ = train(tmp_path, callback)
    assert callback.plan.policies[0] != "keep" and callback.plan.device_peak <= budget
    assert callback.summary["plan_predicted_step_seconds"] > 0
    assert max_relative_difference(reference, ours) <= TOLERANCE


def test_fp16_is_scaled_in_the_optimizer_and_matches_the_trainer_without_fuyou(tmp_path):
    """HF on the CPU: ``fp16=True`` is fp16 autocast with no GradScaler (accelerate has none there). With
    the callback FuyouAdamW scales the model's loss by 2**16 and unscales exactly (a power of two), so the
    weights match the Trainer's own run; with accelerate's GradScaler (CUDA) it would be disabled."""
    reference, ref_trainer = train(tmp_path, fp16=True)
    assert_clean = lambda: not run_dirs(tmp_path)  # noqa: E731
    callback = FuyouCallback(**swap_config(tmp_path))
    model, trainer = train(tmp_path, callback, fp16=True)
    assert callback.summary["loss_scale"] == 2.0**16 and callback.summary["optimizer_steps"] == 6
    assert max_relative_difference(reference, model) <= TOLERANCE
    assert grad_norms(trainer) == pytest.approx(grad_norms(ref_trainer), rel=1e-6), "the unscaled norm is logged"
    assert not model._forward_hooks and assert_clean(), "the scaling hook and the swap files are gone"


def test_fp16_with_label_smoothing_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="label_smoothing_factor=0.1"):
        train(tmp_path, FuyouCallback(**swap_config(tmp_path)), fp16=True, label_smoothing_factor=0.1)
    assert not run_dirs(tmp_path)


def test_fp16_with_accelerates_grad_scaler_as_on_cuda_is_the_trainers_run(tmp_path):
    """On CUDA accelerate makes a GradScaler and autocasts to fp16; here both are set up on the CPU as accelerate
    does there (torch's CPU GradScaler is the same class). The callback turns the scaler off for the run (FuyouAdamW
    scales) and the Trainer's optimizer.step() runs FuyouAdamW's: the weights and the logged norms are the Trainer's
    own, with its scaler on."""
    def with_grad_scaler(trainer):
        trainer.accelerator.scaler, trainer.accelerator.native_amp = torch.amp.GradScaler("cpu"), True
        return trainer

    reference = with_grad_scaler(trainer_for(tmp_path, fp16=True))
    reference.train()
    callback = FuyouCallback(**swap_config(tmp_path))
    trainer = with_grad_scaler(trainer_for(tmp_path, [callback], fp16=True))
    trainer.train()
    assert callback.summary["optimizer_steps"] == 6 and callback.summary["loss_scale"] == 2.0**16
    assert max_relative_difference(reference.model, trainer.model) <= TOLERANCE
    assert grad_norms(trainer) == pytest.approx(grad_norms(reference), rel=1e-6)
    assert trainer.accelerator.scaler.is_enabled(), "accelerate's scaler is on again after the run"
    assert not run_dirs(tmp_path)


def test_the_trainers_optimizer_and_scheduler_stay_its_own_during_the_run(tmp_path):
    """The callback hooks the Trainer's AdamW (its step() runs FuyouAdamW's); the Trainer's scheduler drives
    the learning rates of both, and its checkpoint's optimizer.pt is the AdamW's (no state: fuyou's is on SSD)."""
    seen = []

    class Watch(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
            lrs = [g["lr"] for g in optimizer.param_groups]
            seen.append((type(optimizer.optimizer), lr_scheduler.optimizer is optimizer,
                         lrs == [g["lr"] for g in callback.engine.optimizer.param_groups]))

        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            seen.append(all(p.grad is None for g in optimizer.param_groups for p in g["params"]))

    callback = FuyouCallback(**swap_config(tmp_path))
    trainer = trainer_for(tmp_path, [callback, Watch()], steps=3, save_strategy="steps", save_steps=3)
    trainer.train()
    assert seen == [(torch.optim.AdamW, True, True), True] * 3, "the learning rates as the Trainer's; no gradient left"
    saved = torch.load(tmp_path / "out" / "checkpoint-3" / "optimizer.pt", weights_only=True)
    assert saved["state"] == {}
    assert [g["lr"] for g in saved["param_groups"]] == [trainer.lr_scheduler.get_last_lr()[0]] * 2


# -- torch.compile: refused up front -----------------------------------------------------------------------------
def test_torch_compile_in_the_training_arguments_is_refused_when_the_trainer_is_made(tmp_path):
    with pytest.raises(ConfigError, match=r"TrainingArguments.torch_compile: got True \(torch_compile_backend="
                                          r"'inductor'\).*set torch_compile=False"):
        trainer_for(tmp_path, [FuyouCallback(**swap_config(tmp_path))], torch_compile=True)
    trainer = trainer_for(tmp_path, torch_compile_backend="aot_eager")  # the callback added later: refused at train()
    trainer.add_callback(FuyouCallback(**swap_config(tmp_path)))
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ConfigError, match=r"torch_compile: got True \(torch_compile_backend='aot_eager'\)"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(w, p) for w, p in zip(weights, trainer.model.parameters())), "no step ran"
    assert not run_dirs(tmp_path)


def test_accelerate_launchs_dynamo_backend_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    with pytest.raises(ConfigError, match="ACCELERATE_DYNAMO_BACKEND: got 'INDUCTOR'.*--dynamo_backend no"):
        trainer_for(tmp_path, [FuyouCallback(**swap_config(tmp_path))])


@pytest.mark.parametrize("how", ["torch.compile(model)", "a block's .compile()"])
def test_a_compiled_model_is_refused_when_the_trainer_is_made(tmp_path, how):
    model = tiny_causal_lm("gpt2")
    if how == "torch.compile(model)":
        model = torch.compile(model, backend="aot_eager")
    else:
        model.transformer.h[1].compile(backend="aot_eager")
    with pytest.raises(ConfigError, match=r"model: got a model compiled with torch.compile.*pass the model uncompiled"):
        trainer_for(tmp_path, [FuyouCallback(**swap_config(tmp_path))], model=model)
    assert not run_dirs(tmp_path)
