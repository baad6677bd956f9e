"""What rank 0's committer does after a checkpoint is committed, off the training thread: rotation
(`keep_last_n`), removal of temporaries left by dead processes, and one telemetry line per checkpoint.

Imports no Nanotron: the checkpoints folder is all it needs.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import fasteners

from .. import telemetry, trust
from ..checkpoint.file_io import fsync_path
from ..checkpoint.folder import is_committed, is_temporary, latest_step, step_folders, step_of
from ..checkpoint.names import MANIFEST, NANOTRON_METADATA

LOCK = ".datastates.lock"  # latest.txt moves, and checkpoints are removed, only under this lock
TELEMETRY = telemetry.FILE
_MARKERS = (MANIFEST, NANOTRON_METADATA)  # what makes a folder a checkpoint (is_committed)


def rotate(root: str | os.PathLike, keep_last_n: int, committed_step: int) -> list[Path]:
    """Removes checkpoints of `root` older than its newest `keep_last_n` committed ones, and folders older
    than `committed_step` that were never committed (saves that failed or were cut short).

    Never removes the checkpoint `latest.txt` names, nor any folder newer than `committed_step` (those may
    be in flight). Each folder loses its commit markers first (the manifest), with the directory synced, so
    that a removal cut short never leaves something that looks committed. Returns the folders removed."""
    root = Path(root)
    if keep_last_n <= 0:
        return []
    with fasteners.InterProcessLock(str(root / LOCK)):
        try:
            latest = latest_step(root)
        except ValueError:  # an unreadable latest.txt: remove nothing
            return []
        folders = [f for f in step_folders(root) if step_of(f) <= committed_step]  # real folders only
        committed = [f for f in folders if is_committed(f)]
        keep = set(committed[-keep_last_n:]) | {root / str(latest)}
        doomed = [f for f in folders if f not in keep and (f in committed or step_of(f) < committed_step)]
        for folder in doomed:
            for marker in _MARKERS:  # by name, through no link: a folder swapped for one since is left
                with contextlib.suppress(trust.UntrustedPath):
                    trust.unlink_in(root, f"{folder.name}/{marker}")
            if trust.is_real_dir(folder):
                fsync_path(folder)
    return [folder for folder in doomed if trust.remove_tree(root, folder.name)]


def after_commit(result: Any, root: Path, settings: Any, cache: dict[str, Any]) -> list[Path]:
    """Rank 0, after each checkpoint's outcome (`result`, a CommitResult): for a committed one, its folder's
    stale temporaries removed and rotation (`settings.keep_last_n`); then the telemetry line (with `cache`,
    the engine's cache statistics since the last one) where `settings.telemetry`. Returns what was removed."""
    removed: list[Path] = []
    if result.committed:
        with contextlib.suppress(OSError):  # a folder moved while searched: rotation still runs
            remove_temporaries(result.folder)
        # At least 2: a restart whose newest checkpoint is damaged falls back to the one before (and an S3
        # upload hook runs at the next checkpoint, after this one).
        keep = max(settings.keep_last_n, 2) if settings.keep_last_n else 0
        removed = rotate(root, keep, result.step)
    if settings.telemetry:
        append_telemetry(root, telemetry_record(result, cache, removed))
    return removed


def describe(r: Any) -> str:
    """The log line of a committed checkpoint (`r`, a CommitResult)."""
    queued = f" (queued at the next step in {1e3 * r.queued_s:.1f} ms)" if r.queued_s else ""
    cpu = r.engine_cpu_s
    used = ""
    if cpu:
        roles = ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
        used = f"; the engine's threads used {sum(cpu.values()):.2f} s of CPU ({roles})"
    return (
        f"checkpoint {r.step}: {r.bytes / 1e9:.2f} GB in {r.files} files, "
        f"training stall {1e3 * r.stall_s:.1f} ms{queued}, snapshot {1e3 * r.snapshot_s:.1f} ms, "
        f"persisted {r.persisted_s:.2f} s, committed {r.committed_s:.2f} s ({r.gbps:.2f} GB/s){used}"
    )


def remove_temporaries(folder: str | os.PathLike) -> int:
    """Removes the temporaries in a committed checkpoint folder: every rank's files are persisted by then, so
    any left are from a process killed while saving into the same step earlier. Each is removed by name from
    its folder's descriptor, no link followed (`trust.remove_files`); trust.UntrustedPath where a folder was
    moved away while searched. Returns how many were removed."""
    return trust.remove_files(folder, is_temporary)


def telemetry_record(result: Any, cache: dict[str, Any], removed: list[Path]) -> dict[str, Any]:
    """One checkpoint's line: `result` is a CommitResult, `cache` the engine's cache statistics since the
    previous line."""
    return telemetry.record(
        step=result.step,
        where=str(result.folder),
        committed=result.committed,
        errors=result.errors,
        nbytes=result.bytes,
        files=result.files,
        stall_s=result.stall_s,
        queued_s=result.queued_s,
        snapshot_s=result.snapshot_s,
        persisted_s=result.persisted_s,
        committed_s=result.committed_s,
        engine_cpu_s=result.engine_cpu_s,
        rank_bytes=result.rank_bytes,
        cache=cache,
        removed=[str(p) for p in removed],
    )


def append_telemetry(root: str | os.PathLike, record: dict[str, Any]) -> None:
    """Appends one line to the checkpoints folder's telemetry file."""
    Path(root).mkdir(parents=True, exist_ok=True)
    telemetry.append(root, [record])


read_telemetry = telemetry.read
