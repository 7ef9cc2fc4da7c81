"""KVCacheManager: vLLM 0.33.0's verified scenarios for one full-attention group.

Requests are ``backend.Request`` objects hashed by ``backend.BlockHasher``, except where a
test shows that any duck-typed request works.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from kvblocks.errors import UnknownBlockError
from kvblocks.values import PrefixCacheStats


def new_manager(backend: ModuleType, num_blocks: int = 11, block_size: int = 16, **kw: Any) -> Any:
    return backend.KVCacheManager(num_blocks, block_size, **kw)


def new_request(backend: ModuleType, manager: Any, request_id: str, tokens: Sequence[int]) -> Any:
    hasher = backend.BlockHasher(manager.block_size, "sha256", "kvblocks-tests")
    return backend.Request(request_id, list(tokens), block_hasher=hasher)


def admit(manager: Any, request: Any) -> tuple[list[int], int, list[int] | None]:
    """The scheduler's admission: look up hits, allocate, mark the prompt computed."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits)
    if new is not None:
        request.num_computed_tokens = request.num_tokens
    return hits, num_hit_tokens, new


def decode(manager: Any, request: Any, tokens: Sequence[int]) -> list[int] | None:
    request.append_output_token_ids(list(tokens))
    new: list[int] | None = manager.allocate_slots(request, len(tokens))
    if new is not None:
        request.num_computed_tokens += len(tokens)
    return new


def table(manager: Any, request: Any) -> list[int]:
    ids: list[int] = manager.get_block_ids(request.request_id)[0]
    return ids


def ref_cnts(manager: Any, ids: Sequence[int]) -> list[int]:
    return [manager.block_pool.get_block(i).ref_cnt for i in ids]


def hashes(manager: Any, ids: Sequence[int]) -> list[bytes | None]:
    return [manager.block_pool.get_block(i).block_hash for i in ids]


def state(manager: Any, request_ids: Sequence[str] = ()) -> dict[str, Any]:
    """The manager's observable state: the pool's and the given requests' block tables."""
    pool = manager.block_pool
    blocks = [pool.get_block(i) for i in range(pool.num_blocks)]
    return {
        "free": pool.free_block_ids(),
        "blocks": [(b.block_id, b.ref_cnt, b.block_hash, b.group_id) for b in blocks],
        "tables": {rid: manager.get_block_ids(rid) for rid in request_ids},
        "usage": manager.usage,
    }


# --------------------------------------------------------------------------- construction


