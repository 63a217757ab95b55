"""The optimizer state's device tier in the planner (``FuyouConfig.device_state``): the cost model counts it in the
device peak, updates it on the compute device with no SSD traffic and no CPU time, fills it first in the optimizer's
order (the rest of the model, then block 0, 1, ...) before the host tier; ``device_state=None`` takes what the device
budget leaves; 0 changes no prediction; plans carry it; ``fuyou plan`` prints it against torch's step."""

import dataclasses
import json
import types

import pytest
import torch

from fuyou_strategy.cli import main as fuyou
from fuyou_strategy.planner import MODEL_PRESETS, Plan, PlanError, predict, solve
from fuyou_strategy.planner import profile as profile_module
from test_planner import H, K, R, S, MiB, synthetic

PER_PARAM = 2 * 12  # bytes of state per parameter: two slots of fp32 master and moments (synthetic's profiles)


def tasks(prediction):
    """The timeline as ``{name: (resource, start, end)}``."""
    return {name: (resource, start, end) for resource, name, start, end in prediction.timeline}


# -- the cost model ----------------------------------------------------------------------------------------------
def test_the_device_tier_counts_in_the_device_peak_and_not_on_the_ssd():
    base = synthetic(n=4)  # 5 x 10**6 parameters: the rest and 4 blocks
    room = 30 * 10**6 + 5  # a block and a quarter of state, and 5 bytes: whole parameters only
    ref, dev = predict(base, [K] * 4), predict(dataclasses.replace(base, device_state=room), [K] * 4)
    assert ref.state_on_device == 0 and dev.state_on_device == room // PER_PARAM * PER_PARAM
    assert dev.device_peak == ref.device_peak + dev.state_on_device
    assert dev.ssd_peak == ref.ssd_peak - dev.state_on_device and dev.host_peak == ref.host_peak
    assert dev.ssd_write_bytes == ref.ssd_write_bytes - dev.state_on_device // 2, "one slot written per step"
    # a device_state given in bytes counts whatever the budget: over it, the prediction says by how much
    tight = dataclasses.replace(base, device_state=room, device_budget=ref.device_peak + 10**6)
    assert predict(tight, [K] * 4).over == {"device": dev.state_on_device - 10**6}


def test_a_device_tier_update_runs_on_the_device_after_its_gradients_with_no_cpu_ssd_or_link_time():
    profile = synthetic(n=4, weight_upload_bytes_per_param=2.0)  # a host update uploads the weight
    ref = predict(profile, [K] * 4)
    assert ref.cpu_s > 0 and ref.ssd_s > 0 and ref.link_s > 0
    everything = dataclasses.replace(profile, device_state=10**12, device_adam_params_per_s=1e8)
    pred = predict(everything, [K] * 4, timeline=True)
    assert pred.state_on_device == profile.params * PER_PARAM
    assert (pred.cpu_s, pred.ssd_s, pred.link_s, pred.ssd_write_bytes) == (0, 0, 0, 0)
    assert pred.compute_s == pytest.approx(ref.compute_s + profile.params / 1e8)
    spans = tasks(pred)
    assert {resource for name, (resource, _s, _e) in spans.items() if "adamw" in name} == {"compute"}
    # block 3's update follows its backward at once, and block 2's backward waits for it: they share the device
    assert spans["adamw on device block 3"][1] == spans["backward 3"][2]
    assert spans["backward 2"][1] == spans["adamw on device block 3"][2]
    assert spans["adamw on device block 3"][2] - spans["adamw on device block 3"][1] == pytest.approx(1e6 / 1e8)
    # part of the state on the device: the CPU updates the rest only
    part = predict(dataclasses.replace(everything, device_state=PER_PARAM * 1_500_000), [K] * 4)
    assert part.cpu_s == pytest.approx(ref.cpu_s - 1_500_000 / profile.adam_params_per_s)


