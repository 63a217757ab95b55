"""The optimizer state's device tier (``FuyouConfig.device_state``, issue 53's second part): on the CPU the device is
host RAM, so every split of the state between the device, host RAM and the SSD trains bitwise like torch's
``AdamW(fused=True)``; the device tier takes the first parameters that fit and keeps to its budget; saves resume
across splits; the tier moves between steps; a device-tier gradient is never copied to the host (the late-copy
mode, where every host copy of a CPU tensor runs late, would show one)."""

import copy

import pytest
import torch

from conftest import decay_groups, tiny_causal_lm
from fuyou_strategy import FuyouAdamW, FuyouConfig, FuyouEngine, device
from fuyou_strategy.config import format_bytes
from fuyou_strategy.optim import updates
from fuyou_strategy.optim.gradients import Gradients
from fuyou_strategy.optim.state import OptimizerState
from fuyou_strategy.storage import StorageError, StorageSpaceError, TensorStore
from test_host_state import resumed_across_splits
from test_schedule import MAX_NORM, SCALER, STEPS, config, fp16_loss, gradscaler_reference, reference, train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

# Of the tiny Llama's state (~690 KiB, two slots, 24 KiB chunks): a device tier of the first parameters; with
# host_state the next ones in RAM, the rest on the SSD.
SPLITS = {"device": dict(device_state="1MiB", host_state=0), "three": dict(device_state="96KiB", host_state="96KiB")}


def tiers(opt):
    """(state bytes on the SSD, in host RAM, on the device): every slot with padding, from the store's entries."""
    where = [0, 0, 0]
    for name, e in opt.store.entries.items():
        if name.startswith("adamw."):
            where[0 if e.memory is None else 1 if e.device is None else 2] += e.slots * e.nchunks * e.stride
    return tuple(where)


def placement(opt):
    """Where each parameter's state is, in the optimizer's order: ``"device"``, ``"ram"`` or ``"ssd"``."""
    entries = opt.store.entries
    return ["ssd" if entries[ps.entry].memory is None else "ram" if entries[ps.entry].device is None else "device"
            for ps in opt.adam_state.owned]


def beside_torch(family="llama"):
    """A tiny model and a copy of it trained by torch (`test_schedule.reference`): (model, torch's, torch's losses)."""
    model = tiny_causal_lm(family)
    ref_model = copy.deepcopy(model)
    return model, ref_model, reference(ref_model)


def assert_torchs(model, ref_model, losses, ref_losses):
    """The run's losses and weights are torch's, bitwise."""
    assert losses == ref_losses
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name


def in_ram_with_no_device_tier(tmp_path, model, schedule="backward"):
    """`FuyouAdamW` (``backward``, clipping) with no device tier yet and 96 KiB of host tier, for a test to move."""
    return FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM, fused=True,
                      config=config(tmp_path, schedule, device_state=0, host_state="96KiB"))


def place_as_on_an_accelerator(engine, weights=None, *, measured=True, **fields):
    """What the engine does once a plan is solved (``measured=False``: a pinned plan, at construction), with the
    engine told its device is an accelerator (only where it decides; every tensor stays on the CPU, the tier's
    memory host RAM) and a plan that asks a device tier larger than the state (``fields``: the plan's other figures).
    Returns the plan."""
    from fuyou_strategy.planner import Plan

    plan = Plan(**{**dict(policies=[], act_bytes=[], reasons=[], predicted_step_s=1.0, device_peak=0, host_peak=0,
                          ssd_peak=0, budgets={}, state_on_device=10**9), **fields})
    engine.plan = plan
    engine.device = torch.device("cuda")
    try:
        engine._place_state(plan, weights, measured=measured)
    finally:
        engine.device = torch.device("cpu")
    return plan


