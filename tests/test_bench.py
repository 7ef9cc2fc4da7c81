"""``kvblocks bench``'s report: the vLLM column and the table, without timing anything."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from kvblocks import bench
from kvblocks.bench import BenchResult, markdown_table, vllm_runner, write_outputs
from kvblocks.bench.workload import Workload, WorkloadSpec
from kvblocks.bench.workloads import manager_tables


def _result(name: str, *, vllm_s: list[float], has_vllm: bool) -> BenchResult:
    return BenchResult(
        name,
        "group",
        f"{name} workload",
        1_000,
        "step",
        [0.02, 0.03],
        [0.002, 0.003],
        vllm_s,
        has_vllm=has_vllm,
    )


def test_vllm_column_shows_time_absence_or_no_counterpart() -> None:
    timed = _result("pool_churn_x", vllm_s=[0.04, 0.05, 0.06], has_vllm=True)
    missing = _result("rollback_x", vllm_s=[], has_vllm=True)
    none = _result("manager_chat", vllm_s=[], has_vllm=False)
    assert timed.vllm_per_op == pytest.approx(50e-6)
    assert missing.vllm_per_op is None
    rows = markdown_table([timed, missing, none]).splitlines()
    assert timed.vllm_ratio == pytest.approx(20.0)
    assert rows[2].endswith("| **10.0x** | 50.00 µs / step (native 20.0x) |")
    assert rows[3].endswith("| absent¹ |")
    assert rows[4].endswith("| — |")
    assert rows[-1] == f"¹ {vllm_runner.status()}."


def test_no_footnote_when_nothing_is_absent() -> None:
    table = markdown_table([_result("manager_chat", vllm_s=[], has_vllm=False)])
    assert "¹" not in table


def test_json_carries_every_column(tmp_path: Path) -> None:
    written = write_outputs([_result("pool_churn_x", vllm_s=[0.05], has_vllm=True)], tmp_path)
    assert tmp_path / "results.md" in written
    payload = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    (row,) = payload["results"]
    assert row["ratio"] == pytest.approx(10.0)
    assert row["vllm_per_op_s"] == pytest.approx(50e-6)
    assert row["vllm_ratio"] == pytest.approx(20.0)
    assert payload["meta"]["vllm"] == vllm_runner.status()


def test_unknown_workload_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["no_such_workload"], quick=True, rounds=1, out=None) == 2
    assert "no workload matches no_such_workload" in capsys.readouterr().err


@pytest.mark.parametrize(("rounds", "shown"), [("0", "0"), ("-1", "-1"), ("two", "'two'")])
def test_rounds_must_be_positive(
    rounds: str, shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvblocks import cli  # noqa: PLC0415 (only this test drives the CLI)

    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--rounds", rounds])
    assert exc.value.code == 2
    assert f"expected a positive integer, got {shown}" in capsys.readouterr().err


def test_vllm_rollback_column_gets_the_managers_tables(backend: ModuleType) -> None:
    """``rollback_manager``'s vLLM column assumes the tables a fresh manager hands out."""
    manager = backend.KVCacheManager(4 * 3 + 1, 16)
    for i in range(4):
        request = SimpleNamespace(
            request_id=f"r{i}", num_tokens=48, num_computed_tokens=0, block_hashes=[]
        )
        assert manager.allocate_slots(request, 48) is not None
    assert [list(manager.get_block_ids(f"r{i}")[0]) for i in range(4)] == manager_tables(4, 3)


def test_a_failing_vllm_run_is_reported_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_vllm_run(state: object) -> None:
        raise RuntimeError("no such scheduler method")

    workload = Workload(
        name="tiny",
        group="tiny",
        description="a workload that does nothing",
        ops=1,
        op_name="call",
        setup=lambda backend: None,
        run=lambda backend, state: None,
        check=lambda state, result: None,
        vllm_setup=lambda: None,
        vllm_run=broken_vllm_run,
    )
    monkeypatch.setattr(vllm_runner, "available", lambda: True)
    (result,) = bench.run([WorkloadSpec("tiny", lambda: workload)], rounds=2, progress=None)
    assert len(result.python_s) == len(result.rust_s) == 2
    assert result.vllm_s == []
    assert result.vllm_error == "RuntimeError: no such scheduler method"
    table = markdown_table([result]).splitlines()
    assert table[2].endswith("| failed² |")
    assert table[-1] == "² vLLM's run failed: tiny: RuntimeError: no such scheduler method."


def test_a_workload_without_reference_shows_only_native_and_vllm() -> None:
    """The vllm_scheduler group: kvblocks' manager (native) against vLLM's, no reference."""
    result = BenchResult(
        "vllm_scheduler_256", "vllm scheduler", "scheduler step", 100, "step", [], [0.2], [0.4]
    )
    assert result.python_per_op is None and result.ratio is None
    assert result.vllm_ratio == pytest.approx(2.0)
    row = markdown_table([result]).splitlines()[2]
    assert row == (
        "| `vllm_scheduler_256` | scheduler step | — | 2.00 ms / step | — "
        "| 4.00 ms / step (native 2.0x) |"
    )


def test_self_timed_workload_without_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A self-timed run's own seconds are recorded (not the call's), its result is what
    ``check`` gets, and the reference backend does not run a workload without one."""
    checked: list[object] = []
    backends: list[str] = []

    def setup(backend: ModuleType) -> str:
        backends.append(backend.__name__)
        return "state"

    workload = Workload(
        name="tiny",
        group="tiny",
        description="a self-timed workload",
        ops=1,
        op_name="step",
        setup=setup,
        run=lambda backend, state: (0.25, "native result"),
        check=lambda state, result: checked.append(result),
        vllm_setup=lambda: None,
        vllm_run=lambda state: (0.5, "vLLM result"),
        has_reference=False,
        self_timed=True,
    )
    monkeypatch.setattr(vllm_runner, "available", lambda: True)
    (result,) = bench.run([WorkloadSpec("tiny", lambda: workload)], rounds=2, progress=None)
    assert backends == ["kvblocks._native", "kvblocks._native"]
    assert checked == ["native result", "native result"]
    assert result.python_s == []
    assert result.rust_s == [0.25, 0.25]
    assert result.vllm_s == [0.5, 0.5]
    assert result.vllm_ratio == pytest.approx(2.0)


def test_absent_scheduler_group_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvblocks.bench import vllm_scheduler  # noqa: PLC0415 (only these tests use it)

    monkeypatch.setattr(vllm_scheduler, "available", lambda: False)
    monkeypatch.setattr(vllm_scheduler, "status", lambda: "vLLM is not importable here (test)")
    assert vllm_scheduler.workload_specs(quick=True) == []
    assert bench.main(["vllm_scheduler"], quick=True, rounds=1, out=None) == 2
    err = capsys.readouterr().err
    assert "no workload matches vllm_scheduler" in err
    assert "the vllm_scheduler group is absent: vLLM is not importable here (test)" in err


def test_scheduler_agreement_names_the_first_differing_step() -> None:
    from kvblocks.bench.vllm_scheduler import _Agreement  # noqa: PLC0415 (a private name, for this test only)

    agreement = _Agreement("vllm_scheduler_64")
    first = [(("r0", 16), ("r1", 1)), (("r0", 1),)]
    agreement.check("kvblocks' manager", first)
    agreement.check("vLLM's manager", list(first))
    with pytest.raises(AssertionError, match="differently from kvblocks' manager at step 1 of 2"):
        agreement.check("vLLM's manager", [first[0], (("r0", 2),)])
