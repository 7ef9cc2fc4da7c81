"""Rollback of invalid blocks: vLLM 0.33.0's worked examples, strict mode, hostile input.

The worked examples run at the level of the scheduler methods: "sync r1" is a running
request whose 100-block table holds 1600 computed tokens, 16 of them scheduled in this
step (99 blocks scanned); "r2 shares" is a request whose first 50 blocks are r1's and
which scheduled 800 new tokens. Every error test checks that the call changed nothing.
The golden vectors are replayed by ``tests/test_golden.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from kvblocks.errors import UnknownBlockError, UnsupportedLayoutError
from support import FakeManager, Req

BS = 16
MULTIPLE_GROUPS_MESSAGE = (
    "A KV connector reported block-level load failures (invalid_block_ids) which is not "
    "supported for models with multiple KV cache groups. Connectors must report failed "
    "requests via KVConnectorTransferResults.failed_recving instead."
)


R1_IDS = list(range(1, 101))  # r1's 100 blocks
R2_IDS = R1_IDS[:50] + list(range(201, 251))  # r2 shares r1's first 50 blocks


def sync_r1(computed: int = 1600) -> Req:
    return Req("r1", computed)


def shared_setup() -> tuple[FakeManager, Req, Req, dict[str, int]]:
    """r1 (1584 pre-step tokens + 16) and r2 (800 hit on r1's blocks + 800 new)."""
    manager = FakeManager({"r1": R1_IDS, "r2": R2_IDS})
    return manager, sync_r1(), Req("r2", 1600), {"r1": 16, "r2": 800}


def counts(*requests: Req) -> dict[str, int]:
    return {r.request_id: r.num_computed_tokens for r in requests}


# ------------------------------------------------------------- 5.8 worked examples


@pytest.mark.parametrize(
    ("invalid_idx", "after", "total"),
    [
        ({50}, 800, 784),  # 1
        ({0, 98}, 0, 1584),  # 2
        ({99}, 1600, 0),  # 3: the block of this step's new tokens is not scanned
    ],
)
def test_sync_recompute_truncates_at_the_first_invalid_block(
    backend: ModuleType, invalid_idx: set[int], after: int, total: int
) -> None:
    manager, r1 = FakeManager({"r1": R1_IDS}), sync_r1()
    outcome = backend.handle_invalid_blocks(
        manager,
        {R1_IDS[i] for i in invalid_idx},
        {"r1": 16},
        running=[r1],
        policy="recompute",
    )
    affected = {"r1"} if after != 1600 else set()
    assert r1.num_computed_tokens == after
    assert outcome.rescheduled_req_ids == affected
    assert outcome.failed_req_ids == outcome.retry_req_ids == set()
    assert outcome.total_affected_tokens == total
    # Under recompute nothing is evicted: the blocks are rewritten in place.
    assert outcome.evicted_block_ids == set()
    assert manager.evict_calls == []


def test_sync_rollback_would_evict_the_tail_including_this_steps_block(
    backend: ModuleType,
) -> None:
    # Example 1 through vLLM's own method: blocks_to_evict is ids[50:] (50 blocks).
    r1 = sync_r1()
    affected, total, to_evict = backend.update_requests_with_invalid_blocks(
        FakeManager({"r1": R1_IDS}), [r1], {R1_IDS[50]}, {"r1": 16}
    )
    assert (affected, total, r1.num_computed_tokens) == ({"r1"}, 784, 800)
    assert to_evict == set(R1_IDS[50:])
    assert R1_IDS[99] in to_evict  # the block allocated for this step's tokens


def test_sync_fail_evicts_the_tail_and_fails_the_request(backend: ModuleType) -> None:
    # Example 4.
    manager, r1 = FakeManager({"r1": R1_IDS}), sync_r1()
    outcome = backend.handle_invalid_blocks(
        manager, {R1_IDS[50]}, {"r1": 16}, running=[r1], policy="fail"
    )
    assert outcome.failed_req_ids == {"r1"}
    assert outcome.rescheduled_req_ids == outcome.retry_req_ids == set()
    assert outcome.evicted_block_ids == set(R1_IDS[50:])
    assert manager.evict_calls == [set(R1_IDS[50:])]
    assert (r1.num_computed_tokens, outcome.total_affected_tokens) == (800, 784)


@pytest.mark.parametrize(
    ("order", "invalid_idx", "expected", "total"),
    [
        (("r1", "r2"), {25, 49}, {"r1": 400, "r2": 800}, 1184 + 800),  # 5
        (("r2", "r1"), {25, 49}, {"r2": 400, "r1": 1584}, 400 + 16),  # 6
        (("r1", "r2"), {0}, {"r1": 0, "r2": 800}, 2384),  # 7
        (("r2", "r1"), {0}, {"r2": 0, "r1": 1584}, 816),  # 8
    ],
)
def test_shared_blocks_are_recomputed_by_the_first_request_in_iteration_order(
    backend: ModuleType,
    order: tuple[str, str],
    invalid_idx: set[int],
    expected: dict[str, int],
    total: int,
) -> None:
    manager, r1, r2, scheduled = shared_setup()
    running = [{"r1": r1, "r2": r2}[name] for name in order]
    outcome = backend.handle_invalid_blocks(
        manager, {R1_IDS[i] for i in invalid_idx}, scheduled, running=running, policy="recompute"
    )
    assert counts(r1, r2) == expected
    assert outcome.rescheduled_req_ids == {"r1", "r2"}
    assert outcome.total_affected_tokens == total
    assert manager.evict_calls == []


def test_the_owner_of_a_shared_block_collects_its_own_tail(backend: ModuleType) -> None:
    # Example 6: with r2 first, blocks_to_evict is r2's ids[25:] (25 shared + 50 own);
    # r1 only reverts to its pre-step count and collects nothing.
    manager, r1, r2, scheduled = shared_setup()
    affected, total, to_evict = backend.update_requests_with_invalid_blocks(
        manager, [r2, r1], {R1_IDS[25], R1_IDS[49]}, scheduled
    )
    assert affected == {"r1", "r2"}
    assert total == 416
    assert to_evict == set(R2_IDS[25:])
    assert len(to_evict) == 75


@pytest.mark.parametrize("invalid_idx", [{25}, {25, 49}])
def test_fail_with_shared_blocks_evicts_only_the_owners_tail(
    backend: ModuleType, invalid_idx: set[int]
) -> None:
    # Example 9: r2's own blocks 50-99 stay hashed (the cache-pollution caveat).
    manager, r1, r2, scheduled = shared_setup()
    outcome = backend.handle_invalid_blocks(
        manager, {R1_IDS[i] for i in invalid_idx}, scheduled, running=[r1, r2], policy="fail"
    )
    assert counts(r1, r2) == {"r1": 400, "r2": 800}
    assert outcome.failed_req_ids == {"r1", "r2"}
    assert manager.evict_calls == [set(R1_IDS[25:])]
    assert not set(R2_IDS[50:]) & outcome.evicted_block_ids


def test_a_partial_last_block_is_scanned(backend: ModuleType) -> None:
    # Example 10: 1000 external tokens = 62.5 blocks, 63 scanned; block 62 is partial.
    table = list(range(1, 64))
    req = Req("r", 1001)
    affected, total, to_evict = backend.update_requests_with_invalid_blocks(
        FakeManager({"r": table}), [req], {table[62]}, {"r": 1}
    )
    assert (affected, total, to_evict) == ({"r"}, 8, {table[62]})
    assert req.num_computed_tokens == 992


def test_a_request_not_scheduled_this_step_is_scanned_in_full(backend: ModuleType) -> None:
    # Example 11: no key in num_scheduled_tokens, so all 100 blocks are scanned.
    req = sync_r1()
    outcome = backend.handle_invalid_blocks(
        FakeManager({"r1": R1_IDS}), {R1_IDS[99]}, {}, running=[req], policy="recompute"
    )
    assert req.num_computed_tokens == 1584
    assert outcome.rescheduled_req_ids == {"r1"}
    assert outcome.total_affected_tokens == 16


def async_ra() -> tuple[FakeManager, Req]:
    """An async request waiting for remote KVs: 1584 tokens, 99 blocks."""
    return FakeManager({"ra": R1_IDS[:99]}), Req("ra", 1584)


def test_async_recompute_truncates_and_retries_without_eviction(backend: ModuleType) -> None:
    # Example 12.
    manager, ra = async_ra()
    outcome = backend.handle_invalid_blocks(
        manager, {R1_IDS[50]}, {}, running=[], waiting_for_remote_kvs=[ra], policy="recompute"
    )
    assert ra.num_computed_tokens == 800
    assert outcome.retry_req_ids == {"ra"}
    assert outcome.rescheduled_req_ids == outcome.failed_req_ids == set()
    assert outcome.evicted_block_ids == set()
    assert manager.evict_calls == []


def test_progressive_async_failures_only_ever_move_lower(backend: ModuleType) -> None:
    # Example 13: {50} -> 800, then {30} -> 480, then {40} is past cdiv(480, 16) = 30
    # scanned blocks and is ignored.
    manager, ra = async_ra()
    steps = [(50, 800, {"ra"}), (30, 480, {"ra"}), (40, 480, set())]
    for idx, after, retried in steps:
        outcome = backend.handle_invalid_blocks(
            manager, {R1_IDS[idx]}, {}, running=[], waiting_for_remote_kvs=[ra], policy="recompute"
        )
        assert ra.num_computed_tokens == after, idx
        assert outcome.retry_req_ids == retried, idx


def test_async_fail_fails_the_request_without_eviction(backend: ModuleType) -> None:
    # Example 16.
    manager, ra = async_ra()
    outcome = backend.handle_invalid_blocks(
        manager, {R1_IDS[50]}, {}, running=[], waiting_for_remote_kvs=[ra], policy="fail"
    )
    assert (ra.num_computed_tokens, outcome.failed_req_ids) == (800, {"ra"})
    assert outcome.evicted_block_ids == set()
    assert manager.evict_calls == []


def test_async_and_sync_passes_do_not_share_marks(backend: ModuleType) -> None:
    # Each pass has its own marked set: a block shared by an async and a sync request is
    # recomputed by both, and only the sync tail is evicted.
    manager = FakeManager({"ra": [1, 2, 3], "rs": [1, 2, 3, 4]})
    ra, rs = Req("ra", 48), Req("rs", 60)
    outcome = backend.handle_invalid_blocks(
        manager, {2}, {"rs": 12}, running=[rs], waiting_for_remote_kvs=[ra], policy="fail"
    )
    assert counts(ra, rs) == {"ra": 16, "rs": 16}
    assert outcome.failed_req_ids == {"ra", "rs"}
    assert manager.evict_calls == [{2, 3, 4}]
    assert outcome.total_affected_tokens == 32 + 32


def test_invalid_ids_matching_nobody_are_ignored(backend: ModuleType) -> None:
    # Example 20, under both policies; the id is also far outside any pool.
    for policy in ("fail", "recompute"):
        manager, r1 = FakeManager({"r1": R1_IDS}, num_blocks=1000), sync_r1()
        outcome = backend.handle_invalid_blocks(
            manager, {999, 1 << 50}, {"r1": 16}, running=[r1], policy=policy
        )
        assert r1.num_computed_tokens == 1600
        assert outcome.failed_req_ids == outcome.rescheduled_req_ids == set()
        assert outcome.total_affected_tokens == 0
        assert manager.evict_calls == []


@pytest.mark.parametrize("invalid", [set(), {5}, {-1}])
def test_multiple_kv_cache_groups_fail_closed_before_anything(
    backend: ModuleType, invalid: set[int]
) -> None:
    # Example 22: raised before any request (or even the ids) is looked at.
    manager, r1 = FakeManager({"r1": R1_IDS}, num_kv_cache_groups=2), sync_r1()
    with pytest.raises(UnsupportedLayoutError) as info:
        backend.handle_invalid_blocks(manager, invalid, {"r1": 99999}, running=[r1])
    assert isinstance(info.value, RuntimeError)
    assert str(info.value) == MULTIPLE_GROUPS_MESSAGE
    assert r1.num_computed_tokens == 1600
    assert manager.evict_calls == []
    with pytest.raises(UnsupportedLayoutError, match="multiple KV cache groups"):
        backend.update_requests_with_invalid_blocks(manager, [r1], {5}, {})
    assert r1.num_computed_tokens == 1600


# --------------------------------------------------------- request-level failures


def test_failed_recving_recompute_rewinds_to_zero_and_ignores_others(backend: ModuleType) -> None:
    # Example 17 (and 19: a running request is not among the async loads).
    ra, running = Req("ra", 1584), Req("r", 1600)
    outcome = backend.handle_failed_recving({"ra", "unknown", "r"}, [ra], policy="recompute")
    assert ra.num_computed_tokens == 0
    assert running.num_computed_tokens == 1600
    assert outcome.retry_req_ids == {"ra"}
    assert outcome.failed_req_ids == outcome.rescheduled_req_ids == set()
    assert outcome.evicted_block_ids == set()
    assert outcome.total_affected_tokens == 1584


def test_failed_recving_fail_reports_and_changes_nothing(backend: ModuleType) -> None:
    # Example 18.
    ra, other = Req("ra", 1584), Req("rb", 32)
    outcome = backend.handle_failed_recving(["ra"], [ra, other], policy="fail")
    assert counts(ra, other) == {"ra": 1584, "rb": 32}
    assert outcome.failed_req_ids == {"ra"}
    assert outcome.retry_req_ids == set()
    assert outcome.total_affected_tokens == 1584


def test_failed_recving_rejects_bad_input_without_changing_anything(backend: ModuleType) -> None:
    ra = Req("ra", 16)
    with pytest.raises(ValueError, match=r"^policy must be 'fail' or 'recompute', got 'retry'$"):
        backend.handle_failed_recving({"ra"}, [ra], policy="retry")
    with pytest.raises(ValueError, match=r"^request 'ra' appears more than once$"):
        backend.handle_failed_recving({"ra"}, [ra, ra], policy="recompute")
    bad = Req("rb", -3)
    with pytest.raises(ValueError, match=r"^num_computed_tokens must be non-negative, got -3$"):
        backend.handle_failed_recving({"ra", "rb"}, [ra, bad], policy="recompute")
    assert (ra.num_computed_tokens, bad.num_computed_tokens) == (16, -3)


def test_failed_recving_reads_every_count_before_checking_any(backend: ModuleType) -> None:
    """A negative count does not hide a later one that is not an int."""
    negative, not_int = Req("ra", -1), Req("rb", 0)
    not_int.num_computed_tokens = "x"  # type: ignore[assignment]
    with pytest.raises(TypeError):
        backend.handle_failed_recving(["ra", "rb"], [negative, not_int], policy="recompute")
    assert negative.num_computed_tokens == -1


# -------------------------------------------------------------------- strict mode


def test_strict_mode_truncates_every_sharer_at_its_own_first_invalid_block(
    backend: ModuleType,
) -> None:
    # Example 5 in strict mode: r2 no longer keeps r1's invalid blocks as computed.
    manager, r1, r2, scheduled = shared_setup()
    affected, total, to_evict = backend.update_requests_with_invalid_blocks(
        manager, [r1, r2], {R1_IDS[25], R1_IDS[49]}, scheduled, mode="strict"
    )
    assert counts(r1, r2) == {"r1": 400, "r2": 400}
    assert affected == {"r1", "r2"}
    assert total == 1184 + 400
    assert to_evict == set(R1_IDS[25:]) | set(R2_IDS[25:])


def test_strict_mode_catches_a_deeper_block_marked_after_truncation(
    backend: ModuleType,
) -> None:
    # vLLM: request a truncates at block 10 but still marks block 20, so b (whose only
    # invalid block is 20) reverts and keeps block 20 as computed. Strict truncates b.
    tables = [[1, 10, 20, 2], [3, 20, 4]]
    args = (tables, [8, 6], [2, 2], {10, 20}, 2)
    vllm = backend.rollback_invalid_blocks(*args)
    strict = backend.rollback_invalid_blocks(*args, mode="strict")
    assert (vllm.num_computed_tokens, vllm.affected) == ([2, 4], [0, 1])
    assert vllm.blocks_to_evict == [2, 10, 20]
    assert (strict.num_computed_tokens, strict.affected) == ([2, 2], [0, 1])
    assert strict.blocks_to_evict == [2, 4, 10, 20]
    assert (vllm.total_affected_tokens, strict.total_affected_tokens) == (6, 6)


def test_strict_mode_in_handle_invalid_blocks(backend: ModuleType) -> None:
    manager, r1, r2, scheduled = shared_setup()
    outcome = backend.handle_invalid_blocks(
        manager, {R1_IDS[25]}, scheduled, running=[r1, r2], policy="fail", mode="strict"
    )
    assert counts(r1, r2) == {"r1": 400, "r2": 400}
    assert outcome.failed_req_ids == {"r1", "r2"}
    assert outcome.total_affected_tokens == 1184 + 400
    assert manager.evict_calls == [set(R1_IDS[25:]) | set(R2_IDS[25:])]


# ------------------------------------------------------------- the batch primitive


def test_batch_primitive_returns_a_frozen_result(backend: ModuleType) -> None:
    result = backend.rollback_invalid_blocks([[5, 6], [7]], [4, 2], [0, 0], [6], 2)
    assert result.num_computed_tokens == [2, 2]
    assert result.affected == [0]
    assert result.total_affected_tokens == 2
    assert result.blocks_to_evict == [6]
    with pytest.raises(AttributeError):
        result.affected = []


def test_unaffected_requests_keep_their_counts_and_nothing_is_collected(
    backend: ModuleType,
) -> None:
    result = backend.rollback_invalid_blocks(
        [[1, 2, 3], [4, 5]], [40, 3], [5, 3], [9, 5], 16, collect_evictions=False
    )
    # Request 1 holds block 5, but only this step's tokens: it was not loaded.
    assert result.num_computed_tokens == [40, 3]
    assert (result.affected, result.total_affected_tokens, result.blocks_to_evict) == ([], 0, [])


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint32])
def test_numpy_arrays_are_accepted(backend: ModuleType, dtype: Any) -> None:
    tables = [R1_IDS, R2_IDS]
    as_lists = backend.rollback_invalid_blocks(tables, [1600, 1600], [16, 800], [26, 50], BS)
    as_arrays = backend.rollback_invalid_blocks(
        [np.asarray(t, dtype=dtype) for t in tables],
        np.asarray([1600, 1600]),
        np.asarray([16, 800]),
        np.asarray([26, 50], dtype=dtype),
        np.int64(BS),
    )
    assert as_arrays == as_lists
    assert all(type(b) is int for b in as_arrays.blocks_to_evict)
    assert type(as_arrays.total_affected_tokens) is int


