"""The optimizer state's host-RAM tier (``FuyouConfig.host_state``, issue 25's first part): any split of the
state between host RAM and the SSD trains bitwise like the state all on the SSD, resumes across splits, and
stays within ``host_memory_budget``."""

import contextlib
import copy
import dataclasses
import json
import os
import threading
import time

import pytest
import torch

from conftest import decay_groups, tiny_causal_lm
from fuyou_strategy import ConfigError, FuyouAdamW, FuyouConfig, FuyouEngine
from fuyou_strategy.activations import Policy
from fuyou_strategy.config import parse_bytes, resolve
from fuyou_strategy.storage import host_budget_split, host_state_bytes
from fuyou_strategy.device import host_buffer_usage, reset_host_buffer_high_water
from fuyou_strategy.optim.state import OptimizerState
from fuyou_strategy.storage import StorageError, StorageSpaceError, TensorStore, aio
from test_schedule import MAX_NORM, STEPS, config, reference, train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

SPLITS = {"none": 0, "mixed": "96KiB", "all": "768KiB"}  # of host_memory_budget="1MiB" (test_schedule.config)


def state_bytes(opt):
    """Optimizer state on the SSD and in host RAM (every slot, with padding)."""
    summary_like = [(e.memory is None, e.slots * e.nchunks * e.stride) for name, e in opt.store.entries.items()
                    if name.startswith("adamw.")]
    return sum(n for ssd, n in summary_like if ssd), sum(n for ssd, n in summary_like if not ssd)


def planned_engine(tmp_path, model, **kwargs):
    """An engine with the planner (2 warm-up steps) and a 64 MiB host budget, which holds the tiny model's state."""
    cfg = config(tmp_path, "auto", host_memory_budget="64MiB", host_state="auto", activations="auto",
                 planner_warmup_steps=2, activation_min_bytes=0)
    return FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True), max_grad_norm=MAX_NORM,
                       config=cfg, **kwargs)


def backward_on_the_ssd(tmp_path):
    """The tiny GPT-2 trained through the engine (``backward`` schedule, the whole state on the SSD) beside torch's
    run: (model, torch's model, the engine, losses, torch's losses)."""
    model = tiny_causal_lm("gpt2")
    ref_model = copy.deepcopy(model)
    ref_losses = reference(ref_model)
    engine = FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True), max_grad_norm=MAX_NORM,
                         config=config(tmp_path, "backward", host_state=0))
    losses, _ = train(model, engine.optimizer, lambda last: engine.begin_micro_batch(update=last))
    return model, ref_model, engine, losses, ref_losses


def test_the_state_on_the_ssd_of_the_last_gradients_is_read_ahead_during_backward_and_changes_no_bit(tmp_path):
    """The tied embedding's gradient is final last; from the second window on its state is read ahead while the
    worker is idle, and its update takes those reads (clipping that bites, a skipped step, accumulation)."""
    model, ref_model, engine, losses, ref_losses = backward_on_the_ssd(tmp_path)
    opt = engine.optimizer
    summary, tail = engine.summary(), opt.control._schedules["backward"].tail
    engine.close()
    assert losses == ref_losses
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
    assert tail[0].param is model.transformer.wte.weight, [ps.describe() for ps in tail]
    assert summary["state_chunks_read_ahead"] > 0, "the updates took chunks read ahead"
    assert summary["state_chunks_read_ahead"] == opt.adam_state.pipeline.ahead_used
    assert opt.stats.redos >= 1 and opt.stats.skips == 1


def test_the_updates_writes_land_behind_step_on_a_slow_drive_and_change_no_bit(tmp_path, monkeypatch):
    """With every write slowed, ``step()`` commits while the speculative updates' shadow writes still land; the
    next reads of those chunks (the next window's updates, a redo after clipping, the state read right after the
    last step) wait for them: bitwise torch, and the state read is the one just committed."""
    # Every write is 10 ms late; once a commit has left writes in flight, each write still to land waits (2 s at
    # most) until a read has waited behind one: so some read meets a write in flight however slowly the machine runs
    # the training thread (under load the 10 ms alone were over before the next window read those chunks).
    real_write, real_wait, real_commit = aio._pwritev, TensorStore._wait_behind, TensorStore.commit
    left_behind, reader_waited = threading.Event(), threading.Event()

    def slow_write(fd, bufs, off):
        time.sleep(0.01)
        if left_behind.is_set():
            reader_waited.wait(timeout=2)
        return real_write(fd, bufs, off)

    def commit(store, *args, **kwargs):
        committed = real_commit(store, *args, **kwargs)
        if store.writes_behind:
            left_behind.set()
        return committed

    def wait_behind(store, entry, phys, k):  # under the store's lock: the write cannot land before the read waits
        if entry.behind[phys] if k is None else k in entry.behind[phys]:
            reader_waited.set()
        return real_wait(store, entry, phys, k)

    monkeypatch.setattr(aio, "_pwritev", slow_write)
    monkeypatch.setattr(TensorStore, "commit", commit)
    monkeypatch.setattr(TensorStore, "_wait_behind", wait_behind)
    model, ref_model, engine, losses, ref_losses = backward_on_the_ssd(tmp_path)
    opt = engine.optimizer
    masters = [opt.read_state(p)["master"] for p in model.parameters()]  # at once: waits for the last writes
    summary = engine.summary()
    engine.close()
    assert losses == ref_losses
    for (name, p), q, master in zip(model.named_parameters(), ref_model.parameters(), masters):
        assert torch.equal(p, q), name
        assert torch.equal(master.view_as(p), p), name
    assert summary["state_chunks_written_behind"] > 0 and summary["state_reads_waited_behind"] > 0, summary
    assert opt.stats.redos >= 1 and opt.stats.skips == 1


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


