"""The promoted single group: with the hybrid manager off (the flag, a connector without
HMA support, or Llama 4 by default) vLLM merges sliding-window and chunked-local layers
into one ``FullAttentionSpec`` with ``sliding_window`` or ``attention_chunk_size`` set,
and manages it as plain full attention. kvblocks manages it too, step for step the same.

The scheduler differential's scenarios run here with that spec in place of the plain one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import harness
import pytest
import torch
from kvblocks.vllm import KVCacheManager, unsupported_reason
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

#: Seeds per family and engine: 17 x 3 families x 2 engines = 102 scenarios per layout.
SEEDS = 17

#: The promoted specs: gpt-oss-like (window 128) and Llama-4-like (chunks of 8,192),
#: scaled to the tiny blocks of the scenarios.
PROMOTED = {
    "sliding-window": {"sliding_window": 8},
    "chunked-local": {"attention_chunk_size": 16},
}


def promoted_config(num_blocks: int, block_size: int, *, extra: dict[str, Any]) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32, **extra
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )


@pytest.mark.parametrize("layout", sorted(PROMOTED))
def test_the_promoted_group_is_managed(layout: str) -> None:
    config = promoted_config(16, 4, extra=PROMOTED[layout])
    kwargs = {
        "kv_cache_config": config,
        "max_model_len": 64,
        "scheduler_block_size": 4,
        "hash_block_size": 4,
    }
    assert unsupported_reason(**kwargs) is None
    KVCacheManager(**kwargs)


SCENARIOS = [
    (layout, f"{family}-s{seed}-{engine}")
    for layout in sorted(PROMOTED)
    for family in ("mixed", "multiturn", "connector")
    for engine in harness.ENGINES
    for seed in range(SEEDS)
]


@pytest.mark.parametrize(("layout", "scenario_id"), SCENARIOS)
def test_same_as_vllm_with_a_promoted_spec(
    layout: str, scenario_id: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[KVCacheConfig] = []

    def build(num_blocks: int, block_size: int) -> KVCacheConfig:
        built.append(promoted_config(num_blocks, block_size, extra=PROMOTED[layout]))
        return built[-1]

    monkeypatch.setattr(harness.driver, "build_kv_cache_config", build)
    scn = harness.make_scenario(*harness.parse_scenario_id(scenario_id))
    reference, other, mismatch = harness.differential(scn, tiny_model_dir)
    assert "exception" not in reference.records[-1], reference.records[-1]
    assert issubclass(other.manager_type, KVCacheManager), other.manager_cls
    assert len(built) == 2, "both schedulers were built with the promoted spec"
    assert mismatch is None, str(mismatch)
