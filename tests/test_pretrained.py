"""Loading a local safetensors checkpoint lazily into a model built on the meta device (`SafetensorsInit`):
bitwise the eagerly built model, each tensor read once, clear errors."""

import collections
import copy
import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open

from conftest import tiny_causal_lm
from test_weights import ids, run_steps
from fuyou_strategy import FuyouConfig, FuyouEngine, SafetensorsInit
from fuyou_strategy.params import pretrained

MIX = {0: "ssd", 1: "host"}


def save(model, folder, sharded=True):
    """``save_pretrained``; sharded: several shards and an index (~8 for these tiny models)."""
    model.save_pretrained(folder, **({"max_shard_size": "20KB"} if sharded else {}))
    return folder


def on_meta(eager, cls=None, dtype=None, **changes):
    """The eager model's architecture (or ``cls``), built on the meta device: shapes only."""
    config = copy.deepcopy(eager.config)
    for name, value in changes.items():
        setattr(config, name, value)
    with torch.device("meta"):
        model = (cls or type(eager))(config)
    return model.to(dtype) if dtype is not None else model


def config(tmp_path, weights):
    folder = tmp_path / "swap"
    folder.mkdir(exist_ok=True)
    return FuyouConfig(swap_dirs=[str(folder)], weights=weights, weight_prefetch_blocks=1, chunk_size="8KiB",
                       host_memory_budget="4MiB")


def engine_for(model, cfg, init=None):
    return FuyouEngine(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                       config=cfg, max_grad_norm=0.5, init_weights=init)


def train(engine, model, steps=3):
    """``steps`` engine steps (clipping on, `run_steps`), then ``close``: every weight resident again. The losses."""
    losses = [loss.item() for loss in run_steps(engine, model, steps)]
    engine.close()
    return losses


def assert_same_tensors(model, eager):
    """Every parameter and buffer (non-persistent ones too) bitwise the eager model's."""
    ours, theirs = dict(model.named_buffers()), dict(eager.named_buffers())
    ours.update(model.named_parameters())
    theirs.update(eager.named_parameters())
    assert ours.keys() == theirs.keys() and ours
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name


def file_keys(folder):
    keys = []
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as handle:
            keys += handle.keys()
    return sorted(keys)


class CountingOpen:
    """Stands in for ``safe_open``: counts the tensors read, the shards open now and the most ever open at once."""

    def __init__(self, monkeypatch):
        self.reads, self.open, self.most_open = collections.Counter(), 0, 0
        real = pretrained.safe_open
        counter = self

        class Handle:
            def __init__(self, path, framework):
                self.handle = real(path, framework=framework)
                counter.open += 1
                counter.most_open = max(counter.most_open, counter.open)

            def __enter__(self):
                return self

            def keys(self):
                return self.handle.keys()

            def get_slice(self, key):
                return self.handle.get_slice(key)  # the header only

            def get_tensor(self, key):
                counter.reads[key] += 1
                return self.handle.get_tensor(key)

            def __exit__(self, *exc):
                counter.open -= 1
                return self.handle.__exit__(*exc)

        monkeypatch.setattr(pretrained, "safe_open", Handle)


