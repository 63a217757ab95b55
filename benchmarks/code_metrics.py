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
  functions alike; imports under ``if TYPE_CHECKING:`` never run and do not count);
- docstring lines: the lines that module, class and function docstrings span (from the string's first
  line to its last), their total and share of all lines of ``src/``, and the five longest;
- reach chains, one object reached through another's parts (``opt.adam_state.pipeline.threads``;
  STYLE.md, "Ask, don't reach"). Stated precisely, by syntax alone: take each ``ast.Attribute`` that
  is not itself the ``.value`` of an ``ast.Attribute`` (so a nested chain counts once, whole) and
  follow ``.value`` down to its root. The chain counts when the root is an ``ast.Name`` (a chain from
  a call or a subscript, ``f().a.b.c``, does not) that is not bound by an import in that file
  (``torch.nn.functional.relu``, ``os.path.join`` are qualified names, not reaches), and the hops
  after the root object number 3 or more. The root object is ``self.<attr>`` (``cls.<attr>``) when the
  root is ``self`` (``cls``), else the name itself: ``opt.a.b.c`` and ``self.opt.a.b.c`` have 3 hops,
  ``self.a.b.c`` has 2. Method calls count like fields (``self.opt.state.store.close()``: 3 hops).

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


def docstrings(mods: dict[str, Path] | None = None) -> list[tuple[str, str, int]]:
    """``(module, where, lines)`` for each module, class and function docstring (``where``: ``""`` for the
    module's, else the dotted name of its class or function inside the module)."""
    mods = modules() if mods is None else mods
    found = []

    def visit(node: ast.AST, module: str, prefix: str) -> None:
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            found.append((module, prefix, body[0].end_lineno - body[0].lineno + 1))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, module, f"{prefix}.{child.name}" if prefix else child.name)
            elif not isinstance(child, ast.expr):
                visit_nested(child, module, prefix)

    def visit_nested(node: ast.AST, module: str, prefix: str) -> None:  # a def under if/try/with: no docstring of its own
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, module, f"{prefix}.{child.name}" if prefix else child.name)
            elif isinstance(child, ast.stmt):
                visit_nested(child, module, prefix)

    for name, path in mods.items():
        visit(ast.parse(path.read_text()), name, "")
    return found


def reach_chains(source: str) -> list[tuple[int, str, int]]:
    """``(line, chain, hops)`` for each reach chain of 3 hops or more in ``source`` (defined in the module
    docstring: rooted at a name no import binds; ``self.x``/``cls.x`` is the root object when rooted at
    ``self``/``cls``; the longest chain of a nested expression, once)."""
    tree = ast.parse(source)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {a.asname or a.name for a in node.names}
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        hops, root = 0, node
        while isinstance(root, ast.Attribute):
            hops, root = hops + 1, root.value
        if not isinstance(root, ast.Name) or root.id in imported:
            continue
        if root.id in ("self", "cls"):
            hops -= 1  # self.<attr> is the root object
        if hops >= 3:
            found.append((node.lineno, ast.unparse(node), hops))
    return sorted(found)


def chains(mods: dict[str, Path] | None = None) -> list[tuple[str, int, str]]:
    """``(module, line, chain)`` for each reach chain of 3 hops or more in the package (`reach_chains`)."""
    mods = modules() if mods is None else mods
    return [(name, line, chain) for name, path in mods.items() for line, chain, _hops in reach_chains(path.read_text())]


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
    parser.add_argument("--list", action="store_true", help="list every private-attribute access and reach chain")
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
    docs = docstrings(mods)
    total = sum(len(path.read_text().splitlines()) for path in mods.values())
    doc_lines = sum(n for _m, _w, n in docs)
    longest = sorted(docs, key=lambda d: -d[2])[:5]
    print(f"\ndocstring lines: {doc_lines} of {total} ({doc_lines / total:.1%}) in {len(docs)} docstrings; longest:")
    for module, where, n in longest:
        print(f"  {module + (':' + where if where else ''):60} {n}")
    reaches = chains(mods)
    by_module = defaultdict(int)
    for module, _line, _chain in reaches:
        by_module[module] += 1
    print(f"\nreach chains (3+ hops beyond the root object, ast): {len(reaches)}")
    for module, n in sorted(by_module.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {module:44} {n}")
    if args.list:
        for module, line, chain in reaches:
            print(f"    {module}:{line}  {chain}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "sizes": table, "private_accesses": accesses, "cycles": found,
            "docstrings": {"lines": doc_lines, "total_lines": total, "share": round(doc_lines / total, 4),
                           "count": len(docs), "longest": [list(d) for d in longest]},
            "reach_chains": {"total": len(reaches), "per_module": dict(sorted(by_module.items())),
                             "chains": [list(c) for c in reaches]}}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
