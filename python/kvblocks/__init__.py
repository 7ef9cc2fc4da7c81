"""kvblocks: a vLLM-compatible KV-cache block manager with a Rust core.

``import kvblocks`` gives the native (Rust) backend, or the pure-Python reference
when ``KVBLOCKS_BACKEND=python`` is set. ``kvblocks.BACKEND`` names the one in use
(``"rust"`` or ``"python"``). Both export the same names with the same behaviour.
"""

from __future__ import annotations

import importlib
import importlib.metadata
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

#: The installed version: the Cargo workspace's, the one place it is written.
__version__: str = importlib.metadata.version(__name__)

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


#: The module of each backend, by the name ``KVBLOCKS_BACKEND`` and ``BACKEND`` use.
BACKEND_MODULES: dict[str, str] = {"rust": "kvblocks._native", "python": "kvblocks.reference"}


def load_backend(name: str) -> ModuleType:
    """The backend module called ``name`` (``"rust"`` or ``"python"``), for running both.

    Raises:
        ValueError: Unknown name.
        ImportError: The module cannot be imported.
    """
    if name not in BACKEND_MODULES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_MODULES)}, got {name!r}")
    return importlib.import_module(BACKEND_MODULES[name])


def _load_backend() -> tuple[str, ModuleType]:
    requested = os.environ.get("KVBLOCKS_BACKEND", "").strip().lower()
    if requested not in ("", *BACKEND_MODULES):
        raise ImportError(f"KVBLOCKS_BACKEND must be 'rust' or 'python', got {requested!r}")
    if requested == "python":
        return "python", load_backend("python")
    try:
        native = load_backend("rust")
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
        return "python", load_backend("python")
    return "rust", native


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
    "BACKEND_MODULES",
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
    "load_backend",
    "rollback_invalid_blocks",
    "update_requests_with_invalid_blocks",
]
