"""vLLM's Scheduler behaves the same with kvblocks' KV cache manager as with its own.

Every scenario (``harness.make_scenario``) runs twice in this process: once on vLLM's
``Scheduler``/``AsyncScheduler`` and once on ``KVBlocksScheduler``/``KVBlocksAsyncScheduler``,
with the same requests, the same fake model outputs and the same connector results. At
every step the normalised ``SchedulerOutput`` (block ids, scheduled tokens, preemptions,
connector metadata), the ``EngineCoreOutputs`` (tokens, finish reasons, ``prefill_stats``,
``SchedulerStats`` with ``kv_cache_usage`` and prefix-cache stats), the published KV events
and the results of ``reset_prefix_cache`` must be equal.

The base families (``harness.BASE_FAMILIES``) run ``SEEDS_PER_FAMILY`` seeds per engine;
the combination families (``harness.COMBINATION_FAMILIES``: ``async-spec-fail``,
``priority``, ``small-blocks``, ``combined``) run ``COMBINATION_SEEDS`` in CI, and
``KVBLOCKS_DIFF_SEEDS=N`` runs N seeds per engine of each of them instead (an opt-in soak;
``KVBLOCKS_DIFF_SEEDS=2000 pytest tests/vllm/test_differential.py -k combined`` runs the
``combined`` family alone). Each combination family must reach the paths it exists for
(``COMBINATION_REQUIRED``, counted on vLLM's runs).

``KVBLOCKS_DIFF_FRACTION=0.25`` runs the first quarter of every family's seeds (CI does on
the older vLLM releases; the coverage checks then stand aside, as they count the whole set).

``KVBLOCKS_DIFF_CANDIDATE=stock`` runs vLLM's class on both sides (a self-check of the
harness). A failure prints the step, each differing field with both values, and the command
that replays the scenario alone.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import harness
import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

SEEDS_PER_FAMILY = 20
#: Seeds per engine of each combination family in CI.
COMBINATION_SEEDS = {"async-spec-fail": 100, "priority": 40, "small-blocks": 40, "combined": 100}
CANDIDATE = os.environ.get("KVBLOCKS_DIFF_CANDIDATE", "kvblocks")


def _combination_seeds() -> dict[str, int]:
    """``COMBINATION_SEEDS``, or ``KVBLOCKS_DIFF_SEEDS`` seeds for every combination family."""
    text = os.environ.get("KVBLOCKS_DIFF_SEEDS", "").strip()
    if not text:
        return COMBINATION_SEEDS
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"KVBLOCKS_DIFF_SEEDS must be a positive integer, not {text!r}")
    return dict.fromkeys(harness.COMBINATION_FAMILIES, int(text))


def _fraction() -> float:
    """``KVBLOCKS_DIFF_FRACTION``: the share of each family's seeds that runs (default 1)."""
    text = os.environ.get("KVBLOCKS_DIFF_FRACTION", "").strip() or "1"
    try:
        fraction = float(text)
    except ValueError:
        fraction = 0.0
    if not 0 < fraction <= 1:
        raise ValueError(f"KVBLOCKS_DIFF_FRACTION must be in (0, 1], not {text!r}")
    return fraction


FRACTION = _fraction()
SEEDS = {
    family: math.ceil(seeds * FRACTION)
    for family, seeds in {
        **dict.fromkeys(harness.BASE_FAMILIES, SEEDS_PER_FAMILY),
        **_combination_seeds(),
    }.items()
}

SCENARIO_IDS = [
    f"{family}-s{seed}-{engine}"
    for family in harness.FAMILIES
    for engine in harness.FAMILY_ENGINES[family]
    for seed in range(SEEDS[family])
]

#: What the reference runs exercised, by engine; checked once every scenario has run.
COVERAGE: dict[str, Counter[str]] = {engine: Counter() for engine in harness.ENGINES}
#: The same, by family and engine.
FAMILY_COVERAGE: dict[tuple[str, str], Counter[str]] = {
    (family, engine): Counter()
    for family in harness.FAMILIES
    for engine in harness.FAMILY_ENGINES[family]
}
SEEN: set[str] = set()


@pytest.fixture(scope="module")
def candidate() -> str:
    """The scheduler compared with vLLM's: kvblocks' (default) or vLLM's own (``stock``)."""
    if CANDIDATE == "kvblocks":
        try:
            import kvblocks.vllm  # noqa: F401, PLC0415 (a failed import fails the test, naming the fix)
        except ImportError as exc:
            pytest.fail(
                f"kvblocks.vllm is not importable in this environment ({exc}); install "
                "kvblocks into the vLLM venv, or set KVBLOCKS_DIFF_CANDIDATE=stock to check "
                "the harness against vLLM alone"
            )
    elif CANDIDATE != "stock":
        pytest.fail(f"KVBLOCKS_DIFF_CANDIDATE must be 'kvblocks' or 'stock', not {CANDIDATE!r}")
    return CANDIDATE


