"""The simulator's configuration: workload, engine limits, connector, failure handling."""

from __future__ import annotations

from dataclasses import dataclass

from kvblocks.constants import (
    HASH_ALGORITHMS,
    LOAD_FAILURE_POLICIES,
    ROLLBACK_MODES,
    cdiv,
    either,
)
from kvblocks.sim.workload import WORKLOADS, WorkloadParams

__all__ = ["SimConfig"]

#: Prompt tokens are capped this far below ``max_model_len`` (outputs are at most 64).
_OUTPUT_HEADROOM = 128


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything a simulated run depends on; two runs with equal configs are identical.

    Attributes:
        num_requests: Requests in the workload.
        workload: ``mix``, ``chat``, ``rag`` or ``bursty`` (see :mod:`kvblocks.sim.workload`).
        seed: Seed of the workload, the connector and the hash seed.
        failure_rate: Probability that an externally loaded block fails to load.
        request_failure_rate: Probability that an async load fails as a whole
            (``failed_recving``); ``None``: the same as ``failure_rate``.
        policy: ``fail`` or ``recompute`` (vLLM's ``kv_load_failure_policy``).
        mode: ``vllm`` or ``strict`` (the rollback mode).
        num_blocks: KV cache blocks, the null block included.
        block_size: Tokens per block.
        max_num_seqs: Running requests at most (vLLM's ``max_num_seqs``).
        max_num_batched_tokens: Token budget of a step (chunked prefill).
        max_model_len: Tokens per request at most; prompts stay 128 below it.
        arrival_rate: Mean arrivals per step outside bursts.
        remote_share: Probability that the connector holds a request's shared prefix.
        async_share: Probability that a connector load is asynchronous.
        max_load_attempts: Loads the connector offers one request.
        max_load_latency: Async loads take 1 to this many steps.
        hash_algo: The block hash function.
        check: Run the per-step checks.
        max_steps: Give up (a failed check) after this many steps; ``None``: a
            generous bound from the workload size.
    """

    num_requests: int = 1000
    workload: str = "mix"
    seed: int = 0
    failure_rate: float = 0.01
    request_failure_rate: float | None = None
    policy: str = "fail"
    mode: str = "vllm"
    num_blocks: int = 4096
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    arrival_rate: float = 2.0
    remote_share: float = 0.5
    async_share: float = 0.5
    max_load_attempts: int = 2
    max_load_latency: int = 4
    hash_algo: str = "sha256"
    check: bool = True
    max_steps: int | None = None

    def __post_init__(self) -> None:
        """Validates every field.

        Raises:
            ValueError: A field is out of range, or the pool cannot hold one request of
                ``max_model_len`` tokens.
        """
        if self.workload not in WORKLOADS:
            raise ValueError(
                f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}"
            )
        if self.policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"policy must be {either(LOAD_FAILURE_POLICIES)}, got {self.policy!r}")
        if self.mode not in ROLLBACK_MODES:
            raise ValueError(f"mode must be {either(ROLLBACK_MODES)}, got {self.mode!r}")
        if self.hash_algo not in HASH_ALGORITHMS:
            raise ValueError(
                f"hash_algo must be one of {', '.join(HASH_ALGORITHMS)}, got {self.hash_algo!r}"
            )
        if self.num_requests < 0:
            raise ValueError(f"num_requests must be non-negative, got {self.num_requests}")
        for name in (
            "num_blocks",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_load_latency",
        ):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.max_load_attempts < 0:
            raise ValueError(
                f"max_load_attempts must be non-negative, got {self.max_load_attempts}"
            )
        for name in ("failure_rate", "remote_share", "async_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {value}")
        if self.request_failure_rate is not None and not 0.0 <= self.request_failure_rate <= 1.0:
            raise ValueError(
                f"request_failure_rate must be between 0 and 1, got {self.request_failure_rate}"
            )
        if self.arrival_rate <= 0:
            raise ValueError(f"arrival_rate must be positive, got {self.arrival_rate}")
        if self.max_model_len < 1024 + _OUTPUT_HEADROOM:
            minimum = 1024 + _OUTPUT_HEADROOM
            raise ValueError(f"max_model_len must be at least {minimum}, got {self.max_model_len}")
        needed = cdiv(self.max_model_len, self.block_size)
        if needed > self.num_blocks - 1:
            raise ValueError(
                f"num_blocks {self.num_blocks} cannot hold one request of max_model_len "
                f"{self.max_model_len} ({needed} blocks of {self.block_size} tokens)"
            )
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(f"max_steps must be positive, got {self.max_steps}")

    @property
    def effective_request_failure_rate(self) -> float:
        """``request_failure_rate``, defaulting to ``failure_rate``."""
        if self.request_failure_rate is None:
            return self.failure_rate
        return self.request_failure_rate

    @property
    def step_limit(self) -> int:
        """``max_steps``, or a bound no healthy run comes near."""
        if self.max_steps is not None:
            return self.max_steps
        return 20_000 + 200 * self.num_requests

    def workload_params(self) -> WorkloadParams:
        """The workload part of the configuration."""
        return WorkloadParams(
            name=self.workload,
            num_requests=self.num_requests,
            seed=self.seed,
            arrival_rate=self.arrival_rate,
            max_prompt_tokens=self.max_model_len - _OUTPUT_HEADROOM,
            remote_share=self.remote_share,
        )
