"""Streaming `FuyouAdamW` state between the SSD tier and a checkpoint folder.

A checkpoint folder holds one subfolder per save, named by the save's token (32 hex digits):
``<folder>/<token>/`` holds ``master.bin``, ``exp_avg.bin`` and ``exp_avg_sq.bin`` (raw fp32,
parameters one after another, each in its natural element order, independent of the chunk
size) and ``optimizer.json`` (the token, the optimizer step count, hyper-parameters, shapes,
offsets, a SHA-256 per parameter and file, what the caller asked to record — the HF Trainer's
step — and a SHA-256 of ``optimizer.json``'s own contents). State moves chunk by chunk through the
host pool; nothing holds a whole parameter's state, let alone the model's, in RAM.

Nothing damaged loads: a changed value in ``optimizer.json`` (an ``lr``, a ``step``) fails its own
checksum, a state file of another size than the one recorded is refused before a byte is read,
and a flipped, missing or truncated byte in one fails that file's checksum; each error names the
file. A save written by the previous format (2, without the metadata checksum) still loads.

A save never touches an earlier one before it is complete: it writes ``<token>.tmp-<pid>/``
(with an ``owner.json`` first, so that ``fuyou clean`` can tell whether its writer still runs),
fsyncs every file and the folder, renames it to ``<token>/`` and fsyncs ``<folder>``; only
then does `save` remove the earlier saves (each renamed to a ``.tmp-<pid>`` name first, so a
half-removed save never looks complete). Every save and load first removes the temporary folders
in its checkpoint folder whose writer is gone (`remove_stale_temps`: a save killed earlier, which
would otherwise hold a full copy of the state for good). A caller that records the token elsewhere — the
Lightning strategy's ``.ckpt`` — writes with `save_version` and removes the earlier saves with
`remove_versions` only after that record is written. A process killed at any instant thus
leaves at least one complete save, and every record names a save that exists.

Loading takes the save a state dict names (`find`: its token must be in the folder, or the
error says which side is stale) or the newest one (`newest`), writes it into the store's
shadow slot and commits only once every checksum matched, so a bad checkpoint changes nothing.

**Data parallel** (an optimizer sharded over a process group, `distributed.Shards`): every rank
writes the parameters it owns into ``<token>.tmp-<pid>/part-<rank>/`` (the same files, its
parameters only, with their global indices); when every rank reports success, rank 0 writes the
top ``optimizer.json`` (every parameter, with the part that holds it) and renames the folder into
place; if any rank failed, the save fails on every rank and nothing is left. A save stores
parameters, not rank shards: any number of ranks (one included) loads it, each reading the
parameters it owns from whichever part holds them, and an unsharded save loads into N ranks.
The folder must be shared by the ranks (one machine, or a shared filesystem).
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
from concurrent.futures import Future
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import torch

from ..config import STATE_BYTES_PER_PARAM, format_bytes
from ..progress import Progress
from ..storage import ACTIVE, SHADOW, HostBuffer, byte_view, gather
from ..storage.rundir import OWNER_FILE, RUN_PREFIX, StaleRun, dir_bytes, temp_writer_gone, write_owner
from .pipeline import ChunkJob

if TYPE_CHECKING:
    from .adamw import FuyouAdamW

__all__ = ["CheckpointError", "save", "save_version", "remove_versions", "discard", "find", "newest", "load",
           "read_meta", "save_dirs", "find_stale_temps", "remove_stale_temps", "KINDS", "META"]

log = logging.getLogger("fuyou_strategy.checkpoint")

FORMAT = 3  # 2: optimizer.json without its own checksum (still read); 1: the state files directly in the folder
_READABLE_FORMATS = (2, FORMAT)
KINDS = ("master", "exp_avg", "exp_avg_sq")
META = "optimizer.json"
META_DIGEST = "meta_sha256"  # optimizer.json's checksum of its other contents
_TOKEN = re.compile(r"[0-9a-f]{32}")
_TEMP = re.compile(r".+\.tmp-(\d+)")  # a save being written or removed (also format 1's <folder>.tmp-<pid>)
_PART = re.compile(r"part-\d+")  # a rank's files inside a sharded save
_SAVE_FILES = {META, OWNER_FILE, *(f"{kind}.bin" for kind in KINDS)}


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing, does not match the optimizer or its record, or fails its checksums."""


