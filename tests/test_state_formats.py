"""Compact optimizer-state formats (``FuyouConfig.state_format``, `optim.formats`).

The references: torchao's ``AdamW8bit`` for ``"8bit"``, run eagerly (torchao's optimizers wrap the same
function in ``torch.compile``, whose fused code may differ in the last bit; eager, the comparison is bitwise),
and ``torch.optim.AdamW`` with its moments rounded to bf16 after every step for ``"bf16"`` (bitwise). ``"fp32"`` is covered, bitwise against
``torch.optim.AdamW``, by the rest of the suite.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from fuyou_strategy import FuyouConfig
from fuyou_strategy.config import ConfigError
from fuyou_strategy.optim import formats
from fuyou_strategy.optim.adamw import FuyouAdamW
from fuyou_strategy.optim.checkpoint import CheckpointError

pytest.importorskip("torchao.optim.adam")
from torchao.optim import AdamW8bit  # noqa: E402
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402

HYPER = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


def config(tmp_path, fmt: str, **kw) -> FuyouConfig:
    # 64 KiB chunks: 4096 elements per state chunk, so the 12288-element weight spans three chunks
    kw.setdefault("host_memory_budget", "16MiB")
    (tmp_path / "swap").mkdir(parents=True, exist_ok=True)
    return FuyouConfig(swap_dirs=[str(tmp_path / "swap")], chunk_size="64KiB", state_format=fmt, progress=False, **kw)


def params() -> list[torch.nn.Parameter]:
    """A 12288-element weight (8-bit, three chunks), a 5000-element one (8-bit, its last block padded) and a
    96-element bias (fp32 moments: under torchao's 4096-element threshold)."""
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(96, 128)), torch.nn.Parameter(torch.randn(5000) * 0.1),
            torch.nn.Parameter(torch.randn(96) * 0.1)]


def grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(96, 128, generator=g), torch.randn(5000, generator=g) * 3,
            torch.randn(96, generator=g) * 0.01]


def run_fuyou(tmp_path, fmt: str, steps: int, clip: float | None = None, **kw) -> tuple[list, FuyouAdamW]:
    ps = params()
    opt = FuyouAdamW(ps, **HYPER, max_grad_norm=clip, config=config(tmp_path, fmt, **kw))
    for step in range(steps):
        for p, g in zip(ps, grads(step)):
            p.grad = g.clone()
        opt.step()
        opt.zero_grad()
    return ps, opt


@pytest.fixture
def eager(monkeypatch):
    """torchao's optimizers without torch.compile: the same function, eagerly."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)


@pytest.fixture(params=["whole chunks", "tiles"])
def tile(request, monkeypatch):
    """The compact updates over each chunk at once (the 4096-element chunks here are under one `TILE`), or in
    tiles of 1024 elements: four per full chunk, and one whose master ends before its padded codes."""
    if request.param == "tiles":
        monkeypatch.setattr(formats, "TILE", 1024)


def _pad(t: torch.Tensor, n: int) -> torch.Tensor:
    out = t.new_zeros(n)
    out[: t.numel()] = t.reshape(-1)
    return out


@pytest.mark.parametrize("clip", [None, 1.0])
def test_8bit_equals_torchao_adamw8bit(tmp_path, eager, clip, tile):
    """Every parameter bitwise as torchao's AdamW8bit on the same gradients (clipping that bites included):
    the 5000-element one as AdamW8bit on a zero-padded 5120-element copy (torchao only quantises whole
    blocks), the bias with torchao's fp32 moments."""
    steps = 4
    ours, opt = run_fuyou(tmp_path, "8bit", steps, clip)
    assert [ps.layout.moments for ps in opt._params] == ["8bit", "8bit", "fp32"]
    ref = params()
    ref[1] = torch.nn.Parameter(_pad(ref[1].detach(), 5120))
    ropt = AdamW8bit(ref, **HYPER)
    for step in range(steps):
        g = grads(step)
        g[1] = _pad(g[1], 5120)
        for p, gi in zip(ref, g):
            p.grad = gi
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(ref, clip)
            assert norm > clip  # it bites
        ropt.step()
    assert isinstance(ropt.state[ref[0]]["exp_avg"], OptimState8bit)
    assert not isinstance(ropt.state[ref[2]]["exp_avg"], OptimState8bit)
    for i, (p, r) in enumerate(zip(ours, ref)):
        n = p.numel()
        assert torch.equal(p.detach().reshape(-1), r.detach().reshape(-1)[:n]), f"parameter {i}"
        state = opt.read_state(p)
        for kind in ("exp_avg", "exp_avg_sq"):
            want = ropt.state[r][kind]
            want = want.dequantize() if isinstance(want, OptimState8bit) else want
            assert torch.equal(state[kind].reshape(-1), want.reshape(-1)[:n]), f"parameter {i} {kind}"
    opt.close()


