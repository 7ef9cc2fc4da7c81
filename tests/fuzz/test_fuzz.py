"""The differential fuzzer: both backends in lockstep, hostile inputs included.

Each test draws a *program*: a list of calls on one API area (pool, hashing, requests,
manager, rollback, constructors and value classes) whose arguments are mostly valid and
sometimes hostile (``tests/fuzz/hostile.py``). ``tests/fuzz/child.py`` runs it in a child
process on the reference and on the native backend, one call at a time, and reports the
first call after which the two disagree: on the outcome (the result as plain values, or
the exact exception class), on the whole observable state, or because a call that raised
changed the state of its backend. Message-only differences are reported apart and do not
fail a test.

A backend that aborts, segfaults or hangs (``STEP_TIMEOUT`` seconds per call) kills only
the child: the test fails with the program as the reproducer, and the child is restarted.
Every failure prints the shrunk program, the command that replays it and the calls as
Python-ish source.

Run ``pytest tests/fuzz`` (the bounded, derandomized ``ci`` profile) or ``pytest tests/fuzz
--hypothesis-profile=long`` (20 times the examples, random).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import IO, Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz import hostile as h
from fuzz.child import PROBE_HASHES
from fuzz.hostile import Recipe

CHILD = Path(__file__).with_name("child.py")

#: Seconds one call may take in the child before it counts as a hang (``faulthandler``
#: then kills the child with every thread's traceback); every valid call takes
#: milliseconds.
STEP_TIMEOUT = 5.0

#: Seconds the parent waits for a whole program: the child's own watchdog should fire
#: long before.
PROGRAM_TIMEOUT = 60.0

Step = dict[str, Any]
Program = list[Step]


# =========================================================================== the child


class Worker:
    """A persistent ``child.py`` process: one JSON program in, one report out."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.lines: queue.Queue[bytes] = queue.Queue()
        self.stderr: IO[bytes] | None = None

    def start(self) -> subprocess.Popen[bytes]:
        # Kept open for the child's lifetime (its stderr), closed with the worker.
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115
        env = {**os.environ, "KVBLOCKS_FUZZ_STEP_TIMEOUT": str(STEP_TIMEOUT)}
        proc = subprocess.Popen(
            [sys.executable, str(CHILD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
        )
        self.lines = queue.Queue()
        # A reader thread, so that waiting for a report can time out on every platform.
        threading.Thread(target=self._read, args=(proc, self.lines), daemon=True).start()
        self.proc = proc
        return proc

    @staticmethod
    def _read(proc: subprocess.Popen[bytes], lines: queue.Queue[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(b"")  # end of file: the child died

    def stderr_tail(self) -> str:
        if self.stderr is None:
            return ""
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-6000:]

    def run(self, program: Program) -> dict[str, Any]:
        """The child's report on ``program``, or ``{"crash": ...}`` if it died or hung."""
        proc = self.proc if self.proc is not None and self.proc.poll() is None else self.start()
        assert proc.stdin is not None and self.stderr is not None
        self.stderr.seek(0)
        self.stderr.truncate()
        try:
            proc.stdin.write(json.dumps(program).encode() + b"\n")
            proc.stdin.flush()
            line = self.lines.get(timeout=PROGRAM_TIMEOUT)
        except (BrokenPipeError, OSError):
            line = b""
        except queue.Empty:
            proc.kill()
            proc.wait()
            self.proc = None
            return {"crash": f"no report after {PROGRAM_TIMEOUT} s", "stderr": self.stderr_tail()}
        if not line:
            code = proc.wait()
            self.proc = None
            kind = "hang (watchdog)" if "Timeout" in self.stderr_tail() else "crash"
            return {"crash": f"{kind}: child exited with {code}", "stderr": self.stderr_tail()}
        report: dict[str, Any] = json.loads(line)
        return report

    def close(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None


_WORKER = Worker()


@pytest.fixture(scope="module", autouse=True)
def _worker() -> Iterator[None]:
    yield
    _WORKER.close()


def check(program: Program) -> None:
    """Runs ``program`` in the child; fails with a reproducer on any divergence, a
    different message for the same error class included."""
    report = _WORKER.run(program)
    if "crash" in report or report["divergences"] or report["messages"]:
        pytest.fail(reproducer(program, report), pytrace=False)
    # Every step ran: no divergence is what a passing program asserts.
    assert report["steps"] == len(program)


def reproducer(program: Program, report: dict[str, Any]) -> str:
    """The failure message: what diverged, the calls, and how to replay them."""
    from fuzz import child  # noqa: PLC0415 (the child module, imported only to format a failure)

    lines = ["The backends diverged (python = reference, rust = native)."]
    if "crash" in report:
        lines += [f"CHILD {report['crash']}", "stderr (tail):", report["stderr"]]
    for d in [*report.get("divergences", []), *report.get("messages", [])]:
        lines.append(json.dumps(d, ensure_ascii=True))
    lines.append("Calls (each backend builds its own fresh arguments):")
    lines += [f"  {child.render_step(step)}" for step in program]
    lines.append("Replay:")
    lines.append(f"  {sys.executable} {CHILD} --replay - <<'EOF'")
    lines.append(json.dumps(program, ensure_ascii=True))
    lines.append("EOF")
    return "\n".join(lines)


# =========================================================================== value recipes


#: How many more hostile values :func:`mostly` may draw into the step being drawn:
#: :func:`one_fault` makes it 1 while it draws a step; ``None`` (outside it) is no limit.
_faults_left: list[int | None] = [None]


@st.composite
def mostly(
    draw: st.DrawFn, valid: st.SearchStrategy[Recipe], hostile: st.SearchStrategy[Recipe]
) -> Recipe:
    """``valid`` about four times in five, else ``hostile`` (marked as a fault); always
    ``valid`` once the step being drawn has had its fault."""
    left = _faults_left[0]
    if left == 0:
        return draw(valid)
    recipe = draw(st.one_of(valid, valid, valid, valid, hostile.map(h.fault)))
    if left is not None:
        _faults_left[0] = max(0, left - h.count_faults(recipe))
    return recipe


@st.composite
def _one_fault_budget(draw: st.DrawFn, steps: st.SearchStrategy[Step]) -> Step:
    outer = _faults_left[0]
    _faults_left[0] = 1
    try:
        return draw(steps)
    finally:
        _faults_left[0] = outer


def one_fault(steps: st.SearchStrategy[Step]) -> st.SearchStrategy[Step]:
    """Steps with at most one hostile value: with several, which one a backend reports
    first is not specified (``kvblocks.reference.kv_cache_utils``), so no divergence.

    :func:`mostly` draws at most one per step; the filter drops the few steps that get a
    second one from a strategy that marks its own faults."""
    return _one_fault_budget(steps).filter(lambda s: h.count_faults(s) <= 1)


def hostile_ints(valid: st.SearchStrategy[int]) -> st.SearchStrategy[Recipe]:
    """Everything that is not quite an in-range int."""
    return st.one_of(
        h.huge_ints(), h.wrong_types(), h.int_subclasses(valid), h.index_objects(valid)
    )


@cache
def ints(lo: int, hi: int) -> st.SearchStrategy[Recipe]:
    """An int in ``lo..hi``, or now and then a hostile one."""
    valid = st.integers(lo, hi)
    return mostly(valid, hostile_ints(valid))


@cache
def flags() -> st.SearchStrategy[Recipe]:
    """A bool, or an int, ``None``, a raising or flipping ``__bool__``."""
    return mostly(st.booleans(), st.one_of(h.hostile_flags(), st.sampled_from([0, 2, None])))


#: Block hashes: the probes of the child's snapshots, so that lookups hit.
HASHES = PROBE_HASHES


@cache
def valid_hashes() -> st.SearchStrategy[Recipe]:
    """A block hash the snapshot probes."""
    return st.sampled_from([h.bytes_recipe(x) for x in HASHES])


@cache
def hostile_hashes() -> st.SearchStrategy[Recipe]:
    """A subclass with lying dunders, a wrong type, an over-long hash."""
    return st.one_of(
        h.bytes_subclasses(st.sampled_from(HASHES)),
        st.just(h.bytes_recipe(b"z" * 33)),
        st.just(["bytearray", "0101"]),
        h.wrong_types(),
    )


@cache
def hashes() -> st.SearchStrategy[Recipe]:
    """A block hash, or now and then a hostile one."""
    return mostly(valid_hashes(), hostile_hashes())


@cache
def sequence_forms() -> st.SearchStrategy[Recipe]:
    """How a list of items (``"$ids"``) is passed: a list mostly, else anything iterable."""
    return mostly(st.just(["list", "$ids"]), int_forms())


@cache
def int_forms() -> st.SearchStrategy[Recipe]:
    """The hostile forms of a sequence of ints ``"$ids"``."""
    return st.one_of(
        h.iterables_of("$ids"),
        h.numpy_arrays("$ids"),
        st.just(["set", "$ids"]),
    )


def item_lists(items: st.SearchStrategy[Recipe], max_size: int = 5) -> st.SearchStrategy[Recipe]:
    """A list of ``items`` in any iterable form."""
    return st.lists(items, max_size=max_size).flatmap(
        lambda xs: mostly(st.just(["list", xs]), h.int_iterables(xs))
    )


@cache
def block_ids(num_blocks: int = 12) -> st.SearchStrategy[Recipe]:
    return ints(0, num_blocks)


@cache
def tokens() -> st.SearchStrategy[Recipe]:
    """Token id lists that share prefixes (so prefix hits happen), in any form."""
    prefixes = st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [5, 5, 5, 5]])
    tails = st.lists(mostly(st.integers(0, 3), hostile_ints(st.integers(0, 3))), max_size=6)
    return st.tuples(prefixes, tails).flatmap(
        lambda pt: mostly(
            st.just(["list", [*pt[0], *pt[1]]]),
            st.one_of(
                h.int_iterables([*pt[0], *pt[1]]),
                # Weighted up: the forms a reader must snapshot, or must not size from.
                h.mutating_lists([*pt[0], *pt[1]]),
                h.lying_hints([*pt[0], *pt[1]]),
            ),
        )
    )


@cache
def request_ids() -> st.SearchStrategy[Recipe]:
    """A few request ids (reused), or subclasses, non-encodable strings, wrong types."""
    valid = st.sampled_from(["r0", "r1", "r2", "r3"])
    return mostly(
        valid,
        st.one_of(h.str_subclasses(valid), h.non_encodable_strings(), h.wrong_types(), st.just(7)),
    )


@cache
def extra_keys() -> st.SearchStrategy[Recipe]:
    """Extra keys: valid nested tuples, and what must be refused."""
    scalars = st.one_of(
        st.none(),
        st.integers(-3, 2**64),
        st.sampled_from(["a", "", "mm"]),
        st.just(h.bytes_recipe(b"k")),
    )
    valid = st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3).map(lambda xs: ["tuple", xs]),
        max_leaves=6,
    )
    deep: Recipe = None
    for _ in range(66):
        deep = ["tuple", [deep]]
    bad = st.one_of(
        st.sampled_from([True, 1.5, ["list", ["a"]], deep, ["object"]]),
        h.non_encodable_strings(),
        h.str_subclasses(st.just("a")),
        h.int_subclasses(st.just(1)),
        h.bytes_subclasses(st.just(b"k")),
    )
    return mostly(valid, bad)


