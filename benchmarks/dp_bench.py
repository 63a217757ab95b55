"""Data parallelism (issue 15): two ranks against one process on the same global batch.

Every configuration is a fresh process (jemalloc preloaded when installed); the data-parallel ones
spawn 2 ranks over gloo (``torch.multiprocessing``, a file rendezvous), each with 1 compute
thread and half the global batch, against one process with 2 threads and the whole batch: the
same 2 cores either way, so the ratio is what data parallelism costs or saves on this machine.
The model is a GPT-2 built from a config (no hub) trained with a ``torch.optim.AdamW(fused=True)``
converted by `FuyouEngine` (``process_group=`` for the ranks, which then sum the gradients onto
each parameter's owner themselves at ``step()``: no DDP), ``optimizer_schedule="next_forward"``,
with the blocks' weights resident (``device``) or streamed from the SSD (``ssd``).

Per configuration: the median step time after warm-up (rank 0's), its ratio to one process with
the same weights tier, each rank's optimizer state on its SSD and peak RSS, and where a rank's
step goes beyond compute: the time ``step()`` spends summing the streamed gradients onto their
owners and the time the forward waits for the owners' new weights (``Sharding.land``).

    .venv/bin/python benchmarks/dp_bench.py                  # ~25M parameters, a few minutes
    .venv/bin/python benchmarks/dp_bench.py --quick          # a few MB, under a minute

Prints a table and writes ``benchmarks/results/dp_bench.json``; the compute dtype is bf16 where
the CPU has bf16 instructions (``avx512_bf16``/``amx_bf16`` in /proc/cpuinfo), else fp32.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (add_gpt2_arguments, allocator, choose_dtype, parse_or_work, peak_rss_bytes,  # noqa: E402
                    run_interleaved, temporary_swap_dir, worker_argv, write_results)

CONFIGS = ("one-device", "one-ssd", "ranks2-device", "ranks2-ssd")  # process layout - weights tier
QUICK = dict(layers=2, hidden=64, vocab=512, seq=32, batch=4, warmup=1, steps=2)


def _train_rank(rank: int, world: int, args: argparse.Namespace, folder: str) -> dict:
    """One process's run: ``world`` 1 is one process on the whole batch, else rank ``rank`` of ``world``."""
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    from fuyou_strategy import FuyouConfig, FuyouEngine
    from fuyou_strategy.optim import distributed

    if world > 1:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    try:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64),
                                           vocab_size=args.vocab, n_positions=args.seq)).to(dtype)
        swap = os.path.join(args.swap_dir, f"rank{rank}")
        os.makedirs(swap, exist_ok=True)
        config = FuyouConfig(swap_dirs=[swap], host_memory_budget=args.host_budget, host_state=args.host_state, weights=args.weights,
                             optimizer_schedule="next_forward")
        spent = {"land": 0.0, "reduce_streamed": 0.0}

        def timed(name, fn):
            def wrapper(*a, **k):
                start = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    spent[name] += time.perf_counter() - start
            return wrapper

        # On the classes, before the engine binds them into the model's hooks: the training thread's waits
        # for new weights, resident (Sharding.land, a collective) and streamed (the streamer's, which
        # do not go through land)
        for kind in (distributed.Solo, distributed.Sharding):
            kind.land = timed("land", kind.land)
        distributed._SentWeights.wait = timed("land", distributed._SentWeights.wait)
        engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), config=config,
                             process_group=dist.group.WORLD if world > 1 else None)
        opt = engine.optimizer
        if world > 1:
            opt.sharding.sum_streamed = timed("reduce_streamed", opt.sharding.sum_streamed)
        per_rank = args.batch // world
        data = torch.randint(0, args.vocab, (args.warmup + args.steps, args.batch, args.seq),
                             generator=torch.Generator().manual_seed(0))
        times, shares = [], []
        try:
            for i in range(args.warmup + args.steps):
                ids = data[i, rank * per_rank:(rank + 1) * per_rank]
                before = dict(spent)
                start = time.perf_counter()
                engine.begin_micro_batch(update=True)
                loss = model(input_ids=ids, labels=ids).loss
                forward = time.perf_counter()
                loss.backward()
                backward = time.perf_counter()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i >= args.warmup:
                    end = time.perf_counter()
                    times.append(end - start)
                    shares.append({**{k: spent[k] - before[k] for k in spent}, "forward": forward - start,
                                   "backward": backward - forward, "step": end - backward})
            opt.flush()
            state = sum(e.slots * e.nchunks * e.stride for n, e in opt.store.entries.items() if n.startswith("adamw."))
            summary = engine.summary()
        finally:
            engine.close()
        return {"step_s": times, "land_s": [s["land"] for s in shares],
                "reduce_streamed_s": [s["reduce_streamed"] for s in shares],
                **{f"{k if k != 'step' else 'optimizer_step'}_s": [s[k] for s in shares] for k in ("forward", "backward", "step")}, "state_bytes": state,
                "peak_rss": peak_rss_bytes(), "params": sum(p.numel() for p in model.parameters()),
                "streamed_bytes": summary["weight_bytes_streamed"]}
    finally:
        if world > 1:
            dist.destroy_process_group()


