"""Weight streaming (issue 11): block weights resident, or streamed from host memory or SSD.

Two modes, every run a fresh process (so peak RSS is its own), jemalloc preloaded when installed:

``compare``: a ~1B-parameter GPT-2 (18 layers x 2048 hidden, 16 heads, vocab 50257; built from
a ``GPT2Config``, no hub) trained with full fine-tuning, batch 1 x seq 256: a
``torch.optim.AdamW(fused=True)`` converted by `FuyouEngine` (optimizer state on SSD), with
``weights="device"`` (all resident), ``"host"`` and ``"ssd"``. Configurations interleaved over
``--rounds``; per configuration the median step time after warm-up and its ratio to
all-resident, peak RSS (VmHWM) and the engine's ``summary()`` weight figures.

``scale``: peak RSS against model size (0.35B, 1B, 2B, 4B) with ``weights="ssd"`` and a 2 GiB
``device_memory_budget``, one step after one warm-up each, the model built on the meta device
(the engine materialises it block by block, so it is never whole in memory). Records step time,
the swap files' size and the free disk before each size, and stops before a size whose
estimated SSD footprint exceeds the free disk (``--state-slots 1`` halves the optimizer's part).

``--quick`` runs a model of a few MB through every configuration in under a minute;
``--frozen-blocks`` freezes the blocks (a frozen base under a trainable embedding and head, as in
LoRA). The compute dtype is bf16 where the CPU has bf16 instructions (``avx512_bf16`` or
``amx_bf16`` in /proc/cpuinfo), else fp32.

    .venv/bin/python benchmarks/weights_bench.py compare
    .venv/bin/python benchmarks/weights_bench.py scale --sizes 0.35B,1B,2B,4B --state-slots 1
    .venv/bin/python benchmarks/weights_bench.py compare --quick
    # the largest shape this machine's disk holds: Llama-2-7B's depth and width, an 8-bit state, fp32 weights
    # streamed from the optimizer's master (10.03 B/param on the SSD); one step, its updates timed as they land
    .venv/bin/python benchmarks/weights_bench.py scale --sizes 6.7B --state-format 8bit --state-slots 1 --dtype fp32 \
        --warmup 0 --steps 1 --seq 64 --host-budget 2GiB --prefetch-blocks 1 --device-budget 6GiB

Prints a table and writes ``weights_<mode>.json`` (every raw number) and, when matplotlib is
importable, ``weights_<mode>.png`` to ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (allocator, choose_dtype, proc_bytes, run_fresh, run_interleaved, temporary_swap_dir,  # noqa: E402
                    worker_argv)

TIERS = ("device", "host", "ssd")
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
SSD_MARGIN = 1.1  # padding and the store's other entries: 1B, bf16, 2 slots measured 30.4 B/param for 28 estimated
# Scale presets, (layers, hidden, heads): the named parameter count with vocab 50257 and seq 256 (tiny: --quick).
# "4.5B": the largest that this project's disk (~77 GB free) holds in fp32 compute with an 8-bit state, one slot;
# "6.7B": Llama-2-7B's depth and width (32 x 4096, 6.65B with GPT-2's vocabulary and MLP).
SIZES = {"0.35B": (24, 1024, 16), "1B": (18, 2048, 16), "2B": (24, 2560, 20), "4B": (34, 3072, 24),
         "4.5B": (36, 3200, 25), "6.7B": (32, 4096, 32),
         "tiny-1": (2, 64, 2), "tiny-2": (4, 64, 2), "tiny-3": (4, 128, 2)}
MODE_DEFAULTS = {
    "compare": dict(warmup=2, steps=3, build="memory"),
    "scale": dict(warmup=1, steps=1, device_budget="2GiB", build="meta"),
}
QUICK = {  # a few MB: every configuration in under a minute
    "compare": dict(layers=4, hidden=64, heads=2, vocab=512, seq=32, warmup=1, steps=2, host_budget="256MiB",
                    prefetch_blocks=1),
    "scale": dict(vocab=512, seq=32, sizes="tiny-1,tiny-2,tiny-3", host_budget="256MiB"),
}


# -- the model ---------------------------------------------------------------------------------------
def gpt2_param_count(layers: int, hidden: int, vocab: int, positions: int) -> int:
    """Parameters of ``GPT2LMHeadModel`` (lm_head tied to wte): per block 12 h^2 + 13 h (attention
    3h x h + h x h, MLP 4h x h twice, their biases, two layer norms), embeddings, final norm."""
    return layers * (12 * hidden * hidden + 13 * hidden) + (vocab + positions) * hidden + 2 * hidden


def build_model(cfg, dtype, meta: bool = False):
    """The benchmark's GPT-2, initialised in ``dtype`` (seeded). ``meta=True`` builds it on the meta
    device (no memory): for models larger than RAM, once the engine materialises weights block by
    block; the workers build normally until then."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def gpt2_config(args: argparse.Namespace):
    from transformers import GPT2Config

    return GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                      n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def vm_hwm_bytes() -> int:
    """This process's peak resident set size (VmHWM) since it started or since `reset_vm_hwm`."""
    return proc_bytes("/proc/self/status", "VmHWM")


