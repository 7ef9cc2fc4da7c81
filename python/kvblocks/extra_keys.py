"""vLLM 0.33.0's block-hash extra keys: what separates blocks whose tokens agree.

A block's extra keys (``None`` or a tuple) enter its hash next to its parent hash and
token ids, and ``BlockStored`` events publish them untagged. This module derives them,
in vLLM's order, from a request's extras read once as plain data
(:class:`RequestExtras`):

* ``("lora", lora_name, lora_path)`` on every block of a LoRA request;
* ``("mm", identifier, offset)`` for every multimodal item overlapping the block, the
  offset relative to the block's first token (negative when the item began earlier);
* ``("cache_salt", salt)`` on the block starting at token 0, when the salt is truthy.

A backend reads the extras in one order (the adapter, the items' positions, the
identifiers of the items :func:`mm_items_needed` names, the salt); every rule that
decides which key a block gets is here, as in the native core's ``extra_keys``. The
reference hasher and its events use it; it imports nothing of either backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

__all__ = [
    "MAX_EXTRA_KEYS_DEPTH",
    "ExtraKeys",
    "Lora",
    "MmItem",
    "MmOverlap",
    "MmPosition",
    "MmWalk",
    "RequestExtras",
    "block_extra_keys",
    "check_extra_keys",
    "event_extra_keys",
    "mm_items_needed",
    "mm_overlaps",
]

#: An extra-key value: ``None``, an int, a str, bytes, or a tuple of extra-key values.
ExtraKeys: TypeAlias = "str | int | bytes | tuple[ExtraKeys, ...] | None"

#: The deepest tuple nesting extra keys may have (a flat tuple is depth 1). vLLM's keys
#: are two deep; the bound keeps every backend's recursion far from any stack limit.
MAX_EXTRA_KEYS_DEPTH = 64

#: How multimodal items are matched to blocks: ``"hashing"`` is vLLM's walk (from
#: block 0 it resumes where the last block stopped; starting past block 0 only the last
#: item can still overlap), ``"events"`` starts every block at item 0.
MmWalk: TypeAlias = Literal["hashing", "events"]


def check_extra_keys(extra_keys: object) -> None:
    """Checks that a value is a valid extra key, depth first.

    The first offending node in depth-first order decides the error, in both backends.

    Args:
        extra_keys: ``None``, an ``int``, ``str`` or ``bytes``, or a tuple of such values
            (exact types: ``bool``, subclasses, lists, floats... are refused).

    Raises:
        TypeError: For a value of any other type.
        ValueError: For tuples nested more than ``MAX_EXTRA_KEYS_DEPTH`` deep.
        UnicodeEncodeError: For a string with a lone surrogate, which CBOR cannot
            encode and the native backend cannot hold.
    """
    check_extra_key(extra_keys, 0)


def check_extra_key(value: object, enclosing_tuples: int) -> None:
    """:func:`check_extra_keys` for a value nested inside ``enclosing_tuples`` tuples."""
    # Exact types only: a subclass (bool, an enum, a namedtuple) pickles differently.
    if value is None or type(value) is int or type(value) is bytes:
        return
    if type(value) is str:
        # Raises UnicodeEncodeError for lone surrogates (the message PyO3 also gives).
        value.encode("utf-8")
        return
    if type(value) is tuple:
        if enclosing_tuples + 1 > MAX_EXTRA_KEYS_DEPTH:
            raise ValueError(f"extra keys are nested more than {MAX_EXTRA_KEYS_DEPTH} tuples deep")
        for item in value:
            check_extra_key(item, enclosing_tuples + 1)
        return
    raise TypeError(
        f"unsupported extra key type {type(value).__name__!r}; "
        "extra keys are nested tuples of str, int, bytes and None"
    )


@dataclass(frozen=True, slots=True)
class MmPosition:
    """Where a multimodal item's placeholder tokens are."""

    offset: int
    length: int


@dataclass(slots=True)
class MmItem:
    """A multimodal item: its position, and its identifier once read (only the items
    that overlap the blocks at hand are)."""

    position: MmPosition
    identifier: Any = None
    has_identifier: bool = False


@dataclass(frozen=True, slots=True)
class Lora:
    """A request's LoRA adapter, as its keys use it."""

    name: Any
    path: Any


@dataclass(slots=True)
class RequestExtras:
    """Everything a request adds to its blocks' extra keys, read once.

    Attributes:
        lora: The adapter, when ``lora_request`` is truthy.
        mm_items: ``mm_features``, sorted by offset.
        cache_salt: The salt, when truthy (else ``None``).
    """

    lora: Lora | None = None
    mm_items: list[MmItem] = field(default_factory=list)
    cache_salt: Any = None


def _mm_in_block(
    positions: list[MmPosition], start: int, end: int, cursor: int
) -> tuple[list[tuple[int, int]], int]:
    """vLLM 0.33.0's ``_gen_mm_extra_hash_keys`` walk: the items (by index) overlapping
    the block ``[start, end)`` with their offsets from ``start``, and where the next
    block's walk resumes. ``cursor`` ``-1`` means the last item."""
    hits: list[tuple[int, int]] = []
    if not positions:
        return hits, cursor
    last = positions[-1]
    if last.offset + last.length <= start:
        # Past every item: vLLM returns the cursor unchanged.
        return hits, cursor
    index = len(positions) - 1 if cursor < 0 else cursor
    while index < len(positions):
        position = positions[index]
        if end <= position.offset:
            # The block has not reached this item.
            break
        if start >= position.offset + position.length:
            # The block is past this item.
            index += 1
            continue
        hits.append((index, position.offset - start))
        if end >= position.offset + position.length:
            # The item ends in this block; the next one may start in it too.
            index += 1
        else:
            break
    return hits, index


