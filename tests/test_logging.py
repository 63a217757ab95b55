"""The library leaves logging to the application: a NullHandler, and records that propagate."""

import logging

import torch

from conftest import tiny_causal_lm
from fuyou_strategy import FuyouConfig, FuyouEngine
from fuyou_strategy.planner import Plan


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_importing_the_library_configures_no_logging():
    import fuyou_strategy  # noqa: F401

    log = logging.getLogger("fuyou_strategy")
    ours = [type(h) for h in log.handlers if not type(h).__module__.startswith("_pytest")]  # pytest adds its own
    assert ours == [logging.NullHandler] and log.propagate and log.level == logging.NOTSET


def test_engine_records_reach_the_applications_handlers(tmp_path, caplog):
    Plan(policies=["keep", "keep"], act_bytes=[0, 0], reasons=["given"] * 2, predicted_step_s=1.0, device_peak=0,
         host_peak=0, ssd_peak=0, budgets={}).save(tmp_path / "plan.json")
    model = tiny_causal_lm("gpt2")
    config = FuyouConfig(swap_dirs=[str(tmp_path)], plan=str(tmp_path / "plan.json"))
    application = Collect()  # as an application configures logging: a handler on the root logger, level INFO
    logging.getLogger().addHandler(application)
    try:
        with caplog.at_level(logging.INFO):
            FuyouEngine(model, torch.optim.AdamW(model.parameters()), config=config).close()
    finally:
        logging.getLogger().removeHandler(application)
    assert [r.name for r in application.records if "applying the pinned plan" in r.getMessage()] == ["fuyou_strategy"]
