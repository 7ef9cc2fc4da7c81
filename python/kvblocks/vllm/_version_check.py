"""The vLLM releases kvblocks.vllm is written against, checked at import and whenever a
manager is made."""

from __future__ import annotations

import re
import warnings

#: The vLLM release series whose Scheduler kvblocks.vllm matches step for step.
TESTED_SERIES = (0, 33)

INSTALL_HINT = (
    "install it with pip install 'kvblocks[vllm]' (or see docs/vllm.md, \"vLLM's scheduler "
    'on a CPU", for the CPU-only recipe)'
)


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
    the tested series; None otherwise."""
    return _newer_reason(installed_version())


def _newer_reason(version: str) -> str | None:
    found = series(version)
    if found is None or found <= TESTED_SERIES:
        return None
    return (
        f"vLLM {version} is newer than the vLLM kvblocks.vllm is tested with "
        f"({_tested()}); python -m kvblocks.vllm.check lists what changed"
    )


def require_vllm() -> None:
    """Raises ImportError naming the fix unless a vLLM of the tested series, or a newer
    one, is importable. A newer one gets a warning: kvblocks' schedulers then run vLLM's
    own KV cache manager (never a half-working one of kvblocks')."""
    try:
        version = installed_version()
    except ImportError as err:
        raise ImportError(
            f"kvblocks.vllm needs vLLM {_tested()}, which is not installed: {INSTALL_HINT}"
        ) from err
    found = series(version)
    if found is None or found < TESTED_SERIES:
        raise ImportError(
            f"kvblocks.vllm supports vLLM {_tested()}, found vLLM {version}: "
            f"pip install 'vllm=={TESTED_SERIES[0]}.{TESTED_SERIES[1]}.0'"
        )
    if (reason := _newer_reason(version)) is not None:
        warnings.warn(
            f"{reason}. kvblocks' schedulers will use vLLM's own KV cache manager.",
            RuntimeWarning,
            stacklevel=2,
        )


def _tested() -> str:
    return f"{TESTED_SERIES[0]}.{TESTED_SERIES[1]}.x"
