"""The import graph of engine/ and server/: no cycles, none hidden behind a function-level
import, and no private name (``_x``) imported from another module.

Every module is read with ``ast``, not imported: module-level and function-level imports count
alike, since a cycle that only closes when a function runs is still a cycle. Imports under
``if TYPE_CHECKING:`` never run and do not count. ``from a.b import y`` is an edge to ``a.b.y``
when that is a module and to ``a.b`` otherwise; relative imports are resolved against the
importing module's package. Imports by string (``importlib.import_module``) are not seen.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "server")


@dataclass(frozen=True)
class Import:
    """One import statement's view of one imported thing."""

    importer: str  # the module the statement is in
    target: str  # the module it loads (a module of engine/ or server/)
    name: str | None  # the name taken from ``target`` (``from target import name``), if any
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the two packages, by dotted name."""
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def statements(nodes: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements at any depth (functions, classes, try blocks, conditions), leaving
    out the bodies of ``if TYPE_CHECKING:``."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        if isinstance(node, ast.If) and is_type_checking(node.test):
            yield from statements(node.orelse)
            continue
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                yield from statements([c for c in children if isinstance(c, ast.stmt)])
                for c in children:  # except handlers and match cases hold statements one level down
                    if isinstance(c, ast.excepthandler | ast.match_case):
                        yield from statements(c.body)


def resolve_base(node: ast.ImportFrom, *, importer: str, is_package: bool) -> str:
    """The absolute module name ``from ... import`` reads from."""
    if node.level == 0:
        return node.module or ""
    package = importer if is_package else importer.rpartition(".")[0]
    parts = package.split(".")
    if node.level > 1:
        parts = parts[: len(parts) - (node.level - 1)]
    base = ".".join(parts)
    return f"{base}.{node.module}" if node.module else base


def known(name: str, known_modules: dict[str, Path]) -> str | None:
    """``name`` if it is a module of ours, else its nearest ancestor that is, else None."""
    while name:
        if name in known_modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_in(source: str, *, name: str, is_package: bool, known_modules: dict[str, Path]) -> list[Import]:
    """The imports of our modules that module ``name`` (whose text is ``source``) makes."""
    tree = ast.parse(source)
    found: list[Import] = []
    for node in statements(tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = known(alias.name, known_modules)
                if target is not None:
                    found.append(Import(name, target, None, node.lineno))
            continue
        base = resolve_base(node, importer=name, is_package=is_package)
        for alias in node.names:
            if f"{base}.{alias.name}" in known_modules:
                found.append(Import(name, f"{base}.{alias.name}", None, node.lineno))
                continue
            target = known(base, known_modules)
            if target is not None:
                found.append(Import(name, target, alias.name, node.lineno))
    return found


def all_imports() -> list[Import]:
    known_modules = modules()
    return [
        imp
        for name, path in known_modules.items()
        for imp in imports_in(
            path.read_text(), name=name, is_package=path.name == "__init__.py", known_modules=known_modules
        )
    ]


def graph(imports: list[Import], names: list[str]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in names}
    for imp in imports:
        if imp.target != imp.importer:
            edges[imp.importer].add(imp.target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def loop_through(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One closed path inside ``component``, from its first module back to it (for messages)."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to ``start``
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & members):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{component} is not strongly connected")


def test_no_import_cycles() -> None:
    edges = graph(all_imports(), list(modules()))
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(
        " -> ".join(loop_through(c, edges)) + f"   (modules in the cycle: {', '.join(c)})" for c in found
    )


def test_no_private_name_is_imported_from_another_module() -> None:
    private = [
        f"{imp.importer} (line {imp.line}) imports {imp.name} from {imp.target}"
        for imp in all_imports()
        if imp.name is not None
        and imp.name.startswith("_")
        and not imp.name.startswith("__")
        and imp.target != imp.importer
    ]
    assert not private, "private names imported across modules:\n" + "\n".join(private)


def test_the_graph_sees_function_level_relative_and_submodule_imports() -> None:
    """The reader itself: a cycle closed only inside a function, through a relative import of a
    submodule, is found; one closed only under TYPE_CHECKING is not."""
    known_modules = {"pkg": Path("pkg/__init__.py"), "pkg.a": Path("pkg/a.py"), "pkg.b": Path("pkg/b.py")}
    sources = {
        "pkg.a": "from pkg import b\n",
        "pkg.b": "def f():\n    try:\n        from . import a\n    except ImportError:\n        pass\n",
    }

    def edges_for(sources: dict[str, str]) -> dict[str, set[str]]:
        found = [
            imp
            for name, text in sources.items()
            for imp in imports_in(text, name=name, is_package=False, known_modules=known_modules)
        ]
        return graph(found, list(known_modules))

    assert cycles(edges_for(sources)) == [["pkg.a", "pkg.b"]]
    typed = {**sources, "pkg.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"}
    assert cycles(edges_for(typed)) == []
