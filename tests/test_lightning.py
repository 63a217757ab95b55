"""Lightning: Trainer(strategy="fuyou") and Fabric(strategy="fuyou") against the stock strategies."""

import contextlib
import errno
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

import fuyou_strategy
from conftest import decay_groups, kill_at_every_step, killed_before_fs_change, tiny_causal_lm
from fuyou_strategy import ConfigError, FuyouFabricStrategy, FuyouStrategy
from fuyou_strategy.cli import main as fuyou_main
from fuyou_strategy.integrations.lightning import sidecar
from fuyou_strategy.optim.checkpoint import CheckpointError, newest
from fuyou_strategy.storage import StorageError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

BATCHES = 12  # micro-batches per epoch: 6 optimizer steps with accumulate_grad_batches=2
TOLERANCE = 1e-5  # relative, per tensor (measured: bitwise equal)


def token_batches(n=BATCHES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 101, (16,), generator=g) for _ in range(2 * n)]


class CausalLM(L.LightningModule):
    """A tiny GPT-2 with AdamW (decay / no-decay groups) and a linear warm-up schedule."""

    def __init__(self, family="gpt2", lr=1e-2, optimizer="adamw", fused=None):
        super().__init__()
        self.model = tiny_causal_lm(family)
        self.lr, self.optimizer_name, self.fused = lr, optimizer, fused

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        opt = torch.optim.AdamW(decay_groups(self.model), lr=self.lr, fused=self.fused)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class FailingLM(CausalLM):
    """Raises in the training step of the second optimizer step."""

    def training_step(self, batch, batch_idx):
        if self.global_step == 1:
            raise RuntimeError("injected fault")
        return super().training_step(batch, batch_idx)


class ClipsItself(CausalLM):
    """Clips to 0.5 in ``configure_gradient_clipping``, by ``algorithm``."""

    def __init__(self, algorithm):
        super().__init__()
        self.algorithm = algorithm

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm=self.algorithm)


def fit(strategy, *, steps=6, ckpt_path=None, callbacks=(), module=None, root=None, batches=BATCHES, batch_size=2,
        sampler=None, **trainer_args):
    torch.manual_seed(0)
    module = module if module is not None else CausalLM()
    args = dict(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=2, gradient_clip_val=1.0,
                logger=False, enable_checkpointing=bool(callbacks), enable_progress_bar=False,
                enable_model_summary=False, callbacks=list(callbacks), default_root_dir=root)
    args.update(trainer_args)
    trainer = L.Trainer(strategy=strategy, **args)
    trainer.fit(module, DataLoader(token_batches(batches), batch_size=batch_size, sampler=sampler), ckpt_path=ckpt_path)
    return module, trainer


def max_relative_difference(a, b):
    worst = 0.0
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        worst = max(worst, ((p.float() - q.float()).abs().max() / p.float().abs().max().clamp_min(1e-12)).item())
    return worst


def run_files(tmp_path):
    return [p.name for p in tmp_path.iterdir() if p.name.startswith("fuyou-run")]


def test_registered_with_trainer_and_fabric():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["fuyou"]["strategy"] is FuyouStrategy
    assert STRATEGY_REGISTRY["fuyou"]["strategy"] is FuyouFabricStrategy
    assert fuyou_strategy.FuyouStrategy is FuyouStrategy


@pytest.mark.parametrize("activations", ["keep", "ssd"])
def test_same_weights_as_the_auto_strategy(tmp_path, activations):
    """6 optimizer steps, accumulate 2, clip 1.0, warm-up: the same weights as strategy='auto'."""
    reference, _ = fit("auto")
    # backward pinned: the redo path is checked below ("auto" takes next_forward on the CPU with the state in RAM)
    strategy = FuyouStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB", activations=activations,
                             activation_min_bytes=0, optimizer_schedule="backward")
    ours, trainer = fit(strategy)
    assert max_relative_difference(reference, ours) <= TOLERANCE
    stats = trainer.strategy.engine.optimizer.stats
    assert stats.steps == 6 and stats.redos > 0, "clipping bit and was honoured through the redo path"
    if activations == "ssd":
        assert trainer.strategy.engine.swapper.stats.ssd_bytes > 0
        assert "forward" not in vars(trainer.strategy.engine.swapper.blocks[0]), "hooks are removed after fit"
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer is trainer.optimizers[0], "the scheduler drives FuyouAdamW"


