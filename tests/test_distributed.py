"""Data parallelism (issue 15, the optimizer's part): 2 processes over gloo, each rank owning a shard
of the SSD state, train like one process on the global batch."""

import contextlib
import dataclasses
import math
import os
import shutil
import signal

import lightning as L
import pytest
import torch
import torch.distributed as dist

from ranks import spawn as spawn_ranks
from conftest import tiny_causal_lm
from fuyou_strategy.cli import main as fuyou_main
from fuyou_strategy import ConfigError, FuyouAdamW, FuyouConfig, FuyouEngine
from fuyou_strategy.activations import discover_blocks
from fuyou_strategy.optim.distributed import RankError

pytestmark = pytest.mark.slow  # runs processes that import torch anew, or a benchmark harness (conftest: slow)

STEPS, ACCUMULATE, PER_RANK, SEQ = 3, 2, 2, 16
TOLERANCE = 1e-3  # relative, per tensor, against one process on the global batch (explained in the test)


def global_batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 101, (2 * PER_RANK, SEQ), generator=g) for _ in range(ACCUMULATE)] for _ in range(STEPS)]


def _rank_main(rank, world, tmp, family, fields, grow=False):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = tiny_causal_lm(family)
        if rank == 1 and fields.get("weights", "device") != "device":
            with torch.no_grad():  # streamed weights start as rank 0's, whatever each rank built
                for block in discover_blocks(model):
                    for p in block.parameters():
                        p.add_(1.0)
        os.makedirs(f"{tmp}/swap{rank}", exist_ok=True)
        config = FuyouConfig(swap_dirs=[f"{tmp}/swap{{local_rank}}"], chunk_size="8KiB", **fields)  # swap0, swap1
        engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), config=config,
                             max_grad_norm=0.5, process_group=dist.group.WORLD)
        try:
            tier = _tier_to_grow(engine, rank) if grow else lambda: None
            state_bytes = sum(e.slots * e.nchunks * e.stride for name, e in engine.optimizer.store.entries.items()
                              if name.startswith("adamw."))
            for micro_batches in global_batches():
                for i, ids in enumerate(micro_batches):
                    mine = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
                    engine.begin_micro_batch(update=i == ACCUMULATE - 1)
                    (model(input_ids=mine, labels=mine).loss / ACCUMULATE).backward()
                engine.optimizer.step()
                engine.optimizer.zero_grad(set_to_none=True)
            # step() returned with the updates still running: each weight is broadcast when the next
            # forward reaches its module (here: when state_dict below lands them all)
            pending = len(engine.optimizer.sharding.unsent)
            stats = engine.optimizer.stats
            torch.save({"weights": model.state_dict(), "state_bytes": state_bytes, "clipped": stats.clipped,
                        "norm": stats.last_grad_norm, "owned": engine.optimizer.shards.loads[rank],
                        "run_dirs": engine.optimizer.store.run_dirs, "pending": pending,
                        "params": len(list(model.parameters())), "summary": engine.summary(),
                        "plan": dataclasses.asdict(engine.plan) if engine.plan is not None else None,
                        "tier": tier()},
                       f"{tmp}/rank{rank}.pt")
        finally:
            engine.close()
    finally:
        dist.destroy_process_group()


def _tier_to_grow(engine, rank):
    """test_device_state's growth of a plan's device tier, on each rank: the engine, told its device is an
    accelerator, places the tier in the 48 KiB the warm-up's peak left; the first step under the plan then leaves rank
    0 96 KiB more and rank 1 nothing. Returns a function of (the rank's tier at the plan, its tier now)."""
    import fuyou_strategy.engine as engine_module
    from test_device_state import place_as_on_an_accelerator

    engine_module.device_memory_headroom = lambda device: 48 * 1024  # this process's module: the rank's own device
    engine_module.device_memory_left = lambda device: 96 * 1024 if rank == 0 else 0
    engine_module.release_cached_memory = lambda device: None
    place_as_on_an_accelerator(engine)  # what the engine does once rank 0's plan is solved and broadcast
    at_plan = engine.optimizer.store.bytes_on_device
    return lambda: (at_plan, engine.optimizer.store.bytes_on_device)


def assert_bitwise_the_ranks_sum(ranks, family="gpt2", **reference_args):
    """Every rank's weights and last global norm are bitwise one process's summing the ranks' gradients alike
    (`reference`)."""
    same_sum, norms = reference(family, as_ranks=True, **reference_args)
    for r in ranks:
        assert r["norm"] == norms[-1]
        for name, p in same_sum.state_dict().items():
            assert torch.equal(p, r["weights"][name]), name


def sum_as_ranks(model, micro_batches):
    """Each rank's accumulated gradient, one after the other, then ``p.grad = (g0 + g1) / 2``: as the ranks sum."""
    per_rank = []
    for rank in range(2):
        for ids in micro_batches:
            mine = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
            (model(input_ids=mine, labels=mine).loss / ACCUMULATE).backward()
        per_rank.append([p.grad for p in model.parameters()])
        for p in model.parameters():
            p.grad = None
    for p, g0, g1 in zip(model.parameters(), *per_rank):
        p.grad = (g0 + g1).div_(2)


