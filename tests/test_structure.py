"""The package's structure: what may import what, and the few rules that keep it readable.

``src/credit/parallel`` is a namespace package (shared with CREDIT) of public modules on top of
private subsystems, each a folder whose ``__init__.py`` (its face) hands on the names the rest of
the package uses. The rules, each a test below:

1. Imports run one way: ``_common`` imports nothing else of the package; ``_norm``, ``_replicas``,
   ``_averaging`` and ``_spikes`` import ``_common``; ``_scaler`` imports ``_common`` and ``_norm``;
   the public modules (``demo`` and ``integrations`` included) import anything. No private folder imports a
   public module. Every import counts: inside functions and under ``TYPE_CHECKING`` too.
2. Outside its folder, a subsystem is reached through its face only (``from credit.parallel import
   _norm``, ``from credit.parallel._norm import reduce``), never its modules, so that each folder
   can be rearranged behind the names it hands on. ``_common``'s modules are imported directly.
3. No import cycle among the package's modules (faces included), counting the imports that run
   when a module is imported: a cycle works or breaks depending on which module is imported first.
4. Only the orchestrator calls the steps (``_norm.steps.reduce``, ``replicas.verify_replicas``):
   what a step takes from another step is a class or an UPPER_CASE constant, never a function.
5. Every cache belongs to a process group: no ``functools`` cache (a re-formed group would meet
   entries learned under another), and every ``ScopedCache`` kept at module level or as a class
   field is named in docs/design.rst, which says what each keeps and why, as ``module.name``
   (``_norm.plan._plans``; a field: ``_norm.stacking.Stacking._indices``).
6. No two classes share a name, so that a name in a message or a doc points at one class.
7. ``credit.parallel`` has no ``__init__.py``: another distribution shares the namespace.

The tests parse the sources (``ast``) and import nothing of the package, so they run in a moment.
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "credit" / "parallel"
DESIGN = ROOT / "docs" / "design.rst"
PREFIX = "credit.parallel"

PUBLIC = (
    "collectives",
    "grad_sync",
    "norm_report",
    "amp",
    "replicas",
    "spikes",
    "parallel_mesh",
    "__main__",
    "demo",
    "integrations",
)
# What each private folder may import besides itself.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "_common": frozenset(),
    "_norm": frozenset({"_common"}),
    "_replicas": frozenset({"_common"}),
    "_averaging": frozenset({"_common"}),
    "_scaler": frozenset({"_common", "_norm"}),
    "_spikes": frozenset({"_common"}),
}
# Folders reached through their face only.
FACES = ("_norm", "_replicas", "_scaler", "_averaging", "_spikes")
# The steps of each subsystem; its orchestrator (not listed) alone calls them.
STEPS: dict[str, tuple[str, ...]] = {
    "_norm": ("request", "plan", "proof", "local_norms", "collective", "verdict", "clip"),
    "_replicas": ("arguments", "plan", "proof", "settle"),
}
UNSCOPED_CACHES = frozenset({"lru_cache", "cache", "cached_property"})
CONSTANT = re.compile(r"_?[A-Z][A-Z0-9_]*")


@dataclass(frozen=True)
class _Import:
    """One name bound by an import statement of a package module."""

    source: str  # importing module, relative to the package ("_norm.plan")
    line: int
    module: str  # absolute module of the statement
    name: str | None  # ``from module import name``; None for ``import module``
    alias: str  # what the importing code writes to reach it
    executed: bool  # runs when the source is imported (not in a function, not TYPE_CHECKING)


@functools.cache
def _modules() -> dict[str, Path]:
    """Every module of the package, by its name relative to the package (a folder: its face)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@functools.cache
def _tree(module: str) -> ast.Module:
    return ast.parse(_modules()[module].read_text(), filename=str(_modules()[module]))


def _where(module: str, line: int | None = None) -> str:
    path = _modules()[module].relative_to(ROOT).as_posix()
    return path if line is None else f"{path}:{line}"


def _part(module: str) -> str:
    return module.split(".")[0]


