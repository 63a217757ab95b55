"""Reads `strace -f -y` output of run.py and checks: every removal of a fuyou save (its folder renamed to
``.tmp-<pid>`` by `checkpoint.discard`) comes after the .ckpt that replaced the one naming it was made durable:
the .ckpt's data fsynced before its rename into place, and its folder fsynced after that rename.

    python audit.py strace.txt
"""
import re
import sys

lines = open(sys.argv[1]).read().splitlines()
rename = re.compile(r'rename(?:at2?)?\(.*?"([^"]+)".*?"([^"]+)"')
fsync = re.compile(r'f(?:data)?sync\((\d+)<([^>]+)>\)\s*=\s*0')
pending_ckpt = {}  # ckpt path -> whether the data of the file renamed onto it was fsynced
synced_tmp = set()  # temp .ckpt files fsynced
durable = {}  # ckpt path -> line number where its folder was fsynced after its last rename
renamed_at = {}
events, problems = [], []
for n, line in enumerate(lines):
    m = fsync.search(line)
    if m:
        path = m.group(2)
        synced_tmp.add(path)
        for ckpt, at in renamed_at.items():
            if path.rstrip("/") == ckpt.rsplit("/", 1)[0] and at < n:
                durable[ckpt] = n
        continue
    m = rename.search(line)
    if not m or "= 0" not in line.rsplit(")", 1)[-1]:
        continue
    src, dst = m.group(1), m.group(2)
    if dst.endswith(".ckpt"):
        renamed_at[dst] = n
        durable.pop(dst, None)
        events.append(f"{n}: .ckpt {dst.rsplit('/', 1)[1]} renamed in; its data fsynced before: {src in synced_tmp}")
        if src not in synced_tmp:
            problems.append(f"line {n}: {dst} renamed in from {src}, which was never fsynced")
    elif ".fuyou/" in src and ".tmp-" in dst and ".tmp-" not in src:
        ckpt = src.split(".fuyou/")[0]
        ok = ckpt in durable and durable[ckpt] > renamed_at.get(ckpt, -1)
        events.append(f"{n}: old save {src.rsplit('/', 1)[1][:8]} of {ckpt.rsplit('/', 1)[1]} removed; "
                      f".ckpt durable first: {ok}")
        if not ok:
            problems.append(f"line {n}: a save of {ckpt} removed before that .ckpt was durable")
print("\n".join(events))
print(f"{len(problems)} problem(s)" + ("".join("\n  " + p for p in problems)))
sys.exit(1 if problems else 0)
