"""Device-dependent tests on the device ``FUYOU_TEST_DEVICE`` names (the `compute_device` fixture: the CPU
by default, ``cuda`` on a GPU machine, as `benchmarks/gpu_check.py` runs them). Existing suites take the
fixture too: every activation policy's bitwise gradients (test_activations.py) and LoRA over streamed
weights on every tier (test_weights.py).

On the CPU they run in every suite (and under the late-copy mode in CI's second pass); on a GPU they
exercise what the CPU cannot: pinned buffers, side-stream copies waited for through events,
``record_stream``, the device's own autocast and loss scaling, and NCCL with two GPUs.

Every comparison is against torch on the same gradients: fuyou's update runs torch's own AdamW
kernel on the host, so the reference runs ``AdamW(fused=True)`` on host fp32 masters holding the
device's gradients, and the two agree bitwise.
"""

import copy

import pytest
import torch

from conftest import tiny_causal_lm
from fuyou_strategy import FuyouAdamW, FuyouConfig, FuyouEngine
from test_schedule import SCALER, gradscaler_step

STEPS = 4
LOSS_SCALE = [0.01, 1.0, 0.01, 1.0]  # clipping bites on the x1 steps only
MAX_NORM = 0.5


def ids(step, device):
    return torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(step)).to(device)


def config(tmp_path, **overrides):
    values = dict(swap_dirs=[str(tmp_path)], chunk_size="8KiB", host_memory_budget="2MiB", activation_min_bytes=0)
    values.update(overrides)
    return FuyouConfig(**values)