def _is_package(module: str) -> bool:
    return module in _modules() and _modules()[module].name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _executed(node: ast.AST) -> Iterator[ast.AST]:
    """The nodes under ``node`` that run on import: not function bodies, not TYPE_CHECKING's."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield stmt
                yield from _executed(stmt)
            continue
        yield child
        yield from _executed(child)


def _absolute(source: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = f"{PREFIX}.{source}".split(".")
    if not _is_package(source):
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@functools.cache
def _imports(source: str) -> tuple[_Import, ...]:
    """Every import of module ``source``, wherever it stands."""
    tree = _tree(source)
    executed = {id(node) for node in _executed(tree)}
    found = []
    for node in ast.walk(tree):
        runs = id(node) in executed
        if isinstance(node, ast.Import):
            for a in node.names:
                alias = a.asname or a.name
                found.append(_Import(source, node.lineno, a.name, None, alias, runs))
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(source, node)
            for a in node.names:
                alias = a.asname or a.name
                found.append(_Import(source, node.lineno, module, a.name, alias, runs))
    return tuple(found)


@functools.cache
def _bound(module: str) -> frozenset[str]:
    """The names the top level of ``module`` binds (a face: the names it hands on)."""
    if module not in _modules():
        return frozenset()
    names = set()
    for node in _tree(module).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return frozenset(names)


def _target(imp: _Import) -> str | None:
    """The package module ``imp`` reaches (relative name), or None outside the package."""
    if imp.module != PREFIX and not imp.module.startswith(PREFIX + "."):
        return None
    module = imp.module[len(PREFIX) + 1 :]
    if imp.name is not None:
        sub = f"{module}.{imp.name}" if module else imp.name
        # a submodule, unless the package binds the name itself (a face's function `plan`)
        if sub in _modules() and imp.name not in _bound(module):
            return sub
    return module or None


def _internal() -> Iterator[tuple[_Import, str]]:
    """Every import of a package module by a package module, with the module it reaches."""
    for source in _modules():
        for imp in _imports(source):
            target = _target(imp)
            if target is not None:
                yield imp, target


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _attributes(source: str, alias: str) -> Iterator[tuple[int, str]]:
    """The attributes that ``source`` reads off the module it imported as ``alias``."""
    for node in ast.walk(_tree(source)):
        if isinstance(node, ast.Attribute) and _dotted(node.value) == alias:
            yield node.lineno, node.attr


def _module_alias(imp: _Import, target: str) -> str | None:
    """What code writes to reach module ``target`` through ``imp``, if ``imp`` binds a module."""
    if imp.name is None:
        return imp.alias
    module = imp.module[len(PREFIX) + 1 :]
    sub = f"{module}.{imp.name}" if module else imp.name
    return imp.alias if target == sub else None


def _origin(module: str, name: str) -> tuple[str, str]:
    """Where ``module.name`` is defined, following re-exports (a face's ``from x import name``)."""
    for imp in _imports(module):
        target = _target(imp)
        if imp.executed and imp.alias == name and target is not None:
            if _module_alias(imp, target) is not None:
                return target, ""
            return _origin(target, imp.name or name)
    return module, name


def _is_class_or_constant(module: str, name: str) -> bool:
    for node in _tree(module).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return CONSTANT.fullmatch(name) is not None
    return False


def test_layout() -> None:
    """Every module sits in a part the rules below know, and the steps' modules exist."""
    parts = set(PUBLIC) | set(MAY_IMPORT)
    unknown = [_where(m) for m in _modules() if _part(m) not in parts]
    assert not unknown, f"modules outside the known parts (add them to this test): {unknown}"
    for folder in (*MAY_IMPORT, "demo", "integrations"):
        assert _is_package(folder), f"{folder}/ has no __init__.py"
    missing = [
        f"{f}.{s}" for f, steps in STEPS.items() for s in steps if f"{f}.{s}" not in _modules()
    ]
    assert not missing, f"step modules listed here but absent: {missing}"


def test_imports_run_one_way() -> None:
    """Rule 1: each private folder imports only itself and the folders below it."""
    bad = []
    for imp, target in _internal():
        source, reached = _part(imp.source), _part(target)
        if source in MAY_IMPORT and reached != source and reached not in MAY_IMPORT[source]:
            bad.append(f"{_where(imp.source, imp.line)}: {source} imports {PREFIX}.{target}")
    assert not bad, "imports against the one-way order:\n" + "\n".join(bad)


def test_subsystems_reached_through_their_face() -> None:
    """Rule 2: outside a folder of FACES, code names the folder's face, never its modules."""
    bad = []
    for imp, target in _internal():
        face = _part(target)
        if face not in FACES or _part(imp.source) == face:
            continue
        if target != face:
            bad.append(f"{_where(imp.source, imp.line)}: imports {PREFIX}.{target}")
            continue
        alias = _module_alias(imp, target)
        for line, attr in _attributes(imp.source, alias) if alias else ():
            if attr not in _bound(face):
                bad.append(f"{_where(imp.source, line)}: {alias}.{attr} is not on {face}'s face")
    assert not bad, "a subsystem's modules reached past its __init__.py:\n" + "\n".join(bad)


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of ``graph`` (module -> {imported module: line}), as the modules on it."""
    state: dict[str, bool] = {}  # False: on the path; True: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = False
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) is False:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = True
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle() -> None:
    """Rule 3: the modules' import-time imports form no cycle."""
    graph: dict[str, dict[str, int]] = defaultdict(dict)
    for imp, target in _internal():
        if not imp.executed:
            continue
        parts = target.split(".")
        # importing a.b.c runs a's and a.b's faces first, unless the importer lives inside them
        for n in range(1, len(parts) + 1):
            reached = ".".join(parts[:n])
            inside = imp.source.startswith(reached + ".") and n < len(parts)
            if reached in _modules() and reached != imp.source and not inside:
                graph[imp.source].setdefault(reached, imp.line)
    cycle = _cycle(graph)
    assert cycle is None, "import cycle:\n" + "\n".join(
        f"{_where(a, graph[a][b])} imports {PREFIX}.{b}" for a, b in itertools.pairwise(cycle)
    )


@pytest.mark.parametrize("folder", sorted(STEPS))
def test_steps_call_no_other_step(folder: str) -> None:
    """Rule 4: a step takes classes and UPPER_CASE constants from another step, no function."""
    steps = {f"{folder}.{s}" for s in STEPS[folder]}
    bad = []

    def check(source: str, line: int, module: str, name: str) -> None:
        origin, defined = _origin(module, name)
        if origin in steps and origin != source and not _is_class_or_constant(origin, defined):
            what = f"{PREFIX}.{origin}" + (f".{defined}" if defined else " (the module)")
            bad.append(f"{_where(source, line)}: takes {what}, not a class or a constant")

    for source in sorted(steps):
        for imp in _imports(source):
            target = _target(imp)
            if target is None:
                continue
            alias = _module_alias(imp, target)
            if alias is None:
                check(source, imp.line, target, imp.name or "")
                continue
            for line, attr in _attributes(source, alias):
                check(source, line, target, attr)
    assert not bad, f"a step of {folder} calls into another step:\n" + "\n".join(bad)


def test_no_unscoped_cache() -> None:
    """Rule 5: no functools cache anywhere in the package."""
    bad = []
    for module in _modules():
        names = {i.alias for i in _imports(module) if i.module == "functools" and i.name is None}
        for imp in _imports(module):
            if imp.module == "functools" and imp.name in UNSCOPED_CACHES:
                bad.append(f"{_where(module, imp.line)}: imports functools.{imp.name}")
        for node in ast.walk(_tree(module)):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in UNSCOPED_CACHES
                and _dotted(node.value) in names
            ):
                bad.append(f"{_where(module, node.lineno)}: functools.{node.attr}")
    assert not bad, "caches not scoped to the process group (use ScopedCache):\n" + "\n".join(bad)


