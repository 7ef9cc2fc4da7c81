"""What the simulator checks, and the ground truth it checks against.

:class:`KVLedger` is the simulator's ground truth about the KV *contents* of every
physical block, which the library itself never sees: which full block of which token
sequence was last written into it (its content hash), whether it was never written, and
whether what it holds is garbage (``stale``): a failed load, or KV computed while
attending to a stale block. It is always kept (it is cheap) because it yields the
hazard metrics of the summary: requests whose accepted output was computed over stale
KV, and stale blocks left in the prefix cache.

:class:`Checker` raises :class:`CheckError` at the first violation. The checks of the
failure handling and of the end of the run always run (they are cheap); the others run
after every step with ``--check`` (``SimConfig.check``, always on in the tests):

* ``check_invariants()`` of the pool;
* every live request's block table, as the manager reports it, is the one the
  simulator expects (hits, then external blocks, then the blocks ``allocate_slots``
  returned), holds no null block and no block twice, and covers its computed tokens;
  every block's ref count equals the number of tables holding it, and the free count
  is what is left; requests freed this step hold nothing;
* every hashed block's hash is the content hash the ledger recorded for it (the prefix
  map holds only hashes that match their blocks' contents), and no block of an async
  load still in flight is hashed. Ref counts and hashes are compared for every block
  the step may have changed, and for the whole pool every ``FULL_SWEEP_EVERY`` steps;
* after ``handle_invalid_blocks``: exactly the requests with an invalid block in their
  scanned range are reported (failed, rescheduled or retried as the policy says), each
  truncated at an invalid block or reverted to its pre-step count (strict mode: at its
  own first invalid block); under ``fail``, from the invalid block a request truncated
  at, no block of its table is still hashed (strict mode: from its first invalid
  block). In vLLM mode a request whose invalid blocks were all marked by an earlier
  request keeps its own later blocks hashed, as vLLM does (it skips a block already
  marked): those blocks are counted (``shared_tail_hashed``), not failed. Under
  ``recompute`` nothing fails and nothing is evicted;
* after ``handle_invalid_blocks`` in strict mode: no request's tokens still counted as
  computed from before the step cover an invalid block;
* the prefix-cache stats: each ``make_prefix_cache_stats()`` delta is non-negative and
  equals what the simulator recorded; the simulator's own counters never decrease;
* no computation reads a block that was never written;
* any extra checks the caller passed.

At the end: every request reached a final state, every block is back in the pool
(``free == num_blocks - 1``), the hashed blocks match their contents, and under
``recompute`` no request failed. Under ``fail`` in strict mode, which promises it, no
accepted output read stale KV and no stale block is left in the prefix cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from kvblocks.constants import cdiv
from kvblocks.errors import InvariantError
from kvblocks.sim.config import SimConfig
from kvblocks.sim.state import Counters, SimRequest

__all__ = [
    "FULL_SWEEP_EVERY",
    "CheckError",
    "CheckedSimulator",
    "Checker",
    "InvalidBlocksContext",
    "KVLedger",
    "Writer",
]

#: Every block's ref count and hash are checked this often (in steps); the blocks a step
#: may have changed are checked after every step.
FULL_SWEEP_EVERY = 32


class CheckError(AssertionError):
    """A check failed; the run stops at the first one.

    Attributes:
        step: The step after which it failed (-1: at the end of the run).
        check: The check's name.
        detail: What was wrong.
    """

    def __init__(self, step: int, check: str, detail: str) -> None:
        super().__init__(f"step {step}: {check}: {detail}")
        self.step = step
        self.check = check
        self.detail = detail


@dataclass(slots=True)
class Writer:
    """A request computing tokens ``[start, start + count)`` in this step's forward.

    Attributes:
        request_id: The request.
        table: Its block table.
        start: Tokens computed before this step.
        count: Tokens scheduled in this step.
        hashes: Returns the request's block hashes (read only when a block fills).
    """

    request_id: str
    table: list[int]
    start: int
    count: int
    hashes: Callable[[], Sequence[bytes]]


class KVLedger:
    """Ground truth about what each physical block holds (see the module docstring).

    Garbage is tracked per token slot: ``bad[b] = k`` says that slots ``k ..
    block_size - 1`` of block ``b`` may hold garbage while slots ``0 .. k - 1`` are good
    (a partly loaded block can be good up to where a failed computation began). A
    block absent from ``bad`` is good throughout (slots never written are not read).

    Invariants: ``unwritten`` and ``bad`` are disjoint; a block's ``content`` is the
    block hash of the full token block last written into it, or absent while it is
    unwritten or only partly written.
    """

    __slots__ = ("bad", "block_size", "content", "unwritten")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        #: Block id -> hash of the full token block written into it.
        self.content: dict[int, bytes] = {}
        #: Block id -> first slot that may hold garbage (absent: none does).
        self.bad: dict[int, int] = {}
        #: Blocks allocated but not written since.
        self.unwritten: set[int] = set()

    @property
    def stale(self) -> set[int]:
        """Blocks holding some garbage KV that a reader could take as valid."""
        return set(self.bad)

    def allocate(self, block_ids: Iterable[int]) -> None:
        """Blocks fresh from the pool: their old contents are gone."""
        for block_id in block_ids:
            self.content.pop(block_id, None)
            self.bad.pop(block_id, None)
            self.unwritten.add(block_id)

    def load(
        self,
        block_ids: Sequence[int],
        first_block_index: int,
        num_loaded_tokens: int,
        block_hashes: Sequence[bytes],
        failed: set[int],
    ) -> None:
        """An external load landed in ``block_ids``; the ``failed`` ones hold garbage.

        Args:
            block_ids: The blocks, in table order.
            first_block_index: Table index of ``block_ids[0]``.
            num_loaded_tokens: Tokens covered once the load landed (local hit included).
            block_hashes: The request's block hashes.
            failed: Blocks whose load failed.
        """
        size = self.block_size
        for j, block_id in enumerate(block_ids):
            index = first_block_index + j
            self.unwritten.discard(block_id)
            if (index + 1) * size <= num_loaded_tokens:
                self.content[block_id] = block_hashes[index]
            if block_id in failed:
                self.bad[block_id] = 0
            else:
                self.bad.pop(block_id, None)

    def compute(self, writers: Sequence[Writer]) -> tuple[list[bool], list[str]]:
        """One forward pass: every writer writes its new tokens' KV at once.

        Within a layer all KV writes of a batch happen before attention reads, so a
        request reading blocks another request writes in the same step sees the new
        contents. A writer's output is good iff every slot it reads is good after this
        step's writes; the slots it writes hold garbage otherwise.

        Returns:
            Per writer, whether everything it read was good; and descriptions of
            reads of never-written blocks (a simulator or library bug).
        """
        size = self.block_size
        bad = self.bad
        full_reads: list[list[int]] = []
        partial_reads: list[tuple[int, int] | None] = []
        #: Block -> (writer, first slot it writes), for the blocks written this step.
        writes: dict[int, list[tuple[int, int]]] = {}
        for i, w in enumerate(writers):
            first, offset = divmod(w.start, size)
            full_reads.append(w.table[:first])
            partial_reads.append((w.table[first], offset) if offset else None)
            for k in range(first, cdiv(w.start + w.count, size)):
                writes.setdefault(w.table[k], []).append((i, offset if k == first else 0))
        written = set(writes)
        bad_elsewhere = bad.keys() - written
        unwritten_before = self.unwritten - written
        problems: list[str] = []
        base_ok: list[bool] = []
        deps: list[list[int]] = []
        for i, w in enumerate(writers):
            block_reads = full_reads[i]
            ok = bad_elsewhere.isdisjoint(block_reads)
            if not unwritten_before.isdisjoint(block_reads):
                never = sorted(unwritten_before.intersection(block_reads))
                problems.append(f"{w.request_id} reads never-written blocks {never}")
            partial = partial_reads[i]
            if partial is not None:
                block_id, offset = partial
                if block_id in self.unwritten:
                    problems.append(f"{w.request_id} extends never-written block {block_id}")
                # Its slots before ``offset`` were written in an earlier step.
                ok = ok and bad.get(block_id, size) >= offset
            base_ok.append(ok)
            deps.append(sorted(written.intersection(block_reads)))

        decided: dict[int, bool] = {}

        def good_after(block_id: int, visiting: frozenset[int]) -> bool:
            """Whether a block written this step is good throughout afterwards."""
            segments = writes[block_id]
            first_slot = min(offset for _, offset in segments)
            return bad.get(block_id, size) >= first_slot and all(
                decide(j, visiting) for j, _ in segments
            )

        def decide(i: int, visiting: frozenset[int]) -> bool:
            if i in decided:
                return decided[i]
            if i in visiting:  # cannot happen (reads precede writes); be conservative
                return False
            inner = visiting | {i}
            ok = base_ok[i] and all(good_after(b, inner) for b in deps[i])
            decided[i] = ok
            return ok

        results = [decide(i, frozenset()) for i in range(len(writers))]
        for block_id, segments in writes.items():
            first_slot = min(offset for _, offset in segments)
            before = bad.get(block_id, size)
            after = before if before < first_slot else size
            for j, offset in segments:
                if not results[j]:
                    after = min(after, offset)
            if after < size:
                bad[block_id] = after
            else:
                bad.pop(block_id, None)
        self.unwritten -= written
        for w in writers:
            first_full = w.start // size
            end_full = (w.start + w.count) // size
            if end_full > first_full:
                hashes = w.hashes()
                for index in range(first_full, end_full):
                    self.content[w.table[index]] = hashes[index]
        return results, problems


@dataclass(slots=True)
class InvalidBlocksContext:
    """What a ``handle_invalid_blocks`` call saw and did, for :meth:`Checker.after_invalid_blocks`.

    Attributes:
        invalid_block_ids: The step's invalid blocks.
        sync_requests: The running requests, in order, with their ``num_computed_tokens``
            before the call and the tokens scheduled for them this step.
        async_requests: The requests waiting for remote KVs, with their
            ``num_computed_tokens`` before the call.
        outcome: The returned ``InvalidBlocksOutcome``.
    """

    invalid_block_ids: set[int]
    sync_requests: list[tuple[SimRequest, int, int]] = field(default_factory=list)
    async_requests: list[tuple[SimRequest, int]] = field(default_factory=list)
    outcome: Any = None


class CheckedSimulator(Protocol):
    """What :class:`Checker` reads of a simulator (:class:`~kvblocks.sim.Simulator` fits).

    ``pool`` and ``manager`` are the backend's ``BlockPool`` and ``KVCacheManager``.
    """

    @property
    def step(self) -> int:
        """The step just run (the one a failed check names)."""
        ...

    @property
    def config(self) -> SimConfig:
        """The run's configuration."""
        ...

    @property
    def pool(self) -> Any:
        """The manager's block pool."""
        ...

    @property
    def manager(self) -> Any:
        """The KV cache manager."""
        ...

    @property
    def ledger(self) -> KVLedger:
        """What each block holds."""
        ...

    @property
    def counters(self) -> Counters:
        """The running totals."""
        ...

    @property
    def requests(self) -> Mapping[str, SimRequest]:
        """The requests not yet final (and failed ones still holding blocks)."""
        ...

    @property
    def recorded_stats(self) -> tuple[int, int, int]:
        """``(requests, queries, hits)`` recorded with the manager in this step."""
        ...

    @property
    def last_stats_delta(self) -> tuple[int, int, int]:
        """The manager's ``make_prefix_cache_stats()`` of this step, as a tuple."""
        ...

    def holders(self) -> list[SimRequest]:
        """The requests whose tables hold blocks."""
        ...

    def stale_hashed_blocks(self) -> int:
        """Stale blocks that are in the prefix cache now."""
        ...


