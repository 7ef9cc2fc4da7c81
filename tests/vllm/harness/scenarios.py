"""The scenarios the differential runs: ``(family, seed, engine)`` to a :class:`Scenario`,
with a ``random.Random`` seeded by a string, so nothing depends on ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from kvblocks.vllm.cpu import (
    VOCAB_SIZE,
    GroupLayout,
)

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


def cdiv(a: int, b: int) -> int:
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
    max_need = cdiv(max_total + lookahead, block_size)
    max_model_len = max(256, cdiv(max_total + lookahead + 8, 64) * 64)
    watermark = rng.choice([0.0, 0.0, 0.05, 0.1]) if chance(0.5, "preempt", "prefix") else 0.0
    small_pool = family in ("preempt", "abort", "priority", "small-blocks") or chance(
        0.6 if combined else 0.4, "deferred", "reset", "connector", "async-spec-fail"
    )
    # Every group holds its own blocks (local groups fewer, once out-of-window ones go).
    groups = max(1, len(layout))
    max_need *= groups
    total_need = groups * sum(cdiv(n + lookahead, block_size) for n in lengths.values())
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


def all_scenarios(seeds_per_family: int) -> Iterable[Scenario]:
    for family in FAMILIES:
        for engine in FAMILY_ENGINES[family]:
            for seed in range(seeds_per_family):
                yield make_scenario(family, seed, engine)


#: Scenario families whose requests can fail together under the ``fail`` policy.
FAILING_FAMILIES = ("connector", "deferred", "mixed", "async-spec-fail", "combined")
