"""Data structures of the block pool: block records, the free queue, and input checks.

This mirrors ``vllm/v1/core/kv_cache_utils.py`` of vLLM 0.33.0 for one full-attention
KV cache group, with two differences that make the state observable and checkable:

* the pool's per-block record (:class:`BlockState`) is private; callers get frozen
  ``kvblocks.values.KVCacheBlock`` snapshots from ``BlockPool.get_block``;
* a prefix-cache key is the pair ``(block_hash, group_id)`` instead of vLLM's
  ``block_hash + group_id.to_bytes(4, "big")``; the two carry the same information.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvblocks.errors import UnknownBlockError
from kvblocks.values import KVCacheBlock, build, materialise, to_block_hash

__all__ = [
    "MAX_BLOCK_HASH_LEN",
    "MAX_GROUP_ID",
    "MAX_NUM_BLOCKS",
    "BlockState",
    "FreeKVCacheBlockQueue",
    "check_block_hash",
    "check_block_ids",
    "check_group_id",
    "check_non_negative",
    "check_num_full_blocks",
    "check_positive",
    "to_block_hashes",
]

#: The longest block hash kvblocks stores: a SHA-256 digest (xxh3-128 digests are 16 bytes).
MAX_BLOCK_HASH_LEN = 32

#: vLLM stores a group id in 4 unsigned big-endian bytes, so this is the largest one.
MAX_GROUP_ID = 2**32 - 1

#: The most blocks a pool holds: block ids are 32-bit, less two reserved for "no block".
MAX_NUM_BLOCKS = 2**32 - 3

#: A prefix-cache key: the block hash and the KV cache group it was cached for.
BlockHashKey = tuple[bytes, int]


# --------------------------------------------------------------------------- validation
#
# Every public entry point validates in this order. The native backend raises the same
# class and message for any single fault; when one call has several faults at once, which
# of them is reported first may differ between the backends (e.g. PyO3 converts typed
# arguments before the body runs):
#   1. types: each argument in signature order, each sequence element by element
#      (``operator.index`` for ints, ``isinstance(x, bytes)`` for hashes) -> TypeError;
#   2. values: each argument in signature order (range of ids, length of hashes,
#      sign of counts) -> ValueError / UnknownBlockError;
#   3. consistency between arguments -> ValueError;
#   4. the pool's state (ref counts, existing hashes) -> NoFreeBlocksError / BlockStateError.
# Only when all of them pass is anything mutated.


def check_block_hash(block_hash: bytes) -> None:
    """Checks the length of a block hash.

    Raises:
        ValueError: ``block hash must be at most 32 bytes, got {len}``.
    """
    if len(block_hash) > MAX_BLOCK_HASH_LEN:
        raise ValueError(
            f"block hash must be at most {MAX_BLOCK_HASH_LEN} bytes, got {len(block_hash)}"
        )


def to_block_hashes(values: Iterable[object]) -> list[bytes]:
    """Block hashes checked as a batch: every type first, then every length.

    Raises:
        TypeError: as ``kvblocks.values.to_block_hash``, for the first non-``bytes`` value.
        ValueError: as :func:`check_block_hash`, for the first hash too long.
    """
    hashes = [to_block_hash(value) for value in materialise(values)]
    for block_hash in hashes:
        check_block_hash(block_hash)
    return hashes


def check_block_ids(block_ids: Iterable[int], num_blocks: int) -> None:
    """Checks that every id lies in ``0 .. num_blocks - 1``, in order.

    Raises:
        UnknownBlockError: ``block id {id} is out of range for a pool of {n} blocks``.
    """
    for block_id in block_ids:
        if not 0 <= block_id < num_blocks:
            raise UnknownBlockError(
                f"block id {block_id} is out of range for a pool of {num_blocks} blocks"
            )


def check_non_negative(name: str, value: int) -> None:
    """Raises ``ValueError("{name} must be non-negative, got {value}")`` if ``value < 0``."""
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")


def check_num_full_blocks(num_full_blocks: int, num_block_ids: int) -> None:
    """Checks that a block table holds the blocks to cache.

    Raises:
        ValueError: ``num_full_blocks {nf} exceeds the {len} block ids given``.
    """
    if num_full_blocks > num_block_ids:
        raise ValueError(
            f"num_full_blocks {num_full_blocks} exceeds the {num_block_ids} block ids given"
        )


def check_positive(name: str, value: int) -> None:
    """Raises ``ValueError("{name} must be positive, got {value}")`` if ``value <= 0``."""
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def check_group_id(group_id: int, name: str = "kv_cache_group_id") -> None:
    """Checks a KV cache group id: ``0 <= group_id <= 2**32 - 1`` (vLLM's 4-byte encoding).

    Args:
        group_id: The id.
        name: The argument it came from, for the message.

    Raises:
        ValueError: ``{name} must be non-negative, got {v}`` or
            ``{name} must be at most 4294967295, got {v}``.
    """
    check_non_negative(name, group_id)
    if group_id > MAX_GROUP_ID:
        raise ValueError(f"{name} must be at most {MAX_GROUP_ID}, got {group_id}")


# --------------------------------------------------------------------------- blocks


@dataclass(slots=True, eq=False)
class BlockState:
    """The pool's mutable record of one block (vLLM's ``KVCacheBlock``).

    Identity, not value, matters: the free queue links these objects to each other.

    Invariants (checked by ``BlockPool.check_invariants``):
        * ``ref_cnt >= 0``; the null block keeps ``ref_cnt == 0`` and never gets a hash;
        * ``block_hash is None`` if and only if ``group_id is None``;
        * a block is linked into the free queue (both pointers set) if and only if it is
          not the null block and ``ref_cnt == 0``.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    group_id: int | None = None
    is_null: bool = False
    #: Neighbours in the free queue; only :class:`FreeKVCacheBlockQueue` touches them.
    prev_free_block: BlockState | None = field(default=None, repr=False)
    next_free_block: BlockState | None = field(default=None, repr=False)

    @property
    def key(self) -> BlockHashKey | None:
        """The block's prefix-cache key ``(block_hash, group_id)``, or ``None``."""
        if self.block_hash is None or self.group_id is None:
            return None
        return (self.block_hash, self.group_id)

    def set_hash(self, block_hash: bytes, group_id: int) -> None:
        """Gives the block its prefix-cache key. The caller checked it had none."""
        self.block_hash = block_hash
        self.group_id = group_id

    def reset_hash(self) -> None:
        """Drops the block's prefix-cache key."""
        self.block_hash = None
        self.group_id = None

    def snapshot(self) -> KVCacheBlock:
        """A frozen copy of the block's public fields."""
        return build(
            KVCacheBlock,
            block_id=self.block_id,
            ref_cnt=self.ref_cnt,
            block_hash=self.block_hash,
            group_id=self.group_id,
            is_null=self.is_null,
        )


