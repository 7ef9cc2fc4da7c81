"""Hostile input, one test per class of fault found by differential fuzzing.

Every public call reads each input once, in a documented order, into plain values
(64-bit ints, exact ``str``/``bytes`` contents, lists snapshotted when read), validates
them, then uses them. Cases that once aborted the process or hung run in a child
process, so a regression is a reported failure with its reproducer, not a dead run.
"""

from __future__ import annotations

import array
import os
import re
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

import pytest
from kvblocks.errors import KVBlocksError
from support import Req, outcome


class LyingIterator:
    """An empty iterator whose ``__length_hint__`` claims ``hint`` items."""

    def __init__(self, hint: int) -> None:
        self.hint = hint

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        raise StopIteration

    def __length_hint__(self) -> int:
        return self.hint


def run_child(backend: ModuleType, body: str, timeout: float = 60) -> str:
    """Runs ``body`` (which prints its result) on ``backend`` in a fresh interpreter."""
    name = "python" if backend.__name__ == "kvblocks.reference" else "rust"
    code = f"from kvblocks import load_backend\nkb = load_backend({name!r})\n" + textwrap.dedent(
        body
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            check=False,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung for {timeout} s; reproduce with:\n{code}")
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}\n{code}"
    return proc.stdout.strip()


# ------------------------------------------------------------------ claimed sizes


@pytest.mark.parametrize("hint", [2**40, 2**62])
def test_a_hashers_lying_length_hint_is_ignored_not_aborted(backend: ModuleType, hint: int) -> None:
    out = run_child(
        backend,
        f"""
        from test_hostile_input import LyingIterator
        r = kb.Request("r", [1, 2], block_hasher=lambda r: LyingIterator({hint}))
        print(r.block_hashes)
        """,
    )
    assert out == "[]"


def test_appended_tokens_with_a_lying_length_hint_are_what_it_yields(backend: ModuleType) -> None:
    out = run_child(
        backend,
        """
        from test_hostile_input import LyingIterator
        r = kb.Request("r", [1, 2])
        r.append_output_token_ids(LyingIterator(2**40))
        print(r.all_token_ids)
        """,
    )
    assert out == "[1, 2]"


@pytest.mark.parametrize("claimed", [2**40, 2**62])
def test_a_request_claiming_more_tokens_hashes_the_blocks_it_has(
    backend: ModuleType, claimed: int
) -> None:
    out = run_child(
        backend,
        f"""
        class Duck:
            all_token_ids = [1, 2, 3, 4, 5]
            num_tokens = {claimed}
            block_hashes = []
            cache_salt = "salt"
        hasher = kb.BlockHasher(2, seed="s")
        print(hasher(Duck()) == hasher.hash_blocks([1, 2, 3, 4], extra_keys=[
            (("cache_salt", "salt"),), None]))
        """,
    )
    assert out == "True"


@pytest.mark.parametrize("num_blocks", [2**32 - 2, 2**40])
def test_pools_past_the_limit_are_refused_at_once(backend: ModuleType, num_blocks: int) -> None:
    out = run_child(
        backend,
        f"""
        n = {num_blocks}
        for make in (lambda: kb.BlockPool(n), lambda: kb.KVCacheManager(n, 16)):
            try:
                make()
            except ValueError as e:
                print(e)
        """,
    )
    expected = f"num_blocks must be at most {2**32 - 3}, got {num_blocks}"
    assert out.splitlines() == [expected, expected]


# ------------------------------------------------------------------ lists changed while read


class Mutator:
    """An int-like item whose ``__index__`` first changes ``target`` (the list it sits in,
    or another argument): ``grow`` appends, ``shrink`` drops the last item, ``replace``
    overwrites it; what it appends or writes is no int, so reading it fails."""

    def __init__(self, value: int, target: list[Any], change: str) -> None:
        self.value = value
        self.target = target
        self.change = change

    def __index__(self) -> int:
        if self.change == "grow":
            self.target.append("appended")
        elif self.change == "shrink" and self.target:
            del self.target[-1]
        elif self.change == "replace" and self.target:
            self.target[-1] = "replaced"
        return self.value


def changing(values: list[int], change: str, at: int = 0) -> list[Any]:
    """``values`` as a list whose item ``at`` changes the list when it is read."""
    items: list[Any] = list(values)
    items[at] = Mutator(values[at], items, change)
    return items


