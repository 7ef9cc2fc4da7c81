"""kvblocks: a vLLM-compatible KV-cache block manager with a Rust core.

``import kvblocks`` gives the native (Rust) backend, or the pure-Python reference
when ``KVBLOCKS_BACKEND=python`` is set. ``kvblocks.BACKEND`` names the one in use
(``"rust"`` or ``"python"``). Both export the same names with the same behaviour.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

from kvblocks.errors import (
    BlockStateError,
    InvariantError,
    KVBlocksError,
    NoFreeBlocksError,
    UnknownBlockError,
    UnsupportedLayoutError,
)

#: The names every backend exports (``kvblocks.reference`` and ``kvblocks._native``).
BACKEND_NAMES: tuple[str, ...] = (
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
)


def _load_backend() -> tuple[str, ModuleType]:
    requested = os.environ.get("KVBLOCKS_BACKEND", "").strip().lower()
    if requested not in ("", "rust", "python"):
        raise ImportError(f"KVBLOCKS_BACKEND must be 'rust' or 'python', got {requested!r}")
    if requested == "python":
        from kvblocks import reference

        return "python", reference
    try:
        from kvblocks import _native
    except ImportError as exc:
        if requested == "rust":
            raise
        warnings.warn(
            f"kvblocks: the native backend could not be imported ({exc}); "
            "falling back to the pure-Python reference, which is much slower. "
            "Set KVBLOCKS_BACKEND=python to silence this warning.",
            RuntimeWarning,
            stacklevel=3,
        )
        from kvblocks import reference

        return "python", reference
    return "rust", _native


BACKEND, _backend = _load_backend()

BlockHasher = _backend.BlockHasher
BlockPool = _backend.BlockPool
InvalidBlocksOutcome = _backend.InvalidBlocksOutcome
KVCacheBlock = _backend.KVCacheBlock
KVCacheManager = _backend.KVCacheManager
PrefixCacheStats = _backend.PrefixCacheStats
Request = _backend.Request
RollbackResult = _backend.RollbackResult
handle_failed_recving = _backend.handle_failed_recving
handle_invalid_blocks = _backend.handle_invalid_blocks
rollback_invalid_blocks = _backend.rollback_invalid_blocks
update_requests_with_invalid_blocks = _backend.update_requests_with_invalid_blocks

__all__ = [
    "BACKEND",
    "BACKEND_NAMES",
    "BlockHasher",
    "BlockPool",
    "BlockStateError",
    "InvalidBlocksOutcome",
    "InvariantError",
    "KVBlocksError",
    "KVCacheBlock",
    "KVCacheManager",
    "NoFreeBlocksError",
    "PrefixCacheStats",
    "Request",
    "RollbackResult",
    "UnknownBlockError",
    "UnsupportedLayoutError",
    "handle_failed_recving",
    "handle_invalid_blocks",
    "rollback_invalid_blocks",
    "update_requests_with_invalid_blocks",
]