def test_duplicate_invalid_ids_and_repeated_blocks_are_harmless(backend: ModuleType) -> None:
    result = backend.rollback_invalid_blocks([[3, 7, 3, 7]], [8], [0], [7, 7, 7], 2)
    assert (result.num_computed_tokens, result.blocks_to_evict) == ([2], [3, 7])


# ------------------------------------------------------------------ hostile input

ROLLBACK_ERRORS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("block size", {"block_size": 0}, ValueError, "block_size must be positive, got 0"),
    (
        "lengths",
        {"num_scheduled_tokens": [0]},
        ValueError,
        "block_tables, num_computed_tokens and num_scheduled_tokens must have the same "
        "length, got 2, 2 and 1",
    ),
    (
        "negative invalid id",
        {"invalid_block_ids": [3, -2, -7]},
        ValueError,
        "invalid_block_ids must be non-negative, got -7",
    ),
    (
        "negative computed",
        {"num_computed_tokens": [4, -1]},
        ValueError,
        "num_computed_tokens[1] must be non-negative, got -1",
    ),
    (
        "negative scheduled",
        {"num_scheduled_tokens": [-2, 0]},
        ValueError,
        "num_scheduled_tokens[0] must be non-negative, got -2",
    ),
    (
        "scheduled exceeds computed",
        {"num_scheduled_tokens": [0, 5]},
        ValueError,
        "num_scheduled_tokens[1] = 5 exceeds num_computed_tokens[1] = 3",
    ),
    (
        "short table",
        {
            "block_tables": [[1, 2], [3]],
            "num_computed_tokens": [4, 9],
            "num_scheduled_tokens": [0, 2],
        },
        ValueError,
        "block_tables[1] has 1 blocks, fewer than the 4 holding its 7 tokens computed "
        "before this step",
    ),
    (
        "negative table id",
        {"block_tables": [[1, 2], [3, 4, -5, -6]]},
        ValueError,
        "block_tables[1][2] must be non-negative, got -5",
    ),
    (
        "first request at fault wins",
        {"block_tables": [[1, 2], [-3]], "num_computed_tokens": [4, -1]},
        ValueError,
        "num_computed_tokens[1] must be non-negative, got -1",
    ),
    (
        "float count",
        {"num_computed_tokens": [4, 2.0]},
        TypeError,
        "'float' object cannot be interpreted as an integer",
    ),
    (
        "float id",
        {"block_tables": [[1, 2.5], [3]]},
        TypeError,
        "'float' object cannot be interpreted as an integer",
    ),
    ("mode", {"mode": "fast"}, ValueError, "mode must be 'vllm' or 'strict', got 'fast'"),
]


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [pytest.param(o, e, m, id=name) for name, o, e, m in ROLLBACK_ERRORS],
)
def test_batch_primitive_rejects_hostile_input(
    backend: ModuleType, overrides: dict[str, Any], error: type[Exception], message: str
) -> None:
    args: dict[str, Any] = {
        "block_tables": [[1, 2], [3]],
        "num_computed_tokens": [4, 3],
        "num_scheduled_tokens": [1, 1],
        "invalid_block_ids": [2],
        "block_size": 2,
    }
    args.update(overrides)
    mode = args.pop("mode", "vllm")
    tables = [list(t) for t in args["block_tables"]]
    with pytest.raises(error) as info:
        backend.rollback_invalid_blocks(*args.values(), mode=mode)
    assert str(info.value) == message
    assert args["block_tables"] == tables  # inputs untouched


