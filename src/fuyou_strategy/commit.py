"""The checkpoint commit protocol: fuyou's optimizer save and a framework's checkpoint file, written in an
order that no kill and no power cut can split into a mismatched pair. Both adapters use it; they only say
when their framework writes, loads and removes its files.

A framework (Lightning, the Hugging Face Trainer) writes its checkpoint file; fuyou streams the optimizer's
SSD state (fp32 masters and moments) into a save folder beside it, ``<folder>/<token>/``, which appears
complete, checksummed and fsynced, by a rename, or not at all (`optim.checkpoint`: the file format). The
framework's file records the token. Then:

1. `begin` writes the new save into ``folder`` and keeps the earlier ones: they belong to the framework
   file still on disk.
2. The framework writes its file, naming the new token, and the file is made durable: written beside
   the old one, fsynced, renamed over it and its folder fsynced (`write_durably`, where fuyou writes it:
   `DurableCheckpointIO`), or fsynced where it lies (`make_durable`: a file, or a folder of files such as
   the Trainer's ``checkpoint-<step>/``; fuyou's saves inside are durable already). If the write fails,
   `abandon` removes the new save (and ``folder``, if the save made it).
3. `commit` makes those files durable and only then removes the earlier saves in ``folder``.

Whenever the process is killed or the power goes, the framework file on disk, the old one or the new,
thus names a save that exists whole. A power cut keeps a file's data only up to its last fsync and a
folder entry only once that folder was fsynced (`storage.durable`); `tests/test_commit.py` replays every
prefix of the three steps under that model.

On load, `resolve_for_load` finds the save the framework file names, and refuses a pair that does not
match with an error naming both files and which is stale; nothing is loaded from a damaged save (its
checksums). `clean` removes the temporary folders a killed writer left (every save and load also does,
in its own folder); `holds_save` tells whether a save appeared in a folder, for an adapter deciding
whether a checkpoint is complete. When the framework removes a checkpoint, `remove` makes that removal
durable before the save goes: no framework file outlives its save.

Data parallel: `begin` is a collective (every rank writes its part of the save; the ranks share the
folder); only the rank that wrote the framework's file commits (``writer``).

Where the adapters put the pieces: Lightning's ``<name>.ckpt`` with ``<name>.ckpt.fuyou/`` beside it
(`integrations.lightning`); the Hugging Face Trainer's ``checkpoint-<step>/`` with ``fuyou_optimizer/``
inside, where the file of step 2 is ``trainer_state.json`` and the Trainer's rotation removes older
checkpoints whole, before a callback can make that file durable (`integrations.hf_checkpoints`: which
checkpoints are complete, and that window).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from .optim.checkpoint import META, CheckpointError, discard, find, newest, read_meta, remove_stale_temps, \
    remove_versions, save_dirs
from .storage import durable
from .storage.durable import fsync_dir, fsync_file, write_durably

if TYPE_CHECKING:
    from .engine import FuyouEngine

__all__ = ["Pending", "begin", "commit", "abandon", "make_durable", "write_durably", "remove", "resolve_for_load",
           "clean", "holds_save"]

_STEP_KEY = "trainer_global_step"  # the framework's step a save was made at, in its optimizer.json's record


@dataclass(frozen=True)
class Pending:
    """A save `begin` wrote that is not committed yet: the earlier saves in its folder still stand."""

    folder: str
    token: str
    steps: int  # optimizer steps taken
    state: dict[str, Any]  # the torch-style state dict naming the save (`FuyouEngine.save`), for the framework's file


def begin(engine: FuyouEngine, folder: str | os.PathLike, *, framework_step: int | None = None) -> Pending:
    """Step 1: stream the engine's optimizer state into a new save in ``folder``, keeping the earlier saves.
    ``framework_step`` (the Hugging Face Trainer's global step) is recorded in the save, for a framework file
    that does not record the token (`resolve_for_load`). Data parallel: a collective."""
    record = {_STEP_KEY: framework_step} if framework_step is not None else None
    state = engine.save(os.fspath(folder), keep_previous=True, record=record)
    return Pending(os.fspath(folder), state["fuyou"]["token"], state["fuyou"]["steps"], state)


def commit(pending: Pending | None, framework_files: Iterable[str | os.PathLike] = (), *, writer: bool = True) -> None:
    """Step 3, once the framework wrote its files naming ``pending``: make ``framework_files`` durable
    (`make_durable`; none, if they were written durably), then remove the saves in ``pending.folder`` but
    ``pending``. ``pending`` None: no new save goes with these files; they are made durable. ``writer``:
    whether this process wrote the framework's files (data parallel: one rank did); the others do nothing.
    If making the files durable fails, nothing is removed."""
    if not writer:
        return
    make_durable(*framework_files)
    if pending is not None:
        remove_versions(pending.folder, keep=pending.token)


def abandon(pending: Pending) -> None:
    """The framework's write failed: remove the save `begin` wrote, and its folder if nothing else is in it."""
    discard(os.path.join(pending.folder, pending.token))
    with contextlib.suppress(OSError):
        os.rmdir(pending.folder)  # if empty: made by this save


def make_durable(*paths: str | os.PathLike) -> None:
    """Make each file of ``paths`` durable where it lies (its data and its entry in its folder); a folder:
    every file and folder in it, and its own entry. fuyou's saves inside are skipped: they fsynced
    themselves, and their folder after each rename. For files someone else wrote in place; their old
    contents may already be gone (`write_durably` never lets that happen)."""
    for path in map(os.fspath, paths):
        if not os.path.isdir(path):
            durable.make_durable(path)
            continue
        for parent, dirs, files in os.walk(path):
            saves = {p.name for p in save_dirs(parent)}
            dirs[:] = [d for d in dirs if d not in saves and ".tmp-" not in d]
            for name in files:
                if not os.path.islink(os.path.join(parent, name)):
                    fsync_file(os.path.join(parent, name))
            fsync_dir(parent)
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def remove(folder: str | os.PathLike, *, removed: Iterable[str | os.PathLike] = ()) -> None:
    """The framework removed its files ``removed`` (those this process removed): make their removal
    durable, then remove the save folder ``folder`` that belonged to them, so that a power cut keeps no
    framework file whose save is gone."""
    for path in removed:
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    shutil.rmtree(folder, ignore_errors=True)


def resolve_for_load(folder: str | os.PathLike, token: str | None, steps: int | None = None, *, named_by: str,
                     fix: str, framework_step: int | None = None) -> Path:
    """The save in ``folder`` that the framework file ``named_by`` belongs to: the one with ``token``, which
    it recorded with ``steps`` optimizer steps; if ``folder`` does not hold it, `CheckpointError` says which
    side is stale and ``fix`` what to do. Without a token and with ``framework_step`` (a Trainer checkpoint
    whose save followed its ``trainer_state.json``, or one written by an earlier version): the newest save,
    if it was made at that step, else refused naming both files."""
    if token is not None or framework_step is None:
        return find(folder, token, steps, named_by=named_by, fix=fix)
    save = newest(folder)
    meta = read_meta(save)
    step = (meta.get("record") or {}).get(_STEP_KEY)
    if step is None:  # an earlier version's save: every Trainer step was one optimizer step, applied or skipped
        step = meta.get("steps", 0) + (meta.get("stats") or {}).get("skips", 0)
    if step != framework_step:
        raise CheckpointError(
            f"{save / META} holds the optimizer state of the Trainer's step {step}, but {named_by} "
            f"resumes at step {framework_step}: the two come from different checkpoints; {fix}")
    return save


def clean(folder: str | os.PathLike) -> None:
    """Remove the temporary folders a killed writer left in the save folder ``folder`` (a save or a
    removal cut short), with a warning naming each."""
    remove_stale_temps(folder)


def holds_save(folder: str | os.PathLike) -> bool:
    """Whether a save appeared in ``folder`` (a save appears only complete, by a rename; whether it is the
    one a framework file names is `resolve_for_load`'s question)."""
    return any((save / META).is_file() for save in save_dirs(folder))
