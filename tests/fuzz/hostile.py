"""Hostile values for the differential fuzzer (``tests/fuzz/test_fuzz.py``), as recipes.

A *recipe* is plain JSON data that describes a value; :func:`build` turns it into the
value. The fuzzer draws recipes (never the objects themselves) because:

* each backend must get its *own* fresh object: a one-shot iterator consumed by one
  backend, or a property that changes on every read, would otherwise leak state from one
  backend's call into the other's;
* a recipe is printable and JSON-serialisable, so a failing case can be replayed in a
  child process (``tests/fuzz/child.py``) and pasted into a bug report as is.

Recipe grammar: a JSON scalar (``int`` of any size, ``float``, ``str`` - lone surrogates
included, JSON escapes them -, ``bool``, ``null``) stands for itself; every other value is
a list ``[tag, *params]``, e.g. ``["list", [1, 2]]`` or ``["oneshot", [1, 2]]``. Each tag
has one builder below and one strategy drawing recipes with it: one concept each (wrong
types, lying lengths, raising iterables, subclasses with lying dunders, ...). Recipes
that call back into the backend under test (``reentrant_*``) get it from the
:class:`Side` they are built for.

Importing this module needs neither backend; NumPy recipes are drawn only when NumPy is
installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import operator
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from types import SimpleNamespace
from typing import Any, Protocol, TypeAlias

from hypothesis import strategies as st

#: A JSON value describing a value to build (see the module docstring).
Recipe: TypeAlias = Any

#: Whether NumPy recipes can be built here.
HAVE_NUMPY = importlib.util.find_spec("numpy") is not None


class HostileError(Exception):
    """What hostile objects raise: a class no backend raises on its own, so that a
    backend swallowing or replacing it shows up as an error-class difference."""


class Side(Protocol):
    """The backend a value is built for, as re-entrant recipes need it."""

    #: Values of the call being built, by name (``["named", ...]``), for recipes that
    #: change another argument of the same call (``["mutator_of", ...]``).
    names: dict[str, Any]

    def reenter(self, call: Recipe) -> Any:
        """Performs ``call`` (a fuzz step, see ``tests/fuzz/child.py``) on this backend."""
        ...


class _NoSide:
    def __init__(self) -> None:
        self.names: dict[str, Any] = {}

    def reenter(self, call: Recipe) -> Any:
        raise HostileError(f"no backend to re-enter for {call!r}")


NO_SIDE: Side = _NoSide()


# --------------------------------------------------------------------------- building

_Builder = Callable[[list[Any], Side], Any]
_BUILDERS: dict[str, _Builder] = {}


def builder(tag: str) -> Callable[[_Builder], _Builder]:
    """Registers the builder of recipes tagged ``tag`` (``fn(params, side)``)."""

    def register(fn: _Builder) -> _Builder:
        _BUILDERS[tag] = fn
        return fn

    return register


def build(recipe: Recipe, side: Side = NO_SIDE) -> Any:
    """The value ``recipe`` describes, freshly built for ``side``.

    Raises:
        ValueError: Unknown tag (a bug in the fuzzer, not in a backend).
    """
    if not isinstance(recipe, list):
        return recipe
    tag, *params = recipe
    try:
        fn = _BUILDERS[tag]
    except KeyError:
        raise ValueError(f"unknown recipe tag {tag!r}") from None
    return fn(params, side)


def build_all(recipes: Sequence[Recipe], side: Side) -> list[Any]:
    """``[build(r, side) for r in recipes]``."""
    return [build(r, side) for r in recipes]


def render(recipe: Recipe) -> str:
    """Python-ish source for a recipe, for the reproducers printed on failure."""
    if not isinstance(recipe, list):
        return repr(recipe)
    if not recipe or not isinstance(recipe[0], str):  # a list of parameters
        return "[" + ", ".join(render(r) for r in recipe) + "]"
    tag, *params = recipe
    if tag == "h":
        return render(params[0])
    if not isinstance(params[0] if params else None, list) and tag in ("list", "tuple"):
        return f"{tag}({render(params[0])})"
    if tag == "list":
        return "[" + ", ".join(render(r) for r in params[0]) + "]"
    if tag == "tuple":
        inner = ", ".join(render(r) for r in params[0])
        return f"({inner},)" if len(params[0]) == 1 else f"({inner})"
    if tag == "bytes":
        return repr(bytes.fromhex(params[0]))
    return f"{tag}({', '.join(render(p) for p in params)})"


# --------------------------------------------------------------------------- containers


@builder("list")
def _build_list(params: list[Any], side: Side) -> list[Any]:
    return build_all(params[0], side)


@builder("tuple")
def _build_tuple(params: list[Any], side: Side) -> tuple[Any, ...]:
    return tuple(build_all(params[0], side))


@builder("set")
def _build_set(params: list[Any], side: Side) -> set[Any]:
    return set(build_all(params[0], side))


@builder("bytes")
def _build_bytes(params: list[Any], side: Side) -> bytes:
    return bytes.fromhex(params[0])


@builder("bytearray")
def _build_bytearray(params: list[Any], side: Side) -> bytearray:
    return bytearray.fromhex(params[0])


@builder("object")
def _build_object(params: list[Any], side: Side) -> object:
    return object()


@builder("ns")
def _build_namespace(params: list[Any], side: Side) -> SimpleNamespace:
    """A plain attribute bag: ``["ns", [[name, recipe], ...]]`` (LoRA, mm items)."""
    return SimpleNamespace(**{name: build(r, side) for name, r in params[0]})


def bytes_recipe(value: bytes) -> Recipe:
    """The recipe of a ``bytes`` value."""
    return ["bytes", value.hex()]


@builder("h")
def _build_fault(params: list[Any], side: Side) -> Any:
    """``["h", recipe]``: ``recipe``, marked as a fault, so that a fuzzer can keep to one
    fault per call (which of several faults a backend reports first is not specified)."""
    return build(params[0], side)


def fault(recipe: Recipe) -> Recipe:
    """``recipe`` marked as a fault (see ``["h", ...]``)."""
    return ["h", recipe]


def count_faults(recipe: Recipe) -> int:
    """How many fault-marked recipes ``recipe`` (or a step, a dict of them) holds."""
    if isinstance(recipe, dict):
        return sum(count_faults(v) for v in recipe.values())
    if not isinstance(recipe, list):
        return 0
    own = 1 if recipe and recipe[0] == "h" else 0
    return own + sum(count_faults(r) for r in recipe)


# --------------------------------------------------------------------------- wrong types


@cache
def wrong_types() -> st.SearchStrategy[Recipe]:
    """Values of a type no argument of the API takes where an int, id or hash is due."""
    return st.sampled_from(
        [None, 1.5, 2.0, float("nan"), "1", "", ["bytes", "01"], ["object"], ["list", []]]
    )


# --------------------------------------------------------------------------- huge ints


#: Ints at and past every width a backend might convert to, and negatives.
HUGE_INTS = [
    -1,
    -(2**31),
    -(2**63),
    -(2**63) - 1,
    2**31,
    2**32 - 3,
    2**32 - 2,
    2**32,
    2**40,
    2**62,
    2**63 - 1,
    2**63,
    2**64,
    2**100,
]


@cache
def huge_ints() -> st.SearchStrategy[Recipe]:
    """Ints beyond 64 bits, at the edges of i32/u32/i64/u64, and negative ones."""
    return st.sampled_from(HUGE_INTS)


# --------------------------------------------------------------------------- subclasses

#: The dunder overrides of the int/str/bytes subclasses, by flavour.
SUBCLASS_FLAVOURS = ["plain", "hash_raises", "hash_lies", "eq_lies", "eq_raises", "index_lies"]


def _raise(*_: object) -> Any:
    raise HostileError("hostile dunder")


def _make_subclass(base: type, flavour: str) -> type:
    namespace: dict[str, Any] = {"__module__": __name__}
    if flavour == "hash_raises":
        namespace["__hash__"] = _raise
    elif flavour == "hash_lies":
        namespace["__hash__"] = lambda self: 7
    elif flavour == "eq_lies":
        # Equal to everything, hashing as the base value would: dict lookups still find it.
        namespace["__eq__"] = lambda self, other: True
        namespace["__hash__"] = base.__hash__
    elif flavour == "eq_raises":
        namespace["__eq__"] = _raise
        namespace["__hash__"] = base.__hash__
    elif flavour == "index_lies":
        if base is int:
            namespace["__index__"] = lambda self: int(self) + 1
            namespace["__int__"] = lambda self: int.__int__(self) + 1
        else:
            namespace["__len__"] = lambda self: len(base(self)) + 1
    elif flavour != "plain":
        raise ValueError(f"unknown subclass flavour {flavour!r}")
    return type(f"{base.__name__.capitalize()}_{flavour}", (base,), namespace)


_SUBCLASSES: dict[tuple[type, str], type] = {
    (base, flavour): _make_subclass(base, flavour)
    for base in (int, str, bytes)
    for flavour in SUBCLASS_FLAVOURS
}


@builder("int_sub")
def _build_int_sub(params: list[Any], side: Side) -> int:
    value, flavour = params
    made: int = _SUBCLASSES[int, flavour](value)
    return made


@builder("str_sub")
def _build_str_sub(params: list[Any], side: Side) -> str:
    value, flavour = params
    made: str = _SUBCLASSES[str, flavour](value)
    return made


@builder("bytes_sub")
def _build_bytes_sub(params: list[Any], side: Side) -> bytes:
    value, flavour = params
    made: bytes = _SUBCLASSES[bytes, flavour](bytes.fromhex(value))
    return made


def int_subclasses(values: st.SearchStrategy[int]) -> st.SearchStrategy[Recipe]:
    """``int`` subclasses whose ``__hash__``/``__eq__``/``__index__``/``__int__`` raise or lie."""
    return st.builds(lambda v, f: ["int_sub", v, f], values, st.sampled_from(SUBCLASS_FLAVOURS))


def str_subclasses(values: st.SearchStrategy[str]) -> st.SearchStrategy[Recipe]:
    """``str`` subclasses (request ids, seeds, algo names) with hostile dunders."""
    return st.builds(lambda v, f: ["str_sub", v, f], values, st.sampled_from(SUBCLASS_FLAVOURS))


def bytes_subclasses(values: st.SearchStrategy[bytes]) -> st.SearchStrategy[Recipe]:
    """``bytes`` subclasses (block hashes, parents) with hostile dunders."""
    return st.builds(
        lambda v, f: ["bytes_sub", v.hex(), f], values, st.sampled_from(SUBCLASS_FLAVOURS)
    )


# --------------------------------------------------------------------------- __index__ objects


class _Indexable:
    """Not an int, but ``operator.index`` accepts it: returns ``values`` in turn."""

    def __init__(self, values: list[Any]) -> None:
        self._values = itertools.cycle(values)

    def __index__(self) -> int:
        value = next(self._values)
        if value == "raise":
            raise HostileError("__index__ raised")
        result: int = value
        return result

    def __repr__(self) -> str:
        return "Indexable()"


@builder("indexable")
def _build_indexable(params: list[Any], side: Side) -> _Indexable:
    return _Indexable(params[0])


def index_objects(values: st.SearchStrategy[int]) -> st.SearchStrategy[Recipe]:
    """Objects with ``__index__``: honest, raising, returning a non-int, or changing value
    on every call (so a backend reading it twice sees two values)."""
    return st.one_of(
        values.map(lambda v: ["indexable", [v]]),
        st.just(["indexable", ["raise"]]),
        st.just(["indexable", [1.5]]),
        values.map(lambda v: ["indexable", [v, v + 1]]),
    )


# --------------------------------------------------------------------------- iterables


class _LyingLength:
    """A sequence of ``items`` whose ``__len__`` claims ``claimed``."""

    def __init__(self, items: list[Any], claimed: int) -> None:
        self._items = items
        self._claimed = claimed

    def __len__(self) -> int:
        return self._claimed

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)


class _LyingHint:
    """An iterator over ``items`` whose ``__length_hint__`` returns ``hint`` (raises for
    ``"raise"``)."""

    def __init__(self, items: list[Any], hint: Any) -> None:
        self._it = iter(items)
        self._hint = hint

    def __iter__(self) -> _LyingHint:
        return self

    def __next__(self) -> Any:
        return next(self._it)

    def __length_hint__(self) -> int:
        if self._hint == "raise":
            raise HostileError("__length_hint__ raised")
        hint: int = self._hint
        return hint


def _raising_gen(items: list[Any], after: int) -> Iterator[Any]:
    yield from items[:after]
    raise HostileError(f"iterable raised after {after} items")


class _Disagreeing:
    """A sequence whose iteration and indexing disagree: ``list(x)`` gives ``iterated``,
    ``len(x)`` and ``x[i]`` give ``indexed``."""

    def __init__(self, iterated: list[Any], indexed: list[Any]) -> None:
        self._iterated = iterated
        self._indexed = indexed

    def __len__(self) -> int:
        return len(self._indexed)

    def __getitem__(self, index: Any) -> Any:
        return self._indexed[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._iterated)


@builder("oneshot")
def _build_oneshot(params: list[Any], side: Side) -> Iterator[Any]:
    return iter(build_all(params[0], side))


@builder("raising_iter")
def _build_raising_iter(params: list[Any], side: Side) -> Iterator[Any]:
    return _raising_gen(build_all(params[0], side), params[1])


@builder("lying_len")
def _build_lying_len(params: list[Any], side: Side) -> _LyingLength:
    return _LyingLength(build_all(params[0], side), params[1])


@builder("lying_hint")
def _build_lying_hint(params: list[Any], side: Side) -> _LyingHint:
    return _LyingHint(build_all(params[0], side), params[1])


@builder("disagreeing")
def _build_disagreeing(params: list[Any], side: Side) -> _Disagreeing:
    return _Disagreeing(build_all(params[0], side), build_all(params[1], side))


def _count(items: Recipe) -> int:
    """How many items a list recipe has (2 for a template placeholder such as ``"$ids"``,
    whose items are only known when the value is built)."""
    return len(items) if isinstance(items, list) else 2


#: Lengths a lying ``__len__`` / ``__length_hint__`` claims: huge, and negative.
LYING_LENGTHS = [0, 1, 7, 2**31, 10**11, 2**40, 2**62, 2**63 - 1, -1]

#: What a lying ``__length_hint__`` may also do: claim past 64 bits, return a non-int,
#: raise (``list()`` would fail on each; a reader must not ask).
LYING_HINTS = [*LYING_LENGTHS, 2**63, 2**100, 1.5, "raise"]


def one_shot_iterables(items: Recipe) -> st.SearchStrategy[Recipe]:
    """An iterator over ``items``, where a re-iterable list is expected."""
    return st.just(["oneshot", items])


def raising_iterables(items: Recipe) -> st.SearchStrategy[Recipe]:
    """A generator yielding some of ``items``, then raising :class:`HostileError`."""
    return st.integers(0, _count(items)).map(lambda k: ["raising_iter", items, k])


def lying_lengths(items: Recipe) -> st.SearchStrategy[Recipe]:
    """A sequence of ``items`` whose ``__len__`` lies (huge, negative, off by some)."""
    return st.sampled_from([*LYING_LENGTHS, _count(items) + 1]).map(
        lambda n: ["lying_len", items, n]
    )


def lying_hints(items: Recipe) -> st.SearchStrategy[Recipe]:
    """An iterator over ``items`` whose ``__length_hint__`` lies: huge, past 64 bits,
    negative, off by one, not an int, or raising."""
    return st.sampled_from([*LYING_HINTS, _count(items) + 1]).map(
        lambda n: ["lying_hint", items, n]
    )


# --------------------------------------------------------------------------- changing lists

#: How a list changes while it is read: what the hook does to it.
CHANGES = ["grow", "shrink", "replace"]

#: What a growing list appends, or a replacing one writes: a copy of its first item (a
#: valid value, so reading it shows in the result) or a string (reading it fails).
PAYLOADS = ["dup", "bad"]


def _change(target: Any, change: str, payload: str) -> None:
    """Applies ``change`` to the list ``target`` (nothing for any other value)."""
    if not isinstance(target, list):
        return
    extra = (target[0] if target else 0) if payload == "dup" else "bad"
    extra = extra.value if isinstance(extra, _Mutator) else extra
    if change == "grow":
        target.append(extra)
    elif change == "shrink" and target:
        del target[-1]
    elif change == "replace" and target:
        target[-1] = extra


class _Mutator:
    """An item standing for ``value`` whose ``__index__`` first changes a list: the one it
    sits in, or another argument of the same call (looked up by name when it runs)."""

    def __init__(self, value: Any, target: Callable[[], Any], change: str, payload: str):
        self.value = value
        self._target = target
        self._change = change
        self._payload = payload

    def __index__(self) -> int:
        _change(self._target(), self._change, self._payload)
        result: int = operator.index(self.value)
        return result

    def __repr__(self) -> str:
        return f"Mutator({self.value!r}, {self._change})"


@builder("mutating")
def _build_mutating(params: list[Any], side: Side) -> list[Any]:
    """``["mutating", items, at, change, payload]``: a list of ``items`` whose item ``at``
    (modulo the length) changes the list when its ``__index__`` runs."""
    items, at, change, payload = params
    made = build_all(items, side)
    if made:
        i = at % len(made)
        made[i] = _Mutator(made[i], lambda: made, change, payload)
    return made


class _ChangingSequence(Sequence[Any]):
    """A registered ``Sequence`` of ``items`` that changes itself on its first read
    (``__len__``, ``__getitem__`` or ``__iter__``): read by index or by ``list()``, a
    reader sees different items."""

    def __init__(self, items: list[Any], change: str, payload: str) -> None:
        self._items = items
        self._pending: tuple[str, str] | None = (change, payload)

    def _read(self) -> list[Any]:
        if self._pending is not None:
            change, payload = self._pending
            self._pending = None
            _change(self._items, change, payload)
        return self._items

    def __len__(self) -> int:
        return len(self._read())

    def __getitem__(self, index: Any) -> Any:
        return self._read()[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._read()))


@builder("changing_seq")
def _build_changing_seq(params: list[Any], side: Side) -> _ChangingSequence:
    items, change, payload = params
    return _ChangingSequence(build_all(items, side), change, payload)


@builder("named")
def _build_named(params: list[Any], side: Side) -> Any:
    """``["named", name, recipe]``: ``recipe``'s value, which ``mutator_of`` can change."""
    name, recipe = params
    value = build(recipe, side)
    side.names[name] = value
    return value


