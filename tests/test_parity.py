"""Both backends export the same API: names, signatures, defaults, docstrings, errors.

The native docstrings and text signatures are generated from the reference
(``tools/api_copies.py``; ``tests/test_api_copies.py`` keeps them current). Comparing the
built module's against the reference's checks that each item carries its own.
"""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import re
from types import SimpleNamespace
from typing import Any

import kvblocks
import pytest
from kvblocks import _native, reference, values


def public_members(obj: Any) -> list[str]:
    return sorted(
        name
        for name in dir(obj)
        if not name.startswith("_") or name in ("__init__", "__call__", "__getitem__", "__len__")
    )


def signature(obj: Any) -> str:
    """The call signature without annotations, in the form PyO3 writes it."""
    text = getattr(obj, "__text_signature__", None)
    if isinstance(text, str):
        # PyO3 marks the receiver positional-only; Python methods cannot tell.
        return (
            text.replace("$self", "self")
            .replace("(self, /, ", "(self, ")
            .replace("(self, /)", "(self)")
        )
    sig = inspect.signature(obj)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


@pytest.mark.parametrize("name", kvblocks.BACKEND_NAMES)
def test_every_backend_name_exists(name: str) -> None:
    assert hasattr(reference, name), f"kvblocks.reference has no {name}"
    assert hasattr(_native, name), f"kvblocks._native has no {name}"


def test_backends_export_exactly_the_backend_names() -> None:
    assert sorted(reference.__all__) == sorted(kvblocks.BACKEND_NAMES)
    assert sorted(_native.__all__) == sorted(kvblocks.BACKEND_NAMES)


@pytest.mark.parametrize("name", kvblocks.BACKEND_NAMES)
def test_same_kind_docstring_and_signature(name: str) -> None:
    py_obj, rs_obj = getattr(reference, name), getattr(_native, name)
    assert isinstance(py_obj, type) == isinstance(rs_obj, type), name
    assert inspect.getdoc(py_obj) == inspect.getdoc(rs_obj), f"docstring of {name}"
    if isinstance(py_obj, type):
        assert signature(py_obj) == signature(rs_obj), f"constructor of {name}"
    else:
        assert signature(py_obj) == signature(rs_obj), name


VALUE_CLASSES = ["InvalidBlocksOutcome", "KVCacheBlock", "PrefixCacheStats", "RollbackResult"]


@pytest.mark.parametrize("name", VALUE_CLASSES)
def test_value_classes_are_one_class_in_both_backends(name: str) -> None:
    assert getattr(_native, name) is getattr(reference, name) is getattr(values, name)


def native_values() -> list[Any]:
    """One value of each class, as the native backend builds them from its core."""
    pool = _native.BlockPool(8, block_size=4)
    ids = pool.get_new_blocks(2)
    pool.cache_full_blocks(ids, [b"a" * 32, b"b" * 32], 0, 2, kv_cache_group_id=3)
    manager = _native.KVCacheManager(16, 4, log_stats=True)
    manager.make_prefix_cache_stats()
    manager.reset_prefix_cache()
    waiting = [SimpleNamespace(request_id=r, num_computed_tokens=8) for r in ("r1", "r2")]
    return [
        pool.get_block(ids[1]),
        pool.get_block(0),
        manager.make_prefix_cache_stats(),
        _native.rollback_invalid_blocks([[1, 2, 3], [1, 5]], [12, 8], [0, 0], [2], 4),
        _native.handle_failed_recving(["r2", "r1"], waiting, policy="recompute"),
        _native.handle_failed_recving(["r1"], waiting),
    ]


@pytest.mark.parametrize("value", native_values(), ids=lambda v: type(v).__name__)
def test_native_values_are_what_their_constructor_makes_of_them(value: Any) -> None:
    # The binding sets the fields without `__post_init__`: each must already be what the
    # constructor's conversion makes of it, to the type of every item.
    rebuilt = dataclasses.replace(value)
    assert rebuilt == value
    for field in dataclasses.fields(value):
        given, converted = getattr(value, field.name), getattr(rebuilt, field.name)
        assert type(given) is type(converted), field.name
        if isinstance(given, list | set):
            assert sorted(map(repr, map(type, given))) == sorted(map(repr, map(type, converted))), (
                field.name
            )
    assert pickle.loads(pickle.dumps(value)) == value


def dataclass_fields(cls: type) -> set[str]:
    """The field names of a dataclass; empty for any other class."""
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def documented_attributes(cls: type) -> set[str]:
    """The names listed in the ``Attributes:`` section of a Google-style class docstring."""
    lines = (inspect.getdoc(cls) or "").splitlines()
    start = lines.index("Attributes:") + 1 if "Attributes:" in lines else len(lines)
    names: set[str] = set()
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break  # the next section
        match = re.match(r"    (\w+): ", line)
        if match:
            names.add(match.group(1))
    return names


CLASS_NAMES = [n for n in kvblocks.BACKEND_NAMES if isinstance(getattr(reference, n), type)]


def class_members() -> list[tuple[str, str]]:
    return [
        (cls, member)
        for cls in kvblocks.BACKEND_NAMES
        if isinstance(getattr(reference, cls), type)
        for member in public_members(getattr(reference, cls))
        if member != "__init__"
    ]


@pytest.mark.parametrize("cls", CLASS_NAMES)
def test_classes_have_the_same_public_members(cls: str) -> None:
    py_members = set(public_members(getattr(reference, cls)))
    rs_members = set(public_members(getattr(_native, cls)))
    # Dataclass machinery is not API.
    ignored = {"__init__"}
    assert py_members - ignored == rs_members - ignored, cls


@pytest.mark.parametrize(("cls", "member"), class_members())
def test_members_match(cls: str, member: str) -> None:
    py_attr = inspect.getattr_static(getattr(reference, cls), member)
    rs_attr = inspect.getattr_static(getattr(_native, cls), member)
    py_doc = inspect.getdoc(getattr(getattr(reference, cls), member))
    rs_doc = inspect.getdoc(getattr(getattr(_native, cls), member))
    assert py_doc == rs_doc, f"docstring of {cls}.{member}"
    py_cls = getattr(reference, cls)
    if member in dataclass_fields(py_cls):
        # A slotted dataclass field has no docstring of its own: the class docstring's
        # Attributes section, compared above, documents it.
        assert member in documented_attributes(py_cls), f"{cls}.{member} is undocumented"
    py_callable = inspect.isfunction(py_attr) or isinstance(py_attr, (staticmethod, classmethod))
    if py_callable:
        assert callable(getattr(getattr(_native, cls), member)), f"{cls}.{member}"
        assert signature(getattr(getattr(reference, cls), member)) == signature(
            getattr(getattr(_native, cls), member)
        ), f"signature of {cls}.{member}"
    else:
        assert not inspect.isroutine(rs_attr), f"{cls}.{member} is a method in Rust only"


def test_native_raises_the_shared_error_classes() -> None:
    for backend in (reference, _native):
        with pytest.raises(kvblocks.NoFreeBlocksError):
            backend.BlockPool(4).get_new_blocks(4)
        with pytest.raises(kvblocks.UnknownBlockError):
            backend.BlockPool(4).touch([9])
        pool = backend.BlockPool(4)
        ids = pool.get_new_blocks(1)
        pool.free_blocks(ids)
        with pytest.raises(kvblocks.BlockStateError):
            pool.free_blocks(ids)
