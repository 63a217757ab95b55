"""Optimizer schedules: "backward", "next_forward" and "auto" give bitwise the same weights.

The training: tiny GPT-2 and Llama, decay / no-decay groups, a warm-up LR schedule, 3 accumulated
micro-batches per step, clipping to 0.5 that bites on some steps and not others, and one step whose
gradient is not finite (skipped). The reference is torch: ``clip_grad_norm_`` then
``AdamW(fused=True)``, the step skipped when the norm is not finite (GradScaler's rule).
"""

import copy
import math
import time

import pytest
import torch

from conftest import decay_groups, tiny_causal_lm
from fuyou_strategy import FuyouAdamW, FuyouConfig, FuyouEngine
from fuyou_strategy.optim import onepass, state
from fuyou_strategy.optim.schedule import BACKWARD, NEXT_FORWARD, ScheduleChooser

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

SCHEDULES = ["backward", "next_forward", "auto"]
STEPS, ACCUMULATE, MAX_NORM = 6, 3, 0.5
LOSS_SCALE = [0.01, 1.0, math.inf, 0.01, 1.0, 1.0]  # x1: clipping bites; x0.01: it does not; inf: skipped
INF_MICRO = 1  # the micro-batch of the inf step whose loss is scaled by inf


def ids(step, micro):
    return torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(step * 10 + micro))


def loss_of(model, step, micro):
    x = ids(step, micro)
    scale = LOSS_SCALE[step] if (LOSS_SCALE[step] != math.inf or micro == INF_MICRO) else 1.0
    return model(input_ids=x, labels=x).loss * scale / ACCUMULATE


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def config(tmp_path, schedule, **overrides):
    values = dict(swap_dirs=[str(tmp_path)], chunk_size="24KiB", host_memory_budget="1MiB", io_threads=2,
                  optimizer_schedule=schedule)
    values.update(overrides)
    return FuyouConfig(**values)


def reference(model):
    """torch: clip_grad_norm_ in param-group order, fused AdamW, a non-finite step skipped."""
    opt = torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True)
    sched, params = warmup(opt), [p for g in opt.param_groups for p in g["params"]]
    losses = []
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            loss = loss_of(model, step, micro)
            loss.backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        if math.isfinite(norm):
            opt.step()
        opt.zero_grad()
        sched.step()
    return losses


def train(model, opt, begin=None, steps=range(STEPS), loss_fn=None):
    """The same loop through FuyouAdamW (``begin(update)`` before each micro-batch: the engine's; the
    loss scaled under ``loss_scaling``). Returns the losses and, per step, the loss scale after it."""
    sched = warmup(opt)
    for _ in range(steps.start):
        sched.step()
    losses, scales = [], []
    for step in steps:
        for micro in range(ACCUMULATE):
            last = micro == ACCUMULATE - 1
            if begin is not None:
                begin(last)
            with opt.no_update() if not last else torch.enable_grad():
                loss = (loss_fn or loss_of)(model, step, micro)
                (opt.scale_loss(loss) if opt.scaler is not None else loss).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        sched.step()
        scales.append(opt.scaler.get_scale() if opt.scaler is not None else None)
    return losses, scales


@pytest.fixture
def slow_updates(monkeypatch):
    """Every chunk's AdamW takes 3 ms longer, with either kernel (torch's or the one pass): the next forward
    catches up with the updates, so a forward that did not wait for them would read stale weights (and the
    losses would differ)."""
    for owner, name in ((state, "adamw_kernel"), (onepass.OnePass, "update")):
        monkeypatch.setattr(owner, name, _slowly(getattr(owner, name)))


