"""The vLLM releases kvblocks.vllm is written against, checked at import and whenever a
manager is made, and what the older ones do differently, by name."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from functools import cache

#: The oldest and the newest vLLM release series whose Scheduler kvblocks.vllm matches
#: step for step.
OLDEST_SERIES = (0, 31)
NEWEST_SERIES = (0, 33)

INSTALL_HINT = (
    "install it with pip install 'kvblocks[vllm]' (or see docs/vllm.md, \"vLLM's scheduler "
    'on a CPU", for the CPU-only recipe)'
)


@dataclass(frozen=True, slots=True)
class ReleaseDifferences:
    """What the installed vLLM series does differently from the newest, where it shows
    in the manager kvblocks puts under vLLM's Scheduler. The manager's own rules are the
    core's, chosen by :attr:`series` (``ReleaseRules`` in ``hybrid/mod.rs``); what stays
    here decides which layouts kvblocks manages at all."""

    #: The series, ``(0, 31)`` for vLLM 0.31.x.
    series: tuple[int, int]
    #: 0.33: the coordinators kvblocks' hybrid manager matches (null blocks trimmed
    #: from freed and unhashed tables, caching capped at the hashed tokens, the
    #: partial-tail key at ``prompt length - 1``). Older series rework them, so their
    #: multi-group and local-attention layouts stay on vLLM's own manager.
    hybrid_layouts: bool

    def unsupported_reason(self, *, single_full_attention_group: bool) -> str | None:
        """Why this series' layout stays on vLLM's manager, or None."""
        if single_full_attention_group or self.hybrid_layouts:
            return None
        return (
            f"vLLM {self.series[0]}.{self.series[1]}.x: kvblocks manages only one "
            "full-attention KV cache group before vLLM 0.33 (its coordinators for "
            "sliding-window, chunked-local and hybrid layouts differ); vLLM 0.33 runs "
            "them on kvblocks"
        )


def differences_of(found: tuple[int, int]) -> ReleaseDifferences:
    """The named differences of a supported series from the newest."""
    return ReleaseDifferences(series=found, hybrid_layouts=found >= (0, 33))


@cache
def installed_differences() -> ReleaseDifferences:
    """The named differences of the installed vLLM (the newest series' for a newer or
    unparseable version: the manager is not used with one)."""
    found = series(installed_version())
    return differences_of(found if found is not None and found < NEWEST_SERIES else NEWEST_SERIES)


def installed_version() -> str:
    """The installed vLLM's ``__version__`` (``"unknown"`` when it has none)."""
    import vllm  # noqa: PLC0415 (vLLM is optional: callers checked it imports)

    return str(getattr(vllm, "__version__", "unknown"))


def series(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``0.33.1rc2``, or None."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def newer_version_reason() -> str | None:
    """Why kvblocks' managers stand aside for the installed vLLM, when it is newer than
    the newest supported series; None otherwise."""
    return _newer_reason(installed_version())


def _newer_reason(version: str) -> str | None:
    found = series(version)
    if found is None or found <= NEWEST_SERIES:
        return None
    return (
        f"vLLM {version} is newer than the vLLM kvblocks.vllm is tested with "
        f"({supported_range()}); python -m kvblocks.vllm.check lists what changed"
    )


def require_vllm() -> None:
    """Raises ImportError naming the fix unless a vLLM of a supported series, or a newer
    one, is importable. A newer one gets a warning: kvblocks' schedulers then run vLLM's
    own KV cache manager (never a half-working one of kvblocks')."""
    try:
        version = installed_version()
    except ImportError as err:
        raise ImportError(
            f"kvblocks.vllm needs vLLM {supported_range()}, which is not installed: {INSTALL_HINT}"
        ) from err
    found = series(version)
    if found is None or found < OLDEST_SERIES:
        raise ImportError(
            f"kvblocks.vllm supports vLLM {supported_range()}, found vLLM {version}: "
            f"pip install 'vllm=={NEWEST_SERIES[0]}.{NEWEST_SERIES[1]}.0' (or any release "
            "in that range)"
        )
    if (reason := _newer_reason(version)) is not None:
        warnings.warn(
            f"{reason}. kvblocks' schedulers will use vLLM's own KV cache manager.",
            RuntimeWarning,
            stacklevel=2,
        )


def supported_range() -> str:
    """The supported series, as users read them: ``0.31.x to 0.33.x``."""
    return f"{OLDEST_SERIES[0]}.{OLDEST_SERIES[1]}.x to {NEWEST_SERIES[0]}.{NEWEST_SERIES[1]}.x"
