"""Progress of long work (checkpoint state streamed to or from disk, the SSD bandwidth probe).

A tqdm bar on standard error when it is a terminal and ``FuyouConfig.progress`` is on; silent
otherwise (logs, CI, ``progress=False``). tqdm arrives with transformers and Lightning. The bar
is thread-safe: the optimizer's worker thread may advance it.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Progress"]

# Work smaller than this finishes before a bar is worth drawing.
MIN_BYTES = 256 * 2**20


class Progress:
    """A byte-counting progress bar for ``total`` bytes, or nothing (see module docstring)."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True) -> None:
        self._bar: Any = None
        if not enabled or total < MIN_BYTES or not _interactive():
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                         file=sys.stderr, dynamic_ncols=True)

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def update(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _interactive() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False
