"""Instruments vLLM 0.33.0's own hybrid KV cache code, for the tests of hybrid layouts.

* :func:`counting` counts, while it is active, the paths vLLM's manager takes that only
  multi-group and local-attention layouts have: out-of-window frees, hits padded with null
  blocks, joint lookups where some groups hit and others miss, fixed-point searches of more
  than one round, hits that retention 0 cut short, block-level load failures refused
  with several groups, and partial prompt-tail keys registered and evicted. It wraps
  methods of vLLM's classes (observing, never changing what they return) and restores
  them on exit.
* :data:`PLANTS` are faults planted in vLLM's classes while a run is active, to show that
  the differential comparison catches a manager that behaves a little differently: a dense
  cache under retention 0, a missing out-of-window free, the deferred frees' group order
  reversed, and no partial prompt-tail keys.

Both patch classes, so every scheduler built while they are active is affected: the tests
run the reference and the candidate one after the other, each under its own context.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator, KVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

#: Counter names (:func:`counting`), each with what it counts.
COUNTERS = {
    "swa_window_free": "SlidingWindowManager.remove_skipped_blocks freed a real block",
    "chunked_window_free": "ChunkedLocalAttentionManager.remove_skipped_blocks freed one",
    "null_hit_admitted": "allocate_slots admitted a request with a hit padded with nulls",
    "swa_null_hit_admitted": "... the padding in a sliding-window group",
    "chunked_null_hit_admitted": "... the padding in a chunked-local group",
    "joint_lookup": "get_cached_block asked several groups at once",
    "joint_lookup_miss": "... and some of them had the block while others did not",
    "fixed_point_rounds>1": "HybridKVCacheCoordinator.find_longest_cache_hit looped again",
    "junction": "find_longest_cache_hit found an uncached common prefix",
    "retention0_miss": "retention 0, and the reconciled hit shorter than full attention's",
    "invalid_blocks_refused": "_handle_invalid_blocks raised RuntimeError, several groups",
    "partial_tail_key": "BlockPool.cache_partial_block keyed a block anew (a partial tail)",
    "partial_tail_evicted": "a block with a partial-tail key lost its keys to reuse",
}


class _Patches:
    """Class attributes replaced for a while, restored in reverse order on :meth:`undo`."""

    _MISSING = object()

    def __init__(self) -> None:
        self._saved: list[tuple[type, str, Any]] = []

    def set(self, owner: type, name: str, value: Any) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, self._MISSING)))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._saved:
            owner, name, value = self._saved.pop()
            if value is self._MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


@contextlib.contextmanager
def _patched() -> Iterator[_Patches]:
    patches = _Patches()
    try:
        yield patches
    finally:
        patches.undo()


def _real_blocks(blocks: Sequence[KVCacheBlock] | None) -> int:
    return sum(not block.is_null for block in blocks or ())


@dataclass
class _Lookup:
    """What one hybrid ``find_longest_cache_hit`` call asked of the spec groups."""

    queries: Counter[tuple[str, tuple[int, ...]]] = field(default_factory=Counter)
    full_hit: int | None = None


@contextlib.contextmanager
def counting() -> Iterator[Counter[str]]:
    """Count the hybrid paths (:data:`COUNTERS`) vLLM's classes take while active."""
    counts: Counter[str] = Counter()
    lookups: list[_Lookup] = []  # the hybrid lookup in progress, if any
    with _patched() as patches:
        _count_window_frees(patches, counts)
        _count_null_hits(patches, counts)
        _count_joint_lookups(patches, counts)
        _count_fixed_point(patches, counts, lookups)
        _count_refused_invalid_blocks(patches, counts)
        _count_partial_tails(patches, counts)
        yield counts


