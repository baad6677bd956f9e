"""Committing a multi-rank checkpoint without stalling training.

Per checkpoint, in order, on a background thread of every rank:

1. wait until this rank's files are persisted (the engine's second future);
2. gather every rank's outcome and file list over a dedicated gloo process group (so the main thread's NCCL
   collectives are never involved, and nothing waits on the GPU);
3. if every rank succeeded, rank 0 runs `finalize` (writes the checkpoint's metadata, the manifest, then
   `latest.txt`, each atomically), and broadcasts whether that worked; a memory checkpoint (files in the
   memory tier only) has no `finalize`: its result carries every rank's files for its manifest in memory;
4. every rank records the same outcome, so the main thread of every rank takes the same decisions at its
   next synchronization point (the next checkpoint, or the end of training).

This module does not import Nanotron: the CheckpointManager supplies `finalize`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, TypedDict, TypeVar

import torch.distributed as dist

from .. import cpu_use
from ..checkpoint.checksums import file_entry
from ..checkpoint.names import name_in
from ..errors import CheckpointError
from .handle import SaveHandle, wait_handles

__all__ = ["CheckpointError", "CommitResult", "Committer", "PendingCheckpoint"]

_T = TypeVar("_T")


@dataclasses.dataclass
class PendingCheckpoint:
    """One checkpoint as this rank submitted it."""

    step: int
    folder: Path
    handles: list[SaveHandle]  # every file this rank writes
    finalize: Callable[[dict[str, Any]], None] | None = None  # rank 0: commit, given every rank's files
    t_start: float = dataclasses.field(default_factory=time.monotonic)
    stall_s: float = 0.0  # caller's time in save plus waits for the snapshot, filled in by the trainer
    queued_s: float = 0.0  # the trainer's time queuing the files at the next step (when deferred there)
    errors: list[str] = dataclasses.field(default_factory=list)  # this rank's, before any file was queued
    memory: bool = False  # a memory checkpoint: its files in the memory tier only, `folder` the tier's


@dataclasses.dataclass
class CommitResult:
    step: int
    folder: Path
    committed: bool
    errors: list[str]
    bytes: int  # all ranks
    files: int  # all ranks
    stall_s: float  # this rank
    snapshot_s: float  # this rank: until all its tensors were captured
    persisted_s: float  # this rank: until all its files were persisted
    committed_s: float  # until every rank agreed and rank 0 committed
    queued_s: float = 0.0  # this rank: queuing the files at the step after the checkpoint (0: in the call)
    mirrored: dict[str, dict[str, Any]] = dataclasses.field(
        default_factory=dict
    )  # this rank's, as in the manifest
    # CPU seconds of this rank's engine threads, by role, since the previous checkpoint's outcome (the
    # threads are idle between checkpoints; two in flight at once share theirs)
    engine_cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)
    rank_bytes: list[int] = dataclasses.field(default_factory=list)  # the bytes each rank wrote, by rank
    memory: bool = False  # a memory checkpoint (nothing in storage)
    mapped_anew: int = 0  # this rank's memory tier files mapped (and pinned) by their save, none kept for it
    entries: dict[str, dict[str, Any]] = dataclasses.field(
        default_factory=dict
    )  # a memory checkpoint's: every rank's files, as its manifest lists them

    @property
    def gbps(self) -> float:
        return self.bytes / self.committed_s / 1e9 if self.committed_s > 0 else 0.0

    def why(self) -> str:
        """Why it was not committed, in one line: the first error in full, then how many more (a disk that
        fills fails every file; the log and the telemetry keep the whole list)."""
        return summary(self.errors)


def summary(errors: list[str]) -> str:
    """The first error in full and the count of the others."""
    if not errors:
        return "no error recorded"
    more = len(errors) - 1
    return errors[0] + (f"; and {more} more error{'s' if more > 1 else ''} (all in the log)" if more else "")


class _Outcome(TypedDict):
    """A rank's part of a checkpoint, as every rank gathers it."""

    errors: list[str]
    files: dict[str, dict[str, Any]]  # by path in the folder: its manifest entry (checksums.file_entry)


