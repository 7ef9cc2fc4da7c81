"""What the tests share besides fixtures: stand-ins for vLLM's request and manager, ways
to compare what two backends did, and Hypothesis example counts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import settings
from kvblocks.errors import UnknownBlockError


def examples(ci: int) -> int:
    """A property test's own example count: ``ci`` under the "ci" profile, scaled with
    the loaded profile (a tenth under "dev", 20 times under "long"). A plain number on the
    test would override every profile."""
    return max(1, ci * settings().max_examples // settings.get_profile("ci").max_examples)


#: What a call did, comparable across backends: ``("ok", result)`` or
#: ``("error", class, message)``.
Outcome = tuple[Any, ...]


def outcome(call: Callable[[], Any]) -> Outcome:
    """``("ok", result)`` or ``("error", class, message)``: what a call did, comparably."""
    try:
        return ("ok", call())
    except Exception as exc:  # the point is to compare whatever is raised
        return ("error", type(exc), str(exc))


def block_tuple(pool: Any, block_id: int) -> tuple[Any, ...]:
    """Every field of ``pool.get_block(block_id)``, to compare blocks across backends."""
    b = pool.get_block(block_id)
    return (b.block_id, b.ref_cnt, b.block_hash, b.group_id, b.is_null)


@dataclass(slots=True)
class Req:
    """The duck-typed request the entry points read and write."""

    request_id: str
    num_computed_tokens: int


@dataclass(slots=True)
class FakeManager:
    """A KV cache manager stand-in: block tables, a block size, recorded evictions."""

    tables: dict[str, list[int]]
    block_size: int = 16
    num_kv_cache_groups: int = 1
    evict_calls: list[set[int]] = field(default_factory=list)
    num_blocks: int | None = None

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([list(self.tables.get(request_id, []))] * self.num_kv_cache_groups)

    def evict_blocks(self, block_ids: set[int]) -> None:
        if self.num_blocks is not None:
            for block_id in sorted(block_ids):
                if block_id >= self.num_blocks:
                    raise UnknownBlockError(
                        f"block id {block_id} is out of range for a pool of "
                        f"{self.num_blocks} blocks"
                    )
        self.evict_calls.append(set(block_ids))
