"""The source's layers, read from its own imports: every import points down, and none closes a circle.

Bottom to top: core <- config <- data | transforms <- parallel <- strategies | checkpoint | optimizers | models <-
planner <- observers <- engine <- launch <- tools | recipes <- cli and the package face. Folders of one rank (data
and transforms, ...) do not import each other.
Imports inside functions count (they run too); imports under `if TYPE_CHECKING:` do not (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
LAYERS = {
    "core": 0,
    "config": 1,
    "data": 2,
    "transforms": 2,
    "parallel": 3,
    "strategies": 4,
    "checkpoint": 4,
    "optimizers": 4,
    "models": 4,
    "planner": 5,
    "observers": 6,
    "engine": 7,
    "launch": 8,
    "tools": 9,
    "recipes": 9,
}
TOP = 10  # multigpu/__init__.py, __main__.py and cli.py


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in (SRC / "multigpu").rglob("*.py")}


def layer(module: str) -> tuple[int, str]:
    """(rank, folder) of a module: folders of equal rank (tools, recipes) may not import each other."""
    parts = module.split(".")
    if (len(parts) > 2 and parts[1] in LAYERS) or (len(parts) == 2 and parts[1] in LAYERS):
        return LAYERS[parts[1]], parts[1]
    return TOP, "top"


def is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports: `from a.b import c` names a.b.c when that is a module, else a.b."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in known else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {name for name in found if name in known}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def test_the_layers_are_the_folders() -> None:
    folders = {path.name for path in (SRC / "multigpu").iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert folders == set(LAYERS), "a new folder needs its place in LAYERS (and in docs/architecture.md)"
    loose = {path.name for path in (SRC / "multigpu").glob("*.py")}
    assert loose == {"__init__.py", "__main__.py", "cli.py"}, "every other module belongs to a layer's folder"


def test_every_import_points_down() -> None:
    upward = []
    for module, targets in graph().items():
        rank, folder = layer(module)
        for target in sorted(targets):
            target_rank, target_folder = layer(target)
            if target_rank > rank or (target_rank == rank < TOP and target_folder != folder):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)


def test_nothing_imports_the_cli() -> None:
    importers = [module for module, targets in graph().items() if "multigpu.cli" in targets]
    assert importers == ["multigpu.__main__"]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def test_no_import_closes_a_circle() -> None:
    assert circles(graph()) == []


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_the_circle_finder_finds_circles(edges: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert circles(edges) == expected


def test_an_upward_import_is_seen(tmp_path: Path) -> None:
    """The reader sees imports inside functions, and skips only TYPE_CHECKING blocks."""
    source = tmp_path / "sample.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from multigpu.cli import main\n"
        "def f():\n    from multigpu.tools import harness\n"
        "from multigpu.core import errors\n"
    )
    known = modules()
    assert imports(source, known) == {"multigpu.tools.harness", "multigpu.core.errors"}


def test_files_and_functions_are_short_enough_to_read() -> None:
    """No module over 450 lines and no function over 60: each reads in one sitting."""
    long = []
    for path in sorted((SRC / "multigpu").rglob("*.py")):
        source = path.read_text()
        if len(source.splitlines()) > 450:
            long.append(f"{path.relative_to(SRC)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1}")
    assert not long, "split these:\n" + "\n".join(long)
