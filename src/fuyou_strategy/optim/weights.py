"""`StreamedWeights`: what the optimizer needs of streamed weights, typed without importing them.

`params.streaming.WeightStreamer` is the one implementation, but ``params`` sits above ``optim`` in the
layers (tests/test_architecture.py), so the optimizer names it through these protocols instead: the
members it calls (`OptimizerControl.attach_weights`, `Updater.publisher`, `StreamedGradients`, `Sharding`),
each with who calls it and what it may wait for. The streamer satisfies them structurally
(tests/test_weights_protocol.py checks each member's parameters on both sides, so neither drifts alone).

Units: ``k`` is a state chunk's index and ``chunk_elems`` its length in elements (`ParamState.span`),
``nbytes`` are bytes, a tier read or write waits at most ``io_timeout`` seconds (`FuyouConfig`).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Iterable, Protocol, runtime_checkable

import torch

__all__ = ["DeviceBytes", "StreamedWeights", "UpdatesGate"]


class DeviceBytes(Protocol):
    """A count of device bytes now and their high-water mark (`params.streaming.DeviceMeter`)."""

    def add(self, nbytes: int) -> None:
        """``nbytes`` more on the device. Any thread (autograd's, for a streamed gradient); thread-safe."""

    def sub(self, nbytes: int) -> None:
        """``nbytes`` fewer on the device. Any thread; thread-safe."""


class UpdatesGate(Protocol):
    """What the streamer waits on before it reads a block's tier copies: `schedule.PendingUpdates` in one
    process, `distributed._SentWeights` under data parallelism (`Sharding.updates_gate`)."""

    def pending(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Whether any of ``params`` still waits for its new value. The streamer's hooks; never blocks."""

    def wait(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Return once ``params``' new values are in their tier copies (raises a failed update). The
        streamer's hooks (training or autograd thread); blocks on the updates' jobs or the weight sender."""


@runtime_checkable
class StreamedWeights(Protocol):
    """The streamed weights an optimizer updates (`OptimizerControl.attach_weights`): a trainable streamed
    parameter's value lives in a tier copy (host buffer or SSD entry), not in the parameter."""

    meter: DeviceBytes
    """Device bytes of weights and gradients: `StreamedGradients.take` counts a streamed gradient (bytes)
    from the end of its accumulation until its copy off the device landed (autograd's thread)."""

    updates: UpdatesGate | None
    """Set by `OptimizerControl.attach_weights` (training thread, between steps); read by the streamer's hooks."""

    def streams(self, param: torch.nn.Parameter) -> bool:
        """Whether trainable ``param``'s value lives in a tier copy (its updates are published there, its
        gradient streamed off the device). Any thread; never blocks."""

    def streamed(self) -> list[torch.nn.Parameter]:
        """Every streamed parameter (frozen and trainable), in block order. Training thread; never blocks."""

    def value(self, param: torch.nn.Parameter) -> torch.Tensor:
        """Streamed ``param``'s value from its tier copy (a new CPU tensor, its dtype and shape). Training
        thread between steps, or the data-parallel sender thread once the update landed; blocks on the read."""

    def publish(self, param: torch.nn.Parameter, k: int, values: torch.Tensor) -> Future | None:
        """Make ``values`` (chunk ``k``'s new fp32 masters, cast to ``param``'s dtype) chunk ``k`` of trainable
        ``param``'s tier copy. The state's worker, once the gradient is final; may block for a host pool
        buffer; returns the SSD write's future (the update job waits for it) or ``None`` when written."""

    def use_master(self, param: torch.nn.Parameter, entry: str, chunk_elems: int) -> bool:
        """Let trainable fp32 ``param``'s SSD copy be the master at the head of each chunk (``chunk_elems``
        elements) of state entry ``entry``, and drop its own copy; returns whether it now does. Training
        thread, between steps, once the master is written; waits for the block's upload in flight."""

    def assign(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Make ``value`` (the whole weight, ``param``'s numel) streamed ``param``'s tier copy (and its device
        bytes if resident). The data-parallel sender thread, or the training thread in `Sharding.attach_weights`;
        blocks on the tier write, never on the streamer's lock."""

    def uninstall(self) -> None:
        """Make every streamed weight resident again from its tier copy, before the optimizer's store closes
        (`adamw._release`, the optimizer's finalizer). Takes the streamer's lock; waits for uploads in flight."""