@pytest.mark.parametrize("tier", [dict(host_state=SPLITS["mixed"]), dict(device_state="96KiB", host_state=0)],
                         ids=["ram", "device"])
@pytest.mark.parametrize("schedule", ["backward", "next_forward"])
def test_an_update_of_state_in_ram_or_on_the_device_takes_its_chunks_in_one_call_and_one_on_the_ssd_each(
        tmp_path, monkeypatch, schedule, tier):
    """The worker's bookkeeping is paid once per parameter whose state is in RAM (a one-pass update) or on the device
    tier (`ChunkJob.batch`), and once per chunk on the SSD, whose chunks each take a pool buffer; bitwise torch's
    either way (split with the SSD)."""
    calls = {}  # entry -> the (first chunk, chunks) of every call of its updates' job functions
    real = OptimizerState.update_job

    def update_job(self, ps, *args, **kwargs):
        job = real(self, ps, *args, **kwargs)
        fn = job.fn

        def counted(k, *bufs):
            calls.setdefault(ps.entry, set()).add((k, len(bufs)))
            return fn(k, *bufs)

        job.fn = counted
        return job

    grouped = []  # the entries each call of a grouped job's function updated (`OptimizerState.group_job`)
    real_group = OptimizerState.group_job

    def group_job(self, members, *args, **kwargs):
        job = real_group(self, members, *args, **kwargs)
        fn = job.fn

        def counted(k, *bufs):
            grouped.append([ps.entry for ps, *_rest in members])
            for ps, *_rest in members:  # each member's chunks all in this one call
                calls.setdefault(ps.entry, set()).add((0, ps.nchunks))
            return fn(k, *bufs)

        job.fn = counted
        return job

    monkeypatch.setattr(OptimizerState, "update_job", update_job)
    monkeypatch.setattr(OptimizerState, "group_job", group_job)
    model = tiny_causal_lm("llama")
    ref_model = copy.deepcopy(model)
    ref_losses = reference(ref_model)
    engine = FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True), max_grad_norm=MAX_NORM,
                         config=config(tmp_path, schedule, **tier))
    opt = engine.optimizer
    assert engine.summary()["update_kernel"] == "one_pass"
    losses, _ = train(model, opt, lambda last: engine.begin_micro_batch(update=last))
    state = opt.adam_state
    chunks = {ps.entry: (ps.nchunks, ps.index in state.in_memory | state.on_device) for ps in state.owned}  # lent?
    assert state.on_device if "device_state" in tier else state.in_memory
    engine.close()
    assert losses == ref_losses
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
    assert calls.keys() == chunks.keys()
    for entry, (n, lent) in chunks.items():
        assert calls[entry] == ({(0, n)} if lent else {(k, 1) for k in range(n)}), (entry, n, lent)
    assert any(n > 1 and lent for n, lent in chunks.values()), chunks
    assert any(n > 1 and not lent for n, lent in chunks.values()), chunks
    assert all(chunks[entry][1] for entry in sum(grouped, [])), grouped  # a grouped job never takes SSD state


def resumed_across_splits(tmp_path, splits, check=None):
    """The tiny GPT-2 trained straight through (the state on the SSD) and, from the same start, two steps in each
    of ``splits`` (`FuyouConfig` fields), each resumed from the save the one before made; ``check(i, opt)`` looks
    at each split's optimizer when built. Returns (straight model, resumed model, straight state, resumed state)."""
    straight = tiny_causal_lm("gpt2")
    model = copy.deepcopy(straight)
    for name in ["a", *map(str, range(len(splits)))]:
        (tmp_path / name).mkdir()
    with FuyouAdamW(decay_groups(straight), lr=3e-3, max_grad_norm=MAX_NORM,
                    config=config(tmp_path / "a", "next_forward")) as opt:
        train(straight, opt)
        expected = [opt.read_state(p) for p in straight.parameters()]
    folder = tmp_path / "ckpt"
    for i, split in enumerate(splits):
        with FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM,
                        config=config(tmp_path / str(i), "next_forward", **split)) as opt:
            if check is not None:
                check(i, opt)
            if i:
                opt.load_folder(folder)
            train(model, opt, steps=range(2 * i, 2 * i + 2))
            opt.state_dict(folder)
            if i == len(splits) - 1:
                got = [opt.read_state(p) for p in model.parameters()]
    return straight, model, expected, got


def test_masters_kept_only_in_the_parameters_go_into_their_chunks_before_a_window_speculates(tmp_path):
    """fp32 on the CPU, the whole state in RAM: an exact one-pass update writes the new master into the parameter
    only (`OptimizerState.masters_behind`), and before a window whose updates speculate (their rollback restores from
    the chunks) or a read of the state those masters go into their chunks. Schedules forced to alternate, with
    clipping that bites, a non-finite step rolled back under ``backward`` and three micro-batches accumulated: the
    run is torch's, bit for bit, and its state read back is the straight run's."""
    model = tiny_causal_lm("gpt2")
    ref_model = copy.deepcopy(model)
    ref_losses = reference(ref_model)
    order = iter(["next_forward", "next_forward", "backward", "next_forward", "backward", "next_forward",
                  "next_forward"])
    behind_at_switch = []  # parameters whose chunks' masters were older as each speculating window was chosen
    with FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM,
                    config=config(tmp_path, "auto", host_state=SPLITS["all"])) as opt:
        state = opt.adam_state

        def forced():
            name = next(order)
            if name == "backward":
                behind_at_switch.append(len(state.masters_behind))
            return name, "forced by the test"

        opt.chooser.choose = forced
        opt.control.choose()  # the first window's schedule, as the optimizer chose it when built
        losses, _ = train(model, opt)
        stats = opt.stats
        assert state.masters_behind, "the last window's exact updates kept their masters in the parameters"
        got = {name: opt.read_state(p) for name, p in model.named_parameters()}
        assert not state.masters_behind, "read_state wrote every master into its chunk"
    assert losses == ref_losses
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(got[name]["master"], q), name
    assert behind_at_switch[0] > 0 and behind_at_switch[1] > 0, behind_at_switch
    assert stats.skips == 1 and stats.clipped >= 1 and stats.rollbacks >= 1 and stats.deferred >= 1, stats


