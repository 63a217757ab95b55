"""cpu-clock samples per phase, per thread, by dso/sym (perf script -F tid,time,ip,sym,dso)."""
import re, sys, subprocess, collections
data, marks = sys.argv[1], sys.argv[2]
top = int(sys.argv[3]) if len(sys.argv) > 3 else 12
steps = [tuple(map(float, l.split()[2:])) for l in open(marks) if l.startswith("step")]
phases = ["fwd", "head+bwd", "step"]
def phase_of(t):
    for s in steps:
        for k in range(3):
            if s[k] <= t < s[k + 1]: return phases[k]
txt = subprocess.run(["perf", "script", "-i", data, "-F", "tid,cpu,time,ip,sym,dso"], capture_output=True, text=True).stdout
cnt = collections.Counter(); per = collections.Counter(); tot = collections.Counter()
for l in txt.splitlines():
    m = re.match(r"\s*(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+\S+\s+(.*?)\s+\((.*)\)\s*$", l)
    if not m: continue
    tid, t, sym, dso = int(m.group(1)), float(m.group(3)), m.group(4), m.group(5).split("/")[-1]
    ph = phase_of(t)
    if ph is None: continue
    tot[ph] += 1; per[(ph, tid)] += 1; cnt[(ph, tid if tid else 0, dso, sym[:60])] += 1
for ph in phases:
    print(f"== {ph}: {tot[ph]} samples; per thread:", {k[1]: v for k, v in per.most_common() if k[0] == ph and v > 10})
    for k, v in cnt.most_common():
        if k[0] == ph and v >= 1:
            top_ = top
    rows = [(k, v) for k, v in cnt.most_common() if k[0] == ph][:top]
    for k, v in rows:
        print(f"   {100*v/tot[ph]:5.1f}%  tid {k[1]:>6}  {k[2][:28]:28} {k[3]}")
