"""FuyouAdamW against torch.optim.AdamW: exact numerics, accumulation, clipping, skips, errors."""

import copy
import math
import os
import time

import pytest
import torch

from conftest import decay_groups, tiny_causal_lm
from fuyou_strategy import ConfigError, FuyouAdamW, FuyouConfig
from fuyou_strategy.storage import aio

STEPS = 5
ACCUMULATE = 3
MAX_NORM = 0.5
# Loss scale per optimizer step: large-scale steps make clipping bite, small ones do not.
LOSS_SCALE = [0.01, 1.0, 0.01, 1.0, 1.0]
# Where `small_config`'s optimizer state lives: the device tier, host RAM, the SSD.
TIERS = [dict(device_state="1MiB", host_state=0), dict(host_state="512KiB"), dict(host_state=0)]


def small_config(tmp_path, **overrides):
    # 24 KiB chunks (2048 elements of [master | exp_avg | exp_avg_sq]): most weights span several chunks.
    values = dict(swap_dirs=[str(tmp_path)], chunk_size="24KiB", host_memory_budget="1MiB", io_threads=2)
    values.update(overrides)
    return FuyouConfig(**values)


def batches(step, micro, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + step * 10 + micro)
    return torch.randint(0, 101, (2, 16), generator=g)


def warmup(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def train_fuyou(model, opt, steps=STEPS):
    sched = warmup(opt)
    for step in range(steps):
        for micro in range(ACCUMULATE):
            last = micro == ACCUMULATE - 1
            with opt.no_update() if not last else torch.enable_grad():
                (lm_loss(model, batches(step, micro)) * LOSS_SCALE[step] / ACCUMULATE).backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def train_reference(model, opt, steps=STEPS, max_norm=MAX_NORM):
    sched = warmup(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    for step in range(steps):
        for micro in range(ACCUMULATE):
            (lm_loss(model, batches(step, micro)) * LOSS_SCALE[step] / ACCUMULATE).backward()
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        opt.zero_grad()
        sched.step()


def max_rel_diff(a_params, b_params):
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
               for a, b in zip(a_params, b_params))


@pytest.mark.parametrize("family,fused", [("gpt2", True), ("llama", True), ("llama", False)])
def test_matches_torch_adamw_with_schedule_groups_accumulation_and_clipping(tmp_path, family, fused):
    model = tiny_causal_lm(family)
    fused_ref = copy.deepcopy(model)
    # backward pinned: the speculative path (redos, commits) is what this test checks, and on the CPU with the
    # state in RAM "auto" takes next_forward outright
    opt = FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM, fused=fused,
                     config=small_config(tmp_path, optimizer_schedule="backward"))
    assert any(ps.nchunks > 1 for ps in opt._params), "the test must cover multi-chunk parameters"
    train_fuyou(model, opt)
    # Clipping must have bitten on some steps and not on others, or a path went untested.
    assert opt.stats.redos >= 1 and opt.stats.commits >= 1 and opt.stats.skips == 0, opt.stats

    # fused=None is torch's default: the for-loop kernel on the CPU.
    ref_opt = torch.optim.AdamW(decay_groups(fused_ref), lr=3e-3, fused=fused or None)
    train_reference(fused_ref, ref_opt)
    # Bitwise: the same kernel on the same gradients, chunk by chunk.
    for p, r in zip(model.parameters(), fused_ref.parameters()):
        assert torch.equal(p, r)
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
        for p, r in zip(group["params"], ref_group["params"]):
            state = opt.read_state(p)
            assert torch.equal(state["master"], r)
            assert torch.equal(state["exp_avg"], ref_opt.state[r]["exp_avg"])
            assert torch.equal(state["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"])
            assert opt.state[p]["step"].item() == ref_opt.state[r]["step"].item() == STEPS

    opt.close()


