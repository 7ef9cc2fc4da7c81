"""``kvblocks.vllm.install()`` / ``uninstall()``: vLLM's own ``Scheduler``, built directly,
gets kvblocks' manager while installed and vLLM's again after; both are idempotent."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import harness
import pytest
import vllm.v1.core.sched.scheduler as scheduler_module
from kvblocks.vllm import cpu
from vllm.config import KVTransferConfig
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheTensor

#: The scheduler module's globals, where ``install()`` rebinds ``KVCacheManager``.
_SCHEDULER_GLOBALS = vars(scheduler_module)


@pytest.fixture
def kvb() -> Iterator[ModuleType]:
    """``kvblocks.vllm``, uninstalled again after the test whatever happened."""
    try:
        import kvblocks.vllm  # noqa: PLC0415 (a failed import fails the test, with the reason)
    except ImportError as exc:
        pytest.fail(f"kvblocks.vllm is not importable in this environment: {exc}")
    assert _SCHEDULER_GLOBALS["KVCacheManager"] is VllmKVCacheManager, "installed before the test"
    try:
        yield kvblocks.vllm
    finally:
        kvblocks.vllm.uninstall()
        _SCHEDULER_GLOBALS["KVCacheManager"] = VllmKVCacheManager


def _scenario(engine: str = "sync") -> harness.Scenario:
    return dataclasses.replace(harness.make_scenario("prefix", 0, engine), num_blocks=64)


@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler], ids=["sync", "async"])
def test_install_and_uninstall(cls: type[Scheduler], kvb: ModuleType, tiny_model_dir: Path) -> None:
    scn = _scenario()
    assert type(harness.build_scheduler(scn, cls, tiny_model_dir).kv_cache_manager) is (
        VllmKVCacheManager
    )

    kvb.install()
    installed = _SCHEDULER_GLOBALS["KVCacheManager"]
    assert installed is not VllmKVCacheManager
    assert isinstance(
        harness.build_scheduler(scn, cls, tiny_model_dir).kv_cache_manager, kvb.KVCacheManager
    )
    kvb.install()  # idempotent: the same factory, still kvblocks' manager
    assert _SCHEDULER_GLOBALS["KVCacheManager"] is installed
    assert isinstance(
        harness.build_scheduler(scn, cls, tiny_model_dir).kv_cache_manager, kvb.KVCacheManager
    )

    kvb.uninstall()
    assert _SCHEDULER_GLOBALS["KVCacheManager"] is VllmKVCacheManager
    assert type(harness.build_scheduler(scn, cls, tiny_model_dir).kv_cache_manager) is (
        VllmKVCacheManager
    )
    kvb.uninstall()  # idempotent
    assert _SCHEDULER_GLOBALS["KVCacheManager"] is VllmKVCacheManager
    assert type(harness.build_scheduler(scn, cls, tiny_model_dir).kv_cache_manager) is (
        VllmKVCacheManager
    )


def test_uninstall_without_install(kvb: ModuleType) -> None:
    kvb.uninstall()
    assert _SCHEDULER_GLOBALS["KVCacheManager"] is VllmKVCacheManager


def test_installed_falls_back(kvb: ModuleType, tiny_model_dir: Path) -> None:
    """Installed, a directly built Scheduler whose connector needs vLLM's real pool still
    gets vLLM's manager."""
    scn = _scenario()
    vllm_config = harness.build_vllm_config(scn, tiny_model_dir)
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector="SimpleCPUOffloadConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": 1 << 16},
    )
    kv_cache_config = harness.build_kv_cache_config(scn.num_blocks, scn.block_size)
    page = kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    kv_cache_config.kv_cache_tensors = [
        KVCacheTensor(
            size=page * scn.num_blocks,
            layers=kv_cache_config.kv_cache_groups[0].layer_names,
            layer_stride=page * scn.num_blocks,
            block_stride=page,
        )
    ]
    kvb.install()
    sched = cpu.build_scheduler(Scheduler, vllm_config, kv_cache_config)
    assert type(sched.kv_cache_manager) is VllmKVCacheManager


@pytest.mark.parametrize(
    "scenario_id", ["connector-s0-sync", "connector-s1-async", "mixed-s1-sync"]
)
def test_installed_scheduler_same_as_vllm(
    scenario_id: str, kvb: ModuleType, tiny_model_dir: Path
) -> None:
    """vLLM's own Scheduler class (its Python rollback included) over kvblocks' installed
    manager behaves as over vLLM's."""
    scn = harness.make_scenario(*harness.parse_scenario_id(scenario_id))
    reference = harness.run_scenario(scn, harness.stock_class(scn), tiny_model_dir)
    kvb.install()
    installed = harness.run_scenario(scn, harness.stock_class(scn), tiny_model_dir)
    kvb.uninstall()
    assert issubclass(installed.manager_type, kvb.KVCacheManager)
    mismatch = harness.compare_runs(reference, installed)
    assert mismatch is None, str(mismatch)
