"""Prefix-caching block hashes, exactly as vLLM 0.33.0 computes them.

Block ``i`` of a request is identified by the hash of the 3-tuple::

    (parent, tuple(token ids of block i), extra_keys)

where ``parent`` is block ``i - 1``'s hash, or the chain seed ``none_hash`` for block 0
(and for an empty parent), and ``extra_keys`` is ``None`` or a tuple that separates
requests whose tokens agree but whose KV cache would not (LoRA adapter, multimodal
inputs, cache salt). ``none_hash`` is the hash of the seed *string*. Chaining makes each
hash a fingerprint of the whole prefix up to the end of its block.

Four hash functions, chosen by name as vLLM's ``--prefix-caching-hash-algo``:

* ``sha256`` (vLLM's default): SHA-256 of ``pickle.dumps(x, protocol=5)``;
* ``sha256_cbor``: SHA-256 of ``cbor2.dumps(x, canonical=True)``;
* ``xxhash`` / ``xxhash_cbor``: the same serialisations, digested with xxh3-128.

Everything is validated before anything is hashed, arguments in signature order and
sequences front to back (the first problem found decides the error), with the messages
the native backend raises. Extra keys are restricted to what both serialisers
agree on: nested tuples of ``str``, ``int``, ``bytes`` and ``None`` (exact types, at most
``MAX_EXTRA_KEYS_DEPTH`` tuples deep, strings without lone surrogates).

Pickle memoizes ``str``, ``bytes`` and tuple objects by *identity*: an object that occurs
twice in one hashed value is written once and then referenced, so ``("mm", a, 1)`` twice
with the same ``"mm"`` object hashes differently from two equal but distinct strings.
This module hands the caller's objects to ``pickle`` unchanged, so it inherits exactly
vLLM's behaviour; the native backend tracks object identity to match it.
"""

from __future__ import annotations

import hashlib
import operator
import os
import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, SupportsIndex, TypeAlias

import cbor2
import xxhash as _xxhash

from kvblocks.constants import HASH_ALGORITHMS
from kvblocks.extra_keys import (
    MAX_EXTRA_KEYS_DEPTH,
    ExtraKeys,
    Lora,
    MmItem,
    MmPosition,
    MmWalk,
    RequestExtras,
    block_extra_keys,
    check_extra_key,
    check_extra_keys,
    mm_items_needed,
    mm_overlaps,
)
from kvblocks.values import INT64_MAX, INT64_MIN, exact_str, materialise, to_int

__all__ = [
    "DEFAULT_SEED",
    "HASH_FUNCTIONS",
    "MAX_EXTRA_KEYS_DEPTH",
    "BlockHasher",
    "ExtraKeys",
    "HashFunction",
    "HashableRequest",
    "check_extra_keys",
    "check_token_ids",
    "extras_attrs",
    "get_hash_fn_by_name",
    "read_extras",
    "resolve_seed",
    "sha256",
    "sha256_cbor",
    "xxhash",
    "xxhash_cbor",
]


#: A hash function: serialises a value and digests it.
HashFunction: TypeAlias = Callable[[object], bytes]

#: ``pickle.HIGHEST_PROTOCOL`` on every Python vLLM 0.33.0 supports, pinned so that a
#: future protocol cannot silently change every hash.
PICKLE_PROTOCOL = 5

#: The seed of the SHA-256 algorithms when neither a seed nor ``PYTHONHASHSEED`` is given.
DEFAULT_SEED = "vllm-none-hash"


def sha256(value: object) -> bytes:
    """SHA-256 of ``pickle.dumps(value, protocol=5)``: vLLM's default block hash.

    Args:
        value: Any picklable value.

    Returns:
        The 32-byte digest.
    """
    return hashlib.sha256(pickle.dumps(value, protocol=PICKLE_PROTOCOL)).digest()


def sha256_cbor(value: object) -> bytes:
    """SHA-256 of ``cbor2.dumps(value, canonical=True)``: reproducible outside Python.

    Args:
        value: Any value cbor2 can encode.

    Returns:
        The 32-byte digest.
    """
    encoded: bytes = cbor2.dumps(value, canonical=True)
    return hashlib.sha256(encoded).digest()


def xxhash(value: object) -> bytes:
    """xxh3-128 of ``pickle.dumps(value, protocol=5)``, big-endian.

    Args:
        value: Any picklable value.

    Returns:
        The 16-byte digest.
    """
    digest: bytes = _xxhash.xxh3_128_digest(pickle.dumps(value, protocol=PICKLE_PROTOCOL))
    return digest


