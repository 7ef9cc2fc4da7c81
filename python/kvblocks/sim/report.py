"""Presenting runs: a progress bar, the summary table, JSON, a trace and a PNG."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from kvblocks._output import format_seconds, headless_pyplot, progress_bar
from kvblocks.sim.results import HIT_RATE_WINDOW

if TYPE_CHECKING:
    from kvblocks.sim.results import SimResult, StepRecord, Summary
    from kvblocks.sim.scheduler import Simulator

__all__ = ["Progress", "summary_table", "trace_lines", "write_outputs"]


class Progress:
    """A carriage-return progress bar on a text stream (no dependencies).

    Redraws at most ``1 / interval_s`` times a second; :meth:`close` draws the final
    state and ends the line.

    Args:
        out: Where to draw (normally ``sys.stderr``).
        label: Shown before the bar.
        interval_s: Minimum time between redraws.
    """

    __slots__ = ("_last", "_sim", "interval_s", "label", "out")

    def __init__(self, out: TextIO, label: str, interval_s: float = 0.1) -> None:
        self.out = out
        self.label = label
        self.interval_s = interval_s
        self._last = 0.0
        self._sim: Simulator | None = None

    def __call__(self, sim: Simulator) -> None:
        """Redraws the bar for the simulator's state (throttled)."""
        self._sim = sim
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        self._draw(sim)

    def _draw(self, sim: Simulator) -> None:
        c = sim.counters
        total = max(sim.config.num_requests, 1)
        done = c.finished + c.failed
        self.out.write(
            f"\r{self.label} {progress_bar(done, total, 30)} {done}/{sim.config.num_requests} "
            f"step {sim.step} usage {sim.pool.get_usage():4.0%} "
            f"running {len(sim.running):>3} waiting {len(sim.waiting):>4}"
        )
        self.out.flush()

    def close(self) -> None:
        """Draws the last state seen and ends the line."""
        if self._sim is None:
            return
        self._draw(self._sim)
        self.out.write("\n")
        self.out.flush()


def _rows(s: Summary, policy: str) -> list[tuple[str, str]]:
    return [
        ("requests finished", f"{s.finished} / {s.requests}"),
        ("requests failed", str(s.failed)),
        ("rescheduled (sync, recompute)", str(s.rescheduled)),
        ("retried (async, recompute)", str(s.retried)),
        ("preemptions (stall)", f"{s.preemptions} ({s.stall_preemptions})"),
        ("steps", str(s.steps)),
        ("tokens computed", str(s.tokens_scheduled)),
        (
            "tokens recomputed" if policy == "recompute" else "tokens lost (failed requests)",
            str(s.tokens_rolled_back),
        ),
        ("external loads sync / async", f"{s.sync_loads} / {s.async_loads}"),
        ("external tokens (blocks)", f"{s.external_tokens} ({s.external_blocks})"),
        ("invalid blocks reported", str(s.invalid_blocks_reported)),
        ("async loads failed whole", str(s.request_load_failures)),
        ("blocks evicted", str(s.evicted_blocks)),
        ("prefix hit rate", f"{s.hit_rate:.1%} ({s.prefix_hits}/{s.prefix_queries})"),
        ("peak block usage", f"{s.peak_usage:.1%}"),
        ("final block usage (free)", f"{s.final_usage:.1%} ({s.final_free_blocks})"),
        ("outputs over stale KV (reqs)", f"{s.stale_reads} ({s.stale_outputs})"),
        ("stale blocks left cached", str(s.stale_hashed_blocks)),
        ("hashed behind shared invalid", str(s.shared_tail_hashed)),
        ("scheduler time / step", format_seconds(s.mean_step_s)),
        ("checks passed (time)", f"{s.checks_passed} ({format_seconds(s.check_s)})"),
        ("wall time", format_seconds(s.wall_s)),
    ]


def summary_table(results: Sequence[SimResult]) -> str:
    """One column per run (backend), one row per metric, then the check verdicts."""
    columns = [_rows(r.summary, r.config.policy) for r in results]
    labels = [label for label, _ in columns[0]]
    headers = ["", *(r.summary.backend for r in results)]
    body = [[label, *(col[i][1] for col in columns)] for i, label in enumerate(labels)]
    body.append(["checks", *("ok" if r.ok else "FAILED" for r in results)])
    widths = [max(len(row[j]) for row in [headers, *body]) for j in range(len(headers))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in body:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    for r in results:
        if r.failure is not None:
            lines.append(f"{r.summary.backend}: check failed at {r.failure}")
    return "\n".join(lines)


def trace_lines(trace: Sequence[StepRecord]) -> list[str]:
    """The trace as JSON lines, one step each."""
    return [json.dumps(asdict(record), separators=(",", ":")) for record in trace]


def write_outputs(
    results: Sequence[SimResult],
    out_dir: Path,
    *,
    traces_identical: bool | None = None,
) -> list[Path]:
    """Writes ``summary.json``, ``trace-<backend>.jsonl`` (for runs with a trace) and,
    when matplotlib is importable, ``usage.png``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {
        "config": asdict(results[0].config),
        "traces_identical": traces_identical,
        "runs": [
            {
                "summary": asdict(r.summary),
                "ok": r.ok,
                "failure": None if r.failure is None else str(r.failure),
                "series": r.series.as_dict(),
            }
            for r in results
        ],
    }
    written = [out_dir / "summary.json"]
    written[0].write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    for r in results:
        if r.trace is not None:
            path = out_dir / f"trace-{r.summary.backend}.jsonl"
            path.write_text("\n".join(trace_lines(r.trace)) + "\n", encoding="utf-8")
            written.append(path)
    png = _plot(results[0], out_dir / "usage.png")
    if png is not None:
        written.append(png)
    return written


def _plot(result: SimResult, path: Path) -> Path | None:
    """Usage and hit rate over time (and queue lengths), if matplotlib is there."""
    plt = headless_pyplot()
    if plt is None:
        return None
    series = result.series
    cfg = result.config
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    top.plot(series.steps, [u * 100 for u in series.usage], color="#c0504d", label="block usage")
    top.plot(
        series.steps,
        [h * 100 for h in series.hit_rate],
        color="#4f81bd",
        label=f"prefix hit rate (last {HIT_RATE_WINDOW} steps)",
    )
    top.set_ylabel("%")
    top.set_ylim(0, 105)
    top.legend(loc="lower right")
    top.set_title(
        f"kvblocks simulate: {cfg.workload}, {cfg.num_requests} requests, "
        f"failure rate {cfg.failure_rate:g}, policy {cfg.policy}, mode {cfg.mode}"
    )
    bottom.plot(series.steps, series.running, color="#9bbb59", label="running")
    bottom.plot(series.steps, series.waiting, color="#8064a2", label="waiting")
    bottom.set_xlabel("scheduler step")
    bottom.set_ylabel("requests")
    bottom.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
