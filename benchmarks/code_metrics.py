"""Structure of the package, measured with Python's ``ast`` (no import of the package itself).

Prints, and writes as JSON (``--json``):

- lines per module and per class under ``optim/`` and in ``engine.py`` (and any ``--path``);
- private-attribute accesses across module boundaries: every ``x._name`` (``_name`` not a dunder)
  where ``x`` is not ``self``/``cls`` of the class the access sits in, nor a name the module itself
  defines. Stated precisely: an access ``obj._attr`` counts when ``obj`` is not ``self``/``cls``,
  is not rooted in a name bound to a module outside the package (``torch._C``, ``os._exit``), and
  ``_attr`` is not defined (assigned as ``self._attr``, a function, class, variable or argument)
  in the module that accesses it; ``from .x import _name`` counts too. That catches ``opt._by_param`` in checkpoint.py and ``scaler._scale`` in adamw.py,
  and does not count a class reading its own private fields of another instance;
- the import cycles among the package's modules (strongly connected components of the graph of
  ``from . import`` / ``from ..x import`` / ``import fuyou_strategy.x`` edges, at module level or in
  functions alike; imports under ``if TYPE_CHECKING:`` never run and do not count).

Run: ``python benchmarks/code_metrics.py [--json out.json]``.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "fuyou_strategy"


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph(mods: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from x import y`` counts ``x.y`` when that is a module)."""
    mods = modules() if mods is None else mods
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        for node in _runtime_nodes(tree):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module) if node.level else (node.module or "")
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in mods else base)
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return {m: graph.get(m, set()) for m in mods}


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (imports for annotations only,
    which never run)."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                todo.extend(child.orelse)
                continue
            todo.append(child)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted. A package's
    ``__init__`` importing its own submodules is not counted as a cycle with them."""
    graph = {m: {t for t in ts if not (m.startswith(t + ".") and _is_init(t, graph))} for m, ts in graph.items()}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return sorted(out)


def _is_init(name: str, graph: dict[str, set[str]]) -> bool:
    return any(m.startswith(name + ".") for m in graph)  # a package (has submodules)


def private_accesses(mods: dict[str, Path] | None = None) -> list[tuple[str, int, str]]:
    """``(module, line, "obj._attr")`` for each private attribute read or written on something other
    than ``self``/``cls`` whose name the accessing module does not define itself (see the docstring)."""
    mods = modules() if mods is None else mods
    found = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        defined = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") \
                    and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Name):
                        defined.add(t.id)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
        foreign = set()  # names bound to modules outside the package (torch._C, os._exit): not ours to count
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                foreign |= {(a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("fuyou")}
            elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("fuyou"):
                foreign |= {a.asname or a.name for a in node.names}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__"):
                continue
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in foreign:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if attr in defined:
                continue
            found.append((name, node.lineno, f"{ast.unparse(node.value)}.{attr}"))
        for node in ast.walk(tree):  # `from .pipeline import _LIVENESS_POLL`: a private name taken from another module
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fuyou")):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append((name, node.lineno, f"import {alias.name}"))
    return found


def sizes(paths: list[Path]) -> dict[str, dict]:
    """Lines of each file and of each top-level class in it."""
    out = {}
    for path in paths:
        tree = ast.parse(path.read_text())
        classes = {n.name: n.end_lineno - n.lineno + 1 for n in tree.body if isinstance(n, ast.ClassDef)}
        methods = {n.name: sum(isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) for m in n.body)
                   for n in tree.body if isinstance(n, ast.ClassDef)}
        out[str(path.relative_to(PACKAGE.parent))] = {
            "lines": len(path.read_text().splitlines()), "classes": classes, "methods": methods}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--list", action="store_true", help="list every private-attribute access")
    args = parser.parse_args(argv)
    mods = modules()
    files = sorted((PACKAGE / "optim").glob("*.py")) + [PACKAGE / "engine.py"]
    files += [p for p in [PACKAGE / "run_report.py"] if p.exists()]
    table = sizes(files)
    print(f"{'file':44} {'lines':>6}  largest classes (lines / methods)")
    for file, info in table.items():
        big = sorted(info["classes"].items(), key=lambda kv: -kv[1])[:3]
        print(f"{file:44} {info['lines']:6}  " + ", ".join(f"{c} {n}/{info['methods'][c]}" for c, n in big))
    accesses = private_accesses(mods)
    by_module: dict[str, int] = defaultdict(int)
    for module, _line, _expr in accesses:
        by_module[module] += 1
    print(f"\nprivate-attribute accesses across module boundaries (ast): {len(accesses)}")
    for module, n in sorted(by_module.items(), key=lambda kv: -kv[1]):
        print(f"  {module:44} {n}")
    if args.list:
        for module, line, expr in accesses:
            print(f"    {module}:{line}  {expr}")
    found = cycles(import_graph(mods))
    print(f"\nimport cycles: {len(found)}")
    for comp in found:
        print(f"  {len(comp)} modules: {', '.join(comp)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"sizes": table, "private_accesses": accesses, "cycles": found}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