def save(opt: "FuyouAdamW", folder: str | os.PathLike, record: dict | None = None) -> dict:
    """Add a save of the committed state to ``folder``, then remove the earlier saves there;
    returns its metadata (``token``, ``steps``, ...)."""
    meta = save_version(opt, folder, record)
    if opt.shards is None or opt.shards.rank == 0:  # the ranks share the folder
        remove_versions(folder, keep=meta["token"])
    if opt.shards is not None:
        opt.shards.barrier()
    return meta


def save_version(opt: "FuyouAdamW", folder: str | os.PathLike, record: dict | None = None) -> dict:
    """Write the committed state of every parameter to ``folder/<token>/`` and return its
    metadata; no other save in ``folder`` changes. The subfolder appears complete and fsynced,
    or not at all (an interrupted save leaves a ``<token>.tmp-<pid>/``, which the next save or
    load in ``folder`` removes, as does ``fuyou clean``). ``record`` (plain JSON values) is kept
    in the metadata as ``meta["record"]``: what the caller needs to tie the save to its own files.
    Sharded over a process group: a collective, every rank writing its part (module docstring)."""
    if opt.shards is not None:
        return _save_sharded(opt, Path(folder), record)
    folder = Path(folder)
    token = uuid.uuid4().hex
    tmp = folder / f"{token}.tmp-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(folder)
    tmp.mkdir()
    try:
        write_owner(tmp)  # kept in the save: who wrote it
        meta = _write_state(opt, tmp, token, record=record)
        _fsync_dir(tmp)
        tmp.rename(folder / token)
        _fsync_dir(folder)
        return meta
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_state(opt: "FuyouAdamW", into: Path, token: str, owned: list | None = None, record: dict | None = None) -> dict:
    """Stream the state of every parameter (or of ``owned``) into ``into``'s files, fsync them, and
    write optimizer.json last."""
    owned = opt._params if owned is None else owned
    with ExitStack() as stack:
        files = {kind: stack.enter_context(open(into / f"{kind}.bin", "wb")) for kind in KINDS}
        bar = stack.enter_context(Progress(sum(ps.numel for ps in owned) * STATE_BYTES_PER_PARAM,
                                           f"fuyou: saving optimizer state to {into.parent}", enabled=opt.config.progress))
        hashes = []
        params = []
        for ps in owned:
            digest = {kind: hashlib.sha256() for kind in KINDS}
            hashes.append(digest)
            params.append({"index": ps.index, "shape": list(ps.param.shape), "numel": ps.numel,
                           "offset": ps_offset(params), "step": float(opt.state[ps.param]["step"])})

            def write_chunk(k: int, buf: HostBuffer, ps=ps, digest=digest) -> None:
                _start, n = ps.span(k)
                with buf:
                    state = buf.view(torch.float32)
                    for i, kind in enumerate(KINDS):
                        view = byte_view(state[i * n : (i + 1) * n])
                        files[kind].write(view)
                        digest[kind].update(view)
                    bar.update(3 * 4 * n)

            opt._pipeline.submit(ChunkJob(ps.entry, ps.nchunks, write_chunk))
        opt._pipeline.drain()
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    for meta, digest in zip(params, hashes):
        meta["sha256"] = {kind: d.hexdigest() for kind, d in digest.items()}
    meta = _optimizer_meta(opt, token, params, record)
    _write_meta(into, meta)
    return meta


def _optimizer_meta(opt: "FuyouAdamW", token: str, params: list[dict], record: dict | None) -> dict:
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [opt._by_param[p].index for p in g["params"]]}
              for g in opt.param_groups]
    return {"format": FORMAT, "token": token, "steps": opt.stats.steps, "saved_ns": time.time_ns(),
            "param_groups": groups, "params": params, "stats": opt.stats.to_dict(), "schedule": opt.chooser.state_dict(),
            "scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
            "max_grad_norm": opt.max_grad_norm, "record": record}


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


