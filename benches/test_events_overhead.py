"""The cost of KV cache events: one chat workload with events off, on (taken every
scheduler step), and on with every step's batch encoded as vLLM's publisher does, on both
backends.

The workload runs on a pool small enough that cached blocks are reallocated (lazy
evictions, so ``BlockRemoved`` events as well as ``BlockStored``). Group
``events overhead``; ``extra_info`` records the backend, the mode and the number of
events. ``KVBLOCKS_BENCH_FULL=1`` runs the full size.

    pytest benches/test_events_overhead.py --benchmark-columns=min,median,rounds
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import msgspec
import pytest
from kvblocks import BACKEND_MODULES, load_backend
from kvblocks.events import KVEventBatch
from pytest_benchmark.fixture import BenchmarkFixture

FULL = os.environ.get("KVBLOCKS_BENCH_FULL") == "1"
MODES = ("off", "on", "on+encode")
#: Script entries between two take_events() calls (about one scheduler step).
STEP = 32


@dataclass(frozen=True, slots=True)
class ChatScript:
    """Admissions (prompt), decodes (token) and finishes of interleaved sessions."""

    num_blocks: int
    block_size: int
    entries: list[tuple[str, int, Any]]


def chat_script(num_sessions: int, turns: int, seed: int = 0) -> ChatScript:
    """Sessions sharing a system prompt, each turn extending its own history."""
    rng = random.Random(seed)
    system = [rng.randrange(32_000) for _ in range(512)]
    history = {s: list(system) for s in range(num_sessions)}
    entries: list[tuple[str, int, Any]] = []
    for _ in range(turns):
        order = list(range(num_sessions))
        rng.shuffle(order)
        for wave in range(0, num_sessions, 16):
            sessions = order[wave : wave + 16]
            for s in sessions:
                history[s] += [rng.randrange(32_000) for _ in range(rng.randint(16, 128))]
                entries.append(("admit", s, list(history[s])))
            for _ in range(rng.randint(16, 48)):
                for s in sessions:
                    token = rng.randrange(32_000)
                    history[s].append(token)
                    entries.append(("decode", s, token))
            entries.extend(("finish", s, None) for s in sessions)
    # 16 live sessions need about 16 * 60 blocks; the rest of the pool caches, and
    # histories outgrow it, so cached blocks get reallocated.
    return ChatScript(num_blocks=2_048, block_size=16, entries=entries)


SCRIPT = chat_script(num_sessions=128 if FULL else 32, turns=4 if FULL else 2)


def run(backend: ModuleType, state: tuple[Any, Any], mode: str) -> int:
    """Plays the script; returns the number of events taken."""
    manager, hasher = state
    encoder = msgspec.msgpack.Encoder()
    live: dict[int, Any] = {}
    turn: dict[int, int] = {}
    num_events = 0
    for i, (kind, session, payload) in enumerate(SCRIPT.entries):
        if kind == "admit":
            turn[session] = turn.get(session, 0) + 1
            request = backend.Request(f"s{session}-{turn[session]}", payload, block_hasher=hasher)
            hits, n = manager.get_computed_blocks(request)
            if manager.allocate_slots(request, request.num_tokens - n, n, hits) is not None:
                request.num_computed_tokens = request.num_tokens
                live[session] = request
        elif kind == "decode":
            request = live.get(session)
            if request is not None:
                request.append_output_token_ids(payload)
                if manager.allocate_slots(request, 1) is not None:
                    request.num_computed_tokens += 1
        else:
            request = live.pop(session, None)
            if request is not None:
                manager.free(request)
        if mode != "off" and i % STEP == STEP - 1:
            events = manager.take_events()
            num_events += len(events)
            if mode == "on+encode":
                encoder.encode(KVEventBatch(ts=0.0, events=events))
    if mode != "off":
        num_events += len(manager.take_events())
    return num_events


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend_name", sorted(BACKEND_MODULES))
def test_events_overhead(benchmark: BenchmarkFixture, backend_name: str, mode: str) -> None:
    backend = load_backend(backend_name)
    benchmark.group = "events overhead"
    benchmark.name = f"chat events {mode}[{backend_name}]"

    def setup() -> tuple[tuple[ModuleType, tuple[Any, Any], str], dict[str, Any]]:
        hasher = backend.BlockHasher(SCRIPT.block_size, "sha256", "0")
        manager = backend.KVCacheManager(
            SCRIPT.num_blocks, SCRIPT.block_size, enable_kv_cache_events=mode != "off"
        )
        return (backend, (manager, hasher), mode), {}

    # pytest-benchmark ships no type hints for pedantic().
    num_events = benchmark.pedantic(  # type: ignore[no-untyped-call]
        run, setup=setup, rounds=3 if backend_name == "python" else 5, iterations=1
    )
    benchmark.extra_info.update(
        backend=backend_name, mode=mode, ops=len(SCRIPT.entries), events=num_events
    )
    if mode == "off":
        assert num_events == 0
    else:
        assert num_events > 100
