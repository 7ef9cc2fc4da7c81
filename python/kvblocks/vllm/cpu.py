"""vLLM's Scheduler on a CPU, with no model: with ``skip_tokenizer_init=True`` vLLM's
configs read nothing but a ``config.json`` (set ``VLLM_TARGET_DEVICE=cpu`` and
``HF_HUB_OFFLINE=1`` before vLLM is imported). The example, ``kvblocks bench`` and the
tests build their schedulers from this one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["TINY_LLAMA_CONFIG", "VOCAB_SIZE", "write_config_only_model"]

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


def write_config_only_model(directory: Path) -> Path:
    """Writes :data:`TINY_LLAMA_CONFIG` as ``directory/config.json``; returns ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG), encoding="utf-8")
    return directory
