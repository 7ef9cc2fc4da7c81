"""Building vLLM's scheduler for a scenario and driving it, as a synchronous engine
(``EngineCore.step``) or as a depth-2 pipeline (``EngineCore.step_with_batch_queue``),
recording per step what :mod:`harness.compare` compares. The fake model's tokens, drafts
and connector results are functions of the request ids, the step number and what the
scheduler output said -- never of Python's ``hash()`` -- so two schedulers that behave
alike are fed exactly the same inputs.
"""

from __future__ import annotations

import zlib
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvblocks.vllm import cpu
from kvblocks.vllm.cpu import (
    VOCAB_SIZE,
    GroupLayout,
    cpu_vllm_config,
    kv_cache_config,
)
from vllm.config import (
    KVEventsConfig,
    KVTransferConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs, FinishReason
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from .connector import (
    DiffFakeConnector,
    DiffFakeHMAConnector,
    LoadRecord,
    RecordingPublisher,
)
from .normalise import normalise, normalise_engine_outputs, normalise_events
from .scenarios import ReqSpec, Scenario

#: Steps without a scheduled token (and nothing pending) after which a run has stalled.
STALL_STEPS = 40
#: Steps in which no request computed past the furthest point it had reached (and nothing
#: pending) after which a run that still schedules tokens is livelocked.
LIVELOCK_STEPS = 200


def crc(*parts: object) -> int:
    """A stable 32-bit hash of ``parts`` (``zlib.crc32``; never Python's ``hash()``)."""
    return zlib.crc32("|".join(str(p) for p in parts).encode())


def fake_token(*parts: object) -> int:
    """A deterministic token id in ``[1, VOCAB_SIZE)``."""
    return 1 + crc("tok", *parts) % (VOCAB_SIZE - 1)


def build_vllm_config(scn: Scenario, model_dir: Path) -> VllmConfig:
    """``VllmConfig`` for ``scn`` (a config-only model, no tokenizer); async engines get
    ``async_scheduling``."""
    kv_events = (
        KVEventsConfig(enable_kv_cache_events=True, publisher="null") if scn.events else None
    )
    spec = (
        SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=scn.spec_tokens,
            prompt_lookup_min=1,
            prompt_lookup_max=2,
        )
        if scn.spec_tokens
        else None
    )
    transfer = (
        KVTransferConfig(
            kv_connector=(
                DiffFakeHMAConnector if scn.connector_hma else DiffFakeConnector
            ).__name__,
            kv_connector_module_path=DiffFakeConnector.__module__,
            kv_role="kv_both",
            kv_load_failure_policy=scn.connector_policy,  # type: ignore[arg-type]
        )
        if scn.connector_policy is not None
        else None
    )
    return cpu_vllm_config(
        model_dir,
        block_size=scn.block_size,
        num_blocks=scn.num_blocks,
        max_num_seqs=scn.max_num_seqs,
        max_num_batched_tokens=scn.max_num_batched_tokens,
        max_model_len=scn.max_model_len,
        enable_prefix_caching=scn.enable_caching,
        async_scheduling=scn.is_async,
        scheduler_options={
            "long_prefill_token_threshold": scn.long_prefill_token_threshold,
            "watermark": scn.watermark,
            "scheduler_reserve_full_isl": scn.reserve_full_isl,
            "policy": "priority" if scn.scheduling_policy == "priority" else "fcfs",
        },
        kv_events_config=kv_events,
        speculative_config=spec,
        kv_transfer_config=transfer,
    )


def build_kv_cache_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    """One full-attention group, as the engine core makes for the tiny model."""
    return kv_cache_config((GroupLayout("full"),), num_blocks, block_size, retention_interval=None)


def scenario_kv_cache_config(scn: Scenario) -> KVCacheConfig:
    """The scenario's layout: :func:`build_kv_cache_config` (one full-attention group) when
    it has none, else one group per item of ``scn.layout``, with its retention interval."""
    if not scn.layout:
        return build_kv_cache_config(scn.num_blocks, scn.block_size)
    return kv_cache_config(
        scn.layout, scn.num_blocks, scn.block_size, retention_interval=scn.retention_interval
    )


def build_scheduler(scn: Scenario, scheduler_cls: type[Scheduler], model_dir: Path) -> Scheduler:
    scheduler: Scheduler = cpu.build_scheduler(
        scheduler_cls,
        build_vllm_config(scn, model_dir),
        scenario_kv_cache_config(scn),
        hash_block_size=scn.hash_block_size,
    )
    return scheduler