def test_a_save_resumes_into_another_split_exactly(tmp_path):
    """Checkpoints do not depend on where the state lived: saved with it all on the SSD, resumed with a mixed
    split (and back), the run goes on bitwise as if uninterrupted."""
    straight, model, expected, got = resumed_across_splits(
        tmp_path, [dict(host_state=SPLITS[split]) for split in ["none", "mixed", "all"]])
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
    on_ssd, ssd_summary = run(tmp_path / "ssd", host_state=0)
    split, summary = run(tmp_path / "split", host_state="64KiB")
    assert summary["host_bytes_optimizer_state"] > 0 and ssd_summary["host_bytes_optimizer_state"] == 0
    assert summary["ssd_bytes_optimizer_state"] < ssd_summary["ssd_bytes_optimizer_state"]
    assert summary["redos"] + summary["clipped"] > 0, "clipping bit"
    for (name, p), q in zip(on_ssd.named_parameters(), split.parameters()):
        assert torch.equal(p, q), name


# -- host_state="auto": the planner's split, and the budget that fits the machine ----------------------------------
def test_the_cost_model_gives_the_state_what_the_host_budget_leaves_in_the_optimizers_order():
    from test_planner import K, MiB, S, synthetic

    from fuyou_strategy.planner import fixed_plan, predict, solve

    # 8 blocks and the rest of 10**6 parameters each: 24 MB of state per block (two slots); a slow SSD, whose state
    # traffic (0.24 s a block) outlasts a block's backward (0.2 s): at 1e9 B/s the tail's read ahead and the writes
    # behind step() hid all of it
    on_ssd = synthetic(n=8, ssd_bw=1e8, host=120 * MiB, optimizer_host_bytes=8 * MiB)  # 216 MB in all
    auto = dataclasses.replace(on_ssd, host_state=None)
    base, ram = predict(on_ssd, [K] * 8), predict(auto, [K] * 8)
    per_block = 2 * 12 * 10**6
    assert base.state_in_ram == 0 and ram.state_in_ram > 0
    assert ram.host_peak <= 120 * MiB and ram.host_peak == base.host_peak + ram.state_in_ram
    assert ram.state_in_ram == (120 * MiB - base.host_peak) // 24 * 24, "all the room, in whole parameters"
    assert ram.ssd_peak == base.ssd_peak - ram.state_in_ram
    assert ram.ssd_write_bytes == base.ssd_write_bytes - ram.state_in_ram // 2, "one slot written per step"
    assert ram.step_s < base.step_s, "less SSD traffic, a shorter step"
    timeline = {name: end - start for _res, name, start, end in predict(auto, [K] * 8, timeline=True).timeline}
    # the rest of the model (first in the optimizer's order) and the first blocks move nothing over the SSD
    assert "read state rest" not in timeline and "read state block 0" not in timeline
    assert "read state block 7" in timeline
    assert ram.state_in_ram // per_block < 8
    # an activation on the host leaves the state less room; the solver weighs it
    host_act = predict(auto, [S] + [K] * 7)
    assert host_act.state_in_ram == ram.state_in_ram
    assert predict(auto, [Policy.HOST] + [K] * 7).state_in_ram < ram.state_in_ram
    plan = solve(auto, allowed=[K, Policy.HOST])
    assert plan.state_in_ram > 0 and plan.host_peak <= 120 * MiB
    # a fixed host_state counts in the host peak and can overflow it
    fixed = dataclasses.replace(on_ssd, host_state=200 * MiB)
    assert "host" in predict(fixed, [K] * 8).over
    assert fixed_plan(auto, [K] * 8).state_in_ram == ram.state_in_ram


def test_room_for_the_whole_state_holds_every_parameter_whatever_the_rounding_of_its_padded_bytes():
    """The third GPU run left one 1,024-element parameter's state on the SSD although the host budget held the
    state eight times over: the planner took ``total // per_param`` parameters, one short in floating point
    for a padded ``state_bytes`` (the case below), and the engine kept the file of the whole state for it."""
    from test_planner import K, MiB, synthetic

    from fuyou_strategy.planner import predict

    params, padded = 177972133, 2142479565  # one such case: (params * b) // b == params - 1 in floating point
    state_bytes = padded / params
    assert (params * 2 * state_bytes) // (2 * state_bytes) == params - 1
    one = synthetic(n=1, ssd_bw=1e9, host=64 * 1024 * MiB)
    block = dataclasses.replace(one.blocks[0], params=params)
    profile = dataclasses.replace(one, blocks=[block], other_params=0, host_state=None, state_bytes=state_bytes)
    assert profile.params == params
    ram = predict(profile, [K])
    assert ram.state_in_ram >= params * 2 * state_bytes, "every parameter's state, never a byte short"
    assert "read state block 0" not in {name for _res, name, _s, _e in predict(profile, [K], timeline=True).timeline}


