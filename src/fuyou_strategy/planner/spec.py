"""Model and hardware descriptions for ``fuyou plan``: a `Profile` without instantiating anything.

**Models** (`ModelSpec`; a Hugging Face ``config.json`` with GPT-2 or Llama-style keys reads the same way):

- ``gpt3-13b``, ``gpt3-175b``: Brown et al. 2020 ("Language Models are Few-Shot Learners"), Table 2.1:
  40 layers × 5120 (40 heads) and 96 × 12288 (96 heads), context 2048, vocabulary 50257, FFN 4× hidden, GeLU.
- ``llama-70b``: Touvron et al. 2023 ("Llama 2") and its ``config.json``: 80 layers × 8192, 64 heads with 8
  key-value heads, FFN 28672 (SwiGLU), vocabulary 32000, context 4096.
- ``llama-7b``: the same paper and ``meta-llama/Llama-2-7b-hf``'s ``config.json``: 32 layers × 4096, 32 heads,
  FFN 11008 (SwiGLU), vocabulary 32000, context 4096 (6.7B parameters).
- ``gpt2-350m``, ``gpt2-1.5b``: Radford et al. 2019 ("Language Models are Unsupervised Multitask Learners"),
  Table 2: 24 layers × 1024 and 48 × 1600; 16 and 25 heads, context 1024 and vocabulary 50257 from the
  ``gpt2-medium`` and ``gpt2-xl`` ``config.json``; FFN 4× hidden, GeLU, tied embeddings (355M and 1.56B
  parameters).

**Per-block costs** (a micro-batch of ``b`` sequences of ``s`` tokens, hidden ``h``):

- FLOPs: forward ``2·b·s·P_block + 4·b·s²·h``, backward twice that; time = FLOPs ÷ (peak × ``efficiency``).
- Saved activations, 16-bit, no s×s scores kept: ``b·s·h·(15 + 19·ffn/(4h))`` bytes (Korthikanti et al. 2022,
  "Reducing Activation Recomputation": GPT's 34·sbh is 15 attention + 19 MLP at ffn = 4h; the MLP part scaled).
- Weights: 16-bit, ``2·P_block`` bytes per block, gradients as many.

**TFLOPS** (`step_flops`), printed twice: *model FLOPs*, forward + backward, ``3 × (2·P·tokens +
4·b·s²·h·layers)`` plus the LM head, recomputation not counted; and *Fuyou's paper's count*, every block's
forward twice (Megatron-LM's ``96·B·s·l·h²·(1 + s/6h + V/16lh)``, Narayanan et al. 2021), about 4/3 of the
model FLOPs. The paper's count is inferred from its numbers: its 156 TFLOPS for GPT-3 13B on an RTX 4090 is
71% of peak in this count but 94% in model FLOPs, above what the matmuls alone reach; it also reproduces the
paper's SSD sweep (``tests/test_planner.py``).

**Hardware** (`Hardware`: peak dense 16-bit tensor TFLOPS with FP32 accumulation; memory from data sheets):

- ``rtx4090``: 24 GB; 165.2 TFLOPS (NVIDIA Ada whitepaper, FP16/BF16 with FP32 accumulate, dense; the 330.3
  FP16-accumulate rate is never used by PyTorch's cuBLAS calls, pytorch/pytorch#123157). ``efficiency`` 0.96:
  ``torch.matmul`` fp16 at n=8192 measures 158.6 TFLOPS (mli/transformers-benchmarks#4; 162.6 on a second card,
  JustAResearcher/gpu-unlock-ada, evidence rtx4090-595.91.07), applied to every FLOP (elementwise kernels not
  modelled). Link: PCIe 4.0 x16, 31.5 GB/s raw each way; copies measure 24–27 GB/s and share about that both
  ways (NVIDIA/nvbandwidth#15) → 25 GB/s, one resource for both directions;
- ``a100-80g``: 80 GB, 312 TFLOPS, PCIe 4.0 → 25 GB/s;
- ``h100``: 80 GB, 989 TFLOPS (SXM), PCIe 5.0 → 50 GB/s;
- ``h200``: H200 SXM (NVIDIA's data sheet): 141 GB of HBM3e at 4.8 TB/s, 989 TFLOPS dense BF16 (the H100 SXM's
  tensor cores), PCIe 5.0 → 50 GB/s as ``h100``; CPU AdamW 0.5e9 parameters/s, what this project measured with
  torch's kernel on the 16 cores of the H200 machine it is lent (0.46–0.6e9, docs/gpu.md);
- ``cpu``: device = host RAM, 1 TFLOPS, a memcpy-speed "link" of 10 GB/s.

**Device AdamW** (the optimizer state's device tier, `Profile.device_adam_params_per_s`): the memory bandwidth
(data sheets: RTX 4090 1,008 GB/s; A100 80 GB SXM 2,039 GB/s; H100 SXM 3.35 TB/s; H200 4.8 TB/s) over the 28 bytes
per parameter one pass of torch's fused AdamW moves in fp32: master, gradient and both moments read (16), master
and moments written (12). An upper bound: the kernel reaches a share of the bandwidth, and mixed precision adds the
16-bit gradient's cast and the weight's copy from the master (12 bytes more), neither counted.

``efficiency`` for presets other than ``rtx4090`` is assumed (0.5). SSDs: per drive 6.5 GB/s read and 3.4 GB/s
write, the Intel D7-P5510 3.84 TB of Fuyou's machine, sequential (Intel's specification; capacity assumed);
``--ssds N`` drives are striped, reads and writes sharing them. CPU AdamW (but ``h200``'s, measured): 1e9
parameters/s, assumed (the paper gives none); the paper's SSD sweep stays within ±20% of the model for 0.75e9 to
1.5e9.

**Weights.** 16-bit weights and gradients stay on the device when they fit; else every block's weights get the
``host`` tier (``ssd`` when the host cannot hold them), streamed per block as the runtime does (`cost.predict`);
the embeddings and head stay resident.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..config import ConfigError, parse_bytes
from .cost import BlockProfile, Profile

__all__ = ["ModelSpec", "Hardware", "MODEL_PRESETS", "HARDWARE_PRESETS", "analytic_profile", "step_flops"]

GB = 1e9
FUSED_ADAMW_BYTES_PER_PARAM = 28  # one pass of torch's fused AdamW in fp32: 4 tensors read, 3 written (docstring)


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
    "llama-7b": ModelSpec("llama-7b", layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000, gated_mlp=True,
                          context=4096),
    "gpt2-350m": ModelSpec("gpt2-350m", layers=24, hidden=1024, heads=16, ffn=4 * 1024, vocab=50257, context=1024),
    "gpt2-1.5b": ModelSpec("gpt2-1.5b", layers=48, hidden=1600, heads=25, ffn=4 * 1600, vocab=50257, context=1024),
}


@dataclass(frozen=True)
class Hardware:
    """A machine for the what-if; every figure and its source is in the module docstring."""

    name: str
    device_memory: int  # bytes
    tflops: float  # peak dense 16-bit tensor, FP32 accumulation
    link_gbps: float  # device <-> host, GB/s (one resource for both directions)
    host_memory: int = 768 * 10**9
    ssds: int = 1
    ssd_read_gbps: float = 6.5  # per drive: Intel D7-P5510 3.84 TB
    ssd_capacity: int = 384 * 10**10  # per drive, bytes: the same drive (3.84 TB)
    ssd_write_gbps: float = 3.4
    adam_params_per_s: float = 1e9  # the host CPU's AdamW
    efficiency: float = 0.5  # fraction of ``tflops`` reached
    device_is_host: bool = False
    memory_gbps: float = 0.0  # the device memory's bandwidth, GB/s (0: the device is host RAM)

    @property
    def device_adam_params_per_s(self) -> float | None:
        """torch's fused AdamW on the device, parameters/s: the memory bandwidth over the bytes one pass moves
        (module docstring); ``None`` without a device of its own."""
        return self.memory_gbps * GB / FUSED_ADAMW_BYTES_PER_PARAM if self.memory_gbps else None


HARDWARE_PRESETS = {
    "rtx4090": Hardware("rtx4090", device_memory=24 * 10**9, tflops=165.2, link_gbps=25, efficiency=0.96,
                        memory_gbps=1008),
    "a100-80g": Hardware("a100-80g", device_memory=80 * 10**9, tflops=312, link_gbps=25, memory_gbps=2039),
    "h100": Hardware("h100", device_memory=80 * 10**9, tflops=989, link_gbps=50, memory_gbps=3350),
    "h200": Hardware("h200", device_memory=141 * 10**9, tflops=989, link_gbps=50, memory_gbps=4800,
                     adam_params_per_s=0.5e9),
    "cpu": Hardware("cpu", device_memory=0, tflops=1.0, link_gbps=10, device_is_host=True),
}


def step_flops(model: ModelSpec, batch: int, seq: int, *, recompute: bool = False) -> float:
    """Training FLOPs of one micro-batch, blocks and LM head: forward + backward (3 forwards), or
    with ``recompute`` one more forward of every block, as Fuyou's paper counts (module docstring)."""
    tokens = batch * seq
    blocks = model.layers * (2 * tokens * model.block_params + 4 * batch * seq * seq * model.hidden)
    head = 2 * tokens * model.vocab * model.hidden
    return (4 if recompute else 3) * blocks + 3 * head


