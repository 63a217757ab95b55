"""The Lightning internals `FuyouStrategy` relies on (`fuyou_strategy.integrations.lightning_internals`),
each named and exercised, against the installed Lightning. Checked with lightning 2.6.6; a Lightning that
moves one fails here, naming it, before a user meets it in a launch."""

import importlib
import socket
import sys
from importlib import metadata

import pytest
import torch

from fuyou_strategy.integrations import lightning_internals as internals


def test_the_launchers_start_ranks_the_way_ddp_does():
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    popen = internals._SubprocessScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    assert popen.is_interactive_compatible is False
    spawn = internals._MultiProcessingLauncher(DDPStrategy(), start_method="spawn")
    assert spawn.is_interactive_compatible is False
    assert callable(popen.launch) and callable(spawn.launch)


def test_the_process_group_helpers_connect_and_reduce_one_rank(tmp_path, monkeypatch):
    from lightning.fabric.plugins.environments import LightningEnvironment

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(probe.getsockname()[1]))
    environment = LightningEnvironment()
    environment.set_world_size(1)
    environment.set_global_rank(0)
    internals._init_dist_connection(environment, internals._default_backend(torch.device("cpu")))
    try:
        assert torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
        mean = internals._sync_ddp_if_available(torch.tensor([2.0, 4.0]), reduce_op="mean")
        assert torch.equal(mean, torch.tensor([2.0, 4.0]))
    finally:
        torch.distributed.destroy_process_group()


def test_a_missing_internal_fails_at_import_naming_it_and_the_versions(monkeypatch):
    import lightning.fabric.utilities.distributed as distributed

    monkeypatch.delattr(distributed, "_init_dist_connection")
    monkeypatch.delitem(sys.modules, "fuyou_strategy.integrations.lightning_internals")
    with pytest.raises(ImportError) as error:
        importlib.import_module("fuyou_strategy.integrations.lightning_internals")
    message = str(error.value)
    assert "_init_dist_connection" in message and internals.CHECKED_WITH in message
    assert f"lightning {metadata.version('lightning')}" in message and 'pip install "fuyou-strategy[lightning]"' in message


def test_the_logger_connector_says_whether_this_step_is_logged():
    """`_logs_this_step` asks ``trainer._logger_connector.should_update_logs`` (a property of this Lightning, not the
    fallback); tests/test_metrics.py checks the steps it picks in a fit."""
    import lightning.pytorch as L

    trainer = L.Trainer(logger=False, log_every_n_steps=2, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    assert isinstance(getattr(type(trainer._logger_connector), "should_update_logs", None), property)
    assert internals._logs_this_step(trainer) is True  # outside a loop, Lightning logs
