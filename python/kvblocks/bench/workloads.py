"""Seeded workloads that run unchanged on either backend module.

Each :class:`Workload` builds a fresh state per round (``setup``), runs the timed part
(``run``) and checks the result outside the timed region (``check``). Every random choice
is drawn from a seeded ``random.Random`` while the script is built, before timing starts,
so both backends replay the very same calls and must produce the very same results.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvblocks.bench import vllm_runner, vllm_scheduler
from kvblocks.bench.workload import Workload, WorkloadSpec, deferred
from kvblocks.constants import HASH_ALGORITHMS

__all__ = ["all_workloads", "churn_loop"]


# --------------------------------------------------------------------------- pool churn


#: One step: (hash chain, blocks to allocate, lookup prefix, victim draw). A step with 0
#: blocks frees the live request picked by the victim draw.
_ChurnStep = tuple[list[bytes], int, list[bytes], int]


@dataclass(frozen=True, slots=True)
class _ChurnScript:
    num_blocks: int
    steps: list[_ChurnStep]


def _churn_script(num_blocks: int, num_steps: int, seed: int) -> _ChurnScript:
    """Admissions and frees as a serving engine makes them.

    An admission's prompt starts with 0 to 32 blocks of one of 32 shared prefixes
    (system prompts, few-shot examples: prefix-cache hits once cached) and goes on
    with 8 to 128 blocks of its own (misses, allocated and cached, and evicted later
    under pressure). Its lookup covers all but the last block, as vLLM's does.
    """
    rng = random.Random(seed)
    families = [[rng.randbytes(32) for _ in range(32)] for _ in range(32)]
    steps: list[_ChurnStep] = []
    for _ in range(num_steps):
        if rng.random() < 0.55:
            shared = families[rng.randrange(len(families))][: rng.randint(0, 32)]
            chain = shared + [rng.randbytes(32) for _ in range(rng.randint(8, 128))]
            steps.append((chain, len(chain), chain[:-1], 0))
        else:
            steps.append(([], 0, [], rng.randrange(1 << 30)))
    return _ChurnScript(num_blocks, steps)


def _churn_setup(script: _ChurnScript) -> Callable[[ModuleType], Any]:
    def setup(backend: ModuleType) -> Any:
        return backend.BlockPool(script.num_blocks)

    return setup


def churn_loop(steps: Sequence[_ChurnStep], pool: Any) -> tuple[list[list[Any]], int]:
    """The churn script on a pool with kvblocks' ``BlockPool`` calls: either backend's,
    or vLLM's behind :class:`kvblocks.bench.vllm_runner.ChurnPool`.

    Returns:
        ``(live block tables, blocks allocated)``.
    """
    live: list[list[Any]] = []
    allocated = 0
    for chain, num_blocks, prefix, victim in steps:
        if num_blocks == 0 or pool.get_num_free_blocks() < num_blocks:
            if live:
                # Swap-remove a random live request and free it tail first.
                i = victim % len(live)
                table = live[i]
                live[i] = live[-1]
                live.pop()
                pool.free_blocks(table[::-1])
            continue
        hits = pool.find_longest_cache_hit(prefix)
        pool.touch(hits)
        table = hits + pool.get_new_blocks(num_blocks - len(hits))
        pool.cache_full_blocks(table, chain, len(hits), num_blocks)
        live.append(table)
        allocated += num_blocks - len(hits)
    return live, allocated


def _churn_run(script: _ChurnScript) -> Callable[[ModuleType, Any], Any]:
    def run(backend: ModuleType, pool: Any) -> Any:
        return churn_loop(script.steps, pool)

    return run


def _churn_check(state: Any, result: Any) -> None:
    live, allocated = result
    state.check_invariants()
    in_use = state.num_blocks - 1 - state.get_num_free_blocks()
    assert in_use <= sum(len(t) for t in live)
    assert allocated > 0


# --------------------------------------------------------------------------- chat manager

_ADMIT, _DECODE, _FINISH = 0, 1, 2

#: KV cache event handling a chat workload can run with: none, ``take_events()`` about
#: once a scheduler step, or that plus encoding each batch as vLLM's publisher does.
EVENT_MODES = ("off", "on", "on+encode")

#: Script entries between two ``take_events()`` calls (about one scheduler step).
_EVENT_STEP = 32


@dataclass(frozen=True, slots=True)
class _ChatScript:
    num_blocks: int
    block_size: int
    # (kind, session, payload): admit carries the prompt, decode one token id.
    events: list[tuple[int, int, Any]]


def _chat_script(
    num_sessions: int, turns: int, seed: int, concurrency: int, num_blocks: int
) -> _ChatScript:
    """Multi-turn sessions over one shared system prompt, interleaved like a scheduler."""
    rng = random.Random(seed)
    system = [rng.randrange(32_000) for _ in range(1_024)]
    history = {s: list(system) for s in range(num_sessions)}
    remaining = {s: turns for s in range(num_sessions)}
    decoding: dict[int, int] = {}
    events: list[tuple[int, int, Any]] = []
    while remaining or decoding:
        # Admit new turns while fewer than `concurrency` sessions decode, then one
        # decode step each.
        idle = [s for s in remaining if s not in decoding]
        while idle and len(decoding) < concurrency:
            s = idle.pop(rng.randrange(len(idle)))
            history[s] += [rng.randrange(32_000) for _ in range(rng.randint(16, 256))]
            events.append((_ADMIT, s, list(history[s])))
            decoding[s] = rng.randint(8, 128)
        for s in list(decoding):
            token = rng.randrange(32_000)
            history[s].append(token)
            events.append((_DECODE, s, token))
            decoding[s] -= 1
            if decoding[s] == 0:
                del decoding[s]
                events.append((_FINISH, s, None))
                remaining[s] -= 1
                if remaining[s] == 0:
                    del remaining[s]
    return _ChatScript(num_blocks=num_blocks, block_size=16, events=events)


def _chat_run(script: _ChatScript, event_mode: str) -> Callable[[ModuleType, Any], Any]:
    # Imports and the encoder are set up here, when the workload is built, not timed.
    encode: Callable[[list[Any]], Any] | None = None
    if event_mode == "on+encode":
        import msgspec  # noqa: PLC0415 (msgspec is optional)

        from kvblocks.events import KVEventBatch  # noqa: PLC0415 (kvblocks.events needs the optional msgspec)

        encoder = msgspec.msgpack.Encoder()

        def encode(events: list[Any]) -> None:
            encoder.encode(KVEventBatch(ts=0.0, events=events))

    events_on = event_mode != "off"

    def run(backend: ModuleType, state: Any) -> Any:
        manager, hasher = state
        live: dict[int, Any] = {}
        turns: dict[int, int] = {}
        rejected = num_events = 0
        countdown = _EVENT_STEP
        for kind, session, payload in script.events:
            if kind == _ADMIT:
                turn = turns[session] = turns.get(session, 0) + 1
                request = backend.Request(f"s{session}-{turn}", payload, block_hasher=hasher)
                blocks, hit = manager.get_computed_blocks(request)
                if manager.allocate_slots(request, request.num_tokens - hit, hit, blocks) is None:
                    rejected += 1
                    continue
                request.num_computed_tokens = request.num_tokens
                live[session] = request
            elif kind == _DECODE:
                request = live.get(session)
                if request is None:
                    continue
                request.append_output_token_ids(payload)
                if manager.allocate_slots(request, 1) is not None:
                    request.num_computed_tokens += 1
            else:
                request = live.pop(session, None)
                if request is not None:
                    manager.free(request)
            if events_on:
                countdown -= 1
                if countdown:
                    continue
                countdown = _EVENT_STEP
                events = manager.take_events()
                num_events += len(events)
                if encode is not None:
                    encode(events)
        num_events += len(manager.take_events())
        return rejected, num_events

    return run


def _chat_check(event_mode: str) -> Callable[[Any, Any], None]:
    def check(state: Any, result: Any) -> None:
        manager, _ = state
        rejected, num_events = result
        pool = manager.block_pool
        pool.check_invariants()
        assert pool.get_num_free_blocks() == pool.num_blocks - 1, "blocks leaked"
        assert rejected == 0
        assert (num_events > 0) == (event_mode != "off")

    return check


def manager_chat(
    num_sessions: int = 256,
    turns: int = 3,
    seed: int = 0,
    *,
    event_mode: str = "off",
    concurrency: int = 64,
    num_blocks: int = 16_384,
    name: str = "manager_chat",
    group: str = "manager chat",
) -> Workload:
    """A chat-like manager workload: shared system prompt, multi-turn sessions, decodes.

    With ``event_mode`` other than ``"off"`` the manager records KV cache events and the
    workload takes them about once a scheduler step (the events-overhead group; the pool
    should then be small enough that cached blocks are reallocated, so that
    ``BlockRemoved`` events occur too).
    """
    if event_mode not in EVENT_MODES:
        raise ValueError(f"event_mode must be one of {EVENT_MODES}, got {event_mode!r}")
    script = _chat_script(num_sessions, turns, seed, concurrency, num_blocks)

    def setup(backend: ModuleType) -> Any:
        hasher = backend.BlockHasher(script.block_size, "sha256", "0")
        manager = backend.KVCacheManager(
            script.num_blocks, script.block_size, enable_kv_cache_events=event_mode != "off"
        )
        return manager, hasher

    events = "" if event_mode == "off" else f", events {event_mode}"
    return Workload(
        name=name,
        group=group,
        description=(
            f"KVCacheManager({num_blocks:,}): {num_sessions} sessions x {turns} turns, "
            f"shared system prompt{events}"
        ),
        ops=len(script.events),
        op_name="event",
        setup=setup,
        run=_chat_run(script, event_mode),
        check=_chat_check(event_mode),
    )


# --------------------------------------------------------------------------- hashing


#: How a hashing workload hands the prompt over: (name prefix, description template).
_HASH_VIAS = {
    "request": ("hash", "Request(prompt, block_hasher=BlockHasher({algo!r}))"),
    "request_numpy": ("hash_np", "Request(np.int64 prompt, block_hasher=BlockHasher({algo!r}))"),
    "hash_blocks": ("hash_blocks", "BlockHasher({algo!r}).hash_blocks(list)"),
}


def hashing(
    algo: str, via: str = "request", num_tokens: int = 131_072, block_size: int = 16
) -> Workload:
    """Hashing one long prompt's full blocks with one algorithm.

    ``via="request"`` builds a ``Request`` with the hasher as its ``block_hasher`` (what a
    scheduler does on admission: the native request keeps tokens and hashes in Rust);
    ``"request_numpy"`` does the same from a NumPy int64 prompt, which the native backend
    reads in place, so it shows the hasher's own speed (the list case adds reading
    131,072 Python ints); ``"hash_blocks"`` calls ``hash_blocks(list_of_ints)``, which
    also converts the list and returns one ``bytes`` object per block.
    """
    prefix, template = _HASH_VIAS[via]
    rng = random.Random(num_tokens)
    tokens = [rng.randrange(150_000) for _ in range(num_tokens)]
    prompt: Any = tokens
    if via == "request_numpy":
        import numpy as np  # noqa: PLC0415 (numpy is optional)

        prompt = np.asarray(tokens, dtype=np.int64)

    def setup(backend: ModuleType) -> Any:
        return backend, backend.BlockHasher(block_size, algo, "0")

    def run(backend: ModuleType, state: Any) -> Any:
        _, hasher = state
        if via == "hash_blocks":
            return hasher.hash_blocks(tokens)
        return backend.Request("prompt", prompt, block_hasher=hasher)

    def check(state: Any, result: Any) -> None:
        _, hasher = state
        hashes = result if via == "hash_blocks" else result.block_hashes
        assert len(hashes) == num_tokens // block_size
        assert hashes[0] == hasher.hash_block(None, tokens[:block_size])
        assert hashes[-1] == hasher.hash_blocks(tokens)[-1]

    return Workload(
        name=f"{prefix}_{algo}",
        group="hashing",
        description=f"{template.format(algo=algo)}: {num_tokens:,} tokens, block {block_size}",
        ops=num_tokens // block_size,
        op_name="block",
        setup=setup,
        run=run,
        check=check,
    )


# --------------------------------------------------------------------------- rollback


@dataclass(frozen=True, slots=True)
class _RollbackInput:
    tables: list[list[int]]
    computed: list[int]
    scheduled: list[int]
    invalid: list[int]
    block_size: int


def _rollback_input(num_requests: int, blocks_per_request: int, seed: int) -> _RollbackInput:
    """Requests in groups of 8 sharing a 200-block prefix, scattered invalid ids."""
    rng = random.Random(seed)
    block_size = 16
    tables: list[list[int]] = []
    next_id = 1
    shared: list[int] = []
    for i in range(num_requests):
        if i % 8 == 0:
            shared = list(range(next_id, next_id + 200))
            next_id += 200
        own = blocks_per_request - len(shared)
        tables.append(shared + list(range(next_id, next_id + own)))
        next_id += own
    scheduled = [rng.choice((0, 1, 16, 64)) for _ in range(num_requests)]
    computed = [blocks_per_request * block_size - rng.randrange(block_size) for _ in tables]
    invalid = rng.sample(range(1, next_id), 100)
    return _RollbackInput(tables, computed, scheduled, invalid, block_size)


def rollback(num_requests: int, native_input: str = "numpy", seed: int = 0) -> Workload:
    """The batch primitive over ``num_requests`` x 1,000-block tables.

    The reference gets lists (its natural input); the native backend gets NumPy int64
    arrays (``native_input="numpy"``) or the same lists (``"lists"``).
    """
    data = _rollback_input(num_requests, 1_000, seed)
    native_tables: list[Any] = data.tables
    if native_input == "numpy":
        import numpy as np  # noqa: PLC0415 (numpy is optional)

        native_tables = [np.asarray(t, dtype=np.int64) for t in data.tables]

    def setup(backend: ModuleType) -> Any:
        return native_tables if backend.__name__.endswith("_native") else data.tables

    def run(backend: ModuleType, tables: Any) -> Any:
        return backend.rollback_invalid_blocks(
            tables, data.computed, data.scheduled, data.invalid, data.block_size
        )

    def check(tables: Any, result: Any) -> None:
        assert len(result.num_computed_tokens) == num_requests
        assert result.affected, "the invalid ids hit no request"
        assert result.total_affected_tokens >= 0

    return Workload(
        name=f"rollback_{num_requests}_{native_input}",
        group=f"rollback {num_requests}",
        description=(
            f"rollback_invalid_blocks: {num_requests:,} requests x 1,000 blocks "
            f"(native fed {'NumPy arrays' if native_input == 'numpy' else 'lists'})"
        ),
        ops=num_requests,
        op_name="request",
        setup=setup,
        run=run,
        check=check,
        vllm_setup=lambda: vllm_runner.setup_rollback(
            data.tables, data.computed, data.scheduled, data.invalid, data.block_size
        ),
        vllm_run=vllm_runner.run_rollback,
    )


@dataclass(slots=True)
class _BenchRequest:
    """The duck-typed request the manager path reads and writes."""

    request_id: str
    num_tokens: int
    num_computed_tokens: int
    block_hashes: list[bytes]


def manager_tables(num_requests: int, blocks_per_request: int) -> list[list[int]]:
    """The block tables a fresh manager gives requests admitted one after another with
    ``blocks_per_request`` blocks each: ascending ids from 1 (a test checks this on both
    backends, so vLLM's column gets the same tables without a manager of its own)."""
    return [
        list(range(1 + i * blocks_per_request, 1 + (i + 1) * blocks_per_request))
        for i in range(num_requests)
    ]


def rollback_manager(num_requests: int = 1_024, blocks_per_request: int = 2_048) -> Workload:
    """``update_requests_with_invalid_blocks`` over block tables held by the manager."""
    block_size = 16
    num_tokens = blocks_per_request * block_size
    rng = random.Random(num_requests)
    num_blocks = num_requests * blocks_per_request + 1
    invalid = rng.sample(range(1, num_blocks), 100)
    built: dict[str, Any] = {}

    def setup(backend: ModuleType) -> Any:
        # Building the manager is expensive: once per backend, then only the requests'
        # token counts are reset for each round.
        if backend.__name__ not in built:
            manager = backend.KVCacheManager(num_blocks, block_size)
            requests = [_BenchRequest(f"r{i}", num_tokens, 0, []) for i in range(num_requests)]
            for request in requests:
                assert manager.allocate_slots(request, num_tokens) is not None
            built[backend.__name__] = manager, requests
        manager, requests = built[backend.__name__]
        for request in requests:
            request.num_computed_tokens = num_tokens
        return manager, requests

    def run(backend: ModuleType, state: Any) -> Any:
        manager, requests = state
        return backend.update_requests_with_invalid_blocks(
            manager, requests, invalid, {}, evict_blocks=True
        )

    def check(state: Any, result: Any) -> None:
        affected, total, to_evict = result
        assert affected and total > 0 and to_evict

    def vllm_setup() -> Any:
        return vllm_runner.setup_rollback(
            manager_tables(num_requests, blocks_per_request),
            [num_tokens] * num_requests,
            [0] * num_requests,
            invalid,
            block_size,
        )

    return Workload(
        name=f"rollback_manager_{num_requests}",
        group="rollback manager",
        description=(
            f"update_requests_with_invalid_blocks: {num_requests:,} running requests x "
            f"{blocks_per_request:,} blocks held by the manager"
        ),
        ops=num_requests,
        op_name="request",
        setup=setup,
        run=run,
        check=check,
        vllm_setup=vllm_setup,
        vllm_run=vllm_runner.run_rollback,
    )


# --------------------------------------------------------------------------- registry


def _importable(module: str) -> bool:
    """Whether an optional dependency (``numpy``, ``msgspec``) is installed."""
    return importlib.util.find_spec(module) is not None


def pool_churn(num_blocks: int = 65_536, num_steps: int = 3_000, seed: int = 0) -> Workload:
    """Allocate / look up and touch / cache / free tail-first on a pool."""
    script = _churn_script(num_blocks, num_steps, seed)
    return Workload(
        name=f"pool_churn_{num_blocks}",
        group="pool churn" if num_blocks == 65_536 else "pool scaling",
        description=f"BlockPool({num_blocks:,}): {num_steps:,} steps of allocate/hit/cache/free",
        ops=num_steps,
        op_name="step",
        setup=_churn_setup(script),
        run=_churn_run(script),
        check=_churn_check,
        vllm_setup=lambda: vllm_runner.setup_pool_churn(num_blocks),
        vllm_run=lambda pool: churn_loop(script.steps, pool),
    )


def all_workloads(quick: bool = False) -> list[WorkloadSpec]:
    """Every workload, in report order, not built yet. ``quick`` shrinks the slow ones."""
    scaling: Sequence[int] = (4_096, 1_048_576) if quick else (4_096, 262_144, 1_048_576)
    native_input = "numpy" if _importable("numpy") else "lists"
    out = [deferred("pool_churn_65536", pool_churn)]
    out += [deferred(f"pool_churn_{n}", pool_churn, n, num_steps=2_000) for n in scaling]
    out.append(deferred("manager_chat", manager_chat, num_sessions=64 if quick else 256))
    if _importable("msgspec"):
        # A pool small enough that cached blocks are reallocated (BlockRemoved events).
        sessions = 32 if quick else 128
        out += [
            deferred(
                f"chat_events_{mode}",
                manager_chat,
                sessions,
                2,
                event_mode=mode,
                concurrency=16,
                num_blocks=2_048,
                name=f"chat_events_{mode}",
                group="events overhead",
            )
            for mode in EVENT_MODES
        ]
    vias = ["request", "request_numpy", "hash_blocks"]
    if native_input != "numpy":
        vias.remove("request_numpy")
    for via in vias:
        out += [
            deferred(f"{_HASH_VIAS[via][0]}_{algo}", hashing, algo, via=via)
            for algo in HASH_ALGORITHMS
        ]
    inputs = [native_input, "lists"] if native_input == "numpy" else [native_input]
    out.append(deferred(f"rollback_1000_{native_input}", rollback, 1_000, native_input))
    out += [deferred(f"rollback_10000_{i}", rollback, 10_000, i) for i in inputs]
    n = 256 if quick else 1_024
    out.append(deferred(f"rollback_manager_{n}", rollback_manager, n))
    # vLLM's Scheduler with kvblocks' manager and with its own: only when both import.
    out += vllm_scheduler.workload_specs(quick)
    return out