def test_string_strategy_and_defaults_train():
    module, trainer = fit("fuyou", steps=2)
    assert isinstance(trainer.strategy, FuyouStrategy)
    assert trainer.strategy.engine.optimizer.stats.steps == 2


def test_resume_from_checkpoint_is_exact(tmp_path):
    """Checkpoint after 3 steps (an epoch), resume to 6 == 6 uninterrupted steps."""
    def strategy():
        return FuyouStrategy(swap_dirs=[str(tmp_path)], chunk_size="8KiB")

    every_epoch = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    uninterrupted, _ = fit(strategy(), steps=-1, max_epochs=2, batches=6, callbacks=[every_epoch])
    ckpt = tmp_path / "ckpts" / "epoch=0.ckpt"
    assert (newest(tmp_path / "ckpts" / "epoch=0.ckpt.fuyou") / "optimizer.json").exists()
    module = CausalLM()
    module.model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    resumed, trainer = fit(strategy(), steps=-1, max_epochs=2, batches=6, ckpt_path=str(ckpt), module=module)
    assert trainer.global_step == 6
    assert trainer.strategy.engine.optimizer.stats.steps == 6, "3 restored + 3 new"
    for (name, p), (_, q) in zip(uninterrupted.named_parameters(), resumed.named_parameters()):
        assert torch.equal(p, q), name


def test_save_after_fit_and_a_corrupt_checkpoint_is_refused(tmp_path):
    module, trainer = fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=2)
    ckpt = tmp_path / "final.ckpt"
    trainer.save_checkpoint(ckpt)  # after fit: the optimizer state is still there to save
    assert os.path.isdir(sidecar(ckpt))
    with open(newest(sidecar(ckpt)) / "exp_avg.bin", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(fuyou_strategy.optim.checkpoint.CheckpointError, match="checksum mismatch"):
        fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=4, ckpt_path=str(ckpt), module=CausalLM())


def test_checkpoint_callback_prunes_optimizer_state_with_the_checkpoints(tmp_path):
    keep = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=2, monitor="step", mode="max")
    fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=4, callbacks=[keep])
    names = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    ckpts = [n for n in names if n.endswith(".ckpt")]
    assert len(ckpts) == 2
    assert names == sorted(ckpts + [c + ".fuyou" for c in ckpts]), "each kept checkpoint has its state, no more"


def test_a_ckpt_beside_the_state_of_another_save_is_refused(tmp_path):
    """The issue's run: an old last.ckpt (step 1) beside optimizer state from a later save (step 2)
    is refused, naming the stale file and the checkpoint to use instead."""
    every_step = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=2, callbacks=[every_step])
    old, new = tmp_path / "ckpts" / "step=1.ckpt", tmp_path / "ckpts" / "step=2.ckpt"
    shutil.rmtree(sidecar(old))
    shutil.copytree(sidecar(new), sidecar(old))
    stale = re.escape(str(old))
    with pytest.raises(CheckpointError, match=rf"{stale} belongs to optimizer save \w{{8}} \(step 1\), but .* holds save "
                       rf"\w{{8}} \(step 2\): {stale} is stale: .*resume from another checkpoint in .*\(step=2.ckpt\)"):
        fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=3, ckpt_path=str(old), module=CausalLM())


def test_a_failed_ckpt_write_leaves_the_previous_pair_loadable(tmp_path, monkeypatch):
    module, trainer = fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=2)
    ckpt = tmp_path / "final.ckpt"
    trainer.save_checkpoint(ckpt)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer.strategy.checkpoint_io, "save_checkpoint", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        trainer.save_checkpoint(ckpt)
    _, resumed = fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=3, ckpt_path=str(ckpt), module=CausalLM())
    assert resumed.strategy.engine.optimizer.stats.steps == 3, "2 restored + 1 new"
    assert len(os.listdir(sidecar(ckpt))) == 1, "the failed save's state is removed again"


