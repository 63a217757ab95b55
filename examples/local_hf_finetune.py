"""Fine-tune a local Hugging Face model folder on a local text file, with the HF Trainer and FuyouCallback.

``--model PATH`` is a folder with a causal LM and its tokenizer (``save_pretrained`` output);
``--data FILE`` a UTF-8 text file, one document per line. The text is tokenised with the folder's
tokenizer and cut into blocks of ``--seq-len`` tokens. ``--lora`` trains LoRA adapters (peft)
instead of every weight. With no ``--model``/``--data`` it runs offline: it writes a small text
file, trains a word-level tokenizer on it, builds a small Llama-style model and saves both into a
folder, then fine-tunes that folder like any other.

    python examples/local_hf_finetune.py
    python examples/local_hf_finetune.py --model ./my-llama --data notes.txt --lora --swap-dir /nvme0
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

import common  # noqa: F401 (first: it quiets the import-time logs of the optional libraries transformers imports)
import torch

from fuyou_strategy import FuyouCallback

SUBJECTS = ["the drive", "the optimizer", "the planner", "a block", "the host pool", "the trainer", "a gradient"]
VERBS = ["reads", "writes", "streams", "updates", "prefetches", "checks", "releases"]
OBJECTS = ["the weights", "the moments", "each chunk", "the activations", "the next block", "the state", "a buffer"]
ENDINGS = ["ahead of time", "during backward", "before the next forward", "in order", "without waiting", "again"]


def write_text(path: str, lines: int, seed: int) -> None:
    """A text file of simple templated sentences (learnable structure, a small vocabulary)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(lines):
            f.write(" ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)} ."
                             for _ in range(rng.randint(2, 5))) + "\n")


def build_folder(folder: str, data: str, hidden: int, layers: int) -> None:
    """A word-level tokenizer trained on ``data`` and a small Llama-style model, saved into ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([data], trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64), num_key_value_heads=1,
                         max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def token_blocks(tokenizer, path: str, seq_len: int) -> torch.Tensor:
    """The file's lines tokenised (each ending in eos), concatenated and cut into ``seq_len`` blocks."""
    ids: list[int] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                ids += tokenizer(line.strip(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    n = len(ids) // seq_len
    if n < 2:
        raise SystemExit(f"--data {path}: {len(ids)} tokens make fewer than 2 blocks of --seq-len {seq_len}")
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a local Hugging Face causal-LM folder with its tokenizer (default: build one)")
    p.add_argument("--data", help="a UTF-8 text file, one document per line (default: write one)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (r=8) instead of every weight")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--swap-dir", action="append", help="an SSD directory (repeat for several drives)")
    p.add_argument("--activations", default="auto", choices=["auto", "keep", "host", "ssd", "recompute"])
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--lines", type=int, default=2000, help="lines of the generated text file (without --data)")
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    with tempfile.TemporaryDirectory(prefix="fuyou-example-") as tmp:
        data = args.data or os.path.join(tmp, "train.txt")
        if args.data is None:
            write_text(data, lines=args.lines, seed=0)
        folder = args.model or os.path.join(tmp, "model")
        if args.model is None:
            build_folder(folder, data, hidden=128, layers=4)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder)
        if args.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                     task_type="CAUSAL_LM"))
        blocks = token_blocks(tokenizer, data, args.seq_len)
        held_out = max(1, len(blocks) // 20)
        train, val = Blocks(blocks[held_out:]), Blocks(blocks[:held_out])
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"model {folder}: {sum(p.numel() for p in model.parameters()):,} parameters, {trainable:,} trainable"
              f"{' (LoRA)' if args.lora else ''}; data {data}: {len(train)} blocks of {args.seq_len} tokens", flush=True)
        callback = FuyouCallback(swap_dirs=args.swap_dir, activations=args.activations)
        training_args = TrainingArguments(
            output_dir=os.path.join(tmp, "out"), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=args.batch_size, gradient_accumulation_steps=args.accumulate,
            learning_rate=args.lr, warmup_steps=max(1, args.steps // 10), lr_scheduler_type="linear",
            max_grad_norm=1.0, bf16=args.bf16, logging_steps=max(1, args.steps // 5), save_strategy="no",
            report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
        trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=val, callbacks=[callback])
        before = trainer.evaluate()["eval_loss"]
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        after = trainer.evaluate()["eval_loss"]
        s = callback.summary
        print(f"held-out loss {before:.3f} -> {after:.3f} in {s['optimizer_steps']} steps, {seconds:.1f} s; median "
              f"step {s['median_step_seconds']:.3f} s; optimizer state on SSD {s['ssd_bytes_optimizer_state']:,} bytes",
              flush=True)
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"  step {entry['step']:>3}: loss {entry['loss']:.3f}, SSD writes "
                      f"{entry.get('fuyou/ssd_write_gbps', 0.0):.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
