"""What kvblocks.vllm relies on in vLLM, and what changed in the installed vLLM.

The surface is every vLLM class and function kvblocks.vllm overrides, calls or is
called through, by signature (parameter names, kinds and defaults), and the fields of
the event, stats and KV cache spec classes it builds or reads. ``_surface_0_31``,
``_surface_0_32`` and ``_surface_0_33`` hold it as recorded from each supported release.

Run ``python -m kvblocks.vllm.check`` against whatever vLLM is installed: it prints each
entry that was added, removed or changed since the recording of its series (of the newest
supported one for a newer vLLM), with exit status 1 if any, so a port to a new vLLM
release starts from that list. ``--write FILE`` records the installed vLLM's surface (for
a release kvblocks.vllm is ported to).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvblocks.vllm._version_check import NEWEST_SERIES, OLDEST_SERIES, installed_version, series

__all__ = ["diff", "main", "recorded", "snapshot"]

#: Classes whose public methods (and constructor) kvblocks.vllm stands in for or calls.
ALL_METHODS = (
    "vllm.v1.core.kv_cache_manager.KVCacheManager",
    "vllm.v1.core.kv_cache_manager.KVCacheBlocks",
    "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator",
    "vllm.v1.core.block_pool.BlockPool",
)
#: Single members it overrides, calls or is called through.
MEMBERS = (
    "vllm.v1.core.sched.scheduler.Scheduler.__init__",
    "vllm.v1.core.sched.scheduler.Scheduler.add_request",
    "vllm.v1.core.sched.scheduler.Scheduler._update_requests_with_invalid_blocks",
    "vllm.v1.core.sched.scheduler.Scheduler._handle_invalid_blocks",
    "vllm.v1.core.sched.async_scheduler.AsyncScheduler.__init__",
    "vllm.v1.request.Request.__init__",
    "vllm.v1.request.Request.append_output_token_ids",
    "vllm.v1.request.Request.update_block_hashes",
    "vllm.v1.core.kv_cache_utils.get_request_block_hasher",
    "vllm.v1.core.kv_cache_utils.init_none_hash",
    "vllm.v1.core.kv_cache_utils.get_none_hash_seed",
    "vllm.v1.core.kv_cache_utils.hash_block_tokens",
)
#: Classes whose fields it builds or reads.
FIELDS = (
    "vllm.distributed.kv_events.BlockStored",
    "vllm.distributed.kv_events.BlockRemoved",
    "vllm.distributed.kv_events.AllBlocksCleared",
    "vllm.v1.metrics.stats.PrefixCacheStats",
    "vllm.v1.kv_cache_interface.KVCacheConfig",
    "vllm.v1.kv_cache_interface.KVCacheGroupSpec",
    "vllm.v1.kv_cache_interface.FullAttentionSpec",
    "vllm.v1.kv_cache_interface.MLAAttentionSpec",
    "vllm.v1.kv_cache_interface.SlidingWindowSpec",
    "vllm.v1.kv_cache_interface.ChunkedLocalAttentionSpec",
)


def snapshot() -> dict[str, str]:
    """The installed vLLM's surface: entry name -> signature or field list; an entry
    that cannot be found is ``"missing"``."""
    out: dict[str, str] = {}
    for path in ALL_METHODS:
        cls = _resolve(path)
        if cls is None:
            out[path] = "missing"
            continue
        for name in sorted({"__init__", *(n for n in dir(cls) if not n.startswith("_"))}):
            member = inspect.getattr_static(cls, name, None)
            if isinstance(member, staticmethod | classmethod):
                member = member.__func__
            if inspect.isfunction(member):
                out[f"{path}.{name}"] = _signature(member)
    for path in MEMBERS:
        member = _resolve(path)
        out[path] = "missing" if member is None else _signature(member)
    for path in FIELDS:
        cls = _resolve(path)
        out[path] = "missing" if cls is None else "fields: " + ", ".join(_fields(cls))
    return out


def recorded(version: str) -> tuple[str, dict[str, str]]:
    """The surface recorded from the supported release of ``version``'s series (the
    newest's for a newer or unreadable version), and that release's version."""
    found = series(version)
    if found is None or not OLDEST_SERIES <= found <= NEWEST_SERIES:
        found = NEWEST_SERIES
    module = importlib.import_module(f"kvblocks.vllm._surface_{found[0]}_{found[1]}")
    return module.VERSION, module.SURFACE


def diff(installed: dict[str, str], recorded: dict[str, str]) -> list[str]:
    """One line per entry added, removed or changed from ``recorded`` to ``installed``."""
    lines = []
    for name in sorted(recorded.keys() | installed.keys()):
        old, new = recorded.get(name), installed.get(name)
        if old == new:
            continue
        if old is None:
            lines.append(f"added    {name}{_shown(new)}")
        elif new is None or new == "missing":
            lines.append(f"removed  {name}{_shown(old)}")
        else:
            lines.append(f"changed  {name}\n           was {old}\n           now {new}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """The command: prints the changes (exit status 1 if any), or records the surface."""
    parser = argparse.ArgumentParser(
        prog="python -m kvblocks.vllm.check",
        description="What changed in the installed vLLM, in what kvblocks.vllm relies on.",
    )
    parser.add_argument(
        "--write",
        metavar="FILE",
        type=Path,
        help="record the installed vLLM's surface as a Python module instead",
    )
    args = parser.parse_args(argv)
    installed = snapshot()
    version = installed_version()
    if args.write is not None:
        args.write.write_text(_module_text(installed, version), encoding="utf-8")
        print(f"recorded {len(installed)} entries of vLLM {version} in {args.write}")
        return 0
    recorded_version, surface = recorded(version)
    lines = diff(installed, surface)
    print(
        f"vLLM {version} against the surface recorded from vLLM {recorded_version} "
        f"({len(surface)} entries): {len(lines) or 'no'} change{'s' * (len(lines) != 1)}"
    )
    for line in lines:
        print(line)
    return 1 if lines else 0


def _resolve(path: str) -> Any:
    """The object a dotted path names, or None where the module or an attribute is gone."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = inspect.getattr_static(obj, name, None)
            if obj is None:
                return None
        if isinstance(obj, staticmethod | classmethod):
            return obj.__func__
        return obj
    return None


