"""``Request`` on both backends: tokens, block hashes kept current by the hasher,
``num_computed_tokens``, and all-or-nothing validation."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import examples

TOKEN = st.integers(min_value=0, max_value=200_000)


def state(request: Any) -> tuple[Any, ...]:
    return (
        list(request.all_token_ids),
        list(request.output_token_ids),
        list(request.block_hashes),
        request.num_tokens,
        request.num_computed_tokens,
    )


def test_construction_without_hasher(backend: ModuleType) -> None:
    prompt = [5, 6, 7]
    request = backend.Request("req-1", prompt)
    prompt.append(8)  # the request keeps its own copy
    assert request.request_id == "req-1"
    assert list(request.prompt_token_ids) == [5, 6, 7]
    assert list(request.all_token_ids) == [5, 6, 7]
    assert list(request.output_token_ids) == []
    assert (request.num_tokens, request.num_prompt_tokens, request.num_output_tokens) == (3, 3, 0)
    assert request.num_computed_tokens == 0
    assert list(request.block_hashes) == []
    assert request.block_hasher is None
    assert (request.lora_request, request.cache_salt, request.prompt_embeds) == (None, None, None)
    assert tuple(request.mm_features) == ()
    assert "req-1" in repr(request)


def test_construction_hashes_the_full_prompt_blocks(backend: ModuleType) -> None:
    hasher = backend.BlockHasher(4, "sha256", "request")
    request = backend.Request("r", range(10), block_hasher=hasher)
    assert request.block_hasher is hasher
    assert list(request.block_hashes) == hasher.hash_blocks(list(range(10)))
    assert len(request.block_hashes) == 2


@settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    algo=st.sampled_from(["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]),
    block_size=st.integers(min_value=1, max_value=5),
    prompt=st.lists(TOKEN, max_size=20),
    appends=st.lists(st.one_of(TOKEN, st.lists(TOKEN, max_size=7)), max_size=8),
)
def test_appends_keep_the_hashes_current(
    backend: ModuleType,
    algo: str,
    block_size: int,
    prompt: list[int],
    appends: list[int | list[int]],
) -> None:
    hasher = backend.BlockHasher(block_size, algo, "appends")
    request = backend.Request("r", prompt, block_hasher=hasher)
    tokens = list(prompt)
    for ids in appends:
        request.append_output_token_ids(ids)
        tokens.extend([ids] if isinstance(ids, int) else ids)
        assert list(request.all_token_ids) == tokens
        assert list(request.output_token_ids) == tokens[len(prompt) :]
        assert request.num_tokens == len(tokens)
        # Incremental hashing agrees with hashing everything at once.
        assert list(request.block_hashes) == hasher.hash_blocks(tokens)


def test_numpy_token_ids(backend: ModuleType) -> None:
    import numpy as np  # noqa: PLC0415 (only this test uses numpy)

    hasher = backend.BlockHasher(2, "sha256", "np")
    request = backend.Request("r", np.arange(3, dtype=np.int64), block_hasher=hasher)
    request.append_output_token_ids(np.int32(7))
    request.append_output_token_ids(np.array([8, 9], dtype=np.int64))
    assert list(request.all_token_ids) == [0, 1, 2, 7, 8, 9]
    assert all(type(t) is int for t in request.all_token_ids)
    assert list(request.block_hashes) == hasher.hash_blocks([0, 1, 2, 7, 8, 9])


def test_num_computed_tokens(backend: ModuleType) -> None:
    request = backend.Request("r", [1, 2, 3])
    request.num_computed_tokens = 2
    assert request.num_computed_tokens == 2
    with pytest.raises(ValueError) as info:
        request.num_computed_tokens = -1
    assert str(info.value) == "num_computed_tokens must be non-negative, got -1"
    with pytest.raises(TypeError) as type_info:
        request.num_computed_tokens = 1.5
    assert str(type_info.value) == "'float' object cannot be interpreted as an integer"
    assert request.num_computed_tokens == 2


@pytest.mark.parametrize(
    ("ids", "cls", "message"),
    [
        (1.5, TypeError, "'float' object cannot be interpreted as an integer"),
        ([1, 2.5], TypeError, "'float' object cannot be interpreted as an integer"),
        (["a"], TypeError, "'str' object cannot be interpreted as an integer"),
        (2**63, ValueError, "token id 9223372036854775808 does not fit in a signed 64-bit integer"),
        (
            [3, -(2**63) - 1],
            ValueError,
            "token id -9223372036854775809 does not fit in a signed 64-bit integer",
        ),
    ],
)
def test_bad_appends_change_nothing(
    backend: ModuleType, ids: object, cls: type[Exception], message: str
) -> None:
    hasher = backend.BlockHasher(2, "sha256", "bad")
    request = backend.Request("r", [1, 2, 3], block_hasher=hasher)
    before = state(request)
    with pytest.raises(cls) as info:
        request.append_output_token_ids(ids)
    assert type(info.value) is cls
    assert str(info.value) == message
    assert state(request) == before


def test_a_failing_hasher_takes_the_append_back(backend: ModuleType) -> None:
    hasher = backend.BlockHasher(2, "sha256", "rollback")
    request = backend.Request("r", [1, 2, 3], block_hasher=hasher)
    before = state(request)
    # Extra keys that cannot be hashed: the append that completes block 1 must fail whole.
    request.lora_request = SimpleNamespace(lora_name=1.5, lora_path="/p")
    with pytest.raises(TypeError) as info:
        request.append_output_token_ids([4, 5])
    assert str(info.value) == (
        "unsupported extra key type 'float'; extra keys are nested tuples of str, int, bytes "
        "and None"
    )
    assert state(request) == before
    # Fixed, the same append goes through and hashes with the LoRA key.
    lora = SimpleNamespace(lora_name="adapter", lora_path="/p")
    request.lora_request = lora
    request.append_output_token_ids([4, 5])
    assert list(request.all_token_ids) == [1, 2, 3, 4, 5]
    want = hasher.hash_blocks(
        [3, 4], parent=before[2][0], extra_keys=[(("lora", "adapter", "/p"),)]
    )
    assert list(request.block_hashes) == [*before[2], *want]


def test_prompt_embeds_are_refused(backend: ModuleType) -> None:
    hasher = backend.BlockHasher(2, "sha256", "embeds")
    with pytest.raises(TypeError) as info:
        backend.Request("r", [1, 2], block_hasher=hasher, prompt_embeds=[[0.5]])
    assert str(info.value) == (
        "requests with prompt_embeds are not supported: kvblocks hashes token ids only"
    )
    # Without a hasher nothing reads them.
    request = backend.Request("r", [1, 2], prompt_embeds=[[0.5]])
    assert request.prompt_embeds == [[0.5]]


@pytest.mark.parametrize(
    ("kwargs", "cls", "message"),
    [
        ({"request_id": 7}, TypeError, "request_id must be a str, got int"),
        (
            {"prompt_token_ids": [1, None]},
            TypeError,
            "'NoneType' object cannot be interpreted as an integer",
        ),
        (
            {"prompt_token_ids": [2**64]},
            ValueError,
            "token id 18446744073709551616 does not fit in a signed 64-bit integer",
        ),
        ({"block_hasher": 3}, TypeError, "block_hasher must be callable or None, got int"),
    ],
)
def test_constructor_errors(
    backend: ModuleType, kwargs: dict[str, Any], cls: type[Exception], message: str
) -> None:
    args: dict[str, Any] = {"request_id": "r", "prompt_token_ids": [1, 2]}
    args.update(kwargs)
    request_id, prompt = args.pop("request_id"), args.pop("prompt_token_ids")
    with pytest.raises(cls) as info:
        backend.Request(request_id, prompt, **args)
    assert type(info.value) is cls
    assert str(info.value) == message


def test_any_block_hasher_callable(backend: ModuleType) -> None:
    """vLLM's contract: called with the request on construction and after each append;
    whatever it returns is appended to ``block_hashes``."""
    calls: list[tuple[int, int]] = []

    def hasher(request: Any) -> list[bytes]:
        calls.append((request.num_tokens, len(request.block_hashes)))
        return [bytes([request.num_tokens])]

    request = backend.Request("r", [1, 2], block_hasher=hasher)
    request.append_output_token_ids(3)
    request.append_output_token_ids([4, 5])
    assert calls == [(2, 0), (3, 1), (5, 2)]
    assert list(request.block_hashes) == [b"\x02", b"\x03", b"\x05"]


def test_block_hasher_reads_duck_typed_requests(backend: ModuleType) -> None:
    """The hasher reads any object shaped like vLLM's Request."""
    hasher = backend.BlockHasher(4, "sha256_cbor", "duck")
    tokens = list(range(13))
    full = hasher.hash_blocks(tokens)
    vllm_like = SimpleNamespace(all_token_ids=tokens, num_tokens=13, block_hashes=full[:1])
    assert hasher(vllm_like) == full[1:]
    vllm_like.block_hashes = full
    assert hasher(vllm_like) == []