def _creates_scoped_cache(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call)
        and (
            (isinstance(n.func, ast.Name) and n.func.id == "ScopedCache")
            or (isinstance(n.func, ast.Attribute) and n.func.attr == "ScopedCache")
        )
        for n in ast.walk(node)
    )


def _kept_caches(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, int]]:
    """The ScopedCaches assigned at this level (module or class body) and in nested classes."""
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield from _kept_caches(node.body, f"{prefix}.{node.name}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and _creates_scoped_cache(node):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            yield from (
                (f"{prefix}.{t.id}", node.lineno) for t in targets if isinstance(t, ast.Name)
            )


def _scoped_caches() -> dict[str, str]:
    """Every ScopedCache kept at module level or as a class field: ``module.name`` -> where."""
    return {
        name: _where(module, line)
        for module in _modules()
        for name, line in _kept_caches(_tree(module).body, module)
    }


def test_scoped_caches_documented() -> None:
    """Rule 5: docs/design.rst names every ScopedCache the package keeps, as ``module.name``."""
    design = DESIGN.read_text()
    missing = [
        f"``{n}`` ({at})" for n, at in sorted(_scoped_caches().items()) if f"``{n}``" not in design
    ]
    assert not missing, "ScopedCaches not named in docs/design.rst:\n" + "\n".join(missing)


def test_class_names_unique() -> None:
    """Rule 6: one class per name across the package, nested classes included."""
    where: dict[str, list[str]] = defaultdict(list)
    for module in _modules():
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(_where(module, node.lineno))
    shared = {name: places for name, places in where.items() if len(places) > 1}
    assert not shared, f"class names defined more than once: {shared}"


def test_namespace_package() -> None:
    """Rule 7: credit.parallel is a namespace package."""
    init = PACKAGE / "__init__.py"
    assert not init.exists(), f"{init.relative_to(ROOT)} makes credit.parallel a regular package"
