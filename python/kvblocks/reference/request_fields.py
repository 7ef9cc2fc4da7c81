"""The one reader of a request's own fields, for the manager and the rollback.

A call that takes a request reads it here: ``request_id`` first, then the fields of the
call's :class:`FieldSet`, in one order (``num_tokens``, ``num_computed_tokens``,
``block_hashes``), each converted as it is read, so the first bad field decides the
error. Every error names the field: the id's message starts with ``request_id``, any
other field's ``TypeError`` or ``OverflowError`` with ``request.{field}: ``. The extras
have their own reader (:func:`kvblocks.reference.hashing.read_extras`), and so does the
hasher, which reads no id.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvblocks.reference.kv_cache_utils import check_block_hash, to_block_hashes
from kvblocks.values import to_block_hash, to_int, to_request_id

__all__ = [
    "ID",
    "MANAGER",
    "PROGRESS",
    "FieldSet",
    "RequestFields",
    "num_computed_tokens_of",
    "read_request",
    "token_slice",
]

_T = TypeVar("_T")


@dataclasses.dataclass(slots=True, frozen=True)
class FieldSet:
    """The fields a call reads besides ``request_id``, which every call reads first."""

    num_tokens: bool = False
    num_computed_tokens: bool = False
    block_hashes: bool = False


#: ``request_id`` alone.
ID = FieldSet()
#: The rollback's: the request's progress.
PROGRESS = FieldSet(num_computed_tokens=True)
#: The manager's: every field.
MANAGER = FieldSet(num_tokens=True, num_computed_tokens=True, block_hashes=True)


@dataclasses.dataclass(slots=True, frozen=True)
class RequestFields:
    """A request's fields as one call read them; those outside its set are 0 and empty.

    ``block_hashes`` is read as a sequence (``len()`` once, then items by index, only
    those the call needs), as the native backend reads it.
    """

    request: Any
    request_id: str
    num_tokens: int = 0
    num_computed_tokens: int = 0
    block_hashes: Sequence[object] = ()
    num_block_hashes: int = 0

    def hashes(self, start: int, stop: int) -> list[bytes]:
        """Hashes ``start .. stop - 1`` (clipped to the length read), checked as a batch."""
        stop = min(stop, self.num_block_hashes)
        return to_block_hashes([self.block_hashes[i] for i in range(start, stop)])

    def hash(self, i: int) -> bytes:
        """Hash ``i``, checked."""
        block_hash = to_block_hash(self.block_hashes[i])
        check_block_hash(block_hash)
        return block_hash


def read_request(request: Any, fields: FieldSet) -> RequestFields:
    """Reads ``request``'s fields of ``fields``, in the one order.

    Raises:
        TypeError: ``request_id must be a str, got {type}``, or ``request.{field}:
            ...``: a count that is not an int, ``block_hashes`` that is not a sequence.
        OverflowError: ``request.{field}: ...``: a count beyond 64 bits.
    """
    request_id = to_request_id(request.request_id)
    num_tokens = _field(request, "num_tokens", to_int) if fields.num_tokens else 0
    num_computed_tokens = (
        _field(request, "num_computed_tokens", to_int) if fields.num_computed_tokens else 0
    )
    if not fields.block_hashes:
        return RequestFields(request, request_id, num_tokens, num_computed_tokens)
    block_hashes = _field(request, "block_hashes", _to_sequence)
    return RequestFields(
        request, request_id, num_tokens, num_computed_tokens, block_hashes, len(block_hashes)
    )


def num_computed_tokens_of(request: Any) -> int:
    """``request.num_computed_tokens`` read alone (``handle_failed_recving`` reads it of
    the matched requests only, after every id)."""
    return _field(request, "num_computed_tokens", to_int)


def token_slice(request: Any, start: int, stop: int) -> list[int]:
    """The token ids ``request.all_token_ids[start:stop]`` (fewer when it holds fewer), as
    plain ints (the events' ``BlockStored.token_ids``)."""
    return [to_int(t) for t in request.all_token_ids[start:stop]]


def _field(request: Any, name: str, convert: Callable[[Any], _T]) -> _T:
    """``convert(getattr(request, name))``, its error naming the field."""
    value = getattr(request, name)
    try:
        return convert(value)
    except (TypeError, OverflowError) as err:
        raise type(err)(f"request.{name}: {err}") from None


def _to_sequence(value: object) -> Sequence[object]:
    """``value`` itself when it is a sequence (read by index)."""
    if not isinstance(value, Sequence):
        raise TypeError(f"must be a sequence, got {type(value).__name__}")
    return value
