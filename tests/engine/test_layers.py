"""The engine's folders are its layers: the scheduling code at the bottom imports nothing else of
the engine, and no module of the engine imports, directly or through others, itself."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def module_name(path: Path) -> str:
    parts = path.relative_to(ENGINE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, *, top_level_only: bool) -> set[str]:
    """The engine modules ``path`` imports (``from engine.x import y`` counts ``engine.x`` and,
    when it is a module, ``engine.x.y``); with ``top_level_only`` only what runs at import, not
    what functions import when called or what only the type checker reads."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue  # type-checking imports never run
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("engine"))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engine"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            if top_level_only:
                if isinstance(node, ast.If | ast.Try):
                    visit([*node.body, *getattr(node, "orelse", [])])
            else:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child])

    visit(tree.body)
    return found


def graph(*, top_level_only: bool) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ENGINE.rglob("*.py")}
    return {
        name: {m for m in imports(path, top_level_only=top_level_only) if m in modules and m != name}
        for name, path in modules.items()
    }


def test_the_scheduling_layer_imports_nothing_else_of_the_engine() -> None:
    for name, deps in graph(top_level_only=False).items():
        if name.startswith("engine.scheduling"):
            outside = {d for d in deps if not d.startswith("engine.scheduling")}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_no_engine_module_imports_itself_through_others() -> None:
    edges = graph(top_level_only=True)
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(edges.get(name, ())):
            dep_module = dep if dep in edges else dep.rsplit(".", 1)[0]
            if state.get(dep_module) == 1:
                cycle = (
                    [*path[path.index(dep_module) :], dep_module]
                    if dep_module in path
                    else [name, dep_module]
                )
                raise AssertionError(" -> ".join(cycle))
            if dep_module not in state:
                walk(dep_module, [*path, dep_module])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            walk(name, [name])


def test_the_commands_share_their_helpers_instead_of_importing_each_other() -> None:
    edges = graph(top_level_only=False)
    assert "engine.commands.cli" not in edges["engine.commands.demo"]
    assert "engine.commands.cli" not in edges["engine.commands.chat"]
