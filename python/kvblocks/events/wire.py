"""KV cache events in vLLM 0.33.0's wire format: the structs and their encoding.

The structs are ``msgspec`` structs declared exactly as in vLLM's
``vllm/distributed/kv_events.py`` (same names, field order, defaults, tags and options),
so ``msgspec.msgpack.encode`` produces the bytes vLLM publishes and consumers written
for vLLM decode them unchanged:

* events are tagged maps (``{"type": "BlockStored", ...}``) whose fields still at their
  default are omitted;
* an :class:`EventBatch` is an array, ``[ts, events, data_parallel_rank]``.

What a manager records (vLLM 0.33.0, one full-attention group ``0``):

* :class:`BlockStored` once per call that caches full blocks: their hashes, the parent
  hash (the request's hash just before them, else ``None``), the request's token ids
  for those blocks, ``block_size``, the LoRA id and name, ``medium="GPU"``, one
  ``extra_keys`` entry per block (untagged: :func:`kvblocks.extra_keys.event_extra_keys`),
  ``group_idx=0`` and ``kv_cache_spec_kind="full_attention"``;
* :class:`BlockRemoved` with one hash per removed prefix-cache entry: a cached block
  reallocated (lazy eviction) or passed to ``evict_blocks``;
* :class:`AllBlocksCleared` after a successful ``reset_prefix_cache()``.

Beyond vLLM, off by default so that the stream stays byte-identical to vLLM's:

* ``KVCacheManager(..., kv_events_last_copy_removal=True)`` emits ``BlockRemoved`` for
  a hash only when the last block caching it goes (vLLM emits one per block, also while
  a duplicate block still serves the hash), so a consumer can keep a plain set;
* :class:`SequencedKVEventBatch` carries the batch's sequence number inside the
  payload (``ZmqEventPublisher(..., sequence_in_batch=True)`` publishes it); vLLM
  decoders ignore the extra field.

Block hashes are ints (the low 8 bytes of the hash, big-endian) unless the environment
variable ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is ``0``, in which case they are the
hash bytes, as in vLLM. kvblocks reads the variable once, when the manager is created.

Both backends build their events with this module (the native one through
``kvblocks.events``), which needs ``msgspec`` and imports neither backend.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

__all__ = [
    "FULL_ATTENTION",
    "INT_BLOCK_HASHES_ENV",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEventBatch",
    "SequencedKVEventBatch",
    "external_block_hash",
    "use_int_block_hashes",
]

#: A block hash as events carry it: the low 8 bytes as an int, or the bytes.
ExternalBlockHash = bytes | int

#: The storage medium of every event kvblocks records.
MEDIUM_GPU = "GPU"

#: The environment variable choosing int (``1``, the default) or bytes (``0``) hashes.
INT_BLOCK_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"

#: ``kv_cache_spec_kind`` of the one group a kvblocks manager has.
FULL_ATTENTION = "full_attention"

_LOW_64_BITS = (1 << 64) - 1


# ---------------------------------------------------------------------- the wire structs
# Declared field by field as vLLM 0.33.0 declares them: msgpack writes a struct's
# fields in declaration order, so the order is part of the wire format.


class EventBatch(
    msgspec.Struct,
    array_like=True,
    omit_defaults=True,
    gc=False,
):
    """A batch of events, encoded as the array ``[ts, events, data_parallel_rank]``.

    ``array_like`` structs keep every field, so ``data_parallel_rank`` is written even
    when it is ``None`` (``omit_defaults`` only drops map entries).
    """

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(
    msgspec.Struct,
    omit_defaults=True,
    gc=False,
    tag=True,
):
    """Base class of the KV cache events: tagged maps, defaults omitted."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache (one event per caching call)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    #: Deprecated in vLLM in favour of ``lora_name``; kept for compatibility.
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    #: One entry per block of ``block_hashes``: its extra keys, untagged, or ``None``.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    #: vLLM 0.33.0 fields kvblocks never sets. ``locality`` and ``ownership`` are typed
    #: loosely so that any vLLM payload carrying them decodes.
    locality: Any = None
    ownership: Any = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None

    def __hash__(self) -> int:
        return hash(
            (
                tuple(self.block_hashes),
                self.parent_block_hash,
                tuple(self.token_ids),
                self.block_size,
                self.lora_id,
                self.medium,
                tuple(self.extra_keys) if self.extra_keys else None,
                self.group_idx,
                self.kv_cache_spec_kind,
                self.kv_cache_spec_sliding_window,
            )
        )


class BlockRemoved(KVCacheEvent):
    """Prefix-cache entries went away (kvblocks, like vLLM, puts one hash in each)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None

    def __hash__(self) -> int:
        return hash((tuple(self.block_hashes), self.medium, self.group_idx))


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was dropped (``reset_prefix_cache()``)."""


class KVEventBatch(EventBatch):
    """The batch vLLM publishes: ``[ts, [events...], data_parallel_rank]``."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class SequencedKVEventBatch(KVEventBatch):
    """A :class:`KVEventBatch` with its sequence number appended (kvblocks only).

    Encoded as ``[ts, events, data_parallel_rank, seq]``. A decoder expecting vLLM's
    :class:`KVEventBatch` ignores the trailing element, and decoding a plain
    three-element batch as this type gives ``seq=None``.
    """

    seq: int | None = None


# ---------------------------------------------------------------------- conversions


def use_int_block_hashes() -> bool:
    """Whether events carry int block hashes, read from ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``.

    As in vLLM, the variable is parsed as an int and its truth taken; unset means ``1``.

    Raises:
        ValueError: the variable is set to something that is not an int.
    """
    raw = os.environ.get(INT_BLOCK_HASHES_ENV, "1")
    try:
        return bool(int(raw))
    except ValueError:
        raise ValueError(f"{INT_BLOCK_HASHES_ENV} must be an integer, got {raw!r}") from None


def external_block_hash(block_hash: bytes, as_int: bool) -> ExternalBlockHash:
    """A block hash as events carry it (vLLM's ``maybe_convert_block_hash``).

    Args:
        block_hash: The hash bytes.
        as_int: Whether to convert: the low 8 bytes read as a big-endian unsigned int.
    """
    if not as_int:
        return block_hash
    return int.from_bytes(block_hash, "big") & _LOW_64_BITS