class Committer:
    """The background committer of one rank. `group` is a gloo process group over all ranks (None: alone)."""

    def __init__(
        self, group: dist.ProcessGroup | None = None, on_result: Callable[[CommitResult], None] | None = None
    ) -> None:
        self._group = group
        self._rank = dist.get_rank(group) if group is not None else 0
        self._world = dist.get_world_size(group) if group is not None else 1
        self._on_result = on_result
        self._queue: queue.Queue[PendingCheckpoint | None] = queue.Queue()
        self._results: list[CommitResult] = []
        self._submitted = 0
        self._done = 0
        self._taken = 0
        self._cv = threading.Condition()
        # Read once here, before any save it will count; then on its thread, one read per outcome: reading
        # /proc for every thread takes about a millisecond, which the training thread would add to its stall.
        self._cpu_mark = cpu_use.thread_cpu()
        self._thread = threading.Thread(target=self._run, name="datastates-committer", daemon=True)
        self._thread.start()

    def submit(self, pending: PendingCheckpoint) -> None:
        with self._cv:
            self._submitted += 1
        self._queue.put(pending)

    def take(self, count: int, timeout: float | None = None) -> list[CommitResult]:
        """Waits for the outcomes of the `count` oldest checkpoints not taken yet and returns them, in order.
        Deterministic, so every rank can act on the same outcomes at the same point."""
        with self._cv:
            count = min(count, self._submitted - self._taken)
            if not self._cv.wait_for(lambda: self._done >= self._taken + count, timeout):
                raise TimeoutError(f"checkpoint commits not done within {timeout} s")
            out, self._results = self._results[:count], self._results[count:]
            self._taken += count
        return out

    def held(self) -> int:
        """How many checkpoints were submitted and their outcomes not taken yet."""
        with self._cv:
            return self._submitted - self._taken

    def ready(self) -> int:
        """How many of the oldest outcomes not taken yet are known now: `take` of as many does not wait."""
        with self._cv:
            return self._done - self._taken

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        cpu_mark = self._cpu_mark
        while True:
            pending = self._queue.get()
            if pending is None:
                return
            try:
                result = self._commit(pending)
            except Exception as e:  # a broken group: nothing can be agreed any more; say so on every wait
                elapsed = time.monotonic() - pending.t_start
                errors = [f"commit failed: {e!r}"]
                result = CommitResult(
                    pending.step, pending.folder, False, errors, 0, 0, pending.stall_s, 0, 0, elapsed
                )
                result.memory = pending.memory
            now = cpu_use.thread_cpu()
            result.engine_cpu_s, cpu_mark = cpu_use.since(cpu_mark, now), now
            if self._on_result is not None:  # first: a checkpoint taken is one whose report is done
                with contextlib.suppress(Exception):  # a logging failure must not stop later commits
                    self._on_result(result)
            with self._cv:
                self._results.append(result)
                self._done += 1
                self._cv.notify_all()

    def _commit(self, p: PendingCheckpoint) -> CommitResult:
        files: dict[str, dict[str, Any]] = {}
        mirrored: dict[str, dict[str, Any]] = {}  # this rank's files also in the memory tier
        anew = 0
        errors = [f"rank {self._rank}: {e}" for e in p.errors]  # every rank still takes part below
        snapshot_s = persisted_s = 0.0
        # One wait for all (this thread takes the GIL back once, not once per file, while training runs):
        # first for the copies, so that staged copies on the GPU go back as soon as they are in the host
        # cache, then for persistence. Errors are reported per file below.
        wait_handles(p.handles)
        wait_handles(p.handles, persisted=True)
        for h in p.handles:
            try:
                h.wait_persisted()
                stats = h.stats
                snapshot_s = max(snapshot_s, stats["snapshot_s"] or 0.0)
                persisted_s = max(persisted_s, stats["persisted_s"] or 0.0)
                rel = name_in(h.path, p.folder)
                files[rel] = file_entry(stats["file_bytes"], h)
                if stats["mirrored"]:
                    mirrored[rel] = files[rel]
                    anew += not stats["mirror_kept"]
            except Exception as e:
                errors.append(f"rank {self._rank}: {e}")
        outcomes = self._gather({"errors": errors, "files": files})
        all_errors = [err for o in outcomes for err in o["errors"]]
        all_files = {k: v for o in outcomes for k, v in o["files"].items()}
        if self._rank == 0 and not all_errors and p.finalize is not None:
            try:
                p.finalize(all_files)
            except Exception as e:
                all_errors.append(f"rank 0: committing {p.folder}: {e}")
        all_errors = self._broadcast(all_errors)
        return CommitResult(
            step=p.step,
            folder=p.folder,
            committed=not all_errors,
            errors=all_errors,
            bytes=sum(f["bytes"] for f in all_files.values()),
            files=len(all_files),
            stall_s=p.stall_s,
            snapshot_s=snapshot_s,
            persisted_s=persisted_s,
            committed_s=time.monotonic() - p.t_start,
            queued_s=p.queued_s,
            mirrored=mirrored,
            rank_bytes=[sum(f["bytes"] for f in o["files"].values()) for o in outcomes],
            memory=p.memory,
            mapped_anew=anew,
            entries=all_files if p.memory and not all_errors else {},
        )

    # A world of one has nothing to agree with: no pickled round trip through the group (about 2 ms of this
    # thread's time under the GIL a checkpoint, which a one-GPU job's training thread shares).
    def _gather(self, obj: _Outcome) -> list[_Outcome]:
        if self._group is None or self._world == 1:
            return [obj]
        out = [obj] * self._world  # all_gather_object puts every rank's in its place
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _broadcast(self, obj: _T) -> _T:
        if self._group is None or self._world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._group, 0), group=self._group)
        return box[0]