def test_attributes(backend: ModuleType) -> None:
    manager = new_manager(backend, 11, 16)
    assert manager.block_size == 16
    assert manager.num_kv_cache_groups == 1
    assert manager.enable_caching is True
    assert manager.block_pool.num_blocks == 11
    assert manager.block_pool.block_size == 16
    assert manager.block_pool.get_num_free_blocks() == 10
    assert manager.usage == 0.0
    assert manager.take_events() == []
    assert manager.make_prefix_cache_stats() is None
    off = new_manager(backend, 5, 4, enable_caching=False, max_model_len=64, log_stats=True)
    assert off.enable_caching is False
    assert off.block_pool.enable_caching is False
    assert off.make_prefix_cache_stats() is not None


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((0, 16), {}, "num_blocks must be positive, got 0"),
        ((4, 0), {}, "block_size must be positive, got 0"),
        ((4, -2), {}, "block_size must be positive, got -2"),
        ((4, 16), {"max_model_len": 0}, "max_model_len must be positive, got 0"),
    ],
)
def test_constructor_errors(
    backend: ModuleType, args: tuple[int, int], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        backend.KVCacheManager(*args, **kwargs)
    assert type(info.value) is ValueError
    assert str(info.value) == message


# --------------------------------------------------------------------------- vLLM scenarios


def test_prefill(backend: ModuleType) -> None:
    """vLLM's test_prefill: sharing, tail-first frees and the resulting allocation order."""
    manager = new_manager(backend)
    common = list(range(48))
    r0 = new_request(backend, manager, "r0", [*common, *range(100, 107)])  # 55 tokens
    assert admit(manager, r0) == ([], 0, [1, 2, 3, 4])
    assert table(manager, r0) == [1, 2, 3, 4]
    assert hashes(manager, [1, 2, 3]) == list(r0.block_hashes[:3])
    assert [manager.block_pool.get_block(i).group_id for i in (1, 2, 3)] == [0, 0, 0]
    assert hashes(manager, [4]) == [None]
    assert ref_cnts(manager, [1, 2, 3, 4]) == [1, 1, 1, 1]

    r1 = new_request(backend, manager, "r1", [*common, *range(200, 205)])  # 53 tokens
    assert admit(manager, r1) == ([1, 2, 3], 48, [5])
    assert table(manager, r1) == [1, 2, 3, 5]
    assert ref_cnts(manager, [1, 2, 3]) == [2, 2, 2]
    assert manager.block_pool.get_num_free_blocks() == 5

    manager.free(r0)
    assert manager.block_pool.free_block_ids() == [4, 6, 7, 8, 9, 10]
    manager.free(r1)
    assert manager.block_pool.free_block_ids() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert manager.get_block_ids("r0") == ([],)

    # r2 hits the three cached blocks, now free, and takes block 5 from the head.
    r2 = new_request(backend, manager, "r2", [*common, *range(300, 307)])
    assert admit(manager, r2) == ([1, 2, 3], 48, [5])
    assert manager.block_pool.get_num_free_blocks() == 6
    manager.free(r2)
    assert manager.block_pool.free_block_ids() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # A 160-token miss takes the whole queue in order, evicting the cached blocks.
    r3 = new_request(backend, manager, "r3", range(1000, 1160))
    assert admit(manager, r3) == ([], 0, [5, 4, 6, 7, 8, 9, 10, 3, 2, 1])
    assert hashes(manager, table(manager, r3)) == list(r3.block_hashes)
    manager.block_pool.check_invariants()


def test_decode(backend: ModuleType) -> None:
    """vLLM's test_decode: partial blocks stay unhashed until they fill."""
    manager = new_manager(backend)
    r0 = new_request(backend, manager, "r0", range(55))
    assert admit(manager, r0)[2] == [1, 2, 3, 4]
    # 4 more tokens fit the partial block: nothing allocated, block 4 still unhashed.
    assert decode(manager, r0, [8] * 4) == []
    assert table(manager, r0) == [1, 2, 3, 4]
    assert hashes(manager, [4]) == [None]
    # 19 more need a fifth block; block 4 is now full and gets hashed.
    assert decode(manager, r0, [9] * 19) == [5]
    assert table(manager, r0) == [1, 2, 3, 4, 5]
    assert hashes(manager, [4, 5]) == [r0.block_hashes[3], None]
    manager.block_pool.check_invariants()


def test_evict(backend: ModuleType) -> None:
    """vLLM's test_evict: free-queue orders, then a hit on [1, 2] takes block 6."""
    manager = new_manager(backend)
    r0 = new_request(backend, manager, "r0", range(87))
    assert admit(manager, r0)[2] == [1, 2, 3, 4, 5, 6]
    r1 = new_request(backend, manager, "r1", range(500, 548))
    assert admit(manager, r1)[2] == [7, 8, 9]
    manager.free(r0)
    assert manager.block_pool.free_block_ids() == [6, 10, 5, 4, 3, 2, 1]
    manager.free(r1)
    assert manager.block_pool.free_block_ids() == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
    r2 = new_request(backend, manager, "r2", [*range(32), *range(900, 903)])  # 35 tokens
    assert admit(manager, r2) == ([1, 2], 32, [6])
    assert manager.block_pool.get_num_free_blocks() == 7
    manager.block_pool.check_invariants()


def test_computed_blocks_not_evicted(backend: ModuleType) -> None:
    """Hits are touched before new blocks are taken, so a hit is never evicted for itself."""
    manager = new_manager(backend, num_blocks=3)
    r0 = new_request(backend, manager, "r0", range(16))
    assert admit(manager, r0)[2] == [1]
    r1 = new_request(backend, manager, "r1", range(100, 116))
    assert admit(manager, r1)[2] == [2]
    manager.free(r0)
    manager.free(r1)
    assert manager.block_pool.free_block_ids() == [1, 2]
    r2 = new_request(backend, manager, "r2", range(32))
    assert admit(manager, r2) == ([1], 16, [2])
    assert table(manager, r2) == [1, 2]
    assert hashes(manager, [1]) == [r0.block_hashes[0]]


def test_not_enough_free_blocks_leaves_hits_untouched(backend: ModuleType) -> None:
    manager = new_manager(backend, num_blocks=11)
    r0 = new_request(backend, manager, "r0", range(48))
    admit(manager, r0)
    manager.free(r0)  # blocks 1-3 cached and free
    hog = new_request(backend, manager, "hog", range(1000, 1000 + 16 * 5))
    assert admit(manager, hog)[2] == [4, 5, 6, 7, 8]
    # r1 hits 3 free cached blocks (touching them costs 3) and needs 3 more: 6 > 5 free.
    r1 = new_request(backend, manager, "r1", [*range(48), *range(2000, 2040)])
    hits, num_hit_tokens = manager.get_computed_blocks(r1)
    assert (hits, num_hit_tokens) == ([1, 2, 3], 48)
    before = state(manager, ["r0", "r1", "hog"])
    assert manager.allocate_slots(r1, r1.num_tokens - 48, 48, hits) is None
    assert state(manager, ["r0", "r1", "hog"]) == before
    assert ref_cnts(manager, [1, 2, 3]) == [0, 0, 0]
    assert manager.get_block_ids("r1") == ([],)
    # With one block less to allocate it fits exactly.
    assert manager.allocate_slots(r1, r1.num_tokens - 48 - 16, 48, hits) == [9, 10]
    assert ref_cnts(manager, [1, 2, 3]) == [1, 1, 1]
    assert manager.block_pool.get_num_free_blocks() == 0
    manager.block_pool.check_invariants()


def test_last_token_is_always_recomputed(backend: ModuleType) -> None:
    manager = new_manager(backend, num_blocks=20)
    r0 = new_request(backend, manager, "r0", range(32))
    admit(manager, r0)
    # The same 32-token prompt only hits 16 tokens: the last block is recomputed.
    same = new_request(backend, manager, "same", range(32))
    assert manager.get_computed_blocks(same) == ([1], 16)
    longer = new_request(backend, manager, "longer", range(33))
    assert manager.get_computed_blocks(longer) == ([1, 2], 32)
    one = new_request(backend, manager, "one", range(1))
    assert manager.get_computed_blocks(one) == ([], 0)
    # Looking up touches nothing.
    assert ref_cnts(manager, [1, 2]) == [1, 1]


def test_chain_stops_at_first_miss(backend: ModuleType) -> None:
    manager = new_manager(backend, num_blocks=20, block_size=4)
    r0 = new_request(backend, manager, "r0", range(12))
    admit(manager, r0)
    manager.evict_blocks([2])
    # Block 3 is still cached, but block 2 misses and the chain stops there.
    r1 = new_request(backend, manager, "r1", range(16))
    assert manager.get_computed_blocks(r1) == ([1], 4)


def test_external_computed_tokens_async(backend: ModuleType) -> None:
    """An async KV load: blocks for the external tokens, nothing cached until it lands."""
    manager = new_manager(backend)
    r0 = new_request(backend, manager, "r0", range(40))
    new = manager.allocate_slots(
        r0, 0, 0, None, num_external_computed_tokens=32, delay_cache_blocks=True
    )
    assert new == []
    assert table(manager, r0) == [1, 2]
    assert hashes(manager, [1, 2]) == [None, None]
    # The load landed: the scheduler sets the computed tokens and schedules the rest.
    r0.num_computed_tokens = 32
    assert manager.allocate_slots(r0, 8) == [3]
    assert table(manager, r0) == [1, 2, 3]
    assert hashes(manager, [1, 2, 3]) == [*r0.block_hashes[:2], None]


def test_external_computed_tokens_sync_after_hits(backend: ModuleType) -> None:
    manager = new_manager(backend, num_blocks=20)
    r0 = new_request(backend, manager, "r0", range(32))
    admit(manager, r0)
    r1 = new_request(backend, manager, "r1", range(72))
    hits, num_hit_tokens = manager.get_computed_blocks(r1)
    assert (hits, num_hit_tokens) == ([1, 2], 32)
    # 32 local hits, 16 external tokens, 24 new: only the new blocks are returned.
    new = manager.allocate_slots(r1, 24, 32, hits, num_external_computed_tokens=16)
    assert new == [4, 5]
    assert table(manager, r1) == [1, 2, 3, 4, 5]
    # Synchronous: everything full up to 32 + 16 + 24 tokens is cached at once.
    assert hashes(manager, [1, 2, 3, 4]) == list(r1.block_hashes[:4])
    assert hashes(manager, [5]) == [None]
    assert ref_cnts(manager, [1, 2, 3]) == [2, 2, 1]


def test_lookahead_and_max_model_len(backend: ModuleType) -> None:
    manager = new_manager(backend, num_blocks=20)
    r0 = new_request(backend, manager, "r0", range(16))
    assert manager.allocate_slots(r0, 16, num_lookahead_tokens=3) == [1, 2]
    # Only the verified tokens are cached: one full block.
    assert hashes(manager, [1, 2]) == [r0.block_hashes[0], None]
    capped = new_manager(backend, num_blocks=20, max_model_len=20)
    r1 = new_request(backend, capped, "r1", range(16))
    assert capped.allocate_slots(r1, 16, num_lookahead_tokens=40) == [1, 2]


def test_request_longer_than_max_model_len(backend: ModuleType) -> None:
    """Slots stop at max_model_len; caching stops at the table's end instead of failing."""
    manager = new_manager(backend, num_blocks=20, block_size=4, max_model_len=8)
    r0 = new_request(backend, manager, "r0", range(12))
    assert manager.allocate_slots(r0, 12) == [1, 2]
    assert hashes(manager, [1, 2]) == list(r0.block_hashes[:2])
    r0.num_computed_tokens = 12
    assert decode(manager, r0, [1]) == []
    assert table(manager, r0) == [1, 2]
    manager.block_pool.check_invariants()


def test_delay_cache_blocks_then_cache_blocks(backend: ModuleType) -> None:
    manager = new_manager(backend, num_blocks=20)
    r0 = new_request(backend, manager, "r0", range(40))
    assert manager.allocate_slots(r0, 40, delay_cache_blocks=True) == [1, 2, 3]
    assert hashes(manager, [1, 2, 3]) == [None, None, None]
    probe = new_request(backend, manager, "probe", range(40))
    assert manager.get_computed_blocks(probe) == ([], 0)
    manager.cache_blocks(r0, 16)
    assert hashes(manager, [1, 2]) == [r0.block_hashes[0], None]
    manager.cache_blocks(r0, 40)
    assert hashes(manager, [1, 2, 3]) == [*r0.block_hashes[:2], None]
    assert manager.get_computed_blocks(probe) == ([1, 2], 32)
    # Caching again, or fewer tokens, changes nothing.
    before = state(manager, ["r0"])
    manager.cache_blocks(r0, 40)
    manager.cache_blocks(r0, 0)
    assert state(manager, ["r0"]) == before


def test_free_unknown_request_is_a_no_op(backend: ModuleType) -> None:
    manager = new_manager(backend)
    r0 = new_request(backend, manager, "r0", range(20))
    admit(manager, r0)
    ghost = new_request(backend, manager, "ghost", range(20))
    before = state(manager, ["r0", "ghost"])
    manager.free(ghost)
    assert state(manager, ["r0", "ghost"]) == before
    manager.free(r0)
    manager.free(r0)
    assert manager.block_pool.get_num_free_blocks() == 10
    assert manager.get_block_ids("r0") == ([],)


def test_caching_disabled(backend: ModuleType) -> None:
    """vLLM's test_basic_prefix_caching_disabled: no hits, and a full pool says None."""
    manager = new_manager(backend, num_blocks=5, block_size=4, enable_caching=False)
    r0 = new_request(backend, manager, "r0", range(10))
    assert admit(manager, r0) == ([], 0, [1, 2, 3])
    assert hashes(manager, [1, 2, 3]) == [None, None, None]
    manager.free(r0)
    r1 = new_request(backend, manager, "r1", range(10))
    assert admit(manager, r1) == ([], 0, [3, 2, 1])
    r2 = new_request(backend, manager, "r2", range(8))
    before = state(manager, ["r1", "r2"])
    assert admit(manager, r2)[2] is None
    assert state(manager, ["r1", "r2"]) == before
    manager.cache_blocks(r1, 10)
    assert hashes(manager, [1, 2, 3]) == [None, None, None]


def test_reset_prefix_cache_and_usage(backend: ModuleType) -> None:
    manager = new_manager(backend)
    r0 = new_request(backend, manager, "r0", range(50))
    admit(manager, r0)
    assert manager.usage == pytest.approx(0.4)
    assert manager.reset_prefix_cache() is False
    manager.free(r0)
    assert manager.usage == 0.0
    assert manager.reset_prefix_cache() is True
    assert hashes(manager, range(11)) == [None] * 11
    again = new_request(backend, manager, "again", range(50))
    assert manager.get_computed_blocks(again) == ([], 0)


def test_evict_blocks_pass_through(backend: ModuleType) -> None:
    manager = new_manager(backend)
    r0 = new_request(backend, manager, "r0", range(48))
    admit(manager, r0)
    manager.evict_blocks({1, 3})
    assert hashes(manager, [1, 2, 3]) == [None, r0.block_hashes[1], None]
    with pytest.raises(UnknownBlockError):
        manager.evict_blocks([11])


def test_numpy_hits(backend: ModuleType) -> None:
    manager = new_manager(backend)
    r0 = new_request(backend, manager, "r0", range(48))
    admit(manager, r0)
    r1 = new_request(backend, manager, "r1", range(40))
    hits, n = manager.get_computed_blocks(r1)
    new = manager.allocate_slots(r1, np.int64(40 - n), np.int64(n), np.array(hits))
    assert new == [4]
    assert table(manager, r1) == [1, 2, 4]


@dataclass
class DuckRequest:
    """The four attributes the manager reads; any object with them works."""

    request_id: str
    num_tokens: int
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0


def test_duck_typed_requests(backend: ModuleType) -> None:
    manager = new_manager(backend, block_size=4)
    a = DuckRequest("a", 9, [b"h0", b"h1"])
    assert manager.allocate_slots(a, 9) == [1, 2, 3]
    assert hashes(manager, [1, 2, 3]) == [b"h0", b"h1", None]
    b = DuckRequest("b", 12, [b"h0", b"h1", b"zz"])
    assert manager.get_computed_blocks(b) == ([1, 2], 8)
    assert manager.allocate_slots(b, 4, 8, [1, 2]) == [4]
    assert hashes(manager, [4]) == [b"zz"]


# --------------------------------------------------------------------------- errors


def check_refused(
    manager: Any,
    call: Callable[[], object],
    exc_type: type[BaseException],
    message: str,
    request_ids: Sequence[str] = (),
) -> None:
    before = state(manager, request_ids)
    with pytest.raises(exc_type) as info:
        call()
    assert type(info.value) is exc_type
    assert str(info.value) == message
    assert state(manager, request_ids) == before
    manager.block_pool.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_new_tokens": -1}, "num_new_tokens must be non-negative, got -1"),
        ({"num_new_computed_tokens": -16}, "num_new_computed_tokens must be non-negative, got -16"),
        ({"num_lookahead_tokens": -2}, "num_lookahead_tokens must be non-negative, got -2"),
        (
            {"num_external_computed_tokens": -3},
            "num_external_computed_tokens must be non-negative, got -3",
        ),
        (
            {"num_new_tokens": 0},
            "num_new_tokens must be greater than 0 when there are no computed tokens to adopt",
        ),
    ],
)
def test_allocate_slots_argument_errors(
    backend: ModuleType, kwargs: dict[str, int], message: str
) -> None:
    manager = new_manager(backend)
    r0 = new_request(backend, manager, "r0", range(20))
    admit(manager, r0)
    r1 = new_request(backend, manager, "r1", range(20))
    args: dict[str, Any] = {"num_new_tokens": 4, **kwargs}
    check_refused(
        manager, lambda: manager.allocate_slots(r1, **args), ValueError, message, ["r0", "r1"]
    )


