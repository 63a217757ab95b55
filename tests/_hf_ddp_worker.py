"""One rank of the HF data-parallel test (launched by torchrun from tests/test_distributed.py)."""

import os
import sys

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(__file__))
from conftest import tiny_causal_lm  # noqa: E402
from test_hf import dataset  # noqa: E402

from fuyou_strategy import FuyouCallback  # noqa: E402


class Norms(TrainerCallback):
    def __init__(self):
        self.norms = []

    def on_step_end(self, args, state, control, **kwargs):
        self.norms.append(fuyou.engine.optimizer.stats.last_grad_norm)


if __name__ == "__main__":
    out, batch, weights, schedule = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    saving = dict(save_strategy="steps", save_steps=2) if sys.argv[5:] == ["save"] else dict(save_strategy="no")
    model = tiny_causal_lm("gpt2")
    fuyou = FuyouCallback(swap_dirs=[out], chunk_size="8KiB", weights=weights, optimizer_schedule=schedule)
    norms = Norms()
    args = TrainingArguments(output_dir=os.path.join(out, "out"), max_steps=3, per_device_train_batch_size=batch,
                             gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=1e-2, weight_decay=0.1,
                             report_to=[], use_cpu=True, seed=0, disable_tqdm=True, logging_steps=1, **saving,
                             ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[fuyou, norms])
    shard = {}

    class Shard(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # after FuyouCallback's: count the comm
            opt, original = fuyou.engine.optimizer, fuyou.engine.optimizer.updates.speculate  # hook's updates
            shard["hook_updates"] = 0

            def counting(ps, grad, *a, **k):
                shard["hook_updates"] += grad.kind == "bucket"
                return original(ps, grad, *a, **k)
            opt.updates.speculate = counting

        def on_step_end(self, args, state, control, **kwargs):
            opt = fuyou.engine.optimizer
            shard["bytes"] = sum(e.slots * e.nchunks * e.stride for n, e in opt.store.entries.items()
                                 if n.startswith("adamw."))
            shard["sharded"] = opt.shards is not None
            shard["tiers"] = fuyou.engine.summary()["weight_tiers"]
            shard["schedules"] = dict(opt.stats.schedules)

    trainer.add_callback(Shard())
    trainer.train()
    rank = dist.get_rank() if dist.is_initialized() else 0
    logged = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    torch.save({"weights": {k: v.clone() for k, v in model.state_dict().items()}, "norms": norms.norms,
                "logged_norms": logged, **shard},
               os.path.join(out, f"hf-rank{rank}-b{batch}-{weights}-{schedule}.pt"))
