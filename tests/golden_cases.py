"""The golden vectors in ``tests/golden/`` (see its ``FORMAT.md``), as test cases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

GOLDEN_DIR = Path(__file__).parent / "golden"


def load_golden(name: str) -> list[dict[str, Any]]:
    """All cases of ``tests/golden/<name>.jsonl``, in file order."""
    path = GOLDEN_DIR / f"{name}.jsonl"
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def golden_params(name: str) -> list[Any]:
    """``pytest.param`` per golden case, with an id naming file and line."""
    return [pytest.param(case, id=f"{name}:{i + 1}") for i, case in enumerate(load_golden(name))]
