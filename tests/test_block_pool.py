"""BlockPool: vLLM 0.33.0's scenarios, every error of the catalogue, inputs and snapshots.

Every error test snapshots the whole observable state before the call and compares it
after, to prove that a call that raises changed nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from kvblocks.errors import (
    BlockStateError,
    InvariantError,
    KVBlocksError,
    NoFreeBlocksError,
    UnknownBlockError,
)
from kvblocks.reference import block_pool as reference_block_pool
from kvblocks.values import KVCacheBlock

H0, H1, H2, H3 = (bytes([i]) * 32 for i in range(1, 5))
SHORT = b"\xab" * 16  # an xxh3-128-sized hash


def hashes_of(pool: Any) -> set[tuple[bytes, int]]:
    """Every (hash, group) some block of ``pool`` holds."""
    keys = set()
    for block_id in range(pool.num_blocks):
        block = pool.get_block(block_id)
        if block.block_hash is not None:
            keys.add((block.block_hash, block.group_id))
    return keys


def state(pool: Any, probe: Iterable[tuple[bytes, int]] = ()) -> dict[str, Any]:
    """The pool's whole observable state, including which block each cached key resolves to."""
    blocks = [pool.get_block(i) for i in range(pool.num_blocks)]
    keys = hashes_of(pool) | set(probe)
    return {
        "free": pool.free_block_ids(),
        "num_free": pool.get_num_free_blocks(),
        "usage": pool.get_usage(),
        "blocks": [(b.block_id, b.ref_cnt, b.block_hash, b.group_id, b.is_null) for b in blocks],
        "lookups": {key: pool.get_cached_block(key[0], [key[1]]) for key in sorted(keys)},
    }


def busy_pool(backend: ModuleType) -> Any:
    """An 11-block pool with blocks in use, cached in use, cached free and plain free.

    Blocks 1-3 hold H0-H2 (1 and 2 in use, 3 free and cached), block 4 is in use and
    unhashed, block 5 holds H0 too (a duplicate, in use), blocks 6-10 are plain free.
    """
    pool = backend.BlockPool(11)
    assert pool.get_new_blocks(5) == [1, 2, 3, 4, 5]
    pool.cache_full_blocks([1, 2, 3, 4], [H0, H1, H2], 0, 3)
    pool.cache_full_blocks([5], [H0], 0, 1)
    pool.free_blocks([3])
    pool.check_invariants()
    assert pool.free_block_ids() == [6, 7, 8, 9, 10, 3]
    return pool


def assert_refused(
    pool: Any,
    call: Callable[[], object],
    exc_type: type[BaseException],
    message: str,
) -> None:
    """``call`` raises exactly ``exc_type(message)`` and leaves ``pool`` as it was."""
    probe = {(H0, 0), (H1, 0), (H2, 0), (H3, 0), (H0, 1)}
    before = state(pool, probe)
    with pytest.raises(exc_type) as info:
        call()
    assert type(info.value) is exc_type
    assert str(info.value) == message
    assert state(pool, probe) == before
    pool.check_invariants()


# --------------------------------------------------------------------------- basics


def test_new_pool(backend: ModuleType) -> None:
    pool = backend.BlockPool(11)
    assert pool.num_blocks == 11
    assert pool.enable_caching is True
    assert pool.block_size == 16
    assert pool.get_num_free_blocks() == 10
    assert pool.free_block_ids() == list(range(1, 11))
    assert pool.get_usage() == 0.0
    null = pool.get_block(0)
    assert (null.block_id, null.ref_cnt, null.block_hash, null.group_id, null.is_null) == (
        0,
        0,
        None,
        None,
        True,
    )
    assert not pool.get_block(1).is_null
    pool.check_invariants()


def test_constructor_options(backend: ModuleType) -> None:
    pool = backend.BlockPool(4, False, block_size=8)
    assert (pool.num_blocks, pool.enable_caching, pool.block_size) == (4, False, 8)
    pool = backend.BlockPool(num_blocks=3, enable_caching=True, block_size=1)
    assert (pool.num_blocks, pool.enable_caching, pool.block_size) == (3, True, 1)


