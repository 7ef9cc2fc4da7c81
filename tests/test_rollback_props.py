"""Properties of the rollback on random batches, for each backend.

* ``mode="vllm"`` equals vLLM 0.33.0's ``_update_requests_with_invalid_blocks``,
  transliterated below line by line, and so both backends agree with each other;
* ``mode="strict"`` leaves no invalid block within any request's pre-step tokens;
* counts are never negative nor raised;
* ``handle_invalid_blocks`` is the two passes plus the policy;
* on arbitrary (often hostile) input every backend raises exactly what the reference
  raises, and changes nothing when it does.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvblocks.reference import scheduler as reference
from support import FakeManager, Req, examples, outcome

# `backend` is a module: nothing to reset between examples.
PROPERTY = settings(
    max_examples=examples(300),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@dataclass(slots=True)
class Batch:
    """A valid random batch; ids come from a small range so blocks are shared."""

    block_size: int
    tables: list[list[int]]
    computed: list[int]
    scheduled: list[int]
    invalid: set[int]

    @property
    def ids(self) -> list[str]:
        return [f"req-{i}" for i in range(len(self.tables))]

    def requests(self) -> list[Req]:
        return [Req(rid, n) for rid, n in zip(self.ids, self.computed, strict=True)]

    def manager(self) -> FakeManager:
        return FakeManager(dict(zip(self.ids, self.tables, strict=True)), self.block_size)

    def scheduled_map(self) -> dict[str, int]:
        # Requests with nothing scheduled are left out, as vLLM's dict does.
        return {rid: s for rid, s in zip(self.ids, self.scheduled, strict=True) if s}


@st.composite
def batches(draw: st.DrawFn, max_requests: int = 8) -> Batch:
    block_size = draw(st.integers(1, 5))
    tables, computed, scheduled = [], [], []
    for _ in range(draw(st.integers(0, max_requests))):
        table = draw(st.lists(st.integers(0, 11), max_size=7))
        full = len(table) * block_size
        before = draw(st.sampled_from([full, draw(st.integers(0, full))]))
        s = draw(st.integers(0, 9))
        tables.append(table)
        computed.append(before + s)
        scheduled.append(s)
    invalid = draw(st.sets(st.integers(0, 13), max_size=5))
    return Batch(block_size, tables, computed, scheduled, invalid)


def vllm_update_requests_with_invalid_blocks(
    manager: FakeManager,
    requests: list[Req],
    invalid_block_ids: set[int],
    num_scheduled_tokens: dict[str, int],
    evict_blocks: bool = True,
) -> tuple[set[str], int, set[int]]:
    """vLLM 0.33.0's method, transliterated (``self`` is the manager)."""
    affected_req_ids: set[str] = set()
    total_affected_tokens = 0
    blocks_to_evict: set[int] = set()
    marked_invalid_block_ids: set[int] = set()
    for request in requests:
        is_affected = False
        marked_invalid_block = False
        req_id = request.request_id
        (req_block_ids,) = manager.get_block_ids(req_id)
        req_num_computed_tokens = request.num_computed_tokens - num_scheduled_tokens.get(req_id, 0)
        req_num_computed_blocks = (
            req_num_computed_tokens + manager.block_size - 1
        ) // manager.block_size
        for idx, block_id in zip(range(req_num_computed_blocks), req_block_ids, strict=False):
            if block_id not in invalid_block_ids:
                continue
            is_affected = True
            if block_id in marked_invalid_block_ids:
                continue
            marked_invalid_block_ids.add(block_id)
            if marked_invalid_block:
                continue
            marked_invalid_block = True
            request.num_computed_tokens = idx * manager.block_size
            total_affected_tokens += req_num_computed_tokens - request.num_computed_tokens
            if evict_blocks:
                blocks_to_evict.update(req_block_ids[idx:])
        if is_affected:
            if not marked_invalid_block:
                total_affected_tokens += request.num_computed_tokens - req_num_computed_tokens
                request.num_computed_tokens = req_num_computed_tokens
            affected_req_ids.add(req_id)
    return affected_req_ids, total_affected_tokens, blocks_to_evict


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@PROPERTY
@given(batch=batches(), evict=st.booleans())
def test_vllm_mode_equals_vllms_own_loop(backend: ModuleType, batch: Batch, evict: bool) -> None:
    expected_requests = batch.requests()
    expected = vllm_update_requests_with_invalid_blocks(
        batch.manager(), expected_requests, batch.invalid, batch.scheduled_map(), evict
    )
    requests = batch.requests()
    got = backend.update_requests_with_invalid_blocks(
        batch.manager(), requests, batch.invalid, batch.scheduled_map(), evict_blocks=evict
    )
    assert got == expected
    assert requests == expected_requests

    # The batch primitive, fed NumPy arrays, says the same.
    result = backend.rollback_invalid_blocks(
        [np.asarray(t, dtype=np.int64) for t in batch.tables],
        np.asarray(batch.computed, dtype=np.int64),
        np.asarray(batch.scheduled, dtype=np.int64),
        np.asarray(sorted(batch.invalid), dtype=np.int64),
        batch.block_size,
        collect_evictions=evict,
    )
    assert result.num_computed_tokens == [r.num_computed_tokens for r in expected_requests]
    assert {batch.ids[i] for i in result.affected} == expected[0]
    assert result.affected == sorted(result.affected)
    assert result.total_affected_tokens == expected[1]
    assert result.blocks_to_evict == sorted(expected[2])


