"""The checkpoint file format of the optimizer state: writing, reading, verifying, tokens, atomic replace.

This module knows files, not optimizers: what a save holds comes from its caller (`saves.Saves`, for a
`FuyouAdamW`: it streams the state through `SaveWriter` and back through `SaveReader`, and describes the
optimizer's own fields).

Layout: one ``<folder>/<token>/`` (32 hex digits) per save, holding a raw file per piece of the state format
(``master.bin``, ``exp_avg.bin``, ``exp_avg_sq.bin``; for ``8bit`` also ``exp_avg.scale.bin`` and
``exp_avg_sq.scale.bin``: `formats`), parameters one after another in element order, independent of the chunk
size; and ``optimizer.json``: token, format and files, step count, hyper-parameters, shapes, each parameter's
offset, size and SHA-256 per file, the caller's ``record`` (the HF Trainer's step) and a SHA-256 of its own
contents. Saves of formats 2 and 3 still load.

Nothing damaged loads: an edited ``optimizer.json`` fails its own checksum, a state file of another size is
refused before a byte is read, a changed byte fails its file's checksum; each error names the file. The
optimizer commits what it read only once every checksum matched.

Atomic replace: a save writes ``<token>.tmp-<pid>/`` (``owner.json`` first, so ``fuyou clean`` can tell whether
its writer runs), fsyncs every file and the folder, renames it to ``<token>/`` and fsyncs ``<folder>``; only then
does `save` remove the earlier saves (each renamed to a ``.tmp-<pid>`` name first). A caller that records the
token elsewhere (Lightning's ``.ckpt``) calls `save_version`, makes its record durable, then `remove_versions`:
a kill or a power cut at any instant leaves a complete save, and every record names one that exists. Every save
and load first removes the temporary folders whose writer is gone (`remove_stale_temps`).

Data parallel (a `Group` of N ranks): each rank writes the parameters it owns, with their global indices, into
``<token>.tmp-<pid>/part-<rank>/``; once all succeeded, rank 0 writes the top ``optimizer.json`` (every
parameter, with its part) and renames the folder in, else the save fails on every rank. A save stores
parameters, not shards: any number of ranks loads it. The ranks must share the folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ..config import format_bytes
from ..progress import Progress
from ..storage.durable import fsync_dir
from ..storage.rundir import OWNER_FILE, RUN_PREFIX, StaleRun, dir_bytes, temp_writer_gone, write_owner
from .formats import ALL_KINDS, KINDS  # KINDS: the files of an fp32 save (a caller names its format's own)

__all__ = ["CheckpointError", "Group", "SaveReader", "SaveWriter", "save", "save_version", "remove_versions",
           "discard", "find", "newest", "read_meta", "save_dirs", "find_stale_temps", "remove_stale_temps", "KINDS",
           "META"]

log = logging.getLogger("fuyou_strategy.checkpoint")

FORMAT = 4  # 3: one offset per parameter, 4 bytes per element in every file; 2: also optimizer.json without its
#            own checksum (both still read); 1: the state files directly in the folder
_READABLE_FORMATS = (2, 3, FORMAT)
META = "optimizer.json"
META_DIGEST = "meta_sha256"  # optimizer.json's checksum of its other contents
_TOKEN = re.compile(r"[0-9a-f]{32}")
_TEMP = re.compile(r".+\.tmp-(\d+)")  # a save being written or removed (also format 1's <folder>.tmp-<pid>)
_PART = re.compile(r"part-\d+")  # a rank's files inside a sharded save
_SAVE_FILES = {META, OWNER_FILE, *(f"{kind}.bin" for kind in ALL_KINDS)}


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing, does not match the optimizer or its record, or fails its checksums."""


class Group:
    """The ranks writing one save together (`distributed.Sharding`); a process alone is a group of one
    (`distributed.Solo`). Only what a save needs: who I am, and three collectives on plain Python values."""

    rank: int
    world: int

    def broadcast_object(self, values: list) -> None: ...
    def all_gather_object(self, value: Any) -> list: ...
    def barrier(self) -> None: ...


