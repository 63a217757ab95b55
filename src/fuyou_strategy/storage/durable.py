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
from typing import IO, Callable

__all__ = ["fsync_dir", "make_durable", "write_durably"]


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of folder ``path`` (files created, renamed in or removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_durable(path: str | os.PathLike) -> None:
    """Make the file ``path`` durable where it is: its data, and its entry in its folder. For a file
    someone else wrote and renamed into place; its old contents may already be gone (`write_durably`
    never lets that happen)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_durably(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Replace the file ``path`` by what ``write(file)`` writes, so that a power cut at any instant
    leaves the old file or the new one, each whole: written to ``<path>.tmp-<pid>`` beside it, fsynced,
    renamed over ``path``, and the folder fsynced. The temporary file is removed if ``write`` raises."""
    path = os.fspath(path)
    temp = f"{path}.tmp-{os.getpid()}"
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