@pytest.mark.parametrize("schedule,slots", [("backward", 2), ("next_forward", 2), ("auto", 2), ("next_forward", 1)])
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_any_split_with_a_device_tier_trains_bitwise_like_torch(tmp_path, split, schedule, slots):
    """Clipping that bites, a non-finite step skipped, three micro-batches accumulated (test_schedule's run)."""
    model, ref_model, ref_losses = beside_torch()
    engine = FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True), max_grad_norm=MAX_NORM,
                         config=config(tmp_path, schedule, state_slots=slots, **SPLITS[split]))
    opt = engine.optimizer
    on_ssd, in_ram, on_device = tiers(opt)
    losses, _ = train(model, opt, lambda last: engine.begin_micro_batch(update=last))
    summary, metrics = engine.summary(), engine.metrics()
    engine.close()
    assert metrics["fuyou/optimizer_state_device_bytes"] == on_device
    assert on_device > 0 and (in_ram > 0 and on_ssd > 0) == (split == "three"), (on_ssd, in_ram, on_device)
    assert summary["device_bytes_optimizer_state"] == on_device and summary["host_bytes_optimizer_state"] == in_ram
    assert summary["ssd_bytes_optimizer_state"] == on_ssd
    assert_torchs(model, ref_model, losses, ref_losses)
    assert opt.stats.skips == 1 and opt.stats.steps == STEPS - 1 and opt.stats.clipped >= 1


@pytest.mark.parametrize("schedule", ["next_forward", "backward"])
@pytest.mark.parametrize("split", ["ram", "device", "three"])
def test_updates_of_consecutive_parameters_in_ram_or_on_the_device_share_a_job_and_change_no_bit(
        tmp_path, monkeypatch, split, schedule):
    """An update (``next_forward``'s exact one; ``backward``'s speculative one and its redo after clipping bit) takes
    one job for a run of consecutive parameters whose state is in host RAM, or on the device tier
    (`OptimizerState.group_job`), up to `GROUP_ELEMENTS` elements (made small here, so that runs are cut), never
    beside state of the other tier or on the SSD; bitwise torch's (clipping that bites, a skipped step,
    accumulation)."""
    monkeypatch.setattr(updates, "GROUP_ELEMENTS", 3000)
    groups = []  # each grouped job's members' entries, as it was built
    real = OptimizerState.group_job

    def group_job(self, members, *args, **kwargs):
        groups.append([(ps.entry, ps.numel) for ps, *_rest in members])
        return real(self, members, *args, **kwargs)

    monkeypatch.setattr(OptimizerState, "group_job", group_job)
    model, ref_model, ref_losses = beside_torch()
    tier = dict(host_state="768KiB", device_state=0) if split == "ram" else SPLITS[split]
    with FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM, fused=True,
                    config=config(tmp_path, schedule, **tier)) as opt:
        where = dict(zip((ps.entry for ps in opt.adam_state.owned), placement(opt)))
        lent = {entry for entry, w in where.items() if w != "ssd"}
        losses, _ = train(model, opt)
        assert opt.stats.skips == 1 and opt.stats.clipped >= 1 and opt.stats.steps == STEPS - 1
        assert opt.stats.redos >= 1 if schedule == "backward" else opt.stats.deferred == STEPS - 1
    assert_torchs(model, ref_model, losses, ref_losses)
    assert (split == "three") == ("ssd" in where.values()), where
    assert groups and any(len(members) > 1 for members in groups), groups
    for members in groups:
        assert len({where[entry] for entry, _n in members}) == 1 and where[members[0][0]] != "ssd", (members, where)
        assert sum(n for _entry, n in members[:-1]) < updates.GROUP_ELEMENTS, members  # cut once it holds enough
    assert {entry for members in groups for entry, _n in members} == lent  # every one of them, every exact step


@pytest.mark.parametrize("schedule", ["next_forward", "backward"])
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_a_device_tier_update_in_a_job_of_its_own_changes_no_bit(tmp_path, monkeypatch, split, schedule):
    """What cannot be grouped (a compact state format, torch's for-loop kernel, a staged gradient) takes a job per
    parameter (`OptimizerState.update_job`); on the device tier too it is bitwise torch's: the speculative update's
    shadow chunk, lent unfilled, filled from the active one before the kernel, the redo after clipping bit, a
    skipped step, accumulation."""
    monkeypatch.setattr(OptimizerState, "group_kind", lambda *args, **kwargs: None)  # every update a job of its own
    model, ref_model, ref_losses = beside_torch()
    with FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM, fused=True,
                    config=config(tmp_path, schedule, **SPLITS[split])) as opt:
        assert "device" in placement(opt)
        losses, _ = train(model, opt)
        assert opt.stats.skips == 1 and opt.stats.clipped >= 1 and opt.stats.steps == STEPS - 1
        assert opt.stats.redos >= 1 if schedule == "backward" else opt.stats.deferred == STEPS - 1
    assert_torchs(model, ref_model, losses, ref_losses)


