"""Comparing two runs of a scenario, the scheduler class pairs, and the command line."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvblocks.vllm.cpu import (
    write_config_only_model,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from .driver import RunResult, run_scenario
from .scenarios import (
    FAILING_FAMILIES,
    FAMILY_ENGINES,
    Scenario,
    make_scenario,
    parse_scenario_id,
)


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
            f"  reproduce: {sys.executable} {Path(__file__).resolve().parent} "
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
    """``harness SCENARIO_ID [stock|kvblocks] [--repeat N]``: replay one scenario on
    vLLM's scheduler and on the candidate (N times), print the first difference.
    ``harness --failing-together [stock|kvblocks] [--repeat N] [--seeds S]``: the
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