def test_fuyou_plan_models_the_split(capsys, tmp_path):
    from fuyou_strategy.cli import main as fuyou

    out = tmp_path / "plan.json"
    results = {}
    for host_state in ["0", "auto"]:
        assert fuyou(["plan", "gpt3-13b", "--gpu", "a100-80g", "--host-memory", "768GB", "--host-state", host_state,
                      "--batch", "32", "--seq", "1024", "--json", str(out)]) == 0
        results[host_state] = json.loads(out.read_text())["results"]["fuyou"]
    printed = capsys.readouterr().out
    assert "optimizer state in host RAM" in printed
    assert results["0"]["state_in_ram"] == 0 and results["auto"]["state_in_ram"] > 0
    assert results["auto"]["step_s"] < results["0"]["step_s"]
    assert results["auto"]["host_peak"] <= parse_bytes("768GB")


def test_auto_holds_what_the_plan_leaves_in_host_ram_after_the_warm_up_and_changes_no_bit(tmp_path):
    """The planner profiles 2 steps with as much state in host RAM as the transfers leave, then the engine holds
    what the plan leaves the state there between steps; the run is bitwise torch's and the state-on-SSD run's.
    (Until the warm-up held it in RAM too, the state started on the SSD: this test said so.)"""
    model = tiny_causal_lm("llama")
    ref_model = copy.deepcopy(model)
    ref_losses = reference(ref_model)
    said = []
    cfg = config(tmp_path, "auto", host_state="auto", activations="auto", planner_warmup_steps=2,
                 activation_min_bytes=0)
    assert host_state_bytes(cfg) > 0, "the warm-up's share; the planner decides after it"
    engine = FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True), max_grad_norm=MAX_NORM,
                         config=cfg, report=said.append)
    opt = engine.optimizer
    assert 0 < state_bytes(opt)[1] <= host_state_bytes(cfg)
    losses, _ = train(model, opt, lambda last: engine.begin_micro_batch(update=last))
    summary, plan = engine.summary(), engine.plan
    engine.close()
    assert plan is not None and plan.state_in_ram > 0
    assert 0 < summary["host_bytes_optimizer_state"] <= plan.state_in_ram
    assert any("host_state='auto'" in line and "in host RAM" in line for line in said), said
    assert losses == ref_losses
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name


def test_a_plan_whose_budget_holds_the_whole_state_moves_all_of_it_into_ram(tmp_path):
    """The plan counts the state as the store holds it (chunks padded to their stride, `state_bytes_per_param`),
    so a budget that holds it all gets it all. (The first GPU run: the plan counted 12 bytes per parameter and
    slot, the store needed 15.1 with GPT-2 350M's padding, and a fifth of the state stayed on the SSD beside a
    66 GB budget.)"""
    model = tiny_causal_lm("llama")
    engine = planned_engine(tmp_path, model)
    cfg = engine.config
    opt = engine.optimizer
    whole = sum(state_bytes(opt))
    padded = opt.control.state_bytes_per_param() * sum(p.numel() for p in model.parameters()) * cfg.state_slots
    assert padded == pytest.approx(whole), "the planner's bytes per parameter are the store's"
    train(model, opt, lambda last: engine.begin_micro_batch(update=last))
    summary, plan = engine.summary(), engine.plan
    engine.close()
    assert plan is not None and plan.state_in_ram >= whole
    assert summary["ssd_bytes_optimizer_state"] == 0 and summary["host_bytes_optimizer_state"] == whole


def test_a_parameter_just_over_one_chunk_takes_two_equal_chunks_not_two_whole_ones(tmp_path):
    """`balanced_chunk`: a parameter one element longer than a chunk was two whole strides on the SSD (and in
    RAM), twice its bytes; now its chunks are equal and the padding is under 2048 elements per chunk."""
    most = host_budget_split(FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="1MiB")).state_chunk // 12
    w = torch.nn.Parameter(torch.randn(most + 1))
    with FuyouAdamW([w], config=FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="1MiB", host_state=0)) as opt:
        on_ssd, _ = opt.adam_state.footprint()
        exact = 2 * 12 * w.numel()  # two slots of [master | exp_avg | exp_avg_sq]
        assert exact <= on_ssd <= exact + 2 * 2 * 2048 * 12, (on_ssd, exact)
        assert opt.control.state_bytes_per_param() * w.numel() * 2 == pytest.approx(on_ssd)


def test_a_pinned_plan_holds_its_state_in_ram_from_the_first_step(tmp_path):
    from test_planner import synthetic

    from fuyou_strategy.planner import fixed_plan

    plan = fixed_plan(synthetic(n=2, host=None), ["keep", "keep"])
    plan.state_in_ram = 96 * 1024
    plan.save(tmp_path / "plan.json")
    model = tiny_causal_lm("gpt2")
    cfg = config(tmp_path, "next_forward", host_state="auto", plan=str(tmp_path / "plan.json"))
    with FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3), config=cfg) as engine:
        on_ssd, in_ram = state_bytes(engine.optimizer)
        assert 0 < in_ram <= 96 * 1024 and on_ssd > 0
        assert engine.config.host_state == in_ram


def test_moving_an_entry_to_memory_keeps_both_slots_and_gives_the_disk_back(tmp_path):
    cfg = FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", host_memory_budget="1MiB", host_state=0)
    with TensorStore(cfg) as store:
        store.create("a", (5000,), torch.float32, chunk_bytes=8192)
        old, new = torch.randn(5000), torch.randn(5000)
        store.write("a", old).result()
        store.write("a", new, slot="shadow").result()
        with pytest.raises(StorageSpaceError, match="host_state"):
            store.to_memory("a")
        store.allow_in_memory(64 * 1024)
        assert store.to_memory("a") == 2 * 3 * 8192 and store.to_memory("a") == 0
        assert store.entry("a").base == {} and store.bytes_in_memory == 2 * 3 * 8192
        assert torch.equal(store.read("a").result(), old) and torch.equal(store.read("a", slot="shadow").result(), new)
        store.commit(["a"])
        assert torch.equal(store.read("a").result(), new)
        store.create("b", (5000,), torch.float32, chunk_bytes=8192)  # reuses the space "a" gave back
        assert store.entry("b").base == {0: 0}
        store.delete("a")
        assert store.bytes_in_memory == 0 and store.pool.lent == 0


