"""Per-step metrics (`FuyouEngine.metrics`) and where they reach users: Lightning's loggers, the HF Trainer's logs."""

import csv
import math

import pytest
import torch

from conftest import tiny_causal_lm
from fuyou_strategy import FuyouCallback, FuyouConfig, FuyouEngine, FuyouStrategy
from fuyou_strategy.config import PAGE
from fuyou_strategy.storage import round_up

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

KEYS = {"fuyou/step_seconds", "fuyou/ssd_read_bytes", "fuyou/ssd_write_bytes", "fuyou/ssd_read_gbps",
        "fuyou/ssd_write_gbps", "fuyou/grad_norm", "fuyou/clipped", "fuyou/skipped", "fuyou/rolled_back",
        "fuyou/schedule_next_forward", "fuyou/rollback_rate", "fuyou/host_pool_peak_bytes",
        "fuyou/activation_bytes_to_ssd", "fuyou/activation_bytes_to_host"}


def state_slot_bytes(engine):
    """Bytes one pass over every parameter's [master | exp_avg | exp_avg_sq] chunks moves: each chunk
    rounded up to the 4 KiB that O_DIRECT transfers."""
    return sum(round_up(e.chunk_len(k)) for name, e in engine.optimizer.store.entries.items()
               if name.startswith("adamw.") for k in range(e.nchunks))


def masters_held_bytes(engine):
    """Bytes of the masters that the parameters hold (every one here: fp32 on the CPU), which an update leaves
    unread on the SSD once its parameter holds the committed master: each chunk's, down to a whole page."""
    return sum(ps.master_nbytes(k) // PAGE * PAGE for ps in engine.optimizer._params for k in range(ps.nchunks))


def train_engine(tmp_path, steps=3, *, max_grad_norm=None, expect=None, **fields):
    """A tiny GPT-2 trained through the engine (closed after); returns the engine, the per-step metrics,
    the bytes of one slot of optimizer state, and the summary taken before closing."""
    torch.manual_seed(0)
    model = tiny_causal_lm("gpt2")
    # host_state=0: the state on the SSD, whose traffic these tests count
    config = FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", **{"host_state": 0, **fields})
    engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config,
                         max_grad_norm=max_grad_norm)
    g, seen = torch.Generator().manual_seed(0), []
    try:
        assert engine.metrics() == {}, "no step yet"
        if expect is not None:
            engine.expect_steps(expect)
        for _ in range(steps):
            ids = torch.randint(0, 101, (2, 16), generator=g)
            engine.begin_micro_batch(update=True)
            model(input_ids=ids, labels=ids).loss.backward()
            engine.optimizer.step()
            engine.optimizer.zero_grad(set_to_none=True)
            seen.append(engine.metrics())
        return engine, seen, state_slot_bytes(engine), engine.summary()
    finally:
        engine.close()


def engine_steps(tmp_path, steps=3, max_grad_norm=None, **fields):
    engine, seen, slot, _ = train_engine(tmp_path, steps, max_grad_norm=max_grad_norm, optimizer_schedule="backward",
                                         **fields)
    return seen, slot, engine.optimizer.stats.last_grad_norm, masters_held_bytes(engine)


def test_a_committed_step_writes_and_reads_one_slot_of_optimizer_state(tmp_path):
    seen, slot, last_norm, masters = engine_steps(tmp_path)
    assert 0 < masters < slot / 3 + 1
    assert len(seen) == 3 and all(KEYS <= set(m) for m in seen)
    for m in seen[1:]:  # the first step's figures include the set-up (the engine's clock starts at the first forward)
        # the speculative update read the active slot and wrote the shadow slot, once: nothing else moved; the
        # committed masters came from the parameters (the first step read them from the SSD)
        assert m["fuyou/ssd_write_bytes"] == slot and m["fuyou/ssd_read_bytes"] == slot - masters
        assert m["fuyou/ssd_write_gbps"] == pytest.approx(slot / m["fuyou/step_seconds"] / 1e9)
        assert (m["fuyou/clipped"], m["fuyou/rolled_back"], m["fuyou/skipped"]) == (0, 0, 0)
        assert m["fuyou/schedule_next_forward"] == 0 and 0 < m["fuyou/host_pool_peak_bytes"]
    assert seen[-1]["fuyou/grad_norm"] == last_norm and math.isfinite(last_norm) and last_norm > 0


