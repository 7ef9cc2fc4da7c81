"""Names and rules shared by both backends, the events, the simulator and the benchmarks.

Each value is written here once. The pure-Python reference validates against these
tuples, the native backend accepts exactly the same names
(``tests/test_no_reference_import.py`` checks both), and code that runs on either
backend (:mod:`kvblocks.sim`, :mod:`kvblocks.bench`) imports them from here, so that it
never loads the reference to know them.
"""

from __future__ import annotations

__all__ = ["HASH_ALGORITHMS", "LOAD_FAILURE_POLICIES", "ROLLBACK_MODES", "cdiv", "either"]

#: The block hash algorithms, by vLLM's ``--prefix-caching-hash-algo`` names, in the
#: order reports list them.
HASH_ALGORITHMS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

#: The rollback modes of ``handle_invalid_blocks``: vLLM's exact semantics, or kvblocks'
#: strict mode (every request truncated at its own first invalid block).
ROLLBACK_MODES: tuple[str, ...] = ("vllm", "strict")

#: The KV-load failure policies (vLLM's ``kv_load_failure_policy``).
LOAD_FAILURE_POLICIES: tuple[str, ...] = ("fail", "recompute")


def either(names: tuple[str, ...]) -> str:
    """``names`` for an error message: ``'vllm' or 'strict'``."""
    return " or ".join(repr(name) for name in names)


def cdiv(a: int, b: int) -> int:
    """Ceiling division, as vLLM's ``cdiv``: the blocks of ``b`` tokens ``a`` tokens fill."""
    return -(a // -b)
