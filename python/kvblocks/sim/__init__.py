"""``kvblocks.sim``: a deterministic serving-workload simulator with KV-load failures.

It drives a :class:`~kvblocks.KVCacheManager` step by step the way vLLM 0.33's
scheduler does (admission with prefix hits, chunked prefill and decode within a token
budget, preemption when out of blocks), with a KV connector stand-in that supplies
external prefix tokens through sync and async loads and fails blocks or whole loads at
a configurable rate. Failures go through ``handle_invalid_blocks`` and
``handle_failed_recving`` with the chosen policy and mode, and the state is checked
after every step (see :mod:`kvblocks.sim.checks`).

Example::

    import kvblocks.reference
    from kvblocks.sim import SimConfig, run

    result = run(SimConfig(num_requests=200, failure_rate=0.05, policy="recompute"),
                 backend=kvblocks.reference)
    assert result.ok, result.failure
    print(result.summary.hit_rate)

The same seed gives the same run on every backend: :func:`first_trace_difference`
compares two runs' step traces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict
from types import ModuleType

from kvblocks.sim.checks import CheckError
from kvblocks.sim.config import SimConfig
from kvblocks.sim.results import SimResult, StepRecord, Summary
from kvblocks.sim.scheduler import ExtraCheck, Simulator
from kvblocks.sim.workload import WORKLOADS

__all__ = [
    "WORKLOADS",
    "CheckError",
    "ExtraCheck",
    "SimConfig",
    "SimResult",
    "Simulator",
    "StepRecord",
    "Summary",
    "first_trace_difference",
    "run",
]


def run(
    config: SimConfig,
    *,
    backend: ModuleType,
    backend_name: str | None = None,
    progress: Callable[[Simulator], None] | None = None,
    extra_checks: Sequence[ExtraCheck] = (),
    record_trace: bool = False,
    keep_final_block_hashes: bool = False,
) -> SimResult:
    """Simulates ``config`` on ``backend``.

    Args:
        config: The run's configuration.
        backend: A backend module (``kvblocks.reference``, ``kvblocks._native``).
        backend_name: Name shown in the summary (default: the module name).
        progress: Called with the simulator after every step.
        extra_checks: More per-step checks (each gets the :class:`Simulator` and
            raises to fail the run); they run only with ``config.check``.
        record_trace: Keep one :class:`StepRecord` per step in ``result.trace``.
        keep_final_block_hashes: Keep each finished request's block hashes.

    Returns:
        The result; ``result.ok`` is false and ``result.failure`` says why when a
        check failed (the run stops there).
    """
    simulator = Simulator(
        config,
        backend,
        backend_name=backend_name,
        extra_checks=extra_checks,
        record_trace=record_trace,
        keep_final_block_hashes=keep_final_block_hashes,
    )
    return simulator.run(progress)


def first_trace_difference(a: Sequence[StepRecord], b: Sequence[StepRecord]) -> str | None:
    """Where two step traces first differ, or ``None`` if they are identical."""
    for record_a, record_b in zip(a, b, strict=False):
        if record_a != record_b:
            fields_a, fields_b = asdict(record_a), asdict(record_b)
            names = [name for name in fields_a if fields_a[name] != fields_b[name]]
            return f"step {record_a.step}: " + "; ".join(
                f"{n}: {fields_a[n]!r} != {fields_b[n]!r}" for n in names
            )
    if len(a) != len(b):
        return f"the traces have {len(a)} and {len(b)} steps"
    return None
