"""The memory tier (`datastates.memory_tier`): the newest committed checkpoint of each rank kept in node-local
shared memory (a tmpfs: /dev/shm), so that a restart on the same node reads it from memory, not storage.

The tier's files are the save's host memory: the engine maps each file there, copies the GPU's bytes straight
into it and writes storage from it (`save(..., mirror=...)`): no cache chunk, no second copy. A rank marks a
step held (`.rank-<r>.json`: its files, sizes, checksums) once the checkpoint is committed to storage.

Copies (`memory_tier_copies`): with 2, the held step stays whole while the next checkpoint is taken; once
that one is committed, the older becomes a spare, whose files (mapped and pinned) a later save takes over:
renamed and overwritten (`recycle`); with replicas a second (`max_spares`), for a save to take while one is
sent. With 1, a new checkpoint takes over the held step's files, its marker withdrawn first: the tier holds
one checkpoint, and a crash while one is in flight restarts from storage. Sets made ahead (`warm`,
`add_warm`: `<job>/.warm-<rank>-<i>/`, the engine's `prepare_mirrors`) are the first saves' spares.

A restart uses a step only where every rank finds it whole: marked, every file of the manifest present with
its size and checksums (`holds`), the ranks agreeing before anyone reads; every tensor's checksum is checked
as it is read (a memory-only checkpoint's files hold none without `memory_checksums`). The tier is removed
when training ends; `nanotron-datastates tier` lists and clears it.

Layout: `<memory_tier_path>/<job>/<step>/<the checkpoint's files>`, `<job>` named after the checkpoints
folder (its resolved path's hash); `<job>/replicas/<step>/...` holds the copies this node keeps for ranks of
other nodes (`memory_replicas`: replicas.py), marked by the rank they belong to.

The tier lives beside other users (`/dev/shm` is world-writable): its root is private to this user (0700,
ours, no link: `trust.private_dir`; the default path holds the user's id), markers list file names that
must stay inside their step's folder, every file is opened without following a link and must be a regular
file of ours, and nothing is removed but by name inside the tier (`trust`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from .. import trust
from ..checkpoint.manifest import Entries
from ..errors import DataStatesError
from .folders import behind, dead_temporary, ours, remove_behind, remove_empty, set_aside, step_numbers

if TYPE_CHECKING:
    from typing import Concatenate, ParamSpec

    _P = ParamSpec("_P")
_R = TypeVar("_R")

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


def marker_rank(name: str) -> int:
    """The rank whose marker (MARKER) `name` is; ValueError where it names no rank."""
    return int(name[len(".rank-") : -len(".json")])


def job_folder(base: str | os.PathLike, checkpoints: str | os.PathLike) -> Path:
    """This job's folder in the tier (not created): named after its checkpoints folder."""
    key = hashlib.sha1(str(Path(checkpoints).resolve()).encode()).hexdigest()[:16]
    return Path(str(base).replace("{uid}", str(os.geteuid()))) / key


