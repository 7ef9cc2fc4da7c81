"""Rolling requests back past KV blocks whose load failed (vLLM's scheduler logic).

vLLM 0.33.0 keeps this logic in ``Scheduler`` (``v1/core/sched/scheduler.py``):
``_update_requests_with_invalid_blocks``, ``_handle_invalid_blocks`` and
``_handle_failed_recving``. kvblocks splits it in two layers:

* :func:`rollback_invalid_blocks` is the batch primitive. It works on plain columns
  (block tables, token counts) and changes nothing: it returns the new
  ``num_computed_tokens`` of every request, which requests were affected and which
  blocks must be evicted.
* :func:`update_requests_with_invalid_blocks`, :func:`handle_invalid_blocks` and
  :func:`handle_failed_recving` are vLLM's entry points. They read the block tables
  through a KV cache manager, run the primitive, and only then write
  ``request.num_computed_tokens``: a call that raises changes nothing.

Per request, in iteration order (vLLM's semantics, ``mode="vllm"``):

* ``computed = num_computed_tokens - num_scheduled_tokens`` is what was computed
  *before* this step. Only its ``cdiv(computed, block_size)`` blocks are scanned:
  blocks holding nothing but this step's tokens were not loaded.
* At the first invalid block that no earlier request of the batch has marked, the
  request truncates to ``idx * block_size`` and (when collecting) puts that block and
  every later block of its table up for eviction.
* Every invalid block met is marked, even after the request has truncated.
* A request whose invalid blocks were all marked by earlier requests only loses this
  step's tokens (``num_computed_tokens = computed``): vLLM relies on the earlier
  request rewriting the shared blocks in the same next step.

``mode="strict"`` (kvblocks only) drops that sharing shortcut: every request truncates
at its own first invalid block and collects its own tail. Guarantee: afterwards no
invalid block lies within any request's tokens that are still counted as computed from
before this step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, SupportsIndex

from kvblocks.constants import LOAD_FAILURE_POLICIES, ROLLBACK_MODES, cdiv, either
from kvblocks.errors import UnsupportedLayoutError
from kvblocks.reference.kv_cache_utils import check_non_negative, check_positive
from kvblocks.reference.request_fields import (
    ID,
    PROGRESS,
    num_computed_tokens_of,
    read_request,
)
from kvblocks.values import (
    InvalidBlocksOutcome,
    RollbackResult,
    build,
    materialise,
    to_int,
    to_int_list,
    to_request_id,
)

__all__ = [
    "BlockTableSource",
    "EvictingBlockTableSource",
    "InvalidBlocksOutcome",
    "RequestLike",
    "RollbackResult",
    "handle_failed_recving",
    "handle_invalid_blocks",
    "rollback_invalid_blocks",
    "update_requests_with_invalid_blocks",
]

#: vLLM's message when block-level failures meet a model with several KV cache groups.
MULTIPLE_GROUPS_MESSAGE = (
    "A KV connector reported block-level load failures (invalid_block_ids) which is not "
    "supported for models with multiple KV cache groups. Connectors must report failed "
    "requests via KVConnectorTransferResults.failed_recving instead."
)


class RequestLike(Protocol):
    """What the entry points read and write on a request (vLLM's ``Request`` fits)."""

    @property
    def request_id(self) -> str:
        """The id the KV cache manager and ``num_scheduled_tokens`` know it by."""
        ...

    num_computed_tokens: int


class BlockTableSource(Protocol):
    """A KV cache manager as far as the rollback reads it (vLLM's fits)."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        ...

    def get_block_ids(self, request_id: str) -> tuple[Sequence[int], ...]:
        """The request's block table, one list per KV cache group."""
        ...


class EvictingBlockTableSource(BlockTableSource, Protocol):
    """A KV cache manager that can also drop the hashes of blocks (``fail`` policy)."""

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Remove the blocks from the prefix cache."""
        ...


def rollback_invalid_blocks(
    block_tables: Iterable[Iterable[SupportsIndex]],
    num_computed_tokens: Iterable[SupportsIndex],
    num_scheduled_tokens: Iterable[SupportsIndex],
    invalid_block_ids: Iterable[SupportsIndex],
    block_size: SupportsIndex,
    *,
    collect_evictions: bool = True,
    mode: str = "vllm",
) -> RollbackResult:
    """Decide how far every request of a batch rolls back past invalid blocks.

    The batch primitive behind the other entry points: one entry per request in each
    column, in iteration order (which matters: see the module docstring). Nothing is
    changed; the caller applies the result.

    Args:
        block_tables: Each request's block ids (lists or NumPy integer arrays).
        num_computed_tokens: Each request's ``num_computed_tokens``, this step included.
        num_scheduled_tokens: Tokens scheduled for each request in this step (0 when it
            was not scheduled).
        invalid_block_ids: Block ids whose KV failed to load; duplicates are harmless and
            ids no table holds are ignored.
        block_size: Tokens per block.
        collect_evictions: Whether to collect the blocks to evict (vLLM's
            ``evict_blocks``; its async pass collects none).
        mode: ``"vllm"`` (vLLM 0.33.0 exactly) or ``"strict"`` (no sharing shortcut).

    Returns:
        The new token counts, the affected indices, the affected-token total and the
        sorted blocks to evict.

    Raises:
        TypeError: A value is not an integer.
        ValueError: Bad mode, non-positive block size, columns of different lengths, a
            negative count or id, more tokens scheduled than computed, or a block table
            too short to hold the tokens computed before this step.
    """
    # The scalars, then the columns, each in signature order.
    size = to_int(block_size)
    collect_evictions = bool(collect_evictions)
    strict = _check_mode(mode)
    tables = [to_int_list(table) for table in materialise(block_tables)]
    computed = to_int_list(num_computed_tokens)
    scheduled = to_int_list(num_scheduled_tokens)
    invalid = set(to_int_list(invalid_block_ids))
    return _decide(tables, computed, scheduled, invalid, size, collect_evictions, strict)[0]


def _decide(  # noqa: PLR0917 (the primitive's columns, read and converted)
    tables: list[list[int]],
    computed: list[int],
    scheduled: list[int],
    invalid: set[int],
    size: int,
    collect_evictions: bool,
    strict: bool,
) -> tuple[RollbackResult, set[int]]:
    """:func:`rollback_invalid_blocks` over converted columns; also returns the blocks
    to evict as the set vLLM builds (its members added in vLLM's order, which sets the
    order it iterates in)."""
    _validate_columns(tables, computed, scheduled, invalid, size)

    new_computed = list(computed)
    affected: list[int] = []
    total_affected_tokens = 0
    blocks_to_evict: set[int] = set()
    # Shared across the batch (vLLM mode): the first request to meet an invalid block
    # owns its recomputation; later requests sharing it do not truncate for it.
    marked: set[int] = set()

    for i, block_ids in enumerate(tables):
        _check_block_ids(i, block_ids)
        # Tokens computed before this step; only their blocks were loaded.
        req_num_computed_tokens = computed[i] - scheduled[i]
        scanned = block_ids[: cdiv(req_num_computed_tokens, size)]
        if invalid.isdisjoint(scanned):
            continue  # the common case, decided at C speed
        affected.append(i)
        truncated = False
        for idx, block_id in enumerate(scanned):
            if block_id not in invalid:
                continue
            if not strict:
                if block_id in marked:
                    continue  # shared: an earlier request recomputes it
                marked.add(block_id)
                if truncated:
                    continue  # marked for later requests, but we already truncated
            truncated = True
            # Block-aligned truncation at the first invalid block this request owns.
            new_computed[i] = idx * size
            total_affected_tokens += req_num_computed_tokens - new_computed[i]
            if collect_evictions:
                # The invalid block and everything after it, including blocks past the
                # scanned range (e.g. the one allocated for this step's tokens).
                blocks_to_evict.update(block_ids[idx:])
            if strict:
                break
        if not truncated:
            # Every invalid block was marked by an earlier request: only this step's
            # tokens are lost; the earlier request rewrites the shared blocks.
            total_affected_tokens += computed[i] - req_num_computed_tokens
            new_computed[i] = req_num_computed_tokens

    result = build(
        RollbackResult,
        num_computed_tokens=new_computed,
        affected=affected,
        total_affected_tokens=total_affected_tokens,
        blocks_to_evict=sorted(blocks_to_evict),
    )
    return result, blocks_to_evict


def update_requests_with_invalid_blocks(
    kv_cache_manager: BlockTableSource,
    requests: Iterable[RequestLike],
    invalid_block_ids: Iterable[SupportsIndex],
    num_scheduled_tokens: Mapping[str, SupportsIndex],
    *,
    evict_blocks: bool = True,
    mode: str = "vllm",
) -> tuple[set[str], int, set[int]]:
    """vLLM's ``Scheduler._update_requests_with_invalid_blocks``.

    Args:
        kv_cache_manager: Source of the block tables (``get_block_ids``) and
            ``block_size``; one KV cache group.
        requests: The requests, in iteration order; each may appear once.
        invalid_block_ids: Block ids whose KV failed to load.
        num_scheduled_tokens: Request id to tokens scheduled this step; a missing id
            means not scheduled.
        evict_blocks: Whether to collect the blocks to evict.
        mode: ``"vllm"`` or ``"strict"``.

    Returns:
        ``(affected_req_ids, total_affected_tokens, blocks_to_evict)``, as vLLM. The
        affected requests' ``num_computed_tokens`` have been updated.

    Raises:
        TypeError: A value is not an integer.
        ValueError: As :func:`rollback_invalid_blocks`, or a request given twice.
        UnsupportedLayoutError: The manager has more than one KV cache group.
    """
    collect_evictions = bool(evict_blocks)
    strict = _check_mode(mode)
    (batch,), invalid, size = _read_passes(
        kv_cache_manager, [requests], invalid_block_ids, num_scheduled_tokens
    )
    result, to_evict = batch.decide(invalid, size, collect_evictions, strict)
    return batch.apply(result), result.total_affected_tokens, to_evict


def handle_invalid_blocks(
    kv_cache_manager: EvictingBlockTableSource,
    invalid_block_ids: Iterable[SupportsIndex],
    num_scheduled_tokens: Mapping[str, SupportsIndex],
    *,
    running: Iterable[RequestLike],
    waiting_for_remote_kvs: Iterable[RequestLike] = (),
    policy: str = "fail",
    mode: str = "vllm",
) -> InvalidBlocksOutcome:
    """vLLM's ``Scheduler._handle_invalid_blocks``.

    The async pass (``waiting_for_remote_kvs``, whose blocks were never hashed, so no
    eviction is collected) and the sync pass (``running``) each have their own marked
    set, so a block shared between an async and a sync request is recomputed by both.
    Under ``fail`` the sync pass's blocks are evicted and every affected request is
    failed; under ``recompute`` the sync requests are rescheduled and the async ones
    retried, and nothing is evicted in ``vllm`` mode (the blocks keep their hashes until
    they are rewritten, so a prefix hit before that reads stale KV), while ``strict``
    mode evicts the sync pass's blocks too.

    Args:
        kv_cache_manager: Source of the block tables and ``block_size``; receives
            ``evict_blocks`` under ``fail``. ``num_kv_cache_groups`` (default 1) must be 1.
        invalid_block_ids: Block ids whose KV failed to load; unmatched ids are ignored.
        num_scheduled_tokens: Request id to tokens scheduled this step.
        running: The running requests, in scheduling order.
        waiting_for_remote_kvs: The requests whose async KV load is in flight.
        policy: ``"fail"`` (vLLM's default) or ``"recompute"``.
        mode: ``"vllm"`` or ``"strict"``.

    Returns:
        Which requests fail, are rescheduled or retried, what was evicted and how many
        tokens were rolled back. The affected requests' ``num_computed_tokens`` have
        been updated.

    Raises:
        TypeError: A value is not an integer.
        ValueError: Bad policy or mode, as :func:`rollback_invalid_blocks`, or a request
            given twice.
        UnsupportedLayoutError: The manager has more than one KV cache group (checked
            before anything else is looked at, as vLLM fails closed).
    """
    recompute = _check_policy(policy)
    strict = _check_mode(mode)
    (async_pass, sync_pass), invalid, size = _read_passes(
        kv_cache_manager, [waiting_for_remote_kvs, running], invalid_block_ids, num_scheduled_tokens
    )
    # Both passes are decided before anything is written, so an error changes nothing.
    async_result, _ = async_pass.decide(invalid, size, False, strict)
    sync_result, to_evict = sync_pass.decide(invalid, size, True, strict)
    evicted_block_ids: set[int] = set()
    if to_evict and (not recompute or strict):
        # vLLM's recompute keeps the hashes and rewrites the blocks in place; strict
        # mode does not leave them reachable by prefix hits meanwhile. Evicting first
        # means a manager that refuses leaves every request unchanged.
        evicted_block_ids = to_evict
        kv_cache_manager.evict_blocks(evicted_block_ids)
    async_affected = async_pass.apply(async_result)
    sync_affected = sync_pass.apply(sync_result)

    total_affected_tokens = async_result.total_affected_tokens + sync_result.total_affected_tokens
    if recompute:
        return build(
            InvalidBlocksOutcome,
            failed_req_ids=set(),
            rescheduled_req_ids=sync_affected,
            retry_req_ids=async_affected,
            evicted_block_ids=evicted_block_ids,
            total_affected_tokens=total_affected_tokens,
        )
    return build(
        InvalidBlocksOutcome,
        failed_req_ids=async_affected | sync_affected,
        rescheduled_req_ids=set(),
        retry_req_ids=set(),
        evicted_block_ids=evicted_block_ids,
        total_affected_tokens=total_affected_tokens,
    )


def handle_failed_recving(
    failed_req_ids: Iterable[str],
    waiting_for_remote_kvs: Iterable[RequestLike],
    *,
    policy: str = "fail",
) -> InvalidBlocksOutcome:
    """vLLM's ``Scheduler._handle_failed_recving``: whole-request load failures.

    Only requests whose async load is in flight can fail this way; other ids (unknown
    requests, running sync loads) are ignored, as in vLLM.

    Args:
        failed_req_ids: Request ids the connector reported as failed.
        waiting_for_remote_kvs: The requests whose async KV load is in flight.
        policy: ``"fail"`` (report them as failed, change nothing) or ``"recompute"``
            (rewind them to 0 tokens and report them for retry).

    Returns:
        The failed or retried ids; ``total_affected_tokens`` counts the matched
        requests' computed tokens, all of which are lost.

    Raises:
        TypeError: A token count is not an integer.
        ValueError: Bad policy, a negative token count, or a request given twice.
    """
    recompute = _check_policy(policy)
    matched, matched_ids, lost = _read_failed_recving(failed_req_ids, waiting_for_remote_kvs)
    if recompute:
        for request in matched:
            request.num_computed_tokens = 0
    return build(
        InvalidBlocksOutcome,
        failed_req_ids=set() if recompute else matched_ids,
        rescheduled_req_ids=set(),
        retry_req_ids=matched_ids if recompute else set(),
        evicted_block_ids=set(),
        total_affected_tokens=sum(lost),
    )


def _read_failed_recving(
    failed_req_ids: Iterable[str], waiting_for_remote_kvs: Iterable[RequestLike]
) -> tuple[list[RequestLike], set[str], list[int]]:
    """:func:`handle_failed_recving`'s inputs, read once and checked: the waiting requests
    reported as failed, their ids and their ``num_computed_tokens``."""
    reported = [to_request_id(i, "failed_req_ids item") for i in materialise(failed_req_ids)]
    failed = set(reported)
    waiting = list(materialise(waiting_for_remote_kvs))
    ids = [read_request(request, ID).request_id for request in waiting]
    _check_unique(ids)
    # Token counts are read from the matched requests only.
    matched = [request for request, i in zip(waiting, ids, strict=True) if i in failed]
    lost = [num_computed_tokens_of(request) for request in matched]
    for value in lost:
        check_non_negative("num_computed_tokens", value)
    # In the order they were reported, as vLLM's `_handle_failed_recving` adds them.
    waiting_ids = set(ids)
    matched_ids = {i for i in reported if i in waiting_ids}
    return matched, matched_ids, lost


def _read_passes(
    kv_cache_manager: BlockTableSource,
    passes: Sequence[Iterable[RequestLike]],
    invalid_block_ids: Iterable[SupportsIndex],
    num_scheduled_tokens: Mapping[str, SupportsIndex],
) -> tuple[list[_Pass], set[int], int]:
    """Every input of a rollback over ``passes``, each read once, before anything is decided.

    In the order both backends read them: the manager's group count, each pass's
    requests, their uniqueness across all passes, each pass's block tables, the invalid
    block ids, the block size.

    Returns:
        The passes (block tables read), the invalid block ids and the block size.
    """
    _check_single_group(kv_cache_manager)
    batches = [_Pass.gather(requests, num_scheduled_tokens) for requests in passes]
    seen: set[str] = set()
    for batch in batches:
        batch.check_unique(seen)
    for batch in batches:
        batch.read_tables(kv_cache_manager)
    invalid = set(to_int_list(invalid_block_ids))
    size = to_int(kv_cache_manager.block_size)
    return batches, invalid, size


@dataclass(slots=True)
class _Pass:
    """One pass's requests, each read once: ``request_id``, then ``num_computed_tokens``,
    then its entry of ``num_scheduled_tokens`` (0 when it has none); later, by
    :meth:`read_tables`, its block table."""

    requests: list[RequestLike]
    ids: list[str]
    computed: list[int]
    scheduled: list[int]
    tables: list[list[int]] = field(default_factory=list)

    @classmethod
    def gather(
        cls, requests: Iterable[RequestLike], num_scheduled_tokens: Mapping[str, SupportsIndex]
    ) -> _Pass:
        """Reads the requests in order.

        A ``dict`` (or subclass) is read as a dict, as the native backend does: its
        overridden ``get`` is not called. Any other mapping is read through ``get``.
        """
        batch = list(materialise(requests))
        ids: list[str] = []
        computed: list[int] = []
        scheduled: list[int] = []
        for request in batch:
            fields = read_request(request, PROGRESS)
            request_id = fields.request_id
            computed.append(fields.num_computed_tokens)
            if isinstance(num_scheduled_tokens, dict):
                entry = dict.get(num_scheduled_tokens, request_id, 0)
            else:
                entry = num_scheduled_tokens.get(request_id, 0)
            scheduled.append(to_int(entry))
            ids.append(request_id)
        return cls(batch, ids, computed, scheduled)

    def check_unique(self, seen: set[str]) -> None:
        """Refuses a request met twice, in this pass or one already in ``seen``."""
        _check_unique(self.ids, seen)

    def read_tables(self, kv_cache_manager: BlockTableSource) -> None:
        """Reads each request's block table, converted as soon as it is read."""
        tables: list[list[int]] = []
        for request_id in self.ids:
            groups = kv_cache_manager.get_block_ids(request_id)
            if len(groups) != 1:
                raise UnsupportedLayoutError(MULTIPLE_GROUPS_MESSAGE)
            tables.append(to_int_list(groups[0]))
        self.tables = tables

    def decide(
        self, invalid: set[int], size: int, collect_evictions: bool, strict: bool
    ) -> tuple[RollbackResult, set[int]]:
        """:func:`_decide` over this pass's columns."""
        return _decide(
            self.tables, self.computed, self.scheduled, invalid, size, collect_evictions, strict
        )

    def apply(self, result: RollbackResult) -> set[str]:
        """Writes the affected requests' new token counts; returns their ids."""
        for i in result.affected:
            self.requests[i].num_computed_tokens = result.num_computed_tokens[i]
        return {self.ids[i] for i in result.affected}


def _validate_columns(
    tables: list[list[int]],
    computed: list[int],
    scheduled: list[int],
    invalid: set[int],
    block_size: int,
) -> None:
    """Every check that needs no block table contents, in the order both backends use."""
    check_positive("block_size", block_size)
    if not len(tables) == len(computed) == len(scheduled):
        raise ValueError(
            "block_tables, num_computed_tokens and num_scheduled_tokens must have the same "
            f"length, got {len(tables)}, {len(computed)} and {len(scheduled)}"
        )
    if invalid and min(invalid) < 0:
        raise ValueError(f"invalid_block_ids must be non-negative, got {min(invalid)}")
    for i, (block_ids, c, s) in enumerate(zip(tables, computed, scheduled, strict=True)):
        check_non_negative(f"num_computed_tokens[{i}]", c)
        check_non_negative(f"num_scheduled_tokens[{i}]", s)
        if s > c:
            raise ValueError(
                f"num_scheduled_tokens[{i}] = {s} exceeds num_computed_tokens[{i}] = {c}"
            )
        # vLLM zips the scan range with the table, silently stopping at its end; a
        # table that short cannot hold the tokens it claims, so it is refused.
        needed = cdiv(c - s, block_size)
        if len(block_ids) < needed:
            raise ValueError(
                f"block_tables[{i}] has {len(block_ids)} blocks, fewer than the {needed} "
                f"holding its {c - s} tokens computed before this step"
            )


def _check_block_ids(i: int, block_ids: list[int]) -> None:
    """Refuses a negative id anywhere in request ``i``'s table (checked in request order)."""
    if block_ids and min(block_ids) < 0:
        j, block_id = next((j, b) for j, b in enumerate(block_ids) if b < 0)
        raise ValueError(f"block_tables[{i}][{j}] must be non-negative, got {block_id}")


def _check_unique(ids: list[str], seen: set[str] | None = None) -> None:
    """A request may appear once: vLLM's scheduler never lists one twice."""
    seen = set() if seen is None else seen
    for request_id in ids:
        if request_id in seen:
            raise ValueError(f"request {request_id!r} appears more than once")
        seen.add(request_id)


def _check_single_group(kv_cache_manager: object) -> None:
    """Block ids are unique only within a KV cache group: fail closed on several."""
    if to_int(getattr(kv_cache_manager, "num_kv_cache_groups", 1)) > 1:
        raise UnsupportedLayoutError(MULTIPLE_GROUPS_MESSAGE)


def _name(value: object) -> str | None:
    """A ``str`` option's contents (a subclass's ``__eq__`` never runs, as natively)."""
    return str.__str__(value) if isinstance(value, str) else None


def _check_mode(mode: str) -> bool:
    """Validates ``mode``; returns whether it is strict."""
    name = _name(mode)
    if name not in ROLLBACK_MODES:
        raise ValueError(f"mode must be {either(ROLLBACK_MODES)}, got {mode!r}")
    return name == "strict"


def _check_policy(policy: str) -> bool:
    """Validates ``policy``; returns whether it is ``recompute``."""
    name = _name(policy)
    if name not in LOAD_FAILURE_POLICIES:
        raise ValueError(f"policy must be {either(LOAD_FAILURE_POLICIES)}, got {policy!r}")
    return name == "recompute"