@pytest.mark.parametrize("fused", [True, False])
def test_bf16_is_torch_adamw_with_its_moments_rounded_to_bf16(tmp_path, fused, tile):
    """The bf16 format is torch's AdamW (the same kernel, fused or for-loop) whose moments are rounded to bf16
    after every step, chunked or not: bitwise, clipping that bites included."""
    steps = 4
    ours = params()
    opt = FuyouAdamW(ours, **HYPER, max_grad_norm=1.0, fused=fused, config=config(tmp_path, "bf16"))
    ref = params()
    topt = torch.optim.AdamW(ref, **HYPER, fused=fused or None)
    for step in range(steps):
        for p, q, g in zip(ours, ref, grads(step)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        opt.zero_grad()
        assert torch.nn.utils.clip_grad_norm_(ref, 1.0) > 1.0  # it bites
        topt.step()
        for st in topt.state.values():
            for kind in ("exp_avg", "exp_avg_sq"):
                st[kind].copy_(st[kind].bfloat16())
    for i, (p, r) in enumerate(zip(ours, ref)):
        assert torch.equal(p.detach(), r.detach()), f"parameter {i}"
        read = opt.read_state(p)
        assert all(torch.equal(read[k], topt.state[r][k]) for k in ("exp_avg", "exp_avg_sq")), f"parameter {i}"
    opt.close()


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
@pytest.mark.parametrize("slots", [1, 2])
def test_checkpoint_of_each_format_resumes_exactly(tmp_path, fmt, slots):
    """Save after 3 steps, go on 3 more; a fresh optimizer loaded from the save does the same 3 bitwise.
    The save records its format and holds that format's files."""
    ps, opt = run_fuyou(tmp_path, fmt, 3, state_slots=slots)
    sd = opt.state_dict(tmp_path / "ckpt")
    save = tmp_path / "ckpt" / sd["fuyou"]["token"]
    meta = json.loads((save / "optimizer.json").read_text())
    assert meta["state_format"] == fmt
    assert sorted(p.name for p in save.glob("*.bin")) == sorted(f"{k}.bin" for k in formats.StateFormat(fmt).kinds)
    for step in range(3, 6):
        for p, g in zip(ps, grads(step)):
            p.grad = g.clone()
        opt.step()
        opt.zero_grad()
    after = [p.detach().clone() for p in ps]
    opt.close()

    ps2 = params()
    opt2 = FuyouAdamW(ps2, **HYPER, config=config(tmp_path / "b", fmt, state_slots=slots))
    opt2.load_state_dict(sd)
    for step in range(3, 6):
        for p, g in zip(ps2, grads(step)):
            p.grad = g.clone()
        opt2.step()
        opt2.zero_grad()
    for a, b in zip(after, ps2):
        assert torch.equal(a, b.detach())
    opt2.close()


def test_loading_another_format_is_refused(tmp_path):
    ps, opt = run_fuyou(tmp_path, "8bit", 2)
    sd = opt.state_dict(tmp_path / "ckpt")
    opt.close()
    before = [p.detach().clone() for p in params()]
    ps2 = params()
    opt2 = FuyouAdamW(ps2, **HYPER, config=config(tmp_path / "b", "fp32"))
    with pytest.raises(CheckpointError, match=r"state_format='8bit'.*state_format='fp32'.*nothing was loaded"):
        opt2.load_state_dict(sd)
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, ps2))  # nothing changed
    opt2.close()


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_host_ram_split_is_bitwise_the_ssd(tmp_path, fmt):
    """A compact state split between host RAM and the SSD gives the weights of the state all on the SSD."""
    on_ssd, opt = run_fuyou(tmp_path / "a", fmt, 3, host_state=0)
    opt.close()
    ram, opt = run_fuyou(tmp_path / "b", fmt, 3, host_state="128KiB")
    on_disk, in_ram = opt.adam_state.footprint()
    assert on_disk > 0 and in_ram > 0  # a mixed split
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(on_ssd, ram))
    opt.close()


def test_state_bytes_per_format(tmp_path):
    """The state entries take the format's bytes: 12, 8 and 6 + 8/256 per parameter and slot for large
    parameters, plus at most a page of padding per chunk (each chunk starts on a page)."""
    per_param = {"fp32": 12, "bf16": 8, "8bit": 6 + 8 / 256}  # 8bit: a code per moment, a fp32 scale per 256
    for fmt, want in per_param.items():
        _ps, opt = run_fuyou(tmp_path / fmt, fmt, 1, host_state=0)
        on_ssd, in_ram = opt.adam_state.footprint()
        assert in_ram == 0
        big = opt._params[0]  # 12288 elements in three chunks of 4096
        assert big.layout.nbytes(big.numel) == want * big.numel
        assert want * big.numel <= big.nbytes < want * big.numel + 4096 * (big.nchunks - 1)
        assert on_ssd >= 2 * sum(ps.nbytes for ps in opt._params)  # two slots
        opt.close()


def test_unknown_format_names_the_field():
    with pytest.raises(ConfigError, match=r"state_format: got 'int4'.*'fp32', 'bf16', '8bit'"):
        FuyouConfig(state_format="int4")