@dataclass
class SaveWriter:
    """Writes one part of a save (a process's parameters, or one rank's): one state file per kind, each
    parameter's chunks in element order, hashed as they go; `chunk` is called on the optimizer's worker
    thread, one parameter after another (its only caller while the writer is open)."""

    into: Path
    total_bytes: int
    progress: bool = True
    kinds: tuple[str, ...] = KINDS  # the files (the state format's pieces; `formats`)
    # per parameter: index, shape, numel, offsets and bytes per kind, step, sha256 per kind
    params: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stack = ExitStack()
        self._files = {kind: self._stack.enter_context(open(self.into / f"{kind}.bin", "wb")) for kind in self.kinds}
        self._at = dict.fromkeys(self.kinds, 0)  # bytes written per file
        self._bar = self._stack.enter_context(Progress(self.total_bytes, f"fuyou: saving optimizer state to "
                                                       f"{self.into.parent}", enabled=self.progress))
        self._digests: list[dict] = []

    def chunk(self, index: int, shape: list[int], numel: int, step: float, data: dict[str, memoryview]) -> None:
        """The next chunk of parameter ``index`` (a new parameter starts when the index changes); ``data``
        holds its bytes per kind (a kind the parameter's layout lacks — the scales of a small parameter
        in an 8-bit save — is absent)."""
        if not self.params or self.params[-1]["index"] != index:
            self.params.append({"index": index, "shape": shape, "numel": numel, "offsets": dict(self._at),
                                "bytes": dict.fromkeys(self.kinds, 0), "step": step})
            self._digests.append({kind: hashlib.sha256() for kind in self.kinds})
        record = self.params[-1]
        for kind, piece in data.items():
            self._files[kind].write(piece)
            self._digests[-1][kind].update(piece)
            self._at[kind] += len(piece)
            record["bytes"][kind] += len(piece)
            self._bar.update(len(piece))

    def close(self) -> list[dict]:
        """Flush and fsync the files; returns each parameter's record with its checksums."""
        try:
            for f in self._files.values():
                f.flush()
                os.fsync(f.fileno())
        finally:
            self._stack.close()
        for record, digest in zip(self.params, self._digests):
            record["sha256"] = {kind: d.hexdigest() for kind, d in digest.items()}
        return self.params

    def abandon(self) -> None:
        self._stack.close()


def save(folder: str | os.PathLike, write_state: Callable[[SaveWriter], None], describe: Callable[[], dict], *,
         group: Group, total_bytes: int = 0, progress: bool = True, record: dict | None = None,
         kinds: tuple[str, ...] = KINDS) -> dict:
    """Add a save to ``folder`` (`save_version`), then remove the earlier saves there; returns its metadata."""
    meta = save_version(folder, write_state, describe, group=group, total_bytes=total_bytes, progress=progress,
                        record=record, kinds=kinds)
    if group.rank == 0:  # the ranks share the folder
        remove_versions(folder, keep=meta["token"])
    group.barrier()
    return meta