@pytest.mark.parametrize("dtype,fused,tolerance", [
    # fp32 against the default (for-loop) AdamW: a different kernel, so not bitwise.
    (torch.float32, False, 1e-6),
    # bf16 compute weights: the global norm is accumulated in fp32 from bf16 grads here and
    # from fp32 copies in the reference, so the clip coefficient may differ in the last bit.
    (torch.bfloat16, True, 1e-6),
])
def test_fp32_masters_match_adamw_on_the_same_gradients(tmp_path, dtype, fused, tolerance):
    model = tiny_causal_lm("llama", dtype=dtype)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = FuyouAdamW(model.parameters(), lr=3e-3, max_grad_norm=MAX_NORM,
                     config=small_config(tmp_path, optimizer_schedule="backward"))  # redos and commits, below
    ref_opt = torch.optim.AdamW(masters, lr=3e-3, fused=fused)
    worst = 0.0
    for step in range(STEPS):
        (lm_loss(model, batches(step, 0)) * LOSS_SCALE[step]).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()  # the reference sees exactly the gradients we saw
        opt.step()
        opt.zero_grad()
        torch.nn.utils.clip_grad_norm_(masters, MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
        for p, m in zip(model.parameters(), masters):
            master = opt.read_state(p)["master"]
            worst = max(worst, ((master - m.detach()).abs().max() / m.detach().abs().max()).item())
            assert torch.equal(p.detach(), master.to(dtype)), "compute weights are the (rounded) masters"
    assert opt.stats.redos >= 1 and opt.stats.commits >= 1
    assert worst <= tolerance, f"max relative difference {worst:.3g} > {tolerance}"
    print(f"{dtype} fused={fused}: max relative difference {worst:.3g}")
    opt.close()


def test_slow_io_changes_nothing(tmp_path, monkeypatch):
    """Synchronisation is by futures, not timing: a drive 1000x slower gives the same bits."""
    model = tiny_causal_lm("gpt2")
    slow_model = copy.deepcopy(model)
    fast = FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=MAX_NORM, config=small_config(tmp_path / "a"))
    train_fuyou(model, fast, steps=3)

    real_w, real_r = aio._pwritev, aio._preadv

    def slowly(real):
        def call(*args):
            time.sleep(0.002)
            return real(*args)
        return call

    monkeypatch.setattr(aio, "_pwritev", slowly(real_w))
    monkeypatch.setattr(aio, "_preadv", slowly(real_r))
    slow = FuyouAdamW(decay_groups(slow_model), lr=3e-3, max_grad_norm=MAX_NORM, config=small_config(tmp_path / "b"))
    train_fuyou(slow_model, slow, steps=3)
    for p, q in zip(model.parameters(), slow_model.parameters()):
        assert torch.equal(p, q)
    fast.close()
    slow.close()


@pytest.fixture(autouse=True)
def _dirs(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()


def test_non_finite_gradient_skips_the_step_and_touches_nothing(tmp_path):
    model = tiny_causal_lm("gpt2")
    opt = FuyouAdamW(model.parameters(), lr=3e-3, config=small_config(tmp_path))
    lm_loss(model, batches(0, 0)).backward()
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    states = [opt.read_state(p) for p in model.parameters()]
    steps = [opt.state[p]["step"].item() for p in model.parameters()]

    (lm_loss(model, batches(1, 0)) * math.inf).backward()
    opt.step()
    assert opt.stats.skips == 1 and opt.stats.commits == 1 and not math.isfinite(opt.stats.last_grad_norm)
    for p, b, s, n in zip(model.parameters(), before, states, steps):
        assert torch.equal(p.detach(), b), "the speculative update must be undone"
        after = opt.read_state(p)
        assert all(torch.equal(after[k], s[k]) for k in s)
        assert opt.state[p]["step"].item() == n
    opt.close()


def test_accumulating_without_no_update_is_an_error_not_a_wrong_update(tmp_path):
    # A graph that saves no weight, so the second backward cannot trip autograd's own
    # version check (which guards the same misuse when weights are saved) before ours.
    w = torch.nn.Parameter(torch.randn(64, 64))
    before = w.detach().clone()
    opt = FuyouAdamW([w], lr=3e-3, config=small_config(tmp_path, optimizer_schedule="backward"))  # queued in backward
    (w * 2.0).sum().backward()
    (w * 3.0).sum().backward()  # the update queued by the first backward used a partial gradient
    with pytest.raises(RuntimeError, match="accumulated again after its update was queued; wrap .*no_update"):
        opt.step()
    assert torch.equal(w.detach(), before), "the speculative update is undone"
    assert opt.stats.commits == 0
    opt.close()


def test_release_grads_without_clipping(tmp_path):
    model = tiny_causal_lm("gpt2")
    ref = copy.deepcopy(model)
    opt = FuyouAdamW(model.parameters(), lr=3e-3, config=small_config(tmp_path))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    for step in range(2):
        lm_loss(model, batches(step, 0)).backward()
        opt.step()
        assert all(p.grad is None for p in model.parameters()), "consumed gradients are dropped"
        lm_loss(ref, batches(step, 0)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), ref.parameters()))
    opt.close()


