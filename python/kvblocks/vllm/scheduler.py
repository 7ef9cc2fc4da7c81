"""vLLM 0.33.0's ``Scheduler`` and ``AsyncScheduler``, or any subclass of them, with
kvblocks' KV cache manager.

The manager is built *during* ``super().__init__()``: the scheduler module's
``KVCacheManager`` name is bound to kvblocks' factory for that call only, so everything
the Scheduler derives from its manager (connector binding, spec-decode block counts)
sees kvblocks' manager, and no throw-away vLLM pool is built. The invalid-block rollback
runs natively, with the block tables read inside Rust.
"""

from __future__ import annotations

import copyreg
import logging
import os
import threading
import types
from collections.abc import Iterable
from functools import partial
from typing import Any

import vllm.v1.core.sched.scheduler as scheduler_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from kvblocks import _native
from kvblocks.constants import ROLLBACK_MODES, either
from kvblocks.vllm.factory import bind_manager_factory, make_kv_cache_manager
from kvblocks.vllm.hashing import log_fallback, native_block_hasher, use_native_hasher
from kvblocks.vllm.hybrid import HybridKVCacheManager
from kvblocks.vllm.manager import KVCacheManager

__all__ = ["KVBlocksAsyncScheduler", "KVBlocksScheduler", "rollback_mode", "with_kvblocks"]

# vLLM's own scheduler logger: the rollback's lines are vLLM's, word for word.
logger = logging.getLogger(scheduler_module.__name__)

# One scheduler is built at a time while the module's name is swapped.
_swap_lock = threading.Lock()


def rollback_mode() -> str:
    """``KVBLOCKS_ROLLBACK_MODE`` (default ``vllm``), checked."""
    mode = os.environ.get("KVBLOCKS_ROLLBACK_MODE", "vllm")
    if mode not in ROLLBACK_MODES:
        raise ValueError(
            f"KVBLOCKS_ROLLBACK_MODE must be {either(ROLLBACK_MODES)}, got {mode!r}: "
            "unset it for vLLM's semantics"
        )
    return mode


class KVBlocksScheduling:
    """What kvblocks adds to a vLLM scheduler class: the manager swap at construction
    and the native rollback. Listed first among the bases (:func:`with_kvblocks` does
    that), so its methods win over the scheduler's."""

    kv_cache_manager: Any
    running: list[Request]
    kv_holding_waiting: Any
    recompute_kv_load_failures: bool
    failed_recving_kv_req_ids: set[str]
    vllm_config: Any
    hash_block_size: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._rollback_mode = rollback_mode()
        # vLLM's own __init__ reports a missing vllm_config; the factory then sees None.
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        with _swap_lock:
            saved = bind_manager_factory(partial(make_kv_cache_manager, vllm_config=vllm_config))
            try:
                super().__init__(*args, **kwargs)
            finally:
                bind_manager_factory(saved)
        ours = isinstance(self.kv_cache_manager, KVCacheManager | HybridKVCacheManager)
        self._block_hasher, reason = native_block_hasher(
            self.vllm_config, self.hash_block_size, kvblocks_manager=ours
        )
        if ours:
            log_fallback(reason)

    def add_request(self, request: Request) -> None:
        """vLLM's ``add_request``, with the request's block hashes computed by kvblocks'
        native hasher from now on (see :mod:`kvblocks.vllm.hashing`)."""
        use_native_hasher(request, self._block_hasher)
        super().add_request(request)  # type: ignore[misc]

    # vLLM calls this only from _handle_invalid_blocks, overridden below; it stays for
    # subclasses and out-of-tree callers, with the same native rollback.
    def _update_requests_with_invalid_blocks(
        self,
        requests: Iterable[Request],
        invalid_block_ids: set[int],
        num_scheduled_tokens: dict[str, int],
        evict_blocks: bool = True,
    ) -> tuple[set[str], int, set[int]]:
        if not isinstance(self.kv_cache_manager, KVCacheManager):
            return super()._update_requests_with_invalid_blocks(  # type: ignore[misc,no-any-return]
                requests, invalid_block_ids, num_scheduled_tokens, evict_blocks
            )
        affected, tokens, to_evict = _native.update_requests_with_invalid_blocks(
            self.kv_cache_manager,
            list(requests),
            invalid_block_ids,
            num_scheduled_tokens,
            evict_blocks=evict_blocks,
            mode=self._rollback_mode,
        )
        return affected, int(tokens), to_evict

    def _handle_invalid_blocks(
        self, invalid_block_ids: set[int], num_scheduled_tokens: dict[str, int]
    ) -> set[str]:
        if not isinstance(self.kv_cache_manager, KVCacheManager):
            return super()._handle_invalid_blocks(  # type: ignore[misc,no-any-return]
                invalid_block_ids, num_scheduled_tokens
            )
        recompute = self.recompute_kv_load_failures
        waiting = [
            req
            for req in self.kv_holding_waiting
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        ]
        outcome = _native.handle_invalid_blocks(
            self.kv_cache_manager,
            invalid_block_ids,
            num_scheduled_tokens,
            running=self.running,
            waiting_for_remote_kvs=waiting,
            policy="recompute" if recompute else "fail",
            mode=self._rollback_mode,
        )
        # The outcome's sets are built as vLLM builds its own (the order matters: the
        # Scheduler frees and reports requests in it).
        if not recompute:
            failed = outcome.failed_req_ids
            if failed:
                logger.error(
                    "Failing %d request(s) due to KV load failure "
                    "(failure_policy=fail, %d tokens affected). Request IDs: %s",
                    len(failed),
                    outcome.total_affected_tokens,
                    failed,
                )
            return failed
        retry, rescheduled = outcome.retry_req_ids, outcome.rescheduled_req_ids
        if retry or rescheduled:
            logger.warning(
                "Recovered from KV load failure: %d request(s) rescheduled (%d tokens affected).",
                len(retry) + len(rescheduled),
                outcome.total_affected_tokens,
            )
        self.failed_recving_kv_req_ids |= retry
        return rescheduled