def _save_sharded(opt: "FuyouAdamW", folder: Path, record: dict | None) -> dict:
    """Every rank writes its part; the save exists, complete, on every rank's return, or fails on all."""
    shards = opt.shards
    name = [f"{uuid.uuid4().hex}.tmp-{os.getpid()}" if shards.rank == 0 else None]
    shards.broadcast_object(name)  # rank 0 names the save (its pid: `fuyou clean` knows whether it runs)
    token = name[0].split(".", 1)[0]
    tmp, part = folder / name[0], f"part-{shards.rank}"
    error, params = None, []
    try:
        if shards.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(folder)
            tmp.mkdir()
            write_owner(tmp)
        shards.barrier()
        (tmp / part).mkdir()
        params = [dict(pm, part=part) for pm in _write_state(opt, tmp / part, token, opt._owned(), record)["params"]]
        _fsync_dir(tmp / part)
    except Exception as exc:  # noqa: BLE001 - every rank learns it, below
        error = f"rank {shards.rank}: {type(exc).__name__}: {exc}"
    reports = shards.all_gather_object((error, params))
    failed = [e for e, _p in reports if e is not None]
    if failed:
        if shards.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        shards.barrier()
        raise CheckpointError(f"{folder}: the sharded save failed on {len(failed)} of {shards.world} ranks "
                              f"({'; '.join(failed)}); nothing was saved")
    meta = _optimizer_meta(opt, token, sorted((pm for _e, ps in reports for pm in ps), key=lambda pm: pm["index"]), record)
    meta["parts"] = [f"part-{r}" for r in range(shards.world)]
    if shards.rank == 0:
        try:
            _write_meta(tmp, meta)
            _fsync_dir(tmp)
            tmp.rename(folder / token)
            _fsync_dir(folder)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"rank 0 (completing the save): {type(exc).__name__}: {exc}"
    if shards.all_gather_object(error)[0] is not None:
        raise CheckpointError(f"{folder}: the sharded save failed: {error or 'on rank 0'}; nothing was saved")
    return meta


def ps_offset(previous: list[dict]) -> int:
    """Byte offset of the next parameter in each state file."""
    return previous[-1]["offset"] + 4 * previous[-1]["numel"] if previous else 0


def _fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (files created, renamed in) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    """The verified ``optimizer.json`` of the save folder ``save`` (``<folder>/<token>/``).

    Raises `CheckpointError`, naming the file, when it is missing, is not JSON, was written by a
    format this version does not read, does not match its own checksum (a value changed after the
    save: an edited ``lr`` or ``step``, bit rot) or names another save than its folder's."""
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
    if meta["format"] != FORMAT and file not in _unprotected_warned:
        _unprotected_warned.add(file)
        log.warning("fuyou: %s was written by an earlier fuyou-strategy (format %s): its values have no checksum, "
                    "so a change to them cannot be detected; the next save writes format %s", file, meta["format"], FORMAT)
    if meta["format"] == FORMAT and meta.get(META_DIGEST) != _meta_digest(meta):
        raise CheckpointError(
            f"{file}: its contents do not match the checksum written with them: a value was changed after the save "
            "(an edited lr, step or weight_decay, or a damaged drive); refusing to resume from it, since training "
            "would go on with values the run never had. Resume from another checkpoint")
    if _TOKEN.fullmatch(save.name) and meta.get("token") != save.name:
        raise CheckpointError(f"{file}: records save {str(meta.get('token'))[:8]}, but lies in the folder of save "
                              f"{save.name[:8]}: the file was copied from another save")
    return meta


_unprotected_warned: set[Path] = set()  # format-2 files warned about (once each); training thread only


def _saves(folder: Path) -> tuple[dict[str, dict], dict[str, CheckpointError]]:
    """Token -> metadata of each complete save in ``folder``, and token -> what is wrong with each
    save whose ``optimizer.json`` fails `read_meta` (a save folder appears only complete, by a rename:
    one that fails is damaged, never half-written)."""
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


def load(opt: "FuyouAdamW", path: str | os.PathLike) -> dict:
    """Stream the save at ``path`` (a ``<folder>/<token>/`` from `find` or `newest`) back into
    the store and the parameters."""
    folder = Path(path)
    meta = read_meta(folder)
    if opt.shards is None or opt.shards.rank == 0:  # the ranks share the folder
        remove_stale_temps(folder.parent)
    if len(meta["params"]) != len(opt._params):
        raise CheckpointError(f"{folder}: holds {len(meta['params'])} parameters, the optimizer has {len(opt._params)}")
    for ps, pm in zip(opt._params, meta["params"]):
        if list(ps.param.shape) != pm["shape"]:
            raise CheckpointError(f"{folder}: parameter {ps.index} has shape {pm['shape']} there, {list(ps.param.shape)} here")
    _check_sizes(folder, meta)
    # This rank's parameters (all of them without a process group), each from the part that holds it.
    owned = opt._owned()
    items = [(ps, pm, folder / pm["part"] if "part" in pm else folder) for ps, pm in zip(opt._params, meta["params"])
             if opt._owns(ps)]
    if opt.config.state_slots == 1:  # no shadow slot to stage in: verify every checksum first, then write
        _stream_state(opt, items, write=False)
    _stream_state(opt, items, write=True)
    opt.store.commit([ps.entry for ps in owned])
    for ps, pm in zip(opt._params, meta["params"]):
        opt.state[ps.param]["step"] = torch.tensor(pm["step"])
    restore_groups(opt, meta["param_groups"])
    if "stats" in meta:
        opt.stats = type(opt.stats).from_dict(meta["stats"])  # commit / redo / skip counts carry on
    opt.chooser.load_state_dict(meta.get("schedule", {}))
    if opt.scaler is not None and meta.get("scaler") is not None:
        opt.scaler.load_state_dict(meta["scaler"])
    opt._window, opt.stats.last_reason = opt.chooser.choose()
    opt._restore_weights(owned)
    if opt.shards is not None:  # every weight from its owner, as after a step, and landed now
        opt._send_later({ps.index for ps in opt._params})
        opt._land()
    return meta


