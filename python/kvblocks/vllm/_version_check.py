"""The one vLLM release kvblocks.vllm is written against, checked at import."""

from __future__ import annotations

#: vLLM versions whose Scheduler kvblocks.vllm matches step for step.
SUPPORTED_SERIES = "0.33."

INSTALL_HINT = (
    "install it with pip install 'kvblocks[vllm]' (or see docs/vllm.md, \"vLLM's scheduler "
    'on a CPU", for the CPU-only recipe)'
)


def require_vllm() -> None:
    """Raises ImportError naming the fix unless vLLM 0.33.x is importable."""
    try:
        import vllm  # noqa: PLC0415 (vLLM is optional: this is the check)
    except ImportError as err:
        raise ImportError(
            f"kvblocks.vllm needs vLLM 0.33.x, which is not installed: {INSTALL_HINT}"
        ) from err
    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED_SERIES):
        raise ImportError(
            f"kvblocks.vllm supports vLLM 0.33.x only, found vLLM {version}: "
            "pip install 'vllm==0.33.0'"
        )