def _slowly(real):
    def slowly(*args, **kwargs):
        time.sleep(0.003)
        return real(*args, **kwargs)

    return slowly


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("via", ["optimizer", "engine"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_every_schedule_is_bitwise_torch(tmp_path, family, via, schedule, slow_updates):
    model = tiny_causal_lm(family)
    ref_model = copy.deepcopy(model)
    ref_losses = reference(ref_model)
    # auto's measured choice (speculation first, next_forward after a rollback) is what this test follows: the
    # state on the SSD, since on the CPU with all of it in RAM auto takes next_forward at once
    # (test_auto_on_the_cpu_with_the_state_in_ram_never_speculates)
    cfg = config(tmp_path, schedule, **({"host_state": 0} if schedule == "auto" else {}))
    if via == "optimizer":  # no model attached: step() lands the updates itself
        opt = FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM, config=cfg)
        closer, begin = opt, None
    else:  # the engine attaches the model: the next forward waits, module by module
        engine = FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True), config=cfg,
                             max_grad_norm=MAX_NORM)
        opt, closer = engine.optimizer, engine
        begin = lambda last: engine.begin_micro_batch(update=last)  # noqa: E731
    losses, _ = train(model, opt, begin)
    stats = opt.stats
    closer.close()  # lands what the last step left pending
    assert losses == ref_losses, "every forward read the updated weights"
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
    assert stats.skips == 1 and stats.steps == STEPS - 1 and stats.clipped >= 1
    assert sum(stats.schedules.values()) == STEPS and len(stats.history) == STEPS
    if schedule == "backward":
        assert stats.redos >= 1 and stats.commits >= 1 and stats.deferred == 0
        assert stats.rollbacks == stats.redos + stats.skips
    elif schedule == "next_forward":
        assert stats.deferred == STEPS - 1 and stats.rollbacks == stats.redos == stats.commits == 0
    else:  # auto: it speculated while nothing had rolled back, and tried next_forward after the first rollback
        assert stats.schedules[BACKWARD] >= 1 and stats.schedules[NEXT_FORWARD] >= 1, stats.history
        assert stats.history[0][0] == BACKWARD and stats.history[2][0] == NEXT_FORWARD, stats.history


def test_a_forward_waits_only_for_the_modules_it_runs(tmp_path, slow_updates):
    """After step(), updates are pending; the first block's forward waits for its own weights, not for
    the head's, which are still being written (forward order)."""
    model = tiny_causal_lm("llama")
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                         config=config(tmp_path, "next_forward"))
    opt = engine.optimizer
    train(model, opt, lambda last: engine.begin_micro_batch(update=last), steps=range(1))
    pending = set(opt.landing.jobs)
    assert pending == set(p for g in opt.param_groups for p in g["params"]), "every update left for the forward"
    first = model.model.embed_tokens.weight
    model.model.embed_tokens(ids(0, 0))
    assert first not in opt.landing.jobs, "the embedding waited for its update"
    assert opt.landing.pending([model.lm_head.weight]), "the head's update (last in forward order) still runs"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sd = model.state_dict()  # lands everything first
    assert not opt.landing.jobs
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters()), "updates landed after the read"
    assert all(torch.equal(sd[n], p) for n, p in model.named_parameters())
    engine.close()


@pytest.mark.parametrize("schedule", ["next_forward", "auto"])
def test_a_checkpoint_saved_with_updates_pending_resumes_exactly(tmp_path, schedule, slow_updates):
    def engine_for(model, where):
        return FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3),
                           config=config(tmp_path / where, schedule), max_grad_norm=MAX_NORM)

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    model = tiny_causal_lm("gpt2")
    resumed_model = copy.deepcopy(model)
    engine = engine_for(model, "a")
    begin = lambda last: engine.begin_micro_batch(update=last)  # noqa: E731
    train(model, engine.optimizer, begin, steps=range(2))
    if schedule == "next_forward":
        assert engine.optimizer.landing.jobs, "the save comes while the last step's updates are pending"
    engine.save(str(tmp_path / "ckpt"))
    train(model, engine.optimizer, begin, steps=range(2, STEPS))
    engine.close()

    resumed = engine_for(resumed_model, "b")
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.optimizer.stats.steps == 2
    train(resumed_model, resumed.optimizer, lambda last: resumed.begin_micro_batch(update=last),
          steps=range(2, STEPS))
    resumed.close()
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(p, q), name


