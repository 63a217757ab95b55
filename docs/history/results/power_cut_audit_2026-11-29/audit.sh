#!/bin/bash
# strace the run (before: a checkout's src on PYTHONPATH, e.g. git archive 92aa3bf src), then audit it.
here=$(cd "$(dirname "$0")" && pwd); out=${1:-$here}; work=$(mktemp -d)
strace -f -y -qq -o "$out/strace.txt" -e trace=rename,renameat,renameat2,fsync,fdatasync,unlink,unlinkat,rmdir,mkdir \
  "$here/../../../../.venv/bin/python" "$here/run.py" "$work" > "$out/run.txt" 2>&1
python3 "$here/audit.py" "$out/strace.txt" | tee "$out/audit.txt"
rm -rf "$work"
