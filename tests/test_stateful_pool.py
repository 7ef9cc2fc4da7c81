"""The reference BlockPool and the backend's, driven by the same random operations.

A hypothesis state machine applies every operation to ``kvblocks.reference.BlockPool`` and
to ``backend.BlockPool`` and, after each step, compares their whole observable state
(free queue, every block snapshot, free count, usage, every lookup) and the outcome of the
call itself: the same result, or the same exception class with the same message. Hostile
calls (double frees, unknown ids, too many blocks, negative or non-int arguments, bad
hashes) are part of the mix. For ``backend=python`` this compares the reference with a
second reference pool, which still checks determinism and every invariant.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kvblocks import reference as _reference
from support import Outcome, block_tuple, examples, outcome

#: The pure-Python reference every backend is compared with.
reference: ModuleType = _reference

#: Hashes of every length a hasher produces (32 and 16 bytes) plus odd ones; few, so
#: that duplicates are common.
HASHES = [b"\x01" * 32, b"\x02" * 32, b"\x03" * 16, b"\x04" * 16, b"", b"\x05" * 7]
GROUPS = [0, 1, 7]
HOSTILE = [
    "over-free",
    "unknown-id",
    "too-many",
    "negative",
    "not-an-int",
    "bad-lookup",
    "bad-cache",
]
SETTINGS = settings(
    max_examples=examples(120),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class PoolComparison(RuleBasedStateMachine):
    """Drives a reference pool and a backend pool in lockstep."""

    backend: ModuleType

    def __init__(self) -> None:
        super().__init__()
        self.pools: tuple[Any, Any] | None = None
        #: Holders of references, like requests' block tables: one ref per entry.
        self.tables: list[list[int]] = []
        self.num_blocks = 0

    # ------------------------------------------------------------------ helpers

    def both(self, call: Callable[[Any], Any]) -> Outcome:
        """Runs ``call`` on both pools and checks that they did the same thing."""
        assert self.pools is not None
        ref, other = self.pools
        expected = outcome(lambda: call(ref))
        got = outcome(lambda: call(other))
        assert got == expected
        return expected

    @property
    def ref(self) -> Any:
        assert self.pools is not None
        return self.pools[0]

    def any_id(self) -> st.SearchStrategy[int]:
        return st.integers(0, self.num_blocks - 1)

    # ------------------------------------------------------------------ setup

    @initialize(num_blocks=st.integers(1, 12), enable_caching=st.booleans())
    def create(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.pools = (
            reference.BlockPool(num_blocks, enable_caching),
            self.backend.BlockPool(num_blocks, enable_caching),
        )

    # ------------------------------------------------------------------ normal operations

    @rule(data=st.data(), n=st.integers(0, 5), group=st.sampled_from(GROUPS))
    def admit(self, data: st.DataObject, n: int, group: int) -> None:
        """A request's blocks allocated, then its full blocks cached."""
        result = self.both(lambda p: p.get_new_blocks(n))
        if result[0] != "ok" or not result[1]:
            return
        table = list(result[1])
        self.tables.append(table)
        num_full = data.draw(st.integers(0, len(table)))
        hashes = data.draw(st.lists(st.sampled_from(HASHES), min_size=num_full, max_size=num_full))
        self.both(lambda p: p.cache_full_blocks(table, hashes, 0, num_full, group))

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), n=st.integers(1, 3))
    def grow(self, data: st.DataObject, n: int) -> None:
        table = data.draw(st.sampled_from(self.tables))
        result = self.both(lambda p: p.get_new_blocks(n))
        if result[0] == "ok":
            table.extend(result[1])

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), group=st.sampled_from(GROUPS))
    def cache(self, data: st.DataObject, group: int) -> None:
        """Any range of a table, so already-hashed blocks are refused now and then."""
        table = data.draw(st.sampled_from(self.tables))
        num_full = data.draw(st.integers(0, len(table)))
        num_cached = data.draw(st.integers(0, num_full + 1))
        hashes = data.draw(
            st.lists(st.sampled_from(HASHES), min_size=num_full, max_size=num_full + 1)
        )
        self.both(lambda p: p.cache_full_blocks(table, hashes, num_cached, num_full, group))

    @rule(
        block_hash=st.sampled_from(HASHES),
        groups=st.lists(st.sampled_from(GROUPS), max_size=2),
    )
    def lookup_and_touch(self, block_hash: bytes, groups: list[int]) -> None:
        """A prefix hit adopted by a new holder."""
        result = self.both(lambda p: p.get_cached_block(block_hash, groups))
        if result[0] == "ok" and result[1]:
            hits = list(result[1])
            self.both(lambda p: p.touch(hits))
            self.tables.append(hits)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free_table(self, data: st.DataObject) -> None:
        """A request finishing: its blocks freed tail first."""
        table = self.tables.pop(data.draw(st.integers(0, len(self.tables) - 1)))
        assert self.both(lambda p: p.free_blocks(reversed(table))) == ("ok", None)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free_tail(self, data: st.DataObject) -> None:
        """Part of a table released, e.g. a preempted tail."""
        table = data.draw(st.sampled_from(self.tables))
        k = data.draw(st.integers(1, len(table)))
        tail = table[-k:]
        del table[-k:]
        if not table:
            self.tables.remove(table)
        assert self.both(lambda p: p.free_blocks(tail[::-1])) == ("ok", None)

    @rule(data=st.data(), reset=st.integers(0, 3))
    def evict_or_reset(self, data: st.DataObject, reset: int) -> None:
        if reset == 0:
            self.both(lambda p: p.reset_prefix_cache())
        else:
            ids = data.draw(st.lists(self.any_id(), max_size=4))
            self.both(lambda p: p.evict_blocks(ids))

    # ------------------------------------------------------------------ hostile calls

    @rule(data=st.data(), kind=st.sampled_from(HOSTILE))
    def hostile(self, data: st.DataObject, kind: str) -> None:
        """A call that must be refused the same way by both, changing nothing.

        Each call has exactly one fault, so the comparison does not depend on the order
        in which a backend validates its arguments.
        """
        result = self.both(self.hostile_call(data, kind))
        assert result[0] == "error", kind
        if kind == "not-an-int":
            assert result[1] is TypeError

    def hostile_call(self, data: st.DataObject, kind: str) -> Callable[[Any], Any]:
        n = self.num_blocks
        if kind == "over-free":
            # One more free than the block is held, after a legal free of another block.
            # (In a one-block pool, block 1 does not exist: refused as unknown instead.)
            block_id = data.draw(st.integers(1, max(n - 1, 1)))
            times = self.ref.get_block(block_id).ref_cnt + 1 if block_id < n else 1
            prefix = [t[0] for t in self.tables[:1] if t[0] != block_id]
            ids = [*prefix, *[block_id] * times]
            return lambda p: p.free_blocks(ids)
        if kind == "unknown-id":
            bad = data.draw(st.sampled_from([-1, -7, n, n + 3]))
            ids = [*data.draw(st.lists(self.any_id(), max_size=2)), bad]
            op = data.draw(st.sampled_from(["free", "touch", "evict", "cache", "get"]))
            return {
                "free": lambda p: p.free_blocks(ids),
                "touch": lambda p: p.touch(ids),
                "evict": lambda p: p.evict_blocks(ids),
                "cache": lambda p: p.cache_full_blocks(ids, HASHES[:1], 0, 1),
                "get": lambda p: p.get_block(bad),
            }[op]
        if kind == "too-many":
            count = self.ref.get_num_free_blocks() + data.draw(st.integers(1, 3))
            return lambda p: p.get_new_blocks(count)
        if kind == "negative":
            count = data.draw(st.integers(-5, -1))
            return lambda p: p.get_new_blocks(count)
        if kind == "not-an-int":
            value = data.draw(st.sampled_from([1.5, 2.0, "1", None]))
            op = data.draw(
                st.sampled_from(["alloc", "free", "touch", "evict", "get", "cache", "group"])
            )
            return {
                "alloc": lambda p: p.get_new_blocks(value),
                "free": lambda p: p.free_blocks([value]),
                "touch": lambda p: p.touch([value]),
                "evict": lambda p: p.evict_blocks([value]),
                "get": lambda p: p.get_block(value),
                "cache": lambda p: p.cache_full_blocks([1], HASHES[:1], value, 1),
                "group": lambda p: p.get_cached_block(HASHES[0], [0, value]),
            }[op]
        if kind == "bad-lookup":
            bad_hash = data.draw(st.sampled_from([b"z" * 33, "text", bytearray(b"ab"), 7]))
            return lambda p: p.get_cached_block(bad_hash)
        if not self.tables:  # "bad-cache" needs a valid table: one fault per call
            return lambda p: p.get_new_blocks(p.get_num_free_blocks() + 1)
        # kind == "bad-cache": a table with inconsistent arguments
        table = data.draw(st.sampled_from(self.tables))
        size = len(table)
        how = data.draw(st.sampled_from(["short", "past", "long", "type", "negative", "group"]))
        return {
            "short": lambda p: p.cache_full_blocks(table, HASHES[: size - 1], 0, size),
            "past": lambda p: p.cache_full_blocks(table, HASHES[:1] * (size + 1), 0, size + 1),
            "long": lambda p: p.cache_full_blocks(table, [b"x" * 33] * size, 0, size),
            "type": lambda p: p.cache_full_blocks(table, ["ab"] * size, 0, size),
            "negative": lambda p: p.cache_full_blocks(table, HASHES[:1] * size, -1, size),
            "group": lambda p: p.cache_full_blocks(table, HASHES[:1] * size, 0, size, -2),
        }[how]

    # ------------------------------------------------------------------ the comparison

    @invariant()
    def same_observable_state(self) -> None:
        if self.pools is None:
            return
        ref, other = self.pools
        ref.check_invariants()
        other.check_invariants()
        assert other.free_block_ids() == ref.free_block_ids()
        assert other.get_num_free_blocks() == ref.get_num_free_blocks()
        assert other.get_usage() == ref.get_usage()
        assert (other.num_blocks, other.enable_caching, other.block_size) == (
            ref.num_blocks,
            ref.enable_caching,
            ref.block_size,
        )
        for block_id in range(self.num_blocks):
            assert block_tuple(other, block_id) == block_tuple(ref, block_id)
        for block_hash in HASHES:
            for groups in ([0], [1], [7], [0, 1]):
                assert other.get_cached_block(block_hash, groups) == ref.get_cached_block(
                    block_hash, groups
                )


def test_pool_matches_the_reference(backend: ModuleType) -> None:
    machine = type("PoolMachine", (PoolComparison,), {"backend": backend})
    run_state_machine_as_test(machine, settings=SETTINGS)