def test_auto_chooses_from_measured_costs():
    chooser = ScheduleChooser("auto", can_speculate=True, history=4)
    assert chooser.choose()[0] == BACKWARD, "nothing rolled back yet"
    chooser.record_wait(BACKWARD, 0.1)
    chooser.record(rolled=True, rollback_s=2.0)
    schedule, why = chooser.choose()
    assert schedule == NEXT_FORWARD and "measure" in why, "a rollback seen, next_forward not measured yet"
    chooser.record_wait(NEXT_FORWARD, 0.5)
    chooser.record(rolled=True)
    assert chooser.choose()[0] == NEXT_FORWARD, "0.1 + 1.0 x 2.0 s expected against 0.5 s"
    for _ in range(3):
        chooser.record(rolled=False)
    schedule, why = chooser.choose()
    assert schedule == NEXT_FORWARD and "rollback rate 0.25" in why, "0.1 + 0.25 x 2.0 = 0.6 s against 0.5 s"
    chooser.record_wait(NEXT_FORWARD, 0.7)  # averaged: 0.6
    chooser.record(rolled=False)  # rate 0: backward at once
    assert chooser.choose()[0] == BACKWARD, "no rollback in the recent history"
    assert ScheduleChooser("auto", can_speculate=False).choose()[0] == NEXT_FORWARD, "one state slot"
    assert ScheduleChooser("backward", can_speculate=True).choose() == (BACKWARD, "configured")


def test_auto_takes_next_forward_at_once_where_its_reason_holds():
    """``exact_first`` (the CPU with the whole state in RAM): ``next_forward`` without measuring ``backward``,
    whatever the windows cost; when it stops holding (state moved to the SSD), the measured choice again."""
    reason = ["the whole state is in host RAM"]
    chooser = ScheduleChooser("auto", can_speculate=True, exact_first=lambda: reason[0])
    chooser.record_wait(BACKWARD, 0.1)
    chooser.record_wait(NEXT_FORWARD, 0.9)
    assert chooser.choose() == (NEXT_FORWARD, "the whole state is in host RAM")
    reason[0] = None
    assert chooser.choose()[0] == BACKWARD, "the measured costs decide once the reason is gone"
    assert ScheduleChooser("backward", can_speculate=True, exact_first=lambda: "x").choose() == (BACKWARD, "configured")


@pytest.mark.parametrize("host_state", ["auto", 0])
def test_auto_on_the_cpu_with_the_state_in_ram_never_speculates(tmp_path, host_state):
    """The engine on the CPU: with the whole state in RAM ``auto`` runs ``next_forward`` from the first step
    and says why; with the state on the SSD it still speculates first; bitwise torch either way."""
    model = tiny_causal_lm("gpt2")
    ref_model = copy.deepcopy(model)
    ref_losses = reference(ref_model)
    engine = FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True), max_grad_norm=MAX_NORM,
                         config=config(tmp_path, "auto", host_memory_budget="64MiB", host_state=host_state))
    losses, _ = train(model, engine.optimizer, lambda last: engine.begin_micro_batch(update=last))
    stats = engine.optimizer.stats
    engine.close()
    assert losses == ref_losses
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
    if host_state == "auto":
        assert stats.schedules[BACKWARD] == 0 and stats.schedules[NEXT_FORWARD] == STEPS, stats.history
        assert "whole state is in host RAM" in stats.last_reason
    else:
        assert stats.history[0][0] == BACKWARD, stats.history