@builder("mutator_of")
def _build_mutator_of(params: list[Any], side: Side) -> _Mutator:
    """``["mutator_of", name, value, change, payload]``: ``value`` as an int-like whose
    ``__index__`` first changes the call's ``named`` list ``name`` (whichever argument is
    read first)."""
    name, value, change, payload = params
    names = side.names
    return _Mutator(build(value, side), lambda: names.get(name), change, payload)


def mutating_lists(items: Recipe) -> st.SearchStrategy[Recipe]:
    """A list of ``items`` one of whose items grows, shrinks or rewrites it from its
    ``__index__`` (a reader converting items from the live list sees the change)."""
    return st.builds(
        lambda at, change, payload: ["mutating", items, at, change, payload],
        st.integers(0, 5),
        st.sampled_from(CHANGES),
        st.sampled_from(PAYLOADS),
    )


def changing_sequences(items: Recipe) -> st.SearchStrategy[Recipe]:
    """A ``Sequence`` of ``items`` that grows, shrinks or rewrites itself when first read
    (read by index, it differs from what ``list()`` gives)."""
    return st.builds(
        lambda change, payload: ["changing_seq", items, change, payload],
        st.sampled_from(CHANGES),
        st.sampled_from(PAYLOADS),
    )


def mutators_of(name: str, values: st.SearchStrategy[Recipe]) -> st.SearchStrategy[Recipe]:
    """Int-likes (from ``values``) whose ``__index__`` changes the call's list ``name``."""
    return st.builds(
        lambda v, change, payload: ["mutator_of", name, v, change, payload],
        values,
        st.sampled_from(CHANGES),
        st.sampled_from(PAYLOADS),
    )


