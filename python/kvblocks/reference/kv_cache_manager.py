"""The request-level KV cache manager for one full-attention KV cache group.

Behaviour follows vLLM 0.33.0's ``KVCacheManager`` with a ``UnitaryKVCacheCoordinator``
over one ``FullAttentionManager`` (``vllm/v1/core/kv_cache_manager.py``,
``kv_cache_coordinator.py``, ``single_type_kv_cache_manager.py``), with the block table
kept as block ids. Requests are duck-typed: the manager reads ``request_id``,
``num_tokens``, ``num_computed_tokens`` and ``block_hashes`` (vLLM's ``Request`` and
:class:`kvblocks.reference.request.Request` both fit) and never writes them. With KV
cache events on it also reads ``all_token_ids`` (and ``lora_request``, ``cache_salt``,
``mm_features`` when present) of the blocks it caches, for their ``BlockStored``.

Where vLLM ``assert``s, kvblocks raises a ``ValueError``; every call that raises or
returns ``None`` leaves the manager and its pool exactly as they were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvblocks.constants import cdiv
from kvblocks.errors import BlockStateError
from kvblocks.extra_keys import event_extra_keys
from kvblocks.reference.block_pool import BlockPool
from kvblocks.reference.borrow import reads, unguarded, writes
from kvblocks.reference.hashing import extras_attrs, read_extras
from kvblocks.reference.kv_cache_utils import (
    check_block_ids,
    check_non_negative,
    check_num_full_blocks,
    check_positive,
)
from kvblocks.reference.request_fields import (
    ID,
    MANAGER,
    RequestFields,
    read_request,
    token_slice,
)
from kvblocks.values import PrefixCacheStats, build, to_int, to_int_list, to_request_id

if TYPE_CHECKING:
    from kvblocks.events import BlockStored, KVCacheEvent

__all__ = ["KVCacheManager"]

#: The one KV cache group this manager handles.
_GROUP_ID = 0


class RequestLike(Protocol):
    """What the manager reads from a request (vLLM's ``Request`` satisfies it)."""

    @property
    def request_id(self) -> str:
        """The request's unique id."""
        ...

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is computed (or scheduled to be)."""
        ...

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """The hashes of the request's full blocks, block 0 first."""
        ...

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt then output token ids (read only with KV cache events on)."""
        ...


@dataclasses.dataclass(slots=True, frozen=True)
class _AllocateSlotsArgs:
    """The arguments of one ``allocate_slots`` call, read and checked, and what the
    request holds: its table, whether it is known, whether it adopts hits now."""

    view: RequestFields
    num_new_tokens: int
    num_new_computed_tokens: int
    hits: list[int]
    num_lookahead_tokens: int
    num_external_computed_tokens: int
    delay_cache_blocks: bool
    req_blocks: list[int]
    is_known: bool
    adopts: bool


class KVCacheManager:
    """Block tables of running requests over a :class:`BlockPool`, with prefix caching.

    Args:
        num_blocks: Blocks in the pool, including the null block. Must be positive.
        block_size: Tokens per block. Must be positive.
        enable_caching: Whether to look up and fill the prefix cache.
        max_model_len: If given (positive), token counts are capped at it, as vLLM does.
        log_stats: Whether to keep :class:`PrefixCacheStats`.
        enable_kv_cache_events: Whether to record KV cache events for
            :meth:`take_events` (vLLM's ``BlockStored``, ``BlockRemoved`` and
            ``AllBlocksCleared``, see :mod:`kvblocks.events`; needs ``msgspec``). Block
            hashes in events are ints unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``,
            read here, asks for bytes.
        kv_events_last_copy_removal: Router-grade option beyond vLLM: emit
            ``BlockRemoved`` for a hash only when the last block caching it goes (vLLM
            emits one per block, also while a duplicate still serves the hash).

    Raises:
        TypeError: a count is not an int.
        ValueError: ``num_blocks must be positive, got {n}``, ``block_size must be
            positive, got {n}`` or ``max_model_len must be positive, got {n}``; with
            events on, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is not an integer.
        ImportError: events are on and ``msgspec`` is not installed.

    Invariants:
        * ``_req_to_blocks[r]`` is request ``r``'s block table; the pool holds one
          reference per appearance of a block in the tables (and in touches made outside);
        * ``_num_cached_block[r]`` (present once ``r`` adopted hits or external tokens, or
          had a full block cached) is how many leading blocks of its table are hashed;
          a request in it is "known" and cannot adopt prefix hits any more.
    """

    __slots__ = (
        "_block_pool",
        "_block_size",
        "_borrow",
        "_enable_caching",
        "_enable_kv_cache_events",
        "_max_model_len",
        "_num_cached_block",
        "_pool",
        "_prefix_cache_stats",
        "_req_to_blocks",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        max_model_len: int | None = None,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        kv_events_last_copy_removal: bool = False,
    ) -> None:
        num_blocks = to_int(num_blocks)
        block_size = to_int(block_size)
        if max_model_len is not None:
            max_model_len = to_int(max_model_len)
        check_positive("num_blocks", num_blocks)
        check_positive("block_size", block_size)
        if max_model_len is not None:
            check_positive("max_model_len", max_model_len)
        self._block_size = block_size
        self._enable_caching = bool(enable_caching)
        self._max_model_len = max_model_len
        self._enable_kv_cache_events = bool(enable_kv_cache_events)
        self._block_pool = BlockPool(num_blocks, self._enable_caching, block_size=block_size)
        # One borrow for the manager and its pool, as natively; the manager's own calls
        # to the pool go through `_pool`, which never counts as re-entry.
        self._borrow = self._block_pool._borrow
        self._pool: BlockPool = unguarded(self._block_pool)
        if self._enable_kv_cache_events:
            from kvblocks.events import use_int_block_hashes  # noqa: PLC0415 (kvblocks.events needs the optional msgspec)

            self._pool._enable_kv_cache_events(
                use_int_block_hashes(), bool(kv_events_last_copy_removal)
            )
        #: Request id -> its block table, in token order.
        self._req_to_blocks: dict[str, list[int]] = {}
        #: Request id -> how many leading blocks of its table are cached (hashed).
        self._num_cached_block: dict[str, int] = {}
        #: The counters since the last make_prefix_cache_stats(); None without log_stats.
        self._prefix_cache_stats: PrefixCacheStats | None = (
            PrefixCacheStats() if log_stats else None
        )

    # ------------------------------------------------------------------ properties

    @property
    @reads
    def block_pool(self) -> BlockPool:
        """The pool the block tables draw from."""
        return self._block_pool

    @property
    @reads
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    @reads
    def num_kv_cache_groups(self) -> int:
        """Always 1: one full-attention group."""
        return 1

    @property
    @reads
    def enable_caching(self) -> bool:
        """Whether prefix caching is on."""
        return self._enable_caching

    @property
    @reads
    def usage(self) -> float:
        """The pool's usage, ``1 - free / (num_blocks - 1)``."""
        return self._pool.get_usage()

    # ------------------------------------------------------------------ lookup

    @reads
    def get_computed_blocks(self, request: RequestLike) -> tuple[list[int], int]:
        """Finds the longest prefix of the request's blocks in the prefix cache.

        Scans ``request.block_hashes`` from block 0 and stops at the first miss (the
        hashes are chained, so nothing later can hit). The hit is capped at
        ``num_tokens - 1`` tokens: the last token is always recomputed for its logits, so a
        block-aligned prompt recomputes its whole last block. Nothing is touched; pass the
        result to :meth:`allocate_slots`, which adopts the hits.

        Returns:
            The hit block ids and the number of tokens they cover (``len * block_size``);
            ``([], 0)`` with caching off.

        Raises:
            TypeError: ``request.num_tokens`` is not an int or a hash is not ``bytes``.
            ValueError: ``num_tokens must be non-negative, got {v}``, or a hash is longer
                than 32 bytes.
        """
        view = read_request(request, MANAGER)
        check_non_negative("num_tokens", view.num_tokens)
        if not self._enable_caching:
            return [], 0
        max_num_blocks = max(view.num_tokens - 1, 0) // self._block_size
        num_lookups = min(max_num_blocks, view.num_block_hashes)
        # Read lazily: a hash after the first miss is never read.
        lookups = (view.block_hashes[i] for i in range(num_lookups))
        hits = self._pool._longest_cache_hit(lookups, _GROUP_ID)
        return hits, len(hits) * self._block_size

    # ------------------------------------------------------------------ allocation

    @writes
    def allocate_slots(  # noqa: PLR0917 (vLLM's positional signature)
        self,
        request: RequestLike,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Iterable[int] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[int] | None:
        """Admits a request or grows its block table (vLLM's ``allocate_slots``).

        The request's tokens are laid out as::

            | computed | new_computed (hits) | external | new | lookahead |

        On a request's first allocation the hits are adopted (touched: ref count + 1, out
        of the free queue) and blocks for the external tokens are allocated. Then blocks
        are added until ``computed + new_computed + external + new + lookahead`` tokens
        (capped at ``max_model_len``) have a slot. Finally, with caching on and
        ``delay_cache_blocks`` false, every block that is full up to
        ``min(computed + new_computed + external + new, num_tokens)`` tokens is cached.

        Args:
            request: The request (see :class:`RequestLike`).
            num_new_tokens: Tokens to compute in this step.
            num_new_computed_tokens: Tokens covered by ``new_computed_blocks``.
            new_computed_blocks: The prefix hits from :meth:`get_computed_blocks`.
            num_lookahead_tokens: Extra slots for speculative tokens.
            num_external_computed_tokens: Tokens a KV connector will load.
            delay_cache_blocks: Skip caching (an asynchronous KV load is in flight).

        Returns:
            The newly allocated block ids (not the hits, not the external blocks), or
            ``None``, with nothing changed, when the pool has too few free blocks.

        Raises:
            TypeError: a count or block id is not an int.
            UnknownBlockError: a block id of ``new_computed_blocks`` is out of range.
            ValueError: ``{name} must be non-negative, got {v}``; ``num_new_tokens must be
                greater than 0 when there are no computed tokens to adopt``;
                ``new_computed_blocks must not contain the null block 0``;
                ``new_computed_blocks must be empty when prefix caching is disabled``;
                ``request {id} already holds blocks, so it cannot adopt computed tokens``;
                or a block hash of the request is longer than 32 bytes.
            BlockStateError: a block to cache already has a hash.
        """
        args = self._read_allocate_slots_args(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
        )
        view, hits, req_blocks, adopts = args.view, args.hits, args.req_blocks, args.adopts
        request_id = view.request_id
        num_external_computed_tokens = args.num_external_computed_tokens

        # Token counts, capped at max_model_len like vLLM.
        num_local_computed_tokens = view.num_computed_tokens + args.num_new_computed_tokens
        total_computed_tokens = self._cap(num_local_computed_tokens + num_external_computed_tokens)
        num_tokens_main_model = total_computed_tokens + args.num_new_tokens
        num_tokens_need_slot = self._cap(num_tokens_main_model + args.num_lookahead_tokens)
        num_required_blocks = cdiv(num_tokens_need_slot, self._block_size)

        if args.is_known:
            num_blocks_to_allocate = max(num_required_blocks - len(req_blocks), 0)
        else:
            num_blocks_to_allocate = max(num_required_blocks - len(hits) - len(req_blocks), 0)
            # A hit still in the free queue stops being free once touched, so it costs a
            # free block just like a new one.
            num_blocks_to_allocate += sum(1 for b in hits if self._pool.get_block(b).ref_cnt == 0)
        if num_blocks_to_allocate > self._pool.get_num_free_blocks():
            return None

        # Plan (and check) the caching step before changing anything. The table will
        # have final_len blocks; those beyond req_blocks come fresh, unhashed, from the pool.
        num_blocks_after_adopt = len(hits) if adopts else len(req_blocks)
        final_len = max(num_blocks_after_adopt, num_required_blocks)
        plan = None
        if self._enable_caching and not args.delay_cache_blocks:
            num_cached = len(hits) if adopts else self._num_cached_block.get(request_id, 0)
            # Only tokens that exist are cached (not lookahead slots), up to num_tokens.
            num_tokens_to_cache = min(num_tokens_main_model, view.num_tokens)
            plan = self._plan_caching(view, req_blocks, num_cached, num_tokens_to_cache, final_len)

        # Adopt the hits and allocate blocks for the external tokens.
        if adopts:
            self._pool.touch(hits)
            req_blocks = list(hits)
            self._num_cached_block[request_id] = len(req_blocks)
            if num_external_computed_tokens > 0:
                num_external_blocks = cdiv(total_computed_tokens, self._block_size) - len(
                    req_blocks
                )
                if num_external_blocks > 0:
                    req_blocks.extend(self._pool.get_new_blocks(num_external_blocks))
        # Slots for the new and lookahead tokens: the only blocks returned.
        num_new_blocks = num_required_blocks - len(req_blocks)
        new_blocks = self._pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks = [*req_blocks, *new_blocks]
        self._req_to_blocks[request_id] = req_blocks

        # Cache every block that is now full, unless an async load must land first.
        if plan is not None:
            self._apply_caching(request_id, req_blocks, plan)
        return new_blocks

    def _read_allocate_slots_args(  # noqa: PLR0917 (allocate_slots' positional signature)
        self,
        request: RequestLike,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: Iterable[int] | None,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        delay_cache_blocks: bool,
    ) -> _AllocateSlotsArgs:
        """What :meth:`allocate_slots` reads, converted and checked before any change."""
        # 1. Reads: the scalar arguments in signature order, the hits, then the request.
        num_new_tokens = to_int(num_new_tokens)
        num_new_computed_tokens = to_int(num_new_computed_tokens)
        num_lookahead_tokens = to_int(num_lookahead_tokens)
        num_external_computed_tokens = to_int(num_external_computed_tokens)
        delay_cache_blocks = bool(delay_cache_blocks)
        hits = [] if new_computed_blocks is None else to_int_list(new_computed_blocks)
        view = read_request(request, MANAGER)
        request_id = view.request_id
        num_tokens = view.num_tokens
        num_computed_tokens = view.num_computed_tokens
        # 2. Counts: the arguments', then the request's.
        check_non_negative("num_new_tokens", num_new_tokens)
        check_non_negative("num_new_computed_tokens", num_new_computed_tokens)
        check_non_negative("num_lookahead_tokens", num_lookahead_tokens)
        check_non_negative("num_external_computed_tokens", num_external_computed_tokens)
        check_non_negative("num_tokens", num_tokens)
        check_non_negative("num_computed_tokens", num_computed_tokens)
        if (
            num_new_tokens == 0
            and num_external_computed_tokens == 0
            and num_new_computed_tokens == 0
        ):
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
            )
        # 3. The hits: real blocks, and only for a request that can adopt them.
        check_block_ids(hits, self._pool.num_blocks)
        if 0 in hits:
            raise ValueError("new_computed_blocks must not contain the null block 0")
        if hits and not self._enable_caching:
            raise ValueError("new_computed_blocks must be empty when prefix caching is disabled")
        req_blocks = self._req_to_blocks.get(request_id, [])
        is_known = request_id in self._num_cached_block
        # Hits and external blocks are adopted on a request's first allocation only; vLLM
        # asserts that a request adopting them holds no blocks yet.
        adopts = (bool(hits) or num_external_computed_tokens > 0) and not is_known
        if (is_known and hits) or (adopts and req_blocks):
            raise ValueError(
                f"request {request_id} already holds blocks, so it cannot adopt computed tokens"
            )
        return _AllocateSlotsArgs(
            view=view,
            num_new_tokens=num_new_tokens,
            num_new_computed_tokens=num_new_computed_tokens,
            hits=hits,
            num_lookahead_tokens=num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks,
            req_blocks=req_blocks,
            is_known=is_known,
            adopts=adopts,
        )

    @writes
    def cache_blocks(self, request: RequestLike, num_computed_tokens: int) -> None:
        """Caches the request's blocks that are full within ``num_computed_tokens`` tokens.

        A no-op with caching off. Only blocks that have a hash in ``request.block_hashes``
        and are not cached yet are entered into the prefix map.

        Raises:
            TypeError: ``num_computed_tokens`` is not an int, or a hash is not ``bytes``.
            ValueError: ``num_computed_tokens must be non-negative, got {v}``, a hash is
                longer than 32 bytes, or the tokens need more blocks than the request holds
                (``num_full_blocks {nf} exceeds the {len} block ids given``).
            BlockStateError: a block to cache already has a hash.
        """
        num_computed_tokens = to_int(num_computed_tokens)
        view = read_request(request, MANAGER)
        check_non_negative("num_computed_tokens", num_computed_tokens)
        if not self._enable_caching:
            return
        request_id = view.request_id
        req_blocks = self._req_to_blocks.get(request_id, [])
        num_full = min(num_computed_tokens // self._block_size, view.num_block_hashes)
        check_num_full_blocks(num_full, len(req_blocks))
        num_cached = self._num_cached_block.get(request_id, 0)
        plan = self._plan_caching(
            view, req_blocks, num_cached, num_computed_tokens, len(req_blocks)
        )
        if plan is not None:
            self._apply_caching(request_id, req_blocks, plan)

    @writes
    def free(self, request: RequestLike) -> None:
        """Frees the request's blocks, tail first, and forgets the request.

        Freeing tail first puts the tail of a cached chain ahead of its parents in the
        eviction order. An unknown request is a no-op.
        """
        request_id = read_request(request, ID).request_id
        blocks = self._req_to_blocks.get(request_id, [])
        self._pool.free_blocks(reversed(blocks))
        self._req_to_blocks.pop(request_id, None)
        self._num_cached_block.pop(request_id, None)

    @reads
    def get_block_ids(self, request_id: str) -> tuple[list[int]]:
        """The request's block table, one list per group: ``([ids...],)``; ``([],)`` if unknown."""
        return (list(self._req_to_blocks.get(to_request_id(request_id), [])),)

    # ------------------------------------------------------------------ pass-through

    @writes
    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Removes the blocks from the prefix cache (see ``BlockPool.evict_blocks``)."""
        self._pool.evict_blocks(block_ids)

    @writes
    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache if no block is in use (see ``BlockPool.reset_prefix_cache``).

        On success the prefix-cache stats (with ``log_stats``) are marked ``reset``.
        """
        if not self._pool.reset_prefix_cache():
            return False
        if self._prefix_cache_stats is not None:
            self._prefix_cache_stats = dataclasses.replace(self._prefix_cache_stats, reset=True)
        return True

    @writes
    def take_events(self) -> list[KVCacheEvent]:
        """The KV cache events recorded since the last call, oldest first.

        ``[]`` unless the manager was created with ``enable_kv_cache_events=True``.
        ``BlockStored`` events carry ``kv_cache_spec_kind="full_attention"``. Publish
        them as ``KVEventBatch(ts=time.time(), events=events)`` (see
        :mod:`kvblocks.events`).
        """
        events = self._pool._take_kv_events()
        if events:
            from kvblocks.events import FULL_ATTENTION, BlockStored  # noqa: PLC0415 (kvblocks.events needs the optional msgspec)

            # As vLLM's take_events: stores get their group's KV cache spec kind, which
            # the pool does not know. The one group is full attention.
            for event in events:
                if isinstance(event, BlockStored) and event.group_idx == _GROUP_ID:
                    event.kv_cache_spec_kind = FULL_ATTENTION
        return events

    # ------------------------------------------------------------------ stats

    @writes
    def record_prefix_cache_stats(self, request: RequestLike, num_hits: int) -> None:
        """Records one admission's prefix-cache lookup (a no-op without ``log_stats``).

        The caller records at admission, as vLLM's scheduler does:
        ``requests += 1``, ``queries += request.num_tokens``, ``hits += num_hits``.

        Raises:
            TypeError: ``num_hits`` or ``request.num_tokens`` is not an int.
            ValueError: ``num_tokens must be non-negative, got {v}``, ``num_hits must be
                non-negative, got {v}`` or ``num_hits {h} exceeds the request's {n} tokens``,
                whether stats are on or not.
        """
        # Checked even with stats off, so a bad call fails the same way either way.
        num_tokens, num_hits = self._read_record_prefix_cache_stats_args(request, num_hits)
        stats = self._prefix_cache_stats
        if stats is not None:
            # Counters only grow: every recorded value was checked non-negative.
            self._prefix_cache_stats = build(
                PrefixCacheStats,
                requests=stats.requests + 1,
                queries=stats.queries + num_tokens,
                hits=stats.hits + num_hits,
                reset=stats.reset,
            )

    @staticmethod
    def _read_record_prefix_cache_stats_args(
        request: RequestLike, num_hits: int
    ) -> tuple[int, int]:
        """``(request.num_tokens, num_hits)``, both non-negative, the hits within the tokens."""
        num_hits = to_int(num_hits)
        num_tokens = read_request(request, MANAGER).num_tokens
        check_non_negative("num_tokens", num_tokens)
        check_non_negative("num_hits", num_hits)
        if num_hits > num_tokens:
            raise ValueError(f"num_hits {num_hits} exceeds the request's {num_tokens} tokens")
        return num_tokens, num_hits

    @writes
    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call (then reset), or ``None`` without ``log_stats``."""
        if self._prefix_cache_stats is None:
            return None
        stats, self._prefix_cache_stats = self._prefix_cache_stats, PrefixCacheStats()
        return stats

    # ------------------------------------------------------------------ helpers

    def _cap(self, num_tokens: int) -> int:
        """``num_tokens`` capped at ``max_model_len`` when there is one."""
        if self._max_model_len is None:
            return num_tokens
        return min(num_tokens, self._max_model_len)

    def _plan_caching(
        self,
        view: RequestFields,
        req_blocks: list[int],
        num_cached: int,
        num_tokens: int,
        table_len: int,
    ) -> tuple[int, int, list[bytes], BlockStored | None] | None:
        """Which blocks caching ``num_tokens`` tokens hashes, checked, before any change.

        A block is cached once it is full and its hash exists (vLLM's ``num_full_blocks =
        min(num_tokens, len(block_hashes) * block_size) // block_size``), never past the
        ``table_len`` blocks the table will have (reachable only when ``max_model_len``
        capped the slots).

        Args:
            view: What the call read of the request (its ``block_hashes``; with events
                on, the request's tokens and extra-key attributes are read too).
            req_blocks: The table now; entries up to ``table_len`` will be fresh blocks.
            num_cached: Leading blocks of the table already cached.
            num_tokens: Tokens whose full blocks to cache.
            table_len: The table's length when the caching happens.

        Returns:
            ``(num_cached, num_full, hashes of blocks num_cached .. num_full - 1, the
            BlockStored to record or None with events off)``, or ``None`` when no new
            block is full.

        Raises:
            BlockStateError: ``block {id} already has a hash`` for a block of the table
                in the range (hashed behind the manager's back).
            TypeError, ValueError: a hash in the range (or, with events on, the parent
                hash) is not ``bytes`` of at most 32 bytes, or a token id is not an int.
            AttributeError: events are on and the request has no ``all_token_ids``.
        """
        num_full = min(num_tokens // self._block_size, view.num_block_hashes, table_len)
        if num_cached >= num_full:
            return None
        for block_id in req_blocks[num_cached:num_full]:
            if self._pool.get_block(block_id).block_hash is not None:
                raise BlockStateError(f"block {block_id} already has a hash")
        hashes = view.hashes(num_cached, num_full)
        event = None
        if self._enable_kv_cache_events:
            event = self._block_stored_event(view, hashes, num_cached, num_full)
        return num_cached, num_full, hashes, event

    def _block_stored_event(
        self, view: RequestFields, hashes: list[bytes], num_cached: int, num_full: int
    ) -> BlockStored:
        """The ``BlockStored`` of caching blocks ``num_cached .. num_full - 1`` (as vLLM's
        ``BlockPool.cache_full_blocks`` builds it), built before anything changes.

        The parent is the request's logical parent, ``block_hashes[num_cached - 1]``;
        the token ids are the request's tokens of the cached blocks.
        """
        from kvblocks.events import (  # noqa: PLC0415 (kvblocks.events needs the optional msgspec)
            MEDIUM_GPU,
            BlockStored,
            external_block_hash,
        )

        as_int = self._pool._kv_events_as_int
        parent = None
        if num_cached > 0:
            parent = view.hash(num_cached - 1)
        block_size = self._block_size
        token_ids = token_slice(view.request, num_cached * block_size, num_full * block_size)
        num_blocks = num_full - num_cached
        attrs = extras_attrs(view.request)
        extras = read_extras(attrs, num_cached * block_size, num_blocks, block_size, "events")
        keys = event_extra_keys(extras, num_cached, num_blocks, block_size)
        lora_id: int | None = None
        lora_name: str | None = None
        extra_keys: list[tuple[Any, ...] | None] = [None] * num_blocks if keys is None else keys
        if keys is not None and extras.lora is not None:
            lora_request = attrs[0]
            int_id = getattr(lora_request, "lora_int_id", None)
            lora_id = getattr(lora_request, "adapter_id", int_id)
            lora_name = extras.lora.name
        return BlockStored(
            block_hashes=[external_block_hash(h, as_int) for h in hashes],
            parent_block_hash=None if parent is None else external_block_hash(parent, as_int),
            token_ids=token_ids,
            block_size=block_size,
            lora_id=lora_id,
            medium=MEDIUM_GPU,
            lora_name=lora_name,
            extra_keys=extra_keys,
            group_idx=_GROUP_ID,
        )

    def _apply_caching(
        self,
        request_id: str,
        req_blocks: list[int],
        plan: tuple[int, int, list[bytes], BlockStored | None],
    ) -> None:
        """Caches the planned blocks, records them as cached and records the planned
        ``BlockStored`` (after any ``BlockRemoved`` of this call, as vLLM); cannot fail."""
        num_cached, num_full, hashes, event = plan
        new_full = req_blocks[num_cached:num_full]
        self._pool.cache_full_blocks(new_full, hashes, 0, len(new_full), _GROUP_ID)
        self._num_cached_block[request_id] = num_full
        if event is not None:
            self._pool._record_kv_event(event)