def _pool_free(b: ModuleType, ids: Any) -> Any:
    pool = b.BlockPool(8)
    pool.get_new_blocks(6)
    pool.free_blocks(ids)
    return pool.free_block_ids()


def _manager_hits(b: ModuleType, ids: Any) -> Any:
    manager = b.KVCacheManager(8, 2)
    return manager.allocate_slots(b.Request("r", [1, 2, 3, 4]), 4, 0, ids)


#: Every reader of a sequence of ints: ``call(backend, seq)`` for a ``seq`` made of
#: ``values``, returning plain values.
INT_READERS: dict[str, tuple[list[int], Any]] = {
    "hash_block": ([1, 2, 3, 4], lambda b, s: b.BlockHasher(4).hash_block(None, s)),
    "hash_blocks": ([1, 2, 3, 4], lambda b, s: b.BlockHasher(2).hash_blocks(s)),
    "Request": ([1, 2, 3, 4], lambda b, s: b.Request("r", s).all_token_ids),
    "append_output_token_ids": (
        [1, 2, 3, 4],
        lambda b, s: (r := b.Request("r", [9])).append_output_token_ids(s) or r.all_token_ids,
    ),
    "free_blocks": ([1, 2, 3], _pool_free),
    "allocate_slots hits": ([1, 2], _manager_hits),
    "get_cached_block groups": (
        [0, 0, 0],
        lambda b, s: b.BlockPool(4).get_cached_block(b"x" * 32, s),
    ),
    "rollback_invalid_blocks table": (
        [1, 2, 3],
        lambda b, s: b.rollback_invalid_blocks([s], [12], [0], [3], 4).num_computed_tokens,
    ),
    "rollback_invalid_blocks ids": (
        [1, 2, 3],
        lambda b, s: b.rollback_invalid_blocks([[1, 2, 3]], [12], [0], s, 4).num_computed_tokens,
    ),
    "RollbackResult": ([1, 2, 3], lambda b, s: b.RollbackResult(s, [0], 0, []).num_computed_tokens),
}


@pytest.mark.parametrize("change", ["grow", "shrink", "replace"])
@pytest.mark.parametrize("reader", sorted(INT_READERS))
def test_a_list_changed_while_read_is_read_as_it_was(
    backend: ModuleType, reader: str, change: str
) -> None:
    """A list is read as ``list()`` gave it before any item was converted: an item's
    ``__index__`` changing the list it sits in changes nothing read."""
    values, call = INT_READERS[reader]
    expected = outcome(lambda: call(backend, list(values)))
    assert expected[0] == "ok", expected
    assert outcome(lambda: call(backend, changing(values, change))) == expected


class ShrinkingHashes(Sequence[bytes]):
    """A registered ``Sequence`` of block hashes that drops all but its first two when
    its first item is read."""

    def __init__(self, items: list[bytes]) -> None:
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: Any) -> Any:
        item = self.items[index]
        del self.items[2:]
        return item


HASHES4 = [bytes([i]) * 32 for i in range(1, 5)]


def test_cached_block_hashes_are_read_as_list_gives_them(backend: ModuleType) -> None:
    """``cache_full_blocks`` reads a sequence as ``list()`` gives it, not by index."""
    pool = backend.BlockPool(8)
    blocks = pool.get_new_blocks(4)
    with pytest.raises(ValueError, match=r"^need 4 block hashes, got 2$"):
        pool.cache_full_blocks(blocks, ShrinkingHashes(HASHES4), 2, 4)
    pool.check_invariants()
    assert [pool.get_block(b).block_hash for b in blocks] == [None] * 4


def test_pool_scalars_are_read_before_sequences(backend: ModuleType) -> None:
    """``cache_full_blocks`` reads its ints before its sequences: a count whose
    ``__index__`` appends hashes has them read."""
    pool = backend.BlockPool(8)
    blocks = pool.get_new_blocks(4)
    hashes = HASHES4[:2]

    class Count:
        def __index__(self) -> int:
            hashes.extend(HASHES4[2:])
            return 4

    pool.cache_full_blocks(blocks, hashes, 0, Count())
    assert [pool.get_block(b).block_hash for b in blocks] == HASHES4