def test_a_hasher_failing_half_way_keeps_no_hash(backend: ModuleType) -> None:
    def hasher(request: Any) -> Any:
        if request.num_tokens >= 8:
            yield b"a" * 32
            raise RuntimeError("connector gone")

    request = backend.Request("r", [1, 2, 3, 4], block_hasher=hasher)
    with pytest.raises(RuntimeError, match="connector gone"):
        request.append_output_token_ids([5, 6, 7, 8])
    assert request.num_tokens == 4
    assert request.block_hashes == []


@pytest.mark.parametrize(
    ("result", "error", "message"),
    [
        (["x"], TypeError, "^block hash must be bytes, got str$"),
        ([b"x" * 33], ValueError, "^block hash must be at most 32 bytes, got 33$"),
    ],
)
def test_a_hasher_returning_a_bad_hash_is_refused(
    backend: ModuleType, result: list[Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        backend.Request("r", [1, 2, 3, 4], block_hasher=lambda _request: result)


def test_list_attributes_are_one_object_kept_current(backend: ModuleType) -> None:
    """The token and hash lists are the same object on every read (a scheduler reads
    them every step) and follow appends, a failed append included, in both backends."""
    hasher = backend.BlockHasher(4, "sha256", "seed")
    request = backend.Request("r", [1, 2, 3, 4, 5], block_hasher=hasher)
    views = [
        request.prompt_token_ids,
        request.all_token_ids,
        request.output_token_ids,
        request.block_hashes,
    ]
    again = [
        request.prompt_token_ids,
        request.all_token_ids,
        request.output_token_ids,
        request.block_hashes,
    ]
    assert all(a is b for a, b in zip(again, views, strict=True))
    request.append_output_token_ids([6, 7, 8])
    with pytest.raises(TypeError):
        request.append_output_token_ids([9, "x"])
    assert views == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8], [6, 7, 8], request.block_hashes]
    assert len(views[3]) == 2
    assert views[3] == hasher.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8])


