"""Inside vLLM, kvblocks' manager does with an argument exactly what vLLM's own does.

Each test makes the same calls on vLLM 0.33.0's ``KVCacheManager`` and on
``kvblocks.vllm.KVCacheManager``, built from the same arguments with twin requests, and
compares what came back: the block ids, or the class of the exception. The arguments are
the odd ones vLLM's scheduler can pass (a negative ``cache_blocks`` count from its async
spec-decode path) or that vLLM's manager takes without complaint; the manager-level
lockstep machine (``test_manager_lockstep.py``) draws them at random.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import harness
import pytest
from kvblocks.vllm import KVCacheManager
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

BLOCK_SIZE = 4
#: Either manager: the tests call vLLM's surface, which both have.
Manager = Any


def twins(**overrides: Any) -> tuple[Manager, Manager]:
    """vLLM's manager and kvblocks', from the same arguments."""
    kwargs: dict[str, Any] = {
        "kv_cache_config": harness.build_kv_cache_config(16, BLOCK_SIZE),
        "max_model_len": 256,
        "scheduler_block_size": BLOCK_SIZE,
        "hash_block_size": BLOCK_SIZE,
        **overrides,
    }
    return VllmKVCacheManager(**kwargs), KVCacheManager(**kwargs)


def make_request(req_id: str, num_tokens: int) -> Request:
    init_none_hash(sha256)
    return Request(
        request_id=req_id,
        prompt_token_ids=list(range(num_tokens)),
        sampling_params=SamplingParams(max_tokens=8),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


class Raised:
    """An exception's class, as an outcome: equal to a raised subclass (kvblocks'
    errors subclass the built-in class vLLM raises)."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, cls: type[BaseException]) -> None:
        self.cls = cls

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Raised) and issubclass(other.cls, self.cls)

    def __repr__(self) -> str:
        return f"Raised({self.cls.__name__})"


def outcome(call: Callable[[], Any]) -> Any:
    """What a call gave, as plain values: block ids, or the exception's class."""
    try:
        result = call()
    except Exception as exc:
        return Raised(type(exc))
    if isinstance(result, tuple):
        return tuple(r.get_block_ids() if hasattr(r, "get_block_ids") else r for r in result)
    return result.get_block_ids() if hasattr(result, "get_block_ids") else result


def same(
    managers: tuple[Manager, Manager],
    requests: dict[str, tuple[Request, Request]],
    call: Callable[[Manager, dict[str, Request]], Any],
) -> Any:
    """Runs ``call`` on both managers (each with its own requests); asserts the outcomes
    and the managers' observable state are equal; returns kvblocks' outcome."""
    theirs, ours = managers
    expected = outcome(lambda: call(theirs, {k: v[0] for k, v in requests.items()}))
    got = outcome(lambda: call(ours, {k: v[1] for k, v in requests.items()}))
    assert expected == got
    for req_id in requests:
        assert ours.get_block_ids(req_id) == theirs.get_block_ids(req_id), req_id
    assert ours.block_pool.get_num_free_blocks() == theirs.block_pool.get_num_free_blocks()
    cached = [dict(m.coordinator.single_type_managers[0].num_cached_block) for m in managers]
    assert cached[1] == cached[0]
    assert [stored_hashes(e) for e in ours.take_events()] == [
        stored_hashes(e) for e in theirs.take_events()
    ]
    return got


def stored_hashes(event: Any) -> tuple[str, Any]:
    """An event's kind and the hashes it names."""
    return type(event).__name__, getattr(event, "block_hashes", None)


def pair(req_id: str, num_tokens: int) -> tuple[Request, Request]:
    return make_request(req_id, num_tokens), make_request(req_id, num_tokens)


def cache_blocks(m: Manager, r: dict[str, Request], *, count: int) -> None:
    m.cache_blocks(r["r"], count)


def block_ids_for_computed_tokens(m: Manager, _: object, *, tokens: int) -> Any:
    return m.get_block_ids_for_computed_tokens("r", tokens)


def num_blocks_to_allocate(m: Manager, _: object, *, tokens: int) -> Any:
    no_hits = KVCacheBlocks(([],)).blocks
    return m.coordinator.get_num_blocks_to_allocate("r", tokens, no_hits, 0, 0, 0, 0)