def test_frozen_parameters_are_ignored(tmp_path):
    model = tiny_causal_lm("gpt2")
    model.transformer.wte.weight.requires_grad_(False)
    frozen = model.transformer.wte.weight.detach().clone()
    opt = FuyouAdamW(model.parameters(), lr=1e-2, config=small_config(tmp_path))
    assert all(p is not model.transformer.wte.weight for g in opt.param_groups for p in g["params"])
    lm_loss(model, batches(0, 0)).backward()
    opt.step()
    assert torch.equal(model.transformer.wte.weight, frozen)
    opt.close()


def test_closure_and_hand_set_gradients(tmp_path):
    w = torch.nn.Parameter(torch.randn(10, 10))
    ref = w.detach().clone().requires_grad_()
    opt = FuyouAdamW([w], lr=0.1, config=small_config(tmp_path, optimizer_schedule="backward"))  # commits, below
    ref_opt = torch.optim.AdamW([ref], lr=0.1, fused=True)
    grad = torch.randn(10, 10)
    w.grad, ref.grad = grad.clone(), grad.clone()  # no backward: hooks never fire
    opt.step()
    ref_opt.step()
    assert torch.equal(w, ref)

    def closure():
        opt.zero_grad()
        loss = (w ** 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() > 0 and opt.stats.commits == 2
    opt.close()


def test_works_with_a_stock_scheduler_and_close_removes_files(tmp_path):
    model = torch.nn.Linear(8, 8)
    opt = FuyouAdamW(model.parameters(), lr=1.0, config=small_config(tmp_path))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
    run_dir = opt.store.run_dirs[0]
    with opt:
        pass
    assert not (tmp_path / run_dir).exists()
    model(torch.randn(2, 8)).sum().backward()  # hooks are gone: nothing is queued after close


@pytest.mark.parametrize("kwargs,match", [
    (dict(amsgrad=True), "amsgrad=True is not supported"),
    (dict(maximize=True), "maximize=True is not supported"),
    (dict(momentum=0.9), "momentum=0.9 is not supported"),
    (dict(max_grad_norm=0.0), "max_grad_norm: got 0.0"),
    (dict(betas=(0.9, 1.0)), r"betas: got \(0.9, 1.0\)"),
])
def test_unsupported_options_are_clear_errors(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        FuyouAdamW(torch.nn.Linear(4, 4).parameters(), config=small_config(tmp_path), **kwargs)


def test_bad_models_are_clear_errors(tmp_path):
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameter"):
        FuyouAdamW(frozen.parameters(), config=small_config(tmp_path))
    with pytest.raises(ConfigError, match="float16: fp16 compute weights need loss scaling"):
        FuyouAdamW(torch.nn.Linear(4, 4).half().parameters(), config=small_config(tmp_path))
    with pytest.raises(ConfigError, match=r"parameter 1 \(0, 4\) has no elements, so no state to keep; leave it out"):
        FuyouAdamW([torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.empty(0, 4))], config=small_config(tmp_path))
    with pytest.raises(ConfigError, match="chunk_size: got 1.00 MiB, larger than host_memory_budget"):
        FuyouAdamW(torch.nn.Linear(4, 4).parameters(), config=small_config(tmp_path, host_memory_budget="64KiB", chunk_size="1MiB"))
    assert list(tmp_path.glob("fuyou-run-*")) == [], "a refused optimizer leaves no files"


def test_a_dropped_optimizer_releases_its_thread_and_swap_files(small_config):
    """The model outlives its optimizer (a Trainer dropped after fit): the parameters' hooks must
    not keep the optimizer, its worker thread and its swap files alive."""
    import gc

    model = torch.nn.Linear(8, 8)
    opt = FuyouAdamW(model.parameters(), config=small_config)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    run_dir = opt.store.run_dirs[0]
    thread = opt.adam_state.pipeline._thread
    del opt
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the optimizer's worker thread outlived the optimizer"
    assert not os.path.exists(run_dir), "the optimizer's swap files outlived the optimizer"
    model(torch.randn(2, 8)).sum().backward()  # the hooks left on the model are harmless
    assert model.weight.grad is not None


@pytest.mark.parametrize("fused", [None, False, True])
def test_an_optimizer_that_leaves_fused_unset_keeps_the_for_loop_kernel_and_says_how_to_get_the_fast_one(tmp_path,
                                                                                                        fused):
    """Converting keeps torch's kernel choice (fused=None is the for-loop kernel on the CPU, bitwise), and only an
    unset flag earns the hint: an explicit fused=False is the user's choice."""
    from fuyou_strategy import FuyouEngine

    model = tiny_causal_lm("llama")
    said = []
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused),
                         config=small_config(tmp_path), report=said.append)
    try:
        assert engine.optimizer.fused is bool(fused)
    finally:
        engine.close()
    hints = [line for line in said if "fused=None" in line]
    if fused is None:
        assert len(hints) == 1 and "fused=True" in hints[0], said
    else:
        assert hints == [], said