def test_a_step_that_clipping_rolls_back_says_so_and_moves_the_state_twice(tmp_path):
    seen, slot, _, masters = engine_steps(tmp_path, max_grad_norm=1e-6)
    m = seen[-1]
    assert (m["fuyou/clipped"], m["fuyou/rolled_back"]) == (1, 1)
    # the speculative pass and the redo each wrote one slot; the speculative pass took the committed masters from
    # the parameters, and the redo read them from the SSD (the parameters held the speculative weights)
    assert m["fuyou/ssd_write_bytes"] == 2 * slot and m["fuyou/ssd_read_bytes"] == 2 * slot - masters
    assert m["fuyou/rollback_rate"] > 0


def test_activations_on_ssd_are_counted_in_the_step(tmp_path):
    seen, slot, _, _ = engine_steps(tmp_path, activations="ssd", activation_min_bytes=0)
    m = seen[-1]
    assert m["fuyou/activation_bytes_to_ssd"] > 0
    assert m["fuyou/ssd_write_bytes"] >= slot + m["fuyou/activation_bytes_to_ssd"]


def test_lightning_logs_the_metrics_to_the_trainers_loggers(tmp_path):
    from lightning.pytorch.loggers import CSVLogger
    from test_lightning import fit

    logger = CSVLogger(str(tmp_path / "logs"), name="run")
    fit(FuyouStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB", optimizer_schedule="backward", host_state=0),
        logger=logger, log_every_n_steps=1)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("fuyou/grad_norm")]
    assert len(rows) == 6, "one row per optimizer step"
    assert KEYS <= set(rows[0])
    writes = [float(r["fuyou/ssd_write_bytes"]) for r in rows]
    assert all(w > 0 for w in writes) and all(float(r["fuyou/grad_norm"]) > 0 for r in rows)
    clipped = [float(r["fuyou/clipped"]) for r in rows]
    assert set(clipped) <= {0.0, 1.0}
    # every step after the first that was not rolled back wrote one slot of state: the same bytes
    kept = {w for w, r in zip(writes[1:], rows[1:]) if float(r["fuyou/rolled_back"]) == 0}
    assert len(kept) == 1, (writes, [r["fuyou/rolled_back"] for r in rows])


def test_hf_trainer_logs_carry_the_metrics_and_its_grad_norm_agrees(tmp_path):
    from test_hf import train

    # "backward": every step's state writes complete before step() returns, so each step counts its own
    # (under next_forward they run after it, and land in whichever step they complete in)
    callback = FuyouCallback(swap_dirs=[str(tmp_path)], chunk_size="8KiB", optimizer_schedule="backward", host_state=0)
    _, trainer = train(tmp_path, callback)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 6 and all(KEYS <= set(h) for h in logged)
    for h in logged:
        # the Trainer computes its grad_norm from the gradients it keeps; fuyou's is the optimizer's own
        assert h["fuyou/grad_norm"] == pytest.approx(h["grad_norm"], rel=1e-5)
        assert h["fuyou/ssd_write_bytes"] > 0 and h["fuyou/schedule_next_forward"] == 0
    quiet = FuyouCallback(swap_dirs=[str(tmp_path)], chunk_size="8KiB", log_metrics=False)
    _, trainer = train(tmp_path, quiet)
    assert not any(k.startswith("fuyou/") for h in trainer.state.log_history for k in h)


def test_hf_reporting_integrations_see_the_metrics_once_the_callback_is_placed_before_them(tmp_path):
    from transformers import TrainerCallback

    from test_hf import trainer_for

    class Integration(TrainerCallback):
        """Stands for a report_to integration (TensorBoard, W&B): the Trainer puts those before user callbacks."""

        def __init__(self):
            self.keys = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.keys.append(set(logs or {}))

    for placed in (False, True):
        seen = Integration()
        callback = FuyouCallback(swap_dirs=[str(tmp_path)], chunk_size="8KiB")
        trainer = trainer_for(tmp_path, [seen, callback], steps=2)
        if placed:
            callback.place_before_integrations(trainer)
            names = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
            assert names.index("FuyouCallback") < names.index("Integration")
        trainer.train()
        step_logs = [k for k in seen.keys if "loss" in k]
        assert len(step_logs) == 2
        assert all((KEYS <= k) == placed for k in step_logs)
    with pytest.raises(Exception, match="not one of the Trainer's callbacks"):
        FuyouCallback().place_before_integrations(trainer)


