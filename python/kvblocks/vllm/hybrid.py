"""``HybridKVCacheManager``: vLLM 0.33.0's manager surface for several KV cache groups
(full, sliding-window and chunked-local attention, as gpt-oss, Gemma 2/3/4, Cohere2 and
Llama 4 have) or one local-attention group, with its state and decisions in kvblocks'
Rust core.

The hot calls are native methods; this module adds the constructor vLLM calls, the
per-group members vLLM's coordinator and single-type managers expose, and the stats,
which accumulate in vLLM's own class.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec

from kvblocks._native import KVCacheBlockView, VllmKVCacheManager
from kvblocks.vllm.config import ManagerArgs
from kvblocks.vllm.manager import BlockPool, CoordinatorCalls, ManagerSurface, native_arguments

__all__ = ["HybridKVCacheManager"]


class GroupTables(Mapping[str, list[KVCacheBlockView]]):
    """One group's ``req_to_blocks``, read from the manager (never grown by reads)."""

    __slots__ = ("_group_id", "_manager")

    def __init__(self, manager: HybridKVCacheManager, group_id: int) -> None:
        self._manager = manager
        self._group_id = group_id

    def __getitem__(self, request_id: str) -> list[KVCacheBlockView]:
        table = self._manager.group_table(request_id, self._group_id)
        return [] if table is None else [self._manager.block(b) for b in table]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._manager.request_ids(self._group_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._manager.request_ids(self._group_id))

    def __len__(self) -> int:
        return len(self._manager.request_ids(self._group_id))


class HybridSingleTypeManager:
    """What vLLM's Scheduler, engine core and connectors read of one group's manager."""

    __slots__ = (
        "_manager",
        "block_pool",
        "block_size",
        "dcp_world_size",
        "kv_cache_group_id",
        "kv_cache_spec",
        "req_to_blocks",
    )

    def __init__(
        self, manager: HybridKVCacheManager, spec: KVCacheSpec, group_id: int, block_pool: BlockPool
    ) -> None:
        self._manager = manager
        self.kv_cache_spec = spec
        self.block_size: int = spec.block_size
        self.kv_cache_group_id = group_id
        self.block_pool = block_pool
        self.dcp_world_size = 1
        self.req_to_blocks = GroupTables(manager, group_id)

    @property
    def num_cached_block(self) -> dict[str, int]:
        """Each request's count of cached leading blocks in this group (a snapshot)."""
        return dict(self._manager.cached_block_counts(self.kv_cache_group_id))


class HybridKVCacheCoordinator(CoordinatorCalls):
    """vLLM's coordinator members that leak out of its manager, for several groups."""

    enable_partial_hash_hits = False
    num_reprefillable_tokens = 0
    dcp_world_size = 1
    pcp_world_size = 1

    __slots__ = (
        "_manager",
        "block_pool",
        "drop_eagle_group_ids",
        "eagle_group_ids",
        "full_attention_group_id",
        "group_block_sizes",
        "hash_block_size",
        "kv_cache_config",
        "retention_interval",
        "scheduler_block_size",
        "single_type_managers",
    )

    def __init__(
        self,
        manager: HybridKVCacheManager,
        kv_cache_config: KVCacheConfig,
        block_pool: BlockPool,
        *,
        scheduler_block_size: int,
        hash_block_size: int,
    ) -> None:
        self._manager = manager
        self.kv_cache_config = kv_cache_config
        groups = kv_cache_config.kv_cache_groups
        self.block_pool = block_pool
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.single_type_managers = tuple(
            HybridSingleTypeManager(manager, g.kv_cache_spec, i, block_pool)
            for i, g in enumerate(groups)
        )
        self.group_block_sizes = tuple(m.block_size for m in self.single_type_managers)
        self.retention_interval = kv_cache_config.prefix_cache_retention_interval
        self.full_attention_group_id = next(
            (i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)),
            None,
        )
        self.eagle_group_ids: set[int] = set()
        self.drop_eagle_group_ids: set[int] = set()


class HybridKVCacheManager(ManagerSurface, VllmKVCacheManager):
    """vLLM 0.33.0's ``KVCacheManager`` for several KV cache groups (or one
    local-attention group), with its state and decisions in Rust. Takes vLLM's
    constructor arguments (:class:`~kvblocks.vllm.config.ManagerArgs`); build it
    through :func:`kvblocks.vllm.make_kv_cache_manager`."""

    def __new__(cls, *args: Any, **kwargs: Any) -> HybridKVCacheManager:
        config = ManagerArgs(*args, **kwargs)
        reason = config.unsupported_reason()
        if reason is not None:
            raise ValueError(f"kvblocks' HybridKVCacheManager does not support {reason}")
        return super().__new__(cls, **native_arguments(config))  # type: ignore[no-any-return]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = ManagerArgs(*args, **kwargs)
        self._set_vllm_attributes(config)
        self.coordinator = HybridKVCacheCoordinator(
            self,
            config.kv_cache_config,
            self._vllm_block_pool,
            scheduler_block_size=config.scheduler_block_size,
            hash_block_size=config.hash_block_size,
        )