def reference(family, *, as_ranks, bf16_moments=False):
    """One process, torch's AdamW and clip_grad_norm_: on the whole global batch, or (``as_ranks``)
    summing each rank's accumulated gradient as the ranks do, ``(g0 + g1) / 2``; ``bf16_moments``: the
    moments rounded to bf16 after every step (``state_format="bf16"``)."""
    torch.manual_seed(0)
    model = tiny_causal_lm(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for micro_batches in global_batches():
        if as_ranks:
            sum_as_ranks(model, micro_batches)
        else:
            for ids in micro_batches:
                (model(input_ids=ids, labels=ids).loss / ACCUMULATE).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        for st in opt.state.values() if bf16_moments else ():
            for kind in ("exp_avg", "exp_avg_sq"):
                st[kind].copy_(st[kind].bfloat16())
        opt.zero_grad(set_to_none=True)
    return model, norms


def max_relative_difference(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)).item() for k in a)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_two_ranks_train_like_one_process_on_the_global_batch_each_holding_half_the_state(tmp_path, family):
    spawn_ranks(_rank_main, args=(2, str(tmp_path), family, {"optimizer_schedule": "next_forward"}), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # the ranks hold the same weights, bitwise: every rank has the owner's broadcast
    for name, p in ranks[0]["weights"].items():
        assert torch.equal(p, ranks[1]["weights"][name]), name
    assert all(r["pending"] == r["params"] for r in ranks), "the updates overlap what follows step()"
    for r in range(2):  # swap_dirs "swap{local_rank}": a directory per rank
        assert [os.path.dirname(d) for d in ranks[r]["run_dirs"]] == [str(tmp_path / f"swap{r}")]
    # bitwise what one process computes when it sums the ranks' gradients the same way
    same_sum, norms = reference(family, as_ranks=True)
    for r in ranks:
        assert r["clipped"] == STEPS, "clipping bit on every step, on both ranks alike"
        assert r["norm"] == norms[-1]
        for name, p in same_sum.state_dict().items():
            assert torch.equal(p, r["weights"][name]), name
    # against one process on the global batch: the gradients differ in their last bits (the batch is
    # summed in another order), and Adam's per-element m / sqrt(v) amplifies that where a gradient is
    # near zero; measured 2.2e-4 (GPT-2) and 9.2e-5 (Llama) at most per tensor after 3 steps at lr 1e-2
    whole, whole_norms = reference(family, as_ranks=False)
    assert ranks[0]["norm"] == pytest.approx(whole_norms[-1], rel=1e-5)
    assert max_relative_difference(whole.state_dict(), ranks[0]["weights"]) <= TOLERANCE
    # each rank's SSD holds its shard only: together the whole state, each about half
    total = sum(r["state_bytes"] for r in ranks)
    single = FuyouEngine(whole, torch.optim.AdamW(whole.parameters()),
                         config=FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB"))
    try:
        whole = sum(e.slots * e.nchunks * e.stride for name, e in single.optimizer.store.entries.items()
                    if name.startswith("adamw."))
    finally:
        single.close()
    assert total == whole
    assert all(abs(r["state_bytes"] - whole / 2) <= 0.1 * whole for r in ranks), [r["state_bytes"] for r in ranks]


@pytest.mark.parametrize("split", [{"host_state": "64KiB"},
                                   {"host_state": "auto", "activations": "auto", "planner_warmup_steps": 2}],
                         ids=["fixed", "planned"])
def test_two_ranks_with_part_of_their_state_in_host_ram_train_like_one_process(tmp_path, split):
    """Each rank's own shard splits between host RAM and its SSD (``host_state``; ``"auto"``: what rank 0's
    plan leaves, moved there after the warm-up): bitwise the same as one process summing the ranks' gradients
    alike, as with the state all on the SSD."""
    spawn_ranks(_rank_main, args=(2, str(tmp_path), "gpt2", {"optimizer_schedule": "next_forward", **split}), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(r["summary"]["host_bytes_optimizer_state"] > 0 for r in ranks), "each rank kept some of its shard in RAM"
    assert_bitwise_the_ranks_sum(ranks)


def test_two_ranks_with_a_compact_state_train_like_one_process(tmp_path):
    """``state_format="bf16"``: each rank keeps its shard's moments in bf16; bitwise torch's AdamW summing the
    ranks' gradients alike, its moments rounded to bf16 after every step (the format's definition)."""
    spawn_ranks(_rank_main, args=(2, str(tmp_path), "gpt2", {"optimizer_schedule": "next_forward", "state_format": "bf16"}),
             nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(r["summary"]["state_format"] == "bf16" for r in ranks)
    assert_bitwise_the_ranks_sum(ranks, bf16_moments=True)


# Llama's weights are 100,224 bytes: with one block on the device at a time, each rank trains in less.
SMALLER_THAN_THE_WEIGHTS = {"weight_prefetch_blocks": 0, "device_memory_budget": 100_000}


@pytest.mark.parametrize("family,weights,fields", [("gpt2", "ssd", {}),
                                                   ("llama", {0: "host", 1: "ssd"}, SMALLER_THAN_THE_WEIGHTS)])
def test_two_ranks_stream_the_blocks_weights_and_train_like_one_process(tmp_path, family, weights, fields):
    """Weight streaming under data parallelism: every rank streams the blocks' weights from its own
    tier copies; a streamed gradient is summed onto its owner from the ranks' host copies, and the
    owner's new weight reaches the others' tier copies as the next forward reaches the block."""
    spawn_ranks(_rank_main, args=(2, str(tmp_path), family, {"optimizer_schedule": "auto", "weights": weights, **fields}),
             nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    weight_bytes = sum(p.numel() * p.element_size() for p in tiny_causal_lm(family).parameters())
    for r in ranks:  # both ranks streamed both blocks, trainable weights included
        s = r["summary"]
        assert s["weight_tiers"] == ({0: "ssd", 1: "ssd"} if weights == "ssd" else {0: "host", 1: "ssd"})
        assert s["weight_bytes_trainable_streamed"] > 0
        if fields:  # weights and gradients on the device at most: under the budget, which the weights exceed
            assert s["device_peak_bytes"] <= fields["device_memory_budget"] < weight_bytes
        assert s["schedule_steps"] == {"backward": 0, "next_forward": STEPS}, "auto takes next_forward here"
    for name, p in ranks[0]["weights"].items():
        assert torch.equal(p, ranks[1]["weights"][name]), name
    # bitwise what one process computes when it sums the ranks' gradients the same way: rank 1 built
    # its blocks with other values (+1), and started from rank 0's all the same
    same_sum, norms = reference(family, as_ranks=True)
    for r in ranks:
        assert r["clipped"] == STEPS and r["norm"] == norms[-1]
        for name, p in same_sum.state_dict().items():
            assert torch.equal(p, r["weights"][name]), name
    whole, _ = reference(family, as_ranks=False)
    assert max_relative_difference(whole.state_dict(), ranks[0]["weights"]) <= TOLERANCE
    assert abs(ranks[0]["state_bytes"] - ranks[1]["state_bytes"]) <= 0.2 * sum(r["state_bytes"] for r in ranks)


def _one_rank_profile(tmp, family):
    """One process on one rank's share of the batches, planning with everything resident: its profile."""
    torch.manual_seed(0)
    model = tiny_causal_lm(family)
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                         config=FuyouConfig(swap_dirs=[tmp], chunk_size="8KiB", **PLANNED), max_grad_norm=0.5)
    try:
        for micro_batches in global_batches()[:PLANNED["planner_warmup_steps"]]:
            for i, ids in enumerate(micro_batches):
                engine.begin_micro_batch(update=i == ACCUMULATE - 1)
                (model(input_ids=ids[:PER_RANK], labels=ids[:PER_RANK]).loss / ACCUMULATE).backward()
            engine.optimizer.step()
            engine.optimizer.zero_grad(set_to_none=True)
        return engine.plan.profile
    finally:
        engine.close()


PLANNED = {"activations": "auto", "weights": "auto", "planner_warmup_steps": 2, "weight_prefetch_blocks": 0,
           "activation_min_bytes": 0, "host_memory_budget": "4MiB"}


def test_the_planner_chooses_the_weight_tiers_under_data_parallelism_alike_on_every_rank(tmp_path):
    """``activations="auto", weights="auto"`` on 2 ranks with a device budget that the resident weights
    exceed: the ranks profile the warm-up, apply rank 0's plan (streaming the blocks from the SSD) and
    train bitwise like one process summing their gradients alike."""
    from fuyou_strategy.activations import Policy
    from fuyou_strategy.planner import Profile, predict

    roomy = Profile.from_dict(_one_rank_profile(str(tmp_path), "llama"))
    resident, streamed = (predict(roomy, [Policy.RECOMPUTE] * 2, weight_tiers=[tier] * 2).device_peak
                          for tier in ("device", "ssd"))
    assert streamed < resident
    budget = (streamed + resident) // 2
    spawn_ranks(_rank_main, args=(2, str(tmp_path), "llama", {**PLANNED, "device_memory_budget": budget}), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    plans = [r["plan"] for r in ranks]
    assert plans[0] is not None and plans[0] == plans[1], "every rank applied rank 0's plan"
    tiers = {i: t for i, t in enumerate(plans[0]["weight_tiers"]) if t != "device"}
    assert set(tiers.values()) == {"ssd"}
    for r in ranks:
        assert r["summary"]["weight_tiers"] == tiers
        assert r["summary"]["device_peak_bytes"] <= budget
    assert_bitwise_the_ranks_sum(ranks, "llama")


def _mismatched(rank, world, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = tiny_causal_lm("gpt2")
        config = FuyouConfig(swap_dirs=[tmp], chunk_size="8KiB", activations="keep" if rank == 0 else "recompute")
        try:
            FuyouEngine(model, torch.optim.AdamW(model.parameters()), config=config, process_group=dist.group.WORLD)
        except ConfigError as exc:
            with open(f"{tmp}/error{rank}.txt", "w") as f:
                f.write(str(exc))
    finally:
        dist.destroy_process_group()


def test_ranks_with_different_configs_fail_on_every_rank_naming_the_field(tmp_path):
    spawn_ranks(_mismatched, args=(2, str(tmp_path)), nprocs=2)
    for r in range(2):
        text = (tmp_path / f"error{r}.txt").read_text()
        assert "FuyouConfig differs" in text and "activations" in text


def test_backward_schedule_is_refused_with_a_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        model = tiny_causal_lm("gpt2")
        # one rank: nothing to shard, anything goes
        engine = FuyouEngine(model, torch.optim.AdamW(model.parameters()), process_group=dist.group.WORLD,
                             config=FuyouConfig(swap_dirs=[str(tmp_path)], optimizer_schedule="backward"))
        assert engine.optimizer.shards is None
        engine.close()
    finally:
        dist.destroy_process_group()


class SaveRankResults(L.Callback):
    """Each rank's weights and shard of the SSD state, at the end of fit (spawned ranks return nothing else)."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        engine = trainer.strategy.engine
        torch.save({"weights": {k: v.clone() for k, v in pl_module.state_dict().items()},
                    "state_bytes": sum(e.slots * e.nchunks * e.stride for name, e in
                                       engine.optimizer.store.entries.items() if name.startswith("adamw.")),
                    "steps": engine.optimizer.stats.steps, "clipped": engine.optimizer.stats.clipped,
                    "norm": engine.optimizer.stats.last_grad_norm, "states": _states(engine),
                    "tiers": engine.summary()["weight_tiers"], "ignored": sorted(trainer.strategy.model.parameters_to_ignore),
                    "scale": engine.optimizer.scaler.get_scale() if engine.optimizer.scaler is not None else None,
                    "history": list(engine.optimizer.stats.history)},
                   os.path.join(self.folder, f"lightning-rank{trainer.global_rank}.pt"))


def one_device_on_the_ranks_batches(tmp_path, *, schedule="auto", **trainer_args):
    """`fit` on one device fed, per micro-batch, the 4 sequences the two ranks saw (2 each): Lightning
    gave the ranks a DistributedSampler that shuffles training data (seed PL_GLOBAL_SEED + epoch 0),
    rank r taking perm[r::2]. Returns the module and the optimizer (closed: its stats stay)."""
    from fuyou_strategy import FuyouStrategy
    from test_lightning import BATCHES, fit

    perm = torch.randperm(2 * BATCHES, generator=torch.Generator().manual_seed(int(os.environ.get("PL_GLOBAL_SEED", 0))))
    single = FuyouStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB", optimizer_schedule=schedule)
    module, _ = fit(single, steps=3, batch_size=4, sampler=perm.tolist(), **trainer_args)
    opt = single.engine.optimizer
    single.engine.close()
    return module, opt


@pytest.mark.parametrize("weights", ["device", "ssd", "auto"])
def test_lightning_fuyou_ddp_on_two_processes_trains_like_one_device_on_the_global_batch(tmp_path, weights):
    """``weights="ssd"``: DDP leaves the streamed parameters to the optimizer, which sums their
    gradients over the ranks. ``"auto"`` (with ``activations="auto"``): DDP leaves every block's
    weights to the optimizer, since the planner chooses their tiers after the wrap; here it keeps
    them on the device (no budget), and the optimizer still sums them."""
    from fuyou_strategy import FuyouDDPStrategy
    from test_lightning import fit

    planned = {"activations": "auto", "planner_warmup_steps": 2} if weights == "auto" else {}
    strategy = FuyouDDPStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB", weights=weights, start_method="spawn",
                                **planned)
    fit(strategy, steps=3, devices=2, callbacks=[SaveRankResults(str(tmp_path))], enable_checkpointing=False)
    ranks = [torch.load(tmp_path / f"lightning-rank{r}.pt") for r in range(2)]
    for r in ranks:
        if weights != "device":  # DDP told to leave exactly the blocks' weights; streamed where "ssd" says
            assert r["tiers"] == ({0: "ssd", 1: "ssd"} if weights == "ssd" else {})
            assert r["ignored"] and all(".h." in name for name in r["ignored"]), r["ignored"]
            assert r["history"][-1][0] == "next_forward"
        else:
            assert r["tiers"] == {} and r["ignored"] == []
    for name, p in ranks[0]["weights"].items():
        assert torch.equal(p, ranks[1]["weights"][name]), name
    assert [r["steps"] for r in ranks] == [3, 3] and ranks[0]["clipped"] == ranks[1]["clipped"]
    module, opt = one_device_on_the_ranks_batches(tmp_path)
    assert ranks[0]["norm"] == pytest.approx(opt.stats.last_grad_norm, rel=1e-5)
    assert max_relative_difference(module.state_dict(), ranks[0]["weights"]) <= TOLERANCE
    assert abs(ranks[0]["state_bytes"] - ranks[1]["state_bytes"]) <= 0.2 * sum(r["state_bytes"] for r in ranks)


def test_two_ranks_grow_their_plans_device_tier_each_on_its_own_measure_and_train_like_one_process(tmp_path):
    """``device_state="auto"`` on an accelerator (the CPU standing in, `_tier_to_grow`): after the first step under
    rank 0's plan every rank lands its pending updates and grows its tier to what its own device left free, rank 0
    more, rank 1 not at all; no rank waits on a collective the other did not join, and the run is bitwise one
    process summing the ranks' gradients alike."""
    fields = {"optimizer_schedule": "next_forward", "host_state": "64KiB"}
    # a rank that skipped the landing would leave the other waiting in a collective: a run takes seconds
    spawn_ranks(_rank_main, args=(2, str(tmp_path), "gpt2", fields, True), nprocs=2, timeout=120)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    (at_plan, grown), (at_plan_1, kept) = ranks[0]["tier"], ranks[1]["tier"]
    assert 0 < at_plan <= 48 * 1024 < grown <= at_plan + 96 * 1024, ranks[0]["tier"]
    assert 0 < at_plan_1 == kept <= 48 * 1024, ranks[1]["tier"]
    assert [r["summary"]["device_bytes_optimizer_state"] for r in ranks] == [grown, kept]
    assert_bitwise_the_ranks_sum(ranks)


def _states(engine) -> dict:
    """This rank's committed optimizer state per parameter index (master, exp_avg, exp_avg_sq) and steps."""
    opt = engine.optimizer
    return {ps.index: {**opt.read_state(ps.param), "step": float(opt.state[ps.param]["step"])}
            for ps in opt._params if opt.shards is None or opt.shards.owns(ps)}


def _train(engine, model, rank, world, steps):
    for micro_batches in global_batches()[:steps]:
        for i, ids in enumerate(micro_batches):
            mine = ids[rank * PER_RANK:(rank + 1) * PER_RANK] if world > 1 else ids
            engine.begin_micro_batch(update=i == ACCUMULATE - 1)
            (model(input_ids=mine, labels=mine).loss / ACCUMULATE).backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)


def _engine(rank, tmp, *, group=None, **fields):
    torch.manual_seed(0)
    model = tiny_causal_lm("gpt2")
    os.makedirs(f"{tmp}/swap{rank}", exist_ok=True)
    config = FuyouConfig(swap_dirs=[f"{tmp}/swap{rank}"], chunk_size="8KiB", optimizer_schedule="next_forward", **fields)
    return model, FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config,
                              max_grad_norm=0.5, process_group=group)


def _checkpoint_ranks(rank, world, tmp, mode, weights="device"):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous-{mode}", rank=rank, world_size=world)
    try:
        model, engine = _engine(rank, tmp, group=dist.group.WORLD, weights=weights)
        try:
            if mode == "save":  # 2 steps on 2 ranks, then a save into the shared folder
                _train(engine, model, rank, world, 2)
                engine.save(f"{tmp}/ckpt")
            elif mode == "load":  # a one-process save into 2 ranks
                engine.load(f"{tmp}/ckpt-one")
            else:  # a save that fails on rank 1
                from fuyou_strategy.optim import checkpoint

                if rank == 1:
                    def disk_gone(*args, **kwargs):
                        raise OSError(28, "No space left on device")
                    checkpoint._write_state = disk_gone
                try:
                    engine.save(f"{tmp}/ckpt-bad")
                except Exception as exc:  # noqa: BLE001 - recorded for the test
                    torch.save(str(exc), f"{tmp}/error-{rank}.pt")
            torch.save({"states": _states(engine), "weights": model.state_dict(),
                        "tiers": engine.summary()["weight_tiers"]}, f"{tmp}/{mode}-rank{rank}.pt")
        finally:
            engine.close()
    finally:
        dist.destroy_process_group()


def _assert_same_states(mine: dict, theirs: dict) -> None:
    for index, state in mine.items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(theirs[index][key])), (index, key)


@pytest.mark.parametrize("weights", ["device", "ssd"])
def test_a_checkpoint_saved_by_two_ranks_loads_exactly_into_one_process_and_back(tmp_path, weights):
    """The ranks stream their weights or not (``weights``); the one process keeps them resident."""
    spawn_ranks(_checkpoint_ranks, args=(2, str(tmp_path), "save", weights), nprocs=2)
    saved = [torch.load(tmp_path / f"save-rank{r}.pt") for r in range(2)]
    assert set(saved[0]["states"]).isdisjoint(saved[1]["states"]), "each rank saved only what it owns"
    assert all(r["tiers"] == ({} if weights == "device" else {0: "ssd", 1: "ssd"}) for r in saved)
    (token,) = [p.name for p in (tmp_path / "ckpt").iterdir()]
    assert sorted(p.name for p in (tmp_path / "ckpt" / token).iterdir()) == ["optimizer.json", "owner.json",
                                                                            "part-0", "part-1"]
    # one process resumes the 2-rank save: every parameter's state and weight, bitwise
    model, engine = _engine(0, str(tmp_path / "one"))
    try:
        engine.load(str(tmp_path / "ckpt"))
        states = _states(engine)
        assert len(states) == len(saved[0]["states"]) + len(saved[1]["states"])
        for r in range(2):
            _assert_same_states(saved[r]["states"], states)
        for name, p in model.state_dict().items():
            assert torch.equal(p, saved[0]["weights"][name]), name
        engine.save(str(tmp_path / "ckpt-one"))  # and back: a one-process save into 2 ranks
    finally:
        engine.close()
    spawn_ranks(_checkpoint_ranks, args=(2, str(tmp_path), "load", weights), nprocs=2)
    for r in range(2):
        loaded = torch.load(tmp_path / f"load-rank{r}.pt")
        _assert_same_states(loaded["states"], states)
        for name, p in model.state_dict().items():
            assert torch.equal(p, loaded["weights"][name]), name


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_leaves_nothing(tmp_path):
    spawn_ranks(_checkpoint_ranks, args=(2, str(tmp_path), "bad"), nprocs=2)
    for r in range(2):
        error = torch.load(tmp_path / f"error-{r}.pt")
        assert "the sharded save failed on 1 of 2 ranks" in error and "rank 1: OSError" in error, error
    assert not list((tmp_path / "ckpt-bad").iterdir()), "no save and no temporary folder is left"


def _sharded_save_killed(rank, world, tmp, mode):
    """``kill``: 2 steps and a complete save, 1 more step and a save during which rank 0 is SIGKILLed just
    after writing its part. ``resume``: load the folder's save, 1 step, save again."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous-{mode}", rank=rank, world_size=world)
    try:
        model, engine = _engine(rank, tmp, group=dist.group.WORLD)
        try:
            if mode == "kill":
                _train(engine, model, rank, world, 2)
                engine.save(f"{tmp}/ckpt")
                _train(engine, model, rank, world, 1)
                from fuyou_strategy.optim import checkpoint

                if rank == 0:
                    write_state = checkpoint._write_state

                    def write_then_die(*args, **kwargs):
                        write_state(*args, **kwargs)
                        os.kill(os.getpid(), signal.SIGKILL)

                    checkpoint._write_state = write_then_die
                engine.save(f"{tmp}/ckpt")
            else:
                engine.load(f"{tmp}/ckpt")
                left_by_load = sorted(p for p in os.listdir(f"{tmp}/ckpt") if ".tmp-" in p)
                _train(engine, model, rank, world, 1)
                engine.save(f"{tmp}/ckpt")
                torch.save({"left_by_load": left_by_load, "steps": engine.optimizer.stats.steps},
                           f"{tmp}/resume-rank{rank}.pt")
        finally:
            engine.close()
    finally:
        dist.destroy_process_group()


def test_a_sharded_save_killed_on_one_rank_leaves_nothing_after_clean_or_a_resumed_run(tmp_path):
    """Rank 0 SIGKILLed inside a sharded save, after writing its part: the ``<token>.tmp-<pid>/`` with
    ``owner.json`` and ``part-<rank>/`` folders is recognised as stale by ``fuyou clean``, and a resumed
    2-rank run removes it from the folder it loads from and saves into."""
    with pytest.raises(Exception, match="signal|SIGKILL|exited"):
        spawn_ranks(_sharded_save_killed, args=(2, str(tmp_path), "kill"), nprocs=2)
    (temp,) = [p for p in (tmp_path / "ckpt").iterdir() if ".tmp-" in p.name]
    assert "part-0" in {p.name for p in temp.iterdir()}, "rank 0 wrote its part before it died"
    shutil.copytree(tmp_path / "ckpt", tmp_path / "copy")
    assert fuyou_main(["clean", "--dir", str(tmp_path / "copy")]) == 0
    assert not [p for p in (tmp_path / "copy").iterdir() if ".tmp-" in p.name], "fuyou clean removed it"
    spawn_ranks(_sharded_save_killed, args=(2, str(tmp_path), "resume"), nprocs=2)
    for r in range(2):
        resumed = torch.load(tmp_path / f"resume-rank{r}.pt")
        assert resumed["steps"] == 3 and resumed["left_by_load"] == [], "the load removed it"
    assert [len(list((tmp_path / "ckpt").iterdir()))] == [1], "one complete save, nothing else"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("launcher,weights,schedule", [("torchrun", "device", "next_forward"),
                                                       ("torchrun", "device", "backward"),
                                                       ("accelerate", "ssd", "auto")])
def test_hf_trainer_under_torchrun_shards_the_state_and_trains_like_one_process(tmp_path, launcher, weights, schedule):
    """``"backward"``: the callback found accelerate's DDP wrapper and registered the comm hook, which
    queued the updates as the buckets landed. ``accelerate launch --multi_gpu`` starts the ranks with
    torchrun's machinery (on a machine without GPUs the script's ``use_cpu=True`` and gloo hold)."""
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(__file__), "_hf_ddp_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = str(_free_port())
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
              if launcher == "torchrun" else
              [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--multi_gpu", "--num_processes",
               "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               port])
    for cmd in ([*launch, worker, str(tmp_path), "2", weights, schedule],  # 2 ranks x 2 sequences
                [sys.executable, worker, str(tmp_path), "4", weights, schedule]):  # one process x 4
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1, one = (torch.load(tmp_path / f"hf-rank{r}-b{b}-{weights}-{schedule}.pt") for r, b in ((0, 2), (1, 2), (0, 4)))
    if schedule == "backward":
        assert r0["schedules"]["backward"] == r1["schedules"]["backward"] == 3
        assert r0["hook_updates"] > 0 and r1["hook_updates"] > 0, "the updates overlapped backward on both ranks"
    else:
        assert r0["hook_updates"] == r1["hook_updates"] == 0
    assert r0["sharded"] and r1["sharded"] and not one["sharded"]
    # weights="ssd": every rank streamed both blocks (FuyouCallback.on_init_end had DDP leave them alone)
    assert r0["tiers"] == r1["tiers"] == one["tiers"] == ({} if weights == "device" else {0: "ssd", 1: "ssd"})
    assert r0["bytes"] + r1["bytes"] == one["bytes"], "each rank holds its shard of the state, together all of it"
    for name, p in r0["weights"].items():
        assert torch.equal(p, r1["weights"][name]), name
    # the Trainer's sampler gives the two ranks together the one process's batches: the same norms up to
    # the last bits of the gradients' sum, the weights up to Adam's amplification of those (measured 3.0e-4)
    assert r0["norms"] == pytest.approx(one["norms"], rel=1e-6)
    # the logged grad_norm is the global one on every rank (a rank's .grad holds only what it owns)
    assert len(r0["logged_norms"]) == 3 and r0["logged_norms"] == r1["logged_norms"] == r0["norms"]
    assert max_relative_difference(one["weights"], r0["weights"]) <= TOLERANCE


def test_hf_checkpoints_under_torchrun_are_complete_tied_and_resume_in_one_process(tmp_path):
    """Every rank writes its part of fuyou's state just before the Trainer's save (``on_step_end``: a
    collective), rank 0's ``trainer_state.json`` records that save; the checkpoint is complete by the files,
    and one process resumes it (a save stores parameters, not rank shards)."""
    import json
    import subprocess
    import sys

    from transformers import Trainer, TrainingArguments

    from fuyou_strategy import FuyouCallback
    from fuyou_strategy.integrations import hf_checkpoints
    from fuyou_strategy.optim import checkpoint
    from test_hf import dataset

    worker = os.path.join(os.path.dirname(__file__), "_hf_ddp_worker.py")
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    proc = subprocess.run([*launch, worker, str(tmp_path), "2", "device", "next_forward", "save"], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = tmp_path / "out" / "checkpoint-2"
    assert hf_checkpoints.why_incomplete(ckpt) is None
    saved = hf_checkpoints.recorded_save(json.loads((ckpt / "trainer_state.json").read_text())["stateful_callbacks"])
    (save,) = checkpoint.save_dirs(ckpt / hf_checkpoints.STATE_FOLDER)
    assert saved == {"token": save.name, "steps": 2, "global_step": 2}
    meta = checkpoint.read_meta(save)
    assert meta["parts"] == ["part-0", "part-1"] and meta["record"] == {"trainer_global_step": 2}
    callback = FuyouCallback(swap_dirs=[str(tmp_path)], chunk_size="8KiB", optimizer_schedule="next_forward")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=1e-2, weight_decay=0.1,
                             report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    Trainer(model=tiny_causal_lm("gpt2", seed=1), args=args, train_dataset=dataset(),
            callbacks=[callback]).train(resume_from_checkpoint=str(ckpt))
    assert callback.summary["optimizer_steps"] == 3, "2 restored + 1 new"


@pytest.mark.parametrize("precision,weights", [("32-true", "device"), ("bf16-true", "ssd")])
def test_lightning_fuyou_ddp_checkpoints_resume_on_one_device(tmp_path, precision, weights):
    """bf16: the .ckpt holds every weight's fp32 master, gathered on rank 0 from the owners."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fuyou_strategy import FuyouDDPStrategy, FuyouStrategy
    from test_lightning import fit

    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)
    fit(FuyouDDPStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB", start_method="spawn", weights=weights),
        steps=2, devices=2, callbacks=[ckpt, SaveRankResults(str(tmp_path))], precision=precision)
    ranks = [torch.load(tmp_path / f"lightning-rank{r}.pt") for r in range(2)]
    (path,) = [p for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".ckpt"]
    single = FuyouStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB")
    module, trainer = fit(single, steps=2, ckpt_path=str(path), precision=precision)  # restores, nothing left to train
    try:
        assert trainer.global_step == 2
        states = _states(single.engine)
        assert len(states) == len(ranks[0]["states"]) + len(ranks[1]["states"])
        for r in ranks:
            _assert_same_states(r["states"], states)
        for name, p in module.state_dict().items():
            assert torch.equal(p, ranks[0]["weights"][name]), name
        saved = torch.load(path, weights_only=False)["state_dict"]
        masters = single.engine.master_weights()
        assert len(masters) == (len(list(module.parameters())) if precision == "bf16-true" else 0)
        for name, p in module.named_parameters():
            if p in masters:
                assert saved[name].dtype == torch.float32 and torch.equal(saved[name], masters[p]), name
    finally:
        single.engine.close()


def _disk_fails_on_rank_1(rank, world, tmp, weights):
    import datetime

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # the backstop; the test needs no wait
    try:  # host_state=0: the optimizer state on the disk that fails
        model, engine = _engine(rank, tmp, group=dist.group.WORLD, weights=weights, host_state=0)
        try:
            _train(engine, model, rank, world, 1)
            if rank == 1:
                from fuyou_strategy.storage import aio

                def gone(*args, **kwargs):
                    raise OSError(5, "Input/output error")
                aio._pwritev = gone
            try:
                _train(engine, model, rank, world, 1)
                engine.flush()  # the step's updates land ahead of the next forward: here, at the latest
            except Exception as exc:  # noqa: BLE001 - recorded for the test
                torch.save(f"{type(exc).__name__}: {exc}", f"{tmp}/error-{rank}.pt")
        finally:
            try:
                engine.close()
            except Exception:  # noqa: BLE001 - the failed rank's store may refuse; the error was recorded
                pass
    finally:
        dist.destroy_process_group()


def _receive_fails_on_rank_1(rank, world, tmp):
    import datetime

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # the backstop; the test needs no wait
    try:
        model, engine = _engine(rank, tmp, group=dist.group.WORLD, weights="ssd")
        try:
            _train(engine, model, rank, world, 1)
            if rank == 1:  # the new weights rank 0 owns cannot be written into rank 1's tier copies
                def full(*args, **kwargs):
                    raise OSError(28, "No space left on device")
                engine.streamer.assign = full
            try:
                _train(engine, model, rank, world, 2)
            except Exception as exc:  # noqa: BLE001 - recorded for the test
                torch.save(f"{type(exc).__name__}: {exc}", f"{tmp}/error-{rank}.pt")
        finally:
            with contextlib.suppress(RankError):  # the weights that never arrived cannot be made resident
                engine.close()
    finally:
        dist.destroy_process_group()


def test_a_rank_that_cannot_take_a_streamed_weight_stops_every_rank_at_that_block(tmp_path):
    """The sender's lockstep: every rank says whether its part of each weight's send worked, so rank 1's
    failure to write a weight it receives is every rank's error, raised where the forward needs it."""
    import time

    start = time.monotonic()
    spawn_ranks(_receive_fails_on_rank_1, args=(2, str(tmp_path)), nprocs=2)
    assert time.monotonic() - start < 100, "no rank waited for the collective timeout"
    errors = [torch.load(tmp_path / f"error-{r}.pt") for r in range(2)]
    for error in errors:
        assert error.startswith("RankError: sending the new weight of parameter"), error
        assert "failed on 1 of 2 ranks (rank 1: OSError: [Errno 28] No space left on device)" in error, error
    assert errors[0] == errors[1], "the same error, for the same weight, on both ranks"


@pytest.mark.parametrize("weights", ["device", "ssd"])
def test_a_rank_that_loses_its_disk_stops_every_rank_with_the_cause_not_a_hang(tmp_path, weights):
    """``"ssd"``: rank 1's streamed gradients, its updates and the new weights it receives all fail."""
    import time

    start = time.monotonic()
    spawn_ranks(_disk_fails_on_rank_1, args=(2, str(tmp_path), weights), nprocs=2)
    assert time.monotonic() - start < 100, "no rank waited for the collective timeout"
    for r in range(2):
        error = torch.load(tmp_path / f"error-{r}.pt")
        assert error.startswith("RankError") and "failed on 1 of 2 ranks" in error, error
        assert "rank 1:" in error and "Input/output error" in error, error


def test_swap_dir_placeholders_are_rank_and_local_rank_only():
    FuyouConfig(swap_dirs=["/nvme{local_rank}/fuyou", "/data/r{rank}"])
    with pytest.raises(ConfigError, match=r"swap_dirs: got '/nvme\{gpu\}'; the only placeholders are \{rank\}"):
        FuyouConfig(swap_dirs=["/nvme{gpu}"])


def test_strategy_fuyou_by_name_takes_any_device_count_with_lightnings_launcher():
    """``"fuyou"`` and its older name ``"fuyou_ddp"`` are one strategy: with several devices Lightning's
    subprocess launcher starts the ranks and the data loaders get a DistributedSampler; with one there is
    no launcher and the loaders keep their samplers, as with ``strategy="auto"``."""
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    from fuyou_strategy import FuyouDDPStrategy, FuyouStrategy

    assert FuyouDDPStrategy is FuyouStrategy
    for name in ("fuyou", "fuyou_ddp"):
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, num_nodes=1, logger=False)
        assert isinstance(trainer.strategy, FuyouStrategy), name
        assert isinstance(trainer.strategy.launcher, _SubprocessScriptLauncher) and trainer.num_devices == 2
        assert trainer.strategy.data_parallel and trainer.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
        one = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)
        assert one.strategy.launcher is None and not one.strategy.data_parallel and not one.strategy.is_distributed


