"""Pool several runs of the peers harness into one table of ratios to torch.

One run of ``python -m benchmarks.peers`` gives a few interleaved rounds; on a 2-core machine whose own torch
step moves by 15% from round to round, a target such as "<= 1.03x torch" needs more rounds than one run takes.
This reads the JSON of several runs of the same code and settings (each must have run ``torch`` beside the
systems), and for every system at every size prints:

- each round's ratio: the system's median step over the median step of the *same run and round's* torch
  (rounds are interleaved, so the two ran minutes apart);
- the median of those per-round ratios, and their spread;
- the pooled ratio: the median of every timed step of the system over the median of every timed step of
  torch, in the runs that ran the system.

It writes the same as JSON with ``--out``. Nothing is re-measured::

    python -m benchmarks.peers.pool docs/history/results/peers_350M_b2_*/peers-gpt2-fp32.json --out pooled.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def pool(paths: list[Path]) -> dict:
    """``{size: {system: {"rounds": [{"run", "round", "ratio"}], "median_ratio", "min", "max", "pooled"}}}``."""
    pairs: dict = {}  # size -> system -> [(run, round, the system's round, the same run and round's torch)]
    for path in paths:
        for size, systems in json.loads(path.read_text())["runs"].items():
            torch_rounds = systems.get("torch") or []
            for name, rounds in systems.items():
                if name != "torch":
                    pairs.setdefault(size, {}).setdefault(name, []).extend(
                        (path.parent.name, i + 1, run, ref) for i, (run, ref) in enumerate(zip(rounds, torch_rounds))
                        if run.get("status") == "ok" and ref.get("status") == "ok")
    return {size: {name: _entry(ok) for name, ok in systems.items()} for size, systems in pairs.items()}


def _entry(ok: list[tuple]) -> dict:
    rounds = [{"run": run, "round": i, "ratio": statistics.median(r["step_s"]) / statistics.median(t["step_s"])}
              for run, i, r, t in ok]
    if not rounds:
        return {"rounds": []}
    ratios = [r["ratio"] for r in rounds]
    # pooled as the harness pools one run's rounds (`run.merge`): the median of every timed step
    pooled = (statistics.median(x for *_, r, _ in ok for x in r["step_s"])
              / statistics.median(x for *_, t in ok for x in t["step_s"]))
    return {"rounds": rounds, "median_ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "pooled": pooled}


def table(pooled: dict) -> str:
    lines = ["| size | system | rounds | per round × torch | median of rounds | pooled × torch |", "|---|---|---|---|---|---|"]
    for size, systems in pooled.items():
        for name, e in systems.items():
            if not e["rounds"]:
                continue
            per = ", ".join(f"{r['ratio']:.2f}" for r in e["rounds"])
            lines.append(f"| {size} | {name} | {len(e['rounds'])} | {per} | {e['median_ratio']:.2f} "
                         f"({e['min']:.2f}–{e['max']:.2f}) | {e['pooled']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="the JSON files the harness wrote (peers-<model>-<dtype>.json)")
    p.add_argument("--out", type=Path, help="write the pooled ratios here as JSON")
    args = p.parse_args(argv)
    pooled = pool(args.results)
    print(table(pooled))
    if args.out:
        args.out.write_text(json.dumps({"sources": [str(s) for s in args.results], "pooled": pooled}, indent=1))


if __name__ == "__main__":
    main()
