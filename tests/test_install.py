"""Light installs: the core with torch alone, each integration with its own extra, and the message
that names the extra when it is missing.

The first tests hide the frameworks from a subprocess (``sys.meta_path``'s path finder made to
find neither their modules nor their distributions). The last two build fresh virtual
environments from a copy of the project, as a user's ``pip install "fuyou-strategy[hf]"`` /
``[lightning]`` would, and run the matching example there; they need the package index (skipped,
saying so, when it cannot be reached) and take about a minute each (marker ``venv``:
``pytest -m "not venv"`` leaves them out).
"""

import os
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.request
import warnings
from pathlib import Path

import pytest

import fuyou_strategy

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("lightning", "transformers", "accelerate", "peft")
LIGHTNING_LINE = ('fuyou_strategy.integrations.lightning needs lightning, which is not installed: '
                  'pip install "fuyou-strategy[lightning]"')
HF_LINE = 'fuyou_strategy.integrations.hf needs {}, which is not installed: pip install "fuyou-strategy[hf]"'

_HIDE = """
import importlib.machinery, sys

class Hide(importlib.machinery.PathFinder):  # as if these were not installed: no module, no distribution
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] in {hidden!r} else super().find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        return (d for d in super().find_distributions(*args, **kwargs) if d.name.lower() not in {hidden!r})

sys.meta_path[:] = [Hide if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path]
"""


def _run_hidden(hidden: tuple[str, ...], code: str, tmp_path: Path) -> str:
    script = textwrap.dedent(_HIDE.format(hidden=set(hidden))) + textwrap.dedent(code)
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_core_imports_and_trains_with_torch_alone(tmp_path):
    """No framework at all: the package imports silently, a plain loop trains with FuyouAdamW, the CLI plans;
    every framework name raises the line that installs its extra."""
    out = _run_hidden(FRAMEWORKS, f"""
        import warnings
        warnings.simplefilter("error")  # importing the package says nothing
        import fuyou_strategy
        from fuyou_strategy import FuyouAdamW, FuyouConfig, FuyouEngine, SafetensorsInit, ConfigError
        warnings.resetwarnings()
        import torch

        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        opt = FuyouAdamW(model.parameters(), lr=1e-2, config=FuyouConfig(swap_dirs=[sys.argv[1]]))
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.close()

        from fuyou_strategy.cli import main
        assert main(["plan", "gpt3-13b"]) == 0

        def error_of(action):
            try:
                action()
            except ImportError as error:
                return error
            raise AssertionError("no ImportError")

        import importlib
        errors = [
            error_of(lambda: fuyou_strategy.FuyouStrategy),
            error_of(lambda: fuyou_strategy.FuyouFabricStrategy),
            error_of(lambda: importlib.import_module("fuyou_strategy.integrations.lightning")),
            error_of(lambda: fuyou_strategy.FuyouCallback),
            error_of(lambda: exec("from fuyou_strategy import FuyouCallback")),
            error_of(lambda: importlib.import_module("fuyou_strategy.integrations.hf")),
        ]
        assert all(isinstance(e, ModuleNotFoundError) for e in errors)
        for e in errors:
            print("ERROR", e)
        print("LOADED", sorted(m for m in sys.modules if m.split(".")[0] in {FRAMEWORKS!r}))
    """, tmp_path)
    errors = [line.removeprefix("ERROR ") for line in out.splitlines() if line.startswith("ERROR ")]
    assert errors == [LIGHTNING_LINE] * 3 + [HF_LINE.format("transformers")] * 3
    assert "LOADED []" in out
    assert "model gpt3-13b: 12.9B parameters" in out, "fuyou plan printed its table"


@pytest.mark.slow
def test_each_integration_needs_only_its_own_extra(tmp_path):
    """Lightning without transformers registers strategy="fuyou"; the HF callback without Lightning imports;
    accelerate missing alone is named as such."""
    out = _run_hidden(("transformers", "accelerate", "peft"), """
        import fuyou_strategy
        from lightning.pytorch.strategies import StrategyRegistry
        print("REGISTERED", "fuyou" in StrategyRegistry, fuyou_strategy.FuyouStrategy.__name__)
    """, tmp_path)
    assert "REGISTERED True FuyouStrategy" in out
    out = _run_hidden(("lightning",), """
        import fuyou_strategy
        from fuyou_strategy import FuyouCallback
        print("CALLBACK", FuyouCallback.__name__)
    """, tmp_path)
    assert "CALLBACK FuyouCallback" in out
    out = _run_hidden(("accelerate",), """
        try:
            import fuyou_strategy.integrations.hf
        except ImportError as error:
            print("ERROR", error)
    """, tmp_path)
    assert f"ERROR {HF_LINE.format('accelerate')}" in out


