"""`FolderStore`: the `Store` of a checkpoints folder on a POSIX file system, made of the package's existing
pieces: atomic writes (`checkpoint/file_io.py`), the listing and `latest.txt` read strictly
(`checkpoint/folder.py`), removal by descriptor with no link followed (`trust/`), the inter-process lock
file `.datastates.lock` (a POSIX record lock, its file opened as the writer lock's: no link followed, never
a FIFO) and the writer lock (`store/writer_lock.py`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path
from typing import Iterator

from .. import telemetry, trust
from ..checkpoint import folder as listing
from ..checkpoint.file_io import fsync_path, write_atomic
from ..checkpoint.names import LATEST, MANIFEST, NANOTRON_METADATA
from .writer_lock import WriterLock, open_lock_file

LOCK = ".datastates.lock"  # latest.txt moves, and checkpoints are removed, only under this lock
MARKERS = (MANIFEST, NANOTRON_METADATA)  # what makes a folder a checkpoint (`is_committed`)


class FolderStore:
    """The checkpoints folder `root` (made only where something is written into it)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._mutex = threading.RLock()  # one thread at a time in `locked`, reentrant
        self._depth = 0
        self._fd: int | None = None  # the lock file's, while held

    def __repr__(self) -> str:
        return f"FolderStore({str(self.root)!r})"

    def path(self, rel: str) -> Path:
        return self.root / trust.relative_name(rel, str(self.root))

    def write_atomic(self, rel: str, data: bytes | str) -> None:
        write_atomic(self.path(rel), data)

    def steps(self) -> list[int]:
        return [listing.step_of(f) for f in listing.step_folders(self.root)]

    def is_committed(self, step: int) -> bool:
        return listing.is_committed(self._step(step))

    def latest(self) -> int | None:
        return listing.latest_step(self.root)

    def set_latest(self, step: int) -> None:
        with self.locked():
            self.write_atomic(LATEST, str(step))

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._mutex:
            if self._depth == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                fd = open_lock_file(self.root / LOCK, "the store's lock")
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX)  # waits for another process's commit or rotation
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._fd is not None:
                    os.close(self._fd)  # drops the record lock
                    self._fd = None

    def uncommit(self, step: int) -> None:
        folder = self._step(step)
        for marker in MARKERS:  # by name, through no link: a folder swapped for one since is left
            with contextlib.suppress(trust.UntrustedPath):
                trust.unlink_in(self.root, f"{folder.name}/{marker}")
        if trust.is_real_dir(folder):
            fsync_path(folder)

    def remove_step(self, step: int) -> bool:
        self.uncommit(step)
        return trust.remove_tree(self.root, self._step(step).name)

    def remove(self, rel: str) -> bool:
        if trust.is_real_dir(self.path(rel)):
            return trust.remove_tree(self.root, rel)
        try:
            return trust.unlink_in(self.root, rel)
        except OSError:  # a folder now, a link on the way, no permission: left as it is
            return False

    def remove_temporaries(self, step: int) -> int:
        return trust.remove_files(self._step(step), listing.is_temporary)

    def append_line(self, rel: str, text: str) -> None:
        telemetry.append_text(self.path(rel), text if text.endswith("\n") else text + "\n")

    def writer_lock(self) -> WriterLock:
        return WriterLock(self.root).acquire()

    def _step(self, step: int) -> Path:
        if not isinstance(step, int) or isinstance(step, bool) or trust.step_number(str(step)) is None:
            raise ValueError(f"{self.root}: {step!r} is not a step number")
        return self.root / str(step)
