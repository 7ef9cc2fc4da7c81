"""The native classes' borrow rule, kept by the reference so both refuse the same calls.

A native pool or manager is borrowed for the length of each call: a call that changes
it holds it exclusively, a call that only reads shares it. Code a call runs on the
caller's behalf (an ``__index__``, a ``block_hashes`` sequence, a request property)
may therefore read the object again but not change it, and may not touch it at all
while a changing call runs. A manager and its ``block_pool`` are one object for this.

Calls the reference makes internally (a manager to its own pool) go through
:func:`unguarded`, which skips the rule: only re-entry from the caller's code counts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = ["Borrow", "reads", "unguarded", "writes"]

F = TypeVar("F", bound=Callable[..., Any])


class Borrow:
    """How an object is borrowed right now: ``state > 0`` readers, ``-1`` a writer."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = 0


def reads(method: F) -> F:
    """Marks a call that only reads: refused while a changing call runs."""

    @functools.wraps(method)
    def read(self: Any, *args: Any, **kwargs: Any) -> Any:
        borrow = self._borrow
        if borrow.state < 0:
            raise RuntimeError("Already mutably borrowed")
        borrow.state += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            borrow.state -= 1

    return cast("F", read)


def writes(method: F) -> F:
    """Marks a call that changes the object: refused while any other call runs."""

    @functools.wraps(method)
    def write(self: Any, *args: Any, **kwargs: Any) -> Any:
        borrow = self._borrow
        if borrow.state != 0:
            raise RuntimeError("Already borrowed")
        borrow.state = -1
        try:
            return method(self, *args, **kwargs)
        finally:
            borrow.state = 0

    return cast("F", write)


class _Unguarded:
    """An object's methods without the borrow rule (see :func:`unguarded`)."""

    __slots__ = ("_target",)

    def __init__(self, target: object) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        attr = getattr(type(self._target), name, None)
        if isinstance(attr, property) and attr.fget is not None:
            getter = getattr(attr.fget, "__wrapped__", attr.fget)
            return getter(self._target)
        inner = getattr(attr, "__wrapped__", None)
        if inner is not None:
            return functools.partial(inner, self._target)
        return getattr(self._target, name)


def unguarded(target: object) -> Any:
    """``target`` for the library's own calls, which never count as re-entry."""
    return _Unguarded(target)
