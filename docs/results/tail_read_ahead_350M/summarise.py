"""Pool the timed steps of run.sh's rounds (each run's JSON copied here as <variant>-r<round>.json) per variant: medians, ratios, per-round ratios, peak RSS, losses."""
import glob
import json
import os
import statistics
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
runs = {}
for path in sorted(glob.glob(os.path.join(root, "*-r[0-9].json"))):  # <variant>-r<round>.json, the harness's JSON
    variant, rnd = os.path.basename(path)[: -len(".json")].rsplit("-r", 1)
    data = json.load(open(path))
    (system, row), = data["sizes"]["350M"].items()
    runs.setdefault(variant, {})[int(rnd)] = row
out = {"variants": {}, "per_round": {}}
torch_med = statistics.median(s for row in runs["torch"].values() for s in row["step_s"])
print(f"{'variant':<8}{'median step s':>15}{'x torch':>9}{'peak RSS GiB':>14}  loss after 9 steps")
for variant, rounds in runs.items():
    steps = [s for row in rounds.values() for s in row["step_s"]]
    med = statistics.median(steps)
    rss = max(row["peak_rss"] for row in rounds.values()) / 2**30
    losses = {row["losses"][-1] for row in rounds.values()}
    out["variants"][variant] = dict(median_s=med, x_torch=med / torch_med, steps=steps, peak_rss_gib=rss,
                                    last_losses=sorted(losses))
    print(f"{variant:<8}{med:>15.2f}{med / torch_med:>9.2f}{rss:>14.2f}  {sorted(losses)}")
for r in sorted(runs["torch"]):
    t = runs["torch"][r]["median_s"]
    ratios = {v: runs[v][r]["median_s"] / t for v in runs if v != "torch"}
    ratios["new/old"] = runs["new"][r]["median_s"] / runs["old"][r]["median_s"]
    out["per_round"][r] = ratios
    print(f"round {r}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
json.dump(out, open(os.path.join(root, "summary.json"), "w"), indent=1)
