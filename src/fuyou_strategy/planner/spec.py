"""Model and hardware descriptions for ``fuyou plan``: a `Profile` without instantiating anything.

**Models.** `ModelSpec` holds a decoder-only transformer's shape. Presets:

- ``gpt3-13b``, ``gpt3-175b``: Brown et al. 2020 ("Language Models are Few-Shot Learners"),
  Table 2.1: 40 layers × 5120 (40 heads) and 96 layers × 12288 (96 heads), context 2048,
  vocabulary 50257, FFN 4× hidden, GeLU.
- ``llama-70b``: Touvron et al. 2023 ("Llama 2"), and its ``config.json``: 80 layers × 8192,
  64 heads with 8 key-value heads, FFN 28672 (SwiGLU), vocabulary 32000, context 4096.

A Hugging Face ``config.json`` (GPT-2 or Llama-style keys) is read the same way.

**Per-block costs** (per micro-batch of ``b`` sequences of ``s`` tokens, hidden ``h``):

- FLOPs: forward ``2·b·s·P_block + 4·b·s²·h`` (matmuls plus attention scores and context),
  backward twice that; time = FLOPs ÷ (peak × ``efficiency``).
- Saved activations in 16-bit, FlashAttention-style (no s×s score matrix kept):
  ``b·s·h·(15 + 19·ffn/(4h))`` bytes, Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models"), whose 34·sbh for GPT splits into 15 (attention)
  and 19 (MLP with ffn = 4h); the MLP part is scaled to the actual FFN width.

**Hardware.** `Hardware` presets (peak dense bf16 tensor TFLOPS and memory from the vendors'
data sheets; the device↔host link is PCIe, effective ≈ 80% of the raw rate):

- ``rtx4090``: 24 GB, 82.6 TFLOPS (Ada whitepaper: FP16/BF16 tensor with FP32 accumulate,
  which GeForce runs at half the 165 TFLOPS FP16-accumulate rate), PCIe 4.0 x16 → 25 GB/s;
- ``a100-80g``: 80 GB, 312 TFLOPS, PCIe 4.0 → 25 GB/s;
- ``h100``: 80 GB, 989 TFLOPS (SXM), PCIe 5.0 → 50 GB/s;
- ``cpu``: no accelerator (device = host RAM), 1 TFLOPS, memcpy-speed "link" of 10 GB/s.

SSDs: per drive 3.5 GB/s read and 3.0 GB/s write by default (a PCIe 4.0 NVMe's sustained
rates are higher; these are conservative); ``--ssds N`` drives are striped, so bandwidth
scales with N. CPU AdamW throughput defaults to 1e9 parameters/s (a multi-core server with
a vectorised kernel). ``efficiency`` (default 0.5) is the fraction of peak FLOPS reached.

**Weights.** Fuyou keeps 16-bit compute weights and gradients on the device when they fit.
When they do not (e.g. 175B on a 24 GB GPU), the what-if models them streamed per block from
host memory (or from SSD when the host cannot hold them): 2 bytes per parameter in for the
forward and again for the backward, and 2 bytes of gradient out. **The runtime does not do
this yet** (weights must fit the device today); the planner shows what it would cost.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from ..config import ConfigError, parse_bytes
from .cost import BlockProfile, Profile

__all__ = ["ModelSpec", "Hardware", "MODEL_PRESETS", "HARDWARE_PRESETS", "analytic_profile", "step_flops"]

GB = 1e9


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    kv_heads: int | None = None
    gated_mlp: bool = False  # SwiGLU (three FFN matrices) vs GeLU (two)
    context: int = 2048

    @property
    def block_params(self) -> int:
        kv = self.hidden * (self.kv_heads or self.heads) // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return attention + mlp + 4 * self.hidden  # + norms/biases, roughly

    @property
    def other_params(self) -> int:
        return self.vocab * self.hidden * (1 if not self.gated_mlp else 2) + self.context * self.hidden * (not self.gated_mlp)

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.other_params

    @classmethod
    def from_hf_config(cls, path: str | os.PathLike) -> "ModelSpec":
        """Read a Hugging Face ``config.json`` (GPT-2 or Llama-style keys)."""
        with open(path) as f:
            c = json.load(f)

        def get(*keys: str, default: int | None = None) -> int | None:
            for key in keys:
                if key in c:
                    return c[key]
            return default

        hidden = get("hidden_size", "n_embd", "d_model")
        layers = get("num_hidden_layers", "n_layer", "num_layers")
        heads = get("num_attention_heads", "n_head")
        if not (hidden and layers and heads):
            raise ConfigError(f"{os.fspath(path)}: needs hidden_size/n_embd, num_hidden_layers/n_layer and "
                              "num_attention_heads/n_head")
        gated = c.get("model_type") in ("llama", "mistral", "qwen2", "gemma") or "intermediate_size" in c and c.get("hidden_act") == "silu"
        return cls(name=os.path.basename(os.path.dirname(os.path.abspath(path))) or "config", layers=layers, hidden=hidden,
                   heads=heads, ffn=get("intermediate_size", "n_inner", default=None) or 4 * hidden,
                   vocab=get("vocab_size", default=32000), kv_heads=get("num_key_value_heads", default=None),
                   gated_mlp=bool(gated), context=get("max_position_embeddings", "n_positions", default=2048))


MODEL_PRESETS = {
    "gpt3-13b": ModelSpec("gpt3-13b", layers=40, hidden=5120, heads=40, ffn=4 * 5120, vocab=50257),
    "gpt3-175b": ModelSpec("gpt3-175b", layers=96, hidden=12288, heads=96, ffn=4 * 12288, vocab=50257),
    "llama-70b": ModelSpec("llama-70b", layers=80, hidden=8192, heads=64, ffn=28672, vocab=32000, kv_heads=8,
                           gated_mlp=True, context=4096),
}


@dataclass(frozen=True)
class Hardware:
    name: str
    device_memory: int  # bytes
    tflops: float  # peak dense 16-bit
    link_gbps: float  # device <-> host, GB/s each way
    host_memory: int = 768 * 10**9
    ssds: int = 1
    ssd_read_gbps: float = 3.5  # per drive
    ssd_write_gbps: float = 3.0
    adam_params_per_s: float = 1e9
    efficiency: float = 0.5
    device_is_host: bool = False


HARDWARE_PRESETS = {
    "rtx4090": Hardware("rtx4090", device_memory=24 * 10**9, tflops=82.6, link_gbps=25),
    "a100-80g": Hardware("a100-80g", device_memory=80 * 10**9, tflops=312, link_gbps=25),
    "h100": Hardware("h100", device_memory=80 * 10**9, tflops=989, link_gbps=50),
    "cpu": Hardware("cpu", device_memory=0, tflops=1.0, link_gbps=10, device_is_host=True),
}


def step_flops(model: ModelSpec, batch: int, seq: int) -> float:
    """Training FLOPs of one micro-batch (forward + backward = 3 × forward), blocks and head."""
    tokens = batch * seq
    fwd = model.layers * (2 * tokens * model.block_params + 4 * batch * seq * seq * model.hidden)
    fwd += 2 * tokens * model.vocab * model.hidden  # the LM head
    return 3 * fwd


def analytic_profile(model: ModelSpec, hw: Hardware, *, batch: int, seq: int, micro_batches: int = 1,
                     prefetch_blocks: int = 2, host_reserve: int | str = "8GiB") -> Profile:
    """A `Profile` from shapes and data-sheet numbers (see the module docstring)."""
    rate = hw.tflops * 1e12 * hw.efficiency
    tokens = batch * seq
    fwd = (2 * tokens * model.block_params + 4 * batch * seq * seq * model.hidden) / rate
    act = int(tokens * model.hidden * (15 + 19 * model.ffn / (4 * model.hidden)))
    link = hw.link_gbps * GB
    ssd_rd, ssd_wr = hw.ssds * hw.ssd_read_gbps * GB, hw.ssds * hw.ssd_write_gbps * GB
    blocks = [BlockProfile(fwd_s=fwd, bwd_s=2 * fwd, act_bytes=act, params=model.block_params)] * model.layers
    head_fwd = 2 * tokens * model.vocab * model.hidden / rate
    weights = 4 * model.params  # 16-bit weights + 16-bit gradients
    host_reserve = parse_bytes(host_reserve, name="host_reserve")
    device_memory = None if hw.device_is_host else hw.device_memory
    notes = {"weights": "device"}
    device_base = weights
    if device_memory is not None and weights + act > device_memory:
        # Weights do not fit: stream them per block (2 B in for forward, 2 B in for backward, 2 B of
        # gradient out) from host memory, or from SSD when the host cannot hold them either.
        from_host = 2 * model.params + host_reserve <= hw.host_memory
        notes["weights"] = "streamed from host" if from_host else "streamed from ssd"
        per_block = model.block_params * 2
        in_flight = 3 * per_block  # this block's weights and gradients, and the next block's weights
        device_base = in_flight + 4 * model.other_params
        blocks = [replace(b, fwd_s=max(b.fwd_s, per_block / link), bwd_s=max(b.bwd_s, 2 * per_block / link))
                  for b in blocks]
        if not from_host:
            blocks = [replace(b, fwd_s=max(b.fwd_s, per_block / ssd_rd),
                              bwd_s=max(b.bwd_s, per_block / ssd_rd + per_block / ssd_wr)) for b in blocks]
    optimizer_host = min(hw.host_memory, host_reserve)
    host_budget = hw.host_memory - (2 * model.params if notes["weights"] == "streamed from host" else 0)
    return Profile(
        blocks=list(blocks), other_fwd_s=head_fwd, other_bwd_s=2 * head_fwd, other_params=model.other_params,
        link_bytes_per_s=link, ssd_read_bytes_per_s=ssd_rd, ssd_write_bytes_per_s=ssd_wr,
        adam_params_per_s=hw.adam_params_per_s, weight_upload_bytes_per_param=0.0 if hw.device_is_host else 2.0,
        device_base_bytes=device_base, optimizer_host_bytes=optimizer_host, micro_batches=micro_batches,
        prefetch_blocks=prefetch_blocks, device_budget=device_memory, host_budget=max(0, host_budget),
        blocking_swap_out=False,  # Fuyou's design: copies on a side stream (the runtime's CUDA path blocks today)
        ssd_budget=None, source="analytic",
        notes={**notes, "model": model.name, "hardware": hw.name, "batch": batch, "seq": seq,
               "flops_per_step": step_flops(model, batch, seq) * micro_batches, "params": model.params,
               "host_reserve_bytes": host_reserve},
    )
