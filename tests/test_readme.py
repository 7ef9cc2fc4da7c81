"""The README's usage example runs, on both backends, and prints what its comments say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


@pytest.mark.parametrize("backend_name", ["python", "rust"])
def test_readme_usage_example(backend_name: str) -> None:
    blocks = python_blocks()
    assert blocks, "the README has no python example"
    env = {**os.environ, "KVBLOCKS_BACKEND": backend_name}
    result = subprocess.run(
        [sys.executable, "-c", blocks[0]], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["1 [3, 4, 5, 6, 7, 8, 9, 10]", "{'r0'} 32"]