def test_missing_torchao_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "_TORCHAO", None)
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import fails
    with pytest.raises(ConfigError, match=r"pip install 'fuyou-strategy\[compact\]'"):
        FuyouAdamW(params(), config=config(tmp_path, "8bit"))


@pytest.fixture
def quantise_small(monkeypatch):
    """The tests' tiny models have no parameter of 4096 elements: quantise those of 512 and more, so that
    their 8-bit path runs (a 3232-element embedding with a padded last block included)."""
    monkeypatch.setattr(formats, "MIN_8BIT", 512)


@pytest.mark.parametrize("integration", ["lightning", "hf"])
def test_through_lightning_and_hf_an_8bit_state_trains_and_a_split_changes_no_bit(tmp_path, quantise_small,
                                                                                 integration):
    """The integrations' own runs (6 steps, 2 micro-batches each, clipping that bites) with ``state_format="8bit"``:
    the summary says so and counts fewer state bytes than fp32; the weights stay close to fp32's (lr 1e-2: within
    5e-3 on average per tensor); a host-RAM split of the 8-bit state changes no bit."""
    from test_host_state import _hf, _lightning

    run = _lightning if integration == "lightning" else _hf
    for name in ("fp32", "ssd", "split"):
        (tmp_path / name).mkdir()
    exact, exact_summary = run(tmp_path / "fp32", host_state=0)
    on_ssd, summary = run(tmp_path / "ssd", host_state=0, state_format="8bit")
    split, split_summary = run(tmp_path / "split", host_state="64KiB", state_format="8bit")
    assert summary["state_format"] == "8bit" and exact_summary["state_format"] == "fp32"
    assert summary["ssd_bytes_optimizer_state"] < 0.75 * exact_summary["ssd_bytes_optimizer_state"]
    assert split_summary["host_bytes_optimizer_state"] > 0
    assert summary["redos"] + summary["clipped"] > 0, "clipping bit"
    for (name, p), q, e in zip(on_ssd.named_parameters(), split.parameters(), exact.parameters()):
        assert torch.equal(p, q), name
        # Close to fp32 on average; single elements can move further: where a block's second moment spans more than
        # the 8-bit map's range, a small one quantises to zero and that element's step is m / eps (torchao's and
        # bitsandbytes' 8-bit Adam alike). Whether that costs training is the convergence benchmark's question.
        assert (p - e).abs().mean() <= 5e-3, name


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_quantiser_gives_torchaos_codes_bitwise(signed):
    """`Quantiser` (one bucketize against exact thresholds) against torchao's ``quantize_8bit_with_qmap`` on random
    scaled values, on every threshold and on both its fp32 neighbours, on the map's own values and on zeros."""
    q = formats._torchao()
    qmap, thresholds = q.qmap[signed], q.quantiser[signed].thresholds
    low = -1.0 if signed else 0.0
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(1 << 20, generator=g) * (1 - low) + low, thresholds, qmap,
                   torch.nextafter(thresholds, torch.tensor(-2.0)), torch.nextafter(thresholds, torch.tensor(2.0)),
                   torch.tensor([0.0, -0.0, 1.0, low])]).clamp(low, 1.0)
    assert torch.equal(q.quantiser[signed].codes(x), q.quantize_8bit_with_qmap(x, qmap))
    assert torch.all(thresholds[1:] > thresholds[:-1])  # one threshold per interval, in order


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_quantisers_lookups_equal_bucketize_and_torchaos_values(signed):
    """`Quantiser.codes` looks the code up by the value's top 16 bits and steps past the thresholds inside that
    interval: it must equal ``bucketize`` over the thresholds for every fp32 value but NaN. Checked here on both
    ends and a random middle of each of the 65,536 intervals, every threshold and its neighbours, infinities and
    zeros (all 2**32 patterns: ``state_format_bench.py --quantiser``). `Quantiser.values` must equal torchao's
    ``dequant_with_qmap`` for every code."""
    q = formats._torchao()
    quantiser, qmap = q.quantiser[signed], q.qmap[signed]
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    middle = top | torch.randint(0, 1 << 16, (1 << 16,), generator=torch.Generator().manual_seed(0))
    bits = torch.cat([top, top | 0xFFFF, middle])
    x = formats.fp32_of_bits(bits)
    t = quantiser.thresholds
    x = torch.cat([x, t, torch.nextafter(t, torch.tensor(-2.0)), torch.nextafter(t, torch.tensor(2.0)),
                   torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf")])])
    x = x[~x.isnan()]
    assert quantiser.steps >= 1  # some interval holds a threshold inside it, so the steps are exercised
    assert torch.equal(quantiser.codes(x), torch.bucketize(x, t, right=True).to(torch.uint8))
    codes = torch.arange(1 << 16).remainder(256).to(torch.uint8)  # every code, in 256 blocks
    scale = torch.rand(codes.numel() // formats.BLOCK, generator=torch.Generator().manual_seed(1)) + 0.5
    assert torch.equal(quantiser.values(codes, scale), q.dequant_with_qmap(codes, qmap, scale))