def test_the_device_tier_takes_the_first_parameters_and_the_host_tier_the_next():
    """The optimizer's order: the rest of the model (the embeddings, whose gradients come last), then block 0, 1, ...
    The device tier takes the first, the host tier the next of those the device left, the SSD the rest."""
    profile = synthetic(n=4, tail_read_ahead=False)  # every read of the state when its update runs: named per update
    both = dataclasses.replace(profile, device_state=PER_PARAM * 1_500_000, host_state=PER_PARAM * 1_000_000)
    pred = predict(both, [K] * 4, timeline=True)
    assert pred.state_on_device == PER_PARAM * 1_500_000 and pred.state_in_ram == PER_PARAM * 1_000_000
    spans = tasks(pred)
    on_device = {name.removeprefix("adamw on device ") for name in spans if name.startswith("adamw on device")}
    on_cpu = {name.removeprefix("adamw ") for name in spans if name.startswith("adamw ") and "device" not in name}
    read = {name.removeprefix("read state ") for name in spans if name.startswith("read state")}
    assert on_device == {"rest", "block 0"}, "the rest and half of block 0"
    assert on_cpu == {"block 0", "block 1", "block 2", "block 3"}
    assert read == {"block 1", "block 2", "block 3"}, "block 0's other half and half of block 1 in RAM"
    # the host tier without a budget takes all the device left
    rest_in_ram = predict(dataclasses.replace(both, host_state=None), [K] * 4)
    assert rest_in_ram.state_in_ram == profile.params * PER_PARAM - rest_in_ram.state_on_device
    assert rest_in_ram.ssd_peak == 0 and rest_in_ram.ssd_write_bytes == 0


def test_a_streamed_blocks_state_stays_off_the_device_tier_as_the_runtime_keeps_it():
    """`OptimizerState.leave_device`: a streamed parameter's weight and gradient leave the device, and so does its
    state; the model gives the device tier the resident parameters only, the host tier the rest."""
    base = synthetic(n=4)
    tiers = ["device", "host", "device", "ssd"]
    pred = predict(dataclasses.replace(base, device_state=10**12, host_state=0), [K] * 4, weight_tiers=tiers)
    resident = base.other_params + sum(b.params for b, t in zip(base.blocks, tiers) if t == "device")
    assert pred.state_on_device == resident * PER_PARAM < base.params * PER_PARAM


