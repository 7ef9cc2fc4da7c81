"""The fake scheduler-side KV connector and the recording event publisher. vLLM's KV
connector factory imports this module by name to build :class:`DiffFakeConnector`
(``kv_connector_module_path`` is ``DiffFakeConnector.__module__``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import (
    VllmConfig,
)
from vllm.distributed.kv_events import EventBatch, EventPublisher
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
from .normalise import normalise
from .scenarios import cdiv


@dataclass
class LoadRecord:
    """A load the connector started in ``update_state_after_alloc``."""

    req_id: str
    attempt: int
    is_async: bool
    num_local_tokens: int
    num_external_tokens: int
    external_block_ids: list[int]  # the blocks it writes, every group's, no null block


class DiffConnectorMetadata(KVConnectorMetadata):
    """What the connector saw since the previous step, as plain data (compared as is)."""

    def __init__(self, log: list[dict[str, Any]]) -> None:
        self.log = log

    def normalised(self) -> Any:
        """The log, its entries as dicts so a difference names the entry's field."""
        return [
            {key: normalise(value, f"kv_connector_metadata.{key}") for key, value in entry.items()}
            for entry in self.log
        ]


class DiffFakeConnector(KVConnectorBase_V1):
    """A scheduler-side KV connector with sync and async loads.

    It offers ``kv_transfer_params["diff_ext_blocks"]`` blocks past the local prefix hit
    (never the prompt's last token), asynchronously if ``kv_transfer_params["diff_async"]``.
    It reads what real connectors read: the block table (``get_blocks``), block views
    (``block_id``, ``block_hash``, ``is_null``), ``get_unhashed_block_ids`` (its
    ``_all_groups`` form with several groups), ``KVConnectorBlockState.get_block_ids`` and
    ``request_finished``'s block ids, and puts all of it into its metadata, so the
    comparison sees it. The driver reads :attr:`new_loads` after each ``schedule()`` to
    report ``finished_recving``, ``invalid_block_ids`` and ``failed_recving``.

    Without ``SupportsHMA`` (see :class:`DiffFakeHMAConnector`) vLLM allows one group only.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        assert kv_cache_config is not None
        super().__init__(vllm_config, role, kv_cache_config)
        # Offers and load ranges in the scheduler's blocks (every group's for one size).
        self.block_size = max(g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups)
        self._offers: dict[str, tuple[int, int, bool]] = {}
        self.attempts: Counter[str] = Counter()
        self.new_loads: list[LoadRecord] = []
        self._log: list[dict[str, Any]] = []

    # Worker side: nothing to do.
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return

    # Scheduler side.
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        num_blocks = int(params.get("diff_ext_blocks", 0))
        cap = ((request.num_tokens - 1) // self.block_size) * self.block_size
        ext = min(num_computed_tokens + num_blocks * self.block_size, cap) - num_computed_tokens
        if num_blocks <= 0 or ext <= 0:
            return 0, False
        is_async = bool(params.get("diff_async", False))
        self._offers[request.request_id] = (num_computed_tokens, ext, is_async)
        self._log.append(
            {
                "kind": "offer",
                "req_id": request.request_id,
                "num_computed_tokens": num_computed_tokens,
                "num_external_tokens": ext,
                "load_async": is_async,
            }
        )
        return ext, is_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        tables = blocks.get_block_ids()
        one_group = len(tables) == 1

        def by_group(values: list[Any]) -> Any:
            """One group's values as they are; several groups' as a list per group."""
            return values[0] if one_group else values

        self._log.append(
            {
                "kind": "alloc",
                "req_id": req_id,
                "block_ids": by_group([list(table) for table in tables]),
                "num_external_tokens": num_external_tokens,
            }
        )
        if num_external_tokens <= 0:
            return
        local, ext, is_async = self._offers.pop(req_id)
        assert ext == num_external_tokens, (ext, num_external_tokens)
        first = local // self.block_size
        last = cdiv(local + ext, self.block_size)
        views = [list(group)[first:last] for group in blocks.blocks]
        external = [[view.block_id for view in group] for group in views]
        for ids, table in zip(external, tables, strict=True):
            assert ids == list(table[first:last]), (ids, table)
        unhashed = (
            [blocks.get_unhashed_block_ids()]
            if one_group
            else blocks.get_unhashed_block_ids_all_groups()
        )
        self._log.append(
            {
                "kind": "load",
                "req_id": req_id,
                "external_block_ids": by_group(external),
                "unhashed": by_group([[v.block_hash is None for v in group] for group in views]),
                "is_null": by_group([[bool(v.is_null) for v in group] for group in views]),
                "unhashed_block_ids": by_group([sorted(ids) for ids in unhashed]),
            }
        )
        self.attempts[req_id] += 1
        # A sliding-window group's external range can hold nulls: it loads nothing there.
        loaded = [view.block_id for group in views for view in group if not view.is_null]
        self.new_loads.append(
            LoadRecord(req_id, self.attempts[req_id], is_async, local, ext, loaded)
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        state = scheduler_output.kv_connector_block_state
        tables = {
            req_id: state.get_block_ids(req_id) if state is not None else None
            for req_id in scheduler_output.num_scheduled_tokens
        }
        log, self._log = self._log, []
        return DiffConnectorMetadata([{"kind": "tables", "block_ids": tables}, *log])

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._log.append(
            {"kind": "request_finished", "req_id": request.request_id, "block_ids": list(block_ids)}
        )
        return False, None

    def take_new_loads(self) -> list[LoadRecord]:
        loads, self.new_loads = self.new_loads, []
        return loads


class DiffFakeHMAConnector(DiffFakeConnector, SupportsHMA):
    """:class:`DiffFakeConnector` for several KV cache groups: vLLM hands a connector with
    ``SupportsHMA`` every group's block ids when a request finishes."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._log.append(
            {
                "kind": "request_finished_all_groups",
                "req_id": request.request_id,
                "block_ids": [list(ids) for ids in block_ids],
            }
        )
        return False, None


class RecordingPublisher(EventPublisher):
    """Stands in for ``sched.kv_event_publisher``: keeps each batch's events, drops ``ts``."""

    def __init__(self) -> None:
        super().__init__(0)
        self.batches: list[list[Any]] = []

    def publish(self, events: EventBatch) -> None:
        self.batches.append(list(events.events))

    def shutdown(self) -> None:
        return

    def take(self) -> list[list[Any]]:
        batches, self.batches = self.batches, []
        return batches
