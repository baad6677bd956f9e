"""The memory of the temporaries a replica is received into, reserved beside the transfer: a tier out of
room must fail with an error naming the file, never with a SIGBUS (a write into a mapping with no page behind
it) that kills the rank in the middle of a transfer.

Before the ranks agree to go, `room` checks that the tier's file system has the bytes free. Then `reserving`
reserves every temporary, several files at once, each from its start in RANGE steps, while the transfer
runs: `posix_fallocate` makes a range's pages (a link writes a range only once `Reservation.wait` says they
exist), then other threads map them into the receiving mapping (`MADV_POPULATE_WRITE`), so that the link's
copies neither allocate nor fault pages in one at a time. Where a file's memory cannot be reserved after all
(the room taken by another process meanwhile), the link still receives its bytes and drops them, so that no
peer waits forever on a send; its check then fails naming the file (`Reservation.check`), and it is never
placed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    from .replica_transfer import Transfer

RANGE = 64 << 20  # bytes reserved at a time: a link's first chunks of a large file wait for no more
THREADS = 8  # files reserved at once, and ranges mapped at once
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class Reservation:
    """How far the memory of one temporary (`path`, `nbytes`) is reserved: bytes [0, `upto`), or `error`."""

    def __init__(self, path: Path | None, nbytes: int) -> None:
        self.path, self.nbytes, self.upto = path, nbytes, 0
        self.error: OSError | None = None
        self.done_at: float | None = None  # time.monotonic() once every byte is reserved
        self.waited = 0.0  # seconds the waiters spent waiting, all threads together
        self._cond = threading.Condition()

    def wait(self, end: int) -> bool:
        """Waits until bytes [0, end) are reserved: True, or False where they will not be (`error`)."""
        with self._cond:
            if self.upto < end and self.error is None:
                t0 = time.monotonic()
                self._cond.wait_for(lambda: self.upto >= end or self.error is not None)
                self.waited += time.monotonic() - t0
            return self.upto >= end

    def check(self) -> None:
        """Raises the OSError (naming the file) where this file's memory could not be reserved."""
        self.wait(self.nbytes)
        if self.error is not None:
            raise self.error

    def run(self, fd: int, stop: threading.Event, mapped: Callable[[int, int], None] | None = None) -> None:
        """Reserves the file open on `fd`, range by range, until done, failed or `stop`ped; `mapped(a, n)`
        after each range is reserved."""
        try:
            self._run(fd, stop, mapped)
        except Exception as e:  # noqa: BLE001 - a waiter must never wait forever
            self._set(error=OSError(errno.EIO, f"reserving a replica file's memory: {e}", str(self.path)))

    def _run(self, fd: int, stop: threading.Event, mapped: Callable[[int, int], None] | None) -> None:
        while self.upto < self.nbytes:
            a, n = self.upto, min(RANGE, self.nbytes - self.upto)
            try:
                if stop.is_set():
                    raise OSError(errno.ECANCELED, "the transfer ended first")
                os.posix_fallocate(fd, a, n)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    why = f"reserving the memory of a replica file: {e.strerror}"
                    self._set(error=OSError(e.errno, why, str(self.path)))
                    return
                self._set(upto=self.nbytes)  # a file system that cannot: pages at first use
                return
            self._set(upto=a + n)
            if mapped is not None:
                mapped(a, n)

    def _set(self, upto: int | None = None, error: OSError | None = None) -> None:
        with self._cond:
            self.upto = upto if upto is not None else self.upto
            self.error = error or self.error
            if self.upto >= self.nbytes and self.done_at is None:
                self.done_at = time.monotonic()
            self._cond.notify_all()


def room(recvs: list[Transfer], folder: Path) -> None:
    """OSError (ENOSPC, naming `folder`, the tier folder received into) where the file system of the
    temporaries has fewer bytes free than they still need (a taken-over file's pages are there already).
    Asked of the temporaries' own descriptors (`fstat`, `fstatvfs`): no path walked again."""
    need: dict[int, tuple[int, int]] = {}  # by device: (a temporary's descriptor, bytes to reserve)
    for t in recvs:
        if t.fd is not None:
            st = os.fstat(t.fd)
            fd, n = need.get(st.st_dev, (t.fd, 0))
            need[st.st_dev] = (fd, n + max(0, t.nbytes - st.st_blocks * 512))
    for fd, n in need.values():
        vfs = os.fstatvfs(fd)
        free = vfs.f_bavail * vfs.f_frsize
        if free < n:
            why = f"{n / 1e9:.3f} GB of replica files to receive, {free / 1e9:.3f} GB free"
            raise OSError(errno.ENOSPC, why, str(folder))


def reserved_within(recvs: list[Transfer], t0: float) -> tuple[float, float]:
    """How long after `t0` (time.monotonic) the last of `recvs` was reserved (0: before it), and how long
    the link's copies waited for reservations, all threads together."""
    ends = [t.reservation.done_at or t0 for t in recvs if t.reservation is not None]
    waited = sum(t.reservation.waited for t in recvs if t.reservation is not None)
    return max([0.0] + [e - t0 for e in ends]), waited


@contextlib.contextmanager
def reserving(recvs: list[Transfer]) -> Iterator[None]:
    """Gives each receive with an open temporary its `reservation` and reserves them all, THREADS files at
    once in `recvs`' order (a link's), each range mapped into `t.buf` once reserved, while the block runs;
    on the way out stops and waits for the threads (the temporaries are still open then)."""
    todo = [t for t in recvs if t.fd is not None]
    for t in todo:
        t.reservation = Reservation(t.temporary, t.nbytes)
    stop = threading.Event()
    pool = ThreadPoolExecutor(max(1, min(THREADS, len(todo))), "datastates-replica-reserve")
    mapper = ThreadPoolExecutor(THREADS, "datastates-replica-map")
    for t in todo:
        assert t.reservation is not None and t.fd is not None and t.buf is not None
        address = t.buf.data_ptr()

        def mapped(a: int, n: int, address: int = address) -> None:
            if not stop.is_set():
                mapper.submit(_populate, address + a, n, stop)

        pool.submit(t.reservation.run, t.fd, stop, mapped)
    try:
        yield
    finally:
        stop.set()
        pool.shutdown(wait=True)
        mapper.shutdown(wait=True)


def _populate(address: int, n: int, stop: threading.Event) -> None:
    """Maps the reserved pages of [address, address + n): a speed-up only (a write would map them too), so a
    kernel that cannot (before 5.14: EINVAL) or any failure is ignored."""
    if not stop.is_set():
        _libc.madvise(address, n, _MADV_POPULATE_WRITE)
