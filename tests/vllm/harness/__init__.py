"""Drive vLLM's real v1 Scheduler twice on the same inputs and diff the two runs.

A plain package (not tests): the tests import it, and vLLM's KV connector factory
imports :mod:`harness.connector` by name. One module per job:

* :mod:`harness.scenarios`: :func:`make_scenario` turns ``(family, seed, engine)`` into a
  :class:`Scenario`;
* :mod:`harness.connector`: the fake scheduler-side KV connector and event publisher;
* :mod:`harness.driver`: :func:`run_scenario` builds ``VllmConfig``/``KVCacheConfig``/the
  scheduler (a model directory holding only ``config.json``; one full-attention group,
  or the scenario's hybrid layout) and drives it, recording per step the normalised
  ``SchedulerOutput``, the ``EngineCoreOutputs``, the published KV events and the
  results of prefix-cache resets;
* :mod:`harness.normalise`: those records as JSON-like, order-stable values;
* :mod:`harness.compare`: :func:`compare_runs` reports the first step at which two runs
  differ, field by field; the scheduler class pairs; the command line.

Run ``python tests/vllm/harness SCENARIO_ID`` (for example ``connector-s3-async``) to
replay one scenario and print the first difference between vLLM's manager and kvblocks'.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import inspect

import vllm
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

from .compare import (
    Mismatch,
    candidate_class,
    compare_runs,
    differential,
    failing_together,
    kvblocks_class,
    stock_class,
)
from .driver import (
    RunResult,
    build_kv_cache_config,
    build_scheduler,
    build_vllm_config,
    crc,
    run_scenario,
)
from .normalise import normalise
from .scenarios import (
    BASE_FAMILIES,
    COMBINATION_FAMILIES,
    ENGINES,
    FAMILIES,
    FAMILY_ENGINES,
    HYBRID_FAMILIES,
    Scenario,
    make_scenario,
    parse_scenario_id,
)

#: The installed vLLM's release series, ``(0, 33)`` for 0.33.x.
VLLM_SERIES = tuple(int(part) for part in vllm.__version__.split(".")[:2])
#: Whether the installed vLLM's lookups take a hit cap (0.33 on; older ones take the
#: request alone).
TAKES_MAX_CACHE_HIT_LENGTH = (
    "max_cache_hit_length" in inspect.signature(VllmKVCacheManager.get_computed_blocks).parameters
)

__all__ = [
    "BASE_FAMILIES",
    "COMBINATION_FAMILIES",
    "ENGINES",
    "FAMILIES",
    "FAMILY_ENGINES",
    "HYBRID_FAMILIES",
    "TAKES_MAX_CACHE_HIT_LENGTH",
    "VLLM_SERIES",
    "Mismatch",
    "RunResult",
    "Scenario",
    "build_kv_cache_config",
    "build_scheduler",
    "build_vllm_config",
    "candidate_class",
    "compare_runs",
    "crc",
    "differential",
    "failing_together",
    "kvblocks_class",
    "make_scenario",
    "normalise",
    "parse_scenario_id",
    "run_scenario",
    "stock_class",
]
