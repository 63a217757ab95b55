"""Activation swapping: bitwise gradients for every policy, budgets, cleanup, safe edges."""

import contextlib

import pytest
import torch

from conftest import tiny_causal_lm
from fuyou_strategy import ConfigError, FuyouConfig
from fuyou_strategy.activations import ActivationSwapper, Policy, discover_blocks, resolve_policies

POLICIES = ["keep", "host", "ssd", "recompute"]
MIX = {0: "ssd", 1: "recompute"}  # blocks: 0 -> ssd, 1 -> recompute (tiny models have 2 blocks)


def config(tmp_path, activations, **overrides):
    values = dict(swap_dirs=[str(tmp_path)], activations=activations, activation_min_bytes=0,
                  chunk_size="8KiB", host_memory_budget="2MiB")
    values.update(overrides)
    return FuyouConfig(**values)


def ids(seed=0):
    return torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(seed))


def grads(model, context=contextlib.nullcontext(), autocast=False):
    model.zero_grad(set_to_none=True)
    x = ids().to(next(model.parameters()).device)  # compute_device's, where a test asks for it
    with context:
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_bitwise(a, b):
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_nothing_held(swapper):
    assert swapper.held == 0
    if swapper.store is not None:
        assert swapper.store.entries == {}, "SSD entries are released after use"
        assert swapper.store.pool.lent == 0, "host buffers are back in the pool"
        assert swapper.store.pool.high_water <= swapper.store.pool.budget


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("activations", POLICIES + [MIX], ids=POLICIES + ["mix"])
def test_gradients_are_bitwise_equal_to_no_hooks(tmp_path, family, activations, compute_device):
    model = tiny_causal_lm(family).to(compute_device)
    reference = grads(model)
    swapper = ActivationSwapper(model, config(tmp_path, activations))
    for _ in range(2):  # a second step reuses the freed SSD space
        assert_bitwise(grads(model, swapper), reference)
        assert_nothing_held(swapper)
    if activations in ("ssd", MIX):
        assert swapper.stats.ssd_bytes > 0 and swapper.stats.prefetched + swapper.stats.fetched_on_demand > 0
    if activations == "ssd" and family == "llama":
        # Llama's separate q/k/v (and gate/up) projections save one input several times.
        assert swapper.stats.deduplicated > 0
    if activations == "host":
        assert swapper.stats.host_bytes > 0
    swapper.close()
    assert not any(p.name.startswith("fuyou-run") for p in tmp_path.iterdir()), "close() removes the files"


@pytest.mark.parametrize("activations", ["ssd", "host", MIX], ids=["ssd", "host", "mix"])
def test_bf16_autocast(tmp_path, activations):
    model = tiny_causal_lm("llama")
    reference = grads(model, autocast=True)
    swapper = ActivationSwapper(model, config(tmp_path, activations))
    assert_bitwise(grads(model, swapper, autocast=True), reference)
    assert_nothing_held(swapper)
    swapper.close()


def test_autocast_weight_copies_and_parameters_are_never_swapped(tmp_path):
    model = tiny_causal_lm("llama")
    swapper = ActivationSwapper(model, config(tmp_path, "ssd"))
    swapped = []
    pack = swapper._pack

    def recording_pack(*args):
        t = args[-1]
        out = pack(*args)
        if out is not t:
            swapped.append(t)
        return out

    swapper._pack = recording_pack
    grads(model, swapper, autocast=True)
    swapper.close()
    assert swapped, "activations were swapped"
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    bf16_weights = [p.detach().to(torch.bfloat16) for p in model.parameters() if p.ndim == 2]
    for t in swapped:
        base = t._base if t._base is not None else t  # mm saves weight.t(), a view of the copy
        assert base.untyped_storage().data_ptr() not in params
        assert not any(base.shape == w.shape and torch.equal(base, w) for w in bf16_weights), "a bf16 weight copy was swapped"
    # A tensor saved again is not swapped again: it gets the handle it already has.
    assert len({id(t) for t in swapped}) + swapper.stats.deduplicated == len(swapped)


