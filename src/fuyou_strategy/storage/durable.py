"""What survives a power cut, and the few calls that make a file or a folder entry survive it.

After a power cut a file system keeps a file's data only up to its last ``fsync``, and a folder
entry (a file or folder created, renamed in, removed) only once that folder was fsynced after the
change; anything else may be lost, or kept, in any mix (ext4 and xfs may keep a renamed file's name
without its data). So a file that replaces another is written beside it, fsynced, renamed over it,
and its folder fsynced (`write_durably`); only then may anything the old file referred to go.

The guarantee is the file system's: ext4, xfs and btrfs on a local drive honour fsync (unless
mounted ``nobarrier``, or on a drive that lies about its cache); tmpfs keeps nothing over a power
cut; a network file system (NFS, Lustre, a FUSE mount) keeps what its server committed, as its
mount options say.
"""

from __future__ import annotations

import os
import re
from typing import IO, Callable, Iterable

from .rundir import RUN_PREFIX, StaleRun, pid_running

__all__ = ["fsync_dir", "fsync_file", "make_durable", "write_durably", "find_stale_temp_files"]

_TEMP_FILE = re.compile(r".+\.tmp-(\d+)")  # `write_durably`'s <name>.tmp-<pid>


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of folder ``path`` (files created, renamed in or removed) durable."""
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def fsync_file(path: str | os.PathLike) -> None:
    """Make the data of the file ``path`` durable (not its entry in its folder: `make_durable`)."""
    _fsync(path, os.O_RDONLY)


def _fsync(path: str | os.PathLike, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_durable(path: str | os.PathLike) -> None:
    """Make the file ``path`` durable where it is: its data, and its entry in its folder. For a file
    someone else wrote and renamed into place; its old contents may already be gone (`write_durably`
    never lets that happen)."""
    fsync_file(path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_durably(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Replace the file ``path`` by what ``write(file)`` writes, so that a power cut at any instant
    leaves the old file or the new one, each whole: written to ``<path>.tmp-<pid>`` beside it, fsynced,
    renamed over ``path``, and the folder fsynced. The temporary file is removed if ``write`` raises, and
    those of ``path`` that a killed process left are removed first (`find_stale_temp_files`)."""
    path = os.fspath(path)
    temp = f"{path}.tmp-{os.getpid()}"
    folder, name = os.path.split(os.path.abspath(path))
    for stale in _stale_temp_files(folder, lambda other: other.startswith(f"{name}.tmp-")):
        os.unlink(stale.path)
    try:
        with open(temp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def find_stale_temp_files(roots: Iterable[str], suffix: str = ".ckpt") -> list[StaleRun]:
    """The temporary files ``<name><suffix>.tmp-<pid>`` that `write_durably` left anywhere under ``roots``
    when its process was killed mid-write (``pid`` no longer runs): for ``fuyou clean``. Run directories
    and symbolic links are not searched."""
    stale = []
    for root in roots:
        for parent, dirs, _files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(RUN_PREFIX)]
            stale += _stale_temp_files(parent, lambda name: name.rsplit(".tmp-", 1)[0].endswith(suffix))
    return stale


def _stale_temp_files(folder: str, ours: Callable[[str], bool]) -> list[StaleRun]:
    found = []
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        match = _TEMP_FILE.fullmatch(entry.name)
        if match is None or not ours(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and not pid_running(pid):
            found.append(StaleRun(entry.path, pid, entry.stat(follow_symlinks=False).st_size,
                                  f"left by a write cut short; process {pid} is not running"))
    return found
