"""What rank 0's committer does after a checkpoint is committed, off the training thread: rotation
(`keep_last_n`), removal of temporaries left by dead processes, and one telemetry line per checkpoint.

Imports no Nanotron: the checkpoints folder is all it needs, and every operation on it goes through its store
(`store/`); what is kept is decided here.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Protocol

from .. import telemetry, trust
from ..store import open_store

if TYPE_CHECKING:
    from .commit import CommitResult

TELEMETRY = telemetry.FILE


class Settings(Protocol):
    """What `after_commit` reads of the trainer's settings."""

    @property
    def keep_last_n(self) -> int: ...

    @property
    def telemetry(self) -> bool: ...


def rotate(root: str | os.PathLike, keep_last_n: int, committed_step: int) -> list[Path]:
    """Removes checkpoints of `root` older than its newest `keep_last_n` committed ones, and folders older
    than `committed_step` that were never committed (saves that failed or were cut short).

    Never removes the checkpoint `latest.txt` names, nor any folder newer than `committed_step` (those may
    be in flight). Under the store's lock, each folder loses its commit markers first (`Store.uncommit`,
    made durable), so that a removal cut short never leaves something that looks committed; the trees go
    after. Returns the folders removed."""
    if keep_last_n <= 0:
        return []
    store = open_store(root)
    with store.locked():
        try:
            latest = store.latest()
        except ValueError:  # an unreadable latest.txt: remove nothing
            return []
        steps = [s for s in store.steps() if s <= committed_step]  # real folders only
        committed = [s for s in steps if store.is_committed(s)]
        keep = set(committed[-keep_last_n:]) | {latest}
        doomed = [s for s in steps if s not in keep and (s in committed or s < committed_step)]
        for step in doomed:
            store.uncommit(step)
    return [store.path(str(step)) for step in doomed if store.remove_step(step)]


def after_commit(result: CommitResult, root: Path, settings: Settings, cache: dict[str, int]) -> list[Path]:
    """Rank 0, after each checkpoint's outcome (`result`): for a committed one, its folder's
    stale temporaries removed and rotation (`settings.keep_last_n`); then the telemetry line (with `cache`,
    the engine's cache statistics since the last one) where `settings.telemetry`. Returns what was removed."""
    removed: list[Path] = []
    if result.committed and not result.memory:  # a memory checkpoint: nothing in storage
        with contextlib.suppress(OSError):  # a folder moved while searched: rotation still runs
            remove_temporaries(result.folder)
        # At least 2: a restart whose newest checkpoint is damaged falls back to the one before (and an S3
        # upload hook runs at the next checkpoint, after this one).
        keep = max(settings.keep_last_n, 2) if settings.keep_last_n else 0
        removed = rotate(root, keep, result.step)
    if settings.telemetry:
        append_telemetry(root, telemetry_record(result, cache, removed))
    return removed


def describe(r: CommitResult) -> str:
    """The log line of a committed checkpoint."""
    queued = f" (queued at the next step in {1e3 * r.queued_s:.1f} ms)" if r.queued_s else ""
    cpu = r.engine_cpu_s
    used = ""
    if cpu:
        roles = ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
        used = f"; the engine's threads used {sum(cpu.values()):.2f} s of CPU ({roles})"
    if r.mapped_anew:
        used += f"; {r.mapped_anew} memory tier files mapped anew"
    return (
        f"checkpoint {r.step}: {r.bytes / 1e9:.2f} GB in {r.files} files, "
        f"training stall {1e3 * r.stall_s:.1f} ms{queued}, snapshot {1e3 * r.snapshot_s:.1f} ms, "
        f"persisted {r.persisted_s:.2f} s, committed {r.committed_s:.2f} s ({r.gbps:.2f} GB/s){used}"
    )


def remove_temporaries(folder: str | os.PathLike) -> int:
    """Removes the temporaries in a committed checkpoint folder: every rank's files are persisted by then, so
    any left are from a process killed while saving into the same step earlier. Each is removed by name from
    its folder's descriptor, no link followed (`Store.remove_temporaries`); trust.UntrustedPath where a folder
    was moved away while searched. Returns how many were removed."""
    folder = Path(folder)
    step = trust.step_number(folder.name)
    if step is None:
        raise ValueError(f"{folder}: not a checkpoint folder (not named by a step number)")
    return open_store(folder.parent).remove_temporaries(step)


def telemetry_record(result: CommitResult, cache: dict[str, int], removed: list[Path]) -> dict[str, object]:
    """One checkpoint's line: `cache` holds the engine's cache statistics since the previous line."""
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
        memory=bool(result.memory),
    )


def append_telemetry(root: str | os.PathLike, record: Mapping[str, object]) -> None:
    """Appends one line to the checkpoints folder's telemetry file."""
    open_store(root).append_line(TELEMETRY, json.dumps(record))


read_telemetry = telemetry.read