def disagreeing_sequences(
    items: Recipe, other: st.SearchStrategy[list[Recipe]]
) -> st.SearchStrategy[Recipe]:
    """A sequence iterating as ``items`` but indexing (and ``len``) as another list."""
    return other.map(lambda indexed: ["disagreeing", items, indexed])


def numpy_arrays(items: Recipe) -> st.SearchStrategy[Recipe]:
    """NumPy arrays of ``items`` with odd dtypes and layouts (nothing without NumPy).

    Dtypes: int8, uint64, float64, bool, object; layouts: contiguous, non-contiguous
    (every other element of a doubled array), 0-d (first item only), 2-d (one row).
    """
    if not HAVE_NUMPY:
        return st.nothing()
    return st.builds(
        lambda dtype, layout: ["ndarray", items, dtype, layout],
        st.sampled_from(["int64", "int8", "uint64", "float64", "bool", "object"]),
        st.sampled_from(["plain", "strided", "0d", "2d"]),
    )


@builder("ndarray")
def _build_ndarray(params: list[Any], side: Side) -> Any:
    import numpy as np  # noqa: PLC0415 (numpy is optional)

    items, dtype, layout = params
    values = build_all(items, side)
    if layout == "strided":
        doubled = [v for v in values for _ in (0, 1)]
        with np.errstate(all="ignore"):
            return np.array(doubled).astype(dtype)[::2]
    if layout == "0d":
        return np.array(values[0] if values else 0).astype(dtype)
    with np.errstate(all="ignore"):
        array = np.array(values, dtype=object).astype(dtype) if values else np.array([], dtype)
    if layout == "2d":
        return array.reshape(1, -1)
    return array


