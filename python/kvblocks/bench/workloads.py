"""Seeded workloads that run unchanged on either backend module.

Each :class:`Workload` builds a fresh state per round (``setup``), runs the timed part
(``run``) and checks the result outside the timed region (``check``). Every random choice
is drawn from a seeded ``random.Random`` while the script is built, before timing starts,
so both backends replay the very same calls and must produce the very same results.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["WORKLOADS", "Workload", "workloads"]


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
        numpy_input: Whether the native backend is fed NumPy arrays (its natural input).
    """

    name: str
    group: str
    description: str
    ops: int
    op_name: str
    setup: Callable[[ModuleType], Any]
    run: Callable[[ModuleType, Any], Any]
    check: Callable[[Any, Any], None]


def _digest(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


# --------------------------------------------------------------------------- pool churn


@dataclass(frozen=True, slots=True)
class _ChurnScript:
    num_blocks: int
    families: list[list[bytes]]  # per prefix family, the hash chain of its blocks
    steps: list[tuple[int, int, int]]  # (family or -1 for a free, blocks, victim draw)


def _churn_script(num_blocks: int, num_steps: int, seed: int) -> _ChurnScript:
    rng = random.Random(seed)
    families = [[_digest(seed, f, i) for i in range(64)] for f in range(32)]
    steps: list[tuple[int, int, int]] = []
    for _ in range(num_steps):
        if rng.random() < 0.55:
            steps.append((rng.randrange(len(families)), rng.randint(4, 64), 0))
        else:
            steps.append((-1, 0, rng.randrange(1 << 30)))
    return _ChurnScript(num_blocks, families, steps)


def _churn_setup(script: _ChurnScript) -> Callable[[ModuleType], Any]:
    def setup(backend: ModuleType) -> Any:
        return backend.BlockPool(script.num_blocks)

    return setup


def _churn_run(script: _ChurnScript) -> Callable[[ModuleType, Any], Any]:
    def run(backend: ModuleType, pool: Any) -> Any:
        live: list[list[int]] = []
        allocated = 0
        for family, num_blocks, victim in script.steps:
            if family < 0 or pool.get_num_free_blocks() < num_blocks:
                if live:
                    table = live.pop(victim % len(live))
                    pool.free_blocks(table[::-1])  # tail first, as vLLM frees
                continue
            chain = script.families[family]
            # The longest cached prefix, one lookup per block as vLLM's manager does.
            hits: list[int] = []
            for block_hash in chain[: num_blocks - 1]:
                cached = pool.get_cached_block(block_hash)
                if cached is None:
                    break
                hits.append(cached[0])
            pool.touch(hits)
            table = hits + pool.get_new_blocks(num_blocks - len(hits))
            pool.cache_full_blocks(table, chain, len(hits), num_blocks)
            live.append(table)
            allocated += num_blocks - len(hits)
        return live, allocated

    return run


def _churn_check(state: Any, result: Any) -> None:
    live, allocated = result
    state.check_invariants()
    in_use = state.num_blocks - 1 - state.get_num_free_blocks()
    assert in_use <= sum(len(t) for t in live)
    assert allocated > 0


# --------------------------------------------------------------------------- registry


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
    )


def workloads(quick: bool = False) -> list[Workload]:
    """Every workload, in report order. ``quick`` shrinks the slow ones."""
    scaling: Sequence[int] = (4_096, 1_048_576) if quick else (4_096, 65_536, 262_144, 1_048_576)
    out = [pool_churn()]
    out += [pool_churn(n, num_steps=2_000) for n in scaling if n != 65_536]
    return out


WORKLOADS: dict[str, Callable[[], Workload]] = {"pool_churn": pool_churn}