def test_rollback_scalars_are_read_before_sequences(backend: ModuleType) -> None:
    """``rollback_invalid_blocks`` reads ``block_size`` before its columns."""
    computed = [8]

    class Size:
        def __index__(self) -> int:
            computed[0] = 4
            return 4

    result = backend.rollback_invalid_blocks([[1, 2]], computed, [0], [9], Size())
    assert result.num_computed_tokens == [4]


# ------------------------------------------------------------------ lying length hints


class HintedIterator:
    """An iterator over ``items`` whose ``__length_hint__`` lies (or raises)."""

    def __init__(self, items: list[Any], hint: Any) -> None:
        self.items = iter(items)
        self.hint = hint

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return next(self.items)

    def __length_hint__(self) -> int:
        if self.hint == "raise":
            raise LookupError("__length_hint__ raised")
        result: int = self.hint
        return result


class LyingLen(list[Any]):
    """A list subclass whose ``__len__`` claims 2**62 items (``list()`` preallocates)."""

    def __len__(self) -> int:
        return 2**62


LYING_HINTS = [10**11, 2**62, 2**63, -1, "raise"]


@pytest.mark.parametrize("hint", LYING_HINTS, ids=str)
@pytest.mark.parametrize("position", range(4))
def test_rollback_ignores_a_lying_length_hint(
    backend: ModuleType, position: int, hint: Any
) -> None:
    """An iterable's ``__length_hint__`` is never asked: its items are what it yields."""
    args: list[Any] = [[[1, 2, 3]], [12], [0], [3], 4]
    expected = backend.rollback_invalid_blocks(*args)
    args[position] = HintedIterator(args[position], hint)
    assert backend.rollback_invalid_blocks(*args) == expected


@pytest.mark.parametrize("form", ["hint", "len"])
@pytest.mark.parametrize("reader", sorted(INT_READERS))
def test_every_reader_ignores_claimed_lengths(backend: ModuleType, reader: str, form: str) -> None:
    values, call = INT_READERS[reader]
    expected = outcome(lambda: call(backend, list(values)))
    seq = HintedIterator(values, 2**62) if form == "hint" else LyingLen(values)
    assert outcome(lambda: call(backend, seq)) == expected


def test_hash_and_set_readers_ignore_claimed_lengths(backend: ModuleType) -> None:
    pool = backend.BlockPool(8)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, HintedIterator(HASHES4[:2], 2**62), 0, 2)
    assert pool.find_longest_cache_hit(HintedIterator(HASHES4, -1)) == blocks
    request = backend.Request("r", [1, 2], block_hasher=lambda r: HintedIterator([], 2**62))
    assert request.block_hashes == []

    class LyingSet(set[int]):
        def __len__(self) -> int:
            return 2**62

    made = backend.InvalidBlocksOutcome(set(), set(), set(), LyingSet({3}), 0)
    assert made.evicted_block_ids == {3}


# ------------------------------------------------------------------ read once


def test_one_shot_invalid_ids_reach_every_pass(backend: ModuleType) -> None:
    def run(invalid: Any) -> Any:
        manager = backend.KVCacheManager(16, 4)
        req = backend.Request("a", list(range(8)))
        manager.allocate_slots(req, 8)
        req.num_computed_tokens = 8
        result = backend.handle_invalid_blocks(manager, invalid, {}, running=[req])
        return result, req.num_computed_tokens, manager.get_block_ids("a")

    ids = manager_ids = run([1])
    assert run(iter([1])) == manager_ids
    assert ids[0].failed_req_ids == {"a"} and ids[1] == 0


class CountingRequest:
    """A duck request whose every attribute read is counted and changes the next value."""

    def __init__(self) -> None:
        self.reads: dict[str, int] = {}
        self._num_computed_tokens = 0

    def _read(self, name: str) -> int:
        self.reads[name] = self.reads.get(name, 0) + 1
        return self.reads[name]

    @property
    def request_id(self) -> str:
        return f"r{self._read('request_id')}"

    @property
    def num_tokens(self) -> int:
        return 8 * self._read("num_tokens")

    @property
    def num_computed_tokens(self) -> int:
        self._read("num_computed_tokens")
        return self._num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self._num_computed_tokens = value

    @property
    def block_hashes(self) -> list[bytes]:
        self._read("block_hashes")
        return [bytes([1]) * 32, bytes([2]) * 32]