def test_a_numpy_float_array_is_a_type_error(backend: ModuleType) -> None:
    with pytest.raises(TypeError):
        backend.rollback_invalid_blocks([np.array([1.0, 2.0])], [4], [0], [2], 2)


def run_hostile(
    backend: ModuleType,
    call: Callable[[ModuleType, FakeManager, Sequence[Req]], Any],
    error: type[Exception],
    message: str,
) -> None:
    """Runs ``call`` on the shared setup; it must raise and change nothing at all."""
    manager, r1, r2, _ = shared_setup()
    before = counts(r1, r2)
    with pytest.raises(error) as info:
        call(backend, manager, [r1, r2])
    assert str(info.value) == message
    assert counts(r1, r2) == before
    assert manager.evict_calls == []


def test_update_requests_validates_everything_before_writing(backend: ModuleType) -> None:
    # r1 would be truncated, but r2 is refused: nothing may be written.
    run_hostile(
        backend,
        lambda b, m, rs: b.update_requests_with_invalid_blocks(
            m, rs, {R1_IDS[0]}, {"r1": 16, "r2": 1601}
        ),
        ValueError,
        "num_scheduled_tokens[1] = 1601 exceeds num_computed_tokens[1] = 1600",
    )
    run_hostile(
        backend,
        lambda b, m, rs: b.update_requests_with_invalid_blocks(m, [*rs, rs[0]], {1}, {}),
        ValueError,
        "request 'r1' appears more than once",
    )
    run_hostile(
        backend,
        lambda b, m, rs: b.update_requests_with_invalid_blocks(m, rs, {1}, {"r1": "16"}),
        TypeError,
        "'str' object cannot be interpreted as an integer",
    )
    run_hostile(
        backend,
        lambda b, m, rs: b.update_requests_with_invalid_blocks(m, rs, {1}, {}, mode="lax"),
        ValueError,
        "mode must be 'vllm' or 'strict', got 'lax'",
    )


