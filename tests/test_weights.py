"""Streaming frozen weights (a LoRA base model) from host memory and SSD: bitwise like resident."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from conftest import tiny_causal_lm
from fuyou_strategy import ConfigError, FuyouConfig, FuyouEngine
from fuyou_strategy.params import WeightStreamer

MIX = {0: "ssd", 1: "host"}
TIERS = ["ssd", "host", MIX]
TIER_IDS = ["ssd", "host", "mix"]


def lora_model(family="gpt2"):
    if family == "gpt2":
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    else:
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(tiny_causal_lm(family), lora)


def config(tmp_path, weights="device", **overrides):
    values = dict(swap_dirs=[str(tmp_path)], weights=weights, weight_prefetch_blocks=1, chunk_size="8KiB",
                  host_memory_budget="4MiB", activation_min_bytes=0)
    values.update(overrides)
    return FuyouConfig(**values)


def ids(seed):
    return torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(seed))


def engine_for(model, cfg, **kwargs):
    """A FuyouEngine over the model's trainable parameters."""
    return FuyouEngine(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                       config=cfg, **kwargs)


def run_steps(engine, model, n, start=0):
    """``n`` engine steps on a fixed batch schedule, from its step ``start``; the losses."""
    losses = []
    for step in range(start, start + n):
        engine.begin_micro_batch(update=True)
        x = ids(step).to(next(model.parameters()).device)  # compute_device's, where a test asks for it
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def train(model, cfg, steps=3):
    """A few engine steps (clipping on); the losses, the trainable weights and the engine's summary."""
    engine = engine_for(model, cfg, max_grad_norm=1e-3)
    try:
        losses = run_steps(engine, model, steps)
        summary = engine.summary()
    finally:
        engine.close()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, summary


def frozen(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def assert_equal(a, b):
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("weights", TIERS, ids=TIER_IDS)
def test_lora_trains_bitwise_like_resident_weights(tmp_path, family, weights, compute_device):
    ref_losses, reference, _ = train(lora_model(family).to(compute_device), config(tmp_path))
    model = lora_model(family).to(compute_device)
    base = frozen(model)
    losses, ours, summary = train(model, config(tmp_path, weights))
    assert [x.item() for x in losses] == [x.item() for x in ref_losses]
    assert_equal(ours, reference)
    assert_equal(frozen(model), base)  # resident again after close, with the original bits
    assert summary["redos"] > 0, "clipping bit"
    assert summary["weight_bytes_streamed"] > 0 and len(summary["weight_tiers"]) == 2
    assert 0 < summary["weight_device_peak_bytes"] <= summary["weight_bytes_streamed"]
    assert not any(p.name.startswith("fuyou-run") for p in tmp_path.iterdir())


@pytest.mark.parametrize("activations", ["ssd", {0: "ssd", 1: "recompute"}], ids=["ssd", "ssd+recompute"])
def test_with_activation_swapping(tmp_path, activations):
    ref_losses, reference, ref_summary = train(lora_model(), config(tmp_path, activations=activations))
    losses, ours, summary = train(lora_model(), config(tmp_path, "ssd", activations=activations))
    assert [x.item() for x in losses] == [x.item() for x in ref_losses]
    assert_equal(ours, reference)
    assert summary["activation_bytes_to_ssd"] > 0 and summary["weight_bytes_streamed"] > 0
    # A streamed weight's storage moves when it is materialised again: still a weight, never an activation.
    assert summary["activation_bytes_to_ssd"] == ref_summary["activation_bytes_to_ssd"]


def test_streamed_weights_leave_the_device_and_the_window_bounds_the_peak(tmp_path):
    model = lora_model("llama")
    base = frozen(model)
    streamer = WeightStreamer(model, config(tmp_path, "ssd", weight_prefetch_blocks=0))
    streamer.install()
    blocks = streamer.blocks
    streamed = [p for _, p in streamer._units[0].params]
    assert streamed and all(not p.requires_grad for p in streamed)
    names = {n for n, _ in streamer._units[0].params}
    assert not any("lora" in n for n in names), "trainable adapters stay resident"
    assert all(p.untyped_storage().nbytes() == 0 for p in streamed), "released at install"
    seen = []
    for i, block in enumerate(blocks):  # during its own forward, a block's weights are there, the others' not
        block.register_forward_hook(lambda m, a, o, i=i: seen.append(
            [all(p.untyped_storage().nbytes() > 0 for _, p in streamer._units[j].params) for j in range(len(blocks))]), prepend=True)
    loss = model(input_ids=ids(0), labels=ids(0)).loss
    assert seen == [[True, False], [False, True]]
    assert all(p.untyped_storage().nbytes() == 0 for p in streamed), "block 0 released after its forward"
    loss.backward()
    assert streamer.stats.materialized_bytes == 0, "backward's end releases every block"
    assert all(p.untyped_storage().nbytes() == 0 for u in streamer._units.values() for _, p in u.params)
    assert 0 < streamer.stats.high_water_bytes <= streamer.stats.window_bytes
    assert streamer.stats.window_bytes == max(u.nbytes for u in streamer._units.values())  # k = 0: one block
    assert model.base_model.model.lm_head.weight.untyped_storage().nbytes() > 0, "outside the blocks: resident"
    state = model.state_dict()  # served from the tier copies, not the released storage
    assert_equal({n: state[n] for n in base}, base)
    changed = {n: t + 1 if n in base else t for n, t in state.items()}
    model.load_state_dict(changed)  # into the tier copies: the block is released again afterwards
    assert all(p.untyped_storage().nbytes() == 0 for u in streamer._units.values() for _, p in u.params)
    assert_equal({n: model.state_dict()[n] for n in base}, {n: changed[n] for n in base})
    streamer.close()
    assert_equal(frozen(model), {n: changed[n] for n in base})


def test_tied_weights_stay_resident(tmp_path):
    model = tiny_causal_lm("gpt2")
    for p in model.parameters():
        p.requires_grad_(False)
    block = model.transformer.h[0]
    model.transformer.h[1].mlp.c_proj.weight = block.mlp.c_proj.weight  # one Parameter in two blocks
    streamer = WeightStreamer(model, config(tmp_path, "host"))
    streamer.install()
    shared = block.mlp.c_proj.weight
    assert shared.untyped_storage().nbytes() > 0
    assert all(p is not shared for u in streamer._units.values() for _, p in u.params)
    assert model.transformer.wte.weight.untyped_storage().nbytes() > 0, "wte (tied to lm_head) stays"
    streamer.close()


def test_eval_under_no_grad_works_and_releases(tmp_path):
    model = lora_model()
    model.eval()
    with torch.no_grad():
        reference = model(input_ids=ids(0)).logits
    streamer = WeightStreamer(model, config(tmp_path, "ssd"))
    streamer.install()
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(input_ids=ids(0)).logits, reference)
            assert streamer.stats.materialized_bytes == 0, "no backward follows: nothing kept"
    assert streamer.store.pool.lent == 0, "staging buffers are back"
    streamer.close()


