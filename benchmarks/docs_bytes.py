"""Bytes of reference docs against bytes of measurement history in docs/ (issue 52: docs split by reader).

    python benchmarks/docs_bytes.py                               # the working tree, the current layout
    python benchmarks/docs_bytes.py --rev 3cc5786 --old-layout    # a commit before the split, its history by name
    python benchmarks/docs_bytes.py --rev 3cc5786 --history docs/results docs/status.md \\
        "docs/gpu.md#The first GPU run (2026-11-26, H200)"        # any classification of your own

Reference: the top-level pages, docs/*.md. History: everything under docs/history/, plus each --history entry
(--old-layout gives the names history had before the split). An entry is a file, a folder (every file under
it) or ``page.md#Heading``: that heading's section, up to the next heading of its level or higher, counts as
history and leaves the page's reference bytes. README.md, CONTRIBUTING.md and images count as neither. "Prose"
is the history's Markdown; the rest is raw output (JSON, logs, scripts). Standard library only; --rev reads
the commit's objects with git.
"""

import argparse
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What was history in docs/ before the split (commit 3cc5786): the log, the status page, two full tables,
# the results folder, and gpu.md's five run-by-run sections.
OLD_HISTORY = [
    "docs/host-state-log.md",
    "docs/status.md",
    "docs/dp-bench.md",
    "docs/peers-gpt2-bf16.md",
    "docs/results",
    "docs/gpu.md#The first GPU run (2026-11-26, H200)",
    "docs/gpu.md#The second GPU run (2026-11-26, H200, same box)",
    "docs/gpu.md#The third GPU run (2026-11-26, H200, 15-minute lease)",
    "docs/gpu.md#The fourth GPU run (2026-11-27, H200, 15-minute lease)",
    "docs/gpu.md#The fifth GPU run (2026-11-27, evening, H200, 15-minute lease): four times the tokens per step",
]


def tree(rev):
    """{path: bytes} of every file under docs/, and a reader of a file's text, in the working tree or at rev."""
    if rev is None:
        sizes = {p.relative_to(ROOT).as_posix(): p.stat().st_size
                 for p in (ROOT / "docs").rglob("*") if p.is_file()}
        return sizes, lambda path: (ROOT / path).read_bytes()
    out = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "-l", rev, "docs/"],
                         capture_output=True, text=True, check=True).stdout
    sizes = {}
    for line in out.splitlines():
        meta, path = line.split("\t", 1)
        sizes[path] = int(meta.split()[3])
    return sizes, lambda path: subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"],
                                              capture_output=True, check=True).stdout


def section_bytes(text, heading):
    """Bytes of the section under ``heading`` (its heading line included), outside fenced code."""
    lines, fence, start, level, end = text.split(b"\n"), False, None, 0, None
    for i, line in enumerate(lines):
        if line.lstrip().startswith(b"```"):
            fence = not fence
        m = None if fence else re.match(rb"^(#{1,6})\s+(.*?)\s*$", line)
        if not m:
            continue
        if start is None and m.group(2).decode() == heading:
            start, level = i, len(m.group(1))
        elif start is not None and len(m.group(1)) <= level:
            end = i
            break
    if start is None:
        raise SystemExit(f"no heading {heading!r}")
    return len(b"\n".join(lines[start:end])) + (1 if end is not None else 0)


def classify(sizes, read, entries):
    """(reference, history) as {path: bytes}; a section entry moves its bytes from the page to history."""
    reference = {p: n for p, n in sizes.items() if re.fullmatch(r"docs/[^/]+\.md", p)}
    history = {p: n for p, n in sizes.items() if p.startswith("docs/history/")}
    for entry in entries:
        path, _, heading = entry.partition("#")
        path = path.rstrip("/")
        if heading:
            n = section_bytes(read(path), heading)
            reference[path] -= n
            history[entry] = n
            continue
        under = {p: n for p, n in sizes.items() if p == path or p.startswith(path + "/")}
        if not under:
            raise SystemExit(f"no such file or folder: {path}")
        for p, n in under.items():
            reference.pop(p, None)
            history[p] = n
    return reference, history


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", help="a git revision instead of the working tree")
    ap.add_argument("--old-layout", action="store_true", help="count the names history had before the split")
    ap.add_argument("--history", nargs="*", default=[], help="more history: files, folders, page.md#Heading")
    args = ap.parse_args()
    sizes, read = tree(args.rev)
    reference, history = classify(sizes, read, (OLD_HISTORY if args.old_layout else []) + args.history)
    prose = {p: n for p, n in history.items() if p.partition("#")[0].endswith(".md")}
    rows = [("reference: docs/*.md", reference), ("history", history),
            ("  of which prose (.md and sections)", prose), ("  of which raw output", {
                p: n for p, n in history.items() if p not in prose})]
    print(f"docs bytes at {args.rev or 'the working tree'}" + (" (old layout)" if args.old_layout else ""))
    print(f"{'':38} {'files':>6} {'bytes':>11}")
    for name, part in rows:
        print(f"{name:38} {len(part):6} {sum(part.values()):11,}")
    ref, prose_n = sum(reference.values()), sum(prose.values())
    print(f"history prose / reference: {prose_n / ref:.2f}; reference share of all prose: "
          f"{ref / (ref + prose_n):.0%}")


if __name__ == "__main__":
    main()
