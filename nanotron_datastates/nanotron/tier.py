"""The memory tier (`datastates.memory_tier`): the newest committed checkpoint of each rank kept in node-local
shared memory (a tmpfs: /dev/shm), so that a restart on the same node (a process killed, torchrun restarting
it, a manual relaunch) reads it from memory instead of storage.

Each file is written there by the engine from the same host cache chunks as it flushes them to storage
(`save(..., mirror=...)`): no second copy from the GPU. Storage stays the source of truth: a rank marks a
step as held (`.rank-<r>.json`: its files with their sizes and checksums) only once the checkpoint is
committed to storage, then drops its older steps; so the tier holds at most one committed checkpoint per
rank, plus the one in flight. A restart uses a step only where every rank finds it whole: marked, every file
of the manifest present with the manifest's size and checksums (`holds`), and the ranks agree before anyone
reads; the engine checks every tensor's checksum as it reads. The tier is removed when training ends
normally; `nanotron-datastates tier` lists and clears it.

Layout: `<memory_tier_path>/<job>/<step>/<the checkpoint's files>`, `<job>` named after the checkpoints
folder (its resolved path's hash), so jobs of one node keep apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from . import layout

MARKER = ".rank-{rank}.json"


class TierError(RuntimeError):
    """The memory tier cannot hold the checkpoints asked for (no room on the node)."""


def job_folder(base: str | os.PathLike, checkpoints: str | os.PathLike) -> Path:
    """This job's folder in the tier: named after its checkpoints folder."""
    key = hashlib.sha1(str(Path(checkpoints).resolve()).encode()).hexdigest()[:16]
    return Path(base) / key


