"""vLLM 0.33.0's ``KVCacheManager`` and kvblocks' driven in lockstep by a Hypothesis machine.

:class:`ManagerLockstep` builds both managers from the same constructor arguments, gives
each side its own twin of every vLLM ``Request`` (same id, tokens and
``num_computed_tokens``; block hashes from vLLM's own ``get_request_block_hasher``), calls
the same manager, coordinator, block-pool and ``KVCacheBlocks`` members on both, and after
every call compares the result (or the exception class), the KV events the call produced
and the observable state (usage, free blocks, every block table with its blocks' ref
counts and hashes).

A difference raises a :class:`DivergenceError`. Its class is made per ``(call, aspect)``, so
Hypothesis (which tells bugs apart by exception class and raise site) reports each
distinct divergence with its own minimal example instead of only the first one found.

When vLLM raises, its state may be half-mutated, so once both sides raised the same
class the machine builds both managers afresh (same configuration) and forgets its
requests, rather than compare two half-states.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import harness
from hypothesis import currently_in_test_context, event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from kvblocks.vllm import KVCacheManager as KVBlocksManager
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request, RequestStatus

__all__ = ["Config", "DivergenceError", "ManagerLockstep", "Side"]

# vLLM logs a warning for each refused prefix-cache reset; thousands of them hide a report.
logging.getLogger("vllm").setLevel(logging.ERROR)

#: The request ids the machine uses; a few, so that frees, re-admissions and reuse of an
#: id after its request finished are common.
SLOT_IDS = ("r0", "r1", "r2", "r3")
#: An id no request ever has: calls with it reach the managers' "unknown request" paths.
GHOST_ID = "ghost"
#: Two token sequences prompts start from, so that prefixes (and hits) are shared.
BASES = (tuple(range(1000, 1100)), tuple(range(2000, 2100)))
HASH_NAMES = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
SIDE_NAMES = ("vLLM", "kvblocks")
#: Which live request a rule acts on; past the live ones, an unknown request.
LIVE_REQUEST = st.integers(0, len(SLOT_IDS) - 1)
ANY_REQUEST = st.integers(0, len(SLOT_IDS))

ManagerFactory = Callable[..., Any]


class DivergenceError(AssertionError):
    """kvblocks did not do what vLLM did. ``call`` names the member, ``aspect`` what
    differed: ``exception``, ``result``, ``events`` or ``state``."""

    call: ClassVar[str] = ""
    aspect: ClassVar[str] = ""


_DIVERGENCE_CLASSES: dict[tuple[str, str], type[DivergenceError]] = {}


def divergence(call: str, aspect: str, message: str) -> DivergenceError:
    """A :class:`DivergenceError` of the class kept for ``(call, aspect)``."""
    cls = _DIVERGENCE_CLASSES.get((call, aspect))
    if cls is None:
        name = f"DivergenceError_{call}_{aspect}".replace(".", "_")
        cls = type(name, (DivergenceError,), {"call": call, "aspect": aspect})
        _DIVERGENCE_CLASSES[call, aspect] = cls
    return cls(f"{call} ({aspect}): {message}")


@dataclass(frozen=True)
class Config:
    """One machine's managers: their constructor arguments and the hash function."""

    num_blocks: int
    block_size: int
    max_model_len: int
    enable_caching: bool
    log_stats: bool
    enable_kv_cache_events: bool
    watermark: float
    hash_name: str

    def kwargs(self) -> dict[str, Any]:
        """``KVCacheManager``'s keyword arguments, as vLLM's Scheduler passes them."""
        return {
            "kv_cache_config": harness.build_kv_cache_config(self.num_blocks, self.block_size),
            "max_model_len": self.max_model_len,
            "scheduler_block_size": self.block_size,
            "hash_block_size": self.block_size,
            "max_in_flight_tokens": self.max_model_len,
            "enable_caching": self.enable_caching,
            "log_stats": self.log_stats,
            "enable_kv_cache_events": self.enable_kv_cache_events,
            "watermark": self.watermark,
        }


