"""One test suite, two backends: every test that takes ``backend`` runs on both."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from kvblocks import BACKEND_MODULES, load_backend
from kvblocks.errors import UnknownBlockError

GOLDEN_DIR = Path(__file__).parent / "golden"

# Hypothesis profiles. "ci" (the default) is reproducible: derandomized, no example
# database, so every run tries the same examples; it bounds tests/test_fuzz.py to about
# a minute. "long" (``pytest --hypothesis-profile=long``) tries 20 times as many random
# examples and keeps the failures it finds in the database. Neither has a deadline: the
# fuzzer's calls run in a child process, whose start-up time would count.
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    max_examples=2000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(params=sorted(BACKEND_MODULES), ids=lambda name: f"backend={name}")
def backend(request: pytest.FixtureRequest) -> ModuleType:
    """The backend module under test: ``kvblocks.reference`` or ``kvblocks._native``."""
    return load_backend(request.param)


def load_golden(name: str) -> list[dict[str, Any]]:
    """All cases of ``tests/golden/<name>.jsonl``, in file order."""
    path = GOLDEN_DIR / f"{name}.jsonl"
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def golden_params(name: str) -> list[Any]:
    """``pytest.param`` per golden case, with an id naming file and line."""
    return [pytest.param(case, id=f"{name}:{i + 1}") for i, case in enumerate(load_golden(name))]


#: What a call did, comparable across backends: ``("ok", result)`` or
#: ``("error", class, message)``.
Outcome = tuple[Any, ...]


def outcome(call: Callable[[], Any]) -> Outcome:
    """``("ok", result)`` or ``("error", class, message)``: what a call did, comparably."""
    try:
        return ("ok", call())
    except Exception as exc:  # the point is to compare whatever is raised
        return ("error", type(exc), str(exc))


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


def block_tuple(pool: Any, block_id: int) -> tuple[Any, ...]:
    """Every field of ``pool.get_block(block_id)``, to compare blocks across backends."""
    b = pool.get_block(block_id)
    return (b.block_id, b.ref_cnt, b.block_hash, b.group_id, b.is_null)