@pytest.mark.parametrize(
    "call",
    [
        lambda m, r: m.get_computed_blocks(r),
        lambda m, r: m.allocate_slots(r, 8),
        lambda m, r: m.cache_blocks(r, 0),
        lambda m, r: m.record_prefix_cache_stats(r, 0),
    ],
    ids=["get_computed_blocks", "allocate_slots", "cache_blocks", "record_prefix_cache_stats"],
)
def test_manager_reads_each_request_attribute_once(backend: ModuleType, call: Any) -> None:
    request = CountingRequest()
    call(backend.KVCacheManager(16, 4), request)
    assert request.reads == dict.fromkeys(
        ["request_id", "num_tokens", "num_computed_tokens", "block_hashes"], 1
    )


def test_rollback_reads_each_request_attribute_once(backend: ModuleType) -> None:
    manager = backend.KVCacheManager(16, 4)
    request = CountingRequest()
    backend.handle_invalid_blocks(manager, [1], {}, running=[request])
    assert request.reads == {"request_id": 1, "num_computed_tokens": 1}


class HostileDict(dict[str, int]):
    def get(self, *args: Any) -> Any:
        raise AssertionError("a dict is read as a dict")

    def __getitem__(self, key: str) -> int:
        raise AssertionError("a dict is read as a dict")


def test_scheduled_tokens_dict_subclass_is_read_as_a_dict(backend: ModuleType) -> None:
    manager = backend.KVCacheManager(16, 4)
    req = backend.Request("a", list(range(8)))
    manager.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    affected, tokens, _ = backend.update_requests_with_invalid_blocks(
        manager, [req], [1], HostileDict(a=4)
    )
    # Four tokens were computed before this step, in block 1, which failed.
    assert (affected, tokens, req.num_computed_tokens) == ({"a"}, 4, 0)


# ------------------------------------------------------------------ exact contents


class HostileStr(str):
    __slots__ = ()

    def __hash__(self) -> int:
        raise RuntimeError("__hash__ must not run")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("__eq__ must not run")


class HostileBytes(bytes):
    def __hash__(self) -> int:
        raise RuntimeError("__hash__ must not run")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("__eq__ must not run")


def test_request_ids_are_read_as_their_contents(backend: ModuleType) -> None:
    request = backend.Request(HostileStr("a"), list(range(8)))
    assert type(request.request_id) is str
    manager = backend.KVCacheManager(16, 4)
    manager.allocate_slots(request, 8)
    assert manager.get_block_ids("a") == ([1, 2],)
    outcome_ = backend.handle_failed_recving([HostileStr("a")], [request])
    assert outcome_.failed_req_ids == {"a"}


def test_policies_and_modes_are_read_as_their_contents(backend: ModuleType) -> None:
    request = Req("r", 16)
    outcome_ = backend.handle_failed_recving(["r"], [request], policy=HostileStr("recompute"))
    assert outcome_.retry_req_ids == {"r"}
    result = backend.rollback_invalid_blocks([[1]], [16], [0], [1], 16, mode=HostileStr("strict"))
    assert result.num_computed_tokens == [0]


def test_unencodable_and_non_str_ids_raise_the_same_class(backend: ModuleType) -> None:
    with pytest.raises(UnicodeEncodeError):
        backend.Request("\ud800", [1])
    with pytest.raises(TypeError):
        backend.Request(7, [1])


class IntIdRequest:
    """A duck request whose id is an int."""

    request_id = 5
    num_tokens = 4
    num_computed_tokens = 0
    block_hashes: ClassVar[list[bytes]] = []


NON_STR_ID_CALLS: dict[str, tuple[str, Any]] = {
    "allocate_slots": (
        "request_id",
        lambda b: b.KVCacheManager(8, 4).allocate_slots(IntIdRequest(), 4),
    ),
    "get_computed_blocks": (
        "request_id",
        lambda b: b.KVCacheManager(8, 4).get_computed_blocks(IntIdRequest()),
    ),
    "free": ("request_id", lambda b: b.KVCacheManager(8, 4).free(IntIdRequest())),
    "get_block_ids": ("request_id", lambda b: b.KVCacheManager(8, 4).get_block_ids(5)),
    "update_requests_with_invalid_blocks": (
        "request_id",
        lambda b: b.update_requests_with_invalid_blocks(
            b.KVCacheManager(8, 4), [IntIdRequest()], [1], {}
        ),
    ),
    "handle_failed_recving ids": (
        "failed_req_ids item",
        lambda b: b.handle_failed_recving([5], []),
    ),
    "handle_failed_recving requests": (
        "request_id",
        lambda b: b.handle_failed_recving(["a"], [IntIdRequest()]),
    ),
    "InvalidBlocksOutcome": (
        "request_id",
        lambda b: b.InvalidBlocksOutcome({5}, set(), set(), set(), 0),
    ),
    "Request": ("request_id", lambda b: b.Request(5, [1])),
}