#: The simulator type a :class:`Checker` checks, and its extra checks are called with.
SimT = TypeVar("SimT", bound=CheckedSimulator)


class Checker(Generic[SimT]):
    """Runs the checks of the module docstring against one simulator.

    Args:
        extra_checks: Callables run after the built-in checks of every step, with the
            simulator; each raises :class:`CheckError` (or any exception, reported as a
            failure) to fail the run.
    """

    __slots__ = ("_previous_counters", "extra_checks", "num_checks", "shared_tail_hashed")

    def __init__(self, extra_checks: Sequence[Callable[[SimT], None]] = ()) -> None:
        self.extra_checks = tuple(extra_checks)
        #: Checks passed so far.
        self.num_checks = 0
        #: vLLM-mode only: blocks left hashed behind an invalid block an earlier request
        #: had marked.
        self.shared_tail_hashed = 0
        #: The simulator's counters at the previous step (all start at 0).
        self._previous_counters = Counters().as_tuple()

    # ------------------------------------------------------------------ helpers

    def _ok(self) -> None:
        self.num_checks += 1

    @staticmethod
    def _hashed(pool: Any, block_ids: Iterable[int]) -> list[int]:
        return [b for b in block_ids if pool.get_block(b).block_hash is not None]

    # ------------------------------------------------------------------ failure handling

    def after_invalid_blocks(self, sim: SimT, ctx: InvalidBlocksContext) -> None:
        """Checks one ``handle_invalid_blocks`` call (policy and mode specific)."""
        step, mode, policy = sim.step, sim.config.mode, sim.config.policy
        size = sim.config.block_size
        invalid = ctx.invalid_block_ids
        outcome = ctx.outcome
        pool = sim.pool
        name = "handle_invalid_blocks"
        if policy == "recompute":
            # vLLM's recompute keeps the blocks hashed; strict mode evicts the sync tails.
            if outcome.failed_req_ids or (mode == "vllm" and outcome.evicted_block_ids):
                raise CheckError(step, name, "recompute failed requests or evicted blocks")
        elif outcome.rescheduled_req_ids or outcome.retry_req_ids:
            raise CheckError(step, name, "fail rescheduled or retried requests")
        passes = [(s, before, sched, True) for s, before, sched in ctx.sync_requests]
        passes += [(s, before, 0, False) for s, before in ctx.async_requests]
        for s, before, scheduled, is_sync in passes:
            rid = s.spec.request_id
            computed_before_step = before - scheduled
            now = s.req.num_computed_tokens
            scanned = s.table[: cdiv(computed_before_step, size)]
            hit = [idx for idx, b in enumerate(scanned) if b in invalid]
            if policy == "fail":
                reported = outcome.failed_req_ids
            elif is_sync:
                reported = outcome.rescheduled_req_ids
            else:
                reported = outcome.retry_req_ids
            if bool(hit) != (rid in reported):
                raise CheckError(
                    step, name, f"{rid}: invalid blocks at {hit} but reported={rid in reported}"
                )
            if not hit:
                if now != before:
                    raise CheckError(step, name, f"{rid} unaffected but changed {before}->{now}")
                continue
            truncated = now < computed_before_step
            if truncated and (now % size or s.table[now // size] not in invalid):
                raise CheckError(step, name, f"{rid} truncated to {now}, not at an invalid block")
            if not truncated and now != computed_before_step:
                raise CheckError(step, name, f"{rid} neither truncated nor reverted: {now}")
            if mode == "strict" and now != hit[0] * size:
                raise CheckError(
                    step, name, f"strict: {rid} at {now}, its first invalid block is {hit[0]}"
                )
            if is_sync and (policy == "fail" or mode == "strict"):
                # The tail a truncating request collected was evicted.
                left = self._hashed(pool, s.table[now // size :]) if truncated else []
                if left:
                    raise CheckError(
                        step,
                        "fail evicts",
                        f"{rid}: blocks {left} from its invalid block {now // size} onward "
                        "are still hashed",
                    )
                # In vLLM mode a request skips invalid blocks an earlier request marked,
                # so its own later blocks may stay hashed; strict mode truncates at
                # the first one, so nothing may be left.
                tail = self._hashed(pool, s.table[hit[0] :])
                if tail and mode == "strict":
                    raise CheckError(
                        step,
                        "fail evicts",
                        f"{rid}: blocks {tail} from its invalid block {hit[0]} onward are "
                        "still hashed",
                    )
                self.shared_tail_hashed += len(tail)
            if mode == "strict":
                covered = s.table[: cdiv(min(now, computed_before_step), size)]
                if not invalid.isdisjoint(covered):
                    raise CheckError(
                        step,
                        "strict prefix",
                        f"{rid}: computed prefix of {now} tokens covers invalid blocks "
                        f"{sorted(invalid.intersection(covered))}",
                    )
        self._ok()

    # ------------------------------------------------------------------ every step

    def after_step(
        self,
        sim: SimT,
        freed: Sequence[str],
        problems: Sequence[str],
        dirty: set[int],
    ) -> None:
        """The per-step checks.

        Args:
            sim: The simulator, after the step.
            freed: Requests freed in the step.
            problems: What the ledger found wrong in the step's forward pass.
            dirty: Every block whose ref count or hash the step may have changed (the
                tables it allocated, adopted, freed or cached into, the tails of the
                scheduled requests, the evicted blocks). These are swept every step,
                every block every :data:`FULL_SWEEP_EVERY` steps and at the end.
        """
        step = sim.step
        if problems:
            raise CheckError(step, "ledger", "; ".join(problems))
        pool, manager = sim.pool, sim.manager
        try:
            pool.check_invariants()
        except InvariantError as exc:
            raise CheckError(step, "check_invariants", str(exc)) from exc
        size = sim.config.block_size
        held: Counter[int] = Counter()
        unhashed: set[int] = set()
        holders = sim.holders()
        for s in holders:
            rid = s.spec.request_id
            (actual,) = manager.get_block_ids(rid)
            if list(actual) != s.table:
                raise CheckError(
                    step, "block table", f"{rid}: manager has {list(actual)}, expected {s.table}"
                )
            if 0 in s.table or len(set(s.table)) != len(s.table):
                raise CheckError(step, "block table", f"{rid}: null or repeated block {s.table}")
            if s.req.num_computed_tokens > len(s.table) * size:
                raise CheckError(
                    step,
                    "block table",
                    f"{rid}: {s.req.num_computed_tokens} computed tokens in {len(s.table)} blocks",
                )
            held.update(s.table)
            if s.load_in_flight():
                assert s.load is not None
                unhashed.update(s.load.block_ids)
        holding = {s.spec.request_id for s in holders}
        for rid in freed:
            # Freed and not re-admitted in the same step: the manager forgot it.
            if rid not in holding and manager.get_block_ids(rid) != ([],):
                raise CheckError(step, "block table", f"{rid} was freed but still holds blocks")
        num_blocks = sim.config.num_blocks
        expected_free = num_blocks - 1 - len(held)
        if pool.get_num_free_blocks() != expected_free:
            raise CheckError(
                step,
                "ref counts",
                f"{pool.get_num_free_blocks()} free blocks, expected {expected_free}",
            )
        full = step % FULL_SWEEP_EVERY == 0
        swept = range(1, num_blocks) if full else sorted(dirty | unhashed)
        self._sweep(sim, step, swept, held, unhashed)
        self._check_stats(sim)
        self._check_counters(sim)
        for check in self.extra_checks:
            name = getattr(check, "__name__", repr(check))
            try:
                check(sim)
            except CheckError:
                raise
            except Exception as exc:
                raise CheckError(step, name, f"{type(exc).__name__}: {exc}") from exc
        self._ok()

    @staticmethod
    def _sweep(
        sim: CheckedSimulator,
        step: int,
        block_ids: Iterable[int],
        held: Counter[int],
        unhashed: set[int],
    ) -> None:
        """Ref count and hash of each block against the tables and the ledger."""
        get_block = sim.pool.get_block
        held_get = held.get
        content_get = sim.ledger.content.get
        for block_id in block_ids:
            block = get_block(block_id)
            if block.ref_cnt != held_get(block_id, 0):
                raise CheckError(
                    step,
                    "ref counts",
                    f"block {block_id} has ref count {block.ref_cnt}, "
                    f"{held_get(block_id, 0)} tables hold it",
                )
            block_hash = block.block_hash
            if block_hash is None:
                continue
            if content_get(block_id) != block_hash:
                raise CheckError(
                    step,
                    "prefix map",
                    f"block {block_id} is hashed {block_hash.hex()[:16]}... but holds "
                    f"{(content_get(block_id) or b'nothing').hex()[:16]}...",
                )
            if block_id in unhashed:
                raise CheckError(
                    step, "prefix map", f"block {block_id} of an in-flight async load is hashed"
                )

    def _check_stats(self, sim: SimT) -> None:
        delta = sim.last_stats_delta
        if min(delta) < 0:
            raise CheckError(sim.step, "stats", f"negative prefix-cache stats delta {delta}")
        expected = sim.recorded_stats
        if delta != expected:
            raise CheckError(
                sim.step, "stats", f"prefix-cache stats delta {delta}, recorded {expected}"
            )

    def _check_counters(self, sim: SimT) -> None:
        now = sim.counters.as_tuple()
        previous = self._previous_counters
        if any(n < p for n, p in zip(now, previous, strict=True)):
            raise CheckError(sim.step, "counters", f"a counter decreased: {previous} -> {now}")
        self._previous_counters = now

    # ------------------------------------------------------------------ end of run

    def final(self, sim: SimT) -> None:
        """The end-of-run checks."""
        step = -1
        pool = sim.pool
        if sim.requests:
            raise CheckError(
                step, "drained", f"{len(sim.requests)} requests never reached a final state"
            )
        try:
            pool.check_invariants()
        except InvariantError as exc:
            raise CheckError(step, "check_invariants", str(exc)) from exc
        num_free = pool.get_num_free_blocks()
        if num_free != sim.config.num_blocks - 1:
            raise CheckError(
                step, "all blocks returned", f"{num_free} of {sim.config.num_blocks - 1} free"
            )
        self._sweep(sim, step, range(1, sim.config.num_blocks), Counter(), set())
        summary = sim.counters
        if sim.config.policy == "recompute" and summary.failed:
            raise CheckError(step, "recompute", f"{summary.failed} requests failed")
        if sim.config.policy == "fail" and sim.config.mode == "strict":
            if summary.stale_outputs:
                raise CheckError(
                    step, "strict fail", f"{summary.stale_outputs} outputs read stale KV"
                )
            stale_hashed = sim.stale_hashed_blocks()
            if stale_hashed:
                raise CheckError(
                    step, "strict fail", f"stale blocks left in the prefix cache: {stale_hashed}"
                )
        self._ok()