def _locked(method: Callable[Concatenate[MemoryTier, _P], _R]) -> Callable[Concatenate[MemoryTier, _P], _R]:
    """`method` run holding the tier's lock: the spares change on the training thread (`recycle`) and the
    committer's (`commit`)."""

    @functools.wraps(method)
    def run(self: MemoryTier, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        self.pruned()
        with self._lock:
            return method(self, *args, **kwargs)

    return run


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
        max_spares: int = 1,
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
        self.max_spares = max_spares
        # Folders whose files (of this rank) the next saves take over, first first: sets made ahead (WARM),
        # or a step this rank held before.
        self._spares: list[tuple[str, list[str]]] = []
        self._given: tuple[int, tuple[str, list[str]]] | None = None  # the spare handed to a step's saves
        self._lock = threading.RLock()
        self._marked: dict[int, list[str]] = {}  # the files of the markers `commit` wrote (not read back)
        self._pruning: threading.Thread | None = None  # `prune_behind`'s
        self.removing: list[threading.Thread] = []  # the threads of `remove_behind`, which `pruned` waits for
        self.busy: set[int] = set()  # steps being read (sent to a peer): never handed to a save to overwrite

    def path(self, step: int, rel: str | os.PathLike) -> Path:
        """Where the tier keeps the file `rel` of the checkpoint of `step`."""
        return self.folder / str(step) / rel

    def sets(self) -> int:
        """The checkpoints of this rank the tier keeps at most between two saves: held, and spare."""
        return self.copies + (self.max_spares - 1 if self.copies == 2 else 0)

    def warm(self, i: int, rel: str | os.PathLike) -> Path:
        """Where the `i`-th set of files made ahead of the first saves keeps `rel` (`add_warm`)."""
        return self.folder / WARM.format(rank=self.rank, i=i) / rel

    @_locked
    def add_warm(self, i: int, rels: list[str]) -> None:
        """Hands the `i`-th set made ahead (its files `rels`, at `warm(i, rel)`) to the next saves to take
        over, before any step this rank held."""
        made_ahead = sum(not n.isdigit() for n, _ in self._spares)
        self._spares.insert(made_ahead, (WARM.format(rank=self.rank, i=i), rels))

    def remove_warm(self, i: int) -> None:
        """Removes the `i`-th set made ahead, which could not be made whole (never handed to a save)."""
        trust.remove_tree(self.folder, WARM.format(rank=self.rank, i=i))

    def _made_ahead(self) -> list[str]:
        """The folders of this rank's sets made ahead that are not its spares (taken over, or left behind)."""
        prefix, spares = WARM.format(rank=self.rank, i=""), {n for n, _ in self._spares}
        return [n for n in os.listdir(self.folder) if n.startswith(prefix) and n not in spares]

    def held_steps(self) -> list[int]:
        """The steps this rank marks held here."""
        mine = MARKER.format(rank=self.rank)
        return [s for s in self.steps() if mine in self.markers(s)]

    @_locked
    def recycle(self, step: int, rels: list[str]) -> list[str | None]:
        """The files of an earlier step (or of a set made ahead) that the save of `step` takes over (renamed
        and overwritten by the engine), one per name of `rels` (None: a new file): the rank's first spare that
        is not being read; with 1 copy and no spare, the held step's, its marker withdrawn first, so that no
        restart reads them while they are overwritten. Every call for one step draws on the same files.
        Paths as strings: a checkpoint's hundreds of files, every save, on the queuer's thread."""
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

    def _files_of(self, donor: tuple[str, list[str]], rels: list[str]) -> list[str | None]:
        folder, have = self.folder / donor[0], set(donor[1])
        mine = ours(folder, [rel for rel in rels if rel in have])
        prefix = f"{folder}/"
        return [prefix + rel if rel in mine else None for rel in rels]

    @_locked
    def commit(self, step: int, files: Entries) -> None:
        """Marks `step` as held by this rank (its files, each with the manifest's size and checksums), after
        the checkpoint was committed to storage; then, with 2 copies, the step it held before becomes its
        spare (marker withdrawn, files kept for the next save), and its other older steps are dropped."""
        for rel in files:
            trust.name_parts(rel, f"the files of step {step}")
        marker = f"{step}/{MARKER.format(rank=self.rank)}"  # written with no link followed
        trust.write_in(self.folder, marker, json.dumps({"step": step, "files": files}).encode())
        self._marked[step] = list(files)
        spare = self._held_before(step) if self.copies == 2 else None
        if spare is not None:
            self._withdraw(spare[0])  # first: never taken as held again
            self._spares.append((str(spare[0]), spare[1]))
            self.drop_spares(keep=self.max_spares)
        kept = {n for n, _ in self._spares}
        for s in self.steps():
            if s < step and str(s) not in kept and s not in self.busy:  # one being read: a later commit's
                self.drop(s)
        for name in self._made_ahead():  # taken over: empty
            remove_empty(self.folder, name)

    def _held_before(self, step: int) -> tuple[int, list[str]] | None:
        """The newest step below `step` that this rank marks held, with the files it marked; None: none."""
        held = [s for s in self.held_steps() if s < step]
        if not held:
            return None
        files = self._marked.get(held[-1])
        return held[-1], files if files is not None else list(self.marked(held[-1], self.rank) or {})

    def _withdraw(self, step: int) -> None:
        """Removes this rank's marker of `step`: from then on no restart takes the step as held."""
        self._marked.pop(step, None)
        trust.unlink_in(self.folder, f"{step}/{MARKER.format(rank=self.rank)}")

    def drop(self, step: int) -> None:
        """Removes this rank's files (and marker) of `step`; the step's folder once no rank has any there.
        Only names inside the step's folder are removed, never through a link: a marker naming anything
        else is ignored."""
        name = MARKER.format(rank=self.rank)
        self._marked.pop(step, None)
        files = self.marked(step, self.rank) or {}
        trust.unlink_in(self.folder, f"{step}/{name}")  # first: a half-dropped step is never taken as held
        for rel in files:
            with contextlib.suppress(trust.UntrustedPath):  # under a link: left for the folder's removal
                trust.unlink_in(self.folder / str(step), rel)
        if not self.markers(step):
            trust.remove_tree(self.folder, str(step))

    @_locked
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
            if not name.isdigit() or not self.markers(int(name)):
                remove_empty(self.folder, name)

    def prune(self, keep: int | None, aside: list[str] | None = None) -> None:
        """At the start of training: drops this rank's steps other than `keep` (the step latest.txt names),
        and the unmarked folders below it. A process killed between marking a step and dropping the older
        ones leaves them behind; this keeps the tier at one checkpoint per rank plus the one in flight.
        With `aside`, the sets an earlier process made ahead are set aside (folders.py) and named there, for
        the caller to remove behind, rather than removed in line."""
        self._remove_dead_temporaries()
        for name in self._made_ahead():  # by an earlier process of this rank
            if aside is None:
                trust.remove_tree(self.folder, name)
            else:
                with contextlib.suppress(OSError):  # gone meanwhile, or refused: left to the next start
                    aside.append(set_aside(self.folder, name))
        mine = MARKER.format(rank=self.rank)
        for step in self.steps():
            if step == keep:
                continue
            markers = self.markers(step)
            if mine in markers or (keep is not None and step < keep and not markers):
                self.drop(step)

    def prune_behind(self, keep: int | None, on_done: Callable[[BaseException | None, float], None]) -> None:
        """`prune(keep)` on a thread of its own (freeing a killed process's 20 GB of a 1.1B's tier takes
        seconds): every locked method, and `pruned`, waits for it first. `on_done(error or None, seconds)`."""
        self._pruning = behind(lambda: self.prune(keep), on_done, "datastates-tier-prune")

    def remove_behind(
        self, folder: Path, names: list[str], on_done: Callable[[BaseException | None, float], None]
    ) -> None:
        """Removes `folder/<names>` (sets put aside by `prune`'s caller) on a thread of its own that `pruned`
        waits for (folders.remove_behind)."""
        self.removing.append(remove_behind(folder, names, on_done))

    def pruned(self) -> None:
        """Waits for `prune_behind`'s removal and those in `removing`, if any (never on the thread itself)."""
        for t in (self._pruning, *self.removing):
            if t is not None and t is not threading.current_thread():
                t.join()

    def _remove_dead_temporaries(self) -> None:
        """Removes the files that saves of processes no longer running were writing
        (`.<name>.dstmp.<pid>.<n>`): each holds up to a file's worth of memory nothing would give back."""
        with contextlib.suppress(OSError):  # a folder moved while searched: the next start goes on
            trust.remove_files(self.folder, dead_temporary)

    def steps(self) -> list[int]:
        """The steps this job's folder holds (real folders named by a step), oldest first."""
        return step_numbers(self.folder)

    @_locked
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

    def markers(self, step: int) -> list[str]:
        """The names of the rank markers in the folder of `step`."""
        try:
            names = os.listdir(self.folder / str(step))
        except OSError:
            return []
        return sorted(n for n in names if n.startswith(".rank-") and n.endswith(".json"))

    def marked(self, step: int, rank: int, strict: bool = False) -> dict[str, dict[str, object]] | None:
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
                trust.name_parts(rel, str(path))
            if not all(isinstance(e, dict) for e in files.values()):
                raise ValueError(f"{path}: an entry is not an object")
            return files
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            if strict:
                raise
            return None