@cache
def lora_requests() -> st.SearchStrategy[Recipe]:
    return st.one_of(
        st.none(),
        st.builds(
            lambda name, path: [
                "ns",
                [["lora_name", name], ["lora_path", path], ["lora_int_id", 3]],
            ],
            mostly(
                st.just("L"),
                st.one_of(h.non_encodable_strings(), h.str_subclasses(st.just("L")), st.just(1.5)),
            ),
            st.just("/p"),
        ),
    )


@cache
def mm_features() -> st.SearchStrategy[Recipe]:
    item = st.builds(
        lambda ident, off, length: [
            "ns",
            [["identifier", ident], ["mm_position", ["ns", [["offset", off], ["length", length]]]]],
        ],
        mostly(
            st.sampled_from(["img", "b"]), st.one_of(h.non_encodable_strings(), h.wrong_types())
        ),
        ints(0, 10),
        ints(0, 6),
    )
    return st.one_of(st.just(["tuple", []]), item_lists(item, 3), h.wrong_types())


@cache
def cache_salts() -> st.SearchStrategy[Recipe]:
    return mostly(
        st.sampled_from([None, "salt", ""]),
        st.one_of(h.str_subclasses(st.just("salt")), h.non_encodable_strings(), h.wrong_types()),
    )


# =========================================================================== steps


