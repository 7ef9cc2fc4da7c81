"""A KV connector stand-in: external prefix tokens, sync and async loads, failures.

It plays the part of vLLM's ``KVConnectorBase_V1`` on both sides:

* scheduler side, :meth:`Connector.get_num_new_matched_tokens` says how many prompt
  tokens past the local prefix hit the "remote store" holds and whether they load
  asynchronously (vLLM's ``(num_external_tokens, load_kv_async)``);
* worker side, :meth:`Connector.take_output` is the step's ``KVConnectorOutput``:
  ``invalid_block_ids`` (block-level failures), ``failed_recving`` (request-level
  failures) and ``finished_recving`` (async loads done, failed or not).

The reporting contract is vLLM's: a sync load's failed blocks are reported in the
step that consumes it (its admission step); an async load's failed blocks in any step
up to and including the one that reports it finished; a request whose async load fails
as a whole appears in ``failed_recving`` and in ``finished_recving`` of the same step.
Each externally loaded block fails independently with probability ``failure_rate``;
each async load fails as a whole with probability ``request_failure_rate``. All draws
come from a generator seeded with the request id and the attempt number, so they do not
depend on scheduling order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["Connector", "ConnectorOutput", "ExternalLoad"]


@dataclass(slots=True)
class ExternalLoad:
    """One load of external KV into a request's blocks.

    Attributes:
        request_id: The loading request.
        block_ids: The blocks the external tokens land in, in table order.
        first_block_index: Index of ``block_ids[0]`` in the request's block table.
        num_local_tokens: Tokens of the local prefix hit before the external ones.
        num_external_tokens: Tokens loaded.
        is_async: Whether the load is asynchronous.
        start_step: The step that admitted the request.
        finish_step: The step whose output reports the load finished (async only;
            equal to ``start_step`` for sync loads).
        failed_block_ids: Blocks whose load fails.
        request_failed: Whether the whole (async) load fails (``failed_recving``).
    """

    request_id: str
    block_ids: list[int]
    first_block_index: int
    num_local_tokens: int
    num_external_tokens: int
    is_async: bool
    start_step: int
    finish_step: int
    failed_block_ids: set[int]
    request_failed: bool


@dataclass(slots=True)
class ConnectorOutput:
    """The connector's part of one step's model-runner output (vLLM's names).

    Attributes:
        invalid_block_ids: Blocks whose load failed, reported this step.
        failed_recving: Requests whose async load failed as a whole.
        finished_recving: Requests whose async load finished, in admission order.
        landed: The async loads that finished this step.
    """

    invalid_block_ids: set[int] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    finished_recving: list[str] = field(default_factory=list)
    landed: list[ExternalLoad] = field(default_factory=list)


class Connector:
    """The remote KV store and its transfers (deterministic for a given seed).

    Args:
        seed: The run's seed.
        failure_rate: Probability that one externally loaded block fails.
        request_failure_rate: Probability that an async load fails as a whole.
        async_share: Probability that a load is asynchronous.
        max_load_attempts: Loads offered per request; later lookups find nothing
            (what a connector that remembers failed transfers would do), so a request
            whose loads keep failing falls back to local computation.
        max_latency: Async loads take ``1 .. max_latency`` steps.
    """

    __slots__ = (
        "_attempts",
        "_block_reports",
        "_finishes",
        "async_share",
        "failure_rate",
        "max_latency",
        "max_load_attempts",
        "request_failure_rate",
        "seed",
    )

    def __init__(
        self,
        *,
        seed: int,
        failure_rate: float,
        request_failure_rate: float,
        async_share: float,
        max_load_attempts: int,
        max_latency: int,
    ) -> None:
        for name, value in (
            ("failure_rate", failure_rate),
            ("request_failure_rate", request_failure_rate),
            ("async_share", async_share),
        ):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {value}")
        if max_latency < 1:
            raise ValueError(f"max_latency must be positive, got {max_latency}")
        if max_load_attempts < 0:
            raise ValueError(f"max_load_attempts must be non-negative, got {max_load_attempts}")
        self.seed = seed
        self.failure_rate = failure_rate
        self.request_failure_rate = request_failure_rate
        self.async_share = async_share
        self.max_load_attempts = max_load_attempts
        self.max_latency = max_latency
        #: Request id -> loads offered so far.
        self._attempts: dict[str, int] = {}
        #: Step -> block-level failure reports due then.
        self._block_reports: dict[int, set[int]] = {}
        #: Step -> async loads finishing then, in admission order.
        self._finishes: dict[int, list[ExternalLoad]] = {}

    def _rng(self, request_id: str, attempt: int) -> random.Random:
        return random.Random(f"kvblocks-sim/{self.seed}/connector/{request_id}/{attempt}")

    def get_num_new_matched_tokens(
        self, request_id: str, num_tokens: int, remote_prefix_tokens: int, num_local_tokens: int
    ) -> tuple[int, bool]:
        """External tokens past the local hit, and whether they load asynchronously.

        The remote store holds the first ``remote_prefix_tokens`` tokens; like vLLM,
        the last prompt token is never offered (it is recomputed for its logits).
        Asking does not count as an attempt: :meth:`start_load` does.
        """
        if self._attempts.get(request_id, 0) >= self.max_load_attempts:
            return 0, False
        num_external = min(remote_prefix_tokens, num_tokens - 1) - num_local_tokens
        if num_external <= 0:
            return 0, False
        attempt = self._attempts.get(request_id, 0)
        is_async = self._rng(request_id, attempt).random() < self.async_share
        return num_external, is_async

    def start_load(
        self,
        request_id: str,
        *,
        block_ids: list[int],
        first_block_index: int,
        num_local_tokens: int,
        num_external_tokens: int,
        is_async: bool,
        step: int,
    ) -> ExternalLoad:
        """Starts a load into ``block_ids`` and schedules its reports.

        Sync failures are reported in ``step``; async ones between ``step + 1`` and
        the finishing step.
        """
        attempt = self._attempts.get(request_id, 0)
        self._attempts[request_id] = attempt + 1
        rng = self._rng(request_id, attempt)
        rng.random()  # the sync/async draw of get_num_new_matched_tokens
        failed = {b for b in block_ids if rng.random() < self.failure_rate}
        finish_step = step + rng.randint(1, self.max_latency) if is_async else step
        request_failed = is_async and rng.random() < self.request_failure_rate
        load = ExternalLoad(
            request_id=request_id,
            block_ids=block_ids,
            first_block_index=first_block_index,
            num_local_tokens=num_local_tokens,
            num_external_tokens=num_external_tokens,
            is_async=is_async,
            start_step=step,
            finish_step=finish_step,
            failed_block_ids=failed,
            request_failed=request_failed,
        )
        for block_id in block_ids:
            if block_id in failed:
                report = rng.randint(step + 1, finish_step) if is_async else step
                self._block_reports.setdefault(report, set()).add(block_id)
        if is_async:
            self._finishes.setdefault(finish_step, []).append(load)
        return load

    def forget(self, request_id: str) -> None:
        """Drops a finished request's attempt count (bounded memory)."""
        self._attempts.pop(request_id, None)

    def has_pending(self) -> bool:
        """Whether any async load or failure report is still due."""
        return bool(self._finishes) or bool(self._block_reports)

    def take_output(self, step: int) -> ConnectorOutput:
        """The connector output of ``step``; each report is handed out once."""
        landed = self._finishes.pop(step, [])
        return ConnectorOutput(
            invalid_block_ids=self._block_reports.pop(step, set()),
            failed_recving={load.request_id for load in landed if load.request_failed},
            finished_recving=[load.request_id for load in landed],
            landed=landed,
        )
