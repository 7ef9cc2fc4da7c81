"""Instructions in vLLM's scheduler step, kvblocks' manager against vLLM's (callgrind).

``kvblocks bench --workload vllm_scheduler`` times the step in wall time, which moves by
a few percent from run to run on a shared machine. An instruction count moves by under
1 %, so it shows what a change to the hot path saves. This script runs one
``vllm_scheduler`` row on each side to its steady state, then counts, under callgrind,
the instructions of ``schedule()`` and ``update_from_output()`` alone over ``--steps``
steps::

    python benches/step_instructions.py vllm_scheduler_256 --steps 50

It needs ``valgrind``, vLLM (the ``vllm`` extra, ``VLLM_TARGET_DEVICE=cpu``) and a
CPython whose ``libpython`` keeps its symbols (pyenv's builds do): callgrind counts only
inside ``functools_reduce``, CPython's C ``functools.reduce``, through which the two
calls are made. The two sides run at once, one per core: about 8 minutes for
``vllm_scheduler_256`` on 2 cores.
"""

from __future__ import annotations

import argparse
import functools
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvblocks import _native
from kvblocks.bench import vllm_scheduler

#: The C function inside which callgrind counts.
TOGGLE = "functools_reduce"

SIDES = {"vllm": "vLLM's manager and hasher", "kvblocks": "kvblocks' manager and hasher"}


def counted(call: Callable[..., Any], reduce: Callable[..., Any]) -> Callable[..., Any]:
    """``call``, made inside one call of ``reduce`` (``functools.reduce``)."""

    def wrapper(*args: Any) -> Any:
        return reduce(lambda _, __: call(*args), (None,), None)

    return wrapper


def count_steps(driver: Any, steps: int, reduce: Callable[..., Any] = functools.reduce) -> None:
    """Runs ``steps`` steps of ``driver`` (a warmed-up ``vllm_scheduler`` driver), its
    scheduler's ``schedule()`` and ``update_from_output()`` each inside ``reduce``."""
    scheduler = driver.scheduler
    scheduler.schedule = counted(scheduler.schedule, reduce)
    scheduler.update_from_output = counted(scheduler.update_from_output, reduce)
    for _ in range(steps):
        driver.step()


def steady_driver(row: str, side: str) -> Any:
    """The driver of ``row`` on ``side`` (``"vllm"`` or ``"kvblocks"``), warmed up."""
    specs = {spec.name: spec for spec in vllm_scheduler.workload_specs(quick=False)}
    if row not in specs:
        raise SystemExit(f"unknown row {row!r}: {', '.join(specs) or vllm_scheduler.status()}")
    workload = specs[row].build()
    if side == "vllm":
        assert workload.vllm_setup is not None
        return workload.vllm_setup()
    return workload.setup(_native)


def collected(valgrind_stderr: str) -> int:
    """The instruction count callgrind reports (``Collected : N``)."""
    found = re.findall(r"Collected : (\d+)", valgrind_stderr)
    if not found:
        raise RuntimeError(f"no count in valgrind's output:\n{valgrind_stderr[-2000:]}")
    return int(found[-1])


def measure(row: str, side: str, steps: int, out_dir: Path) -> int:
    """Instructions of ``steps`` steps of ``row`` on ``side``, counted in a child."""
    command = [
        "valgrind",
        "--tool=callgrind",
        "--collect-atstart=no",
        f"--toggle-collect={TOGGLE}",
        f"--callgrind-out-file={out_dir / f'{side}.callgrind'}",
        sys.executable,
        __file__,
        row,
        "--steps",
        str(steps),
        "--child",
        side,
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{side}: exit status {done.returncode}\n{done.stderr[-2000:]}")
    count = collected(done.stderr)
    if count == 0:
        raise RuntimeError(
            f"callgrind counted nothing: this CPython's libpython has no symbol {TOGGLE}"
        )
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Instructions in vLLM's scheduler step, kvblocks' manager against vLLM's."
    )
    parser.add_argument("row", nargs="?", default="vllm_scheduler_256")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--child", choices=sorted(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--keep", type=Path, help="keep the callgrind files in this directory")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.child:
        count_steps(steady_driver(args.row, args.child), args.steps)
        return 0
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed")
    out_dir = args.keep or Path(tempfile.mkdtemp(prefix="kvblocks-instructions-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(len(SIDES)) as pool:
        futures = {
            side: pool.submit(measure, args.row, side, args.steps, out_dir) for side in SIDES
        }
        counts = {side: future.result() for side, future in futures.items()}
    print(f"{args.row}, {args.steps} steps, schedule() + update_from_output():")
    for side, label in SIDES.items():
        print(f"  {label:<30} {counts[side] / 1e6:>10,.1f} M instructions")
    print(f"  {'ratio':<30} {counts['vllm'] / counts['kvblocks']:>10.3f}x")
    if args.keep is None:
        shutil.rmtree(out_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