def test_lora_model_through_peft(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_causal_lm("gpt2"), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    reference = grads(model)
    assert all("lora" in name for name in reference), "only adapter weights train"
    swapper = ActivationSwapper(model, config(tmp_path, "ssd"))
    assert len(swapper.blocks) == 2, "blocks are found through the PEFT wrapper"
    assert_bitwise(grads(model, swapper), reference)
    assert_nothing_held(swapper)
    swapper.close()


def test_host_pool_never_exceeds_budget_and_overflow_keeps(tmp_path):
    model = tiny_causal_lm("gpt2")
    reference = grads(model)
    swapper = ActivationSwapper(model, config(tmp_path, "host", host_memory_budget="64KiB"))
    assert_bitwise(grads(model, swapper), reference)
    assert swapper.stats.host_pool_full > 0, "the budget was too small for all: the rest stayed on the device"
    assert swapper.store.pool.high_water <= 64 * 1024
    assert_nothing_held(swapper)
    swapper.close()


def test_eval_and_no_grad_leave_nothing_behind(tmp_path):
    model = tiny_causal_lm("gpt2")
    swapper = ActivationSwapper(model, config(tmp_path, "ssd"))
    model.eval()
    with swapper, torch.no_grad():
        model(input_ids=ids())
    assert swapper.stats.ssd_bytes == 0
    assert_nothing_held(swapper)
    with swapper:  # eval with grad enabled, no backward: released at exit
        model(input_ids=ids(), labels=ids()).loss
    assert swapper.stats.ssd_bytes > 0
    assert_nothing_held(swapper)
    swapper.close()


def test_exception_mid_forward_and_mid_backward_releases_everything(tmp_path):
    model = tiny_causal_lm("gpt2")
    swapper = ActivationSwapper(model, config(tmp_path, "ssd"))
    blocks = swapper.blocks

    def boom(*_):
        raise RuntimeError("boom in forward")

    handle = blocks[1].register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom in forward"):
        grads(model, swapper)
    handle.remove()
    assert_nothing_held(swapper)
    assert "forward" not in vars(blocks[0]), "the wrappers are removed"

    # A forward someone else set on the instance survives a step (and is what the step ran).
    calls = []
    original = blocks[0].forward

    def theirs(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    blocks[0].forward = theirs
    grads(model, swapper)
    assert vars(blocks[0])["forward"] is theirs and calls
    del blocks[0].forward

    def raise_in_backward(module, args, output):
        hidden = output if isinstance(output, torch.Tensor) else output[0]
        hidden.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom in backward")))

    handle = blocks[1].register_forward_hook(raise_in_backward)
    with pytest.raises(RuntimeError, match="boom in backward"):
        grads(model, swapper)
    handle.remove()
    assert_nothing_held(swapper)
    reference = grads(model)
    assert_bitwise(grads(model, swapper), reference), "the swapper still works afterwards"
    swapper.close()


def test_second_backward_is_a_clear_error_for_swapped_policies(tmp_path):
    model = tiny_causal_lm("gpt2")
    for policy in ("ssd", "host"):
        swapper = ActivationSwapper(model, config(tmp_path, policy))
        with swapper:
            loss = model(input_ids=ids(), labels=ids()).loss
            loss.backward(retain_graph=True)
            with pytest.raises(RuntimeError, match="already used by a backward pass and released, .*retain_graph=True needs"):
                loss.backward()
        assert_nothing_held(swapper)
        swapper.close()
    swapper = ActivationSwapper(model, config(tmp_path, "ssd"))
    with swapper:
        loss = model(input_ids=ids(), labels=ids()).loss
    with pytest.raises(RuntimeError, match="the `with swapper:` block it was saved in has ended"):
        loss.backward()  # backward outside the block: its activations were released on exit
    swapper.close()
    swapper = ActivationSwapper(model, config(tmp_path, "recompute"))
    with swapper:  # recompute supports it
        loss = model(input_ids=ids(), labels=ids()).loss
        loss.backward(retain_graph=True)
        loss.backward()


def test_block_discovery_and_policy_errors():
    gpt2, llama = tiny_causal_lm("gpt2"), tiny_causal_lm("llama")
    assert discover_blocks(gpt2) == list(gpt2.transformer.h)
    assert discover_blocks(llama) == list(llama.model.layers)
    assert discover_blocks(llama, "model.layers.1") == [llama.model.layers[1]]
    with pytest.raises(ConfigError, match="blocks: 'model.nope' is not a submodule"):
        discover_blocks(llama, "model.nope")
    with pytest.raises(ConfigError, match="found no ModuleList of repeated blocks"):
        discover_blocks(torch.nn.Linear(2, 2))
    assert resolve_policies({1: "ssd"}, 3) == [Policy.KEEP, Policy.SSD, Policy.KEEP]
    with pytest.raises(ConfigError, match=r"activations\[5\]: the model has 3 blocks"):
        resolve_policies({5: "ssd"}, 3)
    with pytest.raises(ConfigError, match="activations: got 'disk'; expected 'auto', one of"):
        FuyouConfig(activations="disk")


def test_installed_for_a_run_with_accumulation_and_two_forwards_before_backward(tmp_path):
    """install/begin_pass (the engine's mode): each forward is a pass with its own bookkeeping."""
    model = tiny_causal_lm("gpt2")

    def accumulated(swapper=None):
        model.zero_grad(set_to_none=True)
        for seed in (1, 2):  # two micro-batches, each forward then backward
            if swapper is not None:
                swapper.begin_pass()
            model(input_ids=ids(seed), labels=ids(seed)).loss.backward()
        losses = []
        for seed in (3, 4):  # two forwards, then one backward through both graphs
            if swapper is not None:
                swapper.begin_pass()
            losses.append(model(input_ids=ids(seed), labels=ids(seed)).loss)
        (losses[0] + losses[1]).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    reference = accumulated()
    swapper = ActivationSwapper(model, config(tmp_path, "ssd", activation_prefetch_blocks=1))
    swapper.install()
    try:
        assert_bitwise(accumulated(swapper), reference)
        assert_nothing_held(swapper)
        # Backward reached each pass's blocks through that pass's own hooks, so most reads were
        # issued ahead of their unpack even across passes.
        assert swapper.stats.prefetched > 0
    finally:
        swapper.uninstall()
        swapper.close()
    assert "forward" not in vars(swapper.blocks[0]), "uninstall() puts the class's forward back"
