"""The block pool: ref-counted KV cache blocks, the free queue and the prefix cache.

Behaviour follows ``vllm/v1/core/block_pool.py`` of vLLM 0.33.0 for one full-attention
KV cache group (``hash_block_size == block_size``). Where vLLM ``assert``s or silently
corrupts its state (double free, re-hashing a hashed block, unknown ids), kvblocks raises
a documented error and leaves the pool exactly as it was: every method validates all of
its input first (see the order in :mod:`kvblocks.reference.kv_cache_utils`) and only then
mutates.

KV cache events (``vllm/distributed/kv_events.py``) are recorded only once a
:class:`~kvblocks.reference.kv_cache_manager.KVCacheManager` created with
``enable_kv_cache_events=True`` switched them on for its pool: a ``BlockRemoved`` per
prefix-cache entry dropped (lazy eviction in :meth:`BlockPool.get_new_blocks`,
:meth:`BlockPool.evict_blocks`) and an ``AllBlocksCleared`` per successful reset. The
manager adds the ``BlockStored`` events, which need the request's token ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvblocks.errors import BlockStateError, InvariantError, NoFreeBlocksError
from kvblocks.reference.borrow import Borrow, reads, writes
from kvblocks.reference.kv_cache_utils import (
    MAX_NUM_BLOCKS,
    BlockHashKey,
    BlockState,
    FreeKVCacheBlockQueue,
    check_block_hash,
    check_block_ids,
    check_group_id,
    check_non_negative,
    check_num_full_blocks,
    check_positive,
    to_block_hashes,
)
from kvblocks.values import KVCacheBlock, materialise, to_block_hash, to_int, to_int_list

if TYPE_CHECKING:
    from kvblocks.events import KVCacheEvent

__all__ = ["BlockHashToBlockMap", "BlockPool"]


class BlockHashToBlockMap:
    """The prefix cache: ``(block_hash, group_id)`` -> the blocks cached under that key.

    vLLM does not deduplicate identical full blocks (block tables stay append-only), so a
    key can map to several blocks. They are kept in insertion order and a lookup returns
    the earliest-inserted one still cached. vLLM stores a lone block bare and several in a
    ``{block_id: block}`` dict to save GC work; an insertion-ordered dict per key has the
    same semantics.

    Invariant: no key maps to an empty dict.
    """

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[BlockHashKey, dict[int, BlockState]] = {}

    def get_one_block(self, key: BlockHashKey) -> BlockState | None:
        """The first-inserted block still cached under ``key``, or ``None``."""
        blocks = self._cache.get(key)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def contains(self, key: BlockHashKey, block_id: int) -> bool:
        """Whether block ``block_id`` is cached under ``key``."""
        return block_id in self._cache.get(key, {})

    def insert(self, key: BlockHashKey, block: BlockState) -> None:
        """Adds ``block`` under ``key``, after any blocks already there."""
        self._cache.setdefault(key, {})[block.block_id] = block

    def pop(self, key: BlockHashKey, block_id: int) -> BlockState | None:
        """Removes block ``block_id`` from ``key``; returns it, or ``None`` if absent."""
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        block = blocks.pop(block_id, None)
        if not blocks:
            del self._cache[key]
        return block

    def items(self) -> Iterator[tuple[BlockHashKey, dict[int, BlockState]]]:
        """Every key with its blocks (for invariant checks)."""
        return iter(self._cache.items())

    def __len__(self) -> int:
        """The number of keys."""
        return len(self._cache)


class BlockPool:
    """A fixed set of KV cache blocks with ref counts, an LRU free queue and a prefix cache.

    Block ids are ``0 .. num_blocks - 1``. Block 0 is the null block: it is never handed
    out, never freed, never hashed and its ref count is not tracked, so a new pool has
    ``num_blocks - 1`` free blocks, queued in ascending id order.

    Args:
        num_blocks: The number of blocks, including the null block. Must be positive.
        enable_caching: Whether freed hashed blocks stay cached (appended to the free
            queue, LRU) and lose their hash only when reallocated. With caching off every
            freed block is prepended and reallocation keeps any hash, as in vLLM.
        block_size: Tokens per block. Must be positive. Recorded for callers; the pool's
            behaviour does not depend on it.

    Raises:
        TypeError: an argument is not an int.
        ValueError: ``num_blocks must be positive, got {n}`` or
            ``block_size must be positive, got {n}``.

    Invariants (see :meth:`check_invariants`):
        * the free queue holds exactly the non-null blocks with ``ref_cnt == 0``;
        * every hashed block is in the prefix map under its key, and every map entry
          points at a block holding that key;
        * ref counts are never negative; the null block is never free, hashed or counted.
    """

    __slots__ = (
        "_block_size",
        "_blocks",
        "_borrow",
        "_cached_block_hash_to_block",
        "_enable_caching",
        "_free_block_queue",
        "_kv_event_queue",
        "_kv_events_as_int",
        "_kv_events_last_copy_removal",
        "_null_block",
        "_num_blocks",
    )

    def __init__(self, num_blocks: int, enable_caching: bool = True, *, block_size: int = 16):
        num_blocks = to_int(num_blocks)
        block_size = to_int(block_size)
        check_positive("num_blocks", num_blocks)
        if num_blocks > MAX_NUM_BLOCKS:
            raise ValueError(f"num_blocks must be at most {MAX_NUM_BLOCKS}, got {num_blocks}")
        check_positive("block_size", block_size)
        self._borrow = Borrow()
        self._num_blocks = num_blocks
        self._enable_caching = bool(enable_caching)
        self._block_size = block_size
        self._blocks = [BlockState(block_id=i) for i in range(num_blocks)]
        self._free_block_queue = FreeKVCacheBlockQueue(self._blocks)
        self._cached_block_hash_to_block = BlockHashToBlockMap()
        # The queue starts in id order, so the null block is always block 0. It leaves the
        # queue for good and its ref count stays 0.
        self._null_block = self._free_block_queue.popleft()
        self._null_block.is_null = True
        # KV cache events since the last take; None while events are off.
        self._kv_event_queue: list[KVCacheEvent] | None = None
        self._kv_events_as_int = True
        self._kv_events_last_copy_removal = False

    # ------------------------------------------------------------------ properties

    @property
    @reads
    def num_blocks(self) -> int:
        """The number of blocks, including the null block."""
        return self._num_blocks

    @property
    @reads
    def enable_caching(self) -> bool:
        """Whether prefix caching is on (see the class docstring)."""
        return self._enable_caching

    @property
    @reads
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    # ------------------------------------------------------------------ allocation

    @writes
    def get_new_blocks(self, n: int) -> list[int]:
        """Takes ``n`` blocks from the head of the free queue.

        A taken block that still holds a hash loses it first when caching is on (lazy
        eviction). Each block's ref count becomes 1. The prefix cache is not consulted.

        Args:
            n: How many blocks to take.

        Returns:
            The ids taken, in free-queue order.

        Raises:
            TypeError: ``n`` is not an int.
            ValueError: ``n must be non-negative, got {n}``.
            NoFreeBlocksError: ``Cannot get {n} free blocks from the pool ({free} free)``.
        """
        n = to_int(n)
        check_non_negative("n", n)
        num_free = self._free_block_queue.num_free_blocks
        if n > num_free:
            raise NoFreeBlocksError(f"Cannot get {n} free blocks from the pool ({num_free} free)")
        blocks = self._free_block_queue.popleft_n(n)
        for block in blocks:
            if self._enable_caching:
                self._maybe_evict_cached_block(block)
            # A block in the free queue has ref_cnt 0 (queue invariant).
            block.ref_cnt = 1
        return [block.block_id for block in blocks]

    @writes
    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drops one reference to each block, in eviction-priority order.

        Blocks reaching ref count 0 go back to the free queue: unhashed ones (or all, with
        caching off) are prepended, hashed ones appended, each group keeping the order
        given, so the first block given is reused or evicted first. Callers free a
        request's blocks tail first. The null block is skipped.

        Args:
            block_ids: The ids, first to be evicted first. Any iterable of ints (a NumPy
                int array too). An id may repeat up to its ref count.

        Raises:
            TypeError: an id is not an int.
            UnknownBlockError: an id is out of range.
            BlockStateError: ``block {id} is already free (ref count 0)``, also when an id
                repeats more often than its ref count.
        """
        blocks = self._read_blocks_to_free(block_ids)
        evict_first: list[BlockState] = []
        evict_last: list[BlockState] = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self._enable_caching:
                    evict_first.append(block)
                else:
                    evict_last.append(block)
        # Unhashed blocks are worthless to the cache: reuse them first (LIFO, GPU locality).
        self._free_block_queue.prepend_n(evict_first)
        # Hashed blocks stay cached as long as possible (FIFO gives LRU eviction).
        self._free_block_queue.append_n(evict_last)

    def _read_blocks_to_free(self, block_ids: Iterable[int]) -> list[BlockState]:
        """The non-null blocks of :meth:`free_blocks`, in order, checked before any change.

        The decrements are simulated, so a double free anywhere in the call is refused
        before any ref count changes.
        """
        blocks = [block for block in self._read_blocks(block_ids) if not block.is_null]
        remaining: dict[int, int] = {}
        for block in blocks:
            left = remaining.get(block.block_id, block.ref_cnt)
            if left == 0:
                raise BlockStateError(f"block {block.block_id} is already free (ref count 0)")
            remaining[block.block_id] = left - 1
        return blocks

    @writes
    def touch(self, block_ids: Iterable[int]) -> None:
        """Adds one reference to each block (a prefix-cache hit being adopted).

        A block at ref count 0 is first taken out of the free queue, so it can no longer be
        evicted. The null block is skipped.

        Args:
            block_ids: The ids. Any iterable of ints.

        Raises:
            TypeError: an id is not an int.
            UnknownBlockError: an id is out of range.
        """
        for block in self._read_blocks(block_ids):
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                # Queue invariant: a non-null block with ref_cnt 0 is in the free queue.
                self._free_block_queue.remove(block)
            block.ref_cnt += 1

    def _read_blocks(self, block_ids: Iterable[int]) -> list[BlockState]:
        """The blocks of ``block_ids``: every id converted first, then every id checked."""
        ids = to_int_list(block_ids)
        check_block_ids(ids, self._num_blocks)
        return [self._blocks[block_id] for block_id in ids]

    # ------------------------------------------------------------------ prefix cache

    @writes
    def cache_full_blocks(
        self,
        block_ids: Iterable[int],
        block_hashes: Iterable[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        kv_cache_group_id: int = 0,
    ) -> None:
        """Enters a request's newly full blocks into the prefix cache.

        Blocks ``block_ids[num_cached_blocks:num_full_blocks]`` get the hashes at the same
        positions of ``block_hashes`` under ``kv_cache_group_id`` and are added to the
        prefix map after any blocks already cached under the same key (duplicates are
        kept, as in vLLM). Ref counts and the free queue do not change. Null blocks are
        skipped. A no-op when ``num_cached_blocks >= num_full_blocks``.

        Args:
            block_ids: The request's whole block table.
            block_hashes: The request's block hashes, block 0 first (at least
                ``num_full_blocks`` of them, each ``bytes`` of at most 32 bytes).
            num_cached_blocks: Blocks of the table already cached.
            num_full_blocks: Blocks of the table that are now full.
            kv_cache_group_id: The KV cache group the blocks belong to.

        Raises:
            TypeError: an id or count is not an int, or a hash is not ``bytes``.
            UnknownBlockError: an id is out of range.
            ValueError: a hash is longer than 32 bytes, a count or the group id is
                negative, ``num_full_blocks {nf} exceeds the {len} block ids given``, or
                ``need {nf} block hashes, got {len}``.
            BlockStateError: ``block {id} already has a hash`` (also when a block occurs
                twice among the blocks to cache).
        """
        to_cache = self._read_cache_full_blocks_args(
            block_ids, block_hashes, num_cached_blocks, num_full_blocks, kv_cache_group_id
        )
        for block, key in to_cache:
            block.set_hash(*key)
            self._cached_block_hash_to_block.insert(key, block)

    def _read_cache_full_blocks_args(
        self,
        block_ids: Iterable[int],
        block_hashes: Iterable[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        kv_cache_group_id: int,
    ) -> list[tuple[BlockState, BlockHashKey]]:
        """The blocks :meth:`cache_full_blocks` caches, each with its key, checked in full.

        Null blocks are left out; ``[]`` when no block is newly full.
        """
        # 1. Types: the ints, then the sequences, each in signature order.
        num_cached_blocks = to_int(num_cached_blocks)
        num_full_blocks = to_int(num_full_blocks)
        kv_cache_group_id = to_int(kv_cache_group_id)
        ids = to_int_list(block_ids)
        hashes = materialise(block_hashes)
        # 2. Values, in signature order.
        check_block_ids(ids, self._num_blocks)
        check_non_negative("num_cached_blocks", num_cached_blocks)
        check_non_negative("num_full_blocks", num_full_blocks)
        check_group_id(kv_cache_group_id)
        # 3. Consistency between arguments.
        check_num_full_blocks(num_full_blocks, len(ids))
        if len(hashes) < num_full_blocks:
            raise ValueError(f"need {num_full_blocks} block hashes, got {len(hashes)}")
        if num_cached_blocks >= num_full_blocks:
            return []
        # Only the hashes of the blocks to cache are read (the caller passes the
        # request's whole hash list, as vLLM does).
        new_hashes = to_block_hashes(hashes[num_cached_blocks:num_full_blocks])
        # 4. State: each block to cache must be unhashed (a full block is cached once).
        to_cache: list[tuple[BlockState, BlockHashKey]] = []
        seen: set[int] = set()
        for i in range(num_cached_blocks, num_full_blocks):
            block = self._blocks[ids[i]]
            if block.is_null:
                continue
            if block.block_hash is not None or block.block_id in seen:
                raise BlockStateError(f"block {block.block_id} already has a hash")
            seen.add(block.block_id)
            to_cache.append((block, (new_hashes[i - num_cached_blocks], kv_cache_group_id)))
        return to_cache

    @reads
    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Iterable[int] = (0,)
    ) -> list[int] | None:
        """Looks a block hash up in the prefix cache, one block per group.

        Nothing changes: hits are neither touched nor moved in the free queue.

        Args:
            block_hash: The hash to look up.
            kv_cache_group_ids: The groups to look it up in.

        Returns:
            For each group, the earliest-inserted block still cached under
            ``(block_hash, group)``; ``None`` if any group misses.

        Raises:
            TypeError: the hash is not ``bytes`` or a group id is not an int.
            ValueError: the hash is longer than 32 bytes or a group id is out of range.
        """
        block_hash = to_block_hash(block_hash)
        group_ids = to_int_list(kv_cache_group_ids)
        check_block_hash(block_hash)
        for group_id in group_ids:
            check_group_id(group_id, "kv_cache_group_ids")
        found: list[int] = []
        for group_id in group_ids:
            block = self._cached_block_hash_to_block.get_one_block((block_hash, group_id))
            if block is None:
                return None
            found.append(block.block_id)
        return found

    @reads
    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], kv_cache_group_id: int = 0
    ) -> list[int]:
        """Finds the longest prefix of a hash chain that is cached, in one call.

        vLLM's ``find_longest_cache_hit`` for one full-attention group: looks the hashes up
        in order and stops at the first miss (the hashes are chained, so nothing later can
        hit). Nothing changes: pass the result to :meth:`touch` to adopt the hits.

        Args:
            block_hashes: A request's block hashes, block 0 first.
            kv_cache_group_id: The group to look them up in.

        Returns:
            The earliest-inserted cached block of each hash of the longest cached prefix.

        Raises:
            TypeError: a hash read is not ``bytes`` or the group id is not an int.
            ValueError: a hash read is longer than 32 bytes or the group id is out of range.
        """
        kv_cache_group_id = to_int(kv_cache_group_id)
        check_group_id(kv_cache_group_id)
        return self._longest_cache_hit(iter(materialise(block_hashes)), kv_cache_group_id)

    def _longest_cache_hit(
        self, block_hashes: Iterator[object], kv_cache_group_id: int
    ) -> list[int]:
        """:meth:`find_longest_cache_hit` over hashes converted lazily, up to the first miss."""
        hits: list[int] = []
        for item in block_hashes:
            block_hash = to_block_hash(item)
            check_block_hash(block_hash)
            block = self._cached_block_hash_to_block.get_one_block((block_hash, kv_cache_group_id))
            if block is None:
                break
            hits.append(block.block_id)
        return hits

    @writes
    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Removes the given blocks from the prefix cache.

        Only hashes are dropped: ref counts and free-queue positions do not change, so a
        free block stays where it is (now unhashed) and a block in use is prepended, as an
        unhashed block, when it is freed later. Unhashed and null blocks are skipped.

        Args:
            block_ids: The ids. Any iterable of ints (vLLM passes a set).

        Raises:
            TypeError: an id is not an int.
            UnknownBlockError: an id is out of range.
        """
        for block in self._read_blocks(block_ids):
            self._maybe_evict_cached_block(block)

    @writes
    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache, if no block is in use.

        Returns:
            True when every non-null block was free: all hashes are dropped (the free
            queue order is kept). False, with nothing changed, otherwise.
        """
        if self._free_block_queue.num_free_blocks != self._num_blocks - 1:
            return False
        self._cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self._blocks:
            block.reset_hash()
        if self._kv_event_queue is not None:
            from kvblocks.events import AllBlocksCleared  # noqa: PLC0415 (kvblocks.events needs the optional msgspec)

            self._kv_event_queue.append(AllBlocksCleared())
        return True

    def _maybe_evict_cached_block(self, block: BlockState) -> bool:
        """Drops ``block``'s hash from the block and the prefix map; False if it had none.

        With events on, records one ``BlockRemoved`` for the key, unless the router-grade
        ``last_copy_removal`` option is on and another block still caches the key.
        """
        key = block.key
        if key is None:
            return False
        self._cached_block_hash_to_block.pop(key, block.block_id)
        block.reset_hash()
        if self._kv_event_queue is not None:
            still_cached = self._cached_block_hash_to_block.get_one_block(key) is not None
            if not (self._kv_events_last_copy_removal and still_cached):
                from kvblocks.events import MEDIUM_GPU, BlockRemoved, external_block_hash  # noqa: PLC0415 (kvblocks.events needs the optional msgspec)

                block_hash, group_id = key
                self._kv_event_queue.append(
                    BlockRemoved(
                        block_hashes=[external_block_hash(block_hash, self._kv_events_as_int)],
                        medium=MEDIUM_GPU,
                        group_idx=group_id,
                    )
                )
        return True

    # ------------------------------------------------------------------ events

    def _enable_kv_cache_events(self, as_int: bool, last_copy_removal: bool) -> None:
        """Starts recording KV cache events (called by the manager that owns the pool).

        Args:
            as_int: Whether hashes go out as ints (low 8 bytes) rather than bytes.
            last_copy_removal: Record a ``BlockRemoved`` only when the last block cached
                under the key goes.
        """
        self._kv_event_queue = []
        self._kv_events_as_int = as_int
        self._kv_events_last_copy_removal = last_copy_removal

    def _record_kv_event(self, event: KVCacheEvent) -> None:
        """Appends an event (the manager's ``BlockStored``) if events are on."""
        if self._kv_event_queue is not None:
            self._kv_event_queue.append(event)

    def _take_kv_events(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first (``[]`` while events are off)."""
        if self._kv_event_queue is None:
            return []
        events, self._kv_event_queue = self._kv_event_queue, []
        return events

    # ------------------------------------------------------------------ accessors

    @reads
    def get_num_free_blocks(self) -> int:
        """The number of free blocks, cached ones with ref count 0 included."""
        return self._free_block_queue.num_free_blocks

    @reads
    def get_usage(self) -> float:
        """The fraction of usable (non-null) blocks in use: ``1 - free / (num_blocks - 1)``.

        0.0 for a pool with no usable block.
        """
        total = self._num_blocks - 1
        if total == 0:
            return 0.0
        return 1.0 - self._free_block_queue.num_free_blocks / total

    @reads
    def get_block(self, block_id: int) -> KVCacheBlock:
        """A frozen snapshot of one block.

        Raises:
            TypeError: ``block_id`` is not an int.
            UnknownBlockError: ``block_id`` is out of range.
        """
        block_id = to_int(block_id)
        check_block_ids((block_id,), self._num_blocks)
        return self._blocks[block_id].snapshot()

    @reads
    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be allocated) first."""
        return [block.block_id for block in self._free_block_queue]

    @reads
    def check_invariants(self) -> None:
        """Walks the whole state and checks every invariant of the class docstring.

        Raises:
            InvariantError: naming the first broken rule.
        """
        queue = self._free_block_queue
        null = self._null_block
        if null is not self._blocks[0] or not null.is_null:
            raise InvariantError("block 0 is not the null block")
        if null.ref_cnt != 0 or null.block_hash is not None or null.group_id is not None:
            raise InvariantError("the null block has a ref count or a hash")

        # The free list: consistent links, bounded length, only free non-null blocks.
        in_queue: set[int] = set()
        prev = queue.fake_free_list_head
        node = prev.next_free_block
        while node is not queue.fake_free_list_tail:
            if node is None:
                raise InvariantError("the free queue is not linked to its tail")
            if node.prev_free_block is not prev:
                raise InvariantError(f"free queue links around block {node.block_id} disagree")
            if node.block_id in in_queue or len(in_queue) >= self._num_blocks:
                raise InvariantError(f"block {node.block_id} is in the free queue twice")
            if not 0 <= node.block_id < self._num_blocks or self._blocks[node.block_id] is not node:
                raise InvariantError(f"the free queue holds a foreign block {node.block_id}")
            if node.is_null:
                raise InvariantError("the null block is in the free queue")
            if node.ref_cnt != 0:
                raise InvariantError(
                    f"block {node.block_id} is in the free queue with ref count {node.ref_cnt}"
                )
            in_queue.add(node.block_id)
            prev, node = node, node.next_free_block
        if queue.fake_free_list_tail.prev_free_block is not prev:
            raise InvariantError("the free queue's tail link is wrong")
        if len(in_queue) != queue.num_free_blocks:
            raise InvariantError(
                f"the free count is {queue.num_free_blocks} but the free queue holds "
                f"{len(in_queue)} blocks"
            )

        num_hashed = 0
        for block in self._blocks:
            if block.ref_cnt < 0:
                raise InvariantError(f"block {block.block_id} has ref count {block.ref_cnt}")
            linked = block.prev_free_block is not None or block.next_free_block is not None
            if block.block_id not in in_queue:
                if block.ref_cnt == 0 and not block.is_null:
                    raise InvariantError(
                        f"block {block.block_id} has ref count 0 but is not in the free queue"
                    )
                if linked:
                    raise InvariantError(
                        f"block {block.block_id} has free-queue links but is not in the queue"
                    )
            if (block.block_hash is None) != (block.group_id is None):
                raise InvariantError(f"block {block.block_id} has half a prefix-cache key")
            key = block.key
            if key is not None:
                num_hashed += 1
                if not self._cached_block_hash_to_block.contains(key, block.block_id):
                    raise InvariantError(
                        f"block {block.block_id} is hashed but not in the prefix map"
                    )

        num_entries = 0
        for key, entries in self._cached_block_hash_to_block.items():
            if not entries:
                raise InvariantError("the prefix map has an empty entry")
            for block_id, block in entries.items():
                num_entries += 1
                if block is not self._blocks[block_id] or block.key != key:
                    raise InvariantError(
                        f"the prefix map lists block {block_id} under a key it does not hold"
                    )
        if num_entries != num_hashed:
            raise InvariantError(
                f"the prefix map has {num_entries} entries for {num_hashed} hashed blocks"
            )