def step(op: str, *args: Recipe, **extra: Any) -> Step:
    """A step; ``kwargs=[[name, recipe], ...]`` and bookkeeping keys go in ``extra``."""
    result: Step = {"op": op, "args": list(args)}
    result.update(extra)
    return result


@cache
def reentrant_calls(area: str) -> st.SearchStrategy[Recipe]:
    """Calls a hostile callback makes back into the same backend's objects."""
    if area == "pool":
        return st.sampled_from(
            [
                step("pool.get_new_blocks", 1, save="table"),
                step("pool.free_blocks", ["table", 0, True, ["list", "$ids"]]),
                step("pool.reset_prefix_cache"),
            ]
        )
    return st.sampled_from(
        [
            step("mgr.free", ["req", 0]),
            step("mgr.allocate_slots", ["req", 0], 4),
            step("mgr.reset_prefix_cache"),
            step("mgr.evict_blocks", ["list", [1, 2]]),
            step("req.append_output_token_ids", 1, index=0),
        ]
    )


@cache
def valid_table_arg() -> st.SearchStrategy[Recipe]:
    """One of the pool's held tables, as a list."""
    return st.builds(lambda k: ["table", k, False, ["list", "$ids"]], st.integers(0, 5))


@cache
def table_arg(take: bool = False) -> st.SearchStrategy[Recipe]:
    """One of the pool's held tables, in any iterable form."""
    return st.builds(lambda k, form: ["table", k, take, form], st.integers(0, 5), sequence_forms())


