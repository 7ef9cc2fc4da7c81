"""The pure-Python reference backend: the executable specification of kvblocks.

File names follow vLLM's ``v1/core`` so the two can be read side by side. It exports the
same names, signatures, docstrings and error classes as the native backend
(``kvblocks._native``); ``tests/test_parity.py`` checks that.
"""

from kvblocks.reference.block_pool import BlockPool
from kvblocks.reference.kv_cache_utils import KVCacheBlock

__all__ = [
    "BlockPool",
    "KVCacheBlock",
]
