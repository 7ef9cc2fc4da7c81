"""A minimal request: the token ids and block hashes the KV cache manager reads.

It mirrors the part of vLLM's ``v1/request.py`` ``Request`` that block management
uses: ``all_token_ids`` grows as output tokens are appended, and a ``block_hasher``
(e.g. ``BlockHasher``) keeps ``block_hashes`` current: it runs on construction and
after every append, and its new hashes are appended. Managers read ``request_id``,
``num_tokens``, ``num_computed_tokens`` (and write it) and ``block_hashes``.

Every method validates its input before changing anything; when the hasher fails
during an append, the appended tokens are taken back, so a failed call has no effect.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any, SupportsIndex

from kvblocks.reference.hashing import check_token_ids
from kvblocks.reference.kv_cache_utils import to_block_hashes
from kvblocks.values import to_int, to_request_id

__all__ = ["Request"]

#: vLLM's block-hasher contract: the hashes of the request's new full blocks.
BlockHasherFn = Callable[["Request"], list[bytes]]


class Request:
    """A request's token ids and the hashes of its full blocks.

    ``lora_request``, ``cache_salt``, ``mm_features`` and ``prompt_embeds`` are the
    attributes of vLLM's ``Request`` that ``BlockHasher`` reads for extra keys.
    """

    __slots__ = (
        "_all_token_ids",
        "_block_hasher",
        "_block_hashes",
        "_cache_salt",
        "_lora_request",
        "_mm_features",
        "_num_computed_tokens",
        "_output_token_ids",
        "_prompt_embeds",
        "_prompt_token_ids",
        "_request_id",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[SupportsIndex],
        *,
        block_hasher: BlockHasherFn | None = None,
        lora_request: Any = None,
        cache_salt: str | None = None,
        mm_features: Sequence[Any] = (),
        prompt_embeds: object = None,
    ) -> None:
        """Builds a request and hashes its full prompt blocks.

        Args:
            request_id: The request's id.
            prompt_token_ids: The prompt's token ids (ints in the int64 range).
            block_hasher: Called with the request; returns the new full-block hashes
                (vLLM's contract, which ``BlockHasher`` implements).
            lora_request: vLLM's ``LoRARequest``, or any object with ``lora_name`` and
                ``lora_path``.
            cache_salt: Mixed into the first block's hash when truthy.
            mm_features: Multimodal items sorted by offset, each with ``identifier``
                and ``mm_position.offset`` / ``.length``.
            prompt_embeds: Prompt embeddings; ``BlockHasher`` hashes no block of a request
                that has them.

        Raises:
            TypeError: For a non-str id, a non-int token id or a non-callable hasher,
                or whatever the hasher raises.
            UnicodeEncodeError: For an id holding a lone surrogate.
            ValueError: For a token id outside the int64 range, or from the hasher.
        """
        request_id = to_request_id(request_id)
        if block_hasher is not None and not callable(block_hasher):
            raise TypeError(
                f"block_hasher must be callable or None, got {type(block_hasher).__name__}"
            )
        prompt = list(check_token_ids(prompt_token_ids))
        self._request_id = request_id
        self._prompt_token_ids = prompt
        self._all_token_ids = list(prompt)
        self._output_token_ids: list[int] = []
        self._block_hashes: list[bytes] = []
        self._lora_request = lora_request
        self._cache_salt = cache_salt
        self._mm_features = mm_features
        self._prompt_embeds = prompt_embeds
        self._num_computed_tokens = 0
        self._block_hasher = block_hasher
        self.update_block_hashes()

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self._request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids (do not modify)."""
        return self._prompt_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output token ids (do not modify)."""
        return self._all_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        """Token ids appended since construction (do not modify)."""
        return self._output_token_ids

    @property
    def block_hashes(self) -> list[bytes]:
        """One hash per full block hashed so far, block 0 first (do not modify)."""
        return self._block_hashes

    @property
    def lora_request(self) -> Any:
        """The LoRA adapter: adds ``("lora", name, path)`` to every block's extra keys."""
        return self._lora_request

    @lora_request.setter
    def lora_request(self, value: Any) -> None:
        self._lora_request = value

    @property
    def cache_salt(self) -> str | None:
        """Mixed into the first block's hash (``("cache_salt", salt)``) when truthy."""
        return self._cache_salt

    @cache_salt.setter
    def cache_salt(self, value: str | None) -> None:
        self._cache_salt = value

    @property
    def mm_features(self) -> Sequence[Any]:
        """Multimodal items, sorted by offset: ``("mm", identifier, offset)`` keys."""
        return self._mm_features

    @mm_features.setter
    def mm_features(self, value: Sequence[Any]) -> None:
        self._mm_features = value

    @property
    def prompt_embeds(self) -> object:
        """Prompt embeddings; ``BlockHasher`` hashes no block of a request that has them."""
        return self._prompt_embeds

    @prompt_embeds.setter
    def prompt_embeds(self, value: object) -> None:
        self._prompt_embeds = value

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens."""
        return len(self._prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens appended so far."""
        return len(self._output_token_ids)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is computed (or loaded); managers read and write it."""
        return self._num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: SupportsIndex) -> None:
        count = to_int(value)
        if count < 0:
            raise ValueError(f"num_computed_tokens must be non-negative, got {count}")
        self._num_computed_tokens = count

    @property
    def block_hasher(self) -> BlockHasherFn | None:
        """The hasher keeping ``block_hashes`` current, if any."""
        return self._block_hasher

    def append_output_token_ids(self, token_ids: SupportsIndex | Iterable[SupportsIndex]) -> None:
        """Appends output tokens, then hashes the blocks they complete.

        Args:
            token_ids: One token id or several.

        Raises:
            TypeError: For a non-int token id, or from the hasher.
            ValueError: For a token id outside the int64 range, or from the hasher.
        """
        if isinstance(token_ids, numbers.Integral) or not isinstance(token_ids, Iterable):
            # A single id; operator.index raises the usual TypeError for a float etc.
            new_ids = list(check_token_ids((token_ids,)))
        else:
            new_ids = list(check_token_ids(token_ids))
        self._output_token_ids.extend(new_ids)
        self._all_token_ids.extend(new_ids)
        try:
            self.update_block_hashes()
        except BaseException:
            # All or nothing: take the tokens back out.
            if new_ids:
                del self._output_token_ids[-len(new_ids) :]
                del self._all_token_ids[-len(new_ids) :]
            raise

    def update_block_hashes(self) -> None:
        """Appends the hashes of full blocks not hashed yet (vLLM's method of that name).

        Raises:
            TypeError: A hash the hasher returned is not ``bytes``.
            ValueError: A hash the hasher returned is longer than 32 bytes.
            Exception: Whatever the hasher raises; ``block_hashes`` is then unchanged.
        """
        if self._block_hasher is not None:
            # Collected and checked in full before any is kept, so that a hasher failing
            # half-way (or returning a bad hash) leaves ``block_hashes`` unchanged.
            new_hashes = to_block_hashes(self._block_hasher(self))
            self._block_hashes.extend(new_hashes)

    def __repr__(self) -> str:
        return (
            f"Request(request_id={self._request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self._num_computed_tokens}, "
            f"num_block_hashes={len(self._block_hashes)})"
        )
