"""``kvblocks.vllm`` hands back vLLM's own KV cache manager for what it does not support.

For every fallback reason: ``unsupported_reason(**kwargs)`` names it,
``make_kv_cache_manager(**kwargs)`` returns ``vllm.v1.core.kv_cache_manager.KVCacheManager``
and logs exactly one INFO line with that reason. The keyword arguments are the ones vLLM
0.33.0's ``Scheduler`` really passes (recorded from a real construction), changed in the
one respect each case is about. Reasons only the scheduler's config shows (aux outputs,
connectors that need vLLM's real pool) are checked through the scheduler constructors.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import harness
import pytest
import torch
import vllm.v1.core.sched.scheduler as scheduler_module
from kvblocks.vllm import cpu
from vllm.config import KVTransferConfig, VllmConfig
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
)

#: The scheduler module's globals, where the constructors look ``KVCacheManager`` up.
_SCHEDULER_GLOBALS = vars(scheduler_module)

BLOCK_SIZE = 4
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def kvb() -> ModuleType:
    try:
        import kvblocks.vllm  # noqa: PLC0415 (a failed import fails the test, with the reason)
    except ImportError as exc:
        pytest.fail(f"kvblocks.vllm is not importable in this environment: {exc}")
    return kvblocks.vllm


def _scenario() -> harness.Scenario:
    return dataclasses.replace(
        harness.make_scenario("prefix", 0, "sync"),
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        events=True,
    )


@pytest.fixture(scope="module")
def scheduler_kwargs(tiny_model_dir: Path) -> dict[str, Any]:
    """What the installed vLLM's ``Scheduler.__init__`` passes to ``KVCacheManager``,
    recorded."""
    seen: list[dict[str, Any]] = []

    def record(**kwargs: Any) -> VllmKVCacheManager:
        seen.append(kwargs)
        return VllmKVCacheManager(**kwargs)

    with mock.patch.object(scheduler_module, "KVCacheManager", record):
        harness.build_scheduler(_scenario(), Scheduler, tiny_model_dir)
    (kwargs,) = seen
    # Every parameter of the installed vLLM's manager, by keyword.
    parameters = inspect.signature(VllmKVCacheManager.__init__).parameters
    assert sorted(kwargs) == sorted(set(parameters) - {"self"})
    assert kwargs["scheduler_block_size"] == kwargs["hash_block_size"] == BLOCK_SIZE
    return kwargs


def _attention(cls: type[AttentionSpec] = FullAttentionSpec, **extra: Any) -> KVCacheSpec:
    return cls(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32, **extra)


def _kv_config(*specs: KVCacheSpec, cls: type[KVCacheConfig] = KVCacheConfig) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
    return cls(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


@dataclasses.dataclass
class _ZeroingKVCacheConfig(KVCacheConfig):
    """One plain full-attention group that nevertheless asks for zeroed blocks."""

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        return True


def _mamba() -> KVCacheSpec:
    return MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((1,),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
    )


#: case id -> (the change to the Scheduler's kwargs, a pattern the reason must match)
KWARG_CASES: dict[str, tuple[Callable[[], dict[str, Any]], str]] = {
    "chunked-local-group-alone": (
        lambda: {
            "kv_cache_config": _kv_config(
                _attention(ChunkedLocalAttentionSpec, attention_chunk_size=8)
            )
        },
        r"chunked-local",
    ),
    "chunked-local-blocks-below-the-scheduler's": (
        lambda: {
            "kv_cache_config": _kv_config(
                FullAttentionSpec(
                    block_size=2 * BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
                _attention(ChunkedLocalAttentionSpec, attention_chunk_size=8),
            ),
            "scheduler_block_size": 2 * BLOCK_SIZE,
        },
        r"block sizes",
    ),
    "mamba-spec": (
        lambda: {"kv_cache_config": _kv_config(_mamba())},
        r"Mamba|zero",
    ),
    "needs-kv-cache-zeroing": (
        lambda: {"kv_cache_config": _kv_config(_attention(), cls=_ZeroingKVCacheConfig)},
        r"zero",
    ),
    "dcp-world-size-2": (
        lambda: {
            "dcp_world_size": 2,
            "scheduler_block_size": 2 * BLOCK_SIZE,
            "hash_block_size": 2 * BLOCK_SIZE,
        },
        r"dcp|context.parallel",
    ),
    "use-eagle": (lambda: {"use_eagle": True}, r"eagle"),
    "num-prefill-lookahead": (lambda: {"num_prefill_lookahead": 1}, r"lookahead"),
    "metrics-collector": (
        lambda: {"metrics_collector": KVCacheMetricsCollector(1.0)},
        r"metric",
    ),
    "mamba-shared-prefix-checkpoint": (
        lambda: {"enable_mamba_shared_prefix_checkpoint": True},
        r"mamba",
    ),
}

if "num_hash_lookahead_tokens" in inspect.signature(VllmKVCacheManager.__init__).parameters:
    # vLLM 0.33 on: older managers have no hash lookahead.
    KWARG_CASES["num-hash-lookahead-tokens"] = (
        lambda: {"num_hash_lookahead_tokens": 1},
        r"lookahead",
    )

#: The loggers a kvblocks line may come through (vLLM's may not propagate to the root).
_LOGGERS = ("", "vllm", "kvblocks")


@contextmanager
def info_lines() -> Iterator[list[str]]:
    """The INFO lines kvblocks logs inside the block (loggers named ``*kvblocks*``)."""

    records: dict[int, logging.LogRecord] = {}

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records[id(record)] = record

    handler = Collect(logging.DEBUG)
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
    lines: list[str] = []
    try:
        yield lines
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
        lines.extend(
            record.getMessage()
            for record in records.values()
            if record.levelno == logging.INFO and "kvblocks" in record.name
        )


@pytest.mark.parametrize("case", sorted(KWARG_CASES))
def test_fallback_reason(case: str, kvb: ModuleType, scheduler_kwargs: dict[str, Any]) -> None:
    change, pattern = KWARG_CASES[case]
    reason = kvb.unsupported_reason(**{**scheduler_kwargs, **change()})
    assert isinstance(reason, str), f"{case}: unsupported_reason returned {reason!r}"
    assert re.search(pattern, reason, re.IGNORECASE), f"{case}: reason {reason!r}"
    with info_lines() as lines:
        manager = kvb.make_kv_cache_manager(**{**scheduler_kwargs, **change()})
    assert type(manager) is VllmKVCacheManager, f"{case}: got {type(manager)}"
    assert len(lines) == 1, f"{case}: expected one INFO line naming the reason, got {lines}"
    assert reason in lines[0], f"{case}: {lines[0]!r} does not name {reason!r}"


def test_supported_configuration(kvb: ModuleType, scheduler_kwargs: dict[str, Any]) -> None:
    """The kwargs of a plain one-group full-attention Scheduler give kvblocks' manager."""
    assert kvb.unsupported_reason(**scheduler_kwargs) is None
    manager = kvb.make_kv_cache_manager(**scheduler_kwargs)
    assert isinstance(manager, kvb.KVCacheManager)
    assert not isinstance(manager, VllmKVCacheManager)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"enable_caching": False}, id="prefix-caching-off"),
        pytest.param({"log_stats": False, "enable_kv_cache_events": False}, id="no-stats-events"),
        pytest.param({"watermark": 0.1}, id="watermark"),
        pytest.param(
            {"kv_cache_config": _kv_config(_attention(MLAAttentionSpec))}, id="mla-attention"
        ),
        pytest.param(
            {
                "kv_cache_config": dataclasses.replace(
                    _kv_config(_attention()), prefix_cache_retention_interval=0
                )
            },
            id="retention-interval-0",
        ),
    ],
)
def test_supported_variants(
    change: dict[str, Any], kvb: ModuleType, scheduler_kwargs: dict[str, Any]
) -> None:
    """One plain full-attention (or MLA) group is kvblocks' case, whatever the options."""
    kwargs = {**scheduler_kwargs, **change}
    assert kvb.unsupported_reason(**kwargs) is None
    assert isinstance(kvb.make_kv_cache_manager(**kwargs), kvb.KVCacheManager)


