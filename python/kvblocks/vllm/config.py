"""The arguments vLLM 0.33.0's Scheduler builds its ``KVCacheManager`` with, and which
configurations kvblocks manages: exactly one full-attention KV cache group (plain, or
promoted from sliding-window or chunked-local layers)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    MLAAttentionSpec,
)

__all__ = ["FULL_ATTENTION_SPECS", "POOL_CONNECTORS", "ManagerArgs", "config_reason"]

#: Connectors that reach into vLLM's real pool or coordinator objects (ref-count
#: pinning through ``pool.blocks``, free-list walks, per-group coordinators).
POOL_CONNECTORS = frozenset(
    {"SimpleCPUOffloadConnector", "MooncakeStoreConnector", "HiSparseConnector", "UMBPConnector"}
)

#: The spec types whose single group kvblocks manages.
FULL_ATTENTION_SPECS = (FullAttentionSpec, MLAAttentionSpec)


@dataclass(frozen=True, slots=True)
class ManagerArgs:
    """The keyword arguments ``Scheduler.__init__`` passes to ``KVCacheManager``
    (``scheduler.py`` of vLLM 0.33.0), with vLLM's defaults."""

    kv_cache_config: KVCacheConfig
    max_model_len: int
    scheduler_block_size: int
    hash_block_size: int
    max_in_flight_tokens: int | None = None
    enable_caching: bool = True
    use_eagle: bool = False
    num_hash_lookahead_tokens: int = 0
    num_prefill_lookahead: int = 0
    log_stats: bool = False
    enable_kv_cache_events: bool = False
    dcp_world_size: int = 1
    pcp_world_size: int = 1
    metrics_collector: object | None = None
    watermark: float = 0.0
    enable_mamba_shared_prefix_checkpoint: bool = False

    def unsupported_reason(self) -> str | None:
        """Why kvblocks cannot manage this configuration, or None when it can."""
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            return f"{len(groups)} KV cache groups (kvblocks manages exactly one)"
        group = groups[0]
        spec = group.kv_cache_spec
        # A full-attention spec with `sliding_window` or `attention_chunk_size` set is
        # what vLLM promotes local layers to with the hybrid manager off: its manager is
        # plain full attention, and so is kvblocks'.
        if not isinstance(spec, FullAttentionSpec) or type(spec) not in FULL_ATTENTION_SPECS:
            return f"KV cache spec {type(spec).__name__} is not plain full attention"
        if group.role != KVCacheGroupRole.DEFAULT or group.is_eagle_group:
            return f"KV cache group role {group.role.value} (eagle group: {group.is_eagle_group})"
        if self.kv_cache_config.needs_kv_cache_zeroing:
            return "the KV cache needs zeroing (Mamba layers or mixed precision)"
        # Full attention caches densely: vLLM accepts only None or 0 for it (and raises
        # its own error for anything else, which falling back lets it do).
        if self.kv_cache_config.prefix_cache_retention_interval not in (None, 0):
            return "a prefix-cache retention interval is set"
        if self.dcp_world_size != 1 or self.pcp_world_size != 1:
            return (
                f"context parallelism (dcp_world_size={self.dcp_world_size}, "
                f"pcp_world_size={self.pcp_world_size})"
            )
        if self.use_eagle or self.num_hash_lookahead_tokens or self.num_prefill_lookahead:
            return (
                f"EAGLE/MTP lookahead (use_eagle={self.use_eagle}, "
                f"num_hash_lookahead_tokens={self.num_hash_lookahead_tokens}, "
                f"num_prefill_lookahead={self.num_prefill_lookahead})"
            )
        if self.enable_mamba_shared_prefix_checkpoint:
            return "Mamba shared-prefix checkpoints"
        if self.metrics_collector is not None:
            return "a KV cache metrics collector (observability kv_cache_metrics)"
        if (
            spec.block_size != self.scheduler_block_size
            or self.hash_block_size != self.scheduler_block_size
        ):
            return (
                f"block sizes differ (spec {spec.block_size}, "
                f"scheduler {self.scheduler_block_size}, hash {self.hash_block_size})"
            )
        return None


def config_reason(vllm_config: Any) -> str | None:
    """What the Scheduler's config asks for that kvblocks' pool cannot serve."""
    aux = getattr(vllm_config, "aux_output_config", None)
    if aux is not None and getattr(aux, "enabled", False):
        return "aux outputs (an aux-output connector reads vLLM's coordinator)"
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    for name in _connector_names(transfer):
        if name in POOL_CONNECTORS:
            return f"KV connector {name} needs vLLM's own block pool objects"
    return None


def _connector_names(transfer: Any) -> Iterator[str]:
    """The connector's name and, for a MultiConnector, its children's."""
    if transfer is None or not getattr(transfer, "kv_connector", None):
        return
    yield transfer.kv_connector
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    for child in extra.get("connectors", []) if transfer.kv_connector == "MultiConnector" else []:
        name = child.get("kv_connector")
        if name:
            yield name