def test_pool_of_only_the_null_block(backend: ModuleType) -> None:
    pool = backend.BlockPool(1)
    assert pool.get_num_free_blocks() == 0
    assert pool.get_usage() == 0.0
    assert pool.free_block_ids() == []
    assert pool.get_new_blocks(0) == []
    assert pool.reset_prefix_cache() is True
    assert_refused(
        pool,
        lambda: pool.get_new_blocks(1),
        NoFreeBlocksError,
        "Cannot get 1 free blocks from the pool (0 free)",
    )


def test_usage(backend: ModuleType) -> None:
    pool = backend.BlockPool(11)
    pool.get_new_blocks(5)
    assert pool.get_usage() == 0.5
    pool.get_new_blocks(5)
    assert pool.get_usage() == 1.0


def test_get_new_blocks_sets_ref_one(backend: ModuleType) -> None:
    pool = backend.BlockPool(6)
    assert pool.get_new_blocks(2) == [1, 2]
    assert [pool.get_block(i).ref_cnt for i in range(6)] == [0, 1, 1, 0, 0, 0]
    assert pool.get_new_blocks(0) == []
    assert pool.free_block_ids() == [3, 4, 5]


# --------------------------------------------------------------------------- vLLM scenarios


def test_prefill_free_order(backend: ModuleType) -> None:
    """vLLM's test_prefill at pool level: the free queue is ``[5,4,6,...,10,3,2,1]``."""
    pool = backend.BlockPool(11)
    r0 = pool.get_new_blocks(4)  # 55 tokens: three full blocks and a partial one
    assert r0 == [1, 2, 3, 4]
    pool.cache_full_blocks(r0, [H0, H1, H2], 0, 3)
    # r1 (53 tokens) hits r0's three full blocks and needs one block of its own.
    hits = [pool.get_cached_block(h) for h in (H0, H1, H2)]
    assert hits == [[1], [2], [3]]
    pool.touch([1, 2, 3])
    r1 = [1, 2, 3, *pool.get_new_blocks(1)]
    assert r1 == [1, 2, 3, 5]
    assert [pool.get_block(i).ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    assert pool.get_num_free_blocks() == 5

    pool.free_blocks(reversed(r0))
    assert pool.free_block_ids() == [4, 6, 7, 8, 9, 10]
    assert [pool.get_block(i).ref_cnt for i in (1, 2, 3)] == [1, 1, 1]
    pool.free_blocks(reversed(r1))
    assert pool.free_block_ids() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    pool.check_invariants()

    # A 160-token miss takes everything in queue order; the cached blocks lose their hashes.
    assert pool.get_new_blocks(10) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert all(pool.get_block(i).block_hash is None for i in range(11))
    assert pool.get_cached_block(H0) is None
    pool.check_invariants()


def test_evict_order(backend: ModuleType) -> None:
    """vLLM's test_evict: hashed blocks are appended tail first, unhashed ones prepended."""
    pool = backend.BlockPool(11)
    r0 = pool.get_new_blocks(6)  # 87 tokens: five full blocks
    pool.cache_full_blocks(r0, [H0, H1, H2, H3, b"h4"], 0, 5)
    r1 = pool.get_new_blocks(3)  # 48 tokens: three full blocks
    pool.cache_full_blocks(r1, [b"g0", b"g1", b"g2"], 0, 3)
    pool.free_blocks(reversed(r0))
    assert pool.free_block_ids() == [6, 10, 5, 4, 3, 2, 1]
    pool.free_blocks(reversed(r1))
    assert pool.free_block_ids() == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
    # A 35-token request hits [1, 2] and needs one new block: 6, not a hit.
    assert pool.get_cached_block(H0) == [1]
    assert pool.get_cached_block(H1) == [2]
    pool.touch([1, 2])
    assert pool.get_new_blocks(1) == [6]
    assert pool.get_num_free_blocks() == 7
    assert pool.free_block_ids() == [10, 5, 4, 3, 9, 8, 7]
    pool.check_invariants()


def test_duplicate_keys_first_inserted_wins(backend: ModuleType) -> None:
    """vLLM's test_maybe_evict_cached_block: one key, several blocks, evicted one by one."""
    pool = backend.BlockPool(6)
    pool.get_new_blocks(4)
    pool.cache_full_blocks([1, 2, 3], [H0, H1, H2], 0, 3)
    pool.cache_full_blocks([4], [H0], 0, 1)
    assert pool.get_cached_block(H0) == [1]
    pool.evict_blocks([2])
    assert pool.get_cached_block(H1) is None
    assert pool.get_cached_block(H0) == [1]
    pool.evict_blocks([1])
    # The key survives: block 4 still holds it.
    assert pool.get_cached_block(H0) == [4]
    # Re-cached, block 1 now comes after block 4.
    pool.cache_full_blocks([1], [H0], 0, 1)
    assert pool.get_cached_block(H0) == [4]
    pool.evict_blocks([3, 4])
    assert pool.get_cached_block(H2) is None
    assert pool.get_cached_block(H0) == [1]
    pool.evict_blocks({1})
    assert pool.get_cached_block(H0) is None
    assert hashes_of(pool) == set()
    pool.check_invariants()


def test_lazy_eviction(backend: ModuleType) -> None:
    pool = backend.BlockPool(3)
    assert pool.get_new_blocks(1) == [1]
    pool.cache_full_blocks([1], [H0], 0, 1)
    pool.free_blocks([1])
    # Free but still cached: found, kept in the queue, hash intact.
    assert pool.free_block_ids() == [2, 1]
    assert pool.get_cached_block(H0) == [1]
    assert pool.get_block(1).block_hash == H0
    assert pool.get_new_blocks(1) == [2]
    assert pool.get_cached_block(H0) == [1]
    # Reallocating it drops the hash.
    assert pool.get_new_blocks(1) == [1]
    assert pool.get_block(1).block_hash is None
    assert pool.get_block(1).group_id is None
    assert pool.get_cached_block(H0) is None
    pool.check_invariants()


def test_touch_takes_a_free_block_out_of_the_queue(backend: ModuleType) -> None:
    pool = backend.BlockPool(21)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [H0], 0, 1)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 20
    pool.touch(blocks)
    assert pool.get_block(1).ref_cnt == 1
    assert pool.get_num_free_blocks() == 19
    assert 1 not in pool.free_block_ids()
    pool.touch([1, 1])
    assert pool.get_block(1).ref_cnt == 3
    pool.free_blocks([1, 1, 1])
    assert pool.free_block_ids()[-1] == 1
    pool.check_invariants()


