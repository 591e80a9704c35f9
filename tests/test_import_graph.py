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
from typing import Any

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


# The service reaches the engine through its package faces: ``engine`` and ``engine.<package>``,
# whose ``__init__`` lists the public names in ``__all__`` (heavy ones loaded on first use by a
# module ``__getattr__``: ``_HOMES`` maps such a name to the module that defines it, ``_RENAMED``
# to its name there when the face gives it another).


def literal(tree: ast.Module, name: str) -> Any:
    """The value of the module-level ``name = <literal>`` in ``tree`` (None when there is none)."""
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
            return ast.literal_eval(node.value)
    return None


def faces(known_modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each package face of the engine (``engine`` and its direct subpackages) -> its ``__all__``."""
    return {
        name: set(literal(ast.parse(path.read_text()), "__all__") or ())
        for name, path in known_modules.items()
        if path.name == "__init__.py" and name.split(".")[0] == "engine" and name.count(".") <= 1
    }


def face_aliases(
    tree: ast.Module, *, importer: str, is_package: bool, face_names: set[str]
) -> dict[str, str]:
    """The names ``tree`` binds to a face module itself (``from engine import training as layout``,
    ``import engine.tracking as tracking``) -> that face."""
    bound: dict[str, str] = {}
    for node in statements(tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in face_names:
                    bound[alias.asname] = alias.name
            continue
        base = resolve_base(node, importer=importer, is_package=is_package)
        for alias in node.names:
            if f"{base}.{alias.name}" in face_names:
                bound[alias.asname or alias.name] = f"{base}.{alias.name}"
    return bound


def face_offenders(
    imports: list[Import], attributes: list[tuple[str, int, str, str]], face_all: dict[str, set[str]]
) -> list[str]:
    """What the service imports from the engine other than a face's listed names: a module below
    a face, or a name (imported, or read as ``alias.name`` from a face module imported whole) that
    the face's ``__all__`` leaves out. ``attributes``: (importer, line, face, name) per such read."""
    found = []
    for imp in imports:
        if not (imp.importer.split(".")[0] == "server" and imp.target.split(".")[0] == "engine"):
            continue
        if imp.target not in face_all:
            package = ".".join(imp.target.split(".")[:2])
            found.append(
                f"{imp.importer} (line {imp.line}) imports {imp.target}: below the package face "
                f"(import {imp.name or 'its names'} from {package if package in face_all else 'engine'})"
            )
        elif imp.name is not None and imp.name not in face_all[imp.target]:
            found.append(
                f"{imp.importer} (line {imp.line}) imports {imp.name} from {imp.target}, not in its __all__"
            )
    found += [
        f"{importer} (line {line}) reads {face}.{name}, not in its __all__"
        for importer, line, face, name in attributes
        if name not in face_all[face]
    ]
    return found


def face_attributes(known_modules: dict[str, Path], face_names: set[str]) -> list[tuple[str, int, str, str]]:
    """Every ``alias.name`` a server module reads from a face module it imported whole."""
    found = []
    for name, path in known_modules.items():
        if name.split(".")[0] != "server":
            continue
        tree = ast.parse(path.read_text())
        bound = face_aliases(
            tree, importer=name, is_package=path.name == "__init__.py", face_names=face_names
        )
        found += [
            (name, node.lineno, bound[node.value.id], node.attr)
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
        ]
    return found


def test_the_server_imports_only_names_the_engine_faces_list() -> None:
    known_modules = modules()
    face_all = faces(known_modules)
    offenders = face_offenders(all_imports(), face_attributes(known_modules, set(face_all)), face_all)
    assert not offenders, "the server reaches past the engine's package faces:\n" + "\n".join(offenders)


def bindings(nodes: list[ast.stmt]) -> set[str]:
    """The names module-level statements bind when the module runs (``if TYPE_CHECKING:`` bodies
    left out; both branches of any other ``if``, every part of a ``try``)."""
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.If):
            names |= bindings(node.orelse) | (set() if is_type_checking(node.test) else bindings(node.body))
        elif isinstance(node, ast.Try):
            names |= bindings(node.body) | bindings(node.orelse) | bindings(node.finalbody)
            for handler in node.handlers:
                names |= bindings(handler.body)
    return names


