"""Which KV cache layouts kvblocks manages inside vLLM: every layout of full,
sliding-window and chunked-local attention that the model census finds (Llama, gpt-oss,
Gemma 2/3/4 in either block-size orientation, Cohere2, Llama 4, Mistral-7B-v0.1 style)
gets kvblocks' manager; Mamba groups and lone chunked-local groups get vLLM's own, with a
reason."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kvblocks.vllm import HybridKVCacheManager, KVCacheManager, make_kv_cache_manager
from kvblocks.vllm import unsupported_reason as reason_for
from kvblocks.vllm._version_check import installed_differences
from kvblocks.vllm.cpu import GEMMA3_LIKE, GPT_OSS_LIKE, LLAMA4_LIKE, GroupLayout, kv_cache_config
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

BLOCK = 16


def _spec(cls: type[Any], block_size: int = BLOCK, **extra: Any) -> KVCacheSpec:
    spec: KVCacheSpec = cls(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32, **extra
    )
    return spec


def _config(*specs: KVCacheSpec) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)],
    )


def _kwargs(config: KVCacheConfig, scheduler: int = BLOCK, hashed: int = BLOCK) -> dict[str, Any]:
    return {
        "kv_cache_config": config,
        "max_model_len": 512,
        "scheduler_block_size": scheduler,
        "hash_block_size": hashed,
    }


#: layout -> (the manager's kwargs, the kvblocks class that manages it)
MANAGED: dict[str, tuple[dict[str, Any], type[Any]]] = {
    "llama (one full group)": (_kwargs(_config(_spec(FullAttentionSpec))), KVCacheManager),
    "promoted sliding window": (
        _kwargs(_config(_spec(FullAttentionSpec, sliding_window=128))),
        KVCacheManager,
    ),
    "promoted chunked-local (llama 4 default)": (
        _kwargs(_config(_spec(FullAttentionSpec, attention_chunk_size=8192))),
        KVCacheManager,
    ),
    "one sliding-window group (mistral-7b-v0.1)": (
        _kwargs(_config(_spec(SlidingWindowSpec, sliding_window=4096))),
        HybridKVCacheManager,
    ),
    "gpt-oss": (_kwargs(kv_cache_config(GPT_OSS_LIKE, 64, BLOCK)), HybridKVCacheManager),
    "gemma 3": (_kwargs(kv_cache_config(GEMMA3_LIKE, 64, BLOCK)), HybridKVCacheManager),
    "llama 4 with the hybrid manager": (
        _kwargs(kv_cache_config(LLAMA4_LIKE, 64, BLOCK)),
        HybridKVCacheManager,
    ),
    "gemma 4 (window blocks twice the full ones)": (
        _kwargs(
            _config(
                *[_spec(SlidingWindowSpec, 2 * BLOCK, sliding_window=1024)] * 5,
                _spec(FullAttentionSpec),
            ),
            scheduler=2 * BLOCK,
        ),
        HybridKVCacheManager,
    ),
    "full blocks twice the window ones (partial-tail keys)": (
        _kwargs(
            _config(
                _spec(SlidingWindowSpec, sliding_window=1024),
                _spec(FullAttentionSpec, 2 * BLOCK),
            ),
            scheduler=2 * BLOCK,
        ),
        HybridKVCacheManager,
    ),
}

FALLBACK: dict[str, tuple[dict[str, Any], str]] = {
    "mamba groups (qwen3.5)": (
        _kwargs(
            _config(
                MambaSpec(
                    block_size=BLOCK,
                    shapes=((1,),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
                _spec(FullAttentionSpec),
            )
        ),
        "MambaSpec",
    ),
    "chunked-local alone": (
        _kwargs(kv_cache_config((GroupLayout("chunked_local", 64),), 64, BLOCK)),
        "chunked-local",
    ),
}


@pytest.mark.parametrize("layout", sorted(MANAGED))
def test_managed(layout: str) -> None:
    kwargs, cls = MANAGED[layout]
    if cls is HybridKVCacheManager and not installed_differences().hybrid_layouts:
        # Before vLLM 0.33, these layouts stay on vLLM's manager, saying why.
        reason = reason_for(**kwargs)
        assert reason is not None and "before vLLM 0.33" in reason
        assert type(make_kv_cache_manager(**kwargs)) is VllmKVCacheManager
        return
    assert reason_for(**kwargs) is None
    manager = make_kv_cache_manager(**kwargs)
    assert type(manager) is cls
    assert manager.num_kv_cache_groups == len(kwargs["kv_cache_config"].kv_cache_groups)


@pytest.mark.parametrize("layout", sorted(FALLBACK))
def test_falls_back_with_a_reason(layout: str) -> None:
    kwargs, fragment = FALLBACK[layout]
    reason = reason_for(**kwargs)
    assert reason is not None
    assert fragment in reason
    assert type(make_kv_cache_manager(**kwargs)) is VllmKVCacheManager
