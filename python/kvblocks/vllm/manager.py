"""``KVCacheManager``: vLLM 0.33.0's manager surface for one full-attention KV cache
group, with its state and decisions in kvblocks' Rust core.

The Scheduler's hot calls (``allocate_slots``, ``get_computed_blocks``, ``free``,
``cache_blocks``, ``get_blocks``, ...) are native methods; this module adds the
constructor vLLM calls, the members vLLM's coordinator and block pool expose, the
once-a-step conversion to vLLM's own stats class, and the members that are constants
for one full-attention group. Events are built natively as vLLM's own event classes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, overload

from vllm.distributed import kv_events as vllm_events
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from kvblocks._native import KVCacheBlocks, KVCacheBlockView, VllmKVCacheManager
from kvblocks.vllm._version_check import installed_differences
from kvblocks.vllm.config import ManagerArgs

__all__ = ["BlockPool", "KVCacheBlocks", "KVCacheCoordinator", "KVCacheManager"]

#: The statuses of requests being admitted, which the watermark applies to.
ADMISSION_STATUSES = (int(RequestStatus.WAITING), int(RequestStatus.PREEMPTED))


def block_ids(blocks: Iterable[KVCacheBlockView | int]) -> list[int]:
    """The ids of block objects (anything with ``block_id``) or of plain ints."""
    return [b if isinstance(b, int) else b.block_id for b in blocks]


class PoolOwner(Protocol):
    """What the pool views read of a manager (one group's or several's)."""

    def block(self, block_id: int) -> KVCacheBlockView: ...
    def evict_blocks(self, block_ids: Iterable[int]) -> None: ...
    @property
    def block_pool(self) -> BlockPool: ...


class BlockPool:
    """vLLM's ``BlockPool`` members that the Scheduler and id-level connectors use, on
    the manager's native pool. Blocks come back as live :class:`KVCacheBlockView` objects;
    ``free_blocks`` and ``touch`` take those (or ids)."""

    #: Where the blocks live, as vLLM's pool says.
    medium = "GPU"
    #: No KV-cache metrics collector (configurations with one fall back).
    metrics_collector = None
    #: No hash lookahead (EAGLE/MTP configurations fall back).
    num_hash_lookahead_tokens = 0

    __slots__ = (
        "_manager",
        "_pool",
        "enable_caching",
        "enable_kv_cache_events",
        "hash_block_size",
        "num_gpu_blocks",
    )

    def __init__(
        self,
        manager: PoolOwner,
        pool: Any,
        *,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        block_size: int,
    ) -> None:
        self._manager = manager
        self._pool = pool
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.hash_block_size = block_size
        self.num_gpu_blocks: int = pool.num_blocks

    @property
    def blocks(self) -> Sequence[KVCacheBlockView]:
        """Every block of the pool, by id."""
        return BlockViews(self._manager)

    @property
    def free_block_queue(self) -> FreeBlockQueue:
        """The free queue's length, as vLLM's queue object reports it."""
        return FreeBlockQueue(self._pool)

    @property
    def null_block(self) -> KVCacheBlockView:
        """Block 0, never handed out."""
        return self._manager.block(0)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlockView | int]) -> None:
        """Drops one reference of each block, in eviction-priority order."""
        self._pool.free_blocks(block_ids(ordered_blocks))

    def touch(self, blocks: Iterable[KVCacheBlockView | int]) -> None:
        """Adds one reference to each block (taking free ones out of the queue)."""
        self._pool.touch(block_ids(blocks))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlockView]:
        """Allocates ``num_blocks`` blocks from the free queue's head."""
        return [self._manager.block(b) for b in self._pool.get_new_blocks(num_blocks)]

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlockView] | None:
        """The cached block of each group for ``block_hash``, or None on a miss."""
        ids = self._pool.get_cached_block(block_hash, tuple(kv_cache_group_ids))
        return None if ids is None else [self._manager.block(b) for b in ids]

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drops the blocks' hashes from the prefix cache (the manager's rule: vLLM's
        pool and manager take the same ids)."""
        self._manager.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache if no block is in use."""
        return self._pool.reset_prefix_cache()  # type: ignore[no-any-return]

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue."""
        return self._pool.get_num_free_blocks()  # type: ignore[no-any-return]

    def get_usage(self) -> float:
        """``1 - free / (num_gpu_blocks - 1)``."""
        return self._pool.get_usage()  # type: ignore[no-any-return]

    def is_block_writable(self, block: KVCacheBlockView) -> bool:
        """Whether the block may be written: every block but the null block (no
        pinning without a connector that needs vLLM's pool)."""
        return not block.is_null


class RequestId:
    """All that freeing reads of a request: its id."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class RequestTables(Mapping[str, list[KVCacheBlockView]]):
    """vLLM's ``req_to_blocks``, read from the manager: each request's blocks (an
    unknown request has none, as with vLLM's ``defaultdict``, which this view never
    grows)."""

    __slots__ = ("_manager",)

    def __init__(self, manager: KVCacheManager) -> None:
        self._manager = manager

    def __getitem__(self, request_id: str) -> list[KVCacheBlockView]:
        return list(self._manager.get_blocks(request_id).blocks[0])

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._manager.request_ids(0)

    def __iter__(self) -> Iterator[str]:
        return iter(self._manager.request_ids(0))

    def __len__(self) -> int:
        return len(self._manager.request_ids(0))


class BlockViews(Sequence[KVCacheBlockView]):
    """vLLM's ``block_pool.blocks``, read from the pool: item ``i`` is block ``i``."""

    __slots__ = ("_manager",)

    def __init__(self, manager: PoolOwner) -> None:
        self._manager = manager

    @overload
    def __getitem__(self, index: int) -> KVCacheBlockView: ...
    @overload
    def __getitem__(self, index: slice) -> list[KVCacheBlockView]: ...
    def __getitem__(self, index: int | slice) -> KVCacheBlockView | list[KVCacheBlockView]:
        ids = range(len(self))[index]
        if isinstance(ids, int):
            return self._manager.block(ids)
        return [self._manager.block(i) for i in ids]

    def __len__(self) -> int:
        return self._manager.block_pool.num_gpu_blocks


class FreeBlockQueue:
    """What is read of vLLM's ``free_block_queue``: its length."""

    __slots__ = ("_pool",)

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue."""
        return self._pool.get_num_free_blocks()  # type: ignore[no-any-return]


class SingleTypeManager:
    """What vLLM's Scheduler, engine core, connectors and tests read of the group's
    manager."""

    __slots__ = (
        "_manager",
        "block_pool",
        "block_size",
        "dcp_world_size",
        "kv_cache_group_id",
        "kv_cache_spec",
        "req_to_blocks",
    )

    def __init__(self, manager: KVCacheManager, spec: KVCacheSpec, block_pool: BlockPool) -> None:
        self._manager = manager
        self.kv_cache_spec = spec
        self.block_size: int = spec.block_size
        self.kv_cache_group_id = 0
        self.block_pool = block_pool
        self.dcp_world_size = 1
        self.req_to_blocks = RequestTables(manager)

    @property
    def num_cached_block(self) -> dict[str, int]:
        """Each request's count of cached leading blocks (a snapshot)."""
        return dict(self._manager.cached_block_counts(0))


class CoordinatorCalls:
    """The coordinator members that do not depend on the groups: they go to the
    manager (``_manager``, set by the subclass), which runs every group."""

    __slots__ = ()

    _manager: Any

    def get_blocks(self, request_id: str) -> tuple[Sequence[KVCacheBlockView], ...]:
        """The request's blocks, one sequence per group."""
        return self._manager.get_blocks(request_id).blocks  # type: ignore[no-any-return]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Caches the request's full blocks within ``num_computed_tokens`` tokens."""
        self._manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        """Frees the request's blocks, group by group, each table tail first."""
        self._manager.free(RequestId(request_id))

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlockView]:
        """Forgets the request; returns its blocks, unfreed, group after group."""
        return self._manager.pop_blocks_for_free(RequestId(request_id))  # type: ignore[no-any-return]

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache if no block is in use."""
        return self._manager.block_pool.reset_prefix_cache()  # type: ignore[no-any-return]

    def new_step_starts(self) -> None:
        """Nothing to do without Mamba groups."""

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

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Frees the blocks that left each group's window."""
        self._manager.remove_skipped_blocks(
            request_id, processed_computed_tokens, num_prompt_tokens
        )


