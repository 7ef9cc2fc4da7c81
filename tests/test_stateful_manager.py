"""The reference KVCacheManager and the backend's, driven by the same random workload.

Requests are admitted (with prefix hits, external tokens, async loads), decoded, freed,
their blocks evicted, the cache reset, stats taken, and hostile calls made, on both
managers in lockstep; after every step the block tables, the free queue, every block and
the outcome of the call (result, or exception class and message) must be identical.
Each side uses its own backend's ``Request`` and ``BlockHasher`` on the same tokens.
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

#: Shared prompt prefixes, so that prefix hits and duplicate blocks are common.
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5]]
TOKENS = st.integers(0, 3)
SETTINGS = settings(
    max_examples=examples(100),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class Pair:
    """One request as each backend sees it: the same tokens in each backend's Request."""

    def __init__(self, sides: tuple[Any, Any]) -> None:
        self.sides = sides

    @property
    def request_id(self) -> str:
        rid: str = self.sides[0].request_id
        return rid

    @property
    def num_tokens(self) -> int:
        n: int = self.sides[0].num_tokens
        return n

    @property
    def num_computed_tokens(self) -> int:
        n: int = self.sides[0].num_computed_tokens
        return n

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        for request in self.sides:
            request.num_computed_tokens = value

    def append(self, tokens: list[int]) -> None:
        for request in self.sides:
            request.append_output_token_ids(tokens)
        assert list(self.sides[0].block_hashes) == list(self.sides[1].block_hashes)


