"""The trust boundary: every path the package acts on in a folder it shares with others, checked here and
nowhere else (docs/SECURITY.md says what is trusted and why).

- `step_number`: the one parser of step numbers (folder names, `latest.txt`): canonical ASCII decimal only.
- `relative_name`: a name read from a file (a marker, a manifest) as a path under a folder: relative, no
  `..`, no empty or `.` part (`name_parts`: the same check, giving the parts). Files list names, never paths.
- `walk_dir` / `unlink_in` / `remove_tree` / `walk_tree` / `remove_files` / `write_in` / `rename_in` /
  `link_in`: act inside a folder without following a link anywhere below it (each component opened with
  O_NOFOLLOW from its parent's descriptor, files created O_EXCL), never recursing on the Python stack.
- `private_dir`: a folder only its owner can use (created 0700; refused if it is a link, has another owner,
  or lets the group or others write or enter it), under folders no other user can change.
- `open_regular` / `read_regular`: a file opened without following a link (its last component, or every one
  below a folder), checked to be a regular file (owned by this user, where asked), read to a bound.

Imports neither torch nor Nanotron (the core's module, `_core`, neither).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator

from . import _core
from .errors import UntrustedPath

_STEP = re.compile(r"(?:0|[1-9][0-9]{0,18})")  # ASCII only; at most 19 digits: fits 63 bits
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # a folder, never a link
NEW_FILE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC  # a new file, never a link's
_temporaries = itertools.count()


def step_number(text: str) -> int | None:
    """The step a folder name or `latest.txt` holds, or None: canonical ASCII decimal only (`10`; not
    `010`, `+10`, `1_0`, ` 10`, `１０`), below 2**63."""
    if not isinstance(text, str) or _STEP.fullmatch(text) is None:
        return None
    n = int(text)
    return n if n < 2**63 else None


def relative_name(name: object, where: str = "") -> PurePosixPath:
    """`name` as a path below a folder, checked as `name_parts` checks it."""
    return PurePosixPath(*name_parts(name, where))


def name_parts(name: object, where: str = "") -> tuple[str, ...]:
    """`name`'s parts; UntrustedPath (naming `where`, e.g. the file that held the name) if it is not a
    non-empty relative POSIX path without `..`, `.`, empty parts, backslashes or NUL."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise UntrustedPath(errno.EINVAL, f"{where}: {name!r} is not a file name")
    if {"", ".", ".."}.intersection(parts := tuple(name.split("/"))):  # an absolute name starts with ""
        raise UntrustedPath(errno.EINVAL, f"{where}: {name!r} leaves its folder or is not a plain path")
    return parts


