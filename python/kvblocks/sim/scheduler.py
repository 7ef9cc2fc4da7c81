"""The simulated engine: a vLLM-0.33-style scheduler loop over one KV cache manager.

Each step does what vLLM's ``Scheduler.schedule()`` then ``update_from_output()`` do,
on a single KV cache group:

1. **Running loop.** Every running request gets ``num_tokens - num_computed_tokens``
   tokens, capped by the step's token budget (chunked prefill). When
   ``allocate_slots`` returns ``None`` the last running request is preempted (freed,
   rewound to 0, put back at the head of the waiting queue), until the request fits
   or is itself the victim.
2. **Waiting loop** (only if nothing was preempted). A request waiting for remote KVs
   is skipped until its load finished; then, as ``_update_waiting_for_remote_kv``
   does, its valid prefix is cached (or its blocks freed when nothing is valid) and it
   is admitted like the others. A fresh request looks its prefix up
   (``get_computed_blocks``) and asks the connector for more. An async load allocates
   with ``delay_cache_blocks`` and parks the request in ``WAITING_FOR_REMOTE_KVS``; a
   sync load is admitted at once, its blocks hashed at allocation.
3. ``num_computed_tokens += scheduled`` for every scheduled request.
4. **Forward pass** (a stand-in): sync loads land, every scheduled request writes its
   tokens' KV. The :class:`~kvblocks.sim.checks.KVLedger` records what each block now
   holds and whether it is garbage.
5. **Output**, in vLLM's order: ``handle_failed_recving``, then
   ``handle_invalid_blocks`` (async pass over the requests waiting for remote KVs,
   sync pass over the running ones); the outputs of failed and rescheduled requests
   are discarded; the others get their sampled token and finish at their output
   length; failed requests are finished with an error (an async one whose transfer is
   still in flight keeps its blocks until the connector reports it finished); then
   ``finished_recving`` is processed.

Deviation from vLLM, to keep every run finite: if a step schedules nothing while no
transfer is in flight and blocks are held by waiting requests (async loads that filled
the pool), the last such request is preempted ("stall preemption").
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from kvblocks.constants import cdiv
from kvblocks.errors import KVBlocksError
from kvblocks.sim.checks import Checker, CheckError, InvalidBlocksContext, KVLedger, Writer
from kvblocks.sim.config import SimConfig
from kvblocks.sim.connector import Connector, ConnectorOutput, ExternalLoad
from kvblocks.sim.results import Series, SimResult, StepRecord, Summary
from kvblocks.sim.state import Counters, SimRequest, Status
from kvblocks.sim.workload import RequestSpec, iter_requests, output_token_id, prompt_token_ids

__all__ = ["ExtraCheck", "Simulator"]

#: A caller-supplied check: called with the simulator after every step; raises
#: :class:`~kvblocks.sim.checks.CheckError` (or any exception, reported as a failure) to
#: fail the run.
ExtraCheck = Callable[["Simulator"], None]


@dataclass(slots=True)
class _Plan:
    """A step's scheduler output and what happened to it."""

    num_scheduled: dict[str, int] = field(default_factory=dict)
    scheduled: list[SimRequest] = field(default_factory=list)
    computed_before: list[int] = field(default_factory=list)
    sync_loads: list[tuple[SimRequest, ExternalLoad]] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    async_started: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    rescheduled: list[str] = field(default_factory=list)
    retried: list[str] = field(default_factory=list)
    invalid: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)