class KVBlocksScheduler(KVBlocksScheduling, Scheduler):
    """vLLM's ``Scheduler`` (async scheduling off) with kvblocks' KV cache manager:
    ``--scheduler-cls kvblocks.vllm.KVBlocksScheduler``; ``with_kvblocks(Scheduler)``."""


class KVBlocksAsyncScheduler(KVBlocksScheduling, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (async scheduling on, vLLM's default on GPUs) with
    kvblocks' KV cache manager: ``--scheduler-cls kvblocks.vllm.KVBlocksAsyncScheduler``;
    ``with_kvblocks(AsyncScheduler)``."""


#: The classes :func:`with_kvblocks` made, by base; vLLM's two are written out above so
#: that they are importable, picklable and typed as classes.
_made: dict[type[Scheduler], type[Scheduler]] = {
    Scheduler: KVBlocksScheduler,
    AsyncScheduler: KVBlocksAsyncScheduler,
}
_made_lock = threading.Lock()
#: The metaclass of the classes made over bases of each metaclass.
_metaclasses: dict[type, type] = {}


def with_kvblocks(base: type[Scheduler]) -> type[Scheduler]:
    """``base`` (vLLM's ``Scheduler``, ``AsyncScheduler`` or any subclass of either,
    such as NVIDIA Dynamo's ``InstrumentedScheduler``) with kvblocks' KV cache manager
    and native rollback: the class ``KVBlocks<base name>``, whose bases are
    :class:`KVBlocksScheduling` and ``base``. The same base always gives the same class,
    and a class that has them already is returned as it is.

    ``--scheduler-cls`` takes a dotted name: bind the result to a name in a module of
    your own::

        # my_schedulers.py
        from dynamo.vllm.instrumented_scheduler import InstrumentedScheduler
        from kvblocks.vllm import with_kvblocks

        KVBlocksInstrumentedScheduler = with_kvblocks(InstrumentedScheduler)

    then ``--scheduler-cls my_schedulers.KVBlocksInstrumentedScheduler``.

    Raises:
        TypeError: ``base`` is not a subclass of vLLM's ``Scheduler``.
    """
    if not (isinstance(base, type) and issubclass(base, Scheduler)):
        raise TypeError(f"with_kvblocks needs a subclass of vLLM's Scheduler, got {base!r}")
    if issubclass(base, KVBlocksScheduling):
        return base
    with _made_lock:
        made = _made.get(base)
        if made is None:
            name = f"KVBlocks{base.__name__}"
            body = {
                "__module__": __name__,
                "__qualname__": name,
                "__doc__": f"``{base.__module__}.{base.__qualname__}`` with kvblocks' KV "
                "cache manager.",
            }
            made = types.new_class(
                name,
                (KVBlocksScheduling, base),
                {"metaclass": _picklable_metaclass(type(base))},
                lambda ns: ns.update(body),
            )
            _made[base] = made
        return made


def _picklable_metaclass(meta: type) -> type:
    """A metaclass under ``meta`` whose classes pickle as ``with_kvblocks(base)``: a
    class made here has no module-level name to be found by, and vLLM may send its
    ``scheduler_cls`` to the engine-core process. Called under ``_made_lock``."""
    made_meta = _metaclasses.get(meta)
    if made_meta is None:
        made_meta = type(f"KVBlocks{meta.__name__}", (meta,), {"__module__": __name__})
        copyreg.pickle(made_meta, _reduce_made_class)
        _metaclasses[meta] = made_meta
    return made_meta


def _reduce_made_class(cls: type) -> tuple[Any, tuple[type]]:
    (base,) = (b for b, made in _made.items() if made is cls)
    return with_kvblocks, (base,)