def _assert_kvblocks_manager(result: harness.RunResult, candidate: str) -> None:
    if candidate != "kvblocks":
        return
    from kvblocks.vllm import KVCacheManager  # noqa: PLC0415 (only the kvblocks candidate needs it)

    assert issubclass(result.manager_type, KVCacheManager), (
        f"{result.scenario_id}: {result.scheduler_cls} built {result.manager_cls}, not "
        "kvblocks.vllm.KVCacheManager, for a configuration kvblocks supports"
    )


@pytest.mark.parametrize("scenario_id", SCENARIO_IDS)
def test_same_as_vllm(scenario_id: str, tiny_model_dir: Path, candidate: str) -> None:
    scn = harness.make_scenario(*harness.parse_scenario_id(scenario_id))
    reference, other, mismatch = harness.differential(scn, tiny_model_dir, candidate)
    COVERAGE[scn.engine].update(reference.coverage)
    FAMILY_COVERAGE[scn.family, scn.engine].update(reference.coverage)
    SEEN.add(scenario_id)
    assert "exception" not in reference.records[-1], (
        f"{scenario_id}: vLLM's own scheduler raised: {reference.records[-1]['exception']}"
    )
    assert reference.finished or reference.stalled or reference.livelocked, (
        f"{scenario_id}: vLLM's own scheduler did not finish in {scn.max_steps} steps"
    )
    _assert_kvblocks_manager(other, candidate)
    assert mismatch is None, str(mismatch)


REPEATS = 6


def test_requests_failing_together_finish_in_vllm_order(
    tiny_model_dir: Path, candidate: str
) -> None:
    """When several requests fail in one step, the candidate finishes (and frees) them in
    vLLM's order on every run (``harness.failing_together``), under this process's seed."""
    checked, mismatches = harness.failing_together(
        tiny_model_dir, candidate, SEEDS_PER_FAMILY, REPEATS
    )
    assert checked, "no scenario failed several requests in one step"
    assert not mismatches, "\n".join(str(m) for m in mismatches)


@pytest.mark.parametrize("hash_seed", ["0"])
def test_requests_failing_together_under_a_fixed_hash_seed(hash_seed: str, candidate: str) -> None:
    """The same check in a subprocess with a fixed ``PYTHONHASHSEED``, so ids that collide
    in vLLM's set do so on every run of the suite (this process's seed is random)."""
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(harness.__file__).parent),
            "--failing-together",
            candidate,
            "--repeat",
            "4",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    report = [line for line in proc.stdout.splitlines() if not line.startswith(("INFO", "WARN"))]
    assert proc.returncode == 0, (
        f"PYTHONHASHSEED={hash_seed}: " + "\n".join(report) + "\n" + proc.stderr[-2000:]
    )


#: Paths every engine's scenarios must take at least once (counted on vLLM's runs).
REQUIRED_EVERYWHERE = (
    "prefix_hit",
    "multiturn",
    "prefill_chunk",
    "preempted",
    "resumed",
    "stats_preempted",
    "aborted",
    "reset_ok",
    "reset_ok_running",
    "reset_refused",
    "stats_reset",
    "spec_scheduled",
    "spec_accepted",
    "event_batches",
    "prefill_stats_cached",
    "load_sync",
    "load_async",
    "invalid_sync:recompute",
    "invalid_sync:fail",
    "invalid_async:recompute",
    "invalid_async:fail",
    "failed_recving:recompute",
    "failed_recving:fail",
    "finished_error",
    "multi_error_step",
    "call:evict_blocks",
    "call:cache_blocks",
)
#: Paths only overlapping batches take: deferred frees need a step still in flight.
REQUIRED_ASYNC = ("call:pop_blocks_for_free", "deferred_frees_pending", "abort_remote_kv")


def test_scenarios_cover_every_path() -> None:
    """The scenarios above reach every path the suite claims to test (on vLLM's runs)."""
    if FRACTION < 1:
        pytest.skip(f"KVBLOCKS_DIFF_FRACTION={FRACTION}: coverage counts the whole set")
    if len(SEEN) < len(SCENARIO_IDS):
        pytest.skip("needs every scenario of test_same_as_vllm to have run first")
    assert len(SCENARIO_IDS) >= 200
    for engine, counts in COVERAGE.items():
        required = REQUIRED_EVERYWHERE + (REQUIRED_ASYNC if engine == "async" else ())
        missing = [key for key in required if not counts[key]]
        assert not missing, f"{engine} scenarios never reached {missing}: {dict(counts)}"


