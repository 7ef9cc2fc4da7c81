"""No two modules of ``python/kvblocks`` import each other, even lazily, and no two
modules of a Rust crate name each other.

``tools/import_cycles.py`` builds the import graph; run it to see where a cycle closes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from repo_tools import load_tool


def _tool() -> Any:
    return load_tool("import_cycles")


def test_a_cycle_is_found() -> None:
    """The checker sees a lazy import that closes a cycle (as ``kvblocks.bench`` had)."""
    tool = _tool()
    path = Path("x.py")
    graph = [
        tool.Edge("kvblocks.a", "kvblocks.b", path, 1),
        tool.Edge("kvblocks.b", "kvblocks.c", path, 2),
        tool.Edge("kvblocks.c", "kvblocks.a", path, 3),
        tool.Edge("kvblocks.c", "kvblocks.d", path, 4),
    ]
    assert tool.cycles(graph) == [["kvblocks.a", "kvblocks.b", "kvblocks.c"]]
    assert tool.cycles(graph[:2] + graph[3:]) == []


def test_a_rust_cycle_is_found(tmp_path: Path) -> None:
    """Siblings that name each other (as the binding's request and hashing files did)
    are a cycle, through a ``use`` tree or a path in code; a folder's files naming
    their ``mod.rs`` are none, and neither is a test module."""
    tool = _tool()
    files = {
        "lib.rs": "mod request;\nmod hashing;\nmod convert;\n",
        "request.rs": "use crate::{convert::to_list as list, hashing::{Hasher, plan}};\n",
        "hashing.rs": "fn call() { crate::request::Request::new(); }\n",
        "convert/mod.rs": "mod ints;\npub use ints::token_ids;\npub fn to_list() {}\n",
        "convert/ints.rs": "use super::to_list;\n#[cfg(test)]\nmod tests { use crate::request; }\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = tool.rust_edges("x", tool.rust_modules(tmp_path))
    assert tool.cycles(graph) == [["x::hashing", "x::request"]]
    assert {(e.source, e.target) for e in graph} == {
        ("x::request", "x::convert"),
        ("x::request", "x::hashing"),
        ("x::hashing", "x::request"),
    }


def test_no_import_cycle() -> None:
    module = _tool()
    count, graph = module.all_edges()
    assert any(e.source.startswith("kvblocks-py::") for e in graph), "no Rust module read"
    assert any(e.source.startswith("kvblocks.") for e in graph), "no Python module read"
    assert count > len(module.modules())
    assert module.cycles(graph) == [], "run `python tools/import_cycles.py` to see where"
