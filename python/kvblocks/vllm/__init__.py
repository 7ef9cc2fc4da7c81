"""kvblocks inside vLLM's own Scheduler (vLLM 0.31.x to 0.33.x).

Use it with vLLM's supported hook::

    vllm serve MODEL --scheduler-cls kvblocks.vllm.KVBlocksScheduler        # async scheduling off
    vllm serve MODEL --scheduler-cls kvblocks.vllm.KVBlocksAsyncScheduler   # async scheduling on

or ``LLM(..., scheduler_cls="kvblocks.vllm.KVBlocksScheduler")``. The scheduler builds
kvblocks' :class:`KVCacheManager` (state and decisions in Rust) in place of vLLM's for
one full-attention KV cache group, :class:`HybridKVCacheManager` for full,
sliding-window and chunked-local groups of one block size (gpt-oss, Gemma 2/3, Cohere2,
Llama 4; vLLM 0.33 only), and vLLM's own manager otherwise, logging the reason once at
INFO.
:func:`install` does the same for code that builds
``vllm.v1.core.sched.scheduler.Scheduler`` directly.

Importing this module imports vLLM; ``import kvblocks`` never does.
"""

from __future__ import annotations

from kvblocks.vllm._version_check import require_vllm

require_vllm()

from kvblocks.vllm.factory import (  # noqa: E402
    install,
    make_kv_cache_manager,
    uninstall,
    unsupported_reason,
)
from kvblocks.vllm.hybrid import HybridKVCacheManager  # noqa: E402
from kvblocks.vllm.manager import KVCacheManager  # noqa: E402
from kvblocks.vllm.num_tokens import register_request_class  # noqa: E402
from kvblocks.vllm.scheduler import (  # noqa: E402
    KVBlocksAsyncScheduler,
    KVBlocksScheduler,
    rollback_mode,
    with_kvblocks,
)

__all__ = [
    "HybridKVCacheManager",
    "KVBlocksAsyncScheduler",
    "KVBlocksScheduler",
    "KVCacheManager",
    "install",
    "make_kv_cache_manager",
    "rollback_mode",
    "uninstall",
    "unsupported_reason",
    "with_kvblocks",
]

# The managers and the hasher read vLLM's `Request.num_tokens` natively from here on.
register_request_class()
