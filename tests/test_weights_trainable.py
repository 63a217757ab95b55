"""Streaming trainable weights (full fine-tuning): bitwise like all-resident training.

Every run here takes 4 optimizer steps of 3 accumulated micro-batches, clipping to 0.5 with loss
scales chosen so that clipping bites on some steps and not on others, and compares every weight
bit and every loss with a resident reference: in fp32, plain torch (``clip_grad_norm_`` +
``torch.optim.AdamW``); in bf16, where torch's AdamW has no fp32 master weights, the same engine
with every weight resident (tests/test_optimizer.py ties that one to torch).
"""

import copy

import pytest
import torch

from conftest import decay_groups, tiny_causal_lm
from fuyou_strategy import ConfigError, FuyouConfig, FuyouEngine

STEPS, ACCUMULATE, MAX_NORM = 4, 3, 0.5
LOSS_SCALE = [0.01, 1.0, 0.01, 1.0]  # x1.0: the norm is above 0.5 (clipping bites); x0.01: below
MIX = {0: "ssd", 1: "host"}


def ids(step, micro):
    return torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(step * 10 + micro))


def loss_of(model, step, micro):
    x = ids(step, micro)
    return model(input_ids=x, labels=x).loss * LOSS_SCALE[step]


def reference(model, tmp_path, steps=STEPS):
    """Resident training: plain torch in fp32 (accumulate, clip_grad_norm_ in param-group order as the
    engine sums, AdamW); the engine with weights='device' otherwise. Returns the losses and how many
    steps clipping bit."""
    if model.dtype != torch.float32:
        engine, losses = train(model, config(tmp_path / "resident", "device"), steps=steps)
        clipped = engine.optimizer.stats.clipped
        engine.close()
        return losses, clipped
    opt = torch.optim.AdamW(decay_groups(model), lr=1e-2)
    losses, clipped = [], 0
    for step in range(steps):
        for micro in range(ACCUMULATE):
            loss = loss_of(model, step, micro)
            loss.backward()
            losses.append(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], MAX_NORM)
        clipped += bool(norm > MAX_NORM)
        opt.step()
        opt.zero_grad()
    return losses, clipped


def config(tmp_path, weights, **overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    values = dict(swap_dirs=[str(tmp_path)], weights=weights, weight_prefetch_blocks=1, chunk_size="8KiB",
                  host_memory_budget="4MiB")
    values.update(overrides)
    return FuyouConfig(**values)


def train(model, cfg, steps=STEPS, engine=None, start=0):
    engine = engine or FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=1e-2), config=cfg,
                                   max_grad_norm=MAX_NORM)
    losses = []
    for step in range(start, steps):
        for micro in range(ACCUMULATE):
            engine.begin_micro_batch(update=micro == ACCUMULATE - 1)
            loss = loss_of(model, step, micro)
            loss.backward()
            losses.append(loss.detach())
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    return engine, losses


def assert_same(model, ref_model, losses, ref_losses):
    assert [x.item() for x in losses] == [x.item() for x in ref_losses]
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), name


def streamed_run(tmp_path, family, weights, dtype, **overrides):
    model = tiny_causal_lm(family, dtype=dtype)
    ref_model = copy.deepcopy(model)
    ref_losses, clipped = reference(ref_model, tmp_path)
    assert 0 < clipped < STEPS, "clipping bites on some steps, not all"
    engine, losses = train(model, config(tmp_path, weights, **overrides))
    summary = engine.summary()
    engine.close()  # every weight resident again, from its tier copy
    assert_same(model, ref_model, losses, ref_losses)
    return summary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weights", ["ssd", MIX], ids=["ssd", "mix"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_full_fine_tune_with_streamed_weights_is_bitwise_torch(tmp_path, family, weights, dtype):
    summary = streamed_run(tmp_path, family, weights, dtype)
    assert summary["weight_tiers"] == ({0: "ssd", 1: "ssd"} if weights == "ssd" else MIX)
    assert summary["weight_bytes_trainable_streamed"] == summary["weight_bytes_streamed"] > 0, "all trainable"
    assert summary["redos"] > 0 and summary["commits"] > 0, "both paths ran with streamed weights"
    assert summary["deferred"] > 0, "auto tried next_forward after the first redo: the streamer waited for updates"
    assert not any(p.name.startswith("fuyou-run") for p in tmp_path.iterdir())


