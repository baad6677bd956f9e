"""The rounds of `--rounds N` put together: each mode's figures over the rounds (`aggregate_rounds`), and
the headline table of the training time over the run without checkpoints (`overhead_table`).
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from _bench_figures import AFTER, BEFORE, WINDOW


def overhead_table(summary: dict[str, Any]) -> str:
    """The headline: each mode's training time over the run without checkpoints, median [min, max] over the
    rounds, and the same by the iterations' place after a checkpoint; its median stall."""

    def pct(figures: dict[str, Any], key: str) -> str:
        f = figures.get(key)
        if f is None:
            return "-"
        return f"{100 * f['median']:+.1f}% [{100 * f['min']:+.1f}, {100 * f['max']:+.1f}]"

    lines = [
        f"{summary['rounds']} rounds; training time over the run without checkpoints in the same round, "
        "median [min, max]",
        "",
        "| mode | whole run | stall iterations | while persisting | far from a checkpoint | median stall "
        "ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in summary["modes"].items():
        if name == "none":
            continue
        stall = m.get("stall_median_s")
        cells = [name] + [pct(m, f"overhead_{k}") for k in ("total", "stall", "flush", "far")]
        cells.append("-" if stall is None else f"{1e3 * stall['median']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    on_off = {n: pct(m, "blocks_on_vs_off") for n, m in summary["modes"].items() if "blocks_on_vs_off" in m}
    if on_off:  # --blocks: the figure that the drift between runs does not move
        lines += ["", "blocks with checkpoints over blocks without, within each run: "]
        lines[-1] += ", ".join(f"{n} {v}" for n, v in on_off.items())
    excess = summary.get("excess_after_s", {})
    if excess:
        lines += [
            "",
            f"Excess of each of the {AFTER} iterations after a checkpoint over the median of the {BEFORE} "
            "before it, ms (mean over the checkpoints and rounds; none's at the same steps)",
            "",
            "| mode | " + " | ".join(f"+{j}" for j in range(1, AFTER + 1)) + f" | first {WINDOW} | all |",
            "| --- " * (AFTER + 3) + "|",
        ]
        for name, row in excess.items():
            cells = [name] + [f"{1e3 * x:.1f}" for x in row]
            cells += [f"{1e3 * sum(row[:WINDOW]):.1f}", f"{1e3 * sum(row):.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


ROUND_FIGURES = (
    "stall_median_s",
    "stall_share_of_interval",
    "throughput_loss",
    "blocks_on_vs_off",
    "mean_iteration_s",
    "overhead_total",
    "overhead_stall",
    "overhead_flush",
    "overhead_far",
)


def aggregate_rounds(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode and figure (ROUND_FIGURES), the value of every round and their median; the ratios too."""
    modes: dict[str, Any] = {}
    for r in results:
        for name, m in r["modes"].items():
            for key in ROUND_FIGURES:
                if m.get(key) is not None:
                    modes.setdefault(name, {}).setdefault(key, []).append(m[key])
    excess: dict[str, list[float]] = {}  # after a checkpoint, iteration by iteration: the rounds' mean
    for name in modes:
        rows = [r["modes"][name].get("excess_after_s") for r in results if name in r["modes"]]
        rows = [row for row in rows if row]
        if rows:
            excess[name] = [statistics.fmean(col) for col in zip(*rows)]
    ratios: dict[str, list[float]] = {}
    for r in results:
        for key, v in r.get("ratios", {}).items():
            ratios.setdefault(key, []).append(v)
    med = statistics.median
    return {
        "command": " ".join(sys.argv),
        "rounds": len(results),
        "modes": {
            n: {k: {"rounds": v, "median": med(v), "min": min(v), "max": max(v)} for k, v in m.items()}
            for n, m in modes.items()
        },
        "ratios": {k: {"rounds": v, "median": med(v)} for k, v in ratios.items()},
        "excess_after_s": excess,
    }