class MemoryTier:
    """One rank's view of its job's folder in the tier."""

    def __init__(self, base: str | os.PathLike, checkpoints: str | os.PathLike, rank: int) -> None:
        self.folder = job_folder(base, checkpoints)
        self.checkpoints = Path(checkpoints)
        self.rank = rank

    def path(self, step: int, rel: str | os.PathLike) -> Path:
        """Where the tier keeps the file `rel` of the checkpoint of `step`."""
        return self.folder / str(step) / rel

    def check_room(self, node_bytes: int) -> None:
        """Raises TierError unless the tier's file system has room for two checkpoints of this node's ranks
        (the one held and the one in flight) besides what this job already holds there."""
        self.folder.mkdir(parents=True, exist_ok=True)
        st = os.statvfs(self.folder)
        free = st.f_bavail * st.f_frsize + _size(self.folder)
        if free < 2 * node_bytes:
            raise TierError(
                f"datastates.memory_tier needs {2 * node_bytes / 1e9:.2f} GB in {self.folder.parent} (two "
                f"checkpoints of this node's ranks), and {free / 1e9:.2f} GB is free there: turn the memory "
                "tier off, or give the tmpfs more room (mount -o remount,size=...)"
            )
        (self.folder / "job.json").write_text(json.dumps({"checkpoints": str(self.checkpoints.resolve())}))

    def commit(self, step: int, files: dict[str, dict[str, Any]]) -> None:
        """Marks `step` as held by this rank (its files, each with the manifest's size and checksums), after
        the checkpoint was committed to storage; then drops this rank's older steps."""
        marker = self.folder / str(step) / MARKER.format(rank=self.rank)
        layout.write_atomic(marker, json.dumps({"step": step, "files": files}))
        for folder in self.steps():
            if int(folder.name) < step:
                self.drop(int(folder.name))

    def drop(self, step: int) -> None:
        """Removes this rank's files (and marker) of `step`; the step's folder once no rank has any there."""
        folder = self.folder / str(step)
        marker = folder / MARKER.format(rank=self.rank)
        doc = layout.read_json(marker)
        marker.unlink(missing_ok=True)  # first: a half-dropped step is never taken as held
        for rel in doc.get("files", {}):
            (folder / rel).unlink(missing_ok=True)
        if not list(folder.glob(".rank-*.json")):
            shutil.rmtree(folder, ignore_errors=True)

    def prune(self, keep: int | None) -> None:
        """At the start of training: drops this rank's steps other than `keep` (the step latest.txt names),
        and the unmarked folders below it. A process killed between marking a step and dropping the older
        ones leaves them behind; this keeps the tier at one checkpoint per rank plus the one in flight."""
        for folder in self.steps():
            step = int(folder.name)
            if step == keep:
                continue
            if (folder / MARKER.format(rank=self.rank)).exists() or (
                keep is not None and step < keep and not list(folder.glob(".rank-*.json"))
            ):
                self.drop(step)

    def steps(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return sorted(
            (p for p in self.folder.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
        )

    def holds(self, step: int, manifest: dict[str, Any]) -> bool:
        """Whether the tier holds the whole checkpoint of `step` as the manifest describes it: marked by the
        ranks that wrote its files (on this node), every file present with the manifest's size and the
        checksums its writer recorded."""
        return self.why_not(step, manifest) is None

    def why_not(self, step: int, manifest: dict[str, Any]) -> str | None:
        """Why the tier does not hold the checkpoint of `step` whole (None: it does; see `holds`)."""
        folder = self.folder / str(step)
        if not folder.is_dir():
            return f"no copy of step {step} in {self.folder}"
        marked: dict[str, dict[str, Any]] = {}
        for marker in folder.glob(".rank-*.json"):
            doc = layout.read_json(marker)
            if doc.get("step") != step:
                return f"{marker} is not of step {step}"
            marked.update(doc.get("files", {}))
        files = manifest.get("files", {})
        if manifest.get("step") != step:
            return f"the manifest is of step {manifest.get('step')}, not {step}"
        if set(marked) != set(files):
            lacking = sorted(set(files) - set(marked))
            return f"{len(lacking)} of {len(files)} files not marked held (first: {lacking[:1]})"
        for rel, entry in files.items():
            try:
                size = (folder / rel).stat().st_size
            except OSError as e:
                return f"{folder / rel}: {e.strerror}"
            if size != entry.get("bytes") or marked[rel] != entry:
                return f"{folder / rel} differs from the manifest's entry"
        return None

    def release(self) -> None:
        """At the normal end of training: this rank's steps dropped, and the job's folder once empty."""
        for folder in self.steps():
            self.drop(int(folder.name))
        if not self.steps():
            shutil.rmtree(self.folder, ignore_errors=True)

    def clear(self) -> None:
        """Removes this job's folder, every rank's files (`nanotron-datastates tier clear`)."""
        shutil.rmtree(self.folder, ignore_errors=True)


def tier_copy(settings: Any, folder: Path, manifest: dict[str, Any], rank: int) -> Path | None:
    """The memory tier's copy of the checkpoint in `folder` (TrainerSettings `settings`), where this node's
    tier holds it whole; None otherwise, or where the memory tier is off."""
    if not settings.memory_tier:
        return None
    tier = MemoryTier(settings.memory_tier_path, folder.parent, rank)
    step = int(manifest.get("step", -1))
    return tier.folder / str(step) if tier.holds(step, manifest) else None


def why_not(settings: Any, folder: Path, manifest: dict[str, Any], rank: int) -> str | None:
    """Why the memory tier holds no whole copy of the checkpoint in `folder` (None: it does)."""
    tier = MemoryTier(settings.memory_tier_path, folder.parent, rank)
    return tier.why_not(int(manifest.get("step", -1)), manifest)


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def clear_jobs(base: str | os.PathLike, folders: list[Path] | None = None) -> list[Path]:
    """Removes these jobs' folders of the tier (default: every one); returns those removed."""
    folders = [Path(f["folder"]) for f in jobs(base)] if folders is None else folders
    removed = [f for f in folders if f.is_dir()]
    for f in removed:
        shutil.rmtree(f, ignore_errors=True)
    return removed


def jobs(base: str | os.PathLike) -> list[dict[str, Any]]:
    """Every job's folder in the tier: its checkpoints folder, the steps it holds, their bytes."""
    base = Path(base)
    out = []
    for folder in sorted(base.iterdir()) if base.is_dir() else []:
        if not folder.is_dir():
            continue
        doc = layout.read_json(folder / "job.json")
        steps = sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())
        out.append(
            {
                "folder": str(folder),
                "checkpoints": doc.get("checkpoints"),
                "steps": steps,
                "bytes": _size(folder),
            }
        )
    return out
