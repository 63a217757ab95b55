"""Does a compact optimizer state train as well as the exact one? (``FuyouConfig.state_format``)

Two fine-tuning tasks, each format in a fresh process, the same model initialisation and batches:

* ``counting`` — the examples' task (``examples/common.py``: sequences counting up from a random start
  with a random stride, modulo the vocabulary) on the examples' GPT-2 (4 layers, 256 wide, vocabulary 128),
  with 10% of the tokens replaced at random so that the loss has a floor above zero (otherwise every
  format reaches ~0 and "within 1%" of ~0 says nothing);
* ``language`` — a small language built in code: a random Markov source over 256 tokens, each token
  followed by one of 8 successors of its own with Zipf weights (an entropy floor of ~1.82 nats; the
  best possible next-token accuracy ~0.37), on the same 4-layer, 256-wide GPT-2.

Each run: ``--steps`` AdamW steps (default 300; lr 1e-3 with 30 steps of warm-up, weight decay 0.01, clipping at
1.0), a batch of 16 sequences of 64 tokens, fp32 compute (this project's machines have no bf16
instructions; the script says which it used). Reported: the final training loss (mean of the last 20 steps),
the held-out loss and next-token accuracy on 64 held-out sequences, and each against ``fp32`` as a ratio.
Writes ``benchmarks/results/state_format.json`` and a PNG of the loss curves (one panel per task).

    python -m benchmarks.state_format_bench            # both tasks, fp32 / bf16 / 8bit, 300 steps
    python -m benchmarks.state_format_bench --steps 50 --tasks counting   # quicker look
    python -m benchmarks.state_format_bench --bytes   # SSD bytes per parameter and per step, every format

``--bytes`` measures instead what each format costs on the drive: a 4-layer, 256-wide GPT-2 through
`FuyouEngine` with every block's weights streamed from the SSD (``weights="ssd"``, ``host_state=0``), for each
format, compute dtype (fp32, bf16) and ``state_slots`` (1, 2): ``summary()["ssd_bytes_per_trainable_parameter"]``
(the swap files' high-water mark) and the bytes written to the SSD per step and parameter, measured by the I/O
engine over 3 steps after one warm-up, beside the state's own bytes per parameter (`optim.formats`).
Writes ``benchmarks/results/state_format_bytes.json``.

``--padding`` computes, without training, the state's bytes per parameter and slot as the store holds them
(each chunk a whole stride) for GPT-2 124M/350M/1.5B and Llama-shaped 6.7B (built on the meta device: no
memory) at the default chunk size, with every chunk of full length and the last one padded (the rule before
2026-11-26) and with `balanced_chunk` (equal chunks). Writes ``benchmarks/results/state_padding.json``.

``--update`` measures the CPU cost instead: one chunk's update (4M elements, what the optimizer's worker runs
per chunk) in each format, median of 7 after a warm-up, as parameters per second and as a multiple of the
fused fp32 kernel's time. Writes ``benchmarks/results/state_format_update.json``.

``--quantiser`` times the 8-bit format's quantiser and dequantiser (`formats.Quantiser`, table look-ups) against
``torch.bucketize`` over the same thresholds and torchao's ``dequant_with_qmap``, on a 4M-element chunk of each
map, and compares the codes of all 2**32 fp32 bit patterns with ``bucketize``'s (a few minutes; ``--quick``
skips it). Writes ``benchmarks/results/state_format_quantiser.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FORMATS = ("fp32", "bf16", "8bit")
TASKS = ("counting", "language")
SEQ, BATCH, HELD_OUT = 64, 16, 64


def _data(task: str, n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    if task == "counting":
        vocab = 128
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        seqs = (start + stride * torch.arange(SEQ)) % vocab
        noise = torch.rand(n, SEQ, generator=g) < 0.10
        return torch.where(noise, torch.randint(0, vocab, (n, SEQ), generator=g), seqs), vocab
    vocab, likely = 256, 8
    source = torch.Generator().manual_seed(1234)  # the language itself: the same for every split
    nexts = torch.randint(0, vocab, (vocab, likely), generator=source, dtype=torch.int64)
    weights = 1.0 / torch.arange(1, likely + 1, dtype=torch.float32)  # Zipf over each token's likely successors
    seqs = torch.empty(n, SEQ, dtype=torch.int64)
    seqs[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, SEQ):
        pick = torch.multinomial(weights.expand(n, likely), 1, generator=g).squeeze(1)
        seqs[:, t] = nexts[seqs[:, t - 1], pick]
    return seqs, vocab


def _run(task: str, fmt: str, steps: int, seed: int) -> dict:
    """One training run in this process; returns its curve and metrics."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from fuyou_strategy import FuyouConfig
    from fuyou_strategy.optim.adamw import FuyouAdamW

    torch.manual_seed(seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    train, vocab = _data(task, steps * BATCH, seed=seed + 1)
    held, _ = _data(task, HELD_OUT, seed=seed + 2)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=vocab, n_positions=SEQ,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=vocab - 1,
                                       eos_token_id=vocab - 1, loss_type="ForCausalLMLoss"))
    with tempfile.TemporaryDirectory(prefix="fuyou-format-bench-") as swap:
        config = FuyouConfig(swap_dirs=[swap], state_format=fmt, host_memory_budget="1GiB", host_state=0,
                             progress=False)
        opt = FuyouAdamW(model.parameters(), lr=1e-3, weight_decay=0.01, max_grad_norm=1.0, config=config)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
        on_ssd = opt.control.figures().state_ssd_bytes
        losses = []
        for step in range(steps):
            batch = train[step * BATCH : (step + 1) * BATCH]
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
            if not math.isfinite(losses[-1]):
                break
        model.eval()
        with torch.no_grad():
            out = model(input_ids=held, labels=held)
            predicted = out.logits[:, :-1].argmax(-1)
            accuracy = (predicted == held[:, 1:]).float().mean().item()
        opt.close()
    params = sum(p.numel() for p in model.parameters())
    return {"task": task, "format": fmt, "steps": steps, "losses": losses,
            "final_loss": sum(losses[-20:]) / len(losses[-20:]), "held_out_loss": out.loss.item(),
            "held_out_accuracy": accuracy, "parameters": params, "state_bytes_on_ssd": on_ssd,
            "state_bytes_per_parameter": on_ssd / params}