def test_allocate_slots_adoption_errors(backend: ModuleType) -> None:
    manager = new_manager(backend)
    r0 = new_request(backend, manager, "r0", range(40))
    admit(manager, r0)
    ids = ["r0", "r1", "r2"]
    # A running request cannot adopt hits any more.
    check_refused(
        manager,
        lambda: manager.allocate_slots(r0, 4, 16, [1]),
        ValueError,
        "request r0 already holds blocks, so it cannot adopt computed tokens",
        ids,
    )
    # Nor can a request that holds blocks but has none cached yet.
    r1 = new_request(backend, manager, "r1", range(100, 105))
    assert admit(manager, r1)[2] == [4]
    check_refused(
        manager,
        lambda: manager.allocate_slots(r1, 4, 16, [1]),
        ValueError,
        "request r1 already holds blocks, so it cannot adopt computed tokens",
        ids,
    )
    check_refused(
        manager,
        lambda: manager.allocate_slots(r1, 4, num_external_computed_tokens=16),
        ValueError,
        "request r1 already holds blocks, so it cannot adopt computed tokens",
        ids,
    )
    r2 = new_request(backend, manager, "r2", range(40))
    check_refused(
        manager,
        lambda: manager.allocate_slots(r2, 24, 16, [11]),
        UnknownBlockError,
        "block id 11 is out of range for a pool of 11 blocks",
        ids,
    )
    check_refused(
        manager,
        lambda: manager.allocate_slots(r2, 24, 16, [0]),
        ValueError,
        "new_computed_blocks must not contain the null block 0",
        ids,
    )
    check_refused(
        manager,
        lambda: manager.allocate_slots(r2, 24, 16, [1.0]),
        TypeError,
        "'float' object cannot be interpreted as an integer",
        ids,
    )


