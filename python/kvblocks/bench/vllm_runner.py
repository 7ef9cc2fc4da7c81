"""The pool-churn and rollback workloads on vLLM's own code (``kvblocks bench``'s vLLM column).

When vLLM is importable, the same scripts the two kvblocks backends replay also run on
vLLM's classes, driven the way vLLM drives them:

* pool churn: a ``vllm.v1.core.block_pool.BlockPool`` of ``KVCacheBlock`` objects, the
  lookup through ``FullAttentionManager.find_longest_cache_hit`` (what
  ``KVCacheManager.get_computed_blocks`` runs for one full-attention group), then
  ``touch``, ``get_new_blocks``, ``cache_full_blocks`` with a request carrying the
  block hashes, and ``free_blocks`` tail first as ``SingleTypeKVCacheManager.free``.
* rollback: ``Scheduler._update_requests_with_invalid_blocks`` itself, called unbound on
  a stand-in ``self`` (a real ``Scheduler`` needs a full engine configuration). The
  stand-in holds ``block_size`` and a ``kv_cache_manager`` whose ``get_block_ids``
  returns the prepared block table; everything is built in the untimed setup.

Every vLLM import is lazy, so this module imports (and :func:`status` answers) without
vLLM. Importing vLLM imports torch: the first call takes seconds.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ChurnPool",
    "RollbackState",
    "available",
    "column_version",
    "pool_churn_outcome",
    "rollback_outcome",
    "run_rollback",
    "setup_pool_churn",
    "setup_rollback",
    "status",
]

#: The vLLM release the column was written against.
VLLM_VERSION = "0.33.0"

_BLOCK_POOL = "vllm.v1.core.block_pool"
_MANAGERS = "vllm.v1.core.single_type_kv_cache_manager"
_SPECS = "vllm.v1.kv_cache_interface"
_SCHEDULER = "vllm.v1.core.sched.scheduler"
_ROLLBACK_METHOD = "_update_requests_with_invalid_blocks"


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[bool, str]:
    try:
        vllm = importlib.import_module("vllm")
        for name in (_BLOCK_POOL, _MANAGERS, _SPECS, _SCHEDULER):
            importlib.import_module(name)
    except Exception as exc:  # any import failure means "not available"
        return False, f"vLLM is not importable here ({type(exc).__name__}: {exc})"
    version = str(getattr(vllm, "__version__", "?"))
    scheduler = importlib.import_module(_SCHEDULER).Scheduler
    if not hasattr(scheduler, _ROLLBACK_METHOD):
        return False, (
            f"vLLM {version} has no Scheduler.{_ROLLBACK_METHOD} "
            f"(the column was written for vLLM {VLLM_VERSION})"
        )
    return True, f"vLLM {version}"


def status() -> str:
    """Says whether the vLLM column can run (imports vLLM once, then cached).

    Returns:
        ``"vLLM <version>"`` when vLLM and every class the column uses import, else
        why not, e.g. ``"vLLM is not importable here (ModuleNotFoundError: ...)"``.
    """
    return _probe()[1]


def column_version() -> str:
    """The vLLM version the column shows: the installed one when it runs, else the one
    it was written against (:data:`VLLM_VERSION`)."""
    return status().removeprefix("vLLM ") if available() else VLLM_VERSION


def available() -> bool:
    """Whether the vLLM column can run (see :func:`status`).

    Returns:
        True when vLLM and every class the column uses import.
    """
    return _probe()[0]


# --------------------------------------------------------------------------- pool churn


class _HashedRequest:
    """What ``BlockPool.cache_full_blocks`` reads from a vLLM ``Request`` (events off)."""

    __slots__ = ("block_hashes",)

    def __init__(self, block_hashes: list[bytes]) -> None:
        self.block_hashes = block_hashes


class ChurnPool:
    """vLLM's ``BlockPool`` behind the calls the churn script makes on a kvblocks
    ``BlockPool``, so that one loop (``workloads.churn_loop``) drives all three.

    ``get_num_free_blocks``, ``touch``, ``get_new_blocks`` and ``free_blocks`` are vLLM's
    own bound methods. The lookup is ``FullAttentionManager.find_longest_cache_hit`` as
    ``UnitaryKVCacheCoordinator`` calls it for one group (what
    ``KVCacheManager.get_computed_blocks`` runs), and caching passes a request that
    carries the block hashes, as ``SingleTypeKVCacheManager.cache_blocks`` does.

    Attributes:
        pool: The ``vllm.v1.core.block_pool.BlockPool``, prefix caching on.
    """

    __slots__ = (
        "_block_size",
        "_find",
        "_group_ids",
        "_spec",
        "free_blocks",
        "get_new_blocks",
        "get_num_free_blocks",
        "pool",
        "touch",
    )

    def __init__(self, pool: Any, spec: Any, find: Any, block_size: int) -> None:
        self.pool = pool
        self._spec = spec
        self._find = find
        self._block_size = block_size
        self._group_ids = [0]
        self.get_num_free_blocks = pool.get_num_free_blocks
        self.touch = pool.touch
        self.get_new_blocks = pool.get_new_blocks
        self.free_blocks = pool.free_blocks

    def find_longest_cache_hit(self, prefix: list[bytes]) -> list[Any]:
        """The cached blocks of the longest cached prefix of ``prefix``."""
        (hits,), _ = self._find(
            block_hashes=prefix,
            max_length=len(prefix) * self._block_size,
            kv_cache_group_ids=self._group_ids,
            block_pool=self.pool,
            kv_cache_spec=self._spec,
            drop_eagle_block=False,
            alignment_tokens=self._block_size,
        )
        return hits  # type: ignore[no-any-return]

    def cache_full_blocks(
        self, blocks: list[Any], chain: list[bytes], num_cached: int, num_full: int
    ) -> None:
        """Caches ``blocks[num_cached:num_full]`` under the hashes of ``chain``."""
        self.pool.cache_full_blocks(
            _HashedRequest(chain), blocks, num_cached, num_full, self._block_size, 0
        )


def setup_pool_churn(num_blocks: int) -> ChurnPool:
    """Builds a vLLM ``BlockPool`` of ``num_blocks`` blocks (block 0 is the null block),
    16 tokens a block (vLLM's default), behind :class:`ChurnPool`.

    Args:
        num_blocks: Blocks in the pool, the null block included (as kvblocks counts).

    Returns:
        The pool, for ``workloads.churn_loop``.
    """
    block_size = 16
    block_pool = importlib.import_module(_BLOCK_POOL)
    managers = importlib.import_module(_MANAGERS)
    specs = importlib.import_module(_SPECS)
    torch = importlib.import_module("torch")
    pool = block_pool.BlockPool(
        num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=block_size
    )
    spec = specs.FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float16
    )
    return ChurnPool(pool, spec, managers.FullAttentionManager.find_longest_cache_hit, block_size)


def pool_churn_outcome(result: tuple[list[list[Any]], int]) -> tuple[list[list[int]], int]:
    """``churn_loop``'s result on a :class:`ChurnPool` with block ids for blocks,
    outside the timing.

    Args:
        result: ``(live block tables of KVCacheBlock objects, blocks allocated)``.

    Returns:
        ``(live block tables as ids, blocks allocated)``, which equal the result of the
        kvblocks backends on the same script.
    """
    live, allocated = result
    return [[block.block_id for block in blocks] for blocks in live], allocated


# --------------------------------------------------------------------------- rollback


class _RunningRequest:
    """What ``_update_requests_with_invalid_blocks`` reads and writes on a ``Request``."""

    __slots__ = ("num_computed_tokens", "request_id")

    def __init__(self, request_id: str, num_computed_tokens: int) -> None:
        self.request_id = request_id
        self.num_computed_tokens = num_computed_tokens


class _BlockTables:
    """The scheduler's ``kv_cache_manager`` as the rollback reads it: one group."""

    __slots__ = ("_tables",)

    def __init__(self, tables: dict[str, tuple[list[int]]]) -> None:
        self._tables = tables

    def get_block_ids(self, request_id: str) -> tuple[list[int]]:
        """The request's block ids, one list per KV cache group (vLLM's shape)."""
        return self._tables[request_id]


class _SchedulerSelf:
    """The attributes of ``Scheduler`` that ``_update_requests_with_invalid_blocks`` uses."""

    __slots__ = ("block_size", "kv_cache_manager")

    def __init__(self, kv_cache_manager: _BlockTables, block_size: int) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.block_size = block_size


@dataclass(frozen=True, slots=True)
class RollbackState:
    """Everything the rollback method gets, built outside the timed region.

    Attributes:
        method: ``Scheduler._update_requests_with_invalid_blocks`` (unbound).
        scheduler: The stand-in ``self``.
        requests: The running requests, in iteration order (ids ``"r0"``, ``"r1"``...).
        invalid_block_ids: As vLLM receives them from the KV connector (a set).
        num_scheduled_tokens: Request id to tokens scheduled this step (scheduled
            requests only, as in ``SchedulerOutput``).
    """

    method: Any
    scheduler: _SchedulerSelf
    requests: list[_RunningRequest]
    invalid_block_ids: set[int]
    num_scheduled_tokens: dict[str, int]


def setup_rollback(
    tables: Sequence[list[int]],
    num_computed_tokens: Sequence[int],
    num_scheduled_tokens: Sequence[int],
    invalid_block_ids: Sequence[int],
    block_size: int,
) -> RollbackState:
    """Builds the stand-in scheduler and requests for one rollback run.

    Args:
        tables: Each request's block ids (kept, not copied).
        num_computed_tokens: Each request's ``num_computed_tokens``, this step included.
        num_scheduled_tokens: Tokens scheduled for each request this step (0: none).
        invalid_block_ids: Block ids whose KV failed to load.
        block_size: Tokens per block.

    Returns:
        The state :func:`run_rollback` runs; its requests are fresh, so build one per
        run (the method rewrites their ``num_computed_tokens``).
    """
    method = getattr(importlib.import_module(_SCHEDULER).Scheduler, _ROLLBACK_METHOD)
    ids = [f"r{i}" for i in range(len(tables))]
    manager = _BlockTables({rid: (table,) for rid, table in zip(ids, tables, strict=True)})
    requests = [_RunningRequest(rid, n) for rid, n in zip(ids, num_computed_tokens, strict=True)]
    scheduled = {rid: n for rid, n in zip(ids, num_scheduled_tokens, strict=True) if n}
    return RollbackState(
        method,
        _SchedulerSelf(manager, block_size),
        requests,
        set(invalid_block_ids),
        scheduled,
    )


def run_rollback(state: RollbackState) -> tuple[set[str], int, set[int]]:
    """Runs vLLM's ``Scheduler._update_requests_with_invalid_blocks`` once, collecting
    blocks to evict (as for running requests).

    Args:
        state: From :func:`setup_rollback`; its requests are updated in place.

    Returns:
        vLLM's ``(affected_req_ids, total_affected_tokens, blocks_to_evict)``.
    """
    result: tuple[set[str], int, set[int]] = state.method(
        state.scheduler,
        state.requests,
        state.invalid_block_ids,
        state.num_scheduled_tokens,
        evict_blocks=True,
    )
    return result


def rollback_outcome(
    state: RollbackState, result: tuple[set[str], int, set[int]]
) -> tuple[list[int], list[int], int, list[int]]:
    """vLLM's rollback in the shape of kvblocks' ``RollbackResult``, for comparison.

    Args:
        state: The state :func:`run_rollback` ran on.
        result: What :func:`run_rollback` returned.

    Returns:
        ``(num_computed_tokens, affected, total_affected_tokens, blocks_to_evict)``:
        the requests' new token counts in order, the affected request indices
        ascending, the token total and the sorted blocks to evict, which equal the
        fields of ``rollback_invalid_blocks(...)``'s result.
    """
    affected_ids, total, to_evict = result
    affected = sorted(int(rid[1:]) for rid in affected_ids)
    computed = [request.num_computed_tokens for request in state.requests]
    return computed, affected, total, sorted(to_evict)
