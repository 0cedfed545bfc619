"""The import graph of ``sparse_scan/`` and ``cli/``, read from the sources (issue 19).

Every ``import`` and ``from ... import`` of both folders (``cli/`` is installed as ``sparse_scan.cli``),
at module level or inside a function, relative imports resolved, is an edge between two of the
package's modules. ``from package import name`` is an edge to ``package.name`` where that is a module,
else to the package (whose ``__init__`` runs; a name it loads lazily, PEP 562, counts as the package).
Imports under ``if TYPE_CHECKING:`` never run: they count for the engine's layers, not for loops.

The graph must have

- no loop: an import inside a function closes a loop as surely as one at the top, only later;
- no import of a sibling module inside a function (it hides loops and a module's real dependencies),
  but for :data:`LAZY`, each with its reason. The command line imports the library inside its
  functions on purpose (``--help`` and ``--threads`` come before NumPy), never its own modules;
- the engine's layers (``sparse_scan/engine/``): a plan-side module (any but the executors,
  ``_tables`` and ``run``) imports no executor, ``_tables`` nor ``run``, not even through other
  modules; an executor imports no other executor and not ``run``;
- a module outside one of the :data:`SUBPACKAGES` (the engine, the layers, the recurrent modules, ...)
  imports only its public modules (those not named ``_...``, which tests/test_namespace.py requires to
  be documented), but for :data:`PRIVATE_USERS`: a helper two packages need is public to them.

Violations listed in :data:`KNOWN` are being fixed elsewhere: the tests pass while each one stays as
it is and fail once it is fixed (so that it leaves the list) or when a new one appears.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOTS = {"sparse_scan": REPO / "sparse_scan", "sparse_scan.cli": REPO / "cli"}
"""Dotted prefix -> folder: the repository's ``cli/`` is installed as ``sparse_scan.cli``."""

ENGINE = "sparse_scan.engine"
EXECUTORS = ("_cpu", "_dense_cpu", "_gpu", "_dense_gpu")
GPU_TABLES = "_tables"
DISPATCH = "run"

LAZY: dict[tuple[str, str], str] = {}
"""Function-level imports of a sibling module, allowed: (importer, imported) -> why. None: the host
kernels stay lazy without one (numba, 0.3 s to import, is imported by the first call of a compiled
kernel, :func:`sparse_scan._host_kernels.compiled`; tests/test_host_kernels.py checks that no module
imports it)."""

SUBPACKAGES = ("sparse_scan.engine", "sparse_scan.layers", "sparse_scan.recurrent", "sparse_scan.distributed",
               "sparse_scan.flops", "sparse_scan.torch", "sparse_scan.cli")
"""The packages whose private modules are theirs alone."""

PRIVATE_USERS: dict[tuple[str, str], str] = {}
"""Modules outside a subpackage that import one of its private modules: (importer, imported) -> why."""

KNOWN: set[tuple[str, str, str]] = set()
"""Violations being fixed elsewhere: (rule, importer, imported). Empty it as they are fixed."""


@dataclass(frozen=True)
class Edge:
    """One import: ``source`` imports ``target`` (both dotted module names) at ``line``."""

    source: str
    target: str
    line: int
    in_function: bool
    typing_only: bool

    def __str__(self) -> str:
        where = " inside a function" if self.in_function else ""
        return f"{self.source} imports {self.target} (line {self.line}{where})"


