"""Run tests/test_on_device.py's CUDA-only growth test on the CPU, in a scratch copy of the tree whose engine and
profiler treat the CPU as an accelerator (the edits below), to check the test's own logic before a GPU runs it.
Usage: python pose_cuda_test.py TREE SCRATCH (then pytest in SCRATCH, as run.sh does)."""
import shutil
import sys
from pathlib import Path

tree, scratch = Path(sys.argv[1]), Path(sys.argv[2])
shutil.rmtree(scratch, ignore_errors=True)
for part in ("src", "tests"):
    shutil.copytree(tree / part, scratch / part)
EDITS = [  # (file, old, new): the CPU posing as an accelerator with memory to spare
    ("src/fuyou_strategy/engine.py", 'self.device.type in ("cpu", "meta") or not plan.state_on_device',
     "not plan.state_on_device"),
    ("src/fuyou_strategy/engine.py", "room = device_memory_left(self.device) or 0", "room = 10**9"),
    ("src/fuyou_strategy/planner/profile.py", 'return 0 if device.type == "cpu" else None', "return None"),
    ("src/fuyou_strategy/planner/profile.py",
     "device_budget = config.device_memory_budget or device_memory_bytes(self.device)", "device_budget = 10**9"),
    ("tests/test_on_device.py", '    if compute_device.type != "cuda":\n        pytest.skip', "    if False:\n        pytest.skip"),
    ("tests/test_on_device.py", "torch.cuda.max_memory_allocated(compute_device)", "0"),
]
for name, old, new in EDITS:
    path = scratch / name
    text = path.read_text()
    assert text.count(old) >= 1, (name, old)
    path.write_text(text.replace(old, new))
