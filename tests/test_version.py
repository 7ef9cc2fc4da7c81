"""One version, written once (the Cargo workspace), shown by the package and the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import kvblocks

ROOT = Path(__file__).resolve().parent.parent


def workspace_version() -> str | None:
    """``[workspace.package] version`` of the repository's Cargo.toml, if it is here."""
    cargo = ROOT / "Cargo.toml"
    if not cargo.is_file():
        return None
    section = cargo.read_text().split("[workspace.package]", 1)[1]
    match = re.search(r'^version = "([^"]+)"', section, re.MULTILINE)
    assert match, "no version in [workspace.package]"
    return match.group(1)


def test_the_package_version_is_the_workspace_version() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)?", kvblocks.__version__), kvblocks.__version__
    expected = workspace_version()
    if expected is not None:
        assert kvblocks.__version__ == expected


def test_the_cli_prints_the_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvblocks.cli", "--version"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"kvblocks {kvblocks.__version__}"