def test_auto_measures_next_forward_without_a_rollback_and_keeps_the_faster_schedule(monkeypatch):
    """Nothing rolling back, ``auto`` used to keep ``backward`` for good; with the state in host RAM its
    shadow-slot copy made every window longer (124M on this CPU, 2 rounds: 1.11x torch's step against
    1.05x under next_forward). Now it measures each schedule's windows (wall time from one step() to the
    next, the first after a switch left out) and keeps the faster, measuring the other again now and then."""
    from fuyou_strategy.optim import schedule as schedule_module

    clock = [0.0]
    monkeypatch.setattr(schedule_module.time, "perf_counter", lambda: clock[0])
    seconds = {BACKWARD: 1.0, NEXT_FORWARD: 0.8}
    chooser = ScheduleChooser("auto", can_speculate=True, probe_after=4, probe_every=10)
    chosen = []
    for _ in range(40):
        schedule, why = chooser.choose()
        chosen.append(schedule)
        clock[0] += seconds[schedule] + (0.5 if chosen[-2:-1] not in ([schedule], []) else 0.0)  # a switch costs
        chooser.end_step(schedule, rolled=False, rollback_s=None)
    assert chosen[:4] == [BACKWARD] * 4, "backward until next_forward is due to be measured"
    assert chosen[4:6] == [NEXT_FORWARD] * 2, "two windows: a transition, then one measured"
    costs = (chooser.cost(BACKWARD), chooser.cost(NEXT_FORWARD))
    assert costs == pytest.approx((1.0, 0.8)), "the switches' cost left out"
    assert chosen[6:16] == [NEXT_FORWARD] * 10, "the faster one kept"
    assert chosen[16:18] == [BACKWARD] * 2 and chosen[18:28] == [NEXT_FORWARD] * 10, "backward measured again"
    assert "vs next_forward 0.8 s" in why
    # the costs change (the planner moved the state): measured anew, backward first
    chooser.forget_costs()
    assert chooser.choose()[0] == BACKWARD and chooser.cost(NEXT_FORWARD) is None
    seconds[BACKWARD] = 0.5  # now backward is the faster: measured, then kept
    chosen = []
    for _ in range(12):
        schedule, _why = chooser.choose()
        chosen.append(schedule)
        clock[0] += seconds[schedule]
        chooser.end_step(schedule, rolled=False, rollback_s=None)
    assert chosen == [BACKWARD] * 4 + [NEXT_FORWARD] * 2 + [BACKWARD] * 6
    # what the choice rests on survives a checkpoint
    again = ScheduleChooser("auto", can_speculate=True, probe_after=4, probe_every=10)
    again.load_state_dict(chooser.state_dict())
    assert again.choose() == chooser.choose() and again.cost(BACKWARD) == 0.5


def test_auto_does_not_measure_next_forward_early_where_the_planner_predicts_it_far_slower(monkeypatch):
    """With the state on the SSD, next_forward leaves only forward to hide the state's traffic under, and its
    early measurement (two windows) slowed short runs. Where the plan's cost model predicts it at least
    `PREDICTED_SLOWER` times backward's step, it is measured only after ``probe_every`` windows, unless
    something rolls back."""
    from fuyou_strategy.optim import schedule as schedule_module

    clock = [0.0]
    monkeypatch.setattr(schedule_module.time, "perf_counter", lambda: clock[0])
    seconds = {BACKWARD: 1.0, NEXT_FORWARD: 1.4}

    def run(chooser, windows, rolled_at=()):
        chosen, reasons = [], []
        for w in range(windows):
            schedule, why = chooser.choose()
            chosen.append(schedule)
            reasons.append(why)
            clock[0] += seconds[schedule]
            chooser.end_step(schedule, rolled=w in rolled_at, rollback_s=0.5 if w in rolled_at else None)
        return chosen, reasons

    far = {BACKWARD: 10.0, NEXT_FORWARD: 10.0 * schedule_module.PREDICTED_SLOWER}
    chooser = ScheduleChooser("auto", can_speculate=True, probe_after=4, probe_every=10)
    chooser.expect(far)
    chosen, reasons = run(chooser, 14)
    assert chosen == [BACKWARD] * 10 + [NEXT_FORWARD] * 2 + [BACKWARD] * 2, "measured at probe_every, then dropped"
    assert "the planner predicts next_forward 12 s a step against backward's 10 s (1.20x)" in reasons[5]
    # a prediction closer than that: measured early, as without one
    near = ScheduleChooser("auto", can_speculate=True, probe_after=4, probe_every=10)
    near.expect({BACKWARD: 10.0, NEXT_FORWARD: 11.9})
    assert run(near, 6)[0] == [BACKWARD] * 4 + [NEXT_FORWARD] * 2
    # a rollback: the model assumed the warm-up's rate of them, so next_forward is measured at once
    rolled = ScheduleChooser("auto", can_speculate=True, probe_after=4, probe_every=10)
    rolled.expect(far)
    assert run(rolled, 4, rolled_at=(1,))[0] == [BACKWARD] * 2 + [NEXT_FORWARD] * 2
    # the prediction survives a checkpoint; an empty one (a plan without a profile) clears it
    again = ScheduleChooser("auto", can_speculate=True, probe_after=4, probe_every=10)
    again.load_state_dict(chooser.state_dict())
    assert again.predicted == far
    again.expect({})
    assert again.predicted == {}
    # without a prediction, ``backward_first`` (the whole state on the SSD) rules it out alike, while it holds
    reason = ["the whole state is on the SSD"]
    ssd = ScheduleChooser("auto", can_speculate=True, probe_after=4, probe_every=10, backward_first=lambda: reason[0])
    chosen, reasons = run(ssd, 6)
    assert chosen == [BACKWARD] * 6 and reasons[5].startswith("the whole state is on the SSD: next_forward not measured")
    reason[0] = None  # the plan moved part of the state into RAM
    assert run(ssd, 2)[0] == [NEXT_FORWARD] * 2