def test_the_device_tier_takes_the_first_parameters_that_fit_then_the_host_tier_the_next(tmp_path):
    model = tiny_causal_lm("llama")
    with FuyouAdamW(decay_groups(model), lr=3e-3, config=config(tmp_path, "backward", **SPLITS["three"])) as opt:
        where, cfg = placement(opt), opt.config
        sizes = [TensorStore.footprint(ps.nbytes, ps.stride, 2) for ps in opt.adam_state.owned]
        on_device = [s for s, w in zip(sizes, where) if w == "device"]
        assert where[0] == "device" and "ram" in where and "ssd" in where, where
        assert sum(on_device) == opt.store.bytes_on_device <= cfg.device_state
        # whole parameters, in order, each that still fits: none left on the SSD would have fitted in either tier
        for size, w in zip(sizes, where):
            if w == "ssd":
                assert size > cfg.device_state - sum(on_device)
        assert opt.control.figures().state_device_bytes == opt.store.bytes_on_device
        assert not opt.adam_state.in_memory & opt.adam_state.on_device


def test_the_device_tier_keeps_to_device_state_and_says_which_field_to_raise(tmp_path):
    cfg = FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", host_memory_budget="1MiB", host_state=0,
                      device_state="16KiB")
    with TensorStore(cfg) as store:
        store.create("a", (2048,), torch.float32, device=torch.device("cpu"))  # 8 KiB, two slots
        with pytest.raises(StorageSpaceError, match=r"entry 'b' needs 16.00 KiB of device memory but the optimizer "
                                                    r"state's device tier \(device_state\) has 0 B of 16.00 KiB left"):
            store.create("b", (2048,), torch.float32, device=torch.device("cpu"))
        assert store.bytes_on_device == 16 * 1024 and store.bytes_in_memory == 0 and store.pool.lent == 0


def test_moving_an_entry_to_the_device_and_back_keeps_both_slots_and_frees_where_it_was(tmp_path):
    """`TensorStore.to_device` from the SSD and from host RAM, and `to_ssd` from the device: the written chunks of
    both slots move, the tier they left gets its bytes back, and an entry with a chunk lent is refused, unchanged."""
    cfg = FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", host_memory_budget="1MiB", host_state="64KiB",
                      device_state="96KiB")
    cpu = torch.device("cpu")
    with TensorStore(cfg) as store:
        store.create("a", (5000,), torch.float32, chunk_bytes=8192)
        store.create("b", (5000,), torch.float32, chunk_bytes=8192, in_memory=True)
        values = {}
        for name in "ab":
            old, new = torch.randn(5000), torch.randn(5000)
            store.write(name, old).result()
            store.write(name, new, slot="shadow").result()
            values[name] = old, new
        assert store.to_device("a", cpu) == 2 * 3 * 8192 and store.to_device("a", cpu) == 0
        assert store.bytes_on_disk == 0 and store.entry("a").base == {}, "the SSD's region went back"
        lent = store.read_chunk("b", 0, lend="shadow").result()
        with pytest.raises(StorageError, match="cannot move entry 'b' to the device while a write to it is in flight"):
            store.to_device("b", cpu)
        assert store.entry("b").device is None and store.bytes_on_device == 2 * 3 * 8192
        store.write_chunk("b", 0, lent, slot="shadow").result()  # lent as a copy of the active chunk
        values["b"][1][:2048] = values["b"][0][:2048]
        store.to_device("b", cpu)
        assert store.bytes_in_memory == 0 and store.pool.lent == 0 and store.bytes_on_device == 4 * 3 * 8192
        with pytest.raises(StorageError, match="move it to_ssd first"):
            store.to_memory("a")
        for name, (old, new) in values.items():
            assert torch.equal(store.read(name).result(), old)
            assert torch.equal(store.read(name, slot="shadow").result(), new)
        store.commit(["a"])
        assert store.to_ssd("a") == 2 * 3 * 8192 and store.bytes_on_device == 2 * 3 * 8192
        assert store.entry("a").device is None and store.entry("a").memory is None and store.pool.lent == 0
        assert torch.equal(store.read("a").result(), values["a"][1])
        store.delete("b")
        assert store.bytes_on_device == 0


