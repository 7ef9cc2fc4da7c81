"""kvblocks' ``KVCacheManager`` against vLLM 0.33.0's, call by call.

The Hypothesis machine in ``lockstep.py`` builds both managers from the same constructor
arguments (one full-attention group; small pools; block sizes 1, 2, 4 and 16; caching,
stats and KV events on or off; a watermark; each of vLLM's hash functions), drives them
with twin vLLM ``Request`` objects through every public member of the manager, its
coordinator, its block pool and ``KVCacheBlocks``, with arguments from the whole range
vLLM's Scheduler can produce (negative, zero and past-the-end counts, lookahead, external
tokens, delayed caching, preemption and resumption, frees of unknown requests, growing
requests), and after every call compares the result or the exception class, the KV
events and the state. A difference fails the test with its minimal call sequence (in
the long profile, each distinct ``(member, aspect)`` difference with its own).

Profiles:

* CI (the default): derandomized, no example database, ``CI_EXAMPLES`` examples of up to
  ``CI_STEPS`` steps each (about 9,000 rule steps): 10-35 s on two shared cores when
  nothing diverges. It stops at the first divergence, so a failing run shrinks only that
  one (about a minute).
* Long: ``KVBLOCKS_LOCKSTEP_EXAMPLES=N`` runs N random examples of up to
  ``KVBLOCKS_LOCKSTEP_STEPS`` steps (default 80), keeping failures in Hypothesis'
  example database, e.g. ``KVBLOCKS_LOCKSTEP_EXAMPLES=2000 pytest
  tests/vllm/test_manager_lockstep.py -k lockstep_with_vllm``.

The ``test_planted_*`` tests run the same machine against kvblocks managers with a fault
planted in a Python subclass and check that it fails on that fault.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from kvblocks.vllm import KVCacheManager
from lockstep import DivergenceError, ManagerLockstep, Side

CI_EXAMPLES = 200
CI_STEPS = 50
LONG_EXAMPLES = int(os.environ.get("KVBLOCKS_LOCKSTEP_EXAMPLES", "0"))
LONG_STEPS = int(os.environ.get("KVBLOCKS_LOCKSTEP_STEPS", "80"))

_COMMON: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
    "print_blob": True,
}

#: Reproducible: the same examples every run, nothing read from or written to a database.
#: It stops at the first divergence (shrinking several takes minutes).
CI_SETTINGS = settings(
    max_examples=CI_EXAMPLES,
    stateful_step_count=CI_STEPS,
    derandomize=True,
    database=None,
    report_multiple_bugs=False,
    **_COMMON,
)
#: Random examples, failures kept in the default example database, every distinct
#: divergence reported with its own minimal example.
LONG_SETTINGS = settings(
    max_examples=max(LONG_EXAMPLES, 1),
    stateful_step_count=LONG_STEPS,
    report_multiple_bugs=True,
    **_COMMON,
)
SETTINGS = LONG_SETTINGS if LONG_EXAMPLES else CI_SETTINGS

#: The fault tests need no shrinking: they check that the planted fault is found, not
#: what its minimal example is. A fault in an explicit `cache_blocks` call shows only when
#: that call caches something, which some runs of 400 examples never drew.
FAULT_SETTINGS = settings(
    max_examples=1500,
    stateful_step_count=50,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    **_COMMON,
)


def test_lockstep_with_vllm() -> None:
    """kvblocks does what vLLM 0.33.0's manager does, call for call."""
    run_state_machine_as_test(ManagerLockstep, settings=SETTINGS)


# ------------------------------------------------------------------------ planted faults


class Watching(ManagerLockstep):
    """The machine, failing only on divergences of the watched ``(call, aspect)``.

    Any other divergence (what kvblocks does differently today) makes it start afresh,
    as after a raise, so the search goes on for the planted fault alone.
    """

    watch: ClassVar[tuple[str | None, str | None]] = (None, None)

    def watched(self, err: DivergenceError) -> bool:
        call, aspect = self.watch
        return call in {None, err.call} and aspect in {None, err.aspect}

    def both(self, call: str, fn: Callable[[Side], Any]) -> tuple[Any, Any] | None:
        try:
            return super().both(call, fn)
        except DivergenceError as err:
            if self.watched(err):
                raise
            self._build_managers()
            return None

    def teardown(self) -> None:
        found = self.deferred_divergence
        if found is not None and self.watched(found):
            raise found


def failure_of(
    candidate: type[KVCacheManager],
    watch: tuple[str | None, str | None] = (None, None),
    reference: Callable[..., Any] | None = None,
) -> DivergenceError:
    """Runs the machine with ``candidate`` and returns the divergence it failed with."""
    attrs: dict[str, Any] = {"candidate": candidate, "watch": watch}
    if reference is not None:
        attrs["reference"] = reference
    machine = type(f"Planted{candidate.__name__}", (Watching,), attrs)
    with pytest.raises(DivergenceError) as caught:
        run_state_machine_as_test(machine, settings=FAULT_SETTINGS)
    return caught.value


class OneBlockMore(KVCacheManager):
    """``cache_blocks`` caches one block past the count it is given."""

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        super().cache_blocks(request, max(num_computed_tokens, 0) + self.block_size)


class OneBlockFewer(KVCacheManager):
    """``cache_blocks`` caches one block short of the count it is given."""

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        super().cache_blocks(request, max(num_computed_tokens - self.block_size, 0))


class RaisesOnNegative(KVCacheManager):
    """``cache_blocks`` refuses a negative count (vLLM does nothing with it)."""

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        if num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens must be non-negative: {num_computed_tokens}")
        super().cache_blocks(request, max(num_computed_tokens, 0))


class NoPrefixCacheStats(KVCacheManager):
    """Has no readable ``prefix_cache_stats`` attribute."""

    def __getattribute__(self, name: str) -> Any:
        if name == "prefix_cache_stats":
            raise AttributeError(name)
        return super().__getattribute__(name)


@pytest.mark.parametrize("fault", [OneBlockMore, OneBlockFewer], ids=["more", "fewer"])
def test_planted_off_by_one_in_cache_blocks(fault: type[KVCacheManager]) -> None:
    # Against kvblocks' own manager, so that what vLLM does differently today cannot be
    # what fails the run: any divergence found is the planted fault's.
    failure_of(fault, reference=KVCacheManager)


def test_planted_value_error_on_negative_cache_blocks() -> None:
    # vLLM does nothing with a negative count: the planted raise must be reported.
    failure = failure_of(RaisesOnNegative, watch=("cache_blocks", "exception"))
    assert "ValueError" in str(failure), failure


def test_planted_missing_prefix_cache_stats() -> None:
    failure = failure_of(NoPrefixCacheStats, watch=("prefix_cache_stats", None))
    assert "AttributeError" in str(failure), failure
