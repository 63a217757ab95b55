"""A Hugging Face Trainer's ``checkpoint-<step>`` folders: which are complete, decided from the files.

`FuyouCallback` writes fuyou's half of a checkpoint *inside* the Trainer's save, by the commit protocol
(`..commit`), in this order:

1. the Trainer's files (model, optimizer, scheduler, RNG states) into ``checkpoint-<step>/``;
2. fuyou's state into ``checkpoint-<step>/fuyou_optimizer/<token>/`` (`commit.begin`: it appears
   complete or not at all; `FuyouCallback.state`, which the Trainer calls for the
   ``stateful_callbacks`` of ``trainer_state.json``). Under data parallelism every rank writes its
   part just before the Trainer's save (`FuyouCallback.on_step_end`);
3. ``trainer_state.json``, the Trainer's last file, recording that save's token and step;
4. only then the Trainer's rotation removes older checkpoints.

The Trainer fsyncs none of its files. `commit.make_durable` fsyncs them (and the folder's entry in the
output directory) at 2, and `commit.commit` again at ``on_save``, after 3 and 4. One window is left
that no callback hook reaches: from ``trainer_state.json`` being written until ``on_save``, the rotation
removes the oldest checkpoints while that file may not yet be on disk. A power cut there can leave
``checkpoint-<step>`` without a readable ``trainer_state.json`` (set aside as incomplete, below) and
the removed checkpoints gone: the run resumes from the newest older checkpoint that survives, which
every earlier ``on_save`` made durable; with ``save_total_limit=1`` there may be none, and the
Trainer's ``resume_from_checkpoint=True`` says it found no valid checkpoint. Never a wrong resume.

The rotation's removal of a checkpoint is not atomic either: a power cut in it can keep some of the
files it removed gone and the rest, ``trainer_state.json`` included, there. So the callback's entry also lists
the checkpoint's files (the Trainer's and fuyou's) with their sizes as `FuyouCallback.state` found
them (``files``, `recorded_files`); a checkpoint that lacks one whose folder is there, or holds it at another size,
is incomplete (the Trainer would resume from it without complaint, restarting its learning-rate
schedule when ``scheduler.pt`` is gone).

So a checkpoint is **complete** when its ``trainer_state.json`` reads as JSON, every file it
records is there at its size, and, if it records a fuyou save (``stateful_callbacks.FuyouCallback``)
or holds a ``fuyou_optimizer/`` folder, a save appeared there (save folders appear only complete, by
a rename). Whether it is the save that
``trainer_state.json`` records (its token; its step) is checked on resume, and a mismatch — state
copied from another checkpoint — is refused naming both files, not set aside. A kill at any instant leaves the previous complete
checkpoint in place (rotation comes last) and at most one incomplete one. A checkpoint neither
written with `FuyouCallback` nor holding fuyou state is not judged (a plain Trainer's), beyond
needing its ``trainer_state.json``.

`set_aside_incomplete` renames incomplete checkpoints to ``incomplete-checkpoint-<step>`` (a name the
Trainer's ``get_last_checkpoint`` and rotation do not match), with a warning, before
``resume_from_checkpoint=True`` looks; `find_leftovers` lists them, and the incomplete checkpoints of
a run that is gone, for ``fuyou clean --dir <output_dir>``. Whether a run still writes an output
directory is told by ``_fuyou_writer.json`` there (`claim`/`release`; the Trainer's ``push_to_hub``
skips ``_*`` files). A damaged save (a checksum that does not match) is not incomplete: loading it
is refused with an error that names the file, rather than quietly resuming from an older checkpoint.

This module reads files only: it imports neither transformers nor torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from .. import commit
from ..storage.rundir import StaleRun, dir_bytes, owner_gone, owner_pid, write_owner

__all__ = ["STATE_FOLDER", "TRAINER_STATE", "WRITER_FILE", "SET_ASIDE_PREFIX", "recorded_save", "recorded_files", "why_incomplete",
           "checkpoint_files", "checkpoints", "set_aside_incomplete", "find_leftovers", "claim", "release", "live_writer"]

log = logging.getLogger("fuyou_strategy")

STATE_FOLDER = "fuyou_optimizer"  # inside each checkpoint-N folder
TRAINER_STATE = "trainer_state.json"  # the Trainer writes it last
CALLBACK_KEY = "FuyouCallback"  # its entry in trainer_state.json's stateful_callbacks
WRITER_FILE = "_fuyou_writer.json"  # in the output directory while a run writes checkpoints there
SET_ASIDE_PREFIX = "incomplete-"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")  # the Trainer's own pattern (transformers.trainer_utils)
_TEMP = re.compile(r".+\.tmp-\d+")  # a fuyou save being written or removed (`optim.checkpoint`)

_NOT_RECORDED = object()


def _entry(stateful_callbacks: Any) -> Any:
    """The `FuyouCallback` entry of a ``trainer_state.json``'s ``stateful_callbacks``, or `_NOT_RECORDED`."""
    entry = (stateful_callbacks or {}).get(CALLBACK_KEY, _NOT_RECORDED) if isinstance(stateful_callbacks, dict) \
        else _NOT_RECORDED
    if isinstance(entry, list):  # one entry per FuyouCallback; the first one writes the state
        entry = entry[0] if entry else _NOT_RECORDED
    return entry


