"""What FuyouCallback relies on beyond the documented entry points (`fuyou_strategy.integrations.hf_internals`),
each exercised for real, and the message when it is gone.

Checked against transformers 5.24, accelerate 1.15 and torch 2.13 (the installed versions are read from
``importlib.metadata`` and named in every message):

- accelerate's ``AcceleratedOptimizer.optimizer``: the torch optimizer the Trainer built, whose ``step()``
  the wrapper calls (the callback hooks that step);
- torch's ``GradScaler._enabled``: accelerate's fp16 loss scaler (CUDA) turned off while FuyouAdamW scales;
- ``TrainingArguments.max_grad_norm`` as the Trainer reads it: at every optimizer step, clipping only above 0.

torch's ``Module._compiled_call_impl`` (how the engine tells that ``module.compile()`` compiled a module, to
refuse it) is checked in ``tests/test_compile.py``.
"""

from importlib import metadata

import pytest
import torch
from accelerate import Accelerator
from transformers import Trainer, TrainerCallback, TrainingArguments

from conftest import tiny_causal_lm
from fuyou_strategy.integrations import hf_internals
from test_hf import dataset

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def assert_names_the_internal_and_the_versions(excinfo, internal):
    message = str(excinfo.value)
    assert internal in message
    for name in ("transformers", "accelerate", "torch"):
        assert f"{name} {metadata.version(name)}" in message, message
    assert "checked against transformers 5.24, accelerate 1.15, torch 2.13" in message


def test_the_torch_optimizer_inside_accelerates_wrapper_is_the_one_it_steps(monkeypatch):
    model = torch.nn.Linear(3, 2)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.1)
    wrapped = Accelerator(cpu=True).prepare_optimizer(adamw)
    inner = hf_internals.torch_optimizer(wrapped)
    assert inner is adamw
    stepped = []
    inner.register_step_pre_hook(lambda opt, args, kwargs: stepped.append(opt))
    model(torch.ones(1, 3)).sum().backward()
    wrapped.step()
    assert stepped == [adamw], "accelerate's step() steps the inner optimizer, where the callback's hook runs"
    monkeypatch.delattr(wrapped, "optimizer")
    with pytest.raises(RuntimeError) as excinfo:
        hf_internals.torch_optimizer(wrapped)
    assert_names_the_internal_and_the_versions(excinfo, "AcceleratedOptimizer.optimizer")


def test_accelerates_grad_scaler_off_passes_the_loss_and_the_step_through_and_on_again(monkeypatch):
    """accelerate makes its GradScaler on CUDA only; torch's CPU GradScaler is the same class."""
    model = torch.nn.Linear(3, 2)
    scaler = torch.amp.GradScaler("cpu")
    wrapped = Accelerator(cpu=True).prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
    wrapped.scaler = scaler  # as Accelerator.prepare_optimizer sets it on CUDA
    loss = model(torch.ones(1, 3)).sum()
    assert hf_internals.set_grad_scaler_enabled(scaler, False) is True
    assert scaler.scale(loss) is loss and not scaler.is_enabled()
    loss.backward()
    before = model.weight.detach().clone()
    scaler.step(wrapped.optimizer)
    assert not torch.equal(before, model.weight), "off, the scaler's step() calls optimizer.step()"
    assert hf_internals.set_grad_scaler_enabled(scaler, True) is False and scaler.is_enabled()
    assert scaler.scale(torch.ones(())).item() == scaler.get_scale()
    monkeypatch.delattr(scaler, "_enabled")
    with pytest.raises(RuntimeError) as excinfo:
        hf_internals.set_grad_scaler_enabled(scaler, False)
    assert_names_the_internal_and_the_versions(excinfo, "GradScaler._enabled")
    assert "bf16=True" in str(excinfo.value), "says what to do meanwhile"


def test_the_trainer_reads_max_grad_norm_at_every_step_and_skips_clipping_at_zero(tmp_path):
    class TurnsClippingOff(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.previous = hf_internals.set_trainer_max_grad_norm(args, 0.0)

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, max_grad_norm=1.0,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, learning_rate=1e-2)
    callback = TurnsClippingOff()
    trainer = Trainer(model=tiny_causal_lm("gpt2"), args=args, train_dataset=dataset(), callbacks=[callback])
    norms = []
    clip = trainer.accelerator.clip_grad_norm_
    trainer.accelerator.clip_grad_norm_ = lambda params, max_norm, **kw: norms.append(max_norm) or clip(
        params, max_norm, **kw)
    trainer.train()
    assert callback.previous == 1.0 and norms == [float("inf")] * 3, "set after the Trainer began: only measured"
    with pytest.raises(RuntimeError) as excinfo:
        hf_internals.set_trainer_max_grad_norm(object(), 0.0)
    assert_names_the_internal_and_the_versions(excinfo, "TrainingArguments.max_grad_norm")