# --------------------------------------------------------------------------- free queue


class FreeKVCacheBlockQueue:
    """The free blocks as a doubly linked list threaded through the blocks themselves.

    The head is the next block to be allocated (and so the next cached block to lose its
    hash); ``free_blocks`` prepends unhashed blocks and appends hashed ones. Two sentinel
    blocks (id -1) bound the list, so every real block in it has both neighbours set and
    ``remove`` is O(1) with no special cases.

    Invariants:
        * walking ``next_free_block`` from the head sentinel reaches the tail sentinel after
          exactly ``num_free_blocks`` real blocks, and ``prev_free_block`` mirrors it;
        * a block outside the list has both pointers ``None``.
    """

    __slots__ = ("fake_free_list_head", "fake_free_list_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[BlockState]) -> None:
        """Links ``blocks`` in the order given.

        Args:
            blocks: The initially free blocks, head first.
        """
        self.fake_free_list_head = BlockState(block_id=-1)
        self.fake_free_list_tail = BlockState(block_id=-1)
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.num_free_blocks = 0
        self.append_n(list(blocks))

    def popleft(self) -> BlockState:
        """Unlinks and returns the head block.

        Raises:
            ValueError: the queue is empty (callers check the count first).
        """
        first = self.fake_free_list_head.next_free_block
        if first is None or first is self.fake_free_list_tail:
            raise ValueError("No free blocks available")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[BlockState]:
        """Unlinks and returns the first ``n`` blocks, head first.

        The caller guarantees ``0 <= n <= num_free_blocks``.
        """
        return [self.popleft() for _ in range(n)]

    def remove(self, block: BlockState) -> None:
        """Unlinks ``block`` from anywhere in the queue in O(1).

        Raises:
            RuntimeError: ``block`` is not in the queue.
        """
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise RuntimeError(f"remove() called on an invalid block: {block}")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: list[BlockState]) -> None:
        """Links ``blocks`` at the tail, keeping their order (last one becomes the tail)."""
        for block in blocks:
            last = self.fake_free_list_tail.prev_free_block
            assert last is not None  # the tail sentinel always has a predecessor
            self._link_between(block, last, self.fake_free_list_tail)

    def prepend_n(self, blocks: list[BlockState]) -> None:
        """Links ``blocks`` at the head, keeping their order: ``[a, b]`` gives ``a, b, ...``."""
        for block in reversed(blocks):
            first = self.fake_free_list_head.next_free_block
            assert first is not None  # the head sentinel always has a successor
            self._link_between(block, self.fake_free_list_head, first)

    def _link_between(self, block: BlockState, before: BlockState, after: BlockState) -> None:
        block.prev_free_block = before
        block.next_free_block = after
        before.next_free_block = block
        after.prev_free_block = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[BlockState]:
        """The free blocks, head first (stops at the tail sentinel or a broken link)."""
        block = self.fake_free_list_head.next_free_block
        while block is not None and block is not self.fake_free_list_tail:
            yield block
            block = block.next_free_block

    def get_all_free_blocks(self) -> list[BlockState]:
        """The free blocks, head first."""
        return list(self)
