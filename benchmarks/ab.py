"""Before/after of one fuyou system, with torch beside it: the same peers-harness run from two source trees.

``old`` puts ``--old-src`` (another checkout's ``src``, e.g. a ``git worktree`` of the commit before a change)
first on ``PYTHONPATH``; ``new`` is this checkout, or ``--new-src``. Each round runs torch, new and old, each a fresh process of
``benchmarks.peers`` (which preloads jemalloc), in an order that alternates between rounds (torch, new, old;
then old, new, torch) so that the machine's drift falls on both sides. Every run's JSON is kept as
``<out>/<variant>-r<round>.json``; ``summary.json`` and the printed table pool the timed steps per variant
(medians, × torch, peak RSS, the last loss of each run) and give each round's ratios, new/old included.

    .venv/bin/python -m benchmarks.ab --old-src /work/old-wt/src --system fuyou-state-ssd --rounds 3 \\
        --out docs/history/results/writes_behind_350M
    .venv/bin/python -m benchmarks.ab --summarise docs/history/results/tail_read_ahead_350M   # the table again
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

VARIANTS = ("torch", "new", "old")


def run(args: argparse.Namespace) -> None:
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="fuyou-ab-")
    for r in range(1, args.rounds + 1):
        for variant in VARIANTS if r % 2 else VARIANTS[::-1]:
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            if variant == "old" or (variant == "new" and args.new_src):
                env["PYTHONPATH"] = os.path.abspath(args.old_src if variant == "old" else args.new_src)
            where = os.path.join(scratch, f"{variant}-r{r}")
            cmd = [sys.executable, "-m", "benchmarks.peers", "--sizes", args.size, "--dtype", args.dtype,
                   "--systems", "torch" if variant == "torch" else args.system, "--batch", str(args.batch),
                   "--rounds", "1", "--warmup", str(args.warmup), "--steps", str(args.steps), "--out", where]
            print(f"round {r}: {variant} ...", flush=True)
            with open(os.path.join(args.out, f"{variant}-r{r}.log"), "w") as log:
                subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
            (result,) = glob.glob(os.path.join(where, "peers-*.json"))
            shutil.copy(result, os.path.join(args.out, f"{variant}-r{r}.json"))
    shutil.rmtree(scratch, ignore_errors=True)
    summarise(args.out)


def summarise(root: str) -> dict:
    """Pool the timed steps of every ``<variant>-r<round>.json`` in ``root``; print and write ``summary.json``."""
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(glob.glob(os.path.join(root, "*-r[0-9].json"))):
        variant, rnd = os.path.basename(path)[: -len(".json")].rsplit("-r", 1)
        (row,) = next(iter(json.load(open(path))["sizes"].values())).values()
        runs.setdefault(variant, {})[int(rnd)] = row
    out: dict = {"variants": {}, "per_round": {}}
    torch_med = statistics.median(s for row in runs["torch"].values() for s in row["step_s"])
    print(f"{'variant':<8}{'median step s':>15}{'x torch':>9}{'peak RSS GiB':>14}  last loss of each run")
    for variant, rounds in runs.items():
        steps = [s for row in rounds.values() for s in row["step_s"]]
        med = statistics.median(steps)
        rss = max(row["peak_rss"] for row in rounds.values()) / 2**30
        losses = sorted({row["losses"][-1] for row in rounds.values()})
        out["variants"][variant] = dict(median_s=med, x_torch=med / torch_med, steps=steps, peak_rss_gib=rss,
                                        last_losses=losses)
        print(f"{variant:<8}{med:>15.2f}{med / torch_med:>9.2f}{rss:>14.2f}  {losses}")
    for r in sorted(runs["torch"]):
        t = runs["torch"][r]["median_s"]
        ratios = {v: runs[v][r]["median_s"] / t for v in runs if v != "torch" and r in runs[v]}
        if r in runs.get("new", {}) and r in runs.get("old", {}):
            ratios["new/old"] = runs["new"][r]["median_s"] / runs["old"][r]["median_s"]
        out["per_round"][r] = ratios
        print(f"round {r}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    json.dump(out, open(os.path.join(root, "summary.json"), "w"), indent=1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old-src", help="the source tree (a checkout's src/) to run as 'old'")
    p.add_argument("--new-src", help="the source tree to run as 'new' (default: the installed package, this "
                   "checkout when installed editable); one apart lets this checkout change while the rounds run")
    p.add_argument("--system", default="fuyou-state-ssd", help="the peers harness's fuyou system to compare")
    p.add_argument("--size", default="350M")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="where the runs' JSON, logs and summary.json go")
    p.add_argument("--summarise", metavar="DIR", help="only print and write the summary of runs already in DIR")
    args = p.parse_args()
    if args.summarise:
        summarise(args.summarise)
    elif not (args.old_src and args.out):
        p.error("--old-src and --out are needed to run (or --summarise DIR)")
    else:
        run(args)


if __name__ == "__main__":
    main()