def test_fabric_names_one_device_and_data_parallel_strategies():
    """Fabric asks every multi-process strategy to be launched (``fabric.launch()``), so ``"fuyou"`` stays a
    one-device strategy there (scripts without a launch keep working) and ``"fuyou_ddp"`` takes any count;
    ``"fuyou"`` with several devices says so before anything is made."""
    from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    from fuyou_strategy import FuyouFabricStrategy
    from fuyou_strategy.integrations.lightning import FuyouFabricDDPStrategy

    two = L.Fabric(strategy="fuyou_ddp", accelerator="cpu", devices=2)
    assert type(two.strategy) is FuyouFabricDDPStrategy and isinstance(two.strategy.launcher, _SubprocessScriptLauncher)
    assert two.strategy.data_parallel and two.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    one = L.Fabric(strategy="fuyou", accelerator="cpu", devices=1)
    assert type(one.strategy) is FuyouFabricStrategy and not one.strategy.data_parallel
    refused = L.Fabric(strategy="fuyou", accelerator="cpu", devices=2)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"devices: got 2 devices; Fabric\(strategy='fuyou'\) trains on one device; "
                                          r"for data parallelism use Fabric\(strategy='fuyou_ddp', devices=N\)"):
        refused.strategy.setup_module_and_optimizers(model, [torch.optim.AdamW(model.parameters())])