def test_hits_with_caching_disabled_are_refused(backend: ModuleType) -> None:
    manager = new_manager(backend, enable_caching=False)
    r0 = new_request(backend, manager, "r0", range(40))
    admit(manager, r0)
    r1 = new_request(backend, manager, "r1", range(40))
    check_refused(
        manager,
        lambda: manager.allocate_slots(r1, 24, 16, [1]),
        ValueError,
        "new_computed_blocks must be empty when prefix caching is disabled",
        ["r0", "r1"],
    )


def test_cache_blocks_errors(backend: ModuleType) -> None:
    manager = new_manager(backend)
    r0 = new_request(backend, manager, "r0", range(20))
    admit(manager, r0)
    check_refused(
        manager,
        lambda: manager.cache_blocks(r0, -1),
        ValueError,
        "num_computed_tokens must be non-negative, got -1",
        ["r0"],
    )
    # More full blocks than the request holds.
    ghost = new_request(backend, manager, "ghost", range(40))
    check_refused(
        manager,
        lambda: manager.cache_blocks(ghost, 32),
        ValueError,
        "num_full_blocks 2 exceeds the 0 block ids given",
        ["r0", "ghost"],
    )


# --------------------------------------------------------------------------- stats


def test_prefix_cache_stats(backend: ModuleType) -> None:
    manager = new_manager(backend, log_stats=True)
    r0 = new_request(backend, manager, "r0", range(40))
    _, hits, _ = admit(manager, r0)
    manager.record_prefix_cache_stats(r0, hits)
    r1 = new_request(backend, manager, "r1", range(40))
    _, hits, _ = admit(manager, r1)
    manager.record_prefix_cache_stats(r1, hits)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 80, 32)
    fresh = manager.make_prefix_cache_stats()
    assert (fresh.requests, fresh.queries, fresh.hits) == (0, 0, 0)