@contextlib.contextmanager
def walk_dir(root: str | os.PathLike, parts: tuple[str, ...] = (), create: bool = False) -> Iterator[int]:
    """A descriptor of `root/parts...`, each component below `root` (opened as given) opened without following
    a link (UntrustedPath where one is a link or not a folder); with `create`, made 0700 where missing."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            try:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o700, dir_fd=fd)
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
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
    parts = name_parts(name, where or str(root))
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
    """Removes the folder `root/name` and all in it, following no link (a link inside goes, itself), last
    listed entries first. False where it is a link, not a folder, or changed meanwhile (a file added, a
    folder swapped for a link), or an entry cannot be removed: what is left stays. The walk runs in the core's
    storage target (`ext/storage_posix.cpp`) off the GIL: a committer removing an old step holds none."""
    return bool(_core.remove_tree(os.fspath(root), list(name_parts(name, str(root)))))


def walk_tree(root: str | os.PathLike, name: str = "") -> Iterator[tuple[int, str, str, bool]]:
    """Every entry below the folder `root/name` (reached as `walk_dir` does), depth first, a folder after its
    entries: (its folder's descriptor, valid until the next item, to act by name from; that folder's path
    relative to `root/name`; its name; whether a folder). No link followed (a folder swapped for one comes as
    a file), no recursion, one descriptor open at a time: the walk climbs back by `..`, checked to be the
    folder it came from (UntrustedPath, naming it, where one was moved away meanwhile)."""
    with walk_dir(root, name_parts(name, str(root)) if name else ()) as top:
        fd = os.dup(top)
    try:
        frames = [_frame(fd, "")]  # the folders on the way down
        while frames[-1][1]:  # entries left in the folder at hand
            entry, is_dir = frames[-1][1].pop()
            rel = frames[-1][2]
            try:
                child = os.open(entry, DIR_FLAGS, dir_fd=fd) if is_dir else None
            except OSError as e:  # gone; or a link now, or a file: itself, never followed
                if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                    raise
                child = -1 if e.errno == errno.ENOENT else None
            if child is None:
                yield fd, rel, entry, False
            elif child >= 0:
                os.close(fd)
                fd = child
                frames.append(_frame(fd, f"{rel}/{entry}" if rel else entry))
            while not frames[-1][1] and len(frames) > 1:  # a folder done: back up, then the folder itself
                rel = frames.pop()[2]
                up = os.open("..", DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = up
                if os.fstat(fd)[1:3] != frames[-1][0]:
                    where = os.path.join(root, name, rel)
                    raise UntrustedPath(errno.ESTALE, f"{where}: moved away while walked; left as it is")
                yield fd, frames[-1][2], os.path.basename(rel), True
    finally:
        os.close(fd)


def _frame(fd: int, rel: str) -> tuple[tuple[int, int], list[tuple[str, bool]], str]:
    """The folder open at `fd` as `walk_tree` keeps it: (inode, device); the entries left, each with whether
    it is a folder (not a link to one); its path."""
    with os.scandir(fd) as it:
        return os.fstat(fd)[1:3], [(e.name, e.is_dir(follow_symlinks=False)) for e in it], rel


def remove_files(root: str | os.PathLike, match: Callable[[str], bool]) -> int:
    """Removes every file below the folder `root` whose name `match`es, by name from its folder's descriptor
    (`walk_tree`, whose UntrustedPath it raises); returns how many."""
    n = 0
    for fd, _, name, is_dir in walk_tree(root):
        if not is_dir and match(name):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(name, dir_fd=fd)
                n += 1
    return n


def write_in(root: str | os.PathLike, name: str, data: bytes) -> None:
    """Writes the file `root/name` whole or not at all (a new temporary beside it, synced, renamed over it),
    its missing folders made 0700, no link followed on the way (UntrustedPath, naming it)."""
    parts = name_parts(name, str(root))
    tmp = f".{parts[-1]}.{os.getpid()}.{next(_temporaries)}.tmp"
    with walk_dir(root, parts[:-1], create=True) as folder:
        try:
            with os.fdopen(os.open(tmp, NEW_FILE, 0o600, dir_fd=folder), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, parts[-1], src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=folder)
            raise
        os.fsync(folder)


def rename_in(root: str | os.PathLike, name: str, new_name: str) -> None:
    """Renames `root/name` to `root/new_name`, no link followed on the way to either (UntrustedPath)."""
    src, dst = name_parts(name, str(root)), name_parts(new_name, str(root))
    with walk_dir(root, src[:-1]) as a, walk_dir(root, dst[:-1]) as b:
        os.rename(src[-1], dst[-1], src_dir_fd=a, dst_dir_fd=b)


def link_in(src_root: str | os.PathLike, root: str | os.PathLike, name: str) -> None:
    """Makes `root/name` a second name of `src_root/name` (its folders made 0700 where missing), no link
    followed on the way to either (UntrustedPath); FileExistsError where it exists."""
    parts = name_parts(name, str(root))
    with walk_dir(src_root, parts[:-1]) as a, walk_dir(root, parts[:-1], create=True) as b:
        os.link(parts[-1], parts[-1], src_dir_fd=a, dst_dir_fd=b, follow_symlinks=False)


def private_dir(path: str | os.PathLike, what: str = "folder") -> Path:
    """`path` as a folder only this user can use: created 0700 where missing (its parents 0755); else
    UntrustedPath, naming it, where it is a link, is not a folder, has another owner, or lets the group or
    others in; or where another user could change a folder above it (`_check_ancestors`)."""
    path = Path(os.path.join(os.getcwd(), path))
    _check_ancestors(path, what)  # before anything is made there
    for p in reversed([p for p in path.parents if not os.path.lexists(p)]):
        with contextlib.suppress(FileExistsError):
            os.mkdir(p, 0o755)  # as `mkdir -p`, whatever the umask would let the group do
    _check_ancestors(path, what)  # those made, or made first by someone else
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
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
        why = "another user may have planted it: remove it, or choose another path"
        raise UntrustedPath(errno.EPERM, f"the {what} {path} {problem}; {why}")
    return path


def _check_ancestors(path: Path, what: str) -> None:
    """UntrustedPath, naming it, where a folder on the way to `path` (resolved as the kernel does, up to where
    none exists yet) is one that another user than this one and root could change: one of theirs, or one the
    group or others may write to without the sticky bit; or where a link of theirs is on the way (the rule
    of OpenSSH's `safe_path`)."""
    trusted, links, cur, todo = (0, os.geteuid()), 0, "/", str(path.parent).split("/")[::-1]
    problem = None
    while problem is None:
        st = os.lstat(cur)  # a folder reached without a link, every one above it checked
        if st.st_uid not in trusted:
            problem = f"it belongs to uid {st.st_uid}"
        elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            problem = f"its mode {stat.S_IMODE(st.st_mode):04o} lets others than its owner write to it"
        while problem is None:
            part = todo.pop() if todo else None
            if part is None:
                return
            if part in ("", ".", ".."):
                cur = os.path.dirname(cur) if part == ".." else cur  # checked already
                continue
            nxt = os.path.join(cur, part)
            try:
                st = os.lstat(nxt)
            except FileNotFoundError:
                return  # made by this user, inside the folders checked
            if not stat.S_ISLNK(st.st_mode):
                cur = nxt
                break
            links += 1
            if st.st_uid not in trusted or links > 40:
                cur, problem = nxt, f"a link of uid {st.st_uid}" if links <= 40 else "too many links"
            else:
                target = os.readlink(nxt)
                cur = "/" if target.startswith("/") else cur
                todo += target.split("/")[::-1]
    raise UntrustedPath(
        errno.EPERM,
        f"the {what} {path} is inside {cur}: {problem}, so that another user could replace what is inside "
        "it: choose a path whose every folder is this user's or root's and not writable by others (unless "
        "sticky, as /tmp and /dev/shm are)",
    )


def open_regular(
    path: str | os.PathLike, *, own: bool = False, within: str | os.PathLike | None = None
) -> int:
    """A read-only descriptor of `path`, its last component not followed if a link, checked to be a regular
    file (and, with `own`, this user's); UntrustedPath otherwise, naming it. Never blocks on a FIFO.
    `within`: `path` is a name below that folder, and no link is followed anywhere below it (`walk_dir`)."""
    shown = os.path.join(within, path) if within is not None else path
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        parts = name_parts(os.fspath(path), os.fspath(within)) if within is not None else (path,)
        with walk_dir(within, parts[:-1]) if within is not None else contextlib.nullcontext(None) as top:
            fd = os.open(parts[-1], flags, dir_fd=top)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UntrustedPath(e.errno, f"{shown}: a link; not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedPath(errno.EINVAL, f"{shown}: not a regular file")
        if own and st.st_uid != os.geteuid():
            raise UntrustedPath(errno.EPERM, f"{shown}: belongs to uid {st.st_uid}, not to this user")
    except BaseException:
        os.close(fd)
        raise
    return fd


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
    folder's own files take `open_regular`). Never waits on what is not a regular file: IsADirectoryError for
    a folder, UntrustedPath for a FIFO, a socket or a device, each with the path as `filename`. The type is
    checked before opening (a device is never opened) and again on the descriptor (swapped in since)."""
    name = os.fspath(path)

    def check(mode: int) -> None:
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "a folder, not a file", name)
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
            raise UntrustedPath(errno.EINVAL, f"{kind}, not a regular file", name)

    check(os.stat(name).st_mode)
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        check(os.fstat(fd).st_mode)
        os.set_blocking(fd, True)  # io_uring fails a read of a non-blocking file with EAGAIN, not waiting
    except BaseException:
        os.close(fd)
        raise
    return fd
