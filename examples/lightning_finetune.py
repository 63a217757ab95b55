"""Fine-tune a causal LM with ``Trainer(strategy="fuyou")``: SSD-resident AdamW and activations.

Runs with no arguments and with the ``[lightning]`` extra alone: a built-in GPT-2-style model in
plain PyTorch, generated data (see ``common.py``) and a temporary swap directory. ``--model PATH``
loads a local Hugging Face checkpoint (needs transformers); ``--swap-dir`` points at a real NVMe
drive (repeat it for several). ``--help`` lists the rest.

    python examples/lightning_finetune.py
    python examples/lightning_finetune.py --swap-dir /nvme0 --swap-dir /nvme1 --precision bf16-mixed
    python examples/lightning_finetune.py --devices 2 --weights ssd   # data parallel (CPU: 2 processes, gloo)
"""

from __future__ import annotations

import argparse
import time
import warnings

from common import add_common_arguments, build_model, counting_sequences, fuyou_fields, print_summary, next_token_pairs

import lightning as L  # noqa: E402 (after common: it quiets the optional libraries transformers imports)
import torch  # noqa: E402
import torchmetrics  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import fuyou_strategy  # noqa: E402,F401 (registers strategy="fuyou")

# Lightning 2.6 flattens its batches with torch's LeafSpec, which torch 2.13 deprecates: a FutureWarning from inside
# Lightning at every fit, about nothing this script does (Lightning's own fix is to call TreeSpec.is_leaf()).
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning,
                        module=r"lightning\.pytorch\.utilities\._pytree")


class CausalLMModule(L.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float, warmup: int, vocab: int) -> None:
        super().__init__()
        self.model, self.lr, self.warmup = model, lr, warmup
        self.val_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=vocab, average="micro")

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        out = self.model(input_ids=batch, labels=batch)
        self.val_accuracy.update(*next_token_pairs(out.logits.argmax(-1), batch))
        self.log("val_loss", out.loss, prog_bar=True)
        self.log("val_acc", self.val_accuracy, prog_bar=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=self.lr, fused=True)  # FuyouAdamW uses the same (fused) kernel
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / self.warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class PrintSummary(L.Callback):
    """The run's summary, printed by rank 0 when training ends (with ``--devices N`` the engine lives in
    the spawned ranks, not in this process)."""

    def __init__(self, tokens: int) -> None:
        self.tokens, self.start = tokens, 0.0

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            ranks = f" on {trainer.world_size} ranks" if trainer.world_size > 1 else ""
            print_summary(f"Lightning + {type(trainer.strategy).__name__}{ranks}", trainer.strategy.engine.summary(),
                          float(trainer.callback_metrics["val_acc"]), tokens=self.tokens,
                          seconds=time.perf_counter() - self.start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "bf16-true"])
    parser.add_argument("--devices", type=int, default=1, help="data parallel over this many devices (on the CPU: "
                        "processes), each rank owning 1/N of the optimizer state")
    args = parser.parse_args(argv)

    model = build_model(args, transformers_model=False)
    micro_batches = args.steps * args.accumulate
    train = counting_sequences(micro_batches * args.batch_size, args.seq_len, args.vocab, seed=args.seed)
    val = counting_sequences(4 * args.batch_size, args.seq_len, args.vocab, seed=args.seed + 1)
    module = CausalLMModule(model, args.lr, warmup=max(1, args.steps // 10), vocab=args.vocab)
    # Any --devices: with several each rank takes 1/N of every global batch (Lightning's DistributedSampler);
    # spawned ranks, so that the script also runs from a notebook or a test ("popen", the default, re-runs it).
    strategy = fuyou_strategy.FuyouStrategy(start_method="spawn", **fuyou_fields(args))
    # One epoch of exactly steps x accumulate micro-batches: the progress bar counts them against their total.
    trainer = L.Trainer(strategy=strategy, accelerator="auto", devices=args.devices, precision=args.precision,
                        max_epochs=1, accumulate_grad_batches=args.accumulate,
                        gradient_clip_val=args.max_grad_norm, logger=False, enable_checkpointing=False,
                        check_val_every_n_epoch=1, log_every_n_steps=1,
                        callbacks=[PrintSummary(tokens=micro_batches * args.batch_size * args.seq_len)])
    trainer.fit(module, DataLoader(train, batch_size=args.batch_size // args.devices, shuffle=True),
                DataLoader(val, batch_size=args.batch_size // args.devices))
    if strategy.engine is not None:  # one device: the engine lives here
        strategy.engine.close()


if __name__ == "__main__":
    main()
