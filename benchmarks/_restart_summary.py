"""bench_restart.py's result from its runs' records: each restore's and restart's first step over the start
from scratch of the same engine, their ratios, the repeats' spread, the comparison with the state saved, the
lost node's figures and each run's memory peaks.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def first_step(rec: dict[str, Any]) -> float | None:
    marks = rec.get("marks", {})
    if "first_step_end_s" not in marks:
        return None
    return marks["first_step_end_s"] - marks.get("library_report_s", 0.0) - marks.get("compare_s", 0.0)


def summarize(args: argparse.Namespace, records: dict[str, Any]) -> dict[str, Any]:
    def last(name: str) -> dict[str, Any]:
        runs = records.get(name, {}).get("runs", [])
        return runs[-1] if runs else {}

    # Each restore against the runs of the same engine built from scratch in the same call (the first run of
    # a call also pays the machine's cold start: `none` runs first to take it): their median, where the
    # engine started from scratch more than once (`--scratch-twice`, `--repeats`), as a start's time
    # depends on what ran on the machine before it.
    scratch_s = {e: scratch_starts(records, e) for e in ("datastates", "torch")}
    restore = {}
    for name, scratch_run in (
        ("restore-torch", "torch"),
        ("restore-datastates", "datastates"),
        ("restart-memory", "datastates"),
        ("restart-replica", "datastates"),
    ):
        t, scratch = first_step(last(name)), median(scratch_s[scratch_run])
        restore[name] = None if t is None or scratch is None else t - scratch
    native = restore.get("restore-torch")
    ratios = {
        f"native_over_{k.split('-', 1)[1]}": native / v
        for k, v in restore.items()
        if k != "restore-torch" and native and v and v > 0
    }
    repeats = [k for k in records if k.split(".")[0] == "restart-memory" and "runs" in records[k]]
    compared = last("restart-memory").get("compared", {})
    each = [records[k]["runs"][-1].get("compared", {}) for k in repeats]
    if "restart-replica" in records:
        each.append(last("restart-replica").get("compared", {}))
    bitwise = bool(each) and all(c and all(p["differences"] == 0 for p in c.values()) for c in each)
    replica = last("restart-replica")
    without = (records.get("restart-memory", {}).get("runs") or [{}])[0]  # its first start: replicas off
    lost_node = None
    if replica:
        first = records["restart-replica"]["runs"][0] if records["restart-replica"]["runs"] else {}
        lost_node = {
            "resumed_from_memory": replica.get("resumed_from_memory"),
            "ranks_from_memory": replica.get("ranks_from_memory"),
            "sources": replica.get("sources"),  # [GROUP_RANK, the folder its files were read from] by rank
            "compared": {
                k: {"tensors": v["tensors"], "differences": v["differences"]}
                for k, v in replica.get("compared", {}).items()
            },
            "replicated": first.get("replicated"),
            "stall_s": first.get("stall_s"),  # replication on; restart-memory's: off
            "stall_without_replicas_s": without.get("stall_s"),
        }
    return {
        "command": " ".join(sys.argv),
        "model": args.model,
        "step": args.step,
        "dp": args.dp,
        "tp": getattr(args, "tp", 1),
        "zero_stage": args.zero,
        # restart-replica's memory checkpoints, where it took them (absent: it resumed storage's checkpoint)
        **({"memory_interval": args.memory_interval} if getattr(args, "memory_interval", None) else {}),
        "first_step_end_s": {k: first_step(last(k)) for k in records if "runs" in records[k]},
        **({"scratch_s": scratch_s} if any(len(v) > 1 for v in scratch_s.values()) else {}),
        "restore_over_scratch_s": restore,
        "ratios": ratios,
        "repeats": repeated_restarts(records, repeats),
        "resumed_from_memory": last("restart-memory").get("resumed_from_memory"),
        "ranks_from_memory": last("restart-memory").get("ranks_from_memory"),
        "compared": {
            k: {"tensors": v["tensors"], "differences": v["differences"]} for k, v in compared.items()
        },
        "bitwise": bitwise,
        "tier": last("restart-memory").get("tier"),
        "lost_node": lost_node,
        # Each run's peaks over its incarnations (the restart's first trains and saves, its second restores).
        "memory": {k: peaks(records[k]["runs"]) for k in records if "runs" in records[k]},
        "records": records,
    }


def scratch_starts(records: dict[str, Any], engine: str) -> list[float]:
    """The first steps of the call's starts from scratch of `engine` (`datastates`, `datastates.2`,
    `datastates.end` ...), in the order they ran."""
    runs = [records[k]["runs"] for k in records if k.split(".")[0] == engine and records[k].get("runs")]
    return [t for t in (first_step(r[-1]) for r in runs) if t is not None]


def median(values: list[float]) -> float | None:
    got = sorted(values)
    return (got[(len(got) - 1) // 2] + got[len(got) // 2]) / 2 if got else None


def repeated_restarts(records: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Each restart from memory over the start from scratch that ran next to it (`datastates`, `.2` ...), and
    over its own first incarnation (a start from scratch in the same torchrun): values, median, spread."""

    def stats(values: list[float | None]) -> dict[str, Any]:
        got = sorted(v for v in values if v is not None)
        return {"values": values, "median": median(got), "min": got[0] if got else None,
                "max": got[-1] if got else None}  # fmt: skip

    over_scratch, over_own_start = [], []
    for name in names:
        runs = records[name]["runs"]
        scratch = records.get(name.replace("restart-memory", "datastates"), {}).get("runs", [])
        t = first_step(runs[-1]) if runs else None
        s = first_step(scratch[-1]) if scratch else None
        own = first_step(runs[0]) if len(runs) > 1 else None
        over_scratch.append(None if t is None or s is None else t - s)
        over_own_start.append(None if t is None or own is None else t - own)
    return {
        "runs": names,
        "over_scratch_s": stats(over_scratch),
        "over_own_first_start_s": stats(over_own_start),
    }


def peaks(runs: list[dict[str, Any]]) -> dict[str, int] | None:
    """The largest of each memory figure over a run's incarnations."""
    mems = [r["memory"] for r in runs if r.get("memory")]
    return {k: max(m[k] for m in mems) for k in mems[0]} if mems else None
