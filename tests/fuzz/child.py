"""The lockstep engine of the differential fuzzer, run in a child process.

``tests/fuzz/test_fuzz.py`` draws *programs* (lists of JSON steps whose arguments are
``tests/fuzz/hostile.py`` recipes) and sends them to this process, one JSON line each; it
answers one JSON line per program. A backend that aborts, segfaults or hangs kills only
this process: the parent sees the pipe close (or time out) and reports the program as the
reproducer. A per-step ``faulthandler`` watchdog turns a hang into an exit with every
thread's traceback on stderr, and an address-space limit turns a runaway allocation of the
reference into a ``MemoryError``.

Each step runs on the reference (side 0) and on the native backend (side 1), each with its
own objects and freshly built arguments. After every step the engine compares the
outcomes (result normalised to plain values, or exact exception class and message),
the whole observable state of both sides, and, for a side that raised, its state before
and after the call: a call that raises must change nothing.

Step: ``{"op": "target.name", "args": [recipe...], "kwargs": [[name, recipe]...]}`` plus
optional ``"save"`` (where the result goes) and ``"hold"`` / ``"advance"`` (bookkeeping
after success). Targets: ``mod`` (the backend module), ``ctx`` (test doubles), ``pool``,
``mgr``, ``hasher``, ``req`` (``"index"`` picks the request). ``name`` may be ``@attr``
(read an attribute) or ``=attr`` (assign ``args[0]``).

Usage: ``python tests/fuzz/child.py`` serves programs on stdin; ``python
tests/fuzz/child.py --replay PROGRAM.json`` (or ``-`` for stdin) runs one program and
prints its report, exiting 1 on a divergence or a different message.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

from kvblocks import reference

# Run as a script, this file has only its own folder on the path: put tests/ first, where
# ``fuzz`` is this package and ``support`` (the shared test doubles) lives.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import FakeManager, Req

from fuzz import hostile
from fuzz.hostile import Recipe, build, build_all, builder, render

#: Seconds one step (call plus snapshots) may take before it counts as a hang.
STEP_TIMEOUT = float(os.environ.get("KVBLOCKS_FUZZ_STEP_TIMEOUT", "10"))

#: Address-space limit of this process, so that a runaway allocation fails fast.
MEMORY_LIMIT = 6 * 2**30

#: Hashes looked up in every snapshot (the fuzzer's hashes are drawn from these).
PROBE_HASHES = [b"\x01" * 32, b"\x02" * 32, b"\x03" * 16, b"", b"\x05" * 7]

#: `` at 0x7f...`` in a default ``repr``: normalised out of error messages.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

#: Outcome: ``["ok", plain result]`` or ``["error", class name, message]``.
Outcome = list[Any]


def _type_name(value: object) -> str:
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def outcome(call: Callable[[], Any]) -> Outcome:
    """What ``call()`` did, as JSON-able data (``BaseException``: PyO3 panics are one)."""
    try:
        return ["ok", plain(call())]
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the point is to compare whatever is raised
        try:
            message = str(exc)
        except Exception:  # a hostile object's message may not render
            message = "<unprintable>"
        # Each side builds its own objects: a repr's address names no difference.
        return ["error", _type_name(exc), _ADDRESS.sub(" at 0x?", message)]


def plain(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON data that compares equal exactly when the values agree,
    including the exact type of scalars (a ``str`` subclass is not a ``str``)."""
    if depth > 20:
        return ["deep"]
    cls = type(value)
    if value is None or cls is bool:
        return value
    if cls is int:
        return value if abs(value) < 2**53 else ["int", str(value)]
    if cls is float:
        return ["float", repr(value)] if not math.isnan(value) else ["float", "nan"]
    if cls is str:
        return value
    if cls is bytes:
        return ["bytes", value.hex()]
    if isinstance(value, int | str | bytes):  # subclasses: keep the type visible
        return [_type_name(value), plain(cls.__mro__[-2](value))]
    if cls in (list, tuple):
        return [cls.__name__, [plain(v, depth + 1) for v in value]]
    if cls in (set, frozenset):
        items = [plain(v, depth + 1) for v in value]
        return ["set", sorted(items, key=lambda x: json.dumps(x, sort_keys=True))]
    if cls is dict:
        pairs = [[plain(k, depth + 1), plain(v, depth + 1)] for k, v in value.items()]
        return ["dict", pairs]
    name = cls.__name__
    fields = _VALUE_FIELDS.get(name)
    if fields is not None:
        return [name, {f: plain(getattr(value, f), depth + 1) for f in fields}]
    if name == "Request":
        return ["Request", request_snapshot(value)]
    if hasattr(value, "__struct_fields__"):  # a kvblocks.events msgspec struct
        return [name, {f: plain(getattr(value, f), depth + 1) for f in value.__struct_fields__}]
    return ["object", name]


