"""The planner chooses weight tiers (weights="auto") jointly with the activation policies: on synthetic
profiles, in plan files, in the config, and in training (a LoRA GPT-2 streaming its frozen base)."""

import dataclasses
import json
import math

import pytest
import torch

from fuyou_strategy import ConfigError, FuyouConfig, FuyouEngine
from fuyou_strategy.optim.control import OptimizerControl
from fuyou_strategy.config import format_bytes, resolve
from fuyou_strategy.activations import Policy
from fuyou_strategy.storage.store import TensorStore
from fuyou_strategy.planner import (ONE_SLOT_HINT, WEIGHT_TIERS, Plan, PlanError, Profile, Timings, fixed_plan, one_slot,
                                    predict, solve, with_one_slot, worth_one_slot)
from test_planner import MiB, assert_within_budgets, synthetic
from conftest import tiny_causal_lm
from test_weights import engine_for, frozen, lora_model, run_steps

GiB = 2**30


def weighty(**fields):
    """8 blocks of 100 MiB activations and 100 MiB of trainable weights (as many gradients), 200 MiB besides."""
    return synthetic(weight_bytes=100 * MiB, **fields)


# -- solver -----------------------------------------------------------------------------------------------------
def test_weights_stay_on_the_device_when_they_fit():
    plan = solve(weighty(device=10 * GiB), weight_tiers=WEIGHT_TIERS)
    assert plan.weight_tiers == ["device"] * 8 and plan.weights == {} and plan.policies == ["keep"] * 8
    assert plan.device_peak == 200 * MiB + 8 * 200 * MiB + 8 * 100 * MiB  # base, weights and gradients, activations


@pytest.mark.parametrize("host,tier", [(10 * GiB, "host"), (250 * MiB, "ssd")], ids=["host-has-room", "host-holds-one-block"])
def test_blocks_stream_when_all_resident_does_not_fit(host, tier):
    # Resident weights and gradients alone (200 + 1600 MiB) are over the budget: no activation policy helps.
    profile = weighty(device=1200 * MiB, host=host)
    with pytest.raises(PlanError, match="does not fit: device needs"):
        solve(profile)  # the profile's tiers (all device) kept
    plan = solve(profile, weight_tiers=WEIGHT_TIERS)
    assert_within_budgets(plan)
    streamed = plan.weights
    assert streamed and set(streamed.values()) == {tier}, "the cheapest tier that fits"
    assert "streamed" in plan.reasons[next(iter(streamed))]
    assert plan.predicted_step_s == pytest.approx(
        predict(profile, [Policy(p) for p in plan.policies], weight_tiers=plan.weight_tiers).step_s)


def test_only_the_offered_tiers_are_chosen():
    plan = solve(weighty(device=1200 * MiB, host=10 * GiB), weight_tiers=["device", "ssd"])  # e.g. on the CPU
    assert set(plan.weights.values()) == {"ssd"}


def test_the_read_cost_of_streamed_weights_is_in_the_prediction():
    # Blocks streamed from SSD: a slower drive, a slower predicted step (reads, not only the optimizer's traffic).
    # The slow drive's plan may stream other blocks than the fast one's (the solver tries each block), so the
    # fast drive's placement is also predicted on the slow drive: the same blocks streamed, a slower step.
    fast, slow = (solve(weighty(device=2000 * MiB, host=250 * MiB, ssd_bw=bw), weight_tiers=["device", "ssd"],
                        allowed=["keep"]) for bw in (10e9, 0.5e9))
    assert fast.weights and slow.weights and fast.policies == slow.policies
    tiers = [Policy.KEEP] * 8
    same_blocks = predict(weighty(device=2000 * MiB, host=250 * MiB, ssd_bw=0.5e9), tiers,
                          weight_tiers=fast.weight_tiers)
    assert same_blocks.step_s - fast.predicted_step_s > (
        predict(weighty(ssd_bw=0.5e9), tiers).step_s - predict(weighty(ssd_bw=10e9), tiers).step_s), \
        "more than the optimizer's state traffic alone slows down"
    assert slow.predicted_step_s <= same_blocks.step_s * (1 + 1e-9), "the slow drive's own plan is no slower"


def test_weights_streamed_from_the_masters_take_no_ssd_space_or_writes_of_their_own():
    """fp32 weights in one process are the masters in the state (`WeightStreamer.use_master`): the model counts
    neither their copy on the SSD nor its write-back, and the step is no slower for it."""
    tiers = [Policy.KEEP] * 8
    own, master = (predict(dataclasses.replace(weighty(ssd_bw=0.5e9), weights_from_master=m), tiers,
                           weight_tiers=["ssd"] * 8) for m in (False, True))
    trainable = 8 * 100 * MiB
    assert own.ssd_peak - master.ssd_peak == trainable
    assert own.ssd_write_bytes - master.ssd_write_bytes == trainable
    assert master.step_s < own.step_s
    resident = [predict(dataclasses.replace(weighty(), weights_from_master=m), tiers) for m in (False, True)]
    assert resident[0] == resident[1], "only the SSD tier's weights are affected"