class CountHookUpdates(L.Callback):
    """How many updates the DDP comm hook queued during backward, and the schedules used, per rank."""

    def __init__(self, folder):
        self.folder = folder

    def on_fit_start(self, trainer, pl_module):
        opt = trainer.strategy.engine.optimizer
        original, self.count = opt.updates.speculate, 0

        def counting(ps, grad, *args, **kwargs):
            if grad.kind == "bucket":
                self.count += 1
            return original(ps, grad, *args, **kwargs)
        opt.updates.speculate = counting

    def on_train_end(self, trainer, pl_module):
        stats = trainer.strategy.engine.optimizer.stats
        torch.save({"hook_updates": self.count, "schedules": dict(stats.schedules), "outcomes": list(stats.history)},
                   os.path.join(self.folder, f"hook-rank{trainer.global_rank}.pt"))


@pytest.mark.parametrize("clip, outcome", [(100.0, "commit"), (0.5, "redo")])
def test_lightning_fuyou_ddp_backward_schedule_updates_as_buckets_land(tmp_path, clip, outcome):
    from fuyou_strategy import FuyouDDPStrategy
    from test_lightning import fit

    strategy = FuyouDDPStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB", start_method="spawn",
                                optimizer_schedule="backward")
    fit(strategy, steps=3, devices=2, callbacks=[SaveRankResults(str(tmp_path)), CountHookUpdates(str(tmp_path))],
        enable_checkpointing=False, gradient_clip_val=clip)  # 100: every step commits; 0.5: clipping bites
    ranks = [torch.load(tmp_path / f"lightning-rank{r}.pt") for r in range(2)]
    hooks = [torch.load(tmp_path / f"hook-rank{r}.pt") for r in range(2)]
    for h in hooks:
        assert h["schedules"]["backward"] == 3 and h["hook_updates"] > 0, h
        assert [o for _s, o in h["outcomes"]] == [outcome] * 3
    assert hooks[0]["hook_updates"] + hooks[1]["hook_updates"] == 3 * len(ranks[0]["weights"]) - 3  # tied lm_head
    for name, p in ranks[0]["weights"].items():
        assert torch.equal(p, ranks[1]["weights"][name]), name
    module, _ = one_device_on_the_ranks_batches(tmp_path, gradient_clip_val=clip)
    assert max_relative_difference(module.state_dict(), ranks[0]["weights"]) <= TOLERANCE


