"""``KVBLOCKS_ROLLBACK_MODE``: unset (or ``vllm``) is vLLM's exact semantics, which the
differential suite checks; ``strict`` is kvblocks' strict mode; anything else is refused
when the scheduler is built, naming the fix."""

from __future__ import annotations

from pathlib import Path

import harness
import pytest


def test_an_unknown_mode_is_refused(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    from kvblocks.vllm import KVBlocksScheduler  # noqa: PLC0415 (as in the other tests here, imported where used)

    monkeypatch.setenv("KVBLOCKS_ROLLBACK_MODE", "lenient")
    scn = harness.make_scenario("connector", 0, "sync")
    with pytest.raises(ValueError, match="must be 'vllm' or 'strict', got 'lenient': unset it"):
        harness.build_scheduler(scn, KVBlocksScheduler, tiny_model_dir)


@pytest.mark.parametrize("engine", harness.ENGINES)
def test_strict_mode_runs_and_departs_from_vllm_on_shared_invalid_blocks(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, engine: str
) -> None:
    # Strict mode truncates every request at its own first invalid block; vLLM lets a
    # request keep a shared invalid block that an earlier request recomputes. Over the
    # connector scenarios some hit that case, so some strict run must differ from vLLM's,
    # and every strict run must still complete.
    monkeypatch.setenv("KVBLOCKS_ROLLBACK_MODE", "strict")
    differing = []
    for seed in range(40):
        scn = harness.make_scenario("connector", seed, engine)
        reference, strict, mismatch = harness.differential(scn, tiny_model_dir)
        assert "exception" not in strict.records[-1], strict.records[-1]
        assert strict.finished == reference.finished, scn.scenario_id
        if mismatch is not None:
            differing.append(scn.scenario_id)
    assert differing, "no connector scenario reached a shared invalid block"
