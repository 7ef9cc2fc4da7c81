"""Benchmarks run every workload on both backends; see ``kvblocks.bench.workloads``."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

BACKEND_MODULES = {"python": "kvblocks.reference", "rust": "kvblocks._native"}


@pytest.fixture(params=sorted(BACKEND_MODULES), ids=lambda name: f"backend={name}")
def backend(request: pytest.FixtureRequest) -> tuple[str, ModuleType]:
    """``(name, module)`` of the backend under test."""
    name: str = request.param
    return name, importlib.import_module(BACKEND_MODULES[name])