class FirstGradients(L.Callback):
    """Each rank's gradients when the first optimizer step begins, and which parameters it owns."""

    def __init__(self, folder, tag):
        self.folder, self.tag = folder, tag

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step:
            return
        opt = trainer.strategy.engine.optimizer
        owned = {ps.param for ps in opt.sharding.owned(opt._params)}
        torch.save({name: (p in owned, p.grad.clone()) for name, p in pl_module.named_parameters()},
                   os.path.join(self.folder, f"grads-{self.tag}-rank{trainer.global_rank}.pt"))


def test_fuyou_ddp_sums_each_gradient_onto_its_owner_only(tmp_path):
    """``gradient_reduction="owner"``: DDP's buckets are reduced onto the owners (about half the
    traffic of an all-reduce on 2 ranks); an owner's gradient is bitwise the all-reduce's average,
    and the weights after 3 steps are bitwise those of ``"all"``."""
    from fuyou_strategy import FuyouDDPStrategy
    from test_lightning import fit

    for mode in ("owner", "all"):
        strategy = FuyouDDPStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB", start_method="spawn",
                                    gradient_reduction=mode)
        folder = tmp_path / mode
        folder.mkdir()
        fit(strategy, steps=3, devices=2, callbacks=[SaveRankResults(str(folder)), FirstGradients(str(folder), mode)],
            enable_checkpointing=False)
    owner = [torch.load(tmp_path / "owner" / f"grads-owner-rank{r}.pt") for r in range(2)]
    every = [torch.load(tmp_path / "all" / f"grads-all-rank{r}.pt") for r in range(2)]
    differ = 0
    for name, (mine, grad) in owner[0].items():
        theirs = owner[1][name]
        assert mine != theirs[0], f"{name}: one owner"
        average = every[0][name][1]
        assert torch.equal(every[1][name][1], average), name  # all-reduce: every rank has the average
        owned_grad = grad if mine else theirs[1]
        assert torch.equal(owned_grad, average), name  # the owner's is bitwise the average
        differ += not torch.equal(grad if not mine else theirs[1], average)
    assert differ > 0, "the non-owners did not receive the average"
    weights = [torch.load(tmp_path / mode / "lightning-rank0.pt")["weights"] for mode in ("owner", "all")]
    for name, p in weights[0].items():
        assert torch.equal(p, weights[1][name]), name


