"""Telemetry: one JSON line per checkpoint (the Nanotron trainer's, in its checkpoints folder) or per saved
file (the engine's, with `DataStatesConfig.telemetry_path`), in one format that `nanotron-datastates plot`
draws: bytes, the caller's stall, the times to snapshot and to persisted, throughput, and the host cache's
size, high-water mark and waits since the previous line. With memory replicas, the trainer's file also has
one line per checkpoint replicated (`"event": "replicated"`): the bytes sent over the network, the time."""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypedDict

from . import trust

FILE = "datastates_telemetry.jsonl"  # its name in a checkpoints folder


class ReplicaFigures(TypedDict):
    """One rank's part in one checkpoint's memory replicas (tier/replicas.py, `Replicated.figures`)."""

    transport: str  # the link's name
    sent_bytes: int
    received_bytes: int
    seconds: float
    to: list[int]  # the ranks it sent to
    error: str | None


def record(
    *,
    step: int | None,
    where: str,
    committed: bool,
    errors: list[str],
    nbytes: int,
    files: int,
    stall_s: float,
    snapshot_s: float,
    persisted_s: float,
    committed_s: float,
    cache: Mapping[str, int],
    queued_s: float = 0.0,
    removed: list[str] | None = None,
    engine_cpu_s: dict[str, float] | None = None,
    rank_bytes: list[int] | None = None,
    memory: bool = False,
) -> dict[str, object]:
    """One line. `cache`: the engine's `cache_stats` since the previous line; `engine_cpu_s`: the CPU seconds
    the engine's threads used for it, by role (`cpu_use`); `rank_bytes`: what each rank wrote, by rank;
    `memory`: a memory checkpoint (`memory_interval`: in node memory only), whose line says so."""
    return {
        "time": time.time(),
        "step": step,
        "folder": where,
        "committed": committed,
        "errors": errors,
        "bytes": nbytes,
        "files": files,
        "stall_s": stall_s,
        "queued_s": queued_s,
        "snapshot_s": snapshot_s,
        "persisted_s": persisted_s,
        "committed_s": committed_s,
        "throughput_gbps": nbytes / committed_s / 1e9 if committed_s > 0 else 0.0,
        "cache_bytes": cache.get("chunks", 0) * cache.get("chunk_bytes", 0),
        "cache_high_water_bytes": cache.get("high_water", 0) * cache.get("chunk_bytes", 0),
        "cache_wait_s": cache.get("wait_ns", 0) / 1e9,
        "removed": removed or [],
        "engine_cpu_s": engine_cpu_s or {},
        "rank_bytes": rank_bytes or [],
        **({"memory": True} if memory else {}),
    }


def replication(step: int, ranks: Sequence[ReplicaFigures]) -> dict[str, object]:
    """One checkpoint's memory replicas (`"event": "replicated"`): `ranks`, each rank's figures (bytes sent
    and received, seconds, the ranks sent to, its error or None); `sent_bytes`, what the checkpoint sent over
    the network in all; `seconds`, the slowest rank's time."""
    return {
        "time": time.time(),
        "event": "replicated",
        "step": step,
        "sent_bytes": sum(r["sent_bytes"] for r in ranks),
        "seconds": max((r["seconds"] for r in ranks), default=0.0),
        "errors": [f"rank {i}: {r['error']}" for i, r in enumerate(ranks) if r["error"]],
        "ranks": ranks,
    }


def append(path: str | os.PathLike, records: Sequence[Mapping[str, object]]) -> None:
    """Appends the lines to `path` (a file; in a folder, its FILE) in one write: lines never mix."""
    path = Path(path)
    append_text(path / FILE if path.is_dir() else path, "".join(json.dumps(r) + "\n" for r in records))


def append_text(path: Path, text: str) -> None:
    """Appends `text` to the regular file `path` (made with its folders where missing) in one write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Non-blocking: a FIFO there (no reader) fails at once instead of holding the committer; a file only.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "a") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise trust.UntrustedPath(errno.EINVAL, "not a regular file: nothing appended", str(path))
        os.set_blocking(fd, True)
        f.write(text)


def read(path: str | os.PathLike) -> list[object]:
    """The records of a telemetry file (or of the one in a folder), each as its line's JSON reads (an object,
    where the file is telemetry); a line cut short by a crash is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / FILE
    out: list[object] = []
    with os.fdopen(trust.open_to_read(path), encoding="utf-8", errors="replace") as f:
        text = f.read()
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
