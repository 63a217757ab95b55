"""Streaming `FuyouAdamW` state between the SSD tier and a checkpoint folder.

A checkpoint folder holds ``master.bin``, ``exp_avg.bin`` and ``exp_avg_sq.bin`` (raw fp32,
parameters one after another, each in its natural element order, independent of the chunk
size) and ``optimizer.json`` (hyper-parameters, step counts, shapes, offsets and a SHA-256
per parameter and file). State moves chunk by chunk through the host pool; nothing holds a
whole parameter's state, let alone the model's, in RAM.

Saving writes into ``<folder>.tmp-<pid>`` and renames it into place, so a crash never
leaves a half-written folder under the final name. Loading writes into the store's shadow
slot and commits only once every checksum matched, so a corrupt checkpoint changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import torch

from ..storage import SHADOW, HostBuffer, byte_view, gather
from ..storage.rundir import OWNER_FILE, RUN_PREFIX, StaleRun, _dir_bytes, owner_gone
from .pipeline import ChunkJob

if TYPE_CHECKING:
    from .adamw import FuyouAdamW

__all__ = ["CheckpointError", "save", "load", "find_stale_temps", "KINDS"]

FORMAT = 1
KINDS = ("master", "exp_avg", "exp_avg_sq")
META = "optimizer.json"
_TEMP = re.compile(r".+\.tmp-(\d+)")  # a save being written
_SAVE_FILES = {META, OWNER_FILE, *(f"{kind}.bin" for kind in KINDS)}


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing, does not match the optimizer, or fails its checksums."""


def save(opt: "FuyouAdamW", folder: str | os.PathLike) -> dict:
    """Write the committed state of every parameter to ``folder``; returns the metadata."""
    folder = Path(folder)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files = {kind: open(tmp / f"{kind}.bin", "wb") for kind in KINDS}
        hashes = []
        params = []
        for ps in opt._params:
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

            opt._pipeline.submit(ChunkJob(ps.entry, ps.nchunks, write_chunk))
        opt._pipeline.drain()
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        for meta, digest in zip(params, hashes):
            meta["sha256"] = {kind: d.hexdigest() for kind, d in digest.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [opt._by_param[p].index for p in g["params"]]}
                  for g in opt.param_groups]
        meta = {"format": FORMAT, "param_groups": groups, "params": params, "stats": vars(opt.stats).copy(),
                "max_grad_norm": opt.max_grad_norm}
        (tmp / META).write_text(json.dumps(meta, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
        return meta
    except BaseException:
        for f in locals().get("files", {}).values():
            f.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ps_offset(previous: list[dict]) -> int:
    """Byte offset of the next parameter in each state file."""
    return previous[-1]["offset"] + 4 * previous[-1]["numel"] if previous else 0


def load(opt: "FuyouAdamW", folder: str | os.PathLike) -> dict:
    """Stream a checkpoint written by `save` back into the store and the parameters."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / META).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no {META}; is this a FuyouAdamW checkpoint folder?") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{folder}: format {meta.get('format')!r}, this version reads format {FORMAT}")
    if len(meta["params"]) != len(opt._params):
        raise CheckpointError(f"{folder}: holds {len(meta['params'])} parameters, the optimizer has {len(opt._params)}")
    for ps, pm in zip(opt._params, meta["params"]):
        if list(ps.param.shape) != pm["shape"]:
            raise CheckpointError(f"{folder}: parameter {ps.index} has shape {pm['shape']} there, {list(ps.param.shape)} here")
    files = {kind: open(folder / f"{kind}.bin", "rb") for kind in KINDS}
    writes: list[Future] = []
    bad = []
    try:
        for ps, pm in zip(opt._params, meta["params"]):
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
                writes.append(opt.store.write_chunk(ps.entry, k, buf, slot=SHADOW))
            for kind in KINDS:
                if digest[kind].hexdigest() != pm["sha256"][kind]:
                    bad.append(f"{kind}.bin parameter {ps.index}")
    except BaseException:
        gather(writes).exception()
        opt.store.rollback()
        raise
    finally:
        for f in files.values():
            f.close()
    error = gather(writes).exception()
    if error is not None or bad:
        opt.store.rollback()
        if error is not None:
            raise error
        raise CheckpointError(f"{folder}: checksum mismatch in {', '.join(bad[:5])}; nothing was loaded")
    opt.store.commit([ps.entry for ps in opt._params])
    for ps, pm in zip(opt._params, meta["params"]):
        opt.state[ps.param]["step"] = torch.tensor(pm["step"])
    restore_groups(opt, meta["param_groups"])
    if "stats" in meta:
        opt.stats = type(opt.stats)(**meta["stats"])  # commit / redo / skip counts carry on
    opt._restore_weights(opt._params)
    return meta


def restore_groups(opt: "FuyouAdamW", saved_groups: list[dict]) -> None:
    """Put saved hyper-parameters (lr, betas, ...) back into the optimizer's param groups."""
    for group, saved in zip(opt.param_groups, saved_groups):
        group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items() if k != "params"})


def find_stale_temps(roots: Iterable[str]) -> list[StaleRun]:
    """Folders that interrupted saves left anywhere under ``roots``: ``*.tmp-<pid>`` folders that
    hold nothing but checkpoint files and whose writer is gone (`owner_gone`). Run directories
    and symbolic links are not searched."""
    stale = []
    for root in roots:
        for parent, dirs, _files in os.walk(root):
            for name in list(dirs):
                path = os.path.join(parent, name)
                match = _TEMP.fullmatch(name)
                if name.startswith(RUN_PREFIX):
                    dirs.remove(name)
                elif match and _only_save_files(path):
                    dirs.remove(name)
                    reason = owner_gone(path, pid=int(match.group(1)))
                    if reason is not None:
                        stale.append(StaleRun(path, int(match.group(1)), _dir_bytes(path), reason))
    return stale


def _only_save_files(path: str) -> bool:
    try:
        return set(os.listdir(path)) <= _SAVE_FILES
    except OSError:
        return False
