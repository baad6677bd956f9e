"""Acts inside a folder without following a link anywhere below it: each component opened with O_NOFOLLOW
from its parent's descriptor, files created O_EXCL, never recursing on the Python stack."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import stat
from typing import Callable, Iterator

from .. import _core
from ..errors import UntrustedPath
from .names import name_parts

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # a folder, never a link
NEW_FILE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC  # a new file, never a link's
_temporaries = itertools.count()


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
