"""Optional dependencies: which extra installs each framework, and the error when one is missing.

The core (``FuyouAdamW``, ``FuyouEngine``, the CLI) needs torch alone; each integration checks its
framework before importing it::

    require(__name__, "transformers", "accelerate")   # first lines of integrations/hf.py

so that ``import fuyou_strategy.integrations.hf`` without the ``[hf]`` extra fails with the line
that installs it, not with a bare ``No module named 'transformers'``.
"""

from __future__ import annotations

import importlib

__all__ = ["EXTRAS", "MissingExtraError", "install_line", "require"]

# importable name -> the extra of fuyou-strategy that installs it
EXTRAS = {"lightning": "lightning", "transformers": "hf", "accelerate": "hf", "peft": "hf"}


class MissingExtraError(ModuleNotFoundError):
    """A framework an integration needs is not installed; the message names it and the install line."""


def install_line(extra: str) -> str:
    return f'pip install "fuyou-strategy[{extra}]"'


def require(user: str, *modules: str) -> None:
    """Import each of ``modules`` (top-level names from `EXTRAS`); raise `MissingExtraError` for the
    first one not installed, saying that ``user`` (a module or feature) needs it and how to install it.

    A module that is installed but fails to import (a missing dependency of its own, a broken
    install) raises its own error unchanged.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module:  # installed, but something it imports is missing
                raise
            extra = EXTRAS[module]
            raise MissingExtraError(f"{user} needs {module}, which is not installed: {install_line(extra)}",
                                    name=module) from None