def iterables_of(items: Recipe) -> st.SearchStrategy[Recipe]:
    """``items`` as a list, tuple, one-shot iterator, raising or lying iterable, or a list
    or sequence that changes itself while it is read."""
    return st.one_of(
        st.just(["list", items]),
        st.just(["tuple", items]),
        one_shot_iterables(items),
        raising_iterables(items),
        lying_lengths(items),
        lying_hints(items),
        mutating_lists(items),
        changing_sequences(items),
    )


def int_iterables(items: Recipe) -> st.SearchStrategy[Recipe]:
    """``items`` in any iterable form above, as a NumPy array too."""
    return st.one_of(iterables_of(items), numpy_arrays(items))


# --------------------------------------------------------------------------- mappings

#: How the dict subclasses misbehave.
DICT_FLAVOURS = [
    "plain",
    "get_lies",
    "get_raises",
    "getitem_lies",
    "getitem_raises",
    "contains_lies",
]


def _make_dict_subclass(flavour: str) -> type:
    namespace: dict[str, Any] = {"__module__": __name__}
    if flavour == "get_lies":
        namespace["get"] = lambda self, key, default=None: 1
    elif flavour == "get_raises":
        namespace["get"] = _raise
    elif flavour == "getitem_lies":
        namespace["__getitem__"] = lambda self, key: 1
    elif flavour == "getitem_raises":
        namespace["__getitem__"] = _raise
    elif flavour == "contains_lies":
        namespace["__contains__"] = lambda self, key: True
    return type(f"Dict_{flavour}", (dict,), namespace)