def find_modules(roots: Mapping[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    """Dotted name -> source file of every module under ``roots`` (dotted prefix -> folder)."""
    modules = {}
    for prefix, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([prefix, *parts])] = path
    return modules


def _root_of(name: str, roots: Iterable[str]) -> str | None:
    """The longest of ``roots`` that ``name`` is or lies inside, else None (not the package's)."""
    inside = [root for root in roots if name == root or name.startswith(f"{root}.")]
    return max(inside, key=len, default=None)


def _typing_only_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            guarded.update(id(child) for statement in node.body for child in ast.walk(statement))
    return guarded


def read_imports(modules: Mapping[str, pathlib.Path], roots: Iterable[str]) -> list[Edge]:
    """Every import of ``modules`` of a module among them, in source order per module.

    Raises
    ------
    LookupError
        An import names a module inside ``roots`` that does not exist.
    """
    roots = tuple(roots)
    edges = []
    for name, path in sorted(modules.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        in_function = {id(node) for function in ast.walk(tree)
                       if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for node in ast.walk(function)}
        typing_only = _typing_only_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    if node.level > len(parts):
                        raise LookupError(f"{path}:{node.lineno}: relative import beyond the top package")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                if _root_of(target, roots) is None:
                    continue  # the standard library or a dependency
                if target not in modules:
                    raise LookupError(f"{path}:{node.lineno}: no module {target}")
                edges.append(Edge(name, target, node.lineno, id(node) in in_function,
                                  id(node) in typing_only))
    return edges


def _graph(edges: Iterable[Edge], runtime: bool = True) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for edge in edges:
        if not (runtime and edge.typing_only):
            graph.setdefault(edge.source, set()).add(edge.target)
    return graph


def _parents(graph: Mapping[str, set[str]], start: str) -> dict[str, str]:
    """Breadth first from ``start``: each module reached by one import or more -> the one importing it
    on a shortest path (``start`` itself is among them when it is on a loop)."""
    parents, queue = {}, [start]
    for node in queue:
        for target in sorted(graph.get(node, ())):
            if target not in parents:
                parents[target] = node
                if target != start:
                    queue.append(target)
    return parents


def _path(parents: Mapping[str, str], start: str, goal: str) -> list[str]:
    path = [goal]
    while True:
        path.append(parents[path[-1]])
        if path[-1] == start:
            return path[::-1]


def import_loops(edges: Iterable[Edge]) -> list[list[str]]:
    """Each loop of runtime imports (a strongly connected part), as ``a -> b -> ... -> a``, sorted."""
    graph = _graph(edges)
    reach = {node: _parents(graph, node) for node in graph}
    loops, seen = [], set()
    for node in sorted(graph):
        if node in seen or node not in reach[node]:
            continue
        seen.update(other for other in reach[node] if node in reach.get(other, {}))
        loops.append(_path(reach[node], node, node))
    return loops


def function_level_siblings(edges: Iterable[Edge], roots: Iterable[str]) -> list[Edge]:
    """The imports inside functions of a module of the same root (``sparse_scan`` or its ``cli``)."""
    roots = tuple(roots)
    return [edge for edge in edges
            if edge.in_function and _root_of(edge.source, roots) == _root_of(edge.target, roots)]


def engine_violations(edges: Iterable[Edge], engine: str = ENGINE) -> list[tuple[str, str, str]]:
    """``(rule, importer, imported: how)`` for each break of the engine's layers (module docstring)."""
    edges = list(edges)
    graph = _graph(edges, runtime=False)
    modules = set(graph) | {edge.target for edge in edges}
    inside = sorted(name for name in modules if name.startswith(f"{engine}."))
    short = {name: name[len(engine) + 1:] for name in inside}
    executors = {name for name in inside if short[name] in EXECUTORS}
    run_side = executors | {name for name in inside if short[name] in (GPU_TABLES, DISPATCH)}
    found = []
    for name in inside:
        if name in executors or short[name] == GPU_TABLES:
            forbidden, rule = (executors - {name}) | {f"{engine}.{DISPATCH}"}, "executor"
        elif name not in run_side:
            forbidden, rule = run_side, "plan-side"
        else:
            continue
        parents = _parents(graph, name)
        for target in sorted(forbidden & set(parents)):
            found.append((rule, name, target, " -> ".join(_path(parents, name, target))))
    return found


def private_reaches(edges: Iterable[Edge],
                    packages: Iterable[str] = SUBPACKAGES) -> list[tuple[str, str, str]]:
    """``(importer, imported, how)`` for each import of a private module of a package in ``packages``
    (a module ``_...`` anywhere under it) by a module outside that package."""
    found = []
    for edge in edges:
        for package in packages:
            inner = edge.target[len(package) + 1:].split(".") if edge.target.startswith(f"{package}.") else []
            private = any(part.startswith("_") for part in inner)
            outside = edge.source != package and not edge.source.startswith(f"{package}.")
            if private and outside:
                found.append((edge.source, edge.target, str(edge)))
    return found


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return read_imports(find_modules(ROOTS), ROOTS)


def _check(rule: str, found: Mapping[tuple[str, str], str], allowed: Iterable[tuple[str, str]] = ()) -> None:
    """``found`` ((importer, imported) -> how) is the allowed and :data:`KNOWN` ones, no more or fewer."""
    known = {(source, target) for known_rule, source, target in KNOWN if known_rule == rule}
    allowed = set(allowed)
    new = [how for pair, how in sorted(found.items()) if pair not in known | allowed]
    fixed = sorted(known - set(found))
    assert not new, f"{rule} imports:\n" + "\n".join(new)
    assert not fixed, f"fixed, remove from KNOWN: {[(rule, *pair) for pair in fixed]}"


def test_the_graph_is_read(edges):
    sources = {edge.source for edge in edges}
    assert {"sparse_scan.engine.run", "sparse_scan.cli.app", "sparse_scan.distributed"} <= sources
    assert any(edge.in_function for edge in edges)  # the command line's lazy imports of the library


def test_no_import_loop(edges):
    loops = import_loops(edges)
    assert not loops, "import loops:\n" + "\n".join(" -> ".join(loop) for loop in loops)


def test_no_function_level_import_of_a_sibling(edges):
    found = {(edge.source, edge.target): str(edge) for edge in function_level_siblings(edges, ROOTS)}
    _check("function-level", found, LAZY)
    assert set(LAZY) <= set(found), f"no longer lazy, remove from LAZY: {sorted(set(LAZY) - set(found))}"


def test_the_engine_layers(edges):
    found = {(source, target): f"{rule}: {how}" for rule, source, target, how in engine_violations(edges)}
    _check("engine", found)


def test_outside_a_subpackage_only_its_public_modules(edges):
    found = {(source, target): how for source, target, how in private_reaches(edges)}
    _check("outside", found, PRIVATE_USERS)
    stale = sorted(set(PRIVATE_USERS) - set(found))
    assert not stale, f"no longer imported, remove from PRIVATE_USERS: {stale}"


def test_the_engines_roles_name_its_modules():
    """A new engine module is plan-side unless named here: an executor must be added to EXECUTORS."""
    names = {path.stem for path in (REPO / "sparse_scan" / "engine").glob("*.py")}
    assert {*EXECUTORS, DISPATCH, "schedule", "products", "plan", "dense_plan"} <= names


def _write(root: pathlib.Path, files: Mapping[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_checks_find_planted_violations(tmp_path):
    _write(tmp_path / "pkg", {
        "__init__.py": "",
        "a.py": "import os\nfrom . import b\n",
        "b.py": "from .a import os\n",  # a -> b -> a
        "c.py": "def f():\n    from .a import os\n    import json\n    return os, json\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import e\n",
        "e.py": "from . import d\n",  # a loop only for the type checker
        "engine/__init__.py": "",
        "engine/plan.py": "from .schedule import x\n",
        "engine/schedule.py": "from ..f import y\n",
        "f.py": "from .engine import run\n",  # schedule reaches run through f
        "engine/run.py": "from . import _cpu, _gpu\n",
        "engine/_cpu.py": "import os\n",
        "engine/_gpu.py": "from ._cpu import w\n",
    })
    roots = {"pkg": tmp_path / "pkg"}
    edges = read_imports(find_modules(roots), roots)
    assert import_loops(edges) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert [(edge.source, edge.target, edge.line) for edge in function_level_siblings(edges, roots)] == [
        ("pkg.c", "pkg.a", 2)]
    found = {(rule, source, target) for rule, source, target, _ in engine_violations(edges, "pkg.engine")}
    assert ("executor", "pkg.engine._gpu", "pkg.engine._cpu") in found
    assert ("plan-side", "pkg.engine.schedule", "pkg.engine.run") in found
    assert ("plan-side", "pkg.engine.plan", "pkg.engine._gpu") in found  # through schedule -> f -> run
    assert not private_reaches(edges, ["pkg.engine"])  # f imports the public run
    _write(tmp_path / "pkg", {"g.py": "from .engine._cpu import w\n", "h.py": "import pkg.missing\n"})
    with pytest.raises(LookupError, match="no module pkg.missing"):
        read_imports(find_modules(roots), roots)
    (tmp_path / "pkg" / "h.py").unlink()
    edges = read_imports(find_modules(roots), roots)
    assert [(source, target) for source, target, _ in private_reaches(edges, ["pkg.engine"])] == [
        ("pkg.g", "pkg.engine._cpu")]
