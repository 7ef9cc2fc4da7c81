"""``python -m kvblocks.vllm.check`` and the version gate: the surface kvblocks.vllm relies
on is recorded for each supported release, the installed vLLM matches its series'
recording, a change to it is named, a vLLM newer than the supported series gets a
warning and vLLM's own manager, and an older one is refused."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

import harness
import pytest
import vllm
from kvblocks.vllm import check, make_kv_cache_manager, unsupported_reason
from kvblocks.vllm._version_check import NEWEST_SERIES, OLDEST_SERIES, require_vllm, series
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.metrics import stats

ALLOCATE = "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots"
#: The series kvblocks.vllm supports, each with a recorded surface.
SUPPORTED = [(0, minor) for minor in range(OLDEST_SERIES[1], NEWEST_SERIES[1] + 1)]


def _installed_recording() -> dict[str, str]:
    version, surface = check.recorded(vllm.__version__)
    assert series(version) == series(vllm.__version__)
    return surface


def test_the_installed_vllm_is_the_recorded_one() -> None:
    surface = _installed_recording()
    assert check.diff(check.snapshot(), surface) == []


@pytest.mark.parametrize("found", SUPPORTED, ids=[f"{a}.{b}" for a, b in SUPPORTED])
def test_each_supported_series_is_recorded(found: tuple[int, int]) -> None:
    version, surface = check.recorded(f"{found[0]}.{found[1]}.7")
    assert series(version) == found
    # Every entry was found when it was recorded, and the record is not trivially small.
    assert "missing" not in surface.values()
    assert len(surface) >= 80
    assert surface[ALLOCATE].startswith("(self, request, num_new_tokens,")


def test_a_newer_or_unreadable_version_is_compared_with_the_newest() -> None:
    newest = check.recorded(f"{NEWEST_SERIES[0]}.{NEWEST_SERIES[1]}.0")
    assert check.recorded("0.34.0") == newest
    assert check.recorded("unknown") == newest


def test_the_command_says_no_change(capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main([]) == 0
    assert "no changes" in capsys.readouterr().out


def test_a_changed_signature_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def allocate_slots(self: Any, request: Any, num_new_tokens: int, new_flag: bool = False) -> Any:
        return None

    monkeypatch.setattr(VllmKVCacheManager, "allocate_slots", allocate_slots)
    assert check.main([]) == 1
    out = capsys.readouterr().out
    assert f"changed  {ALLOCATE}" in out
    assert "now (self, request, num_new_tokens, new_flag=False)" in out


def test_removed_members_and_fields_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(BlockPool, "touch")

    @dataclasses.dataclass
    class PrefixCacheStats(stats.PrefixCacheStats):
        new_field: int = 0

    monkeypatch.setattr(stats, "PrefixCacheStats", PrefixCacheStats)
    lines = check.diff(check.snapshot(), _installed_recording())
    assert [line.split()[:2] for line in lines] == [
        ["removed", "vllm.v1.core.block_pool.BlockPool.touch"],
        ["changed", "vllm.v1.metrics.stats.PrefixCacheStats"],
    ]
    assert "new_field" in lines[1]


def test_write_records_what_main_compares(tmp_path: Any) -> None:
    out = tmp_path / "surface.py"
    assert check.main(["--write", str(out)]) == 0
    recorded: dict[str, Any] = {}
    exec(out.read_text(encoding="utf-8"), recorded)
    assert recorded["SURFACE"] == check.snapshot()
    # The committed record of this series is this command's output, not edited by hand.
    found = series(vllm.__version__)
    assert found is not None
    committed = importlib.import_module(f"kvblocks.vllm._surface_{found[0]}_{found[1]}")
    assert committed.__file__ is not None
    assert out.read_text(encoding="utf-8") == Path(committed.__file__).read_text(encoding="utf-8")


def _kwargs() -> dict[str, Any]:
    return {
        "kv_cache_config": harness.build_kv_cache_config(16, 4),
        "max_model_len": 256,
        "scheduler_block_size": 4,
        "hash_block_size": 4,
    }


def test_a_newer_vllm_gets_a_warning_and_its_own_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    assert unsupported_reason(**_kwargs()) is None
    monkeypatch.setattr(vllm, "__version__", "0.34.0rc1")
    with pytest.warns(RuntimeWarning, match=r"vLLM 0\.34\.0rc1 is newer .* vLLM's own"):
        require_vllm()
    reason = unsupported_reason(**_kwargs())
    assert reason is not None and "python -m kvblocks.vllm.check" in reason
    assert type(make_kv_cache_manager(**_kwargs())) is VllmKVCacheManager
    # Even with an argument this vLLM's manager might have gained.
    assert unsupported_reason(**_kwargs(), new_argument=1) == reason


@pytest.mark.parametrize("version", ["0.30.4", "0.1", "unknown"])
def test_an_older_or_unreadable_vllm_is_refused(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(
        ImportError, match=r"supports vLLM 0\.31\.x to 0\.33\.x, found vLLM .*vllm==0\.33\.0"
    ):
        require_vllm()


@pytest.mark.parametrize("version", ["0.31.0", "0.32.1", "0.33.0"])
def test_a_supported_vllm_is_accepted_quietly(
    monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder, version: str
) -> None:
    monkeypatch.setattr(vllm, "__version__", version)
    require_vllm()
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_series() -> None:
    assert series("0.33.1.dev12+gabc") == (0, 33)
    assert series("1.0") == (1, 0)
    assert series("unknown") is None
