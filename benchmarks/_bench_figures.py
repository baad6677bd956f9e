"""Figures of one run's record, alone or against another's: its iteration times, each checkpoint's stall,
where the cost lands after a checkpoint, the whole run's overhead over the run without checkpoints, a
datastates queuing's parts, losses compared, and the restores' speedups pair by pair.
"""

from __future__ import annotations

import statistics
from typing import Any

WARMUP = 3  # iterations left out of every statistic
WINDOW = 3  # iterations after a checkpoint that carry its cost
BEFORE = 10  # iterations before a checkpoint that its local reference is taken over
AFTER = 8  # iterations after a checkpoint whose excess is also reported one by one


def iteration_times(rec: dict[str, Any]) -> dict[int, float]:
    ends = rec.get("ends", [])
    return {step: t - ends[i - 1][1] for i, (step, t) in enumerate(ends) if i > 0}


BLOCK_LEAD = 2  # iterations at the start of a block left out: the last block's checkpoints spill into them


def block_on(step: int, blocks: int) -> bool:
    """`--blocks N`: whether `step` lies in a block of N steps that takes checkpoints (every other one,
    from the second on; the first takes none and warms up)."""
    return blocks <= 0 or (step - 1) // blocks % 2 == 1


def blocks_figures(rec: dict[str, Any], blocks: int) -> dict[str, Any] | None:
    """`--blocks N`: the run's mean iteration in the blocks that take checkpoints and in those that do not
    (the first block and each block's first BLOCK_LEAD iterations left out), and the first over the second
    less one: the checkpoints' cost measured within one run, which the drift between runs does not move."""
    if blocks <= 0:
        return None
    it = iteration_times(rec)
    kept = {s: t for s, t in it.items() if s > blocks and (s - 1) % blocks >= BLOCK_LEAD}
    on = [t for s, t in kept.items() if block_on(s, blocks)]
    off = [t for s, t in kept.items() if not block_on(s, blocks)]
    if not on or not off:
        return None
    on_s, off_s = statistics.fmean(on), statistics.fmean(off)
    return {"on_mean_iteration_s": on_s, "off_mean_iteration_s": off_s, "on_vs_off": on_s / off_s - 1}


def stall_figures(rec: dict[str, Any], fallback_median: float) -> dict[str, Any]:
    """Per checkpoint, the excess of the WINDOW iterations after it over the run's own median iteration
    (iterations outside every window and past WARMUP). Where there are none (the stress run checkpoints at
    every step), the excess of the one iteration after it over `fallback_median`."""
    it = iteration_times(rec)
    every = [x["step"] for x in rec.get("saves", [])]
    saves = [s for s in every if s > WARMUP]
    windows = {s + j for s in every for j in range(1, WINDOW + 1)}
    quiet = [t for s, t in it.items() if s > WARMUP and s not in windows]
    median = statistics.median(quiet) if quiet else fallback_median
    window = WINDOW if quiet else 1  # a checkpoint at every step: each iteration carries one
    excess = [[it[s + j] - median for j in range(1, window + 1) if s + j in it] for s in saves]
    excess = [e for e in excess if e]  # the last step's checkpoint has no iteration after it
    stalls = [sum(e) for e in excess]
    # Local stall: the same excess over the median of the quiet iterations among the BEFORE just before each
    # checkpoint. The iteration time drifts by 10-20% over tens of steps (in every mode), and the run's
    # median puts that drift into the stall of a checkpoint that falls in a slow or fast stretch.
    local = []
    for s in saves:
        before = [it[k] for k in range(s - BEFORE + 1, s + 1) if k in it and k > WARMUP and k not in windows]
        after = [it[s + j] for j in range(1, window + 1) if s + j in it]
        if before and after and quiet:
            local.append(sum(after) - len(after) * statistics.median(before))
    return {
        "median_quiet_iteration_s": median,
        "window_excess_s": excess,
        "stall_s": stalls,
        "stall_median_s": statistics.median(stalls) if stalls else None,
        "stall_local_s": local,
        "stall_local_median_s": statistics.median(local) if local else None,
    }


def excess_after(rec: dict[str, Any], interval: int) -> list[float] | None:
    """Where a checkpoint's cost lands: the mean excess of the i-th iteration after each checkpoint step
    (every `interval` steps, in every mode: none's is the placebo), i = 1..AFTER, over the median of the
    BEFORE iterations just before it."""
    it = iteration_times(rec)
    rows = []
    for c in range(interval, max(it, default=0) - AFTER + 1, interval):
        before = [it[k] for k in range(c - BEFORE + 1, c + 1) if k in it and k > WARMUP]
        if before and all(c + j in it for j in range(1, AFTER + 1)):
            ref = statistics.median(before)
            rows.append([it[c + j] - ref for j in range(1, AFTER + 1)])
    return [statistics.fmean(col) for col in zip(*rows)] if rows else None


