"""vLLM's ``Request.num_tokens``, read natively.

The property is ``len(self._all_token_ids)``. The managers and the hasher read it for
every request at every step, and a Python property called from C costs about a quarter
of a decoding ``allocate_slots``. Once this module has checked that the installed
vLLM's property is that one line, it registers vLLM's ``Request`` with the native
module. That module then reads the list's length for requests of exactly that class,
while the class keeps that property (``num_tokens.rs``). Any other request, or a
release whose property differs, is read through the property.
"""

from __future__ import annotations

import builtins
from types import FunctionType
from typing import Any

from vllm.v1.request import Request

from kvblocks import _native

__all__ = ["register_request_class"]


def _num_tokens(self: Any) -> int:
    return len(self._all_token_ids)


def _is_len_of_token_list(getter: object) -> bool:
    """Whether ``getter`` compiles to the same code as :func:`_num_tokens` and sees the
    builtin ``len``."""
    if not isinstance(getter, FunctionType) or getter.__closure__ is not None:
        return False
    code, template = getter.__code__, _num_tokens.__code__
    return (
        code.co_code == template.co_code
        and code.co_names == template.co_names
        and code.co_consts == template.co_consts
        and code.co_argcount == template.co_argcount
        and "len" not in getter.__globals__
        and getattr(getter, "__builtins__", {}).get("len") is builtins.len
    )


def register_request_class(request_class: type = Request) -> bool:
    """Registers ``request_class`` with the native module if its ``num_tokens`` is
    ``len(self._all_token_ids)``; returns whether it did."""
    prop = vars(request_class).get("num_tokens")
    if not isinstance(prop, property) or not _is_len_of_token_list(prop.fget):
        return False
    _native.register_vllm_request(request_class)
    return True