@PROPERTY
@given(batch=batches())
def test_strict_mode_leaves_no_invalid_block_in_pre_step_tokens(
    backend: ModuleType, batch: Batch
) -> None:
    args = (batch.tables, batch.computed, batch.scheduled, batch.invalid, batch.block_size)
    strict = backend.rollback_invalid_blocks(*args, mode="strict")
    vllm = backend.rollback_invalid_blocks(*args)
    expected_evict: set[int] = set()
    for i, table in enumerate(batch.tables):
        before = batch.computed[i] - batch.scheduled[i]
        new = strict.num_computed_tokens[i]
        # The guarantee.
        kept_blocks = table[: cdiv(min(new, before), batch.block_size)]
        assert not set(kept_blocks) & batch.invalid, (i, table, new)
        scanned = table[: cdiv(before, batch.block_size)]
        first = next((j for j, b in enumerate(scanned) if b in batch.invalid), None)
        if first is None:
            assert new == batch.computed[i]
        else:
            assert new == first * batch.block_size
            expected_evict.update(table[first:])
        # Strict never keeps more than vLLM, and affects the same requests.
        assert new <= vllm.num_computed_tokens[i]
    assert strict.affected == vllm.affected
    assert strict.blocks_to_evict == sorted(expected_evict)


@PROPERTY
@given(batch=batches(), strict=st.booleans())
def test_counts_are_never_negative_nor_raised(
    backend: ModuleType, batch: Batch, strict: bool
) -> None:
    result = backend.rollback_invalid_blocks(
        batch.tables,
        batch.computed,
        batch.scheduled,
        batch.invalid,
        batch.block_size,
        mode="strict" if strict else "vllm",
    )
    rolled_back = 0
    for i, new in enumerate(result.num_computed_tokens):
        assert 0 <= new <= batch.computed[i]
        if i in result.affected:
            before = batch.computed[i] - batch.scheduled[i]
            assert new % batch.block_size == 0 or new == before
        else:
            assert new == batch.computed[i]
        rolled_back += batch.computed[i] - new
    assert 0 <= result.total_affected_tokens <= rolled_back
    assert all(b >= 0 for b in result.blocks_to_evict)


@PROPERTY
@given(
    waiting=batches(max_requests=4),
    running=batches(max_requests=4),
    policy=st.sampled_from(["fail", "recompute"]),
)
def test_handle_invalid_blocks_is_two_passes_and_the_policy(
    backend: ModuleType, waiting: Batch, running: Batch, policy: str
) -> None:
    # One manager and block size for both: rename the running requests and keep only
    # those their tables still cover at the waiting batch's block size.
    block_size, invalid = waiting.block_size, waiting.invalid
    keep = [
        i
        for i, t in enumerate(running.tables)
        if len(t) >= cdiv(running.computed[i] - running.scheduled[i], block_size)
    ]
    run_ids = [f"run-{i}" for i in keep]
    tables = dict(zip(waiting.ids, waiting.tables, strict=True))
    tables.update({rid: running.tables[i] for rid, i in zip(run_ids, keep, strict=True)})
    scheduled = {**waiting.scheduled_map()}
    scheduled.update({rid: running.scheduled[i] for rid, i in zip(run_ids, keep, strict=True)})

    def fresh() -> tuple[FakeManager, list[Req], list[Req]]:
        run = [Req(rid, running.computed[i]) for rid, i in zip(run_ids, keep, strict=True)]
        return FakeManager(tables, block_size), waiting.requests(), run

    manager, async_reqs, sync_reqs = fresh()
    outcome = backend.handle_invalid_blocks(
        manager,
        invalid,
        scheduled,
        running=sync_reqs,
        waiting_for_remote_kvs=async_reqs,
        policy=policy,
    )
    oracle, expected_async, expected_sync = fresh()
    a_ids, a_total, _ = vllm_update_requests_with_invalid_blocks(
        oracle, expected_async, invalid, scheduled, evict_blocks=False
    )
    s_ids, s_total, s_evict = vllm_update_requests_with_invalid_blocks(
        oracle, expected_sync, invalid, scheduled
    )
    assert async_reqs + sync_reqs == expected_async + expected_sync
    assert outcome.total_affected_tokens == a_total + s_total
    if policy == "fail":
        assert outcome.failed_req_ids == a_ids | s_ids
        assert outcome.rescheduled_req_ids == outcome.retry_req_ids == set()
        assert outcome.evicted_block_ids == s_evict
        assert manager.evict_calls == ([s_evict] if s_evict else [])
    else:
        assert outcome.failed_req_ids == set()
        assert (outcome.rescheduled_req_ids, outcome.retry_req_ids) == (s_ids, a_ids)
        assert outcome.evicted_block_ids == set()
        assert manager.evict_calls == []


small = st.integers(-2, 9)
hostile_args = st.tuples(
    st.lists(st.lists(st.integers(-2, 6), max_size=4), max_size=4),  # block tables
    st.lists(small, max_size=4),  # num_computed_tokens
    st.lists(small, max_size=4),  # num_scheduled_tokens
    st.sets(st.integers(-2, 6), max_size=3),  # invalid block ids
    st.integers(-1, 3),  # block size
)


@PROPERTY
@given(args=hostile_args, mode=st.sampled_from(["vllm", "strict", "other"]))
def test_every_backend_raises_what_the_reference_raises(
    backend: ModuleType,
    args: tuple[list[list[int]], list[int], list[int], set[int], int],
    mode: str,
) -> None:
    tables = args[0]
    snapshot = [list(t) for t in tables]
    got = outcome(lambda: backend.rollback_invalid_blocks(*args, mode=mode))
    expected = outcome(lambda: reference.rollback_invalid_blocks(*args, mode=mode))
    if got[0] == "ok" and expected[0] == "ok":
        for name in ("num_computed_tokens", "affected", "total_affected_tokens"):
            assert getattr(got[1], name) == getattr(expected[1], name)
        assert list(got[1].blocks_to_evict) == expected[1].blocks_to_evict
    else:
        assert got == expected
    assert tables == snapshot