def test_hashes_from_a_hasher_are_type_checked_before_length_checked(
    backend: ModuleType,
) -> None:
    with pytest.raises(TypeError, match=r"^block hash must be bytes, got str$"):
        backend.Request("a", list(range(8)), block_hasher=lambda request: [b"x" * 40, "y"])


def test_a_python_hasher_reads_the_tokens_being_appended(backend: ModuleType) -> None:
    """vLLM's hasher slices ``all_token_ids`` up to ``num_tokens``: the list it reads must
    already hold the new tokens, also when the list was handed out before."""

    def hasher(request: Any) -> list[bytes]:
        tokens = request.all_token_ids
        assert len(tokens) == request.num_tokens
        done = len(request.block_hashes)
        return [bytes(tokens[i * 2 : i * 2 + 2]) for i in range(done, request.num_tokens // 2)]

    request = backend.Request("a", [1, 2, 3], block_hasher=hasher)
    assert list(request.all_token_ids) == [1, 2, 3]
    request.append_output_token_ids(4)
    assert list(request.block_hashes) == [b"\x01\x02", b"\x03\x04"]
    assert list(request.block_hashes) == list(
        backend.Request("b", [1, 2, 3, 4], block_hasher=hasher).block_hashes
    )


def test_extra_key_attributes_may_read_the_request(backend: ModuleType) -> None:
    """Reading the request's lists from inside hashing (here a LoRA attribute that
    looks at the tokens) is allowed: the lists need no exclusive borrow."""
    seen: list[int] = []

    class Lora:
        lora_path = "/adapters/a"

        @property
        def lora_name(self) -> str:
            seen.append(len(request.all_token_ids) + len(request.block_hashes))
            return "a"

    hasher = backend.BlockHasher(2, "sha256", "seed")
    request = backend.Request("r", [1, 2, 3], block_hasher=hasher)
    request.lora_request = Lora()
    request.append_output_token_ids(4)
    assert len(request.block_hashes) == 2
    assert seen and all(n >= 4 for n in seen)
