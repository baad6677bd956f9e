"""The Python side of the storage seam: every operation on a checkpoints folder that the package does itself
(the commit's small files and `latest.txt`, rotation, temporaries, telemetry, the writer lock, the resume's
choice of step) goes through one `Store`, as every byte of a save and a restore goes through the core's
`Storage` (ext/storage.hpp). `open_store` is where a folder's store is chosen; `posix.FolderStore` is the
POSIX one.

A store's root is a checkpoints folder (`latest.txt`, one folder per step), or the one checkpoint folder a
conversion writes; `rel` names a file below it, relative (`"40/datastates.json"`), checked by
`trust.relative_name` (no `..`, nothing absolute). Imports no Nanotron (torch only through
`checkpoint/folder.py`, whose listing `posix` reuses).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, ContextManager, Protocol

if TYPE_CHECKING:
    from .writer_lock import WriterLock

__all__ = ["Store", "open_store"]


class Store(Protocol):
    """What a checkpoints folder's storage guarantees the commit, housekeeping, the Saver and the resume."""

    def path(self, rel: str) -> Path:
        """Where the file `rel` goes (a step's folder: `path(str(step))`), for the core's saves and reads,
        which reach the same storage through ext/storage.hpp. UntrustedPath where `rel` leaves the root."""
        ...

    def write_atomic(self, rel: str, data: bytes | str) -> None:
        """`rel` holds `data`, all or nothing: readers see the old file or the new one, never a part; durable
        (the file and its name) when it returns. Its missing folders are made."""
        ...

    def steps(self) -> list[int]:
        """The steps that have a folder, oldest first: real folders (never a link) named by a canonical step
        number (`trust.step_number`)."""
        ...

    def is_committed(self, step: int) -> bool:
        """The step's folder holds a whole checkpoint: ours (its manifest) or Nanotron's own (its metadata
        file), each a regular file."""
        ...

    def latest(self) -> int | None:
        """The step `latest.txt` names, None without one; ValueError, naming it, where it is not a regular
        file (a link is not followed) or holds anything but a step number."""
        ...

    def set_latest(self, step: int) -> None:
        """`latest.txt` names `step`, written atomically and durably, under `locked()` (taken here where the
        caller does not hold it already)."""
        ...

    def locked(self) -> ContextManager[None]:
        """The inter-process lock of the folder, held for the block: `latest.txt` moves, and checkpoints are
        removed, only under it (several jobs, or a pruning tool, may share the folder). Reentrant within one
        thread: an inner block never releases what an outer one holds."""
        ...

    def uncommit(self, step: int) -> None:
        """The step's commit markers removed by name (no link followed; a folder swapped for a link since is
        left as it is), the removal made durable: from here on it never looks committed, whatever happens
        to the rest of its folder. Rotation does it under `locked()`."""
        ...

    def remove_step(self, step: int) -> bool:
        """The step's folder removed: `uncommit` first, then the tree, following no link (a link below it
        goes itself, never its target). A removal cut short never leaves something that looks committed.
        False where it was not removed (a link, not a folder, changed meanwhile)."""
        ...

    def remove(self, rel: str) -> bool:
        """`rel` removed, a folder with all in it, following no link (a link goes itself); False where it was
        gone already or could not be removed (changed meanwhile, refused)."""
        ...

    def remove_temporaries(self, step: int) -> int:
        """The temporaries dead processes left in the step's folder (`checkpoint.folder.is_temporary`)
        removed, each by name, no link followed below it; UntrustedPath where a folder was moved away while
        searched. Returns how many."""
        ...

    def append_line(self, rel: str, text: str) -> None:
        """One line appended to `rel` in one write (lines of several writers never mix); never waits on what
        is not a regular file (a FIFO without a reader fails at once, UntrustedPath naming it)."""
        ...

    def writer_lock(self) -> WriterLock:
        """The folder's writer lock, acquired: one job writes checkpoints into it (FolderBusy, naming the
        holder, otherwise); released by `WriterLock.release` or the holder's death."""
        ...


def open_store(root: str | os.PathLike) -> Store:
    """The store of the folder `root`: POSIX, the one target there is (a new target is chosen here)."""
    from .posix import FolderStore

    return FolderStore(root)