def test_resident_weights_that_hold_their_masters_leave_a_third_of_the_state_unread():
    """fp32 compute on the CPU: a resident weight is its master (`OptimizerState.param_holds`), so the model reads
    4 bytes less of the state per parameter for it; a streamed block's state is read whole."""
    tiers = [Policy.KEEP] * 8
    params = 9 * 10**6  # 8 blocks and the parameters outside them, 10**6 each
    for weight_tiers, unread in ((["device"] * 8, params), (["ssd"] * 8, 10**6)):
        whole, held = (predict(dataclasses.replace(weighty(), masters_in_weights=m), tiers, weight_tiers=weight_tiers)
                       for m in (False, True))
        assert whole.ssd_s - held.ssd_s == pytest.approx(4 * unread / 2e9), weight_tiers
        assert whole.ssd_write_bytes == held.ssd_write_bytes, "the new master is written as before"


def test_nothing_fits_is_a_plan_error_naming_the_tier_and_the_weights():
    with pytest.raises(PlanError, match=r"does not fit: device needs .* more \(.*weights 8 ssd"):
        solve(weighty(device=300 * MiB, host=0), weight_tiers=WEIGHT_TIERS)
    with pytest.raises(ValueError, match=r"weight_tiers: got \['gpu'\]"):
        solve(weighty(), weight_tiers=["gpu"])


# -- plans ------------------------------------------------------------------------------------------------------
def test_plan_json_round_trip_with_weight_tiers_and_old_plans_without_them(tmp_path):
    plan = solve(weighty(device=1200 * MiB, host=10 * GiB), weight_tiers=WEIGHT_TIERS)
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    table = plan.table()
    assert "weights" in table.splitlines()[0] and " host " in table and "weights: " in table
    old = dataclasses.asdict(plan)
    del old["weight_tiers"]  # a plan file written before weight tiers were planned
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Plan.load(tmp_path / "old.json").weight_tiers == ["device"] * 8
    bad = dict(old, weight_tiers=["device"] * 7 + ["gpu"])
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(PlanError, match=r"weight_tiers\[7\]: got 'gpu' \(str\); expected one of \['device', 'host', "
                                        r"'ssd'\]"):
        Plan.load(tmp_path / "bad.json")
    (tmp_path / "short.json").write_text(json.dumps(dict(old, weight_tiers=["device"])))
    with pytest.raises(PlanError, match="policies has 8 entries but weight_tiers has 1"):
        Plan.load(tmp_path / "short.json")


def test_config_weights_auto_needs_the_planner_or_a_plan(tmp_path):
    assert FuyouConfig(weights="auto", activations="auto").weights == "auto"
    with pytest.raises(ConfigError, match=r"weights: got 'auto' with activations='ssd' and no plan; .*activations='auto'"):
        FuyouConfig(weights="auto", activations="ssd")
    path = tmp_path / "plan.json"
    fixed_plan(weighty(n=2), ["keep", "ssd"], weight_tiers=["ssd", "device"]).save(path)
    for weights in ("auto", "device"):
        assert FuyouConfig(weights=weights, plan=str(path)).plan == str(path)
    with pytest.raises(ConfigError, match=r"weights: got 'host', but the plan .* chooses the weight tiers \{0: 'ssd'\}"):
        resolve(FuyouConfig(weights="host", plan=str(path)))
    fixed_plan(weighty(n=2), ["keep", "ssd"]).save(path)  # every block's weights on the device
    assert FuyouConfig(weights="host", plan=str(path)).weights == "host"


# -- in training ----------------------------------------------------------------------------------------------------
def run(model, config, steps):
    """``steps`` engine steps on a fixed batch schedule; the engine (open: the caller closes it) and the losses."""
    engine = engine_for(model, config)
    try:
        return engine, [loss.item() for loss in run_steps(engine, model, steps)]
    except BaseException:
        engine.close()
        raise


def losses_of(model, config, steps):
    engine, losses = run(model, config, steps)
    engine.close()
    return losses


def auto(tmp_path, **fields):
    return FuyouConfig(swap_dirs=[str(tmp_path)], activations="auto", weights="auto", planner_warmup_steps=2,
                       weight_prefetch_blocks=0, chunk_size="8KiB", host_memory_budget="4MiB",
                       activation_min_bytes=0, **fields)


def test_auto_streams_the_frozen_base_when_the_device_budget_is_small_and_changes_no_number(tmp_path):
    engine, reference = run(lora_model(), auto(tmp_path), steps=5)  # no device budget on the CPU: all resident
    roomy = engine.plan
    engine.close()
    assert roomy.weight_tiers == ["device", "device"] and engine.streamer is None, "weights fit: nothing streams"
    profile = roomy.profile
    assert all(b["weight_bytes"] > b["frozen_weight_bytes"] > 0 for b in profile["blocks"]), "LoRA: mostly frozen"
    # Below what any activation policy reaches with every weight resident, above the all-streamed minimum.
    measured = Profile.from_dict(profile)
    lowest = {tiers: min(predict(measured, [p] * 2, weight_tiers=[tiers] * 2).device_peak for p in (Policy.RECOMPUTE,
                                                                                                     Policy.SSD))
              for tiers in ("device", "ssd")}
    assert lowest["ssd"] < lowest["device"]
    budget = (lowest["ssd"] + lowest["device"]) // 2

    model = lora_model()
    base = frozen(model)
    engine, losses = run(model, auto(tmp_path, device_memory_budget=budget), steps=5)
    try:
        plan = engine.plan
        measured = Profile.from_dict(plan.profile)
        assert plan.weights and set(plan.weights.values()) == {"ssd"} and plan.device_peak <= budget
        assert engine.streamer is not None and engine.streamer.weights == plan.weights
        summary = engine.summary()
        assert summary["weight_tiers"] == plan.weights and summary["weight_bytes_streamed"] > 0
        # The prediction includes reading the streamed blocks at the measured SSD and copy bandwidths.
        assert summary["plan_predicted_step_seconds"] == plan.predicted_step_s > predict(
            measured, [Policy(p) for p in plan.policies], weight_tiers=["device", "device"]).step_s
        assert plan.profile["ssd_read_bytes_per_s"] > 0
        assert all(b["weight_tier"] == "device" for b in plan.profile["blocks"]), \
            "the profile is measured with the weights resident; the plan's tiers are the solver's"
    finally:
        engine.close()
    assert losses == reference, "streaming the frozen base changes no number"
    for name, p in base.items():
        assert torch.equal(dict(model.named_parameters())[name], p), name