#: The public fields of the backends' value classes: the reference's dataclass fields,
#: and the scalar properties of the stateful classes.
_VALUE_FIELDS = {
    **{
        name: [field.name for field in dataclasses.fields(getattr(reference, name))]
        for name in ("KVCacheBlock", "PrefixCacheStats", "RollbackResult", "InvalidBlocksOutcome")
    },
    "BlockPool": ["num_blocks", "enable_caching", "block_size"],
    "KVCacheManager": ["block_size", "num_kv_cache_groups", "enable_caching"],
    "BlockHasher": ["block_size", "algo", "seed", "none_hash"],
    "Req": ["request_id", "num_computed_tokens"],
}


def _read(call: Callable[[], Any]) -> Any:
    """A snapshot field: the plain value, or the error class (messages are compared
    only for the step's own call)."""
    result = outcome(call)
    return result[1] if result[0] == "ok" else ["raised", result[1]]


# --------------------------------------------------------------------------- snapshots


def pool_snapshot(pool: Any) -> dict[str, Any]:
    """Everything a pool shows: free queue, every block, counts, invariants, lookups."""
    num_blocks = pool.num_blocks
    return {
        "config": [num_blocks, _read(lambda: pool.enable_caching), _read(lambda: pool.block_size)],
        "invariants": _read(pool.check_invariants),
        "free_queue": _read(pool.free_block_ids),
        "num_free": _read(pool.get_num_free_blocks),
        "usage": _read(pool.get_usage),
        "blocks": [_read(partial(pool.get_block, i)) for i in range(min(num_blocks, 64))],
        "lookups": [
            _read(partial(pool.get_cached_block, h, g))
            for h in PROBE_HASHES
            for g in ([0], [1], [0, 1])
        ],
    }


def request_snapshot(request: Any) -> dict[str, Any]:
    """Every public field of a backend ``Request``."""
    names = [
        "request_id",
        "prompt_token_ids",
        "all_token_ids",
        "output_token_ids",
        "block_hashes",
        "num_tokens",
        "num_prompt_tokens",
        "num_output_tokens",
        "num_computed_tokens",
        "cache_salt",
        "lora_request",
        "mm_features",
        "prompt_embeds",
    ]
    return {name: _read(partial(getattr, request, name)) for name in names}


def _rb_fields(request: Any) -> tuple[Any, Any]:
    return request.request_id, request.num_computed_tokens


# --------------------------------------------------------------------------- a side