def xxhash_cbor(value: object) -> bytes:
    """xxh3-128 of ``cbor2.dumps(value, canonical=True)``, big-endian.

    Args:
        value: Any value cbor2 can encode.

    Returns:
        The 16-byte digest.
    """
    digest: bytes = _xxhash.xxh3_128_digest(cbor2.dumps(value, canonical=True))
    return digest


#: The hash functions by vLLM's names for them.
HASH_FUNCTIONS: dict[str, HashFunction] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash,
    "xxhash_cbor": xxhash_cbor,
}

#: The algorithms vLLM seeds randomly (non-cryptographic, so a fixed seed would make
#: collisions easy to construct).
_RANDOMLY_SEEDED = frozenset({"xxhash", "xxhash_cbor"})


def get_hash_fn_by_name(name: object) -> HashFunction:
    """The hash function vLLM calls ``name``.

    Args:
        name: ``"sha256"``, ``"sha256_cbor"``, ``"xxhash"`` or ``"xxhash_cbor"``.

    Returns:
        The hash function.

    Raises:
        ValueError: For any other name (or a non-string).
    """
    # A subclass is looked up by its contents, as natively: its dunders never run.
    if isinstance(name, str) and str.__str__(name) in HASH_FUNCTIONS:
        return HASH_FUNCTIONS[str.__str__(name)]
    raise ValueError(
        f"unknown hash algorithm {name!r}; expected one of "
        + ", ".join(repr(algo) for algo in HASH_ALGORITHMS)
    )


def resolve_seed(seed: str | None, algo: str) -> str:
    """The chain seed string, as vLLM's ``init_none_hash`` picks it.

    Args:
        seed: An explicit seed; wins when given (even ``""``).
        algo: The hash algorithm's name (assumed valid).

    Returns:
        ``seed``, else ``$PYTHONHASHSEED`` when set (to anything), else ``"vllm-none-hash"``
        for the SHA-256 algorithms and 32 random bytes as hex for the xxhash ones.

    Raises:
        TypeError: When ``seed`` is neither a str nor None.
    """
    if seed is not None:
        if not isinstance(seed, str):
            raise TypeError(f"seed must be a str or None, got {type(seed).__name__}")
        return exact_str(seed)
    env_seed = os.environ.get("PYTHONHASHSEED")
    if env_seed is not None:
        return env_seed
    if algo in _RANDOMLY_SEEDED:
        return os.urandom(32).hex()
    return DEFAULT_SEED


def check_token_ids(token_ids: Iterable[SupportsIndex]) -> tuple[int, ...]:
    """Token ids as a tuple of plain ints, each in the signed 64-bit range.

    Args:
        token_ids: Ints, or anything ``operator.index`` accepts (NumPy ints).

    Returns:
        The ids as a tuple of ``int``.

    Raises:
        TypeError: For an id that is not an integer (``operator.index``'s message).
        ValueError: For an id outside the signed 64-bit range.
    """
    tokens = []
    # One pass, in order: the first bad id decides the error, in both backends.
    for token_id in materialise(token_ids):
        value = operator.index(token_id)
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"token id {value} does not fit in a signed 64-bit integer")
        tokens.append(value)
    return tuple(tokens)


def _check_parent(parent: object) -> bytes | None:
    # Exact bytes: a subclass would pickle as a different object.
    if parent is None or type(parent) is bytes:
        return parent
    raise TypeError(f"parent hash must be bytes or None, got {type(parent).__name__}")


def _check_extra_keys_per_block(extra_keys: object, num_blocks: int) -> None:
    """Checks ``hash_blocks``' ``extra_keys``: a list or tuple of ``num_blocks`` valid keys."""
    if not isinstance(extra_keys, list | tuple):
        raise TypeError(
            "extra_keys must be a list or tuple with one entry per full block, "
            f"or None; got {type(extra_keys).__name__}"
        )
    if len(extra_keys) != num_blocks:
        raise ValueError(
            "extra_keys must have one entry per full block: "
            f"got {len(extra_keys)} for {num_blocks} full blocks"
        )
    for keys in extra_keys:
        check_extra_keys(keys)