def test_moving_entries_to_memory_gives_the_end_of_the_swap_file_back_to_the_filesystem(tmp_path):
    """The state a plan moves into RAM takes no disk afterwards (the second GPU run: 8.5 GB of swap file stayed
    reserved for a state wholly in RAM, and the summary said 24 bytes per parameter on the SSD)."""
    cfg = FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", host_memory_budget="1MiB", host_state="256KiB")
    with TensorStore(cfg) as store:
        values = {name: torch.randn(5000) for name in "ab"}
        for name, value in values.items():
            store.create(name, (5000,), torch.float32, chunk_bytes=8192)
            store.write(name, value).result()
        size = lambda: os.fstat(store._files[0].fd).st_size  # noqa: E731
        both = store.bytes_on_disk
        assert size() == both > 0
        store.to_memory("a")  # the file's first half: nothing past "b" to give back yet
        assert store.bytes_on_disk == size() == both
        store.to_memory("b")  # now the whole file is free, and gone
        assert store.bytes_on_disk == size() == 0
        for name, value in values.items():
            assert torch.equal(store.read(name).result(), value)
        store.create("c", (5000,), torch.float32, chunk_bytes=8192)  # the file grows again when asked
        c = torch.randn(5000)
        store.write("c", c).result()
        assert torch.equal(store.read("c").result(), c) and size() == store.bytes_on_disk > 0


def test_a_state_the_plan_moves_wholly_into_ram_leaves_no_bytes_on_the_ssd(tmp_path):
    model = tiny_causal_lm("llama")
    engine = planned_engine(tmp_path, model)
    train(model, engine.optimizer, lambda last: engine.begin_micro_batch(update=last))
    summary = engine.summary()
    sizes = {f: os.stat(os.path.join(d, f)).st_size for d in engine.optimizer.store.run_dirs for f in os.listdir(d)
             if f.endswith(".bin")}  # the swap files (beside them: owner.json, who runs there)
    engine.close()
    assert summary["ssd_bytes_optimizer_state"] == 0 and summary["host_bytes_optimizer_state"] > 0
    assert summary["ssd_file_bytes"] == 0 and summary["ssd_bytes_per_trainable_parameter"] == 0
    assert sizes and not any(sizes.values()), sizes


def test_host_state_auto_without_a_planner_takes_what_the_transfers_leave(tmp_path):
    cfg = config(tmp_path, "auto", host_state="auto")
    shares = host_budget_split(cfg)
    assert shares.state_in_ram == host_state_bytes(cfg) > 0
    assert shares.host_activations == 0 and shares.state_in_ram + shares.reserved == cfg.host_memory_budget
    for claims in [dict(activations="host"), dict(weights={0: "host"}), dict(weights="ssd")]:
        assert host_state_bytes(config(tmp_path, "auto", host_state="auto", **claims)) == 0, claims
    # The planner's warm-up keeps every activation and weight where it is: the state takes the same share, and
    # the plan then moves out what its host users need (`test_a_plan_that_needs_the_warm_ups_ram_moves_...`).
    for planner in [dict(activations="auto"), dict(activations="auto", weights="auto")]:
        assert host_state_bytes(config(tmp_path, "auto", host_state="auto", **planner)) == host_state_bytes(cfg)


def test_host_memory_budget_auto_takes_half_the_available_ram_and_falls_back_to_ssd_when_little(tmp_path, monkeypatch,
                                                                                              caplog):
    import fuyou_strategy.config as config_module

    GiB = 1024**3
    monkeypatch.setattr(config_module, "available_memory", lambda: 20 * GiB)
    with caplog.at_level("DEBUG", logger="fuyou_strategy"):  # the engine announces it (test_config), at INFO
        settings = resolve(FuyouConfig(swap_dirs=[str(tmp_path)], host_memory_budget="auto", host_state="auto"))
    roomy = settings.config
    assert roomy.host_memory_budget == 10 * GiB and roomy.host_state == "auto"
    assert "host_memory_budget='auto' took 10.00 GiB: 50% of the 20.00 GiB of RAM available" in caplog.text
    assert settings.choices["host_memory_budget"][1].startswith("50% of the 20.00 GiB of RAM available")
    assert roomy.replace(io_threads=1).host_memory_budget == 10 * GiB, "resolved once"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: two ranks on this machine share it
    assert resolve(FuyouConfig(host_memory_budget="auto")).config.host_memory_budget == 5 * GiB
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(config_module, "available_memory", lambda: 6 * GiB)
    assert resolve(FuyouConfig(host_memory_budget="auto")).config.host_memory_budget == 2 * GiB, \
        "at least 4 GiB left to the rest"
    monkeypatch.setattr(config_module, "available_memory", lambda: GiB)
    with pytest.warns(UserWarning, match=r"only 1.00 GiB of RAM is available.*keeps the optimizer state on the SSD"):
        tight = resolve(FuyouConfig(swap_dirs=[str(tmp_path)], host_memory_budget="auto", host_state="auto")).config
    assert tight.host_memory_budget == 512 * 1024**2 and tight.host_state == 0
    model = tiny_causal_lm("gpt2")
    with FuyouAdamW(decay_groups(model), lr=1e-3, config=tight) as opt:
        assert state_bytes(opt)[1] == 0 and state_bytes(opt)[0] > 0