class _KilledInSecondLastSave(FuyouStrategy):
    def __init__(self, kill_at, **kwargs):
        super().__init__(**kwargs)
        self.kill_at, self.last_saves = kill_at, 0

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        self.last_saves += os.path.basename(filepath) == "last.ckpt"
        second = os.path.basename(filepath) == "last.ckpt" and self.last_saves == 2
        with killed_before_fs_change(self.kill_at) if second else contextlib.nullcontext():
            super().save_checkpoint(checkpoint, filepath, storage_options)


def last_ckpt_killed_at(root, k):
    """Three epochs of one step with ModelCheckpoint(save_last=True); killed before the k-th file-system
    change of the second save of last.ckpt (run by `kill_at_every_step`)."""
    (Path(root) / "swap").mkdir(parents=True)
    every_epoch = ModelCheckpoint(dirpath=Path(root) / "ckpts", save_last=True, every_n_epochs=1)
    _, trainer = fit(_KilledInSecondLastSave(k, swap_dirs=[str(Path(root) / "swap")]), steps=-1, max_epochs=3,
                     batches=2, callbacks=[every_epoch])
    trainer.strategy.engine.close()


@pytest.mark.slow
def test_a_kill_at_any_step_of_a_save_leaves_a_resumable_last_ckpt(tmp_path):
    """Killed between any two steps of overwriting last.ckpt, the last.ckpt on disk resumes exactly:
    from the old save until the new .ckpt is in, then from the new one."""
    killed = kill_at_every_step(tmp_path, "test_lightning", "last_ckpt_killed_at")
    uninterrupted, _ = fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=-1, max_epochs=3, batches=2)
    resumed_from = []
    for root in killed:
        last = root / "ckpts" / "last.ckpt"
        resumed_from.append(torch.load(last, weights_only=True)["global_step"])
        module = CausalLM()
        module.model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
        resumed, _ = fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=-1, max_epochs=3, batches=2,
                         ckpt_path=str(last), module=module)
        for (name, p), (_, q) in zip(uninterrupted.named_parameters(), resumed.named_parameters()):
            assert torch.equal(p, q), (root.name, name)
    assert resumed_from == sorted(resumed_from) and set(resumed_from) == {1, 2}, "the old save until the new .ckpt is in"
    argv = ["clean", "--dir", str(tmp_path / "killed")] + [a for r in killed for a in ("--dir", str(r / "swap"))]
    assert fuyou_main(argv) == 0
    assert not [p for p in (tmp_path / "killed").rglob("*") if ".tmp-" in p.name or p.name.startswith("fuyou-run-")]


def test_bf16_mixed_trains():
    module, trainer = fit("fuyou", steps=3, precision="bf16-mixed")
    stats = trainer.strategy.engine.optimizer.stats
    assert stats.steps == 3 and stats.skips == 0
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert torch.isfinite(torch.tensor(stats.last_grad_norm))


def test_bf16_true_checkpoint_holds_fp32_master_weights(tmp_path):
    module, trainer = fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=2, precision="bf16-true")
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    trainer.save_checkpoint(tmp_path / "bf16.ckpt")
    state = torch.load(tmp_path / "bf16.ckpt", weights_only=True)["state_dict"]
    engine = trainer.strategy.engine
    for name, p in module.named_parameters():
        saved = state[name]
        assert saved.dtype == torch.float32, name
        assert torch.equal(saved, engine.optimizer.read_state(p)["master"]), name
        assert torch.equal(saved.to(torch.bfloat16), p.detach()), "the weight is the rounded master"


# -- bad input: a clear error, and nothing left on disk -----------------------------------------------------
def test_missing_swap_dir_is_a_clear_error_and_creates_nothing(tmp_path):
    missing = tmp_path / "nvme0"
    with pytest.raises(StorageError, match="does not exist"):
        fit(FuyouStrategy(swap_dirs=[str(missing)]), steps=1)
    assert not missing.exists() and list(tmp_path.iterdir()) == []


def test_read_only_swap_dir_is_a_clear_error_and_creates_nothing(tmp_path):
    readonly = tmp_path / "ro"
    readonly.mkdir()
    if os.geteuid() == 0:  # root ignores permission bits, not the immutable attribute
        if subprocess.run(["chattr", "+i", str(readonly)], capture_output=True).returncode != 0:
            pytest.skip("running as root and `chattr +i` is not available to make a read-only directory")
        undo = ["chattr", "-i", str(readonly)]
    else:
        readonly.chmod(0o555)
        undo = ["chmod", "755", str(readonly)]
    try:
        with pytest.raises(StorageError, match="not writable"):
            fit(FuyouStrategy(swap_dirs=[str(readonly)]), steps=1)
        assert list(readonly.iterdir()) == []
    finally:
        subprocess.run(undo, check=True)


