"""vLLM is optional: ``import kvblocks`` never imports it, and ``kvblocks.vllm`` says how
to install it when it is missing or older than 0.31.x (a newer one is
``tests/vllm/test_check.py``'s). Each case runs in a fresh interpreter, with vLLM hidden
or faked, so it holds with or without vLLM installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_import_kvblocks_does_not_import_vllm() -> None:
    result = run_python(
        """
        import sys
        import kvblocks, kvblocks.events, kvblocks.bench, kvblocks.sim
        heavy = sorted(m for m in ("vllm", "torch") if m in sys.modules)
        print("imported:", heavy)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "imported: []" in result.stdout


def test_missing_vllm_names_the_extra() -> None:
    result = run_python(
        """
        import sys
        sys.modules["vllm"] = None  # as if vLLM were not installed
        try:
            import kvblocks.vllm
        except ImportError as err:
            print("ImportError:", err)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "ImportError: kvblocks.vllm needs vLLM 0.31.x to 0.33.x" in result.stdout
    assert "pip install 'kvblocks[vllm]'" in result.stdout


def test_an_older_vllm_names_the_supported_one() -> None:
    result = run_python(
        """
        import sys, types
        fake = types.ModuleType("vllm")
        fake.__version__ = "0.30.1"
        sys.modules["vllm"] = fake
        try:
            import kvblocks.vllm
        except ImportError as err:
            print("ImportError:", err)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "supports vLLM 0.31.x to 0.33.x, found vLLM 0.30.1" in result.stdout
    assert "pip install 'vllm==0.33.0'" in result.stdout
