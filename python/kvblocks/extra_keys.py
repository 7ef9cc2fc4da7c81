"""vLLM 0.33.0's block-hash extra keys: what separates blocks whose tokens agree.

A block's extra keys (``None`` or a tuple) enter its hash next to its parent hash and
token ids, and ``BlockStored`` events publish them untagged
(:func:`kvblocks.events.to_event_extra_keys`). This module computes them from a request,
in vLLM's order:

* ``("lora", lora_name, lora_path)`` on every block of a LoRA request;
* ``("mm", identifier, offset)`` for every multimodal item overlapping the block, the
  offset relative to the block's first token (negative when the item began earlier);
* ``("cache_salt", salt)`` on the block starting at token 0, when the salt is truthy.

The reference hasher (:mod:`kvblocks.reference.hashing`) and the events of both
backends use it; the native hasher computes the same keys in Rust. It imports nothing
of either backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

__all__ = ["ExtraKeys", "generate_block_hash_extra_keys"]

#: An extra-key value: ``None``, an int, a str, bytes, or a tuple of extra-key values.
ExtraKeys: TypeAlias = "str | int | bytes | tuple[ExtraKeys, ...] | None"


def _gen_lora_extra_hash_keys(request: object) -> list[ExtraKeys]:
    """vLLM 0.33.0: ``("lora", name, path)`` on every block of a LoRA request."""
    lora_request: Any = getattr(request, "lora_request", None)
    if not lora_request:
        return []
    return [("lora", lora_request.lora_name, lora_request.lora_path)]


def _gen_mm_extra_hash_keys(
    request: object, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[list[ExtraKeys], int]:
    """vLLM 0.33.0's walk over the multimodal items overlapping a block.

    Each overlapping item adds ``("mm", identifier, offset - start_token_idx)``; the
    offset is negative when the item began in an earlier block.

    Args:
        request: The request (reads ``mm_features``, sorted by offset).
        start_token_idx: First token of the block.
        end_token_idx: One past the last token of the block.
        start_mm_idx: The item to start from; ``-1`` means the last one (used once
            hashing starts past block 0, when only the last item can still overlap).

    Returns:
        The keys and the item index to start the next block from.
    """
    extra_keys: list[ExtraKeys] = []
    mm_features: Sequence[Any] = getattr(request, "mm_features", None) or ()
    if not mm_features:
        return extra_keys, start_mm_idx

    # Past the end of the last item: nothing can overlap (late prefill, decode).
    last_pos = mm_features[-1].mm_position
    if last_pos.offset + last_pos.length <= start_token_idx:
        return extra_keys, start_mm_idx

    if start_mm_idx < 0:
        start_mm_idx = len(mm_features) + start_mm_idx

    curr_mm_idx = start_mm_idx
    while curr_mm_idx < len(mm_features):
        mm_feature = mm_features[curr_mm_idx]
        offset = mm_feature.mm_position.offset
        length = mm_feature.mm_position.length
        if end_token_idx <= offset:
            # The block has not reached this item.
            break
        if start_token_idx >= offset + length:
            # The block is past this item.
            curr_mm_idx += 1
            continue
        extra_keys.append(("mm", mm_feature.identifier, offset - start_token_idx))
        if end_token_idx >= offset + length:
            # The item ends here; the next one may start in this block too.
            curr_mm_idx += 1
        else:
            break
    return extra_keys, curr_mm_idx


def generate_block_hash_extra_keys(
    request: object,
    start_token_idx: int,
    end_token_idx: int,
    start_mm_idx: int,
    *,
    salt_is_truthy: bool | None = None,
) -> tuple[tuple[ExtraKeys, ...] | None, int]:
    """The extra keys of one block, tagged as vLLM 0.33.0 tags them.

    Order: LoRA, multimodal, then ``("cache_salt", salt)`` on the block starting at
    token 0 when the salt is truthy.

    Args:
        request: The request.
        start_token_idx: First token of the block.
        end_token_idx: One past the last token of the block.
        start_mm_idx: Where the multimodal walk starts (see ``_gen_mm_extra_hash_keys``).
        salt_is_truthy: The salt's truth when the caller has tested it already (each
            attribute is read once); ``None`` tests it here.

    Returns:
        The keys (``None`` when there are none) and the next multimodal index.
    """
    mm_keys, next_mm_idx = _gen_mm_extra_hash_keys(
        request, start_token_idx, end_token_idx, start_mm_idx
    )
    cache_salt = getattr(request, "cache_salt", None)
    if start_token_idx != 0:
        has_salt = False
    else:
        has_salt = bool(cache_salt) if salt_is_truthy is None else salt_is_truthy
    salt_keys: list[ExtraKeys] = [("cache_salt", cache_salt)] if has_salt else []
    extra_keys = _gen_lora_extra_hash_keys(request) + mm_keys + salt_keys
    return (tuple(extra_keys) if extra_keys else None), next_mm_idx
