"""Every public member of the installed vLLM's manager classes exists on kvblocks'
counterpart, or is in the table of deliberate exclusions in ``docs/vllm.md`` (with the
releases that have it, and its reason).

The members are enumerated from live objects (``dir()``, no leading underscore), so an
attribute set in ``__init__`` counts as much as a method. Whether each member means the
same is the lockstep machine's and the differential suite's job; this test makes sure
none is forgotten, and that the documented list stays true.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import harness
import pytest
import vllm
from kvblocks.vllm import KVCacheManager
from kvblocks.vllm._version_check import series
from kvblocks.vllm.manager import ManagerSurface
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
#: ``| `class` | `member` | 0.31-0.33 | why |`: the releases are one series or a range.
ROW = re.compile(r"^\| `(\w+)` \| `(\w+)` \| 0\.(\d+)(?:-0\.(\d+))? \| (.+) \|$")


def exclusions(installed: tuple[int, int] | None = None) -> dict[str, set[str]]:
    """The documented exclusions of the installed vLLM's series, by class."""
    found = installed or series(vllm.__version__)
    table: dict[str, set[str]] = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if (match := ROW.match(line)) and found is not None:
            first, last = int(match[3]), int(match[4] or match[3])
            if first <= found[1] <= last:
                table.setdefault(match[1], set()).add(match[2])
    return table


def public(obj: Any) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


def counterparts() -> dict[str, tuple[Any, Any]]:
    """vLLM's objects and kvblocks', by class name, from twin managers."""
    kwargs: dict[str, Any] = {
        "kv_cache_config": harness.build_kv_cache_config(16, 4),
        "max_model_len": 256,
        "scheduler_block_size": 4,
        "hash_block_size": 4,
        "log_stats": True,
        "enable_kv_cache_events": True,
    }
    theirs, ours = VllmKVCacheManager(**kwargs), KVCacheManager(**kwargs)
    return {
        "KVCacheManager": (theirs, ours),
        "KVCacheCoordinator": (theirs.coordinator, ours.coordinator),
        "BlockPool": (theirs.block_pool, ours.block_pool),
        "KVCacheBlocks": (theirs.empty_kv_cache_blocks, ours.empty_kv_cache_blocks),
    }


def undocumented(name: str) -> tuple[set[str], set[str], set[str]]:
    """vLLM's members kvblocks lacks without a reason; excluded members vLLM no longer
    has; excluded members kvblocks has after all."""
    theirs, ours = counterparts()[name]
    excluded = exclusions().get(name, set())
    return (
        public(theirs) - public(ours) - excluded,
        excluded - public(theirs),
        excluded & public(ours),
    )


CLASSES = ("KVCacheManager", "KVCacheCoordinator", "BlockPool", "KVCacheBlocks")


@pytest.mark.parametrize("name", CLASSES)
def test_every_public_member_is_there_or_documented(name: str) -> None:
    missing, stale, present = undocumented(name)
    assert not missing, (
        f"kvblocks' {name} lacks vLLM's {sorted(missing)} (add, or document why not)"
    )
    assert not stale, f"docs/vllm.md excludes {sorted(stale)}, which vLLM's {name} no longer has"
    assert not present, f"docs/vllm.md excludes {sorted(present)}, which kvblocks' {name} has"


def test_the_table_is_read() -> None:
    # A reformatted table must not make the test above vacuous.
    table = exclusions()
    assert sum(map(len, table.values())) >= 10, table
    assert set(table) <= set(CLASSES)
    # The releases column is read: a member of one release only is not another's.
    assert "get_replay_boundaries" in exclusions((0, 31))["KVCacheCoordinator"]
    assert "get_replay_boundaries" not in exclusions((0, 33))["KVCacheCoordinator"]


def test_a_missing_member_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # The checker catches what it checks: hide a member kvblocks has (in the surface
    # kvblocks' managers share).
    monkeypatch.delattr(ManagerSurface, "prefix_cache_lookup_enabled")
    assert undocumented("KVCacheManager")[0] == {"prefix_cache_lookup_enabled"}
