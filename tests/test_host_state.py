"""The optimizer state's host-RAM tier (``FuyouConfig.host_state``, issue 25's first part): any split of the
state between host RAM and the SSD trains bitwise like the state all on the SSD, resumes across splits, and
stays within ``host_memory_budget``."""

import copy

import pytest
import torch

from conftest import decay_groups, tiny_causal_lm
from fuyou_strategy import ConfigError, FuyouAdamW, FuyouConfig, FuyouEngine
from fuyou_strategy.device import host_buffer_usage, reset_host_buffer_high_water
from fuyou_strategy.storage import StorageSpaceError, TensorStore
from test_schedule import MAX_NORM, STEPS, config, reference, train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

SPLITS = {"none": 0, "mixed": "96KiB", "all": "768KiB"}  # of host_memory_budget="1MiB" (test_schedule.config)


def state_bytes(opt):
    """Optimizer state on the SSD and in host RAM (every slot, with padding)."""
    summary_like = [(e.memory is None, e.slots * e.nchunks * e.stride) for name, e in opt.store.entries.items()
                    if name.startswith("adamw.")]
    return sum(n for ssd, n in summary_like if ssd), sum(n for ssd, n in summary_like if not ssd)


@pytest.mark.parametrize("schedule,slots", [("backward", 2), ("next_forward", 2), ("auto", 2), ("next_forward", 1)])
@pytest.mark.parametrize("split", ["mixed", "all"])
def test_any_split_trains_bitwise_like_torch_and_the_state_on_ssd(tmp_path, split, schedule, slots):
    """Clipping that bites, a non-finite step skipped, three micro-batches accumulated (test_schedule's run)."""
    model = tiny_causal_lm("llama")
    ref_model = copy.deepcopy(model)
    ref_losses = reference(ref_model)
    engine = FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True), max_grad_norm=MAX_NORM,
                         config=config(tmp_path, schedule, state_slots=slots, host_state=SPLITS[split]))
    opt = engine.optimizer
    on_ssd, in_ram = state_bytes(opt)
    losses, _ = train(model, opt, lambda last: engine.begin_micro_batch(update=last))
    summary = engine.summary()
    engine.close()
    assert in_ram > 0 and (on_ssd > 0) == (split == "mixed"), (on_ssd, in_ram)
    assert summary["host_bytes_optimizer_state"] == in_ram and summary["ssd_bytes_optimizer_state"] == on_ssd
    assert losses == ref_losses
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
    assert opt.stats.skips == 1 and opt.stats.steps == STEPS - 1 and opt.stats.clipped >= 1


def test_a_save_resumes_into_another_split_exactly(tmp_path):
    """Checkpoints do not depend on where the state lived: saved with it all on the SSD, resumed with a mixed
    split (and back), the run goes on bitwise as if uninterrupted."""
    straight = tiny_causal_lm("gpt2")
    first = copy.deepcopy(straight)
    splits = ["none", "mixed", "all"]
    for name in ["a", *splits]:
        (tmp_path / name).mkdir()
    with FuyouAdamW(decay_groups(straight), lr=3e-3, max_grad_norm=MAX_NORM,
                    config=config(tmp_path / "a", "next_forward")) as opt:
        train(straight, opt)
        expected = [opt.read_state(p) for p in straight.parameters()]
    model, folder = first, tmp_path / "ckpt"
    for i, split in enumerate(splits):
        with FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM,
                        config=config(tmp_path / split, "next_forward", host_state=SPLITS[split])) as opt:
            if i:
                opt.load_folder(folder)
            train(model, opt, steps=range(2 * i, 2 * i + 2))
            opt.state_dict(folder)
            if split == splits[-1]:
                got = [opt.read_state(p) for p in model.parameters()]
    for p, q in zip(straight.parameters(), model.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(expected, got):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_host_tier_stays_within_host_memory_budget(tmp_path):
    """The state in RAM comes out of host_memory_budget: the pool lends it for the entries' life, and every
    host buffer of the process together (the process-wide counter) never exceeds the budget."""
    cfg = config(tmp_path, "backward", host_state="512KiB")
    model = tiny_causal_lm("gpt2")
    reset_host_buffer_high_water()
    base = host_buffer_usage().live
    with FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM, config=cfg) as opt:
        assert opt.store.pool.budget == cfg.host_memory_budget
        assert 0 < opt.store.bytes_in_memory <= cfg.host_state and opt.store.pool.lent >= opt.store.bytes_in_memory
        train(model, opt, steps=range(3))
    assert host_buffer_usage().high_water - base <= cfg.host_memory_budget


def test_host_state_is_checked_against_the_budget_and_the_store_keeps_to_it(tmp_path):
    with pytest.raises(ConfigError, match=r"host_state: got '1000KiB' .* the transfers need at least two chunks"):
        FuyouConfig(chunk_size="24KiB", host_memory_budget="1MiB", host_state="1000KiB")
    with TensorStore(FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", host_memory_budget="1MiB",
                                 host_state="16KiB")) as store:
        store.create("a", (2048,), torch.float32, in_memory=True)  # 8 KiB, two slots
        with pytest.raises(StorageSpaceError, match=r"entry 'b' needs 16.00 KiB of host memory but the optimizer "
                                                    r"state's host tier \(host_state\) has 0 B of 16.00 KiB left"):
            store.create("b", (2048,), torch.float32, in_memory=True)
        x = torch.randn(2048)
        store.write("a", x, slot="shadow").result()
        store.commit(["a"])
        assert torch.equal(store.read("a").result(), x), "the slots of an in-memory entry flip like the SSD's"
        assert store.bytes_in_memory == 16 * 1024 and store.bytes_on_disk == 0


def _lightning(tmp_path, **fields):
    from test_lightning import fit

    from fuyou_strategy import FuyouStrategy

    model, trainer = fit(FuyouStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB", **fields))
    return model, trainer.strategy.engine.summary()


def _hf(tmp_path, **fields):
    from test_hf import swap_config, train

    from fuyou_strategy import FuyouCallback

    callback = FuyouCallback(**swap_config(tmp_path, **fields))
    model, _ = train(tmp_path, callback)
    return model, callback.summary


@pytest.mark.parametrize("run", [_lightning, _hf], ids=["lightning", "hf"])
def test_through_lightning_and_hf_a_split_changes_no_bit(tmp_path, run):
    """6 steps, 2 micro-batches each, clipping that bites (the integrations' own tests' runs)."""
    (tmp_path / "ssd").mkdir()
    (tmp_path / "split").mkdir()
    on_ssd, ssd_summary = run(tmp_path / "ssd")
    split, summary = run(tmp_path / "split", host_state="64KiB")
    assert summary["host_bytes_optimizer_state"] > 0 and ssd_summary["host_bytes_optimizer_state"] == 0
    assert summary["ssd_bytes_optimizer_state"] < ssd_summary["ssd_bytes_optimizer_state"]
    assert summary["redos"] + summary["clipped"] > 0, "clipping bit"
    for (name, p), q in zip(on_ssd.named_parameters(), split.parameters()):
        assert torch.equal(p, q), name