def _rank_entry(rank: int, world: int, args: argparse.Namespace, folder: str) -> None:
    import json

    result = _train_rank(rank, world, args, folder)
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def worker(args: argparse.Namespace) -> dict:
    import json

    import torch.multiprocessing as mp

    layout, args.weights = args.worker.split("-")
    if layout == "one":
        return {"config": args.worker, "ranks": [_train_rank(0, 1, args, "")]}
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank_entry, args=(2, args, folder), nprocs=2)
        ranks = []
        for r in range(2):
            with open(os.path.join(folder, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    return {"config": args.worker, "ranks": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_gpt2_arguments(parser, "dp_bench", layers=8, hidden=512, vocab=8192, seq=128, batch=8, steps=4, warmup=2,
                       rounds=2)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"))
    parser.add_argument("--quick", action="store_true", help="a model of a few MB, every configuration in a minute")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which of them to run")
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parse_or_work(parser, worker)
    if args is None:
        return
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.dtype, why = choose_dtype(args.dtype)
    temporary_swap_dir(args, "fuyou-dp-")
    argv = worker_argv(args, ("quick", "configs"))
    configs = args.configs.split(",")
    if not set(configs) <= set(CONFIGS) or not all("one-" + c.split("-")[1] in configs for c in configs):
        raise SystemExit(f"--configs: got {args.configs!r}; a comma list of {', '.join(CONFIGS)} that holds the "
                         "one-process row of each weights tier it names (the ratios' reference)")
    runs, results = run_interleaved(__file__, [], configs, args.rounds, argv, use_jemalloc=not args.no_jemalloc)
    merged = {}
    for config in configs:  # every round's timed steps, rank 0's (the ranks step together)
        rounds = runs[config]
        merged[config] = {
            "step": statistics.median(t for r in rounds for t in r["ranks"][0]["step_s"]),
            "land": statistics.median(t for r in rounds for t in r["ranks"][0]["land_s"]),
            "reduce": statistics.median(t for r in rounds for t in r["ranks"][0]["reduce_streamed_s"]),
            **{k: statistics.median(t for r in rounds for t in r["ranks"][0][f"{k}_s"])
               for k in ("forward", "backward", "optimizer_step") if f"{k}_s" in rounds[0]["ranks"][0]},
            "state": [rk["state_bytes"] for rk in rounds[-1]["ranks"]],
            "rss": [statistics.median(r["ranks"][k]["peak_rss"] for r in rounds) for k in range(len(rounds[-1]["ranks"]))],
            "streamed": rounds[-1]["ranks"][0]["streamed_bytes"],
        }
    params = runs[configs[0]][-1]["ranks"][0]["params"]
    lines = [
        f"data parallel: 2 ranks x 1 thread (gloo) vs 1 process x 2 threads, the same global batch {args.batch} x "
        f"{args.seq}; GPT-2 {args.layers} x {args.hidden}, {params / 1e6:.1f}M parameters, {args.dtype} ({why}); "
        f"allocator {allocator(not args.no_jemalloc)}",
        f"medians of {args.steps} steps x {args.rounds} round(s) after {args.warmup} warm-up, rank 0's; each "
        "configuration a fresh process, interleaved",
        "",
        f"{'config':<14} {'step s':>7} {'x one':>6} {'state MiB per rank':>19} {'x one':>6} {'peak RSS GiB per rank':>22} "
        f"{'weights wait s':>15} {'grad sum s':>11} {'forward s':>10} {'backward s':>11} {'step() s':>9}",
        "-" * 142,
    ]
    for config in configs:
        m, one = merged[config], merged["one-" + config.split("-")[1]]
        state = "/".join(f"{b / 2**20:.1f}" for b in m["state"])
        rss = "/".join(f"{b / 2**30:.2f}" for b in m["rss"])
        lines.append(f"{config:<14} {m['step']:>7.3f} {m['step'] / one['step']:>6.2f} {state:>19} "
                     f"{max(m['state']) / one['state'][0]:>6.2f} {rss:>22} {m['land']:>15.3f} {m['reduce']:>11.3f} "
                     f"{m['forward']:>10.3f} {m['backward']:>11.3f} {m['optimizer_step']:>9.3f}")
    lines += ["", "x one: against one process with the same weights tier; 'weights wait': the training thread's waits for "
              "the owners' new weights (Sharding.land, and the streamer's waits for streamed ones); 'grad sum': step()'s sum "
              "of the streamed gradients onto their owners (host copies, gloo)"]
    write_results(args.json, {"runs": runs, "merged": merged, "table": "\n".join(lines)})


if __name__ == "__main__":
    main()
