"""A simulated request's state, and the running totals of a simulation."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

from kvblocks.sim.connector import ExternalLoad
from kvblocks.sim.workload import RequestSpec

__all__ = ["Counters", "SimRequest", "Status"]


class Status(enum.Enum):
    """A request's state (vLLM's ``RequestStatus``, the ones a simulation reaches)."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    FAILED = "failed"  # vLLM's FINISHED_ERROR


@dataclass(slots=True, eq=False)
class SimRequest:
    """A request inside the simulator.

    Attributes:
        spec: Its workload entry.
        req: The backend's ``Request`` (tokens, block hashes, ``num_computed_tokens``).
        status: Where it is.
        table: The block table the simulator expects the manager to hold for it.
        num_output: Output tokens accepted so far.
        num_preemptions: Times it was preempted.
        load: Its async load, while one is in flight or not yet processed.
        free_delayed: Failed while its transfer was in flight: its blocks are freed
            when the connector reports it finished.
        stale_output: Some accepted output of it was computed over stale KV.
    """

    spec: RequestSpec
    req: Any
    status: Status = Status.WAITING
    table: list[int] = field(default_factory=list)
    num_output: int = 0
    num_preemptions: int = 0
    load: ExternalLoad | None = None
    free_delayed: bool = False
    stale_output: bool = False

    def load_in_flight(self) -> bool:
        """Whether it holds async-loaded blocks not yet cached (they must be unhashed)."""
        return self.load is not None and (
            self.status is Status.WAITING_FOR_REMOTE_KVS or self.free_delayed
        )


@dataclass(slots=True)
class Counters:
    """Running totals of a simulation; none ever decreases."""

    arrived: int = 0
    admissions: int = 0
    finished: int = 0
    failed: int = 0
    rescheduled: int = 0
    retried: int = 0
    preemptions: int = 0
    stall_preemptions: int = 0
    tokens_scheduled: int = 0
    tokens_rolled_back: int = 0
    sync_loads: int = 0
    async_loads: int = 0
    external_tokens: int = 0
    external_blocks: int = 0
    invalid_blocks_reported: int = 0
    request_load_failures: int = 0
    evicted_blocks: int = 0
    prefix_requests: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    stale_outputs: int = 0
    stale_reads: int = 0

    def as_tuple(self) -> tuple[int, ...]:
        """All counters, in field order."""
        return tuple(getattr(self, f.name) for f in fields(self))