def test_auto_takes_what_the_device_budget_leaves_and_never_more():
    base = synthetic(n=4, act=10 * MiB)
    ref = predict(base, [K] * 4)
    total = base.params * PER_PARAM
    for spare in (0, 100, 24 * 10**6 + 7, 10**9):
        budget = ref.device_peak + spare
        pred = predict(dataclasses.replace(base, device_state=None, device_budget=budget), [K] * 4)
        assert pred.fits and pred.device_peak <= budget, spare
        assert pred.state_on_device == min(spare // PER_PARAM * PER_PARAM, total), spare
    assert predict(dataclasses.replace(base, device_state=None), [K] * 4).state_on_device == 0, "no budget: none"
    # The solver weighs activations against the state: on a slow drive, recomputing a block's forward (0.1 s) frees
    # room for 4 blocks' state, each 0.24 s of drive time a step.
    slow = synthetic(n=4, ssd_bw=1e8)  # 100 MiB of activations a block
    slow = dataclasses.replace(slow, device_state=None, device_budget=predict(slow, [K] * 4).device_peak)
    assert predict(slow, [K] * 4).state_on_device == 0
    plan = solve(slow)
    assert plan.device_peak <= slow.device_budget and plan.state_on_device > 0
    assert plan.policies != ["keep"] * 4
    assert plan.predicted_step_s < predict(slow, [K] * 4).step_s


# What the cost model predicted before the device tier (its commit's parent), for profiles that take each path
# through it: with device_state 0 (the default) every figure is the same, to the last bit.
BEFORE = {  # step_s, compute_s, link_s, ssd_s, cpu_s, device_peak, host_peak, ssd_peak, ssd_write_bytes, state_in_ram
    'host tier, budget': (3.3297232, 1.47097152, 0.02097152, 3.1713228800000004, 0.005, 629145600, 125829120,
                          212274688, 158566144, 12582912),
    'ssd-tier weights, next_forward': (1.4307286400000006, 1.3604857600000002, 0.0, 0.09145728000000002, 0.005,
                                       671088640, 20971520, 120000000, 60000000, 0),
    'upload, redo, after backward': (1.2910003199999995, 1.16048576, 0.012085760000000004, 0.20085760000000008, 0.008,
                                     419430400, 0, 200857600, 152857600, 0),
    'upload, redo, overlapped': (1.2361817279999998, 1.16048576, 0.012085760000000004, 0.16940032000000005, 0.008,
                                 419430400, 31457280, 169400320, 137128960, 31457280),
    'data parallel, micro-batches, host tier': (2.1294629760000006, 2.1268435456000008, 0.0226298112,
                                                0.25571520000000003, 0.004, 541065216, 16777216, 200857600, 257715200,
                                                0),
}
FIGURES = ("step_s", "compute_s", "link_s", "ssd_s", "cpu_s", "device_peak", "host_peak", "ssd_peak",
           "ssd_write_bytes", "state_in_ram")


def before_cases():
    return {
        "host tier, budget": (synthetic(n=4, ssd_bw=1e8, host=120 * MiB, optimizer_host_bytes=8 * MiB,
                                        host_state=None), [K, S, H, R], {}),
        "ssd-tier weights, next_forward": (synthetic(n=4, weight_bytes=10 * MiB, weight_tier="ssd",
                                                     weights_from_master=True), [K] * 4, {"schedule": "next_forward"}),
        "upload, redo, after backward": (synthetic(n=3, redo_fraction=0.3, weight_upload_bytes_per_param=2.0,
                                                   device=2000 * MiB), [K, R, S], {"overlap_optimizer": False}),
        "upload, redo, overlapped": (synthetic(n=3, redo_fraction=0.3, weight_upload_bytes_per_param=2.0,
                                               device=2000 * MiB, host_state=30 * MiB), [K, R, S], {}),
        "data parallel, micro-batches, host tier": (synthetic(n=3, data_parallel=2, micro_batches=2,
                                                              weight_bytes=4 * MiB, weight_tier="host",
                                                              masters_in_weights=True,
                                                              weight_upload_bytes_per_param=2.0), [S, K, K], {}),
    }


@pytest.mark.parametrize("case", list(BEFORE))
def test_no_device_tier_predicts_exactly_what_the_cost_model_did_before_it(case):
    profile, policies, options = before_cases()[case]
    assert profile.device_state == 0, "the default"
    variants = [profile, dataclasses.replace(profile, device_adam_params_per_s=1.0)]
    if profile.device_budget is None:
        variants.append(dataclasses.replace(profile, device_state=None))  # auto without a device budget: none
    for variant in variants:
        pred = predict(variant, policies, **options)
        assert tuple(getattr(pred, name) for name in FIGURES) == BEFORE[case]
        assert pred.state_on_device == 0


# -- plans ---------------------------------------------------------------------------------------------------------
def test_a_plan_carries_its_device_tier_through_its_file_and_older_files_load(tmp_path):
    base = synthetic(n=2, act=10 * MiB)
    budget = predict(base, [K, K]).device_peak + 5 * 10**7
    plan = solve(dataclasses.replace(base, device_state=None, device_budget=budget))
    assert plan.state_on_device == 5 * 10**7 // PER_PARAM * PER_PARAM  # of 72 MB
    assert any(line.startswith("optimizer state on the device: ") and "% of it" in line for line in plan.totals())
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path).state_on_device == plan.state_on_device
    older = json.loads(path.read_text())
    del older["state_on_device"]
    path.write_text(json.dumps(older))
    assert Plan.load(path).state_on_device == 0
    assert not any("on the device" in line for line in Plan.load(path).totals())
    path.write_text(json.dumps({**older, "state_on_device": "1GiB"}))
    with pytest.raises(PlanError, match=r"state_on_device: got '1GiB' \(str\); expected a byte count"):
        Plan.load(path)


# -- the warm-up's profile -----------------------------------------------------------------------------------------
def test_the_profile_takes_device_state_from_the_config_auto_being_nothing_on_the_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert profile_module.device_state_bytes("auto", cpu) == 0, "the CPU's device memory is host RAM"
    assert profile_module.device_state_bytes("auto", cuda) is None, "what the plan leaves"
    assert profile_module.device_state_bytes(2**30, cpu) == profile_module.device_state_bytes(2**30, cuda) == 2**30


