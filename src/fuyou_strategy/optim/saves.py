"""`Saves`: what a save of a `FuyouAdamW` holds, and how one is restored.

`checkpoint` knows the files; this module knows the optimizer: it streams this rank's masters and moments
through a `checkpoint.SaveWriter` with their step counts, describes the optimizer's own fields (`describe`:
param groups, statistics, the schedule chooser's costs, the loss scale) and, on a load, puts each back, then
the weights from the restored masters. The front (`FuyouAdamW.state_dict`, `load_state_dict`, `load_folder`)
lands its updates and refuses a save between backward and ``step()`` first; everything here runs on the
training thread (the chunks themselves move on the state's worker).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from . import checkpoint
from .control import OptimizerControl
from .formats import StateFormat
from .scaler import LossScaler
from .schedule import Parts
from .state import ParamState

__all__ = ["Saves"]


class Saves:
    """Saves and loads of one optimizer's state (module docstring).

    Args:
        params: every trainable parameter's `ParamState`, in param-group order.
        parts: the front's parts (`schedule.Parts`): the state, the sharding, the statistics, the step counts.
        control: the schedule's chooser and choice (`OptimizerControl`).
        config: ``progress``.
        state_format, scaler: what the save records and a load must match or restore.
        on_loaded: called after a load (the front's list: the run's reporting rebases its counts).
    """

    def __init__(self, params: list[ParamState], parts: Parts, control: OptimizerControl, config: Any, *,
                 state_format: StateFormat, scaler: LossScaler | None, on_loaded: list[Callable[[], None]]) -> None:
        self.params, self.config, self.control = params, config, control
        self.state, self.sharding, self.stats = parts.state, parts.sharding, parts.stats
        self.updates, self.order, self.max_grad_norm = parts.updates, parts.order, parts.max_grad_norm
        self.state_format, self.scaler, self.on_loaded = state_format, scaler, on_loaded
        self.chooser = control.chooser
        self.counts = parts.counts
        self.settle = parts.settle  # a step decided on the device is read before its counts are saved or replaced
        self._by_param = {ps.param: ps for ps in params}

    def write(self, folder: str | os.PathLike, param_groups: list[dict], *, keep_previous: bool,
              record: dict[str, Any] | None) -> dict[str, Any]:
        """Stream this rank's state into a new save in ``folder`` (`checkpoint.save`, or `checkpoint.save_version`
        with ``keep_previous``); returns what the state dict records of it (``sd["fuyou"]``)."""
        self.settle()
        owned = self.sharding.owned(self.params)
        steps = {ps.index: float(self.counts[ps.index]) for ps in owned}
        save = checkpoint.save_version if keep_previous else checkpoint.save
        meta = save(folder, lambda writer: self.state.export(owned, lambda ps, data: writer.chunk(
            ps.index, list(ps.param.shape), ps.numel, steps[ps.index], data)), lambda: self.describe(param_groups),
            group=self.sharding, total_bytes=sum(ps.nbytes for ps in owned), progress=self.config.progress,
            record=record, kinds=self.state_format.kinds)
        return {"folder": str(folder), "token": meta["token"], "steps": meta["steps"]}

    def describe(self, param_groups: list[dict]) -> dict[str, Any]:
        """The optimizer's own fields, as a save records them (the keys and values of every earlier version)."""
        self.settle()
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [self._by_param[p].index for p in g["params"]]}
                  for g in param_groups]
        return {"steps": self.stats.steps, "state_format": self.state_format.name, "param_groups": groups,
                "stats": self.stats.to_dict(), "schedule": self.chooser.state_dict(),
                "max_grad_norm": self.max_grad_norm,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_dict(self, state_dict: dict[str, Any], param_groups: list[dict]) -> None:
        """Restore a dict from `FuyouAdamW.state_dict` (module docstring of `checkpoint`: the save it names)."""
        self.settle()
        folder = state_dict.get("fuyou", {}).get("folder")
        if folder is None and any(float(s.get("step", 0)) for s in state_dict.get("state", {}).values()):
            raise checkpoint.CheckpointError(
                "this state dict holds no SSD state (masters and moments): it was made by state_dict() "
                "without a folder; save with optimizer.state_dict(folder) to resume exactly")
        if folder is None:
            return restore_groups(param_groups, state_dict["param_groups"])
        record = state_dict["fuyou"]
        fix = ("load the state dict made with that save, or resume from the folder's newest save alone with "
               "optimizer.load_folder(folder)")
        self.load(checkpoint.find(folder, record.get("token"), record.get("steps"), named_by="this state dict", fix=fix),
                  param_groups)

    def load_folder(self, folder: str | os.PathLike, token: str | None, param_groups: list[dict]) -> dict[str, Any]:
        """The newest save in ``folder`` (or the one with ``token``), loaded (`load`)."""
        return self.load(Path(folder) / token if token is not None else checkpoint.newest(folder), param_groups)

    def load(self, path: Path, param_groups: list[dict]) -> dict[str, Any]:
        """Stream the save at ``path`` back: masters, moments, steps, hyper-parameters, statistics, the chooser's
        costs, the loss scale, then the weights (checksums verified first; a bad save changes nothing); returns
        its metadata."""
        self.settle()
        owned = self.sharding.owned(self.params)
        with checkpoint.SaveReader(path, group=self.sharding) as reader:
            reader.check_shapes([list(ps.param.shape) for ps in self.params])
            saved = reader.meta.get("state_format", "fp32")
            if saved != self.state_format.name:
                raise checkpoint.CheckpointError(
                    f"{path}: holds optimizer state in state_format={saved!r}, this optimizer keeps "
                    f"state_format={self.state_format.name!r}; resume with FuyouConfig(state_format={saved!r}) (a "
                    "save is not converted between formats: that would change the training); nothing was loaded")
            self.state.load(owned, lambda ps, start, data: reader.read(ps.index, start, data),
                            lambda ps: reader.finish(ps.index), reader.check, what=str(path.parent),
                            progress=self.config.progress)
        meta = reader.meta
        for ps, step in zip(self.params, reader.steps()):
            self.counts[ps.index] = step  # into the view ``state[param]["step"]`` is
        restore_groups(param_groups, meta["param_groups"])
        if "stats" in meta:
            self.stats.load(meta["stats"])  # commit / redo / skip counts carry on
        self.chooser.load_state_dict(meta.get("schedule", {}))
        if self.scaler is not None and meta.get("scaler") is not None:
            self.scaler.load_state_dict(meta["scaler"])
        self.stats.last_reason = self.control.choose()
        self.state.restore_weights(owned, self.updates.publisher())
        self.sharding.updated(self.order.update, gated=False)  # data parallel: each weight from its owner, now
        for listener in self.on_loaded:
            listener()
        return meta


def restore_groups(param_groups: list[dict], saved_groups: list[dict]) -> None:
    """Put saved hyper-parameters (lr, betas, ...) back into the param groups."""
    for group, saved in zip(param_groups, saved_groups):
        group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items() if k != "params"})