def analytic_profile(model: ModelSpec, hw: Hardware, *, batch: int, seq: int, micro_batches: int = 1,
                     prefetch_blocks: int = 2, host_reserve: int | str = "8GiB", gpus: int = 1) -> Profile:
    """A `Profile` from shapes and data-sheet numbers (module docstring). ``gpus`` > 1: data parallel on one
    machine (`Profile.data_parallel`), each rank planning its host-tier weights and activations within 1/N of
    the host memory beyond the optimizer's share; the FLOPs in the notes are all GPUs'."""
    rate = hw.tflops * 1e12 * hw.efficiency
    tokens = batch * seq
    fwd = (2 * tokens * model.block_params + 4 * batch * seq * seq * model.hidden) / rate
    act = int(tokens * model.hidden * (15 + 19 * model.ffn / (4 * model.hidden)))
    link = hw.link_gbps * GB
    ssd_rd, ssd_wr = hw.ssds * hw.ssd_read_gbps * GB, hw.ssds * hw.ssd_write_gbps * GB
    host_reserve = parse_bytes(host_reserve, name="host_reserve")
    device_memory = None if hw.device_is_host else hw.device_memory
    # Weights stream (from host if it holds them, else SSD) unless they and their gradients fit beside one
    # block's activations. Each rank keeps its own host-tier weights; ``host_reserve`` is the machine's, once.
    host_share = host_reserve + (hw.host_memory - host_reserve) // gpus
    tier = "device"
    if device_memory is not None and 4 * model.params + act > device_memory:
        tier = "host" if 2 * model.params + host_reserve <= host_share else "ssd"
    block = BlockProfile(fwd_s=fwd, bwd_s=2 * fwd, act_bytes=act, params=model.block_params,
                         weight_bytes=2 * model.block_params, weight_tier=tier)
    head_fwd = 2 * tokens * model.vocab * model.hidden / rate
    device_base = 4 * model.other_params  # the blocks' weights and gradients: `cost.predict` adds them per tier
    notes = {"weights": "device" if tier == "device" else f"streamed from {tier}"}
    return Profile(
        blocks=[block] * model.layers, other_fwd_s=head_fwd, other_bwd_s=2 * head_fwd, other_params=model.other_params,
        link_bytes_per_s=link, ssd_read_bytes_per_s=ssd_rd, ssd_write_bytes_per_s=ssd_wr,
        adam_params_per_s=hw.adam_params_per_s, weight_upload_bytes_per_param=0.0 if hw.device_is_host else 2.0,
        **({"device_adam_params_per_s": hw.device_adam_params_per_s} if hw.device_adam_params_per_s else {}),
        device_base_bytes=device_base, optimizer_host_bytes=min(hw.host_memory, host_reserve),
        micro_batches=micro_batches, data_parallel=gpus, prefetch_blocks=prefetch_blocks, device_budget=device_memory,
        host_budget=host_share,
        # Fuyou's design: copies on a side stream (the runtime's CUDA path blocks today)
        blocking_swap_out=False, blocking_weight_copy=False,
        ssd_budget=None, source="analytic",
        notes={**notes, "model": model.name, "hardware": hw.name, "batch": batch, "seq": seq,
               "flops_per_step": step_flops(model, batch, seq) * micro_batches * gpus,
               "flops_per_step_paper": step_flops(model, batch, seq, recompute=True) * micro_batches * gpus,
               "gpus": gpus,
               "params": model.params,
               "host_reserve_bytes": host_reserve},
    )
