"""kvblocks reads vLLM's ``Request.num_tokens`` natively, as the length of the request's
``_all_token_ids`` list, only where the property would give that: a request of exactly
vLLM's class, whose class still has the property and CPython's generic attribute lookup,
and whose token list is a ``list``. Every other request is read through the property,
as vLLM's own manager and hasher read it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import harness
import pytest
from kvblocks.vllm import KVCacheManager
from kvblocks.vllm.hashing import native_block_hasher
from kvblocks.vllm.num_tokens import register_request_class
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_manager as vllm_manager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

BLOCK = 4
#: 13 tokens: three full blocks.
PROMPT = [(i * 37) % 997 + 1 for i in range(13)]
#: What a request that says it has 6 tokens may hit: one block.
SHRUNK_HIT = BLOCK


def shrunk(self: Any) -> int:
    """A ``num_tokens`` 7 below the token list's length: 6 for :data:`PROMPT`."""
    return len(self._all_token_ids) - 7


class Overriding(Request):
    num_tokens = property(shrunk)


class ShortList(list[int]):
    def __len__(self) -> int:
        return super().__len__() - 7


def intercept(self: Any, name: str) -> Any:
    if name == "num_tokens":
        return shrunk(self)
    return object.__getattribute__(self, name)


def make(cls: type[Request] = Request) -> Request:
    return cls(
        request_id="b",
        prompt_token_ids=list(PROMPT),
        sampling_params=SamplingParams(max_tokens=8),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def overriding() -> Request:
    return make(Overriding)


def short_list() -> Request:
    request = make()
    request._all_token_ids = ShortList(request._all_token_ids)
    return request


#: Each request, what its ``num_tokens`` is, and what a class patch it needs (if any).
VARIANTS: dict[str, tuple[Callable[[], Request], int, tuple[str, Any] | None]] = {
    "exact": (make, 13, None),
    "subclass property": (overriding, 6, None),
    "list subclass": (short_list, 6, None),
    "class property patched": (make, 6, ("num_tokens", property(shrunk))),
    "class __getattribute__ patched": (make, 6, ("__getattribute__", intercept)),
}


def test_the_installed_vllm_request_is_registered() -> None:
    # The differential suites run the native read: vLLM's property is the one line.
    assert register_request_class() is True
    assert isinstance(vars(Request)["num_tokens"], property)


def test_a_different_property_is_not_registered() -> None:
    class Longer(Request):
        num_tokens = property(lambda self: len(self._all_token_ids) + 1)

    class Inherited(Request):
        pass

    assert register_request_class(Longer) is False
    assert register_request_class(Inherited) is False  # no property of its own


def test_another_class_with_the_same_property_is_refused() -> None:
    # The code check passes; the native module keeps the first class registered.
    class Same(Request):
        @property
        def num_tokens(self) -> int:
            return len(self._all_token_ids)

    with pytest.raises(ValueError, match="already registered"):
        register_request_class(Same)


@pytest.fixture
def vllm_none_hash() -> None:
    init_none_hash(sha256)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_managers_and_hasher_read_num_tokens_as_vllm_does(
    variant: str, vllm_none_hash: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    build, num_tokens, patch = VARIANTS[variant]
    kwargs: dict[str, Any] = {
        "kv_cache_config": harness.build_kv_cache_config(32, BLOCK),
        "max_model_len": 256,
        "scheduler_block_size": BLOCK,
        "hash_block_size": BLOCK,
    }
    ours, theirs = KVCacheManager(**kwargs), vllm_manager.KVCacheManager(**kwargs)
    for manager in (ours, theirs):
        first = make()
        first.request_id = "a"
        assert manager.allocate_slots(first, first.num_tokens) is not None
    hasher, _ = native_block_hasher(None, BLOCK, kvblocks_manager=True)
    assert hasher is not None
    request = build()
    if patch is not None:
        monkeypatch.setattr(Request, *patch)
    assert request.num_tokens == num_tokens
    hit_ours = ours.get_computed_blocks(request)[1]
    assert hit_ours == theirs.get_computed_blocks(request)[1]
    assert hit_ours == (3 * BLOCK if num_tokens == 13 else SHRUNK_HIT)
    # Hashed again from the first block, as far as num_tokens says.
    request.block_hashes.clear()
    vllm_hashes = get_request_block_hasher(BLOCK, sha256)(request)
    assert hasher(request) == vllm_hashes
    assert len(vllm_hashes) == num_tokens // BLOCK