def recorded_save(stateful_callbacks: Any) -> Any:
    """What a ``trainer_state.json``'s ``stateful_callbacks`` records of fuyou's save: a dict
    (``token``, ``steps``, ``global_step``; or ``pending`` when the save follows the Trainer's files),
    ``None`` (the callback had no save to record), or `_NOT_RECORDED` (no `FuyouCallback` entry)."""
    entry = _entry(stateful_callbacks)
    if entry is _NOT_RECORDED:
        return _NOT_RECORDED
    attributes = entry.get("attributes", {}) if isinstance(entry, dict) else {}
    saved = attributes.get("fuyou_save") if isinstance(attributes, dict) else None
    return saved if isinstance(saved, dict) else None


def recorded_files(stateful_callbacks: Any) -> dict[str, int]:
    """The checkpoint's files and their sizes as `FuyouCallback.state` found them (`checkpoint_files`; the
    entry's ``files``, beside the Trainer's ``args`` and ``attributes``), or ``{}`` if none were recorded."""
    entry = _entry(stateful_callbacks)
    files = entry.get("files") if isinstance(entry, dict) else None
    return files if isinstance(files, dict) else {}


def is_recorded(saved: Any) -> bool:
    return saved is not _NOT_RECORDED


def why_incomplete(checkpoint: str | os.PathLike) -> str | None:
    """Why the Trainer checkpoint folder ``checkpoint`` is incomplete, or None (module docstring)."""
    checkpoint = Path(checkpoint)
    try:
        trainer_state = json.loads((checkpoint / TRAINER_STATE).read_text())
    except FileNotFoundError:
        return f"no {TRAINER_STATE}: the save was cut short"
    except (OSError, ValueError):
        return f"{TRAINER_STATE} is cut short or unreadable"
    if not isinstance(trainer_state, dict):
        return f"{TRAINER_STATE} does not hold the Trainer's state"
    folder = checkpoint / STATE_FOLDER
    saved = recorded_save(trainer_state.get("stateful_callbacks"))
    for name, size in recorded_files(trainer_state.get("stateful_callbacks")).items():
        if not (checkpoint / name).parent.is_dir():
            continue  # a fuyou save gone whole, or another in its place: told below, or refused on resume
        try:
            found = (checkpoint / name).stat().st_size
        except OSError:
            return f"{name}, which {TRAINER_STATE} records, is missing: a removal cut short"
        if found != size:
            return f"{name} holds {found} bytes, {TRAINER_STATE} records {size}"
    if not is_recorded(saved) and not folder.is_dir():
        return None  # not written with FuyouCallback: not ours to judge
    if commit.holds_save(folder):
        return None  # whether it is the save trainer_state.json names is checked, with both names, on resume
    if isinstance(saved, dict) and saved.get("token"):
        return f"{TRAINER_STATE} records fuyou save {str(saved['token'])[:8]}, but {folder} holds no save"
    return f"{folder} holds no complete save"


def checkpoint_files(checkpoint: str | os.PathLike) -> dict[str, int]:
    """The files in ``checkpoint``, fuyou's save included, but ``trainer_state.json`` (written after) and
    temporary save folders (``*.tmp-<pid>``, removed by the next save or load): ``{relative path: bytes}``."""
    found = {}
    for parent, dirs, files in os.walk(checkpoint):
        dirs[:] = [d for d in dirs if not _TEMP.fullmatch(d)]
        for name in files:
            path = os.path.join(parent, name)
            relative = os.path.relpath(path, checkpoint)
            if relative != TRAINER_STATE and not os.path.islink(path):
                found[relative] = os.path.getsize(path)
    return found