_DICT_SUBCLASSES = {flavour: _make_dict_subclass(flavour) for flavour in DICT_FLAVOURS}


@builder("dict")
def _build_dict(params: list[Any], side: Side) -> dict[Any, Any]:
    pairs, flavour = params
    made: dict[Any, Any] = _DICT_SUBCLASSES[flavour](
        (build(k, side), build(v, side)) for k, v in pairs
    )
    return made


def dict_subclasses(pairs: list[tuple[Recipe, Recipe]]) -> st.SearchStrategy[Recipe]:
    """``dict`` subclasses over ``pairs`` whose ``get``/``__getitem__``/``__contains__``
    lie or raise (a backend reading the dict through another method sees other values)."""
    return st.sampled_from(DICT_FLAVOURS).map(lambda f: ["dict", [list(p) for p in pairs], f])


# --------------------------------------------------------------------------- truthiness


class _Truth:
    """A flag: ``__bool__`` returns ``values`` in turn, or raises for ``"raise"``."""

    def __init__(self, values: list[Any]) -> None:
        self._values = itertools.cycle(values)

    def __bool__(self) -> bool:
        value = next(self._values)
        if value == "raise":
            raise HostileError("__bool__ raised")
        return bool(value)

    def __repr__(self) -> str:
        return "Truth()"


