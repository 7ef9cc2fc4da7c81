"""What a benchmark workload is: :class:`Workload`, and :class:`WorkloadSpec` before it is built.

Its own module because both :mod:`kvblocks.bench.workloads` and
:mod:`kvblocks.bench.vllm_scheduler` make workloads, and the first lists the second's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["Workload", "WorkloadSpec", "deferred"]


@dataclass(frozen=True, slots=True)
class Workload:
    """One benchmark workload.

    Attributes:
        name: Unique name (``kvblocks bench --workload NAME``).
        group: The pytest-benchmark group; workloads of one group are compared.
        description: One line for tables.
        ops: Operations per run, to report time per operation.
        op_name: What one operation is ("step", "block", "request", ...).
        setup: ``setup(backend) -> state``: a fresh state, not timed.
        run: ``run(backend, state) -> result``: the timed part.
        check: ``check(state, result)``: raises if the run went wrong, not timed.
        vllm_setup: ``vllm_setup() -> state`` for the same workload on vLLM's own code
            (:mod:`kvblocks.bench.vllm_runner`), not timed; None when vLLM has no
            counterpart.
        vllm_run: ``vllm_run(state) -> result``: the timed part on vLLM.
        has_reference: Whether the reference backend runs it (False: the native column
            only, against vLLM's; ``setup`` and ``run`` then ignore their backend).
        self_timed: Whether ``run`` and ``vllm_run`` time themselves and return
            ``(seconds, result)``: for a timed region narrower than the whole call.
    """

    name: str
    group: str
    description: str
    ops: int
    op_name: str
    setup: Callable[[ModuleType], Any]
    run: Callable[[ModuleType, Any], Any]
    check: Callable[[Any, Any], None]
    vllm_setup: Callable[[], Any] | None = None
    vllm_run: Callable[[Any], Any] | None = None
    has_reference: bool = True
    self_timed: bool = False

    @property
    def has_vllm(self) -> bool:
        """Whether the workload also runs on vLLM's own code."""
        return self.vllm_setup is not None and self.vllm_run is not None


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A workload before its scripts and data exist.

    Workloads are built one at a time, right before they are measured, and dropped
    after: holding every workload's data at once (tens of millions of Python objects)
    slows the ones measured next by up to 20 %, the native backend most.

    Attributes:
        name: The name of the workload ``build`` makes.
        build: Builds the workload (seeded: the same scripts every time).
    """

    name: str
    build: Callable[[], Workload]


def deferred(
    spec_name: str, factory: Callable[..., Workload], /, *args: Any, **kwargs: Any
) -> WorkloadSpec:
    """``factory(*args, **kwargs)``, deferred, checked to build the workload named."""

    def build() -> Workload:
        workload = factory(*args, **kwargs)
        if workload.name != spec_name:
            raise AssertionError(f"workload spec {spec_name!r} built {workload.name!r}")
        return workload

    return WorkloadSpec(spec_name, build)