def test_prefix_cache_stats_cannot_go_negative(backend: ModuleType) -> None:
    manager = new_manager(backend, log_stats=True)
    r0 = new_request(backend, manager, "r0", range(40))
    manager.record_prefix_cache_stats(r0, 16)
    for bad, message in [
        (-1, "num_hits must be non-negative, got -1"),
        (41, "num_hits 41 exceeds the request's 40 tokens"),
    ]:
        with pytest.raises(ValueError) as info:
            manager.record_prefix_cache_stats(r0, bad)
        assert type(info.value) is ValueError
        assert str(info.value) == message
    with pytest.raises(TypeError):
        manager.record_prefix_cache_stats(r0, 1.5)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 40, 16)
    manager.record_prefix_cache_stats(r0, 40)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 40, 40)


def test_prefix_cache_stats_disabled(backend: ModuleType) -> None:
    manager = new_manager(backend)
    r0 = new_request(backend, manager, "r0", range(40))
    manager.record_prefix_cache_stats(r0, 16)
    assert manager.make_prefix_cache_stats() is None
    with pytest.raises(ValueError, match="num_hits must be non-negative, got -1"):
        manager.record_prefix_cache_stats(r0, -1)


def test_reference_stats_is_a_slotted_dataclass() -> None:
    stats = PrefixCacheStats()
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
    assert not hasattr(stats, "__dict__")