def test_with_activation_swapping_and_recompute(tmp_path):
    summary = streamed_run(tmp_path, "llama", MIX, torch.float32, activations={0: "ssd", 1: "recompute"},
                           activation_min_bytes=0)
    assert summary["activation_bytes_to_ssd"] > 0 and summary["weight_bytes_trainable_streamed"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_state_slot_updates_in_step_bitwise(tmp_path, dtype):
    summary = streamed_run(tmp_path, "gpt2", MIX, dtype, state_slots=1)
    assert summary["redos"] == summary["commits"] == 0, "no speculative update, nothing to redo"
    assert summary["deferred"] == summary["schedule_steps"]["next_forward"] == STEPS, "one slot: next_forward"


@pytest.mark.parametrize("slots", [1, 2])
def test_streamed_weights_with_the_state_in_ram_updated_in_place_are_bitwise(tmp_path, slots):
    """The whole optimizer state in host RAM (``host_state``) under the exact schedule: each update runs on the
    active chunk itself, lent from the read-ahead until handed back, while the streamer reads the masters
    from those chunks; with one slot every step, with two whenever ``auto`` chooses ``next_forward``."""
    summary = streamed_run(tmp_path, "gpt2", MIX, torch.float32, state_slots=slots, host_state="2MiB")
    assert summary["ssd_bytes_optimizer_state"] == 0 < summary["host_bytes_optimizer_state"], "all of it in RAM"
    assert summary["deferred"] > 0, "exact updates ran"


def test_streamed_parameters_state_leaves_the_device_tier_and_the_rest_stays_bitwise(tmp_path):
    """``device_state`` with room for the whole state: the streamed blocks' state goes to the SSD as the streamer
    is installed (their weights and gradients leave the device), the resident parameters' stays on the device."""
    summary = streamed_run(tmp_path, "gpt2", MIX, torch.float32, device_state="4MiB", host_state=0)
    assert summary["weight_bytes_trainable_streamed"] > 0
    assert summary["device_bytes_optimizer_state"] > 0 and summary["ssd_bytes_optimizer_state"] > 0, summary


def test_device_high_water_stays_within_the_budget(tmp_path):
    model = tiny_causal_lm("llama")
    weights_and_grads = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(0.8 * weights_and_grads)  # all-resident training does not fit
    summary = streamed_run(tmp_path, "llama", "ssd", torch.float32, weight_prefetch_blocks=0,
                           device_memory_budget=budget)
    assert 0 < summary["device_peak_bytes"] <= budget < weights_and_grads
    assert summary["weight_device_peak_bytes"] < summary["weight_bytes_streamed"], "never every block at once"


def test_gradients_of_streamed_blocks_leave_the_device(tmp_path):
    model = tiny_causal_lm("gpt2")
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config(tmp_path, "ssd"),
                         max_grad_norm=MAX_NORM)
    try:
        streamed = [p for u in engine.streamer._units.values() for _, p in u.params]
        for micro in range(2):
            with engine.optimizer.no_update():
                loss_of(model, 1, micro).backward()
            assert all(p.grad is None for p in streamed), "partial sums wait in the store, not on the parameter"
            assert model.transformer.wte.weight.grad is not None, "resident parameters accumulate as usual"
        with pytest.raises(RuntimeError, match="between backward and step"):
            engine.save(str(tmp_path / "ckpt"))  # a window is open: its partial sums are not in a checkpoint
        loss_of(model, 1, 2).backward()
        assert all(p.grad is None for p in streamed)
        engine.optimizer.step()
    finally:
        engine.close()


