"""The trust boundary: every path the package acts on in a folder it shares with others, checked here and
nowhere else (docs/SECURITY.md says what is trusted and why).

- `step_number`: the one parser of step numbers (folder names, `latest.txt`): canonical ASCII decimal only.
- `relative_name`: a name read from a file (a marker, a manifest) as a path under a folder: relative, no
  `..`, no empty or `.` part. Files list names, never paths.
- `walk_dir` / `unlink_in` / `remove_tree`: act inside a folder without following a link anywhere below it
  (each component opened with O_NOFOLLOW from its parent's descriptor).
- `private_dir`: a folder only its owner can use (created 0700; refused if it is a link, has another owner,
  or lets the group or others write or enter it).
- `open_regular` / `read_regular`: a file opened without following a link, checked to be a regular file
  (owned by this user, where asked), read to a bound.

Imports neither torch nor Nanotron.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
from pathlib import Path, PurePosixPath
from typing import Iterator

_STEP = re.compile(r"(?:0|[1-9][0-9]{0,18})")  # ASCII only; at most 19 digits: fits 63 bits
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UntrustedPath(OSError):
    """A path that is not what the package wrote: a link, a name leaving its folder, a file of another user,
    a folder others can write to. The message names the path and what is wrong with it."""


def step_number(text: str) -> int | None:
    """The step a folder name or `latest.txt` holds, or None: canonical ASCII decimal only (`10`; not
    `010`, `+10`, `1_0`, ` 10`, `１０`), below 2**63."""
    if not isinstance(text, str) or _STEP.fullmatch(text) is None:
        return None
    n = int(text)
    return n if n < 2**63 else None


def relative_name(name: object, where: str = "") -> PurePosixPath:
    """`name` as a path below a folder; UntrustedPath (naming `where`, e.g. the file that held the name) if it
    is not a non-empty relative POSIX path without `..`, `.`, empty parts, backslashes or NUL."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise UntrustedPath(errno.EINVAL, f"{where}: {name!r} is not a file name")
    p = PurePosixPath(name)
    if p.is_absolute() or any(part in ("", ".", "..") for part in name.split("/")):
        raise UntrustedPath(errno.EINVAL, f"{where}: {name!r} leaves its folder or is not a plain path")
    return p


@contextlib.contextmanager
def walk_dir(root: str | os.PathLike, parts: tuple[str, ...] = ()) -> Iterator[int]:
    """A descriptor of `root/parts...`, every component below `root` opened without following a link (ELOOP
    or ENOTDIR, as UntrustedPath, where one is a link or not a folder). `root` itself is opened as given."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    where = os.path.join(root, *parts[: i + 1])
                    raise UntrustedPath(e.errno, f"{where}: a link or not a folder; not followed") from None
                raise
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def unlink_in(root: str | os.PathLike, name: str, where: str = "") -> bool:
    """Removes the file `root/name` (`name` checked by `relative_name`), following no link on the way; a
    link there is removed itself, never its target. False where it is already gone."""
    parts = relative_name(name, where or str(root)).parts
    try:
        with walk_dir(root, parts[:-1]) as fd:
            os.unlink(parts[-1], dir_fd=fd)
    except FileNotFoundError:
        return False
    return True


def is_real_dir(path: str | os.PathLike) -> bool:
    """A folder, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def remove_tree(root: str | os.PathLike, name: str) -> bool:
    """Removes the folder `root/name` and everything in it, following no link (a link inside is removed
    itself); does nothing where `root/name` is a link or not a folder. Returns whether it was removed."""
    relative_name(name, str(root))
    path = os.path.join(root, name)
    if not is_real_dir(path):
        return False
    # rmtree walks by descriptors where the platform allows (Linux does): a link swapped in is not followed.
    assert shutil.rmtree.avoids_symlink_attacks
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def private_dir(path: str | os.PathLike, what: str = "folder") -> Path:
    """`path` as a folder only this user can use: created 0700 where missing (its parents as usual); else
    UntrustedPath, naming it, where it is a link, is not a folder, has another owner, or lets the group or
    others in."""
    path = Path(path)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)
    st = os.lstat(path)
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "is a link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}: others than its owner may use it (0700 needed)"
    if problem:
        raise UntrustedPath(
            errno.EPERM,
            f"the {what} {path} {problem}; another user may have planted it: remove it, or choose another "
            "path",
        )
    return path


def open_regular(path: str | os.PathLike, *, own: bool = False) -> int:
    """A read-only descriptor of `path`, its last component not followed if a link, checked to be a regular
    file (and, with `own`, this user's); UntrustedPath otherwise, naming it. Never blocks on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UntrustedPath(e.errno, f"{path}: a link; not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedPath(errno.EINVAL, f"{path}: not a regular file")
        if own and st.st_uid != os.geteuid():
            raise UntrustedPath(errno.EPERM, f"{path}: belongs to uid {st.st_uid}, not to this user")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike, limit: int, *, own: bool = False) -> bytes:
    """The bytes of the regular file `path` (see `open_regular`); UntrustedPath where it holds more than
    `limit` bytes."""
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
