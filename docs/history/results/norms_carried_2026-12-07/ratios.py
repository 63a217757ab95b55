"""carried.txt -> per configuration (chunks, threads): each round's step in ms for each system, and the ratios
carried / first and carried / before, per round and of the medians."""
import re
import statistics
import sys
from collections import defaultdict

rows = defaultdict(lambda: defaultdict(dict))  # (chunks, threads) -> system -> round -> ms
rnd = 0
for line in open(sys.argv[1] if len(sys.argv) > 1 else "carried.txt"):
    m = re.match(r"round (\d+)", line)
    if m:
        rnd = int(m.group(1))
        continue
    m = re.match(r"(before|after, first|after, carried):\s+calls=\w+ threads=(\d+) elems=\d+ chunks=(\d+): step ([\d.]+) ms", line)
    if m:
        rows[(int(m.group(3)), int(m.group(2)))][m.group(1)][rnd] = float(m.group(4))
for (chunks, threads), systems in sorted(rows.items(), reverse=True):
    print(f"{chunks} chunks, {threads} threads")
    for name, per in systems.items():
        print(f"  {name:16s} " + ", ".join(f"{per[r]:.2f}" for r in sorted(per)) + f"  median {statistics.median(per.values()):.2f}")
    c, f, b = systems["after, carried"], systems["after, first"], systems["before"]
    print("  carried / first:  " + ", ".join(f"{c[r] / f[r]:.2f}" for r in sorted(c))
          + f"  (medians {statistics.median(c.values()) / statistics.median(f.values()):.2f})")
    print("  carried / before: " + ", ".join(f"{c[r] / b[r]:.2f}" for r in sorted(c))
          + f"  (medians {statistics.median(c.values()) / statistics.median(b.values()):.2f})")
    print("  first / before:   " + ", ".join(f"{f[r] / b[r]:.2f}" for r in sorted(c))
          + f"  (medians {statistics.median(f.values()) / statistics.median(b.values()):.2f})")