def test_the_device_adamw_rate_is_torchs_fused_kernel_timed_the_median_of_the_runs_after_the_first(monkeypatch):
    calls = []

    def kernel(master, grad, exp_avg, exp_avg_sq, step, *, fused, **hyper):
        calls.append((fused, {t.dtype for t in (master, grad, exp_avg, exp_avg_sq)}, master.numel()))

    # start and end of each run: the first (untimed) 10 s, then 4, 1, 2, 3, 5 ms
    ticks = iter([0.0, 10.0, 20.0, 20.004, 30.0, 30.001, 40.0, 40.002, 50.0, 50.003, 60.0, 60.005])
    monkeypatch.setattr(profile_module, "adamw_kernel", kernel)
    monkeypatch.setattr(profile_module, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    rate = profile_module.device_adam_throughput(torch.device("cpu"), n=1000, reps=5)
    assert calls == [(True, {torch.float32}, 1000)] * 6
    assert rate == pytest.approx(1000 / 0.003)


def test_timing_the_device_adamw_draws_nothing_from_the_random_stream():
    """It runs after the warm-up, mid-training: a draw would change the dropout of every step after."""
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    assert profile_module.device_adam_throughput(torch.device("cpu"), n=4096) > 0
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("device_state", ["auto", "64KiB"])
def test_a_warm_up_on_the_cpu_plans_the_device_state_it_was_given(tmp_path, device_state):
    from conftest import decay_groups, tiny_causal_lm
    from fuyou_strategy import FuyouEngine
    from test_schedule import MAX_NORM, config, train

    model = tiny_causal_lm("gpt2")
    cfg = config(tmp_path, "auto", activations="auto", planner_warmup_steps=2, activation_min_bytes=0,
                 device_state=device_state)
    engine = FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True), max_grad_norm=MAX_NORM,
                         config=cfg)
    try:
        train(model, engine.optimizer, lambda last: engine.begin_micro_batch(update=last))
        plan = engine.plan
    finally:
        engine.close()
    given = 0 if device_state == "auto" else 64 * 1024
    assert plan.profile["device_state"] == given
    assert plan.profile["device_adam_params_per_s"] == 50e9, "not measured on the CPU"
    if given:
        assert 0 < plan.state_on_device <= given
    else:
        assert plan.state_on_device == 0


