"""Finds import cycles between the modules of ``python/kvblocks``.

The graph is read from the source with ``ast``, nothing is imported. An edge is any import
of another kvblocks module: at the top, inside a function (lazy), under ``TYPE_CHECKING``,
or as ``importlib.import_module("kvblocks...")`` with a literal name. A lazy import only
hides a cycle from the interpreter, not from a reader, so it counts. ``from pkg import name``
is an edge to ``pkg.name`` when that is a module, else to ``pkg``. That a submodule's
import runs its parent package first is no edge: every import of a submodule does it.

Run ``python tools/import_cycles.py`` to print each cycle with the imports that close it,
and ``--check`` to also fail (exit 1) when there is one.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "python"
PACKAGE = "kvblocks"


@dataclass(frozen=True, slots=True)
class Edge:
    """One import of a kvblocks module by another, where it is written."""

    source: str
    target: str
    path: Path
    line: int


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name: sources, and stubs of native modules."""
    found: dict[str, Path] = {}
    root = SOURCE / PACKAGE
    # Sources last, so a module with both keeps its source: stubs hold type-only imports.
    for path in [*sorted(root.rglob("*.pyi")), *sorted(root.rglob("*.py"))]:
        parts = path.relative_to(SOURCE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imported_names(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """The dotted names one node imports: ``from pkg import name`` gives ``pkg.name``."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            # A relative import counts from the package: the module itself when it is one.
            package = module.split(".")
            package = package[: len(package) - node.level + (1 if is_package else 0)]
            base = ".".join([*package, base] if base else package)
        yield from (f"{base}.{alias.name}" for alias in node.names)
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "importlib"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        yield node.args[0].value


def _owner(name: str, known: dict[str, Path]) -> str:
    """The longest prefix of ``name`` that is a module (``""`` outside kvblocks)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def edges(known: dict[str, Path]) -> list[Edge]:
    """Every import from one kvblocks module of another, self-imports aside."""
    out: list[Edge] = []
    for module, path in known.items():
        if path.suffix == ".pyi":
            continue
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = _imported_names(node, module, is_package)
            targets = {_owner(name, known) for name in names} - {"", module}
            out += [Edge(module, t, path, getattr(node, "lineno", 0)) for t in sorted(targets)]
    return out


def cycles(graph: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    successors: dict[str, set[str]] = {}
    for edge in graph:
        successors.setdefault(edge.source, set()).add(edge.target)
        successors.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(successors[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component: list[str] = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(successors):
        if node not in index:
            visit(node)
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if there is a cycle")
    args = parser.parse_args(argv)
    known = modules()
    graph = edges(known)
    found = cycles(graph)
    for component in found:
        print("cycle: " + ", ".join(component))
        members = set(component)
        for edge in graph:
            if edge.source in members and edge.target in members:
                where = f"{edge.path.relative_to(REPO)}:{edge.line}"
                print(f"  {where}: {edge.source} imports {edge.target}")
    print(f"{len(known)} modules, {len(graph)} imports, {len(found)} cycles")
    return 1 if args.check and found else 0


if __name__ == "__main__":
    sys.exit(main())
