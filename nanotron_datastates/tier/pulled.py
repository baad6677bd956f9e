"""A restart's pulled files told as each is in place (`Placed`), so that a read-ahead reads each file as soon
as it is in the rank's tier folder, checked, while the rest of the pull goes on, rather than after it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterable


class Placed:
    """The files a restart brings into `folder` (its node's tier folder of the step): `wait(path)` returns
    True once the file is there, checked, or where the pull does not bring it (this node held it already);
    False where the pull ended without it. The pull says what it brings (`expect`), each file it placed
    (`place`), and its end (`finish`): on success every file expected is there (a node-mate's pulls
    included), on failure none not yet placed will be."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._cond = threading.Condition()
        self._pending: set[str] | None = None  # None: not known yet
        self._ok: bool | None = None  # None: not ended

    def expect(self, rels: Iterable[str]) -> None:
        with self._cond:
            if self._ok is None:
                self._pending = set(rels)
                self._cond.notify_all()

    def place(self, rel: str) -> None:
        with self._cond:
            if self._pending is not None:
                self._pending.discard(rel)
                self._cond.notify_all()

    def finish(self, ok: bool) -> None:
        """The pull's end; only the first call counts."""
        with self._cond:
            if self._ok is None:
                self._ok = ok and self._pending is not None
                if self._ok:
                    self._pending = set()
                self._cond.notify_all()

    def wait(self, path: Path) -> bool:
        """Whether `path` (a file under `folder`) is there to be read; waits until it is, or the pull ends."""
        try:
            rel = Path(path).relative_to(self.folder).as_posix()
        except ValueError:
            return False  # not a file of this pull's folder
        with self._cond:
            self._cond.wait_for(lambda: self._ok is not None or self._there(rel))
            return self._there(rel)

    def _there(self, rel: str) -> bool:  # holding the lock
        return self._pending is not None and rel not in self._pending
