"""The exception classes of kvblocks, shared by both backends.

Every class also derives from the built-in exception a caller of vLLM's own code
would catch for the same mistake, so code written against vLLM keeps working.
The native backend raises these very classes (it imports this module), so
``except kvblocks.NoFreeBlocksError`` catches the same thing whichever backend
is in use.
"""

from __future__ import annotations

__all__ = [
    "BlockStateError",
    "InvariantError",
    "KVBlocksError",
    "NoFreeBlocksError",
    "UnknownBlockError",
    "UnsupportedLayoutError",
]


class KVBlocksError(Exception):
    """Base class of every error kvblocks raises on purpose."""


class NoFreeBlocksError(KVBlocksError, ValueError):
    """More blocks were asked for than the pool has free."""


class BlockStateError(KVBlocksError, ValueError):
    """The call would break a block's state: a double free, re-hashing a hashed block, ..."""


class UnknownBlockError(KVBlocksError, IndexError):
    """A block id outside ``0 .. num_blocks - 1``."""


class UnsupportedLayoutError(KVBlocksError, RuntimeError):
    """Block-level load failures were reported for more than one KV cache group."""


class InvariantError(KVBlocksError, AssertionError):
    """``check_invariants()`` found the state inconsistent."""