def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The Trainer's ``checkpoint-<step>`` folders in ``output_dir``, by step."""
    try:
        found = [p for p in Path(output_dir).iterdir() if _CHECKPOINT.fullmatch(p.name) and p.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(found, key=lambda p: int(_CHECKPOINT.fullmatch(p.name).group(1)))


def live_writer(output_dir: str | os.PathLike) -> int | None:
    """The pid of another process that still writes checkpoints into ``output_dir`` (`claim`), or None."""
    if not (Path(output_dir) / WRITER_FILE).exists():
        return None
    if owner_gone(output_dir, name=WRITER_FILE) is not None:
        return None
    pid = owner_pid(output_dir, name=WRITER_FILE)
    return None if pid == os.getpid() else pid


def claim(output_dir: str | os.PathLike) -> bool:
    """Record this process as the one writing checkpoints into ``output_dir`` (replacing the record of
    a process that is gone); False, with a warning, if another live process holds it."""
    other = live_writer(output_dir)
    if other is not None:
        log.warning("FuyouCallback: process %d also writes checkpoints into %s; two runs in one output_dir "
                    "overwrite each other's checkpoints: give each its own output_dir", other, output_dir)
        return False
    os.makedirs(output_dir, exist_ok=True)
    release(output_dir)
    try:
        write_owner(output_dir, name=WRITER_FILE)
    except FileExistsError:  # another process claimed it between our look and our write
        return claim(output_dir)
    return True


def release(output_dir: str | os.PathLike) -> None:
    """Remove the record `claim` wrote (if it is this process's, or its writer is gone)."""
    path = Path(output_dir) / WRITER_FILE
    if path.exists() and live_writer(output_dir) is None:
        path.unlink(missing_ok=True)


def set_aside_incomplete(output_dir: str | os.PathLike) -> list[tuple[Path, Path, str]]:
    """Rename every incomplete checkpoint in ``output_dir`` to ``incomplete-checkpoint-<step>`` (with a
    warning naming both; the Trainer's files in it are kept for ``fuyou clean``), after removing the
    temporary save folders a dead writer left in any checkpoint, so that ``resume_from_checkpoint=True`` picks the newest complete checkpoint. Nothing is done
    while another live process writes there (`live_writer`). Returns ``(old, new, why)`` for each."""
    other = live_writer(output_dir)
    if other is not None:
        log.warning("FuyouCallback: process %d writes checkpoints into %s: its incomplete checkpoints are left "
                    "alone", other, output_dir)
        return []
    moved = []
    for checkpoint in checkpoints(output_dir):
        commit.clean(checkpoint / STATE_FOLDER)  # a killed save's copy of the state: of no use to anyone
        why = why_incomplete(checkpoint)
        if why is None:
            continue
        target = checkpoint.with_name(SET_ASIDE_PREFIX + checkpoint.name)
        n = 1
        while target.exists():
            n += 1
            target = checkpoint.with_name(f"{SET_ASIDE_PREFIX}{checkpoint.name}.{n}")
        checkpoint.rename(target)
        log.warning("FuyouCallback: %s is incomplete (%s), left by a run that was stopped while saving; set aside as "
                    "%s so that resume_from_checkpoint=True never picks it. `fuyou clean --dir %s` removes it",
                    checkpoint, why, target.name, output_dir)
        moved.append((checkpoint, target, why))
    return moved


def find_leftovers(output_dir: str | os.PathLike) -> list[StaleRun]:
    """What runs that are gone left in the Trainer output directory ``output_dir``: checkpoints set
    aside as incomplete, and, unless a live process writes there, the incomplete checkpoints not yet
    set aside (``fuyou clean``)."""
    output_dir = Path(output_dir)
    found = []
    try:
        aside = sorted(p for p in output_dir.iterdir()
                       if p.name.startswith(SET_ASIDE_PREFIX + "checkpoint-") and p.is_dir() and not p.is_symlink())
    except (FileNotFoundError, NotADirectoryError):
        return []
    for path in aside:
        found.append(StaleRun(str(path), None, dir_bytes(str(path)), "an incomplete checkpoint, set aside"))
    if live_writer(output_dir) is not None:
        return found
    # A run that is gone left its record (`claim`) here: every incomplete checkpoint is its. Without one,
    # only those holding fuyou's folder are judged: a plain Trainer may be writing the others right now.
    claimed = (output_dir / WRITER_FILE).exists()
    for checkpoint in checkpoints(output_dir):
        if claimed or (checkpoint / STATE_FOLDER).exists():
            why = why_incomplete(checkpoint)
            if why is not None:
                found.append(StaleRun(str(checkpoint), owner_pid(output_dir, name=WRITER_FILE),
                                      dir_bytes(str(checkpoint)), f"an incomplete checkpoint ({why}); its writer is gone"))
    return found
