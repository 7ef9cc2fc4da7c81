"""Drive vLLM 0.33.0's real v1 Scheduler twice on the same inputs and diff the two runs.

A plain module (not a test file): the tests import it, and vLLM's KV connector factory
imports it by name to build :class:`DiffFakeConnector` (``kv_connector_module_path`` is
``DiffFakeConnector.__module__``, so whatever name this module was imported under works).

* :func:`make_scenario` turns ``(family, seed, engine)`` into a :class:`Scenario`, with a
  ``random.Random`` seeded by a string (so nothing depends on ``PYTHONHASHSEED``).
* :func:`run_scenario` builds ``VllmConfig``/``KVCacheConfig``/the scheduler (the model a
  directory holding only ``config.json``; one full-attention group, or the scenario's
  hybrid layout of full, sliding-window and chunked-local groups) and drives it, either as
  a synchronous engine (``EngineCore.step``) or as a depth-2 pipeline
  (``EngineCore.step_with_batch_queue``), recording per step the normalised
  ``SchedulerOutput``, the ``EngineCoreOutputs`` (with ``prefill_stats`` and
  ``SchedulerStats``), the published KV events and the results of prefix-cache resets.
* The fake model's tokens, drafts and connector results are functions of the request ids,
  the step number and what the scheduler output said -- never of Python's ``hash()`` -- so
  two schedulers that behave alike are fed exactly the same inputs.
* :func:`compare_runs` reports the first step at which two runs differ, field by field.

Run ``python tests/vllm/harness.py SCENARIO_ID`` (for example ``connector-s3-async``) to
replay one scenario and print the first difference between vLLM's manager and kvblocks'.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses
import enum
import inspect
import json
import random
import sys
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import vllm
from kvblocks.vllm import cpu
from kvblocks.vllm.cpu import (
    VOCAB_SIZE,
    GroupLayout,
    cpu_vllm_config,
    kv_cache_config,
    write_config_only_model,
)
from vllm.config import (
    KVEventsConfig,
    KVTransferConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import EventBatch, EventPublisher
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs, FinishReason
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

#: The installed vLLM's release series, ``(0, 33)`` for 0.33.x.
VLLM_SERIES = tuple(int(part) for part in vllm.__version__.split(".")[:2])
#: Whether the installed vLLM's lookups take a hit cap (0.33 on; older ones take the
#: request alone).
TAKES_MAX_CACHE_HIT_LENGTH = (
    "max_cache_hit_length" in inspect.signature(VllmKVCacheManager.get_computed_blocks).parameters
)

#: Steps without a scheduled token (and nothing pending) after which a run has stalled.
STALL_STEPS = 40
#: Steps in which no request computed past the furthest point it had reached (and nothing
#: pending) after which a run that still schedules tokens is livelocked.
LIVELOCK_STEPS = 200


def crc(*parts: object) -> int:
    """A stable 32-bit hash of ``parts`` (``zlib.crc32``; never Python's ``hash()``)."""
    return zlib.crc32("|".join(str(p) for p in parts).encode())


def fake_token(*parts: object) -> int:
    """A deterministic token id in ``[1, VOCAB_SIZE)``."""
    return 1 + crc("tok", *parts) % (VOCAB_SIZE - 1)


# --------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------

ENGINES = ("sync", "async")
#: Families that each stress one feature (some with a little of the others).
BASE_FAMILIES = (
    "prefix",
    "multiturn",
    "chunked",
    "preempt",
    "abort",
    "reset",
    "spec",
    "connector",
    "deferred",
    "nocache",
    "mixed",
)
#: Families that combine what users combine:
#:
#: * ``async-spec-fail``: overlapping batches (``AsyncScheduler``) with ngram spec decode
#:   (k in 1..3) and a connector whose sync and async loads fail often, under the
#:   ``recompute`` and ``fail`` policies (async engine only);
#: * ``priority``: the ``priority`` scheduling policy, random priorities and arrival times
#:   (ties included), tight pools and long outputs, so running requests get preempted;
#: * ``small-blocks``: block sizes 1, 2 and 4 with tight pools (lengths drawn in tokens),
#:   some with spec decode (its lookahead spans several blocks);
#: * ``combined``: all of the above and every knob of ``mixed``, each at random.
COMBINATION_FAMILIES = ("async-spec-fail", "priority", "small-blocks", "combined")
FAMILIES = BASE_FAMILIES + COMBINATION_FAMILIES
#: Families with a multi-group (hybrid) or local-attention layout, each drawing every knob
#: of ``mixed`` at random, with blocks of 2 to 8 tokens and windows (chunks) smaller than
#: the prompts, so out-of-window blocks are freed:
#:
#: * ``swa``: one sliding-window group (vLLM's unitary coordinator);
#: * ``gpt-oss``: full attention + one sliding-window group, in either order;
#: * ``gemma3``: full attention + 2 to 5 sliding-window groups of one window (looked up
#:   jointly), sometimes with 1 or 2 groups of a second window, in a drawn order;
#: * ``llama4``: full attention + 1 to 3 chunked-local groups, in a drawn order;
#: * ``gemma4``: full attention + 1 to 5 sliding-window groups, one kind's blocks twice
#:   the other's (the scheduler's block size is the larger, the hash block size the
#:   smaller): window blocks larger, as Gemma 4's larger full-attention heads make, or
#:   full-attention blocks larger, where vLLM keys each prompt's partial tail block
#:   under an extra key; in a drawn order.
#:
#: Each draws ``prefix_cache_retention_interval`` (0, vLLM's default, most often; None;
#: or a multiple of the block size) and resends earlier prompts (so hits land on the
#: replay boundary). Their connector supports HMA when there are several groups (vLLM
#: asserts one group for a connector without it), and half the time with one. Block-level
#: load failures are rare with several groups: vLLM refuses them (a ``RuntimeError`` ends
#: the run there).
HYBRID_FAMILIES = ("swa", "gpt-oss", "gemma3", "llama4", "gemma4")
#: The engines each family runs on.
FAMILY_ENGINES: dict[str, tuple[str, ...]] = {
    **{family: ENGINES for family in FAMILIES + HYBRID_FAMILIES},
    "async-spec-fail": ("async",),
}


@dataclass(frozen=True)
class ReqSpec:
    """One request of a scenario.

    ``parent`` makes a multi-turn continuation: the request arrives once the parent has
    finished (and not before ``arrival_step``), with prompt = the parent's prompt + the
    parent's output + ``prompt``. ``ext_blocks``/``ext_async`` tell the fake connector how
    many blocks past the local hit it offers and whether it loads them asynchronously;
    ``fail`` injects a load failure into the first load attempt.
    """

    req_id: str
    arrival_step: int
    prompt: tuple[int, ...]
    max_tokens: int
    parent: str | None = None
    ext_blocks: int = 0
    ext_async: bool = False
    fail: str | None = None  # None, "invalid" or "failed_recving"
    priority: int = 0  # the scheduling priority (lower first) under the "priority" policy
    arrival_time: float = 0.0  # Request.arrival_time: the priority policy's tie-break


@dataclass(frozen=True)
class Abort:
    """At ``step``, abort between ``schedule()`` and ``update_from_output()``.

    ``kind == "sched"``: the ``k``-th (mod n) request of the newest ``SchedulerOutput``;
    ``kind == "any"``: the ``k``-th (mod n) of the scheduler's live request ids, sorted.
    """

    step: int
    kind: str
    k: int


@dataclass(frozen=True)
class Scenario:
    """Everything that determines a run (the scheduler class aside)."""

    family: str
    seed: int
    engine: str  # "sync": Scheduler + EngineCore.step; "async": AsyncScheduler + batch queue
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    requests: tuple[ReqSpec, ...]
    enable_caching: bool = True
    events: bool = True
    spec_tokens: int = 0
    connector_policy: str | None = None  # None, "recompute" or "fail"
    long_prefill_token_threshold: int = 0
    watermark: float = 0.0
    reserve_full_isl: bool = True
    aborts: tuple[Abort, ...] = ()
    resets: tuple[tuple[int, bool], ...] = ()  # (step, reset_running_requests)
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority"
    max_steps: int = 800
    #: The KV cache groups; empty: one full-attention group (``build_kv_cache_config``).
    layout: tuple[GroupLayout, ...] = ()
    #: vLLM's ``prefix_cache_retention_interval`` (0 is the engine's default).
    retention_interval: int | None = 0
    #: The block size of the requests' hashes, when smaller than ``block_size``.
    hash_block_size: int | None = None
    #: Whether the fake connector implements ``SupportsHMA`` (needed with several groups).
    connector_hma: bool = False

    @property
    def scenario_id(self) -> str:
        return f"{self.family}-s{self.seed}-{self.engine}"

    @property
    def is_async(self) -> bool:
        return self.engine == "async"


def parse_scenario_id(scenario_id: str) -> tuple[str, int, str]:
    """``"connector-s3-async"`` -> ``("connector", 3, "async")``."""
    family, seed, engine = scenario_id.rsplit("-", 2)
    if engine not in FAMILY_ENGINES.get(family, ()) or not seed.startswith("s"):
        raise ValueError(f"not a scenario id: {scenario_id!r}")
    return family, int(seed[1:]), engine


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, VOCAB_SIZE) for _ in range(n))


