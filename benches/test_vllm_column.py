"""The vLLM column of ``kvblocks bench`` agrees with the reference backend.

Skipped unless vLLM is importable. Runs the pool-churn and rollback scripts once on
vLLM's own code (``kvblocks.bench.vllm_runner``) and once on ``kvblocks.reference``,
and compares the results: the same block ids, the same rollback.
"""

from __future__ import annotations

import pytest
from kvblocks import load_backend
from kvblocks.bench import vllm_runner
from kvblocks.bench.workloads import _churn_run, _churn_script, _rollback_input, churn_loop

pytest.importorskip("vllm")


def test_status_names_the_version() -> None:
    assert vllm_runner.available(), vllm_runner.status()
    assert vllm_runner.status().startswith("vLLM ")


def test_pool_churn_matches_reference() -> None:
    reference = load_backend("python")
    script = _churn_script(num_blocks=4_096, num_steps=2_000, seed=0)
    pool = reference.BlockPool(script.num_blocks)
    expected = _churn_run(script)(reference, pool)
    vllm_pool = vllm_runner.setup_pool_churn(script.num_blocks)
    live, allocated = vllm_runner.pool_churn_outcome(churn_loop(script.steps, vllm_pool))
    assert (live, allocated) == (expected[0], expected[1])
    assert vllm_pool.get_num_free_blocks() == pool.get_num_free_blocks()


def test_rollback_matches_reference() -> None:
    reference = load_backend("python")
    data = _rollback_input(num_requests=1_000, blocks_per_request=1_000, seed=0)
    args = (data.tables, data.computed, data.scheduled, data.invalid, data.block_size)
    expected = reference.rollback_invalid_blocks(*args)
    state = vllm_runner.setup_rollback(*args)
    outcome = vllm_runner.rollback_outcome(state, vllm_runner.run_rollback(state))
    assert expected.affected, "the script hits no request"
    assert outcome == (
        list(expected.num_computed_tokens),
        list(expected.affected),
        expected.total_affected_tokens,
        list(expected.blocks_to_evict),
    )