@dataclass
class RunResult:
    """What one run produced: a record per step, plus facts about what it exercised."""

    scenario_id: str
    scheduler_cls: str
    manager_cls: str
    manager_type: type
    records: list[dict[str, Any]]
    finished: bool
    stalled: bool = False
    livelocked: bool = False
    coverage: Counter[str] = field(default_factory=Counter)


@dataclass
class _Pending:
    due: int
    load: LoadRecord
    fail: str | None


class Driver:
    """Feeds one scheduler a scenario's requests and fake model outputs, step by step."""

    def __init__(
        self,
        scn: Scenario,
        scheduler_cls: type[Scheduler],
        model_dir: Path,
        count_manager_calls: bool = False,
    ) -> None:
        self.scn = scn
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(scn.hash_block_size or scn.block_size, sha256)
        self.sched = build_scheduler(scn, scheduler_cls, model_dir)
        self.publisher = RecordingPublisher()
        self.sched.kv_event_publisher = self.publisher
        self.records: list[dict[str, Any]] = []
        self.coverage: Counter[str] = Counter()
        self.specs = {r.req_id: r for r in scn.requests}
        self.prompts: dict[str, list[int]] = {}
        self.generated: dict[str, list[int]] = {}
        self.done: set[str] = set()
        self.added: set[str] = set()
        self.pending_loads: list[_Pending] = []
        # Requests whose sync load the output of a step reports invalid, by that step.
        self.invalid_sync_loads: dict[int, list[str]] = {}
        self.quiet_steps = 0
        self.stalled = False
        self.furthest: dict[str, int] = {}  # each request's most computed tokens so far
        self.last_progress = 0
        self.livelocked = False
        self.last_event = max(
            [r.arrival_step for r in scn.requests]
            + [a.step for a in scn.aborts]
            + [step for step, _ in scn.resets]
        )
        if count_manager_calls:
            self._count_manager_calls()

    # -- coverage -------------------------------------------------------------------
    def _count_manager_calls(self) -> None:
        """Wrap a few manager methods on the instance to count the paths a run takes."""
        manager = self.sched.kv_cache_manager
        for name in ("pop_blocks_for_free", "evict_blocks", "free"):
            self._wrap(manager, name)
        self._wrap(manager, "cache_blocks", self._cache_blocks_args)
        self._wrap(manager.coordinator, "get_num_blocks_to_allocate")
        self._wrap(manager.block_pool, "free_blocks")

    def _wrap(
        self, obj: Any, name: str, inspect: Callable[[tuple[Any, ...]], None] | None = None
    ) -> None:
        inner = getattr(obj, name)
        coverage = self.coverage

        def counted(*args: Any, **kwargs: Any) -> Any:
            coverage[f"call:{name}"] += 1
            if inspect is not None:
                inspect(args + tuple(kwargs.values()))
            return inner(*args, **kwargs)

        setattr(obj, name, counted)

    def _cache_blocks_args(self, args: tuple[Any, ...]) -> None:
        """``cache_blocks(request, num_computed_tokens)``: count the negative counts that
        ``update_from_output`` passes when a failed load cut a request in flight back."""
        _, num_tokens = args
        if num_tokens < 0:
            self.coverage["call:cache_blocks_negative"] += 1

    # -- inputs ---------------------------------------------------------------------
    def _new_request(self, spec: ReqSpec) -> Request:
        prompt = list(spec.prompt)
        if spec.parent is not None:
            prompt = self.prompts[spec.parent] + self.generated[spec.parent] + prompt
            self.coverage["multiturn"] += 1
        room = self.scn.max_model_len - spec.max_tokens - self.scn.spec_tokens - 2
        prompt = prompt[:room]
        self.prompts[spec.req_id] = prompt
        self.generated[spec.req_id] = []
        extra: dict[str, Any] | None = None
        if spec.ext_blocks:
            extra = {
                "kv_transfer_params": {
                    "diff_ext_blocks": spec.ext_blocks,
                    "diff_async": spec.ext_async,
                }
            }
        params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True, extra_args=extra)
        return Request(
            request_id=spec.req_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            arrival_time=spec.arrival_time,
            block_hasher=self.hasher,
            priority=spec.priority,
        )

    def _add_arrivals(self, step: int, rec: dict[str, Any]) -> None:
        arrived = []
        for spec in self.scn.requests:
            if spec.req_id in self.added or spec.arrival_step > step:
                continue
            if spec.parent is not None and spec.parent not in self.done:
                continue
            self.sched.add_request(self._new_request(spec))
            self.added.add(spec.req_id)
            arrived.append(spec.req_id)
        if arrived:
            rec["arrived"] = arrived

    def _future_arrivals(self) -> bool:
        return len(self.added) < len(self.scn.requests)

    def _resets(self, step: int, rec: dict[str, Any]) -> None:
        for at, running in self.scn.resets:
            if at != step:
                continue
            try:
                ok: Any = self.sched.reset_prefix_cache(reset_running_requests=running)
            except RuntimeError as exc:
                ok = f"RuntimeError: {exc}"
            rec.setdefault("resets", []).append([running, ok])
            if ok is True:
                self.coverage["reset_ok_running" if running else "reset_ok"] += 1
            else:
                self.coverage["reset_refused"] += 1

    def _abort_targets(self, step: int, so: SchedulerOutput | None) -> list[str]:
        targets: list[str] = []
        for abort in self.scn.aborts:
            if abort.step != step:
                continue
            if abort.kind == "sched":
                ids = list(so.num_scheduled_tokens) if so is not None else []
            else:
                ids = sorted(r for r, req in self.sched.requests.items() if not req.is_finished())
            if ids:
                targets.append(ids[abort.k % len(ids)])
        return targets

    def _abort(self, targets: list[str], rec: dict[str, Any]) -> None:
        if not targets:
            return
        for req_id in targets:
            req = self.sched.requests.get(req_id)
            if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.coverage["abort_remote_kv"] += 1
        aborted = self.sched.finish_requests(targets, RequestStatus.FINISHED_ABORTED)
        rec["aborted"] = sorted(r.request_id for r in aborted)
        self.coverage["aborted"] += len(aborted)
        for req in aborted:
            self._finish(req.request_id)

    def _finish(self, req_id: str) -> None:
        self.done.add(req_id)

    # -- the fake model -------------------------------------------------------------
    def _model_output(self, step: int, so: SchedulerOutput) -> ModelRunnerOutput:
        """Sampled tokens for ``so``, decided as the worker would at execution time."""
        ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in ids:
            req = self.sched.requests[req_id]
            if req.is_prefill_chunk:
                sampled.append([])
                continue
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            accepted = crc("acc", req_id, step) % (len(drafts) + 1)
            tokens = [
                d if d >= 0 else fake_token(req_id, step, i)
                for i, d in enumerate(drafts[:accepted])
            ]
            tokens.append(fake_token(req_id, step, "bonus"))
            if drafts:
                self.coverage["spec_scheduled"] += 1
                self.coverage["spec_accepted"] += accepted
                self.coverage["spec_rejected"] += len(drafts) - accepted
            sampled.append(tokens)
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=self._connector_output(step, so),
        )

    def _connector_output(self, step: int, so: SchedulerOutput) -> KVConnectorOutput | None:
        connector = self.sched.connector
        if connector is None:
            return None
        assert isinstance(connector, DiffFakeConnector)
        invalid: set[int] = set()
        failed: set[str] = set()
        finished: set[str] = set()
        for load in connector.take_new_loads():
            fail = self.specs[load.req_id].fail if load.attempt == 1 else None
            if load.is_async:
                self.coverage["load_async"] += 1
                delay = 1 + crc("delay", load.req_id, load.attempt) % 3
                self.pending_loads.append(_Pending(step + delay, load, fail))
            else:
                self.coverage["load_sync"] += 1
                if fail is not None and load.external_block_ids:
                    invalid.add(self._pick(load))
                    self._count_invalid(step, load, "sync")
        keep: list[_Pending] = []
        for pending in self.pending_loads:
            if pending.due > step:
                keep.append(pending)
                continue
            finished.add(pending.load.req_id)
            if pending.fail == "invalid" and pending.load.external_block_ids:
                invalid.add(self._pick(pending.load))
                self._count_invalid(step, pending.load, "async")
            elif pending.fail == "failed_recving":
                failed.add(pending.load.req_id)
                self.coverage[f"failed_recving:{self.scn.connector_policy}"] += 1
        self.pending_loads = keep
        return KVConnectorOutput(
            finished_recving=finished or None,
            invalid_block_ids=invalid,
            failed_recving=failed,
        )

    def _count_invalid(self, step: int, load: LoadRecord, kind: str) -> None:
        policy = self.scn.connector_policy
        self.coverage[f"invalid_{kind}:{policy}"] += 1
        if self.scn.spec_tokens:
            self.coverage[f"invalid_with_spec:{policy}"] += 1
        if kind == "sync" and self.scn.is_async:
            self.invalid_sync_loads.setdefault(step, []).append(load.req_id)

    @staticmethod
    def _pick(load: LoadRecord) -> int:
        ids = load.external_block_ids
        return ids[crc("invalid", load.req_id, load.attempt) % len(ids)]

    def _propose_drafts(self, step: int, so: SchedulerOutput) -> None:
        """Sync engine with spec decode: the drafter's proposals after the step."""
        if not self.scn.spec_tokens or so.total_num_scheduled_tokens == 0:
            return
        req_ids: list[str] = []
        drafts: list[list[int]] = []
        for req_id in so.num_scheduled_tokens:
            n = crc("ndraft", req_id, step) % (self.scn.spec_tokens + 1)
            req_ids.append(req_id)
            drafts.append([fake_token("draft", req_id, step, i) for i in range(n)])
        self.sched.update_draft_token_ids(DraftTokenIds(req_ids, drafts))

    # -- recording ------------------------------------------------------------------
    def _record_schedule(self, so: SchedulerOutput, rec: dict[str, Any]) -> None:
        norm = normalise(so, "so")
        rec["schedule"] = norm
        for new in so.scheduled_new_reqs:
            if new.num_computed_tokens > 0:
                self.coverage["prefix_hit"] += 1
        cached = so.scheduled_cached_reqs
        self.coverage["resumed"] += len(cached.resumed_req_ids)
        if so.preempted_req_ids:
            self.coverage["preempted"] += len(so.preempted_req_ids)
            self.coverage[f"preempted:{self.scn.scheduling_policy}"] += len(so.preempted_req_ids)
            self.coverage[f"preempted:bs{self.scn.block_size}"] += len(so.preempted_req_ids)
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            if req.is_prefill_chunk and n > 1:
                self.coverage["prefill_chunk"] += 1
        if self.sched.deferred_frees:
            self.coverage["deferred_frees_pending"] += 1

    def _record_update(self, outputs: dict[int, EngineCoreOutputs], rec: dict[str, Any]) -> None:
        rec["outputs"] = normalise_engine_outputs(outputs)
        rec["events"] = normalise_events(self.publisher.take())
        if rec["events"]:
            self.coverage["event_batches"] += 1
        errors = sum(
            out.finish_reason == FinishReason.ERROR
            for eco in outputs.values()
            for out in eco.outputs
        )
        if errors > 1:
            # Several requests failed at once: vLLM finishes (and frees) them in the
            # iteration order of a set of request ids.
            self.coverage["multi_error_step"] += 1
        for eco in outputs.values():
            for out in eco.outputs:
                self.generated.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    self._finish(out.request_id)
                    if out.finish_reason == FinishReason.ERROR:
                        self.coverage["finished_error"] += 1
                    elif out.finish_reason == FinishReason.ABORT:
                        self.coverage["finished_abort"] += 1
                if out.prefill_stats is not None and out.prefill_stats.num_cached_tokens:
                    self.coverage["prefill_stats_cached"] += 1
            stats = eco.scheduler_stats
            if stats is not None and stats.prefix_cache_stats.reset:
                self.coverage["stats_reset"] += 1
            if stats is not None and stats.prefix_cache_stats.preempted_requests:
                self.coverage["stats_preempted"] += 1

    def _count_invalid_in_flight(
        self, sched_step: int, so: SchedulerOutput, mro: ModelRunnerOutput
    ) -> None:
        """Before the update of step ``sched_step``: count the requests whose sync load it
        reports invalid while a later batch, already scheduled, holds more of their tokens
        (the failure rolls back tokens that the later batch's update accounts for), and the
        running requests that its invalid blocks meet with fewer computed tokens than it
        scheduled (an earlier rollback took them back; vLLM then scans none of their blocks)."""
        kv_output = mro.kv_connector_output
        if kv_output is not None and kv_output.invalid_block_ids:
            for running in self.sched.running:
                if running.num_computed_tokens < so.num_scheduled_tokens.get(running.request_id, 0):
                    self.coverage["invalid_scan_behind"] += 1
        for req_id in self.invalid_sync_loads.pop(sched_step, []):
            req = self.sched.requests.get(req_id)
            if req is None or req.is_finished():
                continue
            if req.num_in_flight_tokens > so.num_scheduled_tokens.get(req_id, 0):
                self.coverage["invalid_sync_in_flight"] += 1
                if self.scn.spec_tokens:
                    self.coverage["invalid_sync_in_flight_spec"] += 1

    # -- engines --------------------------------------------------------------------
    def run(self) -> bool:
        """Drive until no request is left; False if it stalled, livelocked or ``max_steps``
        ran out."""
        if self.scn.is_async:
            return self._run_batch_queue()
        return self._run_sync()

    def _stalled(self, step: int, so: SchedulerOutput | None) -> bool:
        """Whether nothing has been scheduled for a long while and nothing can change.

        vLLM 0.33.0 itself can stall: a request whose async load failed with nothing
        valid stays in ``_inflight_prefills``, so its re-admission reserves its own
        remaining blocks on top of what it allocates, and in a small pool it never fits.
        """
        if so is not None and so.total_num_scheduled_tokens > 0:
            self.quiet_steps = 0
            return False
        self.quiet_steps += 1
        if self.quiet_steps < STALL_STEPS or self.pending_loads or step <= self.last_event:
            return False
        self.records[-1]["stalled"] = True
        self.stalled = True
        return True

    def _livelocked(self, step: int) -> bool:
        """Whether tokens are still scheduled but no request has got further for a long
        while, and nothing can change.

        vLLM 0.33.0 itself can livelock: under the ``priority`` policy, with prefix caching
        off and no full-sequence reservation, two requests of equal priority and arrival
        time that do not fit together keep preempting each other (``max`` picks the first
        of them in ``running``, the one further along) and recompute from scratch.
        """
        for req_id, req in self.sched.requests.items():
            if req.num_computed_tokens > self.furthest.get(req_id, -1):
                self.furthest[req_id] = req.num_computed_tokens
                self.last_progress = step
        since = step - max(self.last_progress, self.last_event)
        if since < LIVELOCK_STEPS or self.pending_loads:
            return False
        self.records[-1]["livelocked"] = True
        self.livelocked = True
        self.coverage["livelocked"] += 1
        return True

    def _run_sync(self) -> bool:
        """``EngineCore.step`` (+ ``post_step``'s drafts), one scheduler step per tick."""
        for step in range(self.scn.max_steps):
            rec: dict[str, Any] = {"step": step}
            self.records.append(rec)
            self._add_arrivals(step, rec)
            self._resets(step, rec)
            if not self.sched.has_requests():
                if not self._future_arrivals():
                    return True
                rec["idle"] = True
                continue
            so = self.sched.schedule()
            self._record_schedule(so, rec)
            mro = self._model_output(step, so)
            self._abort(self._abort_targets(step, so), rec)
            outputs = self.sched.update_from_output(so, mro)
            self._record_update(outputs, rec)
            self._propose_drafts(step, so)
            if self._stalled(step, so) or self._livelocked(step):
                return False
        return False

    def _run_batch_queue(self) -> bool:
        """``EngineCore.step_with_batch_queue`` with a queue of two batches."""
        queue: deque[tuple[int, SchedulerOutput, ModelRunnerOutput]] = deque()
        for step in range(self.scn.max_steps):
            rec: dict[str, Any] = {"step": step}
            self.records.append(rec)
            self._add_arrivals(step, rec)
            self._resets(step, rec)
            newest: SchedulerOutput | None = None
            if self.sched.has_requests():
                so = self.sched.schedule()
                newest = so
                self._record_schedule(so, rec)
                executed = so.total_num_scheduled_tokens > 0
                queue.appendleft((step, so, self._model_output(step, so)))
                if self._stalled(step, so) or self._livelocked(step):
                    return False
                if len(queue) < 2 and (executed or self.sched.has_requests()):
                    continue
            elif not queue:
                if not self._future_arrivals():
                    return True
                rec["idle"] = True
                continue
            sched_step, old_so, mro = queue.pop()
            rec["update_of"] = sched_step
            self._count_invalid_in_flight(sched_step, old_so, mro)
            self._abort(self._abort_targets(step, newest), rec)
            outputs = self.sched.update_from_output(old_so, mro)
            self._record_update(outputs, rec)
        return False


def run_scenario(
    scn: Scenario,
    scheduler_cls: type[Scheduler],
    model_dir: Path,
    count_manager_calls: bool = False,
) -> RunResult:
    """Run ``scn`` on a fresh ``scheduler_cls``; an exception ends the records with it."""
    driver = Driver(scn, scheduler_cls, model_dir, count_manager_calls)
    manager_cls = type(driver.sched.kv_cache_manager)
    try:
        finished = driver.run()
    except Exception as exc:  # the candidate raising is a difference to report
        # Into the step that raised, so the first difference names the exception.
        if not driver.records:
            driver.records.append({"step": -1})
        driver.records[-1]["exception"] = f"{type(exc).__name__}: {exc}"
        finished = False
    return RunResult(
        scenario_id=scn.scenario_id,
        scheduler_cls=f"{scheduler_cls.__module__}.{scheduler_cls.__qualname__}",
        manager_cls=f"{manager_cls.__module__}.{manager_cls.__qualname__}",
        manager_type=manager_cls,
        records=driver.records,
        finished=finished,
        stalled=driver.stalled,
        livelocked=driver.livelocked,
        coverage=driver.coverage,
    )
