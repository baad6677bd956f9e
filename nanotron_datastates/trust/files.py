"""Files opened to be read. Each is first opened as a mere handle (O_PATH: no read, no open of a FIFO or a
device, no driver called), its type checked on that handle, and only then opened for reading, through the
handle (`/proc/self/fd`): what a neighbour swaps in between the check and the open is never opened."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Callable

from ..errors import UntrustedPath
from .inside import walk_dir
from .names import name_parts

_READ = os.O_RDONLY | os.O_CLOEXEC


def _open_checked(
    name: str, dir_fd: int | None, follow: bool, check: Callable[[os.stat_result], None]
) -> int:
    """A read-only descriptor of the file `name` (below `dir_fd`), opened only once `check` accepted the
    status of the very file that is opened."""
    handle = os.open(name, os.O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW), dir_fd=dir_fd)
    try:
        st = os.fstat(handle)
        check(st)
        try:
            return os.open(f"/proc/self/fd/{handle}", _READ)
        except FileNotFoundError:
            if os.path.isdir("/proc/self/fd"):
                raise
        # No /proc: by name again, refused where it is no longer the file checked (opened, though, if a FIFO).
        fd = os.open(name, _READ | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW), dir_fd=dir_fd)
        if os.fstat(fd)[1:3] != st[1:3]:
            os.close(fd)
            raise UntrustedPath(errno.ESTALE, f"{name}: replaced while opened; not read")
        os.set_blocking(fd, True)
        return fd
    finally:
        os.close(handle)


def open_regular(
    path: str | os.PathLike, *, own: bool = False, within: str | os.PathLike | None = None
) -> int:
    """A read-only descriptor of `path`, its last component not followed if a link, checked to be a regular
    file (and, with `own`, this user's); UntrustedPath otherwise, naming it. Never opens a FIFO or a device.
    `within`: `path` is a name below that folder, and no link is followed anywhere below it (`walk_dir`)."""
    shown = os.path.join(within, path) if within is not None else path

    def check(st: os.stat_result) -> None:
        if stat.S_ISLNK(st.st_mode):  # O_PATH | O_NOFOLLOW holds a link itself
            raise UntrustedPath(errno.ELOOP, f"{shown}: a link; not followed")
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedPath(errno.EINVAL, f"{shown}: not a regular file")
        if own and st.st_uid != os.geteuid():
            raise UntrustedPath(errno.EPERM, f"{shown}: belongs to uid {st.st_uid}, not to this user")

    try:
        parts = name_parts(os.fspath(path), os.fspath(within)) if within is not None else (os.fspath(path),)
        with walk_dir(within, parts[:-1]) if within is not None else contextlib.nullcontext(None) as top:
            return _open_checked(parts[-1], top, False, check)
    except UntrustedPath:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UntrustedPath(e.errno, f"{shown}: a link; not followed") from None
        raise type(e)(e.errno, e.strerror, os.fspath(shown)) from None


def read_regular(path: str | os.PathLike, limit: int, *, own: bool = False) -> bytes:
    """The bytes of the regular file `path` (`open_regular`); UntrustedPath where over `limit` bytes."""
    fd = open_regular(path, own=own)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UntrustedPath(errno.EFBIG, f"{path}: {size} bytes, more than the {limit} expected")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:  # grew since
            raise UntrustedPath(errno.EFBIG, f"{path}: more than the {limit} bytes expected")
        return data
    finally:
        os.close(fd)


def open_to_read(path: str | os.PathLike) -> int:
    """A read-only descriptor of the regular file `path`, a link followed (a path the caller chose; a
    folder's own files take `open_regular`). Never opens what is not a regular file, so never waits on it:
    IsADirectoryError for a folder, UntrustedPath for a FIFO, a socket or a device, each with the path as
    `filename`."""
    name = os.fspath(path)

    def check(st: os.stat_result) -> None:
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "a folder, not a file", name)
        if not stat.S_ISREG(st.st_mode):
            kind = (
                "a FIFO"
                if stat.S_ISFIFO(st.st_mode)
                else "a socket"
                if stat.S_ISSOCK(st.st_mode)
                else "a device"
            )
            raise UntrustedPath(errno.EINVAL, f"{kind}, not a regular file", name)

    try:
        return _open_checked(name, None, True, check)
    except (UntrustedPath, IsADirectoryError):
        raise
    except OSError as e:  # named by the path asked for, not by /proc's
        raise type(e)(e.errno, e.strerror, name) from None
