"""The ``vllm_scheduler`` group of ``kvblocks bench``: vLLM's Scheduler step with kvblocks'
KV cache manager against vLLM's own.

Skipped unless vLLM is importable. The harness itself is checked with vLLM's own
``Scheduler`` on both sides; the tests of kvblocks' scheduler are skipped unless
``kvblocks.vllm`` imports too. Small sizes: the group's real sizes are
``kvblocks bench --workload vllm_scheduler``'s.
"""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace
from typing import Any

import pytest

# benches/, where this file is, is on sys.path for its tests.
import step_instructions
from kvblocks import bench
from kvblocks.bench import BenchResult, vllm_scheduler
from kvblocks.bench.workload import Workload, WorkloadSpec
from kvblocks.bench.workloads import all_workloads

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


def test_decode_load_times_only_decodes() -> None:
    """After the warm-up every request decodes: each timed step schedules one token for
    each of the ``N`` requests, and nothing arrives or is hashed."""
    workload = vllm_scheduler.vllm_scheduler(16, load="decode", steps=8, kvblocks_cls=_stock())
    assert workload.name == "vllm_scheduler_decode_16"
    driver = workload.vllm_setup()  # type: ignore[misc]
    assert not driver.scheduler.cache_config.enable_prefix_caching
    # As vLLM's engine makes them without the prefix cache: not hashed.
    assert not any(r.block_hashes for r in driver.scheduler.requests.values())
    first = len(driver.scheduled)
    _, record = driver.run(8)
    assert all(sorted(n for _, n in step) == [1] * 16 for step in driver.scheduled[first:])
    assert record.mean_tokens == 16
    workload.check(driver, record)


@pytest.mark.parametrize("num_requests", [16, 256])
def test_long_prompt_load_prefills_beside_the_decodes(num_requests: int) -> None:
    """``N`` requests decode while long prompts arrive, one at a time, and are prefilled
    in chunks beside them (and hashed: prefix caching is on), also at ``N`` = 256, where
    the arriving request is the 257th sequence."""
    workload = vllm_scheduler.vllm_scheduler(
        num_requests, load="long_prompt", steps=8, kvblocks_cls=_stock()
    )
    driver = workload.vllm_setup()  # type: ignore[misc]
    assert driver.scheduler.cache_config.enable_prefix_caching
    first = len(driver.scheduled)
    _, record = driver.run(8)
    prefill = [n for step in driver.scheduled[first:] for _, n in step if n > 1]
    assert sum(prefill) >= vllm_scheduler.LONG_PROMPT_TOKENS
    assert record.mean_tokens > num_requests
    workload.check(driver, record)


def test_a_load_is_named() -> None:
    with pytest.raises(ValueError, match="load must be"):
        vllm_scheduler.vllm_scheduler(16, load="prefill")


@needs_kvblocks_vllm
@pytest.mark.parametrize("load", ["decode", "long_prompt"])
def test_kvblocks_scheduler_matches_vllms_on_the_decode_loads(load: str) -> None:
    result = _run(vllm_scheduler.vllm_scheduler(32, load=load, steps=8))
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
        "vllm_scheduler_decode_128",
        "vllm_scheduler_decode_256",
        "vllm_scheduler_long_prompt_64",
        "vllm_scheduler_gpt_oss_64",
        "vllm_scheduler_gemma3_64",
    ]
    full = [s.name for s in vllm_scheduler.workload_specs(quick=False)]
    assert len(full) == (
        len(vllm_scheduler.SIZES)
        + len(vllm_scheduler.KV_LOAD_SIZES)
        + len(vllm_scheduler.DECODE_SIZES)
        + 1
        + len(vllm_scheduler.HYBRID_LAYOUTS)
    )
    assert "vllm_scheduler_long_prompt_256" in full
    assert full[-2:] == ["vllm_scheduler_gpt_oss_256", "vllm_scheduler_gemma3_256"]


