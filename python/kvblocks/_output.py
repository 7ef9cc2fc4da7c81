"""Formatting shared by the command-line reports (``kvblocks bench`` and ``simulate``)."""

from __future__ import annotations

from typing import Any

__all__ = ["format_seconds", "headless_pyplot", "progress_bar"]


def format_seconds(seconds: float) -> str:
    """``seconds`` in the largest unit it reaches, e.g. ``"4.54 µs"`` or ``"702 ns"``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.2f} {unit}"
    return f"{seconds / 1e-9:.0f} ns"


def progress_bar(done: int, total: int, width: int) -> str:
    """``[###---]``: ``done`` of ``total`` in ``width`` characters."""
    filled = width * done // max(total, 1)
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def headless_pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None without matplotlib."""
    try:
        import matplotlib  # noqa: PLC0415 (matplotlib is optional)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 (only after choosing the Agg backend)
    except ImportError:
        return None
    return plt