def test_the_optimizer_on_the_device_is_adamw_fused_on_the_same_gradients_bitwise(tmp_path, compute_device):
    model = tiny_causal_lm("llama").to(compute_device)
    masters = [p.detach().cpu().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(masters, lr=3e-3, fused=True)
    # backward pinned: commits are checked below ("auto" takes next_forward on the CPU with the state in RAM)
    opt = FuyouAdamW(model.parameters(), lr=3e-3, max_grad_norm=MAX_NORM, fused=True,
                     config=config(tmp_path, optimizer_schedule="backward"))
    try:
        for step in range(STEPS):
            x = ids(step, compute_device)
            (model(input_ids=x, labels=x).loss * LOSS_SCALE[step]).backward()
            for m, p in zip(masters, model.parameters()):
                m.grad = p.grad.detach().cpu()  # the reference sees exactly the device's gradients
            opt.step()
            opt.zero_grad()
            torch.nn.utils.clip_grad_norm_(masters, MAX_NORM)
            ref.step()
            ref.zero_grad()
        assert opt.stats.clipped >= 1 and opt.stats.commits >= 1, opt.stats
        for p, m in zip(model.parameters(), masters):
            assert p.device.type == compute_device.type
            assert torch.equal(opt.read_state(p)["master"], m.detach())
            assert torch.equal(p.detach().cpu(), m.detach()), "the device weights are the masters"
    finally:
        opt.close()


def test_fp16_on_the_device_is_gradscaler_and_adamw_bitwise(tmp_path, compute_device):
    fp16_beside_gradscaler(tmp_path, compute_device)


@pytest.mark.parametrize("pool", ["spares", "full"])
def test_a_half_precision_weight_on_the_device_is_written_by_the_pass_into_a_host_buffer(tmp_path, compute_device,
                                                                                          monkeypatch, pool):
    """An fp16 (or bf16) parameter on an accelerator (on the CPU, in the late-copy mode) gets each chunk's new weight
    from the one pass, written in its dtype into a host buffer and copied in (`Publisher.start_land`); one in host
    memory gets it in place. When the pool spares no buffer, the fp32 master is copied in as before. The weights
    are GradScaler's and AdamW's bitwise either way."""
    from fuyou_strategy.device import read_on_host
    from fuyou_strategy.optim.updates import Publisher
    from fuyou_strategy.storage import HostBufferPool

    landed, land = [], Publisher.start_land

    def counted(ps, k, weight):
        landed.append(weight.dtype)
        return land(ps, k, weight)

    monkeypatch.setattr(Publisher, "start_land", staticmethod(counted))
    if pool == "full":  # the read-ahead's try_acquire too: it reads nothing ahead, which changes no bit
        monkeypatch.setattr(HostBufferPool, "try_acquire", lambda self, nbytes, keep_free=0: None)
    kernel = fp16_beside_gradscaler(tmp_path, compute_device)
    if kernel == "one_pass" and pool == "spares" and read_on_host(torch.empty(1, device=compute_device)):
        assert landed and set(landed) == {torch.float16}
    else:
        assert landed == []


def fp16_beside_gradscaler(tmp_path, compute_device) -> str:
    """An fp16 model on ``compute_device`` trained by fuyou with loss scaling and clipping, beside torch's GradScaler
    and fused AdamW on host fp32 masters holding the same gradients; checks every weight bitwise and returns the update
    kernel that ran."""
    model = tiny_causal_lm("llama", dtype=torch.float16).to(compute_device)
    ref_model = copy.deepcopy(model)
    params = list(ref_model.parameters())
    masters = [p.detach().float().cpu().clone().requires_grad_() for p in params]
    ref = torch.optim.AdamW(masters, lr=3e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", **SCALER)  # on the host masters, where fuyou's update runs too
    opt = FuyouAdamW(model.parameters(), lr=3e-3, max_grad_norm=MAX_NORM, config=config(tmp_path), loss_scaling=SCALER)
    try:
        scales, ref_scales = [], []
        for step in range(STEPS):
            x = ids(step, compute_device)
            scale = LOSS_SCALE[step] if step != 2 else float("inf")  # step 2 overflows: skipped, the scale backs off
            opt.scale_loss(model(input_ids=x, labels=x).loss * scale).backward()
            opt.step()
            opt.zero_grad()
            scales.append(opt.scaler.get_scale())
            scaler.scale(ref_model(input_ids=x, labels=x).loss * scale).backward()
            for p, m in zip(params, masters):
                m.grad, p.grad = p.grad.float().cpu(), None
            gradscaler_step(scaler, ref, params, masters, masters, MAX_NORM)
            ref_scales.append(scaler.get_scale())
        assert scales == ref_scales and opt.stats.skips == 1
        for p, q in zip(model.parameters(), params):
            assert p.dtype == torch.float16 and torch.equal(p, q)
        return opt.control.figures().update_kernel
    finally:
        opt.close()


def test_streamed_weights_in_a_device_budget_below_the_models_train_like_resident_ones(tmp_path, compute_device):
    def train(weights):
        model = tiny_causal_lm("llama").to(compute_device)
        (tmp_path / weights).mkdir()
        engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
                             config=config(tmp_path / weights, weights=weights, weight_prefetch_blocks=0),
                             max_grad_norm=1e-3)
        try:
            for step in range(3):
                engine.begin_micro_batch(update=True)
                x = ids(step, compute_device)
                model(input_ids=x, labels=x).loss.backward()
                engine.optimizer.step()
                engine.optimizer.zero_grad()
            summary = engine.summary()
        finally:
            engine.close()  # a streamed weight's device storage is released between uses: read it after close
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}, summary

    resident, _ = train("device")
    streamed, summary = train("ssd")
    assert summary["weight_tiers"] == {0: "ssd", 1: "ssd"}
    assert 0 < summary["weight_device_peak_bytes"] < summary["weight_bytes_streamed"], \
        "the streamed blocks were never all on the device at once"
    assert resident.keys() == streamed.keys()
    for name in resident:
        assert torch.equal(resident[name], streamed[name]), name


