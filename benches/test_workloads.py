"""pytest-benchmark over every workload of ``kvblocks bench``, both backends side by side.

One benchmark group per workload; the backend is recorded in ``extra_info``. Each round
gets a fresh state from the workload's ``setup`` (not timed) and its result is checked
after timing. Set ``KVBLOCKS_BENCH_FULL=1`` for the full sizes (``kvblocks bench``
without ``--quick``); the default sizes are ``--quick``'s, which CI runs once each with
``--benchmark-disable`` as a smoke test.

    pytest benches --benchmark-group-by=group --benchmark-columns=min,median,rounds
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
from types import ModuleType
from typing import Any

import pytest
from kvblocks import BACKEND_MODULES, load_backend
from kvblocks.bench.workload import WorkloadSpec
from kvblocks.bench.workloads import all_workloads
from pytest_benchmark.fixture import BenchmarkFixture

QUICK = os.environ.get("KVBLOCKS_BENCH_FULL") != "1"
WORKLOADS = all_workloads(quick=QUICK)


@pytest.fixture(params=sorted(BACKEND_MODULES), ids=lambda name: f"backend={name}")
def backend(request: pytest.FixtureRequest) -> tuple[str, ModuleType]:
    """``(name, module)`` of the backend under test."""
    name: str = request.param
    return name, load_backend(name)


@pytest.mark.parametrize("spec", WORKLOADS, ids=lambda w: w.name)
def test_workload(
    benchmark: BenchmarkFixture, backend: tuple[str, ModuleType], spec: WorkloadSpec
) -> None:
    name, module = backend
    workload = spec.build()
    benchmark.group = workload.group
    benchmark.name = f"{workload.name}[{name}]"
    benchmark.extra_info.update(
        backend=name, workload=workload.name, ops=workload.ops, op_name=workload.op_name
    )
    states: list[Any] = []

    def setup() -> tuple[tuple[ModuleType, Any], dict[str, Any]]:
        state = workload.setup(module)
        states.append(state)
        return (module, state), {}

    # pytest-benchmark ships no type hints for pedantic().
    result = benchmark.pedantic(  # type: ignore[no-untyped-call]
        workload.run, setup=setup, rounds=5, iterations=1
    )
    workload.check(states[-1], result)


def test_sha256_floor(benchmark: BenchmarkFixture) -> None:
    """SHA-256 alone over the bytes the ``sha256`` algorithm hashes: the floor on this machine.

    The pickled inputs of a 131,072-token prompt's 8,192 blocks (block size 16) are
    concatenated and hashed in one call, so only SHA-256's throughput is measured.
    """
    rng = random.Random(0)
    parent = bytes(32)
    payload = b"".join(
        pickle.dumps((parent, tuple(rng.randrange(150_000) for _ in range(16)), None), 5)
        for _ in range(8_192)
    )
    benchmark.group = "hashing"
    benchmark.extra_info.update(backend="hashlib", bytes=len(payload), ops=8_192, op_name="block")
    digest = benchmark(lambda: hashlib.sha256(payload).digest())
    assert len(digest) == 32
