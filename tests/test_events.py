"""KV cache events on both backends: vLLM 0.33.0's golden traces byte for byte, hash
forms, request fields (LoRA, multimodal, salt), the router-grade option, and
all-or-nothing behaviour."""

from __future__ import annotations

import collections
from types import ModuleType, SimpleNamespace
from typing import Any

import kvblocks.events
import msgspec
import pytest
from golden_cases import golden_params, load_golden
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvblocks import _native, reference
from kvblocks.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
    SequencedKVEventBatch,
    external_block_hash,
)
from kvblocks.extra_keys import Lora, MmItem, MmPosition, RequestExtras, event_extra_keys
from support import examples

ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"


def encode_hex(events: list[Any]) -> list[str]:
    return [msgspec.msgpack.encode(e).hex() for e in events]


def python_set(ids: list[int]) -> set[int]:
    """vLLM's ``evict_blocks`` takes a set and removes in its iteration order."""
    return set(ids)


class DuckRequest:
    """A request that is not a kvblocks ``Request`` (the native duck-typed path)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def num_computed_tokens(self) -> int:
        return int(self._inner.num_computed_tokens)

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self._inner.num_computed_tokens = value


def replay(
    backend: ModuleType,
    case: dict[str, Any],
    check: Any,
    *,
    duck: bool = False,
    **manager_kwargs: Any,
) -> None:
    """Replays a golden events case, calling ``check(op, events, manager)`` after each op."""
    hasher = backend.BlockHasher(case["block_size"], case["hash_algo"], case["seed"])
    assert hasher.none_hash.hex() == case["none_hash"]
    manager = backend.KVCacheManager(
        case["num_blocks"], case["block_size"], enable_kv_cache_events=True, **manager_kwargs
    )
    live: dict[str, Any] = {}
    for op in case["ops"]:
        kind = op["op"]
        if kind == "add":
            request = backend.Request(op["req_id"], op["token_ids"], block_hasher=hasher)
            if duck:
                request = DuckRequest(request)
            hits, num_hit_tokens = manager.get_computed_blocks(request)
            allocated = manager.allocate_slots(
                request, len(op["token_ids"]) - num_hit_tokens, num_hit_tokens, hits
            )
            assert (allocated is None) == (op["allocated"] is None)
            if allocated is not None:
                request.num_computed_tokens = len(op["token_ids"])
                live[op["req_id"]] = request
        elif kind == "decode":
            request = live[op["req_id"]]
            request.append_output_token_ids(op["token_id"])
            allocated = manager.allocate_slots(request, 1)
            assert (allocated is None) == (op["allocated"] is None)
            if allocated is not None:
                request.num_computed_tokens += 1
        elif kind == "free":
            manager.free(live.pop(op["req_id"]))
        elif kind == "evict_blocks":
            manager.evict_blocks(python_set(op["ids"]))
        elif kind == "reset_prefix_cache":
            assert manager.reset_prefix_cache() == op["result"]
        else:
            pytest.fail(f"unknown golden op {kind!r}")
        check(op, manager.take_events(), manager)
        manager.block_pool.check_invariants()


# --------------------------------------------------------------------------- golden


@pytest.mark.parametrize("case", golden_params("events"))
@pytest.mark.parametrize("duck", [False, True], ids=["Request", "duck"])
def test_golden_events_byte_identical(
    backend: ModuleType, case: dict[str, Any], duck: bool
) -> None:
    empty = KVEventBatch(ts=1.5, events=[])
    assert msgspec.msgpack.encode(empty).hex() == case["empty_batch_ts_1_5"]

    def check(op: dict[str, Any], events: list[Any], manager: Any) -> None:
        where = f"{op['op']} {op.get('req_id', '')}"
        assert encode_hex(events) == op["events"], where
        assert [msgspec.to_builtins(e) for e in events] == op["events_decoded"], where
        # Each event also decodes from vLLM's bytes to an equal struct, and a batch of
        # them round-trips.
        decoded = [
            msgspec.msgpack.decode(bytes.fromhex(h), type=type(e))
            for h, e in zip(op["events"], events, strict=True)
        ]
        assert decoded == events, where
        batch = KVEventBatch(ts=1.5, events=events)
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KVEventBatch) == batch
        assert manager.take_events() == [], "take_events() empties the queue"

    replay(backend, case, check, duck=duck)


def test_golden_events_cover_every_event_kind_and_duplicates() -> None:
    """The traces are worth replaying: stores with parents, removals of duplicated
    hashes (vLLM emits one per block), and evictions."""
    kinds: collections.Counter[str] = collections.Counter()
    with_parent = 0
    for case in load_golden("events"):
        for op in case["ops"]:
            for event in op["events_decoded"]:
                kinds[event["type"]] += 1
                with_parent += event.get("parent_block_hash") is not None
    assert kinds["BlockStored"] > 100 and kinds["BlockRemoved"] > 50
    assert with_parent > 50


def test_events_are_identical_across_backends_with_bytes_hashes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV, "0")
    for case in load_golden("events")[:12]:
        streams: dict[str, list[Any]] = {}
        for name, backend in (("python", reference), ("rust", _native)):
            got: list[Any] = []
            replay(backend, case, lambda op, events, manager, got=got: got.append(events))
            streams[name] = got
        assert [encode_hex(e) for e in streams["python"]] == [
            encode_hex(e) for e in streams["rust"]
        ]
        golden_events = [op["events_decoded"] for op in case["ops"]]
        for ours, theirs in zip(streams["python"], golden_events, strict=True):
            for event, want in zip(ours, theirs, strict=True):
                if isinstance(event, AllBlocksCleared):
                    continue
                assert all(isinstance(h, bytes) and len(h) == 32 for h in event.block_hashes)
                assert [int.from_bytes(h, "big") & (2**64 - 1) for h in event.block_hashes] == (
                    want["block_hashes"]
                )


@pytest.mark.parametrize("value", ["yes", ""])
def test_bad_int_hashes_variable_is_refused_at_creation(
    backend: ModuleType, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=ENV):
        backend.KVCacheManager(8, 4, enable_kv_cache_events=True)
    # Without events the variable is not read.
    assert backend.KVCacheManager(8, 4).take_events() == []


# --------------------------------------------------------------------------- scenarios


def test_events_off_records_nothing(backend: ModuleType) -> None:
    manager = backend.KVCacheManager(6, 2)
    hasher = backend.BlockHasher(2, "sha256", "s")
    request = backend.Request("r", [1, 2, 3, 4, 5], block_hasher=hasher)
    assert manager.allocate_slots(request, 5) == [1, 2, 3]
    manager.free(request)
    manager.evict_blocks([1])
    assert manager.reset_prefix_cache()
    assert manager.take_events() == []


def test_prefill_scenario(backend: ModuleType) -> None:
    """vLLM's test_kv_cache_events: one BlockStored with N hashes, N removals when the
    blocks are reallocated, and AllBlocksCleared on reset."""
    block_size = 4
    hasher = backend.BlockHasher(block_size, "sha256", "x")
    manager = backend.KVCacheManager(8, block_size, enable_kv_cache_events=True)
    request = backend.Request("r0", range(3 * block_size), block_hasher=hasher)
    assert manager.allocate_slots(request, 3 * block_size) == [1, 2, 3]
    (stored,) = manager.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [external_block_hash(h, True) for h in request.block_hashes]
    assert stored.parent_block_hash is None
    assert stored.token_ids == list(range(3 * block_size))
    assert (stored.block_size, stored.medium, stored.group_idx) == (block_size, "GPU", 0)
    assert stored.kv_cache_spec_kind == "full_attention"
    assert stored.extra_keys == [None, None, None]
    assert (stored.lora_id, stored.lora_name) == (None, None)
    manager.free(request)
    assert manager.take_events() == []

    other = backend.Request("r1", range(100, 100 + 7 * block_size), block_hasher=hasher)
    manager.allocate_slots(other, 7 * block_size)
    events = manager.take_events()
    assert [type(e) for e in events] == [BlockRemoved] * 3 + [BlockStored]
    # Tail first: the chain's tail block was evicted first.
    assert [e.block_hashes[0] for e in events[:3]] == stored.block_hashes[::-1]
    assert all(len(e.block_hashes) == 1 and e.group_idx == 0 for e in events[:3])
    manager.free(other)
    assert manager.reset_prefix_cache()
    (cleared,) = manager.take_events()
    assert cleared == AllBlocksCleared()
    assert msgspec.msgpack.encode(cleared) == b"\x81\xa4type\xb0AllBlocksCleared"


def test_decode_stores_one_block_with_its_logical_parent(backend: ModuleType) -> None:
    hasher = backend.BlockHasher(2, "sha256_cbor", "p")
    manager = backend.KVCacheManager(8, 2, enable_kv_cache_events=True)
    request = backend.Request("r", [1, 2, 3], block_hasher=hasher)
    manager.allocate_slots(request, 3)
    request.num_computed_tokens = 3
    (first,) = manager.take_events()
    request.append_output_token_ids(4)
    manager.allocate_slots(request, 1)
    (second,) = manager.take_events()
    assert second.parent_block_hash == first.block_hashes[-1]
    assert second.token_ids == [3, 4]
    assert second.block_hashes == [external_block_hash(request.block_hashes[1], True)]


def test_cache_blocks_and_pool_eviction_record_events(backend: ModuleType) -> None:
    hasher = backend.BlockHasher(2, "sha256", "c")
    manager = backend.KVCacheManager(8, 2, enable_kv_cache_events=True)
    request = backend.Request("r", [1, 2, 3, 4], block_hasher=hasher)
    manager.allocate_slots(request, 4, delay_cache_blocks=True)
    assert manager.take_events() == []
    manager.cache_blocks(request, 4)
    (stored,) = manager.take_events()
    assert stored.token_ids == [1, 2, 3, 4]
    # The manager's pool is the one that records: evicting through it is an event too.
    manager.block_pool.evict_blocks([2, 0, 2])
    (removed,) = manager.take_events()
    assert removed.block_hashes == [stored.block_hashes[1]]


def test_kv_load_failure_eviction_is_an_event(backend: ModuleType) -> None:
    """handle_invalid_blocks under ``fail`` evicts through the manager: BlockRemoved."""
    hasher = backend.BlockHasher(2, "sha256", "f")
    manager = backend.KVCacheManager(8, 2, enable_kv_cache_events=True)
    request = backend.Request("r", [1, 2, 3, 4, 5, 6], block_hasher=hasher)
    manager.allocate_slots(request, 6)
    request.num_computed_tokens = 6
    (stored,) = manager.take_events()
    outcome = backend.handle_invalid_blocks(manager, {2}, {"r": 0}, running=[request])
    assert outcome.evicted_block_ids == {2, 3}
    removed = manager.take_events()
    assert sorted(e.block_hashes[0] for e in removed) == sorted(stored.block_hashes[1:])


@pytest.fixture
def lora() -> SimpleNamespace:
    return SimpleNamespace(lora_name="L", lora_path="/p", adapter_id=7)


def image(offset: int, length: int) -> SimpleNamespace:
    return SimpleNamespace(
        identifier="imgA", mm_position=SimpleNamespace(offset=offset, length=length)
    )


def test_lora_multimodal_and_salt_fields(backend: ModuleType, lora: SimpleNamespace) -> None:
    """LoRA, an image across two blocks and a salt: extra keys published untagged, per block."""
    hasher = backend.BlockHasher(4, "sha256", "m")
    manager = backend.KVCacheManager(8, 4, enable_kv_cache_events=True)
    request = backend.Request(
        "r",
        range(13),
        block_hasher=hasher,
        lora_request=lora,
        cache_salt="S",
        mm_features=[image(2, 5)],
    )
    manager.allocate_slots(request, 13)
    (stored,) = manager.take_events()
    assert stored.extra_keys == [("L", ("imgA", 2), "S"), ("L", ("imgA", -2)), ("L",)]
    assert (stored.lora_id, stored.lora_name) == (7, "L")
    # Later blocks: no salt, no image, still the LoRA name.
    request.num_computed_tokens = 13
    request.append_output_token_ids([13, 14, 15])
    manager.allocate_slots(request, 3)
    (later,) = manager.take_events()
    assert later.extra_keys == [("L",)]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(later), type=BlockStored) == later


def test_event_extra_keys_are_untagged() -> None:
    """The events' form of the keys (the same cases as the core's test): the adapter's
    name, ``(identifier, offset)`` per item, the salt on block 0; ``None`` for a request
    without extras on these blocks."""
    salted = RequestExtras(cache_salt="s")
    assert event_extra_keys(salted, 1, 2, 4) is None
    item = MmItem(MmPosition(2, 4), "img", has_identifier=True)
    extras = RequestExtras(lora=Lora("L", "/p"), mm_items=[item], cache_salt="s")
    assert event_extra_keys(extras, 0, 3, 4) == [("L", ("img", 2), "s"), ("L", ("img", -2)), ("L",)]
    late = RequestExtras(mm_items=[MmItem(MmPosition(9, 1), "img", has_identifier=True)])
    assert event_extra_keys(late, 0, 2, 4) == [None, None]


def test_external_block_hash() -> None:
    digest = bytes.fromhex("52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a")
    assert external_block_hash(digest, True) == 1882140585328457242
    assert external_block_hash(digest, False) is digest
    assert external_block_hash(b"\x01\x02", True) == 0x0102


# --------------------------------------------------------------------------- all-or-nothing


class NoTokens:
    """A duck-typed request without ``all_token_ids``."""

    def __init__(self, block_hashes: list[bytes], num_tokens: int) -> None:
        self.request_id = "nt"
        self.num_tokens = num_tokens
        self.num_computed_tokens = 0
        self.block_hashes = block_hashes


def test_events_need_the_request_tokens_and_change_nothing_without(backend: ModuleType) -> None:
    hashes = backend.BlockHasher(2, "sha256", "n").hash_blocks([1, 2, 3, 4])
    request = NoTokens(hashes, 5)
    manager = backend.KVCacheManager(8, 2, enable_kv_cache_events=True)
    free_before = manager.block_pool.free_block_ids()
    with pytest.raises(AttributeError, match="all_token_ids"):
        manager.allocate_slots(request, 5)
    assert manager.block_pool.free_block_ids() == free_before
    assert manager.get_block_ids("nt") == ([],)
    assert manager.take_events() == []
    # Events off: the tokens are never read.
    assert backend.KVCacheManager(8, 2).allocate_slots(request, 5) == [1, 2, 3]


def test_bad_token_ids_are_refused_before_any_change(backend: ModuleType) -> None:
    hashes = backend.BlockHasher(2, "sha256", "n").hash_blocks([1, 2])
    request = NoTokens(hashes, 3)
    request.all_token_ids = [1.0, 2, 3]  # type: ignore[attr-defined]
    manager = backend.KVCacheManager(8, 2, enable_kv_cache_events=True)
    with pytest.raises(TypeError, match="'float' object cannot be interpreted as an integer"):
        manager.allocate_slots(request, 3)
    assert manager.block_pool.get_num_free_blocks() == 7
    assert manager.take_events() == []


# --------------------------------------------------------------------------- router-grade


@pytest.mark.parametrize("case", golden_params("events"))
def test_last_copy_removal(backend: ModuleType, case: dict[str, Any]) -> None:
    """The option keeps exactly vLLM's removals of a hash's last cached copy."""
    copies: collections.Counter[Any] = collections.Counter()

    def check(op: dict[str, Any], events: list[Any], manager: Any) -> None:
        want = []
        for hex_event, event in zip(op["events"], op["events_decoded"], strict=True):
            if event["type"] == "BlockStored":
                copies.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                (block_hash,) = event["block_hashes"]
                copies[block_hash] -= 1
                if copies[block_hash] > 0:
                    continue
                del copies[block_hash]
            else:
                copies.clear()
            want.append(hex_event)
        assert encode_hex(events) == want
        # A plain set rebuilt from the stream equals the pool's cached hashes.
        cached = {
            external_block_hash(block.block_hash, True)
            for b in range(case["num_blocks"])
            if (block := manager.block_pool.get_block(b)).block_hash is not None
        }
        assert set(copies) == cached

    replay(backend, case, check, kv_events_last_copy_removal=True)


def test_sequenced_batch_is_readable_as_vllms_batch() -> None:
    stored = BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[1, 2],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    )
    payload = msgspec.msgpack.encode(
        SequencedKVEventBatch(ts=2.0, events=[stored], data_parallel_rank=3, seq=41)
    )
    as_vllm = msgspec.msgpack.decode(payload, type=KVEventBatch)
    assert as_vllm == KVEventBatch(ts=2.0, events=[stored], data_parallel_rank=3)
    plain = msgspec.msgpack.encode(KVEventBatch(ts=2.0, events=[]))
    assert msgspec.msgpack.decode(plain, type=SequencedKVEventBatch).seq is None


# --------------------------------------------------------------------------- property

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 5), st.integers(1, 14)),
        st.tuples(st.just("decode"), st.integers(0, 5), st.integers(0, 3)),
        st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("evict"), st.integers(0, 11), st.integers(0, 11)),
        st.tuples(st.just("reset"), st.just(0), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, last_copy=st.booleans())
def test_backends_emit_identical_streams_that_rebuild_the_cache(
    ops: list[tuple[str, int, int]], last_copy: bool
) -> None:
    """Random workloads with shared prefixes: both backends emit the same bytes, and
    the cached hashes rebuilt from the stream alone equal the pool's.

    With ``last_copy_removal`` a consumer keeps a set: a hash cached twice (a duplicate
    block) is stored twice but removed once, when its last copy goes."""
    streams = []
    for backend in (reference, _native):
        hasher = backend.BlockHasher(2, "sha256", "prop")
        manager = backend.KVCacheManager(
            12, 2, enable_kv_cache_events=True, kv_events_last_copy_removal=last_copy
        )
        live: dict[int, Any] = {}
        stream: list[str] = []
        rebuilt: collections.Counter[ExternalBlockHash] = collections.Counter()
        present: set[ExternalBlockHash] = set()
        for kind, a, b in ops:
            if kind == "add" and a not in live:
                # Prompts share prefixes: token t at position i is (i * 7) % (a % 3 + 5).
                prompt = [(i * 7) % (a % 3 + 5) for i in range(b)]
                request = backend.Request(f"r{a}", prompt, block_hasher=hasher)
                hits, n = manager.get_computed_blocks(request)
                if manager.allocate_slots(request, b - n, n, hits) is not None:
                    request.num_computed_tokens = b
                    live[a] = request
            elif kind == "decode" and a in live:
                request = live[a]
                request.append_output_token_ids(b)
                if manager.allocate_slots(request, 1) is not None:
                    request.num_computed_tokens += 1
            elif kind == "free" and a in live:
                manager.free(live.pop(a))
            elif kind == "evict":
                manager.evict_blocks([a, b])
            elif kind == "reset":
                manager.reset_prefix_cache()
            for event in manager.take_events():
                stream.append(msgspec.msgpack.encode(event).hex())
                if isinstance(event, BlockStored):
                    rebuilt.update(event.block_hashes)
                    present.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    rebuilt.subtract(event.block_hashes)
                    present.difference_update(event.block_hashes)
                else:
                    rebuilt.clear()
                    present.clear()
            pool = manager.block_pool
            cached = collections.Counter(
                external_block_hash(block.block_hash, True)
                for i in range(12)
                if (block := pool.get_block(i)).block_hash is not None
            )
            if last_copy:
                assert present == set(cached)
            else:
                assert +rebuilt == cached
        streams.append(stream)
    assert streams[0] == streams[1]


def vllm_adapter_manager(**kwargs: Any) -> Any:
    """The vLLM adapter's native half, with events on, and one request cached."""
    full_attention = ("full", 4, None, 0, None, 0)
    manager = _native.VllmKVCacheManager(
        16,
        4,
        4,
        64,
        [full_attention],
        enable_kv_cache_events=True,
        admission_statuses=[0],
        **kwargs,
    )
    request = _native.Request("r", list(range(8)), block_hasher=_native.BlockHasher(4))
    assert manager.allocate_slots(request, 8) is not None
    return manager