def test_the_top_level_exports_what_users_call():
    assert sorted(fuyou_strategy.__all__) == sorted([
        "ConfigError", "FuyouAdamW", "FuyouCallback", "FuyouConfig", "FuyouDDPStrategy", "FuyouEngine",
        "FuyouFabricDDPStrategy", "FuyouFabricStrategy", "FuyouStrategy", "SafetensorsInit", "__version__",
        "ignore_streamed_in_ddp"])
    for name in fuyou_strategy.__all__:
        assert getattr(fuyou_strategy, name) is not None


@pytest.mark.parametrize("name, where", [("TensorStore", "storage"), ("HostBufferPool", "storage"),
                                         ("IOEngine", "storage"), ("ActivationSwapper", "activations"),
                                         ("Policy", "activations"), ("SwapStats", "activations"),
                                         ("StepStats", "optim")])
def test_the_building_blocks_moved_to_their_subpackage_with_a_deprecation(name, where):
    import importlib

    moved = getattr(importlib.import_module(f"fuyou_strategy.{where}"), name)
    assert name not in fuyou_strategy.__all__
    with pytest.warns(DeprecationWarning, match=rf"fuyou_strategy\.{name} moved to fuyou_strategy\.{where}"):
        assert getattr(fuyou_strategy, name) is moved
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
            fuyou_strategy.Nothing  # noqa: B018


# --- fresh virtual environments ------------------------------------------------------------------------

TORCH = "torch==2.13.0"  # first, alone: a local CPU wheel here; any other torch requirement pulls CUDA wheels
TINY = ["--steps", "3", "--layers", "2", "--hidden", "32", "--seq-len", "16", "--batch-size", "2", "--vocab", "64"]


INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def _index_reachable() -> bool:
    try:
        with urllib.request.urlopen(f"{INDEX}/pip/", timeout=15):
            return True
    except (OSError, ValueError):
        return False


def _sh(args: list, cwd: Path, timeout: int = 600) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, args))}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result.stdout + result.stderr


@pytest.mark.venv
@pytest.mark.parametrize("extra, example, absent, other", [
    ("hf", "hf_trainer_finetune.py", "lightning", LIGHTNING_LINE),
    ("lightning", "lightning_finetune.py", "transformers", HF_LINE.format("transformers")),
])
@pytest.mark.slow
def test_a_fresh_environment_with_one_extra_runs_its_example(tmp_path, extra, example, absent, other):
    if not _index_reachable():
        pytest.skip(f"the package index ({INDEX}) cannot be reached: a fresh environment cannot install the extras")
    start = time.perf_counter()
    project = tmp_path / "project"  # a copy: building the wheel writes build/ and *.egg-info next to the sources
    project.mkdir()
    shutil.copy(ROOT / "pyproject.toml", project)
    shutil.copy(ROOT / "README.md", project)
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (tmp_path / "pin.txt").write_text(TORCH + "\n")
    python = tmp_path / "venv" / "bin" / "python"
    pip = [python, "-m", "pip", "install", "--quiet", "--no-compile"]
    _sh([sys.executable, "-m", "venv", tmp_path / "venv"], tmp_path)
    _sh(pip + [TORCH], tmp_path)
    _sh(pip + ["-c", tmp_path / "pin.txt", f"{project}[{extra}]"], tmp_path)  # not editable; torch stays
    installed = time.perf_counter() - start

    out = _sh([python, "-c", textwrap.dedent(f"""
        import importlib.util, torch, fuyou_strategy
        print("TORCH", torch.__version__)
        print("FROM", fuyou_strategy.__file__)
        print("ABSENT", importlib.util.find_spec({absent!r}) is None)
        try:
            {"from fuyou_strategy import FuyouStrategy" if extra == "hf" else "from fuyou_strategy import FuyouCallback"}
        except ImportError as error:
            print("ERROR", error)
    """)], tmp_path)
    assert "TORCH 2.13.0" in out, out
    assert f"FROM {tmp_path / 'venv'}" in out, f"the installed copy is imported, not the sources: {out}"
    assert "ABSENT True" in out, f"{absent} was installed with [{extra}]"
    assert f"ERROR {other}" in out, out

    swap = tmp_path / "swap"
    swap.mkdir()
    out = _sh([python, ROOT / "examples" / example] + TINY + ["--swap-dir", swap], tmp_path)
    title = "HF Trainer + FuyouCallback" if extra == "hf" else "Lightning + FuyouStrategy"
    assert title in out and "3 optimizer steps" in out, out[-3000:]
    assert list(swap.iterdir()) == []
    print(f"[{extra}]: installed in {installed:.0f} s, example ran, {time.perf_counter() - start:.0f} s in all")
