"""No two modules of ``python/kvblocks`` import each other, even lazily.

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


def test_no_import_cycle() -> None:
    module = _tool()
    graph = module.edges(module.modules())
    assert graph, "no import found: the tool reads the wrong directory"
    assert module.cycles(graph) == [], "run `python tools/import_cycles.py` to see where"