def test_the_vllm_adapter_builds_events_as_the_classes_it_is_given() -> None:
    """The adapter passes vLLM's ``kv_events``; any module with the same fields works."""

    class BlockStored(kvblocks.events.BlockStored):
        pass

    structs = SimpleNamespace(
        BlockStored=BlockStored,
        BlockRemoved=kvblocks.events.BlockRemoved,
        AllBlocksCleared=kvblocks.events.AllBlocksCleared,
    )
    (stored,) = vllm_adapter_manager(
        event_structs=structs, event_metadata=[("mla_attention", None)]
    ).take_events()
    assert type(stored) is BlockStored
    assert stored.kv_cache_spec_kind == "mla_attention"
    assert stored.token_ids == list(range(8))
    (default,) = vllm_adapter_manager().take_events()
    assert type(default) is kvblocks.events.BlockStored
    assert default.kv_cache_spec_kind == "full_attention"


def test_the_vllm_adapter_refuses_event_classes_with_other_fields() -> None:
    class BlockRemoved(msgspec.Struct):
        block_hashes: list[bytes]
        medium: str | None

    structs = SimpleNamespace(
        BlockStored=kvblocks.events.BlockStored,
        BlockRemoved=BlockRemoved,
        AllBlocksCleared=kvblocks.events.AllBlocksCleared,
    )
    with pytest.raises(TypeError, match=r'has the fields \["block_hashes", "medium"\], not'):
        vllm_adapter_manager(event_structs=structs)