def test_handle_invalid_blocks_validates_both_passes_before_anything(
    backend: ModuleType,
) -> None:
    # The async pass is fine and would truncate r2; the sync pass is refused.
    run_hostile(
        backend,
        lambda b, m, rs: b.handle_invalid_blocks(
            m,
            {R1_IDS[0]},
            {"r1": 1601},
            running=[rs[0]],
            waiting_for_remote_kvs=[rs[1]],
            policy="fail",
        ),
        ValueError,
        "num_scheduled_tokens[0] = 1601 exceeds num_computed_tokens[0] = 1600",
    )
    run_hostile(
        backend,
        lambda b, m, rs: b.handle_invalid_blocks(m, {1}, {}, running=rs, policy="retry"),
        ValueError,
        "policy must be 'fail' or 'recompute', got 'retry'",
    )
    run_hostile(
        backend,
        lambda b, m, rs: b.handle_invalid_blocks(
            m, {1}, {}, running=rs, waiting_for_remote_kvs=[rs[0]]
        ),
        ValueError,
        "request 'r1' appears more than once",
    )
    run_hostile(
        backend,
        lambda b, m, rs: b.handle_invalid_blocks(m, {-4}, {}, running=rs),
        ValueError,
        "invalid_block_ids must be non-negative, got -4",
    )