class Simulator:
    """One simulated engine on one backend.

    Args:
        config: The run's configuration.
        backend: ``kvblocks.reference``, ``kvblocks._native`` or any module with the
            same API.
        backend_name: Name for the summary (default: ``backend.__name__``).
        extra_checks: Checks run after the built-in ones of every step (with
            ``config.check``, which turns the per-step checks on; the checks of the
            failure handling and of the end of the run always run).
        record_trace: Keep a :class:`StepRecord` per step.
        keep_final_block_hashes: Keep each finished request's block hashes.

    Attributes:
        config, backend, manager, pool, connector, ledger: The parts.
        step: The current step.
        waiting: The waiting queue (requests waiting for remote KVs included).
        running: The running requests, in scheduling order.
        requests: Every request not yet final, and failed ones whose blocks are still
            held by an in-flight transfer.
        counters: Running totals.
    """

    def __init__(
        self,
        config: SimConfig,
        backend: ModuleType,
        *,
        backend_name: str | None = None,
        extra_checks: Sequence[ExtraCheck] = (),
        record_trace: bool = False,
        keep_final_block_hashes: bool = False,
    ) -> None:
        self.config = config
        self.backend = backend
        self.backend_name = backend_name or backend.__name__
        self.manager: Any = backend.KVCacheManager(
            config.num_blocks,
            config.block_size,
            enable_caching=True,
            max_model_len=config.max_model_len,
            log_stats=True,
        )
        self.pool: Any = self.manager.block_pool
        self.hasher: Any = backend.BlockHasher(
            config.block_size, config.hash_algo, f"kvblocks-sim/{config.seed}"
        )
        self.connector = Connector(
            seed=config.seed,
            failure_rate=config.failure_rate,
            request_failure_rate=config.effective_request_failure_rate,
            async_share=config.async_share,
            max_load_attempts=config.max_load_attempts,
            max_latency=config.max_load_latency,
        )
        self.ledger = KVLedger(config.block_size)
        self.checker: Checker[Simulator] = Checker(extra_checks)
        self.step = 0
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        #: Async loads reported finished, not yet processed (vLLM's set of that name).
        self.finished_recving_ids: set[str] = set()
        #: Async loads that failed and are retried from their valid prefix.
        self.failed_recving_ids: set[str] = set()
        self.counters = Counters()
        #: (requests, queries, hits) recorded with the manager in the current step.
        self.recorded_stats = (0, 0, 0)
        #: The manager's make_prefix_cache_stats() of the current step, as a tuple.
        self.last_stats_delta = (0, 0, 0)
        self.series = Series()
        self.trace: list[StepRecord] | None = [] if record_trace else None
        self.final_block_hashes: dict[str, list[bytes]] | None = (
            {} if keep_final_block_hashes else None
        )
        #: Blocks whose ref count or hash the current step may have changed.
        self.dirty: set[int] = set()
        self.num_steps = 0
        self.peak_usage = 0.0
        self.scheduler_s = 0.0
        self.check_s = 0.0

    # ------------------------------------------------------------------ views

    def holders(self) -> list[SimRequest]:
        """The requests whose tables hold blocks."""
        return [s for s in self.requests.values() if s.table]

    def stale_hashed_blocks(self) -> int:
        """Stale blocks that are in the prefix cache now."""
        return sum(1 for b in self.ledger.stale if self.pool.get_block(b).block_hash is not None)

    # ------------------------------------------------------------------ the run

    def run(self, progress: Callable[[Simulator], None] | None = None) -> SimResult:
        """Runs the whole workload; stops at the first failed check.

        Args:
            progress: Called after every step (e.g. a progress bar).

        Returns:
            The result; ``result.failure`` is the failed check, if any.
        """
        start = time.perf_counter()
        failure: CheckError | None = None
        specs = iter_requests(self.config.workload_params())
        pending = next(specs, None)
        limit = self.config.step_limit
        try:
            while True:
                while pending is not None and pending.arrival_step <= self.step:
                    self._arrive(pending)
                    pending = next(specs, None)
                if not self.requests and not self.connector.has_pending():
                    if pending is None:
                        break
                    self.step = pending.arrival_step  # idle until the next arrival
                    continue
                if self.num_steps >= limit:
                    raise CheckError(
                        self.step,
                        "drained",
                        f"{len(self.requests)} requests left after {limit} steps",
                    )
                self._step()
                self.step += 1
                if progress is not None:
                    progress(self)
            t = time.perf_counter()
            self.checker.final(self)
            self.check_s += time.perf_counter() - t
        except CheckError as exc:
            failure = exc
        except KVBlocksError as exc:
            failure = CheckError(self.step, "library error", f"{type(exc).__name__}: {exc}")
            failure.__cause__ = exc
        return SimResult(
            config=self.config,
            summary=self._summary(time.perf_counter() - start),
            series=self.series,
            failure=failure,
            trace=self.trace,
            final_block_hashes=self.final_block_hashes,
        )

    def _summary(self, wall_s: float) -> Summary:
        c = self.counters
        return Summary(
            backend=self.backend_name,
            requests=self.config.num_requests,
            finished=c.finished,
            failed=c.failed,
            rescheduled=c.rescheduled,
            retried=c.retried,
            preemptions=c.preemptions,
            stall_preemptions=c.stall_preemptions,
            steps=self.num_steps,
            tokens_scheduled=c.tokens_scheduled,
            tokens_rolled_back=c.tokens_rolled_back,
            sync_loads=c.sync_loads,
            async_loads=c.async_loads,
            external_tokens=c.external_tokens,
            external_blocks=c.external_blocks,
            invalid_blocks_reported=c.invalid_blocks_reported,
            request_load_failures=c.request_load_failures,
            evicted_blocks=c.evicted_blocks,
            prefix_queries=c.prefix_queries,
            prefix_hits=c.prefix_hits,
            hit_rate=c.prefix_hits / c.prefix_queries if c.prefix_queries else 0.0,
            peak_usage=self.peak_usage,
            final_usage=self.pool.get_usage(),
            final_free_blocks=self.pool.get_num_free_blocks(),
            stale_outputs=c.stale_outputs,
            stale_reads=c.stale_reads,
            stale_hashed_blocks=self.stale_hashed_blocks(),
            shared_tail_hashed=self.checker.shared_tail_hashed,
            mean_step_s=self.scheduler_s / self.num_steps if self.num_steps else 0.0,
            check_s=self.check_s,
            wall_s=wall_s,
            checks_passed=self.checker.num_checks,
        )

    def _arrive(self, spec: RequestSpec) -> None:
        request = self.backend.Request(
            spec.request_id, prompt_token_ids(spec), block_hasher=self.hasher
        )
        s = SimRequest(spec=spec, req=request)
        self.requests[spec.request_id] = s
        self.waiting.append(s)
        self.counters.arrived += 1

    def _step(self) -> None:
        t0 = time.perf_counter()
        self.dirty = set()
        check_before = self.check_s
        plan = self._schedule()
        t1 = time.perf_counter()
        usage = self.pool.get_usage()
        self.peak_usage = max(self.peak_usage, usage)
        accepted_ok, problems = self._forward(plan)
        output = self.connector.take_output(self.step)
        t2 = time.perf_counter()
        self._update_from_output(plan, output, accepted_ok)
        self._pull_stats()
        t3 = time.perf_counter()
        # Checks run inside the output handling are not scheduler time.
        self.scheduler_s += (t1 - t0) + (t3 - t2) - (self.check_s - check_before)
        self.num_steps += 1
        if self.config.check:
            self.checker.after_step(self, plan.freed, problems, self.dirty)
            self.check_s += time.perf_counter() - t3
        self.recorded_stats = (0, 0, 0)
        self.series.add(
            self.step,
            usage=usage,
            queries=self.last_stats_delta[1],
            hits=self.last_stats_delta[2],
            running=len(self.running),
            waiting=len(self.waiting),
        )
        if self.trace is not None:
            self.trace.append(self._record(plan))

    def _pull_stats(self) -> None:
        stats = self.manager.make_prefix_cache_stats()
        c = self.counters
        c.prefix_requests += stats.requests
        c.prefix_queries += stats.queries
        c.prefix_hits += stats.hits
        self.last_stats_delta = (stats.requests, stats.queries, stats.hits)

    def _record(self, plan: _Plan) -> StepRecord:
        digest = hashlib.sha256()
        digest.update(repr(self.pool.free_block_ids()).encode())
        for rid in sorted(self.requests):
            s = self.requests[rid]
            digest.update(f"{rid}:{s.req.num_computed_tokens}:{s.table}".encode())
        return StepRecord(
            step=self.step,
            scheduled=tuple(
                (s.spec.request_id, plan.num_scheduled[s.spec.request_id]) for s in plan.scheduled
            ),
            admitted=tuple(plan.admitted),
            async_started=tuple(plan.async_started),
            preempted=tuple(plan.preempted),
            finished=tuple(plan.finished),
            failed=tuple(plan.failed),
            rescheduled=tuple(plan.rescheduled),
            retried=tuple(plan.retried),
            invalid_block_ids=tuple(plan.invalid),
            evicted_block_ids=tuple(plan.evicted),
            num_free_blocks=self.pool.get_num_free_blocks(),
            state_digest=digest.hexdigest()[:16],
        )

    # ------------------------------------------------------------------ schedule()

    def _schedule(self) -> _Plan:
        plan = _Plan()
        budget = self.config.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            s = self.running[i]
            r = s.req
            num_new = min(r.num_tokens - r.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            new_blocks = self.manager.allocate_slots(r, num_new)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim, plan)
                self.waiting.appendleft(victim)
                preempted = True
                if victim is s:
                    break
                new_blocks = self.manager.allocate_slots(r, num_new)
            if new_blocks is None:
                break
            self._extend(s, new_blocks)
            self._scheduled(s, num_new, plan)
            budget -= num_new
            i += 1
        if not preempted:
            self._schedule_waiting(budget, plan)
        if not plan.scheduled and not plan.async_started:
            self._break_stall(plan)
        # vLLM's _update_after_schedule.
        size = self.config.block_size
        for s in plan.scheduled:
            r = s.req
            # allocate_slots cached at most the blocks from the one before the first
            # block this step computes into.
            self.dirty.update(s.table[max(r.num_computed_tokens // size - 1, 0) :])
            plan.computed_before.append(r.num_computed_tokens)
            r.num_computed_tokens = r.num_computed_tokens + plan.num_scheduled[s.spec.request_id]
        return plan

    def _scheduled(self, s: SimRequest, num_new: int, plan: _Plan) -> None:
        plan.num_scheduled[s.spec.request_id] = num_new
        plan.scheduled.append(s)
        self.counters.tokens_scheduled += num_new

    def _extend(self, s: SimRequest, new_blocks: list[int]) -> None:
        if new_blocks:
            s.table.extend(new_blocks)
            self.ledger.allocate(new_blocks)
            self.dirty.update(new_blocks)

    def _free(self, s: SimRequest, plan: _Plan) -> None:
        self.manager.free(s.req)
        self.dirty.update(s.table)
        s.table = []
        plan.freed.append(s.spec.request_id)

    def _preempt(self, s: SimRequest, plan: _Plan) -> None:
        """Frees ``s``'s blocks and sends it back to be recomputed (the caller queues it)."""
        self._free(s, plan)
        s.req.num_computed_tokens = 0
        s.status = Status.PREEMPTED
        s.num_preemptions += 1
        self.counters.preemptions += 1
        plan.preempted.append(s.spec.request_id)

    def _schedule_waiting(self, budget: int, plan: _Plan) -> None:
        skipped: list[SimRequest] = []
        max_seqs = self.config.max_num_seqs
        while self.waiting and budget > 0 and len(self.running) < max_seqs:
            s = self.waiting[0]
            if s.status is Status.WAITING_FOR_REMOTE_KVS:
                if s.spec.request_id not in self.finished_recving_ids:
                    skipped.append(self.waiting.popleft())
                    continue
                self._update_waiting_for_remote_kv(s, plan)
            num_new = self._admit(s, budget, plan)
            if num_new is None:
                break
            self.waiting.popleft()
            if s.status is Status.WAITING_FOR_REMOTE_KVS:
                skipped.append(s)
            else:
                self.running.append(s)
                budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _update_waiting_for_remote_kv(self, s: SimRequest, plan: _Plan) -> None:
        """vLLM's ``_update_waiting_for_remote_kv``."""
        rid, r = s.spec.request_id, s.req
        self.dirty.update(s.table)
        if rid in self.failed_recving_ids:
            if r.num_computed_tokens:
                self.manager.cache_blocks(r, r.num_computed_tokens)
            else:
                self._free(s, plan)  # nothing valid: retried from scratch
            self.failed_recving_ids.discard(rid)
        else:
            self.manager.cache_blocks(r, r.num_computed_tokens)
        if r.num_computed_tokens == r.num_tokens:
            r.num_computed_tokens = r.num_tokens - 1
        self.finished_recving_ids.discard(rid)
        s.load = None
        s.status = Status.PREEMPTED if s.num_preemptions else Status.WAITING

    def _admit(self, s: SimRequest, budget: int, plan: _Plan) -> int | None:
        """Admits the head of the waiting queue; returns its tokens, or None if it does not fit."""
        rid, r = s.spec.request_id, s.req
        fresh = r.num_computed_tokens == 0
        hits: list[int] = []
        num_local = num_external = 0
        is_async = False
        if fresh:
            hits, num_local = self.manager.get_computed_blocks(r)
            num_external, is_async = self.connector.get_num_new_matched_tokens(
                rid, r.num_tokens, s.spec.remote_prefix_tokens, num_local
            )
        # An async load holds the request until its KV lands: no tokens run this step
        # and its blocks are cached only once the load is processed.
        num_new = (
            0
            if is_async
            else min(r.num_tokens - r.num_computed_tokens - num_local - num_external, budget)
        )
        new_blocks = self.manager.allocate_slots(
            r,
            num_new,
            num_local,
            hits,
            num_external_computed_tokens=num_external,
            delay_cache_blocks=is_async,
        )
        if new_blocks is None:
            return None
        if fresh:
            self._record_stats(r, num_local)
        if is_async or hits or num_external:
            self._adopt(
                s,
                hits=hits,
                new_blocks=new_blocks,
                num_local=num_local,
                num_external=num_external,
                is_async=is_async,
                plan=plan,
            )
        else:
            self._extend(s, new_blocks)
        r.num_computed_tokens = r.num_computed_tokens + num_local + num_external
        self.counters.admissions += 1
        if is_async:
            s.status = Status.WAITING_FOR_REMOTE_KVS
            plan.async_started.append(rid)
            return 0
        s.status = Status.RUNNING
        plan.admitted.append(rid)
        self._scheduled(s, num_new, plan)
        return num_new

    def _record_stats(self, r: Any, num_hits: int) -> None:
        self.manager.record_prefix_cache_stats(r, num_hits)
        n, q, h = self.recorded_stats
        self.recorded_stats = (n + 1, q + r.num_tokens, h + num_hits)

    def _adopt(
        self,
        s: SimRequest,
        *,
        hits: list[int],
        new_blocks: list[int],
        num_local: int,
        num_external: int,
        is_async: bool,
        plan: _Plan,
    ) -> None:
        """A first allocation with hits or external tokens: rebuild the expected table."""
        rid = s.spec.request_id
        size = self.config.block_size
        (table,) = self.manager.get_block_ids(rid)
        table = list(table)
        num_external_blocks = cdiv(num_local + num_external, size) - len(hits)
        external = table[len(hits) : len(hits) + max(num_external_blocks, 0)]
        expected = [*hits, *external, *new_blocks]
        if table != expected or len(external) != max(num_external_blocks, 0):
            raise CheckError(
                self.step,
                "admission",
                f"{rid}: table {table} is not hits {hits} + {num_external_blocks} external "
                f"blocks + new {new_blocks}",
            )
        s.table = table
        self.dirty.update(table)
        self.ledger.allocate([*external, *new_blocks])
        if not num_external:
            return
        load = self.connector.start_load(
            rid,
            block_ids=external,
            first_block_index=len(hits),
            num_local_tokens=num_local,
            num_external_tokens=num_external,
            is_async=is_async,
            step=self.step,
        )
        c = self.counters
        c.external_tokens += num_external
        c.external_blocks += len(external)
        if is_async:
            c.async_loads += 1
            s.load = load
        else:
            c.sync_loads += 1
            plan.sync_loads.append((s, load))

    def _break_stall(self, plan: _Plan) -> None:
        """Nothing could run: free the last waiting request that holds blocks (if stuck)."""
        if self.running or not self.waiting or self.connector.has_pending():
            return
        for s in reversed(self.waiting):
            rid = s.spec.request_id
            landed = rid in self.finished_recving_ids
            if s.table and (s.status is not Status.WAITING_FOR_REMOTE_KVS or landed):
                self.finished_recving_ids.discard(rid)
                self.failed_recving_ids.discard(rid)
                s.load = None
                self._preempt(s, plan)  # already in the waiting queue
                self.counters.stall_preemptions += 1
                return
        raise CheckError(self.step, "stalled", "nothing can be scheduled and nothing is in flight")

    # ------------------------------------------------------------------ the forward pass

    def _forward(self, plan: _Plan) -> tuple[dict[str, bool], list[str]]:
        """Sync loads land and every scheduled request writes its KV (ledger only)."""
        for s, load in plan.sync_loads:
            self.ledger.load(
                load.block_ids,
                load.first_block_index,
                load.num_local_tokens + load.num_external_tokens,
                s.req.block_hashes,
                load.failed_block_ids,
            )
        writers = [
            Writer(
                request_id=s.spec.request_id,
                table=s.table,
                start=start,
                count=plan.num_scheduled[s.spec.request_id],
                hashes=_hashes_of(s.req),
            )
            for s, start in zip(plan.scheduled, plan.computed_before, strict=True)
        ]
        ok, problems = self.ledger.compute(writers)
        return {w.request_id: good for w, good in zip(writers, ok, strict=True)}, problems

    # ------------------------------------------------------------------ update_from_output()

    def _update_from_output(
        self, plan: _Plan, output: ConnectorOutput, read_ok: dict[str, bool]
    ) -> None:
        cfg, c = self.config, self.counters
        remote = [s for s in self.waiting if s.status is Status.WAITING_FOR_REMOTE_KVS]
        failed_ids: set[str] = set()
        retry_ids: set[str] = set()
        skip: set[str] = set()
        if output.failed_recving:
            outcome = self.backend.handle_failed_recving(
                output.failed_recving, [s.req for s in remote], policy=cfg.policy
            )
            failed_ids |= outcome.failed_req_ids
            retry_ids |= outcome.retry_req_ids
            c.request_load_failures += len(outcome.failed_req_ids | outcome.retry_req_ids)
            c.tokens_rolled_back += outcome.total_affected_tokens
        if output.invalid_block_ids:
            invalid = output.invalid_block_ids
            plan.invalid = sorted(invalid)
            c.invalid_blocks_reported += len(invalid)
            ctx = InvalidBlocksContext(
                invalid_block_ids=set(invalid),
                sync_requests=[
                    (s, s.req.num_computed_tokens, plan.num_scheduled.get(s.spec.request_id, 0))
                    for s in self.running
                ],
                async_requests=[(s, s.req.num_computed_tokens) for s in remote],
            )
            outcome = self.backend.handle_invalid_blocks(
                self.manager,
                invalid,
                plan.num_scheduled,
                running=[s.req for s in self.running],
                waiting_for_remote_kvs=[s.req for s in remote],
                policy=cfg.policy,
                mode=cfg.mode,
            )
            ctx.outcome = outcome
            failed_ids |= outcome.failed_req_ids
            retry_ids |= outcome.retry_req_ids
            skip |= outcome.rescheduled_req_ids
            plan.evicted = sorted(outcome.evicted_block_ids)
            self.dirty.update(outcome.evicted_block_ids)
            c.evicted_blocks += len(outcome.evicted_block_ids)
            c.tokens_rolled_back += outcome.total_affected_tokens
            rescheduled = [
                s.spec.request_id
                for s in self.running
                if s.spec.request_id in outcome.rescheduled_req_ids
            ]
            plan.rescheduled = rescheduled
            c.rescheduled += len(rescheduled)
            # Cheap and only on failure steps: always run (it also counts a hazard).
            t = time.perf_counter()
            self.checker.after_invalid_blocks(self, ctx)
            self.check_s += time.perf_counter() - t
        skip |= failed_ids
        self.failed_recving_ids |= retry_ids
        plan.retried = [s.spec.request_id for s in remote if s.spec.request_id in retry_ids]
        c.retried += len(retry_ids)

        done: set[str] = set()
        for s in plan.scheduled:
            rid = s.spec.request_id
            if rid in skip:
                continue  # output discarded
            if not read_ok[rid]:
                c.stale_reads += 1
                if not s.stale_output:
                    s.stale_output = True
                    c.stale_outputs += 1
            r = s.req
            if r.num_computed_tokens >= r.num_tokens:
                r.append_output_token_ids(output_token_id(s.spec, s.num_output))
                s.num_output += 1
                if s.num_output >= s.spec.output_len:
                    done.add(rid)
                    self._finish(s, Status.FINISHED, plan)
                    plan.finished.append(rid)
        if failed_ids:
            for s in [*self.running, *remote]:
                rid = s.spec.request_id
                if rid in failed_ids and rid not in done:
                    done.add(rid)
                    self._finish(s, Status.FAILED, plan)
                    plan.failed.append(rid)
        if done:
            self.running = [s for s in self.running if s.spec.request_id not in done]
            if failed_ids:
                self.waiting = deque(s for s in self.waiting if s.spec.request_id not in done)

        for load in output.landed:
            s_or_none = self.requests.get(load.request_id)
            if s_or_none is None or s_or_none.load is not load:
                continue
            s = s_or_none
            failed = set(load.block_ids) if load.request_failed else load.failed_block_ids
            self.ledger.load(
                load.block_ids,
                load.first_block_index,
                load.num_local_tokens + load.num_external_tokens,
                s.req.block_hashes,
                failed,
            )
            if s.status is Status.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_ids.add(load.request_id)
            elif s.free_delayed:
                s.free_delayed = False
                s.load = None
                self._free(s, plan)
                self._forget(s)

    def _finish(self, s: SimRequest, status: Status, plan: _Plan) -> None:
        rid = s.spec.request_id
        delay = (
            status is Status.FAILED
            and s.status is Status.WAITING_FOR_REMOTE_KVS
            and rid not in self.finished_recving_ids
        )
        self.finished_recving_ids.discard(rid)
        self.failed_recving_ids.discard(rid)
        s.status = status
        if status is Status.FINISHED:
            self.counters.finished += 1
            if self.final_block_hashes is not None:
                self.final_block_hashes[rid] = list(s.req.block_hashes)
        else:
            self.counters.failed += 1
        if delay:
            # The transfer still writes into the blocks: free them when it finishes.
            s.free_delayed = True
            return
        s.load = None
        self._free(s, plan)
        self._forget(s)

    def _forget(self, s: SimRequest) -> None:
        del self.requests[s.spec.request_id]
        self.connector.forget(s.spec.request_id)


def _hashes_of(request: Any) -> Callable[[], Sequence[bytes]]:
    def hashes() -> Sequence[bytes]:
        block_hashes: Sequence[bytes] = request.block_hashes
        return block_hashes

    return hashes