def _draw_layout(
    rng: random.Random, family: str, block_size: int
) -> tuple[tuple[GroupLayout, ...], int | None]:
    """A hybrid family's KV cache groups and retention interval (see ``HYBRID_FAMILIES``)."""

    def window() -> int:
        return rng.randint(2, 4 * block_size)

    if family == "swa":
        layout = [GroupLayout("sliding_window", window())]
    elif family == "gpt-oss":
        layout = [GroupLayout("sliding_window", window()), GroupLayout("full")]
        if rng.random() < 0.3:
            layout.reverse()
    elif family == "gemma3":
        first = window()
        layout = [GroupLayout("sliding_window", first)] * rng.randint(2, 5)
        if rng.random() < 0.3:
            second = rng.choice([w for w in range(2, 4 * block_size + 1) if w != first])
            layout += [GroupLayout("sliding_window", second)] * rng.randint(1, 2)
        layout.append(GroupLayout("full"))
        if rng.random() < 0.4:
            rng.shuffle(layout)
    elif family == "gemma4":
        # One kind's blocks twice the other's, either way round; windows of up to 4
        # scheduler blocks.
        small, large = block_size // 2, block_size
        wide_full = rng.random() < 0.5
        window_bs, full_bs = (small, large) if wide_full else (large, small)
        swa = GroupLayout("sliding_window", rng.randint(2, 4 * block_size), window_bs)
        layout = [swa] * rng.randint(1, 5) + [GroupLayout("full", None, full_bs)]
        if rng.random() < 0.4:
            rng.shuffle(layout)
    else:  # llama4
        chunk = GroupLayout("chunked_local", block_size * rng.randint(1, 4))
        layout = [chunk] * rng.randint(1, 3) + [GroupLayout("full")]
        if rng.random() < 0.4:
            rng.shuffle(layout)
    # vLLM accepts a positive interval only with a sliding-window (or Mamba) group.
    has_window = any(group.kind == "sliding_window" for group in layout)
    draw = rng.random()
    retention = (
        0
        if draw < 0.6
        else None
        if draw < 0.8 or not has_window
        else block_size * rng.randint(1, 4)
    )
    return tuple(layout), retention


