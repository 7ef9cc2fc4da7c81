"""Hybrid layouts with salted requests: a cache salt enters the first block's hash and
the extra keys of that block's ``BlockStored``, in every group's event, including groups
whose window stores only some of a step's blocks. kvblocks' events must carry them as
vLLM's do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import harness
import pytest
from kvblocks.vllm import HybridKVCacheManager
from kvblocks.vllm._version_check import installed_differences
from vllm.v1.request import Request

pytestmark = pytest.mark.skipif(
    not installed_differences().hybrid_layouts,
    reason="before vLLM 0.33 these layouts run on vLLM's own manager "
    "(test_layouts.py::test_managed checks that, with the reason)",
)

SEEDS = 6


def salted_request(*args: Any, **kwargs: Any) -> Any:
    """vLLM's ``Request``, salted for every other request id."""
    if harness.crc(kwargs["request_id"]) % 2:
        kwargs["cache_salt"] = f"salt-{harness.crc(kwargs['request_id']) % 3}"
    return Request(*args, **kwargs)


SCENARIOS = [
    f"{family}-s{seed}-{engine}"
    for family in ("swa", "gpt-oss", "gemma3", "gemma4")
    for engine in harness.ENGINES
    for seed in range(SEEDS)
]


@pytest.mark.parametrize("scenario_id", SCENARIOS)
def test_same_events_with_salted_requests(
    scenario_id: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(harness.driver, "Request", salted_request)
    scn = harness.make_scenario(*harness.parse_scenario_id(scenario_id))
    _, other, mismatch = harness.differential(scn, tiny_model_dir)
    assert issubclass(other.manager_type, HybridKVCacheManager), other.manager_cls
    assert mismatch is None, str(mismatch)


def test_salted_events_carry_the_salt(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scenarios above publish salted extra keys in a group other than 0 (so the
    comparison looks at them)."""
    monkeypatch.setattr(harness.driver, "Request", salted_request)
    salted_groups: set[int] = set()
    for scenario_id in SCENARIOS:
        scn = harness.make_scenario(*harness.parse_scenario_id(scenario_id))
        if not scn.events:
            continue
        run = harness.run_scenario(scn, harness.kvblocks_class(scn), tiny_model_dir)
        for record in run.records:
            for batch in record.get("events", []):
                for event in batch:
                    keys = event.get("extra_keys") if isinstance(event, dict) else None
                    if keys and any(k is not None for k in keys):
                        salted_groups.add(event.get("group_idx", 0))
    assert salted_groups - {0}, salted_groups
