"""After / before per round from an update_rate_bench JSON with --before-src: each fuyou system's round medians."""
import json, sys
d = json.load(open(sys.argv[1]))["summary"]
for name, row in d.items():
    if "@before" in name or name + "@before" not in d:
        continue
    after, before = row["round_medians_s"], d[name + "@before"]["round_medians_s"]
    print(f"{name}: after/before per round " + ", ".join(f"{a / b:.2f}" for a, b in zip(after, before))
          + f"; x torch-bare after {d['torch-bare']['median_step_s'] / row['median_step_s']:.2f}, before "
          f"{d['torch-bare']['median_step_s'] / d[name + '@before']['median_step_s']:.2f}")
