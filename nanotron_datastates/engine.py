"""DataStatesEngine: the Python face of the core.

A save goes through four stages; only the first runs on the caller's thread::

    plan (flatten, caller) -> copy (copy threads, into the host cache) -> flush (io_uring) -> commit

and resolves two futures, as PyTorch DCP's ``AsyncSaveResponse`` does: *snapshot* (every tensor captured, the
caller may mutate them) and *persisted* (fsync'd, renamed into place, directory fsync'd).

This module is the public face; the plumbing is beside it: `plan` (flattening), `staged_save` (a save
prepared, handed to the core later), `save_handle` (one save's futures), `in_flight` (the engine-wide waits
and telemetry), `engine_reads` (the loading methods, which the engine inherits) over `restore` (reading),
`core_setup` (starting the C++ core).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import time
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from . import _core
from .core_setup import start_core
from .engine_settings import DataStatesConfig
from .load.engine_reads import EngineReads
from .save.handle import SaveHandle, let_go_of_jobs, wait_handles
from .save.in_flight import InFlight
from .save.plan import SavePlan, plan_save
from .save.prepare import current, prepare_all
from .save.stage import Stager
from .save.staged_save import StagedSave

if TYPE_CHECKING:
    import torch

__all__ = ["DataStatesEngine", "SaveHandle", "StagedSave", "wait_handles"]

log = logging.getLogger("nanotron_datastates")
_ENGINES: weakref.WeakSet[DataStatesEngine] = weakref.WeakSet()  # every engine made, for the exit below


class DataStatesEngine(EngineReads):
    """Lazy asynchronous checkpointing into valid safetensors files.

    ``save`` returns at once; tensors are copied into a pinned host cache by copy threads and flushed by
    io_uring workers. ``load`` reads files (ours or any safetensors) in parallel. Use as a context manager, or
    call :meth:`close`, which drains every save.
    """

    def __init__(self, config: DataStatesConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = DataStatesConfig(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)  # a TrainerSettings stays one
        self.config = config
        self._core = start_core(config)
        self._in_flight = InFlight(config.telemetry_path, self.cache_stats)
        _ENGINES.add(self)
        self._stager = Stager()  # the last staged layout, for the next save of the same tensors
        # Per device: the stream the core's copies of a staging wait on
        self._side_streams: dict[int, torch.cuda.Stream] = {}
        self._closed = False

    # -- saving -------------------------------------------------------------------------------------------

    def save(
        self,
        state: object,
        path: str | os.PathLike,
        *,
        metadata: Mapping[str, str] | None = None,
        allow_pickle: bool = False,
        exact_metadata: bool = False,
        stage: bool = False,
        mirror: str | os.PathLike | None = None,
    ) -> SaveHandle:
        """Starts saving `state` (nested dicts/lists/tuples of tensors and plain values) to `path`.

        Returns before any byte is copied. Until :meth:`SaveHandle.wait_snapshot` returns, the caller must not
        modify the tensors. `metadata` (str to str) lands in the file's ``__metadata__``. Objects other than
        tensors and plain values raise TypeError naming their key, unless `allow_pickle`.

        `exact_metadata`: `state` is a flat dict of tensors and `metadata` is written verbatim as the whole
        ``__metadata__``, for readers that reject unknown keys (Nanotron's). Checksums are still computed:
        keep them from :meth:`SaveHandle.checksums` and pass them to :meth:`load`.

        `stage`: first copy every tensor where it is (a GPU's memory, at its speed, in the order of each
        device's current stream) and save those copies; the caller may mutate the state as soon as this
        returns. Costs the state's size in memory on each device until the copies reach the host cache.

        `mirror`: a second path (a memory tier, e.g. under /dev/shm) whose file is the save's staging memory:
        mapped (and pinned) in place of host cache chunks, each piece copied into it and written to `path`
        from it, renamed into place once the file is persisted (not synced: a copy in memory). The mapping is
        kept for a later save to recycle (:meth:`save_plans`' `recycle`, :meth:`keep_mirrors`). A mirror that
        cannot be had (no room) is dropped, never the save (`SaveHandle.mirrored`). A mirror that is `path`
        itself keeps the file in memory only (a memory checkpoint): nothing is written to storage, and where
        the mirror cannot be had the save fails, naming why.
        """
        t0 = time.perf_counter()
        plan = self.plan(state, metadata=metadata, allow_pickle=allow_pickle, exact_metadata=exact_metadata)
        planned = time.perf_counter() - t0
        handle = self.save_plan(plan, path, stage=stage, mirror=mirror)
        handle._stall_s += planned  # the caller's stall counts its whole call, as its own clock does
        return handle

    def plan(
        self,
        state: object,
        *,
        metadata: Mapping[str, str] | None = None,
        allow_pickle: bool = False,
        exact_metadata: bool = False,
        like: SavePlan | None = None,
    ) -> SavePlan:
        """Flattens `state` (arguments as for :meth:`save`) into a plan that :meth:`save_plan` saves, as often
        as wanted: for the same tensors saved again and again (a model's weights at every checkpoint), the
        walk over the state and its checks are done once. The plan holds the tensors, not their values: each
        save captures them as they are then. Plain values in `state` are those of this call.

        `like`: the plan of an earlier state much like this one (an optimizer's state, whose plain values
        change between checkpoints): the checks of the tensors it still holds are not done again."""
        return plan_save(
            state, metadata=metadata, allow_pickle=allow_pickle, exact_metadata=exact_metadata, like=like
        )

    def save_plan(
        self,
        plan: SavePlan,
        path: str | os.PathLike,
        *,
        stage: bool = False,
        mirror: str | os.PathLike | None = None,
    ) -> SaveHandle:
        """Saves a plan from :meth:`plan`, as :meth:`save` saves a state (same rules, `stage`, `mirror`)."""
        return self.save_plans([(plan, path)], stage=stage, mirrors=[mirror])[0]

    def save_plans(
        self,
        files: Sequence[tuple[SavePlan, str | os.PathLike]],
        *,
        stage: bool = False,
        mirrors: Sequence[str | os.PathLike | None] | None = None,
        recycle: Sequence[str | os.PathLike | None] | None = None,
    ) -> list[SaveHandle]:
        """Saves several plans, each to its path, as :meth:`save_plan` would one by one. Staged, their copies
        are made together (one allocation per device, packed as the files are, and one multi-tensor copy per
        dtype): for a checkpoint of many files, far fewer kernel launches on the caller's thread, and fewer
        copies to the host. The files are queued all together or, if this raises (staging out of memory:
        torch's OutOfMemoryError), none of them. `mirrors`: each file's mirror path or None (:meth:`save`).
        `recycle`: for each mirror, an earlier save's mirror file (of this user's, in a folder private to it)
        to rename to the new mirror path and overwrite, its mapping and pinned pages reused; None or a missing
        file: a new one."""
        save = self._prepare([p for p, _ in files], stage, names=[os.fspath(f) for _, f in files])
        save.target([path for _, path in files], mirrors=mirrors, recycle=recycle)
        return save.queue()

    def stage_plans(
        self,
        files: Sequence[tuple[SavePlan, str | os.PathLike]],
        *,
        mirrors: Sequence[str | os.PathLike | None] | None = None,
        recycle: Sequence[str | os.PathLike | None] | None = None,
    ) -> StagedSave:
        """The first half of ``save_plans(files, stage=True, ...)``: every tensor copied where it is, now (the
        caller may change the originals as soon as this returns); :meth:`StagedSave.queue` then hands the
        copies to the engine, when the caller likes. Raises as save_plans does (staging out of memory:
        torch's OutOfMemoryError, nothing staged)."""
        staged = self._prepare([p for p, _ in files], True, names=[os.fspath(f) for _, f in files])
        staged.target([path for _, path in files], mirrors=mirrors, recycle=recycle)
        return staged

    def stage(self, plans: Sequence[SavePlan], *, keep: bool = False) -> StagedSave:
        """Every tensor of `plans` copied where it is, now, as :meth:`stage_plans` does, before anything is
        known of where the files go: :meth:`StagedSave.target` says it, then :meth:`StagedSave.queue`, from
        any thread (the core's copies follow these staging copies alone). A trainer stages before its
        optimizer step and leaves the rest to a thread of its own once the step is launched.

        `keep`: the copies' memory stays with the engine once the save has read it, for the next staging of
        the same tensors to copy into (no allocation, no view made: what staging costs the caller then is one
        multi-tensor copy per dtype); a staging while a save still reads them takes new memory, kept in
        their place. :meth:`release_staging` lets go of it."""
        return self._prepare(plans, True, events=True, keep=keep)

    @property
    def staging_nbytes(self) -> int:
        """Bytes of device memory kept by ``stage(..., keep=True)``."""
        return self._stager.kept_nbytes

    def release_staging(self) -> None:
        """Lets go of the memory kept by ``stage(..., keep=True)``; it goes back once no save reads it."""
        self._stager.release()

    def _prepare(
        self,
        plans: Sequence[SavePlan],
        stage: bool,
        events: bool = False,
        names: list[str] | None = None,
        keep: bool = False,
    ) -> StagedSave:
        """`names`: the files' paths, for the errors of plans whose tensors can no longer be saved."""
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        t0 = time.perf_counter()
        fresh = current(plans, names or [f"file {k} of the save" for k in range(len(plans))])
        prep = prepare_all(fresh, stage=stage, stager=self._stager, events=events, keep=keep)
        return StagedSave(self, fresh, prep, stage, time.perf_counter() - t0)

    def keep_mirrors(self, paths: Sequence[str | os.PathLike] | None = None) -> int:
        """Keeps the mirror files at `paths` mapped (and pinned) for later saves to recycle, and unmaps every
        other mirror file this engine has written; returns how many stay mapped. A mirror file that is
        removed keeps its memory until it is unmapped here (or the engine closes). None: those whose path
        still names their file (one `lstat` each, off the GIL), for a caller that has just removed files."""
        listed = None if paths is None else [os.path.abspath(os.fspath(p)) for p in paths]
        return self._core.keep_mirrors(listed)

    def prepare_mirrors(self, files: Sequence[tuple[SavePlan, str | os.PathLike]]) -> int:
        """Makes a mirror file at each path, laid out as a save of its plan lays out its file (with a page of
        header room), mapped, faulted in and pinned before this returns; a later save of the plan that
        recycles it (`save_plans`' `recycle`) then pins nothing while training runs. Kept mapped as
        :meth:`keep_mirrors` says. Raises OSError naming a file that cannot be made (those before it stay);
        returns how many were made."""
        described = [
            _core.MirrorLayout(
                path=os.path.abspath(os.fspath(path)),
                names=p.names,
                dtypes=p.dtypes,
                itemsizes=[a.element_size() for a in p.arrays],
                shapes=[list(a.shape) for a in p.arrays],
                metadata=p.metadata,
                embed_checksums=not p.exact_metadata,
            )
            for p, path in files
        ]
        return self._core.prepare_mirrors(described)

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Waits for the snapshot of every save in flight; raises the first error not yet reported."""
        self._in_flight.wait("snapshot", timeout)

    def wait_persisted(self, timeout: float | None = None) -> None:
        """Waits until every save in flight is persisted; raises the first error not yet reported."""
        self._in_flight.wait("persisted", timeout)

    # -- lifetime -----------------------------------------------------------------------------------------

    @property
    def io_backend(self) -> str:
        """'io_uring' or 'pwrite' (the fallback where io_uring is refused)."""
        return self._core.backend

    @property
    def pinned(self) -> bool:
        """Whether the host cache is page-locked for DMA (decided when the engine starts)."""
        return self._core.pinned

    def cache_stats(self, reset: bool = False) -> dict[str, int]:
        """Chunks, chunks in use, high-water mark, time spent waiting for a free chunk, and how many chunks
        are prepared (faulted in and pinned) so far."""
        return self._core.cache_stats(reset)

    def prepare_cache(self, wait: bool = True, nbytes: int | None = None) -> None:
        """Faults in and pins the host cache, all of it or the chunks that hold the first `nbytes` handed out:
        now (`wait`), or on a background thread.

        The engine starts at once with one chunk ready; a chunk is otherwise prepared by its first user, and
        chunks are reused most recent first, so only as much of the cache is ever pinned as is in use at
        once. Preparing takes about 0.2 s per GiB with huge pages (`huge_pages`; 0.25-0.55 s with 4 KiB
        pages) and pinning holds the CUDA driver's locks, stalling other CUDA calls meanwhile: call this to
        take the cost where it hurts least. A chunk holds a piece of one file
        only, so count `nbytes` in whole chunks per file.
        """
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        if nbytes is not None and nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        chunks = self._core.num_chunks if nbytes is None else -(-nbytes // self._core.chunk_bytes)
        self._core.prepare_cache(wait, chunks)

    def close(self) -> None:
        """Drains every save, stops the threads and frees the cache (its memory goes back). Idempotent.

        Raises the first save error that no wait has reported yet, so that no failure goes unnoticed.
        """
        if self._closed:
            return
        self._in_flight.log_remaining()
        self._closed = True
        self._stager.release()
        self._core.close()
        self._in_flight.close()

    def __enter__(self) -> DataStatesEngine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not mask the exception in flight
            self.close()
        except Exception as e:
            log.error("while closing after %s: %s", exc_type.__name__, e)

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass


@atexit.register
def _let_go_at_exit() -> None:
    """At interpreter exit, before its modules are torn down: every engine still open closed (its saves
    drained), and every engine and save handle let go of its core objects, so that none outlives the core's
    module, whatever still holds the engine or handle (a script's globals, freed later than the module on
    some interpreters: the binding then reports them as leaks)."""
    for engine in list(_ENGINES):
        try:
            engine.close()
        except Exception as e:  # a save that failed unnoticed: said, not raised, at exit
            log.error("closing a DataStatesEngine at exit: %s", e)
        engine._core = None  # type: ignore[assignment]  # closed: nothing reads it after this
    let_go_of_jobs()