def roomy_full_fine_tune(tmp_path):
    """A full fine-tune of the tiny GPT-2 planned with no device budget: the model after 5 steps, their losses, and
    the device peaks its plan would reach with every weight resident and with every block streamed."""
    resident_model = tiny_causal_lm("gpt2")
    engine, reference = run(resident_model, auto(tmp_path), steps=5)
    roomy = Profile.from_dict(engine.plan.profile)
    engine.close()
    assert all(b.frozen_weight_bytes == 0 < b.weight_bytes for b in roomy.blocks), "every weight trainable"
    # Weights and gradients resident, with the least activations: over; every block streamed: fits.
    resident, streamed = (predict(roomy, [Policy.RECOMPUTE] * 2, weight_tiers=[tier] * 2).device_peak
                          for tier in ("device", "ssd"))
    assert streamed < resident
    return resident_model, reference, resident, streamed


def streams_the_full_fine_tune_exactly(config, resident_model, reference, **engine_arguments):
    """5 steps of a fresh tiny GPT-2 with ``config``: its plan streams every block's trainable weights from the
    SSD, and the losses and the weights are bitwise those of ``resident_model``'s run. The engine, closed."""
    model = tiny_causal_lm("gpt2")
    engine = engine_for(model, config, **engine_arguments)
    try:
        losses = [loss.item() for loss in run_steps(engine, model, 5)]
        plan = engine.plan
        assert set(plan.weights.values()) == {"ssd"} and engine.summary()["weight_tiers"] == plan.weights
        assert engine.streamer.stats.trainable_bytes > 0, "the trainable weights are streamed"
    finally:
        engine.close()
    assert losses == reference, "streaming the trainable weights changes no number"
    for (name, p), (_, q) in zip(resident_model.named_parameters(), model.named_parameters()):
        assert torch.equal(p, q), name
    return engine


