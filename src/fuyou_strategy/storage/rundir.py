"""Per-process run directories inside swap directories, and cleaning up after crashes.

Each process that stores tensors makes ``<swap_dir>/fuyou-run-<pid>-<token>/`` (mode 0700) with an
``owner.json`` (host, pid, process start time). It is removed on close, at exit, after an uncaught exception
and on SIGTERM; one a hard kill leaves behind is found by `find_stale_runs` (its owner is gone) and removed by
``fuyou clean``.

SIGTERM (how Slurm and Kubernetes stop jobs) kills without running atexit handlers, so while run directories
exist a handler removes them, then dies of SIGTERM as the default would. It is installed from the main thread
only, in place of the default action (never of an application's handler), and the default returns with the
last run directory. A later handler that calls ours (Lightning's) decides what SIGTERM means; ours does nothing.
A forked child (a DataLoader worker) owns none of its parent's run directories: SIGTERM takes its default action
there again.

Other folders a killed process may leave (a checkpoint save) record their owner with `write_owner`;
`owner_gone` and `temp_writer_gone` tell whether anyone still writes them. A zombie counts as gone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..config import format_bytes

__all__ = ["RUN_PREFIX", "make_run_dir", "StaleRun", "find_stale_runs", "remove_run_dir", "write_owner", "owner_gone",
           "owner_pid", "pid_running", "temp_writer_gone", "dir_bytes"]

log = logging.getLogger("fuyou_strategy.storage")

RUN_PREFIX = "fuyou-run-"
_RUN_NAME = re.compile(re.escape(RUN_PREFIX) + r"(\d+)-[0-9a-f]+")  # fuyou-run-<pid>-<token>
OWNER_FILE = "owner.json"


def _process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (guards against pid reuse), or None when no
    such process runs. A zombie (dead, not yet reaped by its parent: a killed rank whose launcher
    still lives) or a process being torn down counts as not running: it will never write again."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields after the closing paren are plain.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X", "x"):  # zombie, dead
        return None
    return int(fields[19])


def pid_running(pid: int) -> bool:
    """Whether a live (not zombie) process ``pid`` exists on this host."""
    return _process_start_ticks(pid) is not None


def make_run_dir(parent: str | None) -> str:
    """Create this process's 0700 run directory inside ``parent`` (``None``: a fresh temporary ``fuyou-swap-*``
    directory, removed with it) and return its path. Run directories in ``parent`` whose process is gone are
    removed first, with a warning: their swap files would take the space."""
    if parent is None:
        return _make_run_dir_in_temporary_dir()
    for stale in find_stale_runs([parent]):
        log.warning("fuyou: removing %s (%s), the run directory of a process that is gone (%s)", stale.path,
                    format_bytes(stale.nbytes), stale.reason)
        remove_run_dir(stale.path)
    token = secrets.token_hex(4)
    path = os.path.join(parent, f"{RUN_PREFIX}{os.getpid()}-{token}")
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
    write_owner(path)
    _track(path, None)
    return path


def _make_run_dir_in_temporary_dir() -> str:
    parent = tempfile.mkdtemp(prefix="fuyou-swap-")
    try:
        path = make_run_dir(parent)
    except BaseException:
        shutil.rmtree(parent, ignore_errors=True)
        raise
    _track(path, parent)  # removed with its run directory
    return path


@dataclass
class StaleRun:
    path: str
    pid: int | None
    nbytes: int
    reason: str


def dir_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def find_stale_runs(parents: Iterable[str]) -> list[StaleRun]:
    """Run directories under ``parents`` whose owning process on this host is gone (never another host's)."""
    stale = []
    for parent in parents:
        try:
            children = sorted(Path(parent).iterdir())
        except FileNotFoundError:
            continue
        for child in children:
            match = _RUN_NAME.fullmatch(child.name)
            if match is None or not child.is_dir() or child.is_symlink():
                continue
            # A directory whose owner.json is not written yet belongs to the pid in its name.
            if (reason := owner_gone(child, pid=int(match.group(1)))) is not None:
                stale.append(StaleRun(str(child), owner_pid(child), dir_bytes(str(child)), reason))
    return stale


def owner_pid(path: str | os.PathLike, name: str = OWNER_FILE) -> int | None:
    """The pid that ``path/<name>`` (`write_owner`) records, or None if it is missing or unreadable."""
    try:
        pid = json.loads((Path(path) / name).read_text()).get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) else None


