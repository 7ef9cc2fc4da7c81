"""vLLM's Scheduler on a CPU, with no model: with ``skip_tokenizer_init=True`` vLLM's
configs read nothing but a ``config.json`` (set ``VLLM_TARGET_DEVICE=cpu`` and
``HF_HUB_OFFLINE=1`` before vLLM is imported). The example, ``kvblocks bench`` and the
tests build their schedulers from this one."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "GEMMA3_LIKE",
    "GPT_OSS_LIKE",
    "LLAMA4_LIKE",
    "TINY_LLAMA_CONFIG",
    "VOCAB_SIZE",
    "GroupLayout",
    "kv_cache_config",
    "write_config_only_model",
]

#: The tiny model's vocabulary: token ids are ``0 .. VOCAB_SIZE - 1``.
VOCAB_SIZE = 1_000

#: A two-layer Llama small enough for any machine; only its shape is ever read.
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}


def write_config_only_model(directory: Path, max_position_embeddings: int = 4096) -> Path:
    """Writes :data:`TINY_LLAMA_CONFIG` as ``directory/config.json``, with a longer context
    when asked (vLLM refuses a ``max_model_len`` beyond it); returns ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {**TINY_LLAMA_CONFIG, "max_position_embeddings": max_position_embeddings}
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


#: The attention types of a KV cache group, as vLLM's specs name them.
GroupKind = Literal["full", "sliding_window", "chunked_local"]


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """One KV cache group: its attention type, for a local one its window (or chunk)
    in tokens, and its block size when it differs from the config's."""

    kind: GroupKind
    window: int | None = None
    block_size: int | None = None

    def size(self) -> int:
        """The window (or chunk) of a local-attention group."""
        if self.window is None:
            raise ValueError(f"a {self.kind} group needs its window")
        return self.window


#: gpt-oss: sliding-window layers (window 128) and full layers, two groups (vLLM puts
#: the sliding-window group first).
GPT_OSS_LIKE = (GroupLayout("sliding_window", 128), GroupLayout("full"))
#: Gemma 3: six sliding-window groups (window 1024) and one full group.
GEMMA3_LIKE = (*(GroupLayout("sliding_window", 1024),) * 6, GroupLayout("full"))
#: Llama 4 with the hybrid manager on: three chunked-local groups (chunks of 8,192) and
#: one full group.
LLAMA4_LIKE = (*(GroupLayout("chunked_local", 8192),) * 3, GroupLayout("full"))


def kv_cache_config(
    groups: Sequence[GroupLayout],
    num_blocks: int,
    block_size: int,
    *,
    retention_interval: int | None = 0,
) -> KVCacheConfig:
    """A ``KVCacheConfig`` with one group per item of ``groups`` (one layer each, of
    ``block_size`` tokens unless the group says), as the engine core would build for a
    model with those layers.
    ``retention_interval`` is vLLM's ``prefix_cache_retention_interval`` (the engine's
    default is 0)."""
    # Imported here: the rest of this module serves callers without vLLM installed.
    import torch  # noqa: PLC0415
    from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    specs: list[Any] = []
    for group in groups:
        shape: dict[str, Any] = {
            "block_size": group.block_size or block_size,
            "num_kv_heads": 1,
            "head_size": 1,
            "dtype": torch.float32,
        }
        if group.kind == "full":
            specs.append(FullAttentionSpec(**shape))
        elif group.kind == "sliding_window":
            specs.append(SlidingWindowSpec(**shape, sliding_window=group.size()))
        else:
            specs.append(ChunkedLocalAttentionSpec(**shape, attention_chunk_size=group.size()))
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)
        ],
        prefix_cache_retention_interval=retention_interval,
    )
