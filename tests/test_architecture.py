"""The package's structure, as the code shows it (read with Python's ``ast``, `benchmarks/code_metrics.py`):
no import cycle, layers that import only downward, and one definition of what two modules share."""

import ast
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from code_metrics import _runtime_nodes, chains, cycles, import_graph, modules, private_accesses, reach_chains  # noqa: E402

from fuyou_strategy import _extras, planfile  # noqa: E402
from fuyou_strategy.activations import Policy  # noqa: E402
from fuyou_strategy.planner import Plan  # noqa: E402

# Layers, bottom first: a module may import its own layer and those below (DESIGN.md's arrows).
LAYERS = [
    ("_extras", "planfile", "drives", "config", "cleanup", "progress", "device", "trace"),
    ("storage",),
    ("optim", "activations", "params"),
    ("planner",),
    ("run_report", "engine", "commit", "doctor", "report"),
    ("integrations", "cli", "fuyou_strategy"),
]


def _layer(module: str) -> int:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else parts[0]
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    raise AssertionError(f"{module}: not in any layer of LAYERS; add it where it belongs")


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, f"import cycles: {found}"


def test_every_import_points_down_or_sideways():
    upward = [(m, t) for m, targets in import_graph().items() for t in targets
              if t != "fuyou_strategy" and _layer(t) > _layer(m)]
    assert not upward, f"modules importing a layer above them: {upward}"


def test_the_optimizer_and_its_checkpoints_read_no_private_field_of_each_other():
    optim = [a for a in private_accesses() if a[0].startswith("fuyou_strategy.optim.")]
    allowed = {"ddp_model._fuyou_hook_target",  # our own mark on the DDP model (one comm hook per lifetime)
               "tensor._version"}  # torch's version counter of a tensor, which has no public name (`gradients.version`)
    assert [a for a in optim if a[2] not in allowed] == []


