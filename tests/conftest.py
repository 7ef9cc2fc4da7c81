"""One test suite, two backends: every test that takes ``backend`` runs on both."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from kvblocks import BACKEND_MODULES, load_backend

GOLDEN_DIR = Path(__file__).parent / "golden"


@pytest.fixture(params=sorted(BACKEND_MODULES), ids=lambda name: f"backend={name}")
def backend(request: pytest.FixtureRequest) -> ModuleType:
    """The backend module under test: ``kvblocks.reference`` or ``kvblocks._native``."""
    return load_backend(request.param)


def load_golden(name: str) -> list[dict[str, Any]]:
    """All cases of ``tests/golden/<name>.jsonl``, in file order."""
    path = GOLDEN_DIR / f"{name}.jsonl"
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def golden_params(name: str) -> list[Any]:
    """``pytest.param`` per golden case, with an id naming file and line."""
    return [pytest.param(case, id=f"{name}:{i + 1}") for i, case in enumerate(load_golden(name))]


#: What a call did, comparable across backends: ``("ok", result)`` or
#: ``("error", class, message)``.
Outcome = tuple[Any, ...]


def outcome(call: Callable[[], Any]) -> Outcome:
    """``("ok", result)`` or ``("error", class, message)``: what a call did, comparably."""
    try:
        return ("ok", call())
    except Exception as exc:  # the point is to compare whatever is raised
        return ("error", type(exc), str(exc))
