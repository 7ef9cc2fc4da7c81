"""kvblocks' schedulers hash vLLM's requests natively: ``add_request`` gives each request
kvblocks' ``BlockHasher``, whose hashes must be vLLM's own, request by request, for every
algorithm vLLM accepts and every extra key it adds; anything it cannot reproduce keeps
vLLM's hasher."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import harness
import pytest
from kvblocks._native import BlockHasher
from kvblocks.constants import HASH_ALGORITHMS
from kvblocks.vllm import KVBlocksScheduler
from kvblocks.vllm.hashing import native_block_hasher, use_native_hasher
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name, sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

BLOCK = 4

#: Extra-key kinds: the keyword arguments that give a request each kind.
EXTRA_KEYS: dict[str, dict[str, Any]] = {
    "none": {},
    "lora": {"lora_request": LoRARequest("adapter", 7, "/adapters/a")},
    "cache-salt": {"cache_salt": "tenant-3"},
    "lora-and-salt": {
        "lora_request": LoRARequest("other", 2, "/adapters/b"),
        "cache_salt": "tenant-9",
    },
}


@pytest.fixture
def none_hash_for(request: pytest.FixtureRequest) -> Iterator[None]:
    """Seeds vLLM's ``NONE_HASH`` for the test's algorithm, then for sha256 again (the
    harness's)."""
    init_none_hash(get_hash_fn_by_name(request.param))
    yield
    init_none_hash(sha256)


def _request(req_id: str, hasher: Any, prompt_len: int = 23, **extra: Any) -> Request:
    tokens = [(i * 37 + len(req_id)) % 997 + 1 for i in range(prompt_len)]
    return Request(
        request_id=req_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=64),
        pooling_params=None,
        block_hasher=hasher,
        **extra,
    )


def _decode_both(theirs: Request, ours: Request) -> list[int]:
    """Appends the same output tokens to both, a few at a time; the steps after which
    their hashes differ."""
    differences = []
    for step in range(12):
        tokens = [(step * 13 + k) % 997 + 1 for k in range(step % 3 + 1)]
        theirs.append_output_token_ids(tokens)
        ours.append_output_token_ids(tokens)
        if list(theirs.block_hashes) != list(ours.block_hashes):
            differences.append(step)
    return differences


CASES = [
    (algo, kind, prompt_len)
    for algo in HASH_ALGORITHMS
    for kind in EXTRA_KEYS
    # A prompt shorter than a block: the output tokens fill block 0, hashed from the
    # seed (NONE_HASH); a longer one chains from the prompt's last hash.
    for prompt_len in (2, 23)
]


@pytest.mark.parametrize(("none_hash_for", "kind", "prompt_len"), CASES, indirect=["none_hash_for"])
def test_same_hashes_as_vllm(none_hash_for: None, kind: str, prompt_len: int) -> None:
    algo = kv_cache_utils.get_none_hash_seed() and _algo_of_none_hash()
    vllm_hasher = get_request_block_hasher(BLOCK, get_hash_fn_by_name(algo))
    config = type(
        "Config", (), {"cache_config": type("Cache", (), {"prefix_caching_hash_algo": algo})}
    )
    native, reason = native_block_hasher(config, BLOCK, kvblocks_manager=True)
    assert native is not None, reason
    theirs = _request("r", vllm_hasher, prompt_len, **EXTRA_KEYS[kind])
    ours = _request("r", vllm_hasher, prompt_len, **EXTRA_KEYS[kind])
    use_native_hasher(ours, native)
    assert getattr(ours._block_hasher, "__self__", None) is native
    assert len(theirs.block_hashes) == prompt_len // BLOCK
    assert _decode_both(theirs, ours) == []
    assert len(ours.block_hashes) == (prompt_len + sum(s % 3 + 1 for s in range(12))) // BLOCK


def _algo_of_none_hash() -> str:
    """The algorithm whose ``init_none_hash`` made vLLM's current ``NONE_HASH``."""
    seed = kv_cache_utils.get_none_hash_seed()
    for algo in HASH_ALGORITHMS:
        if BlockHasher(BLOCK, algo, seed).none_hash == kv_cache_utils.NONE_HASH:
            return algo
    raise AssertionError("NONE_HASH matches no algorithm")


@pytest.mark.parametrize("none_hash_for", ["sha256"], indirect=True)
def test_a_planted_seed_difference_is_caught(none_hash_for: None) -> None:
    """A hasher seeded one character off gives another block 0 hash (and so every hash
    chained on it), and the comparison above reports it."""
    vllm_hasher = get_request_block_hasher(BLOCK, sha256)
    theirs = _request("r", vllm_hasher, prompt_len=2)
    ours = _request("r", vllm_hasher, prompt_len=2)
    seed = kv_cache_utils.get_none_hash_seed()
    ours._block_hasher = BlockHasher(BLOCK, "sha256", seed[:-1] + chr(ord(seed[-1]) ^ 1))  # type: ignore[assignment]
    assert _decode_both(theirs, ours), "a different seed went unnoticed"


@pytest.mark.parametrize("none_hash_for", ["sha256"], indirect=True)
def test_fallbacks_keep_vllms_hasher(none_hash_for: None, monkeypatch: pytest.MonkeyPatch) -> None:
    config = type(
        "Config", (), {"cache_config": type("Cache", (), {"prefix_caching_hash_algo": "sha256"})}
    )
    hasher, reason = native_block_hasher(config, BLOCK, kvblocks_manager=False)
    assert hasher is None and reason is not None and "own KV cache manager" in reason
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", b"\\x00" * 32)
    hasher, reason = native_block_hasher(config, BLOCK, kvblocks_manager=True)
    assert hasher is None and reason is not None and "NONE_HASH" in reason
    # A request with prompt embeddings keeps vLLM's hasher.
    vllm_hasher = get_request_block_hasher(BLOCK, sha256)
    request = _request("r", vllm_hasher)
    request.prompt_embeds = object()  # type: ignore[assignment]
    use_native_hasher(request, BlockHasher(BLOCK))
    assert request._block_hasher is vllm_hasher


def test_kvblocks_schedulers_hash_natively(tiny_model_dir: Path) -> None:
    """A request added to kvblocks' scheduler gets the native hasher; the differential
    suites run with it."""
    scn = harness.make_scenario("prefix", 0, "sync")
    init_none_hash(sha256)
    scheduler = harness.build_scheduler(scn, KVBlocksScheduler, tiny_model_dir)
    request = _request("r", get_request_block_hasher(scn.block_size, sha256))
    scheduler.add_request(request)
    # The hasher's bound __call__ (called directly, without the type's lookup).
    hasher = getattr(request._block_hasher, "__self__", None)
    assert isinstance(hasher, BlockHasher)
    assert hasher.block_size == scn.block_size