@builder("truth")
def _build_truth(params: list[Any], side: Side) -> _Truth:
    return _Truth(params[0])


@cache
def hostile_flags() -> st.SearchStrategy[Recipe]:
    """Flags whose ``__bool__`` raises or flips on every call (read eagerly or lazily?)."""
    return st.sampled_from(
        [["truth", ["raise"]], ["truth", [True, False]], ["truth", [False, True]]]
    )


# --------------------------------------------------------------------------- strings


#: Strings a UTF-8 encoder refuses (lone surrogates), or that stress one.
NON_ENCODABLE = ["\ud800", "a\udfffb", "\udc80" * 3]


@cache
def non_encodable_strings() -> st.SearchStrategy[Recipe]:
    """Strings with lone surrogates: valid ``str``, not encodable as UTF-8."""
    return st.sampled_from(NON_ENCODABLE)


# --------------------------------------------------------------------------- changing values


class _Changing:
    """A descriptor returning the next of its values on every read (cycling)."""

    def __init__(self, values: list[Any]) -> None:
        self._values = values
        self._reads: dict[int, int] = {}

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        n = self._reads.get(id(obj), 0)
        self._reads[id(obj)] = n + 1
        return self._values[n % len(self._values)]


@builder("duck")
def _build_duck(params: list[Any], side: Side) -> Any:
    """``["duck", [[name, recipe], ...], [[name, [recipe, ...]], ...]]``: an object with
    fixed attributes (writable) and attributes that change value on every read."""
    fixed, changing = params
    namespace: dict[str, Any] = {"__module__": __name__}
    for name, values in changing:
        namespace[name] = _Changing(build_all(values, side))
    cls = type("DuckRequest", (), namespace)
    duck = cls()
    for name, r in fixed:
        setattr(duck, name, build(r, side))
    return duck