def remove_run_dir(path: str) -> None:
    """Remove a run directory; refuses paths that are not fuyou run directories."""
    if not os.path.basename(os.path.normpath(path)).startswith(RUN_PREFIX):
        raise ValueError(f"refusing to remove {path!r}: not a fuyou run directory ({RUN_PREFIX}*)")
    failures: list[str] = []
    shutil.rmtree(path, onerror=lambda _fn, name, exc: failures.append(f"{name}: {exc[1]}"))
    if failures and os.path.exists(path):
        log.warning("fuyou: could not remove run directory %s (%s); `fuyou clean --dir %s` removes it once "
                    "this process has ended", path, "; ".join(failures[:3]), os.path.dirname(path))
    temporary_parent = _untrack(path)
    if temporary_parent is not None:
        shutil.rmtree(temporary_parent, ignore_errors=True)


def write_owner(path: str | os.PathLike, name: str = OWNER_FILE) -> None:
    """Record this process (host, pid, start time) in ``path/<name>`` (mode 0600; it must not exist),
    fsynced: the folder it lies in may be fsynced and renamed into place later (a checkpoint save)."""
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": _process_start_ticks(os.getpid()),
             "created": time.time()}
    fd = os.open(os.path.join(path, name), os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(owner, f)
        f.flush()
        os.fsync(f.fileno())


def owner_gone(path: str | os.PathLike, pid: int | None = None, name: str = OWNER_FILE) -> str | None:
    """Why the process that owns folder ``path`` (``path/<name>``, `write_owner`) no longer runs, or None while it
    may. Without an owner file, the owner is ``pid`` on this host (None: gone); another host's is never gone."""
    try:
        owner = json.loads((Path(path) / name).read_text())
    except (OSError, ValueError):
        if pid is None:
            return "no readable owner.json"
        owner = {"host": socket.gethostname(), "pid": pid}
    if owner.get("host") != socket.gethostname():
        return None
    pid = owner.get("pid")
    ticks = _process_start_ticks(pid) if isinstance(pid, int) else None
    if ticks is None:
        return f"process {pid} is not running"
    if owner.get("start_ticks") is not None and ticks != owner["start_ticks"]:
        return f"pid {pid} now belongs to another process"
    return None


def temp_writer_gone(path: str | os.PathLike, pid: int) -> str | None:
    """Why no process writes or removes the temporary folder ``path`` any more, or None while one may. ``pid``
    (from its ``*.tmp-<pid>`` name) made it, or renamed it aside to remove it; both it and the ``owner.json``'s
    process must be gone."""
    reason = owner_gone(path, pid=pid)
    if reason is None:
        return None
    owner = owner_pid(Path(path))
    if owner is not None and owner != pid and pid_running(pid):
        return None  # renamed aside by a live process, which is removing it now
    return reason


# -- removal on SIGTERM (see the module docstring) ------------------------------------------------
_live: dict[str, str | None] = {}  # this process's run directories -> the temporary parent made for each
_live_lock = threading.RLock()  # re-entrant: a store's finalizer may run (gc) while this thread holds it


def _track(path: str, temporary_parent: str | None) -> None:
    with _live_lock:
        _live[path] = temporary_parent
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)


def _untrack(path: str) -> str | None:
    with _live_lock:
        temporary_parent = _live.pop(path, None)
        main = threading.current_thread() is threading.main_thread()
        if not _live and main and signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return temporary_parent


def _on_sigterm(signum: int, frame: object) -> None:
    if signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        return  # called by a handler installed after ours: that handler owns SIGTERM
    try:
        for path, temporary_parent in tuple(_live.items()):  # no lock: the interrupted main thread may hold it
            shutil.rmtree(temporary_parent or path, ignore_errors=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


def _forget_parent_runs() -> None:
    """In a forked child (a DataLoader worker): it owns none of its parent's run directories, and SIGTERM takes its
    default action again, as before any run: the kernel's, whatever the child is doing. Under our handler a SIGTERM
    that arrived just before a wait for signals (``signal.pause``) stayed pending until another signal came, and the
    child never died."""
    global _live_lock
    _live_lock = threading.RLock()  # another thread of the parent may have held it at the fork
    _live.clear()
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:  # never an application's handler
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_forget_parent_runs)