def _count_window_frees(patches: _Patches, counts: Counter[str]) -> None:
    for cls, key in (
        (SlidingWindowManager, "swa_window_free"),
        (ChunkedLocalAttentionManager, "chunked_window_free"),
    ):
        inner = cls.remove_skipped_blocks

        def remove(
            self: SingleTypeKVCacheManager,
            request_id: str,
            *args: Any,
            _inner: Callable[..., None] = inner,
            _key: str = key,
            **kwargs: Any,
        ) -> None:
            before = _real_blocks(self.req_to_blocks.get(request_id))
            _inner(self, request_id, *args, **kwargs)
            if _real_blocks(self.req_to_blocks.get(request_id)) < before:
                counts[_key] += 1

        patches.set(cls, "remove_skipped_blocks", remove)


def _count_null_hits(patches: _Patches, counts: Counter[str]) -> None:
    inner = KVCacheManager.allocate_slots

    def allocate_slots(
        self: KVCacheManager, request: Any, *args: Any, **kwargs: Any
    ) -> KVCacheBlocks | None:
        hit: KVCacheBlocks | None = kwargs.get("new_computed_blocks")
        if hit is None and len(args) >= 3:
            hit = args[2]
        result = inner(self, request, *args, **kwargs)
        if result is None or hit is None:
            return result
        kinds = set()
        for group, blocks in zip(self.kv_cache_config.kv_cache_groups, hit.blocks, strict=True):
            if any(block.is_null for block in blocks):
                kinds.add(type(group.kv_cache_spec))
        if kinds:
            counts["null_hit_admitted"] += 1
        if SlidingWindowSpec in kinds:
            counts["swa_null_hit_admitted"] += 1
        if ChunkedLocalAttentionSpec in kinds:
            counts["chunked_null_hit_admitted"] += 1
        return result

    patches.set(KVCacheManager, "allocate_slots", allocate_slots)


def _count_joint_lookups(patches: _Patches, counts: Counter[str]) -> None:
    inner = BlockPool.get_cached_block

    def get_cached_block(
        self: BlockPool, block_hash: Any, kv_cache_group_ids: list[int]
    ) -> list[KVCacheBlock] | None:
        result = inner(self, block_hash, kv_cache_group_ids)
        if len(kv_cache_group_ids) > 1:
            counts["joint_lookup"] += 1
            if result is None and any(
                self.cached_block_hash_to_block.get_one_block(
                    make_block_hash_with_group_id(block_hash, group_id)
                )
                for group_id in kv_cache_group_ids
            ):
                counts["joint_lookup_miss"] += 1
        return result

    patches.set(BlockPool, "get_cached_block", get_cached_block)


