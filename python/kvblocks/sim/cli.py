"""``kvblocks simulate``: the command line of :mod:`kvblocks.sim`.

``kvblocks.cli`` registers it with :func:`add_parser` and dispatches to :func:`main`.
Exit status: 0 when every check passed (and, with ``--backend both``, the two
backends' traces are identical), 1 otherwise, 2 for a bad configuration.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvblocks import BACKEND_MODULES, load_backend
from kvblocks.constants import HASH_ALGORITHMS, LOAD_FAILURE_POLICIES, ROLLBACK_MODES
from kvblocks.sim import first_trace_difference, run
from kvblocks.sim.config import SimConfig
from kvblocks.sim.report import Progress, summary_table, write_outputs
from kvblocks.sim.results import SimResult
from kvblocks.sim.scheduler import ExtraCheck
from kvblocks.sim.workload import WORKLOADS

__all__ = ["add_parser", "main"]

_DEFAULTS = SimConfig()


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds the ``simulate`` command to ``subparsers`` (from ``add_subparsers()``).

    Returns:
        The new sub-parser.
    """
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="a serving workload with injected KV-load failures, checked at every step",
        description=(
            "Simulate a vLLM-style scheduler over the KV cache manager: seeded workloads, "
            "a KV connector whose loads fail at a given rate, failures handled with the "
            "given policy and mode. Exits 1 if a check fails."
        ),
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=_DEFAULTS.num_requests,
        metavar="N",
        help="requests in the workload (default %(default)s)",
    )
    parser.add_argument(
        "--failure-rate",
        type=float,
        default=_DEFAULTS.failure_rate,
        metavar="P",
        help="share of externally loaded blocks that fail (default %(default)s)",
    )
    parser.add_argument(
        "--request-failure-rate",
        type=float,
        default=None,
        metavar="P",
        help="share of async loads that fail as a whole (failed_recving); "
        "default: the --failure-rate",
    )
    parser.add_argument(
        "--policy",
        choices=LOAD_FAILURE_POLICIES,
        default=_DEFAULTS.policy,
        help="kv_load_failure_policy (default %(default)s)",
    )
    parser.add_argument(
        "--mode",
        choices=ROLLBACK_MODES,
        default=_DEFAULTS.mode,
        help="rollback mode (default %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=_DEFAULTS.seed,
        help="seed of the workload and the connector (default %(default)s)",
    )
    parser.add_argument(
        "--backend",
        choices=(*sorted(BACKEND_MODULES), "both"),
        default=None,
        help="backend to run on; 'both' runs each and compares their traces "
        "(default: the one 'import kvblocks' picks)",
    )
    parser.add_argument("--check", action="store_true", help="check the state after every step")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="write summary.json, usage.png (with matplotlib) and traces there",
    )
    parser.add_argument(
        "--trace", action="store_true", help="record the step trace (written to --out)"
    )
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=_DEFAULTS.workload,
        help="workload shape (default %(default)s)",
    )
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=_DEFAULTS.num_blocks,
        help="KV cache blocks, null block included (default %(default)s)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=_DEFAULTS.block_size,
        help="tokens per block (default %(default)s)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=_DEFAULTS.max_num_seqs,
        help="running requests at most (default %(default)s)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_DEFAULTS.max_num_batched_tokens,
        help="token budget per step (default %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=_DEFAULTS.max_model_len,
        help="tokens per request at most (default %(default)s)",
    )
    parser.add_argument(
        "--arrival-rate",
        type=float,
        default=_DEFAULTS.arrival_rate,
        help="mean arrivals per step outside bursts (default %(default)s)",
    )
    parser.add_argument(
        "--remote-share",
        type=float,
        default=_DEFAULTS.remote_share,
        help="share of requests whose prefix the connector holds (default %(default)s)",
    )
    parser.add_argument(
        "--async-share",
        type=float,
        default=_DEFAULTS.async_share,
        help="share of connector loads that are async (default %(default)s)",
    )
    parser.add_argument(
        "--hash-algo",
        choices=HASH_ALGORITHMS,
        default=_DEFAULTS.hash_algo,
        help="block hash function (default %(default)s)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _config(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        num_requests=args.requests,
        workload=args.workload,
        seed=args.seed,
        failure_rate=args.failure_rate,
        request_failure_rate=args.request_failure_rate,
        policy=args.policy,
        mode=args.mode,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        arrival_rate=args.arrival_rate,
        remote_share=args.remote_share,
        async_share=args.async_share,
        hash_algo=args.hash_algo,
        check=args.check,
    )


def main(args: argparse.Namespace, *, extra_checks: Sequence[ExtraCheck] = ()) -> int:
    """Runs ``kvblocks simulate`` with parsed ``args``; returns the exit status.

    Args:
        args: The parsed arguments of the ``simulate`` sub-parser.
        extra_checks: More per-step checks (library use and tests).
    """
    try:
        config = _config(args)
    except ValueError as exc:
        sys.stderr.write(f"kvblocks simulate: error: {exc}\n")
        return 2
    if args.backend is None:
        import kvblocks  # noqa: PLC0415 (only this branch reads kvblocks.BACKEND)

        names = [kvblocks.BACKEND]
    elif args.backend == "both":
        names = ["python", "rust"]
    else:
        names = [args.backend]
    both = len(names) > 1
    results: list[SimResult] = []
    for name in names:
        progress = None if args.quiet else Progress(sys.stderr, f"{name:>6}")
        result = run(
            config,
            backend=load_backend(name),
            backend_name=name,
            progress=progress,
            extra_checks=extra_checks,
            record_trace=args.trace or both,
        )
        if progress is not None:
            progress.close()
        results.append(result)
    print(summary_table(results))
    identical: bool | None = None
    if both:
        a, b = (r.trace or [] for r in results)
        difference = first_trace_difference(a, b)
        identical = difference is None
        print(
            f"traces: identical ({len(a)} steps)"
            if identical
            else f"traces: DIFFER at {difference}"
        )
    if args.out is not None:
        for path in write_outputs(results, args.out, traces_identical=identical):
            print(f"wrote {path}")
    ok = all(r.ok for r in results) and identical is not False
    return 0 if ok else 1


def _standalone(argv: Sequence[str] | None = None) -> int:
    """``python -m kvblocks.sim.cli``: the command without the ``kvblocks`` wrapper."""
    parser = argparse.ArgumentParser(prog="kvblocks")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_standalone())
