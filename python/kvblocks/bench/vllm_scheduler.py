"""The ``vllm_scheduler`` group of ``kvblocks bench``: vLLM's own ``Scheduler``, step for step,
with vLLM's KV cache manager and with kvblocks' (``kvblocks.vllm.KVBlocksScheduler``).

Both schedulers are vLLM 0.33.0's real ``Scheduler`` class, built in this process from a
directory holding only a ``config.json`` (no model, no tokenizer), and driven as the
synchronous engine drives them: ``add_request`` for arrivals, then each step
``schedule()``, a fake ``ModelRunnerOutput`` and ``update_from_output()``. Only the two
scheduler calls are timed (``perf_counter`` around each, summed): the requests, their
block hashes and the model outputs are made between them.

The load (seeded; both schedulers replay it exactly):

* ``N`` requests in the system at all times (64, 256 or 1,024): a shared 1,024-token
  system prompt, then 64-2,048 random tokens of their own, 32-256 output tokens
  (``ignore_eos``); every finished request is replaced by the next one before the
  following step, so admissions go on while most requests decode.
* 65,536 blocks of 16 tokens, 8,192 batched tokens a step, chunked prefill, prefix
  caching on, ``max_num_seqs`` at least ``N``. At 1,024 requests the pool holds about
  900 of them at once; the rest wait, as in a saturated server.
* Each round builds both schedulers afresh and warms them up until half as many
  requests as ``N`` have been replaced after the first ``N`` (the pool filled, a
  decode-dominated mix with ongoing admissions), then times a fixed number of steps.
* The ``kv_load`` variant adds a fake KV connector (:data:`CONNECTOR_CLASS`, loaded by
  vLLM from this module): every fourth request loads up to 256 tokens past its local
  prefix hit synchronously, and every fifth step one block of a load made in that step
  fails (``invalid_block_ids``, ``kv_load_failure_policy="recompute"``).
* The hybrid rows (:data:`HYBRID_LAYOUTS`; 256 requests, 64 with ``--quick``) run the
  same load on a model with several KV cache groups, as vLLM's hybrid manager sees one:
  ``vllm_scheduler_gpt_oss_256`` one sliding-window group (window 128) and one
  full-attention group, ``vllm_scheduler_gemma3_256`` six sliding-window groups (window
  1,024) and one full group (``kvblocks.vllm.cpu.kv_cache_config``, retention interval
  0, vLLM's engine default). All groups allocate from one pool, so it gets the
  single-group row's 65,536 blocks for the full group plus, per sliding-window group,
  what it holds once its windows fill: ``cdiv(window - 1, 16) + 1`` blocks per request,
  and one step's worth of prefill (8,192 tokens) that it frees the step after.

On the hybrid rows kvblocks' scheduler may build vLLM's own manager (``kvblocks.vllm``
falls back for a configuration it does not manage). The row then still runs, but its
description says ``FALLBACK`` and names the manager class on each side: its ratio is
vLLM against vLLM, not a measurement of kvblocks. The classes are found by building
the kvblocks side's scheduler once when the row is built, and checked every round.

The model output of a step lists exactly that step's scheduled requests: no token for
a request still in its prefill, else one fixed token per request. At the end of each
round the sequence of scheduled token counts (every step, warm-up included) must equal
the other scheduler's, a cheap check that both made the same decisions. On the hybrid
rows every request's block table must have one row per group, and a sliding-window
group must hold no more than its window's blocks for a request well past it (checked
on the kvblocks side, whichever manager it runs). On the single-group rows kvblocks'
scheduler must run kvblocks' manager (a fallback to vLLM's fails the run), and the
``vllm`` logger is set to ERROR: it logs each recovered load failure from inside
``update_from_output()``.

Every vLLM import is lazy: the module imports, and :func:`status` says why the group
is absent, without vLLM.
"""

from __future__ import annotations

import atexit
import functools
import gc
import importlib
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from kvblocks.bench import vllm_runner
from kvblocks.bench.workload import Workload, WorkloadSpec, deferred

__all__ = [
    "CONNECTOR_CLASS",
    "DECODE_SIZES",
    "GROUP",
    "HYBRID_LAYOUTS",
    "HYBRID_QUICK_SIZE",
    "HYBRID_SIZE",
    "KV_LOAD_SIZES",
    "LONG_PROMPT_QUICK_SIZE",
    "LONG_PROMPT_SIZE",
    "LONG_PROMPT_TOKENS",
    "SIZES",
    "HybridLayout",
    "HybridManagers",
    "RoundRecord",
    "available",
    "hybrid_managers",
    "hybrid_num_blocks",
    "status",
    "vllm_scheduler",
    "vllm_scheduler_hybrid",
    "workload_specs",
]

