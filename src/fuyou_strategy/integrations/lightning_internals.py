"""The parts of Lightning that `FuyouStrategy` uses without a public name, in one place.

`FuyouStrategy` launches and connects its ranks the way Lightning's ``DDPStrategy`` does, so that
``strategy="fuyou"`` behaves like ``strategy="ddp"`` with several devices. It cannot *be* a
``DDPStrategy``: Lightning gives every ``DDPStrategy`` a shuffling ``DistributedSampler``, even at
``devices=1``, which would change the data order of every one-device run. So it is a
``ParallelStrategy`` and takes from Lightning what ``DDPStrategy`` uses for the launch:

- ``_SubprocessScriptLauncher`` / ``_MultiProcessingLauncher`` (``lightning.pytorch.strategies.launchers``,
  listed in that package's ``__all__``): start the other ranks (``start_method="popen"`` / ``"spawn"``);
- ``_init_dist_connection`` (``lightning.fabric.utilities.distributed``): the process group from the
  cluster environment's address, port, ranks and world size;
- ``_sync_ddp_if_available`` (same module): ``reduce`` with the meanings ``LightningModule.log(sync_dist=True)``
  expects (``"mean"``/``"sum"``/...).

And from a running Trainer, as Lightning's own ``LearningRateMonitor`` and ``DeviceStatsMonitor`` ask it:
``trainer._logger_connector.should_update_logs``, whether the loggers write this step's ``on_step`` values
(`_logs_this_step`).

Checked against lightning 2.6.6 (``tests/test_lightning_internals.py`` names each one and fails, with
the installed version, if one moves). A missing one fails at import with the same message.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import torch

from .._extras import require

require(__name__, "lightning")  # without it: the error says which extra to install

CHECKED_WITH = "lightning 2.6.6"


def _missing(what: str, error: Exception) -> ImportError:
    try:
        installed = f"lightning {metadata.version('lightning')}"
    except metadata.PackageNotFoundError:
        installed = "no lightning distribution"
    return ImportError(
        f"fuyou_strategy.integrations.lightning needs Lightning's {what}, which this Lightning does not have "
        f"({installed}; checked with {CHECKED_WITH}): install a lightning version fuyou-strategy supports "
        f'(pip install "fuyou-strategy[lightning]") or report it: {error}')


try:
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
except ImportError as error:  # pragma: no cover - exercised by the version test's message check
    raise _missing("launchers (lightning.pytorch.strategies.launchers._SubprocessScriptLauncher, "
                   "_MultiProcessingLauncher)", error) from error
try:
    from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
except ImportError as error:  # pragma: no cover
    raise _missing("process-group helpers (lightning.fabric.utilities.distributed._init_dist_connection, "
                   "_sync_ddp_if_available)", error) from error

__all__ = ["CHECKED_WITH", "_MultiProcessingLauncher", "_SubprocessScriptLauncher", "_default_backend",
           "_init_dist_connection", "_logs_this_step", "_sync_ddp_if_available"]


def _default_backend(device: torch.device) -> str:
    """The process-group backend for ``device`` (``nccl`` for CUDA, ``gloo`` for the CPU), from torch's own map."""
    return torch.distributed.Backend.default_device_backend_map.get(device.type, "gloo")


def _logs_this_step(trainer: Any) -> bool:
    """Whether ``trainer``'s loggers write the ``on_step`` values logged in this optimizer step (every
    ``log_every_n_steps``: ``trainer._logger_connector.should_update_logs``); True where a Lightning lacks it, so
    that every step is logged rather than none."""
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))