# --------------------------------------------------------------------------------------
# Reasons in the scheduler's config: checked through the scheduler constructors
# --------------------------------------------------------------------------------------


def _with_tensors(config: KVCacheConfig) -> KVCacheConfig:
    """Give the config the backing tensor SimpleCPUOffloadConnector sizes itself from."""
    page = config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    config.kv_cache_tensors = [
        KVCacheTensor(
            size=page * config.num_blocks,
            layers=["layer.0"],
            layer_stride=page * config.num_blocks,
            block_stride=page,
        )
    ]
    return config


def _aux_outputs(config: VllmConfig) -> None:
    config.aux_output_config.enable_return_routed_experts = True


_CPU_OFFLOAD = {
    "kv_connector": "SimpleCPUOffloadConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 16},
}


def _cpu_offload(config: VllmConfig) -> None:
    config.kv_transfer_config = KVTransferConfig(**_CPU_OFFLOAD)  # type: ignore[arg-type]


def _multi_cpu_offload(config: VllmConfig) -> None:
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [_CPU_OFFLOAD]},
    )


CONFIG_CASES: dict[str, tuple[Callable[[VllmConfig], None], str]] = {
    "aux-outputs": (_aux_outputs, r"aux"),
    "simple-cpu-offload-connector": (_cpu_offload, r"SimpleCPUOffload"),
    "multi-connector-with-simple-cpu-offload": (_multi_cpu_offload, r"SimpleCPUOffload"),
}


