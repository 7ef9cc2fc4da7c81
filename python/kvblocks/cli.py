"""The ``kvblocks`` command line: ``bench`` (the main job), ``simulate`` and ``demo``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import kvblocks
from kvblocks.sim import cli as sim_cli


def _pool_line(pool: kvblocks.BlockPool) -> str:
    return (
        f"free={pool.get_num_free_blocks():>2}  usage={pool.get_usage():5.1%}  "
        f"free queue (next to allocate first)={pool.free_block_ids()}"
    )


def demo() -> int:
    """Allocate, share, free and evict on a small pool, printing its state at each step."""
    print(f"kvblocks demo (backend: {kvblocks.BACKEND})\n")
    block_size = 4
    hasher = kvblocks.BlockHasher(block_size, "sha256")
    manager = kvblocks.KVCacheManager(num_blocks=11, block_size=block_size)
    pool = manager.block_pool
    print("a new pool of 11 blocks (block 0 is the null block):")
    print("  ", _pool_line(pool))

    system_prompt = list(range(100, 112))  # 3 full blocks shared by both requests
    first = kvblocks.Request("r0", [*system_prompt, 1, 2, 3], block_hasher=hasher)
    blocks, hit = manager.get_computed_blocks(first)
    manager.allocate_slots(first, first.num_tokens - hit, hit, blocks)
    first.num_computed_tokens = first.num_tokens
    print(f"\nr0 ({first.num_tokens} tokens) admitted, prefix hit {hit} tokens:")
    print("   r0 table:", manager.get_block_ids("r0")[0])
    print("  ", _pool_line(pool))

    second = kvblocks.Request("r1", [*system_prompt, 7, 8], block_hasher=hasher)
    blocks, hit = manager.get_computed_blocks(second)
    manager.allocate_slots(second, second.num_tokens - hit, hit, blocks)
    second.num_computed_tokens = second.num_tokens
    print(f"\nr1 ({second.num_tokens} tokens) shares the system prompt, prefix hit {hit} tokens:")
    print("   r1 table:", manager.get_block_ids("r1")[0])
    shared = manager.get_block_ids("r1")[0][:3]
    print("   ref counts of the shared blocks:", [pool.get_block(b).ref_cnt for b in shared])
    print("  ", _pool_line(pool))

    manager.free(first)
    manager.free(second)
    print("\nboth freed, tail first; hashed blocks stay cached at the LRU end of the queue:")
    print("  ", _pool_line(pool))

    third = kvblocks.Request("r2", [*system_prompt, 9], block_hasher=hasher)
    blocks, hit = manager.get_computed_blocks(third)
    print(f"\nr2 finds {hit} cached tokens in blocks {blocks} and reuses them.")
    pool.check_invariants()
    print("check_invariants(): ok")
    return 0


def _positive_int(text: str) -> int:
    """An argparse type: an int of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvblocks`` console script."""
    parser = argparse.ArgumentParser(prog="kvblocks", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvblocks {kvblocks.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="a short walk through allocation, sharing and eviction")
    bench = sub.add_parser(
        "bench",
        help="time every workload on both backends, side by side, in one process "
        "(and on vLLM's own code when vLLM is installed; with kvblocks.vllm too, vLLM's "
        "Scheduler step with kvblocks' KV cache manager against its own: the "
        "vllm_scheduler group)",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="smaller sizes, fewer scheduler steps, 3 rounds (< 1 min without vLLM)",
    )
    bench.add_argument(
        "--workload",
        action="append",
        default=[],
        metavar="NAME",
        help="run only workloads whose name starts with NAME (repeatable), e.g. vllm_scheduler",
    )
    bench.add_argument(
        "--rounds", type=_positive_int, default=None, help="rounds per workload (at least 1)"
    )
    bench.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write results.json, results.md and results.png there",
    )
    sim_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo()
    if args.command == "bench":
        from kvblocks import bench as bench_module  # noqa: PLC0415 (only `kvblocks bench` loads the bench)

        return bench_module.main(args.workload, args.quick, args.rounds, args.out)
    if args.command == "simulate":
        return sim_cli.main(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