@pytest.mark.parametrize("sharded", [True, False], ids=["shards", "single"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_streamed_and_resident_weights_load_bitwise_and_each_tensor_is_read_once(tmp_path, monkeypatch, family,
                                                                                sharded):
    eager = tiny_causal_lm(family)
    folder = save(eager, tmp_path / "ckpt", sharded)
    assert len(list(folder.glob("*.safetensors"))) > 1 if sharded else (folder / "model.safetensors").is_file()
    opens = CountingOpen(monkeypatch)
    model = on_meta(eager)
    init = SafetensorsInit(model, folder)
    assert init.missing_keys == [] and init.unexpected_keys == []
    assert not opens.reads and opens.open == 0, "nothing is read before a module asks; no shard is left open"
    engine = engine_for(model, config(tmp_path, "ssd"), init)
    assert opens.open == 0 and opens.most_open == 1, "a shard is open only while one module reads from it"
    assert sorted(opens.reads) == file_keys(folder) and set(opens.reads.values()) == {1}, "each tensor read once"
    assert engine.summary()["weight_bytes_streamed"] > 0
    engine.close()  # streamed weights resident again
    assert_same_tensors(model, eager)  # rotary inv_freq (not in the file) recomputed, bitwise
    if family == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight, "tied weights stay tied"
    x = ids(0)
    assert torch.equal(model(input_ids=x).logits, eager(input_ids=x).logits)


@pytest.mark.parametrize("family, weights", [("gpt2", "ssd"), ("llama", "host"), ("qwen2", MIX)],
                         ids=["gpt2-ssd", "llama-host", "qwen2-mix"])
def test_training_a_lazily_loaded_model_is_bitwise_training_the_eager_one(tmp_path, family, weights):
    eager = tiny_causal_lm(family)
    folder = save(eager, tmp_path / "ckpt")
    model = on_meta(eager)
    losses = train(engine_for(model, config(tmp_path, weights), SafetensorsInit(model, folder)), model)
    assert losses == train(engine_for(eager, config(tmp_path, weights)), eager)
    assert_same_tensors(model, eager)


def test_a_bf16_model_loads_an_fp32_checkpoint_cast_and_trains_like_the_eager_one(tmp_path):
    eager = tiny_causal_lm("llama")
    folder = save(eager, tmp_path / "ckpt")
    eager = eager.to(torch.bfloat16)
    model = on_meta(eager, dtype=torch.bfloat16)
    losses = train(engine_for(model, config(tmp_path, MIX), SafetensorsInit(model, folder)), model)
    assert losses == train(engine_for(eager, config(tmp_path, MIX)), eager)
    assert_same_tensors(model, eager)


def test_base_model_checkpoints_and_causal_lm_checkpoints_load_into_each_other(tmp_path, monkeypatch, caplog):
    from transformers import LlamaModel

    gpt2 = tiny_causal_lm("gpt2")  # a GPT-2 base checkpoint (no "transformer." prefix) into GPT2LMHeadModel
    model = on_meta(gpt2)
    init = SafetensorsInit(model, save(gpt2.transformer, tmp_path / "gpt2-base", sharded=False))
    engine_for(model, config(tmp_path, "ssd"), init).close()
    assert_same_tensors(model, gpt2)

    llama = tiny_causal_lm("llama")  # a LlamaForCausalLM checkpoint into the base LlamaModel: lm_head is not read
    folder = save(llama, tmp_path / "llama")
    opens = CountingOpen(monkeypatch)
    base = on_meta(llama, cls=LlamaModel)
    with caplog.at_level(logging.WARNING, logger="fuyou_strategy"):
        init = SafetensorsInit(base, folder)
    engine_for(base, config(tmp_path, "ssd"), init).close()
    assert init.unexpected_keys == ["lm_head.weight"]
    assert any("lm_head.weight" in r.getMessage() and "not loaded" in r.getMessage() for r in caplog.records)
    assert "lm_head.weight" not in opens.reads and len(opens.reads) == len(base.state_dict())
    assert_same_tensors(base, llama.model)

    # ... and the base model's checkpoint into LlamaForCausalLM: its (untied) head is not there
    base_folder = save(llama.model, tmp_path / "llama-base")
    with pytest.raises(ValueError, match=r"lm_head\.weight not in the checkpoint .*llama-base.*pass fallback="):
        SafetensorsInit(on_meta(llama), base_folder)
    model = on_meta(llama)
    init = SafetensorsInit(model, base_folder, fallback=model._init_weights)
    assert init.missing_keys == ["lm_head.weight"]
    engine_for(model, config(tmp_path, "ssd"), init).close()
    assert_same_tensors(model.model, llama.model)
    assert model.lm_head.weight.std() > 0, "initialised by the fallback"
    assert opens.open == 0


def fresh_adapters(model):
    """A fallback for LoRA adapters that peft created on the meta device (they follow the base layer): as
    peft initialises them, A like ``nn.Linear`` (kaiming-uniform), B zeros, so the adapter starts as identity."""
    def init(module):
        module.reset_parameters()
        if any(module is b for layer in model.modules() if hasattr(layer, "lora_B") for b in layer.lora_B.values()):
            torch.nn.init.zeros_(module.weight)
    return init


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_lora_on_a_lazily_loaded_base_trains_like_lora_on_the_eager_base(tmp_path, family):
    targets = dict(target_modules=["c_attn"], fan_in_fan_out=True) if family == "gpt2" else \
        dict(target_modules=["q_proj", "v_proj"])
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **targets)
    eager = tiny_causal_lm(family)
    folder = save(eager, tmp_path / "ckpt")
    base = on_meta(eager)
    init = SafetensorsInit(base, folder, fallback=fresh_adapters(base))  # built before peft renames modules
    model = get_peft_model(base, lora)  # wraps base in place: the fallback finds the adapters in it
    engine = engine_for(model, config(tmp_path, "ssd"), init)
    adapters = {n: t.clone() for n, t in model.state_dict().items() if "lora_" in n}
    assert len(adapters) == 4 * len(targets["target_modules"])  # A and B per target per block
    assert all(t.abs().sum() == 0 for n, t in adapters.items() if "lora_B" in n), "B starts at zero"
    reference = get_peft_model(eager, lora)
    assert not reference.load_state_dict(adapters, strict=False).unexpected_keys
    losses = train(engine, model)
    assert losses == train(engine_for(reference, config(tmp_path, "ssd")), reference)
    assert_same_tensors(model, reference)


def test_errors_name_the_key_the_file_and_the_fix(tmp_path, monkeypatch):
    eager = tiny_causal_lm("llama")
    folder = save(eager, tmp_path / "ckpt")
    opens = CountingOpen(monkeypatch)
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight in .*ckpt.model-\d+-of-\d+\.safetensors "
                                         r"has shape \(101, 32\), the model's .* \(99, 32\).*config\.json"):
        SafetensorsInit(on_meta(eager, vocab_size=99), folder)
    with pytest.raises(ValueError, match=r"model\.layers\.2\..* and \d+ more not in the checkpoint .*ckpt.*fallback="):
        SafetensorsInit(on_meta(eager, num_hidden_layers=3), folder)
    assert opens.open == 0 and opens.most_open == 1, "a failed construction closes what it opened"
    with pytest.raises(FileNotFoundError, match=r"checkpoint folder .*nowhere does not exist"):
        SafetensorsInit(on_meta(eager), tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty holds neither model\.safetensors nor .*index\.json.*"
                                                r"save_pretrained"):
        SafetensorsInit(on_meta(eager), tmp_path / "empty")
    next(folder.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match=r"index\.json names the shard model-00002-of-\d+\.safetensors, "
                                                r"which is not in .*ckpt"):
        SafetensorsInit(on_meta(eager), folder)

    # A module added after the init was built (a LoRA adapter), with no fallback: the engine refuses, cleanly.
    model = on_meta(tiny_causal_lm("gpt2"))
    init = SafetensorsInit(model, save(tiny_causal_lm("gpt2"), tmp_path / "gpt2"))
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn\.lora_A\.default\.weight \(Linear\) not in "
                                         r"the checkpoint .*LoRA adapter.*fallback="):
        engine_for(model, config(tmp_path, "ssd"), init)
    assert not any((tmp_path / "swap").iterdir()), "nothing left in the swap directory"