@contextlib.contextmanager
def two_chunks_in_ram(tmp_path):
    """A store whose entry ``"a"`` holds 4096 random fp32 values in two chunks in host RAM: ``(store, values)``."""
    cfg = FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", host_memory_budget="1MiB", host_state="64KiB")
    with TensorStore(cfg) as store:
        store.create("a", (4096,), torch.float32, chunk_bytes=8192, in_memory=True)  # 2 chunks
        x = torch.randn(4096)
        store.write("a", x).result()
        yield store, x


def test_a_chunk_lent_for_a_speculative_update_is_written_in_place_and_rolled_back_like_a_write(tmp_path):
    """read_chunk(lend='shadow') of an in-memory entry: the shadow slot's own memory holding the active chunk
    (the speculative update's buffer, no pool buffer); handed back it is a write of the shadow slot, given up
    it fails the slot until a rollback, and a rollback gives up what is still lent (a worker that died)."""
    with two_chunks_in_ram(tmp_path) as (store, x):
        lent = store.read_chunk("a", 0, lend="shadow").result()
        assert store.pool.lent == store.bytes_in_memory, "no pool buffer beside the state's own"
        assert torch.equal(lent.view(torch.float32), x[:2048])
        lent.view(torch.float32).mul_(2)  # the update, in place
        assert torch.equal(store.read("a").result(), x), "the active slot is untouched"
        with pytest.raises(StorageError, match="in flight"):
            store.commit(["a"])
        store.write_chunk("a", 0, lent, slot="shadow").result()
        second = store.read_chunk("a", 1, slot="active").result()  # the other chunk: an ordinary copy
        store.write_chunk("a", 1, second, slot="shadow").result()
        store.commit(["a"])
        assert torch.equal(store.read("a").result(), torch.cat([2 * x[:2048], x[2048:]]))
        given_up = store.read_chunk("a", 1, lend="shadow").result()
        given_up.release()
        with pytest.raises(StorageError, match="did not finish"):
            store.read("a", slot="shadow").result()
        store.rollback(["a"])
        store.read_chunk("a", 0, lend="shadow").result()  # never handed back
        store.rollback(["a"])
        assert store.entry("a").inflight == [0, 0] and not store.entry("a").lent
        assert torch.equal(store.read("a").result(), torch.cat([2 * x[:2048], x[2048:]]))


def test_a_shadow_chunk_lent_unfilled_reads_the_active_one_and_fails_like_any_lend(tmp_path):
    """read_chunk(lend='shadow', fill=False): the shadow slot's memory, not copied into, the active chunk beside it
    (``source``, the same bytes); written back it is the shadow's write, given up it fails the slot until a
    rollback, and the active slot is never touched."""
    with two_chunks_in_ram(tmp_path) as (store, x):
        entry = store.entry("a")
        lent = store.read_chunk("a", 0, lend="shadow", fill=False).result()
        assert lent.copy_s == 0.0 and lent.data.data_ptr() == entry.chunk_memory(0, 1 - entry.active).data_ptr()
        assert lent.source.data_ptr() == entry.chunk_memory(0, entry.active).data_ptr()
        assert torch.equal(lent.source.view(torch.float32), x[:2048])
        lent.view(torch.float32).copy_(lent.source.view(torch.float32) * 3)  # the update, out of place
        store.write_chunk("a", 0, lent, slot="shadow").result()
        assert lent.source is None, "no view of the active chunk outlives the lend"
        store.write_chunk("a", 1, store.read_chunk("a", 1).result(), slot="shadow").result()
        assert torch.equal(store.read("a").result(), x), "the active slot is untouched"
        store.commit(["a"])
        assert torch.equal(store.read("a").result(), torch.cat([3 * x[:2048], x[2048:]]))
        given_up = store.read_chunk("a", 1, lend="shadow", fill=False).result()
        given_up.release()
        with pytest.raises(StorageError, match="did not finish"):
            store.read("a", slot="shadow").result()
        store.rollback(["a"])
        assert torch.equal(store.read("a").result(), torch.cat([3 * x[:2048], x[2048:]]))


def test_a_chunk_lent_for_an_exact_update_is_the_active_chunk_itself_and_a_rollback_leaves_it_alone(tmp_path):
    """read_chunk(lend='active') of an in-memory entry (an exact update, written back where it was read): the
    active chunk's own memory, no copy; handed back it is a write, while lent it is not readable, given up it
    fails the slot (the update may have changed part of it), and a rollback of shadow writes leaves it lent."""
    with two_chunks_in_ram(tmp_path) as (store, x):
        entry = store.entry("a")
        lent = store.read_chunk("a", 0, lend="active").result()
        assert lent.data.data_ptr() == entry.chunk_memory(0, entry.active).data_ptr(), "the chunk itself, no copy"
        assert store.pool.lent == store.bytes_in_memory, "no pool buffer beside the state's own"
        lent.view(torch.float32).mul_(2)  # the update, in place
        with pytest.raises(StorageError, match="in flight"):
            store.read_chunk("a", 0).result()
        store.rollback(["a"])  # shadow writes only
        assert entry.lent, "still lent to its update"
        store.write_chunk("a", 0, lent).result()
        assert torch.equal(store.read("a").result(), torch.cat([2 * x[:2048], x[2048:]]))
        store.read_chunk("a", 1, lend="active").result().release()
        with pytest.raises(StorageError, match="did not finish"):
            store.read("a").result()