@pytest.mark.parametrize("call", sorted(NON_STR_ID_CALLS))
def test_a_non_str_request_id_is_named_in_every_call(backend: ModuleType, call: str) -> None:
    name, run = NON_STR_ID_CALLS[call]
    with pytest.raises(TypeError, match=rf"^{name} must be a str, got int$"):
        run(backend)


BAD_FIELDS: list[tuple[str, object, type[Exception], str]] = [
    ("num_tokens", 1.5, TypeError, "'float' object cannot be interpreted as an integer"),
    ("num_computed_tokens", 2**70, OverflowError, ""),
    ("block_hashes", 5, TypeError, "must be a sequence, got int"),
]


@pytest.mark.parametrize(("field", "value", "error", "message"), BAD_FIELDS)
def test_a_bad_request_field_is_named(
    backend: ModuleType, field: str, value: object, error: type[Exception], message: str
) -> None:
    """One reader, one error style: every call names the field it could not convert."""
    manager = backend.KVCacheManager(8, 4)
    request = SimpleNamespace(request_id="r", num_tokens=4, num_computed_tokens=0, block_hashes=[])
    setattr(request, field, value)
    expected = f"^request\\.{field}: {re.escape(message)}"
    with pytest.raises(error, match=expected):
        manager.allocate_slots(request, 4)
    with pytest.raises(error, match=expected):
        manager.get_computed_blocks(request)
    if field == "num_computed_tokens":
        with pytest.raises(error, match=expected):
            backend.update_requests_with_invalid_blocks(manager, [request], [1], {})
        with pytest.raises(error, match=expected):
            backend.handle_failed_recving(["r"], [request])
    assert manager.block_pool.get_num_free_blocks() == 7, "a refused call changes nothing"


def test_a_hash_with_hostile_dunders_is_cached_by_content(backend: ModuleType) -> None:
    pool = backend.BlockPool(8, block_size=2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [HostileBytes(b"a" * 32), HostileBytes(b"b" * 32)], 0, 2, 0)
    pool.check_invariants()
    assert pool.get_cached_block(b"b" * 32) == [blocks[1]]
    assert type(pool.get_block(blocks[0]).block_hash) is bytes


def test_seed_subclass_is_read_as_its_contents(backend: ModuleType) -> None:
    class Seed(str):
        __slots__ = ()

        def __reduce_ex__(self, protocol: Any) -> Any:
            raise RuntimeError("the seed is hashed as a plain str")

    hasher = backend.BlockHasher(4, seed=Seed("s"))
    assert type(hasher.seed) is str
    assert hasher.none_hash == backend.BlockHasher(4, seed="s").none_hash


def test_a_salts_truth_is_tested_once(backend: ModuleType) -> None:
    """A salt whose truth changes between tests is salted as its first answer says."""

    class Salt:
        answers: ClassVar[list[bool]] = []

        def __bool__(self) -> bool:
            self.answers.append(not self.answers)
            return self.answers[-1]

    request = backend.Request("r", list(range(8)), cache_salt=Salt())
    with pytest.raises(TypeError, match="unsupported extra key type 'Salt'"):
        backend.BlockHasher(4)(request)
    assert Salt.answers == [True]


class Logged:
    """An object whose listed attributes, truth, length and items are logged when read."""

    def __init__(self, log: list[str], name: str, items: Sequence[Any] = (), **attrs: Any) -> None:
        self._log, self._name, self._items, self._attrs = log, name, items, attrs

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_") or attr not in self._attrs:
            raise AttributeError(attr)
        self._log.append(f"{self._name}.{attr}")
        return self._attrs[attr]

    def __bool__(self) -> bool:
        self._log.append(f"bool({self._name})")
        return True

    def __len__(self) -> int:
        self._log.append(f"len({self._name})")
        return len(self._items)

    def __getitem__(self, index: int) -> Any:
        self._log.append(f"{self._name}[{index}]")
        return self._items[index]


