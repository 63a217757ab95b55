"""What the benchmarks share: fresh-process runs, the allocator, peak RSS, medians."""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


def allocator(use_jemalloc: bool = True) -> str:
    """The allocator the child processes will use."""
    preloaded = "jemalloc" in os.environ.get("LD_PRELOAD", "")
    name = "jemalloc" if preloaded or (use_jemalloc and os.path.exists(JEMALLOC)) else "glibc malloc"
    conf = os.environ.get("MALLOC_CONF")  # e.g. dirty_decay_ms:-1: freed pages kept for reuse (no page faults)
    return f"{name} (MALLOC_CONF={conf})" if conf and name == "jemalloc" else name


def fresh_env(use_jemalloc: bool = True) -> dict[str, str]:
    """The environment of a child process: this one's, with jemalloc preloaded when installed and wanted."""
    env = dict(os.environ)
    if use_jemalloc and os.path.exists(JEMALLOC) and "jemalloc" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = JEMALLOC
    return env


def run_fresh(script: str, argv: list[str], use_jemalloc: bool = True) -> dict:
    """Run ``script argv`` in a new Python process (jemalloc preloaded when installed); parse its last line as JSON."""
    proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, env=fresh_env(use_jemalloc))
    if proc.returncode != 0:
        raise SystemExit(f"{script} {' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def proc_bytes(path: str, field: str) -> int:
    """A ``Field:  N kB`` line of a /proc file, in bytes."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{path} has no {field} line")


def peak_rss_bytes() -> int:
    """This process's peak resident set size."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_interleaved(script: str, once: list[str], repeated: list[str], rounds: int, argv: list[str],
                    use_jemalloc: bool = True) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Run ``once`` configurations once, then ``repeated`` ones ``rounds`` times, interleaved.

    Each run is a fresh process (``script --worker CONFIG argv``). Returns every run, and per
    configuration one merged result: all timed steps (``step_s``) of all rounds, and the
    median of the processes' ``peak_rss``.
    """
    runs: dict[str, list[dict]] = {}
    for config in once + repeated * rounds:
        print(f"running {config} ...", file=sys.stderr, flush=True)
        runs.setdefault(config, []).append(run_fresh(script, ["--worker", config, *argv], use_jemalloc))
    merged = {}
    for config, rs in runs.items():
        result = dict(rs[-1])
        if "step_s" in result:
            result["step_s"] = [t for r in rs for t in r["step_s"]]
            result["peak_rss"] = statistics.median(r["peak_rss"] for r in rs)
        merged[config] = result
    return runs, merged


def worker_argv(args: argparse.Namespace, parent_only: tuple[str, ...]) -> list[str]:
    """The parent's options, as ``--name=value`` (``--flag`` for a set switch) for its workers, less
    those only the parent uses."""
    skip = {"worker", "json", "no_jemalloc", "rounds", *parent_only}
    return [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in vars(args).items()
            if k not in skip and v is not None and v is not False]


def temporary_swap_dir(args: argparse.Namespace, prefix: str, parent: str | None = None) -> None:
    """Set ``args.swap_dir`` to a fresh temporary directory in ``parent`` (default ``$TMPDIR`` or
    /tmp), removed at exit, unless one was given."""
    if args.swap_dir is not None:
        return
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(prefix=prefix, dir=parent or os.environ.get("TMPDIR", "/tmp"))
    atexit.register(tmp.cleanup)
    args.swap_dir = tmp.name


def parse_or_work(parser: argparse.ArgumentParser, worker) -> argparse.Namespace | None:
    """Parse the command line; in a worker process (``--worker``) run ``worker`` and print its
    JSON result for `run_fresh`, returning ``None``."""
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return None
    return args


def add_gpt2_arguments(parser: argparse.ArgumentParser, name: str, *, layers: int, hidden: int, vocab: int, seq: int,
                       batch: int, steps: int, warmup: int, rounds: int, host_budget: str = "1GiB") -> None:
    """The options every GPT-2 benchmark has: model shape, batch, steps, rounds, host budget, swap dir,
    allocator, and ``--json`` (``benchmarks/results/<name>.json``)."""
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--steps", type=int, default=steps, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=warmup, help="warm-up steps, not measured")
    parser.add_argument("--rounds", type=int, default=rounds,
                        help="run the configurations this many times, interleaved, each a fresh process")
    parser.add_argument("--host-budget", default=host_budget, help="FuyouConfig.host_memory_budget")
    parser.add_argument("--host-state", default="0",
                        help="FuyouConfig.host_state (default 0: the optimizer state all on the SSD, as measured before "
                             "the host tier existed; 'auto': what the budget leaves)")
    parser.add_argument("--swap-dir", help="directory on the SSD (default: a temporary one)")
    parser.add_argument("--no-jemalloc", action="store_true")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / f"{name}.json"))


def gpt2_model(layers: int, hidden: int, seq: int):
    """A GPT-2 of ``layers`` blocks of width ``hidden`` (heads of 64), GPT-2's vocabulary, ``seq`` positions,
    dropout off, seeded: the same weights in every process."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=hidden // 64, vocab_size=50257, n_positions=seq,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def write_results(path: str, results: dict) -> None:
    """Print a benchmark's table (``results["table"]``) and write all of ``results`` as JSON."""
    print(results["table"])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {path}")


def fit_gpt2_lightning(args: argparse.Namespace, strategy, total_steps: int, *, warmup_schedule: bool = False):
    """Train a GPT-2 (``args``' shape, fused AdamW) with ``Trainer(strategy=...)`` for ``total_steps``
    optimizer steps on random tokens; returns the time of every step after the first, and the trainer."""
    import warnings

    warnings.simplefilter("ignore")
    import lightning as L
    import torch
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel

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
            if not warmup_schedule:
                return opt
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: min(1.0, (s + 1) / 10)), "interval": "step"}}

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_end(self, *a) -> None:
            self.marks.append(time.perf_counter())

    timer = StepTimer()
    data = torch.randint(0, args.vocab, (total_steps * args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=total_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer])
    trainer.fit(Module(), DataLoader(data, batch_size=args.batch))
    return [b - a for a, b in zip(timer.marks, timer.marks[1:])], trainer


def choose_dtype(requested: str, cpuinfo: str = "/proc/cpuinfo") -> tuple[str, str]:
    """``(dtype, why)``: bf16 where the CPU computes it natively, else fp32; ``requested`` overrides."""
    if requested != "auto":
        return requested, "--dtype"
    try:
        with open(cpuinfo) as f:
            flags = {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        flags = set()
    native = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if native:
        return "bf16", f"/proc/cpuinfo flags include {', '.join(native)}"
    return "fp32", "no avx512_bf16 or amx_bf16 in /proc/cpuinfo: bf16 matmuls would be emulated"
