"""The value classes both backends return, and the converters that read their fields.

``KVCacheBlock``, ``PrefixCacheStats``, ``RollbackResult`` and ``InvalidBlocksOutcome``
are defined here once: ``kvblocks.reference`` and ``kvblocks._native`` export these very
classes. A caller who builds one gets its fields converted by ``__post_init__``; a backend
builds what it returns with :func:`build`, from results that already hold the fields' types.

The converters read a caller's ints, ids and hashes as the native backend reads its
arguments (the same classes and messages); the reference's entry points use them too.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, SupportsIndex, TypeVar

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "InvalidBlocksOutcome",
    "KVCacheBlock",
    "PrefixCacheStats",
    "RollbackResult",
    "build",
    "exact_str",
    "materialise",
    "to_block_hash",
    "to_field_set",
    "to_flag",
    "to_int",
    "to_int_list",
    "to_request_id",
    "to_uint",
    "to_unsigned_list",
]

#: Ints cross the boundary as signed 64-bit values, as the native backend reads them.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

#: CPython's message for an int beyond 64 bits, as PyO3 reads one: through C's ``long``
#: where that is 64 bits wide, and through ``long long`` where it is not (Windows).
INT64_OVERFLOW = (
    "Python int too large to convert to C long"
    if struct.calcsize("l") == 8
    else "int too big to convert"
)

#: A full slice, for copying a ``bytes`` subclass's contents (see :func:`to_block_hash`).
_ALL = slice(None)


def materialise(values: Iterable[Any]) -> list[Any] | tuple[Any, ...]:
    """The items of ``values`` as they are now, in a list or tuple no caller can change.

    An exact tuple is itself; an exact list is copied (a snapshot: an item's
    ``__index__`` that changes the list later changes nothing read); any other iterable
    is iterated into a new list. Neither ``__len__`` nor ``__length_hint__`` is asked
    (``list()`` would preallocate from them): the length is what iteration yields, and no
    memory is reserved from a size a caller claims. The native backend reads the same way.
    """
    if type(values) is tuple:
        return values
    if type(values) is list:
        return values.copy()
    # A comprehension appends item by item; `list(values)` would trust the hint.
    return [value for value in values]


def to_int(value: SupportsIndex) -> int:
    """``operator.index(value)``, refused outside the signed 64-bit range.

    Raises:
        TypeError: ``value`` is not an integer (``operator.index``'s message).
        OverflowError: ``value`` does not fit in 64 bits (CPython's message, as natively).
    """
    number = operator.index(value)
    if not INT64_MIN <= number <= INT64_MAX:
        raise OverflowError(INT64_OVERFLOW)
    return number


def to_int_list(values: Iterable[SupportsIndex]) -> list[int]:
    """Materialises ``values`` as a list of ints, converting each with :func:`to_int`.

    A one-dimensional NumPy integer array converts in C (``tolist``); anything else is
    materialised by :func:`materialise` (a snapshot whose length is what exists, never a
    claimed size) and converted item by item.

    Raises:
        TypeError: ``values`` is not iterable, or an item is not an integer (the message is
            ``operator.index``'s, e.g. ``'float' object cannot be interpreted as an integer``).
        OverflowError: An item does not fit in 64 bits.
    """
    items: list[Any] | tuple[Any, ...] | None = None
    if not isinstance(values, list):
        array: Any = values
        kind = getattr(getattr(array, "dtype", None), "kind", None)
        if kind in ("i", "u") and getattr(array, "ndim", None) == 1:
            items = array.tolist()
    # An exact int in range is its own value: only other items pay for the call.
    return [
        v if type(v) is int and INT64_MIN <= v <= INT64_MAX else to_int(v)
        for v in (materialise(values) if items is None else items)
    ]


# The value classes' fields: lists and sets of 64-bit ints, sets of exact str, unsigned
# counters of a fixed width, exact bools.


def to_uint(value: SupportsIndex, bits: int = 64) -> int:
    """An unsigned counter of ``bits`` bits.

    Raises:
        TypeError: ``value`` is not an integer.
        OverflowError: ``value`` is negative or does not fit.
    """
    number = operator.index(value)
    if bits < 64 and not 0 <= number < 1 << bits:
        # One message for any value outside a narrower field, however large (Rust's for a
        # failed integer conversion).
        raise OverflowError("out of range integral type conversion attempted")
    if number < 0:
        raise OverflowError("can't convert negative int to unsigned")
    if number >= 1 << bits:
        raise OverflowError("int too big to convert")
    return number


def to_unsigned_list(values: Iterable[SupportsIndex]) -> list[int]:
    """:func:`to_int_list`, refusing negative items.

    Raises:
        TypeError: as :func:`to_int_list`.
        OverflowError: an item is negative or does not fit.
    """
    ints = to_int_list(values)
    if ints and min(ints) < 0:
        raise OverflowError("can't convert negative int to unsigned")
    return ints


def to_field_set(value: object, item: Callable[[Any], Any]) -> set[Any]:
    """A set field: a ``set`` or ``frozenset``, each item converted by ``item``.

    Raises:
        TypeError: ``value`` is not a set, or an item has the wrong type.
    """
    if not isinstance(value, set | frozenset):
        raise TypeError(f"'{type(value).__name__}' object is not an instance of 'set'")
    return {item(v) for v in materialise(value)}


def to_flag(value: object) -> bool:
    """A ``bool`` field: a ``bool``, or NumPy's.

    Raises:
        TypeError: ``value`` is neither.
    """
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in {"bool", "bool_"}:
        return bool(value)
    raise TypeError(f"'{kind.__name__}' object is not an instance of 'bool'")


def to_request_id(value: object, name: str = "request_id") -> str:
    """A request id as an exact ``str``: a subclass is read as its contents, as natively.

    Raises:
        TypeError: ``{name} must be a str, got {type name}``.
        UnicodeEncodeError: The id holds a lone surrogate, which UTF-8 cannot encode.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return exact_str(value)


def exact_str(value: str) -> str:
    """``value``'s contents as an exact ``str``, which must encode as UTF-8, as natively.

    Raises:
        UnicodeEncodeError: ``value`` holds a lone surrogate.
    """
    # `str.__str__` copies a subclass's contents, bypassing its dunders.
    text = str.__str__(value)
    if not text.isascii():
        text.encode("utf-8")
    return text


def to_block_hash(value: object) -> bytes:
    """Checks that ``value`` is a ``bytes`` block hash and returns it as exact ``bytes``.

    A subclass is read as its contents, so its ``__hash__`` and ``__eq__`` never run.

    Raises:
        TypeError: ``block hash must be bytes, got {type name}``.
    """
    if type(value) is bytes:
        return value
    if not isinstance(value, bytes):
        raise TypeError(f"block hash must be bytes, got {type(value).__name__}")
    return bytes.__getitem__(value, _ALL)


# --------------------------------------------------------------------------- values

ValueT = TypeVar("ValueT")


def build(cls: type[ValueT], **fields: object) -> ValueT:
    """An instance of the value class ``cls`` with ``fields`` set as they are.

    What a backend returns is built from its own results, which already hold the fields'
    types, so ``__post_init__``'s conversion of a caller's arguments is skipped. A set then
    keeps the order it was built in: vLLM frees and reports requests in the order it
    inserts them, and building a set again can change the order it iterates in. The native
    backend builds its values the same way (``values.rs``).

    Raises:
        TypeError: ``fields`` does not name each of ``cls``'s fields.
    """
    names: tuple[str, ...] = getattr(cls, "__match_args__", ())
    if sorted(fields) != sorted(names):
        raise TypeError(f"{cls.__name__} has the fields {names}, got {tuple(fields)}")
    value = object.__new__(cls)
    for name, field in fields.items():
        object.__setattr__(value, name, field)
    return value


@dataclass(frozen=True, slots=True)
class KVCacheBlock:
    """A read-only snapshot of one block, as returned by ``BlockPool.get_block``.

    Attributes:
        block_id: The block's id, ``0 .. num_blocks - 1``.
        ref_cnt: How many holders (block tables, touches) the block has. Always 0 for
            the null block, whose count is not tracked.
        block_hash: The prefix-cache hash of the block's tokens, or ``None`` when the
            block is not cached.
        group_id: The KV cache group the hash was cached for; ``None`` exactly when
            ``block_hash`` is ``None``.
        is_null: True only for block 0, the null block.
    """

    block_id: int
    ref_cnt: int
    block_hash: bytes | None
    group_id: int | None
    is_null: bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_id", to_uint(self.block_id, 32))
        object.__setattr__(self, "ref_cnt", to_uint(self.ref_cnt, 32))
        if self.block_hash is not None:
            object.__setattr__(self, "block_hash", to_block_hash(self.block_hash))
        if self.group_id is not None:
            object.__setattr__(self, "group_id", to_uint(self.group_id, 32))
        object.__setattr__(self, "is_null", to_flag(self.is_null))


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Prefix-cache counters since the last ``KVCacheManager.make_prefix_cache_stats()``.

    Attributes:
        requests: Requests recorded (one per admission that looked the cache up).
        queries: Tokens looked up: the sum of the recorded requests' ``num_tokens``.
        hits: Tokens found in the prefix cache.
        reset: Whether ``KVCacheManager.reset_prefix_cache()`` emptied the cache meanwhile
            (vLLM's flag of that name).

    Counters only ever grow: ``KVCacheManager.record_prefix_cache_stats`` refuses negative
    or impossible values, and nothing decrements them.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    reset: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", to_uint(self.requests))
        object.__setattr__(self, "queries", to_uint(self.queries))
        object.__setattr__(self, "hits", to_uint(self.hits))
        object.__setattr__(self, "reset", to_flag(self.reset))


@dataclass(frozen=True, slots=True)
class RollbackResult:
    """What ``rollback_invalid_blocks`` decided; nothing has been changed yet.

    Attributes:
        num_computed_tokens: The new value for every request of the batch, in order
            (unchanged for requests that were not affected).
        affected: Indices of the affected requests, in iteration order.
        total_affected_tokens: Tokens rolled back over the batch, as vLLM counts them
            for its log line. Never negative.
        blocks_to_evict: Sorted block ids to remove from the prefix cache; empty unless
            evictions were collected.
    """

    num_computed_tokens: list[int]
    affected: list[int]
    total_affected_tokens: int
    blocks_to_evict: list[int]
    # Unhashable: its fields are lists.
    __hash__ = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_computed_tokens", to_int_list(self.num_computed_tokens))
        object.__setattr__(self, "affected", to_unsigned_list(self.affected))
        object.__setattr__(self, "total_affected_tokens", to_uint(self.total_affected_tokens, 128))
        object.__setattr__(self, "blocks_to_evict", to_int_list(self.blocks_to_evict))


@dataclass(frozen=True, slots=True)
class InvalidBlocksOutcome:
    """What a load-failure handler did and what the scheduler must do next.

    Attributes:
        failed_req_ids: Requests to finish with ``FINISHED_ERROR`` (``fail`` policy).
        rescheduled_req_ids: Running requests rolled back that the next step recomputes;
            their output of this step must be discarded (``recompute`` policy).
        retry_req_ids: Requests still waiting for remote KVs whose load must be retried
            from their new ``num_computed_tokens`` once it finishes (``recompute``
            policy; vLLM's ``failed_recving_kv_req_ids``).
        evicted_block_ids: Blocks passed to ``kv_cache_manager.evict_blocks``.
        total_affected_tokens: Tokens rolled back (or lost with the failed requests).
    """

    failed_req_ids: set[str]
    rescheduled_req_ids: set[str]
    retry_req_ids: set[str]
    evicted_block_ids: set[int]
    total_affected_tokens: int
    # Unhashable: its fields are sets.
    __hash__ = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        for name in ("failed_req_ids", "rescheduled_req_ids", "retry_req_ids"):
            object.__setattr__(self, name, to_field_set(getattr(self, name), to_request_id))
        object.__setattr__(self, "evicted_block_ids", to_field_set(self.evicted_block_ids, to_int))
        object.__setattr__(self, "total_affected_tokens", to_uint(self.total_affected_tokens, 128))
