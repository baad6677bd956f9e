"""DataStatesEngine: the Python face of the core.

A save goes through four stages; only the first runs on the caller's thread::

    plan (flatten, caller) -> copy (copy threads, into the host cache) -> flush (io_uring) -> commit

and resolves two futures, as PyTorch DCP's ``AsyncSaveResponse`` does: *snapshot* (every tensor captured, the
caller may mutate them) and *persisted* (fsync'd, renamed into place, directory fsync'd).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Iterable, Mapping, Sequence

import torch

from . import _core, telemetry
from . import format as fmt
from .engine_settings import DataStatesConfig
from .plan import SavePlan, plan_save, prepare_many
from .restore import (
    load_file,
    load_into_tensors,
    load_range_list,
    load_ranges,
    load_tensors,
    read_structure,
    verify_file,
)

log = logging.getLogger("nanotron_datastates")
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


class SaveHandle:
    """One save in flight. Returned by :meth:`DataStatesEngine.save`.

    Both waits raise the save's error (OSError with errno and path, for I/O) once it is known, and
    TimeoutError when `timeout` (seconds) passes first.
    """

    def __init__(
        self,
        job: Any,
        path: str,
        keepalive: list[torch.Tensor],
        nbytes: int,
        staged: bool = False,
        mirror: str | None = None,
        exact_metadata: bool = False,
    ) -> None:
        self._job = job
        self.path = path
        self.exact_metadata = exact_metadata
        """Whether the header holds the caller's metadata only, without checksums (see :meth:`checksums`)."""
        self.mirror = mirror
        """Where the save writes its second copy (``save(..., mirror=...)``), or None."""
        self.nbytes = nbytes
        self.staged = staged
        """Whether the save copied the state when it was called (``save(..., stage=True)``)."""
        self._keepalive: list[torch.Tensor] | None = keepalive
        self._reported = False
        self._stall_s = 0.0  # the caller's time in save (its share of the call) and in wait_snapshot
        self._logged = False  # its telemetry line written

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Returns once every tensor of the state has been captured: the caller may mutate them now. At once
        for a staged save, whose copies were queued before :meth:`DataStatesEngine.save` returned."""
        if self.staged:
            self._raise()
            return
        t0 = time.perf_counter()
        try:
            self.wait_copied(timeout)
        finally:
            self._stall_s += time.perf_counter() - t0

    def wait_copied(self, timeout: float | None = None) -> None:
        """Returns once every byte is in the engine's host cache (or already written); the tensors the engine
        read (the state's, or a staged save's copies, whose memory goes back now) are no longer used."""
        if not self._job.wait_snapshot(-1.0 if timeout is None else timeout):
            raise TimeoutError(f"snapshot of {self.path} not done within {timeout} s")
        self._keepalive = None  # the engine no longer reads them
        self._raise()

    def wait_persisted(self, timeout: float | None = None) -> None:
        """Returns once the file is durable at :attr:`path` (fsync'd, renamed, directory fsync'd)."""
        if not self._job.wait_persisted(-1.0 if timeout is None else timeout):
            raise TimeoutError(f"{self.path} not persisted within {timeout} s")
        self._keepalive = None
        self._raise()

    def snapshot_done(self) -> bool:
        """True once :meth:`wait_snapshot` would return at once."""
        return self.staged or self._job.snapshot_done()

    def done(self) -> bool:
        """True once persisted or failed."""
        return self._job.persisted_done()

    def exception(self) -> BaseException | None:
        """The save's error once it has failed, else None; never raises it."""
        if not self._job.failed() or not self.done():
            return None
        try:
            self._job.raise_error()
        except Exception as e:
            return e
        return None

    @property
    def stats(self) -> dict[str, Any]:
        """Bytes and seconds since submission: ``snapshot_s`` and ``persisted_s`` (None until done)."""
        s = self._job.stats()
        t0 = s["t_submit_ns"]
        return {
            "path": self.path,
            "file_bytes": s["file_bytes"],
            "tensor_bytes": s["tensor_bytes"],
            "snapshot_s": (s["t_snapshot_ns"] - t0) / 1e9 if s["t_snapshot_ns"] else None,
            "persisted_s": (s["t_persisted_ns"] - t0) / 1e9 if s["t_persisted_ns"] else None,
            "direct_io": s["direct_io"],
            "mirrored": s["mirrored"],
        }

    def mirrored(self) -> bool:
        """Once persisted: whether the mirror copy is in place at :attr:`mirror`. A mirror that could not be
        written (no room, say) never fails the save: :meth:`mirror_error` says why it was dropped."""
        self.wait_persisted()
        return bool(self._job.stats()["mirrored"])

    def mirror_error(self) -> str | None:
        """Why the mirror copy was dropped, or None."""
        return self._job.mirror_error() or None

    def checksums(self) -> dict[str, int]:
        """CRC-32C of each tensor, by name, once persisted (empty when checksums are off)."""
        self.wait_persisted()
        return dict(self._job.checksums())

    def block_checksums(self) -> tuple[int, dict[str, list[int]]]:
        """(B, the CRC-32C of each block segment per tensor name), once persisted: each tensor's bytes cut at
        the multiples of B in the data section, as docs/FORMAT.md specifies (B is 0 when checksums are off).
        A file saved with `exact_metadata` holds neither these nor :meth:`checksums`: keep them elsewhere to
        read it in part (:meth:`DataStatesEngine.load_ranges`)."""
        self.wait_persisted()
        block, sums = self._job.block_checksums()
        return block, dict(sums)

    def _raise(self) -> None:
        if self._job.failed():
            self._reported = True
            self._job.raise_error()

    def __repr__(self) -> str:
        state = "persisted" if self.done() else ("captured" if self.snapshot_done() else "copying")
        if self.done() and self._job.failed():
            state = "failed"
        return f"<SaveHandle {self.path} {state}>"


