"""``examples/vllm_scheduler.py``, the CPU example of docs/vllm.md: vLLM's real Scheduler runs
every request to completion with kvblocks' KV cache manager, and schedules exactly as it
does with vLLM's own manager."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_scheduler.py"
STOCK = "vllm.v1.core.sched.scheduler.Scheduler"


def _vllm_installed() -> bool:
    # Not find_spec("vllm"): with tests/ on sys.path, tests/vllm passes for a namespace package.
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if not _vllm_installed():
    if os.environ.get("KVBLOCKS_REQUIRE_VLLM") == "1":
        raise RuntimeError("KVBLOCKS_REQUIRE_VLLM=1 but vLLM is not installed")
    pytest.skip("vLLM is not installed", allow_module_level=True)


def run_example(*args: str) -> list[str]:
    """The example's stdout lines; it must exit 0."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout.splitlines()


@pytest.fixture(scope="module")
def kvblocks_lines() -> list[str]:
    """The example as docs/vllm.md runs it: kvblocks.vllm.KVBlocksScheduler."""
    assert importlib.util.find_spec("kvblocks.vllm") is not None, "kvblocks.vllm is missing"
    return run_example()


def test_kvblocks_manager_runs_every_request_to_completion(kvblocks_lines: list[str]) -> None:
    lines = kvblocks_lines
    assert lines[0].startswith("scheduler class: kvblocks.vllm."), lines[0]
    assert lines[1].startswith("kv cache manager: kvblocks."), lines[1]
    assert sum(line.startswith("step ") for line in lines) >= 5
    assert lines[-1].startswith("all 4 requests finished in "), lines[-1]
    assert lines[-1].endswith("['req-0', 'req-1', 'req-2', 'req-3']"), lines[-1]


def test_same_schedule_as_vllms_own_manager(kvblocks_lines: list[str]) -> None:
    stock_lines = run_example("--scheduler-cls", STOCK)
    assert stock_lines[1] == "kv cache manager: vllm.v1.core.kv_cache_manager.KVCacheManager"
    # Every step: requests, tokens, prefix-cache hits, KV usage, which requests finished.
    assert kvblocks_lines[2:] == stock_lines[2:]
