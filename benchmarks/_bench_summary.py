"""One call's result from its runs' records: `summarize` (the JSON's figures, per mode and between modes),
`table` (its markdown), `plot` (the iteration times around checkpoints), and `resummarize` (a results
folder's figures recomputed from its records).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _bench_figures import (
    WARMUP,
    blocks_figures,
    excess_after,
    flush_phase_slowdown,
    iteration_times,
    loss_match,
    overhead_vs_none,
    queue_split,
    restore_pairs,
    stall_figures,
)
from _bench_rounds import aggregate_rounds, overhead_table


def summarize(args: argparse.Namespace, records: dict[str, Any]) -> dict[str, Any]:
    base = iteration_times(records["none"])
    steady = [t for s, t in base.items() if s > WARMUP]
    median = statistics.median(steady) if steady else float("nan")
    modes: dict[str, Any] = {}
    names = ["none", "torch", "dcp", "dcp-zo", "datastates", "stress"]
    names += [n for n in records if n.startswith(("datastates-", "copy-"))]
    for name in names:
        rec = records.get(name, {})
        it = iteration_times(rec)
        measured = [t for s, t in it.items() if s > WARMUP]
        modes[name] = {
            "iterations": len(measured),
            "mean_iteration_s": statistics.fmean(measured) if measured else None,
            "checkpoints": len(rec.get("saves", [])),
            **stall_figures(rec, median),
            "save_call_s": [x["call_s"] for x in rec.get("saves", [])],
            "engine_save_s": [x.get("engine_save_s", 0.0) for x in rec.get("saves", [])],
            "staged_files": [x.get("staged_files", 0) for x in rec.get("saves", [])],
            "persisted_s": [c["persisted_s"] for c in rec.get("commits", [])]
            or [d["persisted_s"] for d in rec.get("dcp", [])],
            "committed_s": [c["committed_s"] for c in rec.get("commits", [])],
            "engine_stall_s": [c["stall_s"] for c in rec.get("commits", [])],
            "engine_queued_at_step_s": [c["queued_s"] for c in rec.get("commits", []) if "queued_s" in c],
            "engine_cpu_s": [c.get("engine_cpu_s", {}) for c in rec.get("commits", [])],
            "queue_split_median_s": queue_split(rec),
            "checkpoint_bytes": max((c["bytes"] for c in rec.get("commits", [])), default=None),
            # the bytes of the rank that wrote most, at each checkpoint (several ranks: balance_writes)
            "slowest_rank_bytes": [
                max(c["rank_bytes"]) for c in rec.get("commits", []) if c.get("rank_bytes")
            ],
            "memory": rec.get("memory"),
            "dcp_staging_waits_s": rec.get("dcp_staging_waits_s"),
            "raw_copy_s": rec.get("raw_copy_s"),
        }
        m = modes[name]
        if m["stall_median_s"] is not None and name != "stress":  # share of training time lost to checkpoints
            interval_s = args.interval * m["median_quiet_iteration_s"]
            m["stall_share_of_interval"] = m["stall_median_s"] / interval_s
        m["flush_phase_slowdown"] = flush_phase_slowdown(rec, args.interval)
        on_off = blocks_figures(rec, getattr(args, "blocks", 0))
        if on_off is not None:  # --blocks
            m["blocks"], m["blocks_on_vs_off"] = on_off, on_off["on_vs_off"]
        m["excess_after_s"] = excess_after(rec, args.interval)
        overhead = overhead_vs_none(rec, records["none"], args.interval) if name != "none" else None
        m["overhead_vs_none"] = overhead
        for part in ("total", "stall", "flush", "far"):
            if overhead is not None and part in overhead:
                m[f"overhead_{part}"] = overhead[part]
        if modes["none"]["mean_iteration_s"] and modes[name]["mean_iteration_s"]:
            modes[name]["throughput_loss"] = (
                modes[name]["mean_iteration_s"] / modes["none"]["mean_iteration_s"] - 1
            )
    first = {name: _first_step_s(rec) for name, rec in records.items() if name != "stress"}
    # The scratch start: the median over every run that builds the model from scratch (the first run of a
    # call, cold, may take a second more than the others; a single run as the baseline swung the ratio).
    scratch = [v for k, v in first.items() if not k.startswith("restore") and v is not None]
    first["scratch_median"] = statistics.median(scratch) if scratch else None
    restore = {
        name: v - first["scratch_median"]
        for name, v in first.items()
        if name.startswith("restore-") and v is not None and scratch
    }
    if modes["stress"]["mean_iteration_s"]:  # every iteration carries one checkpoint: its cost, on average
        modes["stress"]["cost_per_checkpoint_s"] = modes["stress"]["mean_iteration_s"] - median
    ratios = {}
    ds = modes["datastates"]["stall_median_s"]
    for key, other in (("stall_vs_native", "torch"), ("stall_vs_dcp", "dcp"), ("stall_vs_dcp_zo", "dcp-zo")):
        if modes[other]["stall_median_s"] and ds is not None:
            ratios[key] = ds / modes[other]["stall_median_s"]
        local = modes["datastates"]["stall_local_median_s"], modes[other]["stall_local_median_s"]
        if local[0] is not None and local[1]:
            ratios[f"{key}_local"] = local[0] / local[1]
    one = modes.get("datastates-onewriter", {}).get("persisted_s")
    if one and modes["datastates"]["persisted_s"]:  # balanced writes against rank 0 of the replicas writing
        ratios["persisted_vs_one_writer"] = statistics.median(modes["datastates"]["persisted_s"]) / (
            statistics.median(one)
        )
    pairs = restore_pairs(restore)
    if pairs:
        ratios["restore_speedup_vs_native"] = statistics.median(pairs)
        if len(pairs) > 1:
            ratios["restore_speedup_by_pair"] = pairs
    # When each run's set-up phases ended (seconds after the trainer's construction began).
    marks = {k: {"init_s": v["init_s"], **v.get("marks", {})} for k, v in records.items() if "init_s" in v}
    return {
        "command": " ".join(sys.argv),
        "gpu": _gpu_name(),
        "model": args.model,
        "layout": getattr(args, "layout", "1gpu"),
        "micro_batch": getattr(args, "micro_batch", None),
        "fp32_grads": not getattr(args, "no_fp32_grads", False),
        "steps": args.steps,
        "interval": args.interval,
        "sync": getattr(args, "sync", "device"),  # results before --sync were timed with device
        "blocks": getattr(args, "blocks", 0),
        "median_iteration_s": median,
        "modes": modes,
        "restore_to_first_step_s": restore,
        "first_step_end_s": first,
        "setup_marks_s": marks,
        # Nanotron's dummy data restarts from its seed on resume, so a resumed run is compared with the run
        # resumed from the other engine's checkpoint of the same step (same data), and the two training
        # runs with each other (the same seed: equal if training is deterministic).
        "resume_losses": {
            "restore-datastates vs restore-torch": loss_match(
                records.get("restore-datastates", {}), records.get("restore-torch", {})
            ),
            "datastates vs torch": loss_match(records.get("datastates", {}), records.get("torch", {})),
        },
        "ratios": ratios,
        "runs": {k: {"rc": v["rc"], "seconds": v["seconds"]} for k, v in records.items()},
    }


def resummarize(out: Path) -> int:
    """Recomputes a results folder's figures from its raw records, keeping the command that ran them; a
    folder of `--rounds` (round0/, round1/ ...): each round's, then the rounds' summary."""
    rounds = sorted(out.glob("round[0-9]*/"), key=lambda p: int(p.name[len("round") :]))
    if rounds:
        for r in rounds:
            resummarize(r)
        per_round = [json.loads(next(r.glob("bench_nanotron_*.json")).read_text()) for r in rounds]
        old = json.loads((out / "rounds_summary.json").read_text())
        summary = {
            **aggregate_rounds(per_round),
            "command": old["command"],
            "resummarized": " ".join(sys.argv),
        }
        (out / "rounds_summary.json").write_text(json.dumps(summary, indent=1))
        (out / "rounds_summary.md").write_text(overhead_table(summary) + "\n")
        return 0
    (stem,) = out.glob("bench_nanotron_*.json")
    old = json.loads(stem.read_text())
    records = json.loads((out / f"records_{old['model']}.json").read_text())
    args = argparse.Namespace(
        model=old["model"],
        steps=old["steps"],
        interval=old["interval"],
        layout=old.get("layout", "1gpu"),
        micro_batch=old.get("micro_batch"),
        no_fp32_grads=not old.get("fp32_grads", True),
        sync=old.get("sync", "device"),  # how the runs were timed: the records' clock, not today's default
        blocks=old.get("blocks", 0),
    )
    result = summarize(args, records)
    for key in ("command", "gpu", "cold_cache"):
        if key in old:
            result[key] = old[key]
    result["resummarized"] = " ".join(sys.argv)
    stem.write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(table(result))
    return 0


def _gpu_name() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def _first_step_s(rec: dict[str, Any]) -> float | None:
    """When the first step ended, after the trainer's construction began, Nanotron main's library report
    (collect_env: subprocesses, the same work in every mode) left out."""
    ends = rec.get("ends")
    return ends[0][1] - rec.get("marks", {}).get("library_report_s", 0.0) if ends else None


def table(r: dict[str, Any]) -> str:
    def ms(x: Any) -> str:
        return "-" if x is None else f"{1e3 * x:.1f}"

    lines = [
        f"model {r['model']} on {r.get('layout', '1gpu')}, {r['steps']} steps, checkpoint every "
        f"{r['interval']}; median iteration {ms(r['median_iteration_s'])} ms",
        "",
        "| mode | checkpoints | median stall ms | local stall ms | stall / interval | flushing vs idle | "
        "mean iteration ms | mean vs none | persisted s | host GB: PSS (shm peak) | GPU peak GB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in r["modes"].items():
        loss = m.get("throughput_loss")
        persisted = ", ".join(f"{p:.2f}" for p in m["persisted_s"][:6]) or "-"
        stall, mean = ms(m["stall_median_s"]), ms(m["mean_iteration_s"])
        loss_text = "-" if loss is None else f"{100 * loss:+.1f}%"
        share = m.get("stall_share_of_interval")
        share_text = "-" if share is None else f"{100 * share:.2f}%"
        flush = m.get("flush_phase_slowdown")
        flush_text = "-" if flush is None else f"{100 * flush:+.1f}%"
        local = ms(m.get("stall_local_median_s"))
        mem = m.get("memory") or {}
        # results written when PSS was sampled in the background name it by its peak
        old = mem.get("host_peak_pss_tree_bytes", mem.get("host_peak_rss_bytes", 0))
        pss = mem.get("host_pss_tree_bytes", old)
        host = f"{pss / 1e9:.1f} ({mem['shm_peak_bytes'] / 1e9:.1f})" if mem else "-"
        gpu = f"{mem['gpu_max_reserved_bytes'] / 1e9:.1f}" if mem else "-"
        cells = [name, m["checkpoints"], stall, local, share_text, flush_text, mean, loss_text, persisted]
        cells += [host, gpu]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    on_off = {n: m["blocks"] for n, m in r["modes"].items() if m.get("blocks")}
    if on_off:
        lines += [
            "",
            "blocks that take checkpoints over those that do not, within each run (--blocks): "
            + ", ".join(
                f"{n} {100 * b['on_vs_off']:+.1f}% ({1e3 * b['on_mean_iteration_s']:.1f} against "
                f"{1e3 * b['off_mean_iteration_s']:.1f} ms)"
                for n, b in on_off.items()
            ),
        ]
    lines += [
        "",
        "restore to the first step, over the median scratch start: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in r["restore_to_first_step_s"].items()),
        "first step ends, after the trainer's construction began: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in r["first_step_end_s"].items() if v is not None),
        "losses equal, bit for bit (training is not deterministic here, so False is expected: "
        "nanotron_proof.py compares the restored state itself): "
        + ", ".join(
            f"{k} {v['bitwise']} ({len(v['steps'])} steps, largest difference {v['max_abs_diff']})"
            for k, v in r["resume_losses"].items()
        ),
        "ratios: " + ", ".join(f"{k} {_figure(v)}" for k, v in r["ratios"].items()),
        "bytes of the rank that wrote most, GB: "
        + ", ".join(
            f"{k} {', '.join(f'{b / 1e9:.2f}' for b in m['slowest_rank_bytes'])}"
            for k, m in r["modes"].items()
            if m.get("slowest_rank_bytes")
        ),
        "",
    ]
    return "\n".join(lines)


def _figure(v: float | list[float]) -> str:
    return f"[{', '.join(f'{x:.2f}' for x in v)}]" if isinstance(v, list) else f"{v:.4f}"


def plot(records: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name in ("none", "torch", "dcp", "datastates"):
        it = iteration_times(records.get(name, {}))
        steps = [s for s in it if s > WARMUP]
        ax.plot(steps, [1e3 * it[s] for s in steps], label=name, marker=".", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("iteration time (ms, log)")
    ax.set_title(f"Nanotron {args.model}: iteration time, checkpoint every {args.interval} steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
