"""``torch.compile`` with fuyou: refused up front, before anything is made on disk, through every way a
compiled module reaches the engine (a plain loop, Lightning's Trainer with a compiled LightningModule or
a compiled submodule). Dynamo would trace fuyou's forward hooks into the graph, so their side effects
(the schedule's micro-batch signal, activation swapping, weight streaming) would not run per step."""

import lightning as L
import pytest
import torch

from conftest import tiny_causal_lm
from fuyou_strategy import ConfigError, FuyouEngine, FuyouStrategy
from fuyou_strategy.engine import compiled_modules
from test_lightning import CausalLM, fit, run_files


def test_compiled_modules_finds_both_ways_of_compiling():
    """``torch.compile(module)`` (a wrapper, torch's ``OptimizedModule``) and ``module.compile()`` (in place),
    at any depth; checked with torch 2.13."""
    model = tiny_causal_lm("gpt2")
    assert compiled_modules(model) == []
    assert compiled_modules(torch.compile(model)) == [""]
    model.transformer.h[1].compile()
    assert compiled_modules(model) == ["transformer.h.1"]
    outer = torch.nn.Sequential(torch.compile(torch.nn.Linear(2, 2)))
    assert compiled_modules(outer) == ["0"]


def test_a_torch_without_the_in_place_compile_marker_fails_naming_it(monkeypatch):
    monkeypatch.delattr(torch.nn.Module, "_compiled_call_impl")
    with pytest.raises(RuntimeError, match=r"has no torch.nn.Module._compiled_call_impl \(checked with torch 2.13\)"):
        compiled_modules(tiny_causal_lm("gpt2"))


def test_a_plain_loop_with_a_compiled_model_is_refused_before_the_swap_files(tmp_path):
    model = torch.compile(tiny_causal_lm("gpt2"))
    with pytest.raises(ConfigError, match=r"torch.compile: 1 module\(s\) of the model given to the optimizer are "
                                          r"compiled \(the model itself\).*without torch.compile"):
        FuyouEngine(model, torch.optim.AdamW(model.parameters()), config=None)


class CompiledInside(CausalLM):
    """``torch.compile`` applied to the model inside the LightningModule, as users often do."""

    def __init__(self):
        super().__init__()
        self.model = torch.compile(self.model)


def test_lightning_refuses_a_module_that_compiles_its_model_before_any_step(tmp_path):
    with pytest.raises(ConfigError, match=r"module\(s\) of the model given to configure_optimizers are compiled "
                                          r"\('model'\)"):
        fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=1, module=CompiledInside())
    assert run_files(tmp_path) == []


def test_lightning_refuses_a_compiled_lightning_module_before_any_step(tmp_path):
    """``trainer.fit(torch.compile(module))``: Lightning unwraps it and asks the strategy whether it
    supports compilation; only its own single-device, DDP and FSDP strategies do, so Lightning refuses."""
    torch.manual_seed(0)
    trainer = L.Trainer(strategy=FuyouStrategy(swap_dirs=[str(tmp_path)]), accelerator="cpu", devices=1, max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(RuntimeError, match="compiled model is incompatible with the current strategy: `FuyouStrategy`"):
        trainer.fit(torch.compile(CausalLM()), torch.utils.data.DataLoader(torch.randint(0, 64, (4, 8)), batch_size=2))
    assert run_files(tmp_path) == []


def test_fabric_refuses_a_compiled_model_at_the_first_backward_before_any_update(tmp_path):
    """``fabric.setup(torch.compile(model))``: Fabric unwraps the module for the strategy and compiles it again
    afterwards, out of the strategy's sight; the strategy's forward hook sees the compiled forward (dynamo
    replays its flag), and the first ``fabric.backward`` refuses before any gradient or update exists."""
    from fuyou_strategy import FuyouFabricStrategy

    strategy = FuyouFabricStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB")
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    torch.manual_seed(0)
    model = tiny_causal_lm("gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compiled, opt = fabric.setup(torch.compile(model, backend="eager"), torch.optim.AdamW(model.parameters()))
    batch = torch.randint(0, 64, (2, 8))
    loss = compiled(input_ids=batch, labels=batch).loss
    with pytest.raises(ConfigError, match=r"fabric.setup: got a compiled model \(torch.compile\).*without torch.compile"):
        fabric.backward(loss)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    strategy.teardown()
    assert run_files(tmp_path) == []