def build_with(
    scheduler_cls: type[Scheduler], tiny_model_dir: Path, change: Callable[[VllmConfig], None]
) -> Scheduler:
    """``scheduler_cls`` built as the engine core builds it, after ``change`` to the config."""
    vllm_config = harness.build_vllm_config(_scenario(), tiny_model_dir)
    change(vllm_config)
    kv_cache_config = _with_tensors(harness.build_kv_cache_config(NUM_BLOCKS, BLOCK_SIZE))
    scheduler: Scheduler = cpu.build_scheduler(scheduler_cls, vllm_config, kv_cache_config)
    return scheduler


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
@pytest.mark.parametrize("async_scheduler", [False, True], ids=["sync", "async"])
def test_fallback_reason_in_config(
    case: str, async_scheduler: bool, kvb: ModuleType, tiny_model_dir: Path
) -> None:
    change, pattern = CONFIG_CASES[case]
    cls = kvb.KVBlocksAsyncScheduler if async_scheduler else kvb.KVBlocksScheduler
    with info_lines() as lines:
        sched = build_with(cls, tiny_model_dir, change)
    assert type(sched.kv_cache_manager) is VllmKVCacheManager, f"{case}: {sched.kv_cache_manager}"
    matching = [line for line in lines if re.search(pattern, line, re.IGNORECASE)]
    assert len(matching) == 1, f"{case}: expected one INFO line matching {pattern!r}: {lines}"
    if sched.connector is not None:
        # The connector was bound to the manager the scheduler kept (MultiConnector
        # binds its children).
        connectors = getattr(sched.connector, "_connectors", [sched.connector])
        for connector in connectors:
            assert connector._kv_cache_manager is sched.kv_cache_manager


@pytest.mark.parametrize("stock_cls", [Scheduler, AsyncScheduler], ids=["sync", "async"])
def test_kvblocks_schedulers_build_kvblocks_manager(
    stock_cls: type[Scheduler], kvb: ModuleType, tiny_model_dir: Path
) -> None:
    """A supported config through the constructors gives kvblocks' manager."""
    cls = kvb.KVBlocksAsyncScheduler if stock_cls is AsyncScheduler else kvb.KVBlocksScheduler
    assert issubclass(cls, stock_cls)
    sched = build_with(cls, tiny_model_dir, lambda config: None)
    assert isinstance(sched.kv_cache_manager, kvb.KVCacheManager)
    assert _SCHEDULER_GLOBALS["KVCacheManager"] is VllmKVCacheManager, "the name swap leaked"


def test_a_retention_interval_leaves_vllm_to_refuse_it(
    kvb: ModuleType, scheduler_kwargs: dict[str, Any]
) -> None:
    """vLLM accepts only 0 for full attention: kvblocks falls back, and vLLM's own
    manager raises its error naming the fix."""
    config = dataclasses.replace(_kv_config(_attention()), prefix_cache_retention_interval=16)
    kwargs = {**scheduler_kwargs, "kv_cache_config": config}
    reason = kvb.unsupported_reason(**kwargs)
    assert reason is not None and "retention" in reason
    with pytest.raises(ValueError, match="Set it to 0"):
        kvb.make_kv_cache_manager(**kwargs)