def _threads_in_worker(opt):
    """The intra-op threads the optimizer's worker thread runs its ops with."""
    from fuyou_strategy.optim import ChunkJob
    seen = []
    opt.adam_state.run(ChunkJob(None, 1, lambda k: seen.append(torch.get_num_threads())))
    opt.adam_state.drain()
    return seen[0]


def test_the_worker_takes_the_cores_the_training_thread_leaves_and_the_numbers_do_not_change(tmp_path):
    """On the CPU, ``optimizer_threads="auto"`` gives the worker the cores the training thread's team leaves (one,
    at least), set for the worker alone; any count gives bitwise the same weights and state as torch, with
    parameters large enough (128K elements) that the kernels and norms split their work over the threads."""
    from fuyou_strategy.device import usable_cores
    training = torch.get_num_threads()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.GELU(), torch.nn.Linear(256, 512))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    runs = {}
    for threads in ("auto", 1, 2):
        m = copy.deepcopy(model)
        opt = FuyouAdamW(m.parameters(), lr=3e-3, max_grad_norm=MAX_NORM,
                         config=small_config(tmp_path, chunk_size="1MiB", host_memory_budget="16MiB",
                                             optimizer_threads=threads))
        try:
            expected = max(1, usable_cores() - training) if threads == "auto" else threads
            assert _threads_in_worker(opt) == expected
            assert opt.adam_state.pipeline.threads == expected
            assert torch.get_num_threads() == training  # the training thread's own count is left alone
            for step in range(STEPS):
                (m(x).pow(2).mean() * LOSS_SCALE[step] * 300).backward()
                opt.step()
                opt.zero_grad()
            assert 1 <= opt.stats.clipped < STEPS, opt.stats  # clipping bit on some steps, not all
            runs[threads] = ([p.detach().clone() for p in m.parameters()],
                             [opt.read_state(p)["exp_avg_sq"] for p in m.parameters()])
        finally:
            opt.close()
    for step in range(STEPS):
        (ref(x).pow(2).mean() * LOSS_SCALE[step] * 300).backward()
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
    for threads, (weights, moments) in runs.items():
        for w, v, r in zip(weights, moments, ref.parameters()):
            assert torch.equal(w, r), threads
            assert torch.equal(v, ref_opt.state[r]["exp_avg_sq"]), threads


def step_some(opt, ref, params, masters, step, given):
    """One step of fuyou's ``opt`` and torch's ``ref`` where only the parameters ``given`` (indices) have a gradient,
    the same one on both sides, drawn from the step and the index."""
    for i in given:
        g = torch.randn(params[i].shape, generator=torch.Generator().manual_seed(100 * step + i))
        params[i].grad, masters[i].grad = g.clone(), g.clone()
    opt.step()
    ref.step()
    opt.zero_grad()
    ref.zero_grad()


