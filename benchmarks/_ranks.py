"""A run's record from its ranks' own records (bench_nanotron.py's `phase` writes one per rank).

The job runs at the pace of its slowest rank: every collective of the next step waits for it. So an iteration
of the job is the longest of the ranks' iterations that end at that step (each rank's clock runs from the end
of one of its steps to the end of its next, `save_checkpoint` included); a save call, a stall, a time to
persisted, the largest over the ranks; bytes are summed, and also kept by rank (the slowest rank's bytes).
Host memory is per node (every rank here runs on one node): the ranks' proportional set sizes and peak
resident sets summed, `/dev/shm`'s gain (node-wide already) its largest reading."""

from __future__ import annotations

from typing import Any


def merge(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's record from its ranks' records (rank 0 first). One rank: its record, unchanged."""
    if len(ranks) == 1:
        return ranks[0]
    out = dict(ranks[0])
    out["ranks"] = len(ranks)
    out["ends"] = _job_ends(ranks)
    out["saves"] = _by_step(ranks, "saves", largest=("call_s", "engine_save_s"), summed=("staged_files",))
    commits = _by_step(ranks, "commits", largest=("stall_s", "queued_s", "snapshot_s", "persisted_s",
                                                  "committed_s"))  # fmt: skip
    for c in commits:  # each rank's own figures, by rank: which one was slowest, and why
        c["rank_persisted_s"] = [_at(r, "commits", c["step"], "persisted_s") for r in ranks]
        c["rank_stall_s"] = [_at(r, "commits", c["step"], "stall_s") for r in ranks]
    out["commits"] = commits
    out["dcp"] = _by_step(ranks, "dcp", largest=("persisted_s",))
    out["losses"] = next((r["losses"] for r in reversed(ranks) if r.get("losses")), [])  # pp: the last stage
    marks = [r.get("marks", {}) for r in ranks]
    out["marks"] = {k: max(m[k] for m in marks if k in m) for k in out.get("marks", {})}
    out["init_s"] = max(r.get("init_s", 0.0) for r in ranks)
    waits = [r.get("dcp_staging_waits_s") or [] for r in ranks]
    out["dcp_staging_waits_s"] = [max(w) for w in zip(*waits)] if all(waits) else None
    out["memory"] = _node_memory([r["memory"] for r in ranks if r.get("memory")])
    return out


def _job_ends(ranks: list[dict[str, Any]]) -> list[list[float]]:
    """[step, seconds] where every iteration lasts as long as the longest of the ranks' iterations ending at
    that step; the clock starts at rank 0's first end."""
    durations: dict[int, float] = {}
    for rank in ranks:
        ends = rank.get("ends", [])
        for (_, t0), (step, t1) in zip(ends, ends[1:]):
            durations[step] = max(durations.get(step, 0.0), t1 - t0)
    first = ranks[0].get("ends") or []
    if not first:
        return []
    steps = [s for s, _ in first[1:] if all(_has_end(r, s) for r in ranks)]
    out, t = [list(first[0])], first[0][1]
    for step in steps:
        t += durations[step]
        out.append([step, t])
    return out


def _has_end(rank: dict[str, Any], step: int) -> bool:
    return any(s == step for s, _ in rank.get("ends", [])[1:])


def _at(rank: dict[str, Any], key: str, step: int, field: str) -> Any:
    return next((x.get(field) for x in rank.get(key, []) if x["step"] == step), None)


def _by_step(
    ranks: list[dict[str, Any]], key: str, *, largest: tuple[str, ...], summed: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """Rank 0's entries of `key`, each with the `largest` fields the largest and the `summed` fields the sum
    over the ranks' entries of the same step."""
    out = []
    for entry in ranks[0].get(key, []):
        alike = [x for r in ranks for x in r.get(key, []) if x["step"] == entry["step"]]
        merged = dict(entry)
        for f in largest:
            values = [x[f] for x in alike if x.get(f) is not None]
            if values:
                merged[f] = max(values)
        for f in summed:
            merged[f] = sum(x.get(f, 0) for x in alike)
        out.append(merged)
    return out


def _node_memory(mems: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not mems:
        return None
    total = ("host_peak_rss_bytes", "host_pss_tree_bytes")
    out = {k: sum(m.get(k, 0) for m in mems) for k in total}
    out["shm_peak_bytes"] = max(m.get("shm_peak_bytes", 0) for m in mems)
    for k in ("gpu_max_reserved_bytes", "gpu_max_allocated_bytes", "pss_read_max_s"):
        out[k] = max(m.get(k, 0) for m in mems)
    out["pss_reads"] = sum(m.get("pss_reads", 0) for m in mems)
    out["rank_host_pss_tree_bytes"] = [m.get("host_pss_tree_bytes", 0) for m in mems]
    return out