def test_evict_keeps_ref_counts_and_queue_positions(backend: ModuleType) -> None:
    pool = busy_pool(backend)
    pool.evict_blocks([3, 1])
    # Block 3 (free) stays where it was, unhashed; block 1 stays in use.
    assert pool.free_block_ids() == [6, 7, 8, 9, 10, 3]
    assert pool.get_block(3).block_hash is None
    assert pool.get_block(1).ref_cnt == 1
    assert pool.get_block(1).block_hash is None
    # The duplicate in block 5 still serves H0.
    assert pool.get_cached_block(H0) == [5]
    # Freed later, block 1 counts as unhashed and is prepended.
    pool.free_blocks([1])
    assert pool.free_block_ids() == [1, 6, 7, 8, 9, 10, 3]
    # Evicting unhashed, null and already-evicted blocks is a no-op.
    before = state(pool)
    pool.evict_blocks([0, 1, 3, 4, 6])
    assert state(pool) == before
    pool.check_invariants()


def test_reset_prefix_cache_refuses_while_blocks_are_in_use(backend: ModuleType) -> None:
    pool = busy_pool(backend)
    before = state(pool)
    assert pool.reset_prefix_cache() is False
    assert state(pool) == before
    pool.free_blocks([5, 4, 2, 1])
    order = pool.free_block_ids()
    assert pool.reset_prefix_cache() is True
    assert hashes_of(pool) == set()
    assert pool.get_cached_block(H0) is None
    assert pool.free_block_ids() == order
    assert pool.get_num_free_blocks() == 10
    pool.check_invariants()


def test_caching_disabled_prepends_and_keeps_hashes(backend: ModuleType) -> None:
    """With caching off (as vLLM): every freed block is prepended; no lazy eviction."""
    pool = backend.BlockPool(5, enable_caching=False)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [H0, H1], 0, 2)
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [3, 2, 1, 4]
    assert pool.get_new_blocks(3) == [3, 2, 1]
    assert pool.get_block(1).block_hash == H0
    assert pool.get_cached_block(H1) == [2]
    pool.check_invariants()