# -- fp16 with dynamic loss scaling under data parallelism -----------------------------------------------
FP16_STEPS, FP16_OVERFLOW_STEP = 4, 2  # on that step rank 1's first micro-batch overflows: every rank skips
SCALER = dict(init_scale=2.0**12, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)


def _fp16_loss(model, step, micro, rank):
    ids = torch.randint(0, 101, (PER_RANK, SEQ), generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
    loss = model(input_ids=ids, labels=ids).loss
    return (loss * math.inf if (step, micro, rank) == (FP16_OVERFLOW_STEP, 0, 1) else loss) / ACCUMULATE


def _fp16_rank(rank, world, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        model = tiny_causal_lm("llama", dtype=torch.float16)
        opt = FuyouAdamW(model.parameters(), lr=3e-3, max_grad_norm=0.5, loss_scaling=SCALER,
                         process_group=dist.group.WORLD,
                         config=FuyouConfig(swap_dirs=[tmp], chunk_size="8KiB", optimizer_schedule="auto"))
        try:
            scales = []
            for step in range(FP16_STEPS):
                for micro in range(ACCUMULATE):
                    with opt.no_update() if micro < ACCUMULATE - 1 else contextlib.nullcontext():
                        opt.scale_loss(_fp16_loss(model, step, micro, rank)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                scales.append(opt.scaler.get_scale())
            opt.flush()
            torch.save({"weights": {n: p.clone() for n, p in model.named_parameters()}, "scales": scales,
                        "skips": opt.stats.skips, "masters": {n: opt.read_state(p)["master"]
                                                              for n, p in model.named_parameters() if opt.sharding.owns(opt._by_param[p])}},
                       f"{tmp}/fp16-rank{rank}.pt")
        finally:
            opt.close()
    finally:
        dist.destroy_process_group()


def _fp16_reference():
    """One process, torch's GradScaler, clip_grad_norm_ and fused AdamW on fp32 masters, with the ranks'
    fp16 gradients summed as the ranks sum them: ``(g0 + g1) / 2`` in fp16."""
    from test_schedule import gradscaler_step

    model = tiny_causal_lm("llama", dtype=torch.float16)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, lr=3e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    scales = []
    for step in range(FP16_STEPS):
        per_rank = []
        for rank in range(2):
            for micro in range(ACCUMULATE):
                scaler.scale(_fp16_loss(model, step, micro, rank)).backward()
            per_rank.append([p.grad for p in params])
            for p in params:
                p.grad = None
        for m, g0, g1 in zip(masters, *per_rank):
            m.grad = (g0 + g1).div_(2).float()
        gradscaler_step(scaler, opt, params, masters, masters, 0.5)
        scales.append(scaler.get_scale())
    return model, masters, scales


def test_fp16_loss_scaling_under_data_parallelism_is_gradscaler_on_the_ranks_sum(tmp_path):
    """Every rank scales its loss by the same scale; an overflow on one rank skips the step on every
    rank and backs the scale off everywhere, as GradScaler does on the ranks' summed gradients."""
    spawn_ranks(_fp16_rank, args=(2, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"fp16-rank{r}.pt") for r in range(2)]
    model, masters, scales = _fp16_reference()
    for r in ranks:
        assert r["scales"] == scales and r["skips"] == 1, (r["scales"], scales)
        for name, p in model.named_parameters():
            assert r["weights"][name].dtype == torch.float16 and torch.equal(r["weights"][name], p), name
    assert any(b < a for a, b in zip(scales, scales[1:])) and any(b > a for a, b in zip(scales, scales[1:]))
    names = [n for n, _ in model.named_parameters()]
    owned = {**ranks[0]["masters"], **ranks[1]["masters"]}
    assert sorted(owned) == sorted(names) and not set(ranks[0]["masters"]) & set(ranks[1]["masters"])
    for name, m in zip(names, masters):
        assert torch.equal(owned[name], m.detach()), name


def test_lightning_fuyou_ddp_in_fp16_scales_alike_on_every_rank(tmp_path):
    """``precision="16-true"`` under ``fuyou_ddp`` (the ``backward`` schedule: the comm hook updates with
    the scaled, averaged gradients): the ranks' weights bitwise equal, the loss scale and outcomes those
    of one device on the same global batches. The weights are not compared with one device's: in fp16
    the summation order alone moves them by up to 48% relative on a tensor (one device fed the same
    data as 4 x 2 or 2 x 4 sequences, measured), where Adam's step turns a near-zero gradient's sign;
    `test_fp16_loss_scaling_under_data_parallelism_is_gradscaler_on_the_ranks_sum` checks them bitwise."""
    from fuyou_strategy import FuyouDDPStrategy
    from test_lightning import fit

    strategy = FuyouDDPStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB", start_method="spawn",
                                optimizer_schedule="backward")
    fit(strategy, steps=3, devices=2, callbacks=[SaveRankResults(str(tmp_path))], enable_checkpointing=False,
        precision="16-true")
    ranks = [torch.load(tmp_path / f"lightning-rank{r}.pt") for r in range(2)]
    for name, p in ranks[0]["weights"].items():
        assert p.dtype == torch.float16 and torch.equal(p, ranks[1]["weights"][name]), name
    _, opt = one_device_on_the_ranks_batches(tmp_path, schedule="backward", precision="16-true")
    for r in ranks:
        assert r["scale"] == opt.scaler.get_scale() and r["history"] == list(opt.stats.history)
        assert r["norm"] == pytest.approx(opt.stats.last_grad_norm, rel=1e-3)


class SaveWeights(L.Callback):
    """Rank 0's weights at the end of fit, as ``<folder>/<name>.pt`` (spawned ranks return nothing else)."""

    def __init__(self, path):
        self.path = path

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            torch.save({k: v.clone() for k, v in pl_module.state_dict().items()}, self.path)


def test_strategy_fuyou_on_two_devices_trains_like_lightnings_ddp(tmp_path):
    """The same two-rank fit (gloo, spawned ranks, Lightning's DistributedSampler, accumulate 2, clip
    1.0, warm-up): ``strategy="ddp"`` with torch's AdamW, and the fuyou strategy (``"fuyou"``'s class,
    which is also ``"fuyou_ddp"``) with the same devices. DDP averages the gradients in both; fuyou's
    ranks update the shards they own and broadcast them. Measured on gloo: bitwise equal (a two-term sum
    does not depend on its order); asserted to the data-parallel tests' tolerance, since the reduction
    order may differ with more ranks or another backend."""
    from lightning.pytorch.strategies import DDPStrategy

    from fuyou_strategy import FuyouStrategy
    from test_lightning import CausalLM, fit

    fit(DDPStrategy(start_method="spawn"), steps=3, devices=2, callbacks=[SaveWeights(str(tmp_path / "ddp.pt"))],
        enable_checkpointing=False)
    fit(FuyouStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB", start_method="spawn"), steps=3, devices=2,
        callbacks=[SaveWeights(str(tmp_path / "fuyou.pt"))], enable_checkpointing=False)
    ddp, fuyou = torch.load(tmp_path / "ddp.pt"), torch.load(tmp_path / "fuyou.pt")
    assert ddp.keys() == fuyou.keys()
    difference = max_relative_difference(ddp, fuyou)
    print(f"strategy='ddp' vs the fuyou strategy on two ranks: max relative difference {difference:.2e}")
    assert difference <= TOLERANCE
    torch.manual_seed(0)  # as `fit` makes its module
    initial = CausalLM().state_dict()
    assert max_relative_difference(initial, fuyou) > 100 * TOLERANCE  # they trained: agreeing is not standing still


def _fabric_rank(fabric, path, fuyou):
    """Two ranks, each a DistributedSampler's half of every batch, accumulate 2 with Fabric's idiom, clip 1.0."""
    from test_lightning import fabric_accumulating_with_no_backward_sync, token_batches

    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(token_batches(), batch_size=2))
    model, opt = fabric_accumulating_with_no_backward_sync(fabric, loader)
    if fuyou:
        assert fabric.strategy.engine.data_parallel and opt.stats.steps == 3
    if fabric.global_rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, path)


