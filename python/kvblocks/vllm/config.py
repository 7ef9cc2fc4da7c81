"""The arguments vLLM 0.33.0's Scheduler builds its ``KVCacheManager`` with, and which
configurations kvblocks manages: KV cache groups of full attention (plain, MLA, or
promoted from sliding-window or chunked-local layers), sliding-window and chunked-local
attention, of one block size, or with larger sliding-window blocks (Gemma 4)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__all__ = [
    "FULL_ATTENTION_SPECS",
    "LOCAL_ATTENTION_SPECS",
    "POOL_CONNECTORS",
    "ManagerArgs",
    "config_reason",
]

#: Connectors that reach into vLLM's real pool or coordinator objects (ref-count
#: pinning through ``pool.blocks``, free-list walks, per-group coordinators).
POOL_CONNECTORS = frozenset(
    {"SimpleCPUOffloadConnector", "MooncakeStoreConnector", "HiSparseConnector", "UMBPConnector"}
)

#: The full-attention spec types kvblocks manages.
FULL_ATTENTION_SPECS = (FullAttentionSpec, MLAAttentionSpec)
#: The local-attention spec types kvblocks manages (exact types: subclasses such as
#: sliding-window MLA have managers of their own in vLLM).
LOCAL_ATTENTION_SPECS = (SlidingWindowSpec, ChunkedLocalAttentionSpec)


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
        if not groups:
            return "no KV cache group (an attention-free model)"
        if self.dcp_world_size != 1 or self.pcp_world_size != 1:
            return (
                f"context parallelism (dcp_world_size={self.dcp_world_size}, "
                f"pcp_world_size={self.pcp_world_size})"
            )
        for group in groups:
            spec = group.kv_cache_spec
            # A full-attention spec with `sliding_window` or `attention_chunk_size` set
            # is what vLLM promotes local layers to with the hybrid manager off: its
            # manager is plain full attention, and so is kvblocks'.
            if type(spec) not in FULL_ATTENTION_SPECS + LOCAL_ATTENTION_SPECS:
                return (
                    f"KV cache spec {type(spec).__name__} is not full, sliding-window or "
                    "chunked-local attention"
                )
            if group.role != KVCacheGroupRole.DEFAULT or group.is_eagle_group:
                return (
                    f"KV cache group role {group.role.value} (eagle group: {group.is_eagle_group})"
                )
            reason = self._block_size_reason(spec, single=len(groups) == 1)
            if reason is not None:
                return reason
        if all(type(g.kv_cache_spec) is ChunkedLocalAttentionSpec for g in groups):
            # No model has one (Llama 4's chunked layers come with full ones), so no
            # differential run covers it.
            return "chunked-local groups without full attention"
        if self.kv_cache_config.needs_kv_cache_zeroing:
            return "the KV cache needs zeroing (Mamba layers or mixed precision)"
        retention = self.kv_cache_config.prefix_cache_retention_interval
        # vLLM refuses a retention interval it cannot use with its own error, which
        # falling back lets it raise.
        if retention not in (None, 0) and (
            not any(type(g.kv_cache_spec) is SlidingWindowSpec for g in groups)
            or retention < 0
            or retention % self.scheduler_block_size
        ):
            return f"prefix-cache retention interval {retention} (vLLM refuses it)"
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
        return None

    def _block_size_reason(self, spec: KVCacheSpec, *, single: bool) -> str | None:
        """Why a group's block size is outside what kvblocks manages: vLLM's own
        divisibility rules, a chunked-local group whose blocks are not the scheduler's,
        or one group of another size."""
        size, scheduler, hashed = spec.block_size, self.scheduler_block_size, self.hash_block_size
        if (
            scheduler % size
            or size % hashed
            or (type(spec) is ChunkedLocalAttentionSpec and size != scheduler)
            or (single and not size == scheduler == hashed)
        ):
            return f"block sizes differ (group {size}, scheduler {scheduler}, hash {hashed})"
        return None

    def single_full_attention_group(self) -> bool:
        """Whether the layout is one full-attention group (kvblocks' fastest manager)."""
        groups = self.kv_cache_config.kv_cache_groups
        return len(groups) == 1 and type(groups[0].kv_cache_spec) in FULL_ATTENTION_SPECS


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