def test_cache_full_blocks_range(backend: ModuleType) -> None:
    pool = backend.BlockPool(8)
    table = pool.get_new_blocks(4)
    before = state(pool)
    pool.cache_full_blocks(table, [H0, H1, H2], 2, 2)
    pool.cache_full_blocks(table, [H0, H1, H2], 3, 1)
    pool.cache_full_blocks(table, [], 0, 0)
    assert state(pool) == before
    pool.cache_full_blocks(table, [H0, H1, H2], 1, 3)
    assert [pool.get_block(i).block_hash for i in table] == [None, H1, H2, None]
    assert pool.get_cached_block(H0) is None
    assert pool.get_cached_block(H2) == [3]
    # Extra hashes beyond num_full_blocks are allowed and ignored.
    pool.cache_full_blocks(table, [H0, H1, H2, H3], 0, 1)
    assert pool.get_block(1).block_hash == H0
    assert pool.get_block(4).block_hash is None
    # Ref counts and the free queue are untouched by caching.
    assert [pool.get_block(i).ref_cnt for i in table] == [1, 1, 1, 1]
    assert pool.free_block_ids() == [5, 6, 7]
    pool.check_invariants()


def test_hash_lengths(backend: ModuleType) -> None:
    pool = backend.BlockPool(5)
    table = pool.get_new_blocks(3)
    pool.cache_full_blocks(table, [SHORT, b"", b"\x00" * 32], 0, 3)
    assert pool.get_cached_block(SHORT) == [1]
    assert pool.get_cached_block(b"") == [2]
    assert pool.get_cached_block(b"\x00" * 32) == [3]
    assert pool.get_cached_block(b"\x00" * 31) is None
    assert pool.get_block(2).block_hash == b""
    pool.check_invariants()


def test_groups_are_separate_keys(backend: ModuleType) -> None:
    pool = backend.BlockPool(6)
    table = pool.get_new_blocks(4)
    pool.cache_full_blocks(table[:2], [H0, H1], 0, 2, 0)
    pool.cache_full_blocks(table[2:], [H0, H1], 0, 1, 1)
    assert pool.get_block(3).group_id == 1
    assert pool.get_cached_block(H0) == [1]
    assert pool.get_cached_block(H0, [1]) == [3]
    assert pool.get_cached_block(H0, [0, 1]) == [1, 3]
    assert pool.get_cached_block(H0, (1, 0)) == [3, 1]
    # Any group missing is a miss.
    assert pool.get_cached_block(H1, [0, 1]) is None
    assert pool.get_cached_block(H1, [1]) is None
    assert pool.get_cached_block(H0, [2]) is None
    assert pool.get_cached_block(H0, []) == []
    pool.cache_full_blocks([4], [H0], 0, 1, kv_cache_group_id=2**32 - 1)
    assert pool.get_cached_block(H0, [2**32 - 1]) == [4]
    pool.check_invariants()


def test_null_block_is_skipped(backend: ModuleType) -> None:
    pool = backend.BlockPool(4)
    pool.get_new_blocks(1)
    before = state(pool)
    pool.free_blocks([0])
    pool.touch([0, 0])
    pool.evict_blocks([0])
    assert state(pool) == before
    # In a table, the null block is skipped and the others get their own position's hash.
    pool.cache_full_blocks([0, 1], [H0, H1], 0, 2)
    assert pool.get_block(0).block_hash is None
    assert pool.get_block(1).block_hash == H1
    assert pool.get_cached_block(H0) is None
    pool.free_blocks([0, 1, 0])
    assert pool.get_block(0).ref_cnt == 0
    assert pool.free_block_ids() == [2, 3, 1]
    pool.check_invariants()


