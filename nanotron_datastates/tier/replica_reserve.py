"""The memory of the temporaries a replica is received into, reserved beside the transfer: a tier out of
room must fail with an error naming the file, never with a SIGBUS (a write into a mapping with no page behind
it) that kills the rank in the middle of a transfer.

Before the ranks agree to go, `room` checks that the tier's file system has the bytes free. Then `reserving`
reserves every temporary (`posix_fallocate`), several files at once, each from its start in RANGE steps,
while the transfer runs: a link writes a range of a file only once `Reservation.wait` says its pages exist
(the tmpfs pages are made by these threads, not one fault at a time by the copying ones). Where a file's
memory cannot be reserved after all (the room taken by another process meanwhile), the link still receives
its bytes and drops them, so that no peer waits forever on a send; its check then fails naming the file
(`Reservation.check`), and it is never placed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from .replica_transfer import Transfer

RANGE = 256 << 20  # bytes reserved at a time: a link's first chunks of a large file wait for no more
THREADS = 8  # files reserved at once


class Reservation:
    """How far the memory of one temporary (`path`, `nbytes`) is reserved: bytes [0, `upto`), or `error`."""

    def __init__(self, path: Path | None, nbytes: int) -> None:
        self.path, self.nbytes, self.upto = path, nbytes, 0
        self.error: OSError | None = None
        self._cond = threading.Condition()

    def wait(self, end: int) -> bool:
        """Waits until bytes [0, end) are reserved: True, or False where they will not be (`error`)."""
        with self._cond:
            self._cond.wait_for(lambda: self.upto >= end or self.error is not None)
            return self.upto >= end

    def check(self) -> None:
        """Raises the OSError (naming the file) where this file's memory could not be reserved."""
        self.wait(self.nbytes)
        if self.error is not None:
            raise self.error

    def run(self, fd: int, stop: threading.Event) -> None:
        """Reserves the file open on `fd`, range by range, until done, failed or `stop`ped."""
        try:
            self._run(fd, stop)
        except Exception as e:  # noqa: BLE001 - a waiter must never wait forever
            self._set(error=OSError(errno.EIO, f"reserving a replica file's memory: {e}", str(self.path)))

    def _run(self, fd: int, stop: threading.Event) -> None:
        while self.upto < self.nbytes:
            n = min(RANGE, self.nbytes - self.upto)
            try:
                if stop.is_set():
                    raise OSError(errno.ECANCELED, "the transfer ended first")
                os.posix_fallocate(fd, self.upto, n)
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system that cannot: pages at 1st use
                    n = self.nbytes - self.upto
                else:
                    why = f"reserving the memory of a replica file: {e.strerror}"
                    self._set(error=OSError(e.errno, why, str(self.path)))
                    return
            self._set(upto=self.upto + n)

    def _set(self, upto: int | None = None, error: OSError | None = None) -> None:
        with self._cond:
            self.upto = upto if upto is not None else self.upto
            self.error = error or self.error
            self._cond.notify_all()


def room(recvs: list[Transfer], folder: Path) -> None:
    """OSError (ENOSPC, naming `folder`) where the file system of the tier `folder` is in has fewer bytes free
    than the temporaries received into still need (a taken-over file's pages are there already)."""
    need = 0
    for t in recvs:
        if t.fd is not None:
            need += max(0, t.nbytes - os.fstat(t.fd).st_blocks * 512)
    if need:
        st = os.statvfs(folder)
        free = st.f_bavail * st.f_frsize
        if free < need:
            why = f"{need / 1e9:.3f} GB of replica files to receive, {free / 1e9:.3f} GB free"
            raise OSError(errno.ENOSPC, why, str(folder))


@contextlib.contextmanager
def reserving(recvs: list[Transfer]) -> Iterator[None]:
    """Gives each receive with an open temporary its `reservation` and reserves them all, THREADS files at
    once in `recvs`' order (a link's), while the block runs; on the way out stops and waits for the threads
    (the temporaries are still open then)."""
    todo = [t for t in recvs if t.fd is not None]
    for t in todo:
        t.reservation = Reservation(t.temporary, t.nbytes)
    stop = threading.Event()
    pool = ThreadPoolExecutor(max(1, min(THREADS, len(todo))), "datastates-replica-reserve")
    for t in todo:
        assert t.reservation is not None and t.fd is not None
        pool.submit(t.reservation.run, t.fd, stop)
    try:
        yield
    finally:
        stop.set()
        pool.shutdown(wait=True)
