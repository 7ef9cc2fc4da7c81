"""One test suite, two backends: every test that takes ``backend`` runs on both.

This file holds only fixtures and settings; the helpers the tests share are modules of
their own: ``support.py`` (request and manager stand-ins, cross-backend comparisons) and
``golden_cases.py`` (the golden vectors).
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest
from hypothesis import HealthCheck, settings
from kvblocks import BACKEND_MODULES, load_backend

# Hypothesis profiles. "ci" (the default) is reproducible: derandomized, no example
# database, so every run tries the same examples; it bounds tests/fuzz/ to about a
# minute. "dev" (``make test``) is "ci" with a tenth of the examples, for the fast loop.
# "long" (``pytest --hypothesis-profile=long``) tries 20 times as many random examples
# and keeps the failures it finds in the database. None has a deadline: the fuzzer's
# calls run in a child process, whose start-up time would count.
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# With so few examples, a test's early filtering trips Hypothesis's health check.
settings.register_profile(
    "dev",
    settings.get_profile("ci"),
    max_examples=10,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
settings.register_profile(
    "long",
    max_examples=2000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(params=sorted(BACKEND_MODULES), ids=lambda name: f"backend={name}")
def backend(request: pytest.FixtureRequest) -> ModuleType:
    """The backend module under test: ``kvblocks.reference`` or ``kvblocks._native``."""
    return load_backend(request.param)