def test_a_failed_eviction_leaves_every_request_as_it_was(backend: ModuleType) -> None:
    # Blocks outside the pool reach evict_blocks, which refuses them: the requests must
    # not have been rolled back already.
    manager = FakeManager({"r1": [*R1_IDS[:99], 5000]}, num_blocks=1000)
    r1 = sync_r1()
    with pytest.raises(UnknownBlockError, match="block id 5000 is out of range"):
        backend.handle_invalid_blocks(manager, {R1_IDS[50]}, {"r1": 16}, running=[r1])
    assert r1.num_computed_tokens == 1600


@pytest.mark.parametrize("mode", ["vllm", "strict"])
def test_recompute_in_strict_mode_leaves_no_stale_block_reachable(
    backend: ModuleType, mode: str
) -> None:
    """vLLM's recompute keeps invalid blocks hashed until they are rewritten, so a prefix
    hit meanwhile reads stale KV; strict mode evicts the rescheduled request's tail."""
    hasher = backend.BlockHasher(4, "sha256", "0")
    manager = backend.KVCacheManager(64, 4)
    prompt = list(range(17))
    r1 = backend.Request("r1", prompt, block_hasher=hasher)
    assert manager.allocate_slots(r1, 17) is not None
    r1.num_computed_tokens = 17
    table = manager.get_block_ids("r1")[0]
    outcome = backend.handle_invalid_blocks(
        manager, {table[1]}, {"r1": 1}, running=[r1], policy="recompute", mode=mode
    )
    assert outcome.rescheduled_req_ids == {"r1"}
    assert r1.num_computed_tokens == 4
    probe = backend.Request("probe", prompt, block_hasher=hasher)
    hits, num_hit = manager.get_computed_blocks(probe)
    if mode == "strict":
        assert outcome.evicted_block_ids == set(table[1:])
        assert hits == table[:1] and num_hit == 4
    else:
        assert outcome.evicted_block_ids == set()
        assert hits == table[:4] and num_hit == 16  # the stale blocks are still hit
    manager.block_pool.check_invariants()