#: The prefix of every workload name in the group (``--workload vllm_scheduler``).
GROUP = "vllm_scheduler"
#: Requests kept in the system, one workload each.
SIZES = (64, 256, 1_024)
#: The sizes of the KV-connector variant.
KV_LOAD_SIZES = (64, 256, 1_024)
#: The fake KV connector's class name, looked up in this module by vLLM's connector
#: factory (``kv_connector_module_path``).
CONNECTOR_CLASS = "BenchLoadConnector"

_BLOCK_SIZE = 16
_NUM_BLOCKS = 65_536
_MAX_BATCHED_TOKENS = 8_192
_MAX_MODEL_LEN = 4_096
_VOCAB = 1_000
_SYSTEM_TOKENS = 1_024
_SUFFIX_TOKENS = (64, 2_048)
_OUTPUT_TOKENS = (32, 256)
#: The decode loads: each decoding request's prompt and output lengths (none finishes
#: within a round: warm-up and timed steps stay below the output length).
_DECODE_PROMPT_TOKENS = 512
_DECODE_OUTPUT_TOKENS = 1_024
#: Decode loads: ``N`` decoding, prefix caching off (as in vLLM's own step benchmarks).
DECODE_SIZES = (128, 256)
#: The long-prompt load: ``N`` decoding while prompts of this many tokens arrive ...
LONG_PROMPT_TOKENS = 8_192
#: ... at this ``N`` ...
LONG_PROMPT_SIZE = 256
#: ... and with ``--quick``.
LONG_PROMPT_QUICK_SIZE = 64
#: Warm-up stops once this fraction of ``N`` requests have been replaced.
_WARMUP_REPLACED = 0.5
#: A warm-up that has not reached its steady state after this many steps is a bug.
_MAX_WARMUP_STEPS = 20_000
#: Connector variant: one request in this many loads external tokens ...
_LOAD_EVERY = 4
#: ... at most this many, past its local prefix hit ...
_LOAD_TOKENS = 256
#: ... and one block of a load fails on every step that is a multiple of this.
_FAIL_EVERY = 5

_SCHEDULER = "vllm.v1.core.sched.scheduler"

# The schedulers run no model: a CPU device config and no hub access are all they need,
# and this CUDA wheel cannot detect a CPU platform by itself. vLLM resolves its platform
# once, on first use, so this is set when the bench is imported, before vLLM is; values
# already set win.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[bool, str]:
    if not vllm_runner.available():
        return False, vllm_runner.status()
    try:
        importlib.import_module("kvblocks.vllm").KVBlocksScheduler  # noqa: B018
    except Exception as exc:  # any failure means "not available"
        return False, f"kvblocks.vllm is not importable here ({type(exc).__name__}: {exc})"
    # On a newer vLLM kvblocks' schedulers run vLLM's own manager: no comparison to make.
    newer = importlib.import_module("kvblocks.vllm._version_check").newer_version_reason()
    if newer is not None:
        return False, f"{newer}; kvblocks' schedulers run vLLM's own manager there"
    return True, f"{vllm_runner.status()}, kvblocks.vllm.KVBlocksScheduler"


def status() -> str:
    """Why the group is absent, or what it runs (imports vLLM once, then cached).

    Returns:
        ``"vLLM <version>, kvblocks.vllm.KVBlocksScheduler"`` when the group can run,
        else why not (vLLM not importable, or ``kvblocks.vllm`` not importable).
    """
    return _probe()[1]


def available() -> bool:
    """Whether the group can run: vLLM and ``kvblocks.vllm`` both import."""
    return _probe()[0]


# --------------------------------------------------------------------------- the load


@dataclass(frozen=True, slots=True)
class _Script:
    """The mixed load: the requests, by index. Each one's tokens and output length
    depend only on its index and the seed, so both schedulers get the same ones in the
    same order.

    Attributes:
        num_requests: ``N``, the requests kept in the system.
        seed: Seeds the requests.
        system: The shared system prompt.
        prefix_caching: Whether the scheduler caches prefixes.
        max_model_len: The model's context length.
    """

    num_requests: int
    seed: int
    system: list[int]
    prefix_caching: bool = True
    max_model_len: int = _MAX_MODEL_LEN

    @property
    def in_system(self) -> int:
        """Unfinished requests (running or waiting) kept at every step."""
        return self.num_requests

    def request(self, index: int) -> tuple[list[int], int]:
        """``(prompt token ids, max output tokens)`` of request ``index``."""
        rng = random.Random(self.seed * 1_000_003 + index)
        suffix = [rng.randrange(_VOCAB) for _ in range(rng.randint(*_SUFFIX_TOKENS))]
        return self.system + suffix, rng.randint(*_OUTPUT_TOKENS)

    def warmed_up(self, num_added: int, scheduler: Any) -> bool:
        """Whether ``_WARMUP_REPLACED * N`` requests have replaced finished ones."""
        return num_added >= self.num_requests + int(self.num_requests * _WARMUP_REPLACED)


def _script(num_requests: int, seed: int) -> _Script:
    rng = random.Random(seed)
    return _Script(num_requests, seed, [rng.randrange(_VOCAB) for _ in range(_SYSTEM_TOKENS)])


