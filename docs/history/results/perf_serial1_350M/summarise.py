"""The A/B files of this folder (loop.py's lines) as one table: mean step of steps 4-13 and its phases, each
against the same round's torch; then each mode's pooled mean step over its rounds' torch. argv: files."""
import collections, re, sys
rows = []
for f in sys.argv[1:]:
    r = 0
    for line in open(f):
        if line.startswith("round"):
            r = int(line.split()[1]); continue
        m = re.match(r"(\w+) median step \(4..\) ([\d.]+) mean ([\d.]+) \| mean update ([\d.]+) forward ([\d.]+) "
                     r"backward ([\d.]+) step ([\d.]+)", line)
        if m:
            rows.append((f, r, m.group(1), *map(float, m.groups()[1:])))
torch_ = {(f, r): x for f, r, mode, *x in rows if mode == "torch"}
print("| file, round | mode | mean step s | x torch | update | forward (vs torch) | backward (vs torch) | step |")
print("|---|---|---|---|---|---|---|---|")
mine, theirs = collections.Counter(), collections.Counter()
for f, r, mode, _med, mean, u, fw, bw, st in rows:
    t = torch_[(f, r)]
    print(f"| {f.split('_')[-1].split('.')[0]} {r} | {mode} | {mean:.3f} | {mean / t[1]:.3f} | {u:.3f} | {fw:.3f} ({fw - t[3]:+.2f}) "
          f"| {bw:.3f} ({bw - t[4]:+.2f}) | {st:.3f} |")
    if mode != "torch":
        mine[mode] += mean; theirs[mode] += t[1]
for mode in mine:
    print(f"{mode}: pooled mean step x torch {mine[mode] / theirs[mode]:.3f}")