def test_a_negative_cache_blocks_count_does_nothing() -> None:
    # vLLM's async spec-decode path passes num_computed_tokens - num_in_flight_tokens,
    # which can be -1: vLLM's floor division caches nothing.
    managers = twins()
    reqs = {"r": pair("r", 10)}
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 10, delay_cache_blocks=True))
    for count in (-1, -5, -(2**40)):
        same(managers, reqs, partial(cache_blocks, count=count))
    assert managers[1].get_blocks("r").get_unhashed_block_ids() == [1, 2, 3]
    same(managers, reqs, lambda m, r: m.cache_blocks(r["r"], 8))
    assert managers[1].get_blocks("r").get_unhashed_block_ids() == [3]


def test_cache_blocks_past_the_table_caches_what_is_there_and_counts_the_rest() -> None:
    managers = twins()
    reqs = {"r": pair("r", 17), "s": pair("s", 17)}
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 8, delay_cache_blocks=True))
    same(managers, reqs, lambda m, r: m.cache_blocks(r["r"], 17))
    for req in reqs["r"]:
        req.num_computed_tokens = 8
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 9))
    # vLLM counted blocks 2 and 3 as cached though it had not allocated them yet.
    assert managers[1].get_blocks("r").get_unhashed_block_ids() == [3, 4, 5]
    same(managers, reqs, lambda m, r: m.get_computed_blocks(r["s"]))
    # A request vLLM has never seen: nothing cached, the count remembered.
    same(managers, reqs, lambda m, r: m.cache_blocks(r["s"], 17))
    same(managers, reqs, lambda m, r: m.free(r["s"]))


def test_cache_blocks_past_the_hashed_blocks_is_taken_as_vllm_takes_it() -> None:
    # The table holds blocks whose hashes are gone (a streaming update cut the list):
    # vLLM 0.33 caches up to the hashed blocks; earlier releases cache those, then fail
    # indexing the next hash.
    managers = twins()
    reqs = {"r": pair("r", 12)}
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 12, delay_cache_blocks=True))
    for req in reqs["r"]:
        del req.block_hashes[1:]
    same(managers, reqs, lambda m, r: m.cache_blocks(r["r"], 12))
    assert managers[1].get_blocks("r").get_unhashed_block_ids() == [2, 3]


def test_odd_allocate_slots_counts_are_taken_as_vllm_takes_them() -> None:
    managers = twins()
    reqs = {"r": pair("r", 10)}
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 0))
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], -3))
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 6, num_lookahead_tokens=-2))
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 2, reserved_blocks=-4))
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 2, num_encoder_tokens=7))
    same(
        managers,
        reqs,
        lambda m, r: m.allocate_slots(r["r"], 2, num_external_computed_tokens=-5),
    )


def test_odd_lookups_and_slices_are_taken_as_vllm_takes_them() -> None:
    managers = twins()
    reqs = {"r": pair("r", 13), "e": pair("e", 0)}
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 13))
    for tokens in (-9, -5, -4, -1, 0, 1, 5, 99):
        same(managers, reqs, partial(block_ids_for_computed_tokens, tokens=tokens))
    same(managers, reqs, lambda m, r: m.get_computed_blocks(r["e"]))
    if harness.TAKES_MAX_CACHE_HIT_LENGTH:
        same(managers, reqs, lambda m, r: m.get_computed_blocks(r["r"], -1))
        same(managers, reqs, lambda m, r: m.get_computed_blocks(r["r"], 10**6))
    for tokens in (-9, 0, 3, 64):
        same(managers, reqs, partial(num_blocks_to_allocate, tokens=tokens))


def test_evicting_odd_block_ids_fails_or_wraps_as_vllm_does() -> None:
    managers = twins()
    reqs = {"r": pair("r", 13)}
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 13))
    same(managers, reqs, lambda m, _: m.evict_blocks({16}))
    same(managers, reqs, lambda m, _: m.evict_blocks({-16}))
    same(managers, reqs, lambda m, _: m.evict_blocks({-17}))
    # -15 is block 1 from the end of the list: its hash goes.
    same(managers, reqs, lambda m, _: m.evict_blocks({-15}))
    assert managers[1].get_blocks("r").get_unhashed_block_ids() == [1, 4]