@dataclass(frozen=True, slots=True)
class _DecodeScript:
    """The decode loads: ``N`` requests (:data:`_DECODE_PROMPT_TOKENS` random tokens
    each) that all decode through the timed steps, none finishing. With
    ``long_prompt``, one more request at a time: a prompt of that many random tokens
    that arrives, is prefilled in chunks beside the decodes and finishes after one
    token, replaced by the next.

    Attributes:
        num_requests: ``N``, the decoding requests.
        seed: Seeds the requests.
        long_prompt: The arriving prompts' length (0: none arrive).
        prefix_caching: Whether the scheduler caches prefixes.
        max_model_len: The model's context length.
    """

    num_requests: int
    seed: int
    long_prompt: int = 0
    prefix_caching: bool = False
    max_model_len: int = _MAX_MODEL_LEN

    @property
    def in_system(self) -> int:
        """Unfinished requests (running or waiting) kept at every step."""
        return self.num_requests + (1 if self.long_prompt else 0)

    def request(self, index: int) -> tuple[list[int], int]:
        """``(prompt token ids, max output tokens)`` of request ``index``: the decoding
        ones first, then the arriving long prompts."""
        rng = random.Random(self.seed * 1_000_003 + index)
        if index < self.num_requests:
            prompt = [rng.randrange(_VOCAB) for _ in range(_DECODE_PROMPT_TOKENS)]
            return prompt, _DECODE_OUTPUT_TOKENS
        return [rng.randrange(_VOCAB) for _ in range(self.long_prompt)], 1

    def warmed_up(self, num_added: int, scheduler: Any) -> bool:
        """Whether every decoding request has sampled its first token."""
        requests = scheduler.requests
        return num_added >= self.in_system and all(
            requests[f"r{i}"].num_output_tokens > 0 for i in range(self.num_requests)
        )