# -- fuyou plan ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model,batch,seq", [("gpt2-350m", 8, 1024), ("gpt2-1.5b", 8, 1024), ("llama-7b", 2, 4096)])
def test_fuyou_plan_on_an_h200_gives_the_device_tier_and_the_step_against_torchs(model, batch, seq, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert fuyou(["plan", model, "--gpu", "h200", "--batch", str(batch), "--seq", str(seq), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    ours, theirs = results["fuyou"], results["torch"]
    state = MODEL_PRESETS[model].params * PER_PARAM
    assert [line for line in printed.splitlines() if line.startswith("optimizer state on the device: ")]
    assert "torch, the model alone on the device" in printed and "x torch's" in printed
    assert results["zero-infinity-like"]["state_on_device"] == 0, "ZeRO-Infinity keeps the state on NVMe"
    assert theirs["fits"]
    if model == "llama-7b":  # 161 GB of two-slot state: the device holds part of it, up to its memory
        assert 0 < ours["state_on_device"] < state and ours["device_peak"] <= 141 * 10**9
        assert ours["step_s"] > theirs["step_s"]
    else:  # it all fits: the device updates it all, as torch does
        assert ours["state_on_device"] >= state and ours["ssd_peak"] == 0
        assert ours["step_s"] == pytest.approx(theirs["step_s"], rel=0.01)
    assert fuyou(["plan", model, "--gpu", "h200", "--batch", str(batch), "--seq", str(seq), "--device-state", "0",
                  "--json", str(out)]) == 0
    assert "optimizer state on the device: none (--device-state 0)" in capsys.readouterr().out
    without = json.loads(out.read_text())["results"]["fuyou"]
    assert without["state_on_device"] == 0 and without["step_s"] > ours["step_s"]


def test_fuyou_plan_with_one_slot_holds_half_the_state_and_models_the_exact_schedule(tmp_path, capsys):
    """``--state-slots 1`` (``FuyouConfig.state_slots=1``, which implies ``next_forward``): every tier holds half the
    state's bytes and the exact schedule is modelled; the ZeRO-Infinity-like row does not change. On an H200 with
    128 GB of host RAM, GPT-3 13B (which torch cannot hold) spills state to the SSD with two slots and none with one;
    Llama 7B's state, which two slots spill off the device, fits there whole with one, and the step is torch's. The
    two-slot plan names one slot and its step where it is faster, and not where it is slower (GPT-3 13B on an RTX
    4090 with 12 drives, its state on them either way), unless one slot's swap files fit the drives and two slots'
    do not (182B on one drive)."""
    runs = {}
    for model in ("gpt3-13b", "llama-7b"):
        for slots in (2, 1):
            out = tmp_path / f"{model}-{slots}.json"
            assert fuyou(["plan", model, "--gpu", "h200", "--host-memory", "128GB", "--batch", "8", "--seq", "1024",
                          "--host-state", "auto", "--state-slots", str(slots), "--json", str(out)]) == 0
            runs[model, slots] = capsys.readouterr().out, json.loads(out.read_text())
    printed, saved = runs["gpt3-13b", 1]
    assert saved["state_slots"] == 1 and "bytes per parameter and slot, 1 slot (" in printed
    assert saved["results"]["fuyou"]["schedule"] == "next_forward" and saved["results"]["fuyou"]["state_slots"] == 1
    assert runs["gpt3-13b", 2][1]["results"]["fuyou"]["schedule"] == "backward"
    assert "(optimizer overlapped with the next forward, one slot of state;" in printed
    assert "2 slots (" in runs["gpt3-13b", 2][0] and "(optimizer overlapped with backward;" in runs["gpt3-13b", 2][0]
    for model in ("gpt3-13b", "llama-7b"):
        two, one = (runs[model, slots][1]["results"] for slots in (2, 1))
        assert one["zero-infinity-like"] == two["zero-infinity-like"]
        assert one["fuyou"]["step_s"] < two["fuyou"]["step_s"]
        held = one["fuyou"]["state_on_device"] + one["fuyou"]["state_in_ram"]
        assert one["fuyou"]["ssd_peak"] == 0 and held >= MODEL_PRESETS[model].params * PER_PARAM // 2
        assert held < MODEL_PRESETS[model].params * PER_PARAM // 2 + 2**30  # one slot, not two
        assert two["fuyou"]["one_slot_step_s"] == one["fuyou"]["step_s"] and "one_slot_step_s" not in one["fuyou"]
        faster = two["fuyou"]["step_s"] / one["fuyou"]["step_s"]
        assert "--state-slots 1; FuyouConfig(state_slots=1)" in runs[model, 2][0]
        assert f"{faster:.2f}x faster" in runs[model, 2][0]
    out = tmp_path / "rtx4090.json"
    assert fuyou(["plan", "gpt3-13b", "--gpu", "rtx4090", "--ssds", "12", "--host-memory", "768GB", "--batch", "8",
                  "--json", str(out)]) == 0
    assert "--state-slots 1" not in capsys.readouterr().out
    assert "one_slot_step_s" not in json.loads(out.read_text())["results"]["fuyou"]
    # A 182B GPT-2 of 14 wide blocks (quick to solve) on an H200 and one 3.84 TB drive: two slots' swap files need two
    # drives, one slot's fit on one, so one slot is named though it is slower; with two drives it is not.
    wide = tmp_path / "config.json"
    wide.write_text(json.dumps({"model_type": "gpt2", "n_layer": 14, "n_embd": 32768, "n_head": 64,
                                "vocab_size": 50257, "n_positions": 1024}))
    for ssds in (1, 2):
        out = tmp_path / f"wide-{ssds}.json"
        assert fuyou(["plan", str(wide), "--gpu", "h200", "--ssds", str(ssds), "--host-memory", "768GB", "--seq", "128",
                      "--batch", "1", "--json", str(out)]) == 0
        printed, ours = capsys.readouterr().out, json.loads(out.read_text())["results"]["fuyou"]
        assert ours["ssd_drives_needed"] == 2
        if ssds == 1:
            assert ours["one_slot_step_s"] > ours["step_s"]
            assert (f"{ours['one_slot_step_s'] / ours['step_s']:.2f}x slower, its swap files within the 1 drive, where "
                    "two slots' need 2 drives") in printed
        else:
            assert "one_slot_step_s" not in ours and "--state-slots 1" not in printed
    big = (runs["gpt3-13b", 2][1]["results"], runs["gpt3-13b", 1][1]["results"])
    assert not big[1]["torch"]["fits"] and big[0]["fuyou"]["ssd_peak"] > 0
    small = runs["llama-7b", 1][1]["results"]
    assert small["fuyou"]["state_on_device"] >= MODEL_PRESETS["llama-7b"].params * PER_PARAM // 2
    assert small["fuyou"]["step_s"] == pytest.approx(small["torch"]["step_s"], rel=0.01)
    assert runs["llama-7b", 2][1]["results"]["fuyou"]["state_on_device"] < MODEL_PRESETS["llama-7b"].params * PER_PARAM


def test_fuyou_plan_says_when_torch_does_not_fit_and_leaves_the_papers_runtime_without_the_device_tier(capsys):
    assert fuyou(["plan", "gpt3-13b", "--gpu", "h200", "--batch", "8", "--seq", "1024"]) == 0
    printed = capsys.readouterr().out
    assert "torch, the model alone on the device: does not fit (needs 2" in printed  # 16 B per parameter: 208 GB
    assert "optimizer state on the device: " in printed and "% of it" in printed
    assert fuyou(["plan", "gpt3-13b", "--gpu", "h200", "--batch", "8", "--seq", "1024", "--paper-runtime"]) == 0
    assert "optimizer state on the device: none (--paper-runtime)" in capsys.readouterr().out
