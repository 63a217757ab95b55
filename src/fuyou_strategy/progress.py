"""Progress of long work (checkpoint state streamed to or from disk, the SSD bandwidth probe).

Where a live rich display is already on screen (Lightning's ``RichProgressBar``, which the
strategy shares through `share_display`), a task of that display, in MiB; otherwise a tqdm bar
on standard error when it is a terminal. Silent in logs and CI and with ``FuyouConfig.progress``
off. tqdm arrives with transformers and Lightning. Both are thread-safe: the optimizer's worker
thread may advance them.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

__all__ = ["Progress", "share_display"]

# Work smaller than this finishes before a bar is worth drawing.
MIN_BYTES = 256 * 2**20
_MiB = 2**20

# A callable returning the live rich ``Progress`` to add tasks to, or None (see `share_display`).
_display: Callable[[], Any] | None = None


def share_display(display: Callable[[], Any] | None) -> None:
    """Show progress as tasks of the rich ``Progress`` that ``display()`` returns while it returns one
    (Lightning's ``RichProgressBar.progress``); ``None`` goes back to tqdm bars."""
    global _display
    _display = display


class Progress:
    """A byte-counting progress bar for ``total`` bytes, or nothing (see module docstring)."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True) -> None:
        self._bar: Any = None
        self._rich: Any = None
        self._task: Any = None
        if not enabled or total < MIN_BYTES:
            return
        live = _display() if _display is not None else None
        if live is not None:
            self._rich, self._task = live, live.add_task(f"{desc} (MiB)", total=total / _MiB)
            return
        if not _interactive():
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                         file=sys.stderr, dynamic_ncols=True)

    @property
    def shown(self) -> bool:
        return self._bar is not None or self._rich is not None

    def update(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(nbytes)
        elif self._rich is not None:
            self._rich.update(self._task, advance=nbytes / _MiB)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._rich is not None:
            self._rich.remove_task(self._task)
            self._rich = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _interactive() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False