@needs_kvblocks_vllm
def test_group_is_absent_on_a_newer_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a vLLM newer than the newest supported, kvblocks' schedulers run vLLM's own
    manager: the group says so and is absent, rather than failing in every row."""
    version_check = importlib.import_module("kvblocks.vllm._version_check")
    monkeypatch.setattr(version_check, "installed_version", lambda: "0.99.0")
    vllm_scheduler._probe.cache_clear()
    try:
        assert not vllm_scheduler.available()
        assert vllm_scheduler.workload_specs(quick=True) == []
        assert vllm_scheduler.status() == (
            "vLLM 0.99.0 is newer than the vLLM kvblocks.vllm is tested with (0.31.x to "
            "0.33.x); python -m kvblocks.vllm.check lists what changed; kvblocks' schedulers "
            "run vLLM's own manager there"
        )
    finally:
        monkeypatch.undo()
        vllm_scheduler._probe.cache_clear()
    assert vllm_scheduler.available()


# --------------------------------------------------------------------------- hybrid rows

_FALLBACK = "FALLBACK, not a kvblocks measurement"


def _layout(key: str) -> vllm_scheduler.HybridLayout:
    (layout,) = (x for x in vllm_scheduler.HYBRID_LAYOUTS if x.key == key)
    return layout


@needs_kvblocks_vllm
def test_hybrid_pools_hold_the_windows() -> None:
    """The single-group rows' 65,536 blocks for the full group, plus per sliding-window
    group 256 windows of cdiv(window - 1, 16) + 1 blocks and one step of prefill."""
    gpt_oss, gemma3 = (_layout(key).groups() for key in ("gpt_oss", "gemma3"))
    assert vllm_scheduler.hybrid_num_blocks(gpt_oss, 256) == 65_536 + 256 * 9 + 512
    assert vllm_scheduler.hybrid_num_blocks(gemma3, 256) == 65_536 + 6 * (256 * 65 + 512)


@needs_kvblocks_vllm
def test_hybrid_harness_with_vllm_on_both_sides_says_fallback() -> None:
    """vLLM's own Scheduler in the native column: the row runs, both columns agree step
    for step, and its description refuses to call it a kvblocks measurement."""
    workload = vllm_scheduler.vllm_scheduler_hybrid(
        _layout("gpt_oss"), 32, steps=8, kvblocks_cls=_stock()
    )
    assert workload.name == "vllm_scheduler_gpt_oss_32"
    assert workload.self_timed and not workload.has_reference
    manager = "vllm.v1.core.kv_cache_manager.KVCacheManager"
    assert workload.description.endswith(
        f"{_FALLBACK}: kvblocks' scheduler ran {manager}, vLLM's ran {manager}"
    )
    result = _run(workload)
    assert result.vllm_error is None
    assert len(result.rust_s) == len(result.vllm_s) == 2
    assert _FALLBACK in bench.markdown_table([result])


@needs_kvblocks_vllm
@pytest.mark.parametrize("key", ["gpt_oss", "gemma3"])
def test_hybrid_row_runs_and_names_its_managers(key: str) -> None:
    """kvblocks' scheduler on a multi-group layout: the row runs (one block table per
    group, sliding windows freed), and its description names the manager class of each
    side, with FALLBACK exactly when kvblocks' scheduler did not run kvblocks' manager."""
    layout = _layout(key)
    managers = vllm_scheduler.hybrid_managers(layout, 32)
    vllm_manager = importlib.import_module("vllm.v1.core.kv_cache_manager").KVCacheManager
    assert managers.vllm_side is vllm_manager
    assert managers.fallback == (not managers.kvblocks_side.__module__.startswith("kvblocks."))
    workload = vllm_scheduler.vllm_scheduler_hybrid(layout, 32, steps=8)
    assert workload.name == f"vllm_scheduler_{key}_32"
    native = f"{managers.kvblocks_side.__module__}.{managers.kvblocks_side.__qualname__}"
    assert native in workload.description
    assert "vllm.v1.core.kv_cache_manager.KVCacheManager" in workload.description
    assert (_FALLBACK in workload.description) == managers.fallback
    result = _run(workload, rounds=1)
    assert result.vllm_error is None
    assert result.vllm_ratio is not None and result.vllm_ratio > 0


@needs_kvblocks_vllm
def test_hybrid_table_check_catches_a_window_not_freed() -> None:
    """A sliding-window group that keeps every block of a request far past its window
    fails the round's check; one that holds only its window passes."""
    from kvblocks.bench.vllm_scheduler import _table_check  # noqa: PLC0415 (a private name, for this test only)
    from kvblocks.vllm.cpu import GPT_OSS_LIKE  # noqa: PLC0415 (imports vLLM)

    request = SimpleNamespace(request_id="r0", num_output_tokens=40, num_computed_tokens=640)
    full = list(range(1, 41))
    tables = {"freed": ([0] * 31 + full[31:], full), "kept": (full, full)}

    def driver(kind: str) -> Any:
        manager = SimpleNamespace(get_block_ids=lambda request_id: tables[kind])
        return SimpleNamespace(
            scheduler=SimpleNamespace(running=[request], kv_cache_manager=manager)
        )

    _table_check(driver("freed"), GPT_OSS_LIKE)
    with pytest.raises(AssertionError, match="window 128\\) holds 39 blocks at 640 tokens"):
        _table_check(driver("kept"), GPT_OSS_LIKE)


def test_step_instructions_counts_each_scheduler_call_inside_one_toggle() -> None:
    """``benches/step_instructions.py`` counts inside ``functools.reduce`` only: each
    ``schedule()`` and ``update_from_output()`` of the counted steps runs inside exactly
    one call of it, and the steps still run."""
    calls: list[str] = []

    def reduce(function: Any, items: Any, initial: Any) -> Any:
        calls.append(function.__code__.co_name)
        return functools.reduce(function, items, initial)

    driver = vllm_scheduler.vllm_scheduler(32, steps=8, kvblocks_cls=_stock()).vllm_setup()  # type: ignore[misc]
    before = len(driver.scheduled)
    step_instructions.count_steps(driver, 3, reduce)
    assert len(driver.scheduled) == before + 3
    assert len(calls) == 6


def test_step_instructions_reads_callgrinds_count() -> None:
    stderr = "==1== Events    : Ir\n==1== Collected : 878812216\n==1==\n==1== I   refs:  9\n"
    assert step_instructions.collected(stderr) == 878_812_216
    with pytest.raises(RuntimeError, match="no count in valgrind's output"):
        step_instructions.collected("==1== I   refs:  9\n")