def test_a_checkpoint_taken_with_streamed_weights_resumes_exactly(tmp_path):
    straight = tiny_causal_lm("qwen2")
    model = copy.deepcopy(straight)
    ref_engine, ref_losses = train(straight, config(tmp_path / "a", "ssd"))
    ref_engine.close()

    engine, losses = train(model, config(tmp_path / "b", MIX), steps=2)
    engine.save(str(tmp_path / "ckpt"))
    weights = copy.deepcopy(model.state_dict())  # streamed blocks are served from their tier copies
    engine.close()

    resumed = tiny_causal_lm("qwen2", seed=123)  # another init: everything comes from the checkpoint
    resumed.load_state_dict(weights)
    engine = FuyouEngine(resumed, torch.optim.AdamW(decay_groups(resumed), lr=1e-2),
                         config=config(tmp_path / "c", "ssd", state_slots=1), max_grad_norm=MAX_NORM)
    engine.load(str(tmp_path / "ckpt"))
    engine, more = train(resumed, None, engine=engine, start=2)
    engine.close()
    assert_same(resumed, straight, losses + more, ref_losses)


def test_streamed_blocks_that_no_longer_fit_the_device_at_close_stay_on_the_cpu_bitwise(tmp_path, monkeypatch):
    """A model streamed because it is larger than the device cannot be made resident there when the engine
    closes: the blocks that hit an out-of-memory error become resident on the CPU, from their tier copies
    (bitwise the final weights), with a warning; nothing is lost with the swap files."""
    from fuyou_strategy.params import streaming

    model = tiny_causal_lm("llama")
    ref_model = copy.deepcopy(model)
    ref_losses, _ = reference(ref_model, tmp_path)
    engine, losses = train(model, config(tmp_path, MIX))

    def out_of_memory(t, nbytes):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(streaming, "resize_for_copies", out_of_memory)
    with pytest.warns(RuntimeWarning, match="2 of 2 streamed blocks did not fit on cpu .* resident on the CPU"):
        engine.close()
    assert_same(model, ref_model, losses, ref_losses)


def test_a_skipped_step_leaves_streamed_weights_as_they_were(tmp_path):
    model = tiny_causal_lm("gpt2")
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config(tmp_path, MIX),
                         max_grad_norm=MAX_NORM)
    before = copy.deepcopy(model.state_dict())
    try:
        (loss_of(model, 1, 0) * float("inf")).backward()
        engine.optimizer.step()
        assert engine.optimizer.stats.skips == 1
        after = model.state_dict()
        for name, t in before.items():
            assert torch.equal(after[name], t), name
    finally:
        engine.close()


def test_a_streamed_block_that_does_not_fit_the_device_budget_is_refused(tmp_path):
    model = tiny_causal_lm("gpt2")
    with pytest.raises(ConfigError, match=r"device_memory_budget: got 16.00 KiB, but the resident weights .* "
                                          r"and the largest streamed gradient"):
        FuyouEngine(model, torch.optim.AdamW(model.parameters()),
                    config=config(tmp_path, "ssd", device_memory_budget="16KiB"))
    assert not any(p.name.startswith("fuyou-run") for p in tmp_path.iterdir())