@st.composite
def configs(draw: st.DrawFn) -> Config:
    """Small pools (so admissions fail and requests get preempted) of every block size."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    blocks_per_request = draw(st.integers(2, 8))
    max_model_len = min(64, block_size * blocks_per_request + draw(st.integers(0, 3)))
    max_model_len = max(max_model_len, 2)
    return Config(
        num_blocks=draw(st.integers(1, 12)),
        block_size=block_size,
        max_model_len=max_model_len,
        enable_caching=draw(st.booleans()),
        log_stats=draw(st.booleans()),
        enable_kv_cache_events=draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1, 0.25, 0.5])),
        hash_name=draw(st.sampled_from(HASH_NAMES)),
    )


@dataclass
class Twin:
    """One request as each side sees it: equal, but separate, vLLM ``Request`` objects."""

    sides: tuple[Request, Request]

    @property
    def v(self) -> Request:
        return self.sides[0]

    def set(self, **attrs: Any) -> None:
        """Sets the attributes on both requests (as the Scheduler sets them)."""
        for request in self.sides:
            for name, value in attrs.items():
                setattr(request, name, value)

    def append(self, tokens: Sequence[int]) -> None:
        """Appends output tokens to both (vLLM's hasher extends ``block_hashes``)."""
        for request in self.sides:
            request.append_output_token_ids(list(tokens))


@dataclass
class Outcome:
    """What one side's call did: its raw result (or exception) and the result normalised."""

    raw: Any = None
    norm: Any = None
    error: Exception | None = None


@dataclass
class Side:
    """One manager and the objects its calls produced."""

    index: int
    manager: Any
    lookups: dict[str, Any] = field(default_factory=dict)
    deferred: list[list[Any]] = field(default_factory=list)
    pinned: list[list[Any]] = field(default_factory=list)


# ----------------------------------------------------------------------------- normalise


def core_hash(block_hash: Any) -> bytes | None:
    """A block's hash without vLLM's 4-byte group id suffix (``BlockHashWithGroupId``).

    vLLM's hashes are 32 (sha256) or 16 (xxhash) bytes, so a length of 4 modulo 16 is
    a hash with the suffix. How each side spells the suffix is compared on its own
    (``KVCacheBlock.block_hash``), so that it does not mask every other result.
    """
    if block_hash is None:
        return None
    raw = bytes(block_hash)
    return raw[:-4] if len(raw) % 16 == 4 else raw


def norm_block(block: Any) -> tuple[Any, ...]:
    """A block as a connector reads it: id, ref count, hash (bytes), null."""
    return (block.block_id, block.ref_cnt, core_hash(block.block_hash), bool(block.is_null))


def block_hash_view(block: Any) -> tuple[Any, ...]:
    """The hash of a block exactly as vLLM's ``KVCacheBlock`` has it (with the group id).

    ``block_hash_num_tokens`` is left out: kvblocks does not keep it (a deliberate
    difference, in ``docs/vllm.md``).
    """
    block_hash = block.block_hash
    return (block.block_id, None if block_hash is None else bytes(block_hash))


def norm_blocks(blocks: Any) -> dict[str, Any]:
    """A ``KVCacheBlocks`` through every member a Scheduler or connector reads."""
    out: dict[str, Any] = {
        "ids": blocks.get_block_ids(),
        "ids_or_none": blocks.get_block_ids(allow_none=True),
        "group_0": blocks.get_block_ids(group_ids=[0]),
        "no_group": blocks.get_block_ids(allow_none=True, group_ids=[]),
        "unhashed": blocks.get_unhashed_block_ids(),
        "unhashed_all": blocks.get_unhashed_block_ids_all_groups(),
        "blocks": [[norm_block(b) for b in group] for group in blocks.blocks],
        "new_empty": blocks.new_empty().get_block_ids(),
    }
    return out


def norm_value(value: Any) -> Any:
    """Results made comparable across the two sides."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if hasattr(value, "get_block_ids") and hasattr(value, "blocks"):
        return norm_blocks(value)
    if hasattr(value, "block_id") and hasattr(value, "ref_cnt"):
        return norm_block(value)
    if isinstance(value, (list, tuple)):
        return [norm_value(v) for v in value]
    if isinstance(value, dict):
        return {k: norm_value(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: norm_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return harness.normalise(value)


# ------------------------------------------------------------------------------ machine


class ManagerLockstep(RuleBasedStateMachine):
    """vLLM's ``KVCacheManager`` (``reference``) and kvblocks' (``candidate``) in lockstep.

    Subclasses swap ``candidate`` (or ``reference``) for a manager with a planted fault.
    """

    reference: ClassVar[ManagerFactory] = VllmManager
    candidate: ClassVar[ManagerFactory] = KVBlocksManager

    def __init__(self) -> None:
        super().__init__()
        self.config: Config | None = None
        self.sides: tuple[Side, Side] = (Side(0, None), Side(1, None))
        self.reqs: dict[str, Twin] = {}
        self.hasher: Any = None
        self.calls = 0
        #: Both constructors raised: nothing is left to compare.
        self.dead = False
        #: A divergence that is reported when the run ends (see ``same_state``).
        self.deferred_divergence: DivergenceError | None = None

    # -------------------------------------------------------------- building and calling

    def _build_managers(self) -> None:
        assert self.config is not None
        kwargs = self.config.kwargs()
        # A raise here is a divergence of the constructor, like any other call's.
        self.sides = (Side(0, None), Side(1, None))
        self.reqs = {}
        factories = (type(self).reference, type(self).candidate)
        built = [
            self._run(lambda s: factories[s.index](**kwargs), side, normalise=False)
            for side in self.sides
        ]
        if self._compare("__init__", built):
            self.dead = True
        for side, outcome in zip(self.sides, built, strict=True):
            side.manager = outcome.raw

    def _run(self, fn: Callable[[Side], Any], side: Side, *, normalise: bool = True) -> Outcome:
        try:
            raw = fn(side)
        except Exception as err:
            return Outcome(error=err)
        return Outcome(raw=raw, norm=norm_value(raw) if normalise else None)

    def _compare(self, call: str, outcomes: Sequence[Outcome]) -> bool:
        """Checks the two outcomes; True when vLLM raised (and kvblocks raised alike)."""
        ref, got = outcomes
        if ref.error is not None:
            expected = type(ref.error)
            if got.error is None:
                raise divergence(
                    call,
                    "exception",
                    f"vLLM raised {expected.__name__}({ref.error}); kvblocks returned {got.norm!r}",
                )
            if not isinstance(got.error, expected):
                raise divergence(
                    call,
                    "exception",
                    f"vLLM raised {expected.__name__}({ref.error}); kvblocks raised "
                    f"{type(got.error).__name__}({got.error})",
                )
            return True
        if got.error is not None:
            raise divergence(
                call,
                "exception",
                f"vLLM returned {ref.norm!r}; kvblocks raised "
                f"{type(got.error).__name__}({got.error})",
            )
        if ref.norm != got.norm:
            raise divergence(call, "result", f"vLLM {ref.norm!r} != kvblocks {got.norm!r}")
        return False

    def both(self, call: str, fn: Callable[[Side], Any]) -> tuple[Any, Any] | None:
        """Calls ``fn`` on each side and compares what happened (result or exception
        class, then the KV events the call queued).

        Returns:
            Both raw results, or None when both raised (the managers were rebuilt).
        """
        if self.dead:
            return None
        self.calls += 1
        outcomes = [self._run(fn, side) for side in self.sides]
        raised = self._compare(call, outcomes)
        if raised:
            assert outcomes[0].error is not None
            if currently_in_test_context():  # the rules also run as plain methods
                event(f"both raised {type(outcomes[0].error).__name__} in {call}: rebuilt")
            self._build_managers()
            return None
        self._compare_events(call)
        return outcomes[0].raw, outcomes[1].raw

    def _compare_events(self, call: str) -> None:
        taken = [self._run(lambda s: s.manager.take_events(), side) for side in self.sides]
        ref, got = taken
        if ref.error is not None or got.error is not None:
            self._compare(f"{call}+take_events", taken)
            return
        ref_events = [harness.normalise(e, "event") for e in ref.raw]
        got_events = [harness.normalise(e, "event") for e in got.raw]
        if ref_events != got_events:
            raise divergence(call, "events", f"vLLM {ref_events!r} != kvblocks {got_events!r}")

    def request(self, side: Side, slot: str) -> Request:
        return self.reqs[slot].sides[side.index]

    def ghost(self) -> Request:
        """A request no manager has seen (a fresh object each call)."""
        num_tokens = min(3, self.cfg.max_model_len - 1) or 1
        return self.new_request(GHOST_ID, [7] * num_tokens, SamplingParams(max_tokens=4))

    def new_request(self, rid: str, prompt: list[int], params: SamplingParams) -> Request:
        return Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            arrival_time=0.0,
            block_hasher=self.hasher,
        )

    def pick(self, which: int, *, ghost: bool, waiting: bool = False) -> str:
        """The ``which``-th live request's id (of those not running, if ``waiting``),
        or past the live ones the id no manager knows (when ``ghost``)."""
        live = [
            rid
            for rid, twin in self.reqs.items()
            if not waiting or twin.v.status != RequestStatus.RUNNING
        ]
        if ghost and which >= len(live):
            return GHOST_ID
        return live[which % len(live)] if live else GHOST_ID

    @property
    def cfg(self) -> Config:
        assert self.config is not None
        return self.config

    # ----------------------------------------------------------------------- the rules

    @initialize(config=configs())
    def build(self, config: Config) -> None:
        self.config = config
        hash_fn = get_hash_fn_by_name(config.hash_name)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(config.block_size, hash_fn)
        self._build_managers()
        self.both("constants", self._constants)

    @staticmethod
    def _constants(side: Side) -> Any:
        m = side.manager
        return (
            m.max_model_len,
            m.enable_caching,
            m.log_stats,
            m.enable_kv_cache_events,
            m.use_eagle,
            m.num_kv_cache_groups,
            m.watermark_blocks,
            m.metrics_collector,
            m.mamba_shared_prefix_checkpoint,
            m.retained_hit_group_ids,
            m.kv_cache_config.num_blocks,
            m.empty_kv_cache_blocks,
            m.block_pool.num_gpu_blocks,
            m.block_pool.enable_caching,
            m.block_pool.hash_block_size,
            m.block_pool.null_block,
            m.coordinator.enable_partial_hash_hits,
            m.coordinator.num_reprefillable_tokens,
            sorted(m.coordinator.eagle_group_ids),
            [(s.block_size, s.kv_cache_group_id) for s in m.coordinator.single_type_managers],
        )

    @precondition(lambda self: len(self.reqs) < len(SLOT_IDS))
    @rule(
        which=LIVE_REQUEST,
        base=st.sampled_from([0, 1]),
        shared=st.integers(0, 64),
        suffix=st.lists(st.integers(0, 3), max_size=12),
        report_full=st.booleans(),
        skip_reading=st.sampled_from([False, False, False, True]),
    )
    def add_request(
        self,
        *,
        which: int,
        base: int,
        shared: int,
        suffix: list[int],
        report_full: bool,
        skip_reading: bool,
    ) -> None:
        """A new request (waiting) under a free id; a finished id is used again."""
        free_ids = [i for i in SLOT_IDS if i not in self.reqs]
        slot = free_ids[which % len(free_ids)]
        prompt = (list(BASES[base][:shared]) + suffix)[: self.cfg.max_model_len - 1] or [5]
        extra = {"kv_cache_report_mode": "full"} if report_full else None
        twins = tuple(
            self.new_request(
                slot,
                list(prompt),
                SamplingParams(
                    max_tokens=8, extra_args=extra, skip_reading_prefix_cache=skip_reading
                ),
            )
            for _ in SIDE_NAMES
        )
        self.reqs[slot] = Twin((twins[0], twins[1]))

    @rule(
        which=LIVE_REQUEST,
        cap=st.sampled_from(
            ["default", "default", "zero", "tokens", "over", "block", "odd"]
            if harness.TAKES_MAX_CACHE_HIT_LENGTH
            else ["default"]
        ),
        connector=st.booleans(),
        ext_blocks=st.sampled_from([0, 0, 0, 1, 2]),
        ext_extra=st.integers(0, 3),
        truncate=st.booleans(),
        chunk=st.integers(0, 70),
        lookahead=st.sampled_from([0, 0, 1, 3]),
        delay=st.booleans(),
        full_fit=st.booleans(),
        reserved=st.sampled_from([0, 0, 1, 3]),
        has_scheduled=st.booleans(),
        record=st.booleans(),
    )
    @precondition(lambda self: any(t.v.status != RequestStatus.RUNNING for t in self.reqs.values()))
    def admit(
        self,
        *,
        which: int,
        cap: str,
        connector: bool,
        ext_blocks: int,
        ext_extra: int,
        truncate: bool,
        chunk: int,
        lookahead: int,
        delay: bool,
        full_fit: bool,
        reserved: int,
        has_scheduled: bool,
        record: bool,
    ) -> None:
        """The Scheduler's admission of a waiting or preempted request: the local lookup,
        a connector's external tokens, then ``allocate_slots`` with all its arguments."""
        slot = self.pick(which, ghost=False, waiting=True)
        twin = self.reqs.get(slot)
        if twin is None or twin.v.status == RequestStatus.RUNNING:
            return
        num_tokens = twin.v.num_tokens
        bs = self.cfg.block_size
        if twin.v.num_computed_tokens > 0:
            # A waiting request that already has computed tokens (its async KV load
            # finished) skips the lookup: empty hits, no external tokens.
            self._resume(
                slot,
                twin=twin,
                chunk=chunk,
                lookahead=lookahead,
                full_fit=full_fit,
                has_scheduled=has_scheduled,
            )
            return
        max_hit: int | None = {
            "default": None,
            "zero": 0,
            "tokens": num_tokens,
            "over": num_tokens + 2 * bs,
            "block": bs,
            "odd": max(0, num_tokens - 3),
        }[cap]
        name = "get_computed_blocks_for_connector" if connector else "get_computed_blocks"

        def lookup(side: Side) -> Any:
            m, r = side.manager, self.request(side, slot)
            if connector:
                if max_hit is None:
                    return m.get_computed_blocks_for_connector(r)
                return m.get_computed_blocks_for_connector(r, max_hit)
            if max_hit is None:
                return m.get_computed_blocks(r)
            return m.get_computed_blocks(r, max_cache_hit_length=max_hit)

        found = self.both(name, lookup)
        if found is None:
            return
        hits = [found[0][0], found[1][0]]
        num_hit = int(found[0][1])
        if truncate and num_hit >= bs:
            num_hit -= bs
            cut = self.both(
                "truncate_computed_blocks",
                lambda s: s.manager.truncate_computed_blocks(hits[s.index], num_hit),
            )
            if cut is None:
                return
            hits = [cut[0], cut[1]]
        # A connector's hit continues the local one, never past the prompt.
        num_ext = min(ext_blocks * bs + ext_extra if ext_blocks else 0, num_tokens - num_hit)
        num_ext = max(num_ext, 0)
        if delay and num_ext == 0:
            delay = False
        num_new = 0 if delay else min(chunk, num_tokens - num_hit - num_ext)

        def allocate(side: Side) -> Any:
            return side.manager.allocate_slots(
                self.request(side, slot),
                num_new,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=hits[side.index],
                num_lookahead_tokens=0 if delay else lookahead,
                num_external_computed_tokens=num_ext,
                delay_cache_blocks=delay,
                num_encoder_tokens=0,
                full_sequence_must_fit=full_fit,
                reserved_blocks=reserved,
                has_scheduled_reqs=has_scheduled,
            )

        allocated = self.both("allocate_slots[admission]", allocate)
        if allocated is None or allocated[0] is None:
            return
        twin.set(
            num_computed_tokens=num_hit + num_ext + num_new,
            status=RequestStatus.WAITING_FOR_REMOTE_KVS if delay else RequestStatus.RUNNING,
        )
        if record:
            self.both(
                "record_prefix_cache_stats",
                lambda s: s.manager.record_prefix_cache_stats(self.request(s, slot), num_hit),
            )

    def _resume(
        self,
        slot: str,
        *,
        twin: Twin,
        chunk: int,
        lookahead: int,
        full_fit: bool,
        has_scheduled: bool,
    ) -> None:
        num_new = min(chunk, twin.v.num_tokens - twin.v.num_computed_tokens)

        def allocate(side: Side) -> Any:
            return side.manager.allocate_slots(
                self.request(side, slot),
                num_new,
                num_new_computed_tokens=0,
                new_computed_blocks=side.manager.empty_kv_cache_blocks,
                num_lookahead_tokens=lookahead,
                full_sequence_must_fit=full_fit,
                has_scheduled_reqs=has_scheduled,
            )

        allocated = self.both("allocate_slots[resume]", allocate)
        if allocated is not None and allocated[0] is not None:
            twin.set(
                num_computed_tokens=twin.v.num_computed_tokens + num_new,
                status=RequestStatus.RUNNING,
            )

    @rule(
        which=LIVE_REQUEST,
        num_new=st.one_of(st.integers(1, 4), st.integers(0, 40), st.integers(-6, -1)),
        lookahead=st.sampled_from([0, 0, 1, 4, -1, -4]),
        ext=st.sampled_from([0, 0, 0, 1, 5, -2]),
        hits=st.sampled_from(["none", "none", "empty", "new_empty"]),
        delay=st.sampled_from([False, False, True]),
        full_fit=st.sampled_from([False, False, True]),
        reserved=st.sampled_from([0, 0, 2, -1]),
        has_scheduled=st.booleans(),
        advance=st.booleans(),
    )
    @precondition(lambda self: bool(self.reqs))
    def allocate(
        self,
        *,
        which: int,
        num_new: int,
        lookahead: int,
        ext: int,
        hits: str,
        delay: bool,
        full_fit: bool,
        reserved: int,
        has_scheduled: bool,
        advance: bool,
    ) -> None:
        """``allocate_slots`` as for a running request (or any request), then, if asked,
        ``num_computed_tokens`` advanced by the scheduled tokens."""
        slot = self.pick(which, ghost=False)
        twin = self.reqs.get(slot)
        if twin is None:
            return
        # The Scheduler passes a connector's tokens only to a request holding no blocks
        # (an admission), and never past the request's tokens (it asserts that).
        if self.sides[0].manager.get_blocks(slot).get_block_ids(allow_none=True) is not None:
            ext = 0
        ext = min(ext, max(twin.v.num_tokens - twin.v.num_computed_tokens, 0))

        def new_computed(side: Side) -> Any:
            empty = side.manager.empty_kv_cache_blocks
            return {"none": None, "empty": empty, "new_empty": empty.new_empty()}[hits]

        def call(side: Side) -> Any:
            return side.manager.allocate_slots(
                twin.sides[side.index],
                num_new,
                new_computed_blocks=new_computed(side),
                num_lookahead_tokens=lookahead,
                num_external_computed_tokens=ext,
                delay_cache_blocks=delay,
                full_sequence_must_fit=full_fit,
                reserved_blocks=reserved,
                has_scheduled_reqs=has_scheduled,
            )

        allocated = self.both("allocate_slots", call)
        if allocated is None or allocated[0] is None or not advance:
            return
        computed = twin.v.num_computed_tokens + num_new
        twin.set(num_computed_tokens=computed, status=RequestStatus.RUNNING)

    @rule(
        which=LIVE_REQUEST,
        spec=st.sampled_from([0, 0, 1, 2]),
        accepted=st.integers(0, 2),
        in_flight=st.sampled_from([0, 0, 1]),
    )
    @precondition(lambda self: any(t.v.status == RequestStatus.RUNNING for t in self.reqs.values()))
    def decode_step(self, *, which: int, spec: int, accepted: int, in_flight: int) -> None:
        """One Scheduler step of a running request with ``spec`` draft tokens: the
        allocation, the sampled and accepted tokens, the rejected drafts rolled back,
        then ``cache_blocks(request, num_computed_tokens - num_in_flight_tokens)``."""
        running = [r for r, t in self.reqs.items() if t.v.status == RequestStatus.RUNNING]
        slot = running[which % len(running)]
        twin = self.reqs[slot]
        allocated = self.both(
            "allocate_slots[decode]",
            lambda s: s.manager.allocate_slots(
                twin.sides[s.index], 1 + spec, num_lookahead_tokens=spec
            ),
        )
        if allocated is None or allocated[0] is None:
            return
        accepted = min(accepted, spec)
        room = self.cfg.max_model_len - twin.v.num_tokens
        sampled = [1 + accepted % 3] * min(1 + accepted, max(room, 0))
        if sampled:
            twin.append(sampled)
        twin.set(num_computed_tokens=twin.v.num_computed_tokens + len(sampled))
        num = twin.v.num_computed_tokens - in_flight
        self.both(
            "cache_blocks",
            lambda s: s.manager.cache_blocks(twin.sides[s.index], num),
        )

    @rule(which=LIVE_REQUEST, computed=st.integers(-1, 70))
    @precondition(lambda self: bool(self.reqs))
    def set_num_computed_tokens(self, which: int, computed: int) -> None:
        """The Scheduler moves ``num_computed_tokens`` (async placeholders run it past
        ``num_tokens``; rejected drafts move it back)."""
        slot = self.pick(which, ghost=False)
        twin = self.reqs.get(slot)
        # Only a running request's count moves (a preempted one is back at 0).
        if twin is not None and twin.v.status == RequestStatus.RUNNING:
            twin.set(num_computed_tokens=min(max(computed, 0), twin.v.num_tokens + 3))

    @rule(which=LIVE_REQUEST, tokens=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    @precondition(lambda self: bool(self.reqs))
    def append_output_tokens(self, which: int, tokens: list[int]) -> None:
        """Sampled tokens arrive; the request's block hashes grow with them."""
        slot = self.pick(which, ghost=False)
        twin = self.reqs.get(slot)
        if twin is None:
            return
        room = self.cfg.max_model_len - twin.v.num_tokens
        if room > 0:
            twin.append(tokens[:room])

    @rule(
        which=ANY_REQUEST,
        num=st.one_of(st.sampled_from([-1, 0]), st.integers(-3, 72)),
        relative=st.booleans(),
    )
    def cache_blocks(self, which: int, num: int, relative: bool) -> None:
        """``cache_blocks`` with any count, e.g. ``num_computed_tokens -
        num_in_flight_tokens`` (-1 on vLLM's async + spec-decode path)."""
        slot = self.pick(which, ghost=True)
        twin = self.reqs.get(slot)
        if twin is not None and relative:
            num = twin.v.num_computed_tokens + min(num, 3)

        def call(side: Side) -> Any:
            request = self.ghost() if twin is None else twin.sides[side.index]
            return side.manager.cache_blocks(request, num)

        self.both("cache_blocks", call)

    @rule(which=ANY_REQUEST, how=st.sampled_from(["finish", "preempt"]))
    def free(self, which: int, how: str) -> None:
        """A request finishes (its id may come back) or is preempted (it waits again)."""
        slot = self.pick(which, ghost=True)
        twin = self.reqs.get(slot)

        def call(side: Side) -> Any:
            request = self.ghost() if twin is None else twin.sides[side.index]
            return side.manager.free(request)

        if self.both("free", call) is None or twin is None:
            return
        if how == "finish":
            del self.reqs[slot]
        else:
            twin.set(
                num_computed_tokens=0,
                status=RequestStatus.PREEMPTED,
                num_preemptions=twin.v.num_preemptions + 1,
            )

    @rule(which=ANY_REQUEST, defer=st.booleans())
    def pop_blocks_for_free(self, which: int, defer: bool) -> None:
        """A deferred free: the blocks come back to the pool through
        ``block_pool.free_blocks`` (tail first), now or in a later step."""
        slot = self.pick(which, ghost=True)
        twin = self.reqs.get(slot)

        def call(side: Side) -> Any:
            request = self.ghost() if twin is None else twin.sides[side.index]
            return side.manager.pop_blocks_for_free(request)

        popped = self.both("pop_blocks_for_free", call)
        if popped is None:
            return
        for side in self.sides:
            side.deferred.append(list(popped[side.index]))
        if twin is not None:
            del self.reqs[slot]
        if not defer:
            self.flush_deferred_frees()

    def flush_deferred_frees(self) -> None:
        """``block_pool.free_blocks(reversed(blocks))`` for every popped table."""
        if not self.sides[0].deferred:
            return
        pending = [list(side.deferred) for side in self.sides]
        for side in self.sides:
            side.deferred.clear()

        def call(side: Side) -> Any:
            for blocks in pending[side.index]:
                side.manager.block_pool.free_blocks(reversed(blocks))

        self.both("block_pool.free_blocks", call)

    @rule(which=LIVE_REQUEST)
    @precondition(lambda self: bool(self.reqs))
    def pin_blocks(self, which: int) -> None:
        """A connector pins a request's blocks (``block_pool.touch``)."""
        slot = self.pick(which, ghost=False)
        if slot not in self.reqs:
            return

        def call(side: Side) -> Any:
            blocks = list(side.manager.get_blocks(slot).blocks[0])
            side.manager.block_pool.touch(blocks)
            side.pinned.append(blocks)

        if self.both("block_pool.touch", call) is None:
            return
        # vLLM hands out its live blocks: one read before the touch shows it.
        self.both("KVCacheBlock(live view)", lambda s: s.pinned[-1])

    def unpin_blocks(self) -> None:
        """The connector releases what it pinned (``block_pool.free_blocks``)."""
        if not self.sides[0].pinned:
            return

        def call(side: Side) -> Any:
            for blocks in side.pinned:
                side.manager.block_pool.free_blocks(blocks)
            side.pinned.clear()

        self.both("block_pool.free_blocks[unpin]", call)

    @rule(
        which=ANY_REQUEST,
        cap=st.sampled_from([None, 0, 1, 5, 200] if harness.TAKES_MAX_CACHE_HIT_LENGTH else [None]),
        connector=st.booleans(),
    )
    def lookup(self, which: int, cap: int | None, connector: bool) -> None:
        """A lookup that allocates nothing (a request that then does not fit)."""
        slot = self.pick(which, ghost=True)
        twin = self.reqs.get(slot)

        def call(side: Side) -> Any:
            m = side.manager
            request = self.ghost() if twin is None else twin.sides[side.index]
            lookup = m.get_computed_blocks_for_connector if connector else m.get_computed_blocks
            return lookup(request) if cap is None else lookup(request, cap)

        self.both("get_computed_blocks", call)

    @rule(which=ANY_REQUEST, num=st.integers(0, 72))
    def per_request_queries(self, which: int, num: int) -> None:
        """The per-request reads and no-op hooks the Scheduler and connectors call."""
        slot = self.pick(which, ghost=True)
        twin = self.reqs.get(slot)

        def req(side: Side) -> Request:
            return self.ghost() if twin is None else twin.sides[side.index]

        self.both("get_blocks", lambda s: s.manager.get_blocks(slot))
        self.both("get_block_ids", lambda s: s.manager.get_block_ids(slot))
        self.both(
            "get_block_ids_for_computed_tokens",
            lambda s: s.manager.get_block_ids_for_computed_tokens(slot, num),
        )
        self.both("estimate_cached_tokens", lambda s: s.manager.estimate_cached_tokens(req(s)))
        self.both(
            "get_num_common_prefix_blocks",
            lambda s: s.manager.get_num_common_prefix_blocks(slot),
        )
        self.both(
            "remove_skipped_blocks",
            lambda s: s.manager.remove_skipped_blocks(slot, num, num_prompt_tokens=num),
        )
        self.both(
            "finalize_partial_tail_offloads",
            lambda s: s.manager.finalize_partial_tail_offloads(req(s)),
        )
        self.both(
            "prefix_cache_lookup_enabled",
            lambda s: s.manager.prefix_cache_lookup_enabled(req(s)),
        )

    @rule(
        which=ANY_REQUEST,
        num_tokens=st.integers(0, 72),
        with_hits=st.booleans(),
        apply_cap=st.booleans(),
    )
    def num_blocks_to_allocate(
        self, which: int, num_tokens: int, with_hits: bool, apply_cap: bool
    ) -> None:
        """``coordinator.get_num_blocks_to_allocate`` as the Scheduler calls it for an
        async load's reservation (empty hits), or with a fresh lookup's hits."""
        slot = self.pick(which, ghost=True)
        twin = self.reqs.get(slot)
        hits: list[Any] = []
        num_hit = 0
        if with_hits and twin is not None:
            found = self.both(
                "get_computed_blocks",
                lambda s: s.manager.get_computed_blocks(twin.sides[s.index]),
            )
            if found is None:
                return
            hits, num_hit = [found[0][0].blocks, found[1][0].blocks], int(found[0][1])

        def call(side: Side) -> Any:
            m = side.manager
            blocks = hits[side.index] if hits else m.empty_kv_cache_blocks.blocks
            return m.coordinator.get_num_blocks_to_allocate(
                request_id=slot,
                num_tokens=num_tokens,
                new_computed_blocks=blocks,
                num_encoder_tokens=0,
                total_computed_tokens=num_hit,
                num_local_computed_tokens=num_hit,
                num_tokens_main_model=num_tokens,
                apply_admission_cap=apply_cap,
                prefill_end=0,
            )

        self.both("coordinator.get_num_blocks_to_allocate", call)

    @rule(ids=st.sets(st.integers(-14, 14), max_size=4))
    def evict_blocks(self, ids: set[int]) -> None:
        """A connector reports blocks whose KV is invalid (any id, cached or not)."""
        self.both("evict_blocks", lambda s: s.manager.evict_blocks(set(ids)))

    def reset_prefix_cache(self) -> None:
        self.both("reset_prefix_cache", lambda s: s.manager.reset_prefix_cache())

    def make_prefix_cache_stats(self) -> None:
        self.both("make_prefix_cache_stats", lambda s: s.manager.make_prefix_cache_stats())

    def read_prefix_cache_stats(self) -> None:
        """``prefix_cache_stats``: vLLM's attribute (``None`` without ``log_stats``)."""
        self.both("prefix_cache_stats", lambda s: s.manager.prefix_cache_stats)

    @rule(
        what=st.sampled_from(
            [
                "flush_deferred_frees",
                "unpin_blocks",
                "reset_prefix_cache",
                "make_prefix_cache_stats",
                "read_prefix_cache_stats",
                "step_hooks",
            ]
        )
    )
    def once_a_step(self, what: str) -> None:
        """The calls without arguments: deferred frees and unpins, resets, stats, hooks."""
        getattr(self, what)()

    @rule(which=ANY_REQUEST, num_hits=st.integers(0, 70))
    def record_prefix_cache_stats(self, which: int, num_hits: int) -> None:
        slot = self.pick(which, ghost=True)
        twin = self.reqs.get(slot)

        def call(side: Side) -> Any:
            request = self.ghost() if twin is None else twin.sides[side.index]
            return side.manager.record_prefix_cache_stats(request, num_hits)

        self.both("record_prefix_cache_stats", call)

    def step_hooks(self) -> None:
        """The once-a-step calls with nothing to do for one full-attention group."""
        self.both("new_step_starts", lambda s: s.manager.new_step_starts())
        self.both("take_new_block_ids", lambda s: s.manager.take_new_block_ids())
        self.both("take_kv_cache_block_copies", lambda s: s.manager.take_kv_cache_block_copies())
        self.both(
            "take_boundary_state_offloads", lambda s: s.manager.take_boundary_state_offloads()
        )

    @rule(which=LIVE_REQUEST, index=st.integers(0, 20))
    @precondition(lambda self: bool(self.reqs))
    def get_cached_block(self, which: int, index: int) -> None:
        """``block_pool.get_cached_block`` for one of a request's block hashes."""
        slot = self.pick(which, ghost=False)
        twin = self.reqs.get(slot)
        if twin is None or index >= len(twin.v.block_hashes):
            return
        block_hash = twin.v.block_hashes[index]
        self.both(
            "block_pool.get_cached_block",
            lambda s: s.manager.block_pool.get_cached_block(block_hash, [0]),
        )

    # ------------------------------------------------------------------ the invariant

    @invariant()
    def same_state(self) -> None:
        """Usage, free blocks and every block table (ids, ref counts, hashes) agree."""
        if self.config is None or self.dead:
            return
        self.both("state", self._state)
        # How a block spells its hash changes no decision: reported at teardown, so that
        # it does not hide what the rest of the run would find.
        try:
            self.both("KVCacheBlock.block_hash", self._hash_views)
        except DivergenceError as err:
            self.deferred_divergence = self.deferred_divergence or err

    def teardown(self) -> None:
        if self.deferred_divergence is not None:
            raise self.deferred_divergence

    @staticmethod
    def _state(side: Side) -> Any:
        # Finished ids too: a table that outlives its request is a divergence.
        m = side.manager
        pool = m.block_pool
        tables = {rid: m.get_blocks(rid) for rid in (*SLOT_IDS, GHOST_ID)}
        group = m.coordinator.single_type_managers[0]
        # Which requests vLLM tracks, and how many of their blocks it counts as cached.
        tracked = sorted(group.req_to_blocks), dict(group.num_cached_block)
        return m.usage, pool.get_num_free_blocks(), pool.get_usage(), tables, tracked

    @staticmethod
    def _hash_views(side: Side) -> Any:
        tables = [side.manager.get_blocks(rid).blocks[0] for rid in (*SLOT_IDS, GHOST_ID)]
        return [[block_hash_view(b) for b in table] for table in tables]
