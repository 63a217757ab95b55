"""What both examples share: the embedded default model, generated data and the closing summary.

The default model is a small GPT-2-style causal LM (nothing is downloaded): transformers' GPT-2
for the HF Trainer example, `TinyGPT` (plain PyTorch, so ``[lightning]`` alone runs it) for the
Lightning example. ``--model PATH`` loads a local Hugging Face checkpoint instead. The data is
generated: each sequence counts up from a random start with a random stride, modulo the
vocabulary, so the next token is predictable from the two before it — a model that learns
drives token accuracy from ~1/vocab towards 1, which makes progress easy to see.

The examples import this module before transformers and Lightning: when torchao or DeepSpeed is
installed (fuyou's ``[compact]``/``[test]`` and ``[peers]`` extras), transformers imports it, and its
import logs about its own build (torchao's CUDA kernels that do not load on a CPU-only machine,
torch's deprecation of how torchao registers its enums; DeepSpeed falling back to the CPU), nothing
the example or its user can change. Those three loggers are set to ERROR, nothing else.
"""

from __future__ import annotations

import argparse
import logging
import resource
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from fuyou_strategy.config import format_bytes

STRIDES = 7  # strides 1..7

for _library in ("torchao", "torch.utils._pytree", "DeepSpeed"):  # import-time noise (module docstring)
    logging.getLogger(_library).setLevel(logging.ERROR)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a local Hugging Face causal-LM folder (default: a built-in GPT-2-style model)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the built-in model")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the built-in model")
    parser.add_argument("--vocab", type=int, default=128, help="vocabulary of the built-in model")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--swap-dir", action="append", help="an SSD directory (repeat for several drives); "
                        "default: a temporary directory")
    parser.add_argument("--host-budget", default="1GiB", help="host memory for Fuyou's buffers")
    parser.add_argument("--activations", default="ssd", choices=["auto", "keep", "host", "ssd", "recompute"],
                        help="where every block's activations go; auto: the planner decides after a warm-up")
    parser.add_argument("--device-budget", help="device memory the planner may use (auto), e.g. 2GiB")
    parser.add_argument("--weights", default="device", choices=["device", "host", "ssd", "auto"],
                        help="where the blocks' weights live between uses (streamed unless device); auto: the "
                        "planner decides (with --activations auto)")
    parser.add_argument("--state-format", default="fp32", choices=["fp32", "bf16", "8bit"],
                        help="optimizer state: fp32 (exact), or bf16 / 8-bit moments (fewer bytes; needs torchao)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", help="write a timeline of two steps here (Chrome/Perfetto JSON; draw it with "
                        "`fuyou report PATH --png`)")


def fuyou_fields(args: argparse.Namespace) -> dict[str, Any]:
    """FuyouConfig fields from the command line."""
    return dict(swap_dirs=args.swap_dir, host_memory_budget=args.host_budget, activations=args.activations,
                device_memory_budget=args.device_budget, trace=args.trace, weights=args.weights,
                state_format=args.state_format)


class Block(torch.nn.Module):
    """A pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.proj(attention)
        return x + self.mlp(self.norm2(x))


class TinyGPT(torch.nn.Module):
    """A GPT-2-style causal LM in plain PyTorch, called like a transformers model: ``model(input_ids=...,
    labels=...)`` returns ``.loss`` (next-token cross-entropy) and ``.logits``. Fuyou finds its blocks
    (the largest ``ModuleList`` of one class) as it finds GPT-2's ``transformer.h``."""

    def __init__(self, vocab: int, hidden: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.embed, self.position = torch.nn.Embedding(vocab, hidden), torch.nn.Embedding(seq_len, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, max(1, hidden // 64)) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2
        for name, module in self.named_modules():  # GPT-2's initialisation
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                residual = name.endswith(("proj", "mlp.2"))  # the layers that write into the residual stream
                torch.nn.init.normal_(module.weight, std=0.02 / (2 * layers) ** 0.5 if residual else 0.02)
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                torch.nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SimpleNamespace:
        x = self.embed(input_ids) + self.position(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = None if labels is None else F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss, logits=logits)


def build_model(args: argparse.Namespace, transformers_model: bool = True) -> torch.nn.Module:
    """``--model PATH``, else the built-in model: transformers' GPT-2, or `TinyGPT` when ``transformers_model``
    is false (no transformers needed)."""
    torch.manual_seed(args.seed)
    if args.model:
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise SystemExit("--model loads a Hugging Face checkpoint, which needs transformers: "
                             "pip install transformers") from None
        model = AutoModelForCausalLM.from_pretrained(args.model)
        args.vocab = model.config.vocab_size
    elif not transformers_model:
        return TinyGPT(args.vocab, args.hidden, args.layers, args.seq_len)
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        # bos/eos inside the vocabulary (GPT-2's default, 50256, is not: transformers warns)
        config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64),
                            vocab_size=args.vocab, n_positions=args.seq_len, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1)
        model = GPT2LMHeadModel(config)
    if getattr(model, "loss_type", "") is None:
        # transformers picks the loss from the class name; GPT2LMHeadModel's names none, so its first forward warns
        # "loss_type=None ... unrecognized" and falls back to the causal-LM loss. Name that loss: no warning.
        model.loss_type = "ForCausalLM"
    return model


def counting_sequences(n: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    """``n`` sequences ``start, start+s, start+2s, ...`` (mod ``vocab``), ``s`` in 1..STRIDES."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, STRIDES + 1, (n, 1), generator=g)
    return (start + stride * torch.arange(seq_len)) % vocab


def next_token_pairs(predicted: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted ids (argmax of the logits) and targets for next-token accuracy, shifted as the LM loss is."""
    return predicted[:, :-1].reshape(-1), labels[:, 1:].reshape(-1)


def print_summary(title: str, summary: dict[str, Any], accuracy: float, tokens: int, seconds: float) -> None:
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    lines = [
        f"{title}: {summary['optimizer_steps']} optimizer steps in {seconds:.1f} s "
        f"({tokens / seconds:,.0f} tokens/s); held-out next-token accuracy {accuracy:.3f}",
        f"  trainable parameters {summary['trainable_parameters']:,}; median step {summary['median_step_seconds']:.3f} s",
        f"  gradient clipping: {summary['clipped']} steps clipped; {summary['commits']} committed as computed during "
        f"backward, {summary['redos']} redone with the clip coefficient, {summary['deferred']} updated exactly ahead of "
        f"the next forward, {summary['skips']} skipped (non-finite)",
        f"  optimizer schedule: {', '.join(f'{n} {s}' for s, n in summary['schedule_steps'].items() if n)}; rollback "
        f"rate {summary['rollback_rate']:.0%} ({summary['rollbacks']} of {summary['optimizer_steps'] + summary['skips']} "
        "steps paid a second pass over the state)",
        f"  on SSD: optimizer state {format_bytes(summary['ssd_bytes_optimizer_state'])} ({summary['state_format']}; "
        f"in host RAM "
        f"{format_bytes(summary['host_bytes_optimizer_state'])}: host_state), swap files "
        f"{format_bytes(summary['ssd_file_bytes'])} at most; activations written "
        f"{format_bytes(summary['activation_bytes_to_ssd'])} (to host {format_bytes(summary['activation_bytes_to_host'])})",
        f"  host memory: Fuyou buffers peaked at {format_bytes(summary['host_pool_peak_bytes'])} of "
        f"{format_bytes(summary['host_pool_budget_bytes'])}; process peak RSS {format_bytes(peak_rss)}",
    ]
    print("\n".join(lines), flush=True)