def test_lookup_reads_no_hash_past_the_first_miss(backend: ModuleType) -> None:
    # vLLM never reads a hash after the first miss, so a bad one there is not an error.
    manager = backend.KVCacheManager(16, 4)
    request = DuckRequest("r", 40, [b"miss", 123, b"x" * 33])  # type: ignore[list-item]
    assert manager.get_computed_blocks(request) == ([], 0)


def test_hit_ids_are_range_checked_before_the_null_check(backend: ModuleType) -> None:
    manager = backend.KVCacheManager(16, 4)
    request = DuckRequest("r", 9, [b"a", b"b"])
    with pytest.raises(UnknownBlockError, match=r"^block id 99 is out of range"):
        manager.allocate_slots(request, 1, 8, [0, 99])
    assert manager.block_pool.get_num_free_blocks() == 15


def test_request_code_reaching_back_into_the_pool_is_refused(backend: ModuleType) -> None:
    """A request whose ``block_hashes`` calls into the pool during a manager call.

    The manager is mid-call: both backends refuse with a ``RuntimeError`` (never a Rust
    panic), and the refused call leaves the state as it was.
    """
    manager = backend.KVCacheManager(8, 4)
    pool = manager.block_pool

    class ReentrantHashes(list[bytes]):
        def __getitem__(self, index: Any) -> Any:
            pool.get_num_free_blocks()
            return list.__getitem__(self, index)

    request = DuckRequest("r", 9, ReentrantHashes([b"a" * 32, b"b" * 32]))
    with pytest.raises(RuntimeError, match=r"^Already mutably borrowed$"):
        manager.allocate_slots(request, 9)
    assert pool.get_num_free_blocks() == 7
    assert manager.get_block_ids("r") == ([],)
    pool.check_invariants()