def test_fabric_strategy_fuyou_ddp_on_two_devices_trains_like_fabrics_ddp(tmp_path):
    """``Fabric(strategy="fuyou_ddp", devices=2)``: the same loop as with ``Fabric(strategy="ddp")`` and torch's
    AdamW (spawned ranks, gloo; Fabric's own accumulation idiom, ``no_backward_sync``), weights within the
    data-parallel tests' tolerance."""
    from lightning.fabric.strategies import DDPStrategy

    from fuyou_strategy.integrations.lightning import FuyouFabricDDPStrategy as FuyouFabricStrategy

    L.Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(start_method="spawn")).launch(
        _fabric_rank, str(tmp_path / "ddp.pt"), False)
    fuyou = FuyouFabricStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB", max_grad_norm=1.0, start_method="spawn")
    L.Fabric(accelerator="cpu", devices=2, strategy=fuyou).launch(_fabric_rank, str(tmp_path / "fuyou.pt"), True)
    ddp, ours = torch.load(tmp_path / "ddp.pt"), torch.load(tmp_path / "fuyou.pt")
    difference = max_relative_difference(ddp, ours)
    print(f"Fabric 'ddp' vs 'fuyou_ddp' on two ranks: max relative difference {difference:.2e}")
    assert ddp.keys() == ours.keys() and difference <= TOLERANCE
    torch.manual_seed(0)
    assert max_relative_difference(tiny_causal_lm("gpt2").state_dict(), ours) > 100 * TOLERANCE  # it trained


def test_two_ranks_with_part_of_their_shard_on_the_device_tier_train_like_one_process(tmp_path):
    """``device_state``: each rank's first owned parameters' state on its device (host RAM here), the next in host
    RAM, the rest on its SSD: bitwise one process summing the ranks' gradients alike."""
    split = {"optimizer_schedule": "next_forward", "device_state": "64KiB", "host_state": "128KiB"}
    spawn_ranks(_rank_main, args=(2, str(tmp_path), "gpt2", split), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        s = r["summary"]
        assert s["device_bytes_optimizer_state"] > 0 and s["host_bytes_optimizer_state"] > 0, s
        assert s["ssd_bytes_optimizer_state"] > 0
    assert_bitwise_the_ranks_sum(ranks)