class Side:
    """One backend's objects in a program, and the re-entry point of hostile callbacks."""

    def __init__(self, name: str, module: ModuleType) -> None:
        self.name = name
        self.module = module
        self.pool: Any = None
        self.mgr: Any = None
        self.hasher: Any = None
        self.fake: Any = None
        #: Block tables held on ``pool`` (one reference per entry).
        self.tables: list[list[int]] = []
        self.requests: list[Any] = []
        self.rb_requests: list[Any] = []
        #: The last ``get_computed_blocks`` result, for the next ``allocate_slots``.
        self.hits: list[Any] = [[], 0]
        #: Exact-str request ids seen, whose manager block tables the snapshot reads.
        self.request_ids: list[str] = []
        #: The current call's named arguments (``hostile`` ``named``/``mutator_of``).
        self.names: dict[str, Any] = {}
        self.depth = 0

    # ------------------------------------------------------------------ steps

    def target(self, step: dict[str, Any]) -> Any:
        name = step["op"].split(".", 1)[0]
        if name == "mod":
            return self.module
        if name == "ctx":
            return _Context(self)
        if name == "req":
            return self.request(step.get("index", 0))
        return getattr(self, name)

    def request(self, index: int) -> Any:
        return self.requests[index % len(self.requests)] if self.requests else None

    def perform(self, step: dict[str, Any]) -> Any:
        """Runs one step on this side and does its bookkeeping; returns the result."""
        target = self.target(step)
        name = step["op"].split(".", 1)[1]
        # A fresh registry per call (rebound, so that a re-entrant call does not clear
        # the one its caller's arguments refer to).
        self.names = {}
        args = build_all(step.get("args", []), self)
        kwargs = {k: build(v, self) for k, v in step.get("kwargs", [])}
        if name.startswith("@"):
            result = getattr(target, name[1:])
        elif name.startswith("="):
            setattr(target, name[1:], args[0])
            result = None
        else:
            result = getattr(target, name)(*args, **kwargs)
        self.bookkeeping(step, result, args)
        return result

    def bookkeeping(self, step: dict[str, Any], result: Any, args: list[Any]) -> None:
        save = step.get("save")
        if save == "table":
            self.tables.append(list(result))
        elif save == "request":
            self.requests.append(result)
            self.note_id(result.request_id)
        elif save == "rb_request":
            self.rb_requests.append(result)
        elif save == "hits":
            self.hits = [list(result[0]), result[1]]
        elif save in ("pool", "mgr", "hasher", "fake"):
            setattr(self, save, result)
        if step.get("hold") is not None:
            self.tables.append(list(self.table(step["hold"])))
        if step.get("advance") is not None:
            request = self.request(step["advance"])
            if result is not None and request is not None:
                request.num_computed_tokens = request.num_tokens

    def note_id(self, request_id: object) -> None:
        """Remembers an id whose block table the snapshot reads: only ids a manager can
        hold (an exact ``str`` that encodes as UTF-8; any other is refused on entry)."""
        if type(request_id) is not str or request_id in self.request_ids:
            return
        try:
            request_id.encode("utf-8")
        except UnicodeEncodeError:
            return
        self.request_ids.append(request_id)

    def table(self, index: int) -> list[int]:
        return self.tables[index % len(self.tables)] if self.tables else []

    def reenter(self, call: Recipe) -> Any:
        """A hostile callback's call back into this side (bounded recursion)."""
        if self.depth > 2:
            raise hostile.HostileError("re-entered too deeply")
        self.depth += 1
        try:
            return self.perform(call)
        finally:
            self.depth -= 1

    # ------------------------------------------------------------------ state

    def snapshot(self) -> dict[str, Any]:
        """The side's whole observable state. Drains the manager's stats and events:
        ``stats`` and ``events`` are what happened since the last snapshot."""
        snap: dict[str, Any] = {
            "tables": [list(t) for t in self.tables],
            "hits": plain(self.hits),
            "requests": [request_snapshot(r) for r in self.requests],
            "rb_requests": [_read(partial(_rb_fields, r)) for r in self.rb_requests],
        }
        if self.pool is not None:
            snap["pool"] = pool_snapshot(self.pool)
        if self.hasher is not None:
            snap["hasher"] = plain(self.hasher)
        if self.fake is not None:
            snap["fake"] = plain([self.fake.tables, self.fake.evict_calls])
        mgr = self.mgr
        if mgr is not None:
            snap["mgr"] = {
                "pool": pool_snapshot(mgr.block_pool),
                "config": plain(mgr),
                "usage": _read(lambda: mgr.usage),
                "tables": [_read(partial(mgr.get_block_ids, r)) for r in self.request_ids],
                "stats": _read(mgr.make_prefix_cache_stats),
                "events": _read(mgr.take_events),
            }
        return snap


class _Context:
    """``ctx.*`` steps: the test doubles the rollback entry points take."""

    def __init__(self, side: Side) -> None:
        self.side = side

    def fake_manager(
        self, tables: dict[str, list[int]], block_size: int, groups: int, num_blocks: int | None
    ) -> FakeManager:
        return FakeManager(dict(tables), block_size, groups, [], num_blocks)

    def abort(self) -> None:
        """Kills the process as a native crash would (the isolation's self-test)."""
        os.abort()

    def sleep(self, seconds: float) -> None:
        """Hangs (the isolation's self-test)."""
        time.sleep(seconds)

    def own_message(self) -> None:
        """Raises one class with a message naming the backend (the message check's
        self-test)."""
        raise ValueError(f"raised by {self.side.name}")

    def rb_request(self, request_id: str, num_computed_tokens: int) -> Req:
        self.side.note_id(request_id)
        return Req(request_id, num_computed_tokens)


# --------------------------------------------------------------------------- context recipes


def _side(side: hostile.Side) -> Side:
    assert isinstance(side, Side)
    return side


@builder("table")
def _build_table(params: list[Any], side: hostile.Side) -> Any:
    """``["table", k, take, form]``: table ``k`` of the pool (popped when ``take``), in
    ``form``, a recipe template whose ``"$ids"`` stands for the ids."""
    s = _side(side)
    index, take, form = params
    ids = s.tables.pop(index % len(s.tables)) if take and s.tables else list(s.table(index))
    return build(_substitute(form, ids), side)


