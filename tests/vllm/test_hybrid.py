"""vLLM 0.33.0's Scheduler behaves the same with kvblocks' KV cache manager as with its own
on hybrid layouts: one sliding-window group, full attention with sliding-window groups
(gpt-oss-like, Gemma-3-like) and full attention with chunked-local groups (Llama-4-like).

Each scenario of ``harness.HYBRID_FAMILIES`` runs on vLLM's ``Scheduler``/``AsyncScheduler``
twice, once with vLLM's manager and once with kvblocks', and every step's scheduler output,
engine outputs, KV events and stats must be equal (``harness.compare_runs``). vLLM's runs
are instrumented (``hybrid_probe.counting``) to show that the scenarios reach the paths
these layouts exist for, and faults planted in vLLM's own classes show that the
comparison catches a manager that gets one of them slightly wrong.

``SEEDS`` seeds run per family and engine; ``KVBLOCKS_HYBRID_SEEDS=N`` runs N instead (a
soak: ``KVBLOCKS_HYBRID_SEEDS=1000 pytest tests/vllm/test_hybrid.py -k gemma3``).
``KVBLOCKS_DIFF_CANDIDATE=stock`` compares vLLM's manager with itself (a self-check of the
harness). ``python tests/vllm/harness gemma3-s7-async`` replays one scenario.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from pathlib import Path

import harness
import hybrid_probe
import pytest
from kvblocks.vllm._version_check import installed_differences

pytestmark = pytest.mark.skipif(
    not installed_differences().hybrid_layouts,
    reason="before vLLM 0.33 these layouts run on vLLM's own manager "
    "(test_layouts.py::test_managed checks that, with the reason)",
)

SEEDS = 100
CANDIDATE = os.environ.get("KVBLOCKS_DIFF_CANDIDATE", "kvblocks")
#: What vLLM's own scheduler may raise in these scenarios: block-level load failures with
#: several KV cache groups (the run ends there, on both sides).
REFUSED = "RuntimeError: A KV connector reported block-level load failures (invalid_block_ids)"


def _seeds() -> int:
    text = os.environ.get("KVBLOCKS_HYBRID_SEEDS", "").strip()
    if not text:
        return SEEDS
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"KVBLOCKS_HYBRID_SEEDS must be a positive integer, not {text!r}")
    return int(text)


SCENARIO_IDS = [
    f"{family}-s{seed}-{engine}"
    for family in harness.HYBRID_FAMILIES
    for engine in harness.FAMILY_ENGINES[family]
    for seed in range(_seeds())
]

#: What vLLM's runs reached, by family (the probe's counters and the driver's).
COVERAGE: dict[str, Counter[str]] = {family: Counter() for family in harness.HYBRID_FAMILIES}
SEEN: set[str] = set()


@pytest.fixture(scope="module")
def candidate() -> str:
    """The scheduler compared with vLLM's: kvblocks' (default) or vLLM's own (``stock``)."""
    if CANDIDATE not in ("kvblocks", "stock"):
        pytest.fail(f"KVBLOCKS_DIFF_CANDIDATE must be 'kvblocks' or 'stock', not {CANDIDATE!r}")
    return CANDIDATE


def _reference(scn: harness.Scenario, model_dir: Path) -> tuple[harness.RunResult, Counter[str]]:
    """vLLM's run of ``scn``, with what it reached (the probe's counters added in)."""
    with hybrid_probe.counting() as counts:
        reference = harness.run_scenario(
            scn, harness.stock_class(scn), model_dir, count_manager_calls=True
        )
    counts.update(reference.coverage)
    return reference, counts


@pytest.mark.parametrize("scenario_id", SCENARIO_IDS)
def test_same_as_vllm(scenario_id: str, tiny_model_dir: Path, candidate: str) -> None:
    """kvblocks' manager (the candidate's) does at every step what vLLM's does; vLLM raises
    only where it refuses block-level load failures with several groups."""
    scn = harness.make_scenario(*harness.parse_scenario_id(scenario_id))
    reference, counts = _reference(scn, tiny_model_dir)
    other = harness.run_scenario(scn, harness.candidate_class(scn, candidate), tiny_model_dir)
    COVERAGE[scn.family].update(counts)
    SEEN.add(scenario_id)
    raised = reference.records[-1].get("exception")
    assert raised is None or raised.startswith(REFUSED), f"{scenario_id}: vLLM raised {raised}"
    assert reference.finished or reference.stalled or reference.livelocked or raised, (
        f"{scenario_id}: vLLM's own scheduler did not finish in {scn.max_steps} steps"
    )
    if candidate == "kvblocks":
        assert other.manager_type.__module__.startswith("kvblocks"), (
            f"{scenario_id}: {other.scheduler_cls} built {other.manager_cls}, not kvblocks' "
            "manager, for a hybrid layout kvblocks supports"
        )
    mismatch = harness.compare_runs(reference, other)
    assert mismatch is None, str(mismatch)