def reset_vm_hwm() -> bool:
    """Start VmHWM again from the present RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# -- one configuration, in a fresh process ----------------------------------------------------------
def worker(args: argparse.Namespace) -> dict:
    import torch

    from fuyou_strategy import ConfigError, FuyouConfig, FuyouEngine

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    meta = args.build == "meta"
    model = build_model(gpt2_config(args), dtype, meta=meta)
    if args.frozen_blocks:
        for p in model.transformer.h.parameters():
            p.requires_grad_(False)
    out = {"config": args.worker, "params": sum(p.numel() for p in model.parameters()),
           "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    config = FuyouConfig(swap_dirs=[args.swap_dir], host_memory_budget=args.host_budget, host_state=args.host_state,
                         device_memory_budget=args.device_budget, weights=args.worker,
                         weight_prefetch_blocks=args.prefetch_blocks, state_slots=args.state_slots,
                         activations=args.activations, state_format=args.state_format)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    try:
        engine = FuyouEngine(model, optimizer, config=config, init_weights=model._init_weights if meta else None)
    except ConfigError as exc:  # e.g. the weights do not fit a budget: a row of the table, not a crash
        return {**out, "refused": str(exc), "peak_rss": vm_hwm_bytes()}
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    times, losses = [], []
    try:
        for i in range(args.warmup + args.steps):
            if i == args.warmup:  # the whole process's peak so far is building the model and the engine's setup
                out["peak_rss_setup"], out["peak_rss_reset"] = vm_hwm_bytes(), reset_vm_hwm()
            start = time.perf_counter()
            engine.begin_micro_batch(update=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            engine.optimizer.step()
            engine.optimizer.zero_grad(set_to_none=True)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
            losses.append(loss.item())
        # Under next_forward (one state slot) the last step's updates run after step() returned: wait for them to
        # land (state_dict() does), timed, so that the peak below covers them too.
        start = time.perf_counter()
        engine.optimizer.state_dict()
        out["land_s"] = time.perf_counter() - start
        # Over the measured steps (the whole process where the reset was refused); before close(),
        # which makes every streamed weight resident again.
        out["peak_rss"] = vm_hwm_bytes()
        summary = engine.summary()
    except BaseException:
        engine.close()
        raise
    result = {**out, "step_s": times, "losses": losses, "summary": summary}
    if meta:
        # close() makes every streamed weight resident again, and a model built on the meta device may not fit in
        # RAM whole (6.7B in fp32: 26.6 GB, on a 24 GiB machine): hand the result over and leave; the parent
        # removes the swap directory.
        print(json.dumps(result), flush=True)
        os._exit(0)
    engine.close()
    return result


# -- compare ----------------------------------------------------------------------------------------
RSS_NOTE = ("setup RSS: VmHWM after building the model, the engine's setup and the warm-up; steps RSS: VmHWM over "
            "the measured steps (reset after the warm-up)")


NOT_STREAMED = "no weight was streamed (summary()['weight_bytes_streamed'] is 0)"


def rss_reset_notes(results) -> list[str]:
    refused = [r.get("size", r.get("config")) for r in results if r.get("peak_rss_reset") is False]
    return [f"the kernel refused to reset VmHWM in {refused}: their steps RSS is the whole process's"] if refused else []


def gib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.2f}"


def mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def billions(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"


def compare(args: argparse.Namespace, argv: list[str], header: list[str]) -> dict:
    configs = args.configs.split(",")
    if configs[0] != "device" or not set(configs) <= set(TIERS):
        raise SystemExit(f"--configs: got {args.configs!r}; a comma list of {', '.join(TIERS)} starting with device "
                         "(the other rows are ratios to it)")
    runs, results = run_interleaved(__file__, [], configs, args.rounds, argv, use_jemalloc=not args.no_jemalloc)
    ref = results["device"]
    if "refused" in ref:
        raise SystemExit(f"weights='device' was refused: {ref['refused']}")
    ref_s = statistics.median(ref["step_s"])
    lines = header + [
        f"medians of {args.steps} steps x {args.rounds} round(s) after {args.warmup} warm-up; each run a fresh process, "
        "configurations interleaved",
        "",
        f"{'weights':<8} {'step s':>8} {'x device':>9} {'setup RSS GiB':>14} {'steps RSS GiB':>14} {'x device':>9} "
        f"{'streamed MiB':>13} {'weight dev peak MiB':>20} {'device peak MiB':>16} {'losses = device':>16}",
        "-" * 137,
    ]
    notes = []
    for config in configs:
        r = results[config]
        if "refused" in r:
            lines.append(f"{config:<8} refused (see below)")
            notes.append(f"{config}: {r['refused']}")
            continue
        s, summary = statistics.median(r["step_s"]), r["summary"]
        lines.append(f"{config:<8} {s:>8.2f} {s / ref_s:>9.2f} {gib(r['peak_rss_setup']):>14} {gib(r['peak_rss']):>14} "
                     f"{r['peak_rss'] / ref['peak_rss']:>9.2f} {mib(summary.get('weight_bytes_streamed')):>13} "
                     f"{mib(summary.get('weight_device_peak_bytes')):>20} {mib(summary.get('device_peak_bytes')):>16} "
                     f"{'yes' if r['losses'] == ref['losses'] else 'NO':>16}")
        if config != "device" and not summary.get("weight_bytes_streamed"):
            notes.append(f"{config}: {NOT_STREAMED}")
    lines += ["", RSS_NOTE, "'streamed', 'weight dev peak', 'device peak': summary()['weight_bytes_streamed'], "
              "['weight_device_peak_bytes'], ['device_peak_bytes'] (the device is host RAM on the CPU)"]
    lines += notes + rss_reset_notes(results.values())
    plot = Path(args.out) / f"{args.stem}.png"
    lines.append(plot_bars(plot, configs, results, ref_s, header[0]))
    return {"runs": runs, "results": results, "table": "\n".join(lines)}


def plot_bars(path: Path, configs: list[str], results: dict, ref_s: float, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot: skipped (matplotlib is not importable in this environment)"
    done = [c for c in configs if "step_s" in results[c]]
    medians = [statistics.median(results[c]["step_s"]) for c in done]
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(done, medians)
    for bar, s in zip(bars, medians):
        ax.annotate(f"{s / ref_s:.2f}x", (bar.get_x() + bar.get_width() / 2, s), ha="center", va="bottom")
    ax.set_xlabel("weights=")
    ax.set_ylabel("median step time (s)")
    return _save(plt, fig, ax, title, path)


# -- scale ------------------------------------------------------------------------------------------
def too_big(params: int, dtype_bytes: int, state_slots: int, free_disk: int, mem_available: int | None,
            state_format: str = "fp32") -> str | None:
    """Why a size cannot run here (``None`` if it can): its estimated SSD footprint over the free
    disk (the optimizer state, 12 B/param per slot in fp32, plus the weights and the gradients on the SSD
    tier; fp32 weights have no copy of their own: they stream from the optimizer's master), or, for a
    model built in memory (``mem_available`` given), its weights over the RAM."""
    from fuyou_strategy.optim.formats import bytes_per_param

    state = bytes_per_param(state_format)
    per_param = state * state_slots + (1 if dtype_bytes == 4 else 2) * dtype_bytes
    if params * per_param * SSD_MARGIN > free_disk:
        return (f"its estimated SSD footprint {gib(params * per_param * SSD_MARGIN)} GiB ({per_param:g} B/param: "
                f"{state_format} state {state:g} x {state_slots} slot(s), "
                f"{'gradients 4 (weights: the master)' if dtype_bytes == 4 else f'weights and gradients {dtype_bytes} each'}; "
                f"x {SSD_MARGIN}) exceeds the free disk in the swap dir, {gib(free_disk)} GiB")
    if mem_available is not None and params * dtype_bytes > mem_available:
        return (f"its weights ({gib(params * dtype_bytes)} GiB) exceed the available RAM ({gib(mem_available)} GiB); "
                "build it on the meta device (--build meta)")
    return None


def scale(args: argparse.Namespace, argv: list[str], header: list[str]) -> dict:
    names = args.sizes.split(",")
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes: unknown {unknown}; choose from {', '.join(SIZES)}")
    lines = header + [
        f"weights='ssd', device_memory_budget {args.device_budget}; {args.steps} step(s) after {args.warmup} warm-up "
        "per size, each a fresh process",
        "",
        f"{'size':<7} {'params':>14} {'layers x hidden':>16} {'step s':>8} {'setup RSS GiB':>14} {'steps RSS GiB':>14} "
        f"{'B/param':>8} {'streamed GiB':>13} {'SSD files GiB':>14} {'free disk GiB':>14}",
        "-" * 133,
    ]
    rows, notes, stopped = [], [], None
    for name in names:
        layers, hidden, heads = SIZES[name]
        params = gpt2_param_count(layers, hidden, args.vocab, args.seq)
        free = shutil.disk_usage(args.swap_dir).free
        ram = proc_bytes("/proc/meminfo", "MemAvailable") if args.build == "memory" else None
        reason = too_big(params, DTYPE_BYTES[args.dtype], args.state_slots, free, ram, args.state_format)
        if reason is not None:
            stopped = f"stopped before {name} ({params:,} params): {reason}"
            break
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            r = run_fresh(__file__, ["--worker", "ssd", *argv, f"--layers={layers}", f"--hidden={hidden}",
                                     f"--heads={heads}"], use_jemalloc=not args.no_jemalloc)
        except SystemExit as exc:  # killed (out of memory) or crashed: larger sizes would not do better
            rows.append({"size": name, "params": params, "free_disk": free, "failed": str(exc)})
            stopped = f"{name} failed, stopped there:\n{str(exc)[-2000:]}"
            break
        rows.append({"size": name, "layers": layers, "hidden": hidden, "heads": heads, "free_disk": free, **r})
        shape = f"{layers} x {hidden}"
        if "refused" in r:
            lines.append(f"{name:<7} {params:>14,} {shape:>16} refused (see below)")
            notes.append(f"{name}: {r['refused']}")
            continue
        if not r["summary"].get("weight_bytes_streamed"):
            notes.append(f"{name}: {NOT_STREAMED}")
        s = statistics.median(r["step_s"])
        lines.append(f"{name:<7} {r['params']:>14,} {shape:>16} {s:>8.2f} {gib(r['peak_rss_setup']):>14} "
                     f"{gib(r['peak_rss']):>14} {r['peak_rss'] / r['params']:>8.2f} "
                     f"{gib(r['summary'].get('weight_bytes_streamed')):>13} "
                     f"{gib(r['summary'].get('ssd_file_bytes')):>14} {gib(free):>14}")
    lines += ["", RSS_NOTE + "; B/param: steps RSS per parameter"] + notes + rss_reset_notes(rows)
    lines += [growth] if (growth := rss_growth(rows)) else []
    lines += [stopped] if stopped else []
    lines.append(plot_rss(Path(args.out) / f"{args.stem}.png", rows,
                          f"{header[0]}; allocator: {allocator(not args.no_jemalloc)}"))
    return {"rows": rows, "stopped": stopped, "table": "\n".join(lines)}


def rss_growth(rows: list[dict]) -> str | None:
    """How far the steps' peak RSS moves across the sizes that ran (the 'flat' figure)."""
    done = [r for r in rows if "step_s" in r]
    if len(done) < 2:
        return None
    low, high = min(r["peak_rss"] for r in done), max(r["peak_rss"] for r in done)
    return (f"steps RSS from {done[0]['size']} to {done[-1]['size']} ({done[-1]['params'] / done[0]['params']:.1f}x "
            f"the parameters): {gib(low)} to {gib(high)} GiB, a spread of {gib(high - low)} GiB")


def plot_rss(path: Path, rows: list[dict], title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot: skipped (matplotlib is not importable in this environment)"
    done = [r for r in rows if "step_s" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["params"] / 1e9 for r in done], [r["peak_rss"] / 2**30 for r in done], marker="o")
    for r in done:
        ax.annotate(r["size"], (r["params"] / 1e9, r["peak_rss"] / 2**30), textcoords="offset points", xytext=(4, 4))
    ax.set_ylim(0, max(r["peak_rss"] for r in done) / 2**30 * 1.25 if done else 1)
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("peak RSS over a step (GiB)")
    return _save(plt, fig, ax, title, path)


def _save(plt, fig, ax, title: str, path) -> str:
    """Title, layout, write ``path``; the line the report prints."""
    ax.set_title(title, fontsize=8, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


# -- command line -----------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    from fuyou_strategy.config import STATE_FORMATS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("mode", choices=("compare", "scale"))
    parser.add_argument("--quick", action="store_true", help="a model of a few MB (shape and step defaults below change)")
    parser.add_argument("--worker", choices=TIERS, help=argparse.SUPPRESS)
    parser.add_argument("--replot", metavar="JSON", help="only draw the PNG of a written weights_<mode>.json again")
    parser.add_argument("--configs", default=",".join(TIERS), help="compare: comma list of weight tiers, device first")
    parser.add_argument("--sizes", default="0.35B,1B,2B,4B", help=f"scale: comma list of {', '.join(SIZES)}")
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq", type=int, default=256, help="sequence length (and n_positions)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--frozen-blocks", action="store_true",
                        help="freeze the blocks' weights (a frozen base: embeddings, final norm and head train)")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="compute dtype; auto: bf16 if the CPU has avx512_bf16 or amx_bf16, else fp32")
    parser.add_argument("--steps", type=int, help="measured steps per run (compare 3, scale 1)")
    parser.add_argument("--warmup", type=int, help="warm-up steps, not measured (compare 2, scale 1)")
    parser.add_argument("--rounds", type=int, default=1, help="compare: run the configurations this many times, "
                                                              "interleaved, each a fresh process")
    parser.add_argument("--host-budget", default="4GiB", help="FuyouConfig.host_memory_budget")
    parser.add_argument("--host-state", default="0", help="FuyouConfig.host_state (default 0: the state on the SSD)")
    parser.add_argument("--device-budget", help="FuyouConfig.device_memory_budget (compare: none, scale: 2GiB)")
    parser.add_argument("--prefetch-blocks", type=int, default=2, help="FuyouConfig.weight_prefetch_blocks")
    parser.add_argument("--activations", choices=("keep", "ssd", "recompute"), default="keep",
                        help="FuyouConfig.activations for every block (ssd/recompute keep RSS flat across sizes)")
    parser.add_argument("--state-slots", type=int, choices=(1, 2), default=2,
                        help="FuyouConfig.state_slots: 1 halves the optimizer state on SSD (no overlapped updates)")
    parser.add_argument("--state-format", choices=STATE_FORMATS, default="fp32",
                        help="FuyouConfig.state_format (8bit: ~6 B/param per slot instead of 12)")
    parser.add_argument("--build", choices=("memory", "meta"),
                        help="build the model in memory, or on the meta device for the engine to materialise block "
                             "by block (compare: memory, so every configuration starts from the same weights; "
                             "scale: meta)")
    parser.add_argument("--swap-dir", help="directory on the SSD (default: a temporary one under --out)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"),
                        help="where weights_<mode>[_quick].json and .png go")
    parser.add_argument("--no-jemalloc", action="store_true")
    first, _ = parser.parse_known_args(argv)
    parser.set_defaults(**{**MODE_DEFAULTS[first.mode], **(QUICK[first.mode] if first.quick else {})})
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0; got {args.steps} and {args.warmup}")
    return args