@builder("via")
def _build_via(params: list[Any], side: hostile.Side) -> Any:
    """``["via", source, form]``: the items ``source`` builds, in ``form`` (as ``table``)."""
    source, form = params
    values = build(source, side)
    items = list(values) if isinstance(values, list | tuple) else []
    return build(_substitute(form, items), side)


@builder("req_attr")
def _build_req_attr(params: list[Any], side: hostile.Side) -> Any:
    """``["req_attr", k, name, delta]``: attribute ``name`` of request ``k`` (plus
    ``delta`` for an int), copied."""
    index, name, delta = params
    request = _side(side).request(index)
    if request is None:
        return [] if name in ("block_hashes", "all_token_ids") else 0
    value = getattr(request, name)
    return list(value) if isinstance(value, list) else value + delta


def _substitute(template: Recipe, items: list[Any]) -> Recipe:
    """``template`` with ``"$ids"`` replaced by the already built ``items``."""
    if template == "$ids":
        return [["literal", item] for item in items]
    if isinstance(template, list):
        return [_substitute(t, items) for t in template]
    return template


@builder("req")
def _build_req(params: list[Any], side: hostile.Side) -> Any:
    return _side(side).request(params[0])


@builder("rb_req")
def _build_rb_req(params: list[Any], side: hostile.Side) -> Any:
    s = _side(side)
    return s.rb_requests[params[0] % len(s.rb_requests)] if s.rb_requests else None


@builder("side")
def _build_side_object(params: list[Any], side: hostile.Side) -> Any:
    """``["side", "mgr" | "pool" | "hasher" | "fake"]``: the side's object."""
    return getattr(_side(side), params[0])


@builder("todo")
def _build_todo(params: list[Any], side: hostile.Side) -> Any:
    """Tokens request ``k`` has not computed yet (what the scheduler schedules)."""
    request = _side(side).request(params[0])
    if request is None:
        return 1
    return max(request.num_tokens - request.num_computed_tokens - params[1], 0)


@builder("hit_ids")
def _build_hit_ids(params: list[Any], side: hostile.Side) -> Any:
    return list(_side(side).hits[0])


@builder("hit_tokens")
def _build_hit_tokens(params: list[Any], side: hostile.Side) -> Any:
    return _side(side).hits[1]


@builder("duck_of")
def _build_duck_of(params: list[Any], side: hostile.Side) -> Any:
    """``["duck_of", k, fixed, changing]``: a duck copy of request ``k`` (its attributes
    as plain values) with some attributes replaced (``fixed``) or changing on every read
    (``changing``), as in a ``duck`` recipe."""
    index, fixed, changing = params
    request = _side(side).request(index)
    base: list[Any] = []
    if request is not None:
        for name in [
            "request_id",
            "num_tokens",
            "num_computed_tokens",
            "all_token_ids",
            "block_hashes",
            "lora_request",
            "cache_salt",
            "mm_features",
            "prompt_embeds",
        ]:
            value = getattr(request, name)
            base.append([name, ["literal", list(value) if isinstance(value, list) else value]])
    replaced = {name for name, _ in fixed} | {name for name, _ in changing}
    base = [entry for entry in base if entry[0] not in replaced]
    duck = build(["duck", [*base, *fixed], changing], side)
    _side(side).note_id(vars(duck).get("request_id"))
    return duck


@builder("literal")
def _build_literal(params: list[Any], side: hostile.Side) -> Any:
    """An already built value (used inside ``duck_of``)."""
    return params[0]


# --------------------------------------------------------------------------- the program


def run_program(program: list[dict[str, Any]], trace: bool = False) -> dict[str, Any]:
    """Runs ``program`` on both backends in lockstep; returns the report.

    The report's ``divergences`` lists the first step on which the backends disagree
    (the run stops there: later steps would compare diverged states) and ``messages``
    every step where both raised the same class with different messages.
    """
    import kvblocks  # noqa: PLC0415 (imported in the child only, after its limits are set)

    sides = [Side(name, kvblocks.load_backend(name)) for name in ("python", "rust")]
    report: dict[str, Any] = {"divergences": [], "messages": [], "steps": 0}
    if trace:
        report["trace"] = []
    for number, step in enumerate(program):
        faulthandler.dump_traceback_later(step.get("timeout", STEP_TIMEOUT), exit=True)
        try:
            problems = run_step(sides, step, number, report)
        finally:
            faulthandler.cancel_dump_traceback_later()
        report["steps"] = number + 1
        if problems:
            report["divergences"] = problems
            break
    return report