def test_a_save_resumes_into_another_split_with_a_device_tier_exactly(tmp_path):
    """Saved with the state on the device tier, resumed all on the SSD, then into three tiers: the run goes on bitwise
    as if uninterrupted (checkpoints read and write the device's chunks through host buffers)."""
    splits = [SPLITS["device"], dict(device_state=0, host_state=0), SPLITS["three"]]
    on_device = []
    straight, model, expected, got = resumed_across_splits(
        tmp_path, splits, check=lambda i, opt: on_device.append(opt.store.bytes_on_device > 0))
    assert on_device == [True, False, True]
    for p, q in zip(straight.parameters(), model.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(expected, got):
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("schedule", ["backward", "next_forward"])
def test_the_device_tier_grows_and_shrinks_between_steps_and_changes_no_bit(tmp_path, schedule):
    """`OptimizerControl.hold_state_on_device` (what the engine does with the plan's device tier): the state moves
    onto the device from the SSD and from host RAM, and back off it, between steps of one run, bitwise torch's.
    Under ``next_forward`` the state in RAM of the fp32 weights leaves its masters in the parameters
    (`OptimizerState.masters_behind`) until it moves."""
    model, ref_model, ref_losses = beside_torch()
    opt = in_ram_with_no_device_tier(tmp_path, model, schedule)
    control, seen = opt.control, []
    sizes = iter([10**9, 96 * 1024, 0, 200 * 1024, 10**9])

    def move(last):
        if last:  # before the last micro-batch's backward is the wrong time: between steps only
            return
        if not opt.window.pending() and opt.stats.steps + opt.stats.skips == len(seen):
            nbytes = next(sizes, None)
            if nbytes is not None:
                held = control.hold_state_on_device(nbytes)
                seen.append((held, placement(opt)))

    losses, _ = train(model, opt, move)
    opt.close()
    assert_torchs(model, ref_model, losses, ref_losses)
    everything, some, none = seen[0], seen[1], seen[2]
    assert set(everything[1]) == {"device"} and everything[0] == sum(tiers(opt))
    assert some[1][0] == "device" and "ram" in some[1] and 0 < some[0] <= 96 * 1024
    assert none[0] == 0 and "device" not in none[1] and "ram" in none[1], "the host tier took its share back"
    assert opt.stats.skips == 1 and opt.stats.clipped >= 1


def test_a_device_tier_gradient_is_read_where_it_is_never_copied_to_the_host(tmp_path, monkeypatch):
    """In the late-copy mode every host copy of a gradient (`Gradients.staged`) runs, late, even on the CPU: the
    device tier's gradients take none, the others one each, and training stays bitwise torch's."""
    from fuyou_strategy.device import late_copies

    copied, read_in_place = set(), set()
    real = Gradients.staged

    def spy(self, ps, tensor, kind="resident"):
        grad = real(self, ps, tensor, kind)
        (copied if grad.staging is not None else read_in_place).add(ps.param)
        return grad

    monkeypatch.setattr(Gradients, "staged", spy)
    model, ref_model, ref_losses = beside_torch()
    with late_copies(max_delay_ms=2.0, seed=1):
        engine = FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True),
                             max_grad_norm=MAX_NORM, config=config(tmp_path, "backward", **SPLITS["three"]))
        opt = engine.optimizer
        where = dict(zip((ps.param for ps in opt.adam_state.owned), placement(opt)))
        losses, _ = train(model, opt, lambda last: engine.begin_micro_batch(update=last))
        engine.close()
    assert_torchs(model, ref_model, losses, ref_losses)
    assert read_in_place == {p for p, w in where.items() if w == "device"}
    assert copied == {p for p, w in where.items() if w != "device"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("schedule", ["backward", "next_forward"])
def test_fp16_loss_scaling_with_a_device_tier_is_gradscaler_and_adamw_bitwise(tmp_path, schedule, dtype):
    """fp16 weights, or fp32 ones under a scaled loss (as mixed precision's autocast trains): the device tier's
    updates unscale (and clip) on the device as the host's do, and a step with an inf skips there too; weights,
    masters and the scale's course are GradScaler's with AdamW's. With fp32 gradients, a speculative update's
    unscale leaves them as they were for its redo."""
    model = tiny_causal_lm("llama", dtype=dtype)
    ref_model = copy.deepcopy(model)
    masters, ref_scales = gradscaler_reference(ref_model)
    with FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM, loss_scaling=SCALER,
                    config=config(tmp_path, schedule, **SPLITS["three"])) as opt:
        assert "device" in placement(opt) and "ssd" in placement(opt)
        _, scales = train(model, opt, loss_fn=fp16_loss)
        assert scales == ref_scales
        assert opt.stats.skips == 1 and opt.stats.clipped >= 1
        for (name, p), q, m in zip(model.named_parameters(), ref_model.parameters(), masters):
            assert torch.equal(p, q), name
            assert torch.equal(opt.read_state(p)["master"], m.detach()), name