def replot(path: Path) -> str:
    """Draw the PNG of a written ``weights_<mode>.json`` again (e.g. once matplotlib is installed)."""
    data = json.loads(Path(path).read_text())
    png, title = Path(path).with_suffix(".png"), data["table"].splitlines()[0]
    if data["mode"] == "compare":
        results = data["results"]
        configs = data["args"]["configs"].split(",")
        ref_s = statistics.median(results[configs[0]]["step_s"])
        return plot_bars(png, configs, results, ref_s, title)
    return plot_rss(png, data["rows"], f"{title}; allocator: {data['allocator']}")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.replot:
        print(replot(args.replot))
        return
    if args.worker:
        print(json.dumps(worker(args)))
        return
    args.dtype, dtype_reason = choose_dtype(args.dtype)
    args.stem = f"weights_{args.mode}" + ("_quick" if args.quick else "")
    temporary_swap_dir(args, "weights-swap-", parent=args.out)
    argv = [args.mode, *worker_argv(args, parent_only=("mode", "quick", "configs", "sizes", "out", "stem"))]
    what = "blocks frozen (embeddings, final norm, head train)" if args.frozen_blocks else "full fine-tune"
    if args.mode == "compare":
        params = gpt2_param_count(args.layers, args.hidden, args.vocab, args.seq)
        model = (f"GPT-2 {args.layers} layers x {args.hidden} hidden, {args.heads} heads, vocab {args.vocab}, "
                 f"{args.seq} positions = {params:,} parameters ({billions(params)})")
    else:
        model = f"GPT-2 sizes {args.sizes}, vocab {args.vocab}, {args.seq} positions"
    header = [
        f"model: {model}; {what}; built {'on the meta device' if args.build == 'meta' else 'in memory'}; "
        f"batch {args.batch} x seq {args.seq}",
        f"compute dtype: {args.dtype} ({dtype_reason})",
        f"optimizer: torch.optim.AdamW(fused=True) converted by FuyouEngine (state on SSD, "
        f"{args.state_slots} slot(s), state_format {args.state_format}); host budget "
        f"{args.host_budget}; device budget {args.device_budget or 'none'}; weight prefetch {args.prefetch_blocks} block(s); "
        f"activations {args.activations}",
        f"swap dir: {args.swap_dir} ({gib(shutil.disk_usage(args.swap_dir).free)} GiB free); allocator: "
        f"{allocator(not args.no_jemalloc)}",
    ]
    print("\n".join(header), file=sys.stderr, flush=True)
    result = (compare if args.mode == "compare" else scale)(args, argv, header)
    print(result["table"])
    path = Path(args.out) / f"{args.stem}.json"
    with open(path, "w") as f:
        json.dump({"mode": args.mode, "args": vars(args), "dtype_reason": dtype_reason,
                   "allocator": allocator(not args.no_jemalloc), **result}, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
