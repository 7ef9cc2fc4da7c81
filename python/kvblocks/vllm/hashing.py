"""vLLM's request block hashing in Rust: kvblocks' schedulers give each request they
admit kvblocks' native ``BlockHasher`` in place of vLLM's Python one, so the block
hashes its output tokens add (``Request.append_output_token_ids``, in
``update_from_output``) are computed natively. ``request.block_hashes`` stays the list
of the same ``bytes`` every other reader expects.

The swap is the least invasive place vLLM offers: ``Request`` calls whatever hasher it
holds (``request._block_hasher``), and the scheduler's ``add_request`` sees every
request before its first step. A prompt's own hashes are computed earlier, by the
engine, with vLLM's hasher. The native hasher is used only when it gives exactly
vLLM's hashes: kvblocks' manager in use, an algorithm both implement, vLLM's
``NONE_HASH`` seed reproduced, no hash lookahead, and a request without prompt
embeddings. Otherwise vLLM's hasher stays, with the reason logged once.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from kvblocks._native import BlockHasher
from kvblocks.constants import HASH_ALGORITHMS

__all__ = ["native_block_hasher", "use_native_hasher"]

logger = logging.getLogger("vllm.kvblocks")


def native_block_hasher(
    vllm_config: Any, hash_block_size: int, kvblocks_manager: bool
) -> tuple[BlockHasher | None, str | None]:
    """kvblocks' hasher for the scheduler's requests, or ``None`` and why not.

    Args:
        vllm_config: The scheduler's ``VllmConfig``.
        hash_block_size: The block size the requests are hashed at.
        kvblocks_manager: Whether the scheduler got kvblocks' KV cache manager (the
            hashing falls back with the manager).
    """
    if not kvblocks_manager:
        return None, "vLLM's own KV cache manager is in use"
    cache_config = getattr(vllm_config, "cache_config", None)
    algo = getattr(cache_config, "prefix_caching_hash_algo", "sha256")
    if algo not in HASH_ALGORITHMS:
        return None, f"prefix_caching_hash_algo {algo!r} is not one kvblocks implements"
    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if none_hash is None:
        return None, "vLLM's NONE_HASH is not set (init_none_hash has not run)"
    hasher = BlockHasher(hash_block_size, algo, kv_cache_utils.get_none_hash_seed())
    if hasher.none_hash != none_hash:
        return None, "vLLM's NONE_HASH does not come from its seed (set by hand?)"
    return hasher, None


def use_native_hasher(request: Request, hasher: BlockHasher | None) -> None:
    """Gives ``request`` kvblocks' hasher when it has vLLM's (and no prompt
    embeddings, which kvblocks does not hash)."""
    if hasher is None or request._block_hasher is None:
        return
    if getattr(request, "prompt_embeds", None) is not None:
        return
    # The bound method, not the hasher: calling an instance goes through the type's
    # generic __call__ lookup (about 80 ns more per appended token), a bound builtin
    # method is called directly. The native hasher returns vLLM's BlockHash values
    # (bytes), typed as bytes.
    request._block_hasher = hasher.__call__  # type: ignore[assignment]


def log_fallback(reason: str | None) -> None:
    """Logs, once per scheduler, why vLLM's hasher stays."""
    if reason is not None:
        logger.info("kvblocks: vLLM's block hasher stays: %s", reason)