def test_auto_with_the_whole_state_on_the_ssd_keeps_backward_and_says_why(tmp_path):
    """The engine, every state chunk on the SSD, nothing rolling back: ``auto`` runs ``backward`` throughout
    (``next_forward`` would hide the same traffic under forward only) and names the reason; bitwise torch."""
    model = tiny_causal_lm("gpt2")
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, fused=True)
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True),
                         config=config(tmp_path, "auto", host_memory_budget="64MiB", host_state=0))
    try:
        for step in range(STEPS):
            for m, opt in ((ref_model, ref_opt), (model, engine.optimizer)):
                if m is model:
                    engine.begin_micro_batch(update=True)
                m(input_ids=ids(step, 0), labels=ids(step, 0)).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        engine.optimizer.flush()
        stats = engine.optimizer.stats
        assert stats.schedules[NEXT_FORWARD] == 0 and stats.schedules[BACKWARD] == STEPS, stats.history
        assert stats.rollbacks == 0 and "the whole state is on the SSD" in stats.last_reason, stats.last_reason
    finally:
        engine.close()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name


def test_backward_with_one_state_slot_is_refused():
    from fuyou_strategy import ConfigError

    with pytest.raises(ConfigError, match="optimizer_schedule: got 'backward' with state_slots=1"):
        FuyouConfig(optimizer_schedule="backward", state_slots=1)
    with pytest.raises(ConfigError, match="optimizer_schedule: got 'later'"):
        FuyouConfig(optimizer_schedule="later")


def test_state_slots_takes_two_one_or_auto_and_a_lone_optimizer_starts_auto_with_two(tmp_path):
    """``state_slots="auto"`` is the engine's to settle after its warm-up (`FuyouEngine`); an optimizer on its own
    keeps the two slots it starts with, and may speculate. Any other value is refused, naming the three."""
    from fuyou_strategy import ConfigError

    for bad in (3, 0, True, "two"):
        with pytest.raises(ConfigError, match=r"state_slots: got .*; expected 2 .*, 1 .* or 'auto'"):
            FuyouConfig(state_slots=bad)
    opt = FuyouAdamW([torch.nn.Parameter(torch.zeros(8))], lr=1e-3,
                     config=FuyouConfig(swap_dirs=[str(tmp_path)], state_slots="auto"))
    try:
        assert opt.control.state_slots == 2 and opt.control.can_speculate
    finally:
        opt.close()


# -- through the integrations --------------------------------------------------------------------------------
class Validated:
    """Mixed into the Lightning test module: validation_step records the weights it sees (before its forward)."""

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.seen.append([p.detach().clone() for p in self.parameters()])
        return self.model(input_ids=batch, labels=batch).loss


def lightning_run(tmp_path, schedule):
    import lightning as L
    from torch.utils.data import DataLoader

    from fuyou_strategy import FuyouStrategy
    from test_lightning import CausalLM, token_batches

    class Module(Validated, CausalLM):
        pass

    torch.manual_seed(0)
    module = Module()
    module.seen = []
    trainer = L.Trainer(strategy=FuyouStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB",
                                               optimizer_schedule=schedule),
                        accelerator="cpu", devices=1, max_steps=6, accumulate_grad_batches=2, gradient_clip_val=1.0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, val_check_interval=4, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(token_batches(), batch_size=2), DataLoader(token_batches(2, seed=1), batch_size=2))
    summary = trainer.strategy.engine.summary()
    trainer.strategy.engine.close()
    return module, summary