def flush_phase_slowdown(rec: dict[str, Any], interval: int) -> float | None:
    """Within one run, the median iteration of the first half of each interval after its checkpoint's
    window (while that checkpoint is flushed) over that of the second half, minus 1. Iteration times drift
    between runs by more than the 2% the end-to-end goal allows; within a run, this shows what background
    flushing costs the steps it overlaps."""
    if not rec.get("saves") or interval < 2 * (WINDOW + 1):
        return None
    it = iteration_times(rec)
    offset = {s: (s - 1) % interval + 1 for s in it if s > WARMUP}  # 1: the iteration after a checkpoint
    early = [it[s] for s, o in offset.items() if WINDOW < o <= interval // 2]
    late = [it[s] for s, o in offset.items() if o > interval // 2]
    if not early or not late:
        return None
    return statistics.median(early) / statistics.median(late) - 1


def overhead_vs_none(rec: dict[str, Any], none: dict[str, Any], interval: int) -> dict[str, Any] | None:
    """What checkpointing cost the whole run against the run without checkpoints (the same steps, the same
    data), and where: `total`, the training time of every measured iteration over none's, minus 1; then the
    iterations apart, by their place after the last checkpoint, each set's median over none's median of the
    same steps, minus 1: `stall` (the WINDOW iterations after a checkpoint; `stall_s`, their summed excess
    per checkpoint), `flush` (from there to half the interval, while the checkpoint is persisted) and `far`
    (the second half, the engine idle)."""
    mine, base = iteration_times(rec), iteration_times(none)
    steps = [s for s in mine if s > WARMUP and s in base]
    if not steps:
        return None
    med = statistics.median
    out: dict[str, Any] = {"total": sum(mine[s] for s in steps) / sum(base[s] for s in steps) - 1}
    saves = {x["step"] for x in rec.get("saves", [])}
    if not saves or interval < 2 * (WINDOW + 1):
        return out
    since: dict[int, int] = {}
    for s in steps:  # iterations since the newest checkpoint at or before the step before
        last = max((c for c in saves if c < s), default=None)
        if last is not None:
            since[s] = s - last
    parts = {
        "stall": [s for s, k in since.items() if k <= WINDOW],
        "flush": [s for s, k in since.items() if WINDOW < k <= interval // 2],
        "far": [s for s, k in since.items() if k > interval // 2],
    }
    for name, part in parts.items():
        if part:
            out[name] = med(mine[s] for s in part) / med(base[s] for s in part) - 1
    stalled = [c for c in saves if all(c + j in mine and c + j in base for j in range(1, WINDOW + 1))]
    if stalled:
        out["stall_s"] = med(sum(mine[c + j] - base[c + j] for j in range(1, WINDOW + 1)) for c in stalled)
    return out


def queue_split(rec: dict[str, Any]) -> dict[str, float] | None:
    """Median seconds of a checkpoint's queuing (datastates, past the first): in all, planning (the
    optimizer state), staging on the GPU, the core's call (`core_s`, where recorded), the rest of the
    engine's save calls (paths, handles), and the part before the optimizer step (`before_step`)."""
    qs = rec.get("queues", [])[1:]
    if not qs:
        return None
    med = statistics.median
    out = {
        "total": med(q["total_s"] for q in qs),
        "plan": med(q["plan_s"] for q in qs),
        "stage": med(q["prepare_s"] for q in qs),
        "core": med(q["engine_s"] - q["plan_s"] - q["prepare_s"] for q in qs),
    }
    if all("core_s" in q for q in qs):
        out["core"] = med(q["core_s"] for q in qs)
        out["rest"] = med(q["engine_s"] - q["plan_s"] - q["prepare_s"] - q["core_s"] for q in qs)
    if all(q.get("captured_s") is not None for q in qs):  # before the optimizer step, where deferred
        out["before_step"] = med(q["captured_s"] for q in qs)
    # the optimizer's plan afresh, like the last (`held`, with `replan` where it fell back), its copy, the
    # tier's targets
    for part in ("replan", "held", "state", "targets"):
        if all(f"{part}_s" in q for q in qs):
            out[part] = med(q[f"{part}_s"] for q in qs)
    return out


def loss_match(run: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Losses of two runs at the steps both ran (bitwise is the bar)."""
    mine, theirs = dict(run.get("losses", [])), dict(other.get("losses", []))
    common = sorted(set(mine) & set(theirs))
    diffs = [abs(mine[s] - theirs[s]) for s in common]
    return {
        "steps": common,
        "bitwise": bool(common) and all(d == 0 for d in diffs),
        "max_abs_diff": max(diffs, default=None),
    }


def restore_pairs(restore: dict[str, float]) -> list[float]:
    """Native's restore time over datastates', for each pair of restores run one after the other."""
    out = []
    for name, native in restore.items():
        if name.startswith("restore-torch"):
            ours = restore.get(name.replace("restore-torch", "restore-datastates"))
            if ours is not None and ours > 0:
                out.append(native / ours)
    return out
