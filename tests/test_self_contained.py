"""The repository stands alone: nothing in it points to an issue tracker or to documents
kept outside it (a user's clone has neither)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: "issue 7", "issues #12", a path into the design documents beside the repository.
OUTSIDE = re.compile(r"\bissues? ?#?\d+|\.\./shared\b", re.IGNORECASE)


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    paths = [ROOT / p.decode() for p in listed if p]
    return [p for p in paths if p.suffix in {".py", ".rs", ".md", ".toml", ".txt", ".pyi", ""}]


def outside_references(paths: list[Path]) -> list[str]:
    """``path:line: text`` for each line that points outside the repository. The
    changelog records history and this file names the pattern: both are skipped."""
    found = []
    for path in paths:
        if not path.is_file() or path.name == "CHANGELOG.md" or path == Path(__file__):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{path.name}:{number}: {line.strip()}")
    return found


def test_nothing_points_outside_the_repository() -> None:
    found = outside_references(tracked_text_files())
    assert not found, "\n".join(found)


def test_a_reference_outside_is_found(tmp_path: Path) -> None:
    planted = tmp_path / "notes.md"
    planted.write_text("fixed in issue 7\nsee ../shared/DESIGN.md\nplain text\n", encoding="utf-8")
    assert outside_references([planted]) == [
        "notes.md:1: fixed in issue 7",
        "notes.md:2: see ../shared/DESIGN.md",
    ]