def test_lightning_schedules_are_bitwise_equal_and_validation_sees_the_updated_weights(tmp_path):
    runs = {s: lightning_run(tmp_path, s) for s in SCHEDULES}
    ref, ref_summary = runs["backward"]  # its updates are all in place when step() returns
    assert ref_summary["redos"] >= 1 and ref_summary["commits"] >= 1, "clipping bit on some steps, not all"
    assert len(ref.seen) >= 2, "validation ran in the middle of the epoch"
    for schedule, (module, summary) in runs.items():
        if schedule != "auto":
            assert summary["schedule_steps"][schedule] == 6, summary
        for when, (theirs, ours) in enumerate(zip(ref.seen, module.seen)):
            assert all(torch.equal(a, b) for a, b in zip(theirs, ours)), f"{schedule}: validation {when}"
        for (name, p), q in zip(module.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), f"{schedule}: {name}"
    assert runs["auto"][1]["schedule_steps"]["next_forward"] >= 1, "auto switched after the first rollback"


def test_hf_schedules_are_bitwise_equal_with_evaluation_in_between(tmp_path):
    from transformers import Trainer, TrainingArguments

    from fuyou_strategy import FuyouCallback
    from test_hf import dataset

    results = {}
    for schedule in SCHEDULES:
        model = tiny_causal_lm("gpt2")
        args = TrainingArguments(output_dir=str(tmp_path / schedule / "out"), max_steps=6, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=1e-2, warmup_steps=2,
                                 weight_decay=0.1, report_to=[], save_strategy="no", logging_steps=1, use_cpu=True,
                                 seed=0, disable_tqdm=True, eval_strategy="steps", eval_steps=2)
        callback = FuyouCallback(swap_dirs=[str(tmp_path)], chunk_size="8KiB", optimizer_schedule=schedule)
        trainer = Trainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset(4, seed=1),
                          callbacks=[callback])
        trainer.train()
        evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
        results[schedule] = (model, evals, callback.summary)
    ref, ref_evals, ref_summary = results["backward"]
    assert len(ref_evals) == 3 and ref_summary["redos"] >= 1
    for schedule, (model, evals, summary) in results.items():
        assert evals == ref_evals, f"{schedule}: evaluation saw other weights"
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), f"{schedule}: {name}"
    assert results["next_forward"][2]["deferred"] == 6 and results["next_forward"][2]["rollbacks"] == 0


# -- fp16 with dynamic loss scaling: GradScaler's semantics --------------------------------------------------
FP16_SCALE = [1.0, 1.0, math.inf, 0.01, 1.0, 1.0]  # clipping bites on the x1 steps; step 2 overflows


def fp16_loss(model, step, micro):
    x = ids(step, micro)
    scale = FP16_SCALE[step] if (FP16_SCALE[step] != math.inf or micro == INF_MICRO) else 1.0
    return model(input_ids=x, labels=x).loss * scale / ACCUMULATE


SCALER = dict(init_scale=2.0**12, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)


def gradscaler_reference(model):
    """torch: fp16 forward/backward, fp32 masters, GradScaler + clip_grad_norm_ after unscale_ + fused AdamW."""
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    index = {p: m for p, m in zip(params, masters)}
    groups = [{**g, "params": [index[p] for p in g["params"]]} for g in decay_groups(model)]
    opt = torch.optim.AdamW(groups, lr=3e-3, fused=True)
    scaler, sched = torch.amp.GradScaler("cpu", **SCALER), warmup(opt)
    scales = []
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            scaler.scale(fp16_loss(model, step, micro)).backward()
        for p, m in zip(params, masters):
            m.grad, p.grad = p.grad.float(), None
        gradscaler_step(scaler, opt, params, masters, [m for g in opt.param_groups for m in g["params"]], MAX_NORM)
        sched.step()
        scales.append(scaler.get_scale())
    return masters, scales