#: The spec-decode and connector-failure paths overlapping batches take together: vLLM
#: calls ``cache_blocks`` with a negative count when a sync load's invalid blocks cut back a
#: request that a later, already scheduled batch holds tokens of (``invalid_sync_in_flight``),
#: and its invalid-block scan meets requests with fewer computed tokens than the reported
#: batch scheduled (``invalid_scan_behind``).
_ASYNC_SPEC_FAIL = (
    "call:cache_blocks_negative",
    "invalid_sync_in_flight_spec",
    "invalid_scan_behind",
    "spec_rejected",
    "invalid_with_spec:recompute",
    "invalid_with_spec:fail",
    "failed_recving:recompute",
    "failed_recving:fail",
    "finished_error",
    "deferred_frees_pending",
)
_PRIORITY = ("preempted:priority", "stats_preempted", "resumed", "prefix_hit")
_SMALL_BLOCKS = ("preempted:bs1", "preempted:bs2", "prefix_hit", "spec_rejected")
#: What each combination family reaches on each engine (on vLLM's runs, over its seeds).
COMBINATION_REQUIRED: dict[tuple[str, str], tuple[str, ...]] = {
    ("async-spec-fail", "async"): _ASYNC_SPEC_FAIL,
    ("priority", "sync"): _PRIORITY,
    ("priority", "async"): _PRIORITY,
    ("small-blocks", "sync"): _SMALL_BLOCKS,
    ("small-blocks", "async"): _SMALL_BLOCKS,
    ("combined", "sync"): (
        "preempted:priority",
        "preempted:bs1",
        "spec_rejected",
        "invalid_with_spec:recompute",
        "invalid_with_spec:fail",
    ),
    ("combined", "async"): (
        # vLLM 0.33's Scheduler caches during sync spec decode, which reaches it here too;
        # before 0.33 only async-spec-fail does.
        *(("call:cache_blocks_negative",) if harness.VLLM_SERIES >= (0, 33) else ()),
        "preempted:priority",
        "preempted:bs1",
        "spec_rejected",
        "invalid_with_spec:recompute",
        "invalid_with_spec:fail",
    ),
}


def test_combination_families_reach_their_paths() -> None:
    """Each combination family, on each engine whose scenarios all ran, reached the paths
    it exists for (on vLLM's runs): a negative ``cache_blocks`` count, spec-decode rejections
    with overlapping batches, invalid blocks while spec decode runs, priority preemptions,
    preemptions with blocks of 1 and 2 tokens."""
    if FRACTION < 1:
        pytest.skip(f"KVBLOCKS_DIFF_FRACTION={FRACTION}: coverage counts the whole set")
    assert set(COMBINATION_REQUIRED) == {
        (family, engine)
        for family in harness.COMBINATION_FAMILIES
        for engine in harness.FAMILY_ENGINES[family]
    }
    complete = [
        (family, engine)
        for family, engine in COMBINATION_REQUIRED
        if all(f"{family}-s{seed}-{engine}" in SEEN for seed in range(SEEDS[family]))
    ]
    if not complete:
        pytest.skip("needs every scenario of a combination family to have run first")
    for family, engine in complete:
        counts = FAMILY_COVERAGE[family, engine]
        missing = [key for key in COMBINATION_REQUIRED[family, engine] if not counts[key]]
        assert not missing, f"{family}/{engine} scenarios never reached {missing}: {dict(counts)}"


# --------------------------------------------------------------------------------------
# The comparison can fail
# --------------------------------------------------------------------------------------


class _ManagerProxy:
    """Delegates to a KV cache manager, with some members replaced."""

    def __init__(self, inner: Any, **overrides: Any) -> None:
        self._inner = inner
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _extra_block(cls: type[Scheduler]) -> type[Scheduler]:
    """``cls`` whose manager holds one block for a request the scheduler never sees."""

    class ExtraBlock(cls):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            hidden = Request(
                request_id="__hidden__",
                prompt_token_ids=[1] * self.block_size,
                sampling_params=SamplingParams(max_tokens=1),
                pooling_params=None,
                arrival_time=0.0,
                block_hasher=get_request_block_hasher(self.block_size, sha256),
            )
            assert self.kv_cache_manager.allocate_slots(hidden, self.block_size) is not None

    return ExtraBlock


def _with_manager(cls: type[Scheduler], **overrides: Any) -> type[Scheduler]:
    """``cls`` whose manager is seen through a proxy replacing ``overrides``."""

    class Perturbed(cls):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            inner = vars(self)["kv_cache_manager"]
            bound = {name: make(inner) for name, make in overrides.items()}
            self.kv_cache_manager = _ManagerProxy(inner, **bound)

    return Perturbed


def _cached_plus_one(inner: Any) -> Any:
    return lambda request: inner.estimate_cached_tokens(request) + 1


