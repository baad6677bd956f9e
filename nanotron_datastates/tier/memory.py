"""The memory tier (`datastates.memory_tier`): the newest committed checkpoint of each rank kept in node-local
shared memory (a tmpfs: /dev/shm), so that a restart on the same node (a process killed, torchrun restarting
it, a manual relaunch) reads it from memory instead of storage.

The tier's files are the save's host memory: the engine maps each file there and copies the GPU's bytes
straight into it, then writes storage from it (`save(..., mirror=...)`), so the snapshot the save takes is
the memory copy, with no host cache chunk and no second copy. Storage stays the source of truth: a rank
marks a step as held (`.rank-<r>.json`: its files with their sizes and checksums) only once the checkpoint
is committed to storage.

Copies (`memory_tier_copies`): with 2, the held step stays whole while the next checkpoint is taken; once
that one is committed, the older becomes the rank's spare, whose files (still mapped and pinned) the save
after takes over: renamed and overwritten (`recycle`). The tier then holds two checkpoints of the rank. With
1, a new checkpoint takes over the held step's files, its marker withdrawn first so that no restart reads
them half overwritten: the tier holds one checkpoint, the memory the host cache would take without it, and
a crash while a checkpoint is in flight restarts from storage.

A restart uses a step only where every rank finds it whole: marked, every file of the manifest present with
the manifest's size and checksums (`holds`), and the ranks agree before anyone reads; the engine checks
every tensor's checksum as it reads. The tier is removed when training ends
normally; `nanotron-datastates tier` lists and clears it (jobs.py).

Layout: `<memory_tier_path>/<job>/<step>/<the checkpoint's files>`, `<job>` named after the checkpoints
folder (its resolved path's hash), so jobs of one node keep apart; `<job>/replicas/<step>/...` holds the
copies this node keeps for ranks of other nodes (`memory_replicas`: replicas.py), marked as the node's own
are, by the rank they belong to.

Sets of files made ahead (`warm`, `add_warm`: `<job>/.warm-<rank>-<i>/`) are the first saves' spares,
mapped and pinned before training goes on (the engine's `prepare_mirrors`).

The tier lives beside other users (`/dev/shm` is world-writable): its root is private to this user (0700,
ours, no link: `trust.private_dir`; the default path holds the user's id), markers list file names that
must stay inside their step's folder, every file is opened without following a link and must be a regular
file of ours, and nothing is removed but by name inside the tier (`trust`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .. import trust
from ..errors import DataStatesError
from .folders import dead_temporary, is_ours, regular_size, remove_empty, step_numbers

MARKER = ".rank-{rank}.json"
WARM = ".warm-{rank}-{i}"  # a set of files made ahead of the first saves (`warm`), not a step
REPLICAS = "replicas"  # the job folder's area for other nodes' ranks' copies
MAX_MARKER = 64 << 20  # bytes: a marker lists one rank's files


class TierError(DataStatesError, RuntimeError):
    """The memory tier cannot hold the checkpoints asked for (no room on the node)."""


def root(base: str | os.PathLike) -> Path:
    """The tier's root folder, `base` with `{uid}` replaced by this user's id: created private where missing;
    trust.UntrustedPath, naming it, where it is a link, another user's, or open to others."""
    return trust.private_dir(str(base).replace("{uid}", str(os.geteuid())), "memory tier folder")


def job_folder(base: str | os.PathLike, checkpoints: str | os.PathLike) -> Path:
    """This job's folder in the tier (not created): named after its checkpoints folder."""
    key = hashlib.sha1(str(Path(checkpoints).resolve()).encode()).hexdigest()[:16]
    return Path(str(base).replace("{uid}", str(os.geteuid()))) / key