def make_scenario(family: str, seed: int, engine: str) -> Scenario:
    """The scenario ``family-s<seed>-<engine>``; the same arguments always give the same one.

    The combination and hybrid families draw their extra knobs only after, or instead of,
    the draws every family makes, so the base families' scenarios do not change with them.
    """
    if engine not in FAMILY_ENGINES.get(family, ()):
        raise ValueError(f"unknown family/engine {family!r}/{engine!r}")
    rng = random.Random(f"kvblocks-diff:{family}:{seed}:{engine}")
    combined = family == "combined"
    spec_fail = family == "async-spec-fail"
    hybrid = family in HYBRID_FAMILIES
    mixed = family in ("mixed", "combined") or hybrid

    def chance(p: float, *families: str) -> bool:
        return (family in families or mixed) and rng.random() < p

    if family == "gemma4":
        block_sizes = [4, 4, 8]
    elif hybrid:
        block_sizes = [2, 4, 4, 8]
    elif family == "small-blocks":
        block_sizes = [1, 2, 2, 4]
    elif combined:
        block_sizes = [1, 2, 4, 4, 8, 16]
    elif family == "chunked":
        block_sizes = [2, 4, 8]
    else:
        block_sizes = [2, 4, 4, 8, 16]
    block_size = rng.choice(block_sizes)
    # Lengths below are drawn in units of a block, but at least 4 tokens for small blocks.
    unit = max(block_size, 4) if family in ("small-blocks", "combined") else block_size
    spec = family in ("spec", "async-spec-fail") or chance(0.5 if combined else 0.3, "small-blocks")
    spec_tokens = rng.choice([1, 2, 3]) if spec else 0
    connector = family in ("connector", "deferred", "async-spec-fail") or chance(
        0.5 if combined else 0.4
    )
    policy = (
        rng.choice(["recompute", "recompute", "fail"] if spec_fail else ["recompute", "fail"])
        if connector
        else None
    )
    priority = family == "priority" or (combined and rng.random() < 0.5)
    layout: tuple[GroupLayout, ...] = ()
    retention: int | None = 0
    connector_hma = False
    invalid_ok = True
    if hybrid:
        layout, retention = _draw_layout(rng, family, block_size)
        connector_hma = len(layout) > 1 or rng.random() < 0.5
        invalid_ok = len(layout) == 1 or rng.random() < 0.15
    # Shared prefixes (system prompts), some not block aligned.
    prefixes = [
        _tokens(rng, rng.randint(1, 6) * unit + rng.choice([0, 0, 1, block_size // 2]))
        for _ in range(rng.randint(1, 3))
    ]
    num_requests = rng.randint(6, 14) if not mixed else rng.randint(8, 20)
    long_prompts = family == "chunked" or chance(0.3)
    long_outputs = family in ("preempt", "reset", "priority") or chance(0.3, "small-blocks")
    requests: list[ReqSpec] = []
    standalone: list[tuple[int, ...]] = []  # the prompts drawn in full, to resend
    lengths: dict[str, int] = {}  # upper bound of each request's total tokens
    last_arrival = 0
    for i in range(num_requests):
        req_id = f"r{i}"
        suffix_len = rng.randint(1, 12 * unit if long_prompts else 4 * unit)
        max_tokens = rng.randint(1, 40 if long_outputs else 12)
        parent: str | None = None
        if (family == "multiturn" or chance(0.3)) and requests and rng.random() < 0.6:
            parent = rng.choice(requests).req_id
        if parent is not None:
            prompt = _tokens(rng, rng.randint(1, 2 * unit))
            bound = lengths[parent] + len(prompt)
        elif hybrid and standalone and rng.random() < 0.2:
            # A resend, as is or a little longer: a hit at the sender's replay boundary.
            extra = rng.choice([0, 0, 1, block_size, 2 * block_size + 1])
            prompt = rng.choice(standalone) + _tokens(rng, extra)
            bound = len(prompt)
        else:
            prefix = rng.choice(prefixes) if rng.random() < 0.8 else ()
            prompt = prefix + _tokens(rng, suffix_len)
            bound = len(prompt)
            standalone.append(prompt)
        lengths[req_id] = bound + max_tokens
        arrival = last_arrival + rng.choice([0, 0, 0, 1, 2, 5])
        if rng.random() < 0.1 or (family == "reset" and i == num_requests // 2):
            arrival += rng.randint(10, 60)  # a later wave, often after the cache went idle
        last_arrival = arrival
        ext_blocks = 0
        ext_async = False
        fail: str | None = None
        if connector and rng.random() < (0.85 if spec_fail else 0.7):
            ext_blocks = rng.choice([1, 2, 3, 5, 8])
            ext_async = rng.random() < (0.35 if spec_fail else 0.5)
            fail = rng.choice(
                [None, "invalid", "invalid", "invalid", "failed_recving"]
                if spec_fail
                else [None, None, "invalid", "invalid", "failed_recving"]
                if invalid_ok
                else [None, None, None, "failed_recving"]
            )
            if not (invalid_ok or ext_async):
                fail = None  # the driver reports a failed sync load as invalid blocks
        prio = 0
        arrival_time = 0.0
        if priority:
            # Lower runs first; equal priorities fall back to arrival_time, then request id.
            prio = rng.choice([-1, 0, 0, 1, 2, 5])
            arrival_time = rng.choice(
                [float(arrival), float(arrival), round(rng.uniform(0.0, last_arrival + 20.0), 3)]
            )
        requests.append(
            ReqSpec(
                req_id,
                arrival,
                prompt,
                max_tokens,
                parent,
                ext_blocks,
                ext_async,
                fail,
                prio,
                arrival_time,
            )
        )

    max_total = max(lengths.values())
    lookahead = spec_tokens + 2
    max_need = _cdiv(max_total + lookahead, block_size)
    max_model_len = max(256, _cdiv(max_total + lookahead + 8, 64) * 64)
    watermark = rng.choice([0.0, 0.0, 0.05, 0.1]) if chance(0.5, "preempt", "prefix") else 0.0
    small_pool = family in ("preempt", "abort", "priority", "small-blocks") or chance(
        0.6 if combined else 0.4, "deferred", "reset", "connector", "async-spec-fail"
    )
    # Every group holds its own blocks (local groups fewer, once out-of-window ones go).
    groups = max(1, len(layout))
    max_need *= groups
    total_need = groups * sum(_cdiv(n + lookahead, block_size) for n in lengths.values())
    if small_pool:
        num_blocks = max_need + 1 + rng.randint(0, max(1, max_need // 2))
    else:
        num_blocks = total_need + rng.randint(1, 16)
    # Every request must fit alone (the full-sequence admission gate), watermark included.
    num_blocks = max(num_blocks, int((max_need + 2) / (1.0 - watermark)) + 2)

    if family == "chunked" or chance(0.4):
        max_num_batched_tokens = rng.randint(2, 8) * unit
    else:
        max_num_batched_tokens = rng.choice([128, 256, 512])
    max_num_seqs = rng.choice([2, 3, 4, 8, 16])
    max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs * (1 + spec_tokens) + 1)
    long_prefill = (
        rng.randint(1, 4) * unit
        if chance(0.5, "chunked") and max_num_batched_tokens > block_size
        else 0
    )
    if hybrid and long_prefill:
        # vLLM 0.33.0 pads a one-token admission (a one-token prompt, a hit up to the last
        # token) to 1 + k rows for spec decode, cuts it to the threshold, fails an assert.
        long_prefill = max(long_prefill, 1 + spec_tokens)

    aborts: list[Abort] = []
    if family in ("abort", "deferred") or chance(0.3, "async-spec-fail", "priority"):
        for _ in range(rng.randint(2, 8)):
            aborts.append(
                Abort(
                    rng.randint(0, last_arrival + 30),
                    rng.choice(["sched", "sched", "any"]),
                    rng.randrange(16),
                )
            )
    resets: list[tuple[int, bool]] = []
    if family == "reset" or chance(0.2):
        for _ in range(rng.randint(2, 6)):
            resets.append((rng.randint(0, last_arrival + 60), rng.random() < 0.5))

    return Scenario(
        family=family,
        seed=seed,
        engine=engine,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        requests=tuple(requests),
        enable_caching=family != "nocache" and not chance(0.1),
        events=family != "nocache" and rng.random() < 0.9,
        spec_tokens=spec_tokens,
        connector_policy=policy,
        long_prefill_token_threshold=long_prefill,
        watermark=watermark,
        reserve_full_isl=not chance(0.25, "preempt", "chunked", "priority", "small-blocks"),
        aborts=tuple(sorted(aborts, key=lambda a: (a.step, a.kind, a.k))),
        resets=tuple(sorted(resets)),
        scheduling_policy="priority" if priority else "fcfs",
        layout=layout,
        retention_interval=retention,
        hash_block_size=block_size // 2 if family == "gemma4" else None,
        connector_hma=connector_hma,
    )


# --------------------------------------------------------------------------------------
# The fake scheduler-side KV connector
# --------------------------------------------------------------------------------------


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
        last = _cdiv(local + ext, self.block_size)
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


# --------------------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------------------

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
    if isinstance(value, DiffConnectorMetadata):
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


# --------------------------------------------------------------------------------------
# Building the scheduler
# --------------------------------------------------------------------------------------


def build_vllm_config(scn: Scenario, model_dir: Path) -> VllmConfig:
    """``VllmConfig`` for ``scn`` (a config-only model, no tokenizer); async engines get
    ``async_scheduling``."""
    kv_events = (
        KVEventsConfig(enable_kv_cache_events=True, publisher="null") if scn.events else None
    )
    spec = (
        SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=scn.spec_tokens,
            prompt_lookup_min=1,
            prompt_lookup_max=2,
        )
        if scn.spec_tokens
        else None
    )
    transfer = (
        KVTransferConfig(
            kv_connector=(
                DiffFakeHMAConnector if scn.connector_hma else DiffFakeConnector
            ).__name__,
            kv_connector_module_path=DiffFakeConnector.__module__,
            kv_role="kv_both",
            kv_load_failure_policy=scn.connector_policy,  # type: ignore[arg-type]
        )
        if scn.connector_policy is not None
        else None
    )
    return cpu_vllm_config(
        model_dir,
        block_size=scn.block_size,
        num_blocks=scn.num_blocks,
        max_num_seqs=scn.max_num_seqs,
        max_num_batched_tokens=scn.max_num_batched_tokens,
        max_model_len=scn.max_model_len,
        enable_prefix_caching=scn.enable_caching,
        async_scheduling=scn.is_async,
        scheduler_options={
            "long_prefill_token_threshold": scn.long_prefill_token_threshold,
            "watermark": scn.watermark,
            "scheduler_reserve_full_isl": scn.reserve_full_isl,
            "policy": "priority" if scn.scheduling_policy == "priority" else "fcfs",
        },
        kv_events_config=kv_events,
        speculative_config=spec,
        kv_transfer_config=transfer,
    )


def build_kv_cache_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    """One full-attention group, as the engine core makes for the tiny model."""
    return kv_cache_config((GroupLayout("full"),), num_blocks, block_size, retention_interval=None)


def scenario_kv_cache_config(scn: Scenario) -> KVCacheConfig:
    """The scenario's layout: :func:`build_kv_cache_config` (one full-attention group) when
    it has none, else one group per item of ``scn.layout``, with its retention interval."""
    if not scn.layout:
        return build_kv_cache_config(scn.num_blocks, scn.block_size)
    return kv_cache_config(
        scn.layout, scn.num_blocks, scn.block_size, retention_interval=scn.retention_interval
    )


def build_scheduler(scn: Scenario, scheduler_cls: type[Scheduler], model_dir: Path) -> Scheduler:
    scheduler: Scheduler = cpu.build_scheduler(
        scheduler_cls,
        build_vllm_config(scn, model_dir),
        scenario_kv_cache_config(scn),
        hash_block_size=scn.hash_block_size,
    )
    return scheduler


# --------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """What one run produced: a record per step, plus facts about what it exercised."""

    scenario_id: str
    scheduler_cls: str
    manager_cls: str
    manager_type: type
    records: list[dict[str, Any]]
    finished: bool
    stalled: bool = False
    livelocked: bool = False
    coverage: Counter[str] = field(default_factory=Counter)


@dataclass
class _Pending:
    due: int
    load: LoadRecord
    fail: str | None


class Driver:
    """Feeds one scheduler a scenario's requests and fake model outputs, step by step."""

    def __init__(
        self,
        scn: Scenario,
        scheduler_cls: type[Scheduler],
        model_dir: Path,
        count_manager_calls: bool = False,
    ) -> None:
        self.scn = scn
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(scn.hash_block_size or scn.block_size, sha256)
        self.sched = build_scheduler(scn, scheduler_cls, model_dir)
        self.publisher = RecordingPublisher()
        self.sched.kv_event_publisher = self.publisher
        self.records: list[dict[str, Any]] = []
        self.coverage: Counter[str] = Counter()
        self.specs = {r.req_id: r for r in scn.requests}
        self.prompts: dict[str, list[int]] = {}
        self.generated: dict[str, list[int]] = {}
        self.done: set[str] = set()
        self.added: set[str] = set()
        self.pending_loads: list[_Pending] = []
        # Requests whose sync load the output of a step reports invalid, by that step.
        self.invalid_sync_loads: dict[int, list[str]] = {}
        self.quiet_steps = 0
        self.stalled = False
        self.furthest: dict[str, int] = {}  # each request's most computed tokens so far
        self.last_progress = 0
        self.livelocked = False
        self.last_event = max(
            [r.arrival_step for r in scn.requests]
            + [a.step for a in scn.aborts]
            + [step for step, _ in scn.resets]
        )
        if count_manager_calls:
            self._count_manager_calls()

    # -- coverage -------------------------------------------------------------------
    def _count_manager_calls(self) -> None:
        """Wrap a few manager methods on the instance to count the paths a run takes."""
        manager = self.sched.kv_cache_manager
        for name in ("pop_blocks_for_free", "evict_blocks", "free"):
            self._wrap(manager, name)
        self._wrap(manager, "cache_blocks", self._cache_blocks_args)
        self._wrap(manager.coordinator, "get_num_blocks_to_allocate")
        self._wrap(manager.block_pool, "free_blocks")

    def _wrap(
        self, obj: Any, name: str, inspect: Callable[[tuple[Any, ...]], None] | None = None
    ) -> None:
        inner = getattr(obj, name)
        coverage = self.coverage

        def counted(*args: Any, **kwargs: Any) -> Any:
            coverage[f"call:{name}"] += 1
            if inspect is not None:
                inspect(args + tuple(kwargs.values()))
            return inner(*args, **kwargs)

        setattr(obj, name, counted)

    def _cache_blocks_args(self, args: tuple[Any, ...]) -> None:
        """``cache_blocks(request, num_computed_tokens)``: count the negative counts that
        ``update_from_output`` passes when a failed load cut a request in flight back."""
        _, num_tokens = args
        if num_tokens < 0:
            self.coverage["call:cache_blocks_negative"] += 1

    # -- inputs ---------------------------------------------------------------------
    def _new_request(self, spec: ReqSpec) -> Request:
        prompt = list(spec.prompt)
        if spec.parent is not None:
            prompt = self.prompts[spec.parent] + self.generated[spec.parent] + prompt
            self.coverage["multiturn"] += 1
        room = self.scn.max_model_len - spec.max_tokens - self.scn.spec_tokens - 2
        prompt = prompt[:room]
        self.prompts[spec.req_id] = prompt
        self.generated[spec.req_id] = []
        extra: dict[str, Any] | None = None
        if spec.ext_blocks:
            extra = {
                "kv_transfer_params": {
                    "diff_ext_blocks": spec.ext_blocks,
                    "diff_async": spec.ext_async,
                }
            }
        params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True, extra_args=extra)
        return Request(
            request_id=spec.req_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            arrival_time=spec.arrival_time,
            block_hasher=self.hasher,
            priority=spec.priority,
        )

    def _add_arrivals(self, step: int, rec: dict[str, Any]) -> None:
        arrived = []
        for spec in self.scn.requests:
            if spec.req_id in self.added or spec.arrival_step > step:
                continue
            if spec.parent is not None and spec.parent not in self.done:
                continue
            self.sched.add_request(self._new_request(spec))
            self.added.add(spec.req_id)
            arrived.append(spec.req_id)
        if arrived:
            rec["arrived"] = arrived

    def _future_arrivals(self) -> bool:
        return len(self.added) < len(self.scn.requests)

    def _resets(self, step: int, rec: dict[str, Any]) -> None:
        for at, running in self.scn.resets:
            if at != step:
                continue
            try:
                ok: Any = self.sched.reset_prefix_cache(reset_running_requests=running)
            except RuntimeError as exc:
                ok = f"RuntimeError: {exc}"
            rec.setdefault("resets", []).append([running, ok])
            if ok is True:
                self.coverage["reset_ok_running" if running else "reset_ok"] += 1
            else:
                self.coverage["reset_refused"] += 1

    def _abort_targets(self, step: int, so: SchedulerOutput | None) -> list[str]:
        targets: list[str] = []
        for abort in self.scn.aborts:
            if abort.step != step:
                continue
            if abort.kind == "sched":
                ids = list(so.num_scheduled_tokens) if so is not None else []
            else:
                ids = sorted(r for r, req in self.sched.requests.items() if not req.is_finished())
            if ids:
                targets.append(ids[abort.k % len(ids)])
        return targets

    def _abort(self, targets: list[str], rec: dict[str, Any]) -> None:
        if not targets:
            return
        for req_id in targets:
            req = self.sched.requests.get(req_id)
            if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.coverage["abort_remote_kv"] += 1
        aborted = self.sched.finish_requests(targets, RequestStatus.FINISHED_ABORTED)
        rec["aborted"] = sorted(r.request_id for r in aborted)
        self.coverage["aborted"] += len(aborted)
        for req in aborted:
            self._finish(req.request_id)

    def _finish(self, req_id: str) -> None:
        self.done.add(req_id)

    # -- the fake model -------------------------------------------------------------
    def _model_output(self, step: int, so: SchedulerOutput) -> ModelRunnerOutput:
        """Sampled tokens for ``so``, decided as the worker would at execution time."""
        ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in ids:
            req = self.sched.requests[req_id]
            if req.is_prefill_chunk:
                sampled.append([])
                continue
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            accepted = crc("acc", req_id, step) % (len(drafts) + 1)
            tokens = [
                d if d >= 0 else fake_token(req_id, step, i)
                for i, d in enumerate(drafts[:accepted])
            ]
            tokens.append(fake_token(req_id, step, "bonus"))
            if drafts:
                self.coverage["spec_scheduled"] += 1
                self.coverage["spec_accepted"] += accepted
                self.coverage["spec_rejected"] += len(drafts) - accepted
            sampled.append(tokens)
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=self._connector_output(step, so),
        )

    def _connector_output(self, step: int, so: SchedulerOutput) -> KVConnectorOutput | None:
        connector = self.sched.connector
        if connector is None:
            return None
        assert isinstance(connector, DiffFakeConnector)
        invalid: set[int] = set()
        failed: set[str] = set()
        finished: set[str] = set()
        for load in connector.take_new_loads():
            fail = self.specs[load.req_id].fail if load.attempt == 1 else None
            if load.is_async:
                self.coverage["load_async"] += 1
                delay = 1 + crc("delay", load.req_id, load.attempt) % 3
                self.pending_loads.append(_Pending(step + delay, load, fail))
            else:
                self.coverage["load_sync"] += 1
                if fail is not None and load.external_block_ids:
                    invalid.add(self._pick(load))
                    self._count_invalid(step, load, "sync")
        keep: list[_Pending] = []
        for pending in self.pending_loads:
            if pending.due > step:
                keep.append(pending)
                continue
            finished.add(pending.load.req_id)
            if pending.fail == "invalid" and pending.load.external_block_ids:
                invalid.add(self._pick(pending.load))
                self._count_invalid(step, pending.load, "async")
            elif pending.fail == "failed_recving":
                failed.add(pending.load.req_id)
                self.coverage[f"failed_recving:{self.scn.connector_policy}"] += 1
        self.pending_loads = keep
        return KVConnectorOutput(
            finished_recving=finished or None,
            invalid_block_ids=invalid,
            failed_recving=failed,
        )

    def _count_invalid(self, step: int, load: LoadRecord, kind: str) -> None:
        policy = self.scn.connector_policy
        self.coverage[f"invalid_{kind}:{policy}"] += 1
        if self.scn.spec_tokens:
            self.coverage[f"invalid_with_spec:{policy}"] += 1
        if kind == "sync" and self.scn.is_async:
            self.invalid_sync_loads.setdefault(step, []).append(load.req_id)

    @staticmethod
    def _pick(load: LoadRecord) -> int:
        ids = load.external_block_ids
        return ids[crc("invalid", load.req_id, load.attempt) % len(ids)]

    def _propose_drafts(self, step: int, so: SchedulerOutput) -> None:
        """Sync engine with spec decode: the drafter's proposals after the step."""
        if not self.scn.spec_tokens or so.total_num_scheduled_tokens == 0:
            return
        req_ids: list[str] = []
        drafts: list[list[int]] = []
        for req_id in so.num_scheduled_tokens:
            n = crc("ndraft", req_id, step) % (self.scn.spec_tokens + 1)
            req_ids.append(req_id)
            drafts.append([fake_token("draft", req_id, step, i) for i in range(n)])
        self.sched.update_draft_token_ids(DraftTokenIds(req_ids, drafts))

    # -- recording ------------------------------------------------------------------
    def _record_schedule(self, so: SchedulerOutput, rec: dict[str, Any]) -> None:
        norm = normalise(so, "so")
        rec["schedule"] = norm
        for new in so.scheduled_new_reqs:
            if new.num_computed_tokens > 0:
                self.coverage["prefix_hit"] += 1
        cached = so.scheduled_cached_reqs
        self.coverage["resumed"] += len(cached.resumed_req_ids)
        if so.preempted_req_ids:
            self.coverage["preempted"] += len(so.preempted_req_ids)
            self.coverage[f"preempted:{self.scn.scheduling_policy}"] += len(so.preempted_req_ids)
            self.coverage[f"preempted:bs{self.scn.block_size}"] += len(so.preempted_req_ids)
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            if req.is_prefill_chunk and n > 1:
                self.coverage["prefill_chunk"] += 1
        if self.sched.deferred_frees:
            self.coverage["deferred_frees_pending"] += 1

    def _record_update(self, outputs: dict[int, EngineCoreOutputs], rec: dict[str, Any]) -> None:
        rec["outputs"] = normalise_engine_outputs(outputs)
        rec["events"] = normalise_events(self.publisher.take())
        if rec["events"]:
            self.coverage["event_batches"] += 1
        errors = sum(
            out.finish_reason == FinishReason.ERROR
            for eco in outputs.values()
            for out in eco.outputs
        )
        if errors > 1:
            # Several requests failed at once: vLLM finishes (and frees) them in the
            # iteration order of a set of request ids.
            self.coverage["multi_error_step"] += 1
        for eco in outputs.values():
            for out in eco.outputs:
                self.generated.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    self._finish(out.request_id)
                    if out.finish_reason == FinishReason.ERROR:
                        self.coverage["finished_error"] += 1
                    elif out.finish_reason == FinishReason.ABORT:
                        self.coverage["finished_abort"] += 1
                if out.prefill_stats is not None and out.prefill_stats.num_cached_tokens:
                    self.coverage["prefill_stats_cached"] += 1
            stats = eco.scheduler_stats
            if stats is not None and stats.prefix_cache_stats.reset:
                self.coverage["stats_reset"] += 1
            if stats is not None and stats.prefix_cache_stats.preempted_requests:
                self.coverage["stats_preempted"] += 1

    def _count_invalid_in_flight(
        self, sched_step: int, so: SchedulerOutput, mro: ModelRunnerOutput
    ) -> None:
        """Before the update of step ``sched_step``: count the requests whose sync load it
        reports invalid while a later batch, already scheduled, holds more of their tokens
        (the failure rolls back tokens that the later batch's update accounts for), and the
        running requests that its invalid blocks meet with fewer computed tokens than it
        scheduled (an earlier rollback took them back; vLLM then scans none of their blocks)."""
        kv_output = mro.kv_connector_output
        if kv_output is not None and kv_output.invalid_block_ids:
            for running in self.sched.running:
                if running.num_computed_tokens < so.num_scheduled_tokens.get(running.request_id, 0):
                    self.coverage["invalid_scan_behind"] += 1
        for req_id in self.invalid_sync_loads.pop(sched_step, []):
            req = self.sched.requests.get(req_id)
            if req is None or req.is_finished():
                continue
            if req.num_in_flight_tokens > so.num_scheduled_tokens.get(req_id, 0):
                self.coverage["invalid_sync_in_flight"] += 1
                if self.scn.spec_tokens:
                    self.coverage["invalid_sync_in_flight_spec"] += 1

    # -- engines --------------------------------------------------------------------
    def run(self) -> bool:
        """Drive until no request is left; False if it stalled, livelocked or ``max_steps``
        ran out."""
        if self.scn.is_async:
            return self._run_batch_queue()
        return self._run_sync()

    def _stalled(self, step: int, so: SchedulerOutput | None) -> bool:
        """Whether nothing has been scheduled for a long while and nothing can change.

        vLLM 0.33.0 itself can stall: a request whose async load failed with nothing
        valid stays in ``_inflight_prefills``, so its re-admission reserves its own
        remaining blocks on top of what it allocates, and in a small pool it never fits.
        """
        if so is not None and so.total_num_scheduled_tokens > 0:
            self.quiet_steps = 0
            return False
        self.quiet_steps += 1
        if self.quiet_steps < STALL_STEPS or self.pending_loads or step <= self.last_event:
            return False
        self.records[-1]["stalled"] = True
        self.stalled = True
        return True

    def _livelocked(self, step: int) -> bool:
        """Whether tokens are still scheduled but no request has got further for a long
        while, and nothing can change.

        vLLM 0.33.0 itself can livelock: under the ``priority`` policy, with prefix caching
        off and no full-sequence reservation, two requests of equal priority and arrival
        time that do not fit together keep preempting each other (``max`` picks the first
        of them in ``running``, the one further along) and recompute from scratch.
        """
        for req_id, req in self.sched.requests.items():
            if req.num_computed_tokens > self.furthest.get(req_id, -1):
                self.furthest[req_id] = req.num_computed_tokens
                self.last_progress = step
        since = step - max(self.last_progress, self.last_event)
        if since < LIVELOCK_STEPS or self.pending_loads:
            return False
        self.records[-1]["livelocked"] = True
        self.livelocked = True
        self.coverage["livelocked"] += 1
        return True

    def _run_sync(self) -> bool:
        """``EngineCore.step`` (+ ``post_step``'s drafts), one scheduler step per tick."""
        for step in range(self.scn.max_steps):
            rec: dict[str, Any] = {"step": step}
            self.records.append(rec)
            self._add_arrivals(step, rec)
            self._resets(step, rec)
            if not self.sched.has_requests():
                if not self._future_arrivals():
                    return True
                rec["idle"] = True
                continue
            so = self.sched.schedule()
            self._record_schedule(so, rec)
            mro = self._model_output(step, so)
            self._abort(self._abort_targets(step, so), rec)
            outputs = self.sched.update_from_output(so, mro)
            self._record_update(outputs, rec)
            self._propose_drafts(step, so)
            if self._stalled(step, so) or self._livelocked(step):
                return False
        return False

    def _run_batch_queue(self) -> bool:
        """``EngineCore.step_with_batch_queue`` with a queue of two batches."""
        queue: deque[tuple[int, SchedulerOutput, ModelRunnerOutput]] = deque()
        for step in range(self.scn.max_steps):
            rec: dict[str, Any] = {"step": step}
            self.records.append(rec)
            self._add_arrivals(step, rec)
            self._resets(step, rec)
            newest: SchedulerOutput | None = None
            if self.sched.has_requests():
                so = self.sched.schedule()
                newest = so
                self._record_schedule(so, rec)
                executed = so.total_num_scheduled_tokens > 0
                queue.appendleft((step, so, self._model_output(step, so)))
                if self._stalled(step, so) or self._livelocked(step):
                    return False
                if len(queue) < 2 and (executed or self.sched.has_requests()):
                    continue
            elif not queue:
                if not self._future_arrivals():
                    return True
                rec["idle"] = True
                continue
            sched_step, old_so, mro = queue.pop()
            rec["update_of"] = sched_step
            self._count_invalid_in_flight(sched_step, old_so, mro)
            self._abort(self._abort_targets(step, newest), rec)
            outputs = self.sched.update_from_output(old_so, mro)
            self._record_update(outputs, rec)
        return False


def run_scenario(
    scn: Scenario,
    scheduler_cls: type[Scheduler],
    model_dir: Path,
    count_manager_calls: bool = False,
) -> RunResult:
    """Run ``scn`` on a fresh ``scheduler_cls``; an exception ends the records with it."""
    driver = Driver(scn, scheduler_cls, model_dir, count_manager_calls)
    manager_cls = type(driver.sched.kv_cache_manager)
    try:
        finished = driver.run()
    except Exception as exc:  # the candidate raising is a difference to report
        # Into the step that raised, so the first difference names the exception.
        if not driver.records:
            driver.records.append({"step": -1})
        driver.records[-1]["exception"] = f"{type(exc).__name__}: {exc}"
        finished = False
    return RunResult(
        scenario_id=scn.scenario_id,
        scheduler_cls=f"{scheduler_cls.__module__}.{scheduler_cls.__qualname__}",
        manager_cls=f"{manager_cls.__module__}.{manager_cls.__qualname__}",
        manager_type=manager_cls,
        records=driver.records,
        finished=finished,
        stalled=driver.stalled,
        livelocked=driver.livelocked,
        coverage=driver.coverage,
    )


# --------------------------------------------------------------------------------------
# Comparing two runs
# --------------------------------------------------------------------------------------


@dataclass
class Mismatch:
    """The first step at which two runs differ, with every differing field of it."""

    scenario_id: str
    step: int
    diffs: list[tuple[str, Any, Any]]
    reference: str
    candidate: str

    def __str__(self) -> str:
        lines = [
            f"scenario {self.scenario_id}: first difference at step {self.step}",
            f"  reference = {self.reference}",
            f"  candidate = {self.candidate}",
        ]
        for path, ref, cand in self.diffs[:12]:
            lines.append(f"  field {path}:")
            lines.append(f"    reference: {_short(ref)}")
            lines.append(f"    candidate: {_short(cand)}")
        if len(self.diffs) > 12:
            lines.append(f"  ... and {len(self.diffs) - 12} more differing fields")
        lines.append(
            f"  reproduce: {sys.executable} {Path(__file__).resolve()} "
            f"{self.scenario_id} [--repeat N]"
        )
        return "\n".join(lines)


def _short(value: Any, limit: int = 600) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def diff_values(ref: Any, cand: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """Every leaf path at which two normalised values differ."""
    if isinstance(ref, dict) and isinstance(cand, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in list(ref) + [k for k in cand if k not in ref]:
            if key == "__type__":
                continue
            out.extend(
                diff_values(ref.get(key, "<absent>"), cand.get(key, "<absent>"), f"{path}.{key}")
            )
        if ref.get("__type__") != cand.get("__type__"):
            out.insert(0, (f"{path}.__type__", ref.get("__type__"), cand.get("__type__")))
        return out
    if isinstance(ref, list) and isinstance(cand, list):
        if len(ref) != len(cand):
            return [(f"{path} (length {len(ref)} vs {len(cand)})", ref, cand)]
        out = []
        for i, (a, b) in enumerate(zip(ref, cand, strict=True)):
            out.extend(diff_values(a, b, f"{path}[{i}]"))
        return out
    if ref != cand or type(ref) is not type(cand):
        return [(path or "<root>", ref, cand)]
    return []


def compare_runs(reference: RunResult, candidate: RunResult) -> Mismatch | None:
    """None if both runs recorded the same thing at every step, else the first difference."""
    for i in range(max(len(reference.records), len(candidate.records))):
        ref = reference.records[i] if i < len(reference.records) else {"step": "<no more steps>"}
        cand = candidate.records[i] if i < len(candidate.records) else {"step": "<no more steps>"}
        if ref != cand:
            step = ref.get("step", cand.get("step", i))
            diffs = diff_values(ref, cand) or [("<record>", ref, cand)]
            diffs.sort(key=lambda d: d[0] != ".exception")  # an exception first (stable)
            return Mismatch(
                reference.scenario_id,
                step if isinstance(step, int) else i,
                diffs,
                f"{reference.scheduler_cls} with {reference.manager_cls}",
                f"{candidate.scheduler_cls} with {candidate.manager_cls}",
            )
    if reference.finished != candidate.finished:
        return Mismatch(
            reference.scenario_id,
            len(reference.records),
            [("finished", reference.finished, candidate.finished)],
            reference.scheduler_cls,
            candidate.scheduler_cls,
        )
    return None


# --------------------------------------------------------------------------------------
# Scheduler class pairs
# --------------------------------------------------------------------------------------


def stock_class(scn: Scenario) -> type[Scheduler]:
    """vLLM's own scheduler class for the scenario's engine."""
    return AsyncScheduler if scn.is_async else Scheduler


def kvblocks_class(scn: Scenario) -> type[Scheduler]:
    """kvblocks' scheduler subclass for the scenario's engine."""
    from kvblocks.vllm import KVBlocksAsyncScheduler, KVBlocksScheduler  # noqa: PLC0415 (the stock candidate never needs it)

    return KVBlocksAsyncScheduler if scn.is_async else KVBlocksScheduler


def candidate_class(scn: Scenario, candidate: str) -> type[Scheduler]:
    """``"kvblocks"``: kvblocks' subclass; ``"stock"``: vLLM's class (harness self-check)."""
    if candidate == "stock":
        return stock_class(scn)
    if candidate == "kvblocks":
        return kvblocks_class(scn)
    raise ValueError(f"unknown candidate {candidate!r} (use 'kvblocks' or 'stock')")


def differential(
    scn: Scenario, model_dir: Path, candidate: str = "kvblocks"
) -> tuple[RunResult, RunResult, Mismatch | None]:
    """Run ``scn`` with vLLM's scheduler and with the candidate, and compare."""
    reference = run_scenario(scn, stock_class(scn), model_dir, count_manager_calls=True)
    other = run_scenario(scn, candidate_class(scn, candidate), model_dir)
    return reference, other, compare_runs(reference, other)


def all_scenarios(seeds_per_family: int) -> Iterable[Scenario]:
    for family in FAMILIES:
        for engine in FAMILY_ENGINES[family]:
            for seed in range(seeds_per_family):
                yield make_scenario(family, seed, engine)


#: Scenario families whose requests can fail together under the ``fail`` policy.
FAILING_FAMILIES = ("connector", "deferred", "mixed", "async-spec-fail", "combined")


def failing_together(
    model_dir: Path, candidate: str, seeds: int, repeats: int
) -> tuple[list[str], list[Mismatch]]:
    """Replay, ``repeats`` times each, the scenarios in which vLLM fails several requests
    in one step (``fail`` policy), and return their ids and the differences found.

    vLLM finishes and frees such requests in the iteration order of a set of their ids,
    which depends on ``PYTHONHASHSEED`` and on the order the ids went in; that order
    decides the free queue and so later block ids. A candidate that builds the set in
    another order differs only when two ids collide in the set's table, so only under
    some seeds, and a candidate whose order varies from run to run differs only on some
    runs: hence the repeats (and a fixed seed in a subprocess, in the tests).
    """
    checked: list[str] = []
    mismatches: list[Mismatch] = []
    for family in FAILING_FAMILIES:
        for engine in FAMILY_ENGINES[family]:
            for seed in range(seeds):
                scn = make_scenario(family, seed, engine)
                if scn.connector_policy != "fail":
                    continue
                reference = run_scenario(scn, stock_class(scn), model_dir, count_manager_calls=True)
                if not reference.coverage["multi_error_step"]:
                    continue
                checked.append(scn.scenario_id)
                for _ in range(repeats):
                    other = run_scenario(scn, candidate_class(scn, candidate), model_dir)
                    mismatch = compare_runs(reference, other)
                    if mismatch is not None:
                        mismatches.append(mismatch)
                        break
    return checked, mismatches


def main(argv: list[str]) -> int:
    """``harness.py SCENARIO_ID [stock|kvblocks] [--repeat N]``: replay one scenario on
    vLLM's scheduler and on the candidate (N times), print the first difference.
    ``harness.py --failing-together [stock|kvblocks] [--repeat N] [--seeds S]``: the
    check of :func:`failing_together`."""
    import argparse  # noqa: PLC0415 (only the command line needs it)
    import tempfile  # noqa: PLC0415 (only the command line needs it)

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("scenario_id", nargs="?", help="e.g. connector-s3-async")
    parser.add_argument("candidate", nargs="?", default="kvblocks", choices=["kvblocks", "stock"])
    parser.add_argument("--repeat", type=int, default=1, help="candidate runs (default 1)")
    parser.add_argument("--failing-together", action="store_true")
    parser.add_argument("--seeds", type=int, default=20, help="seeds per family (default 20)")
    args = parser.parse_args(argv)
    if args.failing_together:
        if args.scenario_id in ("kvblocks", "stock"):
            args.candidate = args.scenario_id
        with tempfile.TemporaryDirectory() as tmp:
            checked, mismatches = failing_together(
                write_config_only_model(Path(tmp)), args.candidate, args.seeds, args.repeat
            )
        print(f"checked {len(checked)} scenarios: {' '.join(checked)}")
        for found in mismatches:
            print(found)
        return 1 if mismatches or not checked else 0
    if args.scenario_id is None:
        parser.error("a scenario id or --failing-together is needed")
    scn = make_scenario(*parse_scenario_id(args.scenario_id))
    print(scn)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config_only_model(Path(tmp))
        ref = run_scenario(scn, stock_class(scn), model_dir, count_manager_calls=True)
        print(f"reference: {len(ref.records)} steps, finished={ref.finished}")
        print(f"  covers {dict(sorted(ref.coverage.items()))}")
        for attempt in range(1, args.repeat + 1):
            cand = run_scenario(scn, candidate_class(scn, args.candidate), model_dir)
            mismatch = compare_runs(ref, cand)
            print(f"candidate run {attempt}: {len(cand.records)} steps, {cand.manager_cls}")
            if mismatch is not None:
                print(mismatch)
                return 1
    print("no difference")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