@pytest.mark.parametrize("log_stats", [False, True])
def test_prefix_cache_stats_is_vllms_attribute(log_stats: bool) -> None:
    theirs, ours = twins(log_stats=log_stats)
    if not log_stats:
        assert theirs.prefix_cache_stats is None
        assert ours.prefix_cache_stats is None
        return
    # Readers hold vLLM's accumulator while it grows (vLLM's own scheduler tests do).
    held = theirs.prefix_cache_stats, ours.prefix_cache_stats
    for m in (theirs, ours):
        r = make_request("r", 9)
        m.record_prefix_cache_stats(r, 4)
        m.record_prefix_cache_stats(r, -2)  # vLLM adds what it is given
        r.num_preemptions = 1
        m.record_prefix_cache_stats(r, 3)
    for m in (theirs, ours):
        m.allocate_slots(make_request("x", 3), 3)
        m.free(make_request("x", 3))
        assert m.reset_prefix_cache()
    assert held[1] == held[0]
    assert held[1] is not None
    assert (held[1].requests, held[1].hits, held[1].preempted_hits, held[1].reset) == (
        2,
        2,
        3,
        True,
    )
    assert ours.make_prefix_cache_stats() == theirs.make_prefix_cache_stats()
    assert ours.prefix_cache_stats == theirs.prefix_cache_stats
    assert ours.prefix_cache_stats is not None
    assert ours.prefix_cache_stats.requests == 0


@pytest.mark.parametrize(
    ("watermark", "error"),
    [(-0.5, AssertionError), (float("nan"), AssertionError), (float("inf"), OverflowError)],
)
def test_an_impossible_watermark_fails_as_in_vllm(watermark: float, error: type[Exception]) -> None:
    # vLLM asserts watermark >= 0.0, then int(watermark * num_blocks) overflows on inf.
    for cls in (VllmKVCacheManager, KVCacheManager):
        with pytest.raises(error):
            cls(
                kv_cache_config=harness.build_kv_cache_config(16, BLOCK_SIZE),
                max_model_len=256,
                scheduler_block_size=BLOCK_SIZE,
                hash_block_size=BLOCK_SIZE,
                watermark=watermark,
            )


def test_adopting_into_a_held_table_asserts_after_the_capacity_check() -> None:
    # Caching off: vLLM never counts the request as running, so external tokens make it
    # adopt; no room returns None first, room reaches vLLM's assert.
    managers = twins(enable_caching=False, kv_cache_config=harness.build_kv_cache_config(3, 4))
    reqs = {"r": pair("r", 12)}
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 4))
    no_room = same(
        managers, reqs, lambda m, r: m.allocate_slots(r["r"], 8, num_external_computed_tokens=4)
    )
    assert no_room is None
    room = same(
        managers, reqs, lambda m, r: m.allocate_slots(r["r"], 1, num_external_computed_tokens=1)
    )
    assert room == Raised(AssertionError)


def test_caching_past_the_table_with_events_fails_as_vllm_does() -> None:
    managers = twins(enable_kv_cache_events=True)
    reqs = {"r": pair("r", 17)}
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 8, delay_cache_blocks=True))
    assert same(managers, reqs, lambda m, r: m.cache_blocks(r["r"], 17)) == Raised(IndexError)
    assert managers[1].get_blocks("r").get_unhashed_block_ids() == []
    # `same` compared the events: none was recorded on either side.
    assert not managers[1].take_events()


def test_truncating_a_lookup_asserts_and_slices_as_vllm_does() -> None:
    managers = twins()
    reqs = {"r": pair("r", 13), "s": pair("s", 13)}
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 13))
    hits = {id(m): m.get_computed_blocks(r)[0] for m, r in zip(managers, reqs["s"], strict=True)}
    # 12 tokens hit: blocks 1, 2 and 3. -4 tokens is Python's [:-1].
    for tokens, kept in ((8, [1, 2]), (0, []), (-4, [1, 2]), (12, [1, 2, 3])):
        got = same(managers, reqs, partial(truncate_computed_blocks, hits=hits, tokens=tokens))
        assert got == (kept,), tokens
    for tokens in (6, 16):
        got = same(managers, reqs, partial(truncate_computed_blocks, hits=hits, tokens=tokens))
        assert got == Raised(AssertionError), tokens


def truncate_computed_blocks(m: Manager, _: object, *, hits: dict[int, Any], tokens: int) -> Any:
    return m.truncate_computed_blocks(hits[id(m)], tokens)


