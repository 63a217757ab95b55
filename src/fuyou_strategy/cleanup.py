"""Closing several parts, and undoing a construction that failed half-way, without losing an error.

A constructor that fails after it made a run directory, a thread or a hook must release them before
the error reaches the caller — and the caller must get *that* error (a full disk, an EIO with its file
and offset), not one raised while cleaning up after it. `undo_after` runs the clean-up and keeps the
first cause; `close_all` closes every part of an object even when one of them fails.
"""

from __future__ import annotations

import logging
from typing import Callable

__all__ = ["close_all", "undo_after"]

log = logging.getLogger(__name__)


def undo_after(error: BaseException, *steps: Callable[[], object]) -> None:
    """Run every one of ``steps``, in order, to release what a failed construction made; ``error`` is
    why it failed, and the caller raises it afterwards. A step that raises an ``Exception`` does not
    stop the later ones; its error is logged and noted on ``error`` (``add_note``), never raised in its
    place (a ``KeyboardInterrupt`` still stops everything)."""
    for step in steps:
        try:
            step()
        except Exception as secondary:  # noqa: BLE001 - the construction's own error is the one to raise
            _note(error, step, secondary, "releasing what was made before this error")


def close_all(*steps: Callable[[], object]) -> None:
    """Run every one of ``steps``, in order, even when one raises; then raise the first error, with the
    later ones logged and noted on it."""
    first: Exception | None = None
    for step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - raised below, once every step ran
            if first is None:
                first = exc
            else:
                _note(first, step, exc, "closing the other parts after this error")
    if first is not None:
        raise first


def _note(error: BaseException, step: Callable[[], object], secondary: Exception, doing: str) -> None:
    name = getattr(getattr(step, "func", step), "__qualname__", None) or repr(step)  # a partial by its function
    log.warning("fuyou: %s (%s: %s), %s failed too: %s: %s", doing, type(error).__name__, error, name,
                type(secondary).__name__, secondary, exc_info=secondary)
    error.add_note(f"while {doing}, {name} failed too: {type(secondary).__name__}: {secondary}")