def gradscaler_step(scaler, opt, params, masters, clipped, max_norm):
    """torch's fp16 step on fp32 masters holding their gradients: unscale, clip ``clipped`` (in that
    order) to ``max_norm``, step or skip, update the scale; the fp16 weights take the masters' values."""
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(clipped, max_norm)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    with torch.no_grad():
        for p, m in zip(params, masters):
            p.copy_(m)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fp16_loss_scaling_is_gradscaler_and_adamw_bitwise(tmp_path, schedule):
    model = tiny_causal_lm("llama", dtype=torch.float16)
    ref_model = copy.deepcopy(model)
    masters, ref_scales = gradscaler_reference(ref_model)
    opt = FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM, config=config(tmp_path, schedule),
                     loss_scaling=SCALER)
    _, scales = train(model, opt, loss_fn=fp16_loss)
    assert scales == ref_scales, "the scale backed off and grew as GradScaler's did"
    steps = list(zip(scales, scales[1:]))
    assert any(b > a for a, b in steps) and any(b < a for a, b in steps), "both growth and backoff happened"
    assert opt.stats.skips == 1 and opt.stats.clipped >= 1 and opt.stats.steps == STEPS - 1
    for (name, p), q, m in zip(model.named_parameters(), ref_model.parameters(), masters):
        assert p.dtype == torch.float16 and torch.equal(p, q), name
        assert torch.equal(opt.read_state(p)["master"], m.detach()), name
    opt.close()


def test_fp16_scaler_state_resumes_exactly(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    model = tiny_causal_lm("gpt2", dtype=torch.float16)
    resumed_model = copy.deepcopy(model)
    opt = FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM,
                     config=config(tmp_path / "a", "next_forward"), loss_scaling=SCALER)
    train(model, opt, steps=range(3), loss_fn=fp16_loss)  # through the overflow: the scale has backed off
    sd = opt.state_dict(str(tmp_path / "ckpt"))
    _, scales = train(model, opt, steps=range(3, STEPS), loss_fn=fp16_loss)
    opt.close()
    resumed = FuyouAdamW(decay_groups(resumed_model), lr=3e-3, max_grad_norm=MAX_NORM,
                         config=config(tmp_path / "b", "next_forward"), loss_scaling=True)  # state comes from the save
    resumed.load_state_dict(sd)
    expected = {k: v for k, v in SCALER.items() if k != "init_scale"} | {"scale": 2.0**12, "_growth_tracker": 0}
    assert resumed.scaler.state_dict() == expected, "backed off at the overflow, as saved"
    assert train(resumed_model, resumed, steps=range(3, STEPS), loss_fn=fp16_loss)[1] == scales
    resumed.close()
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(p, q), name


def test_fp16_without_loss_scaling_is_refused(tmp_path):
    from fuyou_strategy import ConfigError

    model = tiny_causal_lm("gpt2", dtype=torch.float16)
    with pytest.raises(ConfigError, match="pass loss_scaling=True"):
        FuyouAdamW(model.parameters(), config=config(tmp_path, "auto"))


@pytest.mark.parametrize("precision", ["16-true", "16-mixed"])
def test_lightning_fp16_scales_in_the_optimizer_bitwise_across_schedules(tmp_path, precision):
    """Lightning on the CPU: "16-true" makes the weights fp16 and has no GradScaler: FuyouAdamW scales the
    loss, unscales, clips and skips, with GradScaler's rules. "16-mixed" Lightning itself turns into
    "bf16-mixed" on the CPU (fp16 autocast is a CUDA feature there): no loss scaling is needed or used.
    On CUDA the strategy's copy of the plugin drops Lightning's GradScaler and the optimizer scales."""
    import lightning as L
    from torch.utils.data import DataLoader

    from fuyou_strategy import FuyouStrategy
    from test_lightning import CausalLM, token_batches

    results = {}
    for schedule in SCHEDULES:
        torch.manual_seed(0)
        module = CausalLM()
        trainer = L.Trainer(strategy=FuyouStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB",
                                                   optimizer_schedule=schedule),
                            accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=2, gradient_clip_val=1.0,
                            precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(module, DataLoader(token_batches(), batch_size=2))
        engine = trainer.strategy.engine
        results[schedule] = (module, engine.summary())
        plugin = trainer.strategy.precision_plugin
        if precision == "16-true":
            assert engine.optimizer.scaler is not None and plugin.precision == "16-true"
        else:
            assert plugin.precision == "bf16-mixed" and engine.optimizer.scaler is None, "Lightning's CPU fallback"
        engine.close()
    ref, ref_summary = results["backward"]
    assert ref_summary["optimizer_steps"] == 4
    assert ref_summary["loss_scale"] == (2.0**16 if precision == "16-true" else None)
    dtype = torch.float16 if precision == "16-true" else torch.float32
    for schedule, (module, summary) in results.items():
        assert summary["loss_scale"] == ref_summary["loss_scale"]
        for (name, p), q in zip(module.named_parameters(), ref.parameters()):
            assert p.dtype == dtype and torch.isfinite(p).all() and torch.equal(p, q), f"{schedule}: {name}"