def test_lightning_with_streamed_weights_on_the_device_ends_fit_with_the_module_on_the_cpu(tmp_path, compute_device):
    """Lightning's teardown moves the module to the CPU. Streamed weights are released on the device between
    uses (their storage freed); they go to the CPU empty, their values served from their tier copies, and
    train exactly like resident ones. (On the first GPU run ``module.cpu()`` copied a released storage:
    "CUDA error: invalid argument".)"""
    from test_lightning import fit

    from fuyou_strategy import FuyouStrategy

    accelerator = "gpu" if compute_device.type == "cuda" else "cpu"

    def run(tag, **fields):
        strategy = FuyouStrategy(swap_dirs=[str(tmp_path / tag)], chunk_size="8KiB", **fields)
        (tmp_path / tag).mkdir()
        module, trainer = fit(strategy, steps=4, accelerator=accelerator)
        return module, trainer

    resident, _ = run("resident")
    streamed, trainer = run("streamed", weights={0: "ssd", 1: "host"})
    assert trainer.strategy.engine.summary()["weight_bytes_trainable_streamed"] > 0
    assert {p.device.type for p in streamed.parameters()} == {"cpu"}, "Lightning's teardown moves the module"
    ours, ref = streamed.state_dict(), resident.state_dict()
    assert ours.keys() == ref.keys()
    for name in ref:
        assert torch.equal(ours[name].cpu(), ref[name].cpu()), name
    trainer.strategy.engine.close()  # every weight resident again, on the CPU now
    for (name, p), (_, q) in zip(streamed.named_parameters(), resident.named_parameters()):
        assert p.device.type == "cpu" and torch.equal(p, q.cpu()), name


def test_two_ranks_over_nccl_sum_like_one_process(tmp_path, compute_device):
    if compute_device.type != "cuda" or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (NCCL); test_distributed.py covers data parallel with gloo on the CPU")
    import torch.multiprocessing as mp
    mp.spawn(_nccl_rank, args=(2, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0].keys() == ranks[1].keys()
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), f"{name}: the ranks' weights differ"
    # one process on the sum of the ranks' gradients, as DDP averages them
    model = tiny_causal_lm("llama").to("cuda:0")
    masters = [p.detach().cpu().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(masters, lr=3e-3, fused=True)
    for step in range(STEPS):
        grads = []
        for rank in range(2):
            model.zero_grad(set_to_none=True)
            x = ids(step * 2 + rank, "cuda:0")
            model(input_ids=x, labels=x).loss.backward()
            grads.append([p.grad.detach().cpu() for p in model.parameters()])
        for m, g0, g1 in zip(masters, *grads):
            m.grad = (g0 + g1) / 2
        ref.step()
        ref.zero_grad()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
    for (name, _), m in zip(model.named_parameters(), masters):
        torch.testing.assert_close(ranks[0][name], m.detach(), rtol=1e-6, atol=1e-7)


def _nccl_rank(rank, world, tmp):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        model = tiny_causal_lm("llama").to(f"cuda:{rank}")
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
        engine = FuyouEngine(ddp, torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True),
                             config=FuyouConfig(swap_dirs=[tmp], chunk_size="8KiB"), process_group=dist.group.WORLD)
        try:
            for step in range(STEPS):
                engine.begin_micro_batch(update=True)
                x = ids(step * 2 + rank, f"cuda:{rank}")
                ddp(input_ids=x, labels=x).loss.backward()
                engine.optimizer.step()
                engine.optimizer.zero_grad()
            engine.optimizer.flush()
        finally:
            engine.close()
        torch.save({n: p.detach().cpu() for n, p in model.named_parameters()}, f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_device_tier_updates_on_the_device_bitwise_adamw_fused_there(tmp_path, compute_device):
    """``device_state``: the first parameters' state on the compute device, updated there by torch's fused AdamW;
    the rest on the SSD, updated on the host. Each parameter matches ``AdamW(fused=True)`` run where its update
    runs (the device's kernel, or the host's on the device's gradients), bitwise. No clipping: on an accelerator
    a device-tier gradient's norm is taken on the device, whose bits ``clip_grad_norm_``'s need not share."""
    from test_device_state import placement

    model = tiny_causal_lm("llama").to(compute_device)
    opt = FuyouAdamW(model.parameters(), lr=3e-3, fused=True, release_grads=False,
                     config=config(tmp_path, optimizer_schedule="backward", device_state="160KiB", host_state=0))
    try:
        where = dict(zip((ps.param for ps in opt.adam_state.owned), placement(opt)))
        assert set(where.values()) == {"device", "ssd"}, where
        masters = [p.detach().clone() if where[p] == "device" else p.detach().cpu().clone() for p in model.parameters()]
        refs = [torch.optim.AdamW([m.requires_grad_()], lr=3e-3, fused=True) for m in masters]
        for step in range(STEPS):
            x = ids(step, compute_device)
            (model(input_ids=x, labels=x).loss * LOSS_SCALE[step]).backward()
            for m, p in zip(masters, model.parameters()):
                m.grad = p.grad.detach().to(m.device, copy=True)
            opt.step()
            opt.zero_grad()
            for ref in refs:
                ref.step()
                ref.zero_grad()
        for p, m in zip(model.parameters(), masters):
            assert p.device.type == compute_device.type
            assert torch.equal(opt.read_state(p)["master"], m.detach().cpu())
            assert torch.equal(p.detach(), m.detach().to(p.device))
    finally:
        opt.close()


def test_the_plans_device_tier_grows_after_the_first_planned_step_to_what_that_step_left(tmp_path, compute_device,
                                                                                         monkeypatch):
    """``device_state="auto"`` with the planner on an accelerator: at the plan the tier is bounded by the warm-up's
    headroom (made 150 KiB here, as a warm-up that kept every activation of a large model leaves little); the
    allocator's cache is released, and after the first planned step the tier grows to what that step left free: here
    the whole state. The allocator's peak statistics are kept. The CPU's device is host RAM, where the tier does not
    move: test_device_state.py checks the engine's steps there, with the CPU standing in for the accelerator."""
    if compute_device.type != "cuda":
        pytest.skip("an accelerator's memory; test_device_state.py checks the engine's steps on the CPU")
    import fuyou_strategy.engine as engine_module
    from test_device_state import placement

    monkeypatch.setattr(engine_module, "device_memory_headroom", lambda device: 150 * 1024)
    model = tiny_causal_lm("llama").to(compute_device)
    said, sizes = [], []  # per step: (planned, the tier's bytes after it)
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), report=said.append,
                         config=config(tmp_path, activations="auto", planner_warmup_steps=2, host_state=0))
    opt = engine.optimizer
    try:
        for step in range(6):
            engine.begin_micro_batch(update=True)
            x = ids(step, compute_device)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            sizes.append((engine.plan is not None, opt.store.bytes_on_device))
            if step == 0:
                warm_up_peak = torch.cuda.max_memory_allocated(compute_device)
            assert torch.isfinite(loss).item()
        where = placement(opt)
        peak = torch.cuda.max_memory_allocated(compute_device)
    finally:
        engine.close()
    at = [planned for planned, _n in sizes].index(True)  # the step whose end applied the plan
    assert all(n == 0 for _planned, n in sizes[:at]), sizes  # nothing during the warm-up
    assert sizes[at][1] <= 150 * 1024 < sizes[at + 1][1] == sizes[-1][1], sizes
    assert set(where) == {"device"}, where
    assert any("the first step under it left" in line for line in said), said
    assert peak >= warm_up_peak  # not reset


