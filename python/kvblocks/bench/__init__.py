"""``kvblocks bench``: every workload on both backends, side by side, in one process.

Both backends (and vLLM's own code, when it is installed and the workload has a
counterpart) run each workload in the same process, interleaved round by round, so a
noisy machine slows them alike and the ratios (reference or vLLM time / native time)
hold. The ``vllm_scheduler`` group (:mod:`kvblocks.bench.vllm_scheduler`, present when
vLLM and ``kvblocks.vllm`` import) times vLLM's own Scheduler step with kvblocks'
manager (the native column) and with vLLM's (the vLLM column); it has no reference
column.
"""

from __future__ import annotations

import ctypes
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

from kvblocks import load_backend
from kvblocks._output import format_seconds, headless_pyplot, progress_bar
from kvblocks.bench import vllm_runner, vllm_scheduler
from kvblocks.bench.workload import Workload, WorkloadSpec
from kvblocks.bench.workloads import all_workloads

__all__ = ["BenchResult", "run", "vllm_status"]


@dataclass(frozen=True, slots=True)
class BenchResult:
    """Timings of one workload on both backends (seconds per run, all rounds).

    ``python_s`` is empty for a workload the reference backend does not run
    (``Workload.has_reference``): the ``vllm_scheduler`` group compares kvblocks'
    manager with vLLM's inside vLLM's own scheduler.
    """

    name: str
    group: str
    description: str
    ops: int
    op_name: str
    python_s: list[float]
    rust_s: list[float]
    #: Timings on vLLM's own code; empty when vLLM was not run (see ``has_vllm``).
    vllm_s: list[float] = field(default_factory=list)
    #: Whether vLLM has a counterpart of this workload.
    has_vllm: bool = False
    #: Why vLLM's run of this workload failed (``"TypeError: ..."``), if it did.
    vllm_error: str | None = None

    @property
    def python_per_op(self) -> float | None:
        """Median reference time per operation, in seconds, when the reference ran."""
        return statistics.median(self.python_s) / self.ops if self.python_s else None

    @property
    def rust_per_op(self) -> float:
        """Median native time per operation, in seconds."""
        return statistics.median(self.rust_s) / self.ops

    @property
    def vllm_per_op(self) -> float | None:
        """Median vLLM time per operation, in seconds, when vLLM ran."""
        return statistics.median(self.vllm_s) / self.ops if self.vllm_s else None

    @property
    def vllm_ratio(self) -> float | None:
        """How many times faster the native backend is than vLLM, when vLLM ran."""
        if not self.vllm_s:
            return None
        return statistics.median(self.vllm_s) / statistics.median(self.rust_s)

    @property
    def ratio(self) -> float | None:
        """How many times faster the native backend is than the reference (median over
        median), when the reference ran."""
        if not self.python_s:
            return None
        return statistics.median(self.python_s) / statistics.median(self.rust_s)


def vllm_status() -> str:
    """Why the vLLM column is absent, or the vLLM version that fills it."""
    return vllm_runner.status()


def _progress(done: int, total: int, label: str, out: TextIO) -> None:
    out.write(f"\r{progress_bar(done, total, 28)} {done}/{total} {label[:40]:<40}")
    out.flush()