def test_an_exception_in_a_block_releases_everything_and_uninstall_restores(tmp_path):
    model = lora_model()
    base = frozen(model)
    streamer = WeightStreamer(model, config(tmp_path, MIX, weight_prefetch_blocks=1))
    streamer.install()
    fault = model.base_model.model.transformer.h[0].mlp.register_forward_hook(
        lambda *_: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        model(input_ids=ids(0), labels=ids(0))
    fault.remove()
    assert streamer.stats.materialized_bytes == 0
    assert all(p.untyped_storage().nbytes() == 0 for u in streamer._units.values() for _, p in u.params)
    assert streamer.store.pool.lent == sum(w.host.capacity for u in streamer._units.values() for w in u.weights
                                           if w.host is not None), \
        "only the host tier's copies are lent: the prefetch's staging buffer is back"
    loss = model(input_ids=ids(0), labels=ids(0)).loss  # and the next step works
    loss.backward()
    streamer.close()
    assert streamer.store.closed
    assert_equal(frozen(model), base)
    for block in streamer.blocks:
        assert not block._forward_pre_hooks and not block._forward_hooks, "every hook removed"


def test_bad_configuration_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"weights: got 'disk'; expected 'auto', one of \['device', 'host', 'ssd'\]"):
        FuyouConfig(weights="disk")
    with pytest.raises(ConfigError, match="weights: got 'auto'"):  # activations set by hand: no planner to choose
        FuyouConfig(weights="auto", activations="keep")
    with pytest.raises(ConfigError, match=r"weights\[1\]: got 'gpu'"):
        FuyouConfig(weights={0: "ssd", 1: "gpu"})
    with pytest.raises(ConfigError, match="weight_prefetch_blocks: got -1"):
        FuyouConfig(weight_prefetch_blocks=-1)
    with pytest.raises(ConfigError, match=r"weights\[5\]: the model has 2 blocks"):
        WeightStreamer(lora_model(), config(tmp_path, {5: "ssd"}))
    model = lora_model()
    base = frozen(model)
    streamer = WeightStreamer(model, config(tmp_path, "ssd", device_memory_budget="64KiB"))
    with pytest.raises(ConfigError, match="device_memory_budget: got 64.00 KiB, but the resident weights"):
        streamer.install()
    streamer.close()
    streamer = WeightStreamer(model, config(tmp_path, "host", host_memory_budget="16KiB", chunk_size="4KiB"))
    with pytest.raises(ConfigError, match="host_memory_budget: the host tier needs"):
        streamer.install()
    streamer.close()
    assert_equal(frozen(model), base)
    with pytest.raises(ConfigError, match="device_memory_budget"):  # through the engine: nothing left behind
        train(lora_model(), config(tmp_path, "ssd", device_memory_budget="64KiB"))
    assert not any(p.name.startswith("fuyou-run") for p in tmp_path.iterdir())


def test_hf_trainer_with_ssd_weights_equals_the_run_without(tmp_path):
    from fuyou_strategy import FuyouCallback
    from test_hf import swap_config, train as hf_train

    reference, _ = hf_train(tmp_path, FuyouCallback(**swap_config(tmp_path)), model=lora_model())
    callback = FuyouCallback(**swap_config(tmp_path, weights="ssd", weight_prefetch_blocks=1))
    ours, _ = hf_train(tmp_path, callback, model=lora_model())
    assert callback.summary["weight_bytes_streamed"] > 0 and callback.summary["weight_tiers"] == {0: "ssd", 1: "ssd"}
    for (name, p), q in zip(reference.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), name
