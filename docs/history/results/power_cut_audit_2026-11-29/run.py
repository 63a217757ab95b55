"""The run the syscall audit traces: a tiny Lightning fine-tune, state on the SSD (host_state=0),
ModelCheckpoint(every_n_train_steps=3, save_last=True), 9 steps. Run under strace by audit.sh."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from fuyou_strategy import FuyouStrategy  # noqa: E402
from test_lightning import fit  # noqa: E402

root = Path(sys.argv[1])
(root / "swap").mkdir(parents=True, exist_ok=True)
every3 = ModelCheckpoint(dirpath=root / "ckpts", save_last=True, every_n_train_steps=3, save_top_k=-1)
_, trainer = fit(FuyouStrategy(swap_dirs=[str(root / "swap")], host_state=0), steps=9, batches=20,
                 callbacks=[every3])
trainer.strategy.engine.close() if trainer.strategy.engine is not None else None
print(sorted(p.name for p in (root / "ckpts").iterdir()))