def test_auto_on_an_accelerator_holds_what_the_plan_leaves_within_the_warm_ups_measured_headroom(tmp_path,
                                                                                                   monkeypatch):
    """``device_state="auto"``: the engine moves the plan's device tier onto the device between steps, no more than
    the warm-up's measured peak leaves (`device.device_memory_headroom`: the plan does not count the runtime's
    context or the allocator's slack), says so, and training goes on bitwise. The CPU stands in for the
    accelerator here (the engine is told its device is one; the tier's memory is then host RAM)."""
    import fuyou_strategy.engine as engine_module

    model, ref_model, ref_losses = beside_torch()
    said = []
    engine = FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True), max_grad_norm=MAX_NORM,
                         config=config(tmp_path, "backward", host_state=0), report=said.append)
    opt = engine.optimizer
    assert engine.config.device_state == "auto" and opt.store.bytes_on_device == 0, "nothing before a plan"
    headroom = 150 * 1024
    monkeypatch.setattr(engine_module, "device_memory_headroom", lambda device: headroom)
    place_as_on_an_accelerator(engine)  # what the engine does once the warm-up's plan is solved
    held = opt.store.bytes_on_device
    losses, _ = train(model, opt, lambda last: engine.begin_micro_batch(update=last))
    engine.close()
    assert 0 < held <= headroom and engine.config.device_state == held
    assert any("device_state='auto'" in line and "measured peak" in line for line in said), said
    assert_torchs(model, ref_model, losses, ref_losses)


@pytest.mark.parametrize("measured", [True, False], ids=["warm-up", "pinned"])
@pytest.mark.parametrize("schedule", ["backward", "next_forward"])
@pytest.mark.parametrize("host_state", [0, "auto"])
def test_auto_on_an_accelerator_grows_the_tier_once_to_what_the_first_step_under_the_plan_leaves(
        tmp_path, monkeypatch, host_state, schedule, measured):
    """The warm-up's peak bounds the device tier at the plan, though its steps kept every activation and weight the
    plan may not; a pinned plan has no step measured at all, and its tier leaves free what the plan counts its steps
    to take beyond what is allocated. The engine then releases the allocator's cache
    (`device.release_cached_memory`) and, after the first step under the plan, grows the tier once to what that step
    left free (`device.device_memory_left`, `FuyouEngine._grow_device_tier`), up to what the plan asked; the host
    tier (``host_state="auto"``) takes the next parameters that fit; the config and the report say so; a comparison
    of the plan's predicted step with the measured ones, where one was begun (not for a pinned plan), restarts after
    the move; training goes on bitwise. The CPU stands in for the accelerator (as above)."""
    import fuyou_strategy.engine as engine_module

    model, ref_model, ref_losses = beside_torch()
    said, events = [], []
    engine = FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True), max_grad_norm=MAX_NORM,
                         config=config(tmp_path, schedule, host_state=host_state, host_memory_budget="4MiB"),
                         report=said.append)
    opt = engine.optimizer
    taken = lambda: opt.stats.steps + opt.stats.skips  # noqa: E731 - the optimizer steps run so far
    # free beside the warm-up's peak at the plan; then beside what the first step under it reserved
    monkeypatch.setattr(engine_module, "device_memory_headroom",
                        lambda device: events.append(("peak", taken())) or 150 * 1024)
    monkeypatch.setattr(engine_module, "device_memory_left",
                        lambda device: events.append(("left", taken())) or 200 * 1024)
    monkeypatch.setattr(engine_module, "release_cached_memory", lambda device: events.append(("released", taken())))
    # a pinned plan's steps take 100 KiB beyond its state, 40 KiB of it allocated already: 90 KiB of the 150 is left
    monkeypatch.setattr(engine_module, "device_memory_allocated",
                        lambda device: events.append(("allocated", taken())) or 40 * 1024)
    # the warm-up's plan solved, or a pinned plan at construction
    place_as_on_an_accelerator(engine, measured=measured, device_peak=10**9 + 100 * 1024, state_in_ram=300 * 1024)
    if measured:
        engine.reporting.plan_applied()  # and then: its predicted step is compared with the steps after it
    at_plan = opt.store.bytes_on_device
    in_ram_at_plan = opt.store.bytes_in_memory
    losses, _ = train(model, opt, lambda last: engine.begin_micro_batch(update=last))
    grown = opt.store.bytes_on_device
    in_ram, summary = opt.store.bytes_in_memory, engine.summary()
    room = opt.store.memory_limit - in_ram  # what the host tier has left
    state = opt.control.state
    on_ssd = [TensorStore.footprint(ps.nbytes, ps.stride, 2) for ps in state.owned
              if ps.index not in state.on_device and ps.index not in state.in_memory]
    engine.close()
    grew = [("released", 0), ("left", 1)]  # the tier grew once, after one step
    if measured:
        assert events == [("peak", 0), *grew], events
        assert 0 < at_plan <= 150 * 1024 < grown <= at_plan + 200 * 1024, (at_plan, grown)
        assert engine.reporting._plan_applied_at == 1, "the comparison with the prediction starts after the move"
    else:
        assert events == [("peak", 0), ("allocated", 0), *grew], events
        assert 0 < at_plan <= 90 * 1024 < grown <= at_plan + 200 * 1024, (at_plan, grown)
        assert engine.reporting._plan_applied_at is None, "a pinned plan begins no comparison"
    assert engine.config.device_state == grown == summary["device_bytes_optimizer_state"]
    assert any("the first step under it left" in line and format_bytes(grown) in line for line in said), said
    if host_state == "auto":  # the host tier took the next parameters that fit, and its share is recorded
        assert in_ram_at_plan > 0 and in_ram > 0 and on_ssd and all(need > room for need in on_ssd), (room, on_ssd)
        assert in_ram == engine.config.host_state == engine.memory.state_in_ram
    assert_torchs(model, ref_model, losses, ref_losses)


