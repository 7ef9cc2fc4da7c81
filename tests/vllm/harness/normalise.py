"""Normalisation: a run's scheduler outputs, engine outputs and events as JSON-like,
order-stable values, opaque objects replaced, so that two runs compare field by field.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.engine import EngineCoreOutputs

#: (class name, field) pairs replaced before comparing: opaque objects, tensors, timestamps.
_DROPPED: dict[tuple[str, str], Callable[[Any], Any]] = {
    ("NewRequestData", "sampling_params"): lambda sp: None if sp is None else sp.max_tokens,
    ("NewRequestData", "pooling_params"): lambda p: None if p is None else type(p).__name__,
    ("NewRequestData", "lora_request"): lambda p: None if p is None else type(p).__name__,
    ("NewRequestData", "mm_features"): len,
    ("NewRequestData", "prompt_embeds"): lambda t: None if t is None else list(t.shape),
    ("SchedulerOutput", "ec_connector_metadata"): lambda m: None if m is None else "set",
    ("SchedulerOutput", "ec_manager_metadata"): lambda m: None if m is None else "set",
    ("SchedulerOutput", "aux_output_connector_metadata"): lambda m: None if m is None else "set",
    ("SchedulerOutput", "scheduled_encoder_input_stats"): lambda m: None,
    ("SchedulerOutput", "encoder_input_updates"): len,
    ("EngineCoreOutputs", "timestamp"): lambda t: None,
    ("EngineCoreOutput", "events"): lambda evs: (
        None if evs is None else [type(e.type).__name__ + "." + e.type.name for e in evs]
    ),
    ("SchedulerStats", "kv_cache_eviction_events"): len,
    ("SchedulerStats", "perf_stats"): lambda s: None,
    ("SchedulerStats", "cudagraph_stats"): lambda s: None,
    ("SchedulerStats", "iteration_details"): lambda s: None,
}


def normalise(value: Any, path: str = "") -> Any:
    """A JSON-like, order-stable copy of ``value``: sets sorted, objects as dicts.

    Dict insertion order is kept (it is meaningful, e.g. ``num_scheduled_tokens``).
    Unknown object types raise, so a new vLLM field cannot slip through uncompared.
    """
    if isinstance(value, enum.Enum):  # before int: IntEnum and StrEnum are ints and strs
        return f"{type(value).__name__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple, deque)):
        return [normalise(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        items = [normalise(v, f"{path}{{}}") for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True, default=str))
    if isinstance(value, dict):
        return [[normalise(k, path), normalise(v, f"{path}[{k!r}]")] for k, v in value.items()]
    if isinstance(value, KVConnectorMetadata) and hasattr(value, "normalised"):
        # The fake connector's metadata gives its own form.
        return value.normalised()
    if isinstance(value, msgspec.Struct):
        names = value.__struct_fields__
        return _normalise_fields(value, names, path)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = tuple(f.name for f in dataclasses.fields(value))
        return _normalise_fields(value, names, path)
    raise TypeError(f"cannot normalise {type(value).__qualname__} at {path or '<root>'}")


def _normalise_fields(value: Any, names: Sequence[str], path: str) -> dict[str, Any]:
    cls = type(value).__name__
    out: dict[str, Any] = {"__type__": cls}
    for name in names:
        item = getattr(value, name)
        replace = _DROPPED.get((cls, name))
        out[name] = replace(item) if replace is not None else normalise(item, f"{path}.{name}")
    return out


def normalise_events(batches: list[list[Any]]) -> list[Any]:
    """Each published batch as a list of ``(type name, fields)``; ``ts`` is already gone."""
    return [[normalise(event, "event") for event in batch] for batch in batches]


def normalise_engine_outputs(outputs: dict[int, EngineCoreOutputs]) -> Any:
    """``update_from_output``'s result, by client index.

    The error outputs appended after the per-request loop come from a set
    (``finish_requests``), so their order is sorted away; the rest keep their order.
    """
    result = []
    for client, eco in sorted(outputs.items()):
        norm = normalise(eco, f"outputs[{client}]")
        items = norm["outputs"]
        split = len(items)
        while split > 0 and _is_error_output(items[split - 1]):
            split -= 1
        tail = sorted(items[split:], key=lambda o: json.dumps(o, sort_keys=True))
        norm["outputs"] = items[:split] + tail
        result.append([client, norm])
    return result


def _is_error_output(output: dict[str, Any]) -> bool:
    return not output["new_token_ids"] and output["finish_reason"] == "FinishReason.ERROR"
