"""One writer per checkpoints folder: two jobs committing the same steps into one folder would mix one's
manifest with the other's files. The rank that commits (rank 0) holds `.datastates.writer.lock` in the
checkpoints folder for the job's life; a second job on the same folder fails at its start, naming the folder
and the holder's host and pid. Readers (resume, verify, inspect, convert) take no lock.

The lock is a POSIX record lock (`fcntl.lockf`, as the store's own lock; it works on NFS with lockd), taken
without waiting and released by the kernel when the holder's process dies, so a job killed and restarted
takes it again. Record locks belong to a process, not to a descriptor: a second acquisition in the same
process is refused here, and nothing else of the package opens the file (closing any descriptor of it
would drop the lock).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from .. import trust
from ..errors import DataStatesError

LOCK = ".datastates.writer.lock"
_HELD: dict[str, WriterLock] = {}  # realpath of the folder -> its lock, in this process


class FolderBusy(DataStatesError, RuntimeError):
    """Another job (or another trainer of this process) writes checkpoints into this folder."""


class WriterLock:
    """The writer's lock of one checkpoints folder, held from `acquire` to `release`."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.fd: int | None = None

    def acquire(self) -> WriterLock:
        """Takes the lock, or raises FolderBusy naming the folder and its holder. The lock file is opened
        without following a link, and must be a regular file with no other name (trust.UntrustedPath,
        naming it, otherwise)."""
        self.root.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.root)
        if key in _HELD:
            raise FolderBusy(
                f"{self.root}: this process already writes checkpoints there (pid {os.getpid()}); one "
                "trainer per checkpoints folder"
            )
        fd = open_lock_file(self.root / LOCK)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            os.close(fd)
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise FolderBusy(
                    f"{self.root}: another job writes checkpoints there ({holder}); give this job its own "
                    "checkpoints_path, or stop that one"
                ) from None
            raise
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        line = json.dumps(me).encode()
        # A regular file with no other name (`open_lock_file`): only the lock's bytes change
        os.pwrite(fd, line, 0)
        os.ftruncate(fd, len(line))
        self.fd = fd
        _HELD[key] = self
        return self

    def release(self) -> None:
        """Releases the lock (idempotent); the file stays, naming the last holder."""
        if self.fd is None:
            return
        _HELD.pop(os.path.realpath(self.root), None)
        os.close(self.fd)  # drops the record lock
        self.fd = None


def open_lock_file(path: Path, what: str = "the writer lock") -> int:
    """A lock file (`what`, for messages), opened read-write without truncating it, never through a link,
    never blocking (a FIFO), checked to be a regular file with no other name: the writer's holder line
    overwrites it, and with a second name (a hard link) it would overwrite another file. trust.UntrustedPath,
    naming it, otherwise."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    with contextlib.suppress(FileNotFoundError):
        _check(path, os.lstat(path), what)  # a device is refused before it is opened
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise trust.UntrustedPath(e.errno, f"{path}: a link; not followed") from None
        raise
    try:
        _check(path, os.fstat(fd), what)  # the file opened: what the lstat saw may have been swapped since
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check(path: Path, st: os.stat_result, what: str) -> None:
    """trust.UntrustedPath, naming the lock file, unless `st` is that of a regular file with one name."""
    if stat.S_ISLNK(st.st_mode):
        raise trust.UntrustedPath(errno.ELOOP, f"{path}: a link; not followed")
    if not stat.S_ISREG(st.st_mode):
        m = st.st_mode
        kind = "a FIFO" if stat.S_ISFIFO(m) else "a folder" if stat.S_ISDIR(m) else "a socket or a device"
        raise trust.UntrustedPath(errno.EINVAL, f"{path}: {what} is {kind}, not a regular file; remove it")
    if st.st_nlink > 1:
        raise trust.UntrustedPath(
            errno.EMLINK, f"{path}: {what} has {st.st_nlink} names (a hard link to another file); remove it"
        )


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says (host and pid), for the message."""
    try:
        doc = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"host {doc['host']}, pid {doc['pid']}, since {doc['since']}"
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return "holder unknown"