def test_only_the_device_module_touches_cuda_and_starts_asynchronous_copies():
    """Streams, events, pinning and ``non_blocking`` copies live in ``device.py`` alone (DESIGN.md), where the
    late-copy test mode can make them land late; anywhere else a missing wait could never show on the CPU."""
    package = Path(__file__).resolve().parent.parent / "src" / "fuyou_strategy"
    found = [f"{path.relative_to(package)}:{n}" for path in sorted(package.rglob("*.py")) if path.name != "device.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if any(word in line for word in ("torch.cuda", "non_blocking", "record_stream", "pin_memory"))]
    assert found == [], f"accelerator calls outside device.py: {found}"


# Reach chains (`code_metrics.reach_chains`: ``opt.adam_state.pipeline.threads``) in the package: 12 when this check
# came in (issue 52), 2 once the run report and the planner read snapshots (`OptimizerControl.figures`,
# `MemoryTiers.figures`). A ceiling: it may only go down. Lower it when a refactor removes chains; never raise it.
REACH_CHAINS_CEILING = 2


def test_reach_chains_do_not_grow():
    found = chains()
    assert len(found) <= REACH_CHAINS_CEILING, (
        f"{len(found)} reach chains (ceiling {REACH_CHAINS_CEILING}): ask the owner (a method or a snapshot) "
        f"instead of reaching through its parts: {found}")


def test_the_chain_counter_counts_reaches_and_nothing_else():
    source = ("import os\nimport torch.nn\nfrom a import b\n"
              "x = opt.adam_state.pipeline.threads\n"          # 3 hops from a name: counted
              "y = self.optimizer.store.engine.bytes_written\n"  # 3 hops beyond self.optimizer: counted
              "self.opt.state.store.close()\n"                  # a method reached 3 hops away: counted
              "z = self.a.b.c\n"                                # 2 hops beyond self.a: not counted
              "w = opt.a.b\n"                                   # 2 hops: not counted
              "p = os.path.join.x\n"                            # rooted at an imported module: not counted
              "q = torch.nn.functional.relu\n"
              "r = b.c.d.e\n"                                   # rooted at an imported name: not counted
              "s = f().a.b.c\n")                                # rooted at a call: not counted
    assert reach_chains(source) == [(4, "opt.adam_state.pipeline.threads", 3),
                                    (5, "self.optimizer.store.engine.bytes_written", 3),
                                    (6, "self.opt.state.store.close", 3)]
    assert reach_chains("v = a.b.c.d.e.f\n") == [(1, "a.b.c.d.e.f", 5)]  # a nested chain counts once, whole


def test_the_plan_file_vocabulary_is_the_packages_one():
    assert planfile.POLICIES == tuple(p.value for p in Policy)
    assert set(planfile.FIELDS) == {f.name for f in dataclasses.fields(Plan)}
    required = {f.name for f in dataclasses.fields(Plan)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert set(planfile.REQUIRED) == required


def _framework_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, framework)`` for each import of Lightning, transformers, accelerate or peft that can run
    (module level or in a function; not under ``if TYPE_CHECKING:``)."""
    found = []
    for node in _runtime_nodes(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        found += [(node.lineno, n.split(".")[0]) for n in names if n.split(".")[0] in _extras.EXTRAS]
    return found


def test_only_the_integrations_import_a_framework():
    """The core (optimizer, engine, planner, CLI, ...) installs with torch alone (pyproject's dependencies):
    Lightning, transformers, accelerate and peft are imported in ``integrations/`` only."""
    found = [f"{name}:{line} imports {framework}" for name, path in modules().items()
             if not name.startswith("fuyou_strategy.integrations") for line, framework in _framework_imports(path)]
    assert found == [], found


def test_each_integration_checks_its_extra_before_importing_its_framework():
    """``require(__name__, ...)`` comes first and names every framework the module imports, so a missing extra
    fails with the line that installs it (test_install.py checks the message)."""
    for name, path in modules().items():
        imports = _framework_imports(path)
        if not imports:
            continue
        calls = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Name) and node.func.id == "require"]
        assert calls, f"{name} imports {sorted({f for _, f in imports})} without require(__name__, ...) first"
        required = {arg.value for call in calls for arg in call.args[1:] if isinstance(arg, ast.Constant)}
        first = min(call.lineno for call in calls)
        assert {f for _, f in imports} <= required, f"{name}: require() does not name {sorted({f for _, f in imports} - required)}"
        assert all(line > first for line, _ in imports), f"{name}: a framework is imported before require()"


# The single modules where a remaining reliance on another library's internals lives, each function with a test that
# names it and the versions it was checked against (issue 27).
INTERNALS_WRAPPERS = ("integrations/hf_internals.py",)


def _foreign_object_hacks(path: Path, relative: str) -> list[str]:
    """In one module: a scan of the garbage collector's objects, a ``__class__`` reassignment, a use of a
    ``GradScaler``'s private ``_enabled``, and (in the Hugging Face integration) a private field written on
    anything but ``self``/``cls`` (the objects the Trainer, accelerate and torch hand over are theirs)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        where = f"{relative}:{node.lineno}"
        if node.attr == "get_objects" and isinstance(node.value, ast.Name) and node.value.id == "gc":
            found.append(f"{where} gc.get_objects")
        elif node.attr == "__class__" and isinstance(node.ctx, ast.Store):
            found.append(f"{where} __class__ =")
        elif node.attr == "_enabled":
            found.append(f"{where} ._enabled")
        elif (relative.startswith("integrations/hf") and isinstance(node.ctx, ast.Store) and node.attr.startswith("_")
              and not node.attr.startswith("__") and not (isinstance(node.value, ast.Name)
                                                          and node.value.id in ("self", "cls"))):
            found.append(f"{where} {ast.unparse(node)} =")
    return sorted(found, key=lambda hack: int(hack.split(":")[1].split()[0]))


def test_no_gc_scan_class_swap_or_private_field_write_outside_the_internals_wrappers():
    package = Path(__file__).resolve().parent.parent / "src" / "fuyou_strategy"
    found = [hack for path in sorted(package.rglob("*.py"))
             if (relative := path.relative_to(package).as_posix()) not in INTERNALS_WRAPPERS
             for hack in _foreign_object_hacks(path, relative)]
    assert found == [], f"move each into a wrapper module with a version test ({INTERNALS_WRAPPERS}): {found}"


def test_the_check_sees_each_kind_of_hack(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import gc\nxs = gc.get_objects()\nplugin.__class__ = Other\nscaler._enabled = False\n"
                      "wrapper._optimizer = opt\nself._mine = 1\n")
    assert _foreign_object_hacks(module, "integrations/hf.py") == [
        "integrations/hf.py:2 gc.get_objects", "integrations/hf.py:3 __class__ =", "integrations/hf.py:4 ._enabled",
        "integrations/hf.py:5 wrapper._optimizer ="]


def test_every_deliberate_bug_of_the_mutation_check_still_names_code_that_exists():
    """A mutant whose code was rewritten can no longer be applied, so the check it stands for silently stops
    (`mutation_check.py` exits at the first such one): each names code that occurs exactly once in ``src/``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mutation_check import MUTANTS

    src = Path(__file__).resolve().parent.parent / "src" / "fuyou_strategy"
    stale = [f"{m.id}: {m.file} holds its code {(src / m.file).read_text().count(m.old)} times" for m in MUTANTS
             if (src / m.file).read_text().count(m.old) != 1]
    assert not stale, "update MUTANTS in tests/mutation_check.py: " + "; ".join(stale)
