"""``with_kvblocks`` puts kvblocks' manager under any vLLM scheduler class.

A third-party scheduler is an ``AsyncScheduler`` (or ``Scheduler``) subclass that reads
the manager's members as NVIDIA Dynamo's ``InstrumentedScheduler`` does
(``coordinator``, ``block_pool``, ``watermark_blocks``, ``use_eagle``,
``take_new_block_ids()``, ``free()``). The differential scenarios run through it twice:
as it is (vLLM's manager) and through ``with_kvblocks`` (kvblocks'), with no difference.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import harness
import pytest
from kvblocks.vllm import (
    KVBlocksAsyncScheduler,
    KVBlocksScheduler,
    KVCacheManager,
    with_kvblocks,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request


class Instrumented:
    """Reads the manager's members each step, as Dynamo's instrumented scheduler does."""

    reads: list[tuple[Any, ...]]
    kv_cache_manager: Any

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        manager = self.kv_cache_manager
        pool = manager.block_pool
        if not hasattr(self, "reads"):
            self.reads = []
        self.reads.append(
            (
                len(manager.coordinator.single_type_managers),
                pool.get_num_free_blocks(),
                manager.watermark_blocks,
                manager.use_eagle,
                tuple(manager.take_new_block_ids()),
            )
        )
        return super().schedule(*args, **kwargs)  # type: ignore[misc,no-any-return]

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        result = super()._free_request(request, delay_free_blocks)  # type: ignore[misc]
        if not delay_free_blocks:
            # Dynamo frees through the manager too; a second free is a no-op.
            self.kv_cache_manager.free(request)
        return result


class InstrumentedScheduler(Instrumented, Scheduler):
    """A third-party ``Scheduler`` subclass."""


class InstrumentedAsyncScheduler(Instrumented, AsyncScheduler):
    """A third-party ``AsyncScheduler`` subclass (Dynamo's is one)."""


def test_vllms_classes_are_with_kvblocks_of_vllms() -> None:
    assert with_kvblocks(Scheduler) is KVBlocksScheduler
    assert with_kvblocks(AsyncScheduler) is KVBlocksAsyncScheduler
    made = with_kvblocks(InstrumentedAsyncScheduler)
    assert with_kvblocks(InstrumentedAsyncScheduler) is made, "one class per base"
    assert with_kvblocks(made) is made
    assert made.__name__ == "KVBlocksInstrumentedAsyncScheduler"
    assert made.__mro__[2] is InstrumentedAsyncScheduler
    with pytest.raises(TypeError, match="subclass of vLLM's Scheduler"):
        with_kvblocks(int)  # type: ignore[arg-type]


def test_a_made_class_pickles_as_the_same_class() -> None:
    # vLLM may send scheduler_cls (a class, when given one) to the engine-core process.
    made = with_kvblocks(InstrumentedAsyncScheduler)
    assert pickle.loads(pickle.dumps(made)) is made
    assert pickle.loads(pickle.dumps(KVBlocksScheduler)) is KVBlocksScheduler


@pytest.mark.parametrize(
    "scenario_id",
    [
        f"{family}-s{seed}-{engine}"
        for family in ("mixed", "connector", "deferred")
        for engine in harness.ENGINES
        for seed in range(4)
    ],
)
def test_a_third_party_scheduler_runs_the_same_with_kvblocks(
    scenario_id: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def third_party(scn: harness.Scenario) -> type[Scheduler]:
        return InstrumentedAsyncScheduler if scn.is_async else InstrumentedScheduler

    monkeypatch.setattr(harness.compare, "stock_class", third_party)
    monkeypatch.setattr(
        harness.compare, "kvblocks_class", lambda scn: with_kvblocks(third_party(scn))
    )
    scn = harness.make_scenario(*harness.parse_scenario_id(scenario_id))
    reference, other, mismatch = harness.differential(scn, tiny_model_dir)
    assert "exception" not in reference.records[-1], reference.records[-1]
    assert issubclass(other.manager_type, KVCacheManager), other.manager_cls
    assert other.scheduler_cls.endswith(f"KVBlocks{third_party(scn).__name__}"), other
    assert mismatch is None, str(mismatch)
