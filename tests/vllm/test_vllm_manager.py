"""kvblocks.vllm.KVCacheManager called directly, at the edges the Scheduler's runs do not
reach: a rewritten ``block_hashes`` list, stats off, errors that name the attribute,
deferred frees, MLA's event annotation."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import harness
import pytest
import torch
from kvblocks.vllm import KVCacheManager
from vllm.distributed.kv_events import BlockStored
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

BLOCK_SIZE = 4


def manager(**overrides: Any) -> KVCacheManager:
    kwargs: dict[str, Any] = {
        "kv_cache_config": harness.build_kv_cache_config(16, BLOCK_SIZE),
        "max_model_len": 256,
        "scheduler_block_size": BLOCK_SIZE,
        "hash_block_size": BLOCK_SIZE,
        **overrides,
    }
    return KVCacheManager(**kwargs)


def hashes(*seeds: int) -> list[bytes]:
    return [bytes([s]) * 32 for s in seeds]


def request(req_id: str, num_tokens: int, block_hashes: list[bytes]) -> Any:
    return SimpleNamespace(
        request_id=req_id,
        num_tokens=num_tokens,
        num_computed_tokens=0,
        block_hashes=block_hashes,
        skip_reading_prefix_cache=False,
        num_preemptions=0,
    )


def test_a_rewritten_block_hashes_list_is_read_again() -> None:
    # vLLM cuts and regrows block_hashes in place (a streaming session's update): the
    # hashes read before must not be cached for the blocks any more.
    m = manager()
    r = request("r", 9, hashes(1, 2))
    assert m.get_computed_blocks(r)[1] == 0  # reads hash 1 (a miss)
    r.block_hashes[:] = hashes(7, 8)
    assert m.allocate_slots(r, 9) is not None
    assert m.get_computed_blocks(request("a", 9, hashes(7, 8)))[1] == 2 * BLOCK_SIZE
    assert m.get_computed_blocks(request("b", 9, hashes(1, 2)))[1] == 0
    # Appending (vLLM's usual case) keeps what was read.
    r.block_hashes.append(hashes(9)[0])
    r.num_computed_tokens, r.num_tokens = 9, 13
    m.allocate_slots(r, 4)
    hit = m.get_computed_blocks(request("c", 13, hashes(7, 8, 9)))
    assert hit[1] == 3 * BLOCK_SIZE


def test_stats_off_reads_and_checks_nothing() -> None:
    m = manager(log_stats=False)
    m.record_prefix_cache_stats(request("r", 4, []), 9)  # vLLM returns at once
    assert m.make_prefix_cache_stats() is None
    on = manager(log_stats=True)
    # vLLM's PrefixCacheStats.record adds what it is given; so does kvblocks inside vLLM.
    on.record_prefix_cache_stats(request("r", 4, []), 9)
    on.record_prefix_cache_stats(request("s", 2, []), -1)
    stats = on.make_prefix_cache_stats()
    assert stats is not None
    assert (stats.requests, stats.queries, stats.hits) == (2, 6, 8)


def test_a_bad_request_attribute_is_named() -> None:
    m = manager()
    bad = request("r", 9, hashes(1, 2))
    bad.num_computed_tokens = None
    with pytest.raises(TypeError, match=r"^request\.num_computed_tokens: "):
        m.allocate_slots(bad, 9)
    bad = request("r", 9, hashes(1, 2))
    bad.block_hashes = 5
    with pytest.raises(TypeError, match=r"^request\.block_hashes: "):
        m.get_computed_blocks(bad)
    assert m.usage == 0.0, "a refused call changes nothing"


def test_popped_blocks_come_back_to_the_pool_through_block_pool() -> None:
    m = manager()
    r = request("r", 9, hashes(1, 2))
    m.allocate_slots(r, 9)
    free = m.block_pool.get_num_free_blocks()
    blocks = m.pop_blocks_for_free(r)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert m.get_block_ids("r") == ([],)
    assert m.block_pool.get_num_free_blocks() == free, "still held"
    m.block_pool.free_blocks(reversed(blocks))
    assert m.block_pool.get_num_free_blocks() == free + 3


def test_mla_events_are_annotated_as_vllm_annotates_them() -> None:
    spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)]
    )
    m = manager(kv_cache_config=config, enable_kv_cache_events=True)
    r = request("r", 9, hashes(1, 2))
    r.all_token_ids = list(range(9))
    m.allocate_slots(r, 9)
    (stored,) = m.take_events()
    assert isinstance(stored, BlockStored), type(stored)
    assert stored.kv_cache_spec_kind == "mla_attention"