def test_host_budget_smaller_than_a_chunk_is_refused():
    with pytest.raises(ConfigError, match="host_memory_budget"):
        FuyouStrategy(host_memory_budget="64KiB", chunk_size="1MiB")


def test_unknown_field_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError, match="did you mean 'swap_dirs'"):
        FuyouStrategy(swap_dir="/nvme0")


def test_no_trainable_parameter_is_refused(tmp_path):
    module = CausalLM()
    module.requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameter"):
        fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=1, module=module)
    assert run_files(tmp_path) == []


def test_unsupported_optimizer_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="converts torch.optim.AdamW or torch.optim.Adam"):
        fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=1, module=CausalLM(optimizer="sgd"))
    assert run_files(tmp_path) == []


@pytest.mark.parametrize("precision", ["64-true"])
def test_unsupported_precision_is_refused(tmp_path, precision):
    with pytest.raises(ConfigError, match=f"precision: got '{precision}'"):
        fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=1, precision=precision)
    assert run_files(tmp_path) == []


def test_clipping_by_value_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="gradient_clip_algorithm"):
        fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=1, gradient_clip_algorithm="value")
    assert run_files(tmp_path) == []


@pytest.mark.parametrize("module", [CausalLM, FailingLM])
def test_the_users_precision_plugin_is_left_as_it_is(tmp_path, module):
    plugin = MixedPrecision("bf16-mixed", "cpu")
    strategy = FuyouStrategy(swap_dirs=[str(tmp_path)])
    with pytest.raises(RuntimeError, match="injected fault") if module is FailingLM else contextlib.nullcontext():
        fit(strategy, steps=2, module=module(), plugins=[plugin])
    assert type(plugin) is MixedPrecision and "clip_gradients" not in vars(plugin)
    assert isinstance(strategy.precision_plugin, MixedPrecision) and strategy.precision_plugin.precision == "bf16-mixed"


@pytest.mark.parametrize("algorithm, error", [("norm", "got gradient_clip_val=0.5 but the optimizer clips to None"),
                                              ("value", "clipping by value is not supported")])
def test_clipping_asked_for_by_the_module_is_checked(tmp_path, algorithm, error):
    with pytest.raises(ConfigError, match=error):
        fit(FuyouStrategy(swap_dirs=[str(tmp_path)]), steps=1, module=ClipsItself(algorithm), gradient_clip_val=None)