def _no_events(inner: Any) -> Any:
    def take_events() -> list[Any]:
        inner.take_events()
        return []

    return take_events


PERTURBATIONS = {
    # (how the candidate is perturbed, a field the first difference must name)
    "extra-block": (_extra_block, "block_ids"),
    "cached-tokens": (
        lambda cls: _with_manager(cls, estimate_cached_tokens=_cached_plus_one),
        "prefill_stats",
    ),
    "events": (lambda cls: _with_manager(cls, take_events=_no_events), "events"),
}


@pytest.mark.parametrize("engine", harness.ENGINES)
@pytest.mark.parametrize("perturbation", sorted(PERTURBATIONS))
def test_comparison_reports_a_perturbed_manager(
    perturbation: str, engine: str, tiny_model_dir: Path, candidate: str
) -> None:
    """A manager that differs (one block too many, a cached-token count off by one, events
    dropped) is reported, at the step and field where it first shows."""
    scn = dataclasses.replace(harness.make_scenario("prefix", 1, engine), events=True)
    base = harness.candidate_class(scn, candidate)
    perturb, field = PERTURBATIONS[perturbation]
    reference = harness.run_scenario(scn, harness.stock_class(scn), tiny_model_dir)
    assert reference.coverage["prefill_stats_cached"] and reference.coverage["event_batches"]
    perturbed = harness.run_scenario(scn, perturb(base), tiny_model_dir)
    mismatch = harness.compare_runs(reference, perturbed)
    assert mismatch is not None, f"the comparison missed the {perturbation} perturbation"
    assert any(field in path for path, _, _ in mismatch.diffs), str(mismatch)
    text = str(mismatch)
    assert f"step {mismatch.step}" in text
    assert "reference:" in text
    assert "candidate:" in text
    assert f"harness {scn.scenario_id}" in text


def test_comparison_reports_different_inputs(tiny_model_dir: Path) -> None:
    """Two different scenarios on the same scheduler class differ (in the prompts)."""
    one = harness.make_scenario("prefix", 0, "sync")
    two = harness.make_scenario("prefix", 1, "sync")
    first = harness.run_scenario(one, Scheduler, tiny_model_dir)
    second = harness.run_scenario(two, Scheduler, tiny_model_dir)
    mismatch = harness.compare_runs(first, second)
    assert mismatch is not None
    assert any("prompt_token_ids" in path for path, _, _ in mismatch.diffs), str(mismatch)
    assert harness.compare_runs(first, harness.run_scenario(one, Scheduler, tiny_model_dir)) is None


def test_normalise_refuses_unknown_objects() -> None:
    """A field holding an object the normaliser does not know is an error, not ignored."""
    with pytest.raises(TypeError, match=r"at so\.field"):
        harness.normalise(object(), "so.field")
    assert harness.normalise({"b": {2, 1}, "a": (b"\x01",)}) == [["b", [1, 2]], ["a", ["01"]]]


def test_scenario_ids_round_trip() -> None:
    for scenario_id in SCENARIO_IDS[:: len(harness.FAMILIES)]:
        scn = harness.make_scenario(*harness.parse_scenario_id(scenario_id))
        assert scn.scenario_id == scenario_id
        assert scn == harness.make_scenario(scn.family, scn.seed, scn.engine)


@pytest.mark.parametrize("engine", harness.ENGINES)
def test_comparison_reports_another_releases_rules(
    engine: str, tiny_model_dir: Path, candidate: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvblocks' manager under vLLM 0.32's rules (no cascade common-prefix count) is
    reported on 0.31, at the field where it first shows: the per-release rules are
    what make the suite pass there."""
    if candidate != "kvblocks":
        pytest.skip("the release rules are kvblocks' own")
    if harness.VLLM_SERIES != (0, 31):
        pytest.skip("only vLLM 0.31's Scheduler asks for the common-prefix count")
    import kvblocks.vllm.manager as kvblocks_manager  # noqa: PLC0415 (the candidate fixture checked it imports)
    from kvblocks.vllm._version_check import installed_differences  # noqa: PLC0415

    planted = dataclasses.replace(installed_differences(), series=(0, 32))
    scn = harness.make_scenario("prefix", 1, engine)
    reference = harness.run_scenario(scn, harness.stock_class(scn), tiny_model_dir)
    monkeypatch.setattr(kvblocks_manager, "installed_differences", lambda: planted)
    planted_run = harness.run_scenario(scn, harness.candidate_class(scn, candidate), tiny_model_dir)
    mismatch = harness.compare_runs(reference, planted_run)
    assert mismatch is not None, "the comparison missed the other release's rule"
    assert any("num_common_prefix_blocks" in path for path, _, _ in mismatch.diffs), str(mismatch)
