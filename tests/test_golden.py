"""Replays every golden vector (produced by running vLLM 0.33.0's own code) on both backends.

The vectors live in ``tests/golden/`` (see ``tests/golden/README.md`` for where they come
from and ``FORMAT.md`` for their format). Every case is replayed exactly: the same block
ids in the same order, the same free-queue order, ref counts, cached map, hashes byte for
byte, rolled-back token counts and evictions.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from golden_cases import golden_params
from kvblocks.errors import NoFreeBlocksError, UnsupportedLayoutError
from support import FakeManager, Req


def extra_key_from_json(value: Any) -> Any:
    """JSON lists stand for tuples and ``{"bytes": hex}`` for bytes (see FORMAT.md)."""
    if isinstance(value, list):
        return tuple(extra_key_from_json(v) for v in value)
    if isinstance(value, dict):
        return bytes.fromhex(value["bytes"])
    return value


# --------------------------------------------------------------------------- block pool


def pool_state(pool: Any, with_free_order: bool) -> dict[str, Any]:
    """The pool's observable state in the golden files' shape."""
    ref_cnt: dict[str, int] = {}
    cached: dict[str, str] = {}
    for block_id in range(1, pool.num_blocks):
        block = pool.get_block(block_id)
        if block.ref_cnt:
            ref_cnt[str(block_id)] = block.ref_cnt
        if block.block_hash is not None:
            cached[str(block_id)] = f"{block.block_hash.hex()}:{block.group_id}"
    usage = pool.get_usage()
    assert usage == 1.0 - pool.get_num_free_blocks() / (pool.num_blocks - 1)
    state: dict[str, Any] = {
        "num_free": pool.get_num_free_blocks(),
        # The generator rounded usage to 12 decimal places.
        "usage": round(usage, 12),
        "ref_cnt": ref_cnt,
        "cached": cached,
    }
    if with_free_order:
        state["free_order"] = pool.free_block_ids()
    return state


@pytest.mark.parametrize("case", golden_params("block_pool"))
def test_block_pool(backend: ModuleType, case: dict[str, Any]) -> None:
    pool = backend.BlockPool(case["num_blocks"], case["enable_caching"])
    pool.check_invariants()
    for step, op in enumerate(case["ops"]):
        name = op["op"]
        where = f"op {step} ({name})"
        if name == "get_new_blocks":
            if "error" in op:
                assert op["error"] == "ValueError"
                with pytest.raises(NoFreeBlocksError):
                    pool.get_new_blocks(op["n"])
            else:
                assert pool.get_new_blocks(op["n"]) == op["result"], where
        elif name == "free_blocks":
            pool.free_blocks(op["ids"])
        elif name == "touch":
            pool.touch(op["ids"])
        elif name == "cache_full_blocks":
            pool.cache_full_blocks(
                op["ids"],
                [bytes.fromhex(h) for h in op["block_hashes"]],
                op["num_cached_blocks"],
                op["num_full_blocks"],
                op["group_id"],
            )
        elif name == "get_cached_block":
            got = pool.get_cached_block(bytes.fromhex(op["hash"]), op["group_ids"])
            assert got == op["result"], where
        elif name == "evict_blocks":
            pool.evict_blocks(op["ids"])
        elif name == "reset_prefix_cache":
            assert pool.reset_prefix_cache() is op["result"], where
        else:
            pytest.fail(f"unknown golden op {name!r}")
        pool.check_invariants()
        expected = op["state"]
        assert pool_state(pool, "free_order" in expected) == expected, where


# --------------------------------------------------------------------------- hashing


@pytest.mark.parametrize("case", golden_params("hashes"))
def test_hashes(backend: ModuleType, case: dict[str, Any]) -> None:
    hasher = backend.BlockHasher(case["block_size"], case["algo"], case["seed"])
    assert hasher.none_hash.hex() == case["none_hash"]
    extra_keys = [extra_key_from_json(e) for e in case["extra_keys"]]
    hashes = hasher.hash_blocks(case["token_ids"], extra_keys=extra_keys)
    assert [h.hex() for h in hashes] == case["block_hashes"]
    # The chain, one block at a time, gives the same hashes.
    parent: bytes | None = None
    size = case["block_size"]
    for i, expected in enumerate(case["block_hashes"]):
        tokens = case["token_ids"][i * size : (i + 1) * size]
        parent = hasher.hash_block(parent, tokens, extra_keys[i])
        assert parent.hex() == expected


# --------------------------------------------------------------------------- manager


@pytest.mark.parametrize("case", golden_params("manager"))
def test_manager(backend: ModuleType, case: dict[str, Any]) -> None:
    hasher = backend.BlockHasher(case["block_size"], case["hash_algo"], case["seed"])
    assert hasher.none_hash.hex() == case["none_hash"]
    manager = backend.KVCacheManager(case["num_blocks"], case["block_size"])
    live: dict[str, Any] = {}
    for step, op in enumerate(case["ops"]):
        where = f"op {step} ({op['op']} {op['req_id']})"
        if op["op"] == "add":
            request = backend.Request(op["req_id"], op["token_ids"], block_hasher=hasher)
            computed, num_computed = manager.get_computed_blocks(request)
            assert computed == op["computed_block_ids"], where
            assert num_computed == op["num_computed_tokens"], where
            allocated = manager.allocate_slots(
                request, op["num_new_tokens"], num_computed, computed
            )
            assert allocated == op["allocated"], where
            if allocated is not None:
                request.num_computed_tokens = len(op["token_ids"])
                live[op["req_id"]] = request
        elif op["op"] == "decode":
            request = live[op["req_id"]]
            request.append_output_token_ids(op["token_id"])
            allocated = manager.allocate_slots(request, 1)
            assert allocated == op["allocated"], where
            if allocated is not None:
                request.num_computed_tokens += 1
        elif op["op"] == "free":
            manager.free(live.pop(op["req_id"]))
        else:
            pytest.fail(f"unknown golden op {op['op']!r}")
        manager.block_pool.check_invariants()
        assert manager.block_pool.get_num_free_blocks() == op["num_free"], where
        tables = {rid: manager.get_block_ids(rid)[0] for rid in live}
        assert tables == op["block_ids"], where


# --------------------------------------------------------------------------- rollback


def golden_requests(case: dict[str, Any]) -> list[Req]:
    return [Req(r["req_id"], r["num_computed_tokens"]) for r in case["requests"]]


def table_manager(case: dict[str, Any]) -> FakeManager:
    return FakeManager(
        {r["req_id"]: r["block_ids"] for r in case["requests"]},
        block_size=case["block_size"],
        num_kv_cache_groups=case.get("num_kv_cache_groups", 1),
    )


@pytest.mark.parametrize("case", golden_params("rollback"))
def test_rollback_update_requests(backend: ModuleType, case: dict[str, Any]) -> None:
    requests = golden_requests(case)
    affected, total, to_evict = backend.update_requests_with_invalid_blocks(
        table_manager(case),
        requests,
        set(case["invalid_block_ids"]),
        case["num_scheduled_tokens"],
        evict_blocks=case["evict_blocks"],
    )
    expect = case["expect"]
    assert affected == set(expect["affected_req_ids"])
    assert total == expect["total_affected_tokens"]
    assert to_evict == set(expect["blocks_to_evict"])
    assert {r.request_id: r.num_computed_tokens for r in requests} == expect["num_computed_tokens"]


@pytest.mark.parametrize("case", golden_params("rollback"))
def test_rollback_batch_primitive(backend: ModuleType, case: dict[str, Any]) -> None:
    reqs = case["requests"]
    scheduled = case["num_scheduled_tokens"]
    result = backend.rollback_invalid_blocks(
        [r["block_ids"] for r in reqs],
        [r["num_computed_tokens"] for r in reqs],
        [scheduled.get(r["req_id"], 0) for r in reqs],
        case["invalid_block_ids"],
        case["block_size"],
        collect_evictions=case["evict_blocks"],
    )
    expect = case["expect"]
    assert {reqs[i]["req_id"] for i in result.affected} == set(expect["affected_req_ids"])
    assert list(result.affected) == sorted(result.affected)
    assert result.total_affected_tokens == expect["total_affected_tokens"]
    assert list(result.blocks_to_evict) == sorted(expect["blocks_to_evict"])
    assert (
        dict(zip([r["req_id"] for r in reqs], result.num_computed_tokens, strict=True))
        == expect["num_computed_tokens"]
    )


@pytest.mark.parametrize("case", golden_params("handle_invalid"))
def test_handle_invalid_blocks(backend: ModuleType, case: dict[str, Any]) -> None:
    manager = table_manager(case)
    requests = golden_requests(case)
    states = [r["state"] for r in case["requests"]]
    running = [r for r, s in zip(requests, states, strict=True) if s == "running"]
    waiting = [r for r, s in zip(requests, states, strict=True) if s == "waiting_for_remote_kvs"]
    before = {r.request_id: r.num_computed_tokens for r in requests}

    def call() -> Any:
        return backend.handle_invalid_blocks(
            manager,
            set(case["invalid_block_ids"]),
            case["num_scheduled_tokens"],
            running=running,
            waiting_for_remote_kvs=waiting,
            policy=case["policy"],
        )

    expect = case["expect"]
    if "error" in expect:
        assert expect["error"] == "RuntimeError"
        with pytest.raises(UnsupportedLayoutError):
            call()
        assert {r.request_id: r.num_computed_tokens for r in requests} == before
        assert manager.evict_calls == []
        return
    outcome = call()
    returned = outcome.failed_req_ids if case["policy"] == "fail" else outcome.rescheduled_req_ids
    assert returned == set(expect["returned_req_ids"])
    assert outcome.retry_req_ids == set(expect["failed_recving_req_ids"])
    assert outcome.evicted_block_ids == set(expect["evicted_block_ids"])
    assert len(manager.evict_calls) == expect["evict_calls"]
    if manager.evict_calls:
        assert manager.evict_calls[0] == set(expect["evicted_block_ids"])
    assert {r.request_id: r.num_computed_tokens for r in requests} == expect["num_computed_tokens"]