def _signature(member: Callable[..., Any]) -> str:
    """Parameter names, kinds and defaults: annotations vary with how vLLM spells them."""
    try:
        signature = inspect.signature(member)
    except (TypeError, ValueError):
        return "no signature"
    params = [
        param.replace(annotation=inspect.Parameter.empty, default=_default(param.default))
        for param in signature.parameters.values()
    ]
    return str(signature.replace(parameters=params, return_annotation=inspect.Signature.empty))


class _Shown:
    """A default value shown by its type, where its repr would vary from run to run."""

    def __init__(self, value: Any) -> None:
        self._text = f"<{type(value).__name__}>"

    def __repr__(self) -> str:
        return self._text


def _default(value: Any) -> Any:
    if value is inspect.Parameter.empty or isinstance(
        value, bool | int | float | str | bytes | type(None)
    ):
        return value
    return _Shown(value)


def _fields(cls: type) -> list[str]:
    """A dataclass's or msgspec struct's field names, in order."""
    if dataclasses.is_dataclass(cls):
        return [field.name for field in dataclasses.fields(cls)]
    return list(getattr(cls, "__struct_fields__", ()))


def _shown(value: str | None) -> str:
    return "" if value is None or value == "missing" else f" {value}"


def _module_text(surface: dict[str, str], version: str) -> str:
    """The recorded surface as a module, formatted as ruff formats it (JSON strings are
    Python literals with double quotes); its long lines are signatures, left whole."""
    entries = "".join(
        f"    {json.dumps(name)}: {json.dumps(text)},\n" for name, text in sorted(surface.items())
    )
    return (
        "# ruff: noqa: E501\n"
        f'"""What kvblocks.vllm relies on in vLLM {version}, recorded by\n'
        "``python -m kvblocks.vllm.check --write`` (see :mod:`kvblocks.vllm.check`).\n"
        'Generated: do not edit."""\n\n'
        f"VERSION = {json.dumps(version)}\n\n"
        "SURFACE: dict[str, str] = {\n"
        f"{entries}"
        "}\n"
    )


if __name__ == "__main__":
    sys.exit(main())
