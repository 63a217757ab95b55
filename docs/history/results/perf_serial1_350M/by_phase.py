"""CPU seconds per step, per phase, by thread kind and symbol, of two perf recordings of loop.py, and the
difference (b - a). argv: a.data a.marks b.data b.marks [top]. perf record -a -e cpu-clock -F 499 -k
CLOCK_MONOTONIC; phases from the marks: update (flush), forward, backward, step. Thread kinds: main (the
training thread), omp (its OpenMP team), worker (fuyou's optimizer thread and its team), other threads of the
process, idle (the idle task), system (any other process)."""
import collections, re, subprocess, sys
HZ = 499
PHASES = ["update", "forward", "backward", "step"]

def load(data, marks):
    steps, main, tasks = [], None, {}
    for line in open(marks):
        w = line.split()
        if w[0] == "step": steps.append(tuple(map(float, w[2:])))
        elif w[0] == "main": main = int(w[1])
        elif w[0] == "task": tasks[int(w[1])] = " ".join(w[2:])
    txt = subprocess.run(["perf", "script", "-i", data, "-F", "pid,tid,time,ip,sym,dso"], capture_output=True,
                         text=True).stdout
    pid = None
    cnt = collections.Counter(); kinds = collections.Counter(); wall = collections.Counter()
    for s in steps:
        for k, ph in enumerate(PHASES): wall[ph] += s[k + 1] - s[k]
    for line in txt.splitlines():
        m = re.match(r"\s*(\d+)/(\d+)\s+([\d.]+):\s+\S+\s+(.*?)\s+\((.*)\)\s*$", line)
        if not m: continue
        p, tid, t, sym, dso = int(m.group(1)), int(m.group(2)), float(m.group(3)), m.group(4), m.group(5).split("/")[-1]
        ph = None
        for s in steps:
            if s[0] <= t < s[4]:
                for k in range(4):
                    if s[k] <= t < s[k + 1]: ph = PHASES[k]
                break
        if ph is None: continue
        if tid == 0: kind = "idle"
        elif tid == main: kind = "main"
        elif tid in tasks: kind = "worker" if "fuyou" in tasks[tid] or "optim" in tasks[tid] else "thread"
        else: kind = "system"
        if sym.startswith("[unknown]"): sym = "[unknown]"
        sym = re.sub(r"\(.*", "", sym)[:70]
        cnt[(ph, kind, dso[:24], sym)] += 1; kinds[(ph, kind)] += 1
    n = len(steps)
    return ({k: v / HZ / n for k, v in cnt.items()}, {k: v / HZ / n for k, v in kinds.items()},
            {k: v / n for k, v in wall.items()}, tasks, n)

a, b = load(sys.argv[1], sys.argv[2]), load(sys.argv[3], sys.argv[4])
top = int(sys.argv[5]) if len(sys.argv) > 5 else 15
print(f"a: {sys.argv[1]} ({a[4]} steps)  b: {sys.argv[3]} ({b[4]} steps); CPU seconds per step (2 CPUs: 2 s per wall second)")
print("threads of b:", sorted(set(b[3].values())))
for ph in PHASES:
    print(f"\n== {ph}: wall a {a[2][ph]:.3f} s, b {b[2][ph]:.3f} s, b - a {b[2][ph] - a[2][ph]:+.3f} s")
    ks = sorted({k[1] for k in list(a[1]) + list(b[1]) if k[0] == ph})
    print("   by kind:", ", ".join(f"{k} {a[1].get((ph, k), 0):.3f}->{b[1].get((ph, k), 0):.3f}" for k in ks))
    keys = {k for k in list(a[0]) + list(b[0]) if k[0] == ph}
    diff = sorted(keys, key=lambda k: -abs(b[0].get(k, 0) - a[0].get(k, 0)))[:top]
    for k in diff:
        print(f"   {b[0].get(k, 0) - a[0].get(k, 0):+.3f}  (a {a[0].get(k, 0):.3f}, b {b[0].get(k, 0):.3f})  {k[1]:6} {k[2]:24} {k[3]}")
