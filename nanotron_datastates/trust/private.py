"""Private folders: only their owner can use them, under folders no other user can change."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from ..errors import UntrustedPath


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