# -- Fabric ----------------------------------------------------------------------------------------------------
def fabric_train(strategy, steps=3, accumulate=2, clip=1.0):
    fuyou = isinstance(strategy, FuyouFabricStrategy)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    torch.manual_seed(0)
    model = tiny_causal_lm("gpt2")
    opt = torch.optim.AdamW(decay_groups(model), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    batches = iter(DataLoader(token_batches(), batch_size=2))
    for _ in range(steps):
        for micro in range(accumulate):
            batch = next(batches)
            accumulate_only = micro < accumulate - 1
            with opt.no_update() if accumulate_only and fuyou else contextlib.nullcontext():
                fabric.backward(model(input_ids=batch, labels=batch).loss)
        fabric.clip_gradients(model, opt, max_norm=clip)
        opt.step()
        opt.zero_grad()
    return model


def fabric_accumulating_with_no_backward_sync(fabric, loader, steps=3, accumulate=2, clip=1.0):
    """Fabric's own accumulation idiom: ``no_backward_sync`` on the micro-batches that only accumulate."""
    torch.manual_seed(0)
    model = tiny_causal_lm("gpt2")
    model, opt = fabric.setup(model, torch.optim.AdamW(decay_groups(model), lr=1e-2))
    batches = iter(loader)
    for _ in range(steps):
        for micro in range(accumulate):
            batch = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                fabric.backward(model(input_ids=batch, labels=batch).loss)
        fabric.clip_gradients(model, opt, max_norm=clip)
        opt.step()
        opt.zero_grad()
    return model, opt


def test_fabric_same_weights_as_plain_fabric(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = fabric_train("auto")
        ours = fabric_train(FuyouFabricStrategy(swap_dirs=[str(tmp_path)], max_grad_norm=1.0))
    assert max_relative_difference(reference, ours) <= TOLERANCE


def test_fabric_setup_twice_counts_each_micro_batch_once(tmp_path):
    strategy = FuyouFabricStrategy(swap_dirs=[str(tmp_path)])
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    model = tiny_causal_lm("gpt2")
    fabric.setup(model, torch.optim.AdamW(model.parameters()))
    wrapped, _ = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    batch = token_batches(1)[0][None]
    wrapped(input_ids=batch, labels=batch)
    assert strategy.engine.micro_batches == 1
    strategy.teardown()
    assert not model._forward_pre_hooks and run_files(tmp_path) == []


@pytest.mark.parametrize("precision, kind", [("32-true", "FuyouPrecision"), ("bf16-mixed", "FuyouMixedPrecision"),
                                             ("16-mixed", "FuyouMixedPrecision"), ("bf16-true", "FuyouHalfPrecision"),
                                             ("16-true", "FuyouHalfPrecision")])
def test_the_strategy_uses_a_named_precision_plugin_of_its_own(precision, kind):
    """Lightning's plugin for ``precision=`` becomes the fuyou subclass of the same Lightning class (clipping
    checked against the optimizer's; 16-mixed without a GradScaler of its own), a plain class that pickles
    (spawned ranks) as itself; the plugin Lightning made is not changed."""
    import pickle

    from lightning.pytorch.plugins.precision import MixedPrecision

    from fuyou_strategy.integrations import lightning as integration

    strategy = FuyouStrategy()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, precision=precision, logger=False)
    lightnings = L.Trainer(accelerator="cpu", devices=1, precision=precision, logger=False).precision_plugin
    plugin = trainer.strategy.precision_plugin  # on the CPU Lightning makes 16-mixed bf16-mixed: the same here
    assert type(plugin) is getattr(integration, kind) and plugin.precision == lightnings.precision
    assert isinstance(plugin, type(lightnings))
    assert type(trainer.precision_plugin) is type(plugin)
    assert getattr(plugin, "scaler", None) is None
    again = pickle.loads(pickle.dumps(plugin))
    assert type(again) is type(plugin) and again.precision == plugin.precision
    if precision == "16-mixed":
        theirs = MixedPrecision("16-mixed", "cpu")
        strategy.precision_plugin = theirs
        assert theirs.scaler is not None and type(theirs) is MixedPrecision  # left as it was


def test_a_custom_precision_plugin_is_refused_with_the_supported_precisions():
    from lightning.pytorch.plugins.precision import Precision

    class Custom(Precision):
        pass

    with pytest.raises(ConfigError, match=r"precision_plugin: got .*Custom; the fuyou strategy takes Lightning's own "
                                          r"precision plugins, chosen with Trainer\(precision=...\)"):
        FuyouStrategy(precision_plugin=Custom())


def test_fabric_ddp_strategy_in_one_process_accumulates_with_fabrics_own_no_backward_sync(tmp_path):
    """``Fabric(strategy="fuyou_ddp")`` in one process (after ``fabric.launch()``, as Fabric asks of every
    multi-process strategy): Fabric's accumulation idiom, ``fabric.no_backward_sync(model, enabled=...)``,
    marks the micro-batches that only accumulate; no process group, the loader keeps its sampler; the same
    weights as plain Fabric, one optimizer update per window."""
    from fuyou_strategy.integrations.lightning import FuyouFabricDDPStrategy

    def train(strategy):
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
        fabric.launch()
        return fabric_accumulating_with_no_backward_sync(fabric, DataLoader(token_batches(), batch_size=2))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference, _ = train("auto")
        strategy = FuyouFabricDDPStrategy(swap_dirs=[str(tmp_path)], max_grad_norm=1.0)
        ours, opt = train(strategy)
    assert max_relative_difference(reference, ours) <= TOLERANCE
    assert strategy.engine.optimizer.stats.steps == 3 and not strategy.data_parallel
    assert strategy.launcher is None and strategy.distributed_sampler_kwargs is None
    assert not torch.distributed.is_initialized()
    strategy.teardown()