def logged_request(log: list[str], block_hashes: list[bytes]) -> Logged:
    """A 12-token request with an adapter, a salt and two multimodal items: one over
    tokens 2..6 (blocks 0 and 1 of 4 tokens), one past its tokens."""
    items = [
        Logged(
            log,
            f"item{i}",
            mm_position=Logged(log, f"pos{i}", offset=offset, length=4),
            identifier=f"img{i}",
        )
        for i, offset in enumerate([2, 100])
    ]
    lora = Logged(log, "lora", lora_name="L", lora_path="/p", lora_int_id=3)
    return Logged(
        log,
        "request",
        request_id="r",
        num_tokens=12,
        num_computed_tokens=0,
        block_hashes=block_hashes,
        all_token_ids=list(range(12)),
        prompt_embeds=None,
        lora_request=lora,
        mm_features=Logged(log, "mm", items),
        cache_salt="s",
    )


#: After the request's own fields, its extras, in the order of the keys they make.
EXTRAS_READ_ORDER = [
    "request.lora_request",
    "request.mm_features",
    "request.cache_salt",
    "bool(lora)",
    "lora.lora_name",
    "lora.lora_path",
    "bool(mm)",
    "len(mm)",
    "mm[0]",
    "item0.mm_position",
    "pos0.offset",
    "pos0.length",
    "mm[1]",
    "item1.mm_position",
    "pos1.offset",
    "pos1.length",
    "item0.identifier",
]


def test_a_hashed_requests_extras_are_read_in_one_order(backend: ModuleType) -> None:
    """The documented order (docs/errors.md): the request's fields, then its extras;
    only the identifiers of the items the hashed blocks overlap are read."""
    log: list[str] = []
    hashes = backend.BlockHasher(4)(logged_request(log, []))
    assert len(hashes) == 3
    fields = ["request.block_hashes", "request.num_tokens", "request.prompt_embeds"]
    assert log == [*fields, "request.all_token_ids", *EXTRAS_READ_ORDER]


def test_a_request_with_no_new_full_block_is_read_as_vllm_reads_it(backend: ModuleType) -> None:
    """vLLM's hasher returns early after ``block_hashes`` and ``num_tokens`` when no
    block is full: so does kvblocks', before ``prompt_embeds``, which may be set."""
    hasher = backend.BlockHasher(4)
    log: list[str] = []
    request = logged_request(log, hasher(logged_request([], [])))
    request._attrs["prompt_embeds"] = [0.5]
    assert hasher(request) == []
    assert log == ["request.block_hashes", "request.num_tokens"]


def test_a_cached_requests_extras_are_read_in_one_order_for_events(backend: ModuleType) -> None:
    """Caching with events on reads the tokens, then the extras as hashing does, then
    the adapter's id for ``BlockStored.lora_id``."""
    pytest.importorskip("msgspec")
    hashes = backend.BlockHasher(4)(logged_request([], []))
    log: list[str] = []
    manager = backend.KVCacheManager(16, 4, enable_kv_cache_events=True)
    manager.allocate_slots(logged_request(log, hashes), 12)
    fields = ["request.request_id", "request.num_tokens", "request.num_computed_tokens"]
    tail = ["lora.lora_int_id"]
    assert log == [
        *fields,
        "request.block_hashes",
        "request.all_token_ids",
        *EXTRAS_READ_ORDER,
        *tail,
    ]
    (stored,) = manager.take_events()
    assert stored.lora_id == 3
    assert stored.extra_keys == [("L", ("img0", 2), "s"), ("L", ("img0", -2)), ("L",)]


# ------------------------------------------------------------------ 64-bit ints


@pytest.mark.parametrize(
    "call",
    [
        lambda b: b.BlockPool(2**70),
        lambda b: b.BlockPool(8).get_new_blocks(2**70),
        lambda b: b.BlockPool(8).free_blocks([2**70]),
        lambda b: b.BlockPool(8).get_block(-(2**70)),
        lambda b: b.BlockHasher(2**64),
        lambda b: b.KVCacheManager(8, 2**70),
        lambda b: b.KVCacheManager(8, 4).allocate_slots(b.Request("a", [1]), 2**64),
    ],
)
def test_ints_past_64_bits_raise_overflow_error(backend: ModuleType, call: Any) -> None:
    result = outcome(lambda: call(backend))
    assert result[:2] == ("error", OverflowError)
    assert not issubclass(result[1], KVBlocksError)


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 2**200])
def test_ints_past_64_bits_are_named_as_this_platforms_c_reader_names_them(
    backend: ModuleType, value: int
) -> None:
    # PyO3 reads a 64-bit int through C's `long` where that is 64 bits wide, and through
    # `long long` where it is not (Windows): CPython words the two overflows differently.
    typecode = "l" if struct.calcsize("l") == 8 else "q"
    with pytest.raises(OverflowError) as c_reader:
        array.array(typecode, [value])
    with pytest.raises(OverflowError) as call:
        backend.BlockPool(8).get_block(value)
    assert str(call.value) == str(c_reader.value)