def test_a_chunk_lent_again_gives_the_views_it_made_before_of_its_own_slot_and_none_once_given_back(tmp_path):
    """The views of a lent chunk (`LentChunk.view`, `kept`, `source_as`) are made once and kept with the slot's
    memory: lent again from the same physical slot, the chunk gives the same tensors, of the same bytes; from the
    other slot (after a commit), that slot's own; a chunk given back gives none; the entry moved to the SSD, its
    memory lets go of them."""
    with two_chunks_in_ram(tmp_path) as (store, x):
        entry = store.entry("a")
        made = []

        def pair(chunk):
            return chunk.kept("pair", lambda: made.append(chunk.slot) or chunk.view(torch.float32).view(2, -1).unbind())

        first, = store.lend_chunks([("a", 0)], lend="shadow", fill=False)
        shadow = 1 - entry.active
        views = first.view(torch.float32), first.source_as(torch.float32), pair(first)
        assert views[0].data_ptr() == entry.chunk_memory(0, shadow).data_ptr() and views[0].numel() == 2048
        assert torch.equal(views[1], x[:2048]) and views[1].data_ptr() == entry.chunk_memory(0, entry.active).data_ptr()
        assert first.known("pair") is views[2] and first.known("never made") is None  # what `kept` made, asked alone
        views[0].copy_(views[1] * 3)
        store.give_back([first])
        with pytest.raises(StorageError, match="given back"):
            first.view()
        with pytest.raises(StorageError, match="given back"):
            first.known("pair")
        with pytest.raises(StorageError, match="given back"):
            pair(first)
        again, = store.lend_chunks([("a", 0)], lend="shadow", fill=False)  # the same physical slot, no commit
        assert again.view(torch.float32) is views[0] and again.source_as(torch.float32) is views[1]
        assert pair(again) is views[2] and made == [shadow], "made once"
        assert torch.equal(views[2][0], 3 * x[:1024]), "the same bytes"
        rest, = store.lend_chunks([("a", 1)], lend="shadow")  # the shadow slot whole, for the commit
        store.give_back([again, rest])
        store.commit(["a"])
        other, = store.lend_chunks([("a", 0)], lend="shadow", fill=False)  # now the other physical slot
        assert other.slot == 1 - shadow and other.view(torch.float32).data_ptr() != views[0].data_ptr()
        assert other.source_as(torch.float32).data_ptr() == views[0].data_ptr(), "the committed slot, read"
        assert torch.equal(other.source_as(torch.float32), 3 * x[:2048])
        assert pair(other)[0].data_ptr() == other.view(torch.float32).data_ptr() and made == [shadow, 1 - shadow]
        store.give_back([other])
        in_place, = store.lend_chunks([("a", 1)])  # an exact update's: the active chunk itself
        with pytest.raises(StorageError, match="was lent filled"):
            in_place.source_as(torch.float32)
        store.give_back([in_place])
        memory = list(entry.memory)
        assert all(m.memo for m in memory)
        store.to_ssd("a")
        assert all(m.memo is None and m.data is None for m in memory), "released with the memory"
        assert all(m.known((0, "buffer")) is None for m in memory)
        assert torch.equal(store.read("a").result(), torch.cat([3 * x[:2048], x[2048:]]))


def test_chunks_lent_together_are_checked_first_given_back_together_and_a_failed_copy_lends_none(tmp_path,
                                                                                                   monkeypatch):
    """lend_chunks (a run of parameters' chunks under one lock): each lent as lend_chunk lends it, every chunk checked
    before any is lent (one not readable lends none, nothing failed), a chunk named twice refused; give_back writes
    them all back in place; a copy that fails part-way lends none and fails the slot it was filling, as a lend given
    up does, until a rollback."""
    with two_chunks_in_ram(tmp_path) as (store, x):
        entry = store.entry("a")
        lent = store.lend_chunks([("a", 0), ("a", 1)], lend="shadow", fill=False)
        assert [c.data.data_ptr() for c in lent] == [entry.chunk_memory(k, 1 - entry.active).data_ptr() for k in (0, 1)]
        assert [c.source.data_ptr() for c in lent] == [entry.chunk_memory(k, entry.active).data_ptr() for k in (0, 1)]
        for c in lent:
            c.view(torch.float32).copy_(c.source.view(torch.float32) + 1)
        with pytest.raises(StorageError, match="in flight"):
            store.commit(["a"])
        store.give_back(lent)
        assert not entry.lent and all(c.data is None and c.source is None for c in lent)
        store.commit(["a"])
        assert torch.equal(store.read("a").result(), x + 1)
        held = store.lend_chunk("a", 1)  # chunk 1 of the active slot: being written
        with pytest.raises(StorageError, match="chunk 1 not written yet"):
            store.lend_chunks([("a", 0), ("a", 1)])
        assert list(entry.lent) == [1] and entry.inflight[entry.active] == 1, "chunk 0 was not lent"
        store.give_back([held])
        with pytest.raises(StorageError, match="named twice"):
            store.lend_chunks([("a", 0), ("a", 0)])
        assert not entry.lent and entry.inflight == [0, 0]
        real = entry.chunk_memory

        def chunk_memory(k, slot):  # the copy into the shadow slot of chunk 1 fails
            if k == 1 and slot != entry.active:
                raise RuntimeError("injected: the copy failed")
            return real(k, slot)

        monkeypatch.setattr(entry, "chunk_memory", chunk_memory)
        with pytest.raises(RuntimeError, match="injected"):
            store.lend_chunks([("a", 0), ("a", 1)], lend="shadow")
        assert not entry.lent and entry.inflight == [0, 0]
        with pytest.raises(StorageError, match="the copy failed"):
            store.read("a", slot="shadow").result()
        store.rollback(["a"])
        assert torch.equal(store.read("a").result(), x + 1), "the active slot is untouched"


