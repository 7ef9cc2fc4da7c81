"""Tests of ``kvblocks.vllm`` against the real Scheduler of a supported vLLM (0.31.x to
0.33.x; CPU only, offline).

Without one, every module here is reported as skipped, with the reason; nothing imports
vLLM then. The vLLM environment variables are set before anything imports it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent

SKIP_REASON = "vLLM 0.31 to 0.33 not installed: run .ci/run, or see docs/vllm.md (its CPU recipe)"
#: The supported release series, as version prefixes.
SUPPORTED_PREFIXES = ("0.31.", "0.32.", "0.33.")


def _vllm_missing() -> str | None:
    """Why the vLLM tests cannot run here, or None (checked without importing vLLM)."""
    if importlib.util.find_spec("vllm") is None:
        return SKIP_REASON
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return SKIP_REASON
    if not version.startswith(SUPPORTED_PREFIXES):
        return f"{SKIP_REASON} (found vLLM {version})"
    return None


MISSING = _vllm_missing()

if MISSING is None:
    # ``harness`` must be importable by name: the tests import it, and vLLM's connector
    # factory imports it from ``kv_connector_module_path``.
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
else:
    _REASON: str = MISSING

    class _SkippedModule(pytest.Module):
        """Stands in for a test module of this directory when vLLM is missing."""

        def collect(self) -> list[pytest.Item | pytest.Collector]:
            pytest.skip(_REASON)

    def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module:
        return _SkippedModule.from_parent(parent, path=module_path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding only a tiny llama ``config.json`` (all vLLM reads of it)."""
    from kvblocks.vllm.cpu import write_config_only_model  # noqa: PLC0415 (imports vLLM, which this conftest must not do when it is missing)

    return write_config_only_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(autouse=True)
def _vllm_rollback_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvblocks' default rollback mode (vLLM's semantics) unless a test sets another."""
    monkeypatch.delenv("KVBLOCKS_ROLLBACK_MODE", raising=False)
