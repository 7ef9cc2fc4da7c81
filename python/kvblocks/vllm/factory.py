"""Which KV cache manager vLLM's Scheduler gets: kvblocks' when it supports the layout
(one full-attention group, or full, sliding-window and chunked-local groups of one
block size), vLLM's own otherwise (with the reason logged once)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import vllm.v1.core.sched.scheduler as scheduler_module
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

from kvblocks.vllm._version_check import installed_differences, newer_version_reason
from kvblocks.vllm.config import ManagerArgs, config_reason
from kvblocks.vllm.hybrid import HybridKVCacheManager
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


def unsupported_reason(*, vllm_config: Any = None, **kwargs: Any) -> str | None:
    """Why kvblocks cannot manage this configuration, or None when it can.

    Takes the keyword arguments vLLM's Scheduler passes to ``KVCacheManager``
    (:class:`~kvblocks.vllm.config.ManagerArgs`), plus the Scheduler's ``vllm_config``
    when known (for aux outputs and connectors).
    """
    # A newer vLLM may pass arguments ManagerArgs does not know: checked first.
    reason = newer_version_reason()
    if reason is not None:
        return reason
    args = ManagerArgs(**kwargs)
    reason = args.unsupported_reason() or installed_differences().unsupported_reason(
        single_full_attention_group=args.single_full_attention_group()
    )
    if reason is None and vllm_config is not None:
        return config_reason(vllm_config)
    return reason


def make_kv_cache_manager(
    **kwargs: Any,
) -> KVCacheManager | HybridKVCacheManager | VllmKVCacheManager:
    """kvblocks' manager for a supported configuration, vLLM's own otherwise.

    Takes exactly the keyword arguments vLLM's Scheduler (0.31 to 0.33) passes to
    ``KVCacheManager`` (and, from kvblocks' schedulers, ``vllm_config``). The reason for
    a fallback is logged once, at INFO.
    """
    vllm_config = kwargs.pop("vllm_config", None)
    reason = unsupported_reason(**kwargs, vllm_config=vllm_config)
    if reason is not None:
        logger.info("kvblocks: using vLLM's own KV cache manager: %s", reason)
        return VllmKVCacheManager(**kwargs)
    if ManagerArgs(**kwargs).single_full_attention_group():
        return KVCacheManager(**kwargs)
    return HybridKVCacheManager(**kwargs)


def _installed_factory(**kwargs: Any) -> KVCacheManager | HybridKVCacheManager | VllmKVCacheManager:
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