@functools.lru_cache(maxsize=2)
def _model_dir(max_model_len: int) -> str:
    """A directory holding only a tiny Llama ``config.json`` whose context holds
    ``max_model_len`` tokens: the model vLLM's configs need."""
    from kvblocks.vllm.cpu import write_config_only_model  # noqa: PLC0415 (kvblocks.vllm imports vLLM)

    path = Path(tempfile.mkdtemp(prefix="kvblocks-bench-model-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return str(write_config_only_model(path, max(max_model_len, _MAX_MODEL_LEN)))


def _build_scheduler(
    scheduler_cls: Any,
    script: _Script | _DecodeScript,
    kv_load: bool,
    groups: Sequence[Any] | None = None,
) -> Any:
    """A ``scheduler_cls`` (vLLM's ``Scheduler`` or a subclass) for ``script``'s load:
    one full-attention group of :data:`_NUM_BLOCKS` blocks, or with ``groups`` (a hybrid
    row's ``GroupLayout``s) one group each, in a pool of :func:`hybrid_num_blocks`."""
    config = importlib.import_module("vllm.config")
    cpu = importlib.import_module("kvblocks.vllm.cpu")
    kv_transfer_config = None
    if kv_load:
        kv_transfer_config = config.KVTransferConfig(
            kv_connector=CONNECTOR_CLASS,
            kv_connector_module_path=__name__,
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
        )
    if groups is None:
        num_blocks, layout = _NUM_BLOCKS, (cpu.GroupLayout("full"),)
    else:
        num_blocks, layout = hybrid_num_blocks(groups, script.num_requests), tuple(groups)
    vllm_config = cpu.cpu_vllm_config(
        _model_dir(script.max_model_len),
        block_size=_BLOCK_SIZE,
        num_blocks=num_blocks,
        max_num_seqs=max(script.in_system, 256),
        max_num_batched_tokens=_MAX_BATCHED_TOKENS,
        max_model_len=script.max_model_len,
        enable_prefix_caching=script.prefix_caching,
        kv_transfer_config=kv_transfer_config,
    )
    # Hybrid rows: retention interval 0, vLLM's engine default for them.
    retention = 0 if groups is not None else None
    kv_cache_config = cpu.kv_cache_config(
        layout, num_blocks, _BLOCK_SIZE, retention_interval=retention
    )
    return cpu.build_scheduler(scheduler_cls, vllm_config, kv_cache_config)


# --------------------------------------------------------------------------- connector


@functools.lru_cache(maxsize=1)
def _connector_class() -> type:
    """``BenchLoadConnector``: a KV connector whose loads are synchronous and free.

    Every ``_LOAD_EVERY``-th request (by index) gets up to ``_LOAD_TOKENS`` external
    tokens past its block-aligned local hit, keeping at least one token to compute. It
    keeps the block ids of each step's loads (``loads``, a list per loading request in
    allocation order) for the driver, which reports some of them as failed.
    """
    base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")

    class BenchLoadConnector(base.KVConnectorBase_V1):  # type: ignore[misc,name-defined]
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            self._local_hit: dict[str, int] = {}
            self._step_loads: list[list[int]] = []
            self.loads: list[list[int]] = []

        # Worker side: nothing to move.
        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            pass

        def wait_for_layer_load(self, layer_name: str) -> None:
            pass

        def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
            pass

        def wait_for_save(self) -> None:
            pass

        # Scheduler side.
        def get_num_new_matched_tokens(
            self, request: Any, num_computed_tokens: int
        ) -> tuple[int, bool]:
            if int(request.request_id[1:]) % _LOAD_EVERY != 1:
                return 0, False
            limit = (request.num_prompt_tokens - 1) // _BLOCK_SIZE * _BLOCK_SIZE
            external = max(0, min(num_computed_tokens + _LOAD_TOKENS, limit) - num_computed_tokens)
            if external:
                self._local_hit[request.request_id] = num_computed_tokens
            return external, False

        def update_state_after_alloc(
            self, request: Any, blocks: Any, num_external_tokens: int
        ) -> None:
            if num_external_tokens:
                start = self._local_hit.pop(request.request_id) // _BLOCK_SIZE
                table = blocks.get_block_ids()[0]
                self._step_loads.append(
                    list(table[start : start + num_external_tokens // _BLOCK_SIZE])
                )

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            self.loads, self._step_loads = self._step_loads, []
            self._local_hit.clear()
            return base.KVConnectorMetadata()

    BenchLoadConnector.__name__ = BenchLoadConnector.__qualname__ = CONNECTOR_CLASS
    BenchLoadConnector.__module__ = __name__
    return BenchLoadConnector


def __getattr__(name: str) -> Any:
    """``BenchLoadConnector``, made on first access (it subclasses a vLLM class)."""
    if name == CONNECTOR_CLASS:
        return _connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- the driver


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """What one round did, beyond its time.

    Attributes:
        steps: Steps timed.
        mean_running: Mean length of ``scheduler.running`` over the timed steps.
        mean_tokens: Mean tokens scheduled per timed step.
        failed_loads: Steps with an injected load failure, warm-up included.
    """

    steps: int
    mean_running: float
    mean_tokens: float
    failed_loads: int


class _Driver:
    """One scheduler and the engine around it: arrivals, fake model outputs, records.

    Attributes:
        scheduler: The vLLM ``Scheduler`` (or subclass) driven.
        scheduled: Per step, the ``(request id, tokens)`` pairs it scheduled, in order.
    """

    __slots__ = (
        "_hasher",
        "_kv_output",
        "_model_runner_output",
        "_next",
        "_request",
        "_sampling_params",
        "_script",
        "_tokens",
        "failed_loads",
        "scheduled",
        "scheduler",
    )

    def __init__(
        self,
        scheduler_cls: Any,
        script: _Script | _DecodeScript,
        kv_load: bool,
        groups: Sequence[Any] | None = None,
    ) -> None:
        kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
        hashing = importlib.import_module("vllm.utils.hashing")
        outputs = importlib.import_module("vllm.v1.outputs")
        self._request = importlib.import_module("vllm.v1.request").Request
        self._sampling_params = importlib.import_module("vllm.sampling_params").SamplingParams
        self._model_runner_output = outputs.ModelRunnerOutput
        self._kv_output = outputs.KVConnectorOutput if kv_load else None
        kv_cache_utils.init_none_hash(hashing.sha256)
        # vLLM's engine hashes requests only for the prefix cache or a KV connector.
        self._hasher = (
            kv_cache_utils.get_request_block_hasher(_BLOCK_SIZE, hashing.sha256)
            if script.prefix_caching or kv_load
            else None
        )
        self._script = script
        self._next = 0
        #: The fixed token each request samples, by request id.
        self._tokens: dict[str, int] = {}
        self.failed_loads = 0
        self.scheduled: list[tuple[tuple[str, int], ...]] = []
        self.scheduler = _build_scheduler(scheduler_cls, script, kv_load, groups)

    def _top_up(self) -> None:
        """Adds requests until the script's count are unfinished (running or waiting)."""
        scheduler = self.scheduler
        while scheduler.get_num_unfinished_requests() < self._script.in_system:
            prompt, max_tokens = self._script.request(self._next)
            request_id = f"r{self._next}"
            self._tokens[request_id] = (self._next * 31 + 7) % _VOCAB
            scheduler.add_request(
                self._request(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling_params=self._sampling_params(max_tokens=max_tokens, ignore_eos=True),
                    pooling_params=None,
                    arrival_time=0.0,
                    block_hasher=self._hasher,
                )
            )
            self._next += 1

    def _output(self, step: int, scheduler_output: Any) -> Any:
        """The fake model output of a step: a fixed token per decoding request, none for a
        prefill chunk, and with the connector some loads failed."""
        ids = list(scheduler_output.num_scheduled_tokens)
        requests = self.scheduler.requests
        tokens = self._tokens
        kv_connector_output = None
        if self._kv_output is not None:
            loads = self.scheduler.connector.loads
            if step % _FAIL_EVERY == 0 and loads:
                self.failed_loads += 1
                first = loads[0]
                kv_connector_output = self._kv_output(invalid_block_ids={first[len(first) // 2]})
        return self._model_runner_output(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[
                [] if requests[rid].is_prefill_chunk else [tokens[rid]] for rid in ids
            ],
            kv_connector_output=kv_connector_output,
        )

    def step(self) -> float:
        """One engine step; returns the seconds spent in ``schedule()`` and
        ``update_from_output()``."""
        self._top_up()
        scheduler = self.scheduler
        step = len(self.scheduled)
        start = time.perf_counter()
        scheduler_output = scheduler.schedule()
        scheduled = time.perf_counter()
        model_output = self._output(step, scheduler_output)
        updating = time.perf_counter()
        scheduler.update_from_output(scheduler_output, model_output)
        end = time.perf_counter()
        self.scheduled.append(tuple(scheduler_output.num_scheduled_tokens.items()))
        return (scheduled - start) + (end - updating)

    def warm_up(self) -> None:
        """Steps until the script's steady state (``warmed_up``)."""
        while not self._script.warmed_up(self._next, self.scheduler):
            if len(self.scheduled) >= _MAX_WARMUP_STEPS:
                raise AssertionError(f"no steady state after {_MAX_WARMUP_STEPS} steps")
            self.step()

    def run(self, steps: int) -> tuple[float, RoundRecord]:
        """``steps`` timed steps: ``(seconds in the scheduler, what they did)``."""
        running = tokens = 0
        seconds = 0.0
        first = len(self.scheduled)
        for _ in range(steps):
            seconds += self.step()
            running += len(self.scheduler.running)
        tokens = sum(n for step in self.scheduled[first:] for _, n in step)
        return seconds, RoundRecord(steps, running / steps, tokens / steps, self.failed_loads)


class _Agreement:
    """Holds the first round's scheduled token counts; every later round, on either
    scheduler, must reproduce them."""

    __slots__ = ("_expected", "_name", "_who")

    def __init__(self, name: str) -> None:
        self._name = name
        self._expected: list[tuple[tuple[str, int], ...]] | None = None
        self._who = ""

    def check(self, who: str, scheduled: list[tuple[tuple[str, int], ...]]) -> None:
        """Raises ``AssertionError`` when ``scheduled`` differs from the first round's."""
        if self._expected is None:
            self._expected, self._who = scheduled, who
            return
        if scheduled == self._expected:
            return
        step = next(
            (i for i, (a, b) in enumerate(zip(scheduled, self._expected, strict=False)) if a != b),
            min(len(scheduled), len(self._expected)),
        )
        raise AssertionError(
            f"{self._name}: {who} scheduled differently from {self._who} at step {step} "
            f"of {len(self._expected)}"
        )


def _timed(
    agreement: _Agreement, who: str, steps: int
) -> Callable[[_Driver], tuple[float, RoundRecord]]:
    """A round of ``steps`` timed steps on ``who``'s driver, its schedule checked
    against the other side's."""

    def run(driver: _Driver) -> tuple[float, RoundRecord]:
        seconds, record = driver.run(steps)
        agreement.check(who, driver.scheduled)
        return seconds, record

    return run


def _stock_scheduler() -> Any:
    return importlib.import_module(_SCHEDULER).Scheduler


def vllm_scheduler(
    num_requests: int,
    *,
    kv_load: bool = False,
    load: str = "mixed",
    steps: int = 128,
    seed: int = 0,
    kvblocks_cls: Any = None,
) -> Workload:
    """vLLM's ``Scheduler`` step with kvblocks' manager (native) and vLLM's (vLLM column).

    Args:
        num_requests: Requests kept in the system (``N``).
        kv_load: Add the fake KV connector: sync loads and injected load failures.
        load: ``"mixed"`` (arrivals and decodes, prefix caching on), ``"decode"`` (``N``
            requests decoding, prefix caching off) or ``"long_prompt"`` (``N`` decoding
            while :data:`LONG_PROMPT_TOKENS`-token prompts arrive one at a time, prefix
            caching on).
        steps: Steps timed per round, after the warm-up.
        seed: Seeds the requests.
        kvblocks_cls: The scheduler class in the native column; None:
            ``kvblocks.vllm.KVBlocksScheduler`` (tests pass vLLM's own to check the
            harness without ``kvblocks.vllm``).

    Returns:
        The workload. Its runs time themselves (``self_timed``): ``run`` returns
        ``(seconds in schedule() + update_from_output(), RoundRecord)``. It has no
        reference column: the kvblocks scheduler uses kvblocks' default backend.
    """
    script: _Script | _DecodeScript
    if load == "mixed":
        script = _script(num_requests, seed)
        shape = f"{num_requests:,} requests (shared 1,024-token prompt + 64-2,048, 32-256 out)"
    elif load == "decode":
        script = _DecodeScript(num_requests, seed)
        shape = (
            f"{num_requests:,} requests decoding ({_DECODE_PROMPT_TOKENS}-token prompts), "
            "prefix caching off"
        )
    elif load == "long_prompt":
        script = _DecodeScript(
            num_requests,
            seed,
            long_prompt=LONG_PROMPT_TOKENS,
            prefix_caching=True,
            max_model_len=2 * LONG_PROMPT_TOKENS,
        )
        shape = (
            f"{num_requests:,} requests decoding while {LONG_PROMPT_TOKENS:,}-token prompts "
            "arrive one at a time"
        )
    else:
        raise ValueError(f"load must be 'mixed', 'decode' or 'long_prompt', not {load!r}")
    variant = ("_kv_load" if kv_load else "") + ("" if load == "mixed" else f"_{load}")
    name = f"vllm_scheduler{variant}_{num_requests}"
    agreement = _Agreement(name)

    def make(scheduler_cls: Any, manager_cls: Any = None) -> _Driver:
        # vLLM logs each recovered load failure (and each connector it builds): printing
        # it inside the timed calls would time the terminal, and garble the progress bar.
        logging.getLogger("vllm").setLevel(logging.ERROR)
        gc.collect()  # the previous round's schedulers, before this one warms up
        driver = _Driver(scheduler_cls, script, kv_load)
        manager = driver.scheduler.kv_cache_manager
        if manager_cls is not None and not isinstance(manager, manager_cls):
            raise AssertionError(
                f"{name}: {scheduler_cls.__qualname__} runs {type(manager).__qualname__}, "
                f"not {manager_cls.__module__}.{manager_cls.__qualname__} (a fallback?)"
            )
        driver.warm_up()
        return driver

    def setup(backend: ModuleType) -> _Driver:
        if kvblocks_cls is not None:
            return make(kvblocks_cls)
        kvblocks_vllm = importlib.import_module("kvblocks.vllm")
        return make(kvblocks_vllm.KVBlocksScheduler, kvblocks_vllm.KVCacheManager)

    run_kvblocks = _timed(agreement, "kvblocks' manager", steps)

    def check(driver: _Driver, record: RoundRecord) -> None:
        assert record.steps == steps and record.mean_tokens > 0
        assert not kv_load or record.failed_loads > 0, "no load failure injected"
        if load == "decode":
            assert record.mean_tokens == num_requests, "a timed step was not all decodes"
        if load == "long_prompt":
            assert record.mean_tokens > num_requests, "no prompt was prefilled"

    what = ", KV connector: sync loads, load failures (recompute)" if kv_load else ", no connector"
    return Workload(
        name=name,
        group="vllm scheduler",
        description=(
            f"vLLM Scheduler step, {shape}, {_NUM_BLOCKS:,} blocks{what}: kvblocks' "
            "manager (native) vs vLLM's"
        ),
        ops=steps,
        op_name="step",
        setup=setup,
        run=lambda backend, driver: run_kvblocks(driver),
        check=check,
        vllm_setup=lambda: make(_stock_scheduler()),
        vllm_run=_timed(agreement, "vLLM's manager", steps),
        has_reference=False,
        self_timed=True,
    )


# --------------------------------------------------------------------------- hybrid rows


@dataclass(frozen=True, slots=True)
class HybridLayout:
    """A multi-group model layout of the hybrid rows.

    Attributes:
        key: The row's name part: ``vllm_scheduler_<key>_<N>``.
        label: What the layout is like, for the description (``"gpt-oss-like"``).
        groups_name: The name of its groups in ``kvblocks.vllm.cpu`` (``"GPT_OSS_LIKE"``):
            read when a row is built, since importing ``kvblocks.vllm`` imports vLLM.
    """

    key: str
    label: str
    groups_name: str

    def groups(self) -> tuple[Any, ...]:
        """The layout's ``kvblocks.vllm.cpu.GroupLayout``s, in vLLM's group order."""
        return tuple(getattr(importlib.import_module("kvblocks.vllm.cpu"), self.groups_name))


#: The hybrid rows' layouts, in report order.
HYBRID_LAYOUTS = (
    HybridLayout("gpt_oss", "gpt-oss-like", "GPT_OSS_LIKE"),
    HybridLayout("gemma3", "Gemma-3-like", "GEMMA3_LIKE"),
)
#: Requests kept in the system on the hybrid rows ...
HYBRID_SIZE = 256
#: ... and with ``--quick``.
HYBRID_QUICK_SIZE = 64


def _window_blocks(window: int) -> int:
    """The blocks a sliding-window group holds per request once its window is full:
    ``cdiv(window - 1, block size) + 1``."""
    return -(-(window - 1) // _BLOCK_SIZE) + 1


def hybrid_num_blocks(groups: Sequence[Any], num_requests: int) -> int:
    """The pool of a hybrid row: the single-group rows' 65,536 blocks per full-attention
    group, and per sliding-window group ``num_requests`` full windows plus one step of
    prefill (allocated for a whole chunk, freed below the window the step after).

    Raises:
        ValueError: A group is neither full attention nor sliding window.
    """
    total = 0
    for group in groups:
        if group.kind == "full":
            total += _NUM_BLOCKS
        elif group.kind == "sliding_window":
            total += (
                num_requests * _window_blocks(group.window) + _MAX_BATCHED_TOKENS // _BLOCK_SIZE
            )
        else:
            raise ValueError(f"no hybrid row for {group.kind} groups")
    return total


def _describe_groups(groups: Sequence[Any]) -> str:
    """``"6 sliding-window groups (window 1,024) + 1 full"``."""
    windows = sorted({g.window for g in groups if g.kind == "sliding_window"})
    local = sum(g.kind == "sliding_window" for g in groups)
    full = sum(g.kind == "full" for g in groups)
    plural = "s" if local > 1 else ""
    sizes = ", ".join(f"{w:,}" for w in windows)
    return f"{local} sliding-window group{plural} (window {sizes}) + {full} full"


def _dotted(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True, slots=True)
class HybridManagers:
    """The KV cache manager classes a hybrid row runs, one per side.

    Attributes:
        kvblocks_side: The class kvblocks' scheduler built (the native column).
        vllm_side: The class vLLM's own ``Scheduler`` built (the vLLM column).
    """

    kvblocks_side: type
    vllm_side: type

    @property
    def fallback(self) -> bool:
        """Whether kvblocks' scheduler runs a manager that is not kvblocks' own: then the
        row times vLLM's manager on both sides and measures nothing of kvblocks."""
        return self.kvblocks_side.__module__.partition(".")[0] != "kvblocks"

    def describe(self) -> str:
        """The description's tail: which manager ran on each side, and ``FALLBACK`` when
        the kvblocks side is not kvblocks'."""
        if self.fallback:
            return (
                f"FALLBACK, not a kvblocks measurement: kvblocks' scheduler ran "
                f"{_dotted(self.kvblocks_side)}, vLLM's ran {_dotted(self.vllm_side)}"
            )
        return (
            f"kvblocks' manager {_dotted(self.kvblocks_side)} (native) vs vLLM's "
            f"{_dotted(self.vllm_side)}"
        )


def _table_check(driver: _Driver, groups: Sequence[Any]) -> None:
    """Every running request has one block table per group, and each sliding-window
    group holds at most its window's blocks (+1 at a block boundary) for a decoding
    request past twice its window: the rest of its table is the null block (its first
    entry)."""
    manager = driver.scheduler.kv_cache_manager
    checked = 0
    for request in driver.scheduler.running:
        tables = manager.get_block_ids(request.request_id)
        if len(tables) != len(groups):
            raise AssertionError(
                f"{request.request_id}: {len(tables)} block tables for {len(groups)} groups"
            )
        if request.num_output_tokens < 2:
            continue  # its last step may have allocated a whole prefill chunk
        for group, table in zip(groups, tables, strict=True):
            if group.kind != "sliding_window" or request.num_computed_tokens < 2 * group.window:
                continue
            live = sum(block != table[0] for block in table)
            if live > _window_blocks(group.window) + 1:
                raise AssertionError(
                    f"{request.request_id}: a sliding-window group (window {group.window}) "
                    f"holds {live} blocks at {request.num_computed_tokens} tokens"
                )
            checked += 1
    assert checked, "no decoding request past a window to check"


def hybrid_managers(
    layout: HybridLayout, num_requests: int = HYBRID_SIZE, kvblocks_cls: Any = None
) -> HybridManagers:
    """The manager classes :func:`vllm_scheduler_hybrid` runs on each side: the
    schedulers are built (not warmed up) and dropped.

    Args:
        layout: The row's layout.
        num_requests: Requests kept in the system (sizes the pool).
        kvblocks_cls: The native column's scheduler class; None:
            ``kvblocks.vllm.KVBlocksScheduler``.
    """
    native = kvblocks_cls or importlib.import_module("kvblocks.vllm").KVBlocksScheduler
    groups = layout.groups()
    logging.getLogger("vllm").setLevel(logging.ERROR)
    sides = [
        type(_build_scheduler(cls, _script(num_requests, 0), False, groups).kv_cache_manager)
        for cls in (native, _stock_scheduler())
    ]
    gc.collect()
    return HybridManagers(*sides)


def vllm_scheduler_hybrid(
    layout: HybridLayout,
    num_requests: int = HYBRID_SIZE,
    *,
    steps: int = 128,
    seed: int = 0,
    kvblocks_cls: Any = None,
) -> Workload:
    """vLLM's ``Scheduler`` step on a multi-group layout, with kvblocks' scheduler
    (native column) and vLLM's own (vLLM column); otherwise :func:`vllm_scheduler`'s load,
    without connector.

    Which manager each side runs is found when the workload is built
    (:func:`hybrid_managers`) and checked every round. When kvblocks' scheduler falls
    back to vLLM's manager, the description says ``FALLBACK, not a kvblocks
    measurement`` and names both classes: it lands in the printed table and in
    ``results.json``.

    Args:
        layout: The row's layout (:data:`HYBRID_LAYOUTS`).
        num_requests: Requests kept in the system (``N``).
        steps: Steps timed per round, after the warm-up.
        seed: Seeds the requests.
        kvblocks_cls: The native column's scheduler class; None:
            ``kvblocks.vllm.KVBlocksScheduler``.

    Returns:
        The workload, self-timed and without reference column, as :func:`vllm_scheduler`'s.
    """
    groups = layout.groups()
    num_blocks = hybrid_num_blocks(groups, num_requests)
    native = kvblocks_cls or importlib.import_module("kvblocks.vllm").KVBlocksScheduler
    managers = hybrid_managers(layout, num_requests, native)
    name = f"vllm_scheduler_{layout.key}_{num_requests}"
    if managers.vllm_side.__module__.partition(".")[0] != "vllm":
        raise AssertionError(
            f"{name}: vLLM's own Scheduler runs {_dotted(managers.vllm_side)} "
            "(kvblocks.vllm.install() in effect?)"
        )
    script = _script(num_requests, seed)
    agreement = _Agreement(name)

    def make(scheduler_cls: Any, expected: type) -> _Driver:
        logging.getLogger("vllm").setLevel(logging.ERROR)
        gc.collect()  # the previous round's schedulers, before this one warms up
        driver = _Driver(scheduler_cls, script, False, groups)
        manager = type(driver.scheduler.kv_cache_manager)
        if manager is not expected:
            raise AssertionError(
                f"{name}: {scheduler_cls.__qualname__} runs {_dotted(manager)}, not "
                f"{_dotted(expected)} as when the row was built"
            )
        driver.warm_up()
        return driver

    run_native = _timed(agreement, "kvblocks' scheduler", steps)

    def check(driver: _Driver, record: RoundRecord) -> None:
        assert record.steps == steps and record.mean_tokens > 0
        _table_check(driver, groups)

    return Workload(
        name=name,
        group="vllm scheduler",
        description=(
            f"vLLM Scheduler step, {layout.label}: {_describe_groups(groups)}; "
            f"{num_requests:,} requests (shared 1,024-token prompt + 64-2,048, 32-256 out), "
            f"{num_blocks:,} blocks, no connector; {managers.describe()}"
        ),
        ops=steps,
        op_name="step",
        setup=lambda backend: make(native, managers.kvblocks_side),
        run=lambda backend, driver: run_native(driver),
        check=check,
        vllm_setup=lambda: make(_stock_scheduler(), managers.vllm_side),
        vllm_run=_timed(agreement, "vLLM's scheduler", steps),
        has_reference=False,
        self_timed=True,
    )


def workload_specs(quick: bool) -> list[WorkloadSpec]:
    """The group's workloads, not built yet; none when :func:`available` is False.

    ``quick`` times fewer steps per round (32 instead of 128), runs the connector
    variant at 256 requests only and the long-prompt row at
    :data:`LONG_PROMPT_QUICK_SIZE`. The decode rows (:data:`DECODE_SIZES`) and the
    long-prompt row follow the mixed ones. The hybrid rows (:data:`HYBRID_LAYOUTS`)
    come last: at :data:`HYBRID_SIZE` requests, or :data:`HYBRID_QUICK_SIZE` with
    ``quick`` (vLLM's step on them costs up to three times the single-group row's, and
    a round's cost grows with the requests).
    """
    if not available():
        return []
    steps = 32 if quick else 128
    sizes: Sequence[int] = (256,) if quick else KV_LOAD_SIZES
    out = [deferred(f"vllm_scheduler_{n}", vllm_scheduler, n, steps=steps) for n in SIZES]
    out += [
        deferred(f"vllm_scheduler_kv_load_{n}", vllm_scheduler, n, kv_load=True, steps=steps)
        for n in sizes
    ]
    out += [
        deferred(f"vllm_scheduler_decode_{n}", vllm_scheduler, n, load="decode", steps=steps)
        for n in DECODE_SIZES
    ]
    n = LONG_PROMPT_QUICK_SIZE if quick else LONG_PROMPT_SIZE
    out.append(
        deferred(
            f"vllm_scheduler_long_prompt_{n}", vllm_scheduler, n, load="long_prompt", steps=steps
        )
    )
    n = HYBRID_QUICK_SIZE if quick else HYBRID_SIZE
    out += [
        deferred(f"vllm_scheduler_{layout.key}_{n}", vllm_scheduler_hybrid, layout, n, steps=steps)
        for layout in HYBRID_LAYOUTS
    ]
    return out
