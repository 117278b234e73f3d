"""The package's modules import each other without cycles.

Every module under ``src/resilient_callbacks`` is parsed (not imported); its module-level
imports of the package (relative ``from . import x``, ``from .x import y``, ``from .. import``,
and absolute ``resilient_callbacks.x``) make the edges of a graph, and a cycle fails the test
naming it. Imports under ``if TYPE_CHECKING:`` and inside functions are not edges: they do not
run when the module is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = "resilient_callbacks"
ROOT = Path(__file__).resolve().parent.parent / "src" / PKG


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: at module level, also inside module-level
    ``try``/``if`` blocks (except ``if TYPE_CHECKING:``)."""
    out: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out.append(node)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return out


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        for node in _top_level_imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _resolve(name, is_pkg, node)
                # `from . import x` imports the submodule x when there is one
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            for t in targets:
                while t and t not in modules:  # `import a.b.c` imports a.b.c's module
                    t = t.rpartition(".")[0]
                if t.startswith(PKG) and t != name:
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as a list of modules (first == last), or None."""
    white, grey, black = 0, 1, 2
    color = dict.fromkeys(graph, white)
    stack: list[str] = []

    def dfs(n: str) -> list[str] | None:
        color[n] = grey
        stack.append(n)
        for m in sorted(graph[n]):
            if color[m] == grey:
                return [*stack[stack.index(m) :], m]
            if color[m] == white:
                found = dfs(m)
                if found:
                    return found
        stack.pop()
        color[n] = black
        return None

    for n in sorted(graph):
        if color[n] == white:
            found = dfs(n)
            if found:
                return found
    return None


def test_the_graph_sees_the_core_modules():
    graph = import_graph()
    assert f"{PKG}.checkpointer" in graph
    assert f"{PKG}.persisting" in graph[f"{PKG}.saving"]
    assert f"{PKG}.session" in graph[f"{PKG}.persisting"]
    assert f"{PKG}.directory" in graph[f"{PKG}.checkpointer"]


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_the_package_root():
    """The root imports the core; a module importing the root back, even inside a function, is
    a cycle waiting to happen (manifest.versions() once did, for __version__: it is in
    _version now)."""
    modules = _modules()
    offenders = []
    for name, path in modules.items():
        if name == PKG:
            continue
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and _resolve(name, is_pkg, node) == PKG:
                offenders += [
                    f"{name}: from {PKG} import {a.name}"
                    for a in node.names
                    if f"{PKG}.{a.name}" not in modules
                ]
    assert not offenders, offenders