# ------------------------------------------------------------------ value classes


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda b: b.RollbackResult([1.5], [0], 0, []), TypeError),
        (lambda b: b.RollbackResult("12", [0], 0, []), TypeError),
        (lambda b: b.RollbackResult(7, [0], 0, []), TypeError),
        (lambda b: b.KVCacheBlock(1, 0, "x", None, False), TypeError),
        (lambda b: b.KVCacheBlock(-1, 0, None, None, False), OverflowError),
        (lambda b: b.KVCacheBlock(1, 0, None, 2**32, False), OverflowError),
        (lambda b: b.KVCacheBlock(1, 0, None, None, 1), TypeError),
        (lambda b: b.RollbackResult([1], [-1], 0, []), OverflowError),
        (lambda b: b.RollbackResult([1], [0], -1, []), OverflowError),
        (lambda b: b.InvalidBlocksOutcome(["a"], set(), set(), set(), 0), TypeError),
        (lambda b: b.InvalidBlocksOutcome({1}, set(), set(), set(), 0), TypeError),
        (lambda b: b.InvalidBlocksOutcome(set(), set(), set(), {"x"}, 0), TypeError),
        (lambda b: b.InvalidBlocksOutcome(set(), set(), set(), set(), -1), OverflowError),
        (lambda b: b.PrefixCacheStats(-1), OverflowError),
        (lambda b: b.PrefixCacheStats(1.0), TypeError),
        (lambda b: b.PrefixCacheStats(reset=1), TypeError),
    ],
)
def test_value_classes_check_their_fields(backend: ModuleType, make: Any, error: type) -> None:
    with pytest.raises(error):
        make(backend)


@pytest.mark.parametrize(
    "fields",
    [
        (-1, 0, None, None, False),
        (2**32, 0, None, None, False),
        (1, 0, None, 2**32, False),
        # Past 64 bits either way: the same message.
        (-(2**63) - 1, 0, None, None, False),
        (1, 2**64, None, None, False),
        (1, 0, None, 2**200, False),
    ],
)
def test_narrow_block_fields_out_of_range_say_so(backend: ModuleType, fields: Any) -> None:
    with pytest.raises(OverflowError, match=r"^out of range integral type conversion attempted"):
        backend.KVCacheBlock(*fields)


def test_value_classes_store_plain_values(backend: ModuleType) -> None:
    result = backend.RollbackResult((4,), [0], 4, (1, 2))
    assert (result.num_computed_tokens, result.blocks_to_evict) == ([4], [1, 2])

    class Id(str):
        __slots__ = ()

    outcome_ = backend.InvalidBlocksOutcome(frozenset({Id("a")}), set(), set(), set(), 0)
    assert outcome_.failed_req_ids == {"a"}
    assert all(type(i) is str for i in outcome_.failed_req_ids)


def test_numpy_bools_are_bools_in_value_classes(backend: ModuleType) -> None:
    np = pytest.importorskip("numpy")
    assert backend.PrefixCacheStats(reset=np.True_).reset is True
    assert backend.KVCacheBlock(0, 0, None, None, np.False_).is_null is False


@pytest.mark.parametrize("value", [None, 1, "yes"])
def test_a_bool_field_names_the_type_it_got(backend: ModuleType, value: object) -> None:
    # Found by the fuzzer's long profile: PyO3's own message named the value, not its type.
    expected = f"'{type(value).__name__}' object is not an instance of 'bool'"
    with pytest.raises(TypeError) as block:
        backend.KVCacheBlock(0, 0, None, None, value)
    with pytest.raises(TypeError) as stats:
        backend.PrefixCacheStats(reset=value)
    assert str(block.value) == str(stats.value) == expected