def _count_fixed_point(patches: _Patches, counts: Counter[str], lookups: list[_Lookup]) -> None:
    """Rounds of the fixed point: a spec group other than full attention is asked again
    only when a later one cut the candidate length (full attention is asked once)."""
    for cls in (FullAttentionManager, SlidingWindowManager, ChunkedLocalAttentionManager):
        inner = cls.__dict__["find_longest_cache_hit"].__func__

        def find(
            klass: type[SingleTypeKVCacheManager],
            /,
            *args: Any,
            _inner: Callable[..., Any] = inner,
            **kwargs: Any,
        ) -> Any:
            blocks, length = _inner(klass, *args, **kwargs)
            if lookups:
                lookup = lookups[-1]
                lookup.queries[klass.__name__, tuple(kwargs["kv_cache_group_ids"])] += 1
                if issubclass(klass, FullAttentionManager):
                    lookup.full_hit = length
            return blocks, length

        patches.set(cls, "find_longest_cache_hit", classmethod(find))

    inner_hybrid = HybridKVCacheCoordinator.find_longest_cache_hit

    def find_hybrid(
        self: HybridKVCacheCoordinator, block_hashes: Any, max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        lookups.append(_Lookup())
        try:
            result = inner_hybrid(self, block_hashes, max_cache_hit_length)
        finally:
            lookup = lookups.pop()
        _, hit, uncached = result
        if max(lookup.queries.values(), default=0) > 1:
            counts["fixed_point_rounds>1"] += 1
        if uncached:
            counts["junction"] += 1
        if self.retention_interval == 0 and lookup.full_hit is not None and hit < lookup.full_hit:
            counts["retention0_miss"] += 1
        return result

    patches.set(HybridKVCacheCoordinator, "find_longest_cache_hit", find_hybrid)


def _count_refused_invalid_blocks(patches: _Patches, counts: Counter[str]) -> None:
    inner = Scheduler._handle_invalid_blocks

    def handle(self: Scheduler, *args: Any, **kwargs: Any) -> set[str]:
        try:
            return inner(self, *args, **kwargs)
        except RuntimeError:
            if len(self.kv_cache_config.kv_cache_groups) > 1:
                counts["invalid_blocks_refused"] += 1
            raise

    patches.set(Scheduler, "_handle_invalid_blocks", handle)


def _count_partial_tails(patches: _Patches, counts: Counter[str]) -> None:
    inner_cache = BlockPool.cache_partial_block

    def cache_partial_block(
        self: BlockPool, request: Any, block: KVCacheBlock, *args: Any, **kwargs: Any
    ) -> Any:
        keys_before = len(self.cached_block_hashes_by_block.get(block.block_id, ()))
        hash_before = block.block_hash
        key = inner_cache(self, request, block, *args, **kwargs)
        keys_after = len(self.cached_block_hashes_by_block.get(block.block_id, ()))
        if key is not None and (keys_after > keys_before or block.block_hash != hash_before):
            counts["partial_tail_key"] += 1
        return key

    inner_remove = BlockPool._remove_cached_block_hashes

    def remove(self: BlockPool, block: KVCacheBlock) -> Any:
        if self.cached_block_hashes_by_block.get(block.block_id):
            counts["partial_tail_evicted"] += 1
        return inner_remove(self, block)

    patches.set(BlockPool, "cache_partial_block", cache_partial_block)
    patches.set(BlockPool, "_remove_cached_block_hashes", remove)


# --------------------------------------------------------------------------------------
# Planted faults
# --------------------------------------------------------------------------------------


def _dense_retention(patches: _Patches) -> None:
    """Sliding-window groups cache every full block, whatever the retention interval."""

    def reachable_block_mask(cls: type, *args: Any, **kwargs: Any) -> list[bool] | None:
        return None

    patches.set(SlidingWindowManager, "reachable_block_mask", classmethod(reachable_block_mask))


def _no_window_free(patches: _Patches) -> None:
    """Sliding-window groups keep their out-of-window blocks until the request ends."""

    def remove_skipped_blocks(self: SingleTypeKVCacheManager, *args: Any, **kwargs: Any) -> None:
        return None

    patches.set(SlidingWindowManager, "remove_skipped_blocks", remove_skipped_blocks)


def _reversed_deferred_free(patches: _Patches) -> None:
    """Deferred frees concatenate the groups' blocks last group first."""

    def pop_blocks_for_free(self: KVCacheCoordinator, request_id: str) -> list[KVCacheBlock]:
        blocks: list[KVCacheBlock] = []
        for manager in reversed(self.single_type_managers):
            blocks.extend(manager.pop_blocks_for_free(request_id))
        return blocks

    patches.set(KVCacheCoordinator, "pop_blocks_for_free", pop_blocks_for_free)


def _no_partial_tail(patches: _Patches) -> None:
    """Full-attention groups with blocks larger than the hash block never key a
    prompt's partial tail block."""

    def cache_partial_tail_block(self: FullAttentionManager, *args: Any, **kwargs: Any) -> None:
        return None

    patches.set(FullAttentionManager, "_cache_partial_tail_block", cache_partial_tail_block)


#: Faults to plant in vLLM's classes, by name.
PLANTS: dict[str, Callable[[_Patches], None]] = {
    "dense-retention": _dense_retention,
    "no-window-free": _no_window_free,
    "reversed-deferred-free": _reversed_deferred_free,
    "no-partial-tail": _no_partial_tail,
}


@contextlib.contextmanager
def planted(name: str) -> Iterator[None]:
    """The fault :data:`PLANTS` ``[name]`` in vLLM's classes while active."""
    with _patched() as patches:
        PLANTS[name](patches)
        yield