class KVCacheCoordinator(CoordinatorCalls):
    """vLLM's coordinator members that leak out of its manager, for one group."""

    _manager: KVCacheManager

    enable_partial_hash_hits = False
    full_attention_group_id = 0
    num_reprefillable_tokens = 0
    dcp_world_size = 1
    pcp_world_size = 1
    #: Dense caching: vLLM's unitary coordinator has no retention interval.
    retention_interval = None

    __slots__ = (
        "_manager",
        "block_pool",
        "block_size",
        "drop_eagle_group_ids",
        "eagle_group_ids",
        "group_block_sizes",
        "kv_cache_config",
        "kv_cache_spec",
        "scheduler_block_size",
        "single_type_managers",
    )

    def __init__(
        self,
        manager: KVCacheManager,
        kv_cache_config: KVCacheConfig,
        block_pool: BlockPool,
    ) -> None:
        self._manager = manager
        self.kv_cache_config = kv_cache_config
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size: int = self.kv_cache_spec.block_size
        self.scheduler_block_size = self.block_size
        self.group_block_sizes = (self.block_size,)
        self.block_pool = block_pool
        self.single_type_managers = (SingleTypeManager(manager, self.kv_cache_spec, block_pool),)
        self.eagle_group_ids: set[int] = set()
        self.drop_eagle_group_ids: set[int] = set()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """The manager's :meth:`KVCacheManager.get_num_common_prefix_blocks`."""
        return self._manager.get_num_common_prefix_blocks(running_request_id)


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