def _check_sizes(save: Path, meta: dict) -> None:
    """Refuse a save whose state files are not the size its metadata records (bytes appended, a file
    from another save) before a byte is read; truncation is caught here too."""
    expected: dict[Path, tuple[int, int]] = {}  # folder holding a part -> (bytes per file, parameters)
    for pm in meta["params"]:
        where = save / pm["part"] if "part" in pm else save
        size, count = expected.get(where, (0, 0))
        expected[where] = (max(size, pm["offset"] + 4 * pm["numel"]), count + 1)
    for where, (size, count) in expected.items():
        for kind in KINDS:
            file = where / f"{kind}.bin"
            try:
                actual = file.stat().st_size
            except FileNotFoundError:
                raise CheckpointError(f"{file}: missing; the save's {META} records {count} parameters in it") from None
            if actual != size:
                raise CheckpointError(f"{file}: {actual} bytes, but the save's {META} records {size} ({count} "
                                      "parameters): it is not the file this save wrote; nothing was loaded")


def _stream_state(opt: "FuyouAdamW", items: list[tuple], *, write: bool) -> None:
    """Read the state of each ``(parameter, its metadata, the folder holding it)`` from the save,
    checking its checksums; with ``write``, into the store's shadow slot (the active one with
    ``state_slots=1``, once a pass without ``write`` found every checksum good). Raises
    `CheckpointError` on a mismatch, with nothing committed."""
    slot = ACTIVE if opt.config.state_slots == 1 else SHADOW
    opened: dict[Path, dict] = {}
    writes: list[Future] = []
    bad = []
    where = items[0][2] if items else Path(".")
    bar = Progress(sum(ps.numel for ps, _pm, _f in items) * STATE_BYTES_PER_PARAM,
                   f"fuyou: {'loading' if write else 'checking'} optimizer state from {where.parent}",
                   enabled=opt.config.progress)
    try:
        for ps, pm, folder in items:
            if folder not in opened:
                opened[folder] = {kind: open(folder / f"{kind}.bin", "rb") for kind in KINDS}
            files = opened[folder]
            digest = {kind: hashlib.sha256() for kind in KINDS}
            for k in range(ps.nchunks):
                start, n = ps.span(k)
                buf = opt.store.pool.acquire(3 * 4 * n)
                state = buf.view(torch.float32)
                try:
                    for i, kind in enumerate(KINDS):
                        view = byte_view(state[i * n : (i + 1) * n])
                        got = os.preadv(files[kind].fileno(), [view], pm["offset"] + 4 * start)
                        if got != len(view):
                            raise CheckpointError(f"{folder / (kind + '.bin')}: truncated at parameter {ps.index}")
                        digest[kind].update(view)
                except BaseException:
                    buf.release()
                    raise
                del state, view  # no view may outlive the buffer, which the write gives back to the pool
                if write:
                    writes.append(opt.store.write_chunk(ps.entry, k, buf, slot=slot))
                else:
                    buf.release()
                bar.update(3 * 4 * n)
            for kind in KINDS:
                if digest[kind].hexdigest() != pm["sha256"][kind]:
                    bad.append(f"{kind}.bin parameter {ps.index}")
    except BaseException:
        gather(writes).exception()
        opt.store.rollback()
        raise
    finally:
        bar.close()
        for files in opened.values():
            for f in files.values():
                f.close()
    error = gather(writes).exception()
    if error is not None or bad:
        opt.store.rollback()
        if error is not None:
            raise error
        raise CheckpointError(f"{where}: checksum mismatch in {', '.join(bad[:5])}; nothing was loaded")


def restore_groups(opt: "FuyouAdamW", saved_groups: list[dict]) -> None:
    """Put saved hyper-parameters (lr, betas, ...) back into the optimizer's param groups."""
    for group, saved in zip(opt.param_groups, saved_groups):
        group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items() if k != "params"})


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