def test_fuyou_ddp_shares_the_auto_budget_between_the_ranks_of_the_machine(monkeypatch, tmp_path):
    """The strategy's config is a value, "auto" kept as given; each rank's engine resolves it with the node's
    processes (``local_ranks``), so with "auto" each of the node's ranks takes its share (a number given stays a
    hard cap). A `FuyouConfig` object asking "auto" shares alike: it no longer holds a number resolved where the
    strategy was made."""
    import fuyou_strategy.config as config_module
    from fuyou_strategy import FuyouDDPStrategy

    GiB = 1024**3
    monkeypatch.setattr(config_module, "available_memory", lambda: 20 * GiB)
    two = [torch.device("cpu")] * 2

    def per_rank(strategy):
        return resolve(strategy.fuyou_config, local_ranks=strategy._parallel_engine_arguments()["local_ranks"]
                       ).config.host_memory_budget

    auto = FuyouDDPStrategy(parallel_devices=two, swap_dirs=[str(tmp_path)])
    assert auto.fuyou_config.host_memory_budget == "auto"
    assert resolve(auto.fuyou_config).config.host_memory_budget == 10 * GiB, "one process takes half"
    assert per_rank(auto) == 5 * GiB
    assert per_rank(FuyouDDPStrategy(parallel_devices=two, host_memory_budget="3GiB")) == 3 * GiB
    assert per_rank(FuyouDDPStrategy(FuyouConfig(host_memory_budget="auto"), parallel_devices=two)) == 5 * GiB
    from_dict = FuyouDDPStrategy({"swap_dirs": [str(tmp_path)]}, parallel_devices=two)
    assert per_rank(from_dict) == 5 * GiB


def test_a_warm_up_whose_budget_holds_the_state_writes_none_of_it_to_the_ssd(tmp_path):
    """With the planner (``activations="auto"``) the state starts in host RAM for the warm-up, as much as the
    transfers leave, and the plan then says how much stays: a run whose budget holds all of it writes nothing to
    the SSD. (Before, the warm-up wrote the whole state to the SSD and the plan read it back: 12.8 GB of writes
    at GPT-2 350M, for a state that ended wholly in RAM.)"""
    model = tiny_causal_lm("llama")
    ref_model = copy.deepcopy(model)
    ref_losses = reference(ref_model)
    said = []
    engine = planned_engine(tmp_path, model, report=said.append)
    assert state_bytes(engine.optimizer)[0] == 0, "the whole state in RAM from the start"
    losses, _ = train(model, engine.optimizer, lambda last: engine.begin_micro_batch(update=last))
    summary, plan = engine.summary(), engine.plan
    engine.close()
    assert plan is not None and summary["ssd_bytes_optimizer_state"] == 0
    assert summary["ssd_write_bytes_total"] == 0 and summary["ssd_file_bytes"] == 0
    assert any("for the warm-up" in line for line in said), said
    assert losses == ref_losses
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name


def test_moving_an_entry_to_the_ssd_keeps_both_slots_and_gives_its_memory_back(tmp_path):
    """`TensorStore.to_ssd`, `to_memory`'s inverse: the written chunks of both slots reach new regions of the swap
    file, the entry's memory goes back to the pool, and an entry with a chunk lent out is refused, unchanged."""
    cfg = FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", host_memory_budget="1MiB", host_state="64KiB")
    with TensorStore(cfg) as store:
        store.create("a", (5000,), torch.float32, chunk_bytes=8192, in_memory=True)
        old, new = torch.randn(5000), torch.randn(5000)
        store.write("a", old).result()
        store.write("a", new, slot="shadow").result()
        lent = store.read_chunk("a", 0, lend="shadow").result()
        with pytest.raises(StorageError, match="cannot move entry 'a' to the SSD while a write to it is in flight"):
            store.to_ssd("a")
        assert store.entry("a").memory is not None and store.bytes_on_disk == 0
        store.write_chunk("a", 0, lent, slot="shadow").result()  # lent as a copy of the active chunk
        new[:2048] = old[:2048]
        assert store.to_ssd("a") == 2 * 3 * 8192 and store.to_ssd("a") == 0
        assert store.bytes_in_memory == 0 and store.pool.lent == 0
        assert store.bytes_on_disk == os.fstat(store._files[0].fd).st_size == 2 * 3 * 8192
        assert torch.equal(store.read("a").result(), old) and torch.equal(store.read("a", slot="shadow").result(), new)
        store.commit(["a"])
        assert torch.equal(store.read("a").result(), new)
        store.to_memory("a")  # and back: the same bytes, the file given back again
        assert torch.equal(store.read("a").result(), new) and store.bytes_on_disk == 0


def test_a_plan_that_needs_the_warm_ups_ram_moves_that_state_to_the_ssd_and_changes_no_bit(tmp_path, monkeypatch):
    """The warm-up held the whole state in RAM; a plan that leaves it less (on a GPU: host activations or host-tier
    weights; here the plan is cut down by hand, since on the CPU the planner never puts anything on the host)
    moves the rest out to the SSD between steps, and the run stays bitwise torch's."""
    import fuyou_strategy.engine as engine_module

    solve = engine_module.solve

    def tighter(*args, **kwargs):
        plan = solve(*args, **kwargs)
        plan.host_peak -= plan.state_in_ram - 96 * 1024
        plan.state_in_ram = 96 * 1024
        return plan

    monkeypatch.setattr(engine_module, "solve", tighter)
    model = tiny_causal_lm("llama")
    ref_model = copy.deepcopy(model)
    ref_losses = reference(ref_model)
    engine = planned_engine(tmp_path, model)
    opt = engine.optimizer
    whole = sum(state_bytes(opt))
    assert state_bytes(opt) == (0, whole)
    losses, _ = train(model, opt, lambda last: engine.begin_micro_batch(update=last))
    on_ssd, in_ram = state_bytes(opt)
    summary = engine.summary()
    engine.close()
    assert 0 < in_ram <= 96 * 1024 and on_ssd == whole - in_ram
    assert engine.config.host_state == in_ram and summary["ssd_bytes_optimizer_state"] == on_ssd
    assert losses == ref_losses
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
