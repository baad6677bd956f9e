"""SaveHandle: one save in flight, with its two futures (snapshot, persisted) and what it measured.

Returned by :meth:`DataStatesEngine.save`; :func:`wait_handles` waits for many in one call to the core.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Sequence, TypedDict

import torch

from .. import _core

log = logging.getLogger("nanotron_datastates")
_HANDLES: weakref.WeakSet[SaveHandle] = weakref.WeakSet()  # every handle alive (let go of at exit)


class SaveStats(TypedDict):
    """:attr:`SaveHandle.stats`: bytes, and seconds since submission (None until that point is reached)."""

    path: str
    file_bytes: int
    tensor_bytes: int
    snapshot_s: float | None
    persisted_s: float | None
    direct_io: bool
    mirrored: bool
    mirror_kept: bool  # took over a kept mapping: nothing mapped or pinned anew
    mirror_refused: str  # why the kept mapping of the file recycled was refused (empty: it was not)


class SaveHandle:
    """One save in flight. Returned by :meth:`DataStatesEngine.save`.

    Both waits raise the save's error (OSError with errno and path, for I/O) once it is known, and
    TimeoutError when `timeout` (seconds) passes first.
    """

    def __init__(
        self,
        job: _core.Job,
        path: str,
        keepalive: list[torch.Tensor],
        nbytes: int,
        staged: bool = False,
        mirror: str | None = None,
        exact_metadata: bool = False,
    ) -> None:
        self._job = job
        _HANDLES.add(self)
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
        self._warned = False  # a kept mapping refused, said once

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
        self._say_refused()
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
    def stats(self) -> SaveStats:
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
            "mirror_kept": s["mirror_kept"],
            # refused where the file recycled has had a second name since: a new file instead
            "mirror_refused": s["mirror_refused"],
        }

    def mirrored(self) -> bool:
        """Once persisted: whether the mirror copy is in place at :attr:`mirror`. A mirror that could not be
        written (no room, say) never fails the save: :meth:`mirror_error` says why it was dropped."""
        self.wait_persisted()
        return bool(self._job.stats()["mirrored"])

    def mirror_error(self) -> str | None:
        """Why the mirror copy was dropped, or None."""
        return self._job.mirror_error() or None

    @property
    def summed(self) -> bool:
        """Whether the save sums its tensors: `checksums` on, and for a file kept in memory only
        `memory_checksums` too."""
        return self._job.summed()

    def checksums(self) -> dict[str, int]:
        """CRC-32C of each tensor, by name, once persisted (empty when not :attr:`summed`)."""
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

    def _say_refused(self) -> None:
        """Once persisted: says, once, why a kept mapping was not taken over."""
        if not self._warned:
            self._warned = True
            refused = self._job.stats()["mirror_refused"]
            if refused:
                log.warning("%s: not written through; the save went to a new file", refused)

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


def let_go_of_jobs() -> None:
    """Every handle's core job let go of (at interpreter exit, once every engine is closed: each job has
    ended); a handle is of no use after it (it has no job any more)."""
    for h in list(_HANDLES):
        _HANDLES.discard(h)
        del h._job