class MemoryTier:
    """One rank's view of its job's folder in the tier (`area`: of a subfolder of it, REPLICAS for the copies
    this node keeps for other nodes' ranks, `rank` then the rank they belong to). Raises trust.UntrustedPath
    where the tier's root, the job's folder or the area is not private to this user."""

    def __init__(
        self,
        base: str | os.PathLike,
        checkpoints: str | os.PathLike,
        rank: int,
        copies: int = 2,
        area: str = "",
        spares: int = 1,
    ) -> None:
        root(base)
        self.folder = trust.private_dir(job_folder(base, checkpoints), "memory tier folder")
        if area:
            self.folder = trust.private_dir(self.folder / area, "memory tier folder")
        self.base = str(base)
        self.checkpoints = Path(checkpoints)
        self.rank = rank
        self.copies = copies
        # With 2 copies, the spares kept (2: with replicas, one may be sent while the next save takes another)
        self.spares = spares
        # Folders whose files (of this rank) the next saves take over, first first: sets made ahead (WARM),
        # or a step this rank held before.
        self._spares: list[tuple[str, list[str]]] = []
        self._given: tuple[int, tuple[str, list[str]]] | None = None  # the spare handed to a step's saves
        self.busy: set[int] = set()  # steps being read (sent to a peer): never handed to a save to overwrite

    def path(self, step: int, rel: str | os.PathLike) -> Path:
        """Where the tier keeps the file `rel` of the checkpoint of `step`."""
        return self.folder / str(step) / rel

    def sets(self) -> int:
        """The checkpoints of this rank the tier keeps at most between two saves: held, and spare."""
        return self.copies + (self.spares - 1 if self.copies == 2 else 0)

    def warm(self, i: int, rel: str | os.PathLike) -> Path:
        """Where the `i`-th set of files made ahead of the first saves keeps `rel` (`add_warm`)."""
        return self.folder / WARM.format(rank=self.rank, i=i) / rel

    def add_warm(self, i: int, rels: list[str]) -> None:
        """Hands the `i`-th set made ahead (its files `rels`, at `warm(i, rel)`) to the next saves to take
        over, before any step this rank held."""
        made_ahead = sum(not n.isdigit() for n, _ in self._spares)
        self._spares.insert(made_ahead, (WARM.format(rank=self.rank, i=i), rels))

    def _made_ahead(self) -> list[str]:
        """The folders of this rank's sets made ahead that are not its spares (taken over, or left behind)."""
        prefix, spares = WARM.format(rank=self.rank, i=""), {n for n, _ in self._spares}
        return [n for n in os.listdir(self.folder) if n.startswith(prefix) and n not in spares]

    def held_steps(self) -> list[int]:
        """The steps this rank marks held here."""
        mine = MARKER.format(rank=self.rank)
        return [s for s in self.steps() if mine in self._markers(s)]

    def recycle(self, step: int, rels: list[str]) -> list[Path | None]:
        """The files of an earlier step (or of a set made ahead) that the save of `step` takes over (renamed
        and overwritten by the engine), one per name of `rels` (None: a new file): the rank's first spare that
        is not being read; with 1 copy and no spare, the held step's, its marker withdrawn first, so that no
        restart reads them while they are overwritten. Every call for one step draws on the same files."""
        if self._given is not None and self._given[0] == step:
            return self._files_of(self._given[1], rels)
        free = (
            d for d in self._spares if not d[0].isdigit() or int(d[0]) < step and int(d[0]) not in self.busy
        )
        if (donor := next(free, None)) is not None:
            self._spares.remove(donor)
        elif self.copies == 1 and (held := self._held_before(step)) is not None:
            if held[0] in self.busy:
                return [None] * len(rels)
            try:
                self._withdraw(held[0])
            except OSError:  # still marked: never overwritten
                return [None] * len(rels)
            donor = (str(held[0]), held[1])
        if donor is None:
            return [None] * len(rels)
        self._given = (step, donor)
        return self._files_of(donor, rels)

    def _files_of(self, donor: tuple[str, list[str]], rels: list[str]) -> list[Path | None]:
        folder, have = self.folder / donor[0], set(donor[1])
        return [folder / rel if rel in have and is_ours(folder, rel) else None for rel in rels]

    def commit(self, step: int, files: dict[str, dict[str, Any]]) -> None:
        """Marks `step` as held by this rank (its files, each with the manifest's size and checksums), after
        the checkpoint was committed to storage; then, with 2 copies, the step it held before becomes its
        spare (marker withdrawn, files kept for the next save), and its other older steps are dropped."""
        for rel in files:
            trust.relative_name(rel, f"the files of step {step}")
        marker = f"{step}/{MARKER.format(rank=self.rank)}"  # written with no link followed
        trust.write_in(self.folder, marker, json.dumps({"step": step, "files": files}).encode())
        spare = self._held_before(step) if self.copies == 2 else None
        if spare is not None:
            self._withdraw(spare[0])  # first: never taken as held again
            self._spares.append((str(spare[0]), spare[1]))
            self.drop_spares(keep=self.spares)
        kept = {n for n, _ in self._spares}
        for s in self.steps():
            if s < step and str(s) not in kept and s not in self.busy:  # one being read: a later commit's
                self.drop(s)
        for name in self._made_ahead():  # taken over: empty
            remove_empty(self.folder, name)

    def _held_before(self, step: int) -> tuple[int, list[str]] | None:
        """The newest step below `step` that this rank marks held, with the files it marked; None: none."""
        mine = MARKER.format(rank=self.rank)
        held = [s for s in self.steps() if s < step and mine in self._markers(s)]
        return (held[-1], list(self._marked(held[-1], self.rank) or {})) if held else None

    def _withdraw(self, step: int) -> None:
        """Removes this rank's marker of `step`: from then on no restart takes the step as held."""
        trust.unlink_in(self.folder, f"{step}/{MARKER.format(rank=self.rank)}")

    def drop(self, step: int) -> None:
        """Removes this rank's files (and marker) of `step`; the step's folder once no rank has any there.
        Only names inside the step's folder are removed, never through a link: a marker naming anything
        else is ignored."""
        name = MARKER.format(rank=self.rank)
        files = self._marked(step, self.rank) or {}
        trust.unlink_in(self.folder, f"{step}/{name}")  # first: a half-dropped step is never taken as held
        for rel in files:
            with contextlib.suppress(trust.UntrustedPath):  # under a link: left for the folder's removal
                trust.unlink_in(self.folder / str(step), rel)
        if not self._markers(step):
            trust.remove_tree(self.folder, str(step))

    def drop_spares(self, keep: int = 0) -> None:
        """Removes what is left of this rank's spares (the files no save took over) but `keep`: the sets made
        ahead first (mapped and pinned already), then the newest steps; a step being read stays."""
        ranked = sorted(self._spares, key=lambda d: int(d[0]) if d[0].isdigit() else 1 << 62, reverse=True)
        kept = ranked[:keep] + [d for d in ranked[keep:] if d[0].isdigit() and int(d[0]) in self.busy]
        dropped, self._spares = (
            [d for d in self._spares if d not in kept],
            [d for d in self._spares if d in kept],
        )
        for name, rels in dropped:
            for rel in rels:
                with contextlib.suppress(OSError):
                    trust.unlink_in(self.folder / name, rel)
            if not name.isdigit() or not self._markers(int(name)):
                remove_empty(self.folder, name)

    def files(self) -> list[Path]:
        """Every file the job's folder holds now (the engine keeps those of this rank mapped)."""
        return [  # not other nodes' copies (REPLICAS), which no save of this rank maps
            self.folder / rel / n
            for _, rel, n, is_dir in trust.walk_tree(self.folder)
            if not is_dir and not n.startswith(".rank-") and n != "job.json" and rel.split("/")[0] != REPLICAS
        ]

    def prune(self, keep: int | None) -> None:
        """At the start of training: drops this rank's steps other than `keep` (the step latest.txt names),
        and the unmarked folders below it. A process killed between marking a step and dropping the older
        ones leaves them behind; this keeps the tier at one checkpoint per rank plus the one in flight."""
        self._remove_dead_temporaries()
        for name in self._made_ahead():  # by an earlier process of this rank
            trust.remove_tree(self.folder, name)
        mine = MARKER.format(rank=self.rank)
        for step in self.steps():
            if step == keep:
                continue
            markers = self._markers(step)
            if mine in markers or (keep is not None and step < keep and not markers):
                self.drop(step)

    def _remove_dead_temporaries(self) -> None:
        """Removes the files that saves of processes no longer running were writing
        (`.<name>.dstmp.<pid>.<n>`): each holds up to a file's worth of memory nothing would give back."""
        with contextlib.suppress(OSError):  # a folder moved while searched: the next start goes on
            trust.remove_files(self.folder, dead_temporary)

    def steps(self) -> list[int]:
        """The steps this job's folder holds (real folders named by a step), oldest first."""
        return step_numbers(self.folder)

    def holds(self, step: int, manifest: dict[str, Any]) -> bool:
        """Whether the tier holds the whole checkpoint of `step` as the manifest describes it: marked by the
        ranks that wrote its files (on this node), every file present with the manifest's size and the
        checksums its writer recorded."""
        return self.why_not(step, manifest) is None

    def held(self, step: int, manifest: dict[str, Any]) -> dict[str, Path]:
        """The files of `step` this folder holds whole, by name: marked held by some rank with the manifest's
        entry, present with its size, each a regular file of this user's reached without a link."""
        folder = self.folder / str(step)
        if manifest.get("step") != step or not trust.is_real_dir(folder):
            return {}
        files, out = manifest.get("files", {}), {}
        for name in self._markers(step):
            try:
                marked = self._marked(step, int(name[len(".rank-") : -len(".json")]), strict=True) or {}
            except (OSError, ValueError):
                continue
            for rel, entry in marked.items():
                with contextlib.suppress(OSError):
                    if files.get(rel) == entry and regular_size(folder, rel) == entry.get("bytes"):
                        out[rel] = folder / rel
        return out

    def why_not(self, step: int, manifest: dict[str, Any]) -> str | None:
        """Why the tier does not hold the checkpoint of `step` whole (None: it does; see `holds`). Every
        marker and file must be a regular file of this user's, reached without a link."""
        folder = self.folder / str(step)
        if not trust.is_real_dir(folder):
            return f"no copy of step {step} in {self.folder}"
        marked: dict[str, dict[str, Any]] = {}
        for name in self._markers(step):
            try:
                files = self._marked(step, int(name[len(".rank-") : -len(".json")]), strict=True)
            except (OSError, ValueError) as e:
                return str(e)
            marked.update(files or {})
        files = manifest.get("files", {})
        if manifest.get("step") != step:
            return f"the manifest is of step {manifest.get('step')}, not {step}"
        if set(marked) != set(files):
            lacking = sorted(set(files) - set(marked))
            return f"{len(lacking)} of {len(files)} files not marked held (first: {lacking[:1]})"
        for rel, entry in files.items():
            try:
                size = regular_size(folder, rel)
            except OSError as e:
                return f"{folder / rel}: {e.strerror or e}"
            if size != entry.get("bytes") or marked[rel] != entry:
                return f"{folder / rel} differs from the manifest's entry"
        return None

    def release(self) -> None:
        """At the normal end of training: this rank's steps dropped, and the job's folder once empty."""
        self.drop_spares()
        for step in self.steps():
            self.drop(step)
        if not self.steps():
            trust.remove_tree(self.folder.parent, self.folder.name)

    def clear(self) -> None:
        """Removes this job's folder, every rank's files (`nanotron-datastates tier clear`)."""
        trust.remove_tree(self.folder.parent, self.folder.name)

    def _markers(self, step: int) -> list[str]:
        """The names of the rank markers in the folder of `step`."""
        try:
            names = os.listdir(self.folder / str(step))
        except OSError:
            return []
        return sorted(n for n in names if n.startswith(".rank-") and n.endswith(".json"))

    def _marked(self, step: int, rank: int, strict: bool = False) -> dict[str, dict[str, Any]] | None:
        """The files rank `rank` marked held at `step` ({name: entry}); None where there is no marker, or
        (unless `strict`, which raises naming the marker) where it is not a regular file of ours holding a
        marker of that step whose names stay inside the step's folder."""
        path = self.folder / str(step) / MARKER.format(rank=rank)
        try:
            doc = json.loads(trust.read_regular(path, MAX_MARKER, own=True))
            files = doc.get("files") if isinstance(doc, dict) else None
            if not isinstance(files, dict) or doc.get("step") != step:
                raise ValueError(f"{path} is not a marker of step {step}")
            for rel in files:
                trust.relative_name(rel, str(path))
            if not all(isinstance(e, dict) for e in files.values()):
                raise ValueError(f"{path}: an entry is not an object")
            return files
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            if strict:
                raise
            return None
