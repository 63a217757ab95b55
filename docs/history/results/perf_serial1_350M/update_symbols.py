"""Full symbol names of the samples in the update (flush) and step phases of one loop.py recording, by thread
(main: the training thread; thr: another thread of the process; idle: the idle task), CPU seconds per step.
argv: perf.data marks."""
import collections, re, subprocess, sys
data, marks = sys.argv[1], sys.argv[2]
steps = [tuple(map(float, l.split()[2:])) for l in open(marks) if l.startswith("step")]
main = [int(l.split()[1]) for l in open(marks) if l.startswith("main")][0]
txt = subprocess.run(["perf", "script", "-i", data, "-F", "tid,time,ip,sym"], capture_output=True, text=True).stdout
c = {"update": collections.Counter(), "step": collections.Counter()}
for l in txt.splitlines():
    m = re.match(r"\s*(\d+)\s+([\d.]+):\s+\S+\s+(.*)$", l)
    if not m: continue
    tid, t, sym = int(m.group(1)), float(m.group(2)), m.group(3).strip()
    who = "main" if tid == main else "idle" if tid == 0 else "thr"
    for s in steps:
        if s[0] <= t < s[1]: c["update"][(who, sym[:150])] += 1
        if s[3] <= t < s[4]: c["step"][(who, sym[:150])] += 1
for ph in c:
    print(f"-- {ph} phase, CPU seconds per step ({len(steps)} steps)")
    for k, v in c[ph].most_common(12): print(f"{v / 499 / len(steps):.3f}", k)