def wait_handles(
    handles: Sequence[SaveHandle], *, persisted: bool = False, timeout: float | None = None
) -> None:
    """Waits until every handle's bytes are in the host cache (`persisted`: durable), in one call that gives
    the GIL up once, then lets go of the tensors they kept alive. TimeoutError if `timeout` passes first.
    A failed save counts as done here: its own waits report its error."""
    if not _core.wait_jobs([h._job for h in handles], persisted, -1.0 if timeout is None else timeout):
        what = "persisted" if persisted else "copied"
        raise TimeoutError(f"{len(handles)} saves not all {what} within {timeout} s")
    for h in handles:
        h._keepalive = None


class DataStatesEngine:
    """Lazy asynchronous checkpointing into valid safetensors files.

    ``save`` returns at once; tensors are copied into a pinned host cache by copy threads and flushed by
    io_uring workers. ``load`` reads files (ours or any safetensors) in parallel. Use as a context manager, or
    call :meth:`close`, which drains every save.
    """

    def __init__(self, config: DataStatesConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = DataStatesConfig(**overrides)
        elif overrides:
            config = DataStatesConfig(**{**config.to_dict(), **overrides})
        self.config = config
        _check_memory(config)
        pin_device = -1
        if config.pin_host_cache and torch.cuda.is_available():
            pin_device = torch.cuda.current_device()
        self._core = _core.Engine(
            cache_bytes=config.cache_bytes,
            chunk_bytes=config.chunk_bytes,
            pin_device=pin_device,
            huge_pages=config.huge_pages,
            parser_threads=config.parser_threads,
            copy_threads=config.copy_threads or 1,
            host_copy_threads=config.copy_threads or min(4, os.cpu_count() or 1),
            flush_threads=config.flush_threads,
            queue_depth=config.queue_depth,
            read_bytes=config.read_bytes,
            io_backend=config.io_backend,
            direct_io=config.direct_io,
            fsync=config.fsync,
            checksums=config.checksums,
        )
        if self._core.fallback_reason:
            _warn_once(
                f"io_uring is refused here ({self._core.fallback_reason}); flushing with a pwrite thread pool"
            )
        if pin_device >= 0 and not self._core.pinned:
            _warn_once(
                f"could not page-lock the host cache ({self._core.pin_error}); GPU copies will be slower"
            )
        self._lock = threading.Lock()
        self._handles: collections.deque[SaveHandle] = collections.deque()
        self._closed = False

    # -- saving -------------------------------------------------------------------------------------------

    def save(
        self,
        state: Any,
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

        `mirror`: a second path (a memory tier, e.g. under /dev/shm) where the same bytes are written from the
        host cache as each piece is flushed, and renamed into place once the file is persisted (not synced:
        a copy in memory). A mirror that cannot be written is dropped, never the save (`SaveHandle.mirrored`).
        """
        plan = self.plan(state, metadata=metadata, allow_pickle=allow_pickle, exact_metadata=exact_metadata)
        return self.save_plan(plan, path, stage=stage, mirror=mirror)

    def plan(
        self,
        state: Any,
        *,
        metadata: Mapping[str, str] | None = None,
        allow_pickle: bool = False,
        exact_metadata: bool = False,
    ) -> SavePlan:
        """Flattens `state` (arguments as for :meth:`save`) into a plan that :meth:`save_plan` saves, as often
        as wanted: for the same tensors saved again and again (a model's weights at every checkpoint), the
        walk over the state and its checks are done once. The plan holds the tensors, not their values: each
        save captures them as they are then. Plain values in `state` are those of this call."""
        return plan_save(state, metadata=metadata, allow_pickle=allow_pickle, exact_metadata=exact_metadata)

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
    ) -> list[SaveHandle]:
        """Saves several plans, each to its path, as :meth:`save_plan` would one by one. Staged, their copies
        are made together (one allocation per device, packed as the files are, and one multi-tensor copy per
        dtype): for a checkpoint of many files, far fewer kernel launches on the caller's thread, and fewer
        copies to the host. The files are queued all together or, if this raises (staging out of memory:
        torch's OutOfMemoryError), none of them. `mirrors`: each file's mirror path or None (:meth:`save`)."""
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        t0 = time.perf_counter()
        paths = [os.path.abspath(os.fspath(path)) for _, path in files]
        mirrors = list(mirrors) if mirrors is not None else [None] * len(files)
        if len(mirrors) != len(files):
            raise ValueError(f"{len(mirrors)} mirrors for {len(files)} files")
        copies = [os.path.abspath(os.fspath(m)) if m is not None else None for m in mirrors]
        prepared = prepare_many([plan for plan, _ in files], stage=stage)
        # One call to the core for all: one event per device on the caller's streams, and a staged file's
        # tensors as places in the staged buffers rather than a DLPack export each.
        requests = [
            (
                path,
                p.names,
                p.dtypes,
                [] if p.views else p.arrays,
                p.views,
                p.metadata,
                not p.exact_metadata,
                m or "",
            )
            for p, path, m in zip(prepared, paths, copies)
        ]
        streams = sorted({s for p in prepared for s in p.streams})
        bases = prepared[0].bases if prepared else []
        jobs = self._core.save_many(requests, bases, streams)  # all queued, or none (it raises)
        handles = [
            SaveHandle(job, path, p.arrays, p.nbytes, stage, m, p.exact_metadata)
            for job, p, path, m in zip(jobs, prepared, paths, copies)
        ]
        for h in handles:
            h._stall_s = (time.perf_counter() - t0) / len(handles)
        with self._lock:
            self._log()
            self._prune()
            self._handles.extend(handles)
        return handles

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Waits for the snapshot of every save in flight; raises the first error not yet reported."""
        self._wait_all("snapshot", timeout)

    def wait_persisted(self, timeout: float | None = None) -> None:
        """Waits until every save in flight is persisted; raises the first error not yet reported."""
        self._wait_all("persisted", timeout)

    def _wait_all(self, what: str, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            handles = list(self._handles)
        for h in handles:  # one at a time, so that a timeout names the save
            left = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            wait = h._job.wait_snapshot if what == "snapshot" else h._job.wait_persisted
            if not wait(left):
                raise TimeoutError(f"{what} of {h.path} not done within {timeout} s")
            h._keepalive = None
        with self._lock:
            failed = next((h for h in self._handles if h._job.failed() and not h._reported), None)
            self._log()
            self._prune()
        if failed is not None:
            failed._raise()  # the others stay for the next wait, or close()

    def _prune(self) -> None:
        # Drop handles that are persisted and have nothing left to report (oldest first).
        while (
            self._handles
            and self._handles[0].done()
            and (self._handles[0]._reported or not self._handles[0]._job.failed())
            and (self._handles[0]._logged or not self.config.telemetry_path)
        ):
            self._handles.popleft()

    def _log(self) -> None:
        """Writes the telemetry lines of the saves done since the last call (`config.telemetry_path`)."""
        if not self.config.telemetry_path:
            return
        done = [h for h in self._handles if not h._logged and h.done()]
        if not done:
            return
        cache = self._core.cache_stats(True)
        lines = []
        for h in done:
            h._logged = True
            s, err = h.stats, h.exception()
            persisted = s["persisted_s"] or 0.0
            line = telemetry.record(
                step=None,
                where=h.path,
                committed=err is None,
                errors=[str(err)] if err else [],
                nbytes=s["file_bytes"],
                files=1,
                stall_s=h._stall_s,
                snapshot_s=s["snapshot_s"] or 0.0,
                persisted_s=persisted,
                committed_s=persisted,
                cache=cache,
            )
            lines.append(line)
            cache = {}  # counted on the first line of the batch
        telemetry.append(self.config.telemetry_path, lines)

    # -- loading ------------------------------------------------------------------------------------------

    def load(
        self,
        path: str | os.PathLike,
        device: str | torch.device = "cpu",
        *,
        verify: bool | None = None,
        allow_pickle: bool = False,
        checksums: Mapping[str, int] | None = None,
    ) -> Any:
        """Reads a file written by :meth:`save` (or any safetensors file) onto `device`, in parallel.

        Returns the saved structure (a dict of tensors for a plain safetensors file). Checksums are verified
        when the file holds them, or against `checksums` (name to CRC-32C, e.g. kept from a save with
        ``exact_metadata``); `verify` defaults to ``config.verify_checksums``. ChecksumError names the tensor.
        """
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        verify = self.config.verify_checksums if verify is None else verify
        state, _ = load_file(
            self._core, path, device, verify=verify, allow_pickle=allow_pickle, checksums=checksums
        )
        return state

    def load_into(
        self,
        path: str | os.PathLike,
        tensors: Mapping[str, torch.Tensor],
        *,
        verify: bool | None = None,
        checksums: Mapping[str, int] | None = None,
    ) -> None:
        """Reads the named tensors of a file into existing ones (same dtype and shape, contiguous): CUDA
        destinations are filled straight from the pinned cache, without a second allocation."""
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        verify = self.config.verify_checksums if verify is None else verify
        load_into_tensors(self._core, path, tensors, verify=verify, checksums=checksums)

    def verify(
        self,
        path: str | os.PathLike,
        checksums: Mapping[str, int] | None = None,
        block_checksums: tuple[int, Mapping[str, Sequence[int]]] | None = None,
    ) -> bool:
        """Checks a file end to end: its header, its size, and every tensor's CRC-32C (stored in the file, or
        `checksums`, with their `block_checksums`). Raises FormatError, ChecksumError or OSError naming the
        file; returns whether any checksum was checked (False: a file without checksums, whose structure
        alone is sound)."""
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        header = verify_file(self._core, path, checksums, block_checksums)
        return checksums is not None or header.checksums() is not None

    def load_tensors(
        self, path: str | os.PathLike, names: Iterable[str], *, checksums: Mapping[str, int] | None = None
    ) -> dict[str, torch.Tensor]:
        """Reads only the named tensors of a file onto the CPU (names as in the file: see
        :meth:`read_structure`), each checked against its checksum as :meth:`load` does."""
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        return load_tensors(self._core, path, names, verify=self.config.verify_checksums, checksums=checksums)

    def load_ranges(
        self,
        path: str | os.PathLike,
        ranges: Mapping[str, tuple[int, int]],
        *,
        checksums: Mapping[str, int] | None = None,
        block_checksums: tuple[int, Mapping[str, Sequence[int]]] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Elements [start, stop) of each named tensor, flattened, onto the CPU: a rank's part of a larger
        state. Files the engine writes hold a checksum per block (1 MiB at most), so only the blocks over
        each range are read and each is checked; for other files the whole tensor is read and checked. A file
        saved with `exact_metadata` is read in part with the `checksums` and `block_checksums` of its
        :class:`SaveHandle`."""
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        verify = self.config.verify_checksums
        return load_ranges(
            self._core, path, ranges, verify=verify, checksums=checksums, block_checksums=block_checksums
        )

    def load_range_list(
        self,
        path: str | os.PathLike,
        items: Sequence[tuple[str, int, int]],
        *,
        checksums: Mapping[str, int] | None = None,
        block_checksums: tuple[int, Mapping[str, Sequence[int]]] | None = None,
    ) -> list[torch.Tensor]:
        """As :meth:`load_ranges`, for a list of (tensor name, start, stop) that may hold several ranges of
        one tensor; the tensors come back in the same order. One read of the file serves them all."""
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        verify = self.config.verify_checksums
        return load_range_list(
            self._core, path, items, verify=verify, checksums=checksums, block_checksums=block_checksums
        )

    def read_structure(self, path: str | os.PathLike) -> Any:
        """The saved structure with a `TensorRef` (name in the file, dtype, shape) in place of each tensor:
        the header alone is read. With :meth:`load_tensors`, a part of a large state can be read."""
        return read_structure(path)

    def read_metadata(self, path: str | os.PathLike) -> dict[str, str]:
        """The file's ``__metadata__`` without the engine's own keys (no tensor is read)."""
        return fmt.read_header(path).user_metadata()

    # -- lifetime -----------------------------------------------------------------------------------------

    @property
    def io_backend(self) -> str:
        """'io_uring' or 'pwrite' (the fallback where io_uring is refused)."""
        return self._core.backend

    @property
    def pinned(self) -> bool:
        """Whether the host cache is page-locked for DMA (decided when the engine starts)."""
        return self._core.pinned

    def cache_stats(self, reset: bool = False) -> dict[str, Any]:
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
        if self.config.telemetry_path:  # the last lines, while the cache's statistics are still there
            with self._lock:
                handles = list(self._handles)
            for h in handles:
                h._job.wait_persisted(-1.0)
            with self._lock:
                self._log()
        self._closed = True
        self._core.close()
        with self._lock:
            pending = [h for h in self._handles if not h._reported and h._job.failed()]
            self._handles.clear()
        if pending:
            for h in pending[1:]:
                log.error("checkpoint save failed: %s", h.exception())
            pending[0]._raise()

    def __enter__(self) -> DataStatesEngine:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
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


def _check_memory(config: DataStatesConfig) -> None:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    if config.cache_bytes > 0.9 * total:
        raise ValueError(
            f"datastates.host_cache_size={config.host_cache_size} GiB does not fit in this machine's "
            f"{total / 2**30:.1f} GiB of memory; use at most {0.9 * total / 2**30:.1f}"
        )