class ManagerComparison(RuleBasedStateMachine):
    """Drives a reference manager and a backend manager in lockstep."""

    backend: ModuleType

    def __init__(self) -> None:
        super().__init__()
        self.managers: tuple[Any, Any] | None = None
        self.hashers: tuple[Any, Any] | None = None
        self.live: dict[str, Pair] = {}
        self.seen: list[str] = []
        self.next_id = 0
        self.num_blocks = 0

    # ------------------------------------------------------------------ helpers

    def both(self, call: Callable[[Any, int], Any]) -> Outcome:
        """Runs ``call(manager, side)`` on both managers; they must do the same thing."""
        assert self.managers is not None
        ref, other = self.managers
        expected = outcome(lambda: call(ref, 0))
        got = outcome(lambda: call(other, 1))
        assert got == expected
        return expected

    def new_pair(self, tokens: list[int]) -> Pair:
        assert self.hashers is not None
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self.seen.append(request_id)
        modules = (reference, self.backend)
        ref_side, other_side = (
            module.Request(request_id, tokens, block_hasher=hasher)
            for module, hasher in zip(modules, self.hashers, strict=True)
        )
        return Pair((ref_side, other_side))

    @property
    def ref(self) -> Any:
        assert self.managers is not None
        return self.managers[0]

    # ------------------------------------------------------------------ setup

    @initialize(
        num_blocks=st.integers(2, 32),
        block_size=st.sampled_from([1, 2, 2, 4, 4]),
        enable_caching=st.sampled_from([True, True, True, False]),
        algo=st.sampled_from(["sha256", "sha256_cbor"]),
        max_model_len=st.sampled_from([None, None, 24]),
    )
    def create(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        algo: str,
        max_model_len: int | None,
    ) -> None:
        self.num_blocks = num_blocks
        kwargs = {
            "enable_caching": enable_caching,
            "max_model_len": max_model_len,
            "log_stats": True,
        }
        self.managers = (
            reference.KVCacheManager(num_blocks, block_size, **kwargs),
            self.backend.KVCacheManager(num_blocks, block_size, **kwargs),
        )
        self.hashers = (
            reference.BlockHasher(block_size, algo, "0"),
            self.backend.BlockHasher(block_size, algo, "0"),
        )

    # ------------------------------------------------------------------ workload

    @rule(
        data=st.data(),
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(TOKENS, max_size=10),
        mode=st.sampled_from(["sync", "sync", "external", "async"]),
        lookahead=st.integers(0, 2),
    )
    def admit(
        self, data: st.DataObject, prefix: list[int], tail: list[int], mode: str, lookahead: int
    ) -> None:
        """The scheduler's admission: lookup, allocate, record stats."""
        tokens = [*prefix, *tail] or [0]
        pair = self.new_pair(tokens)
        found = self.both(lambda m, i: m.get_computed_blocks(pair.sides[i]))
        assert found[0] == "ok"
        hits, num_hit_tokens = found[1]
        rest = len(tokens) - num_hit_tokens
        external = 0 if mode == "sync" else data.draw(st.integers(0, rest - 1))
        num_new = 0 if mode == "async" else rest - external
        result = self.both(
            lambda m, i: m.allocate_slots(
                pair.sides[i],
                num_new,
                num_hit_tokens,
                hits,
                num_lookahead_tokens=lookahead,
                num_external_computed_tokens=external,
                delay_cache_blocks=mode == "async",
            )
        )
        if result[0] != "ok":
            return
        if result[1] is None:
            # No room: the scheduler would preempt a running request to make some.
            if self.live:
                self.preempt(data)
            return
        pair.num_computed_tokens = num_hit_tokens + external + num_new
        self.both(lambda m, i: m.record_prefix_cache_stats(pair.sides[i], num_hit_tokens))
        self.live[pair.request_id] = pair

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new_tokens=st.lists(TOKENS, max_size=3), lookahead=st.integers(0, 2))
    def step(self, data: st.DataObject, new_tokens: list[int], lookahead: int) -> None:
        """One more step of a live request: the rest of its prompt, or decoded tokens."""
        pair = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if new_tokens:
            pair.append(new_tokens)
        todo = pair.num_tokens - pair.num_computed_tokens
        result = self.both(
            lambda m, i: m.allocate_slots(pair.sides[i], todo, num_lookahead_tokens=lookahead)
        )
        if result[0] == "ok" and result[1] is not None:
            pair.num_computed_tokens = pair.num_tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cache_blocks(self, data: st.DataObject) -> None:
        """An async load landed (or any caching call): may be refused if blocks are missing."""
        pair = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        num_tokens = data.draw(st.integers(0, pair.num_tokens))
        self.both(lambda m, i: m.cache_blocks(pair.sides[i], num_tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        """A request finishing (or being preempted): its blocks freed tail first."""
        self.preempt(data)

    def preempt(self, data: st.DataObject) -> None:
        pair = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        assert self.both(lambda m, i: m.free(pair.sides[i])) == ("ok", None)

    @rule(data=st.data(), reset=st.integers(0, 3))
    def evict_or_reset(self, data: st.DataObject, reset: int) -> None:
        if reset == 0:
            self.both(lambda m, i: m.reset_prefix_cache())
        else:
            ids = data.draw(st.lists(st.integers(0, self.num_blocks - 1), max_size=3))
            self.both(lambda m, i: m.evict_blocks(set(ids)))

    @rule()
    def take_stats(self) -> None:
        def stats(manager: Any, _: int) -> tuple[int, int, int] | None:
            s = manager.make_prefix_cache_stats()
            return None if s is None else (s.requests, s.queries, s.hits)

        self.both(stats)
        assert self.both(lambda m, i: m.take_events()) == ("ok", [])

    # ------------------------------------------------------------------ hostile calls

    @rule(
        data=st.data(),
        kind=st.sampled_from(
            ["negative", "zero", "adopt", "unknown-free", "stats", "unknown-id", "bad-id"]
        ),
    )
    def hostile(self, data: st.DataObject, kind: str) -> None:
        live = sorted(self.live)
        pair = self.live[data.draw(st.sampled_from(live))] if live else self.new_pair([1, 2, 3])
        request = pair.sides
        if kind == "negative":
            name = data.draw(
                st.sampled_from(
                    [
                        "num_new_tokens",
                        "num_new_computed_tokens",
                        "num_lookahead_tokens",
                        "num_external_computed_tokens",
                    ]
                )
            )
            kwargs = {"num_new_tokens": 1, name: data.draw(st.integers(-3, -1))}
            result = self.both(lambda m, i: m.allocate_slots(request[i], **kwargs))
        elif kind == "zero":
            result = self.both(lambda m, i: m.allocate_slots(request[i], 0))
        elif kind == "adopt":
            # A request that holds blocks cannot adopt hits or external tokens again.
            if not live:
                return
            result = self.both(lambda m, i: m.allocate_slots(request[i], 1, 1, [1]))
        elif kind == "unknown-free":
            ghost = self.new_pair([7, 7])
            assert self.both(lambda m, i: m.free(ghost.sides[i])) == ("ok", None)
            return
        elif kind == "stats":
            bad = data.draw(st.sampled_from([-1, pair.num_tokens + 1]))
            result = self.both(lambda m, i: m.record_prefix_cache_stats(request[i], bad))
        elif kind == "unknown-id":
            assert self.both(lambda m, i: m.get_block_ids("no-such-request")) == ("ok", ([],))
            return
        else:
            bad_id = data.draw(st.sampled_from([-1, self.num_blocks]))
            result = self.both(lambda m, i: m.evict_blocks([bad_id]))
        assert result[0] == "error", kind

    # ------------------------------------------------------------------ the comparison

    @invariant()
    def same_observable_state(self) -> None:
        if self.managers is None:
            return
        ref, other = self.managers
        ref.block_pool.check_invariants()
        other.block_pool.check_invariants()
        for request_id in self.seen:
            assert other.get_block_ids(request_id) == ref.get_block_ids(request_id)
        assert other.block_pool.free_block_ids() == ref.block_pool.free_block_ids()
        assert other.block_pool.get_num_free_blocks() == ref.block_pool.get_num_free_blocks()
        assert other.usage == ref.usage
        for block_id in range(self.num_blocks):
            assert block_tuple(other.block_pool, block_id) == block_tuple(ref.block_pool, block_id)
        # Ref counts are exactly the blocks' appearances in live block tables.
        uses: dict[int, int] = {}
        for pair in self.live.values():
            for block_id in ref.get_block_ids(pair.request_id)[0]:
                uses[block_id] = uses.get(block_id, 0) + 1
        for block_id in range(1, self.num_blocks):
            assert ref.block_pool.get_block(block_id).ref_cnt == uses.get(block_id, 0)


def test_manager_matches_the_reference(backend: ModuleType) -> None:
    machine = type("ManagerMachine", (ManagerComparison,), {"backend": backend})
    run_state_machine_as_test(machine, settings=SETTINGS)