def test_auto_on_an_accelerator_leaves_the_state_of_the_parameters_about_to_be_streamed_off_the_device(
        tmp_path, monkeypatch):
    """``device_state="auto"`` with a plan that streams block 0: the engine's device tier takes the first parameters'
    state that fits but not that block's (`FuyouEngine._place_state` names them to `hold_state_on_device` before it
    installs the streamer), so that no state moves onto the device only to leave it again with its weights; the
    planner leaves it off the device too. The CPU stands in for the accelerator (as above); the streamer's install is
    recorded, not run."""
    import fuyou_strategy.engine as engine_module
    from fuyou_strategy.params.streaming import streamed_parameter_names

    model, _ref_model, _ref_losses = beside_torch()
    engine = FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True), max_grad_norm=MAX_NORM,
                         config=config(tmp_path, "backward", host_state=0))
    opt = engine.optimizer
    moved = []
    real = opt.control.hold_state_on_device
    monkeypatch.setattr(opt.control, "hold_state_on_device", lambda *a, **k: moved.append("state") or real(*a, **k))
    monkeypatch.setattr(engine, "_install_streamer", lambda weights: moved.append(("streamer", weights)))
    monkeypatch.setattr(engine_module, "device_memory_headroom", lambda device: None)
    try:
        place_as_on_an_accelerator(engine, {0: "ssd"})
        names = set(streamed_parameter_names(model, engine.config, {0: "ssd"}))
        at = dict(zip((id(ps.param) for ps in opt.adam_state.owned), placement(opt)))  # the optimizer's order
        where = {name: at[id(p)] for name, p in model.named_parameters()}
        assert moved == ["state", ("streamer", {0: "ssd"})]
        assert names and all(where[name] != "device" for name in names), where
        assert all(where[name] == "device" for name in where if name not in names), where
    finally:
        engine.close()


def test_a_device_that_runs_out_of_memory_stops_the_tiers_growth_and_loses_nothing(tmp_path, monkeypatch, caplog):
    """Memory the plan counted can be taken by the time the tier moves (``torch.OutOfMemoryError``): the tier stops
    at what fit, with a warning naming the parameter and the bytes; the entry that did not fit stays off the device,
    whole (the host tier then takes what it has room for), and training goes on bitwise."""
    import fuyou_strategy.storage.store as store_module

    model, ref_model, ref_losses = beside_torch()
    opt = in_ram_with_no_device_tier(tmp_path, model)
    real, made = store_module.DeviceMemory, []

    def scarce(data):
        if len(made) >= 4:  # two entries' two slots, then the device is full
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        made.append(data)
        return real(data)

    monkeypatch.setattr(store_module, "DeviceMemory", scarce)
    with caplog.at_level("WARNING", logger="fuyou_strategy.optim.state"):
        held = opt.control.hold_state_on_device(10**9)
    where = placement(opt)
    assert where[:2] == ["device", "device"] and "device" not in where[2:], where
    assert held == opt.store.bytes_on_device == sum(d.numel() for d in made)
    assert "ram" in where, "the host tier took the room the device tier's moves freed"
    assert any("device tier stops at" in r.getMessage() and "parameter 2" in r.getMessage() for r in caplog.records)
    losses, _ = train(model, opt)
    opt.close()
    assert_torchs(model, ref_model, losses, ref_losses)