def test_outcome_reprs_match_the_reference(backend: ModuleType) -> None:
    """Both result types show their fields as the reference does (sets as Python sets)."""
    outcome = backend.InvalidBlocksOutcome(set(), {"a"}, set(), {7}, 16)
    assert repr(outcome) == (
        "InvalidBlocksOutcome(failed_req_ids=set(), rescheduled_req_ids={'a'}, "
        "retry_req_ids=set(), evicted_block_ids={7}, total_affected_tokens=16)"
    )
    result = backend.rollback_invalid_blocks([[1, 2, 3], [4, 5]], [48, 32], [0, 0], [2], 16)
    assert repr(result) == (
        "RollbackResult(num_computed_tokens=[16, 32], affected=[0], "
        "total_affected_tokens=32, blocks_to_evict=[2, 3])"
    )


def test_outcomes_compare_by_value_and_are_unhashable(backend: ModuleType) -> None:
    """Their fields are lists and sets, so neither result type has a hash."""
    outcome = backend.InvalidBlocksOutcome(set(), {"a"}, set(), {7}, 16)
    assert outcome == backend.InvalidBlocksOutcome(set(), {"a"}, set(), {7}, 16)
    result = backend.RollbackResult([16], [0], 32, [2])
    assert result == backend.RollbackResult([16], [0], 32, [2])
    for value in (outcome, result):
        assert type(value).__hash__ is None
        with pytest.raises(TypeError, match="unhashable type"):
            hash(value)


