"""Fine-tune a causal LM with the Hugging Face ``Trainer`` and ``FuyouCallback`` (optionally LoRA).

Runs with no arguments: a built-in GPT-2-style model, generated data (see ``common.py``) and a
temporary swap directory. ``--lora`` trains LoRA adapters (PEFT) instead of every weight;
``--model PATH`` loads a local Hugging Face checkpoint; ``--swap-dir`` points at a real NVMe.

    python examples/hf_trainer_finetune.py
    python examples/hf_trainer_finetune.py --lora --swap-dir /nvme0
"""

from __future__ import annotations

import argparse
import tempfile
import time

from common import add_common_arguments, build_model, counting_sequences, fuyou_fields, next_token_pairs, print_summary

import torch  # noqa: E402 (after common: it quiets the optional libraries transformers imports)
from transformers import Trainer, TrainingArguments  # noqa: E402

from fuyou_strategy import FuyouCallback  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters on the attention projections")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    parser.add_argument("--output-dir", help="where the Trainer writes (default: a temporary directory)")
    args = parser.parse_args(argv)

    model = build_model(args)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        targets = ["c_attn"] if model.config.model_type == "gpt2" else ["q_proj", "v_proj"]
        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                                                 target_modules=targets, fan_in_fan_out=model.config.model_type == "gpt2"))
        model.print_trainable_parameters()
    micro_batches = args.steps * args.accumulate
    train = [{"input_ids": s, "labels": s} for s in
             counting_sequences(micro_batches * args.batch_size, args.seq_len, args.vocab, seed=args.seed)]
    val = [{"input_ids": s, "labels": s} for s in
           counting_sequences(4 * args.batch_size, args.seq_len, args.vocab, seed=args.seed + 1)]

    def compute_metrics(prediction) -> dict[str, float]:  # over the whole evaluation set, which the Trainer gathers
        preds, labels = next_token_pairs(torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids))
        return {"token_accuracy": float((preds == labels).float().mean())}

    callback = FuyouCallback(**fuyou_fields(args))
    with tempfile.TemporaryDirectory(prefix="fuyou-hf-") as tmp:
        training_args = TrainingArguments(
            output_dir=args.output_dir or tmp, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=args.batch_size, gradient_accumulation_steps=args.accumulate,
            learning_rate=args.lr, weight_decay=0.1, warmup_steps=max(1, args.steps // 10), lr_scheduler_type="linear",
            max_grad_norm=args.max_grad_norm, bf16=args.bf16, logging_steps=max(1, args.steps // 10),
            save_strategy="no", report_to=[], seed=args.seed, use_cpu=not torch.cuda.is_available(),
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=val,
                          callbacks=[callback], compute_metrics=compute_metrics,
                          preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1))
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        metrics = trainer.evaluate()
    if callback.plan is not None:  # --activations auto (transformers logs it at INFO, shown with log_level="info")
        print(callback.plan)
    title = "HF Trainer + FuyouCallback" + (" (LoRA)" if args.lora else "")
    print_summary(title, callback.summary, metrics["eval_token_accuracy"],
                  tokens=micro_batches * args.batch_size * args.seq_len, seconds=seconds)


if __name__ == "__main__":
    main()