def test_auto_streams_a_full_fine_tune_when_its_weights_do_not_fit(tmp_path):
    resident_model, reference, resident, streamed = roomy_full_fine_tune(tmp_path)
    streams_the_full_fine_tune_exactly(auto(tmp_path, device_memory_budget=(streamed + resident) // 2),
                                       resident_model, reference)


def streamed_after_a_warm_up(tmp_path, monkeypatch, counted, **fields):
    """A tiny GPT-2 (fp32 on the CPU, fused AdamW, ``fields`` set) run 5 steps twice: resident, and under a device
    budget whose plan streams every block after the warm-up. Asserts the plan streamed every block and that the
    second run is the first's, losses and weights bit for bit, and that no streamed parameter holds its master
    (`OptimizerState.param_holds`). Returns ``counted(state)`` as the engine was about to stream the weights (each
    time it healed the masters; `OptimizerControl.heal_masters`)."""
    _resident_model, _reference, resident, streamed = roomy_full_fine_tune(tmp_path)
    seen = []
    real = OptimizerControl.heal_masters
    monkeypatch.setattr(OptimizerControl, "heal_masters", lambda self: seen.append(counted(self.state)) or real(self))
    runs = {}
    for name, budget in (("resident", None), ("streamed", (streamed + resident) // 2)):
        model = tiny_causal_lm("gpt2")
        (tmp_path / name).mkdir()
        engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), config=auto(
            tmp_path / name, **fields, **({"device_memory_budget": budget} if budget else {})))
        try:
            runs[name] = [loss.item() for loss in run_steps(engine, model, 5)], model, engine.plan
            state = engine.optimizer.control.state
            assert not state.param_holds & {ps.index for ps in state.owned if ps.grads is not None}, \
                "no streamed parameter holds its master"
        finally:
            engine.close()
    (losses, model, plan), (ref_losses, ref_model, _) = runs["streamed"], runs["resident"]
    assert set(plan.weights.values()) == {"ssd"} and seen, (plan.weights, seen)
    assert losses == ref_losses
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
    return seen


def test_weights_streamed_after_a_warm_up_that_kept_their_masters_in_them_change_no_number(tmp_path, monkeypatch):
    """fp32 on the CPU, fused AdamW, ``next_forward`` pinned, the state in RAM: the warm-up's updates keep each new
    master in its parameter only (`OptimizerState.masters_behind`); the plan then streams every block's weights,
    read from those masters, which go into their chunks first. The run is the resident one's, bit for bit."""
    # parameters whose chunks' masters were older as the engine was about to stream the weights
    behind = streamed_after_a_warm_up(tmp_path, monkeypatch, lambda state: len(state.masters_behind),
                                      optimizer_schedule="next_forward")
    assert behind[-1] > 0, behind


@pytest.mark.parametrize("schedule", ["next_forward", "backward"])
def test_weights_streamed_after_a_warm_up_whose_parameters_held_their_masters_read_them_from_the_ssd(
        tmp_path, monkeypatch, schedule):
    """fp32 on the CPU, fused AdamW, the state on the SSD (``host_state=0``): the warm-up's updates leave each
    parameter holding its master (`OptimizerState.param_holds`: an update reads only the moments from the SSD).
    The plan then streams every block's weights, whose parameters' memory the streamer frees: their updates read
    the masters from the SSD again (`OptimizerState.stream`), and the run is the resident one's, bit for bit.
    (Reading the freed parameter failed every update after the plan.)"""
    # parameters holding their masters, and the state in RAM, as the engine was about to stream the weights
    seen = streamed_after_a_warm_up(tmp_path, monkeypatch,
                                    lambda state: (len(state.param_holds), state.store.bytes_in_memory),
                                    optimizer_schedule=schedule, host_state=0)
    assert seen[-1][0] > 0 and seen[-1][1] == 0, seen


@pytest.mark.parametrize("device_state", [120_000, 4 * MiB], ids=["some", "all"])
def test_a_streamed_blocks_state_leaves_the_device_tier_to_the_next_parameters_and_the_host_tier_takes_its_share(
        tmp_path, device_state):
    """The device tier holds the first parameters' state that fits (``device_state``: some, or all of it), a block's
    among them; the plan then streams every block. Their state leaves the device (their weights and gradients do),
    and the room it leaves goes to the next resident parameters in order (`OptimizerState.stream`, then
    `hold_on_device`): the placement the planner predicts (`planner.cost._state_on_device`). The host tier
    (``host_state="auto"``) takes what the plan leaves it of the rest; the summary and the config say what each tier
    took; nothing changes a number. (The state once left the device for the SSD whatever room the tiers had, and the
    report of the host tier's share came before it moved.)"""
    _resident_model, _reference, resident, streamed = roomy_full_fine_tune(tmp_path)
    state_bytes = lambda ps: TensorStore.footprint(ps.nbytes, ps.stride, 2)  # noqa: E731
    runs, total = {}, 0
    for name in ("resident", "streamed"):
        # the device's budget: what streams every block, beside the state's device tier (``total``: all of it)
        fields = {} if name == "resident" else dict(
            device_state=device_state, device_memory_budget=(streamed + resident) // 2 + min(device_state, total))
        model = tiny_causal_lm("gpt2")
        (tmp_path / name).mkdir()
        said = []
        engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
                             config=auto(tmp_path / name, **fields), report=said.append)
        state = engine.optimizer.control.state
        try:
            if name == "streamed":
                block = {i for i, (n, _p) in enumerate(model.named_parameters()) if ".h." in n}
                assert block & state.on_device, "a block's state starts on the device tier"
            runs[name] = [loss.item() for loss in run_steps(engine, model, 5)]
            if name == "resident":
                total = sum(state_bytes(ps) for ps in state.owned)
                continue
            assert set(engine.plan.weights.values()) == {"ssd"}
            streamed_ = {ps.index for ps in state.owned if ps.grads is not None}
            assert streamed_ and not streamed_ & state.on_device, "no streamed parameter's state on the device"
            store = state.store
            # The device tier full, in order: a resident parameter left off it does not fit; nor does one on the SSD
            # in the host tier. (Sizes as numbers: pytest's report of an expression holding a streamed parameter
            # would print its freed memory.)
            off_device = [(state_bytes(ps), ps.describe()) for ps in state.owned
                          if ps.index not in streamed_ and ps.index not in state.on_device]
            on_ssd = [(state_bytes(ps), ps.describe()) for ps in state.owned
                      if ps.index not in state.on_device and ps.index not in state.in_memory]
            device_room = store.device_limit - store.bytes_on_device
            ram_room = engine.plan.state_in_ram - store.bytes_in_memory
            assert all(need > device_room for need, _what in off_device), (off_device, device_room)
            assert all(need > ram_room for need, _what in on_ssd), (on_ssd, ram_room)
            assert max(state.on_device) > max(block), "a parameter after the blocks took their room"
            summary = engine.summary()
            assert summary["device_bytes_optimizer_state"] == store.bytes_on_device > 0
            assert summary["host_bytes_optimizer_state"] == store.bytes_in_memory == engine.config.host_state > 0
            assert store.bytes_in_memory <= engine.plan.state_in_ram
            line = [m for m in said if m.startswith("fuyou planner: host_state='auto'") and "the rest on" in m]
            assert line and line[-1].startswith(
                f"fuyou planner: host_state='auto': {format_bytes(store.bytes_in_memory)} of"), said
        finally:
            engine.close()
    assert runs["streamed"] == runs["resident"]


def test_a_run_whose_plan_streams_blocks_beside_a_device_tier_resumes_from_its_checkpoint_exactly(tmp_path):
    """HF Trainer with ``FuyouCallback``, fused AdamW, some state on the device tier and the rest on the SSD: the plan
    streams every block after the warm-up (their state leaves the device tier, `OptimizerState.stream`), a checkpoint
    is taken at step 5, and a run resumed from it in a fresh model reaches the uninterrupted run's weights bit for
    bit (its own warm-up plans again: streaming and the device tier from the checkpoint's state)."""
    from test_hf import swap_config, train as hf_train

    from fuyou_strategy import FuyouCallback

    _resident_model, _reference, resident, streamed = roomy_full_fine_tune(tmp_path)
    fields = swap_config(tmp_path, activations="auto", weights="auto", planner_warmup_steps=2,
                         weight_prefetch_blocks=0, host_memory_budget="4MiB", activation_min_bytes=0,
                         device_state=40_000, host_state=0, device_memory_budget=(streamed + resident) // 2 + 40_000)
    run = dict(steps=8, optim="adamw_torch_fused")
    uninterrupted, _ = hf_train(tmp_path / "a", FuyouCallback(**fields), **run)
    saving = FuyouCallback(**fields)
    hf_train(tmp_path / "b", saving, save_strategy="steps", save_steps=5, **run)
    assert set(saving.summary["weight_tiers"].values()) == {"ssd"} and saving.summary["device_bytes_optimizer_state"]
    resuming = FuyouCallback(**fields)
    resumed, _ = hf_train(tmp_path / "b", resuming, model=tiny_causal_lm("gpt2", seed=1),
                          resume=str(tmp_path / "b" / "out" / "checkpoint-5"), **run)
    assert resuming.summary["optimizer_steps"] == 8 and resuming.summary["weight_tiers"]
    for (name, p), q in zip(uninterrupted.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_left_unset_activations_and_weights_go_to_the_planner_when_the_device_budget_is_tight(tmp_path):
    """Issue 27, defaults that fit the machine: ``activations`` and ``weights`` left unset plan nothing on the CPU
    without a device budget (every tier is host RAM: the run is the plain one, said once with the reason); with a
    ``device_memory_budget`` the resident weights do not fit, the planner runs as ``activations="auto",
    weights="auto"`` would, streams them and changes no number."""
    resident_model, reference, resident, streamed = roomy_full_fine_tune(tmp_path)
    fields = dict(swap_dirs=[str(tmp_path)], planner_warmup_steps=2, weight_prefetch_blocks=0, chunk_size="8KiB",
                  host_memory_budget="4MiB", activation_min_bytes=0)
    said = []
    model = tiny_causal_lm("gpt2")
    engine = engine_for(model, FuyouConfig(**fields), report=said.append)
    try:
        losses = [loss.item() for loss in run_steps(engine, model, 5)]
        assert engine.config.activations == "keep" and engine.config.weights == "device"
        assert engine.plan is None and engine.profiler is None and engine.streamer is None, "nothing planned"
    finally:
        engine.close()
    assert losses == reference
    # one line says the choice; its reason is in summary()["choices"] (and at DEBUG)
    assert [m for m in said if m.startswith("fuyou: chose ") and "activations='keep'" in m], said
    value, why = engine.choices["activations"]
    assert value == "keep" and why.startswith("the device is cpu with no device_memory_budget"), why
    budget = (streamed + resident) // 2
    said.clear()
    engine = streams_the_full_fine_tune_exactly(FuyouConfig(**fields, device_memory_budget=budget), resident_model,
                                                reference, report=said.append)
    assert engine.config.activations == "auto" and engine.config.weights == "auto"
    assert engine.plan.device_peak <= budget
    assert [m for m in said if m.startswith("fuyou: chose ") and "activations='auto', weights='auto'" in m], said
    assert engine.choices["activations"][1].startswith("a device_memory_budget of")
    assert engine.choices["weights"][1].startswith("the planner places")


def test_auto_that_cannot_fit_is_a_config_error_naming_both_fields(tmp_path):
    with pytest.raises(ConfigError, match=r"activations='auto', weights='auto': does not fit: device needs"):
        run(lora_model(), auto(tmp_path, device_memory_budget="16KiB"), steps=3)
    assert not any(p.name.startswith("fuyou-run") for p in tmp_path.iterdir())


def test_a_pinned_plan_with_weight_tiers_streams_from_the_first_step(tmp_path):
    path = tmp_path / "plan.json"
    fixed_plan(weighty(n=2), ["keep", "recompute"], weight_tiers=["ssd", "device"]).save(path)
    reference = losses_of(lora_model(), FuyouConfig(swap_dirs=[str(tmp_path)]), steps=2)
    engine, losses = run(lora_model(), FuyouConfig(swap_dirs=[str(tmp_path)], plan=str(path), chunk_size="8KiB",
                                                  host_memory_budget="4MiB"), steps=2)
    try:
        assert engine.streamer.stats.tiers == {0: "ssd"} and engine.summary()["weight_bytes_streamed"] > 0
        assert engine.swapper.policies == [Policy.KEEP, Policy.RECOMPUTE]
    finally:
        engine.close()
    assert losses == reference



class _Profiled:
    """Stands in for the warm-up's profiler at its end (`FuyouEngine._plan_from_warmup`): ``profile`` measured."""

    def __init__(self, profile):
        self.steps, self.device, self._profile = 2, torch.device("cpu"), profile

    def remove(self):
        pass

    def profile(self):
        return self._profile


def test_the_warm_up_names_one_slot_of_state_where_it_is_faster_or_fits_where_two_do_not(tmp_path):
    """At the end of the warm-up the engine solves its profile again with one slot of state
    (``FuyouConfig(state_slots=1)``, `planner.one_slot`): a line after the plan names it where its predicted step is
    under `ONE_SLOT_HINT` of two slots' (here over 2x faster: one slot's state fits the host tier, two slots' spill
    to a slow drive), nothing where it is not, and where two slots do not fit the drive and one does, the plan's
    `ConfigError` says so with one slot's predicted step; ``state_slots="auto"`` takes one slot there."""
    said = []
    cases = {"faster": synthetic(host_state=120 * MiB, ssd_bw=2e7), "as fast": synthetic(host_state=120 * MiB),
             "drive": synthetic(host_state=0, ssd=150 * MiB)}
    for name, profile in cases.items():
        said.clear()
        (tmp_path / name).mkdir()
        engine = engine_for(lora_model(), FuyouConfig(swap_dirs=[str(tmp_path / name)], activations="auto",
                                                      weights="device"), report=said.append)
        one = one_slot(profile).predicted_step_s
        try:
            engine.profiler.remove()
            engine.profiler = _Profiled(profile)
            if name == "drive":
                with pytest.raises(ConfigError, match=r"activations='auto': does not fit: ssd needs .*\. With one slot "
                                                      r"of state it fits: FuyouConfig\(state_slots=1\) holds half the "
                                                      rf"optimizer state.*\(predicted {one:.3f} s/step\)"):
                    engine._plan_from_warmup()
                continue
            engine._plan_from_warmup()
        finally:
            engine.close()
        named = [m for m in said if "one slot" in m]
        if name == "faster":
            faster = solve(profile).predicted_step_s / one
            assert faster > 2 and named == [
                f"fuyou planner: with one slot of state, FuyouConfig(state_slots=1), the predicted step is {one:.3f} s, "
                f"{faster:.2f}x faster: half the optimizer state in every tier, each update landing before its "
                "block's next forward instead of during backward (state_slots='auto' takes it)"], said
        else:
            assert not named and any(m.startswith("fuyou planner: plan") for m in said), said
    (tmp_path / "auto").mkdir()  # state_slots="auto" takes one slot where two do not fit: no error
    engine = engine_for(lora_model(), FuyouConfig(swap_dirs=[str(tmp_path / "auto")], activations="auto",
                                                  weights="device", state_slots="auto"), report=said.append)
    try:
        engine.profiler.remove()
        engine.profiler = _Profiled(cases["drive"])
        engine._plan_from_warmup()
        assert engine.plan.profile["state_slots"] == 1 and engine.optimizer.control.state_slots == 1
        assert engine.choices["state_slots"][1].startswith("two slots do not fit and one does")
    finally:
        engine.close()


def test_a_drive_its_own_swap_files_filled_still_holds_the_plan_and_one_slot_trains_as_torch(tmp_path, monkeypatch):
    """The plan's drive budget is its free space and what the run's swap files hold already: a warm-up whose
    state filled the drive to the last byte still plans with that state there. A run with one slot of state
    (``state_slots=1``, what the planner names where two do not fit) plans and trains as torch does."""
    import types
    import fuyou_strategy.planner.profile as profile_module

    def config(folder, **fields):
        (tmp_path / folder).mkdir()
        return FuyouConfig(swap_dirs=[str(tmp_path / folder)], activations="auto", planner_warmup_steps=2,
                           chunk_size="8KiB", host_state=0, activation_min_bytes=0, **fields)

    reference = losses_of(lora_model(), FuyouConfig(swap_dirs=[str(tmp_path)]), steps=4)
    monkeypatch.setattr(profile_module, "shutil", types.SimpleNamespace(  # the drive full once the warm-up began
        disk_usage=lambda _path: types.SimpleNamespace(free=0)))
    for slots in (2, 1):
        engine, losses = run(lora_model(), config(f"slots{slots}", state_slots=slots), steps=4)
        try:
            on_drive = engine.optimizer.control.figures().state_ssd_bytes
            assert engine.plan is not None and engine.plan.ssd_peak >= on_drive > 0
            assert engine.plan.budgets["ssd"] == engine.memory.store.bytes_on_disk
        finally:
            engine.close()
        assert losses == reference


def test_state_slots_auto_takes_one_slot_where_the_plan_names_it_and_resumes_into_two(tmp_path):
    """``state_slots="auto"``: where the warm-up's plan with one slot is predicted faster (a synthetic profile's,
    over 2x), the engine keeps one slot from then on: every state entry drops its shadow slot (half the state's bytes
    on the drive), no update is speculative, and summary()['choices'] says why. Training goes on as the default run's
    (torch's bits), and a save made after the switch resumes into an optimizer of two slots as the run goes on."""
    def config(folder, **fields):
        (tmp_path / folder).mkdir()
        return FuyouConfig(swap_dirs=[str(tmp_path / folder)], chunk_size="8KiB", host_state=0, **fields)

    def steps(engine, model, which):
        return [loss.item() for loss in run_steps(engine, model, len(which), start=which.start)]

    reference = losses_of(lora_model(), FuyouConfig(swap_dirs=[str(tmp_path)]), steps=6)
    said, model = [], lora_model()
    engine = engine_for(model, config("auto", state_slots="auto", activations="auto", weights="device",
                                      planner_warmup_steps=2), report=said.append)
    try:
        engine.profiler.profile = lambda: synthetic(host_state=120 * MiB, ssd_bw=2e7)  # what the warm-up measured
        losses = steps(engine, model, range(1))
        control = engine.optimizer.control
        two = control.figures().state_ssd_bytes
        assert control.state_slots == 2 and control.can_speculate and engine.config.state_slots == "auto"
        losses += steps(engine, model, range(1, 4))  # the warm-up ends at the second step
        assert engine.config.state_slots == 1 and control.state_slots == 1 and not control.can_speculate
        assert all(engine.memory.store.entry(ps.entry).slots == 1 for ps in control.state.owned)
        assert control.figures().state_ssd_bytes == two // 2
        value, why = engine.choices["state_slots"]
        assert value == 1 and why.startswith("the plan with one slot is predicted 2."), why
        assert [m for m in said if m.startswith("fuyou planner: state_slots='auto' took 1: ")], said
        assert [s for s, _outcome in engine.optimizer.stats.history] == ["backward"] * 2 + ["next_forward"] * 2
        engine.save(str(tmp_path / "save"))
        losses += steps(engine, model, range(4, 6))
    finally:
        engine.close()
    assert losses == reference
    model = lora_model()
    engine = engine_for(model, config("two"))
    try:
        engine.load(str(tmp_path / "save"))
        assert engine.optimizer.control.state_slots == 2
        assert steps(engine, model, range(4, 6)) == losses[4:]
    finally:
        engine.close()


def test_one_slot_is_solved_on_the_next_forward_windows_timings_where_the_warm_up_measured_them():
    """`with_one_slot` takes `Profile.next_forward_timings` (what the warm-up's ``next_forward`` windows measured:
    compute and update rate without speculative updates beside backward) in place of the profile's own figures, and
    the profile's without them; the plan with two slots keeps its own; a plan file keeps them (`Profile.to_dict`)."""
    profile = synthetic(host_state=120 * MiB)
    timed = Timings(fwd_s=[0.05] * 8, bwd_s=[0.1] * 8, other_fwd_s=0.02, other_bwd_s=0.04, adam_params_per_s=2e9)
    measured = dataclasses.replace(profile, next_forward_timings=timed)
    one = with_one_slot(measured)
    assert [b.fwd_s for b in one.blocks] == timed.fwd_s and [b.bwd_s for b in one.blocks] == timed.bwd_s
    assert (one.other_fwd_s, one.other_bwd_s, one.adam_params_per_s) == (0.02, 0.04, 2e9)
    assert [dataclasses.replace(b, fwd_s=0.1, bwd_s=0.2) for b in one.blocks] == profile.blocks
    assert with_one_slot(profile).blocks == profile.blocks and with_one_slot(profile).adam_params_per_s == 1e9
    assert one_slot(measured).predicted_step_s < one_slot(profile).predicted_step_s
    assert solve(measured).predicted_step_s == solve(profile).predicted_step_s
    assert Profile.from_dict(json.loads(json.dumps(measured.to_dict()))) == measured


def test_state_slots_auto_times_two_next_forward_windows_after_speculative_ones(tmp_path):
    """``state_slots="auto"``: where the warm-up's steps speculated, two more windows run ``next_forward`` (the first
    a transition) before the plan, and the second's compute and update rate are the profile's
    `next_forward_timings`, what the plan with one slot is solved on; the figures of the first steps leave them
    out. A run of two slots, and one whose state stays in RAM on the CPU (never speculating), take no more steps.
    None changes a number."""
    def config(folder, **fields):
        (tmp_path / folder).mkdir()
        return FuyouConfig(swap_dirs=[str(tmp_path / folder)], chunk_size="8KiB", activations="auto",
                           weights="device", planner_warmup_steps=2, **fields)

    reference = losses_of(lora_model(), FuyouConfig(swap_dirs=[str(tmp_path)]), steps=5)
    runs = {"auto": ({"state_slots": "auto", "host_state": 0}, ["backward"] * 2 + ["next_forward"] * 2),
            "two": ({"state_slots": 2, "host_state": 0}, ["backward"] * 2),
            "in RAM": ({"state_slots": "auto"}, ["next_forward"] * 2)}
    for name, (fields, warm_up) in runs.items():
        said, model, profiles = [], lora_model(), []
        engine = engine_for(model, config(name, **fields), report=said.append)
        profiler = engine.profiler
        measure = profiler.profile
        profiler.profile = lambda: profiles.append(measure()) or profiles[-1]
        try:
            losses = []
            for step in range(5):
                losses += [loss.item() for loss in run_steps(engine, model, 1, start=step)]
                assert (engine.profiler is None) == (step + 1 >= len(warm_up)), (name, step)
            history = [schedule for schedule, _outcome in engine.optimizer.stats.history]
        finally:
            engine.close()
        assert history[:len(warm_up)] == warm_up, name
        assert losses == reference, name
        (profile,) = profiles
        assert profile.host_compute, "the model computes on the CPU"
        assert len(profile.notes["measured_step_s"]) == 1, "the first steps' figures: the second step's"
        recorded = {r["step"]: r for r in profiler._micro}  # one micro-batch a step: its figures are the medians
        assert [b.fwd_s for b in profile.blocks] == recorded[1]["fwd"]
        timed = profile.next_forward_timings
        if name != "auto":
            assert timed is None and "next_forward_step_s" not in profile.notes
            assert not [m for m in said if "more under next_forward" in m], said
            continue
        assert len(profile.notes["next_forward_step_s"]) == 1
        assert len(timed.fwd_s) == len(timed.bwd_s) == len(profile.blocks) and timed.fwd_s == recorded[3]["fwd"]
        assert all(t > 0 for t in timed.fwd_s + timed.bwd_s[1:]) and timed.adam_params_per_s > 0
        assert "fuyou planner: warm-up step 2/4 profiled; 2 more under next_forward, to time a run that never " \
               "speculates (state_slots='auto')" in said


def test_on_the_cpu_one_slot_is_worth_it_where_it_holds_the_whole_state_in_ram_and_two_do_not():
    """Where the model computes on the CPU (`Profile.host_compute`) its updates share the compute's cores, which the
    cost model does not see: one slot is worth naming (`worth_one_slot`) where it holds the whole optimizer state off
    the SSD and two slots leave some there, unless it is predicted slower than two's step over 1/`ONE_SLOT_HINT`
    times. On an accelerator, or where two slots hold it all too, only the predicted step counts."""
    cpu = synthetic(host_state=120 * MiB, host_compute=True)  # one slot's state (108 MB) fits, two slots' do not
    two, one = solve(cpu), one_slot(cpu)
    assert one.state_on_ssd == 0 < two.state_on_ssd
    assert two.state_on_ssd == math.ceil(cpu.params * 2 * cpu.state_bytes) - two.state_in_ram
    assert one.predicted_step_s >= ONE_SLOT_HINT * two.predicted_step_s, "not named for its predicted step"
    assert worth_one_slot(two, one)
    accelerator = dataclasses.replace(cpu, host_compute=False)
    assert not worth_one_slot(solve(accelerator), one_slot(accelerator))
    roomy = dataclasses.replace(cpu, host_state=None)  # no host budget: both hold all of it in RAM
    assert solve(roomy).state_on_ssd == 0 and not worth_one_slot(solve(roomy), one_slot(roomy))
    split = dataclasses.replace(cpu, host_state=48 * MiB, device_state=72 * MiB)  # the device tier holds some
    two, one = solve(split), one_slot(split)
    assert two.state_on_device > 0 and two.state_in_ram > 0 and one.state_on_ssd == 0 and worth_one_slot(two, one)
    assert two.state_on_ssd == math.ceil(split.params * 2 * split.state_bytes) - two.state_in_ram - two.state_on_device
    limit = two.predicted_step_s / ONE_SLOT_HINT
    assert worth_one_slot(two, dataclasses.replace(one, predicted_step_s=limit * 0.99))
    assert not worth_one_slot(two, dataclasses.replace(one, predicted_step_s=limit * 1.01))


def test_on_the_cpu_the_warm_up_names_one_slot_that_holds_the_state_in_ram_and_auto_takes_it(tmp_path):
    """A warm-up on the CPU whose plan with one slot holds the whole state in RAM, where two slots leave some on the
    SSD, names one slot after the plan, saying why, with both predicted steps; ``state_slots="auto"`` takes it and
    ``summary()["choices"]`` says why."""
    profile = synthetic(host_state=120 * MiB, host_compute=True)
    two, one = solve(profile), one_slot(profile)
    why = ("the model computes on the CPU, whose cores its updates share, and one slot holds the whole optimizer state "
           f"in host RAM, where two slots leave {format_bytes(two.state_on_ssd)} on the SSD")
    for slots in (2, "auto"):
        said = []
        (tmp_path / str(slots)).mkdir()
        engine = engine_for(lora_model(), FuyouConfig(swap_dirs=[str(tmp_path / str(slots))], activations="auto",
                                                      weights="device", state_slots=slots), report=said.append)
        try:
            engine.profiler.remove()
            engine.profiler = _Profiled(profile)
            engine._plan_from_warmup()
            if slots == 2:
                assert engine.optimizer.control.state_slots == 2 and [m for m in said if "one slot" in m] == [
                    f"fuyou planner: with one slot of state, FuyouConfig(state_slots=1), {why} (predicted "
                    f"{one.predicted_step_s:.3f} s against {two.predicted_step_s:.3f} s): half the optimizer state "
                    "in every tier, each update landing before its block's next forward instead of during backward "
                    "(state_slots='auto' takes it)"], said
            else:
                assert engine.optimizer.control.state_slots == 1 and engine.plan.state_on_ssd == 0
                assert engine.choices["state_slots"][1].startswith(f"{why}; the state's shadow slots freed"), \
                    engine.choices["state_slots"]
        finally:
            engine.close()