@st.composite
def pool_steps(draw: st.DrawFn) -> Step:
    kind = draw(
        st.sampled_from(
            [
                "alloc",
                "alloc",
                "free",
                "free",
                "touch",
                "cache",
                "cache",
                "lookup",
                "longest",
                "evict",
                "reset",
                "get",
                "free_raw",
            ]
        )
    )
    if kind == "alloc":
        return step("pool.get_new_blocks", draw(ints(0, 4)), save="table")
    if kind == "free":
        return step("pool.free_blocks", draw(table_arg(take=True)))
    if kind == "free_raw":
        return step("pool.free_blocks", draw(item_lists(block_ids())))
    if kind == "touch":
        k = draw(st.integers(0, 5))
        return step("pool.touch", ["table", k, False, draw(sequence_forms())], hold=k)
    if kind == "cache":
        # One argument at most is hostile, chosen first: drawn independently, most
        # cache steps had several faults and were filtered out.
        where = draw(st.sampled_from(["none", "none", "ids", "hash", "hashes", "ints", "mutator"]))
        hash_list = draw(st.lists(valid_hashes(), max_size=6))
        if where == "hash" and hash_list:
            i = draw(st.integers(0, len(hash_list) - 1))
            hash_list[i] = h.fault(draw(hostile_hashes()))
        hash_arg: Recipe = ["list", hash_list]
        if where == "hashes":
            hash_arg = h.fault(
                draw(
                    st.one_of(
                        h.iterables_of(hash_list),
                        h.disagreeing_sequences(hash_list, st.lists(valid_hashes(), max_size=6)),
                        h.reentrant_sequences(hash_list, reentrant_calls("pool")),
                    )
                )
            )
        table = draw(table_arg()) if where == "ids" else draw(valid_table_arg())
        counts = [draw(st.integers(0, 4)), draw(st.integers(0, 6)), draw(st.sampled_from([0, 1]))]
        if where == "ints":
            i = draw(st.integers(0, 2))
            counts[i] = h.fault(draw(hostile_ints(st.just(counts[i]))))
        elif where == "mutator":
            # A count's __index__ changes the ids or the hashes (read after the ints in
            # both backends).
            name = draw(st.sampled_from(["ids", "hashes"]))
            counts[1] = h.fault(draw(h.mutators_of(name, st.integers(1, 4))))
        return step(
            "pool.cache_full_blocks",
            ["named", "ids", table],
            ["named", "hashes", hash_arg],
            *counts,
        )
    if kind == "lookup":
        groups = draw(item_lists(mostly(st.sampled_from([0, 1]), hostile_ints(st.just(0))), 3))
        return step("pool.get_cached_block", draw(hashes()), groups)
    if kind == "longest":
        hash_list = draw(st.lists(hashes(), max_size=4))
        seq = draw(
            st.one_of(
                st.just(["list", hash_list]),
                h.lying_lengths(hash_list),
                h.lying_hints(hash_list),
                h.changing_sequences(hash_list),
                h.disagreeing_sequences(hash_list, st.lists(hashes(), max_size=4)),
                h.reentrant_sequences(hash_list, reentrant_calls("pool")),
            )
        )
        group = draw(mostly(ints(0, 1), h.mutators_of("hashes", st.integers(0, 1))))
        return step("pool.find_longest_cache_hit", ["named", "hashes", seq], group)
    if kind == "evict":
        return step("pool.evict_blocks", draw(item_lists(block_ids())))
    if kind == "reset":
        return step("pool.reset_prefix_cache")
    return step("pool.get_block", draw(block_ids()))


@st.composite
def pool_programs(draw: st.DrawFn) -> Program:
    setup = step(
        "mod.BlockPool",
        draw(st.integers(1, 12)),
        draw(st.booleans()),
        kwargs=[["block_size", draw(st.sampled_from([1, 4, 16]))]],
        save="pool",
    )
    return [setup, *draw(st.lists(one_fault(pool_steps()), min_size=1, max_size=25))]


# --------------------------------------------------------------------------- hashing