def run_on_the_device_tier(tmp_path, monkeypatch, *, late, steps=range(STEPS), **overrides):
    """The tiny Llama with all its state on the device tier, ``next_forward``, clipping and a non-finite step
    (test_schedule's run), in the late-copy mode (``late``: the device's work queued, as on an accelerator) or not.
    Returns (model, optimizer, losses, how many times step() read the global norm on the host)."""
    from fuyou_strategy.device import late_copies
    from fuyou_strategy.optim.schedule import Parts

    host_reads = []
    real = Parts.total_norm
    monkeypatch.setattr(Parts, "total_norm", lambda self, *a: host_reads.append(1) or real(self, *a))
    model = tiny_causal_lm("llama")
    opt = FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM, fused=True,
                     config=config(tmp_path, "next_forward", **SPLITS["device"], **overrides))
    assert set(placement(opt)) == {"device"}
    with late_copies(max_delay_ms=2.0, seed=1) if late else monkeypatch.context() as mode:
        if not late:  # copies as they are, even in a run with FUYOU_ASYNC_DEVICE set
            mode.setattr(device, "_late", None)
        losses, _ = train(model, opt, steps=steps)
    return model, opt, losses, len(host_reads)


@pytest.mark.parametrize("jobs", ["grouped", "each"])
def test_a_step_of_the_device_tier_is_decided_on_the_device_read_later_and_bitwise_torch(tmp_path, monkeypatch, jobs):
    """Every update on the device: step() queues them with the clip coefficient and the non-finite flag as device
    tensors and never reads the norm on the host (`Parts.decide`). The weights are torch's; the statistics, once
    read, are those of the same run decided on the host: the same clipped steps, the non-finite one a skip, its
    step counts not advanced. Grouped updates (`group_job`) or a job per parameter (`update_job`) alike."""
    if jobs == "each":
        monkeypatch.setattr(OptimizerState, "group_kind", lambda *args, **kwargs: None)
    ref_model, ref_losses = beside_torch()[1:]
    (tmp_path / "host").mkdir()
    (tmp_path / "device").mkdir()
    host_model, host_opt, host_losses, host_reads = run_on_the_device_tier(tmp_path / "host", monkeypatch, late=False)
    model, opt, losses, reads = run_on_the_device_tier(tmp_path / "device", monkeypatch, late=True)
    try:
        assert reads == 0 and host_reads == STEPS
        assert opt._parts.unsettled, "the last step's outcome is read only when asked for"
        assert_torchs(model, ref_model, losses, ref_losses)
        stats, host_stats = opt.stats.to_dict(), host_opt.stats.to_dict()
        assert not opt._parts.unsettled
        assert stats == host_stats, (stats, host_stats)
        assert stats["skips"] == 1 and stats["clipped"] >= 1 and stats["history"][2] == ["next_forward", "skip"]
        assert all(float(opt.state[p]["step"]) == STEPS - 1 for p in model.parameters())
    finally:
        opt.close()
        host_opt.close()


def test_a_save_right_after_a_non_finite_step_decided_on_the_device_resumes_exactly(tmp_path, monkeypatch):
    """The save reads the unread outcome first: the skipped step's counts are saved as they were before it, and the
    run resumed from the save goes on bitwise as torch's."""
    ref_model, ref_losses = beside_torch()[1:]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model, opt, losses, _ = run_on_the_device_tier(tmp_path / "a", monkeypatch, late=True, steps=range(3))
    try:
        assert opt._parts.unsettled  # step 2, the non-finite one, not read yet
        sd = opt.state_dict(tmp_path / "ckpt")
        assert {float(s["step"]) for s in sd["state"].values()} == {2.0}
    finally:
        opt.close()
    from fuyou_strategy.device import late_copies

    resumed = FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM, fused=True,
                         config=config(tmp_path / "b", "next_forward", **SPLITS["device"]))
    try:
        resumed.load_state_dict(sd)
        with late_copies(max_delay_ms=2.0, seed=2):
            more, _ = train(model, resumed, steps=range(3, STEPS))
        assert_torchs(model, ref_model, losses + more, ref_losses)
        assert resumed.stats.skips == 1 and resumed.stats.steps == STEPS - 1
    finally:
        resumed.close()