def run_step(
    sides: list[Side], step: dict[str, Any], number: int, report: dict[str, Any]
) -> list[dict[str, Any]]:
    """One step on both sides; the divergences it shows."""
    before = [s.snapshot() for s in sides]
    results = [outcome(partial(s.perform, step)) for s in sides]
    after = [s.snapshot() for s in sides]
    where = {"step": number, "call": render_step(step)}
    problems: list[dict[str, Any]] = []
    ref, nat = results
    if "trace" in report:
        report["trace"].append({**where, "python": ref, "rust": nat})
    if ref[0] != nat[0] or ref[1] != nat[1]:
        problems.append({**where, "kind": "outcome", "python": ref, "rust": nat})
    elif ref[0] == "error" and ref[2] != nat[2]:
        report["messages"].append({**where, "class": ref[1], "python": ref[2], "rust": nat[2]})
    diff = first_difference(after[0], after[1])
    if diff is not None:
        problems.append(
            {**where, "kind": "state", "path": diff[0], "python": diff[1], "rust": diff[2]}
        )
    for side, result, pre, post in zip(sides, results, before, after, strict=True):
        if result[0] != "error":
            continue
        changed = changed_on_error(pre, post)
        if changed is not None:
            problems.append(
                {
                    **where,
                    "kind": "changed on error",
                    "backend": side.name,
                    "error": result,
                    "path": changed[0],
                    "before": changed[1],
                    "after": changed[2],
                }
            )
    return problems


#: A manager's answer for a request it holds no blocks for, as the snapshot records it.
NO_TABLE = ["tuple", [["list", []]]]


def changed_on_error(pre: dict[str, Any], post: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first change a failed call made (stats and events: any at all)."""
    # The harness's own record of held tables is popped while arguments are built,
    # whatever the call then does: not the backend's state.
    post = {k: v for k, v in post.items() if k != "tables"}
    pre = {k: v for k, v in pre.items() if k != "tables"}
    if "mgr" in post:
        pm, qm = dict(pre["mgr"]), dict(post["mgr"])
        for key, empty in (
            (
                "stats",
                [
                    None,
                    ["PrefixCacheStats", {"requests": 0, "queries": 0, "hits": 0, "reset": False}],
                ],
            ),
            ("events", [["list", []]]),
        ):
            if qm[key] not in empty:
                return f"mgr.{key}", None, qm[key]
            pm.pop(key)
            qm.pop(key)
        # Ids first seen while this call's arguments were built have no table before:
        # after a failed call they must still hold none.
        known = len(pm["tables"])
        for i, table in enumerate(qm["tables"][known:], known):
            if table != NO_TABLE:
                return f"mgr.tables[{i}]", NO_TABLE, table
        qm["tables"] = qm["tables"][:known]
        pre["mgr"], post["mgr"] = pm, qm
    return first_difference(pre, post)


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first path where two snapshots differ, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = first_difference(a.get(key), b.get(key), f"{path}.{key}")
            if found is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    return None if a == b else (path, a, b)


def render_step(step: dict[str, Any]) -> str:
    """A step as Python-ish source, for reports."""
    args = [render(a) for a in step.get("args", [])]
    args += [f"{k}={render(v)}" for k, v in step.get("kwargs", [])]
    op = str(step["op"])
    if step.get("index") is not None:
        op = op.replace("req.", f"req[{step['index']}].")
    extra = "".join(
        f"  # {k}={step[k]}" for k in ("save", "hold", "advance") if step.get(k) is not None
    )
    if ".@" in op:
        return op.replace("@", "") + extra
    if ".=" in op:
        return f"{op.replace('=', '')} = {args[0]}{extra}"
    return f"{op}({', '.join(args)}){extra}"


# --------------------------------------------------------------------------- main


def _limit_memory() -> None:
    try:
        import resource  # noqa: PLC0415 (POSIX only)

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    except (ImportError, ValueError, OSError):  # not on this platform: best effort
        pass


def serve() -> None:
    """Answers one JSON report line per JSON program line on stdin."""
    for line in sys.stdin:
        if not line.strip():
            continue
        report = run_program(json.loads(line))
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()


def main(argv: list[str]) -> int:
    """``serve`` (no arguments) or ``--replay FILE|-``."""
    _limit_memory()
    faulthandler.enable()
    if len(argv) >= 2 and argv[0] == "--replay":
        text = sys.stdin.read() if argv[1] == "-" else Path(argv[1]).read_text()
        program = json.loads(text)
        for step in program:
            print(render_step(step))
        report = run_program(program, trace=True)
        print(json.dumps(report, indent=1))
        return 1 if report["divergences"] or report["messages"] else 0
    serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
