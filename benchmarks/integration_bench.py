"""Lightning end to end: ``strategy="auto"`` (torch AdamW in RAM) vs ``strategy="fuyou"``, side by side.

The same LightningModule (a GPT-2 built from config, fused AdamW, warm-up schedule) is
trained by ``Trainer(strategy=...)`` in a fresh process per configuration; each process reports
the median optimizer-step time after warm-up (whole training steps: forward, backward,
optimizer) and its peak RSS. What this measures is the cost of the whole integration —
conversion, hooks, SSD traffic and activation swapping — as a user sees it.

    .venv/bin/python benchmarks/integration_bench.py     # preloads jemalloc itself when installed

Prints a table and writes ``benchmarks/results/integration_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import allocator, peak_rss_bytes, run_interleaved, temporary_swap_dir, worker_argv  # noqa: E402

CONFIGS = {
    "auto": None,  # Lightning's default strategy: torch.optim.AdamW(fused=True) in RAM
    "fuyou": "keep",  # FuyouAdamW, activations kept
    "fuyou+act-ssd": "ssd",  # FuyouAdamW and every block's activations to SSD
}


def worker(args: argparse.Namespace) -> dict:
    import warnings

    warnings.simplefilter("ignore")
    import lightning as L
    import torch
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel

    import fuyou_strategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.hidden // 64,
                                                    vocab_size=args.vocab, n_positions=args.seq))

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: min(1.0, (s + 1) / 10)), "interval": "step"}}

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_end(self, *a) -> None:
            self.marks.append(time.perf_counter())

    policy = CONFIGS[args.worker]
    strategy = "auto" if policy is None else fuyou_strategy.FuyouStrategy(
        swap_dirs=[args.swap_dir], host_memory_budget=args.host_budget, activations=policy)
    timer = StepTimer()
    total = args.warmup + args.steps
    data = torch.randint(0, args.vocab, (total * args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=total, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer])
    trainer.fit(Module(), DataLoader(data, batch_size=args.batch))
    steps = [b - a for a, b in zip(timer.marks, timer.marks[1:])][args.warmup - 1:]
    result = {"step_s": steps, "peak_rss": peak_rss_bytes()}
    if policy is not None:
        result["summary"] = trainer.strategy.engine.summary()
        trainer.strategy.engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the configurations this many times, interleaved, each a fresh process")
    parser.add_argument("--host-budget", default="1GiB")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma list (must include auto)")
    parser.add_argument("--swap-dir", help="directory on the SSD (default: a temporary one)")
    parser.add_argument("--no-jemalloc", action="store_true")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "integration_bench.json"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    tmp = temporary_swap_dir(args, "fuyou-intbench-")
    configs = args.configs.split(",")
    if "auto" not in configs:
        raise SystemExit("--configs must include auto: the other rows are ratios to it")
    runs, results = run_interleaved(__file__, [], configs, args.rounds, worker_argv(args, parent_only=("configs",)),
                                    use_jemalloc=not args.no_jemalloc)
    ref_s, ref_rss = statistics.median(results["auto"]["step_s"]), results["auto"]["peak_rss"]
    params = results[configs[-1]].get("summary", {}).get("trainable_parameters")
    lines = [
        f"model: GPT-2 {args.layers} layers x {args.hidden} hidden, vocab {args.vocab}"
        + (f" ({params / 1e6:.0f}M parameters)" if params else "")
        + f"; batch {args.batch} x seq {args.seq}; allocator: {allocator(not args.no_jemalloc)}; host budget "
        f"{args.host_budget}; medians of {args.steps} steps x {args.rounds} round(s) after {args.warmup} warm-up; "
        "each run a fresh process, configurations interleaved",
        "",
        f"{'strategy':<15} {'step s':>8} {'x auto':>8} {'peak RSS GiB':>13} {'x auto':>8}",
        "-" * 56,
    ]
    for config in configs:
        r = results[config]
        s = statistics.median(r["step_s"])
        lines.append(f"{config:<15} {s:>8.2f} {s / ref_s:>8.2f} {r['peak_rss'] / 2**30:>13.2f} {r['peak_rss'] / ref_rss:>8.2f}")
    table = "\n".join(lines)
    print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "runs": runs, "table": table}, f, indent=2)
    print(f"wrote {args.json}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