def test_request_code_reading_the_managers_pool_is_refused(backend: ModuleType) -> None:
    """``block_pool`` is read from the manager, so it is refused mid-call like any read."""
    manager = backend.KVCacheManager(8, 4)

    class ReentrantHashes(list[bytes]):
        def __getitem__(self, index: Any) -> Any:
            _ = manager.block_pool
            return list.__getitem__(self, index)

    request = DuckRequest("r", 9, ReentrantHashes([b"a" * 32, b"b" * 32]))
    with pytest.raises(RuntimeError, match=r"^Already mutably borrowed$"):
        manager.allocate_slots(request, 9)
    assert manager.get_block_ids("r") == ([],)


def test_reading_again_during_a_read_is_allowed(backend: ModuleType) -> None:
    pool = backend.BlockPool(8, block_size=4)
    reads = []

    def hashes() -> Iterator[bytes]:
        reads.append(pool.get_num_free_blocks())
        yield b"a" * 32

    assert pool.find_longest_cache_hit(hashes()) == []
    assert reads == [7]


def test_prefix_cache_stats_record_a_reset(backend: ModuleType) -> None:
    manager = backend.KVCacheManager(8, 4, log_stats=True)
    assert manager.make_prefix_cache_stats().reset is False
    request = DuckRequest("r", 5, [b"a"])
    manager.record_prefix_cache_stats(request, 4)
    assert manager.reset_prefix_cache() is True
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits, stats.reset) == (1, 5, 4, True)
    assert manager.make_prefix_cache_stats().reset is False


def test_block_pool_is_one_object_and_collectable(backend: ModuleType) -> None:
    """``manager.block_pool`` is the same object on every access, and a manager whose
    pool was used is freed once unreachable (natively the view and its manager refer to
    each other, a cycle the garbage collector must see)."""

    def managers() -> list[Any]:
        return [obj for obj in gc.get_objects() if isinstance(obj, backend.KVCacheManager)]

    gc.collect()
    before = len(managers())
    manager = backend.KVCacheManager(8, 16)
    pool = manager.block_pool
    assert pool is manager.block_pool
    assert len(managers()) == before + 1, "the collector does not track managers"
    del manager, pool
    gc.collect()
    assert len(managers()) == before


def test_hashes_to_cache_are_type_checked_before_length_checked(backend: ModuleType) -> None:
    """As the pool's ``cache_full_blocks``: a wrong type anywhere wins over a long hash."""
    manager = backend.KVCacheManager(8, 4)
    request = SimpleNamespace(
        request_id="q", num_tokens=8, num_computed_tokens=0, block_hashes=[b"x" * 40, "y"]
    )
    with pytest.raises(TypeError, match=r"^block hash must be bytes, got str$"):
        manager.allocate_slots(request, 8)
    assert manager.block_pool.get_num_free_blocks() == 7


def test_prefix_cache_stats_is_a_hashable_value(backend: ModuleType) -> None:
    stats = backend.PrefixCacheStats(1, 2, 3)
    assert stats == backend.PrefixCacheStats(1, 2, 3)
    assert len({stats, backend.PrefixCacheStats(1, 2, 3)}) == 1
    assert stats.__eq__((1, 2, 3)) is NotImplemented