@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize("max_norm", [MAX_NORM, None])
def test_a_step_decided_on_the_device_tier_is_clip_grad_norm_and_adamw_fused_there_bitwise(tmp_path, compute_device,
                                                                                          max_norm, kernel):
    """All the state on the device tier, ``next_forward``: on an accelerator (and in the late-copy mode) step() keeps
    the global norm, the clip coefficient and the non-finite flag on the device (`Parts.decide`). The reference is
    torch there: ``clip_grad_norm_`` as it runs by default (on an accelerator ``_foreach_norm``, one call for the
    list, as `gradients.device_norms` takes them; on the CPU a norm per tensor, or the one pass's kernel with torch's
    bits) and ``AdamW(fused=True)``, the step skipped when the norm is not finite (GradScaler's rule). Clipping bites
    on some steps; one step's gradient is infinite."""
    import math

    from fuyou_strategy.device import read_on_host
    from test_device_state import placement

    model = tiny_causal_lm("llama").to(compute_device)
    masters = [p.detach().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(masters, lr=3e-3, fused=True)
    opt = FuyouAdamW(model.parameters(), lr=3e-3, max_grad_norm=max_norm, fused=True, release_grads=False,
                     config=config(tmp_path, optimizer_schedule="next_forward", device_state="1MiB", host_state=0,
                                   update_kernel=kernel))
    assert set(placement(opt)) == {"device"}
    scales = [*LOSS_SCALE, math.inf, 1.0]
    try:
        for step, scale in enumerate(scales):
            x = ids(step, compute_device)
            (model(input_ids=x, labels=x).loss * scale).backward()
            for m, p in zip(masters, model.parameters()):
                m.grad = p.grad.detach().clone()
            opt.step()
            opt.zero_grad()
            if max_norm is None:
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in masters]))
            else:
                norm = torch.nn.utils.clip_grad_norm_(masters, max_norm)
            if math.isfinite(norm):
                ref.step()
            ref.zero_grad()
        # decided on the device where its work is queued (an accelerator; the late-copy mode), else on the host
        assert bool(opt._parts.unsettled) == read_on_host(masters[0])
        assert opt.stats.skips == 1 and opt.stats.steps == len(scales) - 1
        assert (opt.stats.clipped >= 1) == (max_norm is not None), opt.stats
        for p, m in zip(model.parameters(), masters):
            assert torch.equal(p.detach(), m.detach())
            assert float(opt.state[p]["step"]) == float(ref.state[m]["step"])
    finally:
        opt.close()


