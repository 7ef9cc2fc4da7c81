"""The ``vllm_scheduler`` group of ``kvblocks bench``: vLLM's Scheduler step with kvblocks'
KV cache manager against vLLM's own.

Skipped unless vLLM is importable. The harness itself is checked with vLLM's own
``Scheduler`` on both sides; the tests of kvblocks' scheduler are skipped unless
``kvblocks.vllm`` imports too. Small sizes: the group's real sizes are
``kvblocks bench --workload vllm_scheduler``'s.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from kvblocks import bench
from kvblocks.bench import BenchResult, vllm_scheduler
from kvblocks.bench.workloads import Workload, WorkloadSpec, all_workloads

pytest.importorskip("vllm", reason="the vllm_scheduler group needs vLLM ('kvblocks[vllm]')")

needs_kvblocks_vllm = pytest.mark.skipif(
    not vllm_scheduler.available(), reason=f"vllm_scheduler group: {vllm_scheduler.status()}"
)


def _stock() -> Any:
    return importlib.import_module("vllm.v1.core.sched.scheduler").Scheduler


def _run(workload: Workload, rounds: int = 2) -> BenchResult:
    (result,) = bench.run([WorkloadSpec(workload.name, lambda: workload)], rounds, progress=None)
    return result


@pytest.mark.parametrize("kv_load", [False, True], ids=["plain", "kv_load"])
def test_harness_with_vllm_on_both_sides(kv_load: bool) -> None:
    """Both columns time vLLM's own scheduler: they agree step for step, every round."""
    workload = vllm_scheduler.vllm_scheduler(32, kv_load=kv_load, steps=8, kvblocks_cls=_stock())
    assert workload.self_timed and not workload.has_reference
    result = _run(workload)
    assert result.vllm_error is None
    assert result.python_s == [] and result.ratio is None
    assert len(result.rust_s) == len(result.vllm_s) == 2
    assert all(t > 0 for t in result.rust_s + result.vllm_s)


def test_connector_loads_and_fails_loads() -> None:
    workload = vllm_scheduler.vllm_scheduler(32, kv_load=True, steps=8, kvblocks_cls=_stock())
    driver = workload.vllm_setup()  # type: ignore[misc]
    connector = driver.scheduler.connector
    assert type(connector).__name__ == vllm_scheduler.CONNECTOR_CLASS
    assert driver.failed_loads > 0


def test_a_scheduler_that_decides_otherwise_is_caught() -> None:
    """The check at the end of a round: different scheduled token counts fail vLLM's
    run (reported, not fatal), so no ratio is shown for a comparison that is not one."""

    class Smaller(_stock()):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.max_num_scheduled_tokens = 4_096

    result = _run(vllm_scheduler.vllm_scheduler(32, steps=8, kvblocks_cls=Smaller), rounds=1)
    assert result.vllm_s == []
    assert result.vllm_error is not None
    assert "vLLM's manager scheduled differently from kvblocks' manager" in result.vllm_error


@needs_kvblocks_vllm
@pytest.mark.parametrize("kv_load", [False, True], ids=["plain", "kv_load"])
def test_kvblocks_scheduler_matches_vllms(kv_load: bool) -> None:
    """kvblocks' manager, in vLLM's Scheduler, schedules exactly as vLLM's own."""
    result = _run(vllm_scheduler.vllm_scheduler(64, kv_load=kv_load, steps=8))
    assert result.vllm_error is None
    assert result.vllm_ratio is not None and result.vllm_ratio > 0


@needs_kvblocks_vllm
def test_group_is_registered() -> None:
    names = [spec.name for spec in all_workloads(quick=True)]
    group = [name for name in names if name.startswith(vllm_scheduler.GROUP)]
    assert group == [
        "vllm_scheduler_64",
        "vllm_scheduler_256",
        "vllm_scheduler_1024",
        "vllm_scheduler_kv_load_256",
    ]
    full = [s.name for s in vllm_scheduler.workload_specs(quick=False)]
    assert len(full) == len(vllm_scheduler.SIZES) + len(vllm_scheduler.KV_LOAD_SIZES)