#: glibc's ``mallopt`` parameters (``<malloc.h>``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _pin_allocator() -> None:
    """Fixes glibc malloc's trim and mmap thresholds, so a timed run reuses the heap pages
    earlier runs faulted in, whichever backend ran before it.

    glibc adapts both thresholds to what was freed and returns the heap's free top to the
    kernel, so whether a run's large allocations fault in fresh pages depends on the run
    before it: ``rollback_manager_256``'s native run (8 MB of set tables) took 45% longer
    after one version of the reference than after another. No-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # 32 MiB is glibc's ceiling for the mmap threshold on 64-bit platforms.
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    mallopt(_M_TRIM_THRESHOLD, 1 << 30)


def _timed(setup: Callable[[], Any], run: Callable[[Any], Any]) -> tuple[float, Any, Any]:
    """``run(setup())``, timed; returns ``(seconds, state, result)``.

    Everything that exists before the timed region (the workload's script, the fresh
    state, the other backend's leftovers) is moved to the garbage collector's permanent
    generation first, as vLLM does with ``gc.freeze()`` once its engine is up:
    collections during the run scan only what the run itself allocates. There is no
    ``gc.collect()`` before it: walking the whole heap would also evict the run's
    inputs from the CPU caches. Garbage frozen with the rest goes back to the oldest
    generation at ``gc.unfreeze()``; :func:`run` collects it between workloads.
    """
    state = setup()
    gc.freeze()
    try:
        start = time.perf_counter()
        result = run(state)
        elapsed = time.perf_counter() - start
    finally:
        gc.unfreeze()
    return elapsed, state, result


def _time_once(workload: Workload, backend: ModuleType) -> float:
    """One timed run of ``workload`` on ``backend``, from a fresh state, then checked."""
    elapsed, state, result = _timed(
        lambda: workload.setup(backend), lambda state: workload.run(backend, state)
    )
    if workload.self_timed:
        elapsed, result = result
    workload.check(state, result)
    return float(elapsed)


def run(
    selected: Sequence[WorkloadSpec],
    rounds: int,
    progress: TextIO | None = sys.stderr,
) -> list[BenchResult]:
    """Times every workload on both backends (and vLLM), ``rounds`` times each, interleaved.

    Each workload is built right before its rounds and dropped after them, so only its
    own data is in memory while it is measured.
    """
    backends = {name: load_backend(name) for name in ("python", "rust")}
    with_vllm = vllm_runner.available()
    _pin_allocator()
    results = []
    total = len(selected) * rounds
    for i, spec in enumerate(selected):
        if progress is not None:
            _progress(i * rounds, total, f"{spec.name} (building)", progress)
        workload = spec.build()
        times: dict[str, list[float]] = {name: [] for name in (*backends, "vllm")}
        vllm_error = None
        for r in range(rounds):
            if progress is not None:
                _progress(i * rounds + r, total, workload.name, progress)
            for name, backend in backends.items():
                if name == "python" and not workload.has_reference:
                    continue
                times[name].append(_time_once(workload, backend))
            if with_vllm and workload.has_vllm and vllm_error is None:
                assert workload.vllm_setup is not None and workload.vllm_run is not None
                try:
                    # Its results are checked against the reference's in
                    # benches/test_vllm_column.py.
                    elapsed, _, result = _timed(workload.vllm_setup, workload.vllm_run)
                    times["vllm"].append(result[0] if workload.self_timed else elapsed)
                except Exception as exc:  # vLLM's failure is reported, not fatal
                    vllm_error = f"{type(exc).__name__}: {exc}"
                    times["vllm"].clear()
        results.append(
            BenchResult(
                workload.name,
                workload.group,
                workload.description,
                workload.ops,
                workload.op_name,
                times["python"],
                times["rust"],
                times["vllm"],
                has_vllm=workload.has_vllm,
                vllm_error=vllm_error,
            )
        )
        del workload
        gc.collect()
    if progress is not None:
        _progress(total, total, "done", progress)
        progress.write("\n")
    return results


def markdown_table(results: Sequence[BenchResult]) -> str:
    """The results as a Markdown table, with the vLLM column and its footnote."""
    lines = [
        "| workload | what | reference per op | native per op | native speed-up "
        f"| vLLM {vllm_runner.column_version()} per op (native speed-up) |",
        "|---|---|---:|---:|---:|---|",
    ]
    absent = False
    failures: list[str] = []
    for r in results:
        vllm_per_op, vllm_ratio = r.vllm_per_op, r.vllm_ratio
        if vllm_per_op is not None and vllm_ratio is not None:
            vllm = f"{format_seconds(vllm_per_op)} / {r.op_name} (native {vllm_ratio:.1f}x)"
        elif r.vllm_error is not None:
            failures.append(f"{r.name}: {r.vllm_error}")
            vllm = "failed²"
        elif r.has_vllm:
            vllm, absent = "absent¹", True
        else:
            vllm = "—"
        python_per_op, ratio = r.python_per_op, r.ratio
        reference, speed_up = "—", "—"
        if python_per_op is not None and ratio is not None:
            reference, speed_up = (
                f"{format_seconds(python_per_op)} / {r.op_name}",
                f"**{ratio:.1f}x**",
            )
        lines.append(
            f"| `{r.name}` | {r.description} | {reference} "
            f"| {format_seconds(r.rust_per_op)} / {r.op_name} | {speed_up} | {vllm} |"
        )
    if absent:
        lines += ["", f"¹ {vllm_status()}."]
    if failures:
        lines += ["", f"² vLLM's run failed: {'; '.join(failures)}."]
    return "\n".join(lines)


def write_outputs(results: Sequence[BenchResult], out_dir: Path) -> list[Path]:
    """Writes ``results.json``, ``results.md`` and (with matplotlib) ``results.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "platform": platform.platform(),
        "vllm": vllm_status(),
        "vllm_scheduler": vllm_scheduler.status(),
    }
    payload = {
        "meta": meta,
        "results": [
            {
                **asdict(r),
                "python_per_op_s": r.python_per_op,
                "rust_per_op_s": r.rust_per_op,
                "ratio": r.ratio,
                "vllm_per_op_s": r.vllm_per_op,
                "vllm_ratio": r.vllm_ratio,
            }
            for r in results
        ],
    }
    written = [out_dir / "results.json", out_dir / "results.md"]
    written[0].write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    written[1].write_text(markdown_table(results) + "\n", encoding="utf-8")
    plt = headless_pyplot()
    ratios = [(r.name, r.ratio) for r in results if r.ratio is not None]
    if plt is None or not ratios:
        return written
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(ratios)))
    names = [name for name, _ in ratios]
    ax.barh(names, [ratio for _, ratio in ratios], color="#c0504d")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("native speed-up over the pure-Python reference (log scale)")
    ax.invert_yaxis()
    for y, (_, ratio) in enumerate(ratios):
        ax.text(ratio, y, f" {ratio:.1f}x", va="center")
    fig.tight_layout()
    png = out_dir / "results.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    written.append(png)
    return written


def main(names: Sequence[str], quick: bool, rounds: int | None, out: Path | None) -> int:
    """``kvblocks bench``: returns the process exit code."""
    available = {w.name: w for w in all_workloads(quick)}
    prefixes = list(names)
    selected = [
        w for w in available.values() if not prefixes or any(w.name.startswith(p) for p in prefixes)
    ]
    # The vllm_scheduler group, when asked for (or everything is) but absent: say why.
    group = vllm_scheduler.GROUP
    absent = None
    if not vllm_scheduler.available() and (
        not prefixes or any(group.startswith(p) or p.startswith(group) for p in prefixes)
    ):
        absent = f"the {group} group is absent: {vllm_scheduler.status()}"
    if not selected:
        sys.stderr.write(
            f"kvblocks bench: no workload matches {', '.join(prefixes)}; "
            f"available: {', '.join(available)}\n"
        )
        if absent is not None:
            sys.stderr.write(f"kvblocks bench: {absent}\n")
        return 2
    results = run(selected, rounds or (3 if quick else 7))
    print(markdown_table(results))
    if absent is not None:
        print(f"\n{absent[0].upper()}{absent[1:]}.")
    if out is not None:
        for path in write_outputs(results, out):
            print(f"wrote {path}")
    return 0