def _block_stored_without(*dropped: str) -> type:
    """kvblocks' ``BlockStored`` without the named fields (as an older vLLM's)."""
    fields = [
        (f.name, f.type, f.default)
        for f in msgspec.structs.fields(kvblocks.events.BlockStored)
        if f.name not in dropped
    ]
    return msgspec.defstruct("BlockStored", fields, tag=True, array_like=True)


def test_the_vllm_adapter_takes_an_older_block_stored() -> None:
    """vLLM 0.31 and 0.32's ``BlockStored`` lacks the trailing ``lookahead_token_ids``,
    which the adapter never sets: accepted. A class lacking a field it sets is not."""
    older = _block_stored_without("lookahead_token_ids")
    structs = SimpleNamespace(
        BlockStored=older,
        BlockRemoved=kvblocks.events.BlockRemoved,
        AllBlocksCleared=kvblocks.events.AllBlocksCleared,
    )
    (stored,) = vllm_adapter_manager(event_structs=structs).take_events()
    assert type(stored) is older
    assert isinstance(stored, msgspec.Struct)
    assert msgspec.structs.asdict(stored)["token_ids"] == list(range(8))
    structs.BlockStored = _block_stored_without("lookahead_token_ids", "lora_name")
    with pytest.raises(TypeError, match=r"BlockStored.* has the fields .*, not those of"):
        vllm_adapter_manager(event_structs=structs)