@dataclass(frozen=True, slots=True)
class MmOverlap:
    """An item overlapping a block: the block (counted from the first of the walk), the
    item's index, and the item's offset from the block's first token."""

    block: int
    item: int
    offset: int


def mm_overlaps(
    positions: list[MmPosition], start: int, num_blocks: int, block_size: int, walk: MmWalk
) -> list[MmOverlap]:
    """The items that overlap each of ``num_blocks`` blocks of ``block_size`` tokens from
    token ``start``, block by block."""
    if not positions:
        return []
    items_end = positions[-1].offset + positions[-1].length
    cursor = -1 if walk == "hashing" and start != 0 else 0
    overlaps = []
    for block in range(num_blocks):
        block_start = start + block * block_size
        if block_start >= items_end:
            # Past every item: no later block overlaps one either.
            break
        if walk == "events":
            cursor = 0
        hits, cursor = _mm_in_block(positions, block_start, block_start + block_size, cursor)
        overlaps += [MmOverlap(block, item, offset) for item, offset in hits]
    return overlaps


def mm_items_needed(overlaps: list[MmOverlap]) -> list[int]:
    """The items whose identifiers ``overlaps`` uses, in item order, each once."""
    return sorted({overlap.item for overlap in overlaps})


def _identifier(extras: RequestExtras, item: int) -> Any:
    mm_item = extras.mm_items[item]
    if not mm_item.has_identifier:
        raise AssertionError(f"multimodal item {item}'s identifier was not read")
    return mm_item.identifier


def _has_keys(extras: RequestExtras, start: int) -> bool:
    """Whether blocks from token ``start`` can have any key: the request has an adapter
    or items, or the blocks start at token 0 and it has a salt."""
    return extras.lora is not None or bool(extras.mm_items) or _salt_at(extras, start) is not None


def _salt_at(extras: RequestExtras, block_start: int) -> Any:
    """The salt of the block starting at token ``block_start``: the request's, on block 0
    only (``None`` elsewhere)."""
    return extras.cache_salt if block_start == 0 else None


def _keys_per_block(
    extras: RequestExtras,
    start: int,
    num_blocks: int,
    block_size: int,
    walk: MmWalk,
    *,
    make: tuple[Callable[[Lora], Any], Callable[[Any, int], Any], Callable[[Any], Any]],
) -> list[list[Any]]:
    """Each block's keys, in vLLM's order (the adapter's, each overlapping item's, the
    salt's), each made by the function of its kind in ``make`` (adapter, item, salt)."""
    lora, mm, salt = make
    positions = [item.position for item in extras.mm_items]
    hits_of: dict[int, list[MmOverlap]] = {}
    for overlap in mm_overlaps(positions, start, num_blocks, block_size, walk):
        hits_of.setdefault(overlap.block, []).append(overlap)
    keys = []
    for block in range(num_blocks):
        block_keys = [] if extras.lora is None else [lora(extras.lora)]
        block_keys += [mm(_identifier(extras, o.item), o.offset) for o in hits_of.get(block, [])]
        block_salt = _salt_at(extras, start + block * block_size)
        if block_salt is not None:
            block_keys.append(salt(block_salt))
        keys.append(block_keys)
    return keys


def block_extra_keys(
    extras: RequestExtras, start: int, num_blocks: int, block_size: int
) -> list[tuple[ExtraKeys, ...] | None] | None:
    """The extra keys of ``num_blocks`` blocks of ``block_size`` tokens from token
    ``start``, tagged as vLLM tags them, one entry per block (``None`` for a block
    without keys); ``None`` when no block has any. The extras' values were checked
    when they were read, so every key is a valid one.
    """
    if num_blocks == 0 or not _has_keys(extras, start):
        return None
    make = (
        lambda lora: ("lora", lora.name, lora.path),
        lambda identifier, offset: ("mm", identifier, offset),
        lambda salt: ("cache_salt", salt),
    )
    keys = _keys_per_block(extras, start, num_blocks, block_size, "hashing", make=make)
    return [tuple(block_keys) if block_keys else None for block_keys in keys]


def event_extra_keys(
    extras: RequestExtras, first_block: int, num_blocks: int, block_size: int
) -> list[tuple[Any, ...] | None] | None:
    """The extra keys of blocks ``first_block ..`` as a ``BlockStored`` publishes them,
    untagged: per block the adapter's name, ``(identifier, offset)`` per item, the salt.
    ``None`` when the request has no adapter, no items and no salt on these blocks."""
    start = first_block * block_size
    if not _has_keys(extras, start):
        return None
    make = (lambda lora: lora.name, lambda identifier, offset: (identifier, offset), lambda s: s)
    keys = _keys_per_block(extras, start, num_blocks, block_size, "events", make=make)
    return [tuple(block_keys) if block_keys else None for block_keys in keys]