def test_the_device_tiers_gradient_norms_at_a_step_are_one_call_per_device_and_dtype(tmp_path, monkeypatch):
    """Without the one pass's kernel (which reads a CPU gradient itself), step() takes the device tier's gradient norms
    as ``clip_grad_norm_`` does by default: one ``_foreach_norm`` over the list (`gradients.device_norms`; on an
    accelerator one kernel, not a launch per tensor), none one by one; and the run stays torch's."""
    from fuyou_strategy.optim.gradients import Grad

    ref_model, ref_losses = beside_torch()[1:]
    calls = {"foreach": 0, "one": 0}
    real_foreach, real_norm = torch._foreach_norm, Grad.norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: calls.__setitem__("foreach", calls["foreach"] + 1)
                        or real_foreach(*a, **k))
    monkeypatch.setattr(Grad, "norm", lambda *a, **k: calls.__setitem__("one", calls["one"] + 1) or real_norm(*a, **k))
    model, opt, losses, _ = run_on_the_device_tier(tmp_path, monkeypatch, late=True, update_kernel="torch")
    try:
        assert_torchs(model, ref_model, losses, ref_losses)
        assert calls == {"foreach": STEPS, "one": 0}, calls
    finally:
        opt.close()


def test_auto_takes_next_forward_at_once_where_the_whole_state_is_on_an_accelerators_device_tier(tmp_path):
    """``auto`` measures neither schedule first where every update runs on the accelerator's device tier
    (`OptimizerControl._exact_first`): ``next_forward`` decides each step on the device, ``backward`` would read the
    norm on the host. The late-copy mode stands in for the accelerator; the run stays torch's."""
    from fuyou_strategy.device import late_copies

    model, ref_model, ref_losses = beside_torch()
    with late_copies(max_delay_ms=2.0, seed=3):
        opt = FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM, fused=True,
                         config=config(tmp_path, "auto", **SPLITS["device"]))
        try:
            assert opt.stats.last_reason.startswith("the whole state is on the device tier"), opt.stats.last_reason
            losses, _ = train(model, opt)
            assert opt.stats.schedules == {"backward": 0, "next_forward": STEPS}
            assert opt.stats.skips == 1 and opt.stats.clipped >= 1
        finally:
            opt.close()
    assert_torchs(model, ref_model, losses, ref_losses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("consume", [False, True])
def test_gradients_unscaled_and_clipped_in_one_call_per_factor_are_each_fp32_product_and_in_place_only_when_consumed(
        dtype, consume):
    """`kernels.fp32_gradients` (the device tier's grouped updates): each result is `fp32_gradient`'s bits; an fp32
    gradient is multiplied in place only when the caller consumes it (an exact update), as ``clip_grad_norm_`` does,
    and otherwise left as it was (a speculative update's redo reads it again); an upcast one is never touched."""
    from fuyou_strategy.optim.kernels import fp32_gradient, fp32_gradients

    gen = torch.Generator().manual_seed(5)
    raws = [(torch.randn(n, generator=gen) * 10 ** e).to(dtype) for n, e in ((1, 0), (37, -3), (1000, 2))]
    kept = [g.clone() for g in raws]
    inv_scale, coef = torch.tensor(2.0 ** -13), torch.tensor(0.3183)
    for factors in ((None, None), (inv_scale, None), (None, coef), (inv_scale, coef)):
        raws = [g.clone() for g in kept]
        want = [fp32_gradient(g, *factors) for g in kept]
        got = fp32_gradients(raws, *factors, consume=consume)
        for g, w in zip(got, want):
            assert g.dtype == torch.float32 and torch.equal(g, w)
        in_place = consume and dtype == torch.float32 and factors != (None, None)
        for raw, g, before in zip(raws, got, kept):
            assert (raw is g) == (dtype == torch.float32 and (consume or factors == (None, None)))
            assert torch.equal(raw, before) != in_place