def test_waiting_for_remote_kvs_none_is_refused(backend: ModuleType) -> None:
    manager = backend.KVCacheManager(4, 4)
    assert backend.handle_invalid_blocks(manager, [1], {}, running=[]).total_affected_tokens == 0
    with pytest.raises(TypeError, match="'NoneType' object is not iterable"):
        backend.handle_invalid_blocks(manager, [1], {}, running=[], waiting_for_remote_kvs=None)


def test_results_compare_as_values(backend: ModuleType) -> None:
    args = ([[1, 2, 3], [4, 5]], [48, 32], [0, 0], [2], 16)
    assert backend.rollback_invalid_blocks(*args) == backend.rollback_invalid_blocks(*args)
    outcome = backend.InvalidBlocksOutcome(set(), {"a"}, set(), {7}, 16)
    assert outcome == backend.InvalidBlocksOutcome(set(), {"a"}, set(), {7}, 16)
    assert outcome != backend.InvalidBlocksOutcome(set(), {"b"}, set(), {7}, 16)
    assert outcome.__eq__("outcome") is NotImplemented


class OrderRecordingManager:
    """One request's table ``[1, 2, 7, 15]``; records each eviction in the order given."""

    block_size = 4
    num_kv_cache_groups = 1

    def __init__(self) -> None:
        self.evicted: list[list[int]] = []

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return ([1, 2, 7, 15],)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.evicted.append(list(block_ids))


def test_outcome_sets_keep_the_order_they_were_built_in(backend: ModuleType) -> None:
    # Blocks 7 and 15 share a slot of a small set's table, so a set built again from the
    # evicted one iterates 2, 7, 15: the outcome hands out vLLM's set itself.
    manager = OrderRecordingManager()
    outcome_ = backend.handle_invalid_blocks(
        manager, [2], {"r": 0}, running=[Req("r", 16)], policy="fail"
    )
    assert manager.evicted == [[2, 15, 7]]
    assert list(outcome_.evicted_block_ids) == [2, 15, 7]