class HashableRequest(Protocol):
    """What ``BlockHasher.__call__`` reads from a request (vLLM's ``Request`` fits).

    The hasher also reads, when present, ``lora_request`` (with ``lora_name`` and
    ``lora_path``), ``cache_salt``, ``mm_features`` (each with ``identifier`` and
    ``mm_position.offset`` / ``.length``, sorted by offset) and ``prompt_embeds``.
    """

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt and output token ids."""
        ...

    @property
    def num_tokens(self) -> int:
        """``len(all_token_ids)``."""
        ...

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """The hashes of the full blocks hashed so far."""
        ...


def extras_attrs(request: object) -> tuple[Any, Any, Any]:
    """``getattr(request, name, None)`` for ``lora_request``, ``mm_features`` and
    ``cache_salt``, in that order: the attributes :func:`read_extras` reads."""
    return (
        getattr(request, "lora_request", None),
        getattr(request, "mm_features", None),
        getattr(request, "cache_salt", None),
    )


def read_extras(
    attrs: tuple[Any, Any, Any], start: int, num_blocks: int, block_size: int, walk: MmWalk
) -> RequestExtras:
    """A request's extras for ``num_blocks`` blocks of ``block_size`` tokens from token
    ``start``, read in the order of the keys they make: ``lora_request``'s truth,
    ``lora_name``, ``lora_path``; ``mm_features``' truth, length and each item's
    ``mm_position.offset`` and ``.length``, then the ``identifier`` of each item the
    blocks overlap (``walk``), in item order; ``cache_salt``'s truth. Each value is
    checked as an extra key when it is read.

    Args:
        attrs: The request's attributes, from :func:`extras_attrs`.
        start: The first token of the blocks.
        num_blocks: How many blocks.
        block_size: Tokens per block.
        walk: How the multimodal items are matched to the blocks.

    Raises:
        TypeError: For a value that is not a valid extra key.
        ValueError: For a value nested too deep.
    """
    lora_request, mm_features, cache_salt = attrs
    extras = RequestExtras()
    if lora_request:
        name = _read_key(lora_request.lora_name)
        extras.lora = Lora(name, _read_key(lora_request.lora_path))
    features = []
    if mm_features:
        for i in range(len(mm_features)):
            feature = mm_features[i]
            position = feature.mm_position
            offset, length = to_int(position.offset), to_int(position.length)
            extras.mm_items.append(MmItem(MmPosition(offset, length)))
            features.append(feature)
    positions = [item.position for item in extras.mm_items]
    for index in mm_items_needed(mm_overlaps(positions, start, num_blocks, block_size, walk)):
        item = extras.mm_items[index]
        item.identifier = _read_key(features[index].identifier)
        item.has_identifier = True
    if cache_salt:
        extras.cache_salt = _read_key(cache_salt)
    return extras


def _read_key(value: object) -> object:
    """``value``, checked as a part of a key (inside the block's tuple and the key's)."""
    check_extra_key(value, 2)
    return value


class BlockHasher:
    """Computes vLLM block hashes for one algorithm, block size and seed.

    Also vLLM's per-request ``block_hasher``: calling it on a request returns the hashes
    of the request's full blocks that ``request.block_hashes`` does not hold yet.
    """

    __slots__ = ("_algo", "_block_size", "_hash_fn", "_none_hash", "_seed")

    def __init__(self, block_size: int, algo: str = "sha256", seed: str | None = None) -> None:
        """Builds a hasher.

        Args:
            block_size: Tokens per block, positive.
            algo: ``"sha256"``, ``"sha256_cbor"``, ``"xxhash"`` or ``"xxhash_cbor"``.
            seed: The chain seed; ``None`` resolves it as vLLM does: ``PYTHONHASHSEED``
                when set, else ``"vllm-none-hash"`` for the SHA-256 algorithms and 32
                random bytes (hex) for the xxhash ones.

        Raises:
            TypeError: When ``block_size`` is not an int or ``seed`` not a str.
            ValueError: When ``block_size <= 0`` or ``algo`` is unknown.
        """
        block_size = to_int(block_size)
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        hash_fn = get_hash_fn_by_name(algo)
        seed = resolve_seed(seed, algo)
        self._block_size = block_size
        self._algo = str.__str__(algo)
        self._seed = seed
        self._hash_fn = hash_fn
        # vLLM hashes the seed as a str, not as bytes.
        self._none_hash = hash_fn(seed)

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def algo(self) -> str:
        """The hash algorithm's name."""
        return self._algo

    @property
    def seed(self) -> str:
        """The resolved seed string."""
        return self._seed

    @property
    def none_hash(self) -> bytes:
        """``hash(seed)``: the parent of every first block."""
        return self._none_hash

    def __repr__(self) -> str:
        return (
            f"BlockHasher(block_size={self._block_size}, algo={self._algo!r}, seed={self._seed!r})"
        )

    def hash_block(
        self,
        parent: bytes | None,
        token_ids: Iterable[SupportsIndex],
        extra_keys: ExtraKeys = None,
    ) -> bytes:
        """``hash((parent or none_hash, tuple(token_ids), extra_keys))``.

        Any number of tokens is hashed, as vLLM's ``hash_block_tokens`` does.

        Args:
            parent: The previous block's hash; ``None`` or ``b""`` for a first block.
            token_ids: The block's token ids.
            extra_keys: ``None`` or the block's extra keys.

        Returns:
            The block hash.

        Raises:
            TypeError: For a bad parent, token id or extra key type.
            ValueError: For a token id outside the int64 range or too-deep extra keys.
        """
        parent = _check_parent(parent)
        tokens = check_token_ids(token_ids)
        check_extra_keys(extra_keys)
        return self._hash_fn((parent or self._none_hash, tokens, extra_keys))

    def hash_blocks(
        self,
        token_ids: Iterable[SupportsIndex],
        parent: bytes | None = None,
        extra_keys: Sequence[ExtraKeys] | None = None,
    ) -> list[bytes]:
        """The hashes of the full blocks of ``token_ids``, chained from ``parent``.

        A partial last block is not hashed.

        Args:
            token_ids: The token ids, from the first block to hash.
            parent: The hash before the first block; ``None`` or ``b""`` for a chain
                start.
            extra_keys: ``None``, or a list (or tuple) with one entry per full block.

        Returns:
            One hash per full block.

        Raises:
            TypeError: For a bad parent, token id, ``extra_keys`` container or key type.
            ValueError: For a token id outside the int64 range, too-deep extra keys, or
                an ``extra_keys`` list of the wrong length.
        """
        tokens = check_token_ids(token_ids)
        parent = _check_parent(parent)
        if extra_keys is not None:
            _check_extra_keys_per_block(extra_keys, len(tokens) // self._block_size)
        return self._chain(parent, tokens, extra_keys)

    def __call__(self, request: HashableRequest) -> list[bytes]:
        """vLLM's ``block_hasher``: hashes of the request's new full blocks.

        Hashes every full block after the first ``len(request.block_hashes)`` ones,
        chained from ``request.block_hashes[-1]``, with the extra keys vLLM 0.33.0
        derives from the request (LoRA, multimodal items, cache salt).

        Args:
            request: Any object with ``all_token_ids``, ``num_tokens`` and
                ``block_hashes`` (and optionally the attributes listed on
                ``HashableRequest``).

        Returns:
            The new hashes, in block order, for the caller to append.

        Raises:
            TypeError: When a block is to be hashed and the request has
                ``prompt_embeds`` (not supported), or for bad token ids or extra keys.
            ValueError: For token ids outside the int64 range or too-deep extra keys.
        """
        # vLLM's read order: a decoding step that fills no block reads two fields.
        block_size = self._block_size
        known = request.block_hashes
        start = len(known) * block_size
        num_tokens = to_int(request.num_tokens)
        if start + block_size > num_tokens:
            return []
        if getattr(request, "prompt_embeds", None) is not None:
            raise TypeError(
                "requests with prompt_embeds are not supported: kvblocks hashes token ids only"
            )
        parent = _check_parent(known[-1]) if known else None
        num_blocks = (num_tokens - start) // block_size
        tokens = check_token_ids(request.all_token_ids[start : start + num_blocks * block_size])
        # A request claiming more tokens than it holds hashes the blocks it has: the
        # walk below covers those, never the claim.
        end = start + len(tokens) // block_size * block_size

        attrs = extras_attrs(request)
        extra_keys = None
        if end > start:
            num_hashed = (end - start) // block_size
            extras = read_extras(attrs, start, num_hashed, block_size, "hashing")
            extra_keys = block_extra_keys(extras, start, num_hashed, block_size)
        return self._chain(parent, tokens, extra_keys)

    def _chain(
        self,
        parent: bytes | None,
        tokens: tuple[int, ...],
        extra_keys: Sequence[ExtraKeys] | None,
    ) -> list[bytes]:
        """Hashes validated full blocks, each block's hash the next one's parent."""
        block_size = self._block_size
        hashes: list[bytes] = []
        for i in range(len(tokens) // block_size):
            keys = extra_keys[i] if extra_keys is not None else None
            block = tokens[i * block_size : (i + 1) * block_size]
            parent = self._hash_fn((parent or self._none_hash, block, keys))
            hashes.append(parent)
        return hashes