def event_metadata(config: ManagerArgs) -> tuple[tuple[str, int | None], ...]:
    """vLLM's ``kv_cache_event_metadata``: per group, the ``kv_cache_spec_kind`` and the
    sliding window its ``BlockStored`` events carry."""
    return tuple(
        (spec_kind(g.kv_cache_spec), get_kv_cache_spec_sliding_window(g.kv_cache_spec))
        for g in config.kv_cache_config.kv_cache_groups
    )


def native_arguments(config: ManagerArgs) -> dict[str, Any]:
    """The native manager's constructor arguments for vLLM's."""
    return {
        "num_blocks": config.kv_cache_config.num_blocks,
        "scheduler_block_size": config.scheduler_block_size,
        "hash_block_size": config.hash_block_size,
        "max_model_len": config.max_model_len,
        "groups": group_rows(config),
        "enable_caching": config.enable_caching,
        "retention_interval": config.kv_cache_config.prefix_cache_retention_interval,
        "enable_kv_cache_events": config.enable_kv_cache_events,
        "watermark": config.watermark,
        "admission_statuses": list(ADMISSION_STATUSES),
        "event_structs": vllm_events,
        "event_metadata": list(event_metadata(config)),
        "vllm_series": installed_differences().series,
    }


class ManagerSurface:
    """vLLM's ``KVCacheManager`` members that kvblocks' managers answer alike: the
    attributes vLLM's constructor sets, its stats accumulator, and the constants of
    layouts without Mamba groups, zeroing or copy-on-write. Listed before the native
    base, whose ``reset_prefix_cache`` it extends."""

    prefix_cache_stats: PrefixCacheStats | None
    _vllm_block_pool: BlockPool

    def _set_vllm_attributes(self, config: ManagerArgs) -> None:
        """The attributes vLLM's ``KVCacheManager.__init__`` sets that readers use."""
        self.kv_cache_config = config.kv_cache_config
        self.max_model_len = config.max_model_len
        self.log_stats = config.log_stats
        #: vLLM's accumulator, replaced by :meth:`make_prefix_cache_stats` (readers may
        #: hold it while it grows, as with vLLM's manager).
        self.prefix_cache_stats = PrefixCacheStats() if config.log_stats else None
        self.enable_kv_cache_events = config.enable_kv_cache_events
        self.use_eagle = False
        self.metrics_collector = None
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.kv_cache_event_metadata = event_metadata(config)
        self._vllm_block_pool = BlockPool(
            self,  # type: ignore[arg-type]
            self.native_pool,  # type: ignore[attr-defined]
            enable_caching=config.enable_caching,
            enable_kv_cache_events=config.enable_kv_cache_events,
            block_size=config.hash_block_size,
        )

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        """Whether a local prefix-cache lookup may run for this request."""
        enabled: bool = self.enable_caching  # type: ignore[attr-defined]
        return enabled and not request.skip_reading_prefix_cache

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """``get_computed_blocks`` plus ``hit_diverged`` (only Mamba layouts diverge)."""
        found = self.get_computed_blocks(request, max_cache_hit_length)  # type: ignore[attr-defined]
        return (*found, False)  # type: ignore[no-any-return]

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix-cache stats since the last call (replaced by fresh ones), or None
        without ``log_stats``."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache if no block is in use; the stats then say so."""
        if not super().reset_prefix_cache():  # type: ignore[misc]
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """vLLM 0.31: per group, the leading blocks of the request that every request
        holding blocks shares (for cascade attention). Later releases deprecate it:
        ``[0]`` per group."""
        return self.num_common_prefix_blocks(running_request_id)  # type: ignore[attr-defined,no-any-return]

    @property
    def block_pool(self) -> BlockPool:
        """vLLM's ``BlockPool`` members, on the manager's pool."""
        return self._vllm_block_pool

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group."""
        return self.get_blocks(request_id).get_block_ids()  # type: ignore[attr-defined,no-any-return]

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Records one admission's lookup as vLLM does (not for a skipped lookup)."""
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def new_step_starts(self) -> None:
        """Nothing to do without Mamba groups."""

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba only: ``{}``."""
        return {}

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[KVCacheBlockView]]:
        """No copy-on-write (no partial hits without Mamba groups): ``([], [])``."""
        return [], []

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """Mamba only: ``[]``."""
        return []

    def get_zeroing_block_ids_in_range(
        self, request_id: str, start_token: int, end_token: int
    ) -> list[int]:
        """vLLM 0.31: the request's blocks over ``[start_token, end_token)`` in groups
        whose new blocks are zeroed. No group of a layout kvblocks manages is (layouts
        that need zeroing fall back): ``[]``."""
        return []

    def take_new_block_ids(self) -> list[int]:
        """No zeroing without Mamba groups: ``[]``."""
        return []

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """No zeroing without Mamba groups."""


class KVCacheManager(ManagerSurface, VllmKVCacheManager):
    """vLLM 0.33.0's ``KVCacheManager`` for one full-attention KV cache group, with its
    state and decisions in Rust. Takes vLLM's constructor arguments
    (:class:`~kvblocks.vllm.config.ManagerArgs`); build it through
    :func:`kvblocks.vllm.make_kv_cache_manager`, which falls back to vLLM's manager
    for configurations this one does not support."""

    def __new__(cls, *args: Any, **kwargs: Any) -> KVCacheManager:
        config = ManagerArgs(*args, **kwargs)
        reason = config.unsupported_reason()
        if reason is None and not config.single_full_attention_group():
            reason = (
                "several KV cache groups or a local-attention group (HybridKVCacheManager does)"
            )
        if reason is not None:
            raise ValueError(f"kvblocks' KVCacheManager does not support {reason}")
        return super().__new__(cls, **native_arguments(config))  # type: ignore[no-any-return]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = ManagerArgs(*args, **kwargs)
        self._set_vllm_attributes(config)
        self.coordinator = KVCacheCoordinator(self, config.kv_cache_config, self._vllm_block_pool)


def spec_kind(spec: KVCacheSpec) -> str:
    """vLLM's ``kv_cache_spec_kind`` of a group: ``"full_attention"``, or
    ``"mla_attention"`` for MLA, which ``BlockStored`` events carry."""
    return str(get_kv_cache_spec_kind(spec).value)