# --------------------------------------------------------------------------- callables


@builder("returns")
def _build_returns(params: list[Any], side: Side) -> Callable[..., Any]:
    """A callable returning a fresh ``build(params[0])`` on every call."""
    recipe = params[0]

    def fn(*_: object) -> Any:
        return build(recipe, side)

    return fn


@builder("raises")
def _build_raises(params: list[Any], side: Side) -> Callable[..., Any]:
    def fn(*_: object) -> Any:
        raise HostileError("callback raised")

    return fn


@builder("reentrant")
def _build_reentrant(params: list[Any], side: Side) -> Callable[..., Any]:
    """A callable that first performs fuzz step ``params[0]`` on the same backend (its
    outcome ignored), then returns ``build(params[1])``."""
    call, recipe = params

    def fn(*_: object) -> Any:
        # The re-entrant call's own outcome is not the point; its effect on state is.
        with contextlib.suppress(Exception):
            side.reenter(call)
        return build(recipe, side)

    return fn


class _ReentrantSequence:
    """A sequence of ``items`` that performs a fuzz step on its backend at every read."""

    def __init__(self, items: list[Any], call: Recipe, side: Side) -> None:
        self._items = items
        self._call = call
        self._side = side

    def _reenter(self) -> None:
        # The re-entrant call's own outcome is not the point; its effect on state is.
        with contextlib.suppress(Exception):
            self._side.reenter(self._call)

    def __len__(self) -> int:
        self._reenter()
        return len(self._items)

    def __getitem__(self, index: Any) -> Any:
        self._reenter()
        return self._items[index]

    def __iter__(self) -> Iterator[Any]:
        self._reenter()
        return iter(self._items)


@builder("reentrant_seq")
def _build_reentrant_seq(params: list[Any], side: Side) -> _ReentrantSequence:
    return _ReentrantSequence(build_all(params[0], side), params[1], side)


def reentrant_callables(
    calls: st.SearchStrategy[Recipe], results: st.SearchStrategy[Recipe]
) -> st.SearchStrategy[Recipe]:
    """Callables (a ``block_hasher``) that call back into the backend, then return."""
    return st.builds(lambda c, r: ["reentrant", c, r], calls, results)


def reentrant_sequences(
    items: Recipe, calls: st.SearchStrategy[Recipe]
) -> st.SearchStrategy[Recipe]:
    """Sequences (``block_hashes``) that call back into the backend on every read."""
    return calls.map(lambda c: ["reentrant_seq", items, c])