#: What each family's scenarios reach on vLLM's runs (all engines together).
_EVERY_FAMILY = ("preempted", "prefix_hit", "prefill_chunk", "resumed", "event_batches")
_WINDOWS = ("swa_window_free", "swa_null_hit_admitted")
#: What several groups bring: junctions, refused block-level failures, deferred frees.
_GROUPS = ("junction", "invalid_blocks_refused", "call:pop_blocks_for_free")
REQUIRED: dict[str, tuple[str, ...]] = {
    "swa": (*_EVERY_FAMILY, *_WINDOWS, "invalid_sync:recompute", "invalid_async:fail"),
    "gpt-oss": (*_EVERY_FAMILY, *_WINDOWS, *_GROUPS, "retention0_miss"),
    "gemma3": (
        *_EVERY_FAMILY,
        *_WINDOWS,
        *_GROUPS,
        "retention0_miss",
        "joint_lookup_miss",
        "fixed_point_rounds>1",
    ),
    "llama4": (
        *_EVERY_FAMILY,
        *_GROUPS,
        "chunked_window_free",
        "chunked_null_hit_admitted",
        "joint_lookup_miss",
    ),
    "gemma4": (
        *_EVERY_FAMILY,
        *_WINDOWS,
        *_GROUPS,
        "retention0_miss",
        "partial_tail_key",
        "partial_tail_evicted",
    ),
}
#: What the families reach together, besides every counter of ``hybrid_probe.COUNTERS``:
#: request-level load failures under both policies.
REQUIRED_SOMEWHERE = (*hybrid_probe.COUNTERS, "failed_recving:recompute", "failed_recving:fail")


def test_scenarios_cover_the_hybrid_paths() -> None:
    """vLLM's runs of the scenarios above reached the paths hybrid layouts exist for:
    out-of-window frees, null-padded hits admitted, joint lookups missing in some groups,
    fixed points of several rounds, junctions, retention-0 misses, preemptions, refused
    block-level failures and deferred frees."""
    if len(SEEN) < len(SCENARIO_IDS):
        pytest.skip("needs every scenario of test_same_as_vllm to have run first")
    for family, keys in REQUIRED.items():
        missing = [key for key in keys if not COVERAGE[family][key]]
        assert not missing, f"{family} never reached {missing}: {dict(COVERAGE[family])}"
    total = sum(COVERAGE.values(), Counter())
    missing = [key for key in REQUIRED_SOMEWHERE if not total[key]]
    assert not missing, f"no family reached {missing}: {dict(total)}"


def test_a_connector_without_hma_and_several_groups(tiny_model_dir: Path, candidate: str) -> None:
    """vLLM builds the scheduler with several groups and a connector without
    ``SupportsHMA`` (on a CPU the hybrid manager is off, so nothing checks the connector),
    then fails an ``assert`` in ``_connector_finished`` when the first request finishes;
    the candidate fails the same way at the same step."""
    scn = next(
        scn
        for seed in range(20)
        if (scn := harness.make_scenario("gpt-oss", seed, "sync")).connector_policy
    )
    scn = dataclasses.replace(scn, connector_hma=False)
    reference = harness.run_scenario(scn, harness.stock_class(scn), tiny_model_dir)
    assert reference.records[-1].get("exception") == "AssertionError: "
    other = harness.run_scenario(scn, harness.candidate_class(scn, candidate), tiny_model_dir)
    mismatch = harness.compare_runs(reference, other)
    assert mismatch is None, str(mismatch)


# --------------------------------------------------------------------------------------
# The comparison catches a planted fault
# --------------------------------------------------------------------------------------

#: The seeds of ``PLANT_FAMILIES`` scanned for a scenario that shows a fault.
PLANT_SEEDS = 40


def _can_show(plant: str, scn: harness.Scenario) -> bool:
    """Whether ``scn`` takes the path ``plant`` breaks (the others are not run)."""
    if plant == "dense-retention":
        return scn.enable_caching and scn.retention_interval == 0
    if plant == "reversed-deferred-free":
        # Deferred frees: overlapping batches with a connector that loads.
        return scn.is_async and scn.connector_policy is not None
    if plant == "no-partial-tail":
        return scn.enable_caching and _wide_full(scn)
    return True


