"""Per-process run directories inside swap directories, and cleaning up after crashes.

Each process that stores tensors makes ``<swap_dir>/fuyou-run-<pid>-<token>/`` (mode 0700)
with an ``owner.json`` naming the host, the pid and the process start time. The directory
is removed on close, at interpreter exit, after an uncaught exception and on SIGTERM (see
below). A run killed hard (SIGKILL, power loss) leaves its directory behind;
`find_stale_runs` recognises it because its owner process no longer exists, and
``fuyou clean`` removes it.

SIGTERM's default action kills the process without running atexit handlers or finalizers,
and SIGTERM is how schedulers (Slurm, Kubernetes) stop jobs. So while run directories
exist, a SIGTERM handler removes them and then dies of SIGTERM as the default action would
(the parent still sees ``-SIGTERM``). It is installed from the main thread only, and only
in place of the default action — an application's own handler is never replaced — and the
default comes back when the last run directory is removed from the main thread. If a
handler installed later calls ours, as Lightning's Trainer does with the handler it finds,
that handler decides what SIGTERM means and ours does nothing: Lightning stops at the next
batch and its teardown closes the stores.

Other folders a process may leave behind when killed (a checkpoint save in progress) record
their owner the same way with `write_owner`; `owner_gone` tells whether it still runs, and
`temp_writer_gone` whether anyone still writes or removes a ``*.tmp-<pid>`` folder. A zombie (a
killed process its parent has not reaped yet, e.g. a dead rank whose launcher lives) counts as gone.
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
    """Create this process's 0700 run directory inside ``parent`` and return its path.

    ``parent=None`` makes a fresh temporary directory (``fuyou-swap-*``) to hold it, which
    `remove_run_dir` removes with it. The run directories in ``parent`` of processes that are gone
    (killed runs: their swap files would take the space this run needs) are removed first, with a
    warning naming each.
    """
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
    """Run directories under ``parents`` whose owning process on this host is gone.

    Directories owned by another host are never reported: we cannot tell whether they live.
    """
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
    """Why the process that owns the folder ``path`` no longer runs, or None while it may.

    The owner is read from ``path/<name>`` (`write_owner`); a folder without one is taken
    to belong to ``pid`` on this host (None: it is reported gone). A folder owned by another
    host is never reported: we cannot tell whether its process lives.
    """
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
    """Why no process writes or removes the temporary folder ``path`` any more, or None while one may.

    ``pid`` is the one in its ``*.tmp-<pid>`` name: the process that made it (a save being written,
    whose ``owner.json`` names the same process) or renamed it aside to remove it (a save being
    discarded, whose ``owner.json`` still names the process that wrote it long ago). Both must be
    gone: the owner by `owner_gone` (start time checked), the renaming process by its pid."""
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
    """In a forked child (a DataLoader worker): it owns none of its parent's run directories."""
    global _live_lock
    _live_lock = threading.RLock()  # another thread of the parent may have held it at the fork
    _live.clear()


os.register_at_fork(after_in_child=_forget_parent_runs)
