"""What the memory tier's folders hold, read without trusting the tmpfs they are on: the steps a folder holds,
a file's size once it is known to be a regular file of this user's, which files a save may take over, the
temporaries of processes no longer running, empty folders removed, and the bytes a folder holds. Nothing
here follows a link (`trust`)."""

from __future__ import annotations

import contextlib
import itertools
import os
import stat
import threading
import time
from pathlib import Path
from typing import Callable

from .. import _core, trust
from ..checkpoint.folder import step_folders, step_of


def step_numbers(folder: Path) -> list[int]:
    """The steps `folder` holds (real folders named by a canonical step number), oldest first; none where
    it cannot be listed."""
    return [step_of(p) for p in step_folders(folder)]


def regular_size(folder: Path, rel: str) -> int:
    """The size of the file `folder/rel`, reached without a link; UntrustedPath unless a regular file of
    this user's."""
    parts = trust.name_parts(rel, str(folder))
    with trust.walk_dir(folder, parts[:-1]) as fd:
        st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
    why = _not_mine(st)
    if why:
        raise trust.UntrustedPath(0, f"{folder / rel}: {why}")
    return st.st_size


def _not_mine(st: os.stat_result) -> str:
    """Why a file of this status is not a regular file of this user's; empty where it is."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user"
    return ""


def dead_temporary(name: str) -> bool:
    """Whether `name` is a temporary (`.<name>.dstmp.<pid>.<n>`) of a process no longer running."""
    pid = name.split(".dstmp.", 1)[1].split(".", 1)[0] if name.startswith(".") and ".dstmp." in name else ""
    return pid.isdigit() and not alive(int(pid))


def ours(folder: Path, rels: list[str]) -> set[str]:
    """The names of `rels` that a save may take over below `folder`: regular files of this user's, reached
    without a link, with no other name (a replica linked in, a hard link from elsewhere: their bytes would
    be overwritten too); a name that is not a plain relative path is never one. The core checks them in one
    call off the GIL (`_core.takeable`), each folder on the way opened once for all the names in it: the
    tier's saves ask this of every file of a checkpoint, a 1.1B rank's weight files lie eight folders deep,
    and a check in Python took the GIL back after each of its hundreds of opens and stats."""
    named: list[tuple[str, tuple[str, ...]]] = []
    for rel in sorted(rels):  # sorted: the names of one folder next to each other
        with contextlib.suppress(trust.UntrustedPath):
            named.append((rel, trust.name_parts(rel, str(folder))))
    flags = _core.takeable(os.fspath(folder), [parts for _, parts in named])
    return {rel for (rel, _), ok in zip(named, flags) if ok}


def set_aside(folder: Path, name: str) -> str:
    """Renames the folder `folder/name` (a link: the link itself) to a temporary of this process beside it,
    `<name>.dstmp.<pid>.<n>`, and returns that name: `name` is free at once, and the next start's prune
    removes what a process killed before its `remove_behind` leaves. One already a dead process's stays."""
    if dead_temporary(name):
        return name
    new = f"{name}.dstmp.{os.getpid()}.{next(_asides)}"
    trust.rename_in(folder, name, new)
    return new


_asides = itertools.count()


def remove_behind(
    folder: Path, names: list[str], on_done: Callable[[BaseException | None, float], None]
) -> threading.Thread:
    """Removes the folders `folder/<names>` (`set_aside`'s) on a thread of its own (`behind`), which it
    returns: freeing a 1.1B rank's set made ahead (7 GB) takes a tmpfs most of a second. A folder that cannot
    be removed (a link, changed meanwhile) is named in the error told to `on_done`."""

    def remove() -> None:
        left = [n for n in names if not trust.remove_tree(folder, n)]
        if left:
            raise OSError(f"{folder}: not removed (a link, or changed meanwhile): {', '.join(left)}")

    return behind(remove, on_done, "datastates-tier-remove")


def behind(
    work: Callable[[], None], on_done: Callable[[BaseException | None, float], None], name: str
) -> threading.Thread:
    """`work()` on a thread of its own (`name`), started and returned; `on_done(error or None, seconds)` once
    it ends: a removal that fails is reported, never raised into training, and the next start tries again."""

    def run() -> None:
        t0 = time.perf_counter()
        error: BaseException | None = None
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - reported; what is left goes at the next start
            error = e
        on_done(error, time.perf_counter() - t0)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def alive(pid: int) -> bool:
    """Whether process `pid` runs (another user's counts as running: it cannot be signalled)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: running
        return True
    return True


def remove_empty(root: Path, name: str) -> None:
    """Removes `root/name` and the folders below it where empty (never a file, never through a link)."""
    with contextlib.suppress(OSError):
        for fd, _, entry, is_dir in trust.walk_tree(root, name):
            if is_dir:
                with contextlib.suppress(OSError):
                    os.rmdir(entry, dir_fd=fd)
        with trust.walk_dir(root) as fd:
            os.rmdir(name, dir_fd=fd)


def tree_size(folder: Path) -> int:
    """The bytes of the regular files under `folder` (no link followed)."""
    total = 0
    for fd, _, name, _ in trust.walk_tree(folder):
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:  # gone since listed: another rank's temporary (job.json's), renamed
            continue
        total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total