def test_the_views_vllms_tests_read_agree() -> None:
    # vLLM's own scheduler tests read the group's req_to_blocks and num_cached_block,
    # and the pool's blocks and free_block_queue.
    managers = twins()
    reqs = {"r": pair("r", 13), "s": pair("s", 6)}
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 13))
    same(managers, reqs, lambda m, r: m.allocate_slots(r["s"], 6, delay_cache_blocks=True))
    theirs, ours = managers

    def views(m: Manager) -> tuple[Any, ...]:
        group = m.coordinator.single_type_managers[0]
        pool = m.block_pool
        # Membership first: vLLM's defaultdict grows when an unknown id is read.
        return (
            sorted(group.req_to_blocks),
            "r" in group.req_to_blocks,
            "x" in group.req_to_blocks,
            {k: [b.block_id for b in group.req_to_blocks[k]] for k in ("r", "s")},
            dict(group.num_cached_block),
            pool.free_block_queue.num_free_blocks,
            [(b.block_id, b.ref_cnt) for b in pool.blocks],
            pool.blocks[-1].block_id,
            len(pool.blocks),
        )

    assert views(ours) == views(theirs)
    same(managers, reqs, lambda m, r: m.free(r["r"]))
    assert views(ours) == views(theirs)


def test_an_empty_result_other_than_vllms_own_is_adopted() -> None:
    # vLLM tests new_computed_blocks against its shared empty result by identity: any
    # other result, even empty, makes a new request adopt it (and count as running).
    managers = twins(enable_caching=False, kv_cache_config=harness.build_kv_cache_config(3, 4))
    reqs = {"r": pair("r", 4), "s": pair("s", 4)}
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 4))
    fresh = lambda m, r: m.allocate_slots(  # noqa: E731
        r["r"], 4, new_computed_blocks=m.empty_kv_cache_blocks.new_empty()
    )
    assert same(managers, reqs, fresh) == Raised(AssertionError)
    same(
        managers,
        reqs,
        lambda m, r: m.allocate_slots(r["s"], 4, new_computed_blocks=m.empty_kv_cache_blocks),
    )
    same(
        managers,
        reqs,
        lambda m, r: m.allocate_slots(
            r["s"], 4, new_computed_blocks=m.empty_kv_cache_blocks.new_empty()
        ),
    )


@pytest.mark.parametrize("events", [False, True])
def test_caching_past_the_table_inside_allocate_slots(events: bool) -> None:
    # A negative lookahead leaves the table short of the tokens to cache: vLLM caches
    # the blocks there and counts the rest (with events on, IndexError after it has
    # allocated). Slots capped by max_model_len do the same.
    managers = twins(enable_kv_cache_events=events)
    reqs = {"r": pair("r", 12)}
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 8, num_lookahead_tokens=-4))
    capped = twins(enable_kv_cache_events=events, max_model_len=8)
    reqs = {"r": pair("r", 16)}
    same(capped, reqs, lambda m, r: m.allocate_slots(r["r"], 16))


def test_external_blocks_are_sized_by_the_uncapped_count() -> None:
    managers = twins(max_model_len=8)
    reqs = {"r": pair("r", 16)}
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 4, num_external_computed_tokens=12))


def test_the_pool_evicts_as_vllms_pool_does() -> None:
    managers = twins()
    reqs = {"r": pair("r", 13)}
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 13))
    same(managers, reqs, lambda m, _: m.block_pool.evict_blocks({-15}))
    same(managers, reqs, lambda m, _: m.block_pool.evict_blocks({16}))
    # vLLM evicts in the set's order and stops at the id it refuses.
    got = same(managers, reqs, lambda m, _: m.evict_blocks({2, 3, 100}))
    assert got == Raised(AssertionError)
    assert managers[1].get_blocks("r").get_unhashed_block_ids() == [1, 2, 3, 4]


def test_the_block_count_asserts_only_for_a_running_request_with_hits() -> None:
    # Caching off: no request is running in vLLM's sense, so hits are counted, not refused.
    managers = twins(enable_caching=False)
    reqs = {"r": pair("r", 8), "s": pair("s", 8)}
    same(managers, reqs, lambda m, r: m.allocate_slots(r["r"], 8))
    for req_id in ("r", "s"):
        got = same(managers, reqs, partial(count_with_a_hit, req_id=req_id))
        assert isinstance(got, int), got


def count_with_a_hit(m: Manager, _: object, *, req_id: str) -> Any:
    hit = list(m.get_blocks("r").blocks[0][:1])
    return m.coordinator.get_num_blocks_to_allocate(req_id, 12, (hit,), 0, 0, 0, 0)