@st.composite
def hasher_setup(draw: st.DrawFn, block_size: int | None = None) -> Step:
    """A ``BlockHasher``; hostile algo/seed only where ``hostile`` is set."""
    size = block_size if block_size is not None else draw(st.sampled_from([1, 2, 4]))
    algo = draw(st.sampled_from(["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]))
    return step("mod.BlockHasher", size, algo, "0", save="hasher")


@cache
def parents() -> st.SearchStrategy[Recipe]:
    return st.one_of(st.none(), hashes())


@st.composite
def hashable_requests(draw: st.DrawFn, block_size: int) -> Recipe:
    """A duck request for ``BlockHasher.__call__``: honest or lying ``num_tokens``,
    ``block_hashes`` read by iteration or by index, attributes changing per read."""
    token_list = draw(st.lists(st.integers(0, 3), max_size=10))
    n = len(token_list)
    known = draw(st.lists(hashes(), max_size=2))
    fixed: list[Recipe] = [
        ["all_token_ids", draw(mostly(st.just(["list", token_list]), h.iterables_of(token_list)))],
        [
            "block_hashes",
            draw(
                mostly(
                    st.just(["list", known]),
                    st.one_of(
                        h.lying_lengths(known),
                        h.disagreeing_sequences(known, st.lists(hashes(), max_size=2)),
                        h.wrong_types(),
                    ),
                )
            ),
        ],
        ["lora_request", draw(lora_requests())],
        ["cache_salt", draw(cache_salts())],
        ["mm_features", draw(mm_features())],
        ["prompt_embeds", draw(st.sampled_from([None, None, None, ["object"]]))],
    ]
    changing: list[Recipe] = []
    claimed = draw(st.sampled_from(["honest", "honest", "more", "huge", "hostile", "changing"]))
    if claimed == "honest":
        fixed.append(["num_tokens", n])
    elif claimed == "more":
        fixed.append(["num_tokens", h.fault(n + block_size * draw(st.integers(1, 3)))])
    elif claimed == "huge":
        huge = draw(st.sampled_from([2**40, 2**62, 2**63 - 1, 2**64]))
        fixed.append(["num_tokens", h.fault(huge)])
    elif claimed == "hostile":
        fixed.append(["num_tokens", h.fault(draw(hostile_ints(st.just(n))))])
    else:
        changing.append(["num_tokens", [n, h.fault(n + block_size)]])
    return ["duck", fixed, changing]


@st.composite
def hasher_steps(draw: st.DrawFn, block_size: int) -> Step:
    kind = draw(st.sampled_from(["block", "blocks", "call", "call", "props"]))
    if kind == "block":
        return step("hasher.hash_block", draw(parents()), draw(tokens()), draw(extra_keys()))
    if kind == "blocks":
        keys = draw(st.one_of(st.none(), item_lists(extra_keys(), 4)))
        return step("hasher.hash_blocks", draw(tokens()), draw(parents()), keys)
    if kind == "call":
        return step("hasher.__call__", draw(hashable_requests(block_size)))
    return step(draw(st.sampled_from(["hasher.@none_hash", "hasher.@seed", "hasher.@algo"])))


@st.composite
def hasher_programs(draw: st.DrawFn) -> Program:
    setup = draw(hasher_setup())
    size = setup["args"][0]
    return [setup, *draw(st.lists(one_fault(hasher_steps(size)), min_size=1, max_size=12))]


# --------------------------------------------------------------------------- requests


@cache
def block_hashers(area: str) -> st.SearchStrategy[Recipe]:
    """A ``block_hasher``: the side's ``BlockHasher`` mostly, else one that returns
    hostile iterables (lying ``__length_hint__``), raises, re-enters, or is no callable."""
    results = st.lists(hashes(), max_size=3).flatmap(h.iterables_of)
    return mostly(
        st.just(["side", "hasher"]),
        st.one_of(
            results.map(lambda r: ["returns", r]),
            st.just(["raises"]),
            h.reentrant_callables(reentrant_calls(area), st.just(["list", []])),
            st.sampled_from([1, "f"]),
        ),
    )


@st.composite
def new_request(draw: st.DrawFn, area: str) -> Step:
    kwargs = [["block_hasher", draw(block_hashers(area))]]
    if draw(st.booleans()):
        kwargs += [
            ["lora_request", draw(lora_requests())],
            ["cache_salt", draw(cache_salts())],
            ["mm_features", draw(mm_features())],
        ]
    return step("mod.Request", draw(request_ids()), draw(tokens()), kwargs=kwargs, save="request")


@st.composite
def request_steps(draw: st.DrawFn) -> Step:
    k = draw(st.integers(0, 3))
    kind = draw(st.sampled_from(["new", "append", "append", "computed", "set", "update", "hash"]))
    if kind == "new":
        return draw(new_request("request"))
    if kind == "append":
        one = draw(st.booleans())
        value = draw(ints(0, 3)) if one else draw(tokens())
        return step("req.append_output_token_ids", value, index=k)
    if kind == "computed":
        return step("req.=num_computed_tokens", draw(ints(0, 8)), index=k)
    if kind == "set":
        name, values = draw(
            st.sampled_from(
                [
                    ("cache_salt", cache_salts()),
                    ("mm_features", mm_features()),
                    ("lora_request", lora_requests()),
                    ("prompt_embeds", st.sampled_from([None, ["object"]])),
                ]
            )
        )
        return step(f"req.={name}", draw(values), index=k)
    if kind == "update":
        return step("req.update_block_hashes", index=k)
    return step("hasher.__call__", ["req", k])


@st.composite
def request_programs(draw: st.DrawFn) -> Program:
    setup = draw(hasher_setup())
    first = draw(one_fault(new_request("request")))
    return [setup, first, *draw(st.lists(one_fault(request_steps()), min_size=1, max_size=15))]


@st.composite
def several_bad_extras_programs(draw: st.DrawFn) -> Program:
    """A request whose extras may hold several hostile values at once, hashed as it is
    made and again as it grows. Which bad value a backend reports is specified for the
    extras (their one read order, docs/errors.md), so both must report the same one."""
    extras = [
        ["lora_request", draw(lora_requests())],
        ["mm_features", draw(mm_features())],
        ["cache_salt", draw(cache_salts())],
    ]
    made = step(
        "mod.Request",
        "r",
        draw(tokens()),
        kwargs=[["block_hasher", ["side", "hasher"]], *extras],
        save="request",
    )
    grow = step("req.append_output_token_ids", draw(tokens()), index=0)
    return [draw(hasher_setup()), made, grow, step("hasher.__call__", ["req", 0])]


# --------------------------------------------------------------------------- manager


@st.composite
def manager_requests(draw: st.DrawFn, block_size: int) -> Recipe:
    """Request ``k``, or a duck copy of it with lying or changing attributes."""
    k = draw(st.integers(0, 3))
    if draw(st.integers(0, 4)):
        return ["req", k]
    fixed: list[Recipe] = []
    changing: list[Recipe] = []
    what = draw(
        st.sampled_from(
            [
                "num_tokens",
                "block_hashes",
                "request_id",
                "changing_id",
                "changing_tokens",
                "num_computed_tokens",
            ]
        )
    )
    if what == "num_tokens":
        fixed.append(
            [
                "num_tokens",
                draw(
                    st.one_of(
                        st.sampled_from([2**40, 2**63, -1]),
                        hostile_ints(st.just(4)),
                        st.just(["req_attr", k, "num_tokens", block_size * 3]),
                    )
                ),
            ]
        )
    elif what == "block_hashes":
        form = draw(
            st.one_of(
                st.just(["lying_len", "$ids", 2**40]),
                st.just(["lying_len", "$ids", 0]),
                st.builds(
                    lambda extra: ["disagreeing", "$ids", extra], st.lists(hashes(), max_size=3)
                ),
                reentrant_calls("manager").map(lambda c: ["reentrant_seq", "$ids", c]),
                st.just(["oneshot", "$ids"]),
                st.just(["tuple", "$ids"]),
            )
        )
        fixed.append(["block_hashes", ["via", ["req_attr", k, "block_hashes", 0], form]])
    elif what == "request_id":
        fixed.append(
            [
                "request_id",
                draw(
                    st.one_of(
                        h.str_subclasses(st.sampled_from(["r0", "r1"])),
                        h.non_encodable_strings(),
                        h.wrong_types(),
                    )
                ),
            ]
        )
    elif what == "changing_id":
        changing.append(["request_id", ["r0", "r1"]])
    elif what == "changing_tokens":
        changing.append(
            [
                "num_tokens",
                [["req_attr", k, "num_tokens", 0], ["req_attr", k, "num_tokens", block_size]],
            ]
        )
    else:
        fixed.append(["num_computed_tokens", draw(hostile_ints(st.just(0)))])
    return h.fault(["duck_of", k, fixed, changing])


@st.composite
def manager_steps(draw: st.DrawFn, block_size: int) -> list[Step]:
    k = draw(st.integers(0, 3))
    req = draw(manager_requests(block_size))
    kind = draw(
        st.sampled_from(
            [
                "new",
                "admit",
                "admit",
                "step",
                "append",
                "cache",
                "free",
                "ids",
                "evict",
                "reset",
                "events",
                "stats",
                "rollback",
            ]
        )
    )
    if kind == "new":
        return [draw(new_request("manager"))]
    if kind == "admit":
        # Now and then the lookahead's __index__ changes the hit list (read after it).
        lookahead = draw(mostly(ints(0, 2), h.mutators_of("hits", st.integers(0, 2))))
        return [
            step("mgr.get_computed_blocks", req, save="hits"),
            step(
                "mgr.allocate_slots",
                req,
                draw(mostly(st.just(["todo", k, 0]), hostile_ints(st.just(1)))),
                ["hit_tokens"],
                [
                    "named",
                    "hits",
                    draw(mostly(st.just(["hit_ids"]), item_lists(block_ids()))),
                ],
                lookahead,
                draw(mostly(st.just(0), ints(0, 4))),
                draw(flags()),
                advance=k,
            ),
        ]
    if kind == "step":
        return [
            step(
                "mgr.allocate_slots",
                req,
                ["todo", k, 0],
                kwargs=[["num_lookahead_tokens", draw(ints(0, 2))]],
                advance=k,
            )
        ]
    if kind == "append":
        return [step("req.append_output_token_ids", draw(tokens()), index=k)]
    if kind == "cache":
        return [step("mgr.cache_blocks", req, draw(ints(0, 20)))]
    if kind == "free":
        return [step("mgr.free", req)]
    if kind == "ids":
        return [step("mgr.get_block_ids", draw(request_ids()))]
    if kind == "evict":
        return [step("mgr.evict_blocks", draw(item_lists(block_ids())))]
    if kind == "reset":
        return [step("mgr.reset_prefix_cache")]
    if kind == "events":
        return [step("mgr.take_events")]
    if kind == "stats":
        return [step("mgr.record_prefix_cache_stats", req, draw(ints(0, 8)))]
    # Rollback through the real manager: its block tables, its evict_blocks.
    invalid = draw(item_lists(block_ids()))
    scheduled = draw(scheduled_mappings())
    running = draw(item_lists(st.builds(lambda i: ["req", i], st.integers(0, 3)), 3))
    return [
        step(
            "mod.handle_invalid_blocks",
            ["side", "mgr"],
            invalid,
            scheduled,
            kwargs=[["running", running], ["policy", draw(policies())], ["mode", draw(modes())]],
        )
    ]


@cache
def policies() -> st.SearchStrategy[Recipe]:
    return mostly(
        st.sampled_from(["fail", "recompute"]),
        st.one_of(h.str_subclasses(st.just("fail")), h.wrong_types()),
    )


@cache
def modes() -> st.SearchStrategy[Recipe]:
    return mostly(
        st.sampled_from(["vllm", "strict"]),
        st.one_of(h.str_subclasses(st.just("vllm")), h.wrong_types()),
    )


@cache
def scheduled_mappings() -> st.SearchStrategy[Recipe]:
    """``num_scheduled_tokens``: a dict, or a dict subclass whose methods lie."""
    pairs = st.lists(st.tuples(st.sampled_from(["r0", "r1", "r2", "r3"]), ints(0, 4)), max_size=4)
    return pairs.flatmap(
        lambda ps: mostly(st.just(["dict", [list(p) for p in ps], "plain"]), h.dict_subclasses(ps))
    )


@st.composite
def manager_programs(draw: st.DrawFn) -> Program:
    block_size = draw(st.sampled_from([1, 2, 4]))
    setup = step(
        "mod.KVCacheManager",
        draw(st.integers(2, 24)),
        block_size,
        kwargs=[
            ["enable_caching", draw(st.sampled_from([True, True, False]))],
            ["max_model_len", draw(st.sampled_from([None, None, 24]))],
            ["log_stats", True],
            ["enable_kv_cache_events", draw(st.booleans())],
            ["kv_events_last_copy_removal", draw(st.booleans())],
        ],
        save="mgr",
    )
    hasher = step("mod.BlockHasher", block_size, "sha256", "0", save="hasher")
    groups = manager_steps(block_size).filter(lambda g: all(h.count_faults(s) <= 1 for s in g))
    steps = draw(st.lists(groups, min_size=1, max_size=12))
    return [setup, hasher, *[s for group in steps for s in group]]


# --------------------------------------------------------------------------- rollback


@cache
def rollback_requests() -> st.SearchStrategy[Recipe]:
    """Persistent requests mostly; ducks whose ``request_id`` changes per read now and then."""
    duck = st.builds(
        lambda n: ["duck", [["num_computed_tokens", n]], [["request_id", ["r0", "r1"]]]], ints(0, 8)
    )
    return mostly(st.builds(lambda i: ["rb_req", i], st.integers(0, 3)), duck)


@st.composite
def rollback_steps(draw: st.DrawFn) -> Step:
    kind = draw(st.sampled_from(["primitive", "update", "handle", "handle", "recving"]))
    invalid = draw(item_lists(block_ids(8)))
    if kind == "primitive" and draw(st.booleans()):
        # Valid columns, one of which a hostile value changes or sizes: block_size's
        # __index__ changing a column (read after it), or a column changing itself.
        columns: list[list[Any]] = [
            ["list", [["list", draw(st.lists(st.integers(0, 8), max_size=4))]]],
            ["list", [draw(st.integers(0, 12))]],
            ["list", [draw(st.integers(0, 4))]],
            ["list", draw(st.lists(st.integers(0, 8), max_size=4))],
        ]
        names = ["tables", "computed", "scheduled", "invalid"]
        size: Recipe = draw(st.integers(1, 4))
        i = draw(st.integers(0, 3))
        how = draw(st.sampled_from(["mutator", "mutating", "hint", "changing"]))
        if how == "mutator":
            size = h.fault(draw(h.mutators_of(names[i], st.integers(1, 4))))
        else:
            forms = {
                "mutating": h.mutating_lists,
                "hint": h.lying_hints,
                "changing": h.changing_sequences,
            }
            columns[i] = h.fault(draw(forms[how](columns[i][1])))
        return step(
            "mod.rollback_invalid_blocks",
            *[["named", n, c] for n, c in zip(names, columns, strict=True)],
            size,
        )
    if kind == "primitive":
        tables = draw(item_lists(item_lists(block_ids(8), 4), 3))
        # Now and then block_size's __index__ changes a column (read after it).
        size = draw(
            mostly(
                ints(1, 4),
                st.sampled_from(["tables", "computed", "scheduled", "invalid"]).flatmap(
                    lambda name: h.mutators_of(name, st.integers(1, 4))
                ),
            )
        )
        return step(
            "mod.rollback_invalid_blocks",
            ["named", "tables", tables],
            ["named", "computed", draw(item_lists(ints(0, 12), 3))],
            ["named", "scheduled", draw(item_lists(ints(0, 4), 3))],
            ["named", "invalid", invalid],
            size,
            kwargs=[["collect_evictions", draw(flags())], ["mode", draw(modes())]],
        )
    requests = draw(item_lists(rollback_requests(), 4))
    if kind == "update":
        return step(
            "mod.update_requests_with_invalid_blocks",
            ["side", "fake"],
            requests,
            invalid,
            draw(scheduled_mappings()),
            kwargs=[["evict_blocks", draw(flags())], ["mode", draw(modes())]],
        )
    if kind == "handle":
        waiting = draw(item_lists(rollback_requests(), 2))
        return step(
            "mod.handle_invalid_blocks",
            ["side", "fake"],
            invalid,
            draw(scheduled_mappings()),
            kwargs=[
                ["running", requests],
                ["waiting_for_remote_kvs", waiting],
                ["policy", draw(policies())],
                ["mode", draw(modes())],
            ],
        )
    ids = draw(item_lists(request_ids(), 3))
    return step("mod.handle_failed_recving", ids, requests, kwargs=[["policy", draw(policies())]])


@st.composite
def rollback_programs(draw: st.DrawFn) -> Program:
    tables = {
        rid: draw(st.lists(st.integers(0, 7), max_size=4)) for rid in ["r0", "r1", "r2", "r3"]
    }
    setup = [
        step(
            "ctx.fake_manager",
            tables,
            draw(st.sampled_from([1, 2, 4])),
            draw(st.sampled_from([1, 1, 1, 2])),
            draw(st.sampled_from([None, 8])),
            save="fake",
        )
    ]
    for rid in draw(st.lists(st.sampled_from(["r0", "r1", "r2", "r3"]), min_size=1, max_size=4)):
        setup.append(step("ctx.rb_request", rid, draw(st.integers(0, 12)), save="rb_request"))
    return [*setup, *draw(st.lists(one_fault(rollback_steps()), min_size=1, max_size=8))]


# --------------------------------------------------------------------------- constructors


@cache
def sizes() -> st.SearchStrategy[Recipe]:
    """Pool sizes: small, or beyond any pool a backend may build (>= 2**32 - 2), or
    hostile; never a legal but huge size, which would only measure memory."""
    huge = st.sampled_from([2**32 - 2, 2**32, 2**40, 2**63, 2**64, 0, -1, -(2**63)])
    small = st.integers(1, 8)
    return mostly(
        small,
        st.one_of(huge, h.wrong_types(), h.int_subclasses(small), h.index_objects(small)),
    )


@st.composite
def constructor_steps(draw: st.DrawFn) -> Step:
    kind = draw(
        st.sampled_from(
            [
                "pool",
                "manager",
                "hasher",
                "block",
                "stats",
                "rollback_result",
                "outcome",
            ]
        )
    )
    if kind == "pool":
        return step(
            "mod.BlockPool", draw(sizes()), draw(flags()), kwargs=[["block_size", draw(sizes())]]
        )
    if kind == "manager":
        return step(
            "mod.KVCacheManager",
            draw(sizes()),
            draw(sizes()),
            kwargs=[
                ["enable_caching", draw(flags())],
                ["max_model_len", draw(st.one_of(st.none(), sizes()))],
                ["log_stats", draw(flags())],
                ["enable_kv_cache_events", draw(flags())],
            ],
        )
    if kind == "hasher":
        algo = draw(
            mostly(
                st.sampled_from(["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]),
                st.one_of(
                    h.str_subclasses(st.sampled_from(["sha256", "xxhash"])),
                    h.wrong_types(),
                    h.non_encodable_strings(),
                ),
            )
        )
        # A seed of None is random for the xxhash algorithms: only with plain sha256.
        seeds = st.one_of(
            st.sampled_from(["0", "", "vllm-none-hash"]),
            h.str_subclasses(st.just("0")),
            h.non_encodable_strings(),
            h.wrong_types().filter(lambda v: v is not None),
        )
        if algo in ("sha256", "sha256_cbor"):
            seeds = st.one_of(seeds, st.none())
        hasher = step("mod.BlockHasher", draw(sizes()), algo, draw(seeds))
        return hasher
    if kind == "block":
        return step(
            "mod.KVCacheBlock",
            draw(ints(0, 3)),
            draw(ints(0, 3)),
            draw(st.one_of(st.none(), hashes())),
            draw(st.one_of(st.none(), ints(0, 3))),
            draw(flags()),
        )
    if kind == "stats":
        return step(
            "mod.PrefixCacheStats",
            draw(ints(0, 3)),
            draw(ints(0, 3)),
            draw(ints(0, 3)),
            draw(flags()),
        )
    int_list = item_lists(ints(0, 3), 3)
    if kind == "rollback_result":
        # Now and then the total's __index__ changes a list read before or after it.
        total = draw(
            mostly(
                ints(0, 3),
                st.sampled_from(["computed", "evict"]).flatmap(
                    lambda name: h.mutators_of(name, st.integers(0, 3))
                ),
            )
        )
        return step(
            "mod.RollbackResult",
            ["named", "computed", draw(int_list)],
            draw(int_list),
            total,
            ["named", "evict", draw(int_list)],
        )
    id_sets = st.lists(request_ids(), max_size=2).map(lambda xs: ["set", xs])
    return step(
        "mod.InvalidBlocksOutcome",
        draw(st.one_of(id_sets, int_list)),
        draw(id_sets),
        draw(id_sets),
        draw(
            st.one_of(int_list, st.lists(st.integers(0, 3), max_size=2).map(lambda xs: ["set", xs]))
        ),
        draw(ints(0, 3)),
    )


# =========================================================================== the tests


@given(program=pool_programs())
def test_block_pool(program: Program) -> None:
    check(program)


@given(program=hasher_programs())
def test_block_hasher(program: Program) -> None:
    check(program)


@given(program=request_programs())
def test_request(program: Program) -> None:
    check(program)


@given(program=several_bad_extras_programs())
def test_several_bad_extras(program: Program) -> None:
    check(program)


@given(program=manager_programs())
def test_kv_cache_manager(program: Program) -> None:
    check(program)


@given(program=rollback_programs())
def test_rollback(program: Program) -> None:
    check(program)


@given(program=st.lists(one_fault(constructor_steps()), min_size=1, max_size=3))
def test_constructors_and_value_classes(program: Program) -> None:
    check(program)


def test_the_child_reports_crashes_and_hangs() -> None:
    """The isolation itself: an abort and a hang in the child are reports, not a dead run,
    and the next program gets a fresh child."""
    aborted = _WORKER.run([step("ctx.abort")])
    assert aborted["crash"].startswith("crash"), aborted
    hung = _WORKER.run([step("ctx.sleep", 30, timeout=0.5)])
    assert hung["crash"].startswith("hang"), hung
    assert "sleep" in hung["stderr"]  # the watchdog's traceback shows where it hung
    fine = _WORKER.run([step("mod.BlockPool", 4, save="pool"), step("pool.get_new_blocks", 2)])
    assert fine == {"divergences": [], "messages": [], "steps": 2}


def test_a_different_message_fails_the_program() -> None:
    with pytest.raises(pytest.fail.Exception, match="raised by"):
        check([step("ctx.own_message")])
