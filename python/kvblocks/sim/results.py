"""What a simulated run produces: its step trace, time series, summary and result."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from kvblocks.sim.checks import CheckError
from kvblocks.sim.config import SimConfig

__all__ = ["HIT_RATE_WINDOW", "Series", "SimResult", "StepRecord", "Summary"]


#: The hit rate of the time series covers the lookups of this many steps.
HIT_RATE_WINDOW = 32


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step of a trace; two backends must produce equal records.

    Attributes:
        step: The step number.
        scheduled: ``(request id, tokens)`` in scheduling order.
        admitted: Requests admitted to running.
        async_started: Requests that started an async load.
        preempted: Requests preempted.
        finished: Requests finished normally.
        failed: Requests finished with an error.
        rescheduled: Running requests rolled back for recomputation.
        retried: Async loads to be retried.
        invalid_block_ids: The connector's invalid blocks of the step.
        evicted_block_ids: Blocks evicted by the failure handling.
        num_free_blocks: Free blocks at the end of the step.
        state_digest: SHA-256 of the free queue and every block table (hex, 16 chars).
    """

    step: int
    scheduled: tuple[tuple[str, int], ...]
    admitted: tuple[str, ...]
    async_started: tuple[str, ...]
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    failed: tuple[str, ...]
    rescheduled: tuple[str, ...]
    retried: tuple[str, ...]
    invalid_block_ids: tuple[int, ...]
    evicted_block_ids: tuple[int, ...]
    num_free_blocks: int
    state_digest: str


class Series:
    """Usage and hit rate over time, decimated to at most ``max_points`` points.

    The hit rate is the prefix-cache hit rate of the lookups of the last
    :data:`HIT_RATE_WINDOW` steps. When full, every other point is dropped and the
    sampling stride doubles, so memory stays bounded however long the run.
    """

    __slots__ = (
        "_stride",
        "_window",
        "_window_hits",
        "_window_queries",
        "hit_rate",
        "max_points",
        "running",
        "steps",
        "usage",
        "waiting",
    )

    def __init__(self, max_points: int = 2048) -> None:
        self.max_points = max_points
        self._stride = 1
        self._window: deque[tuple[int, int]] = deque()
        self._window_queries = 0
        self._window_hits = 0
        self.steps: list[int] = []
        self.usage: list[float] = []
        self.hit_rate: list[float] = []
        self.running: list[int] = []
        self.waiting: list[int] = []

    def add(
        self, step: int, *, usage: float, queries: int, hits: int, running: int, waiting: int
    ) -> None:
        """Records a step (kept if it falls on the current stride).

        Args:
            step: The step.
            usage: Pool usage after scheduling.
            queries: Prefix-cache lookup tokens of the step.
            hits: Prefix-cache hit tokens of the step.
            running: Running requests.
            waiting: Waiting requests.
        """
        self._window.append((queries, hits))
        self._window_queries += queries
        self._window_hits += hits
        if len(self._window) > HIT_RATE_WINDOW:
            old_queries, old_hits = self._window.popleft()
            self._window_queries -= old_queries
            self._window_hits -= old_hits
        if step % self._stride:
            return
        self.steps.append(step)
        self.usage.append(usage)
        self.hit_rate.append(
            self._window_hits / self._window_queries if self._window_queries else 0.0
        )
        self.running.append(running)
        self.waiting.append(waiting)
        if len(self.steps) >= self.max_points:
            self._stride *= 2
            keep = [s % self._stride == 0 for s in self.steps]
            for ints in (self.steps, self.running, self.waiting):
                ints[:] = [v for k, v in zip(keep, ints, strict=True) if k]
            for floats in (self.usage, self.hit_rate):
                floats[:] = [v for k, v in zip(keep, floats, strict=True) if k]

    def as_dict(self) -> dict[str, list[Any]]:
        """The columns, for JSON."""
        return {
            "step": self.steps,
            "usage": self.usage,
            "hit_rate": self.hit_rate,
            "running": self.running,
            "waiting": self.waiting,
        }


@dataclass(frozen=True, slots=True)
class Summary:
    """The outcome of one run on one backend.

    Attributes:
        backend: ``"rust"`` or ``"python"`` (or the module name).
        requests: Requests in the workload.
        finished: Finished normally.
        failed: Finished with an error (``fail`` policy).
        rescheduled: Times a running request was rolled back and recomputed.
        retried: Times an async load was retried (``recompute`` policy).
        preemptions: Requests preempted for lack of blocks (stall preemptions included).
        stall_preemptions: Preemptions of waiting requests to break a stall.
        steps: Scheduler steps executed (idle steps skipped).
        tokens_scheduled: Tokens computed by the forward passes.
        tokens_rolled_back: ``total_affected_tokens`` summed over the failure handling:
            tokens recomputed under ``recompute``, lost with the failed requests under
            ``fail``.
        sync_loads: Synchronous connector loads.
        async_loads: Asynchronous connector loads.
        external_tokens: Tokens the connector loaded (or tried to).
        external_blocks: Blocks the connector loaded into.
        invalid_blocks_reported: Block-level failures reported.
        request_load_failures: Requests whose async load failed as a whole.
        evicted_blocks: Blocks evicted by the failure handling.
        prefix_queries: Prefix-cache lookup tokens (the manager's stats).
        prefix_hits: Tokens found in the prefix cache (the manager's stats).
        hit_rate: ``prefix_hits / prefix_queries``.
        peak_usage: Highest pool usage, after scheduling.
        final_usage: Pool usage at the end.
        final_free_blocks: Free blocks at the end.
        stale_outputs: Requests with an accepted output computed over stale KV.
        stale_reads: Accepted step outputs computed over stale KV.
        stale_hashed_blocks: Stale blocks left in the prefix cache at the end.
        shared_tail_hashed: vLLM mode, ``fail``: blocks left hashed after an invalid
            block that an earlier request had already marked (vLLM skips such a block,
            so the later request's own blocks stay cached).
        mean_step_s: Mean scheduler-side time per step (schedule and output handling,
            library calls included; workload, ledger and checks excluded).
        check_s: Time spent in checks.
        wall_s: Wall time of the run.
        checks_passed: Checks run and passed.
    """

    backend: str
    requests: int
    finished: int
    failed: int
    rescheduled: int
    retried: int
    preemptions: int
    stall_preemptions: int
    steps: int
    tokens_scheduled: int
    tokens_rolled_back: int
    sync_loads: int
    async_loads: int
    external_tokens: int
    external_blocks: int
    invalid_blocks_reported: int
    request_load_failures: int
    evicted_blocks: int
    prefix_queries: int
    prefix_hits: int
    hit_rate: float
    peak_usage: float
    final_usage: float
    final_free_blocks: int
    stale_outputs: int
    stale_reads: int
    stale_hashed_blocks: int
    shared_tail_hashed: int
    mean_step_s: float
    check_s: float
    wall_s: float
    checks_passed: int


@dataclass(slots=True)
class SimResult:
    """Everything a run produced.

    Attributes:
        config: The configuration.
        summary: The totals.
        series: Usage and hit rate over time.
        failure: The first failed check, or ``None``.
        trace: The step records, when asked for.
        final_block_hashes: Each finished request's block hashes, when asked for.
    """

    config: SimConfig
    summary: Summary
    series: Series
    failure: CheckError | None
    trace: list[StepRecord] | None
    final_block_hashes: dict[str, list[bytes]] | None

    @property
    def ok(self) -> bool:
        """Whether every check passed."""
        return self.failure is None