class _Interrupted:
    """A pipeline whose wait for a job is interrupted (Ctrl-C while the next forward waits for an update)."""

    def wait_job(self, job, what):
        raise KeyboardInterrupt


class _Failed:
    def wait_job(self, job, what):
        raise OSError(5, "Input/output error")


def test_a_wait_for_an_update_stays_a_keyboard_interrupt_and_a_failure_says_the_state_is_partly_updated():
    from fuyou_strategy.optim.schedule import PendingUpdates

    param = torch.nn.Parameter(torch.zeros(2))
    interrupted = PendingUpdates(_Interrupted())
    interrupted.add(param, object(), "the update of parameter 0 (2,)")
    with pytest.raises(KeyboardInterrupt):
        interrupted.wait([param])
    failed = PendingUpdates(_Failed())
    failed.add(param, object(), "the update of parameter 0 (2,)")
    with pytest.raises(RuntimeError, match="the update of parameter 0 .2,. failed, so the optimizer state on SSD is "
                                           "partly updated") as excinfo:
        failed.wait([param])
    assert isinstance(excinfo.value.__cause__, OSError)


def test_after_a_failed_update_a_later_wait_raises_at_once_and_names_the_first_failure():
    """A forward must not read weights whose update was queued behind one that failed (the state is partly
    updated): its wait raises without waiting, naming the first failure; the message carries the cause."""
    from fuyou_strategy.optim.schedule import PendingUpdates

    first, second = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    failed = PendingUpdates(_Failed())
    failed.add(first, object(), "the update of parameter 0 (2,)")
    failed.add(second, object(), "the update of parameter 1 (3,)")
    with pytest.raises(RuntimeError, match=r"parameter 0 .* \(the cause: OSError: .*Input/output error\)"):
        failed.wait([first])
    assert isinstance(failed.failed, OSError)
    with pytest.raises(RuntimeError, match=r"parameter 1 \(3,\) cannot land, because an earlier update failed "
                                           r"\(.*Input/output error\)") as excinfo:
        failed.wait([second])
    assert excinfo.value.__cause__ is failed.failed
    assert not failed.jobs


class _Slow:
    """A pipeline whose job lands after ``seconds``."""

    def __init__(self, seconds):
        self.seconds, self.waits = seconds, 0

    def wait_job(self, job, what):
        self.waits += 1
        time.sleep(self.seconds)


def test_a_wait_for_an_update_counts_its_seconds():
    """`PendingUpdates.waited_s` adds the seconds each wait for a job took (the planner's warm-up takes them out of
    the forward it times); a parameter whose update landed already adds nothing."""
    from fuyou_strategy.optim.schedule import PendingUpdates

    first, second = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    pipeline = _Slow(0.05)
    landing = PendingUpdates(pipeline)
    job = object()
    landing.add(first, job, "the update of parameter 0 (2,)")
    landing.add(second, job, "the update of parameter 1 (3,)")  # the same job: waited for once
    assert landing.waited_s == 0.0
    landing.wait([first, second])
    waited = landing.waited_s
    assert waited >= 0.05 and pipeline.waits == 1
    landing.wait([first, second])
    assert landing.waited_s == waited and pipeline.waits == 1