@pytest.mark.parametrize("schedule", ["next_forward", "backward"])
@pytest.mark.parametrize("tier", TIERS, ids=["device", "ram", "ssd"])
def test_each_step_count_is_torchs_0d_tensor_and_advances_only_with_its_own_update(tmp_path, schedule, tier):
    """``state[p]["step"]`` as torch keeps it (a 0-d fp32 tensor, in the state dict too): a parameter with no
    gradient in a step keeps its count while the others' advance, and the weights stay torch's; in RAM and on the
    device tier, where the updates of a step share a job, each reads its own count."""
    import io

    params = [torch.nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(i))) for i in range(4)]
    masters = [p.detach().clone().requires_grad_() for p in params]
    ref = torch.optim.AdamW(masters, lr=3e-3, fused=True)
    opt = FuyouAdamW(params, lr=3e-3, config=small_config(tmp_path, optimizer_schedule=schedule, **tier))
    try:
        for step, given in enumerate([range(4), [0, 2], [2, 3], range(4)]):
            step_some(opt, ref, params, masters, step, given)
        counts = [opt.state[p]["step"] for p in params]
        assert all(c.dtype == torch.float32 and c.dim() == 0 for c in counts)
        assert [float(c) for c in counts] == [float(ref.state[m]["step"]) for m in masters] == [3.0, 2.0, 4.0, 3.0]
        assert all(torch.equal(p, m) for p, m in zip(params, masters))
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        saved = torch.load(io.BytesIO(buffer.getvalue()))
        assert [float(saved["state"][i]["step"]) for i in range(4)] == [3.0, 2.0, 4.0, 3.0]
    finally:
        opt.close()


@pytest.mark.parametrize("schedule", ["next_forward", "backward"])
@pytest.mark.parametrize("tier", TIERS[:2], ids=["device", "ram"])
def test_updates_sharing_a_job_each_read_their_own_step_count(tmp_path, schedule, tier):
    """In RAM and on the device tier the updates of consecutive parameters share a job (`group_job`): with the
    parameters' counts apart (some had no gradient in some steps), each update's bias correction takes its own
    count, so the weights and counts stay torch's."""
    params = [torch.nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(i))) for i in range(5)]
    masters = [p.detach().clone().requires_grad_() for p in params]
    ref = torch.optim.AdamW(masters, lr=3e-3, fused=True)
    with FuyouAdamW(params, lr=3e-3, config=small_config(tmp_path, optimizer_schedule=schedule, **tier)) as opt:
        for step, given in enumerate([[0, 2, 4], [1, 2], [0, 1, 3], [2, 3, 4], range(5), [1, 3, 4]]):
            step_some(opt, ref, params, masters, step, given)
            assert all(torch.equal(p, m) for p, m in zip(params, masters)), step
        assert [float(opt.state[p]["step"]) for p in params] == [float(ref.state[m]["step"]) for m in masters]


@pytest.mark.parametrize("tier", TIERS, ids=["device", "ram", "ssd"])
@pytest.mark.parametrize("schedule", ["next_forward", "backward"])
def test_new_weights_reach_a_parameter_whose_memory_was_replaced_between_steps(tmp_path, tier, schedule):
    """``param.data = ...`` (what ``module.to`` does) between steps: each later update's new weight lands in the
    parameter's new memory, not in the old one a kept view still holds; bitwise torch's AdamW."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (7, 300, 5000)]
    refs = [p.detach().clone().requires_grad_() for p in params]
    opt = FuyouAdamW(params, lr=0.1, max_grad_norm=1.0, fused=True,
                     config=small_config(tmp_path, optimizer_schedule=schedule, **tier))
    ref_opt = torch.optim.AdamW(refs, lr=0.1, fused=True)
    for step in range(4):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, r, g in zip(params, refs, grads):
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        opt.flush()
        torch.nn.utils.clip_grad_norm_(refs, 1.0)
        ref_opt.step()
        for p, r in zip(params, refs):
            assert torch.equal(p, r), (step, p.numel())
            p.data = p.data.clone()  # the old memory, still alive, must not be the one written next
    opt.close()
