"""StagedSave: a save prepared on the caller's thread and handed to the core later, once, by `queue`.

A trainer stages a checkpoint's state before its optimizer step (the copies on the GPU are the only work that
must happen there) and hands the rest to a thread of its own once the step is launched: the files'
destinations (`target`), a plan made from values read before the step (`replan`), the core's call
(`queue`). The core's copies to the host follow the staging copies alone, whichever thread queues them and
whatever the caller has launched since (an event recorded after the staging, `Prepared.events`).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Sequence

import torch

from .. import _core
from .handle import SaveHandle
from .plan import SavePlan
from .prepare import Prepared

if TYPE_CHECKING:
    from ..engine import DataStatesEngine


class StagedSave:
    """A save prepared on the caller's thread, not yet handed to the engine; :meth:`queue` does that, once.
    From :meth:`DataStatesEngine.stage_plans` or :meth:`DataStatesEngine.stage`, its tensors are already
    copied; `save_plans` makes one, staged or not, and queues it at once."""

    def __init__(
        self,
        engine: DataStatesEngine,
        plans: list[SavePlan],
        prep: Prepared,
        staged: bool,
        seconds: float,
    ) -> None:
        self._engine, self._plans, self._prep = engine, plans, prep
        self._paths: list[str] | None = None
        self._mirrors: list[str | None] = []
        self._recycle: list[str] = []
        self._staged, self._seconds = staged, seconds
        self._queued = False

    def target(
        self,
        paths: Sequence[str | os.PathLike],
        *,
        mirrors: Sequence[str | os.PathLike | None] | None = None,
        recycle: Sequence[str | os.PathLike | None] | None = None,
    ) -> None:
        """Where each file goes (`paths`, `mirrors`, `recycle` as :meth:`DataStatesEngine.save_plans` takes
        them), given before the save is queued; a later call replaces an earlier one."""
        self._check_open()
        n = len(self._plans)
        if len(paths) != n:
            raise ValueError(f"{len(paths)} paths for {n} files")
        self._paths = [absolute(p) for p in paths]
        self._mirrors = paths_per_file(mirrors, n, "mirrors")
        self._recycle = [r or "" for r in paths_per_file(recycle, n, "files to recycle")]

    def replan(self, index: int, plan: SavePlan) -> None:
        """Puts `plan` in place of file `index`'s plan, before the save is queued: a plan of the very tensors
        staged for that file (`SavePlan.holds`: the same objects, memory, shapes, strides, dtypes) whose plain
        values were read later; a trainer plans its optimizer's state once the step is launched, from a copy
        of the state's containers taken before (`skeleton.freeze`). ValueError naming the file where the
        tensors differ: the staged copies would not be theirs."""
        self._check_open()
        old = self._plans[index]
        if plan.exact_metadata != old.exact_metadata or not old.holds(plan.sources):
            where = self._paths[index] if self._paths is not None else f"file {index} of the save"
            raise ValueError(f"{where}: the new plan does not hold the tensors staged for it")
        self._plans[index] = plan

    def queue(self) -> list[SaveHandle]:
        """Hands every file to the engine: all queued, or none (it raises); a handle per file, in order."""
        engine, prep = self._engine, self._prep
        self._check_open()
        if self._paths is None:
            raise ValueError("where the staged files go was never given: call target() before queue()")
        if engine._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        self._queued = True
        t0 = time.perf_counter()
        # One call to the core for all: one event per device on the streams the copies follow, and a staged
        # file's tensors as places in the staged buffers rather than a DLPack export each.
        requests = [
            _core.FileSave(
                path=path,
                names=p.names,
                dtypes=p.dtypes,
                arrays=[] if v else a,
                views=v,
                metadata=p.metadata,
                embed_checksums=not p.exact_metadata,
                mirror=m or "",
                recycle=r if m else "",
            )
            for p, a, v, path, m, r in zip(
                self._plans, prep.arrays, prep.views, self._paths, self._mirrors, self._recycle
            )
        ]
        jobs = engine._core.save_many(requests, prep.bases, _streams(engine, prep))  # all, or none (raises)
        # Kept buffers (`stage(keep=True)`) are free again once these jobs have read them.
        engine._stager.lend(prep.bases, jobs)
        handles = [
            SaveHandle(job, path, a, p.nbytes, self._staged, m, p.exact_metadata)
            for job, p, a, path, m in zip(jobs, self._plans, prep.arrays, self._paths, self._mirrors)
        ]
        seconds = self._seconds + time.perf_counter() - t0
        for h in handles:
            h._stall_s = seconds / len(handles)
        engine._in_flight.add(handles)
        self._prep = Prepared([], [], [], [])  # the handles keep what the core reads alive
        return handles

    def _check_open(self) -> None:
        if self._queued:
            raise ValueError("this staged save is already queued")


def _streams(engine: DataStatesEngine, prep: Prepared) -> list[tuple[int, int]]:
    """The streams the core's copies follow: for a staging that recorded an event on each device, a stream
    of the engine's that waits for that event alone (the caller may have launched more since, on any
    thread); else each device's stream as it was at the preparation."""
    if not prep.events:
        return sorted({s for ss in prep.streams for s in ss})
    out = []
    for device, event in sorted(prep.events.items()):
        side = engine._side_streams.get(device)
        if side is None:
            side = engine._side_streams[device] = torch.cuda.Stream(device)
        side.wait_event(event)
        out.append((device, side.cuda_stream))
    return out


def paths_per_file(paths: Sequence[str | os.PathLike | None] | None, n: int, what: str) -> list[str | None]:
    """One absolute path (or None) per file of a save; ValueError naming `what` where the count differs."""
    paths = list(paths) if paths is not None else [None] * n
    if len(paths) != n:
        raise ValueError(f"{len(paths)} {what} for {n} files")
    return [absolute(p) if p is not None else None for p in paths]


def absolute(path: str | os.PathLike) -> str:
    """`os.path.abspath(path)`, without its normalization's cost where `path` is already absolute and normal
    (no `.` or `..` part, no empty part, no trailing slash): a checkpoint's 50 to 1000 files, every save."""
    p = os.fspath(path)
    normal = "//" not in p and "/./" not in p and "/../" not in p and not p.endswith(("/", "/.", "/.."))
    return p if normal and p.startswith("/") else os.path.abspath(p)
