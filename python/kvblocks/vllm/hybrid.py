"""``HybridKVCacheManager``: vLLM 0.33.0's manager surface for several KV cache groups
(full, sliding-window and chunked-local attention, as gpt-oss, Gemma 2/3/4, Cohere2 and
Llama 4 have) or one local-attention group, with its state and decisions in kvblocks'
Rust core.

The hot calls are native methods; this module adds the constructor vLLM calls, the
per-group members vLLM's coordinator and single-type managers expose, and the stats,
which accumulate in vLLM's own class.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from vllm.distributed import kv_events as vllm_events
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
)

from kvblocks._native import KVCacheBlockView, VllmKVCacheManager
from kvblocks.vllm._version_check import installed_differences
from kvblocks.vllm.config import ManagerArgs
from kvblocks.vllm.manager import (
    ADMISSION_STATUSES,
    BlockPool,
    CoordinatorCalls,
    ManagerSurface,
    event_metadata,
)

__all__ = ["HybridKVCacheManager"]


#: One group for the native constructor: kind, block size, window, retained tokens,
#: admission cap and lookup class.
GroupRow = tuple[str, int, int | None, int, int | None, int]


def group_rows(config: ManagerArgs) -> list[GroupRow]:
    """The native constructor's ``groups``: per group its kind, block size, window,
    retained tokens, admission cap (vLLM's spec method, the one source of that rule)
    and lookup class (the first group with an equal spec: vLLM looks those up
    jointly)."""
    in_flight = config.max_in_flight_tokens
    if in_flight is None:
        in_flight = config.max_model_len
    specs = [g.kv_cache_spec for g in config.kv_cache_config.kv_cache_groups]
    rows: list[GroupRow] = []
    for spec in specs:
        lookup_class = next(
            i for i, other in enumerate(specs) if type(other) is type(spec) and other == spec
        )
        if isinstance(spec, SlidingWindowSpec | ChunkedLocalAttentionSpec):
            cap: int | None = spec.max_admission_blocks_per_request(
                max_in_flight_tokens=in_flight, max_model_len=config.max_model_len
            )
        else:
            cap = None
        if isinstance(spec, SlidingWindowSpec):
            rows.append(
                (
                    "sliding_window",
                    spec.block_size,
                    spec.sliding_window,
                    spec.extra_retained_tokens,
                    cap,
                    lookup_class,
                )
            )
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            rows.append(
                ("chunked_local", spec.block_size, spec.attention_chunk_size, 0, cap, lookup_class)
            )
        else:
            rows.append(("full", spec.block_size, None, 0, None, lookup_class))
    return rows


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

    def get_num_blocks_to_allocate(  # noqa: PLR0917 (vLLM's signature)
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[Any]],
        num_encoder_tokens: int = 0,
        total_computed_tokens: int = 0,
        num_local_computed_tokens: int = 0,
        num_tokens_main_model: int = 0,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """The blocks an allocation of ``num_tokens`` slots would take from the pool."""
        return self._manager.num_blocks_to_allocate(  # type: ignore[no-any-return]
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            apply_admission_cap,
        )


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
        return super().__new__(  # type: ignore[no-any-return]
            cls,
            config.kv_cache_config.num_blocks,
            config.scheduler_block_size,
            config.hash_block_size,
            config.max_model_len,
            group_rows(config),
            enable_caching=config.enable_caching,
            retention_interval=config.kv_cache_config.prefix_cache_retention_interval,
            enable_kv_cache_events=config.enable_kv_cache_events,
            watermark=config.watermark,
            admission_statuses=list(ADMISSION_STATUSES),
            event_structs=vllm_events,
            event_metadata=list(event_metadata(config)),
            vllm_series=installed_differences().series,
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = ManagerArgs(*args, **kwargs)
        self._set_vllm_attributes(config)
        self._vllm_block_pool = BlockPool(
            self,
            self.native_pool,
            enable_caching=config.enable_caching,
            enable_kv_cache_events=config.enable_kv_cache_events,
            block_size=config.hash_block_size,
        )
        self.coordinator = HybridKVCacheCoordinator(
            self,
            config.kv_cache_config,
            self._vllm_block_pool,
            scheduler_block_size=config.scheduler_block_size,
            hash_block_size=config.hash_block_size,
        )
