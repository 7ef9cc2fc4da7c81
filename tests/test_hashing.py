"""Block hashing on both backends, against vLLM 0.33.0 and against plain Python.

* every case of ``golden/hashes.jsonl`` (produced by vLLM's own code), byte for byte;
* worked examples with their exact serialized bytes and digests, for each algorithm and
  seed, including the request hasher and a request's extra keys;
* properties: any block (nested extra keys with str, big ints, bytes, None, shared
  objects) hashes to what ``pickle``/``cbor2`` + ``hashlib``/``xxhash`` give directly;
* seed resolution and every validation error, with its exact class and message.
"""

from __future__ import annotations

import hashlib
import pickle
import re
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import cbor2
import pytest
import xxhash
from golden_cases import golden_params
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import examples

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
PROPERTY_SETTINGS = settings(
    max_examples=examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def plain_hash(algo: str, value: object) -> bytes:
    """vLLM's hash functions, written out with the standard libraries only."""
    if algo in ("sha256", "xxhash"):
        data = pickle.dumps(value, protocol=5)
    else:
        data = cbor2.dumps(value, canonical=True)
    if algo.startswith("sha256"):
        return hashlib.sha256(data).digest()
    digest: bytes = xxhash.xxh3_128_digest(data)
    return digest


def plain_chain(
    algo: str, seed: str, block_size: int, tokens: list[int], extra_keys: list[Any] | None = None
) -> list[bytes]:
    """vLLM's chain over full blocks, with ``plain_hash``."""
    parent = plain_hash(algo, seed)
    hashes = []
    for i in range(len(tokens) // block_size):
        keys = extra_keys[i] if extra_keys is not None else None
        parent = plain_hash(
            algo, (parent, tuple(tokens[i * block_size : (i + 1) * block_size]), keys)
        )
        hashes.append(parent)
    return hashes


def fresh(s: str) -> str:
    """An equal string that is (for two or more characters) a distinct object."""
    return "".join(list(s))


def from_golden(value: Any) -> Any:
    """A golden extra key: JSON lists are tuples, ``{"bytes": hex}`` is bytes."""
    if isinstance(value, list):
        return tuple(from_golden(v) for v in value)
    if isinstance(value, dict):
        return bytes.fromhex(value["bytes"])
    return value


# --------------------------------------------------------------------------- golden


@pytest.mark.parametrize("case", golden_params("hashes"))
def test_golden_hashes(backend: ModuleType, case: dict[str, Any]) -> None:
    hasher = backend.BlockHasher(case["block_size"], case["algo"], case["seed"])
    assert hasher.seed == case["seed"]
    assert hasher.none_hash.hex() == case["none_hash"]
    tokens = case["token_ids"]
    extra_keys = [from_golden(e) for e in case["extra_keys"]]
    want = case["block_hashes"]

    assert [h.hex() for h in hasher.hash_blocks(tokens, extra_keys=extra_keys)] == want

    # Block by block, chaining by hand.
    bs = case["block_size"]
    parent = None
    for i, expected in enumerate(want):
        parent = hasher.hash_block(parent, tokens[i * bs : (i + 1) * bs], extra_keys[i])
        assert parent.hex() == expected

    # Continuing a chain from its middle.
    if len(want) >= 2:
        k = len(want) // 2
        rest = hasher.hash_blocks(
            tokens[k * bs :], parent=bytes.fromhex(want[k - 1]), extra_keys=extra_keys[k:]
        )
        assert [h.hex() for h in rest] == want[k:]


# --------------------------------------------------------------------------- worked examples

NONE_HASH_SHA256 = "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
BLOCK0_SHA256 = "52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a"
BLOCK1_SHA256 = "bee96bce54f5fcaba04c4a3fc2491b30b48e29dbbd38a327d41bc1f76b956dde"
BLOCK2_SHA256 = "41609895a9415ae1093250e556389cf528d32e2c5e1957195f3971065b56d691"


def test_worked_example_sha256(backend: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    hasher = backend.BlockHasher(4)
    assert (hasher.block_size, hasher.algo, hasher.seed) == (4, "sha256", "vllm-none-hash")
    assert hasher.none_hash.hex() == NONE_HASH_SHA256
    # The exact pickle bytes of the seed and of block 0, hashed.
    seed_pickle = "80059512000000000000008c0e766c6c6d2d6e6f6e652d68617368942e"
    assert pickle.dumps("vllm-none-hash", protocol=5).hex() == seed_pickle
    block0 = bytes.fromhex(
        "8005953200000000000000" + "4320" + NONE_HASH_SHA256 + "94284b014b024b034b0474944e87942e"
    )
    assert hashlib.sha256(block0).hexdigest() == BLOCK0_SHA256

    hashes = hasher.hash_blocks(list(range(1, 11)))
    assert [h.hex() for h in hashes] == [BLOCK0_SHA256, BLOCK1_SHA256]
    assert hasher.hash_block(hashes[1], [9, 10, 11, 12]).hex() == BLOCK2_SHA256
    assert int.from_bytes(hashes[0], "big") & (2**64 - 1) == 1882140585328457242

    salted = hasher.hash_blocks(list(range(1, 11)), extra_keys=[(("cache_salt", "salt"),), None])
    assert [h.hex() for h in salted] == [
        "ea3c4408f0636c8042423e5ab49ca985b6a2bdfc1cdcbd81fc592969e92ef4ef",
        "d19413c1819f34980a4ee21c6a0d0c032248120583964f07534878d5511b80c2",
    ]


def test_worked_example_request_hasher(backend: ModuleType) -> None:
    hasher = backend.BlockHasher(4, "sha256", "vllm-none-hash")
    request = backend.Request("r0", list(range(1, 11)), block_hasher=hasher)
    assert [h.hex() for h in request.block_hashes] == [BLOCK0_SHA256, BLOCK1_SHA256]
    request.append_output_token_ids([11, 12])
    assert [h.hex() for h in request.block_hashes] == [BLOCK0_SHA256, BLOCK1_SHA256, BLOCK2_SHA256]

    salted = backend.Request("r1", list(range(1, 11)), block_hasher=hasher, cache_salt="salt")
    assert [h.hex() for h in salted.block_hashes] == [
        "ea3c4408f0636c8042423e5ab49ca985b6a2bdfc1cdcbd81fc592969e92ef4ef",
        "d19413c1819f34980a4ee21c6a0d0c032248120583964f07534878d5511b80c2",
    ]


def test_worked_example_sha256_cbor(backend: ModuleType) -> None:
    hasher = backend.BlockHasher(4, "sha256_cbor", "vllm-none-hash")
    none_hash = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    assert hasher.none_hash.hex() == none_hash
    assert cbor2.dumps("vllm-none-hash", canonical=True).hex() == "6e766c6c6d2d6e6f6e652d68617368"
    block0 = bytes.fromhex("835820" + none_hash + "8401020304f6")
    assert cbor2.dumps((hasher.none_hash, (1, 2, 3, 4), None), canonical=True) == block0
    assert [h.hex() for h in hasher.hash_blocks(list(range(1, 11)))] == [
        "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111",
        "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1",
    ]


def test_worked_example_seed_zero(backend: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    sha = backend.BlockHasher(4, "sha256")
    assert sha.seed == "0"
    assert re.fullmatch("1973e238[0-9a-f]{52}aa7c", sha.none_hash.hex())
    assert re.fullmatch("762b2e7e[0-9a-f]{52}e91d", sha.hash_block(None, [1, 2, 3, 4]).hex())
    xx = backend.BlockHasher(4, "xxhash_cbor")
    assert xx.none_hash.hex() == "1ebe36576dcb573f26b99533a20aaeca"
    assert xx.hash_block(None, [1, 2, 3, 4]).hex() == "0a8577df5ee3430515a8cc1f6e3ac52e"


def test_request_extra_keys_behaviour_notes_example(backend: ModuleType) -> None:
    """LoRA L at /p, image imgA at offset 2 (length 5), salt S, block size 4."""
    lora = SimpleNamespace(lora_name="L", lora_path="/p", lora_int_id=1)
    image = SimpleNamespace(identifier="imgA", mm_position=SimpleNamespace(offset=2, length=5))
    tokens = list(range(100, 113))
    for algo in ALGOS:
        hasher = backend.BlockHasher(4, algo, "notes")
        request = backend.Request(
            "r", tokens, block_hasher=hasher, lora_request=lora, cache_salt="S", mm_features=[image]
        )
        keys = [
            (("lora", "L", "/p"), ("mm", "imgA", 2), ("cache_salt", "S")),
            (("lora", "L", "/p"), ("mm", "imgA", -2)),
            (("lora", "L", "/p"),),
        ]
        assert request.block_hashes == plain_chain(algo, "notes", 4, tokens, keys)
        assert request.block_hashes == hasher.hash_blocks(tokens, extra_keys=keys)


def test_request_mm_items_sharing_a_block_and_decode(backend: ModuleType) -> None:
    """Two items end and start in one block; the "mm" tag is then the same object twice,
    which pickle writes as a memo reference. Later calls only look at the last item."""
    first = SimpleNamespace(
        identifier=fresh("img-one"), mm_position=SimpleNamespace(offset=1, length=4)
    )
    second = SimpleNamespace(
        identifier=fresh("img-two"), mm_position=SimpleNamespace(offset=6, length=4)
    )
    tokens = list(range(1, 11))
    for algo in ALGOS:
        hasher = backend.BlockHasher(4, algo, "mm")
        request = backend.Request("r", tokens, block_hasher=hasher, mm_features=[first, second])
        one, two = first.identifier, second.identifier
        keys: list[Any] = [
            (("mm", one, 1),),
            (("mm", one, -3), ("mm", two, 2)),  # the literal "mm": one object, twice
        ]
        assert request.block_hashes == plain_chain(algo, "mm", 4, tokens, keys)
        # Block 2 completes during decode: only the last item is considered.
        request.append_output_token_ids([11, 12])
        keys.append((("mm", two, -2),))
        assert request.block_hashes == plain_chain(algo, "mm", 4, [*tokens, 11, 12], keys)


def test_pickle_memo_follows_object_identity(backend: ModuleType) -> None:
    shared = fresh("identifier")
    twin = fresh("identifier")
    assert shared == twin and shared is not twin
    hasher = backend.BlockHasher(4, "sha256", "memo")
    same = hasher.hash_block(None, [1], (shared, shared))
    equal = hasher.hash_block(None, [1], (shared, twin))
    assert same != equal  # pickle writes the second `shared` as a reference
    nh = plain_hash("sha256", "memo")
    assert same == plain_hash("sha256", (nh, (1,), (shared, shared)))
    assert equal == plain_hash("sha256", (nh, (1,), (shared, twin)))
    # The parent object itself inside the extra keys is a reference to it too.
    parent = bytes(range(32))
    assert hasher.hash_block(parent, [1], (parent,)) == plain_hash(
        "sha256", (parent, (1,), (parent,))
    )
    # CBOR has no memo.
    cbor = backend.BlockHasher(4, "sha256_cbor", "memo")
    assert cbor.hash_block(None, [1], (shared, shared)) == cbor.hash_block(
        None, [1], (shared, twin)
    )


def test_identifiers_read_as_new_objects_are_distinct_objects(backend: ModuleType) -> None:
    """An item whose ``identifier`` is a new (equal) object on every read: the two items'
    identifiers are two objects, as pickle sees them in vLLM's tuple, however soon the
    first would be freed (the native backend once let its address be reused, and so
    wrote a memo reference)."""

    class Feature:
        def __init__(self, offset: int) -> None:
            self.mm_position = SimpleNamespace(offset=offset, length=2)

        @property
        def identifier(self) -> str:
            return "".join(["im", "g"])

    request = backend.Request("a", list(range(8)), mm_features=[Feature(0), Feature(2)])
    keys = [(("mm", fresh("img"), 0), ("mm", fresh("img"), 2))]
    assert backend.BlockHasher(4)(request)[0] == backend.BlockHasher(4).hash_block(
        None, range(4), keys[0]
    )


# --------------------------------------------------------------------------- properties


@st.composite
def blocks(draw: st.DrawFn) -> tuple[bytes | None, list[int], Any]:
    """A parent, tokens and extra keys whose leaves may repeat the same objects."""
    parent = draw(st.none() | st.binary(max_size=40))
    tokens = draw(st.lists(INT64, max_size=40))
    scalars = st.one_of(
        st.none(),
        INT64,
        st.integers(min_value=-(2**200), max_value=2**200),
        st.text(max_size=8),
        st.binary(max_size=8),
    )
    pool = draw(
        st.lists(
            st.one_of(
                st.text(min_size=2, max_size=6).map(fresh),
                st.binary(max_size=6).map(bytes),
                st.tuples(scalars, scalars),
            ),
            max_size=4,
        )
    )
    if parent:
        pool.append(parent)
    leaves = st.one_of(scalars, st.sampled_from(pool)) if pool else scalars
    extra = draw(
        st.none()
        | st.recursive(
            leaves, lambda children: st.lists(children, max_size=5).map(tuple), max_leaves=24
        )
    )
    return parent, tokens, extra


@PROPERTY_SETTINGS
@given(algo=st.sampled_from(ALGOS), block=blocks())
def test_any_block_hashes_like_plain_pickle_and_cbor(
    backend: ModuleType, algo: str, block: tuple[bytes | None, list[int], Any]
) -> None:
    parent, tokens, extra = block
    hasher = backend.BlockHasher(4, algo, "props")
    none_hash = plain_hash(algo, "props")
    assert hasher.none_hash == none_hash
    want = plain_hash(algo, (parent or none_hash, tuple(tokens), extra))
    assert hasher.hash_block(parent, tokens, extra) == want


@PROPERTY_SETTINGS
@given(
    algo=st.sampled_from(ALGOS),
    block_size=st.integers(min_value=1, max_value=6),
    tokens=st.lists(INT64, max_size=40),
    data=st.data(),
)
def test_hash_blocks_is_the_chain(
    backend: ModuleType, algo: str, block_size: int, tokens: list[int], data: st.DataObject
) -> None:
    hasher = backend.BlockHasher(block_size, algo, "chain")
    n = len(tokens) // block_size
    keys = data.draw(
        st.none()
        | st.lists(
            st.none() | st.tuples(st.text(max_size=4), INT64) | st.tuples(st.binary(max_size=4)),
            min_size=n,
            max_size=n,
        )
    )
    assert hasher.hash_blocks(tokens, extra_keys=keys) == plain_chain(
        algo, "chain", block_size, tokens, keys
    )


@pytest.mark.parametrize("algo", ALGOS)
def test_large_blocks_and_payloads(backend: ModuleType, algo: str) -> None:
    """Frames over 64 KiB, and payloads of 64 KiB and more written outside frames."""
    tokens = [(i * 7919) % 150_000 - 20_000 for i in range(70_000)]
    tokens[123] = 2**63 - 1
    tokens[456] = -(2**63)
    extra = (b"\x07" * 70_000, "é" * 40_000, "x" * 65_535, b"y" * 65_536, tuple(range(20_000)))
    hasher = backend.BlockHasher(30_000, algo, "large")
    keys = [extra, None]
    assert hasher.hash_blocks(tokens, extra_keys=keys) == plain_chain(
        algo, "large", 30_000, tokens, keys
    )
    nh = plain_hash(algo, "large")
    assert hasher.hash_block(None, tokens, extra) == plain_hash(algo, (nh, tuple(tokens), extra))


def test_extra_keys_nesting_limit(backend: ModuleType) -> None:
    hasher = backend.BlockHasher(1, "sha256", "deep")
    deep: Any = None
    for _ in range(64):
        deep = (deep,)
    nh = plain_hash("sha256", "deep")
    assert hasher.hash_block(None, [1], deep) == plain_hash("sha256", (nh, (1,), deep))
    with pytest.raises(ValueError, match=r"^extra keys are nested more than 64 tuples deep$"):
        hasher.hash_block(None, [1], (deep,))


def test_numpy_style_token_ids(backend: ModuleType) -> None:
    import numpy as np  # noqa: PLC0415 (only this test uses numpy)

    hasher = backend.BlockHasher(4, "sha256", "np")
    tokens = np.arange(1, 11, dtype=np.int64)
    assert hasher.hash_blocks(tokens) == hasher.hash_blocks(list(range(1, 11)))
    assert hasher.hash_block(None, tokens[:4]) == hasher.hash_block(None, [1, 2, 3, 4])


# --------------------------------------------------------------------------- seeds


def test_seed_resolution(backend: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    for algo in ("sha256", "sha256_cbor"):
        hasher = backend.BlockHasher(16, algo)
        assert hasher.seed == "vllm-none-hash"
        assert hasher.none_hash == plain_hash(algo, "vllm-none-hash")
        # Stable across instances.
        assert backend.BlockHasher(16, algo).none_hash == hasher.none_hash
    for algo in ("xxhash", "xxhash_cbor"):
        seeds = {backend.BlockHasher(16, algo).seed for _ in range(5)}
        assert len(seeds) == 5
        for seed in seeds:
            assert re.fullmatch("[0-9a-f]{64}", seed)
        hasher = backend.BlockHasher(16, algo)
        assert hasher.none_hash == plain_hash(algo, hasher.seed)
        assert len(hasher.none_hash) == 16

    monkeypatch.setenv("PYTHONHASHSEED", "python hash seed")
    for algo in ALGOS:
        hasher = backend.BlockHasher(16, algo)
        assert hasher.seed == "python hash seed"
        assert hasher.none_hash == plain_hash(algo, "python hash seed")
        # An explicit seed wins over the environment, even an empty one.
        assert backend.BlockHasher(16, algo, "explicit").seed == "explicit"
        assert backend.BlockHasher(16, algo, "").seed == ""
    monkeypatch.setenv("PYTHONHASHSEED", "")
    assert backend.BlockHasher(16, "xxhash").seed == ""


# --------------------------------------------------------------------------- errors

EXTRA_KEY_TYPE_MESSAGE = (
    "unsupported extra key type {!r}; extra keys are nested tuples of str, int, bytes and None"
)
ALGO_MESSAGE = (
    "unknown hash algorithm {}; expected one of 'sha256', 'sha256_cbor', 'xxhash', 'xxhash_cbor'"
)

ERROR_CASES: list[tuple[str, Callable[[Any, Any], object], type[BaseException], str]] = [
    (
        "block_size 0",
        lambda b, h: b.BlockHasher(0),
        ValueError,
        "block_size must be positive, got 0",
    ),
    (
        "block_size -3",
        lambda b, h: b.BlockHasher(-3),
        ValueError,
        "block_size must be positive, got -3",
    ),
    (
        "block_size float",
        lambda b, h: b.BlockHasher(1.5),
        TypeError,
        "'float' object cannot be interpreted as an integer",
    ),
    ("algo md5", lambda b, h: b.BlockHasher(4, "md5"), ValueError, ALGO_MESSAGE.format("'md5'")),
    (
        "algo quote",
        lambda b, h: b.BlockHasher(4, "it's"),
        ValueError,
        ALGO_MESSAGE.format('"it\'s"'),
    ),
    (
        "algo upper",
        lambda b, h: b.BlockHasher(4, "SHA256"),
        ValueError,
        ALGO_MESSAGE.format("'SHA256'"),
    ),
    ("algo int", lambda b, h: b.BlockHasher(4, 5), ValueError, ALGO_MESSAGE.format("5")),
    (
        "seed int",
        lambda b, h: b.BlockHasher(4, "sha256", 7),
        TypeError,
        "seed must be a str or None, got int",
    ),
    (
        "parent str",
        lambda b, h: h.hash_block("ab", [1]),
        TypeError,
        "parent hash must be bytes or None, got str",
    ),
    (
        "parent bytearray",
        lambda b, h: h.hash_blocks([1, 2], parent=bytearray(b"ab")),
        TypeError,
        "parent hash must be bytes or None, got bytearray",
    ),
    (
        "token float",
        lambda b, h: h.hash_block(None, [1, 2.0]),
        TypeError,
        "'float' object cannot be interpreted as an integer",
    ),
    (
        "token str",
        lambda b, h: h.hash_blocks([1, "2"]),
        TypeError,
        "'str' object cannot be interpreted as an integer",
    ),
    (
        "token 2**63",
        lambda b, h: h.hash_blocks([1, 2**63]),
        ValueError,
        "token id 9223372036854775808 does not fit in a signed 64-bit integer",
    ),
    (
        "token -2**63-1",
        lambda b, h: h.hash_block(None, [-(2**63) - 1]),
        ValueError,
        "token id -9223372036854775809 does not fit in a signed 64-bit integer",
    ),
    (
        "first bad token decides",
        lambda b, h: h.hash_blocks([2**63, 1.5]),
        ValueError,
        "token id 9223372036854775808 does not fit in a signed 64-bit integer",
    ),
    (
        "signature order",
        lambda b, h: h.hash_blocks([1.5], parent="ab"),
        TypeError,
        "'float' object cannot be interpreted as an integer",
    ),
    (
        "extra float",
        lambda b, h: h.hash_block(None, [1], 1.5),
        TypeError,
        EXTRA_KEY_TYPE_MESSAGE.format("float"),
    ),
    (
        "extra bool",
        lambda b, h: h.hash_block(None, [1], ("a", True)),
        TypeError,
        EXTRA_KEY_TYPE_MESSAGE.format("bool"),
    ),
    (
        "extra list",
        lambda b, h: h.hash_block(None, [1], (("a", [1]),)),
        TypeError,
        EXTRA_KEY_TYPE_MESSAGE.format("list"),
    ),
    (
        "extra dict",
        lambda b, h: h.hash_blocks([1, 2, 3, 4], extra_keys=[None, ({"a": 1},)]),
        TypeError,
        EXTRA_KEY_TYPE_MESSAGE.format("dict"),
    ),
    (
        "extra bytearray",
        lambda b, h: h.hash_block(None, [1], (bytearray(b"x"),)),
        TypeError,
        EXTRA_KEY_TYPE_MESSAGE.format("bytearray"),
    ),
    (
        "extra surrogate",
        lambda b, h: h.hash_block(None, [1], ("\ud800",)),
        UnicodeEncodeError,
        "'utf-8' codec can't encode character '\\ud800' in position 0: surrogates not allowed",
    ),
    (
        "extra_keys count",
        lambda b, h: h.hash_blocks([1, 2, 3, 4, 5], extra_keys=[None]),
        ValueError,
        "extra_keys must have one entry per full block: got 1 for 2 full blocks",
    ),
    (
        "extra_keys container",
        lambda b, h: h.hash_blocks([1, 2], extra_keys=5),
        TypeError,
        "extra_keys must be a list or tuple with one entry per full block, or None; got int",
    ),
    (
        "prompt_embeds",
        lambda b, h: h(
            SimpleNamespace(
                all_token_ids=[1, 2], num_tokens=2, block_hashes=[], prompt_embeds=[0.5]
            )
        ),
        TypeError,
        "requests with prompt_embeds are not supported: kvblocks hashes token ids only",
    ),
    (
        "request lora type",
        lambda b, h: b.Request(
            "r", [1, 2], block_hasher=h, lora_request=SimpleNamespace(lora_name=1.5, lora_path="/p")
        ),
        TypeError,
        EXTRA_KEY_TYPE_MESSAGE.format("float"),
    ),
]


@pytest.mark.parametrize(
    ("call", "cls", "message"), [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_errors(
    backend: ModuleType,
    call: Callable[[Any, Any], object],
    cls: type[BaseException],
    message: str,
) -> None:
    hasher = backend.BlockHasher(2, "sha256", "errors")
    before = (hasher.block_size, hasher.algo, hasher.seed, hasher.none_hash)
    reference = hasher.hash_blocks([1, 2, 3, 4], extra_keys=[("k",), None])
    with pytest.raises(cls) as info:
        call(backend, hasher)
    assert type(info.value) is cls
    assert str(info.value) == message
    # A failed call changes nothing.
    assert (hasher.block_size, hasher.algo, hasher.seed, hasher.none_hash) == before
    assert hasher.hash_blocks([1, 2, 3, 4], extra_keys=[("k",), None]) == reference


def test_failed_hash_blocks_leaves_its_arguments_alone(backend: ModuleType) -> None:
    hasher = backend.BlockHasher(2, "sha256", "errors")
    tokens = [1, 2, 3, 4]
    keys: list[Any] = [("ok",), (1.5,)]
    with pytest.raises(TypeError):
        hasher.hash_blocks(tokens, extra_keys=keys)
    assert tokens == [1, 2, 3, 4]
    assert keys == [("ok",), (1.5,)]