def face_problems(name: str, source: str, known_modules: dict[str, Path]) -> list[str]:
    """Why a name the face ``name`` (its ``__init__`` text: ``source``) lists may not be there."""
    tree = ast.parse(source)
    listed = literal(tree, "__all__")
    if listed is None:  # not a face yet: the server may import nothing from it
        return []
    homes: dict[str, str] = literal(tree, "_HOMES") or {}
    renamed: dict[str, str] = literal(tree, "_RENAMED") or {}
    eager = bindings(tree.body)
    typed = {  # what a type checker is told: name -> module, under ``if TYPE_CHECKING:``
        alias.asname or alias.name: node.module
        for top in tree.body
        if isinstance(top, ast.If) and is_type_checking(top.test)
        for node in top.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    problems = [
        f"{name}._HOMES has {n}, which __all__ does not list" for n in sorted(set(homes) - set(listed))
    ]
    for n in listed:
        if n in eager:
            continue
        home = homes.get(n)
        if home is None:
            problems.append(f"{name}.{n}: listed in __all__, neither defined nor in _HOMES")
        elif f"{name}.{n}" in known_modules:
            problems.append(f"{name}.{n}: also a submodule, which shadows it once imported (rename it)")
        elif home not in known_modules:
            problems.append(f"{name}.{n}: its home {home} is no module")
        elif renamed.get(n, n) not in bindings(ast.parse(known_modules[home].read_text()).body):
            problems.append(f"{name}.{n}: {home} defines no {renamed.get(n, n)}")
        elif typed.get(n) != home:
            problems.append(f"{name}.{n}: the TYPE_CHECKING imports name {typed.get(n)}, _HOMES {home}")
    return problems


def test_every_name_a_face_lists_is_there() -> None:
    known_modules = modules()
    problems = [
        problem
        for name in faces(known_modules)
        for problem in face_problems(name, known_modules[name].read_text(), known_modules)
    ]
    assert not problems, "\n".join(problems)


def test_the_face_checks_see_deep_imports_unlisted_names_and_missing_homes() -> None:
    """The readers themselves, on made-up modules: a deep import inside a function, a name the
    face does not list (imported, or read through an alias) and a listed name nothing defines."""
    known_modules = {
        "engine": Path("engine/__init__.py"),
        "engine.data": Path("engine/data/__init__.py"),
        "engine.data.read": Path("engine/data/read.py"),
        "server.a": Path("server/a.py"),
    }
    source = (
        "from engine.data import read_records, secret\n"
        "from engine import data as d\n"
        "def f():\n    from engine.data.read import read_records\n    return d.read_records, d.hidden\n"
    )
    imports = imports_in(source, name="server.a", is_package=False, known_modules=known_modules)
    face_all = {"engine": set(), "engine.data": {"read_records"}}
    tree = ast.parse(source)
    bound = face_aliases(tree, importer="server.a", is_package=False, face_names=set(face_all))
    assert bound == {"d": "engine.data"}
    reads = [
        ("server.a", n.lineno, bound[n.value.id], n.attr)
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in bound
    ]
    assert face_offenders(imports, reads, face_all) == [
        "server.a (line 1) imports secret from engine.data, not in its __all__",
        "server.a (line 4) imports engine.data.read: below the package face "
        "(import read_records from engine.data)",
        "server.a (line 5) reads engine.data.hidden, not in its __all__",
    ]
    face = (
        '__all__ = ["gone", "read"]\n_HOMES = {"gone": "engine.data.nowhere", "read": "engine.data.read"}\n'
    )
    assert face_problems("engine.data", face, known_modules) == [
        "engine.data.gone: its home engine.data.nowhere is no module",
        "engine.data.read: also a submodule, which shadows it once imported (rename it)",
    ]