def test_lightning_with_streamed_weights_equals_resident_and_resumes_exactly(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_lightning import CausalLM, fit

    from fuyou_strategy import FuyouStrategy

    def strategy(**fields):
        return FuyouStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB", **fields)

    def same(a, b):  # after fit the streamer is still installed: its weights are read through state_dict
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for name in sa:
            assert torch.equal(sa[name], sb[name]), name

    resident, _ = fit(strategy(), steps=-1, max_epochs=2, batches=6)
    every_epoch = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    streamed, trainer = fit(strategy(weights={0: "ssd", 1: "host"}), steps=-1, max_epochs=2, batches=6,
                            callbacks=[every_epoch])
    assert trainer.strategy.engine.summary()["weight_bytes_trainable_streamed"] > 0
    assert trainer.strategy.engine.optimizer.stats.redos > 0, "clipping bit"
    same(resident, streamed)
    module = CausalLM()
    module.model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    resumed, trainer = fit(strategy(weights="ssd"), steps=-1, max_epochs=2, batches=6, module=module,
                           ckpt_path=str(tmp_path / "ckpts" / "epoch=0.ckpt"))
    assert trainer.global_step == 6
    same(resident, resumed)
    trainer.strategy.engine.close()  # every weight resident again
    for (name, p), (_, q) in zip(resident.named_parameters(), resumed.named_parameters()):
        assert torch.equal(p, q), name


def test_hf_trainer_with_streamed_weights_equals_resident(tmp_path):
    from test_hf import swap_config, train as hf_train

    from fuyou_strategy import FuyouCallback

    reference, _ = hf_train(tmp_path, FuyouCallback(**swap_config(tmp_path)))
    callback = FuyouCallback(**swap_config(tmp_path, weights="ssd", weight_prefetch_blocks=1))
    ours, _ = hf_train(tmp_path, callback)
    assert callback.summary["weight_bytes_trainable_streamed"] > 0 and callback.summary["redos"] > 0
    for (name, p), q in zip(reference.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), name


def test_a_model_built_on_the_meta_device_is_never_whole_in_memory_and_trains_like_resident(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=3, n_head=2, n_embd=32, vocab_size=101, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    blocks = list(model.transformer.h)
    seen = []

    def init(module):  # called as each module gets memory: no other block may hold any then
        owner = next((i for i, b in enumerate(blocks) if any(module is m for m in b.modules())), None)
        if owner is not None:
            others = [p for i, b in enumerate(blocks) if i != owner for p in b.parameters()]
            seen.append(all(p.is_meta or p.untyped_storage().nbytes() == 0 for p in others))
        model._init_weights(module)

    torch.manual_seed(0)
    engine = FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=1e-2), config=config(tmp_path, "ssd"),
                         max_grad_norm=MAX_NORM, init_weights=init)
    assert seen and all(seen), "one block at a time"
    assert not any(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight, "tied weights stay tied"
    initial = copy.deepcopy(model.state_dict())  # served from the tier copies
    resident = GPT2LMHeadModel(cfg)
    resident.load_state_dict(initial)
    ref_losses, _ = reference(resident, tmp_path)
    engine, losses = train(model, None, engine=engine)
    engine.close()
    assert_same(model, resident, losses, ref_losses)


def test_fabric_with_streamed_weights_equals_resident(tmp_path):
    import warnings

    from test_lightning import fabric_train

    from fuyou_strategy import FuyouFabricStrategy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resident = fabric_train(FuyouFabricStrategy(swap_dirs=[str(tmp_path)], max_grad_norm=1.0))
        strategy = FuyouFabricStrategy(swap_dirs=[str(tmp_path)], max_grad_norm=1.0, weights="ssd")
        streamed = fabric_train(strategy)
    assert strategy.engine.summary()["weight_bytes_trainable_streamed"] > 0
    ours = streamed.state_dict()  # still streamed: served from the tier copies
    for name, t in resident.state_dict().items():
        assert torch.equal(t, ours[name]), name
    strategy.teardown()


def test_fp32_weights_on_the_ssd_stream_from_the_optimizers_master(tmp_path):
    """An fp32 trainable weight on the SSD tier has no copy of its own: the streamer reads the head of each of
    its optimizer state chunks (the master), 4 bytes per parameter less on the SSD. Training stays bitwise (the
    tests above run this path); a model state dict is served from the masters, and loading one into the
    streamed blocks writes the masters, moments kept."""
    model = tiny_causal_lm("gpt2")
    engine, _ = train(model, config(tmp_path, "ssd"), steps=2)
    try:
        streamer, opt = engine.streamer, engine.optimizer
        streamed = {id(p) for p in streamer.streamed()}  # by identity: a released weight must not be read
        assert streamer.stats.from_master == len(streamed) > 0
        assert not [name for name in opt.store.entries if name.startswith("weights.")], "no copy of their own"
        sd = model.state_dict()
        params = {name: p for name, p in model.named_parameters() if id(p) in streamed}
        for name, p in params.items():
            assert torch.equal(sd[name], opt.read_state(p)["master"]), name
        other = tiny_causal_lm("gpt2", seed=7).state_dict()
        before = {name: opt.read_state(p) for name, p in params.items()}
        model.load_state_dict(other)
        for name, p in params.items():
            state = opt.read_state(p)
            assert torch.equal(state["master"], other[name]) and not torch.equal(other[name], before[name]["master"])
            assert torch.equal(state["exp_avg"], before[name]["exp_avg"]), name
    finally:
        engine.close()