def test_free_order_within_one_call(backend: ModuleType) -> None:
    pool = backend.BlockPool(8)
    table = pool.get_new_blocks(7)
    pool.cache_full_blocks(table, [H0, H1, H2, H3], 0, 4, 0)
    # Mixed call: unhashed blocks prepended in the given order, hashed ones appended.
    pool.free_blocks([5, 1, 6, 2, 7])
    assert pool.free_block_ids() == [5, 6, 7, 1, 2]
    pool.free_blocks([3, 4])
    assert pool.free_block_ids() == [5, 6, 7, 1, 2, 3, 4]
    pool.check_invariants()


def test_shared_block_freed_by_each_holder(backend: ModuleType) -> None:
    pool = backend.BlockPool(4)
    pool.get_new_blocks(1)
    pool.touch([1, 1])
    pool.free_blocks([1, 1])
    assert pool.get_block(1).ref_cnt == 1
    assert pool.get_num_free_blocks() == 2
    pool.free_blocks([1])
    assert pool.free_block_ids() == [1, 2, 3]


# --------------------------------------------------------------------------- input types


def test_numpy_int_arrays_are_accepted(backend: ModuleType) -> None:
    pool = backend.BlockPool(np.int64(10))
    table = pool.get_new_blocks(np.int64(4))
    assert table == [1, 2, 3, 4]
    assert all(type(i) is int for i in table)
    pool.cache_full_blocks(
        np.array(table, dtype=np.int64), [H0, H1], np.int64(0), np.int32(2), np.uint8(0)
    )
    assert pool.get_cached_block(H0, np.array([0], dtype=np.int32)) == [1]
    pool.touch(np.array([1, 2], dtype=np.int32))
    assert pool.get_block(np.int16(1)).ref_cnt == 2
    pool.free_blocks(np.array([2, 1], dtype=np.uint16))
    pool.free_blocks(np.array(table[::-1], dtype=np.int64))
    assert pool.free_block_ids() == [4, 3, 5, 6, 7, 8, 9, 2, 1]
    pool.evict_blocks(np.array([1, 2], dtype=np.int64))
    assert pool.get_cached_block(H0) is None
    pool.free_blocks(np.array([], dtype=np.int64))
    pool.check_invariants()


def test_any_iterable_of_ints_is_accepted(backend: ModuleType) -> None:
    pool = backend.BlockPool(8)
    table = pool.get_new_blocks(3)
    pool.cache_full_blocks(tuple(table), (h for h in [H0, H1]), 0, 2)
    pool.touch(range(1, 3))
    pool.touch(i for i in [3])
    pool.free_blocks(iter([3, 2, 1]))
    pool.free_blocks(reversed(table))
    pool.evict_blocks({1})
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1]
    assert pool.get_block(True).block_id == 1
    pool.check_invariants()


# --------------------------------------------------------------------------- snapshots


def test_get_block_is_a_frozen_snapshot(backend: ModuleType) -> None:
    pool = backend.BlockPool(4)
    pool.get_new_blocks(1)
    pool.cache_full_blocks([1], [H0], 0, 1, 3)
    snap = pool.get_block(1)
    assert (snap.block_id, snap.ref_cnt, snap.block_hash, snap.group_id, snap.is_null) == (
        1,
        1,
        H0,
        3,
        False,
    )
    assert isinstance(snap.block_hash, bytes)
    assert snap == pool.get_block(1)
    assert snap != pool.get_block(2)
    with pytest.raises(AttributeError):
        snap.ref_cnt = 5
    # Later changes do not show through an old snapshot.
    pool.free_blocks([1])
    assert snap.ref_cnt == 1
    assert pool.get_block(1).ref_cnt == 0
    assert type(snap) is backend.KVCacheBlock


