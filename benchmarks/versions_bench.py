"""Two checkouts of fuyou-strategy side by side: `optimizer_bench`'s configurations from each, in one run.

For a change that must not make the optimizer slower (a refactor): each configuration runs from each
tree's ``src`` (``PYTHONPATH``), in a fresh process, rounds interleaved (A, B, A, B, ...), jemalloc
preloaded when installed. Prints per configuration the median step of each tree, the spread of the
per-round medians (min-max), and B / A; writes JSON.

    .venv/bin/python benchmarks/versions_bench.py --before /path/to/old-checkout --after . \\
        --configs fuyou-io,fuyou,fuyou-clip --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import allocator, fresh_env, temporary_swap_dir  # noqa: E402

BENCH = str(Path(__file__).parent / "optimizer_bench.py")


def run_from(tree: Path, config: str, argv: list[str], use_jemalloc: bool) -> dict:
    """One `optimizer_bench` worker run with ``tree``'s package."""
    env = fresh_env(use_jemalloc)
    env["PYTHONPATH"] = str(tree / "src")
    proc = subprocess.run([sys.executable, BENCH, "--worker", config, *argv], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{config} from {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, type=Path, help="checkout A (the reference)")
    parser.add_argument("--after", required=True, type=Path, help="checkout B")
    parser.add_argument("--configs", default="fuyou-io,fuyou,fuyou-clip")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--host-budget", default="512MiB")
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--swap-dir")
    parser.add_argument("--no-jemalloc", action="store_true")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "versions_bench.json"))
    args = parser.parse_args()
    temporary_swap_dir(args, "fuyou-versions-")
    argv = [f"--layers={args.layers}", f"--hidden={args.hidden}", f"--seq={args.seq}", f"--batch={args.batch}",
            f"--steps={args.steps}", f"--warmup={args.warmup}", f"--host-budget={args.host_budget}",
            f"--io-threads={args.io_threads}", f"--swap-dir={args.swap_dir}", "--io-size=0", "--io-block=1048576"]
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    configs = args.configs.split(",")
    runs: dict[str, dict[str, list[dict]]] = {c: {t: [] for t in trees} for c in configs}
    for r in range(args.rounds):
        for config in configs:
            for name, tree in trees.items():
                print(f"round {r + 1}/{args.rounds}: {config} from {name} ...", file=sys.stderr, flush=True)
                runs[config][name].append(run_from(tree, config, argv, not args.no_jemalloc))
    lines = [f"GPT-2 {args.layers} layers x {args.hidden} hidden, batch {args.batch} x seq {args.seq}; allocator: "
             f"{allocator(not args.no_jemalloc)}; {args.rounds} interleaved rounds of {args.steps} timed steps "
             f"after {args.warmup} warm-up, each a fresh process; before = {trees['before']}, after = {trees['after']}",
             "", f"{'configuration':<12} {'before s':>9} {'spread':>15} {'after s':>9} {'spread':>15} {'after/before':>13}",
             "-" * 78]
    summary = {}
    for config in configs:
        row = {}
        for name in trees:
            per_round = [statistics.median(run["step_s"]) for run in runs[config][name]]
            row[name] = {"median_s": statistics.median(t for run in runs[config][name] for t in run["step_s"]),
                         "round_medians_s": per_round}
        ratio = row["after"]["median_s"] / row["before"]["median_s"]
        summary[config] = {**row, "after_over_before": ratio}
        spread = {n: f"{min(row[n]['round_medians_s']):.3f}-{max(row[n]['round_medians_s']):.3f}" for n in trees}
        lines.append(f"{config:<12} {row['before']['median_s']:>9.3f} {spread['before']:>15} "
                     f"{row['after']['median_s']:>9.3f} {spread['after']:>15} {ratio:>13.3f}")
    table = "\n".join(lines)
    print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "runs": runs,
                   "table": table}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