def test_lightning_reads_the_metrics_only_in_the_steps_its_loggers_write(tmp_path, monkeypatch):
    """A read of the metrics can wait for the device (a step decided there): the strategy reads them only in the steps
    whose ``on_step`` values the loggers write (``log_every_n_steps``), and every such step's row carries them."""
    from lightning.pytorch.loggers import CSVLogger
    from test_lightning import fit

    reads = []
    real = FuyouEngine.metrics
    monkeypatch.setattr(FuyouEngine, "metrics", lambda self: reads.append(1) or real(self))
    logger = CSVLogger(str(tmp_path / "logs"), name="run")
    fit(FuyouStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB", optimizer_schedule="backward", host_state=0),
        logger=logger, log_every_n_steps=2)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("fuyou/grad_norm")]
    assert [int(r["step"]) for r in rows] == [1, 3, 5], "every second of the 6 optimizer steps"
    assert len(reads) == 3 and all(KEYS <= set(r) and float(r["fuyou/grad_norm"]) > 0 for r in rows)


# The steps (test_schedule's run: LOSS_SCALE) the late-copy run below decides on the device; the others it decides on
# the host. And those whose metrics it reads: steps 1 and 4 (clipped) stay unread until the next step's backward,
# and the step after each (2: a skip, 5: clipped) is decided on the host, whose counts must not carry theirs.
ON_DEVICE, READ = {0, 1, 3, 4}, {0, 2, 3, 5}


def test_metrics_of_a_step_decided_on_the_device_are_read_when_asked_for_and_are_the_hosts(tmp_path, monkeypatch):
    """With the whole state on the device tier under ``next_forward`` a step is decided on the device (the late-copy
    mode stands in for an accelerator, test_device_state.py). Its end reads nothing of it: the engine's reporting
    leaves it unread. ``metrics()``, read in some steps and not others, gives each read step the grad_norm, clipped
    and skipped of the same run decided on the host, and a step left unread passes none of its counts to the next."""
    from fuyou_strategy import device
    from fuyou_strategy.device import late_copies
    from fuyou_strategy.optim.schedule import Parts
    from test_device_state import SPLITS
    from test_schedule import MAX_NORM, STEPS, config, train

    from conftest import decay_groups

    real = Parts.decides_on_device

    def run(tmp, late):
        steps = []

        def decides_on_device(self, stepped):  # once a step: the steps of ON_DEVICE where the late run could
            steps.append(len(steps))
            return real(self, stepped) and (not late or steps[-1] in ON_DEVICE)

        monkeypatch.setattr(Parts, "decides_on_device", decides_on_device)
        model = tiny_causal_lm("llama")
        engine = FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True),
                             max_grad_norm=MAX_NORM, config=config(tmp, "next_forward", **SPLITS["device"]))
        opt, unread, seen = engine.optimizer, [], {}

        def after_step(*_args):  # after the engine's own hook: the step's end as the run reported it
            unread.append(opt.recorded()[1] is not None)
            if len(unread) - 1 in READ or not late:
                seen[len(unread) - 1] = engine.metrics()

        opt.register_step_post_hook(after_step)
        try:
            with late_copies(max_delay_ms=2.0, seed=1) if late else monkeypatch.context() as mode:
                if not late:  # copies as they are, even in a run with FUYOU_ASYNC_DEVICE set
                    mode.setattr(device, "_late", None)
                train(model, opt, lambda last: engine.begin_micro_batch(update=last))
            return unread, seen, engine.summary()
        finally:
            engine.close()

    (tmp_path / "host").mkdir()
    (tmp_path / "device").mkdir()
    host_unread, host, host_summary = run(tmp_path / "host", late=False)
    unread, seen, summary = run(tmp_path / "device", late=True)
    assert host_unread == [False] * STEPS
    assert unread == [i in ON_DEVICE for i in range(STEPS)]
    assert [host[i]["fuyou/skipped"] for i in range(STEPS)] == [0, 0, 1, 0, 0, 0]
    assert host[1]["fuyou/clipped"] == host[4]["fuyou/clipped"] == host[5]["fuyou/clipped"] == 1
    assert sorted(seen) == sorted(READ)
    for i in READ:
        for key in ("fuyou/grad_norm", "fuyou/clipped", "fuyou/skipped", "fuyou/rolled_back"):
            a, b = seen[i][key], host[i][key]
            assert a == b or (i == 2 and key == "fuyou/grad_norm" and not math.isfinite(a) and not math.isfinite(b)), \
                (i, key, a, b)
    for key in ("optimizer_steps", "skips", "clipped", "deferred", "last_grad_norm"):
        assert summary[key] == host_summary[key], key