def test_a_host_tensor_sent_to_the_device_without_waiting_lands_whole_though_its_source_is_dropped(compute_device):
    """`device.to_device` (the step counts and factors a device-tier update takes): on an accelerator a pinned copy
    queued without the thread waiting for the device; each lands with its value and dtype though the host tensor
    it came from is dropped at once and the next one made (the caching host allocator must not hand its block
    out again before the copy ran). On the CPU the tensor itself."""
    from fuyou_strategy.device import to_device

    busy = torch.randn(512, 512, device=compute_device)
    landed = []
    for i in range(64):
        busy = busy @ busy / 512  # queued work the copies need not wait for
        landed.append(to_device(torch.tensor([float(i), i + 0.5]), compute_device))
    assert all(t.device.type == compute_device.type and t.dtype == torch.float32 for t in landed)
    assert torch.equal(torch.stack(landed).cpu(), torch.tensor([[float(i), i + 0.5] for i in range(64)]))


def test_a_staged_weight_copies_in_beside_the_next_chunks_pass_and_lands_before_step_returns(tmp_path, compute_device,
                                                                                                  monkeypatch):
    """A bf16 parameter of several chunks with its state in RAM, in the late-copy mode where every copy lands 20 ms
    after it starts (on the CPU, as on an accelerator, the copy runs on the mode's thread): each chunk's new weight,
    written by the one pass into a host buffer, is copied in while the next chunk's pass runs
    (`OptimizerState.update_job`); a buffer goes back to the pool only once its copy landed (the next chunk's pass
    would write into it), and the last one has landed when step() returns. The weights are AdamW(fused=True)'s
    masters in bf16, bitwise, after every step."""
    from fuyou_strategy import device
    from fuyou_strategy.device import late_copies
    from fuyou_strategy.optim.updates import Publisher

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(8 * 2048).to(torch.bfloat16).to(compute_device))
    master = param.detach().float().cpu().requires_grad_()
    ref = torch.optim.AdamW([master], lr=1e-2, fused=True)
    started, in_flight, start_land = [], [], Publisher.start_land

    def start(ps, k, weight):  # records whether the chunk before's copy into the parameter is still landing
        started.append(k)
        in_flight.append(device._late._pending.get(param.untyped_storage().data_ptr(), 0) > 0)
        return start_land(ps, k, weight)

    monkeypatch.setattr(Publisher, "start_land", staticmethod(start))
    with late_copies(max_delay_ms=20.0, min_delay_ms=20.0, seed=0):
        opt = FuyouAdamW([param], lr=1e-2, fused=True,
                         config=config(tmp_path, optimizer_schedule="next_forward", host_memory_budget="8MiB"))
        try:
            chunks = opt._params[0].nchunks
            for step in range(3):
                param.grad = torch.randn(param.shape).to(torch.bfloat16).to(compute_device)
                master.grad = param.grad.float().cpu()
                opt.step()
                opt.zero_grad()
                ref.step()
                ref.zero_grad()
                assert torch.equal(param.detach().cpu(), master.detach().to(torch.bfloat16)), step
            kernel = opt.control.figures().update_kernel
        finally:
            opt.close()
    assert chunks >= 4 and started == (list(range(chunks)) * 3 if kernel == "one_pass" else []), (kernel, started)
    assert in_flight == ([False] + [True] * (chunks - 1)) * 3 if kernel == "one_pass" else [], in_flight