def test_reference_snapshot_is_a_slotted_frozen_dataclass() -> None:
    snap = reference_block_pool.BlockPool(2).get_block(1)
    assert isinstance(snap, KVCacheBlock)
    assert not hasattr(snap, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.block_id = 3  # type: ignore[misc]
    assert [f.name for f in dataclasses.fields(KVCacheBlock)] == [
        "block_id",
        "ref_cnt",
        "block_hash",
        "group_id",
        "is_null",
    ]


# --------------------------------------------------------------------------- errors


def test_constructor_errors(backend: ModuleType) -> None:
    cases: list[tuple[Callable[[], object], type[BaseException], str]] = [
        (lambda: backend.BlockPool(0), ValueError, "num_blocks must be positive, got 0"),
        (lambda: backend.BlockPool(-3), ValueError, "num_blocks must be positive, got -3"),
        (
            lambda: backend.BlockPool(4, block_size=0),
            ValueError,
            "block_size must be positive, got 0",
        ),
        (
            lambda: backend.BlockPool(4, block_size=-16),
            ValueError,
            "block_size must be positive, got -16",
        ),
        (
            lambda: backend.BlockPool(2.5),
            TypeError,
            "'float' object cannot be interpreted as an integer",
        ),
    ]
    for call, exc_type, message in cases:
        with pytest.raises(exc_type) as info:
            call()
        assert type(info.value) is exc_type
        assert str(info.value) == message


FLOAT_MSG = "'float' object cannot be interpreted as an integer"
STR_MSG = "'str' object cannot be interpreted as an integer"


def out_of_range(block_id: int) -> str:
    return f"block id {block_id} is out of range for a pool of 11 blocks"


# (name, call on the busy pool, class, exact message)
# fmt: off
POOL_ERRORS: list[tuple[str, Callable[[Any], object], type[BaseException], str]] = [
    # get_new_blocks
    ("alloc-too-many", lambda p: p.get_new_blocks(7), NoFreeBlocksError,
     "Cannot get 7 free blocks from the pool (6 free)"),
    ("alloc-negative", lambda p: p.get_new_blocks(-1), ValueError,
     "n must be non-negative, got -1"),
    ("alloc-float", lambda p: p.get_new_blocks(1.0), TypeError, FLOAT_MSG),
    ("alloc-str", lambda p: p.get_new_blocks("1"), TypeError, STR_MSG),
    # free_blocks
    ("free-free-block", lambda p: p.free_blocks([3]), BlockStateError,
     "block 3 is already free (ref count 0)"),
    ("free-never-used", lambda p: p.free_blocks([4, 7]), BlockStateError,
     "block 7 is already free (ref count 0)"),
    ("free-repeated", lambda p: p.free_blocks([2, 1, 1]), BlockStateError,
     "block 1 is already free (ref count 0)"),
    ("free-out-of-range", lambda p: p.free_blocks([2, 1, 11]), UnknownBlockError,
     out_of_range(11)),
    ("free-negative-id", lambda p: p.free_blocks([-1]), UnknownBlockError, out_of_range(-1)),
    ("free-float", lambda p: p.free_blocks([1, 2.0]), TypeError, FLOAT_MSG),
    ("free-range-before-state", lambda p: p.free_blocks([3, 12]), UnknownBlockError,
     out_of_range(12)),
    # touch
    ("touch-out-of-range", lambda p: p.touch([6, 11]), UnknownBlockError, out_of_range(11)),
    ("touch-str", lambda p: p.touch([6, "7"]), TypeError, STR_MSG),
    # cache_full_blocks
    ("cache-hashed", lambda p: p.cache_full_blocks([4, 1], [H0, H1], 0, 2), BlockStateError,
     "block 1 already has a hash"),
    ("cache-free-hashed", lambda p: p.cache_full_blocks([4, 3], [H0, H1], 0, 2),
     BlockStateError, "block 3 already has a hash"),
    ("cache-twice-in-call", lambda p: p.cache_full_blocks([4, 4], [H3, H3], 0, 2),
     BlockStateError, "block 4 already has a hash"),
    ("cache-too-few-hashes", lambda p: p.cache_full_blocks([4, 6, 7], [H3, H3], 0, 3),
     ValueError, "need 3 block hashes, got 2"),
    ("cache-past-table", lambda p: p.cache_full_blocks([4, 6], [H3, H3, H3], 0, 3),
     ValueError, "num_full_blocks 3 exceeds the 2 block ids given"),
    ("cache-long-hash", lambda p: p.cache_full_blocks([4], [b"x" * 33], 0, 1), ValueError,
     "block hash must be at most 32 bytes, got 33"),
    ("cache-str-hash", lambda p: p.cache_full_blocks([4], ["abc"], 0, 1), TypeError,
     "block hash must be bytes, got str"),
    ("cache-bytearray-hash", lambda p: p.cache_full_blocks([4], [bytearray(H3)], 0, 1),
     TypeError, "block hash must be bytes, got bytearray"),
    ("cache-none-hash", lambda p: p.cache_full_blocks([4], [None], 0, 1), TypeError,
     "block hash must be bytes, got NoneType"),
    ("cache-negative-cached", lambda p: p.cache_full_blocks([4], [H3], -1, 1), ValueError,
     "num_cached_blocks must be non-negative, got -1"),
    ("cache-negative-full", lambda p: p.cache_full_blocks([4], [H3], 0, -2), ValueError,
     "num_full_blocks must be non-negative, got -2"),
    ("cache-negative-group", lambda p: p.cache_full_blocks([4], [H3], 0, 1, -1), ValueError,
     "kv_cache_group_id must be non-negative, got -1"),
    ("cache-huge-group", lambda p: p.cache_full_blocks([4], [H3], 0, 1, 2**32), ValueError,
     "kv_cache_group_id must be at most 4294967295, got 4294967296"),
    ("cache-out-of-range", lambda p: p.cache_full_blocks([4, 11], [H3, H3], 0, 1),
     UnknownBlockError, out_of_range(11)),
    ("cache-float-count", lambda p: p.cache_full_blocks([4], [H3], 0.0, 1), TypeError,
     FLOAT_MSG),
    ("cache-noop-still-validated", lambda p: p.cache_full_blocks([4], [H3], 1, 1, -5),
     ValueError, "kv_cache_group_id must be non-negative, got -5"),
    # get_cached_block
    ("lookup-str", lambda p: p.get_cached_block("abc"), TypeError,
     "block hash must be bytes, got str"),
    ("lookup-long", lambda p: p.get_cached_block(b"y" * 40), ValueError,
     "block hash must be at most 32 bytes, got 40"),
    ("lookup-negative-group", lambda p: p.get_cached_block(H0, [0, -1]), ValueError,
     "kv_cache_group_ids must be non-negative, got -1"),
    ("lookup-huge-group", lambda p: p.get_cached_block(H0, [2**32]), ValueError,
     "kv_cache_group_ids must be at most 4294967295, got 4294967296"),
    ("lookup-float-group", lambda p: p.get_cached_block(H0, [0.5]), TypeError, FLOAT_MSG),
    # evict_blocks
    ("evict-out-of-range", lambda p: p.evict_blocks([1, 11]), UnknownBlockError,
     out_of_range(11)),
    ("evict-float", lambda p: p.evict_blocks([1, 1.5]), TypeError, FLOAT_MSG),
    # get_block
    ("get-block-out-of-range", lambda p: p.get_block(11), UnknownBlockError, out_of_range(11)),
    ("get-block-negative", lambda p: p.get_block(-1), UnknownBlockError, out_of_range(-1)),
    ("get-block-float", lambda p: p.get_block(1.0), TypeError, FLOAT_MSG),
]
# fmt: on


@pytest.mark.parametrize(
    ("call", "exc_type", "message"),
    [pytest.param(c, e, m, id=name) for name, c, e, m in POOL_ERRORS],
)
def test_errors_leave_the_pool_unchanged(
    backend: ModuleType,
    call: Callable[[Any], object],
    exc_type: type[BaseException],
    message: str,
) -> None:
    pool = busy_pool(backend)
    assert_refused(pool, lambda: call(pool), exc_type, message)


def test_error_classes() -> None:
    assert issubclass(NoFreeBlocksError, ValueError)
    assert issubclass(BlockStateError, ValueError)
    assert issubclass(UnknownBlockError, IndexError)
    assert issubclass(InvariantError, AssertionError)
    for cls in (NoFreeBlocksError, BlockStateError, UnknownBlockError, InvariantError):
        assert issubclass(cls, KVBlocksError)


def test_double_free_after_full_release(backend: ModuleType) -> None:
    pool = backend.BlockPool(4)
    table = pool.get_new_blocks(2)
    pool.free_blocks(table)
    assert_refused(
        pool,
        lambda: pool.free_blocks(table),
        BlockStateError,
        "block 1 is already free (ref count 0)",
    )


# --------------------------------------------------------------------------- check_invariants


def test_check_invariants_passes_on_healthy_pools(backend: ModuleType) -> None:
    pool = busy_pool(backend)
    pool.check_invariants()
    pool.free_blocks([5, 4, 2, 1])
    pool.check_invariants()
    pool.reset_prefix_cache()
    pool.check_invariants()
    assert pool.check_invariants() is None


def _corrupt_ref_cnt(pool: Any) -> None:
    pool._blocks[1].ref_cnt = -1


def _corrupt_free_in_use(pool: Any) -> None:
    pool._blocks[6].ref_cnt = 2


def _corrupt_lost_free_block(pool: Any) -> None:
    pool._blocks[2].ref_cnt = 0


def _corrupt_count(pool: Any) -> None:
    pool._free_block_queue.num_free_blocks += 1


def _corrupt_link(pool: Any) -> None:
    pool._blocks[7].prev_free_block = pool._blocks[9]


def _corrupt_hash_not_in_map(pool: Any) -> None:
    pool._blocks[4].block_hash = H3
    pool._blocks[4].group_id = 0


def _corrupt_half_key(pool: Any) -> None:
    pool._blocks[1].group_id = None


def _corrupt_map_entry(pool: Any) -> None:
    pool._cached_block_hash_to_block.insert((H3, 0), pool._blocks[6])


def _corrupt_null(pool: Any) -> None:
    pool._null_block.ref_cnt = 1


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_ref_cnt,
        _corrupt_free_in_use,
        _corrupt_lost_free_block,
        _corrupt_count,
        _corrupt_link,
        _corrupt_hash_not_in_map,
        _corrupt_half_key,
        _corrupt_map_entry,
        _corrupt_null,
    ],
)
def test_check_invariants_detects_corruption(corrupt: Callable[[Any], None]) -> None:
    """Reference only: the native state cannot be reached to be corrupted from Python."""
    pool = reference_block_pool.BlockPool(11)
    pool.get_new_blocks(5)
    pool.cache_full_blocks([1, 2, 3], [H0, H1, H2], 0, 3)
    pool.free_blocks([3])
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(InvariantError):
        pool.check_invariants()


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (([99], [b"a"], -1, 1), UnknownBlockError, "^block id 99 is out of range"),
        (([99], [1], 0, 1), UnknownBlockError, "^block id 99 is out of range"),
        (([1], [b"a"], -1, 1, -1), ValueError, "^num_cached_blocks must be non-negative"),
        (([1, 2], [1], 0, 2), ValueError, "^need 2 block hashes, got 1$"),
        (([1], [b"x" * 33], 0, 2), ValueError, "^num_full_blocks 2 exceeds the 1 block ids"),
        (([1], [b"x" * 33], 0, 1, -1), ValueError, "^kv_cache_group_id must be non-negative"),
        # Every hash's type is checked before any hash's length.
        (([1, 2, 3], [H0, b"x" * 33, 5], 1, 3), TypeError, "^block hash must be bytes, got int$"),
        (([1, 2, 3], [H0, b"x" * 33, H1], 1, 3), ValueError, "33"),
    ],
)
def test_cache_full_blocks_reports_the_first_fault_in_the_documented_order(
    backend: ModuleType, args: tuple[Any, ...], error: type[Exception], message: str
) -> None:
    """With several faults in one call, both backends name the same one first."""
    pool = backend.BlockPool(8)
    pool.get_new_blocks(2)
    before = state(pool)
    with pytest.raises(error, match=message):
        pool.cache_full_blocks(*args)
    assert state(pool) == before


def test_flags_are_read_by_truthiness(backend: ModuleType) -> None:
    pool = backend.BlockPool(4, 0)
    assert pool.enable_caching is False
    manager = backend.KVCacheManager(4, 4, enable_caching=1, log_stats=0)
    assert manager.enable_caching is True
    assert manager.make_prefix_cache_stats() is None


def test_explicit_none_is_not_the_default(backend: ModuleType) -> None:
    """``kv_cache_group_ids`` defaults to ``(0,)``; ``None`` is refused, as in the reference."""
    pool = backend.BlockPool(4)
    assert pool.get_cached_block(b"h") is None
    with pytest.raises(TypeError, match="'NoneType' object is not iterable"):
        pool.get_cached_block(b"h", None)
