"""The pure-Python reference backend: the executable specification of kvblocks.

File names follow vLLM's ``v1/core`` so the two can be read side by side. It exports the
same names, signatures, docstrings and error classes as the native backend
(``kvblocks._native``), whose docstrings, text signatures and stub are generated from
this package by ``tools/api_copies.py``.
"""

from kvblocks.reference.block_pool import BlockPool
from kvblocks.reference.hashing import BlockHasher
from kvblocks.reference.kv_cache_manager import KVCacheManager
from kvblocks.reference.request import Request
from kvblocks.reference.scheduler import (
    handle_failed_recving,
    handle_invalid_blocks,
    rollback_invalid_blocks,
    update_requests_with_invalid_blocks,
)
from kvblocks.values import InvalidBlocksOutcome, KVCacheBlock, PrefixCacheStats, RollbackResult

__all__ = [
    "BlockHasher",
    "BlockPool",
    "InvalidBlocksOutcome",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "Request",
    "RollbackResult",
    "handle_failed_recving",
    "handle_invalid_blocks",
    "rollback_invalid_blocks",
    "update_requests_with_invalid_blocks",
]
