"""Seeded synthetic serving workloads: shared-prefix chat, long-context RAG, bursts.

A workload is a lazy, deterministic stream of :class:`RequestSpec`, in arrival order.
A spec is small: the prompt's token ids are rebuilt from seeds only when the request
arrives (:func:`prompt_token_ids`), so memory stays bounded by the requests alive in
the simulator, not by the length of the run.

* ``chat``: multi-turn conversations over a few shared system prompts. Turn ``k`` of a
  conversation repeats the system prompt and the conversation so far, so consecutive
  turns share a long prefix.
* ``rag``: long documents (Zipf-popular, more than the pool holds) followed by a short
  question and a short answer.
* ``bursty``: both kinds, arriving mostly in bursts of tens of requests in one step.
* ``mix``: both kinds, Poisson arrivals with an occasional burst.

Every random choice comes from :class:`random.Random` seeded with a string (hashed with
SHA-512 by the standard library), so a workload depends only on its seed and
parameters, never on ``PYTHONHASHSEED`` or on how the simulator schedules it. Output
tokens are a pure function of the request and the output index
(:func:`output_token_id`): a request rolled back and recomputed produces exactly the
tokens (hence block hashes) it would have produced without failures.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from kvblocks.constants import cdiv

__all__ = [
    "VOCAB_SIZE",
    "WORKLOADS",
    "RequestSpec",
    "WorkloadParams",
    "iter_requests",
    "output_token_id",
    "prompt_token_ids",
]

#: Token ids are drawn from ``0 .. VOCAB_SIZE - 1`` (two random bytes each).
VOCAB_SIZE = 1 << 16

#: The workload names ``--workload`` accepts.
WORKLOADS = ("mix", "chat", "rag", "bursty")

#: Tokens per independently seeded chunk of a token stream (prefix-stable streams).
_CHUNK = 256


@dataclass(frozen=True, slots=True)
class WorkloadParams:
    """The knobs of a workload.

    Attributes:
        name: One of :data:`WORKLOADS`.
        num_requests: Requests in the whole run.
        seed: Seed of every random choice.
        arrival_rate: Mean arrivals per scheduler step outside bursts.
        max_prompt_tokens: No prompt is longer than this.
        remote_share: Probability that the KV connector holds a request's shared
            prefix (system prompt and history, or document).
    """

    name: str = "mix"
    num_requests: int = 1000
    seed: int = 0
    arrival_rate: float = 2.0
    max_prompt_tokens: int = 3968
    remote_share: float = 0.5


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload, before it exists in the simulator.

    The prompt is ``prefix_stream[:prefix_len] + body_stream[:body_len]``; both streams
    are rebuilt from their keys on demand.

    Attributes:
        request_id: Unique id (``req-<index>``).
        index: Position in the workload, 0-based.
        arrival_step: The scheduler step in which the request arrives.
        kind: ``"chat"`` or ``"rag"``.
        prefix_key: Seed key of the shared stream (a system prompt or a document).
        prefix_len: Tokens taken from it.
        body_key: Seed key of the request's own stream (a conversation, a question).
        body_len: Tokens taken from it.
        output_len: Output tokens to generate before the request finishes (>= 1).
        remote_prefix_tokens: Leading prompt tokens the KV connector can supply
            (0: none).
    """

    request_id: str
    index: int
    arrival_step: int
    kind: str
    prefix_key: str
    prefix_len: int
    body_key: str
    body_len: int
    output_len: int
    remote_prefix_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return self.prefix_len + self.body_len


