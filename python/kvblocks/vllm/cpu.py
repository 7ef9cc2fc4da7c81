"""vLLM's Scheduler on a CPU, with no model: with ``skip_tokenizer_init=True`` vLLM's
configs read nothing but a ``config.json`` (set ``VLLM_TARGET_DEVICE=cpu`` and
``HF_HUB_OFFLINE=1`` before vLLM is imported). ``kvblocks bench`` and the tests build
their configs and schedulers with :func:`cpu_vllm_config` and :func:`build_scheduler`;
the example spells the same steps out."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "GEMMA3_LIKE",
    "GPT_OSS_LIKE",
    "LLAMA4_LIKE",
    "TINY_LLAMA_CONFIG",
    "VOCAB_SIZE",
    "GroupLayout",
    "build_scheduler",
    "cpu_vllm_config",
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


def cpu_vllm_config(
    model_dir: Path | str,
    *,
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    enable_prefix_caching: bool = True,
    async_scheduling: bool = False,
    scheduler_options: Mapping[str, Any] | None = None,
    **configs: Any,
) -> VllmConfig:
    """The ``VllmConfig`` of a scheduler on the CPU: the config-only model in
    ``model_dir`` (no tokenizer), chunked prefill, ``num_blocks`` blocks of
    ``block_size`` tokens.

    Args:
        model_dir: A directory from :func:`write_config_only_model`.
        block_size: Tokens per block (vLLM's ``CacheConfig.block_size``).
        num_blocks: The pool's blocks, as the engine core would have measured them.
        max_num_seqs: ``SchedulerConfig.max_num_seqs``.
        max_num_batched_tokens: ``SchedulerConfig.max_num_batched_tokens``.
        max_model_len: The context, at most the model's ``max_position_embeddings``.
        enable_prefix_caching: ``CacheConfig.enable_prefix_caching``.
        async_scheduling: Set once the config is made: the CPU platform turns it off,
            and the scheduler reads it back (for deferred frees and in-flight tokens).
        scheduler_options: More ``SchedulerConfig`` fields (``watermark``, ``policy``...).
        **configs: More ``VllmConfig`` fields (``kv_events_config``,
            ``speculative_config``, ``kv_transfer_config``).
    """
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: PLC0415
    from vllm.config import VllmConfig as Config  # noqa: PLC0415

    vllm_config = Config(
        model_config=ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype="float32",
            seed=0,
            max_model_len=max_model_len,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
            async_scheduling=False,
            **(scheduler_options or {}),
        ),
        cache_config=CacheConfig(
            block_size=block_size, enable_prefix_caching=enable_prefix_caching
        ),
        **configs,
    )
    if async_scheduling:
        vllm_config.scheduler_config.async_scheduling = True
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return vllm_config


def build_scheduler(
    scheduler_cls: type[Any],
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    *,
    hash_block_size: int | None = None,
) -> Any:
    """``scheduler_cls`` (vLLM's ``Scheduler``, ``AsyncScheduler`` or a subclass) built
    as vLLM's engine core builds it, with stats on; ``hash_block_size`` defaults to the
    block size."""
    from vllm.v1.structured_output import StructuredOutputManager  # noqa: PLC0415

    block_size = vllm_config.cache_config.block_size
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size or block_size,
        log_stats=True,
    )
