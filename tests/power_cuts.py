"""The power-cut model the crash tests replay (`tests/test_power_cut.py`, `tests/test_commit.py`).

A kill keeps everything a process wrote; a power cut keeps only what was made durable. `FsRecorder`
records, in this process, the file-system changes made under a folder (files created or truncated,
fsyncs of files and folders, renames, removals, folders made and removed) by wrapping the os and io
calls that make them (shutil and pathlib go through those). `crash_states` then replays every prefix of
that record under the strict model of what survives:

- a file's data survives as of its last fsync (never fsynced: empty);
- a folder entry (created, renamed in or out, removed) survives once the folder was fsynced after it;
  before that, either outcome: each folder with changes not yet fsynced keeps all of them or none,
  in every combination (ext4 and xfs can keep a rename and lose the renamed file's data).

What lay on disk before the recording is taken as durable. Identical trees are returned once;
`materialize` writes one out.
"""

import builtins
import contextlib
import hashlib
import io
import itertools
import os
import stat
import threading
from pathlib import Path

_EMPTY = (hashlib.sha256(b"").hexdigest(), b"")


class FsRecorder:
    """The file-system changes made under ``root`` while recording (`recording`), as a list of model
    operations on folder and file ids (real inode numbers are reused, ids are not):

    ``("entry", folder, name, target)`` a live folder entry set (``target`` an id) or removed (None);
    ``("data", file, (sha256, bytes))`` an fsync: the file's data as it is now becomes durable;
    ``("sync", folder)`` an fsync of a folder: its live entries become durable."""

    _WRAPPED = ("open", "fsync", "rename", "replace", "unlink", "remove", "mkdir", "rmdir")

    def __init__(self, root):
        self.root = os.path.realpath(root)
        self.ops: list[tuple] = []
        self.base_dirs: dict[int, dict[str, int]] = {}  # the durable tree when the recording started
        self.base_files: dict[int, tuple[str, bytes]] = {}
        self.root_id = None
        self._ids: dict[int, int] = {}  # inode -> id, for what lies under root now
        self._next = itertools.count()
        self._lock = threading.RLock()
        self._originals: dict = {}

    # -- the model's ids ---------------------------------------------------------------------------------
    def _new_id(self, ino):
        self._ids[ino] = next(self._next)
        return self._ids[ino]

    def _snapshot(self):
        self.root_id = self._new_id(os.lstat(self.root).st_ino)
        self.base_dirs[self.root_id] = {}
        for parent, dirs, files in os.walk(self.root):
            here = self._ids[os.lstat(parent).st_ino]
            for name in dirs:
                child = self._new_id(os.lstat(os.path.join(parent, name)).st_ino)
                self.base_dirs[here][name], self.base_dirs[child] = child, {}
            for name in files:
                path = os.path.join(parent, name)
                child = self._new_id(os.lstat(path).st_ino)
                self.base_dirs[here][name] = child
                data = Path(path).read_bytes()
                self.base_files[child] = (hashlib.sha256(data).hexdigest(), data)

    def _under(self, path):
        return path == self.root or path.startswith(self.root + os.sep)

    def _path(self, path, dir_fd=None):
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        parent, name = os.path.split(os.path.abspath(path))
        return os.path.join(os.path.realpath(parent), name)

    def _folder(self, path):
        """The id of the folder holding ``path``, and its name there; None outside root."""
        parent, name = os.path.split(path)
        if not self._under(parent):
            return None, name
        return self._ids[os.lstat(parent).st_ino], name

    def _record(self, *op):
        if op[1] is not None:
            self.ops.append(op)

    # -- the wrapped calls -------------------------------------------------------------------------------
    def _open(self, original):
        def wrapped(file, mode="r", *args, **kwargs):
            writes = isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wxa+")
            if not writes:
                return original(file, mode, *args, **kwargs)
            with self._lock:
                path = self._path(file)
                existed = os.path.exists(path)
                f = original(file, mode, *args, **kwargs)
                self._created_or_truncated(path, existed, "w" in mode)
                return f
        return wrapped

    def _os_open(self, original):
        def wrapped(path, flags, mode=0o777, *, dir_fd=None):
            if not flags & (os.O_CREAT | os.O_TRUNC):
                return original(path, flags, mode, dir_fd=dir_fd)
            with self._lock:
                full = self._path(path, dir_fd)
                existed = os.path.exists(full)
                fd = original(path, flags, mode, dir_fd=dir_fd)
                self._created_or_truncated(full, existed, bool(flags & os.O_TRUNC))
                return fd
        return wrapped

    def _created_or_truncated(self, path, existed, truncates):
        folder, name = self._folder(path)
        if folder is None:
            return
        ino = os.lstat(path).st_ino
        if not existed:
            self._record("entry", folder, name, self._new_id(ino))
            self.ops.append(("data", self._ids[ino], _EMPTY))  # a new inode: nothing of it is durable yet
        elif truncates:
            self.ops.append(("data", self._ids[ino], _EMPTY))  # pessimistic: the truncation kept, no new data

    def _fsync(self, original):
        def wrapped(fd):
            result = original(fd)
            with self._lock:
                where = os.readlink(f"/proc/self/fd/{fd}")
                if self._under(where) and os.fstat(fd).st_ino in self._ids:
                    ident = self._ids[os.fstat(fd).st_ino]
                    if stat.S_ISDIR(os.fstat(fd).st_mode):
                        self.ops.append(("sync", ident))
                    else:
                        with open(f"/proc/self/fd/{fd}", "rb") as f:  # read only: not a change
                            data = f.read()
                        self.ops.append(("data", ident, (hashlib.sha256(data).hexdigest(), data)))
            return result
        return wrapped

    def _rename(self, original):
        def wrapped(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
            with self._lock:
                src_path, dst_path = self._path(src, src_dir_fd), self._path(dst, dst_dir_fd)
                ino = os.lstat(src_path).st_ino
                result = original(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
                (src_folder, src_name), (dst_folder, dst_name) = self._folder(src_path), self._folder(dst_path)
                if src_folder is not None:
                    self._record("entry", src_folder, src_name, None)
                if dst_folder is not None:
                    if ino not in self._ids or src_folder is None:  # came in from outside: its data is not durable
                        self._new_id(ino)
                        self.ops.append(("data", self._ids[ino], _EMPTY))
                    self._record("entry", dst_folder, dst_name, self._ids[ino])
                return result
        return wrapped

    def _remove(self, original):
        def wrapped(path, *, dir_fd=None):
            with self._lock:
                full = self._path(path, dir_fd)
                result = original(path, dir_fd=dir_fd)
                self._record("entry", *self._folder(full), None)
                return result
        return wrapped

    def _mkdir(self, original):
        def wrapped(path, mode=0o777, *, dir_fd=None):
            with self._lock:
                full = self._path(path, dir_fd)
                result = original(path, mode, dir_fd=dir_fd)
                folder, name = self._folder(full)
                if folder is not None:
                    self.ops.append(("sync", self._new_id(os.lstat(full).st_ino)))  # a new folder: empty, durably,
                    self._record("entry", folder, name, self._ids[os.lstat(full).st_ino])  # before any entry names it
                return result
        return wrapped

    def _writes_natively(self, original):
        """A function ``f(obj, path, ...)`` whose file is created and written by native code (torch.save,
        safetensors), out of reach of the wrapped os and io calls: recorded as created (or truncated), nothing
        of it durable yet, once it returns."""
        def wrapped(obj, file, *args, **kwargs):
            if not isinstance(file, (str, bytes, os.PathLike)):
                return original(obj, file, *args, **kwargs)
            with self._lock:
                path = self._path(file)
                existed = os.path.exists(path)
                result = original(obj, file, *args, **kwargs)
                self._created_or_truncated(path, existed, True)
                return result
        return wrapped

    def live_paths(self):
        """The paths under root as the recording says they are now: to check it missed nothing."""
        live = {d: dict(e) for d, e in self.base_dirs.items()}
        for op in self.ops:
            if op[0] == "entry":
                entries = live.setdefault(op[1], {})
                if op[3] is None:
                    entries.pop(op[2], None)
                else:
                    entries[op[2]] = op[3]
            elif op[0] == "sync":
                live.setdefault(op[1], {})
        paths = set()

        def walk(folder, prefix):
            for name, target in live.get(folder, {}).items():
                paths.add(prefix + name)
                walk(target, prefix + name + "/")

        walk(self.root_id, "")
        return paths

    @contextlib.contextmanager
    def recording(self, native=()):
        """Take the tree under root as durable, then record what changes it until the block ends; ``native``:
        ``(module, name)`` of functions that write a file in native code (`_writes_natively`)."""
        self._snapshot()
        wrappers = {"open": self._os_open, "fsync": self._fsync, "rename": self._rename, "replace": self._rename,
                    "unlink": self._remove, "remove": self._remove, "rmdir": self._remove, "mkdir": self._mkdir}
        targets = [(os, name, wrap) for name, wrap in wrappers.items()]
        targets += [(builtins, "open", self._open), (io, "open", self._open)]
        targets += [(module, name, self._writes_natively) for module, name in native]
        for module, name, wrap in targets:
            self._originals[(module, name)] = getattr(module, name)
            setattr(module, name, wrap(getattr(module, name)))
        try:
            yield self
        finally:
            for (module, name), original in self._originals.items():
                setattr(module, name, original)
            self._originals.clear()


def crash_states(recorder):
    """Every tree a power cut during the recording could leave (module docstring), deduplicated: a list of
    ``{relative path: (sha256, bytes) or None for a folder}``, and the number of (prefix, outcome) pairs."""
    live = {d: dict(e) for d, e in recorder.base_dirs.items()}
    durable = {d: dict(e) for d, e in recorder.base_dirs.items()}
    data = dict(recorder.base_files)
    unique, enumerated = {}, 0
    for i in range(len(recorder.ops) + 1):
        if i:
            op = recorder.ops[i - 1]
            if op[0] == "entry":
                _kind, folder, name, target = op
                live.setdefault(folder, {})
                if target is None:
                    live[folder].pop(name, None)
                else:
                    live[folder][name] = target
            elif op[0] == "data":
                data[op[1]] = op[2]
            else:
                live.setdefault(op[1], {})
                durable[op[1]] = dict(live[op[1]])
        pending = [d for d in live if live[d] != durable.get(d, {})]
        assert len(pending) <= 8, f"{len(pending)} folders with changes not yet durable: too many outcomes to try"
        for kept in itertools.chain.from_iterable(itertools.combinations(pending, n) for n in range(len(pending) + 1)):
            enumerated += 1
            tree = {}

            def walk(folder, prefix, depth=0):
                assert depth < 32, "a folder inside itself"
                entries = live[folder] if folder in kept else durable.get(folder, {})
                for name, target in sorted(entries.items()):
                    if target in live or target in durable:
                        tree[prefix + name] = None
                        walk(target, prefix + name + "/", depth + 1)
                    else:
                        tree[prefix + name] = data.get(target, _EMPTY)

            walk(recorder.root_id, "")
            key = hashlib.sha256(repr(sorted((p, v and v[0]) for p, v in tree.items())).encode()).hexdigest()
            unique.setdefault(key, tree)
    return list(unique.values()), enumerated


def materialize(tree, into):
    into.mkdir(parents=True)
    for path, value in tree.items():
        if value is None:
            (into / path).mkdir(parents=True, exist_ok=True)
        else:
            (into / path).parent.mkdir(parents=True, exist_ok=True)
            (into / path).write_bytes(value[1])