def _stream(key: str, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` tokens of the stream named ``key``.

    Chunks are seeded separately, so a shorter read is a prefix of a longer one.
    """
    tokens = array("H")
    for chunk in range(cdiv(num_tokens, _CHUNK)):
        tokens.frombytes(random.Random(f"{key}/{chunk}").randbytes(2 * _CHUNK))
    return tokens[:num_tokens].tolist()


def prompt_token_ids(spec: RequestSpec) -> list[int]:
    """The prompt's token ids, rebuilt from the spec's seeds."""
    return _stream(spec.prefix_key, spec.prefix_len) + _stream(spec.body_key, spec.body_len)


def output_token_id(spec: RequestSpec, k: int) -> int:
    """Output token ``k`` of the request: a function of the request and ``k`` only."""
    return (spec.index * 2_654_435_761 + (k + 1) * 40_503) % VOCAB_SIZE


@dataclass(slots=True)
class _Conversation:
    """A chat conversation in progress (one of a bounded set of slots)."""

    conv_id: int
    system: int
    history_len: int
    turns_left: int


class _Generator:
    """Builds the specs one by one; state is bounded by the conversation slots."""

    #: Shared system prompts of the chat workload.
    NUM_SYSTEM_PROMPTS = 8
    #: Documents of the RAG workload (more than a default pool can cache).
    NUM_DOCUMENTS = 48
    #: Conversations in progress at any time.
    NUM_CONVERSATIONS = 64

    def __init__(self, params: WorkloadParams) -> None:
        if params.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {params.name!r}")
        if params.max_prompt_tokens < 1024:
            raise ValueError(
                f"max_prompt_tokens must be at least 1024, got {params.max_prompt_tokens}"
            )
        self.params = params
        self.rng = random.Random(f"kvblocks-sim/{params.seed}/{params.name}")
        root = f"kvblocks-sim/{params.seed}"
        self.root = root
        self.system_lens = [
            random.Random(f"{root}/system-len/{k}").randint(256, 1024)
            for k in range(self.NUM_SYSTEM_PROMPTS)
        ]
        doc_max = min(3072, params.max_prompt_tokens - 128)
        self.doc_lens = [
            random.Random(f"{root}/doc-len/{k}").randint(1024, doc_max)
            for k in range(self.NUM_DOCUMENTS)
        ]
        # Zipf-like popularity: document k is drawn with weight 1 / (k + 1).
        self.doc_weights = [1.0 / (k + 1) for k in range(self.NUM_DOCUMENTS)]
        self.conversations: list[_Conversation | None] = [None] * self.NUM_CONVERSATIONS
        self.next_conv_id = 0
        chat_share = {"mix": 0.6, "chat": 1.0, "rag": 0.0, "bursty": 0.5}[params.name]
        self.chat_share = chat_share

    def _new_conversation(self) -> _Conversation:
        conv = _Conversation(
            conv_id=self.next_conv_id,
            system=self.rng.randrange(self.NUM_SYSTEM_PROMPTS),
            history_len=0,
            turns_left=self.rng.randint(1, 8),
        )
        self.next_conv_id += 1
        return conv

    def _chat(self, index: int, arrival_step: int) -> RequestSpec:
        slot = self.rng.randrange(self.NUM_CONVERSATIONS)
        body_len = self.rng.randint(16, 256)
        reply_len = self.rng.randint(16, 128)
        conv = self.conversations[slot]
        if conv is None or conv.turns_left == 0:
            conv = self._new_conversation()
        system_len = self.system_lens[conv.system]
        if system_len + conv.history_len + body_len > self.params.max_prompt_tokens:
            conv = self._new_conversation()
            system_len = self.system_lens[conv.system]
        history_len = conv.history_len
        conv.history_len += body_len + reply_len
        conv.turns_left -= 1
        self.conversations[slot] = conv
        remote = self.rng.random() < self.params.remote_share
        return RequestSpec(
            request_id=f"req-{index}",
            index=index,
            arrival_step=arrival_step,
            kind="chat",
            prefix_key=f"{self.root}/system/{conv.system}",
            prefix_len=system_len,
            body_key=f"{self.root}/conversation/{conv.conv_id}",
            body_len=history_len + body_len,
            output_len=self.rng.randint(8, 64),
            remote_prefix_tokens=system_len + history_len if remote else 0,
        )

    def _rag(self, index: int, arrival_step: int) -> RequestSpec:
        doc = self.rng.choices(range(self.NUM_DOCUMENTS), self.doc_weights)[0]
        question_len = self.rng.randint(16, 96)
        remote = self.rng.random() < self.params.remote_share
        return RequestSpec(
            request_id=f"req-{index}",
            index=index,
            arrival_step=arrival_step,
            kind="rag",
            prefix_key=f"{self.root}/document/{doc}",
            prefix_len=self.doc_lens[doc],
            body_key=f"{self.root}/question/{index}",
            body_len=question_len,
            output_len=self.rng.randint(4, 32),
            remote_prefix_tokens=self.doc_lens[doc] if remote else 0,
        )

    def _arrival_steps(self) -> Iterator[int]:
        """Arrival steps, non-decreasing, one per request."""
        rate = self.params.arrival_rate
        bursty = self.params.name == "bursty"
        # Outside bursts, a Poisson process; bursty workloads keep a third of the rate.
        base_rate = rate / 3 if bursty else rate
        burst_every = 60.0 if bursty else 400.0
        clock = 0.0
        next_burst = self.rng.expovariate(1.0 / burst_every)
        while True:
            gap = self.rng.expovariate(base_rate)
            if clock + gap >= next_burst:
                clock = next_burst
                for _ in range(self.rng.randint(20, 80)):
                    yield int(clock)
                next_burst = clock + self.rng.expovariate(1.0 / burst_every)
                continue
            clock += gap
            yield int(clock)

    def __iter__(self) -> Iterator[RequestSpec]:
        arrivals = self._arrival_steps()
        for index in range(self.params.num_requests):
            step = next(arrivals)
            if self.rng.random() < self.chat_share:
                yield self._chat(index, step)
            else:
                yield self._rag(index, step)


def iter_requests(params: WorkloadParams) -> Iterator[RequestSpec]:
    """The workload's requests, lazily, in arrival order.

    Raises:
        ValueError: Unknown workload name, or ``max_prompt_tokens`` below 1024.
    """
    return iter(_Generator(params))