def _wide_full(scn: harness.Scenario) -> bool:
    """Whether the full-attention group's blocks are larger than the hash block."""
    return any(group.kind == "full" and group.block_size == scn.block_size for group in scn.layout)


#: The family and engine whose scenarios each fault is planted in.
PLANT_FAMILIES = {
    "dense-retention": ("gpt-oss", "sync"),
    "no-window-free": ("gpt-oss", "sync"),
    "reversed-deferred-free": ("gemma3", "async"),
    "no-partial-tail": ("gemma4", "sync"),
}


@pytest.mark.parametrize("plant", sorted(hybrid_probe.PLANTS))
def test_comparison_catches_a_planted_fault(plant: str, tiny_model_dir: Path) -> None:
    """vLLM's own manager with a fault planted in it (only while the candidate runs)
    differs from vLLM's manager within a few scenarios: a dense cache under retention 0,
    a missing out-of-window free, deferred frees in reversed group order, no partial
    prompt-tail keys."""
    family, engine = PLANT_FAMILIES[plant]
    tried: list[str] = []
    for seed in range(PLANT_SEEDS):
        scn = harness.make_scenario(family, seed, engine)
        if not _can_show(plant, scn):
            continue
        tried.append(scn.scenario_id)
        reference = harness.run_scenario(scn, harness.stock_class(scn), tiny_model_dir)
        with hybrid_probe.planted(plant):
            planted = harness.run_scenario(scn, harness.stock_class(scn), tiny_model_dir)
        if harness.compare_runs(reference, planted) is not None:
            return
    pytest.fail(f"the {plant} fault went unnoticed in {tried}")


# --------------------------------------------------------------------------------------
# The scenarios
# --------------------------------------------------------------------------------------


def test_scenario_ids_round_trip() -> None:
    for scenario_id in SCENARIO_IDS[::7]:
        scn = harness.make_scenario(*harness.parse_scenario_id(scenario_id))
        assert scn.scenario_id == scenario_id
        assert scn == harness.make_scenario(scn.family, scn.seed, scn.engine)


def test_layouts_are_the_families() -> None:
    """Each family draws its layout: the group kinds, group orders, windows below the
    prompts' lengths, retention intervals vLLM accepts (0, None, a multiple of the block
    size), and a connector with ``SupportsHMA`` wherever there are several groups."""
    kinds: dict[str, set[tuple[str, ...]]] = {family: set() for family in harness.HYBRID_FAMILIES}
    full_at: dict[str, set[int]] = {family: set() for family in harness.HYBRID_FAMILIES}
    windows_per_layout: Counter[int] = Counter()
    retentions: Counter[str] = Counter()
    wide_full: set[bool] = set()
    for scenario_id in SCENARIO_IDS:
        scn = harness.make_scenario(*harness.parse_scenario_id(scenario_id))
        kinds[scn.family].add(tuple(sorted({group.kind for group in scn.layout})))
        if len(scn.layout) > 1:
            full_at[scn.family].add([group.kind for group in scn.layout].index("full"))
        if scn.family == "gemma3":
            windows_per_layout[len({group.window for group in scn.layout}) - 1] += 1
        if scn.family == "gemma4":
            wide_full.add(_wide_full(scn))
        assert scn.connector_hma or len(scn.layout) == 1, scenario_id
        windows = [group.window for group in scn.layout if group.window is not None]
        longest = max(len(spec.prompt) for spec in scn.requests)
        assert all(window < longest for window in windows), scenario_id
        retention = scn.retention_interval
        assert retention is None or retention % scn.block_size == 0, scenario_id
        retentions["none" if retention is None else "zero" if retention == 0 else "k"] += 1
    assert kinds == {
        "swa": {("sliding_window",)},
        "gpt-oss": {("full", "sliding_window")},
        "gemma3": {("full", "sliding_window")},
        "llama4": {("chunked_local", "full")},
        "gemma4": {("full", "sliding_window")},
    }
    assert retentions["zero"] > retentions["none"] > 0
    assert retentions["k"] > 0
    # The full-attention group first, last and (with 3 groups or more) in between.
    assert full_at["gpt-oss"] == {0, 1}, full_at
    assert all(len(full_at[family]) > 2 for family in ("gemma3", "llama4")), full_at
    assert set(windows_per_layout) == {1, 2}, windows_per_layout
    assert wide_full == {True, False}, "gemma4 draws both block-size orientations"
