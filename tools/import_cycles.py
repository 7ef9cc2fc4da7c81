"""Finds import cycles between the modules of ``python/kvblocks`` and between the modules
of each Rust crate under ``rust/``.

The graph is read from the source with ``ast``, nothing is imported. An edge is any import
of another kvblocks module: at the top, inside a function (lazy), under ``TYPE_CHECKING``,
or as ``importlib.import_module("kvblocks...")`` with a literal name. A lazy import only
hides a cycle from the interpreter, not from a reader, so it counts. ``from pkg import name``
is an edge to ``pkg.name`` when that is a module, else to ``pkg``. That a submodule's
import runs its parent package first is no edge: every import of a submodule does it.

A Rust module's edges are the paths it names: ``crate::a::b`` anywhere in its code,
``super::a`` and, in a module with children, a path that starts with a child's name
(``pub use child::Item``). Each goes to the longest prefix that is a module of the crate.
A path between a module and its own ancestor is no edge: a folder's files and its
``mod.rs`` (which declares them, re-exports them and holds what they share) are one unit,
as a package and its submodules are. Test modules (``#[cfg(test)] mod``) are left out.

Run ``python tools/import_cycles.py`` to print each cycle with the imports that close it,
and ``--check`` to also fail (exit 1) when there is one.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "python"
PACKAGE = "kvblocks"
CRATES = REPO / "rust"


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


def rust_modules(src: Path) -> dict[str, Path]:
    """Every module of the crate whose sources are in ``src``, by ``crate::``-less path
    with ``::`` separators; the crate root is ``""``."""
    found: dict[str, Path] = {}
    for path in sorted(src.rglob("*.rs")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] in ("lib", "main", "mod"):
            parts.pop()
        found["::".join(parts)] = path
    return found


_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_USE = re.compile(r"\buse\s+([^;]+);")
_CRATE_PATH = re.compile(r"\b(crate|super)((?:::\w+)+)")


def _use_paths(tree: str) -> Iterator[str]:
    """The paths one ``use`` tree names, braces expanded and renames dropped:
    ``a::{b, c::d as e}`` gives ``a::b`` and ``a::c::d``."""
    tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+\w+", "", tree))
    depth, start, parts = 0, 0, []
    brace = tree.find("{")
    if brace < 0:
        yield tree
        return
    prefix, inner = tree[:brace], tree[brace + 1 : tree.rindex("}")]
    for i, char in enumerate(inner):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    parts.append(inner[start:])
    for part in filter(None, parts):
        yield from (prefix + p for p in _use_paths(part))


def _is_within(module: str, ancestor: str) -> bool:
    """Whether ``module`` is ``ancestor`` or inside it (the crate root holds all)."""
    return not ancestor or module == ancestor or module.startswith(ancestor + "::")


def rust_edges(crate: str, known: dict[str, Path]) -> list[Edge]:
    """Every path from one module of a crate to another, self-references aside."""
    out: list[Edge] = []
    for module, path in known.items():
        code = _COMMENT.sub("", path.read_text(encoding="utf-8"))
        code = re.split(r"#\[cfg\(test\)\]\s*mod\b", code)[0]
        parent = module.rpartition("::")[0]
        children = {m.rpartition("::")[2] for m in known if m.rpartition("::")[0] == module and m}
        named: list[tuple[str, int]] = []
        for match in _USE.finditer(code):
            line = code.count("\n", 0, match.start()) + 1
            for used in _use_paths(match.group(1)):
                head, _, rest = used.partition("::")
                base = {"crate": "", "super": parent, "self": module}.get(head)
                if base is not None:
                    named.append((f"{base}::{rest}".strip(":"), line))
                elif head in children:
                    named.append((f"{module}::{used}".strip(":"), line))
        for match in _CRATE_PATH.finditer(code):
            line = code.count("\n", 0, match.start()) + 1
            base = "" if match.group(1) == "crate" else parent
            named.append(((base + match.group(2)).strip(":"), line))
        targets: dict[str, int] = {}
        for name, line in named:
            target = name
            while target and target not in known:
                target = target.rpartition("::")[0]
            if not (_is_within(module, target) or _is_within(target, module)):
                targets.setdefault(target, line)
        out += [
            Edge(f"{crate}::{module}", f"{crate}::{t}", path, line)
            for t, line in sorted(targets.items())
        ]
    return out


def all_edges() -> tuple[int, list[Edge]]:
    """The number of modules and the import graph of the package and of every crate."""
    known = modules()
    graph = edges(known)
    count = len(known)
    for manifest in sorted(CRATES.glob("*/Cargo.toml")):
        crate = rust_modules(manifest.parent / "src")
        graph += rust_edges(manifest.parent.name, crate)
        count += len(crate)
    return count, graph


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
    count, graph = all_edges()
    found = cycles(graph)
    for component in found:
        print("cycle: " + ", ".join(component))
        members = set(component)
        for edge in graph:
            if edge.source in members and edge.target in members:
                where = f"{edge.path.relative_to(REPO)}:{edge.line}"
                print(f"  {where}: {edge.source} imports {edge.target}")
    print(f"{count} modules, {len(graph)} imports, {len(found)} cycles")
    return 1 if args.check and found else 0


if __name__ == "__main__":
    sys.exit(main())