def _bytes(fmt: str, dtype: str, slots: int) -> dict:
    """Bytes on the SSD and written per step for one configuration (in this process)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from fuyou_strategy import FuyouConfig, FuyouEngine
    from fuyou_strategy.optim.formats import bytes_per_param

    torch.manual_seed(0)
    vocab = 512
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=vocab, n_positions=SEQ,
                                       bos_token_id=vocab - 1, eos_token_id=vocab - 1, loss_type="ForCausalLMLoss"))
    model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    data, _ = _data("counting", 5 * 4, seed=1)
    with tempfile.TemporaryDirectory(prefix="fuyou-format-bytes-") as swap:
        config = FuyouConfig(swap_dirs=[swap], state_format=fmt, state_slots=slots, host_state=0, weights="ssd",
                             host_memory_budget="512MiB", optimizer_schedule="next_forward", progress=False)
        with FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config=config) as engine:
            written = []
            for step in range(4):
                before = engine.memory.figures().ssd_write_bytes
                batch = data[step * 4 : (step + 1) * 4] % vocab
                engine.begin_micro_batch()
                model(input_ids=batch, labels=batch).loss.backward()
                engine.optimizer.step()
                engine.optimizer.zero_grad()
                written.append(engine.memory.figures().ssd_write_bytes - before)
            summary = engine.summary()
    params = summary["trainable_parameters"]
    return {"format": fmt, "dtype": dtype, "state_slots": slots, "parameters": params,
            "state_bytes_per_parameter_and_slot": bytes_per_param(fmt),
            "ssd_bytes_per_trainable_parameter": summary["ssd_bytes_per_trainable_parameter"],
            "ssd_written_per_step_per_parameter": sum(written[1:]) / len(written[1:]) / params}


def update_table(out: str, n: int = 1 << 22, repeats: int = 7) -> int:
    """CPU throughput of one chunk's update in each format (`state.apply_update`, what the optimizer's worker
    runs per chunk): median of ``repeats`` over ``n`` elements, fused fp32 kernel as the reference."""
    import statistics
    import time

    import torch

    from fuyou_strategy.optim.formats import StateFormat
    from fuyou_strategy.optim.state import apply_update

    rows = []
    for fmt in FORMATS:
        layout = StateFormat(fmt).layout(n)
        buf = torch.zeros(layout.nbytes(n), dtype=torch.uint8)
        state = layout.views(buf, n)
        state["master"].copy_(torch.randn(n))
        g = torch.Generator().manual_seed(0)
        times = []
        for step in range(repeats + 1):
            grad = torch.randn(n, generator=g) * 1e-3
            start = time.perf_counter()
            apply_update(layout, state, grad, torch.tensor(float(step)), fused=True, lr=1e-3, beta1=0.9, beta2=0.999,
                         weight_decay=0.01, eps=1e-8)
            if step:  # the first is a warm-up
                times.append(time.perf_counter() - start)
        rows.append({"format": fmt, "elements": n, "median_s": statistics.median(times),
                     "params_per_s": n / statistics.median(times), "threads": torch.get_num_threads()})
    base = rows[0]["params_per_s"]
    print(f"| format | update, M params/s ({rows[0]['threads']} threads) | x fp32's time |")
    print("|---|---|---|")
    for r in rows:
        r["time_ratio"] = base / r["params_per_s"]
        print(f"| {r['format']} | {r['params_per_s'] / 1e6:.1f} | {r['time_ratio']:.2f}x |")
    with open(out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    print(f"\nwrote {out}")
    return 0


def quantiser_table(out: str, n: int = 1 << 22, repeats: int = 7, exhaustive: bool = True) -> int:
    """`formats.Quantiser` against ``torch.bucketize`` (its codes) and torchao's ``dequant_with_qmap`` (its
    values): time per 4M-element chunk, side by side, and (``exhaustive``) the codes of all 2**32 fp32 bit
    patterns compared, for both maps (`--quantiser`)."""
    import statistics
    import time

    import torch

    from fuyou_strategy.optim import formats

    q = formats._torchao()
    g = torch.Generator().manual_seed(0)
    rows = []

    def median(fn):
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    for signed in (True, False):
        quantiser, qmap = q.quantiser[signed], q.qmap[signed]
        values = torch.randn(n, generator=g) if signed else torch.rand(n, generator=g) ** 4
        scaled, scale = q.scale_tensor(values, formats.BLOCK)
        codes = quantiser.codes(scaled)
        assert torch.equal(codes, torch.bucketize(scaled, quantiser.thresholds, right=True).to(torch.uint8))
        assert torch.equal(quantiser.values(codes, scale), q.dequant_with_qmap(codes, qmap, scale))
        row = {"map": "signed" if signed else "unsigned", "elements": n, "threads": torch.get_num_threads(),
               "lookup_steps": quantiser.steps,
               "codes_bucketize_s": median(lambda: torch.bucketize(scaled, quantiser.thresholds, right=True)
                                           .to(torch.uint8)),
               "codes_quantiser_s": median(lambda: quantiser.codes(scaled)),
               "values_torchao_s": median(lambda: q.dequant_with_qmap(codes, qmap, scale)),
               "values_quantiser_s": median(lambda: quantiser.values(codes, scale))}
        if exhaustive:
            mismatched, nan = 0, 0
            for start in range(0, 1 << 32, 1 << 24):
                x = formats.fp32_of_bits(torch.arange(start, start + (1 << 24), dtype=torch.int64))
                wrong = quantiser.codes(x) != torch.bucketize(x, quantiser.thresholds, right=True).to(torch.uint8)
                mismatched += int((wrong & ~x.isnan()).sum())
                nan += int((wrong & x.isnan()).sum())
            row.update(exhaustive_non_nan_mismatches=mismatched, exhaustive_nan_mismatches=nan)
        rows.append(row)
    print(f"| map | look-up steps | codes: bucketize | codes: Quantiser | x | values: torchao | values: Quantiser | x "
          f"| all 2**32 patterns: non-NaN mismatches |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['map']} | {r['lookup_steps']} | {r['codes_bucketize_s'] * 1e3:.1f} ms | "
              f"{r['codes_quantiser_s'] * 1e3:.1f} ms | {r['codes_bucketize_s'] / r['codes_quantiser_s']:.2f} | "
              f"{r['values_torchao_s'] * 1e3:.1f} ms | {r['values_quantiser_s'] * 1e3:.1f} ms | "
              f"{r['values_torchao_s'] / r['values_quantiser_s']:.2f} | "
              f"{r.get('exhaustive_non_nan_mismatches', 'not run')} |")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    print(f"\nwrote {out}")
    return 0 if all(r.get("exhaustive_non_nan_mismatches", 0) == 0 for r in rows) else 1


def bytes_table(out: str) -> int:
    rows = [_bytes(fmt, dtype, slots) for dtype in ("fp32", "bf16") for slots in (2, 1) for fmt in FORMATS]
    print("| compute dtype | state_slots | format | state B/param/slot | SSD files B/param | SSD written B/param/step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['state_slots']} | {r['format']} | {r['state_bytes_per_parameter_and_slot']:.2f} | "
              f"{r['ssd_bytes_per_trainable_parameter']:.2f} | {r['ssd_written_per_step_per_parameter']:.2f} |")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump({"model": "GPT-2 4 x 256, vocab 512; weights='ssd', host_state=0, next_forward", "rows": rows}, f,
                  indent=1)
    print(f"\nwrote {out}")
    return 0


def padding_table(out: str) -> int:
    """The state's bytes per parameter and slot, padded as the store holds them, per chunking rule (`--padding`)."""
    import torch

    sys.path.insert(0, str(HERE.parent))
    from benchmarks.peers.systems import Job
    from fuyou_strategy import FuyouConfig
    from fuyou_strategy.config import STATE_BYTES_PER_PARAM
    from fuyou_strategy.storage import host_budget_split
    from fuyou_strategy.optim.state import balanced_chunk
    from fuyou_strategy.storage import TensorStore, round_up

    most = host_budget_split(FuyouConfig()).state_chunk // STATE_BYTES_PER_PARAM
    rules = {"full chunks, last padded": lambda n: most, "balanced_chunk": lambda n: balanced_chunk(n, most)}
    rows = []
    print(f"chunks of at most {most} parameters (the default chunk_size); fp32 state, 12 bytes per parameter\n")
    print("| model | parameters | " + " | ".join(f"{r} (B/param/slot)" for r in rules) + " |")
    print("|---|---|" + "---|" * len(rules))
    for arch, size in [("gpt2", "124M"), ("gpt2", "350M"), ("gpt2", "1.5B"), ("llama", "6.7B")]:
        job = Job(arch, size, None, "fp32", 1, 1024, 1, "")
        with torch.device("meta"):
            model = job._build()
        sizes = [p.numel() for p in model.parameters()]
        row = {"model": f"{arch}-{size}", "parameters": sum(sizes)}
        for name, rule in rules.items():
            padded = sum(TensorStore.footprint(STATE_BYTES_PER_PARAM * n, round_up(STATE_BYTES_PER_PARAM * rule(n)), 1)
                         for n in sizes)
            row[name] = padded / sum(sizes)
        rows.append(row)
        print(f"| {row['model']} | {row['parameters']:,} | " + " | ".join(f"{row[r]:.3f}" for r in rules) + " |")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"chunk_elements": most, "rows": rows}, indent=1))
    print(f"\nwrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE / "results" / "state_format.json"))
    parser.add_argument("--png", default=str(HERE.parent / "docs" / "state-format-convergence.png"))
    parser.add_argument("--update", action="store_true", help="measure each format's update throughput instead")
    parser.add_argument("--replot", action="store_true", help="only draw the PNG again from --out's JSON")
    parser.add_argument("--keep", action="store_true",
                        help="keep the runs of the other tasks from --out's JSON (re-run only --tasks)")
    parser.add_argument("--bytes", action="store_true", help="measure SSD bytes per format instead (see above)")
    parser.add_argument("--quantiser", action="store_true",
                        help="time the 8-bit quantiser against bucketize and torchao, and check all 2**32 codes")
    parser.add_argument("--quick", action="store_true", help="with --quantiser: skip the exhaustive check")
    parser.add_argument("--padding", action="store_true", help="the state's padding per chunking rule (see above)")
    parser.add_argument("--child", nargs=2, metavar=("TASK", "FORMAT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.padding:
        return padding_table(str(HERE / "results" / "state_padding.json"))
    if args.bytes:
        return bytes_table(str(HERE / "results" / "state_format_bytes.json"))
    if args.update:
        return update_table(str(HERE / "results" / "state_format_update.json"))
    if args.quantiser:
        return quantiser_table(str(HERE / "results" / "state_format_quantiser.json"), exhaustive=not args.quick)
    if args.replot:
        print(draw(json.loads(Path(args.out).read_text())["runs"], args.png))
        return 0
    if args.child:
        print(json.dumps(_run(*args.child, args.steps, args.seed)))
        return 0

    sys.path.insert(0, str(HERE.parent))
    from benchmarks.common import allocator, run_fresh

    cpu = open("/proc/cpuinfo").read()
    bf16_cpu = "avx512_bf16" in cpu or "amx_bf16" in cpu
    print(f"compute dtype fp32 (CPU bf16 instructions: {'yes' if bf16_cpu else 'no'}); allocator {allocator()}; "
          f"{args.steps} steps per run, a fresh process each")
    runs = []
    if args.keep and Path(args.out).exists():
        runs = [r for r in json.loads(Path(args.out).read_text())["runs"] if r["task"] not in args.tasks.split(",")]
    for task in args.tasks.split(","):
        for fmt in args.formats.split(","):
            print(f"  {task} / {fmt} ...", flush=True)
            runs.append(run_fresh(__file__, ["--child", task, fmt, "--steps", str(args.steps), "--seed",
                                             str(args.seed)]))
    rows = []
    print(f"\n| task | format | state B/param on SSD | final train loss | vs fp32 | held-out loss | vs fp32 | "
          "held-out accuracy | vs fp32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        base = next(b for b in runs if b["task"] == r["task"] and b["format"] == "fp32")
        row = dict(task=r["task"], format=r["format"], final_loss=r["final_loss"],
                   final_loss_ratio=r["final_loss"] / base["final_loss"], held_out_loss=r["held_out_loss"],
                   held_out_loss_ratio=r["held_out_loss"] / base["held_out_loss"],
                   held_out_accuracy=r["held_out_accuracy"],
                   held_out_accuracy_ratio=r["held_out_accuracy"] / base["held_out_accuracy"],
                   state_bytes_per_parameter=r["state_bytes_per_parameter"])
        rows.append(row)
        print(f"| {r['task']} | {r['format']} | {r['state_bytes_per_parameter']:.2f} | {r['final_loss']:.4f} | "
              f"{row['final_loss_ratio']:.4f}x | {r['held_out_loss']:.4f} | {row['held_out_loss_ratio']:.4f}x | "
              f"{r['held_out_accuracy']:.4f} | {row['held_out_accuracy_ratio']:.4f}x |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "compute_dtype": "fp32", "cpu_bf16": bf16_cpu, "allocator": allocator(),
                   "rows": rows, "runs": runs}, f, indent=1)
    print(f"\nwrote {args.out}")
    print(draw(runs, args.png))
    return 0


def draw(runs: list[dict], png: str) -> str:
    """The loss curves, one panel per task, and below each its ratio to fp32's (10-step means)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG"

    def smooth(xs: list[float]) -> list[float]:
        return [sum(xs[max(0, i - 9) : i + 1]) / len(xs[max(0, i - 9) : i + 1]) for i in range(len(xs))]

    tasks = list(dict.fromkeys(r["task"] for r in runs))
    fig, axes = plt.subplots(2, len(tasks), figsize=(6 * len(tasks), 7), squeeze=False, sharex=True,
                             gridspec_kw={"height_ratios": [2, 1]})
    for col, task in enumerate(tasks):
        mine = [r for r in runs if r["task"] == task]
        base = smooth(next(r for r in mine if r["format"] == "fp32")["losses"])
        for r in mine:
            curve = smooth(r["losses"])
            axes[0][col].plot(curve, label=f"{r['format']} (held-out loss {r['held_out_loss']:.3f}, "
                                           f"acc {r['held_out_accuracy']:.3f})")
            axes[1][col].plot([c / b for c, b in zip(curve, base)], label=r["format"])
        axes[0][col].set_title(f"{task}: training loss (10-step mean)")
        axes[0][col].set_ylabel("loss")
        axes[0][col].set_yscale("log")
        axes[0][col].legend()
        axes[1][col].set_ylabel("loss / fp32's")
        axes[1][col].set_xlabel("optimizer step")
        axes[1][col].axhline(1.01, color="grey", lw=0.5, ls="--")
        axes[1][col].axhline(0.99, color="grey", lw=0.5, ls="--")
    fig.suptitle("FuyouAdamW state formats: fp32 (exact) vs bf16 and 8-bit moments, fresh process each, fp32 compute")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return f"wrote {png}"


if __name__ == "__main__":
    raise SystemExit(main())
