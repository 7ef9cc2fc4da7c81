"""Which KV cache manager vLLM's Scheduler gets: kvblocks' when the configuration is
one plain full-attention group, vLLM's own otherwise (with the reason logged once)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import vllm.v1.core.sched.scheduler as scheduler_module
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    MLAAttentionSpec,
)

from kvblocks.vllm.manager import KVCacheManager

__all__ = [
    "bind_manager_factory",
    "install",
    "make_kv_cache_manager",
    "uninstall",
    "unsupported_reason",
]

# A child of vLLM's logger, so the line shows among vLLM's own.
logger = logging.getLogger("vllm.kvblocks")

#: Connectors that reach into vLLM's real pool or coordinator objects (ref-count
#: pinning through ``pool.blocks``, free-list walks, per-group coordinators).
POOL_CONNECTORS = frozenset(
    {"SimpleCPUOffloadConnector", "MooncakeStoreConnector", "HiSparseConnector", "UMBPConnector"}
)

#: The spec types whose single group kvblocks manages.
FULL_ATTENTION_SPECS = (FullAttentionSpec, MLAAttentionSpec)


def unsupported_reason(
    *,
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    scheduler_block_size: int,
    hash_block_size: int,
    max_in_flight_tokens: int | None = None,
    enable_caching: bool = True,
    use_eagle: bool = False,
    num_hash_lookahead_tokens: int = 0,
    num_prefill_lookahead: int = 0,
    log_stats: bool = False,
    enable_kv_cache_events: bool = False,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
    metrics_collector: object | None = None,
    watermark: float = 0.0,
    enable_mamba_shared_prefix_checkpoint: bool = False,
    vllm_config: Any = None,
) -> str | None:
    """Why kvblocks cannot manage this configuration, or None when it can.

    Takes the keyword arguments vLLM 0.33.0's Scheduler passes to ``KVCacheManager``,
    plus the Scheduler's ``vllm_config`` when known (for aux outputs and connectors).
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return f"{len(groups)} KV cache groups (kvblocks manages exactly one)"
    group = groups[0]
    spec = group.kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or type(spec) not in FULL_ATTENTION_SPECS:
        return f"KV cache spec {type(spec).__name__} is not plain full attention"
    if spec.sliding_window is not None or spec.attention_chunk_size is not None:
        return f"KV cache spec {type(spec).__name__} has a sliding window or chunked attention"
    if group.role != KVCacheGroupRole.DEFAULT or group.is_eagle_group:
        return f"KV cache group role {group.role.value} (eagle group: {group.is_eagle_group})"
    if kv_cache_config.needs_kv_cache_zeroing:
        return "the KV cache needs zeroing (Mamba layers or mixed precision)"
    # Full attention caches densely: vLLM accepts only None or 0 for it (and raises
    # its own error for anything else, which falling back lets it do).
    if kv_cache_config.prefix_cache_retention_interval not in (None, 0):
        return "a prefix-cache retention interval is set"
    if dcp_world_size != 1 or pcp_world_size != 1:
        return f"context parallelism (dcp_world_size={dcp_world_size}, pcp={pcp_world_size})"
    if use_eagle or num_hash_lookahead_tokens or num_prefill_lookahead:
        return (
            "EAGLE/MTP lookahead (use_eagle="
            f"{use_eagle}, num_hash_lookahead_tokens={num_hash_lookahead_tokens}, "
            f"num_prefill_lookahead={num_prefill_lookahead})"
        )
    if enable_mamba_shared_prefix_checkpoint:
        return "Mamba shared-prefix checkpoints"
    if metrics_collector is not None:
        return "a KV cache metrics collector (observability kv_cache_metrics)"
    if spec.block_size != scheduler_block_size or hash_block_size != scheduler_block_size:
        return (
            f"block sizes differ (spec {spec.block_size}, scheduler {scheduler_block_size}, "
            f"hash {hash_block_size})"
        )
    if vllm_config is not None:
        return _config_reason(vllm_config)
    return None


def _config_reason(vllm_config: Any) -> str | None:
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


def make_kv_cache_manager(**kwargs: Any) -> KVCacheManager | VllmKVCacheManager:
    """kvblocks' manager for a supported configuration, vLLM's own otherwise.

    Takes exactly the keyword arguments vLLM 0.33.0's Scheduler passes to
    ``KVCacheManager`` (and, from kvblocks' schedulers, ``vllm_config``). The reason for
    a fallback is logged once, at INFO.
    """
    vllm_config = kwargs.pop("vllm_config", None)
    reason = unsupported_reason(**kwargs, vllm_config=vllm_config)
    if reason is not None:
        logger.info("kvblocks: using vLLM's own KV cache manager: %s", reason)
        return VllmKVCacheManager(**kwargs)
    return KVCacheManager(**kwargs)


def _installed_factory(**kwargs: Any) -> KVCacheManager | VllmKVCacheManager:
    """The factory :func:`install` puts in the scheduler module: it finds the config of
    the Scheduler being built (the caller's ``self``) for the config-level checks."""
    caller = sys._getframe(1).f_locals.get("self")
    return make_kv_cache_manager(**kwargs, vllm_config=getattr(caller, "vllm_config", None))


def bind_manager_factory(factory: Callable[..., Any]) -> Callable[..., Any]:
    """Binds the name the Scheduler builds its manager with
    (``vllm.v1.core.sched.scheduler.KVCacheManager``) to ``factory``; returns what it
    was bound to."""
    namespace = vars(scheduler_module)
    saved: Callable[..., Any] = namespace["KVCacheManager"]
    namespace["KVCacheManager"] = factory
    return saved


#: What the Scheduler's name was bound to before :func:`install`.
_saved: list[Callable[..., Any]] = []


def install() -> None:
    """Makes every ``vllm.v1.core.sched.scheduler.Scheduler`` built from now on use
    kvblocks' manager where supported (rebinds that module's ``KVCacheManager``).
    Idempotent."""
    if vars(scheduler_module)["KVCacheManager"] is _installed_factory:
        return
    _saved[:] = [bind_manager_factory(_installed_factory)]


def uninstall() -> None:
    """Undoes :func:`install`. Idempotent."""
    if vars(scheduler_module)["KVCacheManager"] is _installed_factory:
        bind_manager_factory(_saved.pop() if _saved else VllmKVCacheManager)
