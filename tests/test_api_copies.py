"""The native backend's docstrings and stub are generated from the reference, and current.

``tools/api_copies.py`` writes them; ``tests/test_parity.py`` checks that the built module
carries them, each on its own item.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import ModuleType

import pytest
from kvblocks import reference
from repo_tools import load_tool


@pytest.fixture(scope="module")
def api_copies() -> ModuleType:
    return load_tool("api_copies")


def test_generated_copies_are_current(api_copies: ModuleType) -> None:
    diffs = api_copies.stale(api_copies.rendered())
    assert not diffs, "stale; run `python tools/api_copies.py`:\n" + "\n".join(diffs)


def test_a_changed_docstring_makes_the_rust_copy_stale(
    api_copies: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    touch = reference.BlockPool.touch
    monkeypatch.setattr(touch, "__doc__", "Adds one reference to each block, twice.")
    diffs = api_copies.stale(api_copies.rendered())
    assert len(diffs) == 1
    assert "rust/kvblocks-py/src/docstrings.rs" in diffs[0]
    assert "+Adds one reference to each block, twice." in diffs[0]


def test_a_changed_signature_makes_both_copies_stale(
    api_copies: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    get_new_blocks = reference.BlockPool.get_new_blocks
    sig = inspect.signature(get_new_blocks)
    renamed = [p.replace(name="count") if p.name == "n" else p for p in sig.parameters.values()]
    monkeypatch.setattr(
        get_new_blocks, "__signature__", sig.replace(parameters=renamed), raising=False
    )
    diffs = api_copies.stale(api_copies.rendered())
    assert [d.splitlines()[0] for d in diffs] == [
        "--- rust/kvblocks-py/src/docstrings.rs (committed)",
        "--- python/kvblocks/_native.pyi (committed)",
    ]
    assert '+r"get_new_blocks($self, count)' in diffs[0]
    assert "+    def get_new_blocks(self, count: int) -> list[int]: ..." in diffs[1]


def test_check_fails_on_a_stale_copy_and_keeps_the_file(
    api_copies: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    before = api_copies.STUB.read_text(encoding="utf-8")
    monkeypatch.setattr(reference.BlockPool.touch, "__doc__", "Changed.")
    assert api_copies.main(["--check"]) == 1
    assert "+Changed." in capsys.readouterr().out
    assert api_copies.STUB.read_text(encoding="utf-8") == before
    monkeypatch.undo()
    assert api_copies.main(["--check"]) == 0


def test_the_hand_written_part_of_the_stub_is_kept(api_copies: ModuleType) -> None:
    stub = api_copies.rendered()[api_copies.STUB]
    assert stub.endswith(api_copies.stub_hand_written())
    assert "class VllmKVCacheManager:" in api_copies.stub_hand_written()


def test_binding_signatures_match_the_reference(api_copies: ModuleType) -> None:
    assert api_copies.signature_mismatches(reference) == []
    # Every callable of the backend is found in the binding, classes by their `#[new]`.
    found = api_copies.rust_signatures()
    assert {"BlockPool", "Request", "BlockPool.touch", "handle_failed_recving"} <= set(found)
    assert found["BlockPool"] == [
        ("num_blocks", False, api_copies.NO_DEFAULT),
        ("enable_caching", False, True),
        ("block_size", True, 16),
    ]


def test_a_renamed_rust_parameter_is_a_mismatch(
    api_copies: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for source in api_copies.BINDING.rglob("*.rs"):
        text = source.read_text(encoding="utf-8")
        if source.name == "pool.rs":
            edited = text.replace(
                "n: i64) -> PyResult<Vec<u32>>", "count: i64) -> PyResult<Vec<u32>>"
            )
            assert edited != text
            text = edited.replace(
                "signature = (block_hashes, kv_cache_group_id=0)",
                "signature = (block_hashes, kv_cache_group_id=1)",
            )
        copy = tmp_path / source.relative_to(api_copies.BINDING)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(text, encoding="utf-8")
    monkeypatch.setattr(api_copies, "BINDING", tmp_path)
    assert api_copies.signature_mismatches(reference) == [
        "BlockPool.get_new_blocks: the reference has [('n', False, '<required>')], "
        "the binding [('count', False, '<required>')]",
        "BlockPool.find_longest_cache_hit: the reference has [('block_hashes', False, "
        "'<required>'), ('kv_cache_group_id', False, 0)], the binding [('block_hashes', "
        "False, '<required>'), ('kv_cache_group_id', False, 1)]",
    ]