def save_version(folder: str | os.PathLike, write_state: Callable[[SaveWriter], None], describe: Callable[[], dict],
                 *, group: Group, total_bytes: int = 0, progress: bool = True,
                 record: dict | None = None, kinds: tuple[str, ...] = KINDS) -> dict:
    """Write a new save ``folder/<token>/`` and return its metadata; no other save in ``folder`` changes.

    ``write_state(writer)`` streams this process's parameters into a `SaveWriter`, with global indices;
    ``describe()`` gives the optimizer's own fields; ``record`` (plain JSON) is kept as ``meta["record"]``;
    ``kinds`` names the state files. The folder appears complete and fsynced, or not at all. With a ``group``
    of several ranks, a collective: the save exists on every rank's return, or fails on all."""
    folder = Path(folder)
    name = [f"{uuid.uuid4().hex}.tmp-{os.getpid()}" if group.rank == 0 else None]
    group.broadcast_object(name)  # rank 0 names the save (its pid: `fuyou clean` knows whether it runs)
    token = name[0].split(".", 1)[0]
    tmp = folder / name[0]
    sharded = group.world > 1
    into = tmp / f"part-{group.rank}" if sharded else tmp
    error, params, meta = None, [], {}
    try:
        if group.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(folder)
            tmp.mkdir()
            write_owner(tmp)  # kept in the save: who wrote it
        group.barrier()
        if sharded:
            into.mkdir()
        meta = _write_state(into, token, write_state, describe, total_bytes, progress, record, kinds)
        params = [dict(pm, part=into.name) for pm in meta["params"]] if sharded else meta["params"]
    except Exception as exc:  # noqa: BLE001 - every rank learns it, below
        if not sharded:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        error = f"rank {group.rank}: {type(exc).__name__}: {exc}"
    except BaseException:
        if not sharded:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not sharded:
        try:
            tmp.rename(folder / token)
            fsync_dir(folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return meta
    reports = group.all_gather_object((error, params))
    failed = [e for e, _p in reports if e is not None]
    if failed:
        if group.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        group.barrier()
        raise CheckpointError(f"{folder}: the sharded save failed on {len(failed)} of {group.world} ranks "
                              f"({'; '.join(failed)}); nothing was saved")
    meta = _meta(token, sorted((pm for _e, ps in reports for pm in ps), key=lambda pm: pm["index"]), describe(), record,
                 kinds)
    meta["parts"] = [f"part-{r}" for r in range(group.world)]
    if group.rank == 0:
        try:
            _write_meta(tmp, meta)
            fsync_dir(tmp)
            tmp.rename(folder / token)
            fsync_dir(folder)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"rank 0 (completing the save): {type(exc).__name__}: {exc}"
    if group.all_gather_object(error)[0] is not None:
        raise CheckpointError(f"{folder}: the sharded save failed: {error or 'on rank 0'}; nothing was saved")
    return meta


def _write_state(into: Path, token: str, write_state: Callable[[SaveWriter], None], describe: Callable[[], dict],
                total_bytes: int, progress: bool, record: dict | None, kinds: tuple[str, ...]) -> dict:
    """The three state files and ``optimizer.json`` of one part (a whole save, in one process), fsynced;
    returns that metadata."""
    writer = SaveWriter(into, total_bytes, progress, kinds)
    try:
        write_state(writer)
    except BaseException:
        writer.abandon()
        raise
    meta = _meta(token, writer.close(), describe(), record, kinds)
    _write_meta(into, meta)
    fsync_dir(into)
    return meta


def _meta(token: str, params: list[dict], described: dict, record: dict | None, kinds: tuple[str, ...]) -> dict:
    return {"format": FORMAT, "token": token, "saved_ns": time.time_ns(), "kinds": list(kinds), **described,
            "params": params, "record": record}


def _meta_digest(meta: dict) -> str:
    """SHA-256 of ``meta`` without its own checksum, over a canonical JSON text (the same for the dict
    written and the dict read back: JSON round-trips Python floats exactly)."""
    body = {k: v for k, v in meta.items() if k != META_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _write_meta(into: Path, meta: dict) -> None:
    meta[META_DIGEST] = _meta_digest(meta)
    with open(into / META, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def remove_versions(folder: str | os.PathLike, keep: str) -> None:
    """Remove every save in ``folder`` but the one with token ``keep``."""
    for path in save_dirs(Path(folder)):
        if path.name != keep:
            discard(path)


def discard(path: str | os.PathLike) -> None:
    """Remove the save folder ``path``; it is renamed to a ``.tmp-<pid>`` name first, so that a
    removal cut short never leaves a partial save under a save's name."""
    path = Path(path)
    trash = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        path.rename(trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def save_dirs(folder: str | os.PathLike) -> list[Path]:
    """The save folders (``<token>/``) in ``folder``: each appeared complete, by a rename."""
    folder = Path(folder)
    try:
        return sorted(p for p in folder.iterdir() if _TOKEN.fullmatch(p.name) and p.is_dir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def read_meta(save: str | os.PathLike) -> dict:
    """The verified ``optimizer.json`` of save folder ``save`` (``<folder>/<token>/``). Raises `CheckpointError`,
    naming the file, when it is missing, not JSON, of a format not read, fails its own checksum (an edited
    ``lr``, bit rot) or names another save than its folder's."""
    save = Path(save)
    file = save / META
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{save}: no {META}; is this a FuyouAdamW save?") from None
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot be read ({exc})") from exc
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"{file}: damaged, not valid JSON ({exc}); nothing was loaded") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file}: damaged, holds a {type(meta).__name__}, not the save's metadata")
    if meta.get("format") not in _READABLE_FORMATS:
        raise CheckpointError(f"{file}: format {meta.get('format')!r}, this version reads formats "
                              f"{', '.join(map(str, _READABLE_FORMATS))}: load it with the fuyou-strategy version "
                              "that wrote it")
    if meta["format"] == 2 and file not in _unprotected_warned:
        _unprotected_warned.add(file)
        log.warning("fuyou: %s was written by an earlier fuyou-strategy (format %s): its values have no checksum, "
                    "so a change to them cannot be detected; the next save writes format %s", file, meta["format"], FORMAT)
    if meta["format"] >= 3 and meta.get(META_DIGEST) != _meta_digest(meta):
        raise CheckpointError(
            f"{file}: its contents do not match the checksum written with them: a value was changed after the save "
            "(an edited lr, step or weight_decay, or a damaged drive); refusing to resume from it, since training "
            "would go on with values the run never had. Resume from another checkpoint")
    if _TOKEN.fullmatch(save.name) and meta.get("token") != save.name:
        raise CheckpointError(f"{file}: records save {str(meta.get('token'))[:8]}, but lies in the folder of save "
                              f"{save.name[:8]}: the file was copied from another save")
    if meta["format"] < 4:  # fp32 files, 4 bytes per element, one offset per parameter: as format 4 records them
        meta["kinds"] = list(KINDS)
        for pm in meta.get("params", []):
            pm["offsets"] = dict.fromkeys(KINDS, pm["offset"])
            pm["bytes"] = dict.fromkeys(KINDS, 4 * pm["numel"])
    return meta


_unprotected_warned: set[Path] = set()  # format-2 files warned about (once each); training thread only


def _saves(folder: Path) -> tuple[dict[str, dict], dict[str, CheckpointError]]:
    """Token -> metadata of each complete save in ``folder``, and token -> the `read_meta` error of each damaged
    one (a save folder appears only complete, by a rename)."""
    saves, damaged = {}, {}
    for path in save_dirs(folder):
        try:
            saves[path.name] = read_meta(path)
        except CheckpointError as exc:
            damaged[path.name] = exc
    return saves, damaged


def _no_save(folder: Path) -> CheckpointError:
    if (folder / META).exists():
        return CheckpointError(
            f"{folder}: a format-1 checkpoint (the state files directly in the folder); this version keeps one "
            f"subfolder per save (format {FORMAT}): load it with the fuyou-strategy version that wrote it")
    return CheckpointError(f"{folder}: no saved optimizer state (no <token>/{META} inside); is this a folder "
                           "written by FuyouAdamW.state_dict(folder)?")


def newest(folder: str | os.PathLike) -> Path:
    """The newest complete save in ``folder``."""
    folder = Path(folder)
    saves, damaged = _saves(folder)
    if damaged:  # which save is newest cannot be told from a damaged one: refuse rather than guess
        raise next(iter(damaged.values()))
    if not saves:
        raise _no_save(folder)
    return folder / max(saves, key=lambda token: saves[token].get("saved_ns", 0))


def find(folder: str | os.PathLike, token: str | None, steps: int | None, *, named_by: str, fix: str) -> Path:
    """The save in ``folder`` with ``token``, which ``named_by`` (a ``.ckpt``, a state dict)
    recorded with ``steps`` optimizer steps. When the folder does not hold it the two come
    from different saves: the error says which one is stale and ``fix`` what to do instead."""
    folder = Path(folder)
    if token is None:
        raise CheckpointError(
            f"{named_by} does not record which save in {folder} it belongs to (written by an earlier fuyou-strategy); "
            f"{fix}")
    saves, damaged = _saves(folder)
    if token in saves:
        return folder / token
    if token in damaged:
        raise CheckpointError(f"{named_by} belongs to optimizer save {token[:8]} in {folder}, which is damaged: "
                              f"{damaged[token]}") from damaged[token]
    if (folder / META).exists():
        raise _no_save(folder)
    recorded = f"{named_by} belongs to optimizer save {token[:8]} (step {steps}), but {folder}"
    if not folder.is_dir():
        raise CheckpointError(f"{recorded} does not exist: it was removed, or not copied along; {fix}")
    held = ", ".join(f"save {t[:8]} (step {m.get('steps')})" for t, m in saves.items()) or "no complete save"
    if steps is not None and any(m.get("steps", 0) > steps for m in saves.values()):
        stale = f"{named_by} is stale: a later save replaced the state it belongs to"
    elif steps is not None and any(m.get("steps", 0) < steps for m in saves.values()):
        stale = f"{folder} is stale: it holds an earlier save than {named_by}"
    else:
        stale = f"{named_by} and {folder} come from different saves"
    raise CheckpointError(f"{recorded} holds {held}: {stale}; {fix}")


class SaveReader:
    """One save, read back for loading: ``optimizer.json`` verified, the files' sizes checked before a byte is
    read, each parameter's bytes hashed chunk by chunk (`read`, `finish` per parameter, then `check`). Opening
    it removes stale temporary folders beside the save (on ``group``'s first rank)."""

    def __init__(self, save: str | os.PathLike, group: Group) -> None:
        self.path = Path(save)
        self.meta = read_meta(self.path)
        if group.rank == 0:
            remove_stale_temps(self.path.parent)
        _check_sizes(self.path, self.meta)
        self._records = {pm["index"]: pm for pm in self.meta["params"]}
        self.kinds = tuple(self.meta["kinds"])
        self._files: dict[Path, dict] = {}  # a part's folder -> its open state files
        self._digests: dict[int, dict] = {}
        self._at: dict[int, dict[str, int]] = {}  # parameter -> bytes read so far per kind (chunks come in order)
        self._bad: list[str] = []
        self._first: Path | None = None  # the folder of the first parameter read (named in a checksum error)

    def check_shapes(self, shapes: list[list[int]]) -> None:
        """Refuse a save of other parameters than ``shapes`` (the optimizer's, in order)."""
        params = self.meta["params"]
        if len(params) != len(shapes):
            raise CheckpointError(f"{self.path}: holds {len(params)} parameters, the optimizer has {len(shapes)}")
        for index, (pm, shape) in enumerate(zip(params, shapes)):
            if list(shape) != pm["shape"]:
                raise CheckpointError(f"{self.path}: parameter {index} has shape {pm['shape']} there, {list(shape)} here")

    def steps(self) -> list[float]:
        """Each parameter's step count, in order."""
        return [pm["step"] for pm in self.meta["params"]]

    def read(self, index: int, start: int, data: dict[str, memoryview]) -> None:
        """Fill ``data`` (per kind, bytes) with parameter ``index``'s chunk that starts at element ``start``;
        a parameter's chunks come in order, from ``start == 0``."""
        pm = self._records[index]
        folder = self.path / pm["part"] if "part" in pm else self.path
        if folder not in self._files:
            self._files[folder] = {kind: open(folder / f"{kind}.bin", "rb") for kind in self.kinds}
            self._first = self._first or folder
        if start == 0:
            self._digests[index] = {kind: hashlib.sha256() for kind in self.kinds}
            self._at[index] = dict.fromkeys(self.kinds, 0)
        at = self._at[index]
        for kind, piece in data.items():
            if at[kind] + len(piece) > pm["bytes"][kind]:
                raise CheckpointError(f"{folder / (kind + '.bin')}: parameter {index} holds {pm['bytes'][kind]} bytes "
                                      "there, more are asked for: the save is of another layout; nothing was loaded")
            got = os.preadv(self._files[folder][kind].fileno(), [piece], pm["offsets"][kind] + at[kind])
            if got != len(piece):
                raise CheckpointError(f"{folder / (kind + '.bin')}: truncated at parameter {index}")
            self._digests[index][kind].update(piece)
            at[kind] += len(piece)

    def finish(self, index: int) -> None:
        """Parameter ``index`` was read whole: note each file whose checksum does not match."""
        digest, at = self._digests.pop(index), self._at.pop(index)
        record = self._records[index]
        for kind in self.kinds:
            if at[kind] != record["bytes"][kind] or digest[kind].hexdigest() != record["sha256"][kind]:
                self._bad.append(f"{kind}.bin parameter {index}")

    def check(self) -> None:
        """Raise if any parameter read so far failed its checksum."""
        if self._bad:
            raise CheckpointError(f"{self._first or self.path}: checksum mismatch in {', '.join(self._bad[:5])}; "
                                  "nothing was loaded")

    def close(self) -> None:
        for files in self._files.values():
            for f in files.values():
                f.close()
        self._files.clear()

    def __enter__(self) -> "SaveReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_sizes(save: Path, meta: dict) -> None:
    """Refuse a save whose state files are not the size its metadata records (bytes appended, a file
    from another save) before a byte is read; truncation is caught here too."""
    expected: dict[Path, tuple[dict[str, int], int]] = {}  # folder holding a part -> (bytes per file, parameters)
    for pm in meta["params"]:
        where = save / pm["part"] if "part" in pm else save
        sizes, count = expected.get(where, (dict.fromkeys(meta["kinds"], 0), 0))
        expected[where] = ({kind: max(size, pm["offsets"][kind] + pm["bytes"][kind]) for kind, size in sizes.items()},
                           count + 1)
    for where, (sizes, count) in expected.items():
        for kind, size in sizes.items():
            file = where / f"{kind}.bin"
            try:
                actual = file.stat().st_size
            except FileNotFoundError:
                raise CheckpointError(f"{file}: missing; the save's {META} records {count} parameters in it") from None
            if actual != size:
                raise CheckpointError(f"{file}: {actual} bytes, but the save's {META} records {size} ({count} "
                                      "parameters): it is not the file this save wrote; nothing was loaded")


def find_stale_temps(roots: Iterable[str]) -> list[StaleRun]:
    """Folders that interrupted saves left anywhere under ``roots``: ``*.tmp-<pid>`` folders that
    hold nothing but checkpoint files (a sharded save's in ``part-<rank>/`` folders) and whose
    writer is gone (`temp_writer_gone`). Run directories and symbolic links are not searched."""
    stale = []
    for root in roots:
        for parent, dirs, _files in os.walk(root):
            for name in list(dirs):
                if name.startswith(RUN_PREFIX):
                    dirs.remove(name)
                elif (temp := _stale_temp(os.path.join(parent, name))) is not None:
                    dirs.remove(name)
                    stale.append(temp)
    return stale


def remove_stale_temps(folder: str | os.PathLike) -> list[StaleRun]:
    """Remove the temporary folders directly in the checkpoint folder ``folder`` whose writer is gone
    (a save killed part-way, a removal cut short), with a warning naming each; returns them."""
    try:
        names = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in names:
        temp = _stale_temp(os.path.join(folder, name))
        if temp is not None:
            log.warning("fuyou: removing %s (%s), left by an interrupted checkpoint save (%s)", temp.path,
                        format_bytes(temp.nbytes), temp.reason)
            shutil.rmtree(temp.path, ignore_errors=True)
            removed.append(temp)
    return removed


def _stale_temp(path: str) -> StaleRun | None:
    """``path`` as a stale temporary save folder, or None if it is not one or its writer may live."""
    match = _TEMP.fullmatch(os.path.basename(path))
    if match is None or os.path.islink(path) or not _only_save_files(path):
        return None
    pid = int(match.group(1))
    reason = temp_writer_gone(path, pid)
    return StaleRun(path, pid, dir_bytes(path), reason) if reason is not None else None


def _only_save_files(path: str) -> bool:
    """Whether the folder ``path`` holds checkpoint files only, directly or (a sharded save) in
    ``part-<rank>/`` folders."""
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False) and _PART.fullmatch(entry.name):
                    if not set(os.listdir(entry.path)) <= _SAVE_FILES:
                        return False
                elif entry.name not in _SAVE_FILES or not entry.is_file(follow_symlinks=False):
                    return False
    except OSError:
        return False
    return True
